//! The state every request of a router shares ([`App`]) and the settings it runs with
//! ([`ServerConfig`]). Its own module so that the servers and the admin port both depend on
//! it and not on each other.

use std::collections::hash_map::RandomState;
use std::collections::HashSet;
use std::hash::BuildHasher as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, HeaderValue};
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::sync::watch;

use crate::apis::stored::{ResponseStore, StoreConfig};
use crate::calibration::outcomes::OutcomeLog;
use crate::calibration::Calibrator;
use crate::classifier::ClassifierStore;
use crate::keda::{Keda, KedaConfig};
use crate::openai::ApiError;
use crate::profiles::ProfileStore;
use crate::resilience::ResilienceConfig;
use crate::telemetry;
use crate::tenants::{ActiveTenant, Tenants};
use crate::traces::Traces;
use crate::upstream::{ClientConfig, UpstreamClient};

/// Settings of a running router.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The public port: all interfaces, so a Service reaches the pod; 8080 is the usual
    /// unprivileged HTTP port.
    pub listen: SocketAddr,
    /// The admin port: its own, so a network policy can keep metrics and profiles private.
    pub admin_listen: SocketAddr,
    /// KEDA's external scaler (gRPC); `None` serves none.
    pub scaler_listen: Option<SocketAddr>,
    /// The endpoint picker for a Gateway (Envoy ext_proc, gRPC); `None` serves none.
    pub epp_listen: Option<SocketAddr>,
    /// The picker reads every answer's body for its usage (tokens, cost and savings
    /// metrics), not only those whose books need it; off, as each answer read costs the
    /// Gateway a round trip per chunk.
    pub epp_reads_answers: bool,
    /// Largest accepted request body; 4 MiB holds ~1M tokens of text, beyond any context.
    pub body_limit: usize,
    /// Accepted bearer keys, the implicit tenant's when `tenants` is `None`; with neither,
    /// no authentication.
    pub api_keys: Option<HashSet<String>>,
    /// Tenants: keys, limits and routing bounds of each caller.
    pub tenants: Option<Arc<Tenants>>,
    /// Model names besides `auto` that mean adaptive routing.
    pub aliases: Vec<String>,
    pub client: ClientConfig,
    pub resilience: ResilienceConfig,
    /// After SIGTERM, readiness fails at once but connections are still accepted this
    /// long, while the endpoint removal propagates to Services and load balancers. None
    /// without a load balancer to drain from; the Helm chart sets it.
    pub shutdown_delay: Duration,
    /// How long in-flight requests and streams may then run; inside Kubernetes' default
    /// 30 s termination grace, with time left to exit cleanly.
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
    /// Where stored Responses live (per replica, or shared through Redis).
    pub stored_responses: StoreConfig,
}

/// Shared state of one router.
#[derive(Debug)]
pub struct App {
    pub store: Arc<ProfileStore>,
    pub config: ServerConfig,
    pub metrics: PrometheusHandle,
    /// Tier numbers for KEDA and the demand hook of the request path.
    pub keda: Arc<Keda>,
    /// Who may call and within which limits: the configured tenants, or the implicit
    /// tenant of `api_keys`; `None`: no authentication.
    pub tenants: Option<Arc<Tenants>>,
    /// Live agreement sampling (`policy.calibration`): budget, limits and counts.
    pub calibrator: Arc<Calibrator>,
    /// Which profile stored each Responses answer.
    pub responses: Arc<ResponseStore>,
    /// Which profile recent conversations went to (`policy.affinity.session`).
    pub sessions: crate::affinity::Sessions,
    /// Cached ratings of `policy.second_opinion`.
    pub second_opinions: crate::second_opinion::SecondOpinions,
    pub(crate) client: UpstreamClient,
    pub(crate) shutting_down: AtomicBool,
    /// Turns true when the shutdown grace is over: streams still open end then.
    pub(crate) grace_over: watch::Sender<bool>,
    next_id: AtomicU64,
    id_prefix: u32,
}

// === impl App ===

impl App {
    pub fn new(
        config: ServerConfig,
        store: Arc<ProfileStore>,
        client: UpstreamClient,
        keda: Arc<Keda>,
        tenants: Option<Arc<Tenants>>,
    ) -> Self {
        Self {
            keda,
            tenants,
            calibrator: Arc::new(
                Calibrator::new(config.resilience.calibration).with_outcomes(OutcomeLog::new(
                    config.stored_responses.redis.clone(),
                    config.log_prompts,
                )),
            ),
            responses: Arc::new(ResponseStore::new(config.stored_responses.clone())),
            sessions: crate::affinity::Sessions::default(),
            second_opinions: crate::second_opinion::SecondOpinions::default(),
            store,
            client,
            metrics: telemetry::metrics_handle(),
            config,
            shutting_down: AtomicBool::new(false),
            grace_over: watch::Sender::new(false),
            next_id: AtomicU64::new(0),
            id_prefix: random_id_prefix(),
        }
    }

    /// A new request id, `qr-<prefix>-<counter>`.
    pub(crate) fn next_request_id(&self) -> HeaderValue {
        request_id(self.id_prefix, self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    /// The caller's tenant by its key, in constant time; `None` without authentication.
    pub(crate) fn authenticate(
        &self,
        headers: &HeaderMap,
    ) -> Result<Option<Arc<ActiveTenant>>, ApiError> {
        let Some(tenants) = &self.tenants else {
            return Ok(None);
        };
        tenants.authenticate(headers).map_err(|why| {
            // The reason only: a key is never logged.
            tracing::debug!(reason = why.as_str(), "api key refused");
            ApiError::Unauthorized
        })
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
            epp_listen: None,
            epp_reads_answers: false,
            body_limit: 4 * 1024 * 1024,
            api_keys: None,
            tenants: None,
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
            stored_responses: StoreConfig::default(),
        }
    }
}

/// A 32-bit prefix for request ids that differs between replicas: std seeds every
/// `RandomState` from the OS's randomness. The PID it replaces is 1 in every container.
fn random_id_prefix() -> u32 {
    // Any half of the hash is as random as the other; after the shift nothing is cut off.
    (RandomState::new().hash_one(0u8) >> 32) as u32
}

/// A generated request id, `qr-<process prefix, 8 hex digits>-<counter in hex>`.
pub(crate) fn request_id(prefix: u32, n: u64) -> HeaderValue {
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
