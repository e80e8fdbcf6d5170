//! The retry budget: retries may add at most `ratio` of the requests seen over a sliding
//! window, plus a small floor, so a failing tier never sees a retry storm. Pure.

use std::time::Duration;

use tokio::time::Instant;

use super::window::Window;

/// Budget settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BudgetConfig {
    /// Retries allowed per request: 20% more load at worst on a tier that fails everything.
    pub ratio: f64,
    /// Retries always allowed per window, so a quiet router can still retry a lone failure.
    pub floor: u32,
    /// How far back requests and retries count.
    pub window: Duration,
}

impl Default for BudgetConfig {
    fn default() -> Self {
        Self {
            ratio: 0.2,
            floor: 10,
            window: Duration::from_secs(10),
        }
    }
}

/// Requests (unmarked) and retries (marked) of one profile.
#[derive(Debug, Clone)]
pub struct RetryBudget {
    config: BudgetConfig,
    window: Window,
}

impl RetryBudget {
    pub fn new(config: BudgetConfig, now: Instant) -> Self {
        Self {
            config,
            window: Window::new(config.window, now),
        }
    }

    /// Counts a first attempt.
    pub fn on_request(&mut self, now: Instant) {
        self.window.record(now, false);
    }

    /// Takes one retry from the budget if there is one left.
    pub fn try_retry(&mut self, now: Instant) -> bool {
        let counts = self.window.counts(now);
        let requests = counts.total - counts.marked;
        let allowed = f64::from(self.config.floor) + self.config.ratio * f64::from(requests);
        if f64::from(counts.marked) + 1.0 > allowed {
            return false;
        }
        self.window.record(now, true);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Whatever the interleaving, retries granted never exceed ratio × requests + floor.
        #[test]
        fn retries_stay_within_the_budget(ops in proptest::collection::vec(any::<bool>(), 0..500)) {
            let now = Instant::now();
            let config = BudgetConfig { ratio: 0.2, floor: 3, window: Duration::from_secs(10) };
            let mut budget = RetryBudget::new(config, now);
            let (mut requests, mut retries) = (0u32, 0u32);
            for is_request in ops {
                if is_request {
                    budget.on_request(now);
                    requests += 1;
                } else if budget.try_retry(now) {
                    retries += 1;
                }
                prop_assert!(f64::from(retries) <= 3.0 + 0.2 * f64::from(requests));
            }
        }
    }

    #[test]
    fn the_floor_allows_retries_when_quiet_and_the_window_refills() {
        let t0 = Instant::now();
        let config = BudgetConfig {
            ratio: 0.2,
            floor: 2,
            window: Duration::from_secs(2),
        };
        let mut budget = RetryBudget::new(config, t0);
        assert!(budget.try_retry(t0));
        assert!(budget.try_retry(t0));
        assert!(!budget.try_retry(t0));
        for _ in 0..10 {
            budget.on_request(t0);
        }
        assert!(budget.try_retry(t0), "10 requests earn 2 more");
        assert!(budget.try_retry(t0));
        assert!(!budget.try_retry(t0));
        assert!(
            budget.try_retry(t0 + Duration::from_secs(3)),
            "old retries age out"
        );
    }
}
