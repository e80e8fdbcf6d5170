//! How the router reaches its upstreams, over real sockets: `https://` upstreams (vllm-sim
//! behind TLS, with a CA made in the test), HTTP/2 upstreams (h2c and ALPN), an upstream
//! that reads a request and closes without answering: the request is sent once, and what
//! happens next is the retry module's call, counted where everything else is. And what never
//! reached an upstream's work: a TLS handshake left unanswered, and HTTP/2 streams refused
//! or gone away from, by scripted servers.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use quantrouter::server::{Server, ServerConfig};
use quantrouter_policy::{ProfileSet, Upstream, DEFAULT_PROFILE_SET};
use support::{chat, loopback, send, start_router, Reply, SIMPLE};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;
use vllm_sim::{SimConfig, SimServer};

const JSON: (&str, &str) = ("content-type", "application/json");
/// Every request below names this profile: no routing, no quality re-check.
const PINNED: &str = "llama8b-fp16";

/// A CA and a certificate it signed for 127.0.0.1, made for this test.
struct TestPki {
    ca_pem: String,
    cert_pem: String,
    key_pem: String,
}

fn pki() -> TestPki {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "quantrouter test CA");
    let ca = ca.self_signed(&ca_key).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let leaf = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()]).unwrap();
    let cert = leaf.signed_by(&key, &ca, &ca_key).unwrap();
    TestPki {
        ca_pem: ca.pem(),
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    }
}

/// A simulator for the pinned profile's model, over HTTPS with `pki`'s certificate.
async fn https_sim(pki: &TestPki) -> SimServer {
    let tls =
        vllm_sim::tls::server_config(pki.cert_pem.as_bytes(), pki.key_pem.as_bytes()).unwrap();
    SimServer::bind_tls(loopback(), sim_config(), tls)
        .await
        .unwrap()
}

fn sim_config() -> SimConfig {
    let set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
    SimConfig {
        model: set.profile(PINNED).unwrap().model.clone(),
        ..SimConfig::default()
    }
}

/// The embedded set with every profile sent to `upstream` (a JSON upstream object).
fn set_on(upstream: serde_json::Value) -> ProfileSet {
    let mut set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
    for profile in &mut set.profiles {
        profile.upstream = serde_json::from_value::<Upstream>(upstream.clone()).unwrap();
    }
    set.validate().unwrap();
    set
}

async fn router(set: ProfileSet, tweak: impl FnOnce(&mut ServerConfig)) -> Server {
    start_router(set, |c| {
        // Checks and scrapes would add requests the assertions below do not count.
        c.resilience.health_interval = std::time::Duration::ZERO;
        tweak(c);
    })
    .await
}

async fn post(router: &Server, body: &str) -> Reply {
    let url = format!("http://{}/v1/chat/completions", router.public_addr());
    send(&support::client(), "POST", &url, body, &[JSON]).await
}

fn stream_body() -> String {
    serde_json::json!({"model": PINNED, "stream": true, "max_tokens": 8,
        "messages": [{"role": "user", "content": SIMPLE}]})
    .to_string()
}

