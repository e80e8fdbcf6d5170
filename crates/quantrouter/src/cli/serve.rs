//! The typed configuration of `serve` and `demo`: [`ServeArgs`], from flags, `QUANTROUTER_*`
//! variables and the `--config` file (laid under them by [`super::parse_with_config`]).
//! [`crate::bootstrap`] builds the router from it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::error::CliError;
use crate::resilience::ResilienceConfig;
use crate::server::ServerConfig;
use crate::telemetry::LogFormat;
use crate::upstream::ClientConfig;

/// The `serve` settings, from flags, `QUANTROUTER_*` variables and the `--config` file.
/// Each default is the clap attribute's, written nowhere else; the comment above it says why.
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeArgs {
    /// JSON file of settings keyed by flag name (e.g. {"listen": "0.0.0.0:8080",
    /// "log_prompts": true}); flags and the environment win over it.
    #[arg(long, env = "QUANTROUTER_CONFIG")]
    pub config: Option<PathBuf>,
    /// Public OpenAI-compatible address.
    #[arg(long, env = "QUANTROUTER_LISTEN", default_value_t = ServerConfig::default().listen)]
    pub listen: SocketAddr,
    /// Admin address (metrics, health, profiles).
    #[arg(long, env = "QUANTROUTER_ADMIN_LISTEN", default_value_t = ServerConfig::default().admin_listen)]
    pub admin_listen: SocketAddr,
    /// KEDA external scaler (gRPC) address; `off` serves none.
    // Next to the admin port; KEDA's external-scaler trigger dials it (docs/keda.md).
    #[arg(
        long,
        env = "QUANTROUTER_KEDA_SCALER_LISTEN",
        default_value = "0.0.0.0:9091",
        value_parser = parse_optional_listen
    )]
    pub keda_scaler_listen: OptionalListen,
    /// Endpoint picker (Gateway API Inference Extension, Envoy ext_proc gRPC) address;
    /// `off` (the default) serves none. See docs/operations.md, "Endpoint picker".
    #[arg(
        long,
        env = "QUANTROUTER_EPP_LISTEN",
        default_value = "off",
        value_parser = parse_optional_listen
    )]
    pub epp_listen: OptionalListen,
    /// Which answers the endpoint picker reads for their usage: `when-needed` (a tenant with
    /// limits or budgets, a calibration sample, a stored Responses answer) or `always`
    /// (tokens, cost and savings metrics for every request through the Gateway).
    // Reading an answer's body is most of what the picker costs; few answers need it.
    #[arg(
        long,
        env = "QUANTROUTER_EPP_USAGE",
        value_enum,
        default_value_t = EppUsage::WhenNeeded
    )]
    pub epp_usage: EppUsage,
    /// This replica's name in the tier numbers shared through Redis (default: $HOSTNAME,
    /// the pod name in Kubernetes; else a random id).
    #[arg(long, env = "QUANTROUTER_REPLICA_ID")]
    pub replica_id: Option<String>,
    /// Profile-set file, watched for changes; without it the embedded default is used.
    #[arg(long, env = "QUANTROUTER_PROFILES")]
    pub profiles: Option<PathBuf>,
    /// How often the profile file (and a classifier file) is checked for changes.
    // A file edit applies within a second; a stat a second costs nothing.
    #[arg(long, env = "QUANTROUTER_PROFILES_POLL_MS", default_value_t = 1000)]
    pub profiles_poll_ms: u64,
    /// Prompt classifier: a model file (watched for changes), `builtin` (the model compiled
    /// in) or `off` (the structural score alone). With --redis-url a model pushed to Redis
    /// takes over.
    // The model compiled in works with nothing to ship or mount.
    #[arg(long, env = "QUANTROUTER_CLASSIFIER", default_value = "builtin", value_parser = parse_classifier_choice)]
    pub classifier: ClassifierChoice,
    /// The Redis every replica shares (profiles, classifier, tenants and their counters,
    /// stored Responses, outcome records, KEDA numbers): `redis://[user:password@]host:port[/db]`,
    /// `redis+sentinel://[user:password@]host:port[,host:port...]/MASTER[/db]` or
    /// `redis+cluster://[user:password@]host:port[,host:port...]`; `rediss…` for TLS.
    #[arg(long, env = "QUANTROUTER_REDIS_URL")]
    pub redis_url: Option<String>,
    /// PEM CA certificate to verify a TLS (`rediss…`) Redis with (default: system roots).
    #[arg(long, env = "QUANTROUTER_REDIS_CA_FILE")]
    pub redis_ca_file: Option<PathBuf>,
    /// The sentinels' own password (`requirepass` of a Sentinel set); the URL's password
    /// is the master's and is never sent to the sentinels.
    #[arg(
        long,
        env = "QUANTROUTER_REDIS_SENTINEL_PASSWORD",
        hide_env_values = true
    )]
    pub redis_sentinel_password: Option<String>,
    /// Redis key prefix.
    // The product's name: its keys are recognisable in a shared Redis.
    #[arg(long, env = "QUANTROUTER_REDIS_PREFIX", default_value = "quantrouter")]
    pub redis_prefix: String,
    /// How often the Redis document is re-read in case an update message was missed.
    // Pub/sub brings updates at once; the poll only catches a missed message.
    #[arg(long, env = "QUANTROUTER_REDIS_POLL_MS", default_value_t = 5000)]
    pub redis_poll_ms: u64,
    /// Endpoint for a model of a seed-format list in `model_profiles:active`: MODEL_ID=URL
    /// (repeatable).
    #[arg(
        long = "seed-endpoint",
        env = "QUANTROUTER_SEED_ENDPOINT",
        value_delimiter = ','
    )]
    pub seed_endpoint: Vec<String>,
    /// File with one API key per line, the keys of the implicit tenant `default`; without
    /// it (and without tenants with keys) no authentication is required.
    #[arg(long, env = "QUANTROUTER_API_KEYS_FILE")]
    pub api_keys_file: Option<PathBuf>,
    /// Tenant document (keys as SHA-256 hashes, limits, budgets, routing bounds), watched for
    /// changes; with --redis-url a document pushed to Redis (`quantrouter tenants push`)
    /// takes over.
    #[arg(long, env = "QUANTROUTER_TENANTS")]
    pub tenants: Option<PathBuf>,
    /// Tenants whose metrics carry their own `tenant` label; the rest share `other`.
    // Enough for a team-per-tenant fleet, few enough that the six per-tenant series stay a
    // few hundred per replica.
    #[arg(long, env = "QUANTROUTER_TENANT_METRICS_TOP", default_value_t = crate::tenants::labels::DEFAULT_TOP)]
    pub tenant_metrics_top: usize,
    /// Largest document (profile set, classifier model, tenants) read from a file or Redis;
    /// a larger one is rejected like an invalid one.
    // See `documents::DEFAULT_MAX_BYTES` for why this size.
    #[arg(
        long,
        env = "QUANTROUTER_MAX_DOCUMENT_BYTES",
        default_value_t = crate::documents::DEFAULT_MAX_BYTES,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub max_document_bytes: u64,
    /// Extra model names that mean adaptive routing, like `auto` (repeatable).
    #[arg(
        long = "model-alias",
        env = "QUANTROUTER_MODEL_ALIAS",
        value_delimiter = ','
    )]
    pub model_alias: Vec<String>,
    /// Largest accepted request body in bytes (at least 1024).
    // The floor: the smallest chat request with a few words of prompt is a few hundred bytes.
    #[arg(
        long,
        env = "QUANTROUTER_BODY_LIMIT_BYTES",
        default_value_t = ServerConfig::default().body_limit as u64,
        value_parser = clap::value_parser!(u64).range(1024..)
    )]
    pub body_limit_bytes: u64,
    /// Upstream connect timeout.
    #[arg(long, env = "QUANTROUTER_CONNECT_TIMEOUT_MS", default_value_t = ms(ClientConfig::default().connect_timeout))]
    pub connect_timeout_ms: u64,
    /// Upstream time-to-response-headers timeout.
    #[arg(long, env = "QUANTROUTER_HEADER_TIMEOUT_MS", default_value_t = ms(ClientConfig::default().header_timeout))]
    pub header_timeout_ms: u64,
    /// PEM CA certificate to verify `https://` upstreams with when their profile names no
    /// `upstream.ca_file` (default: the system's roots, which honour SSL_CERT_FILE).
    #[arg(long, env = "QUANTROUTER_UPSTREAM_CA_FILE")]
    pub upstream_ca_file: Option<PathBuf>,
    /// Overall deadline of a request without `x-quantrouter-timeout-ms` (at least 1000).
    // The floor: below a second, a generation of any length times out.
    #[arg(
        long,
        env = "QUANTROUTER_REQUEST_TIMEOUT_MS",
        default_value_t = ms(ResilienceConfig::default().default_deadline),
        value_parser = clap::value_parser!(u64).range(MIN_TIMEOUT_MS..)
    )]
    pub request_timeout_ms: u64,
    /// Longest silence between two chunks of an upstream response (at least 1000).
    // The floor: a busy tier pauses between tokens for hundreds of milliseconds, and a
    // stream waiting for a cold tier is kept alive by a comment every half of it.
    #[arg(
        long,
        env = "QUANTROUTER_IDLE_TIMEOUT_MS",
        default_value_t = ms(ResilienceConfig::default().idle_timeout),
        value_parser = clap::value_parser!(u64).range(MIN_TIMEOUT_MS..)
    )]
    pub idle_timeout_ms: u64,
    /// Upstream attempts per request, across endpoints and tiers.
    #[arg(long, env = "QUANTROUTER_MAX_ATTEMPTS", default_value_t = ResilienceConfig::default().max_attempts)]
    pub max_attempts: u32,
    /// Longest wait for an admission slot before answering 429.
    #[arg(long, env = "QUANTROUTER_QUEUE_TIMEOUT_MS", default_value_t = ms(ResilienceConfig::default().admission.queue_timeout))]
    pub queue_timeout_ms: u64,
    /// How often each endpoint's /metrics is scraped for its queue.
    #[arg(long, env = "QUANTROUTER_SCRAPE_INTERVAL_MS", default_value_t = ms(ResilienceConfig::default().scrape_interval))]
    pub scrape_interval_ms: u64,
    /// How often each endpoint is health-checked (`GET /health`, else `/v1/models`); 0 turns
    /// active checks off.
    #[arg(
        long,
        env = "QUANTROUTER_HEALTH_CHECK_INTERVAL_MS",
        default_value_t = ms(ResilienceConfig::default().health_interval)
    )]
    pub health_check_interval_ms: u64,
    /// A health check slower than this failed.
    #[arg(
        long,
        env = "QUANTROUTER_HEALTH_CHECK_TIMEOUT_MS",
        default_value_t = ms(ResilienceConfig::default().health_timeout)
    )]
    pub health_check_timeout_ms: u64,
    /// After SIGTERM: readiness fails at once, connections are still accepted this long.
    #[arg(long, env = "QUANTROUTER_SHUTDOWN_DELAY_MS", default_value_t = ms(ServerConfig::default().shutdown_delay))]
    pub shutdown_delay_ms: u64,
    /// Then in-flight requests and streams get this long to finish.
    #[arg(long, env = "QUANTROUTER_SHUTDOWN_GRACE_MS", default_value_t = ms(ServerConfig::default().shutdown_grace))]
    pub shutdown_grace_ms: u64,
    /// Longest a client may take over a request head once it sent its first byte; then the
    /// connection closes. Idle keep-alive connections are not timed.
    #[arg(
        long,
        env = "QUANTROUTER_CLIENT_HEADER_TIMEOUT_MS",
        default_value_t = ms(ServerConfig::default().client_header_timeout)
    )]
    pub client_header_timeout_ms: u64,
    /// Longest a client may take to send a request body; then it gets a 400.
    #[arg(
        long,
        env = "QUANTROUTER_CLIENT_BODY_TIMEOUT_MS",
        default_value_t = ms(ServerConfig::default().client_body_timeout)
    )]
    pub client_body_timeout_ms: u64,
    /// Client connections the public port keeps open at once; at the cap the oldest idle one
    /// is closed for a new one. Default: half the open-file limit left after 128 descriptors
    /// for everything else (each request may hold an upstream connection).
    #[arg(long, env = "QUANTROUTER_MAX_CONNECTIONS", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_connections: Option<u64>,
    /// Log each request's prompt text with its routing decision (off: prompts never reach
    /// the logs).
    #[arg(long, env = "QUANTROUTER_LOG_PROMPTS")]
    pub log_prompts: bool,
    /// How `{service, namespace, port}` upstreams are reached: `dns` sends to the service's
    /// cluster DNS name (kube-proxy balances); `kubernetes` watches the service's
    /// EndpointSlices and balances across its ready pods (needs get/list/watch on
    /// endpointslices; see docs/operations.md).
    // DNS works in any cluster with no RBAC; `kubernetes` needs endpointslice permissions.
    #[arg(long, env = "QUANTROUTER_DISCOVERY", value_enum, default_value = "dns")]
    pub discovery: DiscoveryMode,
    /// Threads of the runtime that serves every port and background task. Default: one per
    /// CPU the process may use (a cgroup CPU limit counts; a node's cores do when the pod has
    /// none).
    #[arg(long, env = "QUANTROUTER_WORKERS", value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub workers: Option<u16>,
    /// Log format.
    // Log pipelines parse JSON lines; `text` is for a person at a terminal.
    #[arg(
        long,
        env = "QUANTROUTER_LOG_FORMAT",
        value_enum,
        default_value = "json"
    )]
    pub log_format: LogFormat,
}

