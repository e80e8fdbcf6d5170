//! The HTTP servers: the public OpenAI-compatible port and the admin port.
//!
//! The public request path reads top-down: [`handle`] takes or assigns the request id and
//! dispatches; a generation request goes auth → content type → bounded body read
//! → parse ([`crate::openai`]) → decision ([`crate::routing`]) → upstream
//! ([`crate::upstream`]), and the upstream body streams back frame by frame.

use std::collections::HashSet;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt as _;
use http::header::{self, HeaderName};
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, Version};
use http_body::Body as _;
use http_body_util::{BodyExt, Either, Full, LengthLimitError, Limited};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use metrics_exporter_prometheus::PrometheusHandle;
use opentelemetry::KeyValue;
use quantrouter_policy::{Reason, RoutingDecision};
use serde::Deserialize;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::Instrument;

use crate::admin;
use crate::classifier::ClassifierStore;
use crate::keda::publish::Publisher;
use crate::keda::scaler::Scaler;
use crate::keda::{Keda, KedaConfig};
use crate::openai::{ApiError, Endpoint, ParsedRequest, Usage};
use crate::profiles::{ProfileStore, Snapshot};
use crate::resilience::retry::{self, Answer, Fallback, FallbackReason, Plan};
use crate::resilience::ResilienceConfig;
use crate::routing::{self, PromptSize, AUTO_MODEL};
use crate::telemetry::{self, RequestLabels};
use crate::traces::{RequestTrace, Traces};
use crate::upstream::{
    health, scrape, BodyEvent, BodyLimits, ClientConfig, UpstreamBody, UpstreamClient,
};
use crate::workers;

mod connections;
mod delivery;

use connections::{Conn, Connections, Limits};

/// Body of every response: the router's own (errors, JSON) or the upstream's, streamed.
pub type ResponseBody = Either<Full<Bytes>, UpstreamBody>;

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
    /// Threads serving the public port, each with its own runtime ([`crate::workers`]).
    pub workers: usize,
    /// Whether each of those threads is pinned to a CPU of its own.
    pub pin_workers: workers::Pinning,
}

/// Shared state of one router.
#[derive(Debug)]
pub struct App {
    pub store: Arc<ProfileStore>,
    pub config: ServerConfig,
    pub metrics: PrometheusHandle,
    /// Tier numbers for KEDA and the demand hook of the request path.
    pub keda: Arc<Keda>,
    client: UpstreamClient,
    shutting_down: AtomicBool,
    /// Turns true when the shutdown grace is over: streams still open end then.
    grace_over: watch::Sender<bool>,
    next_id: AtomicU64,
    id_prefix: u32,
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
    trim: JoinHandle<()>,
    publisher: Option<Publisher>,
}

const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
const HOP_BY_HOP: [HeaderName; 6] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::TRAILER,
];
/// Client headers worth passing to vLLM; everything else (API keys above all) stays here.
const FORWARDED: [HeaderName; 5] = [
    header::ACCEPT,
    header::USER_AGENT,
    HeaderName::from_static("traceparent"),
    HeaderName::from_static("tracestate"),
    HeaderName::from_static("openai-organization"),
];

// === impl Server ===

