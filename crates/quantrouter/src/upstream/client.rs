//! The upstream HTTP client: hyper-util's pooled client over rustls, for `http://` and
//! `https://` upstreams, HTTP/1.1 by default and HTTP/2 where a profile asks for it (h2c with
//! prior knowledge on `http://`, ALPN on `https://`).
//!
//! It sends each request at most once. hyper-util's own re-send of a request that a closing
//! keep-alive connection never took is switched off, and every failure says whether the
//! request may have reached the upstream ([`Sent`]): the retry module
//! ([`crate::resilience::retry`]) alone decides what happens next, where the retry budget,
//! the breakers, the metrics and `x-quantrouter-attempts` all see it.
//!
//! One hyper client per way of connecting (plain or TLS with given roots, HTTP/1.1 or 2),
//! each with its own pool of keep-alive connections, shared by every profile that connects
//! that way.

use std::collections::{HashMap, VecDeque};
use std::error::Error as StdError;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::{capture_connection, HttpConnector};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::CertificateDer;
use rustls::RootCertStore;

use super::{Endpoint, UpstreamError};
use bounded::Bounded;
use quiet::{NotQuiet, QuietConnector};

mod bounded;
mod quiet;

/// The pooled hyper client of one way of connecting.
type HyperClient = Client<Bounded<HttpsConnector<QuietConnector>>, Full<Bytes>>;

/// Connection-pooling client shared by every profile.
#[derive(Debug, Clone)]
pub struct UpstreamClient {
    inner: Arc<Clients>,
    pub header_timeout: Duration,
}

/// Upstream client settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientConfig {
    /// Fail fast on unroutable pods; a healthy pod on the cluster network connects in ms.
    /// It bounds the TLS handshake too: that is part of connecting, and nothing is sent
    /// before it ends.
    pub connect_timeout: Duration,
    /// vLLM sends headers when the first token is ready; a long queue can take a while, but
    /// a minute with nothing means the pod is stuck.
    pub header_timeout: Duration,
    /// Idle keep-alive connections per endpoint and way of connecting; enough for bursts
    /// without hoarding sockets.
    pub max_idle_per_host: usize,
    /// PEM CA file that `https://` upstreams are verified against when their profile names
    /// none (`--upstream-ca-file`); `None`: the system's roots, which honour `SSL_CERT_FILE`.
    pub ca_file: Option<PathBuf>,
}

/// How a profile's requests reach its upstream: a CA file for `https://`, and HTTP/2.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Transport {
    /// The profile's `upstream.ca_file`.
    pub ca_file: Option<PathBuf>,
    /// The profile's `upstream.http2`.
    pub http2: bool,
}

/// A response body from an upstream: hyper's, streamed from the connection, or one the
/// router already read (an error answer it looked into), passed on as it came, or a stream
/// whose first frames the stream-start check held, sent before the rest of it.
pub struct UpstreamIncoming {
    inner: Inner,
}

enum Inner {
    Streamed(Incoming),
    Buffered(Full<Bytes>),
    Replayed {
        frames: VecDeque<Bytes>,
        rest: Box<UpstreamIncoming>,
    },
}

/// The clients, built as ways of connecting are first needed.
#[derive(Debug)]
struct Clients {
    config: ClientConfig,
    /// `http://` upstreams over HTTP/1.1 and over h2c: no TLS roots needed.
    plain: HyperClient,
    plain_h2: HyperClient,
    /// `https://` upstreams by roots and HTTP version. Built on first use: loading the
    /// system's roots reads a directory of files, which no router without an `https://`
    /// upstream should pay.
    tls: Mutex<HashMap<TlsKey, HyperClient>>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct TlsKey {
    /// `None`: the system's roots.
    ca_file: Option<PathBuf>,
    http2: bool,
}

/// An idle connection older than this is closed instead of reused: servers drop idle
/// keep-alive connections on their own clock (uvicorn after 5 s), and a connection to an
/// endpoint that discovery removed should not live on.
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// One read from an upstream connection: an SSE event is a few hundred bytes, a whole
/// non-streamed answer a few KiB.
const READ_BUF: usize = 8 * 1024;
/// Bytes an HTTP/2 upstream may send one stream before the router takes them.
const H2_STREAM_WINDOW: u32 = 256 * 1024;

// === impl UpstreamClient ===

impl UpstreamClient {
    pub fn new(config: ClientConfig) -> Self {
        crate::tls::install_crypto_provider();
        // Plain connections never verify a certificate: no roots at all.
        let none = RootCertStore::empty();
        let inner = Clients {
            plain: build(&config, none.clone(), false),
            plain_h2: build(&config, none, true),
            tls: Mutex::default(),
            config,
        };
        Self {
            header_timeout: inner.config.header_timeout,
            inner: Arc::new(inner),
        }
    }

