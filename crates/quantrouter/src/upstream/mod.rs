//! Upstream vLLM servers: a [`Pool`] of endpoints per profile, what the probes
//! ([`crate::probes`]) found on them ([`queue`]), upstream API keys ([`credential`]), the
//! HTTP client ([`client`], hyper-util over rustls), the one SSE parser ([`sse`]), and the
//! response body on its way to the client ([`body`]: small wrappers of one concern each).
//! Retrying is not done here: [`crate::resilience::retry`] drives the attempts.

pub mod body;
mod client;
pub mod context;
pub mod continuation;
pub mod credential;
mod error;
pub mod keepalive;
pub mod pool;
pub mod queue;
pub mod sse;
pub mod stream_check;

pub use client::{ClientConfig, Transport, UpstreamClient, UpstreamIncoming};
pub use error::{BoxError, Sent, UpstreamError};
pub use pool::{placed, Endpoint, InflightGuard, Pick, Placement, Pool};

pub use body::{BodyEnd, BodyError, Held, OnEnd, Outcome, Reading, TimeLimits, UpstreamBody};
pub use sse::{is_event_stream, EventScan};
