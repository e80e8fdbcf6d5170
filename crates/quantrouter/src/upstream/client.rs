//! The upstream HTTP/1.1 client: keep-alive connections to vLLM endpoints, driven from the
//! request's own task.
//!
//! vLLM speaks HTTP/1.1 only, one request per connection at a time, so a stream holds a
//! connection for its whole life. A general client (hyper-util's pooled one) spends per
//! connection a task of its own, a request channel (a 32-slot block, ~9 KB), an 8 KiB write
//! buffer and a read buffer — ~21 KB of the router's ~31 KB heap per open stream — and hands
//! every request and response across tasks. Here a request writes its head and body in one
//! `write` from its own task and reads its response from the socket itself: an open stream
//! costs its socket and the body state, and no buffer while it waits for the next token.
//!
//! What it does not do, because no upstream of the router needs it: TLS, HTTP/2, upgrades,
//! `Expect: 100-continue`, request bodies other than one buffer.

use std::collections::HashMap;
use std::io;
use std::io::Write as _;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderName, HeaderValue};
use http::{HeaderMap, Method, Request, Response, StatusCode, Uri, Version};
use http_body::{Body, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::framing::{Decoder, FramingError};
use super::{Endpoint, UpstreamError};

/// Connection-pooling client shared by every profile.
#[derive(Debug, Clone)]
pub struct UpstreamClient {
    idle: Arc<IdlePool>,
    connect_timeout: Duration,
    pub header_timeout: Duration,
}

/// Upstream client settings.
#[derive(Debug, Clone, Copy)]
pub struct ClientConfig {
    /// Fail fast on unroutable pods; a healthy pod on the cluster network connects in ms.
    pub connect_timeout: Duration,
    /// vLLM sends headers when the first token is ready; a long queue can take a while, but
    /// a minute with nothing means the pod is stuck.
    pub header_timeout: Duration,
    /// Idle keep-alive connections per endpoint and worker thread; enough for bursts without
    /// hoarding sockets.
    pub max_idle_per_host: usize,
}

/// A response body read straight from the upstream socket. When it ends cleanly on a
/// keep-alive connection, the connection goes back to the idle pool; dropped early, it
/// closes the connection, which is how vLLM learns that the client went away.
pub struct UpstreamIncoming {
    stream: Option<TcpStream>,
    /// Read but not yet decoded (rarely anything: a read is usually one event).
    input: Bytes,
    decoder: Decoder,
    /// Where the connection goes when the body is done, if it may be reused.
    reuse: Option<(Arc<IdlePool>, Box<str>)>,
}

/// Largest response head accepted; vLLM's are ~200 bytes.
const MAX_HEAD: usize = 64 * 1024;
/// Most headers in a response head.
const MAX_HEADERS: usize = 64;
/// One read of a body: the bytes read are copied out into a buffer of their own size, so
/// nothing of this size stays allocated while a stream waits for its next token.
const READ_CHUNK: usize = 8 * 1024;
/// An idle connection older than this is closed instead of reused: servers drop idle
/// keep-alive connections on their own clock (uvicorn after 5 s), and a connection to an
/// endpoint that discovery removed should not live on.
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// Request headers the client sets itself, and hop-by-hop headers never forwarded.
const NOT_FORWARDED: [HeaderName; 6] = [
    header::HOST,
    header::CONTENT_LENGTH,
    header::TRANSFER_ENCODING,
    header::CONNECTION,
    header::TE,
    header::UPGRADE,
];

/// Idle keep-alive connections by `host:port`, most recently used last, one pool per worker
/// thread ([`crate::workers`]) and one for every other thread. A tokio socket is bound to the
/// runtime that opened it: on another worker's runtime each of its events would first wake
/// the thread that owns it.
#[derive(Debug)]
struct IdlePool {
    by_worker: Box<[Mutex<IdleConnections>]>,
    max_per_host: usize,
}

#[derive(Debug, Default)]
struct IdleConnections {
    map: HashMap<Box<str>, Vec<(TcpStream, Instant)>>,
    swept: Option<Instant>,
}

/// Where a request goes.
struct Target<'a> {
    authority: &'a str,
    host: &'a str,
    port: u16,
}

