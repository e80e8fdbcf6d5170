//! One request, sent and timed.
//!
//! The client is hyper-util's pooled legacy client over a plain `HttpConnector`: client,
//! router and upstream share a few cores in the benchmarks, so per-request work is kept to
//! building a request around a pre-serialized body and walking the response frames.

use std::time::Duration;

use bytes::Bytes;
use http::header::{ACCEPT, CONTENT_TYPE};
use http::{HeaderValue, Method, Request, Uri};
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
}

/// A keep-alive pooled client with `TCP_NODELAY`.
pub fn build_client(connect_timeout: Duration) -> HttpClient {
    let mut connector = HttpConnector::new();
    // Small request bodies must not wait for Nagle's algorithm.
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(connect_timeout));
    Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(POOL_IDLE_TIMEOUT)
        .pool_max_idle_per_host(usize::MAX)
        .build(connector)
}

/// Sends one request and reads the answer to the end.
pub async fn send(client: &HttpClient, exchange: Exchange<'_>) -> Outcome {
    let origin = exchange.origin;
    let deadline = Instant::now() + exchange.timeout;
    match tokio::time::timeout_at(deadline, send_inner(client, exchange)).await {
        Ok(outcome) => outcome,
        Err(_elapsed) => Outcome {
            latency: origin.elapsed(),
            ttft: None,
            result: Err(ErrorKind::Timeout),
            tier: None,
            profile: None,
        },
    }
}

async fn send_inner(client: &HttpClient, exchange: Exchange<'_>) -> Outcome {
    let origin = exchange.origin;
    let failed = |kind| Outcome {
        latency: origin.elapsed(),
        ttft: None,
        result: Err(kind),
        tier: None,
        profile: None,
    };
    let accept = if exchange.stream {
        HeaderValue::from_static("text/event-stream")
    } else {
        HeaderValue::from_static("application/json")
    };
    let request = Request::builder()
        .method(Method::POST)
        .uri(exchange.uri.clone())
        .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
        .header(ACCEPT, accept)
        .body(Full::new(exchange.body));
    let Ok(request) = request else {
        return failed(ErrorKind::Request);
    };
    let response = match client.request(request).await {
        Ok(response) => response,
        Err(error) if error.is_connect() => return failed(ErrorKind::Connect),
        Err(_) => return failed(ErrorKind::Request),
    };
    let status = response.status();
    let tier = response.headers().get(TIER_HEADER).cloned();
    let profile = response.headers().get(PROFILE_HEADER).cloned();
    let read = read_body(response.into_body(), exchange.stream, origin).await;
    let result = if !status.is_success() {
        Err(ErrorKind::from_status(status))
    } else {
        read.result
    };
    Outcome {
        latency: origin.elapsed(),
        ttft: read.ttft,
        result,
        tier,
        profile,
    }
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
