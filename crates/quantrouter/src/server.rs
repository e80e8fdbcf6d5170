//! The HTTP servers: the public OpenAI-compatible port and the admin port.
//!
//! The public port's request path is one tower stack, built and documented in
//! [`stack::public_service`]; its leaf, a generation request in named phases, is
//! [`proxy`]. This module binds the ports, accepts connections and shuts down.

use std::collections::hash_map::RandomState;
use std::collections::HashSet;
use std::convert::Infallible;
use std::future::Future;
use std::hash::BuildHasher as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderName};
use http::{HeaderMap, HeaderValue, Request};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::admin;
use crate::calibration::Calibrator;
use crate::classifier::ClassifierStore;
use crate::keda::publish::Publisher;
use crate::keda::scaler::Scaler;
use crate::keda::{Keda, KedaConfig};
use crate::openai::ApiError;
use crate::profiles::ProfileStore;
use crate::resilience::ResilienceConfig;
use crate::telemetry;
use crate::traces::Traces;
use crate::upstream::{health, scrape, ClientConfig, UpstreamClient};

mod connections;
mod delivery;
mod proxy;
mod stack;

use connections::{Conn, Connections, Limits};

/// Body of every response: the router's own (errors, JSON) or the upstream's, streamed.
pub type ResponseBody = Either<Full<Bytes>, delivery::Relayed>;

/// Settings of a running router.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub admin_listen: SocketAddr,
    /// KEDA's external scaler (gRPC); `None` serves none.
    pub scaler_listen: Option<SocketAddr>,
    /// Largest accepted request body; 4 MiB holds ~1M tokens of text, beyond any context.
    pub body_limit: usize,
    /// Accepted bearer keys; `None` disables authentication.
    pub api_keys: Option<HashSet<String>>,
    /// Model names besides `auto` that mean adaptive routing.
    pub aliases: Vec<String>,
    pub client: ClientConfig,
    pub resilience: ResilienceConfig,
    /// After SIGTERM, readiness fails at once but connections are still accepted this
    /// long, while the endpoint removal propagates to Services and load balancers.
    pub shutdown_delay: Duration,
    /// How long in-flight requests and streams may then run; with the delay, within the
    /// Helm chart's terminationGracePeriodSeconds.
    pub shutdown_grace: Duration,
    /// Longest a client may take over a request head once it began one. A head is a few
    /// hundred bytes, one or two packets: 10 s covers several retransmissions on a bad link.
    pub client_header_timeout: Duration,
    /// Longest a client may take to send a request body. 60 s carries the largest body
    /// allowed by default (4 MiB) at well under 1 Mbit/s.
    pub client_body_timeout: Duration,
    /// Client connections the public port keeps open at once; `None` derives the cap from
    /// the process's descriptor limit ([`crate::descriptors`]).
    pub max_connections: Option<usize>,
    /// OpenTelemetry tracing, when configured.
    pub traces: Option<Traces>,
    /// Log prompt text with each routing decision.
    pub log_prompts: bool,
    /// The prompt classifier requests are scored with, followed by its own sources.
    pub classifier: Arc<ClassifierStore>,
    /// Cluster-wide tier numbers and scale-from-zero signals for KEDA.
    pub keda: KedaConfig,
}

/// Shared state of one router.
#[derive(Debug)]
pub struct App {
    pub store: Arc<ProfileStore>,
    pub config: ServerConfig,
    pub metrics: PrometheusHandle,
    /// Tier numbers for KEDA and the demand hook of the request path.
    pub keda: Arc<Keda>,
    /// Live agreement sampling (`policy.calibration`): budget, limits and counts.
    pub calibrator: Arc<Calibrator>,
    client: UpstreamClient,
    shutting_down: AtomicBool,
    /// Turns true when the shutdown grace is over: streams still open end then.
    grace_over: watch::Sender<bool>,
    next_id: AtomicU64,
    id_prefix: u32,
}

/// A port that could not be bound, with the flag that sets its address: two routers in one
/// network namespace collide on the fixed default ports, and the operator must see which.
#[derive(Debug, thiserror::Error)]
#[error("binding {flag} {addr}: {error}")]
pub struct BindError {
    /// The flag that sets the address, e.g. `--keda-scaler-listen`.
    pub flag: &'static str,
    pub addr: SocketAddr,
    pub error: std::io::Error,
}