/// Why an exchange on a connection failed, and whether any byte of a response came.
struct ExchangeFailure {
    error: io::Error,
    nothing_received: bool,
}

// === impl UpstreamClient ===

impl UpstreamClient {
    /// A client for use on any thread and on the `workers` worker threads.
    pub fn new(config: ClientConfig, workers: usize) -> Self {
        Self {
            idle: Arc::new(IdlePool {
                by_worker: (0..=workers).map(|_| Mutex::default()).collect(),
                max_per_host: config.max_idle_per_host,
            }),
            connect_timeout: config.connect_timeout,
            header_timeout: config.header_timeout,
        }
    }

    /// Sends one request and waits for the response headers at most `timeout`.
    pub async fn send(
        &self,
        endpoint: &Endpoint,
        request: &Request<Bytes>,
        timeout: Duration,
    ) -> Result<Response<UpstreamIncoming>, UpstreamError> {
        match tokio::time::timeout(timeout, self.exchange(endpoint, request)).await {
            Ok(result) => result,
            Err(_) => Err(UpstreamError::HeaderTimeout {
                endpoint: endpoint.base().to_owned(),
                timeout,
            }),
        }
    }

    /// Idle connections to `authority` held now.
    #[cfg(test)]
    fn idle_connections(&self, authority: &str) -> usize {
        self.idle.count(authority)
    }

    async fn exchange(
        &self,
        endpoint: &Endpoint,
        request: &Request<Bytes>,
    ) -> Result<Response<UpstreamIncoming>, UpstreamError> {
        let invalid = || UpstreamError::InvalidUrl(request.uri().to_string());
        let target = Target::of(request.uri()).ok_or_else(invalid)?;
        let wire = encode(request, target.authority);
        let head_only = request.method() == Method::HEAD;
        let failed = |error: io::Error| match error.kind() {
            // What the parser refused (a head that is not HTTP, bad framing headers).
            io::ErrorKind::InvalidData => UpstreamError::InvalidResponse {
                endpoint: endpoint.base().to_owned(),
                source: error,
            },
            _ => UpstreamError::Exchange {
                endpoint: endpoint.base().to_owned(),
                source: error,
            },
        };
        // A kept-alive connection may have been closed by the server a moment ago; when it
        // fails before any byte of an answer, the request goes once more on a new one.
        if let Some(stream) = self.idle.take(target.authority) {
            match self.exchange_on(stream, &wire, head_only, &target).await {
                Ok(response) => return Ok(response),
                Err(failure) if failure.nothing_received => {
                    tracing::debug!(error = %failure.error, "kept-alive connection was closed");
                }
                Err(failure) => return Err(failed(failure.error)),
            }
        }
        let stream = self
            .connect(&target)
            .await
            .map_err(|source| UpstreamError::Connect {
                endpoint: endpoint.base().to_owned(),
                source,
            })?;
        self.exchange_on(stream, &wire, head_only, &target)
            .await
            .map_err(|failure| failed(failure.error))
    }