impl Server {
    /// Binds the ports and starts serving: the public port on `config.workers` threads of its
    /// own ([`crate::workers`]), everything else on the current runtime.
    pub async fn start(config: ServerConfig, store: Arc<ProfileStore>) -> std::io::Result<Self> {
        let public = workers::bind(config.listen, config.workers, LISTEN_BACKLOG)?;
        let cpus = workers::cpus(config.pin_workers, config.workers);
        if let Some(cpus) = &cpus {
            tracing::info!(?cpus, "each worker pinned to a CPU of its own");
        }
        let public_addr = public[0].local_addr()?;
        let admin = listen(config.admin_listen)?;
        let scaler = match config.scaler_listen {
            Some(addr) => Some(listen(addr)?),
            None => None,
        };
        let admin_addr = admin.local_addr()?;
        let scaler_addr = scaler.as_ref().map(TcpListener::local_addr).transpose()?;
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
        let trim = crate::allocator::spawn_trim();
        let app = Arc::new(App {
            keda: Arc::new(Keda::new(config.keda.clone())),
            store,
            client,
            metrics: telemetry::metrics_handle(),
            config,
            shutting_down: AtomicBool::new(false),
            grace_over: watch::Sender::new(false),
            next_id: AtomicU64::new(0),
            id_prefix: std::process::id() ^ (Instant::now().elapsed().subsec_nanos()),
        });
        let (stop, stopped) = watch::channel(false);
        let public_app = Arc::clone(&app);
        let public_stopped = stopped.clone();
        let (limits, side_port) = connection_limits(&app.config);
        let serve_worker = move |listener| {
            let app = Arc::clone(&public_app);
            let connections = Connections::new(limits);
            accept_loop(
                listener,
                public_stopped.clone(),
                connections,
                move |stream, conn, watcher| serve_public(Arc::clone(&app), stream, conn, watcher),
            )
        };
        // The workers' ends are awaited like the tasks below.
        let mut tasks: Vec<JoinHandle<()>> = workers::spawn(public, cpus.as_deref(), serve_worker)?
            .into_iter()
            .map(|finished| tokio::spawn(async { finished.await.unwrap_or_default() }))
            .collect();
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
            trim,
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
        self.trim.abort();
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

/// What each public worker's listener, and the admin and scaler ports', allow connections.
fn connection_limits(config: &ServerConfig) -> (Limits, Limits) {
    let max = config.max_connections.unwrap_or_else(|| {
        crate::descriptors::default_max_connections(crate::descriptors::limit(), config.workers)
    });
    tracing::info!(max_connections = max, "client connections capped");
    let public = Limits {
        // The kernel spreads new connections evenly over the workers' sockets.
        max: max.div_ceil(config.workers.max(1)),
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

fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = workers::socket(addr)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
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
    let service = public_service(app, Arc::clone(&conn));
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

/// The public request path: [`handle`], boxed — the request's whole state machine (~3 KB)
/// is freed once the response head is out. Inline, an HTTP/2 stream's task would hold it for
/// as long as the body streams — minutes for a long generation. Its response goes out
/// through [`delivery`], the request counted in flight on `conn` until it is sent.
fn public_service(
    app: Arc<App>,
    conn: Arc<Conn>,
) -> impl hyper::service::Service<
    Request<Incoming>,
    Response = Response<delivery::Delivered>,
    Error = Infallible,
    Future = impl Future<Output = Result<Response<delivery::Delivered>, Infallible>> + Send,
> + Clone {
    hyper::service::service_fn(move |req: Request<Incoming>| {
        let app = Arc::clone(&app);
        let request = conn.request(req.version());
        let http1 = req.version() < Version::HTTP_2;
        let watched = Arc::clone(&app);
        Box::pin(handle(app, req).map(move |response| {
            Ok(delivery::deliver(response, request, http1, |upstream| {
                delivery::Watch {
                    deadline: upstream.deadline(),
                    idle: watched.config.resilience.idle_timeout,
                    grace_over: watched.grace_over.subscribe(),
                }
            }))
        }))
    })
}

/// The request's id: its `x-request-id` (1 to 128 bytes), else `qr-<prefix>-<counter>`.
/// Every log line, upstream call and the response carry it.
fn request_id_of(app: &App, headers: &HeaderMap) -> HeaderValue {
    match headers.get(&REQUEST_ID) {
        Some(v) if !v.is_empty() && v.len() <= 128 => v.clone(),
        _ => request_id(app.id_prefix, app.next_id.fetch_add(1, Ordering::Relaxed)),
    }
}

/// The request's future: [`dispatch`] in the request's span. The layers of the request
/// path (`handle`, `dispatch`, `proxy`, `route_and_forward`) are plain functions returning
/// an `async move` block rather than `async fn`s: an `async fn` keeps its arguments twice in
/// its state (as captured and as locals), so each layer added a copy of the request (~300
/// bytes) to a state machine that is moved, whole, into its caller's; and what a layer
/// takes by value it holds until it ends, even once passed on. So the request's head is
/// split off here and lent down, only the body moves, and the upstream request is lent to
/// `UpstreamClient::send`: the boxed state came down from 5.9 to 3.0 KB
/// (`rustc +nightly -Zprint-type-sizes`), 2.9 KB less per request in flight.
fn handle(
    app: Arc<App>,
    req: Request<Incoming>,
) -> impl Future<Output = Response<ResponseBody>> + Send {
    let (parts, body) = req.into_parts();
    let id = request_id_of(&app, &parts.headers);
    // Debug lines of a request carry its id through this span. It is a debug span: at the
    // default level an enabled span per request (its registry slot and formatted fields)
    // cost ~5-10% of the router's saturation throughput, so the few info and warn lines of
    // a request name `request_id` themselves.
    let span = tracing::debug_span!("request", id = id.to_str().unwrap_or_default());
    dispatch(app, parts, body, id).instrument(span)
}

// An `async move` block, not an `async fn`: see `handle`.
#[allow(clippy::manual_async_fn)]
fn dispatch(
    app: Arc<App>,
    parts: http::request::Parts,
    body: Incoming,
    id: HeaderValue,
) -> impl Future<Output = Response<ResponseBody>> + Send {
    async move {
        let started = Instant::now();
        // An HTTP/1.1 request whose body may be left unread by an early rejection (see below).
        let unread_body = parts.version < Version::HTTP_2 && !body.is_end_stream();
        let result = match (&parts.method, parts.uri.path()) {
            (&Method::POST, "/v1/chat/completions") => {
                proxy(&app, &parts, body, Endpoint::Chat, started, &id).await
            }
            (&Method::POST, "/v1/completions") => {
                proxy(&app, &parts, body, Endpoint::Completions, started, &id).await
            }
            (&Method::GET, "/v1/models") => models(&app, &parts.headers),
            (&Method::POST, "/v1/route") => dry_run(&app, &parts, body, &id).await,
            (_, "/v1/chat/completions" | "/v1/completions" | "/v1/models" | "/v1/route") => {
                Err(ApiError::MethodNotAllowed)
            }
            (_, path) => Err(ApiError::RouteNotFound(path.to_owned())),
        };
        let mut response = result.unwrap_or_else(|error| {
            let code = error.kind().1;
            telemetry::router_error(code);
            // What a client sent can be quoted in the message, prompt text included.
            match error.quotes_request() && !app.config.log_prompts {
                true => tracing::debug!(code, "request rejected"),
                false => tracing::debug!(%error, code, "request rejected"),
            }
            let close = unread_body && error.before_body();
            let mut response = error.into_response().map(Either::Left);
            if close {
                // The body was not read, so the connection cannot carry another request. Say
                // so: left to hyper, the close can come after the head went out without it,
                // and a client that reuses the connection sees it drop without an answer.
                response
                    .headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            response
        });
        response.headers_mut().insert(REQUEST_ID, id);
        response
    }
}

/// A generation request, in a request span when tracing is on.
// An `async move` block, not an `async fn`: see `handle`.
#[allow(clippy::manual_async_fn)]
fn proxy<'a>(
    app: &'a App,
    parts: &'a http::request::Parts,
    body: Incoming,
    endpoint: Endpoint,
    started: Instant,
    id: &'a HeaderValue,
) -> impl Future<Output = Result<Response<ResponseBody>, ApiError>> + Send + 'a {
    async move {
        let trace = app
            .config
            .traces
            .as_ref()
            .map(|traces| RequestTrace::start(traces, &parts.headers, endpoint.path()));
        let result =
            route_and_forward(app, parts, body, endpoint, started, trace.as_ref(), id).await;
        if let (Err(error), Some(trace)) = (&result, &trace) {
            // Spans leave the process like logs: no quoted request there either.
            let message = match error.quotes_request() && !app.config.log_prompts {
                true => error.kind().1.to_owned(),
                false => error.to_string(),
            };
            trace.fail(error.status().as_u16(), message);
        }
        result
    }
}

// An `async move` block, not an `async fn`: see `handle`.
#[allow(clippy::manual_async_fn)]
fn route_and_forward<'a>(
    app: &'a App,
    parts: &'a http::request::Parts,
    body: Incoming,
    endpoint: Endpoint,
    started: Instant,
    trace: Option<&'a RequestTrace>,
    id: &'a HeaderValue,
) -> impl Future<Output = Result<Response<ResponseBody>, ApiError>> + Send + 'a {
    async move {
        app.authorize(&parts.headers)?;
        check_content_type(&parts.headers)?;
        let body = read_body(app, body, &parts.headers).await?;
        let key = id.to_str().unwrap_or_default();
        let parsed = ParsedRequest::parse(&body, endpoint)?;
        let snapshot = app.store.load();
        let classifier = app.config.classifier.load();
        let routed = routing::route(
            &snapshot,
            classifier.model.as_ref(),
            &parsed,
            &parts.headers,
            &app.config.aliases,
            key,
        )?;
        let decision = routed.decision;
        app.keda.on_route(&snapshot, decision.profile);
        if let Some(cold) = routed.cold_preferred {
            app.keda.on_route(&snapshot, cold);
        }
        let resilience = &app.config.resilience;
        let deadline =
            started + routing::timeout(&parts.headers)?.unwrap_or(resilience.default_deadline);
        if let Some((cold, timeout)) = routed.wait_for {
            // Scale from zero: wait (counted in the tier's queue depth, which activates KEDA)
            // for the preferred tier's first endpoint.
            let timeout = timeout.min(deadline.saturating_duration_since(Instant::now()));
            if !snapshot.pools[cold].wait_for_endpoints(timeout).await {
                let id = &snapshot.set.profiles[cold].id;
                return Err(ApiError::Unavailable(format!(
                    "profile {id} is scaled to zero and got no endpoint within {timeout:?}"
                )));
            }
        }
        let chosen = &snapshot.set.profiles[decision.profile];
        if app.config.log_prompts {
            let prompt: Vec<&str> = parsed.prompt().segments.iter().map(|s| s.text).collect();
            tracing::info!(request_id = key, profile = %chosen.id, reason = decision.reason.as_str(),
            complexity = decision.complexity, prompt = %prompt.join("\n"), "routed");
        } else {
            tracing::debug!(profile = %chosen.id, reason = decision.reason.as_str(),
            complexity = decision.complexity, "routed");
        }
        if let Some(trace) = trace {
            let profile = chosen;
            trace.record(
                "route",
                vec![
                    KeyValue::new("quantrouter.profile", profile.id.clone()),
                    KeyValue::new("quantrouter.tier", profile.tier.clone()),
                    KeyValue::new("quantrouter.reason", decision.reason.as_str()),
                    KeyValue::new("quantrouter.complexity", decision.complexity),
                    KeyValue::new(
                        "quantrouter.task_class",
                        format!("{:?}", decision.task_class),
                    ),
                ],
            );
        }
        let headers = upstream_headers(&parts.headers, id);
        let plan = Plan {
            snapshot: &snapshot,
            decision: &decision,
            pinned: decision.reason == Reason::Pinned,
            stream: parsed.stream,
            wants_json: parsed.wants_json,
            path: endpoint.path(),
            headers: &headers,
            started,
            deadline,
            trace,
            request_id: key,
        };
        let body_for = |profile: usize| parsed.upstream_body(&body, &snapshot.model_json[profile]);
        telemetry::routed(decision.complexity, started.elapsed());
        let answer = retry::forward(&app.client, resilience, &plan, &body_for).await?;
        let limits = BodyLimits {
            idle: resilience.idle_timeout,
            deadline,
            first_output_by: answer.sent_at + app.client.header_timeout,
            sse: false,
            strip_usage: parsed.adds_usage(),
        };
        let finish_trace = trace.map(|trace| {
            let trace = trace.clone();
            let served = Served::of(&answer);
            let status = answer.response.status();
            let base = span_attributes(&snapshot, &served, status, None, &parsed);
            move |usage: Option<Usage>| {
                let mut attributes = base;
                if let Some(usage) = usage {
                    attributes.extend(usage_attributes(usage));
                }
                trace.finish(attributes);
            }
        });
        Ok(respond_streaming(
            &snapshot,
            &decision,
            answer,
            limits,
            started,
            routed.prompt,
            finish_trace,
        ))
    }
}

/// How a request was served, for the response headers and metric labels.
#[derive(Debug)]
struct Served {
    profile: usize,
    attempts: u32,
    fallback: Option<Fallback>,
}

impl Served {
    fn of(answer: &Answer) -> Self {
        Self {
            profile: answer.profile,
            attempts: answer.attempts,
            fallback: answer.fallback,
        }
    }

