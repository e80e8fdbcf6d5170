//! Command-line interface: `serve`, `demo`, `route`, `audit`, `profiles`, `classifier`,
//! `tenants`, `profile-tier`.
//!
//! Every `serve` flag can also come from `QUANTROUTER_<FLAG>` and from a JSON config file
//! given with `--config` (keys are the flag names in snake_case or kebab-case, values typed
//! JSON: booleans, numbers, arrays for repeatable flags, strings for the rest).
//! Precedence: command line, environment, config file, built-in default. [`ServeArgs`] is
//! the one typed configuration: clap reads the first two and holds the defaults, serde reads
//! the file into the same struct.

use std::collections::HashSet;
use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::parser::ValueSource;
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use quantrouter_policy::{
    audit, decide, score, Overrides, ProfileSet, Prompt, Role, RouteRequest, Segment,
    StaticUpstream, Upstream, DEFAULT_PROFILE_SET,
};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::classifier::{ClassifierConfig, ClassifierStore};
use crate::discovery::{self, Discovery, DiscoveryConfig};
use crate::documents::{Document, RedisStore, StoreError};
use crate::keda::publish::RedisTarget;
use crate::keda::KedaConfig;
use crate::profiles::{self, ProfileStore, SourceKind};
use crate::resilience::ResilienceConfig;
use crate::server::{Server, ServerConfig};
use crate::telemetry::{self, LogFormat};
use crate::upstream::ClientConfig;

mod classifier;
mod suggest;
mod tenants;

/// quantrouter: one OpenAI endpoint, the cheapest quantization profile that does the job.
#[derive(Debug, Parser)]
#[command(name = "quantrouter", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the router.
    Serve(Box<ServeArgs>),
    /// Run the router with three simulated vLLM tiers in-process (no cluster, no Redis).
    Demo(DemoArgs),
    /// Explain the routing decision for a prompt against a profile file, offline.
    Route(RouteArgs),
    /// Route a labelled JSONL prompt mix and report where each label lands.
    Audit(AuditArgs),
    /// Validate profile files and manage the profile set in Redis.
    #[command(subcommand)]
    Profiles(ProfilesCommand),
    /// Train, evaluate and publish the prompt classifier.
    #[command(subcommand)]
    Classifier(classifier::ClassifierCommand),
    /// Manage tenants (API keys, limits, budgets) in Redis and read their usage.
    #[command(subcommand)]
    Tenants(tenants::TenantsCommand),
    /// Measure a live OpenAI-compatible endpoint (latency, throughput, accuracy on an eval
    /// set) and print a profile entry; optionally merge it into a file and push it.
    ProfileTier(Box<crate::tier_profile::ProfileTierArgs>),
}

/// Where the profile set lives in Redis.
#[derive(Debug, Clone, Args)]
pub struct RedisArgs {
    /// `redis://[user:password@]host:port[/db]`, or `rediss://` for TLS.
    #[arg(long, env = "QUANTROUTER_REDIS_URL")]
    pub redis_url: String,
    /// Key prefix.
    #[arg(long, env = "QUANTROUTER_REDIS_PREFIX", default_value = "quantrouter")]
    pub redis_prefix: String,
    /// PEM CA certificate to verify a `rediss://` server with (default: system roots).
    #[arg(long, env = "QUANTROUTER_REDIS_CA_FILE")]
    pub redis_ca_file: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
pub enum ProfilesCommand {
    /// Check a profile-set file (or a seed-format list) and print every error with its path.
    Validate {
        file: PathBuf,
        /// For seed-format lists: MODEL_ID=URL, once per model.
        #[arg(long = "seed-endpoint")]
        seed_endpoint: Vec<String>,
    },
    /// Show how a file differs from the active set.
    Diff {
        file: PathBuf,
        #[command(flatten)]
        redis: RedisArgs,
    },
    /// Propose per-class qualities from the agreement the replicas measured against the
    /// calibration reference (`policy.calibration`); prints, never pushes.
    Suggest {
        /// A replica's admin base URL (http://host:9090); repeat for every replica.
        #[arg(long = "from", required = true)]
        from: Vec<String>,
        /// Only profiles and classes with at least this many samples get a suggestion.
        #[arg(long, default_value_t = 30)]
        min_samples: u64,
        /// Print the suggestions as JSON.
        #[arg(long)]
        json: bool,
    },
    #[command(flatten)]
    Stored(DocumentCommand),
}

/// What operators do with a kind of versioned document in Redis.
#[derive(Debug, Subcommand)]
pub enum DocumentCommand {
    /// Validate a file and make it the active document (version = active + 1), atomically.
    Push {
        file: PathBuf,
        /// Only push if the active version is still this one (for pipelines that diffed
        /// against it); otherwise exit 3 and write nothing.
        #[arg(long)]
        expect_version: Option<u64>,
        /// Largest document pushed, in bytes (the routers' own limit should be as large).
        #[arg(
            long,
            env = "QUANTROUTER_MAX_DOCUMENT_BYTES",
            default_value_t = crate::documents::DEFAULT_MAX_BYTES,
            value_parser = clap::value_parser!(u64).range(1..)
        )]
        max_document_bytes: u64,
        #[command(flatten)]
        redis: RedisArgs,
    },
    /// Print the active document.
    Get {
        #[command(flatten)]
        redis: RedisArgs,
    },
    /// List previous versions, newest first.
    History {
        #[command(flatten)]
        redis: RedisArgs,
    },
    /// Re-publish a previous version (default: the newest in history) as a new version.
    Rollback {
        #[arg(long)]
        to: Option<u64>,
        #[command(flatten)]
        redis: RedisArgs,
    },
}

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
    /// Redis holding the profile set (`redis://[user:password@]host:port[/db]`, or
    /// `rediss://` for TLS); hot reload.
    #[arg(long, env = "QUANTROUTER_REDIS_URL")]
    pub redis_url: Option<String>,
    /// PEM CA certificate to verify a `rediss://` server with (default: system roots).
    #[arg(long, env = "QUANTROUTER_REDIS_CA_FILE")]
    pub redis_ca_file: Option<PathBuf>,
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
fn replica_id(flag: Option<String>, hostname: Option<String>) -> String {
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

fn parse_classifier_choice(value: &str) -> Result<ClassifierChoice, String> {
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

serde_by_flag_name!(DiscoveryMode, LogFormat);

#[derive(Debug, Args)]
pub struct RouteArgs {
    /// The user prompt to route.
    pub prompt: String,
    /// Profile-set file (default: the embedded set).
    #[arg(long)]
    pub profiles: Option<PathBuf>,
    /// Classifier: a model file, `builtin` or `off`.
    #[arg(long, default_value = "builtin", value_parser = parse_classifier_choice)]
    pub classifier: ClassifierChoice,
    /// A system prompt sent along.
    #[arg(long)]
    pub system: Option<String>,
    /// The request's max_tokens.
    #[arg(long)]
    pub max_tokens: Option<u32>,
    /// Ask for JSON output (response_format json_object).
    #[arg(long)]
    pub json_output: bool,
    /// Print the decision as JSON (the `POST /v1/route` shape).
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct AuditArgs {
    /// JSONL file of {"id", "label", "prompt"} lines (optionally "task_class").
    #[arg(long)]
    pub prompts: PathBuf,
    /// Profile-set file (default: the embedded set).
    #[arg(long)]
    pub profiles: Option<PathBuf>,
    /// Classifier: a model file, `builtin` or `off`.
    #[arg(long, default_value = "builtin", value_parser = parse_classifier_choice)]
    pub classifier: ClassifierChoice,
}

/// A default duration as the flag's milliseconds: the defaults are written once, with their
/// reasons, on the config types the flags fill.
fn ms(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// A failed command and its exit code.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Bad input: exit 1.
    #[error("{0}")]
    Invalid(String),
    /// Could not reach or run something: exit 2.
    #[error("{0}")]
    Io(String),
    /// Another operator changed the active set first: exit 3.
    #[error("{0}")]
    Conflict(String),
}

/// Parses the process arguments and runs the command.
pub fn main() -> ExitCode {
    let argv: Vec<OsString> = std::env::args_os().collect();
    let cli = match parse_with_config(argv) {
        Ok(cli) => cli,
        Err(CliError::Invalid(message)) if message.is_empty() => return ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("quantrouter: {e}");
            return ExitCode::from(1);
        }
    };
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("quantrouter: {e}");
            ExitCode::from(match e {
                CliError::Invalid(_) => 1,
                CliError::Io(_) => 2,
                CliError::Conflict(_) => 3,
            })
        }
    }
}