    async fn connect(&self, target: &Target<'_>) -> io::Result<TcpStream> {
        let connecting = TcpStream::connect((target.host, target.port));
        let stream = tokio::time::timeout(self.connect_timeout, connecting)
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))??;
        stream.set_nodelay(true)?;
        Ok(stream)
    }

    async fn exchange_on(
        &self,
        mut stream: TcpStream,
        wire: &[u8],
        head_only: bool,
        target: &Target<'_>,
    ) -> Result<Response<UpstreamIncoming>, ExchangeFailure> {
        stream
            .write_all(wire)
            .await
            .map_err(|error| ExchangeFailure {
                error,
                nothing_received: true,
            })?;
        let (mut head, input) = read_head(&mut stream).await?;
        let invalid = |message: &str| ExchangeFailure {
            error: io::Error::new(io::ErrorKind::InvalidData, message.to_owned()),
            nothing_received: false,
        };
        let decoder = framing(&head, head_only).map_err(invalid)?;
        // Transfer-Encoding overrides Content-Length (RFC 9112 §6.3): passed on, the stale
        // length would frame the body for the client differently than here. Such an answer
        // hints at response splitting, so its connection is not reused either.
        let both = head.headers().contains_key(header::TRANSFER_ENCODING)
            && head.headers_mut().remove(header::CONTENT_LENGTH).is_some();
        // A body that ends with the connection leaves nothing to reuse.
        let reuse = keep_alive(&head) && !decoder.ends_with_close() && !both;
        let mut body = UpstreamIncoming {
            stream: Some(stream),
            input,
            decoder,
            reuse: reuse.then(|| (Arc::clone(&self.idle), target.authority.into())),
        };
        if body.decoder.is_done() {
            body.release();
        }
        Ok(head.map(|()| body))
    }
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(2),
            header_timeout: Duration::from_secs(60),
            max_idle_per_host: 256,
        }
    }
}

// === impl Target ===

impl<'a> Target<'a> {
    fn of(uri: &'a Uri) -> Option<Self> {
        if uri.scheme_str() != Some("http") {
            return None;
        }
        let authority = uri.authority()?;
        let host = authority.host();
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        Some(Self {
            authority: authority.as_str(),
            host,
            port: authority.port_u16().unwrap_or(80),
        })
    }
}

/// The request as it goes on the wire: request line, `host`, the caller's headers (less
/// hop-by-hop ones), `content-length`, the body — one buffer, one write.
fn encode(request: &Request<Bytes>, authority: &str) -> Vec<u8> {
    let path = request.uri().path_and_query().map_or("/", |p| p.as_str());
    let body = request.body();
    let mut wire = Vec::with_capacity(256 + body.len());
    for part in [
        request.method().as_str(),
        " ",
        path,
        " HTTP/1.1\r\nhost: ",
        authority,
        "\r\n",
    ] {
        wire.extend_from_slice(part.as_bytes());
    }
    for (name, value) in request.headers() {
        if NOT_FORWARDED.contains(name) {
            continue;
        }
        wire.extend_from_slice(name.as_str().as_bytes());
        wire.extend_from_slice(b": ");
        wire.extend_from_slice(value.as_bytes());
        wire.extend_from_slice(b"\r\n");
    }
    if !body.is_empty() || request.method() == Method::POST {
        // Writing to a Vec cannot fail.
        let _ = write!(wire, "content-length: {}\r\n", body.len());
    }
    wire.extend_from_slice(b"\r\n");
    wire.extend_from_slice(body);
    wire
}

/// Reads and parses a response head (skipping interim 1xx answers); returns it with the
/// bytes read past it.
async fn read_head(stream: &mut TcpStream) -> Result<(Response<()>, Bytes), ExchangeFailure> {
    let failure = |error: io::Error, received: bool| ExchangeFailure {
        error,
        nothing_received: !received,
    };
    let mut buf = BytesMut::with_capacity(1024);
    let mut received = false;
    loop {
        // What was read may hold an interim head and the final one: parse before reading.
        while !buf.is_empty() {
            let Some((head, len)) = parse_head(&buf).map_err(|e| failure(e, true))? else {
                break;
            };
            let _ = buf.split_to(len);
            if !head.status().is_informational() {
                let rest = match buf.is_empty() {
                    true => Bytes::new(),
                    false => buf.freeze(),
                };
                return Ok((head, rest));
            }
        }
        if buf.len() >= MAX_HEAD {
            let error = io::Error::new(io::ErrorKind::InvalidData, "response head too large");
            return Err(failure(error, true));
        }
        buf.reserve(1024);
        let n = stream
            .read_buf(&mut buf)
            .await
            .map_err(|e| failure(e, received))?;
        if n == 0 {
            let error = io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "connection closed before a response head",
            );
            return Err(failure(error, received));
        }
        received = true;
    }
}

