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
    /// `x-quantrouter-reason` response header, when the router set one.
    pub reason: Option<HeaderValue>,
    /// The router moved the request to another profile (`x-quantrouter-fallback` present).
    pub fallback: bool,
    /// A 429 answer carried `Retry-After`.
    pub retry_after: bool,
}

// === impl Outcome ===

impl Outcome {
    /// A request that failed before any response header arrived.
    pub fn failed(origin: tokio::time::Instant, kind: ErrorKind) -> Self {
        Self {
            latency: origin.elapsed(),
            ttft: None,
            result: Err(kind),
            tier: None,
            profile: None,
            reason: None,
            fallback: false,
            retry_after: false,
        }
    }

    /// How the request ended, for the lost-request accounting.
    pub fn answer(&self) -> Answer {
        match self.result {
            Ok(()) => Answer::Ok,
            Err(kind) => kind.answer(),
        }
    }
}

/// Why a request did not count as ok; the label is the key in the results' `errors` map.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ErrorKind {
    /// A 429 answer (overload); counted apart from other 4xx because admission control is
    /// expected to produce it.
    Http429,
    /// A 4xx answer other than 429.
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
    /// An answer that is not well formed: an error status whose body is not an OpenAI error
    /// object, or (with answer checking on) a 200 whose body is not a completion.
    Malformed,
    /// The open-loop client already had its maximum of requests outstanding, so this one was
    /// dropped instead of sent.
    ClientOverflow,
}

// === impl ErrorKind ===

impl ErrorKind {
    /// Class of a non-success status.
    pub fn from_status(status: StatusCode) -> Self {
        if status == StatusCode::TOO_MANY_REQUESTS {
            Self::Http429
        } else if status.is_client_error() {
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
            Self::Http429 => "http_429",
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
            Self::Malformed => "malformed",
        }
    }

    /// Whether the client received one well-formed answer despite the failure: an error
    /// status with an OpenAI error body, or a stream that ended with an SSE error event.
    /// Everything else (no answer, a cut-off answer, garbage) is a lost request, except a
    /// client overflow, which was never sent.
    pub fn answer(self) -> Answer {
        match self {
            Self::Http429 | Self::Http4xx | Self::Http5xx | Self::HttpOther | Self::StreamError => {
                Answer::WellFormedError
            }
            Self::Connect
            | Self::Request
            | Self::Timeout
            | Self::Body
            | Self::StreamIncomplete
            | Self::Malformed => Answer::Lost,
            Self::ClientOverflow => Answer::NotSent,
        }
    }
}

/// How a request ended, for the lost-request accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// A 2xx answer read to the end.
    Ok,
    /// Exactly one well-formed error answer.
    WellFormedError,
    /// No well-formed answer.
    Lost,
    /// Never sent (client-side overflow).
    NotSent,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_map_to_their_class() {
        assert_eq!(
            ErrorKind::from_status(StatusCode::TOO_MANY_REQUESTS),
            ErrorKind::Http429
        );
        assert_eq!(
            ErrorKind::from_status(StatusCode::NOT_FOUND),
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

    #[test]
    fn only_missing_cut_off_or_garbled_answers_are_lost() {
        for kind in [
            ErrorKind::Http429,
            ErrorKind::Http4xx,
            ErrorKind::Http5xx,
            ErrorKind::HttpOther,
            ErrorKind::StreamError,
        ] {
            assert_eq!(kind.answer(), Answer::WellFormedError, "{kind:?}");
        }
        for kind in [
            ErrorKind::Connect,
            ErrorKind::Request,
            ErrorKind::Timeout,
            ErrorKind::Body,
            ErrorKind::StreamIncomplete,
            ErrorKind::Malformed,
        ] {
            assert_eq!(kind.answer(), Answer::Lost, "{kind:?}");
        }
        assert_eq!(ErrorKind::ClientOverflow.answer(), Answer::NotSent);
    }
}
