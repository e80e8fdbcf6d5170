//! Demand for tiers that have nowhere to send it: the request path reports a request routed
//! to a tier with no ready endpoint, and KEDA's `StreamIsActive` hears of it at once instead
//! of at its next poll — the difference between a cold start now and one 30 s later.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::broadcast;
use tokio::time::Instant;

/// Signals sent but not yet read by a slow stream; a stream that falls further behind
/// re-checks every tier instead (see [`Demand::subscribe`]).
const BACKLOG: usize = 64;

/// Who asked for which tier, and when last.
#[derive(Debug)]
pub struct Demand {
    signals: broadcast::Sender<Arc<str>>,
    last: Mutex<HashMap<String, Instant>>,
}

// === impl Demand ===

impl Demand {
    /// A request wants `tier`, which has no ready endpoint. Cheap, never blocks: a lock held
    /// for one map insert and a send nobody may be listening to.
    pub fn notify_demand(&self, tier: &str) {
        let now = Instant::now();
        let mut last = lock(&self.last);
        match last.get_mut(tier) {
            Some(at) => *at = now,
            None => {
                last.insert(tier.to_owned(), now);
            }
        }
        drop(last);
        if self.signals.receiver_count() > 0 {
            // No receiver left since the check: nobody to wake.
            let _ = self.signals.send(Arc::from(tier));
        }
    }

    /// Was there demand for `tier` within `hold` before `now`?
    pub fn recent(&self, tier: &str, hold: Duration, now: Instant) -> bool {
        lock(&self.last)
            .get(tier)
            .is_some_and(|at| now.saturating_duration_since(*at) <= hold)
    }

    /// Every later [`Demand::notify_demand`], by tier name. A receiver that lags gets
    /// `RecvError::Lagged` and should treat every tier as possibly wanted.
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<str>> {
        self.signals.subscribe()
    }
}

impl Default for Demand {
    fn default() -> Self {
        Self {
            signals: broadcast::channel(BACKLOG).0,
            last: Mutex::new(HashMap::new()),
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A map insert cannot leave the map half-updated, so a poisoned lock's data is sound.
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn demand_is_recent_for_the_hold_and_reaches_subscribers() {
        let demand = Demand::default();
        let mut signals = demand.subscribe();
        let hold = Duration::from_secs(60);
        assert!(!demand.recent("int4", hold, Instant::now()));
        demand.notify_demand("int4");
        assert_eq!(&*signals.recv().await.unwrap(), "int4");
        assert!(demand.recent("int4", hold, Instant::now()));
        assert!(!demand.recent("fp16", hold, Instant::now()));
        tokio::time::advance(hold + Duration::from_secs(1)).await;
        assert!(!demand.recent("int4", hold, Instant::now()));
    }
}
