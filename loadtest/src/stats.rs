//! Aggregation of outcomes: HDR histograms in microseconds, error and tier counts.

use std::collections::BTreeMap;
use std::time::Duration;

use hdrhistogram::Histogram;
use http::HeaderValue;
use serde::{Deserialize, Serialize};

use crate::outcome::{Answer, ErrorKind, Outcome};

/// Largest latency the histograms hold: one hour, far beyond any request timeout.
const MAX_TRACKED_US: u64 = 3_600_000_000;
/// Three significant digits: 0.1% relative error, the usual HDR setting.
const SIGNIFICANT_DIGITS: u8 = 3;

/// Percentiles of a latency distribution, in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Samples behind the figures (0 means every figure is 0).
    #[serde(default)]
    pub count: u64,
    /// Median.
    pub p50: u64,
    /// 90th percentile.
    pub p90: u64,
    /// 99th percentile.
    pub p99: u64,
    /// 99.9th percentile.
    pub p999: u64,
    /// Largest sample.
    pub max: u64,
    /// Arithmetic mean.
    pub mean: f64,
}

/// Latency and TTFT of the successful requests one tier served.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct TierSummary {
    /// End-to-end latency.
    pub latency_us: Summary,
    /// Time to first token.
    pub ttft_us: Summary,
}

/// Did every request get exactly one well-formed answer?
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Accounting {
    /// Requests sent in the measured window.
    pub sent: u64,
    /// 2xx answers read to the end.
    pub ok: u64,
    /// Well-formed error answers (an OpenAI error body, or an SSE error event).
    pub well_formed_errors: u64,
    /// Requests with no well-formed answer: connection failures, timeouts, cut-off bodies,
    /// streams without `[DONE]` or an error event, garbled bodies.
    pub lost: u64,
    /// Requests the client never sent (open-loop overflow); not part of `sent`.
    pub not_sent: u64,
}

/// Per-tier histograms.
#[derive(Debug)]
struct TierHistograms {
    latency: Histogram<u64>,
    ttft: Histogram<u64>,
}

/// Everything measured in a run's recorded window.
#[derive(Debug)]
pub struct Recorder {
    latency: Histogram<u64>,
    ttft: Histogram<u64>,
    requests: u64,
    ok: u64,
    errors: BTreeMap<ErrorKind, u64>,
    tiers: BTreeMap<String, u64>,
    profiles: BTreeMap<String, u64>,
    reasons: BTreeMap<String, u64>,
    per_tier: BTreeMap<String, TierHistograms>,
    fallbacks: u64,
    retry_after_429: u64,
    accounting: Accounting,
}

/// The recorder's counts, ready for a report.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Totals {
    /// Requests recorded, including errors and client overflows.
    pub requests: u64,
    /// 2xx answers read to the end.
    pub ok: u64,
    /// Failures by [`ErrorKind::as_str`].
    pub errors: BTreeMap<String, u64>,
    /// Successful-request latency.
    pub latency_us: Summary,
    /// Successful-request time to first token.
    pub ttft_us: Summary,
    /// `x-quantrouter-tier` values.
    pub tiers: BTreeMap<String, u64>,
    /// `x-quantrouter-profile` values.
    pub profiles: BTreeMap<String, u64>,
    /// `x-quantrouter-reason` values.
    pub reasons: BTreeMap<String, u64>,
    /// Successful-request latency and TTFT by `x-quantrouter-tier`.
    pub per_tier: BTreeMap<String, TierSummary>,
    /// Answers carrying `x-quantrouter-fallback`.
    pub fallbacks: u64,
    /// 429 answers with `Retry-After`.
    pub retry_after_429: u64,
    /// Lost-request accounting.
    pub accounting: Accounting,
}

// === impl Recorder ===

impl Recorder {
    /// An empty recorder.
    pub fn new() -> anyhow::Result<Self> {
        let histogram = || {
            Histogram::new_with_bounds(1, MAX_TRACKED_US, SIGNIFICANT_DIGITS)
                .map_err(|error| anyhow::anyhow!("cannot create histogram: {error:?}"))
        };
        Ok(Self {
            latency: histogram()?,
            ttft: histogram()?,
            requests: 0,
            ok: 0,
            errors: BTreeMap::new(),
            tiers: BTreeMap::new(),
            profiles: BTreeMap::new(),
            reasons: BTreeMap::new(),
            per_tier: BTreeMap::new(),
            fallbacks: 0,
            retry_after_429: 0,
            accounting: Accounting::default(),
        })
    }