/// Parses arguments; for `serve --config FILE`, the file's settings then fill what neither
/// the command line nor the environment set.
pub fn parse_with_config(argv: Vec<OsString>) -> Result<Cli, CliError> {
    let matches = match Cli::command().try_get_matches_from(&argv) {
        Ok(m) => m,
        Err(e) if !e.use_stderr() => {
            // --help / --version: clap prints them.
            let _ = e.print();
            return Err(CliError::Invalid(String::new()));
        }
        Err(e) => return Err(CliError::Invalid(e.render().to_string())),
    };
    let mut cli = Cli::from_arg_matches(&matches).map_err(|e| CliError::Invalid(e.to_string()))?;
    if let (Command::Serve(args), Some(("serve", serve))) = (&mut cli.command, matches.subcommand())
    {
        if let Some(path) = args.config.clone() {
            let text = read_config_file(&path).map_err(|e| {
                CliError::Invalid(format!("reading config {}: {e}", path.display()))
            })?;
            **args = layer_config_file(args, serve, &text)
                .map_err(|e| CliError::Invalid(format!("config {}: {e}", path.display())))?;
        }
    }
    Ok(cli)
}

/// The smallest request and idle timeouts, in milliseconds.
const MIN_TIMEOUT_MS: u64 = 1000;

/// Largest config file read: a file of every setting is a few kilobytes.
const MAX_CONFIG_BYTES: u64 = 1024 * 1024;

/// The `--config` file's text. Only a regular file: reading a FIFO or a device would wait
/// for a writer, or never end, and start-up with it.
fn read_config_file(path: &Path) -> Result<String, String> {
    let meta = std::fs::metadata(path).map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err("not a regular file".into());
    }
    if meta.len() > MAX_CONFIG_BYTES {
        return Err(format!(
            "{} bytes, more than a config file's limit of {MAX_CONFIG_BYTES}",
            meta.len()
        ));
    }
    std::fs::read_to_string(path).map_err(|e| e.to_string())
}

/// `args` (flags, environment and defaults, as clap parsed them) with the settings of a
/// config file laid under the flags and the environment: a file value replaces only a
/// default. The settings travel as a JSON object of `ServeArgs`' fields, so serde types
/// every file value and the one struct is the only list of settings.
fn layer_config_file(
    args: &ServeArgs,
    matches: &clap::ArgMatches,
    text: &str,
) -> Result<ServeArgs, String> {
    let file: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(text).map_err(|e| e.to_string())?;
    let serde_json::Value::Object(mut settings) =
        serde_json::to_value(args).map_err(|e| e.to_string())?
    else {
        return Err("the settings are not a JSON object".into());
    };
    let mut numbers = Vec::new();
    for (key, value) in file {
        // Keys as the flags spell them (`admin-listen`) or as the fields do (`admin_listen`).
        let id = key.replace('-', "_");
        if !settings.contains_key(&id) {
            return Err(format!("unknown setting `{key}`"));
        }
        // The file is already chosen; a `config` inside it names nothing more to read.
        if id == "config" {
            continue;
        }
        if matches!(
            matches.value_source(&id),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        ) {
            continue;
        }
        if value.is_number() {
            numbers.push(format!("--{}={value}", id.replace('_', "-")));
        }
        settings.insert(id, value);
    }
    check_ranges(numbers)?;
    serde_path_to_error::deserialize(serde_json::Value::Object(settings))
        .map_err(|e| format!("`{}`: {}", e.path(), e.inner()))
}