    /// Sends one request and waits for the response head at most `timeout`. The request is
    /// sent at most once; a failure says whether it may have reached the upstream.
    pub async fn send(
        &self,
        transport: &Transport,
        endpoint: &Endpoint,
        request: Request<Bytes>,
        timeout: Duration,
    ) -> Result<Response<UpstreamIncoming>, UpstreamError> {
        let client = self.inner.client_for(transport, endpoint, request.uri())?;
        let mut request = request.map(Full::new);
        // A multiplexed connection is shared: one its server is closing must leave the pool.
        let connection = transport.http2.then(|| capture_connection(&mut request));
        let sending = client.request(request);
        let result = match tokio::time::timeout(timeout, sending).await {
            Ok(result) => result,
            // Dropping the request closes its connection: the upstream learns it may stop.
            Err(_) => {
                return Err(UpstreamError::HeaderTimeout {
                    endpoint: endpoint.base().to_owned(),
                    timeout,
                })
            }
        };
        let mut response = result.map_err(|error| {
            let connected = connection.as_ref().map(|c| c.connection_metadata());
            if let (true, Some(Some(connected))) = (went_away(&error), connected.as_deref()) {
                // It takes no new stream; the request sent again needs another connection.
                connected.poison();
            }
            failure(endpoint, error)
        })?;
        // Transfer-Encoding overrides Content-Length (RFC 9112 §6.3): passed on, the stale
        // length would frame the body for the client differently than here.
        if response.headers().contains_key(header::TRANSFER_ENCODING) {
            response.headers_mut().remove(header::CONTENT_LENGTH);
        }
        Ok(response.map(|body| UpstreamIncoming {
            inner: Inner::Streamed(body),
        }))
    }
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(2),
            header_timeout: Duration::from_secs(60),
            max_idle_per_host: 256,
            ca_file: None,
        }
    }
}

// === impl Transport ===

impl Transport {
    /// A profile's transport settings.
    pub fn of(upstream: &quantrouter_policy::Upstream) -> Self {
        let transport = upstream.transport();
        Self {
            ca_file: transport.ca_file.map(PathBuf::from),
            http2: transport.http2,
        }
    }
}

// === impl Clients ===

impl Clients {
    fn client_for(
        &self,
        transport: &Transport,
        endpoint: &Endpoint,
        uri: &http::Uri,
    ) -> Result<HyperClient, UpstreamError> {
        match uri.scheme_str() {
            Some("http") if transport.http2 => return Ok(self.plain_h2.clone()),
            Some("http") => return Ok(self.plain.clone()),
            Some("https") => {}
            _ => return Err(UpstreamError::InvalidUrl(uri.to_string())),
        }
        let key = TlsKey {
            ca_file: transport
                .ca_file
                .clone()
                .or_else(|| self.config.ca_file.clone()),
            http2: transport.http2,
        };
        let mut clients = crate::upstream::pool::lock(&self.tls);
        if let Some(client) = clients.get(&key) {
            return Ok(client.clone());
        }
        let roots = match &key.ca_file {
            Some(path) => ca_roots(path),
            None => Ok(system_roots().clone()),
        };
        // Not kept: once the file is fixed, the next request reads it again.
        let roots = roots.map_err(|source| UpstreamError::Connect {
            endpoint: endpoint.base().to_owned(),
            source: source.into(),
        })?;
        let client = build(&self.config, roots, key.http2);
        clients.insert(key, client.clone());
        Ok(client)
    }
}

