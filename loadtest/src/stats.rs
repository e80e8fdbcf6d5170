//! Aggregation of outcomes: HDR histograms in microseconds, error and tier counts.

use std::collections::BTreeMap;
use std::time::Duration;

use hdrhistogram::Histogram;
use http::HeaderValue;
use serde::{Deserialize, Serialize};

use crate::outcome::{ErrorKind, Outcome};

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
        })
    }

    /// Records one request. Latency and TTFT histograms hold successful requests only, so
    /// that fast failures cannot make a server look quicker; failures are counted by kind.
    pub fn record(&mut self, outcome: &Outcome) {
        self.requests += 1;
        count_header(&mut self.tiers, outcome.tier.as_ref());
        count_header(&mut self.profiles, outcome.profile.as_ref());
        match outcome.result {
            Ok(()) => {
                self.ok += 1;
                self.latency.saturating_record(micros(outcome.latency));
                if let Some(ttft) = outcome.ttft {
                    self.ttft.saturating_record(micros(ttft));
                }
            }
            Err(kind) => self.record_error(kind),
        }
    }

    /// Records a request that never produced an outcome (a client overflow).
    pub fn record_dropped(&mut self, kind: ErrorKind) {
        self.requests += 1;
        self.record_error(kind);
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
            ttft: None,
            result: Err(ErrorKind::Timeout),
            tier: None,
            profile: None,
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