    fn reason(&self, decision: &RoutingDecision) -> Reason {
        match self.fallback {
            Some(Fallback {
                reason: FallbackReason::Quality,
                ..
            }) => Reason::FallbackQuality,
            Some(_) => Reason::FallbackError,
            None => decision.reason,
        }
    }

    fn labels(&self, snapshot: &Snapshot, decision: &RoutingDecision) -> RequestLabels {
        RequestLabels {
            profile: Arc::clone(&snapshot.telemetry[self.profile]),
            reason: self.reason(decision),
        }
    }
}

/// The upstream's response head and streamed body, with the router's headers.
fn respond_streaming(
    snapshot: &Snapshot,
    decision: &RoutingDecision,
    answer: Answer,
    mut limits: BodyLimits,
    started: Instant,
    prompt: PromptSize,
    finish_trace: Option<impl FnOnce(Option<Usage>) + Send + Sync + 'static>,
) -> Response<ResponseBody> {
    let served = Served::of(&answer);
    let profile = served.profile;
    let pool = Arc::clone(&snapshot.pools[profile]);
    let Answer { response, held, .. } = answer;
    let labels = served.labels(snapshot, decision);
    telemetry::response_headers(&labels, response.status().as_u16());
    let (mut head, incoming) = response.into_parts();
    limits.sse = head
        .headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    if !limits.sse {
        // Not a stream: the first token comes with the head (vLLM, and any server that
        // answers whole). A stream reports its first output event below.
        telemetry::first_token(&labels, started.elapsed());
    }
    finish_head(&mut head, snapshot, decision, &served);
    let prices = Prices::new(snapshot, profile);
    let mut finish_trace = finish_trace;
    let on_event = Box::new(move |event| match event {
        BodyEvent::FirstOutput(elapsed) => telemetry::first_token(&labels, elapsed),
        BodyEvent::End(end) => {
            if let Some(failure) = end.failure {
                telemetry::upstream_error(labels.profile.id(), failure.kind());
            }
            if let Some(usage) = end.usage {
                prices.record(&labels, usage);
                prompt.observe(&pool, usage);
            }
            if let Some(finish) = finish_trace.take() {
                finish(end.usage);
            }
            telemetry::finished(&labels, end.elapsed);
        }
    });
    let body = UpstreamBody::new(incoming, held, started, limits, on_event);
    Response::from_parts(head, Either::Right(body))
}

/// Attributes of a finished request span (HTTP and `gen_ai.*` conventions).
fn span_attributes(
    snapshot: &Snapshot,
    served: &Served,
    status: StatusCode,
    usage: Option<Usage>,
    parsed: &ParsedRequest<'_>,
) -> Vec<KeyValue> {
    let profile = &snapshot.set.profiles[served.profile];
    let mut attributes = vec![
        KeyValue::new("http.response.status_code", i64::from(status.as_u16())),
        KeyValue::new("gen_ai.request.model", parsed.model.to_string()),
        KeyValue::new("gen_ai.response.model", profile.model.clone()),
        KeyValue::new("quantrouter.profile", profile.id.clone()),
        KeyValue::new("quantrouter.tier", profile.tier.clone()),
        KeyValue::new("quantrouter.attempts", i64::from(served.attempts)),
    ];
    if let Some(usage) = usage {
        attributes.extend(usage_attributes(usage));
    }
    attributes
}

fn usage_attributes(usage: Usage) -> [KeyValue; 2] {
    let tokens = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    [
        KeyValue::new("gen_ai.usage.input_tokens", tokens(usage.prompt_tokens)),
        KeyValue::new(
            "gen_ai.usage.output_tokens",
            tokens(usage.completion_tokens),
        ),
    ]
}

/// Per-token prices of the serving profile and of `default_profile`, for cost and savings.
#[derive(Debug, Clone, Copy)]
struct Prices {
    actual: (f64, f64),
    counterfactual: (f64, f64),
}

impl Prices {
    fn new(snapshot: &Snapshot, profile: usize) -> Self {
        let per_token = |p: &quantrouter_policy::Profile| {
            (
                p.cost_per_1m_input_tokens / 1e6,
                p.cost_per_1m_output_tokens / 1e6,
            )
        };
        let actual = per_token(&snapshot.set.profiles[profile]);
        let counterfactual = snapshot
            .set
            .profile(&snapshot.set.default_profile)
            .map_or(actual, per_token);
        Self {
            actual,
            counterfactual,
        }
    }