/// One hyper client: keep-alive pool, timeouts, no re-sending of its own.
fn build(config: &ClientConfig, roots: RootCertStore, http2: bool) -> HyperClient {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(config.connect_timeout));
    // ring, like every other rustls user of the process (`crate::tls`).
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls =
        rustls::ClientConfig::builder_with_provider(provider).with_safe_default_protocol_versions();
    // The ring provider supports the default versions; a failure would be a build mistake,
    // and the plain-HTTP client is still useful without TLS then.
    let tls = match tls {
        Ok(tls) => tls.with_root_certificates(roots).with_no_client_auth(),
        Err(error) => {
            tracing::error!(%error, "TLS for upstreams unavailable");
            rustls::ClientConfig::builder()
                .with_root_certificates(RootCertStore::empty())
                .with_no_client_auth()
        }
    };
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http();
    // ALPN offers exactly the version the profile asked for.
    // HTTP/1.1 connections are checked for stray bytes before each reuse.
    let http = QuietConnector {
        http,
        check: !http2,
    };
    let connector = Bounded {
        inner: match http2 {
            true => https.enable_http2().wrap_connector(http),
            false => https.enable_http1().wrap_connector(http),
        },
        timeout: config.connect_timeout,
    };
    Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(IDLE_TIMEOUT)
        .pool_max_idle_per_host(config.max_idle_per_host)
        // Reads of at most 8 KiB: hyper's adaptive buffer grows to ~400 KiB on a stream
        // whose upstream outruns its client, and the frames waiting for the client keep it
        // alive; a stream's backlog belongs in the kernel's socket buffers instead.
        .http1_read_buf_exact_size(READ_BUF)
        // The same on HTTP/2: what an upstream may send a stream ahead of its client (hyper's
        // default is 2 MiB) — a few hundred tokens' worth.
        .http2_initial_stream_window_size(H2_STREAM_WINDOW)
        // The retry module decides about every request a connection did not take.
        .retry_canceled_requests(false)
        .http2_only(http2)
        .build(connector)
}

/// The system's CA certificates (or those of `SSL_CERT_FILE` / `SSL_CERT_DIR`), loaded once.
fn system_roots() -> &'static RootCertStore {
    static ROOTS: OnceLock<RootCertStore> = OnceLock::new();
    ROOTS.get_or_init(|| {
        let found = rustls_native_certs::load_native_certs();
        for error in &found.errors {
            tracing::warn!(%error, "reading the system's CA certificates");
        }
        let mut roots = RootCertStore::empty();
        let (added, ignored) = roots.add_parsable_certificates(found.certs);
        if added == 0 {
            tracing::warn!(
                ignored,
                "no system CA certificates: https:// upstreams need upstream.ca_file"
            );
        }
        roots
    })
}

/// The CA certificates of a PEM file: the only roots its upstreams are verified against.
fn ca_roots(path: &Path) -> Result<RootCertStore, String> {
    let pem =
        std::fs::read(path).map_err(|e| format!("reading CA file {}: {e}", path.display()))?;
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&pem) {
        let cert = cert.map_err(|e| format!("CA file {}: {e}", path.display()))?;
        roots
            .add(cert)
            .map_err(|e| format!("CA file {}: {e}", path.display()))?;
    }
    if roots.is_empty() {
        return Err(format!("CA file {} holds no certificate", path.display()));
    }
    Ok(roots)
}

/// What a failed exchange means, by whether the request may have been sent.
fn failure(endpoint: &Endpoint, error: hyper_util::client::legacy::Error) -> UpstreamError {
    let endpoint = endpoint.base().to_owned();
    if error.is_connect() {
        return UpstreamError::Connect {
            endpoint,
            source: error.into(),
        };
    }
    let cause = error
        .source()
        .and_then(|e| e.downcast_ref::<hyper::Error>());
    match cause {
        // hyper hands a request back only when its connection closed before taking it, a
        // connection that was not quiet refused to write any of it, and an HTTP/2 server
        // may say it never processed it.
        Some(cause)
            if cause.is_canceled() || refused_unwritten(cause) || never_processed(cause) =>
        {
            UpstreamError::Unsent {
                endpoint,
                source: error.into(),
            }
        }
        Some(cause) if cause.is_parse() => UpstreamError::InvalidResponse {
            endpoint,
            source: error.into(),
        },
        _ => UpstreamError::Exchange {
            endpoint,
            source: error.into(),
        },
    }
}