/// A complete head and its length, or `None` when more bytes are needed.
fn parse_head(buf: &[u8]) -> io::Result<Option<(Response<()>, usize)>> {
    let invalid = |message: String| io::Error::new(io::ErrorKind::InvalidData, message);
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut parsed = httparse::Response::new(&mut headers);
    let len = match parsed.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(invalid(format!("invalid response head: {e}"))),
    };
    let status = parsed
        .code
        .and_then(|c| StatusCode::from_u16(c).ok())
        .ok_or_else(|| invalid("invalid status code".into()))?;
    // Room for the headers the router adds before passing the head on (the request id and
    // the `x-quantrouter-*` ones): growing the map for them cost two reallocations.
    let mut map = HeaderMap::with_capacity(parsed.headers.len() + 7);
    for h in parsed.headers.iter() {
        let name = HeaderName::from_bytes(h.name.as_bytes());
        let value = HeaderValue::from_bytes(h.value);
        match (name, value) {
            (Ok(name), Ok(value)) => map.append(name, value),
            _ => return Err(invalid(format!("invalid header {:?}", h.name))),
        };
    }
    let mut head = Response::new(());
    *head.status_mut() = status;
    *head.version_mut() = match parsed.version {
        Some(0) => Version::HTTP_10,
        _ => Version::HTTP_11,
    };
    *head.headers_mut() = map;
    Ok(Some((head, len)))
}

/// How the body of this response is delimited (RFC 9112 §6.3).
fn framing(head: &Response<()>, head_only: bool) -> Result<Decoder, &'static str> {
    let status = head.status();
    if head_only
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        return Ok(Decoder::length(0));
    }
    if head.headers().contains_key(header::TRANSFER_ENCODING) {
        return Ok(match is_chunked(head) {
            true => Decoder::chunked(),
            false => Decoder::until_close(),
        });
    }
    let mut lengths = head.headers().get_all(header::CONTENT_LENGTH).iter();
    let Some(first) = lengths.next() else {
        return Ok(Decoder::until_close());
    };
    if lengths.any(|other| other != first) {
        return Err("conflicting content-length headers");
    }
    let n = first
        .to_str()
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .ok_or("invalid content-length")?;
    Ok(Decoder::length(n))
}

/// The last transfer coding is `chunked`.
fn is_chunked(head: &Response<()>) -> bool {
    head.headers()
        .get_all(header::TRANSFER_ENCODING)
        .iter()
        .next_back()
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.rsplit(',').next())
        .is_some_and(|last| last.trim().eq_ignore_ascii_case("chunked"))
}

/// The server keeps the connection open after this response.
fn keep_alive(head: &Response<()>) -> bool {
    let says = |token: &str| {
        head.headers()
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case(token))
    };
    match head.version() {
        Version::HTTP_10 => says("keep-alive"),
        _ => !says("close"),
    }
}

// === impl UpstreamIncoming ===

impl UpstreamIncoming {
    /// A body already read in full (an error answer the router looked into), passed on
    /// as it came.
    pub fn buffered(data: Bytes) -> Self {
        Self {
            stream: None,
            decoder: Decoder::length(data.len() as u64),
            input: data,
            reuse: None,
        }
    }

    /// The body is done: the connection goes back to the pool when it may, else closes.
    fn release(&mut self) {
        let stream = self.stream.take();
        if let (Some(stream), Some((pool, authority))) = (stream, self.reuse.take()) {
            if self.input.is_empty() {
                pool.put(authority, stream);
            }
        }
    }

    /// The body failed: the connection cannot carry another request.
    fn fail(&mut self, error: io::Error) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        self.stream = None;
        Poll::Ready(Some(Err(error)))
    }
}