/// How service upstreams are found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DiscoveryMode {
    /// The service's cluster DNS name.
    Dns,
    /// The service's ready pods, from its EndpointSlices.
    Kubernetes,
}

/// Which answers the endpoint picker reads ([`ServeArgs::epp_usage`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EppUsage {
    /// Those whose books need their body.
    WhenNeeded,
    /// Every one.
    Always,
}

/// A listen address that can be switched off (`off`, or empty).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct OptionalListen(pub Option<SocketAddr>);

fn parse_optional_listen(value: &str) -> Result<OptionalListen, String> {
    match value.trim() {
        "" | "off" => Ok(OptionalListen(None)),
        addr => addr
            .parse()
            .map(|a| OptionalListen(Some(a)))
            .map_err(|e| format!("`{addr}`: {e} (an address like 0.0.0.0:9091, or `off`)")),
    }
}

/// The replica id: the flag, else the host name (the pod name in Kubernetes), else random.
pub(crate) fn replica_id(flag: Option<String>, hostname: Option<String>) -> String {
    flag.or(hostname)
        .map(|id| id.trim().to_owned())
        .filter(|id| !id.is_empty())
        .unwrap_or_else(crate::keda::random_replica_id)
}

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Public address (loopback by default: the demo has no authentication).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Admin address.
    #[arg(long, default_value = "127.0.0.1:9090")]
    pub admin_listen: SocketAddr,
}

