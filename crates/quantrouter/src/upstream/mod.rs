//! Upstream vLLM servers: a [`Pool`] of endpoints per profile, what the probes
//! ([`crate::probes`]) found on them ([`queue`]), upstream API keys ([`credential`]), the
//! HTTP client ([`client`], hyper-util over rustls), the one SSE parser ([`sse`]), and the
//! response body on its way to the client ([`body`]: small wrappers of one concern each).
//! Retrying is not done here: [`crate::resilience::retry`] drives the attempts.

pub mod body;
mod client;
pub mod context;
pub mod credential;
pub mod keepalive;
pub mod pool;
pub mod queue;
pub mod sse;
pub mod stream_check;

use std::time::Duration;

pub use client::{ClientConfig, Sent, Transport, UpstreamClient, UpstreamIncoming};
pub use pool::{placed, Endpoint, InflightGuard, Pick, Placement, Pool};

pub use body::{BodyEnd, BodyError, Held, OnEnd, Outcome, Reading, TimeLimits, UpstreamBody};
pub use sse::{is_event_stream, EventScan};

/// The cause of a failed exchange, as the client library reported it.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why an upstream call failed before a response head arrived.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("invalid upstream URL {0}")]
    InvalidUrl(String),
    /// No connection: refused, unreachable, timed out, or its TLS handshake failed.
    #[error("connecting to {endpoint}: {source}")]
    Connect { endpoint: String, source: BoxError },
    /// The upstream did not take the request: a kept-alive connection closed before it was
    /// written, or an HTTP/2 server refused its stream or went away before it (RFC 9113
    /// §8.7: never processed).
    #[error("{endpoint} did not take the request: {source}")]
    Unsent { endpoint: String, source: BoxError },
    /// The connection failed after the request (or part of it) was written, before a
    /// response head.
    #[error("{endpoint} failed before a response head: {source}")]
    Exchange { endpoint: String, source: BoxError },
    /// The upstream answered, but not with a valid HTTP response head.
    #[error("{endpoint} answered with an invalid response: {source}")]
    InvalidResponse { endpoint: String, source: BoxError },
    #[error("{endpoint} sent no response headers within {timeout:?}")]
    HeaderTimeout { endpoint: String, timeout: Duration },
}

impl UpstreamError {
    /// Whether the request may have reached the upstream.
    pub fn sent(&self) -> Sent {
        match self {
            Self::InvalidUrl(_) | Self::Connect { .. } | Self::Unsent { .. } => Sent::No,
            // The timeout may have struck while connecting, but nobody can tell: assume the
            // upstream has the request.
            Self::Exchange { .. } | Self::InvalidResponse { .. } | Self::HeaderTimeout { .. } => {
                Sent::Possibly
            }
        }
    }
}
