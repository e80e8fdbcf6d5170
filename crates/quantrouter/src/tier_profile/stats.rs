//! Statistics over measured requests: percentiles, per-level latency and throughput, and
//! per-class tallies of matched answers. Pure arithmetic.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

use super::eval::EvalClass;

/// The median and 90th percentile of a set of measurements.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Spread {
    pub p50: f64,
    pub p90: f64,
}

/// One streamed request that completed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StreamSample {
    /// From sending the request to the first event that carries content.
    pub ttft: Duration,
    /// From the first to the last event that carries content.
    pub decode: Duration,
    /// From the server's `usage` when it sends one, else the content events counted.
    pub output_tokens: u64,
}

/// Latency and throughput of the requests at one concurrency level.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LevelReport {
    pub concurrency: usize,
    /// Requests sent.
    pub requests: usize,
    pub succeeded: usize,
    /// Failed requests by kind (`status_503`, `timeout`, `connect`, ...).
    pub errors: BTreeMap<String, usize>,
    pub ttft_ms: Option<Spread>,
    /// Per request: decode time over output tokens after the first.
    pub itl_ms: Option<Spread>,
    pub output_tokens_per_s: f64,
    pub requests_per_s: f64,
    pub wall_s: f64,
}

/// How many answers matched (the expected answer, or the baseline's) out of how many.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    pub matched: u32,
    pub total: u32,
}

/// A tally with its rate, as reported.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Figure {
    pub matched: u32,
    pub total: u32,
    pub rate: f64,
}

/// Tallies per task class.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClassTallies(pub BTreeMap<EvalClass, Tally>);

/// The `q` quantile (0 < q ≤ 1) of sorted values by nearest rank: a value that was measured,
/// not an interpolation between two.
pub fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted.get(rank.clamp(1, sorted.len()) - 1).copied()
}