    /// Records one request. Latency and TTFT histograms hold successful requests only, so
    /// that fast failures cannot make a server look quicker; failures are counted by kind.
    pub fn record(&mut self, outcome: &Outcome) {
        self.requests += 1;
        count_header(&mut self.tiers, outcome.tier.as_ref());
        count_header(&mut self.profiles, outcome.profile.as_ref());
        count_header(&mut self.reasons, outcome.reason.as_ref());
        self.fallbacks += u64::from(outcome.fallback);
        self.retry_after_429 += u64::from(outcome.retry_after);
        self.account(outcome.answer());
        match outcome.result {
            Ok(()) => {
                self.ok += 1;
                let latency = micros(outcome.latency);
                let ttft = outcome.ttft.map(micros);
                self.latency.saturating_record(latency);
                if let Some(ttft) = ttft {
                    self.ttft.saturating_record(ttft);
                }
                if let Some(tier) = self.tier_histograms(outcome.tier.as_ref()) {
                    tier.latency.saturating_record(latency);
                    if let Some(ttft) = ttft {
                        tier.ttft.saturating_record(ttft);
                    }
                }
            }
            Err(kind) => self.record_error(kind),
        }
    }

    /// Records a request that never produced an outcome (a client overflow).
    pub fn record_dropped(&mut self, kind: ErrorKind) {
        self.requests += 1;
        self.account(kind.answer());
        self.record_error(kind);
    }

    fn account(&mut self, answer: Answer) {
        let accounting = &mut self.accounting;
        match answer {
            Answer::Ok => accounting.ok += 1,
            Answer::WellFormedError => accounting.well_formed_errors += 1,
            Answer::Lost => accounting.lost += 1,
            Answer::NotSent => accounting.not_sent += 1,
        }
        if answer != Answer::NotSent {
            accounting.sent += 1;
        }
    }

    /// The histograms of the tier named by `tier`, created on first sight; `None` when there
    /// is no tier header or a histogram cannot be made.
    fn tier_histograms(&mut self, tier: Option<&HeaderValue>) -> Option<&mut TierHistograms> {
        let name = tier?.to_str().unwrap_or("<non-ascii>");
        if !self.per_tier.contains_key(name) {
            let histogram = || Histogram::new_with_bounds(1, MAX_TRACKED_US, SIGNIFICANT_DIGITS);
            let histograms = TierHistograms {
                latency: histogram().ok()?,
                ttft: histogram().ok()?,
            };
            self.per_tier.insert(name.to_owned(), histograms);
        }
        self.per_tier.get_mut(name)
    }

    /// Counts so far.
    pub fn totals(&self) -> Totals {
        Totals {
            requests: self.requests,
            ok: self.ok,
            errors: self
                .errors
                .iter()
                .map(|(kind, count)| (kind.as_str().to_owned(), *count))
                .collect(),
            latency_us: summarize(&self.latency),
            ttft_us: summarize(&self.ttft),
            tiers: self.tiers.clone(),
            profiles: self.profiles.clone(),
            reasons: self.reasons.clone(),
            per_tier: self
                .per_tier
                .iter()
                .map(|(name, tier)| {
                    let summary = TierSummary {
                        latency_us: summarize(&tier.latency),
                        ttft_us: summarize(&tier.ttft),
                    };
                    (name.clone(), summary)
                })
                .collect(),
            fallbacks: self.fallbacks,
            retry_after_429: self.retry_after_429,
            accounting: self.accounting,
        }
    }

    fn record_error(&mut self, kind: ErrorKind) {
        *self.errors.entry(kind).or_default() += 1;
    }
}

/// Percentiles of a histogram (all zero when it is empty).
pub fn summarize(histogram: &Histogram<u64>) -> Summary {
    if histogram.is_empty() {
        return Summary::default();
    }
    Summary {
        count: histogram.len(),
        p50: histogram.value_at_quantile(0.50),
        p90: histogram.value_at_quantile(0.90),
        p99: histogram.value_at_quantile(0.99),
        p999: histogram.value_at_quantile(0.999),
        max: histogram.max(),
        mean: histogram.mean(),
    }
}

/// Whole microseconds, at least 1 (the histogram's lowest trackable value).
fn micros(duration: Duration) -> u64 {
    u64::try_from(duration.as_micros())
        .unwrap_or(u64::MAX)
        .max(1)
}

