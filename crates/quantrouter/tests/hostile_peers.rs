//! Peers that misbehave, over real sockets: clients that send absurd headers, trickle heads
//! and bodies, never read their streams or open more connections than the router has
//! descriptors; upstreams that break HTTP/1.1 framing or send bytes nobody asked for; and
//! shutdown with such connections open.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use http_body_util::BodyExt as _;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use quantrouter_policy::{ProfileSet, StaticUpstream, Upstream, DEFAULT_PROFILE_SET};
use support::{chat, eventually, loopback, send, start_router, Harness, Tiers, SIMPLE};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use vllm_sim::SimConfig;

const JSON: (&str, &str) = ("content-type", "application/json");
/// Index of the int4 profile in the embedded set.
const INT4: usize = 2;
/// The profile every request below is pinned to (pinned answers are never re-checked).
const PINNED: &str = "llama8b-fp16";
const ANSWER: &str = r#"{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}]}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_range_header_numbers_are_a_400_over_http1_and_http2() {
    let h = Harness::start().await;
    let h2 = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build(HttpConnector::new());
    let url = h.url("/v1/chat/completions");
    let body = chat("auto", SIMPLE);
    for (client, protocol) in [(&h.client, "HTTP/1.1"), (&h2, "h2c")] {
        for (header, value) in [
            ("x-quantrouter-timeout-ms", "1e22"),
            ("x-quantrouter-timeout-ms", "1e30"),
            ("x-quantrouter-timeout-ms", "1e308"),
            ("x-quantrouter-timeout-ms", "86400001"),
            ("x-quantrouter-timeout-ms", "0"),
            ("x-quantrouter-latency-budget-ms", "1e30"),
        ] {
            let r = send(client, "POST", &url, &body, &[JSON, (header, value)]).await;
            let case = format!("{protocol} {header}: {value}");
            assert_eq!(r.status, StatusCode::BAD_REQUEST, "{case}");
            let error = &r.json()["error"];
            assert_eq!(error["type"], "invalid_request_error", "{case}");
            assert_eq!(error["param"], header, "{case}");
        }
        // The largest deadline allowed is served.
        let r = send(
            client,
            "POST",
            &url,
            &body,
            &[JSON, ("x-quantrouter-timeout-ms", "86400000")],
        )
        .await;
        assert_eq!(r.status, StatusCode::OK, "{protocol}");
    }
}

/// A router whose every profile sends to `upstream`.
async fn router_before(upstream: &str) -> quantrouter::server::Server {
    let mut set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
    for profile in &mut set.profiles {
        profile.upstream = Upstream::Static(StaticUpstream::new(vec![upstream.to_owned()]));
    }
    start_router(set, |_| {}).await
}

/// An upstream over a real socket: `script(n, stream)` runs each accepted connection.
async fn scripted<F, Fut>(script: F) -> String
where
    F: Fn(usize, TcpStream) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind(loopback()).await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        for n in 0.. {
            let (stream, _) = listener.accept().await.unwrap();
            // Like a real server's: with Nagle, a second small write waits for the router's
            // ACK of the first, and arrives after whatever the test sends next.
            stream.set_nodelay(true).unwrap();
            tokio::spawn(script(n, stream));
        }
    });
    url
}

