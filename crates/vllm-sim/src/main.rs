//! `vllm-sim`: one simulated vLLM OpenAI-compatible server.

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use vllm_sim::{MetricsFlavor, SimConfig, SimServer};

/// A vLLM-compatible OpenAI server simulator with a latency model and run-time fault
/// injection (`POST /sim/faults`).
#[derive(Debug, Parser)]
#[command(name = "vllm-sim", version)]
struct Args {
    /// Address to listen on; port 0 picks a free port (the chosen one is printed).
    #[arg(long, env = "VLLM_SIM_LISTEN", default_value = "127.0.0.1:8000")]
    listen: SocketAddr,
    /// The served model name; requests for another model get 404.
    #[arg(long, env = "VLLM_SIM_MODEL", default_value = "sim-model")]
    model: String,
    /// Time to first token in milliseconds.
    #[arg(long, env = "VLLM_SIM_TTFT_MS", default_value_t = 0)]
    ttft_ms: u64,
    /// Inter-token latency in milliseconds.
    #[arg(long, env = "VLLM_SIM_ITL_MS", default_value_t = 0)]
    itl_ms: u64,
    /// Requests running at once; the rest queue.
    #[arg(long, env = "VLLM_SIM_MAX_NUM_SEQS", default_value_t = 256)]
    max_num_seqs: usize,
    /// Seed mixed into the generated text.
    #[arg(long, env = "VLLM_SIM_SEED", default_value_t = 0)]
    seed: u64,
    /// The server whose metric names `/metrics` uses; `llamacpp` also sends a stream's
    /// response headers before prefill, as llama.cpp does.
    #[arg(long, env = "VLLM_SIM_METRICS_FLAVOR", value_enum, default_value_t = MetricsFlavor::Vllm)]
    metrics_flavor: MetricsFlavor,
    /// Require `Authorization: Bearer KEY` on every route but `/health` and `/sim/*`.
    #[arg(long, env = "VLLM_SIM_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Serve only chat and completions: `/v1/messages` and `/v1/responses` answer 404, as on
    /// a server that lacks them (a router must translate).
    #[arg(long, env = "VLLM_SIM_CHAT_ONLY")]
    chat_only: bool,
    /// Prefix-cache capacity in KV blocks (vLLM's `--enable-prefix-caching`); 0 = off.
    #[arg(long, env = "VLLM_SIM_PREFIX_CACHE_BLOCKS", default_value_t = 0)]
    prefix_cache_blocks: usize,
    /// Tokens per KV block, the prefix cache's unit (vLLM's `--block-size`).
    #[arg(long, env = "VLLM_SIM_BLOCK_SIZE", default_value_t = vllm_sim::DEFAULT_BLOCK_SIZE as u64,
          value_parser = clap::value_parser!(u64).range(1..=4096))]
    block_size: u64,
    /// Prefill time per uncached prompt token, in microseconds, added to the time to first
    /// token.
    #[arg(long, env = "VLLM_SIM_PREFILL_US_PER_TOKEN", default_value_t = 0)]
    prefill_us_per_token: u64,
    /// Serve HTTPS with this PEM certificate chain (leaf first); needs `--tls-key`.
    #[arg(long, env = "VLLM_SIM_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The PEM private key of `--tls-cert`.
    #[arg(long, env = "VLLM_SIM_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args = Args::parse();
    let config = SimConfig {
        model: args.model,
        ttft: Duration::from_millis(args.ttft_ms),
        itl: Duration::from_millis(args.itl_ms),
        max_num_seqs: args.max_num_seqs,
        seed: args.seed,
        metrics_flavor: args.metrics_flavor,
        api_key: args.api_key,
        chat_only: args.chat_only,
        prefix_cache_blocks: args.prefix_cache_blocks,
        block_size: usize::try_from(args.block_size).unwrap_or(vllm_sim::DEFAULT_BLOCK_SIZE),
        prefill_per_token: Duration::from_micros(args.prefill_us_per_token),
    };
    let model = config.model.clone();
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => match read_tls(cert, key) {
            Ok(tls) => Some(tls),
            Err(error) => {
                tracing::error!(%error, "cannot serve HTTPS");
                return ExitCode::FAILURE;
            }
        },
        _ => None,
    };
    let bound = match tls {
        Some(tls) => SimServer::bind_tls(args.listen, config, tls).await,
        None => SimServer::bind(args.listen, config).await,
    };
    let server = match bound {
        Ok(server) => server,
        Err(error) => {
            tracing::error!(listen = %args.listen, %error, "cannot listen");
            return ExitCode::FAILURE;
        }
    };
    // Scripts wait for this line to learn the URL (and the port, when 0 was asked for).
    let mut stdout = std::io::stdout().lock();
    let announced = writeln!(
        stdout,
        "vllm-sim listening on {} model={model}",
        server.url()
    )
    .and_then(|()| stdout.flush());
    drop(stdout);
    if let Err(error) = announced {
        tracing::warn!(%error, "cannot write to stdout");
    }
    tracing::info!(url = %server.url(), %model, "vllm-sim ready");
    shutdown_signal().await;
    tracing::info!("shutting down");
    server.shutdown().await;
    ExitCode::SUCCESS
}

/// The TLS configuration of `--tls-cert` and `--tls-key`.
fn read_tls(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, String> {
    let read = |path: &Path| std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()));
    vllm_sim::tls::server_config(&read(cert)?, &read(key)?).map_err(|e| e.to_string())
}

/// Resolves on ctrl-c or SIGTERM (what Kubernetes and scripts send).
async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(error) = tokio::signal::ctrl_c().await {
            tracing::warn!(%error, "cannot listen for ctrl-c");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut sigterm) => {
                sigterm.recv().await;
            }
            Err(error) => {
                tracing::warn!(%error, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
}
