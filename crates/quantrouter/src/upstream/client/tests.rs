//! The client against a scripted HTTP/1.1 server on loopback: what goes on the wire, when a
//! connection is reused or closed, how bodies stream, and whether a failed request was sent.

use std::time::Duration;

use http::StatusCode;
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::*;
use crate::resilience::ResilienceConfig;
use crate::upstream::Sent;

/// A server whose connections the test drives by hand.
struct Server {
    endpoint: Endpoint,
    authority: String,
    accepted: mpsc::UnboundedReceiver<TcpStream>,
}

async fn server() -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let authority = listener.local_addr().unwrap().to_string();
    let (tx, accepted) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            if tx.send(stream).is_err() {
                break;
            }
        }
    });
    let base = format!("http://{authority}");
    let endpoint = Endpoint::new(&base, &ResilienceConfig::default(), Instant::now());
    Server {
        endpoint,
        authority,
        accepted,
    }
}

fn client() -> UpstreamClient {
    UpstreamClient::new(ClientConfig::default())
}

fn post(server: &Server, body: &'static str) -> Request<Bytes> {
    let mut request = Request::post(server.endpoint.uri("/v1/chat/completions").unwrap())
        .body(Bytes::from_static(body.as_bytes()))
        .unwrap();
    let headers = request.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    headers.insert("x-request-id", http::HeaderValue::from_static("qr-1"));
    request
}

/// Reads one request (head and `content-length` body) from a server-side connection.
async fn read_request(conn: &mut TcpStream) -> String {
    let mut data = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = conn.read(&mut buf).await.unwrap();
        assert!(n > 0, "the client closed mid-request");
        data.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&data).into_owned();
        if let Some(end) = text.find("\r\n\r\n") {
            let length = text[..end]
                .lines()
                .find_map(|l| l.strip_prefix("content-length: "))
                .map_or(0, |n| n.parse::<usize>().unwrap());
            if data.len() >= end + 4 + length {
                return text;
            }
        }
    }
}

