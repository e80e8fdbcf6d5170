//! Helpers shared by the integration tests: start a simulator on a free loopback port, talk to
//! it over real HTTP, and wait on conditions with a deadline instead of sleeping.
// Each test binary uses a different subset of the helpers. clippy.toml allows unwrap and panic
// in `#[test]` functions only, not in the helpers they share, and a failed helper should fail
// the test loudly.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;
use vllm_sim::{SimConfig, SimServer};

pub const MODEL: &str = "sim-model";

/// A complete HTTP answer.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {:?}", self.body))
    }

    pub fn text(&self) -> String {
        String::from_utf8(self.body.to_vec()).unwrap()
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }
}

pub async fn start(config: SimConfig) -> SimServer {
    SimServer::bind("127.0.0.1:0".parse().unwrap(), config)
        .await
        .unwrap()
}

pub async fn start_default() -> SimServer {
    start(SimConfig::default()).await
}

pub async fn request(sim: &SimServer, method: Method, path: &str, body: Option<String>) -> Reply {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut builder = Request::builder()
        .method(method)
        .uri(format!("{}{path}", sim.url()));
    if body.is_some() {
        builder = builder.header("content-type", "application/json");
    }
    let request = builder
        .body(Full::new(Bytes::from(body.unwrap_or_default())))
        .unwrap();
    let response = client.request(request).await.unwrap();
    let (parts, body) = response.into_parts();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.unwrap().to_bytes(),
    }
}

pub async fn post(sim: &SimServer, path: &str, body: &Value) -> Reply {
    request(sim, Method::POST, path, Some(body.to_string())).await
}

pub async fn post_raw(sim: &SimServer, path: &str, body: &str) -> Reply {
    request(sim, Method::POST, path, Some(body.to_owned())).await
}

pub async fn get(sim: &SimServer, path: &str) -> Reply {
    request(sim, Method::GET, path, None).await
}

pub fn chat(content: &str) -> Value {
    serde_json::json!({"model": MODEL, "messages": [{"role": "user", "content": content}]})
}

/// The assistant's text in a chat completion.
pub fn chat_content(reply: &Reply) -> String {
    reply.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// The `data:` payloads of an SSE body, in order.
pub fn sse_data(body: &str) -> Vec<String> {
    assert!(
        body.ends_with("\n\n"),
        "stream must end with a blank line: {body:?}"
    );
    body.split("\n\n")
        .filter(|event| !event.is_empty())
        .map(|event| {
            event
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not a data event: {event:?}"))
                .to_owned()
        })
        .collect()
}

/// The value of the sample `name{model_name="<MODEL>"}` in a Prometheus text body.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    let prefix = format!("{name}{{model_name=\"{MODEL}\"}} ");
    text.lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .map(|value| value.parse().unwrap())
}

pub async fn scrape(sim: &SimServer) -> String {
    let reply = get(sim, "/metrics").await;
    assert_eq!(reply.status, StatusCode::OK);
    reply.text()
}

/// Polls `condition` until it holds, failing the test after a generous deadline.
pub async fn eventually<F, Fut>(what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut poll = tokio::time::interval(Duration::from_millis(5));
    loop {
        poll.tick().await;
        if condition().await {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
    }
}

/// Opens a raw connection and writes one POST, for tests that must control the socket.
pub async fn raw_post(addr: SocketAddr, path: &str, body: &Value) -> TcpStream {
    let body = body.to_string();
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: sim\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(body.as_bytes()).await.unwrap();
    stream
}

/// Reads until the peer closes (or resets) the connection.
pub async fn read_until_closed(stream: &mut TcpStream) -> String {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        match tokio::time::timeout(Duration::from_secs(10), stream.read(&mut chunk)).await {
            Ok(Ok(0) | Err(_)) => break,
            Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
            Err(_) => panic!(
                "connection still open after 10s: {:?}",
                String::from_utf8_lossy(&buf)
            ),
        }
    }
    String::from_utf8_lossy(&buf).into_owned()
}

/// Reads until the received bytes contain `needle`.
pub async fn read_until_contains(stream: &mut TcpStream, needle: &str) -> String {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    while !String::from_utf8_lossy(&buf).contains(needle) {
        let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut chunk))
            .await
            .expect("timed out reading")
            .unwrap();
        assert!(
            n > 0,
            "closed before {needle:?}: {:?}",
            String::from_utf8_lossy(&buf)
        );
        buf.extend_from_slice(&chunk[..n]);
    }
    String::from_utf8_lossy(&buf).into_owned()
}
