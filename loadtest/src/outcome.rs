//! The result of one request, as the client saw it.

use std::time::Duration;

use http::{HeaderValue, StatusCode};

/// What happened to one request; timings are measured from its origin (the scheduled send
/// time in rate mode, the actual send time in concurrency mode).
#[derive(Debug, Clone)]
pub struct Outcome {
    /// Until the last body byte (or the failure).
    pub latency: Duration,
    /// Until the first body frame (non-streamed) or the first SSE chunk carrying content.
    pub ttft: Option<Duration>,
    /// `Ok` for a 2xx answer read to the end.
    pub result: Result<(), ErrorKind>,
    /// `x-quantrouter-tier` response header, when the router set one.
    pub tier: Option<HeaderValue>,
    /// `x-quantrouter-profile` response header, when the router set one.
    pub profile: Option<HeaderValue>,
}

/// Why a request did not count as ok; the label is the key in the results' `errors` map.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ErrorKind {
    /// A 4xx answer.
    Http4xx,
    /// A 5xx answer.
    Http5xx,
    /// Any other non-2xx answer (1xx, 3xx).
    HttpOther,
    /// The TCP connection could not be made.
    Connect,
    /// Sending the request or reading the response head failed after connecting.
    Request,
    /// No complete answer within the request timeout.
    Timeout,
    /// The response body broke off.
    Body,
    /// A stream sent an SSE error event.
    StreamError,
    /// A stream ended without `data: [DONE]`.
    StreamIncomplete,
    /// The open-loop client already had its maximum of requests outstanding, so this one was
    /// dropped instead of sent.
    ClientOverflow,
}

// === impl ErrorKind ===

impl ErrorKind {
    /// Class of a non-success status.
    pub fn from_status(status: StatusCode) -> Self {
        if status.is_client_error() {
            Self::Http4xx
        } else if status.is_server_error() {
            Self::Http5xx
        } else {
            Self::HttpOther
        }
    }

    /// Stable, low-cardinality label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Http4xx => "http_4xx",
            Self::Http5xx => "http_5xx",
            Self::HttpOther => "http_other",
            Self::Connect => "connect",
            Self::Request => "request",
            Self::Timeout => "timeout",
            Self::Body => "body",
            Self::StreamError => "stream_error",
            Self::StreamIncomplete => "stream_incomplete",
            Self::ClientOverflow => "client_overflow",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_map_to_their_class() {
        assert_eq!(
            ErrorKind::from_status(StatusCode::TOO_MANY_REQUESTS),
            ErrorKind::Http4xx
        );
        assert_eq!(
            ErrorKind::from_status(StatusCode::BAD_GATEWAY),
            ErrorKind::Http5xx
        );
        assert_eq!(
            ErrorKind::from_status(StatusCode::MOVED_PERMANENTLY),
            ErrorKind::HttpOther
        );
        assert_eq!(ErrorKind::ClientOverflow.as_str(), "client_overflow");
    }
}