/// p50 and p90 of the finite values, if there are any.
pub fn spread(mut values: Vec<f64>) -> Option<Spread> {
    values.retain(|v| v.is_finite());
    values.sort_by(f64::total_cmp);
    Some(Spread {
        p50: percentile(&values, 0.5)?,
        p90: percentile(&values, 0.9)?,
    })
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

// === impl StreamSample ===

impl StreamSample {
    /// Mean time per token after the first; none for an answer of one token.
    pub fn itl_ms(&self) -> Option<f64> {
        (self.output_tokens >= 2).then(|| ms(self.decode) / (self.output_tokens - 1) as f64)
    }
}

// === impl LevelReport ===

impl LevelReport {
    /// Summarises one level: `samples` of the requests that completed, `errors` of the rest,
    /// `wall` from the first request sent to the last one finished.
    pub fn new(
        concurrency: usize,
        samples: &[StreamSample],
        errors: BTreeMap<String, usize>,
        wall: Duration,
    ) -> Self {
        let seconds = wall.as_secs_f64();
        let per_second = |n: f64| if seconds > 0.0 { n / seconds } else { 0.0 };
        let tokens: u64 = samples.iter().map(|s| s.output_tokens).sum();
        Self {
            concurrency,
            requests: samples.len() + errors.values().sum::<usize>(),
            succeeded: samples.len(),
            errors,
            ttft_ms: spread(samples.iter().map(|s| ms(s.ttft)).collect()),
            itl_ms: spread(samples.iter().filter_map(StreamSample::itl_ms).collect()),
            output_tokens_per_s: per_second(tokens as f64),
            requests_per_s: per_second(samples.len() as f64),
            wall_s: seconds,
        }
    }
}

// === impl Tally ===

impl Tally {
    pub fn add(&mut self, matched: bool) {
        self.total += 1;
        self.matched += u32::from(matched);
    }

    pub fn merge(&mut self, other: Tally) {
        self.total += other.total;
        self.matched += other.matched;
    }

    pub fn rate(self) -> Option<f64> {
        (self.total > 0).then(|| f64::from(self.matched) / f64::from(self.total))
    }

    pub fn figure(self) -> Option<Figure> {
        Some(Figure {
            matched: self.matched,
            total: self.total,
            rate: self.rate()?,
        })
    }
}

// === impl ClassTallies ===

impl ClassTallies {
    pub fn add(&mut self, class: EvalClass, matched: bool) {
        self.0.entry(class).or_default().add(matched);
    }

    pub fn get(&self, class: EvalClass) -> Tally {
        self.0.get(&class).copied().unwrap_or_default()
    }

    /// Every class together.
    pub fn overall(&self) -> Tally {
        self.0.values().fold(Tally::default(), |mut all, t| {
            all.merge(*t);
            all
        })
    }

    /// The figure of each class that has items, by class name.
    pub fn figures(&self) -> BTreeMap<&'static str, Figure> {
        self.0
            .iter()
            .filter_map(|(class, tally)| Some((class.as_str(), tally.figure()?)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let values: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(percentile(&values, 0.5), Some(5.0));
        assert_eq!(percentile(&values, 0.9), Some(9.0));
        assert_eq!(percentile(&values, 1.0), Some(10.0));
        assert_eq!(percentile(&[7.0], 0.5), Some(7.0));
        assert_eq!(percentile(&[], 0.5), None);
        let s = spread(vec![3.0, f64::NAN, 1.0, 2.0]).unwrap();
        assert_eq!((s.p50, s.p90), (2.0, 3.0));
        assert!(spread(vec![f64::INFINITY]).is_none());
    }

    #[test]
    fn inter_token_latency_needs_two_tokens() {
        let sample = |tokens, decode_ms| StreamSample {
            ttft: Duration::from_millis(50),
            decode: Duration::from_millis(decode_ms),
            output_tokens: tokens,
        };
        assert_eq!(sample(11, 100).itl_ms(), Some(10.0));
        assert_eq!(sample(1, 0).itl_ms(), None);
        assert_eq!(sample(0, 0).itl_ms(), None);
    }

    #[test]
    fn a_level_counts_errors_as_requests_but_not_in_throughput() {
        let samples = [
            StreamSample {
                ttft: Duration::from_millis(100),
                decode: Duration::from_millis(90),
                output_tokens: 10,
            },
            StreamSample {
                ttft: Duration::from_millis(300),
                decode: Duration::from_millis(180),
                output_tokens: 10,
            },
        ];
        let errors = BTreeMap::from([("status_503".to_owned(), 2)]);
        let level = LevelReport::new(4, &samples, errors, Duration::from_secs(2));
        assert_eq!((level.requests, level.succeeded), (4, 2));
        assert_eq!(level.ttft_ms.map(|s| s.p50), Some(100.0));
        assert_eq!(level.ttft_ms.map(|s| s.p90), Some(300.0));
        assert_eq!(level.itl_ms.map(|s| s.p90), Some(20.0));
        assert_eq!(level.output_tokens_per_s, 10.0);
        assert_eq!(level.requests_per_s, 1.0);
        let empty = LevelReport::new(1, &[], BTreeMap::new(), Duration::ZERO);
        assert_eq!((empty.ttft_ms, empty.requests_per_s), (None, 0.0));
    }

    #[test]
    fn tallies_add_up_per_class_and_overall() {
        let mut t = ClassTallies::default();
        for matched in [true, true, false, true] {
            t.add(EvalClass::Math, matched);
        }
        t.add(EvalClass::General, false);
        assert_eq!(t.get(EvalClass::Math).rate(), Some(0.75));
        assert_eq!(t.get(EvalClass::Code).rate(), None);
        assert_eq!(
            t.overall(),
            Tally {
                matched: 3,
                total: 5
            }
        );
        let figures = t.figures();
        assert_eq!(figures["math"].total, 4);
        assert!(!figures.contains_key("code"));
    }
}
