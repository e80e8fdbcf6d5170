//! The HTTP servers: the public OpenAI-compatible port, the admin port, the KEDA scaler and
//! the endpoint picker.
//!
//! The public port's request path is one tower stack, built and documented in
//! [`stack::public_service`]; its leaf, a generation request in named phases, is
//! [`proxy`]. This module binds the ports, accepts connections and shuts down.

use std::collections::HashSet;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use http::Request;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::admin;
use crate::epp::Picker;
use crate::keda::publish::Publisher;
use crate::keda::scaler::Scaler;
use crate::keda::Keda;
use crate::probes::{health, scrape};
use crate::profiles::ProfileStore;
use crate::telemetry;
use crate::tenants::{ImplicitKeys, Tenants};
use crate::upstream::UpstreamClient;

pub use crate::app::{App, ServerConfig};

mod agents;
mod connections;
pub(crate) mod delivery;
pub(crate) mod proxy;
mod stack;

use connections::{Conn, Connections, Limits};

pub use delivery::ResponseBody;

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
    epp_addr: Option<SocketAddr>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    scraper: JoinHandle<()>,
    health: Option<JoinHandle<()>>,
    upkeep: JoinHandle<()>,
    publisher: Option<Publisher>,
}

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
        let (epp, epp_addr) = match config.epp_listen {
            Some(addr) => {
                let (listener, addr) = listen("--epp-listen", addr)?;
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
        let tenants = match (&config.tenants, &config.api_keys) {
            (Some(tenants), _) => Some(Arc::clone(tenants)),
            (None, Some(keys)) => Some(Arc::new(Tenants::implicit(implicit_keys(keys)).await)),
            (None, None) => None,
        };
        let keda = Arc::new(Keda::new(config.keda.clone()));
        let app = Arc::new(App::new(config, store, client, keda, tenants));
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
        tasks.push(tokio::spawn(crate::calibration::outcomes::check_files(
            Arc::clone(&app.store),
            Arc::clone(&app.calibrator),
            stopped.clone(),
        )));
        if let Some(listener) = epp {
            let picker = Picker::new(Arc::clone(&app));
            // Envoy multiplexes every request's stream over a few connections: the public
            // port's limits, not the side ports' small cap.
            tasks.push(tokio::spawn(accept_loop(
                listener,
                stopped.clone(),
                Connections::new(limits),
                move |stream, conn, watcher| {
                    serve_grpc(picker.clone().into_service(), stream, conn, watcher)
                },
            )));
        }
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
                move |stream, conn, watcher| {
                    serve_grpc(scaler.clone().into_service(), stream, conn, watcher)
                },
            )));
        }
        tracing::info!(%public_addr, %admin_addr, ?scaler_addr, ?epp_addr, "quantrouter listening");
        Ok(Self {
            app,
            public_addr,
            admin_addr,
            scaler_addr,
            epp_addr,
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

    /// The endpoint picker's address, when it is served.
    pub fn epp_addr(&self) -> Option<SocketAddr> {
        self.epp_addr
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

/// A gRPC service (KEDA's scaler, the endpoint picker) on one connection: HTTP/2 with prior
/// knowledge, as KEDA and Envoy dial it (no TLS here).
fn serve_grpc<S>(grpc: S, stream: TcpStream, conn: Arc<Conn>, watcher: Watcher) -> ServeFuture
where
    S: tower::Service<
            Request<Incoming>,
            Response = http::Response<tonic::body::Body>,
            Error = Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    use tower::ServiceExt as _;
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
        let served = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            // A request body Envoy buffered comes in one message: room for the largest
            // without flow-control round trips, and for many streams' messages at once.
            .initial_stream_window_size(GRPC_STREAM_WINDOW)
            .initial_connection_window_size(4 * GRPC_STREAM_WINDOW)
            .serve_connection(TokioIo::new(conn.track(stream)), service);
        if let Some(Err(error)) = conn.serve(watcher.watch(served)).await {
            tracing::debug!(%error, "gRPC connection ended with an error");
        }
    })
}

/// The HTTP/2 stream window of the gRPC ports: the default body limit and its message's
/// framing.
const GRPC_STREAM_WINDOW: u32 = 5 * 1024 * 1024;

/// The digests of `api_keys` that can match a request; one that never could (whitespace,
/// non-ASCII, too long) is left out (`serve` refuses such a file before this).
fn implicit_keys(keys: &HashSet<String>) -> ImplicitKeys {
    let valid = keys
        .iter()
        .map(String::as_str)
        .filter(|k| quantrouter_policy::is_valid_api_key(k));
    ImplicitKeys::from_keys(valid).unwrap_or_default()
}

#[cfg(test)]
mod tests;
