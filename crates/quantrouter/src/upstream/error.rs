//! How an upstream call fails before a response head, and whether the request may have
//! reached the upstream: what the retry rules read.

use std::time::Duration;

/// Whether a failed request may have reached the upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sent {
    /// No byte of it was written: no connection, or a connection that closed before it took
    /// the request. Sending it again cannot make the upstream work twice.
    No,
    /// Some or all of it may have been written: the upstream may be generating.
    Possibly,
}

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