/// Counts a header value without allocating once the value has been seen.
fn count_header(counts: &mut BTreeMap<String, u64>, value: Option<&HeaderValue>) {
    let Some(value) = value else { return };
    let name = value.to_str().unwrap_or("<non-ascii>");
    match counts.get_mut(name) {
        Some(count) => *count += 1,
        None => {
            counts.insert(name.to_owned(), 1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(latency_us: u64, ttft_us: u64, tier: Option<&'static str>) -> Outcome {
        Outcome {
            latency: Duration::from_micros(latency_us),
            ttft: Some(Duration::from_micros(ttft_us)),
            result: Ok(()),
            tier: tier.map(HeaderValue::from_static),
            profile: None,
            reason: None,
            fallback: false,
            retry_after: false,
        }
    }

    fn failed(kind: ErrorKind) -> Outcome {
        Outcome {
            latency: Duration::from_millis(5),
            ttft: None,
            result: Err(kind),
            tier: None,
            profile: None,
            reason: None,
            fallback: false,
            retry_after: kind == ErrorKind::Http429,
        }
    }

    #[test]
    fn percentiles_of_one_to_a_thousand() {
        let mut recorder = Recorder::new().unwrap();
        for value in 1..=1000 {
            recorder.record(&ok(value, value / 2, None));
        }
        let totals = recorder.totals();
        let latency = totals.latency_us;
        assert_eq!(latency.count, 1000);
        assert_eq!(latency.p50, 500);
        assert_eq!(latency.p90, 900);
        assert_eq!(latency.p99, 990);
        assert_eq!(latency.p999, 999);
        assert_eq!(latency.max, 1000);
        assert!((latency.mean - 500.5).abs() < 0.5, "{}", latency.mean);
        assert_eq!(totals.ttft_us.p50, 250);
    }

    #[test]
    fn errors_count_as_requests_but_not_latency() {
        let mut recorder = Recorder::new().unwrap();
        recorder.record(&ok(100, 10, Some("fp16")));
        recorder.record(&ok(200, 10, Some("fp16")));
        recorder.record(&ok(300, 10, Some("int4")));
        recorder.record(&Outcome {
            latency: Duration::from_secs(30),
            ..failed(ErrorKind::Timeout)
        });
        recorder.record_dropped(ErrorKind::ClientOverflow);
        let totals = recorder.totals();
        assert_eq!(totals.requests, 5);
        assert_eq!(totals.ok, 3);
        assert_eq!(totals.latency_us.max, 300);
        assert_eq!(totals.errors["timeout"], 1);
        assert_eq!(totals.errors["client_overflow"], 1);
        assert_eq!(totals.tiers["fp16"], 2);
        assert_eq!(totals.tiers["int4"], 1);
    }

    #[test]
    fn tier_mix_and_per_tier_percentiles_count_each_tier_apart() {
        let mut recorder = Recorder::new().unwrap();
        for value in 1..=100 {
            recorder.record(&ok(value * 10, value, Some("int4")));
        }
        for value in 1..=10 {
            recorder.record(&ok(value * 1000, value * 100, Some("fp16")));
        }
        // An error with a tier header counts in the mix but not in the tier's percentiles.
        recorder.record(&Outcome {
            tier: Some(HeaderValue::from_static("fp16")),
            reason: Some(HeaderValue::from_static("fallback_error")),
            fallback: true,
            ..failed(ErrorKind::Http5xx)
        });
        let totals = recorder.totals();
        assert_eq!(totals.tiers["int4"], 100);
        assert_eq!(totals.tiers["fp16"], 11);
        assert_eq!(totals.per_tier["int4"].ttft_us.count, 100);
        assert_eq!(totals.per_tier["int4"].ttft_us.p99, 99);
        assert_eq!(totals.per_tier["fp16"].latency_us.count, 10);
        assert_eq!(totals.per_tier["fp16"].ttft_us.max, 1000);
        assert_eq!(totals.reasons["fallback_error"], 1);
        assert_eq!(totals.fallbacks, 1);
    }

    #[test]
    fn accounting_separates_answers_errors_lost_and_unsent() {
        let mut recorder = Recorder::new().unwrap();
        recorder.record(&ok(100, 10, None));
        recorder.record(&ok(100, 10, None));
        recorder.record(&failed(ErrorKind::Http429));
        recorder.record(&failed(ErrorKind::StreamError));
        recorder.record(&failed(ErrorKind::Http5xx));
        recorder.record(&failed(ErrorKind::StreamIncomplete));
        recorder.record(&failed(ErrorKind::Malformed));
        recorder.record(&failed(ErrorKind::Connect));
        recorder.record_dropped(ErrorKind::ClientOverflow);
        let totals = recorder.totals();
        assert_eq!(
            totals.accounting,
            Accounting {
                sent: 8,
                ok: 2,
                well_formed_errors: 3,
                lost: 3,
                not_sent: 1,
            }
        );
        assert_eq!(totals.retry_after_429, 1);
        assert_eq!(totals.requests, 9);
    }

    #[test]
    fn empty_histogram_summarizes_to_zeroes() {
        let recorder = Recorder::new().unwrap();
        assert_eq!(recorder.totals().latency_us, Summary::default());
    }

    #[test]
    fn sub_microsecond_and_huge_samples_are_clamped() {
        assert_eq!(micros(Duration::from_nanos(10)), 1);
        let mut recorder = Recorder::new().unwrap();
        recorder.record(&ok(u64::MAX / 2, 1, None));
        assert!(recorder.totals().latency_us.max >= MAX_TRACKED_US);
    }
}