/// File numbers pass the flags' own parsers too: serde checks the integer type, but the
/// ranges some flags allow (`--max-connections` at least 1) live in clap.
fn check_ranges(flags: Vec<String>) -> Result<(), String> {
    if flags.is_empty() {
        return Ok(());
    }
    let argv = ["quantrouter", "serve"]
        .into_iter()
        .map(String::from)
        .chain(flags);
    Cli::command()
        .try_get_matches_from(argv)
        .map(drop)
        .map_err(|e| {
            let text = e.render().to_string();
            let first = text.lines().next().unwrap_or_default();
            first.trim_start_matches("error: ").to_owned()
        })
}

/// Runs a parsed command.
pub fn run(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Serve(args) => runtime(args.workers)?.block_on(serve(*args)),
        Command::Demo(args) => runtime(None)?.block_on(demo(args)),
        Command::Route(args) => route(&args),
        Command::Audit(args) => run_audit(&args),
        Command::Profiles(command) => profiles_command(command),
        Command::ProfileTier(args) => crate::tier_profile::run(*args),
        Command::Classifier(command) => classifier::run(command),
        Command::Tenants(command) => tenants::run(command),
    }
}

fn profiles_command(command: ProfilesCommand) -> Result<(), CliError> {
    match command {
        ProfilesCommand::Validate {
            file,
            seed_endpoint,
        } => {
            let set = read_profile_file(&file, &seed_endpoint)?;
            println!(
                "{}: valid, version {}, {} profiles, default {}",
                file.display(),
                set.version,
                set.profiles.len(),
                set.default_profile
            );
            Ok(())
        }
        ProfilesCommand::Diff { file, redis } => {
            // Validate input before touching the network.
            let new = read_profile_file(&file, &[])?;
            block_on(async {
                let store = connect_store::<ProfileSet>(&redis).await?;
                match store.active().await.map_err(store_error)? {
                    None => println!("no active set: every profile would be added"),
                    Some(old) => {
                        let lines = crate::profiles::diff::diff(&old, &new);
                        if lines.is_empty() {
                            println!("no changes (active version {})", old.version);
                        }
                        for line in lines {
                            println!("{line}");
                        }
                    }
                }
                Ok(())
            })
        }
        ProfilesCommand::Suggest {
            from,
            min_samples,
            json,
        } => suggest::run(&from, min_samples, json),
        ProfilesCommand::Stored(command) => {
            document_command(command, |file| read_profile_file(file, &[]))
        }
    }
}

/// Runs `push`, `get`, `history` or `rollback` on documents of kind `D`; `read` reads and
/// validates a file to push.
pub(crate) fn document_command<D: Document>(
    command: DocumentCommand,
    read: impl FnOnce(&Path) -> Result<D, CliError>,
) -> Result<(), CliError> {
    let (redis, operation) = match command {
        DocumentCommand::Push {
            file,
            expect_version,
            max_document_bytes,
            redis,
        } => {
            crate::documents::set_max_bytes(max_document_bytes);
            (redis, StoreCommand::Push(read(&file)?, expect_version))
        }
        DocumentCommand::Get { redis } => (redis, StoreCommand::Get),
        DocumentCommand::History { redis } => (redis, StoreCommand::History),
        DocumentCommand::Rollback { to, redis } => (redis, StoreCommand::Rollback(to)),
    };
    block_on(run_store_command(&redis, operation))
}

/// What an operator does with a kind of document in Redis.
pub(crate) enum StoreCommand<D> {
    /// Push a validated document, optionally only over the given active version.
    Push(D, Option<u64>),
    Get,
    History,
    Rollback(Option<u64>),
}

/// Runs a command's Redis work on a small runtime of its own.
fn block_on<T>(
    work: impl std::future::Future<Output = Result<T, CliError>>,
) -> Result<T, CliError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| CliError::Io(e.to_string()))?
        .block_on(work)
}

async fn run_store_command<D: Document>(
    redis: &RedisArgs,
    command: StoreCommand<D>,
) -> Result<(), CliError> {
    let store = connect_store::<D>(redis).await?;
    match command {
        StoreCommand::Push(mut doc, expect_version) => {
            let version = match expect_version {
                None => store.push(doc).await,
                Some(expected) => {
                    let too_large = || {
                        CliError::Invalid(format!(
                            "--expect-version {expected}: versions are at most {}",
                            quantrouter_policy::MAX_VERSION
                        ))
                    };
                    let expected = i64::try_from(expected).map_err(|_| too_large())?;
                    doc.set_version((expected as u64).saturating_add(1));
                    store.push_expecting(&doc, expected).await
                }
            }
            .map_err(store_error)?;
            println!("pushed version {version}");
        }
        StoreCommand::Get => match store.active_raw().await.map_err(store_error)? {
            Some(text) => println!("{text}"),
            None => {
                return Err(CliError::Invalid(format!(
                    "nothing at {}",
                    store.keys().active
                )))
            }
        },
        StoreCommand::History => {
            for entry in store.history().await.map_err(store_error)? {
                println!(
                    "version {:>5}  {:<25} {}",
                    entry.version,
                    entry.updated_at.as_deref().unwrap_or("-"),
                    entry.summary
                );
            }
        }
        StoreCommand::Rollback(to) => {
            let version = store.rollback(to).await.map_err(store_error)?;
            println!("rolled back: published as version {version}");
        }
    }
    Ok(())
}