/// Reads requests off `stream`, answering the router's `/metrics` scrapes with an empty
/// 200, until a POST: true then, false at the end of the connection.
async fn next_post(stream: &mut TcpStream) -> bool {
    let mut buf = Vec::new();
    loop {
        let head_end = loop {
            if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break end + 4;
            }
            let mut chunk = [0u8; 4096];
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .map_or(0, |v| v.trim().parse().unwrap());
        while buf.len() < head_end + length {
            let mut chunk = [0u8; 4096];
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        buf.drain(..head_end + length);
        if head.starts_with("post ") {
            return true;
        }
        let empty = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
        if stream.write_all(empty).await.is_err() {
            return false;
        }
    }
}

fn answer(extra_headers: &str, body: &str) -> String {
    format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{extra_headers}\r\n{body}",
        body.len()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_answer_with_a_content_length_reaches_the_client_whole() {
    let upstream = scripted(|_, mut stream| async move {
        while next_post(&mut stream).await {
            let chunked = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\ncontent-length: 7\r\n\r\n{:x}\r\n{ANSWER}\r\n0\r\n\r\n",
                ANSWER.len()
            );
            stream.write_all(chunked.as_bytes()).await.unwrap();
        }
    })
    .await;
    let router = router_before(&upstream).await;
    let url = format!("http://{}/v1/chat/completions", router.public_addr());
    for _ in 0..2 {
        let r = send(
            &support::client(),
            "POST",
            &url,
            &chat(PINNED, SIMPLE),
            &[JSON],
        )
        .await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(std::str::from_utf8(&r.body).unwrap(), ANSWER);
        let length = r.header("content-length");
        assert!(
            length.is_empty() || length == ANSWER.len().to_string(),
            "the stale content-length was passed on: {length}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_the_upstream_connection_header_names_are_not_forwarded() {
    let upstream = scripted(|_, mut stream| async move {
        while next_post(&mut stream).await {
            let headers = "connection: keep-alive, x-upstream-hop\r\nx-upstream-hop: secret\r\nx-upstream-end: kept\r\n";
            stream
                .write_all(answer(headers, ANSWER).as_bytes())
                .await
                .unwrap();
        }
    })
    .await;
    let router = router_before(&upstream).await;
    let url = format!("http://{}/v1/chat/completions", router.public_addr());
    let r = send(
        &support::client(),
        "POST",
        &url,
        &chat(PINNED, SIMPLE),
        &[JSON],
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("x-upstream-hop"), "", "a hop-by-hop header leaked");
    assert_eq!(r.header("x-upstream-end"), "kept");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_an_upstream_sends_after_its_answer_never_answer_the_next_request() {
    const INJECTED: &str = r#"{"injected":true}"#;
    // The connection of the first completion answers it, then, when told, sends a second
    // answer nobody asked for and never answers again. Every other connection answers.
    let posts = Arc::new(AtomicUsize::new(0));
    let (inject, injected) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let script = (Arc::clone(&inject), Arc::clone(&injected));
    let upstream = scripted(move |_, mut stream| {
        let (posts, (inject, injected)) = (Arc::clone(&posts), script.clone());
        async move {
            while next_post(&mut stream).await {
                stream
                    .write_all(answer("", ANSWER).as_bytes())
                    .await
                    .unwrap();
                if posts.fetch_add(1, Ordering::SeqCst) == 0 {
                    inject.notified().await;
                    let extra = answer("", INJECTED);
                    stream.write_all(extra.as_bytes()).await.unwrap();
                    injected.notify_one();
                    let _ = stream.read_to_end(&mut Vec::new()).await;
                    return;
                }
            }
        }
    })
    .await;
    let router = router_before(&upstream).await;
    let url = format!("http://{}/v1/chat/completions", router.public_addr());
    let client = support::client();
    let r = send(&client, "POST", &url, &chat(PINNED, SIMPLE), &[JSON]).await;
    assert_eq!(std::str::from_utf8(&r.body).unwrap(), ANSWER);
    // The answer is complete, so its connection is idle in the router's pool; now the
    // upstream sends more on it.
    inject.notify_one();
    injected.notified().await;
    let r = send(&client, "POST", &url, &chat(PINNED, SIMPLE), &[JSON]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(
        std::str::from_utf8(&r.body).unwrap(),
        ANSWER,
        "the next request got the bytes sent after the previous answer"
    );
}

/// Reads from a raw client connection until the router closes it (EOF or reset); the bytes
/// read. Panics if it is still open after `deadline`.
async fn read_until_closed(stream: &mut TcpStream, deadline: Duration) -> Vec<u8> {
    let mut seen = Vec::new();
    let read = tokio::time::timeout(deadline, async {
        let mut chunk = [0u8; 4096];
        loop {
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => seen.extend_from_slice(&chunk[..n]),
            }
        }
    });
    assert!(read.await.is_ok(), "the router kept the connection open");
    seen
}

/// The connection is open and has nothing to read (asked of the kernel, not of tokio's
/// cached readiness).
fn is_open_and_quiet(stream: &TcpStream) -> bool {
    use rustix::net::RecvFlags;
    let mut probe = [0u8; 1];
    let peeked = rustix::net::recv(stream, &mut probe, RecvFlags::PEEK | RecvFlags::DONTWAIT);
    matches!(peeked, Err(e) if e == rustix::io::Errno::AGAIN)
}

/// Reads one whole response with a Content-Length body off a raw connection.
async fn read_response(stream: &mut TcpStream) -> String {
    let mut seen = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&seen).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length: usize = head
                .to_ascii_lowercase()
                .lines()
                .find_map(|l| {
                    l.strip_prefix("content-length:")
                        .map(|v| v.trim().parse().unwrap())
                })
                .unwrap();
            if body.len() >= length {
                return text;
            }
        }
        let n = stream.read(&mut chunk).await.unwrap();
        assert!(n > 0, "closed mid-response: {text}");
        seen.extend_from_slice(&chunk[..n]);
    }
}

fn request_head(path: &str, body_len: usize, extra: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\ncontent-length: {body_len}\r\n{extra}\r\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_sent_byte_by_byte_is_cut_at_the_header_timeout_but_idle_connections_stay() {
    let h = Harness::start_with(Duration::ZERO, |c| {
        c.client_header_timeout = Duration::from_millis(300);
    })
    .await;
    let addr = h.router.public_addr();
    // Idle connections are not timed: one fresh, one kept alive after a request.
    let fresh = TcpStream::connect(addr).await.unwrap();
    let mut kept = TcpStream::connect(addr).await.unwrap();
    let body = chat("auto", SIMPLE);
    let request = format!(
        "{}{body}",
        request_head("/v1/chat/completions", body.len(), "")
    );
    kept.write_all(request.as_bytes()).await.unwrap();
    assert!(read_response(&mut kept).await.starts_with("HTTP/1.1 200"));

    // One byte of the head every 20 ms: the head would take seconds, the timeout is 300 ms.
    let mut slow = TcpStream::connect(addr).await.unwrap();
    let head = request_head(
        "/v1/chat/completions",
        body.len(),
        "x-padding: 0123456789abcdef0123456789abcdef\r\n",
    );
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    let mut sent = 0;
    let mut byte = [0u8; 1];
    let cut = loop {
        tokio::select! {
            _ = tick.tick() => {
                if sent == head.len() {
                    break false;
                }
                if slow.write_all(&head.as_bytes()[sent..=sent]).await.is_err() {
                    break true;
                }
                sent += 1;
            }
            read = slow.read(&mut byte) => {
                assert!(!matches!(read, Ok(n) if n > 0), "an answer to half a head");
                break true;
            }
        }
    };
    assert!(
        cut,
        "the whole head ({sent} bytes) went out without the connection closing"
    );
    assert!(
        is_open_and_quiet(&fresh),
        "a fresh idle connection was closed"
    );
    assert!(
        is_open_and_quiet(&kept),
        "a kept-alive idle connection was closed"
    );
    kept.write_all(request.as_bytes()).await.unwrap();
    let answer = read_response(&mut kept).await;
    assert!(
        answer.starts_with("HTTP/1.1 200"),
        "the kept-alive connection serves: {answer}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_stops_arriving_gets_a_400_at_the_body_timeout() {
    let h = Harness::start_with(Duration::ZERO, |c| {
        c.client_body_timeout = Duration::from_millis(300);
    })
    .await;
    let mut stream = TcpStream::connect(h.router.public_addr()).await.unwrap();
    let body = chat("auto", SIMPLE);
    let head = request_head("/v1/chat/completions", body.len(), "");
    // The head and a third of the body, then nothing.
    stream.write_all(head.as_bytes()).await.unwrap();
    stream
        .write_all(&body.as_bytes()[..body.len() / 3])
        .await
        .unwrap();
    let answer = read_until_closed(&mut stream, Duration::from_secs(10)).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("\"invalid_request_error\""), "{answer}");
    assert_eq!(h.sim("int4").stats().requests, 0);
}

/// A streamed chat request pinned to int4 that runs for a million tokens.
fn endless_stream() -> String {
    serde_json::json!({"model": "llama8b-awq", "stream": true, "max_tokens": 1_000_000,
        "ignore_eos": true, "messages": [{"role": "user", "content": SIMPLE}]})
    .to_string()
}

/// A router with one admission slot on int4 (none waiting long) and the given idle timeout,
/// over simulators that generate as fast as they can.
async fn one_int4_slot(idle: Duration) -> Tiers {
    Tiers::start(
        [1, 1, 1],
        |_| SimConfig::default(),
        |set| set.profiles[INT4].max_concurrency = 1,
        |c| {
            c.resilience.admission.queue_timeout = Duration::from_millis(100);
            c.resilience.idle_timeout = idle;
        },
    )
    .await
}

/// Posts pinned int4 requests until one is admitted; false if none is within 15 s.
async fn int4_admits_again(t: &Tiers) -> bool {
    let pinned = chat("llama8b-awq", SIMPLE);
    eventually(Duration::from_secs(15), || async {
        t.post(&pinned, &[]).await.status == StatusCode::OK
    })
    .await
}

/// The client's side of the idle timeout: writes the client leaves blocked that long close
/// its connection, which ends the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http1_client_that_never_reads_its_stream_loses_it_and_its_slot() {
    let t = one_int4_slot(Duration::from_secs(1)).await;
    // A client with a small receive window that never reads: the router's buffers fill and
    // its writes block (the kernel may grow its send buffer once or twice first).
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stalled = socket.connect(t.router.public_addr()).await.unwrap();
    let body = endless_stream();
    let head = request_head("/v1/chat/completions", body.len(), "");
    stalled
        .write_all(format!("{head}{body}").as_bytes())
        .await
        .unwrap();
    let pool = || t.router.app.store.load().runtime[INT4].pool.inflight();
    assert!(eventually(Duration::from_secs(5), || async { pool() == 1 }).await);
    // While its connection is open the stream holds the tier's only slot.
    let r = t.post(&chat("llama8b-awq", SIMPLE), &[]).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);

    assert!(
        int4_admits_again(&t).await,
        "the stalled stream kept the slot"
    );
    assert!(
        eventually(Duration::from_secs(5), || async {
            t.sims[INT4][0].stats().cancelled >= 1
        })
        .await,
        "the stalled stream's upstream request was not cancelled"
    );
    read_until_closed(&mut stalled, Duration::from_secs(10)).await;
}

