//! Open-loop timing: when each request is due, and which requests fall in a window.
//!
//! Pure arithmetic so the schedule can be checked without a clock.

use std::time::Duration;

/// Slack for float rounding, so `0.3 s × 10 req/s` counts 3 requests, not 4.
const EPSILON: f64 = 1e-9;

/// Offset of request `index` from the start of an open-loop run at `rate` requests/s.
pub fn scheduled_offset(index: u64, rate: f64) -> Duration {
    Duration::from_secs_f64(index as f64 / rate)
}

/// How many requests an open-loop run at `rate` schedules strictly before `window` has
/// elapsed: the `i` with `i / rate < window`.
pub fn requests_in(window: Duration, rate: f64) -> u64 {
    let exact = window.as_secs_f64() * rate;
    if exact <= EPSILON {
        return 0;
    }
    // Saturating float-to-int: absurd rates clamp rather than wrap.
    (exact - EPSILON).ceil() as u64
}

/// The request indices of a run with a warm-up: `[0, warmup_end)` are sent but not recorded,
/// `[warmup_end, total)` are measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenLoopPlan {
    /// First measured request index.
    pub warmup_end: u64,
    /// One past the last scheduled request index.
    pub total: u64,
}

impl OpenLoopPlan {
    /// Plans `warmup` then `duration` at `rate` requests/s.
    pub fn new(rate: f64, warmup: Duration, duration: Duration) -> Self {
        Self {
            warmup_end: requests_in(warmup, rate),
            total: requests_in(warmup + duration, rate),
        }
    }

    /// Requests in the measured window.
    pub fn measured(&self) -> u64 {
        self.total - self.warmup_end
    }

    /// Whether request `index` is recorded.
    pub fn is_measured(&self, index: u64) -> bool {
        index >= self.warmup_end
    }
}

/// A 64-bit mix (splitmix64) used wherever the workload needs a reproducible "random" choice
/// without pulling in an RNG crate.
pub fn mix64(mut value: u64) -> u64 {
    value = value.wrapping_add(0x9E37_79B9_7F4A_7C15);
    value = (value ^ (value >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    value = (value ^ (value >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    value ^ (value >> 31)
}

/// Maps `value` to `[0, 1)` using its top 53 bits.
pub fn unit_interval(value: u64) -> f64 {
    (value >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_i_is_due_at_i_over_rate() {
        assert_eq!(scheduled_offset(0, 200.0), Duration::ZERO);
        assert_eq!(scheduled_offset(1, 200.0), Duration::from_millis(5));
        assert_eq!(scheduled_offset(400, 200.0), Duration::from_secs(2));
        assert_eq!(scheduled_offset(3, 0.5), Duration::from_secs(6));
    }

    #[test]
    fn window_counts_requests_strictly_before_its_end() {
        assert_eq!(requests_in(Duration::from_secs(15), 200.0), 3000);
        assert_eq!(requests_in(Duration::from_millis(300), 10.0), 3);
        assert_eq!(requests_in(Duration::from_millis(301), 10.0), 4);
        assert_eq!(requests_in(Duration::from_millis(250), 10.0), 3);
        assert_eq!(requests_in(Duration::ZERO, 10.0), 0);
        assert_eq!(requests_in(Duration::from_secs(1), 0.5), 1);
    }

    #[test]
    fn every_counted_request_is_due_inside_the_window() {
        for (window_ms, rate) in [(1000u64, 7.0), (333, 13.0), (15_000, 200.0), (10, 1000.0)] {
            let window = Duration::from_millis(window_ms);
            let count = requests_in(window, rate);
            assert!(count > 0);
            assert!(scheduled_offset(count - 1, rate) < window);
            assert!(scheduled_offset(count, rate) + Duration::from_nanos(1) >= window);
        }
    }

    #[test]
    fn warmup_requests_are_sent_but_not_measured() {
        let plan = OpenLoopPlan::new(100.0, Duration::from_millis(200), Duration::from_secs(1));
        assert_eq!(plan.warmup_end, 20);
        assert_eq!(plan.total, 120);
        assert_eq!(plan.measured(), 100);
        assert!(!plan.is_measured(19));
        assert!(plan.is_measured(20));
    }

    #[test]
    fn unit_interval_stays_below_one() {
        assert_eq!(unit_interval(0), 0.0);
        assert!(unit_interval(u64::MAX) < 1.0);
        assert_ne!(mix64(1), mix64(2));
    }
}