/// Connects to one kind of document in Redis: exit 1 for a bad URL, 2 when unreachable.
pub(crate) async fn connect_store<D: Document>(
    redis: &RedisArgs,
) -> Result<RedisStore<D>, CliError> {
    let client = crate::documents::client(&redis.redis_url, redis.redis_ca_file.as_deref())
        .map_err(|e| CliError::Invalid(e.to_string()))?;
    RedisStore::connect(&client, &redis.redis_prefix)
        .await
        .map_err(store_error)
}

/// A Redis store error as the CLI's exit code: 3 conflict, 2 unreachable, 1 bad data.
pub(crate) fn store_error(e: StoreError) -> CliError {
    match e {
        StoreError::Conflict { .. } => CliError::Conflict(e.to_string()),
        StoreError::Redis(_) | StoreError::Timeout(_) | StoreError::Unconfirmed(_) => {
            CliError::Io(e.to_string())
        }
        StoreError::Invalid(_)
        | StoreError::NotADocument { .. }
        | StoreError::TooLarge { .. }
        | StoreError::NotInHistory(_)
        | StoreError::EmptyHistory => CliError::Invalid(e.to_string()),
    }
}

/// `MODEL_ID=URL` pairs from `--seed-endpoint`.
fn parse_seed_endpoints(
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

/// A profile-set file, or a seed-format list with `MODEL_ID=URL` endpoints.
pub(crate) fn read_profile_file(
    path: &Path,
    seed_endpoints: &[String],
) -> Result<ProfileSet, CliError> {
    let text = crate::documents::read_file(path)
        .map_err(|e| CliError::Invalid(format!("reading {}: {e}", path.display())))?;
    let result = if quantrouter_policy::looks_like_seed_list(&text) {
        quantrouter_policy::from_seed_list(&text, &parse_seed_endpoints(seed_endpoints)?, 1)
    } else {
        ProfileSet::from_json(&text)
    };
    result.map_err(|e| CliError::Invalid(format!("{}:\n{e}", path.display())))
}

/// The one runtime: the public port's requests, the admin and scaler ports and the
/// background work (profile sources, discovery, scraping, KEDA) share its `workers` threads,
/// by default one per CPU the process may use (`available_parallelism` honours a cgroup CPU
/// limit and the affinity mask).
fn runtime(workers: Option<u16>) -> Result<tokio::runtime::Runtime, CliError> {
    let workers = workers.map_or_else(
        || std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get),
        usize::from,
    );
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .map_err(|e| CliError::Io(format!("starting the runtime: {e}")))
}

async fn serve(args: ServeArgs) -> Result<(), CliError> {
    telemetry::init_logging(args.log_format);
    crate::documents::set_max_bytes(args.max_document_bytes);
    crate::descriptors::raise_limit();
    // Before anything records a metric (the profile store sets the version gauge).
    telemetry::metrics_handle();
    let store = start_profiles(&args).await?;
    let classifier = start_classifier(&args).await?;
    // Held until shutdown: dropping it stops the watches.
    let _discovery = match args.discovery {
        DiscoveryMode::Dns => None,
        DiscoveryMode::Kubernetes => {
            let client = discovery::kube_client()
                .await
                .map_err(|e| CliError::Io(e.to_string()))?;
            let config = DiscoveryConfig::default();
            Some(Discovery::start(Arc::clone(&store), client, config))
        }
    };
    let resilience = resilience_config(&args);
    let keda = keda_config(&args)?;
    let tenants = start_tenants(&args, &keda.replica_id).await?;
    let stored_responses = stored_responses(&args)?;
    let config = ServerConfig {
        listen: args.listen,
        admin_listen: args.admin_listen,
        scaler_listen: args.keda_scaler_listen.0,
        epp_listen: args.epp_listen.0,
        body_limit: usize::try_from(args.body_limit_bytes).unwrap_or(usize::MAX),
        api_keys: None,
        tenants,
        aliases: args.model_alias,
        client: ClientConfig {
            connect_timeout: Duration::from_millis(args.connect_timeout_ms),
            header_timeout: Duration::from_millis(args.header_timeout_ms),
            ca_file: args.upstream_ca_file.clone(),
            ..ClientConfig::default()
        },
        resilience,
        shutdown_delay: Duration::from_millis(args.shutdown_delay_ms),
        shutdown_grace: Duration::from_millis(args.shutdown_grace_ms),
        client_header_timeout: Duration::from_millis(args.client_header_timeout_ms),
        client_body_timeout: Duration::from_millis(args.client_body_timeout_ms),
        max_connections: args
            .max_connections
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
        traces: crate::traces::Traces::from_env().unwrap_or_else(|error| {
            tracing::warn!(%error, "tracing disabled");
            None
        }),
        log_prompts: args.log_prompts,
        classifier,
        keda,
        stored_responses,
    };
    let server = Server::start(config, store)
        .await
        .map_err(|e| CliError::Io(e.to_string()))?;
    wait_for_signal().await;
    tracing::info!("shutting down");
    server.shutdown().await;
    Ok(())
}

