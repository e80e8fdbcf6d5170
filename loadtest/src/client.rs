//! One request, sent and timed.
//!
//! The client is hyper-util's pooled legacy client over a plain `HttpConnector`: client,
//! router and upstream share a few cores in the benchmarks, so per-request work is kept to
//! building a request around a pre-serialized body and walking the response frames.

use std::time::Duration;

use bytes::Bytes;
use http::header::{ACCEPT, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderValue, Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tokio::time::Instant;

use crate::outcome::{ErrorKind, Outcome};
use crate::sse::SseScanner;

/// The pooled HTTP/1 client.
pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// Router response header naming the chosen tier.
pub const TIER_HEADER: &str = "x-quantrouter-tier";
/// Router response header naming the chosen profile.
pub const PROFILE_HEADER: &str = "x-quantrouter-profile";
/// Router response header with the reason for the decision.
pub const REASON_HEADER: &str = "x-quantrouter-reason";
/// Router response header present when the request moved to another profile.
pub const FALLBACK_HEADER: &str = "x-quantrouter-fallback";

/// Error and checked bodies are read up to this size; an OpenAI error or a short completion
/// is far smaller, and a bound keeps a misbehaving server from filling the client's memory.
const CHECKED_BODY_LIMIT: usize = 1 << 20;

/// Idle keep-alive connections are closed after this long; longer than any gap in a run, so
/// the pool never reconnects mid-run.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// One request to send.
#[derive(Debug, Clone)]
pub struct Exchange<'a> {
    /// Full URL including the API path.
    pub uri: &'a Uri,
    /// Pre-serialized JSON body.
    pub body: Bytes,
    /// Whether the body asks for a stream (decides how TTFT is found).
    pub stream: bool,
    /// Where latency is measured from.
    pub origin: Instant,
    /// The whole exchange, from the actual send, must finish within this.
    pub timeout: Duration,
    /// Check that a non-streamed 200 body is a completion (error bodies are always checked).
    pub check_answers: bool,
    /// `Authorization` value, if the server wants a key.
    pub authorization: Option<&'a HeaderValue>,
}

/// How requests reach the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// HTTP/1.1 keep-alive: one connection per request in flight.
    Http1,
    /// HTTP/2 with prior knowledge (h2c), requests spread over this many connections.
    Http2 {
        /// Connections, each carrying its share of the streams.
        connections: usize,
    },
}

/// The clients requests are spread over: one pooled HTTP/1 client, or one HTTP/2 client
/// (one multiplexed connection) per connection asked for.
pub fn build_clients(transport: Transport, connect_timeout: Duration) -> Vec<HttpClient> {
    match transport {
        Transport::Http1 => vec![build_client(connect_timeout, false)],
        Transport::Http2 { connections } => (0..connections.max(1))
            .map(|_| build_client(connect_timeout, true))
            .collect(),
    }
}

/// A keep-alive pooled client with `TCP_NODELAY`.
fn build_client(connect_timeout: Duration, http2: bool) -> HttpClient {
    let mut connector = HttpConnector::new();
    // Small request bodies must not wait for Nagle's algorithm.
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(connect_timeout));
    Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(POOL_IDLE_TIMEOUT)
        .pool_max_idle_per_host(usize::MAX)
        .http2_only(http2)
        .build(connector)
}

/// Sends one request and reads the answer to the end.
pub async fn send(client: &HttpClient, exchange: Exchange<'_>) -> Outcome {
    let origin = exchange.origin;
    let deadline = Instant::now() + exchange.timeout;
    match tokio::time::timeout_at(deadline, send_inner(client, exchange)).await {
        Ok(outcome) => outcome,
        Err(_elapsed) => Outcome::failed(origin, ErrorKind::Timeout),
    }
}