    fn record(&self, labels: &RequestLabels, usage: Usage) {
        let cost = |(input, output): (f64, f64)| {
            usage.prompt_tokens as f64 * input + usage.completion_tokens as f64 * output
        };
        telemetry::usage(
            labels,
            usage.prompt_tokens,
            usage.completion_tokens,
            cost(self.actual),
            cost(self.counterfactual),
        );
    }
}

/// Drops hop-by-hop headers and adds the `x-quantrouter-*` ones.
fn finish_head(
    head: &mut http::response::Parts,
    snapshot: &Snapshot,
    decision: &RoutingDecision,
    served: &Served,
) {
    const PROFILE: HeaderName = HeaderName::from_static("x-quantrouter-profile");
    const TIER: HeaderName = HeaderName::from_static("x-quantrouter-tier");
    const REASON: HeaderName = HeaderName::from_static("x-quantrouter-reason");
    const ATTEMPTS: HeaderName = HeaderName::from_static("x-quantrouter-attempts");
    const COMPLEXITY: HeaderName = HeaderName::from_static("x-quantrouter-complexity");
    let headers = &mut head.headers;
    // Looked for before removal: a removal hashes the name, a look at the few names an
    // upstream sends compares them.
    if headers.keys().any(|name| HOP_BY_HOP.contains(name)) {
        // Headers the upstream's `Connection` names are hop-by-hop too (RFC 9110 §7.6.1).
        let named: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|token| HeaderName::from_bytes(token.trim().as_bytes()).ok())
            .collect();
        for name in HOP_BY_HOP.iter().chain(&named) {
            headers.remove(name);
        }
    }
    let telemetry = &snapshot.telemetry[served.profile];
    let values = [
        (PROFILE, telemetry.profile_header.clone()),
        (TIER, telemetry.tier_header.clone()),
        (
            REASON,
            Some(HeaderValue::from_static(served.reason(decision).as_str())),
        ),
        (ATTEMPTS, Some(attempts_header(served.attempts))),
        (COMPLEXITY, complexity_header(decision.complexity)),
    ];
    for (name, value) in values {
        if let Some(value) = value {
            headers.insert(name, value);
        }
    }
    if let Some(f) = served.fallback {
        let value = format!(
            "from={}; to={}; reason={}",
            snapshot.set.profiles[f.from].id,
            snapshot.set.profiles[f.to].id,
            f.reason.as_str()
        );
        if let Ok(v) = HeaderValue::from_str(&value) {
            headers.insert(HeaderName::from_static("x-quantrouter-fallback"), v);
        }
    }
}