/// With `--redis-url`, replicas share their tier numbers through the profile Redis.
fn keda_config(args: &ServeArgs) -> Result<KedaConfig, CliError> {
    let redis = match &args.redis_url {
        Some(url) => Some(RedisTarget {
            client: crate::documents::client(url, args.redis_ca_file.as_deref())
                .map_err(|e| CliError::Invalid(e.to_string()))?,
            prefix: args.redis_prefix.clone(),
        }),
        None => None,
    };
    Ok(KedaConfig {
        redis,
        replica_id: replica_id(args.replica_id.clone(), std::env::var("HOSTNAME").ok()),
        ..KedaConfig::default()
    })
}

fn resilience_config(args: &ServeArgs) -> ResilienceConfig {
    let defaults = ResilienceConfig::default();
    ResilienceConfig {
        max_attempts: args.max_attempts.max(1),
        default_deadline: Duration::from_millis(args.request_timeout_ms),
        idle_timeout: Duration::from_millis(args.idle_timeout_ms),
        scrape_interval: Duration::from_millis(args.scrape_interval_ms.max(10)),
        // Zero stays zero (off); anything else at least 10 ms, like the scrape.
        health_interval: Duration::from_millis(match args.health_check_interval_ms {
            0 => 0,
            ms => ms.max(10),
        }),
        health_timeout: Duration::from_millis(args.health_check_timeout_ms.max(1)),
        admission: crate::resilience::AdmissionConfig {
            queue_timeout: Duration::from_millis(args.queue_timeout_ms),
            ..defaults.admission
        },
        ..defaults
    }
}

/// The profile sources in order of preference: Redis, then the file, then the embedded set.
async fn start_profiles(args: &ServeArgs) -> Result<Arc<ProfileStore>, CliError> {
    let mut sources: Vec<Arc<dyn profiles::ProfileSource>> = Vec::new();
    if let Some(url) = &args.redis_url {
        let client = crate::documents::client(url, args.redis_ca_file.as_deref())
            .map_err(|e| CliError::Invalid(e.to_string()))?;
        let config = profiles::redis_source::RedisSourceConfig {
            prefix: args.redis_prefix.clone(),
            poll: Duration::from_millis(args.redis_poll_ms.max(10)),
            seed_endpoints: parse_seed_endpoints(&args.seed_endpoint)?,
        };
        sources.push(Arc::new(profiles::redis_source::RedisSource {
            client,
            config,
        }));
    }
    match &args.profiles {
        Some(path) => sources.push(Arc::new(profiles::FileSource {
            path: path.clone(),
            interval: Duration::from_millis(args.profiles_poll_ms.max(10)),
        })),
        None => sources.push(Arc::new(profiles::Embedded)),
    }
    let started = profiles::start(sources)
        .await
        .map_err(|e| CliError::Invalid(e.to_string()))?;
    Ok(started.store)
}

/// Tenants from `--tenants` and, with `--redis-url`, Redis (where their counters live too);
/// `--api-keys-file` keys form the implicit tenant. With none of them, no tenants: requests
/// need no key and nothing is counted.
async fn start_tenants(
    args: &ServeArgs,
    replica_id: &str,
) -> Result<Option<Arc<crate::tenants::Tenants>>, CliError> {
    use crate::tenants::limiter::LimiterConfig;
    use crate::tenants::{Clock, ImplicitKeys, Tenants, TenantsConfig};
    if args.tenants.is_none() && args.redis_url.is_none() && args.api_keys_file.is_none() {
        return Ok(None);
    }
    let api_keys = match &args.api_keys_file {
        Some(path) => {
            let keys = read_api_keys(path)?;
            let keys = ImplicitKeys::from_keys(keys.iter().map(String::as_str))
                .map_err(|e| CliError::Invalid(format!("{}: {e}", path.display())))?;
            Some(keys)
        }
        None => None,
    };
    let redis = match &args.redis_url {
        Some(url) => Some((
            crate::documents::client(url, args.redis_ca_file.as_deref())
                .map_err(|e| CliError::Invalid(e.to_string()))?,
            args.redis_prefix.clone(),
        )),
        None => None,
    };
    let config = TenantsConfig {
        file: args.tenants.clone(),
        file_interval: Duration::from_millis(args.profiles_poll_ms.max(10)),
        redis: redis.clone(),
        redis_poll: Duration::from_millis(args.redis_poll_ms.max(10)),
        api_keys,
        metrics_top: args.tenant_metrics_top,
    };
    let limiter = LimiterConfig::new(redis, replica_id.to_owned());
    let tenants = Tenants::start(config, limiter, Clock::system())
        .await
        .map_err(|e| CliError::Invalid(format!("--tenants: {e}")))?;
    Ok(Some(Arc::new(tenants)))
}

/// Stored Responses' placement: shared through the router's Redis when it has one.
fn stored_responses(args: &ServeArgs) -> Result<crate::apis::stored::StoreConfig, CliError> {
    let redis = match &args.redis_url {
        Some(url) => Some((
            crate::documents::client(url, args.redis_ca_file.as_deref())
                .map_err(|e| CliError::Invalid(e.to_string()))?,
            args.redis_prefix.clone(),
        )),
        None => None,
    };
    Ok(crate::apis::stored::StoreConfig {
        redis,
        ..Default::default()
    })
}

async fn start_classifier(args: &ServeArgs) -> Result<Arc<ClassifierStore>, CliError> {
    let redis = match &args.redis_url {
        Some(url) => Some((
            crate::documents::client(url, args.redis_ca_file.as_deref())
                .map_err(|e| CliError::Invalid(e.to_string()))?,
            args.redis_prefix.clone(),
        )),
        None => None,
    };
    let config = ClassifierConfig {
        file: match &args.classifier {
            ClassifierChoice::File(path) => Some(path.clone()),
            _ => None,
        },
        off: args.classifier == ClassifierChoice::Off,
        file_interval: Duration::from_millis(args.profiles_poll_ms.max(10)),
        redis,
        redis_poll: Duration::from_millis(args.redis_poll_ms.max(10)),
    };
    let started = crate::classifier::start(config)
        .await
        .map_err(|e| CliError::Invalid(format!("--classifier: {e}")))?;
    Ok(started.store)
}