impl Body for UpstreamIncoming {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = self.get_mut();
        loop {
            match this.decoder.decode(&mut this.input) {
                Ok(Some(data)) => {
                    if this.decoder.is_done() {
                        this.release();
                    }
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Ok(None) if this.decoder.is_done() => {
                    this.release();
                    return Poll::Ready(None);
                }
                Ok(None) => this.input = Bytes::new(),
                Err(e) => return this.fail(io::Error::new(io::ErrorKind::InvalidData, e)),
            }
            let Some(stream) = this.stream.as_mut() else {
                return Poll::Ready(None);
            };
            // Uninitialised: most polls find nothing to read, and zeroing 8 KiB each time
            // would cost a memset per SSE event.
            let mut chunk = [MaybeUninit::<u8>::uninit(); READ_CHUNK];
            let mut buf = ReadBuf::uninit(&mut chunk);
            match Pin::new(stream).poll_read(cx, &mut buf) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return this.fail(e),
                Poll::Ready(Ok(())) if buf.filled().is_empty() => {
                    this.stream = None;
                    return match this.decoder.finish() {
                        Ok(()) => Poll::Ready(None),
                        Err(e @ FramingError::Truncated) => {
                            Poll::Ready(Some(Err(io::Error::new(io::ErrorKind::UnexpectedEof, e))))
                        }
                        Err(e) => this.fail(io::Error::new(io::ErrorKind::InvalidData, e)),
                    };
                }
                Poll::Ready(Ok(())) => this.input = Bytes::copy_from_slice(buf.filled()),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.decoder.is_done()
    }

    fn size_hint(&self) -> SizeHint {
        match self.decoder.remaining() {
            Some(n) => SizeHint::with_exact(n),
            None => SizeHint::default(),
        }
    }
}

impl std::fmt::Debug for UpstreamIncoming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamIncoming")
            .field("decoder", &self.decoder)
            .finish_non_exhaustive()
    }
}

// === impl IdlePool ===

impl IdlePool {
    /// The most recently used idle connection to `authority` that is still open and quiet.
    ///
    /// Every connection is probed, however recently used: bytes a server sent after a
    /// complete response would otherwise be read as the answer to the next request, which
    /// may be another client's. A close that races the request is caught by `exchange`,
    /// which then opens a new connection.
    fn take(&self, authority: &str) -> Option<TcpStream> {
        let now = Instant::now();
        let mut idle = self.lock();
        let conns = idle.map.get_mut(authority)?;
        while let Some((stream, since)) = conns.pop() {
            if now.duration_since(since) < IDLE_TIMEOUT && is_quiet(&stream) {
                return Some(stream);
            }
        }
        None
    }

    fn put(&self, authority: Box<str>, stream: TcpStream) {
        let now = Instant::now();
        let mut idle = self.lock();
        // Now and then, close what nobody took in time, including connections to
        // endpoints no profile uses any more.
        if idle
            .swept
            .is_none_or(|at| now.duration_since(at) >= IDLE_TIMEOUT)
        {
            idle.swept = Some(now);
            idle.map.retain(|_, conns| {
                conns.retain(|(_, since)| now.duration_since(*since) < IDLE_TIMEOUT);
                !conns.is_empty()
            });
        }
        let conns = idle.map.entry(authority).or_default();
        if conns.len() < self.max_per_host {
            conns.push((stream, now));
        }
    }

    #[cfg(test)]
    fn count(&self, authority: &str) -> usize {
        self.lock().map.get(authority).map_or(0, Vec::len)
    }

    /// The calling thread's pool: each worker's lock is only ever taken by that worker.
    fn lock(&self) -> MutexGuard<'_, IdleConnections> {
        let pool = &self.by_worker[crate::workers::current() % self.by_worker.len()];
        // Every step under the lock is a push, pop or retain: never a half-done update.
        super::pool::lock(pool)
    }
}

/// An idle connection has nothing to read: the server neither closed it nor sent bytes
/// nobody asked for.
///
/// A peek straight to the kernel: tokio's `try_read` answers from the readiness its reactor
/// has seen, which misses bytes that arrived since its last turn.
fn is_quiet(stream: &TcpStream) -> bool {
    use rustix::net::RecvFlags;
    let mut probe = [0u8; 1];
    let peeked = rustix::net::recv(stream, &mut probe, RecvFlags::PEEK | RecvFlags::DONTWAIT);
    matches!(peeked, Err(e) if e == rustix::io::Errno::AGAIN || e == rustix::io::Errno::WOULDBLOCK)
}

#[cfg(test)]
mod tests;