/// A chat answer and a whole stream through the router.
async fn chat_and_stream_work(router: &Server) {
    let r = post(router, &chat(PINNED, SIMPLE)).await;
    assert_eq!(
        r.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    assert_eq!(r.header("x-quantrouter-profile"), PINNED);
    let content = &r.json()["choices"][0]["message"]["content"];
    assert!(content.as_str().is_some_and(|c| !c.is_empty()), "{content}");

    let r = post(router, &stream_body()).await;
    assert_eq!(
        r.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    let text = String::from_utf8(r.body.to_vec()).unwrap();
    assert!(text.starts_with("data: {"), "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert!(text.matches("data: {").count() >= 2, "{text}");
}

fn write_ca(dir: &tempfile::TempDir, pki: &TestPki) -> PathBuf {
    let path = dir.path().join("ca.pem");
    std::fs::write(&path, &pki.ca_pem).unwrap();
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_upstream_signed_by_the_profiles_ca_serves_chat_and_streams() {
    let pki = pki();
    let sim = https_sim(&pki).await;
    assert!(sim.url().starts_with("https://"));
    let dir = tempfile::tempdir().unwrap();
    let ca = write_ca(&dir, &pki);

    let router = router(
        set_on(serde_json::json!({"urls": [sim.url()], "ca_file": ca})),
        |_| {},
    )
    .await;
    chat_and_stream_work(&router).await;
    assert_eq!(sim.stats().requests, 2);
    assert_eq!(sim.stats().http2_requests, 0, "HTTP/1.1 unless asked");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_upstream_is_verified_against_the_global_ca_and_never_without_one() {
    let pki = pki();
    let sim = https_sim(&pki).await;
    let dir = tempfile::tempdir().unwrap();
    let ca = write_ca(&dir, &pki);

    // `--upstream-ca-file`: every https upstream without a CA file of its own.
    let trusting = router(set_on(serde_json::json!({"urls": [sim.url()]})), |c| {
        c.client.ca_file = Some(ca.clone());
    })
    .await;
    chat_and_stream_work(&trusting).await;

    // The system's roots do not know the test CA: no request reaches the upstream.
    let before = sim.stats().requests;
    let strict = router(set_on(serde_json::json!({"urls": [sim.url()]})), |_| {}).await;
    let r = post(&strict, &chat(PINNED, SIMPLE)).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.json()["error"]["code"], "no_healthy_profile");
    assert_eq!(sim.stats().requests, before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_upstreams_serve_chat_and_streams_over_h2c_and_alpn() {
    let h2c = SimServer::bind(loopback(), sim_config()).await.unwrap();
    let router_h2c = router(
        set_on(serde_json::json!({"urls": [h2c.url()], "http2": true})),
        |_| {},
    )
    .await;
    chat_and_stream_work(&router_h2c).await;
    let stats = h2c.stats();
    assert_eq!((stats.requests, stats.http2_requests), (2, 2));

    let pki = pki();
    let tls = https_sim(&pki).await;
    let dir = tempfile::tempdir().unwrap();
    let ca = write_ca(&dir, &pki);
    let router_h2 = router(
        set_on(serde_json::json!({"urls": [tls.url()], "ca_file": ca, "http2": true})),
        |_| {},
    )
    .await;
    chat_and_stream_work(&router_h2).await;
    let stats = tls.stats();
    assert_eq!((stats.requests, stats.http2_requests), (2, 2));
}

/// An HTTP/1.1 upstream over raw TCP: answers every GET with an empty 200 and every POST
/// with a chat completion — except, while `drop_posts` is set, it reads the POST and closes
/// the connection without a byte of answer. Counts the POSTs it read.
async fn reads_and_hangs_up(drop_posts: Arc<AtomicBool>, posts: Arc<AtomicUsize>) -> String {
    let listener = TcpListener::bind(loopback()).await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        loop {
            let (mut stream, _) = listener.accept().await.unwrap();
            stream.set_nodelay(true).unwrap();
            let (drop_posts, posts) = (Arc::clone(&drop_posts), Arc::clone(&posts));
            tokio::spawn(async move {
                while let Some(post) = next_request(&mut stream).await {
                    if !post {
                        let empty = "HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
                        let _ = stream.write_all(empty.as_bytes()).await;
                        continue;
                    }
                    posts.fetch_add(1, Ordering::SeqCst);
                    if drop_posts.load(Ordering::SeqCst) {
                        return;
                    }
                    let body = r#"{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"scripted"},"finish_reason":"stop"}]}"#;
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = stream.write_all(answer.as_bytes()).await;
                }
            });
        }
    });
    url
}

/// Reads one request off `stream`: whether it was a POST; `None` at the end of the
/// connection.
async fn next_request(stream: &mut TcpStream) -> Option<bool> {
    let mut buf = Vec::new();
    let head_end = loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break end + 4;
        }
        let mut chunk = [0u8; 4096];
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
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
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    Some(head.starts_with("post "))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_an_upstream_read_and_never_answered_is_sent_once_and_retried_as_an_attempt() {
    let (drop_posts, posts) = (Arc::new(AtomicBool::new(false)), Arc::default());
    let hangs_up = reads_and_hangs_up(Arc::clone(&drop_posts), Arc::clone(&posts)).await;
    let sim = SimServer::bind(loopback(), sim_config()).await.unwrap();
    // Both endpoints idle: by load alone, the first listed gets each first attempt.
    let set = set_on(serde_json::json!({"urls": [hangs_up, sim.url()], "balance": "least_load"}));
    let router = router(set, |_| {}).await;

    // A first exchange leaves a kept-alive connection to the scripted upstream.
    let r = post(&router, &chat(PINNED, SIMPLE)).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json()["choices"][0]["message"]["content"], "scripted");
    assert_eq!(posts.load(Ordering::SeqCst), 1);

    // The next request is read and the connection closed with no answer: the upstream may
    // have started generating. One attempt there, then the retry module's call: another
    // endpoint, as a second attempt everyone counts.
    drop_posts.store(true, Ordering::SeqCst);
    let r = post(&router, &chat(PINNED, SIMPLE)).await;
    assert_eq!(
        r.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    assert_eq!(
        posts.load(Ordering::SeqCst),
        2,
        "the request was sent to the upstream that had it again"
    );
    assert_eq!(r.header("x-quantrouter-attempts"), "2");
    assert_ne!(r.json()["choices"][0]["message"]["content"], "scripted");
    assert_eq!(sim.stats().requests, 1);
}

/// An `https://` address whose server accepts connections and never says a word: the TLS
/// ClientHello goes unanswered. Counts the connections it accepted.
async fn silent_tls_server(accepted: Arc<AtomicUsize>) -> String {
    let listener = TcpListener::bind(loopback()).await.unwrap();
    let url = format!("https://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            accepted.fetch_add(1, Ordering::SeqCst);
            held.push(stream);
        }
    });
    url
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_tls_handshake_is_a_connect_error_within_the_connect_timeout() {
    let accepted = Arc::new(AtomicUsize::new(0));
    let silent = silent_tls_server(Arc::clone(&accepted)).await;
    let header_timeout = Duration::from_secs(20);
    let router = router(set_on(serde_json::json!({"urls": [silent]})), |c| {
        c.client.connect_timeout = Duration::from_millis(300);
        c.client.header_timeout = header_timeout;
    })
    .await;
    let started = Instant::now();
    let r = post(&router, &chat(PINNED, SIMPLE)).await;
    // Not the 504 of a header timeout: nothing was sent, the upstream could not be reached.
    assert_eq!(
        r.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    assert_eq!(r.json()["error"]["code"], "no_healthy_profile");
    let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(message.contains("could not be reached"), "{message}");
    assert!(
        accepted.load(Ordering::SeqCst) >= 1,
        "the TCP connect succeeded"
    );
    assert!(
        started.elapsed() < header_timeout,
        "bounded by the connect timeout, not the header timeout"
    );
}

/// What a scripted HTTP/2 upstream does with a POST.
#[derive(Debug, Clone, Copy)]
enum H2Post {
    /// `RST_STREAM` with `REFUSED_STREAM`: never processed.
    Refuse,
    /// `GOAWAY` with the last stream id below the request's (never processed), or at it
    /// (it may have been), then the connection closes.
    GoAway { below: bool },
    /// A chat completion.
    Answer,
}

/// An h2c upstream (prior knowledge) written frame by frame: each POST gets the next action
/// of `script`, then answers; a GET (a scrape) gets an empty 200. Counts the POSTs.
async fn scripted_h2(script: Vec<H2Post>, posts: Arc<AtomicUsize>) -> String {
    let listener = TcpListener::bind(loopback()).await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let script = Arc::new(std::sync::Mutex::new(std::collections::VecDeque::from(
        script,
    )));
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (script, posts) = (Arc::clone(&script), Arc::clone(&posts));
            tokio::spawn(serve_h2(stream, script, posts));
        }
    });
    url
}

/// Frame types and flags of RFC 9113 §6.
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const REFUSED_STREAM: u32 = 0x7;

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).unwrap().to_be_bytes();
    let mut frame = vec![len[1], len[2], len[3], kind, flags];
    frame.extend_from_slice(&stream.to_be_bytes());
    frame.extend_from_slice(payload);
    frame
}

