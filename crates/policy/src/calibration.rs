//! Live agreement sampling (`policy.calibration`): which requests are sampled, how much the
//! extra reference requests may cost per hour, and what the counted agreements say about a
//! profile's quality. Pure: time comes in as an argument.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

/// Whether a request is in the sample: `draw`, uniform in [0, 1) from the caller's RNG,
/// against the rate. A fresh draw per request, since anything taken from the request (its
/// id) is the client's to choose and would let it decide what is sampled.
pub fn sampled(draw: f64, rate: f64) -> bool {
    draw < rate
}

/// The estimated cost of the reference requests of the last hour, and whether another fits.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CostWindow {
    /// (time in ms, cost) of each request spent, oldest first.
    spent: VecDeque<(u64, f64)>,
    total: f64,
}

/// Agreements counted for one profile and task class.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgreementTally {
    pub agree: u64,
    pub disagree: u64,
}

/// A profile's quality for a task class as its agreement with the reference suggests: the
/// reference's own quality times the agreement rate, with a 95% interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct QualityEstimate {
    pub estimate: f64,
    pub low: f64,
    pub high: f64,
    pub samples: u64,
}

const HOUR_MS: u64 = 3_600_000;

// === impl CostWindow ===

impl CostWindow {
    /// Spends `cost` at `now_ms` if the last hour's spending stays within `limit`; says
    /// whether it did.
    pub fn try_spend(&mut self, now_ms: u64, cost: f64, limit: f64) -> bool {
        self.expire(now_ms);
        if !(cost.is_finite() && cost >= 0.0) || self.total + cost > limit {
            return false;
        }
        self.spent.push_back((now_ms, cost));
        self.total += cost;
        true
    }

    /// Replaces what a request spent at `spent_at_ms` (its `estimate`, as passed to
    /// [`CostWindow::try_spend`]) by what it turned out to cost; nothing once it left the
    /// window. The actual cost may pass the limit: the window then admits nothing until
    /// it is back under.
    pub fn correct(&mut self, spent_at_ms: u64, estimate: f64, actual: f64) {
        if !(actual.is_finite() && actual >= 0.0) {
            return;
        }
        let entry = self
            .spent
            .iter_mut()
            .rev()
            .find(|(at, cost)| *at == spent_at_ms && *cost == estimate);
        if let Some((_, cost)) = entry {
            self.total += actual - *cost;
            *cost = actual;
        }
    }

    /// What the last hour before `now_ms` cost.
    pub fn spent(&mut self, now_ms: u64) -> f64 {
        self.expire(now_ms);
        self.total.max(0.0)
    }

    fn expire(&mut self, now_ms: u64) {
        while let Some(&(at, cost)) = self.spent.front() {
            if now_ms.saturating_sub(at) < HOUR_MS {
                break;
            }
            self.spent.pop_front();
            self.total -= cost;
        }
        if self.spent.is_empty() {
            // Keeps rounding from drifting across a long run.
            self.total = 0.0;
        }
    }
}

// === impl AgreementTally ===

impl AgreementTally {
    pub fn record(&mut self, agreed: bool) {
        if agreed {
            self.agree += 1;
        } else {
            self.disagree += 1;
        }
    }

    pub fn samples(&self) -> u64 {
        self.agree + self.disagree
    }

    pub fn merge(&mut self, other: AgreementTally) {
        self.agree += other.agree;
        self.disagree += other.disagree;
    }

    /// The agreement rate with its Wilson score interval at 95%: unlike the normal
    /// approximation it stays inside [0, 1] and is honest for a few dozen samples.
    pub fn rate(&self) -> Option<(f64, f64, f64)> {
        let n = self.samples();
        if n == 0 {
            return None;
        }
        const Z: f64 = 1.959_964;
        let n = n as f64;
        let p = self.agree as f64 / n;
        let z2 = Z * Z;
        let centre = (p + z2 / (2.0 * n)) / (1.0 + z2 / n);
        let half = Z * (p * (1.0 - p) / n + z2 / (4.0 * n * n)).sqrt() / (1.0 + z2 / n);
        Some((p, (centre - half).max(0.0), (centre + half).min(1.0)))
    }

    /// The quality this agreement suggests for a profile whose reference has quality
    /// `reference_quality` for the same task class.
    pub fn quality(&self, reference_quality: f64) -> Option<QualityEstimate> {
        let (p, low, high) = self.rate()?;
        Some(QualityEstimate {
            estimate: reference_quality * p,
            low: reference_quality * low,
            high: reference_quality * high,
            samples: self.samples(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_draw_is_sampled_below_the_rate() {
        let draws: Vec<f64> = (0..1000).map(|i| f64::from(i) / 1000.0).collect();
        assert_eq!(draws.iter().filter(|&&d| sampled(d, 0.1)).count(), 100);
        assert!(!draws.iter().any(|&d| sampled(d, 0.0)));
        assert!(draws.iter().all(|&d| sampled(d, 1.0)));
    }

    #[test]
    fn a_correction_replaces_the_estimate_while_it_is_in_the_window() {
        let mut w = CostWindow::default();
        assert!(w.try_spend(0, 0.25, 1.0));
        assert!(w.try_spend(10, 0.25, 1.0));
        w.correct(10, 0.25, 0.75);
        assert!((w.spent(10) - 1.0).abs() < 1e-12);
        assert!(!w.try_spend(20, 0.125, 1.0), "the actual cost filled it");
        w.correct(0, 0.25, 0.0);
        assert!((w.spent(20) - 0.75).abs() < 1e-12);
        w.correct(0, 0.25, 0.5);
        assert!((w.spent(20) - 0.75).abs() < 1e-12, "corrected once only");
        w.correct(10, 0.75, f64::NAN);
        assert!((w.spent(HOUR_MS + 10) - 0.0).abs() < 1e-12);
    }

    #[test]
    fn the_cost_window_refuses_past_the_limit_and_frees_after_an_hour() {
        let mut w = CostWindow::default();
        assert!(w.try_spend(0, 0.6, 1.0));
        assert!(!w.try_spend(1_000, 0.6, 1.0));
        assert!(w.try_spend(2_000, 0.4, 1.0));
        assert!((w.spent(2_000) - 1.0).abs() < 1e-12);
        assert!(!w.try_spend(HOUR_MS - 1, 0.1, 1.0));
        assert!(
            w.try_spend(HOUR_MS, 0.5, 1.0),
            "the first spend left the window"
        );
        assert!(!w.try_spend(HOUR_MS, f64::NAN, 1.0));
        assert!((w.spent(3 * HOUR_MS)).abs() < 1e-12);
    }

    #[test]
    fn the_interval_holds_the_rate_and_narrows_with_samples() {
        let tally = |agree, disagree| AgreementTally { agree, disagree };
        assert_eq!(tally(0, 0).rate(), None);
        let (p, low, high) = tally(80, 20).rate().unwrap();
        assert!(
            (p - 0.8).abs() < 1e-12 && low < p && p < high,
            "{low} {high}"
        );
        let (_, low_more, high_more) = tally(800, 200).rate().unwrap();
        assert!(high_more - low_more < high - low);
        let (_, low, high) = tally(10, 0).rate().unwrap();
        assert!(high <= 1.0 && low > 0.6, "{low} {high}");
        let q = tally(80, 20).quality(0.95).unwrap();
        assert!((q.estimate - 0.76).abs() < 1e-12 && q.low < q.estimate && q.samples == 100);
    }
}