/// A stream the client leaves unread past its deadline ends then, whatever blocks it: here
/// HTTP/2 flow control, while the connection itself stays healthy and serves other streams.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_stream_its_client_never_reads_frees_the_slot_at_the_deadline() {
    let t = one_int4_slot(Duration::from_secs(30)).await;
    // A small stream window, never released: the router's stream stalls on flow control.
    let h2 = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .http2_initial_stream_window_size(16 * 1024)
        .build(HttpConnector::new());
    let url = format!("http://{}/v1/chat/completions", t.router.public_addr());
    let request = http::Request::post(&url)
        .header("content-type", "application/json")
        .header("x-quantrouter-timeout-ms", "2000")
        .body(http_body_util::Full::new(bytes::Bytes::from(
            endless_stream(),
        )))
        .unwrap();
    let stalled = h2.request(request).await.unwrap();
    assert_eq!(stalled.status(), StatusCode::OK);
    let r = send(&h2, "POST", &url, &chat("llama8b-awq", SIMPLE), &[JSON]).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);

    assert!(
        int4_admits_again(&t).await,
        "the stalled stream kept the slot past its deadline"
    );
    // The same connection serves other streams meanwhile.
    let r = send(&h2, "POST", &url, &chat("auto", SIMPLE), &[JSON]).await;
    assert_eq!(r.status, StatusCode::OK);
    drop(stalled);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_closes_idle_and_half_sent_connections_at_once() {
    // Long enough that waiting on any of them would be plain.
    let long = Duration::from_secs(120);
    let h = Harness::start_with(Duration::ZERO, |c| {
        c.shutdown_grace = long;
        c.client_header_timeout = long;
    })
    .await;
    let addr = h.router.public_addr();
    let body = chat("auto", SIMPLE);
    let mut half = TcpStream::connect(addr).await.unwrap();
    let head = request_head("/v1/chat/completions", body.len(), "");
    half.write_all(&head.as_bytes()[..head.len() / 2])
        .await
        .unwrap();
    let mut fresh = TcpStream::connect(addr).await.unwrap();
    let mut kept = TcpStream::connect(addr).await.unwrap();
    kept.write_all(format!("{head}{body}").as_bytes())
        .await
        .unwrap();
    assert!(read_response(&mut kept).await.starts_with("HTTP/1.1 200"));
    let h2 = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build(HttpConnector::new());
    let r = send(&h2, "POST", &h.url("/v1/chat/completions"), &body, &[JSON]).await;
    assert_eq!(r.status, StatusCode::OK);

    let Harness { router, sims, .. } = h;
    let stopping = tokio::spawn(router.shutdown());
    tokio::time::timeout(Duration::from_secs(30), stopping)
        .await
        .expect("shutdown waited on connections with no request in flight")
        .unwrap();
    for conn in [&mut half, &mut fresh, &mut kept] {
        read_until_closed(conn, Duration::from_secs(5)).await;
    }
    drop(sims);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_still_open_when_the_grace_ends_gets_an_error_event_before_the_close() {
    let h = Harness::start_with(Duration::from_millis(100), |c| {
        c.shutdown_grace = Duration::from_millis(300);
    })
    .await;
    // A hundred seconds of tokens.
    let long = serde_json::json!({"model": "auto", "stream": true, "max_tokens": 1000,
        "ignore_eos": true, "messages": [{"role": "user", "content": SIMPLE}]});
    let response = h.open("/v1/chat/completions", &long.to_string()).await;
    assert_eq!(response.status(), StatusCode::OK);
    let Harness { router, sims, .. } = h;
    let stopping = tokio::spawn(router.shutdown());
    let body = tokio::time::timeout(Duration::from_secs(10), response.into_body().collect())
        .await
        .expect("the stream outlived the grace")
        .expect("the stream was cut without ending");
    let text = String::from_utf8_lossy(&body.to_bytes()).into_owned();
    assert!(text.matches("\"delta\"").count() >= 2, "{text}");
    let event = support::last_sse_event(&text);
    assert_eq!(event["error"]["code"], "shutting_down", "{text}");
    assert_eq!(event["error"]["type"], "api_error");
    tokio::time::timeout(Duration::from_secs(10), stopping)
        .await
        .expect("shutdown ends after the grace")
        .unwrap();
    drop(sims);
}

/// Whole HTTP/1.1 answers go out without a watchdog task (`server/delivery.rs`); one whose
/// upstream stops mid-body gets its watchdog when the body first waits, so the end of the
/// grace still ends it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_streamed_answer_stuck_mid_body_ends_with_the_grace() {
    let upstream = scripted(|_, mut stream| async move {
        while next_post(&mut stream).await {
            // Promises 100 bytes, sends 11, then waits for the router to hang up.
            let head =
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n";
            let partial = format!("{head}{{\"id\":\"x\",");
            stream.write_all(partial.as_bytes()).await.unwrap();
            let _ = stream.read_to_end(&mut Vec::new()).await;
        }
    })
    .await;
    let mut set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
    for profile in &mut set.profiles {
        profile.upstream = Upstream::Static(StaticUpstream::new(vec![upstream.clone()]));
    }
    // Timeouts far beyond the test: only the end of the grace can end the answer.
    let router = start_router(set, |c| {
        c.shutdown_delay = Duration::ZERO;
        c.shutdown_grace = Duration::from_millis(300);
        c.resilience.idle_timeout = Duration::from_secs(600);
    })
    .await;
    let mut client = TcpStream::connect(router.public_addr()).await.unwrap();
    let body = chat(PINNED, SIMPLE);
    let request = format!(
        "{}{body}",
        request_head("/v1/chat/completions", body.len(), "")
    );
    client.write_all(request.as_bytes()).await.unwrap();
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("{\"id\":\"x\",") {
        let mut chunk = [0u8; 4096];
        let n = client.read(&mut chunk).await.unwrap();
        assert!(n > 0, "closed before the partial answer");
        seen.extend_from_slice(&chunk[..n]);
    }
    let stopping = tokio::spawn(router.shutdown());
    seen.extend(read_until_closed(&mut client, Duration::from_secs(10)).await);
    let text = String::from_utf8_lossy(&seen);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(
        text.ends_with("{\"id\":\"x\","),
        "the cut answer was completed: {text}"
    );
    tokio::time::timeout(Duration::from_secs(10), stopping)
        .await
        .expect("shutdown ends after the grace")
        .unwrap();
}