async fn serve_h2(
    mut stream: TcpStream,
    script: Arc<std::sync::Mutex<std::collections::VecDeque<H2Post>>>,
    posts: Arc<AtomicUsize>,
) {
    let mut preface = [0u8; 24];
    if stream.read_exact(&mut preface).await.is_err() {
        return;
    }
    let _ = stream.write_all(&frame(SETTINGS, 0, 0, &[])).await;
    loop {
        let mut head = [0u8; 9];
        if stream.read_exact(&mut head).await.is_err() {
            return;
        }
        let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
        let (kind, flags) = (head[3], head[4]);
        let id = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        let mut payload = vec![0u8; len];
        if stream.read_exact(&mut payload).await.is_err() {
            return;
        }
        let reply = match kind {
            SETTINGS if flags & ACK == 0 => frame(SETTINGS, ACK, 0, &[]),
            PING if flags & ACK == 0 => frame(PING, ACK, 0, &payload),
            GOAWAY => return,
            // A GET: its HEADERS end the stream.
            HEADERS if flags & END_STREAM != 0 => {
                frame(HEADERS, END_HEADERS | END_STREAM, id, &[0x88])
            }
            HEADERS => {
                posts.fetch_add(1, Ordering::SeqCst);
                let action = script.lock().unwrap().pop_front().unwrap_or(H2Post::Answer);
                match action {
                    H2Post::Refuse => frame(RST_STREAM, 0, id, &REFUSED_STREAM.to_be_bytes()),
                    H2Post::GoAway { below } => {
                        let last = if below { id.saturating_sub(2) } else { id };
                        let mut payload = last.to_be_bytes().to_vec();
                        payload.extend_from_slice(&0u32.to_be_bytes());
                        let _ = stream.write_all(&frame(GOAWAY, 0, 0, &payload)).await;
                        // Closed for writing, and read to the end: closing with the
                        // request's body unread would reset the connection, and the reset
                        // could overtake the GOAWAY.
                        let _ = stream.shutdown().await;
                        let _ = tokio::io::copy(&mut stream, &mut tokio::io::sink()).await;
                        return;
                    }
                    H2Post::Answer => {
                        // `:status: 200` (static index 8), then `content-type` (static name
                        // index 31) as a literal without indexing.
                        let mut block = vec![0x88, 0x0f, 0x10, 16];
                        block.extend_from_slice(b"application/json");
                        let body = br#"{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"scripted"},"finish_reason":"stop"}]}"#;
                        let mut answer = frame(HEADERS, END_HEADERS, id, &block);
                        answer.extend(frame(DATA, END_STREAM, id, body));
                        answer
                    }
                }
            }
            // The request's body, window updates, resets: nothing to say.
            _ => continue,
        };
        if stream.write_all(&reply).await.is_err() {
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_request_the_upstream_never_processed_is_sent_again_at_once() {
    for never_processed in [H2Post::Refuse, H2Post::GoAway { below: true }] {
        let posts = Arc::new(AtomicUsize::new(0));
        let upstream = scripted_h2(vec![never_processed], Arc::clone(&posts)).await;
        let set = set_on(serde_json::json!({"urls": [upstream], "http2": true}));
        let router = router(set, |_| {}).await;
        let r = post(&router, &chat(PINNED, SIMPLE)).await;
        let text = String::from_utf8_lossy(&r.body);
        assert_eq!(r.status, StatusCode::OK, "{never_processed:?}: {text}");
        assert_eq!(r.json()["choices"][0]["message"]["content"], "scripted");
        assert_eq!(posts.load(Ordering::SeqCst), 2, "{never_processed:?}");
        // The upstream did no work for the first: the same attempt, sent again.
        assert_eq!(
            r.header("x-quantrouter-attempts"),
            "1",
            "{never_processed:?}"
        );
    }
    // A GOAWAY that covers the request: the upstream may be generating, so it is not sent
    // again on the quiet (and this profile has no other endpoint).
    let posts = Arc::new(AtomicUsize::new(0));
    let script = vec![H2Post::GoAway { below: false }];
    let upstream = scripted_h2(script, Arc::clone(&posts)).await;
    let set = set_on(serde_json::json!({"urls": [upstream], "http2": true}));
    let router = router(set, |_| {}).await;
    let r = post(&router, &chat(PINNED, SIMPLE)).await;
    let text = String::from_utf8_lossy(&r.body);
    assert_eq!(posts.load(Ordering::SeqCst), 1, "{text}");
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{text}");
}