/// An HTTP/2 server said it did not process the request (RFC 9113 §8.7): it reset the
/// stream with `REFUSED_STREAM`, or sent `GOAWAY` with a last stream id below it (h2 fails
/// with the peer's `GOAWAY` exactly the streams above that id, and requests opened after it).
fn never_processed(error: &hyper::Error) -> bool {
    h2_cause(error).is_some_and(|h2| {
        let refused = h2.is_reset() && h2.reason() == Some(h2::Reason::REFUSED_STREAM);
        h2.is_remote() && (refused || h2.is_go_away())
    })
}

/// The request failed on an HTTP/2 connection its server is closing (`GOAWAY`).
fn went_away(error: &hyper_util::client::legacy::Error) -> bool {
    let cause = error
        .source()
        .and_then(|e| e.downcast_ref::<hyper::Error>());
    cause
        .and_then(h2_cause)
        .is_some_and(|h2| h2.is_remote() && h2.is_go_away())
}

/// The HTTP/2 error under a hyper error, if it is one.
fn h2_cause(error: &hyper::Error) -> Option<&h2::Error> {
    let mut cause = error.source();
    while let Some(error) = cause {
        if let Some(h2) = error.downcast_ref::<h2::Error>() {
            return Some(h2);
        }
        cause = error.source();
    }
    None
}

/// The quiet check refused the request: nothing of it was written.
fn refused_unwritten(error: &hyper::Error) -> bool {
    let mut cause = error.source();
    while let Some(error) = cause {
        let quiet = error
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .is_some_and(|inner| inner.is::<NotQuiet>());
        if quiet || error.is::<NotQuiet>() {
            return true;
        }
        cause = error.source();
    }
    false
}

// === impl UpstreamIncoming ===

impl UpstreamIncoming {
    /// A body already read in full (an error answer the router looked into), passed on
    /// as it came.
    pub fn buffered(data: Bytes) -> Self {
        Self {
            inner: Inner::Buffered(Full::new(data)),
        }
    }

    /// `frames` read from the start of `rest` (held for the stream-start check), sent first,
    /// then the rest of it.
    pub fn replaying(frames: Vec<Bytes>, rest: UpstreamIncoming) -> Self {
        Self {
            inner: Inner::Replayed {
                frames: frames.into(),
                rest: Box::new(rest),
            },
        }
    }
}

impl Body for UpstreamIncoming {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match &mut self.get_mut().inner {
            Inner::Streamed(body) => Pin::new(body).poll_frame(cx),
            Inner::Buffered(body) => match Pin::new(body).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => Poll::Ready(Some(Ok(frame))),
                Poll::Ready(Some(Err(never))) => match never {},
                Poll::Ready(None) => Poll::Ready(None),
                Poll::Pending => Poll::Pending,
            },
            Inner::Replayed { frames, rest } => match frames.pop_front() {
                Some(frame) => Poll::Ready(Some(Ok(Frame::data(frame)))),
                None => Pin::new(&mut **rest).poll_frame(cx),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            Inner::Streamed(body) => body.is_end_stream(),
            Inner::Buffered(body) => body.is_end_stream(),
            Inner::Replayed { frames, rest } => frames.is_empty() && rest.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Inner::Streamed(body) => body.size_hint(),
            Inner::Buffered(body) => body.size_hint(),
            Inner::Replayed { frames, rest } => {
                let held: usize = frames.iter().map(Bytes::len).sum();
                let rest = rest.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(rest.lower().saturating_add(held as u64));
                if let Some(upper) = rest.upper() {
                    hint.set_upper(upper.saturating_add(held as u64));
                }
                hint
            }
        }
    }
}

impl std::fmt::Debug for UpstreamIncoming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.inner {
            Inner::Streamed(_) => "streamed",
            Inner::Buffered(_) => "buffered",
            Inner::Replayed { .. } => "replayed",
        };
        f.debug_tuple("UpstreamIncoming").field(&kind).finish()
    }
}

#[cfg(test)]
mod tests;