/// `x-quantrouter-attempts`: a static value for the usual few attempts.
fn attempts_header(attempts: u32) -> HeaderValue {
    const SMALL: [&str; 10] = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"];
    match SMALL.get(attempts as usize) {
        Some(s) => HeaderValue::from_static(s),
        None => HeaderValue::from(attempts),
    }
}

/// `x-quantrouter-complexity`: the score with three decimals, exactly as `{:.3}` writes it.
/// A score in [0, 1] not within a hair of a rounding tie is written directly; the
/// formatter's exact decimal expansion cost ~1,000 instructions per request.
fn complexity_header(score: f64) -> Option<HeaderValue> {
    let scaled = score * 1000.0;
    let near_tie = (scaled - scaled.floor() - 0.5).abs() < 1e-6;
    if near_tie || !(0.0..=1.0).contains(&score) || score.is_sign_negative() {
        return HeaderValue::from_str(&format!("{score:.3}")).ok();
    }
    // In 0..=1000 by the check above.
    let milli = scaled.round() as u32;
    let digit = |n: u32| b'0' + (n % 10) as u8;
    let text = [
        digit(milli / 1000),
        b'.',
        digit(milli / 100),
        digit(milli / 10),
        digit(milli),
    ];
    HeaderValue::from_bytes(&text).ok()
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

/// Headers for every upstream attempt: JSON content type, the client headers worth
/// forwarding, and the request id.
fn upstream_headers(client: &HeaderMap, request_id: &HeaderValue) -> HeaderMap {
    let mut headers = HeaderMap::with_capacity(FORWARDED.len() + 2);
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    for name in &FORWARDED {
        if let Some(v) = client.get(name) {
            headers.insert(name.clone(), v.clone());
        }
    }
    headers.insert(REQUEST_ID, request_id.clone());
    headers
}

fn check_content_type(headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(value) = headers.get(header::CONTENT_TYPE) else {
        return Ok(());
    };
    let essence = value
        .to_str()
        .unwrap_or_default()
        .split(';')
        .next()
        .unwrap_or_default()
        .trim();
    if essence.eq_ignore_ascii_case("application/json") {
        Ok(())
    } else {
        Err(ApiError::UnsupportedMediaType)
    }
}

/// Reads the whole body within the client body timeout, refusing more than the body limit
/// (early, from Content-Length, when the client declares it).
async fn read_body(app: &App, body: Incoming, headers: &HeaderMap) -> Result<Bytes, ApiError> {
    let limit = app.config.body_limit;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ApiError::PayloadTooLarge { limit });
    }
    let timeout = app.config.client_body_timeout;
    let read = tokio::time::timeout(timeout, Limited::new(body, limit).collect());
    let Ok(read) = read.await else {
        // Unread, the rest of the body makes hyper close the connection after the answer.
        return Err(ApiError::InvalidRequest {
            message: format!("the request body did not arrive within {timeout:?}"),
            param: None,
        });
    };
    match read {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
            Err(ApiError::PayloadTooLarge { limit })
        }
        Err(e) => Err(ApiError::InvalidRequest {
            message: format!("failed to read the request body: {e}"),
            param: None,
        }),
    }
}