/// The model a command scores with: none for `off`.
fn offline_classifier(
    choice: &ClassifierChoice,
) -> Result<Option<quantrouter_policy::Classifier>, CliError> {
    let model = match choice {
        ClassifierChoice::Off => return Ok(None),
        ClassifierChoice::Builtin => quantrouter_policy::Classifier::builtin(),
        ClassifierChoice::File(path) => classifier::read_model(path)?.classifier(),
    };
    model
        .map(Some)
        .map_err(|e| CliError::Invalid(e.to_string()))
}

/// One key per line; blank lines and `#` comments are skipped.
pub fn read_api_keys(path: &Path) -> Result<HashSet<String>, CliError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| CliError::Invalid(format!("reading {}: {e}", path.display())))?;
    let keys: HashSet<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect();
    if keys.is_empty() {
        return Err(CliError::Invalid(format!(
            "{} holds no API keys",
            path.display()
        )));
    }
    Ok(keys)
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

/// The demo's simulated tiers: the embedded profiles, each served by an in-process vllm-sim
/// with the profile's latency model.
pub async fn start_demo_tiers() -> Result<(ProfileSet, Vec<vllm_sim::SimServer>), CliError> {
    let mut set =
        ProfileSet::from_json(DEFAULT_PROFILE_SET).map_err(|e| CliError::Invalid(e.to_string()))?;
    let mut sims = Vec::new();
    for profile in &mut set.profiles {
        let config = vllm_sim::SimConfig {
            model: profile.model.clone(),
            ttft: Duration::from_secs_f64(profile.latency.ttft_ms / 1000.0),
            itl: Duration::from_secs_f64(profile.latency.itl_ms / 1000.0),
            max_num_seqs: profile.max_concurrency as usize,
            seed: 7,
            ..vllm_sim::SimConfig::default()
        };
        let sim = vllm_sim::SimServer::bind(SocketAddr::from(([127, 0, 0, 1], 0)), config)
            .await
            .map_err(|e| CliError::Io(format!("starting a simulated tier: {e}")))?;
        profile.upstream = Upstream::Static(StaticUpstream::new(vec![sim.url()]));
        sims.push(sim);
    }
    set.validate()
        .map_err(|e| CliError::Invalid(e.to_string()))?;
    Ok((set, sims))
}

async fn demo(args: DemoArgs) -> Result<(), CliError> {
    telemetry::init_logging(LogFormat::Text);
    telemetry::metrics_handle();
    let (set, sims) = start_demo_tiers().await?;
    let store = Arc::new(ProfileStore::new(set, SourceKind::Embedded));
    let config = ServerConfig {
        listen: args.listen,
        admin_listen: args.admin_listen,
        shutdown_grace: Duration::from_secs(2),
        ..ServerConfig::default()
    };
    let server = Server::start(config, Arc::clone(&store))
        .await
        .map_err(|e| CliError::Io(e.to_string()))?;
    let (public, admin) = (server.public_addr(), server.admin_addr());
    println!("quantrouter demo is running (Ctrl-C to stop)\n");
    for (profile, sim) in store.load().set.profiles.iter().zip(&sims) {
        println!(
            "  tier {:<5} {:<14} simulated vLLM at {}",
            profile.tier,
            profile.id,
            sim.url()
        );
    }
    println!("\n  OpenAI endpoint: http://{public}/v1   (model \"auto\")");
    println!("  admin:           http://{admin}/metrics  /readyz  /admin/profiles\n");
    println!("Try:\n  curl -s http://{public}/v1/chat/completions -H 'content-type: application/json' \\");
    println!("    -d '{{\"model\":\"auto\",\"messages\":[{{\"role\":\"user\",\"content\":\"Say hello in French.\"}}]}}' -i");
    println!("  curl -s http://{public}/v1/route -H 'content-type: application/json' \\");
    println!("    -d '{{\"model\":\"auto\",\"messages\":[{{\"role\":\"user\",\"content\":\"Write a Python function that merges two sorted lists.\"}}]}}'");
    wait_for_signal().await;
    server.shutdown().await;
    for sim in sims {
        sim.shutdown().await;
    }
    Ok(())
}

fn load_set(path: Option<&Path>) -> Result<ProfileSet, CliError> {
    profiles::initial_set(path)
        .map(|(set, _)| set)
        .map_err(|e| CliError::Invalid(e.to_string()))
}