/// Which model scores prompts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum ClassifierChoice {
    Builtin,
    Off,
    File(PathBuf),
}

pub(crate) fn parse_classifier_choice(value: &str) -> Result<ClassifierChoice, String> {
    Ok(match value {
        "builtin" => ClassifierChoice::Builtin,
        "off" => ClassifierChoice::Off,
        "" => return Err("expected a model file, `builtin` or `off`".into()),
        path => ClassifierChoice::File(PathBuf::from(path)),
    })
}

// === impl ClassifierChoice ===

impl TryFrom<String> for ClassifierChoice {
    type Error = String;

    fn try_from(value: String) -> Result<Self, String> {
        parse_classifier_choice(&value)
    }
}

impl From<ClassifierChoice> for String {
    fn from(choice: ClassifierChoice) -> Self {
        match choice {
            ClassifierChoice::Builtin => "builtin".into(),
            ClassifierChoice::Off => "off".into(),
            ClassifierChoice::File(path) => path.to_string_lossy().into_owned(),
        }
    }
}

// === impl OptionalListen ===

impl TryFrom<String> for OptionalListen {
    type Error = String;

    fn try_from(value: String) -> Result<Self, String> {
        parse_optional_listen(&value)
    }
}

impl From<OptionalListen> for String {
    fn from(listen: OptionalListen) -> Self {
        listen
            .0
            .map_or_else(|| "off".into(), |addr| addr.to_string())
    }
}

