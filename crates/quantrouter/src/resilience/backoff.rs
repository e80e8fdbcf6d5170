//! The one backoff of the router (exponential, full jitter, capped, `Retry-After` honoured up
//! to a cap). Upstream retries use it in [`super::retry`]; the Redis document sources,
//! Kubernetes discovery and the KEDA publisher follow a [`Schedule`] of it.
//!
//! A leaf: it imports nothing else from the crate, so every background loop can use it
//! without depending on the request path.

use std::time::Duration;

/// Backoff settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    /// First retry's ceiling: long enough for a connection refused by a restarting pod to
    /// change, short next to any LLM request.
    pub base: Duration,
    /// Ceiling of any one wait: the retry happens within the client's patience.
    pub cap: Duration,
    /// Longest `Retry-After` honoured: a server asking for more is treated as unavailable
    /// for this request rather than holding the client.
    pub retry_after_cap: Duration,
}

/// A backoff in progress: the waits before each retry of one operation that keeps failing.
#[derive(Debug, Clone, Copy)]
pub struct Schedule {
    backoff: Backoff,
    retries: u32,
    /// Uniform in [0, 1); fixed in tests.
    jitter: fn() -> f64,
}

// === impl Backoff ===

impl Backoff {
    /// The wait before retry number `retry` (0 = the first retry), for a uniform `jitter` in
    /// [0, 1): full jitter over `min(cap, base·2^retry)`, so concurrent retries spread out.
    /// A `Retry-After` from the failed answer sets a floor, up to `retry_after_cap`.
    pub fn delay(&self, retry: u32, jitter: f64, retry_after: Option<Duration>) -> Duration {
        let ceiling = self
            .base
            .saturating_mul(1u32.checked_shl(retry.min(20)).unwrap_or(u32::MAX))
            .min(self.cap);
        let jittered = ceiling.mul_f64(jitter.clamp(0.0, 1.0));
        match retry_after {
            Some(asked) => jittered.max(asked.min(self.retry_after_cap)),
            None => jittered,
        }
    }

    /// A schedule of waits for an operation retried until it succeeds.
    pub fn schedule(self) -> Schedule {
        Schedule {
            backoff: self,
            retries: 0,
            jitter: fastrand::f64,
        }
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            base: Duration::from_millis(25),
            cap: Duration::from_secs(1),
            retry_after_cap: Duration::from_secs(5),
        }
    }
}

// === impl Schedule ===

impl Schedule {
    /// The wait before the next retry; each call counts one.
    pub fn next_delay(&mut self) -> Duration {
        let wait = self.backoff.delay(self.retries, (self.jitter)(), None);
        self.retries = self.retries.saturating_add(1);
        wait
    }

    /// The operation succeeded: the next failure waits the shortest again.
    pub fn reset(&mut self) {
        self.retries = 0;
    }

    /// Retries since the last success.
    pub fn retries(&self) -> u32 {
        self.retries
    }
}

impl Iterator for Schedule {
    type Item = Duration;

    /// Never ends: such operations are retried for as long as the router runs.
    fn next(&mut self) -> Option<Duration> {
        Some(self.next_delay())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Any retry number, jitter and Retry-After: the wait stays within
        /// [Retry-After (capped), max(cap, Retry-After cap)] and within the exponential
        /// ceiling when no Retry-After was given.
        #[test]
        fn delay_stays_within_its_bounds(
            retry in 0u32..64,
            jitter in 0.0f64..1.0,
            asked_ms in proptest::option::of(0u64..120_000),
        ) {
            let b = Backoff::default();
            let asked = asked_ms.map(Duration::from_millis);
            let d = b.delay(retry, jitter, asked);
            let ceiling = b.base.saturating_mul(1u32 << retry.min(20)).min(b.cap);
            match asked {
                None => prop_assert!(d <= ceiling),
                Some(asked) => {
                    prop_assert!(d >= asked.min(b.retry_after_cap));
                    prop_assert!(d <= ceiling.max(b.retry_after_cap));
                }
            }
        }
    }

    #[test]
    fn grows_exponentially_to_the_cap_and_jitter_scales_it() {
        let b = Backoff::default();
        assert_eq!(b.delay(0, 1.0, None), Duration::from_millis(25));
        assert_eq!(b.delay(2, 1.0, None), Duration::from_millis(100));
        assert_eq!(b.delay(10, 1.0, None), Duration::from_secs(1));
        assert_eq!(b.delay(3, 0.5, None), Duration::from_millis(100));
        assert_eq!(b.delay(3, 0.0, None), Duration::ZERO);
        assert_eq!(b.delay(u32::MAX, 1.0, None), Duration::from_secs(1));
    }

    #[test]
    fn retry_after_is_a_floor_up_to_its_cap() {
        let b = Backoff::default();
        assert_eq!(
            b.delay(0, 0.0, Some(Duration::from_secs(1))),
            Duration::from_secs(1)
        );
        assert_eq!(
            b.delay(0, 0.0, Some(Duration::from_secs(60))),
            Duration::from_secs(5)
        );
        // A short Retry-After does not cut a longer backoff.
        assert_eq!(
            b.delay(10, 1.0, Some(Duration::from_millis(10))),
            Duration::from_secs(1)
        );
    }

    fn schedule(base_ms: u64, cap_ms: u64, jitter: fn() -> f64) -> Schedule {
        Schedule {
            backoff: Backoff {
                base: Duration::from_millis(base_ms),
                cap: Duration::from_millis(cap_ms),
                retry_after_cap: Duration::ZERO,
            },
            retries: 0,
            jitter,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_schedule_waits_longer_after_each_failure_up_to_the_cap_and_resets() {
        let mut backoff = schedule(100, 1000, || 1.0);
        let start = tokio::time::Instant::now();
        let mut waited = Vec::new();
        for _ in 0..6 {
            let before = tokio::time::Instant::now();
            tokio::time::sleep(backoff.next_delay()).await;
            waited.push((tokio::time::Instant::now() - before).as_millis());
        }
        assert_eq!(waited, [100, 200, 400, 800, 1000, 1000]);
        assert_eq!((tokio::time::Instant::now() - start).as_millis(), 3500);
        assert_eq!(backoff.retries(), 6);
        backoff.reset();
        assert_eq!(backoff.retries(), 0);
        assert_eq!(backoff.next_delay(), Duration::from_millis(100));
        // Jitter 0: full jitter may retry at once, however many failures came before.
        let mut eager = schedule(100, 1000, || 0.0);
        assert!(eager.by_ref().take(10).all(|d| d.is_zero()));
    }
}