/// A running router; dropping it does not stop it, call [`Server::shutdown`].
#[derive(Debug)]
pub struct Server {
    pub app: Arc<App>,
    public_addr: SocketAddr,
    admin_addr: SocketAddr,
    scaler_addr: Option<SocketAddr>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    scraper: JoinHandle<()>,
    health: Option<JoinHandle<()>>,
    upkeep: JoinHandle<()>,
    publisher: Option<Publisher>,
}

/// The request id header, taken from clients and sent to upstreams and back.
const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

// === impl Server ===

impl Server {
    /// Binds the ports and starts serving them on the current runtime.
    pub async fn start(config: ServerConfig, store: Arc<ProfileStore>) -> Result<Self, BindError> {
        let (public, public_addr) = listen("--listen", config.listen)?;
        let (admin, admin_addr) = listen("--admin-listen", config.admin_listen)?;
        let (scaler, scaler_addr) = match config.scaler_listen {
            Some(addr) => {
                let (listener, addr) = listen("--keda-scaler-listen", addr)?;
                (Some(listener), Some(addr))
            }
            None => (None, None),
        };
        store.configure(config.resilience);
        let client = UpstreamClient::new(config.client.clone());
        let scraper = scrape::spawn(
            Arc::clone(&store),
            client.clone(),
            config.resilience.scrape_interval,
            config.resilience.scrape_timeout,
        );
        let health = (!config.resilience.health_interval.is_zero()).then(|| {
            health::spawn(
                Arc::clone(&store),
                client.clone(),
                config.resilience.health_interval,
                config.resilience.health_timeout,
            )
        });
        let publisher = config
            .keda
            .redis
            .clone()
            .map(|target| Publisher::start(Arc::clone(&store), target, &config.keda));
        let upkeep = telemetry::spawn_upkeep(telemetry::metrics_handle());
        let app = Arc::new(App {
            keda: Arc::new(Keda::new(config.keda.clone())),
            calibrator: Arc::new(Calibrator::new(config.resilience.calibration)),
            store,
            client,
            metrics: telemetry::metrics_handle(),
            config,
            shutting_down: AtomicBool::new(false),
            grace_over: watch::Sender::new(false),
            next_id: AtomicU64::new(0),
            id_prefix: random_id_prefix(),
        });
        let (stop, stopped) = watch::channel(false);
        let (limits, side_port) = connection_limits(&app.config);
        let public_app = Arc::clone(&app);
        let mut tasks = vec![tokio::spawn(accept_loop(
            public,
            stopped.clone(),
            Connections::new(limits),
            move |stream, conn, watcher| {
                serve_public(Arc::clone(&public_app), stream, conn, watcher)
            },
        ))];
        let admin_app = Arc::clone(&app);
        tasks.push(tokio::spawn(accept_loop(
            admin,
            stopped.clone(),
            Connections::new(side_port),
            move |stream, conn, watcher| serve_admin(Arc::clone(&admin_app), stream, conn, watcher),
        )));
        if let Some(listener) = scaler {
            let scaler = Scaler::new(
                Arc::clone(&app.store),
                Arc::clone(&app.keda),
                stopped.clone(),
            );
            tasks.push(tokio::spawn(accept_loop(
                listener,
                stopped,
                Connections::new(side_port),
                move |stream, conn, watcher| serve_scaler(scaler.clone(), stream, conn, watcher),
            )));
        }
        tracing::info!(%public_addr, %admin_addr, ?scaler_addr, "quantrouter listening");
        Ok(Self {
            app,
            public_addr,
            admin_addr,
            scaler_addr,
            stop,
            tasks,
            scraper,
            health,
            upkeep,
            publisher,
        })
    }

    pub fn public_addr(&self) -> SocketAddr {
        self.public_addr
    }

    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// The KEDA external scaler's address, when it is served.
    pub fn scaler_addr(&self) -> Option<SocketAddr> {
        self.scaler_addr
    }

    /// Graceful stop: readiness turns false at once; connections are still accepted for
    /// the shutdown delay (endpoint removal takes a moment to reach every load balancer);
    /// then the listeners close, idle connections close at once (unfinished request heads
    /// included), and in-flight requests and streams get the grace period. Streams still
    /// open after it end with an SSE error event, given [`GRACE_FLUSH`] to reach clients.
    pub async fn shutdown(self) {
        self.app.shutting_down.store(true, Ordering::SeqCst);
        tokio::time::sleep(self.app.config.shutdown_delay).await;
        let _ = self.stop.send(true);
        let grace = self.app.config.shutdown_grace;
        let mut drained = std::pin::pin!(futures_util::future::join_all(self.tasks));
        if tokio::time::timeout(grace, &mut drained).await.is_err() {
            tracing::warn!(
                ?grace,
                "in-flight requests outlived the grace period; ending them"
            );
            self.app.grace_over.send_replace(true);
            let _ = tokio::time::timeout(GRACE_FLUSH, drained).await;
        }
        self.scraper.abort();
        if let Some(health) = self.health {
            health.abort();
        }
        self.upkeep.abort();
        // Last: until the requests above drained they were load KEDA had to see.
        if let Some(publisher) = self.publisher {
            publisher.stop().await;
        }
        if let Some(traces) = self.app.config.traces.clone() {
            // Flushing joins the exporter thread; keep it off the async workers.
            let _ = tokio::task::spawn_blocking(move || traces.shutdown()).await;
        }
    }
}