fn json_response(status: StatusCode, value: &serde_json::Value) -> Response<ResponseBody> {
    let mut response = Response::new(Either::Left(Full::new(Bytes::from(value.to_string()))));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// `GET /v1/models`: `auto`, the aliases and every enabled profile id.
fn models(app: &App, headers: &HeaderMap) -> Result<Response<ResponseBody>, ApiError> {
    app.authorize(headers)?;
    let snapshot = app.store.load();
    let entry = |id: &str| serde_json::json!({"id": id, "object": "model", "created": 0, "owned_by": "quantrouter"});
    let data: Vec<serde_json::Value> = std::iter::once(AUTO_MODEL)
        .chain(app.config.aliases.iter().map(String::as_str))
        .chain(
            snapshot
                .set
                .profiles
                .iter()
                .filter(|p| p.enabled)
                .map(|p| p.id.as_str()),
        )
        .map(entry)
        .collect();
    Ok(json_response(
        StatusCode::OK,
        &serde_json::json!({"object": "list", "data": data}),
    ))
}

/// `POST /v1/route`: the decision for a chat or completion body, with every candidate.
async fn dry_run(
    app: &App,
    parts: &http::request::Parts,
    body: Incoming,
    id: &HeaderValue,
) -> Result<Response<ResponseBody>, ApiError> {
    #[derive(Deserialize)]
    struct Shape {
        #[serde(default)]
        messages: Option<serde::de::IgnoredAny>,
    }
    app.authorize(&parts.headers)?;
    check_content_type(&parts.headers)?;
    let body = read_body(app, body, &parts.headers).await?;
    let started = Instant::now();
    let endpoint = match serde_json::from_slice::<Shape>(&body) {
        Ok(Shape { messages: None }) => Endpoint::Completions,
        _ => Endpoint::Chat,
    };
    let parsed = ParsedRequest::parse(&body, endpoint)?;
    let snapshot = app.store.load();
    let classifier = app.config.classifier.load();
    let model = classifier.model.as_ref();
    let key = id.to_str().unwrap_or_default();
    let routed = routing::route(
        &snapshot,
        model,
        &parsed,
        &parts.headers,
        &app.config.aliases,
        key,
    )?;
    let decision_us = started.elapsed().as_secs_f64() * 1e6;
    let prompt = parsed.prompt();
    let top = model.map_or_else(Vec::new, |m| {
        routing::top_features(&snapshot.set, m, &prompt)
    });
    let classification = routed.classification.as_ref();
    let explain = routing::explain(
        &snapshot.set,
        &routed.decision,
        classification,
        &top,
        decision_us,
    );
    Ok(json_response(StatusCode::OK, &explain))
}

// === impl App ===

impl App {
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
            workers: workers::default_count(),
            pin_workers: workers::Pinning::default(),
        }
    }
}

#[cfg(test)]
mod tests;