/// The real binary under a small descriptor limit (soft 64, hard 256), with more idle
/// connections than the hard limit: it raises its soft limit, caps its connections (64 under
/// 256), sheds the oldest idle ones, and keeps answering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_idle_connections_than_descriptors_shed_the_oldest_and_the_router_answers() {
    let (set, _sims) = support::sim_tiers(Duration::ZERO).await;
    let free = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
    };
    let (public, admin) = (free(), free());
    let dir = tempfile::tempdir().unwrap();
    let profiles = dir.path().join("profiles.json");
    std::fs::write(&profiles, serde_json::to_string(&set).unwrap()).unwrap();
    let child = tokio::process::Command::new("sh")
        .args(["-c", r#"ulimit -Sn 64 && ulimit -Hn 256 && exec "$0" "$@""#])
        .arg(env!("CARGO_BIN_EXE_quantrouter"))
        .args(["serve", "--workers", "1", "--keda-scaler-listen", "off"])
        .args([
            "--listen",
            &public.to_string(),
            "--admin-listen",
            &admin.to_string(),
        ])
        .arg("--profiles")
        .arg(&profiles)
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let http = support::client();
    let ready = || async {
        let url = format!("http://{admin}/readyz");
        let get = http::Request::get(url)
            .body(http_body_util::Full::new(bytes::Bytes::new()))
            .unwrap();
        matches!(
            tokio::time::timeout(Duration::from_secs(2), http.request(get)).await,
            Ok(Ok(r)) if r.status() == StatusCode::OK
        )
    };
    assert!(
        eventually(Duration::from_secs(10), ready).await,
        "the router came up"
    );
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", child.id().unwrap())).unwrap();
    let open_files = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    let soft: Vec<&str> = open_files.split_whitespace().collect();
    assert_eq!(
        soft[3], "256",
        "the soft limit was not raised: {open_files}"
    );

    let mut idle = Vec::new();
    for _ in 0..300 {
        idle.push(TcpStream::connect(public).await.unwrap());
    }
    assert!(
        eventually(Duration::from_secs(10), ready).await,
        "the admin port stopped answering"
    );
    let url = format!("http://{public}/v1/chat/completions");
    let r = send(&http, "POST", &url, &chat("auto", SIMPLE), &[JSON]).await;
    assert_eq!(r.status, StatusCode::OK);
    read_until_closed(&mut idle[0], Duration::from_secs(10)).await;
    assert!(
        is_open_and_quiet(&idle[299]),
        "the newest idle connection was shed"
    );
    drop(child);
}