/// What the public port, and the admin and scaler ports each, allow connections.
fn connection_limits(config: &ServerConfig) -> (Limits, Limits) {
    let max = config.max_connections.unwrap_or_else(|| {
        crate::descriptors::default_max_connections(crate::descriptors::limit())
    });
    tracing::info!(max_connections = max, "client connections capped");
    let public = Limits {
        max,
        header_timeout: config.client_header_timeout,
        // The idle timeout, on the client's side.
        stall_timeout: config.resilience.idle_timeout,
    };
    let side_port = Limits {
        max: SIDE_PORT_CONNECTIONS,
        ..public
    };
    (public, side_port)
}

/// After the grace, how long the error events of the streams it ended have to reach their
/// clients before the process exits. Within the 5 s margin the Helm chart adds to the pod's
/// terminationGracePeriodSeconds.
const GRACE_FLUSH: Duration = Duration::from_secs(1);

/// Connections the admin and the KEDA scaler port each keep open: probes, Prometheus and
/// KEDA need a few; the cap keeps them from taking the descriptors of the public port.
const SIDE_PORT_CONNECTIONS: usize = 32;

/// Connections the kernel queues per listener before they are accepted (capped by
/// `net.core.somaxconn`, 4096 on current kernels). A burst of new clients — a fleet
/// reconnecting after a restart, thousands of streams opened at once — then waits in the
/// queue instead of losing SYNs and retrying a second or more later; tokio's default is 1024.
const LISTEN_BACKLOG: u32 = 4096;

/// A listener on `addr`, set by the flag `flag`, and the address it got (port 0 picks one).
fn listen(flag: &'static str, addr: SocketAddr) -> Result<(TcpListener, SocketAddr), BindError> {
    let bind = || {
        let socket = match addr {
            SocketAddr::V4(_) => TcpSocket::new_v4()?,
            SocketAddr::V6(_) => TcpSocket::new_v6()?,
        };
        // A restarted router binds at once, despite connections of the last one in TIME_WAIT.
        socket.set_reuseaddr(true)?;
        socket.bind(addr)?;
        let listener = socket.listen(LISTEN_BACKLOG)?;
        let local = listener.local_addr()?;
        Ok((listener, local))
    };
    bind().map_err(|error| BindError { flag, addr, error })
}

/// A 32-bit prefix for request ids that differs between replicas: std seeds every
/// `RandomState` from the OS's randomness. The PID it replaces is 1 in every container.
fn random_id_prefix() -> u32 {
    // Any half of the hash is as random as the other; after the shift nothing is cut off.
    (RandomState::new().hash_one(0u8) >> 32) as u32
}

type ServeFuture = std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;

/// Accepts connections until stopped, then closes idle ones and waits for the others to
/// finish. At `connections`' cap a new connection sheds the oldest idle one, or is closed at
/// once when every connection is busy.
async fn accept_loop<F>(
    listener: TcpListener,
    mut stopped: watch::Receiver<bool>,
    connections: Arc<Connections>,
    serve: F,
) where
    F: Fn(TcpStream, Arc<Conn>, Watcher) -> ServeFuture + Send + 'static,
{
    let graceful = GracefulShutdown::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let Some(conn) = connections.accept() else {
                        tracing::debug!(%peer, "every connection busy at the cap; refused");
                        continue;
                    };
                    let _ = stream.set_nodelay(true);
                    tokio::spawn(serve(stream, conn, graceful.watcher()));
                    if connections.shedding() {
                        tokio::task::yield_now().await;
                    }
                }
                // Out of file descriptors and the like: back off instead of spinning.
                Err(error) => {
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            _ = stopped.changed() => break,
        }
    }
    drop(listener);
    connections.stop();
    graceful.shutdown().await;
}

