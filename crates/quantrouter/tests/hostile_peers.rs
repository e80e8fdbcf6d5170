//! Peers that misbehave, over real sockets: clients sending absurd headers, upstreams that
//! break HTTP/1.1 framing or send bytes nobody asked for.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use http::StatusCode;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use quantrouter_policy::{ProfileSet, StaticUpstream, Upstream, DEFAULT_PROFILE_SET};
use support::{chat, loopback, send, start_router, Harness, SIMPLE};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

const JSON: (&str, &str) = ("content-type", "application/json");
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

/// A router whose every profile sends to `upstream`, on one worker (one idle pool).
async fn router_before(upstream: &str) -> quantrouter::server::Server {
    let mut set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
    for profile in &mut set.profiles {
        profile.upstream = Upstream::Static(StaticUpstream {
            urls: vec![upstream.to_owned()],
        });
    }
    start_router(set, |c| c.workers = 1).await
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