async fn send_inner(client: &HttpClient, exchange: Exchange<'_>) -> Outcome {
    let origin = exchange.origin;
    let failed = |kind| Outcome::failed(origin, kind);
    let accept = if exchange.stream {
        HeaderValue::from_static("text/event-stream")
    } else {
        HeaderValue::from_static("application/json")
    };
    let mut request = Request::builder()
        .method(Method::POST)
        .uri(exchange.uri.clone())
        .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
        .header(ACCEPT, accept);
    if let Some(authorization) = exchange.authorization {
        request = request.header(http::header::AUTHORIZATION, authorization.clone());
    }
    let request = request.body(Full::new(exchange.body));
    let Ok(request) = request else {
        return failed(ErrorKind::Request);
    };
    let response = match client.request(request).await {
        Ok(response) => response,
        Err(error) if error.is_connect() => return failed(ErrorKind::Connect),
        Err(_) => return failed(ErrorKind::Request),
    };
    let status = response.status();
    let headers = response.headers();
    let tier = headers.get(TIER_HEADER).cloned();
    let profile = headers.get(PROFILE_HEADER).cloned();
    let reason = headers.get(REASON_HEADER).cloned();
    let fallback = headers.contains_key(FALLBACK_HEADER);
    let retry_after = status == StatusCode::TOO_MANY_REQUESTS && headers.contains_key(RETRY_AFTER);
    let body = response.into_body();
    let (ttft, result) = if !status.is_success() {
        // An error answer counts as answered only when it is an OpenAI error object.
        let result = match read_checked(body).await {
            Some(bytes) if is_openai_error(&bytes) => Err(ErrorKind::from_status(status)),
            _ => Err(ErrorKind::Malformed),
        };
        (None, result)
    } else if exchange.check_answers && !exchange.stream {
        match read_checked(body).await {
            Some(bytes) if is_completion(&bytes) => (Some(origin.elapsed()), Ok(())),
            Some(_) => (None, Err(ErrorKind::Malformed)),
            None => (None, Err(ErrorKind::Body)),
        }
    } else {
        let read = read_body(body, exchange.stream, origin).await;
        (read.ttft, read.result)
    };
    Outcome {
        latency: origin.elapsed(),
        ttft,
        result,
        tier,
        profile,
        reason,
        fallback,
        retry_after,
    }
}

/// The whole body up to [`CHECKED_BODY_LIMIT`], or `None` when it broke off or is larger.
async fn read_checked(body: hyper::body::Incoming) -> Option<Bytes> {
    let limited = http_body_util::Limited::new(body, CHECKED_BODY_LIMIT);
    limited
        .collect()
        .await
        .ok()
        .map(|collected| collected.to_bytes())
}

/// An OpenAI error body: `{"error": {"message": "...", ...}}`.
pub fn is_openai_error(body: &[u8]) -> bool {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(body) else {
        return false;
    };
    value
        .get("error")
        .and_then(|error| error.get("message"))
        .is_some_and(serde_json::Value::is_string)
}

/// A non-streamed completion body: a JSON object with a non-empty `choices` array.
pub fn is_completion(body: &[u8]) -> bool {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(body) else {
        return false;
    };
    value
        .get("choices")
        .and_then(serde_json::Value::as_array)
        .is_some_and(|choices| !choices.is_empty())
}

struct BodyRead {
    ttft: Option<Duration>,
    result: Result<(), ErrorKind>,
}

/// Drains the body (also for error statuses, so the connection goes back to the pool),
/// noting the time to first token.
async fn read_body(mut body: hyper::body::Incoming, stream: bool, origin: Instant) -> BodyRead {
    let mut ttft = None;
    let mut scanner = stream.then(SseScanner::default);
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else {
            return BodyRead {
                ttft,
                result: Err(ErrorKind::Body),
            };
        };
        let Ok(data) = frame.into_data() else {
            continue; // trailers
        };
        if ttft.is_some() && scanner.is_none() {
            continue;
        }
        match scanner.as_mut() {
            None if !data.is_empty() => ttft = Some(origin.elapsed()),
            None => {}
            Some(scanner) => {
                scanner.feed(&data);
                if ttft.is_none() && scanner.content_seen() {
                    ttft = Some(origin.elapsed());
                }
            }
        }
    }
    let result = match scanner {
        Some(scanner) if scanner.error_seen() => Err(ErrorKind::StreamError),
        Some(scanner) if !scanner.done_seen() => Err(ErrorKind::StreamIncomplete),
        _ => Ok(()),
    };
    BodyRead { ttft, result }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_errors_need_an_error_object_with_a_message() {
        assert!(is_openai_error(
            br#"{"error":{"message":"slow down","type":"rate_limit_error","code":"tier_overloaded"}}"#
        ));
        assert!(!is_openai_error(b"upstream connect error"));
        assert!(!is_openai_error(br#"{"detail":"Not Found"}"#));
        assert!(!is_openai_error(br#"{"error":"plain string"}"#));
    }

    #[test]
    fn completions_need_choices() {
        assert!(is_completion(
            br#"{"id":"x","choices":[{"index":0,"message":{"role":"assistant","content":"hi"}}]}"#
        ));
        assert!(!is_completion(br#"{"id":"x","choices":[]}"#));
        assert!(!is_completion(b"{\"id\":"));
    }
}