/// The public port speaks HTTP/1.1 and HTTP/2 with prior knowledge (h2c), told apart by the
/// HTTP/2 preface: an ingress or sidecar in front (Envoy, Istio) can multiplex many streams
/// over a few connections instead of holding a descriptor per open stream.
fn serve_public(
    app: Arc<App>,
    stream: TcpStream,
    conn: Arc<Conn>,
    watcher: Watcher,
) -> ServeFuture {
    let service = stack::public_service(app, Arc::clone(&conn));
    Box::pin(async move {
        let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
        let served = builder.serve_connection(TokioIo::new(conn.track(stream)), service);
        if let Some(Err(error)) = conn.serve(watcher.watch(served)).await {
            tracing::debug!(%error, "connection ended with an error");
        }
    })
}

fn serve_admin(app: Arc<App>, stream: TcpStream, conn: Arc<Conn>, watcher: Watcher) -> ServeFuture {
    let requests = Arc::clone(&conn);
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let app = Arc::clone(&app);
        let request = requests.request(req.version());
        async move { Ok::<_, Infallible>(admin::handle(&app, req).await.map(|b| request.hold(b))) }
    });
    Box::pin(async move {
        let served = hyper::server::conn::http1::Builder::new()
            .serve_connection(TokioIo::new(conn.track(stream)), service);
        if let Some(Err(error)) = conn.serve(watcher.watch(served)).await {
            tracing::debug!(%error, "admin connection ended with an error");
        }
    })
}

fn serve_scaler(
    scaler: Scaler,
    stream: TcpStream,
    conn: Arc<Conn>,
    watcher: Watcher,
) -> ServeFuture {
    use tower::ServiceExt as _;
    let grpc = scaler.into_service();
    let requests = Arc::clone(&conn);
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let request = requests.request(req.version());
        let answer = grpc.clone().oneshot(req);
        async move {
            let response = answer.await.unwrap_or_else(|never| match never {});
            Ok::<_, Infallible>(response.map(|body| request.hold(body)))
        }
    });
    Box::pin(async move {
        // gRPC is HTTP/2 only; KEDA connects with prior knowledge (no TLS here).
        let served = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .serve_connection(TokioIo::new(conn.track(stream)), service);
        if let Some(Err(error)) = conn.serve(watcher.watch(served)).await {
            tracing::debug!(%error, "scaler connection ended with an error");
        }
    })
}

/// A generated request id, `qr-<process prefix, 8 hex digits>-<counter in hex>`.
fn request_id(prefix: u32, n: u64) -> HeaderValue {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut text = [0u8; 28];
    text[..3].copy_from_slice(b"qr-");
    for (i, byte) in text[3..11].iter_mut().enumerate() {
        *byte = HEX[(prefix >> (28 - 4 * i) & 0xf) as usize];
    }
    text[11] = b'-';
    let digits = (64 - n.leading_zeros()).div_ceil(4).max(1) as usize;
    for (i, byte) in text[12..12 + digits].iter_mut().enumerate() {
        *byte = HEX[(n >> (4 * (digits - 1 - i)) & 0xf) as usize];
    }
    HeaderValue::from_bytes(&text[..12 + digits]).unwrap_or(HeaderValue::from_static("qr"))
}

// === impl App ===

impl App {
    /// A new request id, `qr-<prefix>-<counter>`.
    fn next_request_id(&self) -> HeaderValue {
        request_id(self.id_prefix, self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    fn authorize(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let Some(keys) = &self.config.api_keys else {
            return Ok(());
        };
        let token = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        match token {
            Some(token) if keys.contains(token) => Ok(()),
            _ => Err(ApiError::Unauthorized),
        }
    }

    /// Ready: not shutting down and the active set has somewhere to send requests.
    pub fn ready(&self) -> bool {
        !self.shutting_down.load(Ordering::SeqCst) && self.store.load().ready()
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([0, 0, 0, 0], 8080)),
            admin_listen: SocketAddr::from(([0, 0, 0, 0], 9090)),
            scaler_listen: None,
            body_limit: 4 * 1024 * 1024,
            api_keys: None,
            aliases: Vec::new(),
            client: ClientConfig::default(),
            resilience: ResilienceConfig::default(),
            shutdown_delay: Duration::ZERO,
            shutdown_grace: Duration::from_secs(25),
            client_header_timeout: Duration::from_secs(10),
            client_body_timeout: Duration::from_secs(60),
            max_connections: None,
            traces: None,
            log_prompts: false,
            classifier: Arc::new(ClassifierStore::default()),
            keda: KedaConfig::default(),
        }
    }
}

#[cfg(test)]
mod tests;
