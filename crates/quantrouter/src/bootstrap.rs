//! Assembling a router from its typed configuration: `serve` builds the profile store, the
//! classifier, discovery, the tenants, and the servers' configuration from [`ServeArgs`], starts
//! the [`Server`] and runs until a signal; `demo` does the same around simulated tiers. The
//! CLI only parses and dispatches here.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use quantrouter_policy::{ProfileSet, StaticUpstream, Upstream, UpstreamApi, DEFAULT_PROFILE_SET};

use crate::classifier::{ClassifierConfig, ClassifierStore};
use crate::cli::error::CliError;
use crate::cli::serve::{
    parse_seed_endpoints, replica_id, ClassifierChoice, DemoArgs, DiscoveryMode, ServeArgs,
};
use crate::discovery::{self, Discovery, DiscoveryConfig};
use crate::keda::publish::RedisTarget;
use crate::keda::KedaConfig;
use crate::profiles::{self, ProfileStore, SourceKind};
use crate::redis_conn::Redis;
use crate::resilience::ResilienceConfig;
use crate::server::{Server, ServerConfig};
use crate::telemetry::{self, LogFormat};
use crate::upstream::ClientConfig;

/// Runs the router until SIGTERM or Ctrl-C, then shuts it down gracefully.
pub async fn serve(args: ServeArgs) -> Result<(), CliError> {
    telemetry::init_logging(args.log_format);
    crate::documents::set_max_bytes(args.max_document_bytes);
    crate::descriptors::raise_limit();
    // Before anything records a metric (the profile store sets the version gauge).
    telemetry::metrics_handle();
    // One for the process: its clones share the Sentinel tracking.
    let redis = redis(&args)?;
    let store = start_profiles(&args, redis.clone()).await?;
    let classifier = start_classifier(&args, redis.clone()).await?;
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
    let keda = keda_config(&args, redis.clone());
    let tenants = start_tenants(&args, &keda.replica_id, redis.clone()).await?;
    let stored_responses = crate::apis::stored::StoreConfig {
        redis,
        ..Default::default()
    };
    let config = ServerConfig {
        listen: args.listen,
        admin_listen: args.admin_listen,
        scaler_listen: args.keda_scaler_listen.0,
        epp_listen: args.epp_listen.0,
        epp_reads_answers: args.epp_usage == crate::cli::serve::EppUsage::Always,
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

/// The router's one Redis (`--redis-url`) and key prefix, if it has one: profiles, the
/// classifier, tenants, stored Responses and the KEDA numbers all live there. A bad URL
/// is refused here, at start-up, naming the part at fault.
fn redis(args: &ServeArgs) -> Result<Option<(Redis, String)>, CliError> {
    let Some(url) = &args.redis_url else {
        return match args.redis_sentinel_password {
            Some(_) => Err(CliError::Invalid(
                "--redis-sentinel-password needs --redis-url".into(),
            )),
            None => Ok(None),
        };
    };
    let redis = crate::cli::documents::open_redis(
        url,
        &args.redis_prefix,
        args.redis_ca_file.clone(),
        args.redis_sentinel_password.clone(),
    )?;
    tracing::info!(redis = %redis.url(), "shared state in redis");
    Ok(Some((redis, args.redis_prefix.clone())))
}

/// With `--redis-url`, replicas share their tier numbers through the profile Redis.
fn keda_config(args: &ServeArgs, redis: Option<(Redis, String)>) -> KedaConfig {
    KedaConfig {
        redis: redis.map(|(redis, prefix)| RedisTarget { redis, prefix }),
        replica_id: replica_id(args.replica_id.clone(), std::env::var("HOSTNAME").ok()),
        ..KedaConfig::default()
    }
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
async fn start_profiles(
    args: &ServeArgs,
    redis: Option<(Redis, String)>,
) -> Result<Arc<ProfileStore>, CliError> {
    let mut sources: Vec<Arc<dyn profiles::ProfileSource>> = Vec::new();
    if let Some((redis, prefix)) = redis {
        let config = profiles::redis_source::RedisSourceConfig {
            prefix,
            poll: Duration::from_millis(args.redis_poll_ms.max(10)),
            seed_endpoints: parse_seed_endpoints(&args.seed_endpoint)?,
        };
        sources.push(Arc::new(profiles::redis_source::RedisSource {
            redis,
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
    redis: Option<(Redis, String)>,
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

async fn start_classifier(
    args: &ServeArgs,
    redis: Option<(Redis, String)>,
) -> Result<Arc<ClassifierStore>, CliError> {
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
        // vllm-sim serves the agent APIs natively, as vLLM does: nothing is translated.
        profile.upstream = Upstream::Static(StaticUpstream {
            apis: vec![
                UpstreamApi::Chat,
                UpstreamApi::Completions,
                UpstreamApi::Messages,
                UpstreamApi::Responses,
            ],
            ..StaticUpstream::new(vec![sim.url()])
        });
        sims.push(sim);
    }
    set.validate()
        .map_err(|e| CliError::Invalid(e.to_string()))?;
    Ok((set, sims))
}

/// Runs the router in front of simulated tiers until Ctrl-C.
pub async fn demo(args: DemoArgs) -> Result<(), CliError> {
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
