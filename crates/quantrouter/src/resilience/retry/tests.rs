use std::time::Duration;

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

fn io(message: &str) -> BoxError {
    std::io::Error::other(message.to_owned()).into()
}

use crate::upstream::BoxError;

#[test]
fn only_requests_that_never_left_are_sent_again_at_once() {
    let endpoint = || "http://a:1".to_owned();
    let unsent = UpstreamError::Unsent {
        endpoint: endpoint(),
        source: io("connection closed"),
    };
    assert_eq!(unsent.sent(), Sent::No);
    assert_eq!(is_retryable(Outcome::Failed(&unsent)), Verdict::Resend);

    // Nothing sent, but the endpoint is unreachable: another one, counted.
    let refused = UpstreamError::Connect {
        endpoint: endpoint(),
        source: io("refused"),
    };
    assert_eq!(refused.sent(), Sent::No);
    assert_eq!(is_retryable(Outcome::Failed(&refused)), Verdict::Retry);

    // The upstream may have the request: never resent on the quiet.
    let possibly_sent = [
        UpstreamError::Exchange {
            endpoint: endpoint(),
            source: io("closed before a response head"),
        },
        UpstreamError::InvalidResponse {
            endpoint: endpoint(),
            source: io("not HTTP"),
        },
        UpstreamError::HeaderTimeout {
            endpoint: endpoint(),
            timeout: Duration::from_secs(1),
        },
    ];
    for error in &possibly_sent {
        assert_eq!(error.sent(), Sent::Possibly, "{error}");
        assert_eq!(
            is_retryable(Outcome::Failed(error)),
            Verdict::Retry,
            "{error}"
        );
    }
}

#[test]
fn statuses_that_mean_the_attempt_did_not_happen_are_retried_and_no_others() {
    for status in [429, 502, 503, 504] {
        let status = StatusCode::from_u16(status).unwrap();
        assert_eq!(is_retryable(Outcome::Answered(status)), Verdict::Retry);
    }
    for status in [200, 201, 400, 401, 404, 413, 422, 500, 501] {
        let status = StatusCode::from_u16(status).unwrap();
        assert_eq!(
            is_retryable(Outcome::Answered(status)),
            Verdict::Done,
            "{status}"
        );
    }
}