fn route(args: &RouteArgs) -> Result<(), CliError> {
    let set = load_set(args.profiles.as_deref())?;
    let mut segments = Vec::new();
    if let Some(system) = &args.system {
        segments.push(Segment {
            role: Role::System,
            text: system,
        });
    }
    segments.push(Segment {
        role: Role::User,
        text: &args.prompt,
    });
    let prompt = Prompt {
        segments,
        wants_json: args.json_output,
    };
    let model = offline_classifier(&args.classifier)?;
    let started = std::time::Instant::now();
    let (features, classification) = score(&prompt, &set.policy.complexity, model.as_ref());
    let request = RouteRequest {
        features: &features,
        max_tokens: args.max_tokens,
        overrides: Overrides::default(),
        routing_key: "cli",
    };
    let decision = decide(&set, &request, &[]).map_err(|e| CliError::Invalid(e.to_string()))?;
    let decision_us = started.elapsed().as_secs_f64() * 1e6;
    let top = model
        .as_ref()
        .map_or_else(Vec::new, |m| crate::routing::top_features(&set, m, &prompt));
    if args.json {
        let classification = classification.as_ref();
        let explain = crate::routing::explain(&set, &decision, classification, &top, decision_us);
        println!("{explain}");
        return Ok(());
    }
    let chosen = &set.profiles[decision.profile];
    println!(
        "profile {} (tier {}), reason {}\ncomplexity {:.3}, task {:?}, required quality {:.3}\n",
        chosen.id,
        chosen.tier,
        decision.reason.as_str(),
        decision.complexity,
        decision.task_class,
        decision.required_quality
    );
    println!(
        "{:<20} {:>8} {:>8} {:>12} {:>12} {:>9}  rejected because",
        "candidate", "feasible", "quality", "latency_ms", "cost_usd", "utility"
    );
    for c in &decision.candidates {
        println!(
            "{:<20} {:>8} {:>8.3} {:>12.1} {:>12.8} {:>9.4}  {}",
            set.profiles[c.profile].id,
            c.feasible,
            c.quality,
            c.predicted_latency_ms,
            c.cost,
            c.utility,
            c.rejected_because.map_or("", |r| r.as_str())
        );
    }
    if let Some(c) = &classification {
        let classes: Vec<String> = quantrouter_policy::classifier::TASK_CLASSES
            .iter()
            .zip(c.class_probabilities)
            .map(|(class, p)| format!("{} {:.2}", class.as_str(), p))
            .collect();
        let [heavy, medium, light] = c.difficulty_probabilities;
        println!("\nclassifier: {}", classes.join(", "));
        println!("difficulty: heavy {heavy:.2}, medium {medium:.2}, light {light:.2}");
        println!(
            "\n{:<28} {:>10} {:>11}",
            "top feature", "difficulty", "task class"
        );
        for f in &top {
            println!(
                "{:<28} {:>+10.3} {:>+11.3}",
                f.feature, f.difficulty, f.task_class
            );
        }
    }
    Ok(())
}