const OK: &str =
    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{\"ok\":true}";

/// Answers [`OK`] to every request on a server-side connection, from a task of its own.
fn answer_every_request(mut conn: TcpStream) {
    tokio::spawn(async move {
        loop {
            read_request(&mut conn).await;
            conn.write_all(OK.as_bytes()).await.unwrap();
        }
    });
}

async fn body_of(response: Response<UpstreamIncoming>) -> Bytes {
    response.into_body().collect().await.unwrap().to_bytes()
}

const FIVE_S: Duration = Duration::from_secs(5);

type Sending = tokio::task::JoinHandle<Result<Response<UpstreamIncoming>, UpstreamError>>;

/// Sends `request` from a task of its own while the test plays the server.
fn spawn_send(
    client: &UpstreamClient,
    server: &Server,
    request: Request<Bytes>,
    timeout: Duration,
) -> Sending {
    let client = client.clone();
    let endpoint = Endpoint::new(
        server.endpoint.base(),
        &ResilienceConfig::default(),
        Instant::now(),
    );
    tokio::spawn(async move {
        client
            .send(&Transport::default(), &endpoint, request, timeout)
            .await
    })
}

/// The body of a sent request's response, in full.
async fn sent_body(sent: Sending) -> Bytes {
    body_of(sent.await.unwrap().unwrap()).await
}

/// The next connection the server accepts, with the request on it read.
async fn accept_request(server: &mut Server) -> TcpStream {
    let mut conn = server.accepted.recv().await.unwrap();
    read_request(&mut conn).await;
    conn
}

/// Posts to the server, which answers `answer` on the new connection; returns the client's
/// result and the server's side of the connection.
async fn answered(
    server: &mut Server,
    client: &UpstreamClient,
    timeout: Duration,
    answer: &[u8],
) -> (Result<Response<UpstreamIncoming>, UpstreamError>, TcpStream) {
    let request = post(server, "{}");
    let sending = spawn_send(client, server, request, timeout);
    let mut conn = accept_request(server).await;
    conn.write_all(answer).await.unwrap();
    (sending.await.unwrap(), conn)
}

/// The client closed its end of `conn`: the server reads EOF (nothing more arrives).
/// A close with bytes unread by the client is a reset: that counts as closed too.
async fn closed_by_client(conn: &mut TcpStream) -> Vec<u8> {
    let mut rest = Vec::new();
    let read = async {
        let mut chunk = [0u8; 4096];
        while let Ok(n @ 1..) = conn.read(&mut chunk).await {
            rest.extend_from_slice(&chunk[..n]);
        }
    };
    tokio::time::timeout(FIVE_S, read)
        .await
        .expect("the client closed the connection");
    rest
}

#[tokio::test]
async fn writes_one_request_with_host_and_length() {
    let mut server = server().await;
    let client = client();
    let request = post(&server, r#"{"model":"m"}"#);
    let sending = spawn_send(&client, &server, request, FIVE_S);
    let mut conn = server.accepted.recv().await.unwrap();
    let text = read_request(&mut conn).await;
    conn.write_all(OK.as_bytes()).await.unwrap();
    assert_eq!(sent_body(sending).await, r#"{"ok":true}"#);

    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let mut lines = head.lines();
    assert_eq!(lines.next(), Some("POST /v1/chat/completions HTTP/1.1"));
    let headers: Vec<String> = lines.map(str::to_ascii_lowercase).collect();
    assert!(
        headers.contains(&format!("host: {}", server.authority)),
        "{headers:?}"
    );
    assert!(
        headers.contains(&"content-length: 13".into()),
        "{headers:?}"
    );
    assert!(
        headers.contains(&"x-request-id: qr-1".into()),
        "{headers:?}"
    );
    assert_eq!(body, r#"{"model":"m"}"#);
}

#[tokio::test]
async fn reuses_a_kept_alive_connection_once_the_body_ended() {
    let mut server = server().await;
    let client = client();
    for i in 0..3 {
        let sending = spawn_send(&client, &server, post(&server, "{}"), FIVE_S);
        // Only the first request opens a connection; the others come on it.
        if i == 0 {
            answer_every_request(server.accepted.recv().await.unwrap());
        }
        assert_eq!(sent_body(sending).await, r#"{"ok":true}"#);
    }
    assert!(
        server.accepted.try_recv().is_err(),
        "a second connection was opened"
    );
}

#[tokio::test]
async fn a_connection_the_server_closes_is_not_reused() {
    let mut server = server().await;
    let client = client();
    let close = OK.replace("content-length", "connection: close\r\ncontent-length");
    let (sent, mut conn) = answered(&mut server, &client, FIVE_S, close.as_bytes()).await;
    assert_eq!(body_of(sent.unwrap()).await, r#"{"ok":true}"#);
    assert!(closed_by_client(&mut conn).await.is_empty());
    let (sent, _fresh) = answered(&mut server, &client, FIVE_S, OK.as_bytes()).await;
    assert_eq!(body_of(sent.unwrap()).await, r#"{"ok":true}"#);
}

#[tokio::test]
async fn a_request_read_and_never_answered_is_sent_once_and_reported_as_sent() {
    let mut server = server().await;
    let client = client();
    // The first exchange leaves a kept-alive connection idle in the pool.
    let (sent, mut conn) = answered(&mut server, &client, FIVE_S, OK.as_bytes()).await;
    body_of(sent.unwrap()).await;

    // The server reads the next request on it and closes without an answer: the upstream
    // may be generating, so the client must neither resend it nor hide the failure.
    let second = spawn_send(&client, &server, post(&server, "{}"), FIVE_S);
    read_request(&mut conn).await;
    drop(conn);
    let error = second.await.unwrap().unwrap_err();
    assert!(matches!(error, UpstreamError::Exchange { .. }), "{error}");
    assert_eq!(error.sent(), Sent::Possibly);
    assert!(
        server.accepted.try_recv().is_err(),
        "the request was sent again on a new connection"
    );
}

#[tokio::test]
async fn a_kept_alive_connection_closed_while_idle_is_never_written_to() {
    let mut server = server().await;
    let client = client();
    let (sent, mut conn) = answered(&mut server, &client, FIVE_S, OK.as_bytes()).await;
    body_of(sent.unwrap()).await;
    // The server closes the idle connection; the client notices and closes its end.
    conn.shutdown().await.unwrap();
    assert!(closed_by_client(&mut conn).await.is_empty());

    let (sent, _fresh) = answered(&mut server, &client, FIVE_S, OK.as_bytes()).await;
    assert_eq!(body_of(sent.unwrap()).await, r#"{"ok":true}"#);
}

#[tokio::test]
async fn bytes_on_an_idle_connection_close_it_before_any_request_can_take_it() {
    let mut server = server().await;
    let client = client();
    let (sent, mut conn) = answered(&mut server, &client, FIVE_S, OK.as_bytes()).await;
    body_of(sent.unwrap()).await;
    // An answer nobody asked for: the connection can no longer tell answers apart.
    conn.write_all(OK.as_bytes()).await.unwrap();
    assert!(closed_by_client(&mut conn).await.is_empty());

    let (sent, _fresh) = answered(&mut server, &client, FIVE_S, OK.as_bytes()).await;
    assert_eq!(body_of(sent.unwrap()).await, r#"{"ok":true}"#);
}

#[tokio::test]
async fn bytes_on_an_idle_connection_never_answer_a_request_sent_before_they_are_read() {
    let mut server = server().await;
    let client = client();
    let (sent, mut conn) = answered(&mut server, &client, FIVE_S, OK.as_bytes()).await;
    body_of(sent.unwrap()).await;
    let mut accepted = server.accepted;
    tokio::spawn(async move {
        while let Some(fresh) = accepted.recv().await {
            answer_every_request(fresh);
        }
    });
    // The stray answer is in the kernel, the request follows at once (one thread: hyper's
    // reactor has had no turn to see it): the request must not go on that connection.
    let stray = "HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\n{\"stray\":1}";
    conn.write_all(stray.as_bytes()).await.unwrap();
    let endpoint = Endpoint::new(
        server.endpoint.base(),
        &ResilienceConfig::default(),
        Instant::now(),
    );
    let request = Request::post(endpoint.uri("/v1/chat/completions").unwrap())
        .body(Bytes::from_static(b"{}"))
        .unwrap();
    match client
        .send(&Transport::default(), &endpoint, request, FIVE_S)
        .await
    {
        // hyper saw the bytes first and a new connection answered.
        Ok(response) => assert_eq!(body_of(response).await, r#"{"ok":true}"#),
        // The check saw them: nothing was written, the retry module may resend.
        Err(error) => {
            assert!(matches!(error, UpstreamError::Unsent { .. }), "{error}");
            assert_eq!(error.sent(), Sent::No);
        }
    }
    assert!(closed_by_client(&mut conn).await.is_empty());
}

#[tokio::test]
async fn a_tls_handshake_never_answered_is_a_connect_error_nothing_was_sent_on() {
    let mut server = server().await;
    let endpoint = Endpoint::new(
        &format!("https://{}", server.authority),
        &ResilienceConfig::default(),
        Instant::now(),
    );
    let client = UpstreamClient::new(ClientConfig {
        connect_timeout: Duration::from_millis(200),
        ..ClientConfig::default()
    });
    let request = Request::post(endpoint.uri("/v1/chat/completions").unwrap())
        .body(Bytes::from_static(b"{}"))
        .unwrap();
    let error = client
        .send(&Transport::default(), &endpoint, request, FIVE_S)
        .await
        .unwrap_err();
    assert!(matches!(error, UpstreamError::Connect { .. }), "{error}");
    assert_eq!(error.sent(), Sent::No);
    // The TCP connect itself succeeded; the handshake is what went unanswered.
    assert!(server.accepted.try_recv().is_ok());
}

#[tokio::test]
async fn chunked_frames_arrive_as_the_server_sends_them() {
    let mut server = server().await;
    let client = client();
    let head =
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
    let answer = format!("{head}6\r\ndata: \r\n");
    let (sent, mut conn) = answered(&mut server, &client, FIVE_S, answer.as_bytes()).await;
    let mut body = sent.unwrap().into_body();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(first, "data: ");
    // The next frame only exists once the server sends it.
    conn.write_all(b"4\r\none\n\r\n0\r\n\r\n").await.unwrap();
    let second = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(second, "one\n");
    assert!(body.frame().await.is_none());
}

#[tokio::test]
async fn a_chunked_answer_loses_its_stale_content_length() {
    let mut server = server().await;
    let client = client();
    let answer = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 7\r\n\r\n2\r\nhi\r\n0\r\n\r\n";
    let (sent, _conn) = answered(&mut server, &client, FIVE_S, answer).await;
    let response = sent.unwrap();
    assert!(!response.headers().contains_key(header::CONTENT_LENGTH));
    assert_eq!(body_of(response).await, "hi");
}

#[tokio::test]
async fn dropping_a_body_mid_stream_closes_the_connection() {
    let mut server = server().await;
    let client = client();
    let answer = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nhi\r\n";
    let (sent, mut conn) = answered(&mut server, &client, FIVE_S, answer).await;
    let mut body = sent.unwrap().into_body();
    body.frame().await.unwrap().unwrap();
    drop(body);
    assert!(closed_by_client(&mut conn).await.is_empty());
}

#[tokio::test]
async fn a_body_cut_short_is_an_error() {
    let mut server = server().await;
    let client = client();
    let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nshort";
    let (sent, conn) = answered(&mut server, &client, FIVE_S, answer).await;
    drop(conn);
    let read = sent.unwrap().into_body().collect().await;
    assert!(read.is_err(), "a truncated body read as complete");
}

#[tokio::test]
async fn garbage_instead_of_a_head_is_an_invalid_response() {
    let mut server = server().await;
    let client = client();
    let answer = b"SSH-2.0-OpenSSH\r\n\r\n";
    let (sent, _conn) = answered(&mut server, &client, FIVE_S, answer).await;
    let error = sent.unwrap_err();
    assert!(
        matches!(error, UpstreamError::InvalidResponse { .. }),
        "{error}"
    );
    assert_eq!(error.sent(), Sent::Possibly);
}

#[tokio::test]
async fn interim_answers_are_skipped_and_the_head_timeout_applies() {
    let mut server = server().await;
    let client = client();
    let interim = b"HTTP/1.1 100 Continue\r\n\r\n";
    let short = Duration::from_millis(300);
    let (sent, _conn) = answered(&mut server, &client, short, interim).await;
    let error = sent.unwrap_err();
    assert!(
        matches!(error, UpstreamError::HeaderTimeout { .. }),
        "{error}"
    );

    let answer = format!("HTTP/1.1 100 Continue\r\n\r\n{OK}");
    let (sent, _conn) = answered(&mut server, &client, FIVE_S, answer.as_bytes()).await;
    let response = sent.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(body_of(response).await, r#"{"ok":true}"#);
}

#[tokio::test]
async fn a_refused_connection_is_a_connect_error_and_nothing_was_sent() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    let endpoint = Endpoint::new(&base, &ResilienceConfig::default(), Instant::now());
    let request = Request::get(endpoint.uri("/metrics").unwrap())
        .body(Bytes::new())
        .unwrap();
    let error = client()
        .send(&Transport::default(), &endpoint, request, FIVE_S)
        .await
        .unwrap_err();
    assert!(matches!(error, UpstreamError::Connect { .. }), "{error}");
    assert_eq!(error.sent(), Sent::No);
}

#[tokio::test]
async fn an_unreadable_ca_file_is_a_connect_error_that_names_it() {
    let endpoint = Endpoint::new(
        "https://127.0.0.1:9",
        &ResilienceConfig::default(),
        Instant::now(),
    );
    let transport = Transport {
        ca_file: Some("/nonexistent/ca.pem".into()),
        http2: false,
    };
    let request = Request::get(endpoint.uri("/health").unwrap())
        .body(Bytes::new())
        .unwrap();
    let error = client()
        .send(&transport, &endpoint, request, FIVE_S)
        .await
        .unwrap_err();
    assert!(matches!(error, UpstreamError::Connect { .. }), "{error}");
    assert!(error.to_string().contains("/nonexistent/ca.pem"), "{error}");
}
