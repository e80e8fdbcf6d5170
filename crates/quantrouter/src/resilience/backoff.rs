//! Exponential backoff with full jitter, and how it combines with `Retry-After`.

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

impl Default for Backoff {
    fn default() -> Self {
        Self {
            base: Duration::from_millis(25),
            cap: Duration::from_secs(1),
            retry_after_cap: Duration::from_secs(5),
        }
    }
}

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
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

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
    }
}