/// Serde for the flags' enums by their flag spelling, so a config file takes exactly the
/// names the flag does (and its error lists them).
macro_rules! serde_by_flag_name {
    ($($ty:ty),* $(,)?) => {$(
        impl Serialize for $ty {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                let value = self
                    .to_possible_value()
                    .ok_or_else(|| serde::ser::Error::custom("a value without a flag name"))?;
                serializer.serialize_str(value.get_name())
            }
        }

        impl<'de> Deserialize<'de> for $ty {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                let name = String::deserialize(deserializer)?;
                <$ty as ValueEnum>::from_str(&name, false).map_err(|_| {
                    let names: Vec<String> = <$ty as ValueEnum>::value_variants()
                        .iter()
                        .filter_map(|v| v.to_possible_value())
                        .map(|v| format!("`{}`", v.get_name()))
                        .collect();
                    serde::de::Error::custom(format!(
                        "`{name}` is not one of {}",
                        names.join(", ")
                    ))
                })
            }
        }
    )*};
}

serde_by_flag_name!(DiscoveryMode, EppUsage, LogFormat);

/// The smallest request and idle timeouts, in milliseconds.
const MIN_TIMEOUT_MS: u64 = 1000;

/// A default duration as the flag's milliseconds: the defaults are written once, with their
/// reasons, on the config types the flags fill.
pub(crate) fn ms(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// `MODEL_ID=URL` pairs from `--seed-endpoint`.
pub(crate) fn parse_seed_endpoints(
    pairs: &[String],
) -> Result<std::collections::BTreeMap<String, String>, CliError> {
    pairs
        .iter()
        .map(|pair| {
            pair.split_once('=')
                .map(|(model, url)| (model.to_owned(), url.to_owned()))
                .ok_or_else(|| {
                    CliError::Invalid(format!("--seed-endpoint {pair}: expected MODEL_ID=URL"))
                })
        })
        .collect()
}
