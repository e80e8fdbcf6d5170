//! Drives an in-process hyper server on loopback through the library entry point.
//!
//! Checks counts and the shape of the results, never wall-clock limits.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use loadtest::{run, Endpoint, LoadMode, Mode, RunConfig, TokenMix, Transport};
use tokio::net::TcpListener;

const COMPLETION: &str = r#"{"id":"cmpl-1","object":"chat.completion","created":0,"model":"sim-model","choices":[{"index":0,"message":{"role":"assistant","content":"Hello!"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}"#;

const STREAM: &str = concat!(
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hello\"}}]}\n\n",
    "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}\n\n",
    "data: [DONE]\n\n",
);

/// Answers every request, over HTTP/1.1 or h2c, with a fixed chat completion (or a fixed
/// stream when asked for one) and a tier header; counts the requests it received and the
/// connections it accepted.
async fn start_server() -> (SocketAddr, Arc<AtomicU64>, Arc<AtomicU64>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let received = Arc::new(AtomicU64::new(0));
    let accepted = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&received);
    let connections = Arc::clone(&accepted);
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            connections.fetch_add(1, Ordering::Relaxed);
            let counter = Arc::clone(&counter);
            tokio::spawn(async move {
                let service = service_fn(move |request: Request<Incoming>| {
                    let counter = Arc::clone(&counter);
                    async move {
                        counter.fetch_add(1, Ordering::Relaxed);
                        let body = request.into_body().collect().await.unwrap().to_bytes();
                        let value: serde_json::Value = serde_json::from_slice(&body).unwrap();
                        let (content_type, text) = if value["stream"] == true {
                            ("text/event-stream", STREAM)
                        } else {
                            ("application/json", COMPLETION)
                        };
                        Ok::<_, Infallible>(
                            Response::builder()
                                .header("content-type", content_type)
                                .header("x-quantrouter-tier", "fp16")
                                .header("x-quantrouter-profile", "sim")
                                .body(Full::new(Bytes::from_static(text.as_bytes())))
                                .unwrap(),
                        )
                    }
                });
                let _ = auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (addr, received, accepted)
}

fn config(addr: SocketAddr, mode: LoadMode) -> RunConfig {
    RunConfig {
        url: format!("http://{addr}"),
        mode,
        duration: Duration::from_millis(500),
        warmup: Duration::ZERO,
        prompts: vec!["Say hello.".to_owned(), "Add 2 and 2.".to_owned()],
        stream_share: 0.0,
        max_tokens: TokenMix::fixed(16),
        check_answers: true,
        ignore_eos: false,
        model: "sim-model".to_owned(),
        endpoint: Endpoint::Chat,
        label: "local".to_owned(),
        max_outstanding: 10_000,
        request_timeout: Duration::from_secs(10),
        connect_timeout: Duration::from_secs(5),
        transport: Transport::Http1,
        api_key: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_run_sends_exactly_the_scheduled_requests() {
    let (addr, received, _) = start_server().await;
    let report = run(&config(addr, LoadMode::Rate(100.0))).await.unwrap();

    assert_eq!(report.mode, Mode::Rate);
    assert_eq!(report.rate, Some(100.0));
    // 100 req/s × 0.5 s: the schedule, not the clock, fixes the count.
    assert_eq!(report.requests, 50);
    assert_eq!(report.ok, 50, "errors: {:?}", report.errors);
    assert!(report.errors.is_empty());
    assert_eq!(received.load(Ordering::Relaxed), 50);
    assert_eq!(report.tiers.get("fp16"), Some(&50));
    assert_eq!(report.profiles.get("sim"), Some(&50));
    assert_eq!(report.latency_us.count, 50);
    assert!(report.latency_us.p50 > 0);
    assert!(report.latency_us.p50 <= report.latency_us.p99);
    assert!(report.latency_us.p99 <= report.latency_us.max);
    assert!(report.ttft_us.p50 <= report.latency_us.max);
    assert!(report.throughput_rps > 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warmup_requests_are_sent_but_not_counted() {
    let (addr, received, _) = start_server().await;
    let mut config = config(addr, LoadMode::Rate(100.0));
    config.warmup = Duration::from_millis(200);
    config.duration = Duration::from_millis(300);
    let report = run(&config).await.unwrap();
    assert_eq!(report.requests, 30);
    assert_eq!(report.ok, 30);
    assert_eq!(received.load(Ordering::Relaxed), 50);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_run_completes_every_request() {
    let (addr, received, _) = start_server().await;
    let report = run(&config(addr, LoadMode::Concurrency(4))).await.unwrap();

    assert_eq!(report.mode, Mode::Concurrency);
    assert_eq!(report.concurrency, Some(4));
    assert!(report.requests >= 4, "{report:?}");
    assert_eq!(report.ok, report.requests, "errors: {:?}", report.errors);
    assert_eq!(received.load(Ordering::Relaxed), report.requests);
    assert_eq!(report.latency_us.count, report.ok);
    assert!(report.latency_us.p50 > 0);
    assert!(report.throughput_rps > 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_requests_record_time_to_first_token() {
    let (addr, _, _) = start_server().await;
    let mut config = config(addr, LoadMode::Rate(100.0));
    config.stream_share = 1.0;
    config.duration = Duration::from_millis(200);
    let report = run(&config).await.unwrap();
    assert_eq!(report.requests, 20);
    assert_eq!(report.ok, 20, "errors: {:?}", report.errors);
    assert_eq!(report.ttft_us.count, 20);
    assert!(report.ttft_us.p50 <= report.latency_us.max);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_spreads_streams_over_the_connections_asked_for() {
    let (addr, received, accepted) = start_server().await;
    let mut config = config(addr, LoadMode::Concurrency(12));
    config.stream_share = 0.5;
    config.transport = Transport::Http2 { connections: 3 };
    let report = run(&config).await.unwrap();

    assert!(report.requests >= 12, "{report:?}");
    assert_eq!(report.ok, report.requests, "errors: {:?}", report.errors);
    assert_eq!(received.load(Ordering::Relaxed), report.requests);
    assert!(report.ttft_us.count > 0, "{report:?}");
    // Twelve streams in flight at a time, multiplexed: HTTP/1.1 would have needed twelve.
    assert_eq!(accepted.load(Ordering::Relaxed), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_server_counts_connect_errors() {
    // Bind then drop to get a port nobody listens on.
    let addr = {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        listener.local_addr().unwrap()
    };
    let mut config = config(addr, LoadMode::Rate(50.0));
    config.duration = Duration::from_millis(100);
    let report = run(&config).await.unwrap();
    assert_eq!(report.requests, 5);
    assert_eq!(report.ok, 0);
    assert_eq!(report.errors.get("connect"), Some(&5));
    assert_eq!(report.throughput_rps, 0.0);
}

/// Answers in a cycle of four: a 429 OpenAI error with `Retry-After`, a 503 whose body is not
/// an OpenAI error, a completion, and a 200 whose body is not a completion.
async fn start_cycling_server() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let next = Arc::new(AtomicU64::new(0));
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let next = Arc::clone(&next);
            tokio::spawn(async move {
                let service = service_fn(move |request: Request<Incoming>| {
                    let turn = next.fetch_add(1, Ordering::Relaxed) % 4;
                    async move {
                        let _ = request.into_body().collect().await;
                        let builder = Response::builder().header("x-quantrouter-tier", "int4");
                        let response = match turn {
                            0 => builder
                                .status(429)
                                .header("retry-after", "1")
                                .body(r#"{"error":{"message":"busy","type":"rate_limit_error"}}"#),
                            1 => builder.status(503).body("upstream connect error"),
                            2 => builder.body(COMPLETION),
                            _ => builder.body("<html>"),
                        };
                        Ok::<_, Infallible>(response.unwrap().map(|b| Full::new(Bytes::from(b))))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_are_classified_as_ok_well_formed_errors_or_lost() {
    let addr = start_cycling_server().await;
    // One worker, so the server's cycle lines up with the requests.
    let mut config = config(addr, LoadMode::Concurrency(1));
    config.duration = Duration::from_millis(300);
    let report = run(&config).await.unwrap();
    let a = report.accounting;
    assert!(a.sent >= 8, "{a:?}");
    assert_eq!(a.sent, a.ok + a.well_formed_errors + a.lost, "{a:?}");
    // Per cycle: one ok, one 429 (well formed), two lost (garbage 503, garbage 200).
    let cycles = a.sent / 4;
    assert!(a.ok >= cycles && a.ok <= cycles + 1, "{a:?}");
    assert!(a.lost >= 2 * cycles, "{a:?}");
    assert_eq!(report.retry_after_429, a.well_formed_errors, "{report:?}");
    assert_eq!(report.errors.get("http_429"), Some(&a.well_formed_errors));
    assert_eq!(report.errors.get("malformed"), Some(&a.lost));
    assert_eq!(report.tiers.get("int4"), Some(&a.sent));
    assert_eq!(report.per_tier["int4"].latency_us.count, a.ok);
}
