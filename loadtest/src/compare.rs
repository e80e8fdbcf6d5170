//! Baseline versus subject: how much latency the subject adds, and its relative throughput.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::report::RunReport;
use crate::stats::Summary;

/// `subject − baseline` at each percentile, in microseconds (negative = subject faster).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Added {
    /// Median.
    pub p50: i64,
    /// 90th percentile.
    pub p90: i64,
    /// 99th percentile.
    pub p99: i64,
    /// 99.9th percentile.
    pub p999: i64,
    /// Maximum.
    pub max: i64,
    /// Mean.
    pub mean: f64,
}

/// The comparison `loadtest compare` prints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Comparison {
    /// Baseline label.
    pub baseline: String,
    /// Subject label.
    pub subject: String,
    /// Added end-to-end latency.
    pub added_latency_us: Added,
    /// Added time to first token.
    pub added_ttft_us: Added,
    /// Baseline successful requests/s.
    pub baseline_throughput_rps: f64,
    /// Subject successful requests/s.
    pub subject_throughput_rps: f64,
    /// `subject / baseline` throughput; `null` when the baseline completed nothing.
    pub throughput_ratio: Option<f64>,
    /// Baseline failures.
    pub baseline_errors: u64,
    /// Subject failures.
    pub subject_errors: u64,
}

/// Compares two runs.
pub fn compare(baseline: &RunReport, subject: &RunReport) -> Comparison {
    let throughput_ratio =
        (baseline.throughput_rps > 0.0).then(|| subject.throughput_rps / baseline.throughput_rps);
    Comparison {
        baseline: baseline.label.clone(),
        subject: subject.label.clone(),
        added_latency_us: added(&baseline.latency_us, &subject.latency_us),
        added_ttft_us: added(&baseline.ttft_us, &subject.ttft_us),
        baseline_throughput_rps: baseline.throughput_rps,
        subject_throughput_rps: subject.throughput_rps,
        throughput_ratio,
        baseline_errors: baseline.errors.values().sum(),
        subject_errors: subject.errors.values().sum(),
    }
}

/// Per-percentile difference `subject − baseline`.
pub fn added(baseline: &Summary, subject: &Summary) -> Added {
    let diff = |base: u64, subj: u64| -> i64 {
        i64::try_from(i128::from(subj) - i128::from(base)).unwrap_or(i64::MAX)
    };
    Added {
        p50: diff(baseline.p50, subject.p50),
        p90: diff(baseline.p90, subject.p90),
        p99: diff(baseline.p99, subject.p99),
        p999: diff(baseline.p999, subject.p999),
        max: diff(baseline.max, subject.max),
        mean: subject.mean - baseline.mean,
    }
}

// === impl Comparison ===

impl Comparison {
    /// A compact table for the terminal.
    pub fn render_table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "{} vs baseline {}", self.subject, self.baseline);
        let _ = writeln!(
            out,
            "{:<14} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
            "added µs", "p50", "p90", "p99", "p99.9", "max", "mean"
        );
        for (name, row) in [
            ("latency", &self.added_latency_us),
            ("ttft", &self.added_ttft_us),
        ] {
            let _ = writeln!(
                out,
                "{name:<14} {:>+9} {:>+9} {:>+9} {:>+9} {:>+9} {:>+9.0}",
                row.p50, row.p90, row.p99, row.p999, row.max, row.mean
            );
        }
        let ratio = self
            .throughput_ratio
            .map_or_else(|| "n/a".to_owned(), |ratio| format!("{ratio:.3}"));
        let _ = writeln!(
            out,
            "throughput {:.1} / {:.1} req/s = {ratio}  errors {} / {}",
            self.subject_throughput_rps,
            self.baseline_throughput_rps,
            self.subject_errors,
            self.baseline_errors
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::tests::sample;

    #[test]
    fn added_latency_is_subject_minus_baseline() {
        let baseline = sample("direct", 1000, 200.0);
        let subject = sample("router", 1300, 190.0);
        let comparison = compare(&baseline, &subject);
        assert_eq!(comparison.added_latency_us.p50, 300);
        assert_eq!(comparison.added_latency_us.p90, 600);
        assert_eq!(comparison.added_latency_us.p999, 1200);
        assert_eq!(comparison.added_latency_us.max, 1500);
        assert!((comparison.added_latency_us.mean - 450.0).abs() < 1e-9);
        assert_eq!(comparison.added_ttft_us.p50, 150);
        assert!((comparison.throughput_ratio.unwrap() - 0.95).abs() < 1e-9);
    }

    #[test]
    fn a_faster_subject_has_negative_added_latency() {
        let comparison = compare(&sample("a", 1000, 1.0), &sample("b", 900, 1.0));
        assert_eq!(comparison.added_latency_us.p50, -100);
        assert!(comparison.render_table().contains("-100"));
    }

    #[test]
    fn zero_baseline_throughput_has_no_ratio() {
        let comparison = compare(&sample("a", 1, 0.0), &sample("b", 1, 5.0));
        assert_eq!(comparison.throughput_ratio, None);
        let json = serde_json::to_value(&comparison).unwrap();
        assert_eq!(json["throughput_ratio"], serde_json::Value::Null);
        assert!(comparison.render_table().contains("n/a"));
    }
}