fn run_audit(args: &AuditArgs) -> Result<(), CliError> {
    let set = load_set(args.profiles.as_deref())?;
    let text = std::fs::read_to_string(&args.prompts)
        .map_err(|e| CliError::Invalid(format!("reading {}: {e}", args.prompts.display())))?;
    let model = offline_classifier(&args.classifier)?;
    let report =
        audit(&set, model.as_ref(), &text).map_err(|e| CliError::Invalid(e.to_string()))?;
    print!("{report}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(args: &[&str]) -> Vec<OsString> {
        std::iter::once("quantrouter")
            .chain(args.iter().copied())
            .map(OsString::from)
            .collect()
    }

    fn serve_args(cli: Cli) -> ServeArgs {
        match cli.command {
            Command::Serve(args) => *args,
            other => panic!("expected serve, got {other:?}"),
        }
    }

    /// `serve --config <a file holding json> flags...`, parsed.
    fn parse_with_config_file(json: &str, flags: &[&str]) -> Result<Cli, CliError> {
        let dir = tempfile::Builder::new()
            .prefix("qr-cli-")
            .tempdir()
            .unwrap();
        let path = dir.path().join("config.json");
        std::fs::write(&path, json).unwrap();
        let mut args = vec!["serve", "--config", path.to_str().unwrap()];
        args.extend_from_slice(flags);
        parse_with_config(argv(&args))
    }

    #[test]
    fn config_file_fills_unset_flags_and_the_command_line_wins() {
        let cli = parse_with_config_file(
            r#"{"listen": "127.0.0.1:18080", "admin-listen": "127.0.0.1:19090",
                "model_alias": ["gpt-4o", "smart"], "header_timeout_ms": 1234}"#,
            &["--listen", "127.0.0.1:28080"],
        )
        .unwrap();
        let args = serve_args(cli);
        assert_eq!(args.listen, "127.0.0.1:28080".parse().unwrap());
        assert_eq!(args.admin_listen, "127.0.0.1:19090".parse().unwrap());
        assert_eq!(args.model_alias, vec!["gpt-4o", "smart"]);
        assert_eq!(args.header_timeout_ms, 1234);
        assert_eq!(args.log_format, LogFormat::Json);
        assert_eq!(args.discovery, DiscoveryMode::Dns);
    }

    #[test]
    fn discovery_mode_comes_from_the_flag_or_the_config_file() {
        let args =
            serve_args(parse_with_config(argv(&["serve", "--discovery", "kubernetes"])).unwrap());
        assert_eq!(args.discovery, DiscoveryMode::Kubernetes);
        let cli = parse_with_config_file(r#"{"discovery": "kubernetes"}"#, &[]).unwrap();
        assert_eq!(serve_args(cli).discovery, DiscoveryMode::Kubernetes);
        assert!(parse_with_config(argv(&["serve", "--discovery", "consul"])).is_err());
    }

    #[test]
    fn the_keda_scaler_listens_on_9091_unless_switched_off() {
        let args = serve_args(parse_with_config(argv(&["serve"])).unwrap());
        assert_eq!(
            args.keda_scaler_listen,
            OptionalListen(Some("0.0.0.0:9091".parse().unwrap()))
        );
        for off in ["off", ""] {
            let cli = parse_with_config(argv(&["serve", "--keda-scaler-listen", off])).unwrap();
            assert_eq!(serve_args(cli).keda_scaler_listen, OptionalListen(None));
        }
        let cli = parse_with_config(argv(&["serve", "--keda-scaler-listen", "127.0.0.1:7"]));
        assert_eq!(
            serve_args(cli.unwrap()).keda_scaler_listen,
            OptionalListen(Some("127.0.0.1:7".parse().unwrap()))
        );
        assert!(parse_with_config(argv(&["serve", "--keda-scaler-listen", "nope"])).is_err());
    }

    #[test]
    fn the_endpoint_picker_is_off_unless_given_an_address() {
        let args = serve_args(parse_with_config(argv(&["serve"])).unwrap());
        assert_eq!(args.epp_listen, OptionalListen(None));
        let cli = parse_with_config(argv(&["serve", "--epp-listen", "127.0.0.1:9002"]));
        assert_eq!(
            serve_args(cli.unwrap()).epp_listen,
            OptionalListen(Some("127.0.0.1:9002".parse().unwrap()))
        );
        assert!(parse_with_config(argv(&["serve", "--epp-listen", "nope"])).is_err());
    }

    #[test]
    fn workers_are_one_per_cpu_unless_set_and_never_zero() {
        let args = serve_args(parse_with_config(argv(&["serve"])).unwrap());
        assert_eq!(args.workers, None);
        let args = serve_args(parse_with_config(argv(&["serve", "--workers", "3"])).unwrap());
        assert_eq!(args.workers, Some(3));
        assert!(parse_with_config(argv(&["serve", "--workers", "0"])).is_err());
    }

    #[test]
    fn the_replica_id_is_the_flag_else_the_host_name_else_random() {
        let host = || Some("router-7f9c-abcde".to_owned());
        assert_eq!(replica_id(Some("pod-a".into()), host()), "pod-a");
        assert_eq!(replica_id(None, host()), "router-7f9c-abcde");
        let random = replica_id(None, Some(" ".into()));
        assert!(random.starts_with("qr-"), "{random}");
        assert_ne!(random, replica_id(None, None));
    }

    #[test]
    fn unknown_config_setting_is_an_error_naming_the_file_and_key() {
        let err = parse_with_config_file(r#"{"lisen": "127.0.0.1:1"}"#, &[]).unwrap_err();
        let err = err.to_string();
        assert!(err.contains("unknown setting `lisen`"), "{err}");
        assert!(err.contains("config.json"), "{err}");
    }

    #[test]
    fn a_config_file_with_every_flag_type_parses_as_the_flags_do() {
        let file = serve_args(
            parse_with_config_file(
                r#"{
                    "listen": "127.0.0.1:18080",
                    "admin-listen": "[::1]:19090",
                    "keda_scaler_listen": "off",
                    "log_prompts": true,
                    "header_timeout_ms": 1234,
                    "body_limit_bytes": 65536,
                    "max_attempts": 2,
                    "max_connections": 300,
                    "model_alias": ["gpt-4o", "smart"],
                    "seed_endpoint": ["m=http://a:8000", "n=http://b:8000"],
                    "redis_url": "redis://cache:6379",
                    "profiles": "/etc/quantrouter/profiles.json",
                    "classifier": "off",
                    "discovery": "kubernetes",
                    "log_format": "text"
                }"#,
                &[],
            )
            .unwrap(),
        );
        let flags = serve_args(
            parse_with_config(argv(&[
                "serve",
                "--listen=127.0.0.1:18080",
                "--admin-listen=[::1]:19090",
                "--keda-scaler-listen=off",
                "--log-prompts",
                "--header-timeout-ms=1234",
                "--body-limit-bytes=65536",
                "--max-attempts=2",
                "--max-connections=300",
                "--model-alias=gpt-4o",
                "--model-alias=smart",
                "--seed-endpoint=m=http://a:8000",
                "--seed-endpoint=n=http://b:8000",
                "--redis-url=redis://cache:6379",
                "--profiles=/etc/quantrouter/profiles.json",
                "--classifier=off",
                "--discovery=kubernetes",
                "--log-format=text",
            ]))
            .unwrap(),
        );
        assert!(file.config.is_some());
        assert_eq!(
            ServeArgs {
                config: None,
                ..file
            },
            flags
        );
    }

    #[test]
    fn a_json_boolean_in_the_config_file_sets_a_switch() {
        let on = serve_args(parse_with_config_file(r#"{"log_prompts": true}"#, &[]).unwrap());
        assert!(on.log_prompts);
        let off = serve_args(parse_with_config_file(r#"{"log-prompts": false}"#, &[]).unwrap());
        assert!(!off.log_prompts);
        // The flag wins over the file.
        let cli = parse_with_config_file(r#"{"log_prompts": false}"#, &["--log-prompts"]);
        assert!(serve_args(cli.unwrap()).log_prompts);
    }

    #[test]
    fn a_config_value_the_flag_would_reject_is_an_error_naming_the_key() {
        for (json, key) in [
            (r#"{"listen": 8080}"#, "listen"),
            (r#"{"log_prompts": "yes"}"#, "log_prompts"),
            (r#"{"model_alias": "smart"}"#, "model_alias"),
            (r#"{"discovery": "consul"}"#, "discovery"),
            (r#"{"max_connections": 0}"#, "max-connections"),
            (r#"{"header_timeout_ms": -1}"#, "header-timeout-ms"),
        ] {
            let err = parse_with_config_file(json, &[]).unwrap_err().to_string();
            assert!(err.contains(key), "{json}: {err}");
            assert!(err.contains("config.json"), "{json}: {err}");
        }
    }

    #[test]
    fn api_keys_file_skips_comments_and_rejects_empty_files() {
        let dir = tempfile::Builder::new()
            .prefix("qr-keys-")
            .tempdir()
            .unwrap();
        let path = dir.path().join("keys");
        std::fs::write(&path, "# team a\nkey-1\n\n  key-2  \n").unwrap();
        let keys = read_api_keys(&path).unwrap();
        assert_eq!(
            keys,
            HashSet::from(["key-1".to_owned(), "key-2".to_owned()])
        );
        std::fs::write(&path, "# nothing\n").unwrap();
        assert!(read_api_keys(&path).is_err());
    }
}
