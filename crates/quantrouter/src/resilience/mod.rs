//! Resilience: small state machines with no I/O — the circuit breaker, the retry budget,
//! the sliding window they share, admission and the one [`backoff`] (also waited by the Redis
//! sources, discovery and the KEDA publisher) — and [`retry`], the one place that retries
//! upstream attempts and falls back, and the only caller of those state machines on the
//! request path; [`resume`] keeps a stream's request to continue it there when it breaks.

pub mod admission;
pub mod backoff;
pub mod breaker;
pub mod budget;
pub mod resume;
pub mod retry;
pub mod window;

use std::time::Duration;

pub use admission::{Admission, AdmissionConfig, Overloaded, Permit};
pub use backoff::{Backoff, Schedule};
pub use breaker::{Admit, Breaker, BreakerConfig, CircuitState};
pub use budget::{BudgetConfig, RetryBudget};

/// Every resilience setting, with its default's reason next to it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ResilienceConfig {
    pub backoff: Backoff,
    pub budget: BudgetConfig,
    pub breaker: BreakerConfig,
    pub admission: AdmissionConfig,
    /// Attempts per request across endpoints and tiers: the first try, a retry on another
    /// endpoint, and two fallbacks; more only adds latency to a request that is failing.
    pub max_attempts: u32,
    /// Overall deadline when the client sends no `x-quantrouter-timeout-ms`: long
    /// generations take minutes, nothing legitimate takes ten.
    pub default_deadline: Duration,
    /// Longest silence between two chunks of a response: vLLM emits a token every few ms,
    /// so half a minute of nothing means the stream is stuck.
    pub idle_timeout: Duration,
    /// How often each endpoint's `/metrics` is scraped for its queue: about as fast as the
    /// queue changes, cheap for vLLM.
    pub scrape_interval: Duration,
    /// A scrape slower than this is dropped; the last value stays.
    pub scrape_timeout: Duration,
    /// How often each endpoint is health-checked (`GET /health`); zero turns checks off.
    /// A down endpoint is then noticed after `breaker.consecutive_failures` checks (10 s)
    /// without any traffic, for a request every couple of seconds per endpoint.
    pub health_interval: Duration,
    /// A health check slower than this failed: a live server answers `/health` in ms.
    pub health_timeout: Duration,
    /// Extra upstream load of calibration (`policy.calibration`): reference requests per
    /// eligible request, like retries. One per twenty plus two a window, however high the
    /// sample rate: calibration must never become a tier's load.
    pub calibration: BudgetConfig,
}

impl Default for ResilienceConfig {
    fn default() -> Self {
        Self {
            backoff: Backoff::default(),
            budget: BudgetConfig::default(),
            breaker: BreakerConfig::default(),
            admission: AdmissionConfig::default(),
            max_attempts: 4,
            default_deadline: Duration::from_secs(600),
            idle_timeout: Duration::from_secs(30),
            scrape_interval: Duration::from_secs(1),
            scrape_timeout: Duration::from_millis(500),
            health_interval: Duration::from_secs(2),
            health_timeout: Duration::from_secs(1),
            calibration: BudgetConfig {
                ratio: 0.05,
                floor: 2,
                window: Duration::from_secs(10),
            },
        }
    }
}
