//! Command-line interface: `loadtest run` and `loadtest compare`.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::compare::compare;
use crate::report::RunReport;
use crate::run::{run, LoadMode, RunConfig, DEFAULT_MAX_OUTSTANDING};
use crate::workload::{resolve_prompts, shuffle, Endpoint};

/// Open- and closed-loop load generator for OpenAI-compatible endpoints.
#[derive(Debug, Parser)]
#[command(name = "loadtest", version)]
pub struct Cli {
    /// Tokio worker threads (default: one per core).
    #[arg(long, global = true)]
    pub threads: Option<usize>,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Drive an endpoint and report latency, TTFT, throughput and errors.
    Run(RunArgs),
    /// Print the latency a subject run adds over a baseline run.
    Compare(CompareArgs),
}

/// `loadtest run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Base URL of the OpenAI-compatible server.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// Open loop: arrivals per second, latency measured from each scheduled send time.
    #[arg(
        long,
        conflicts_with = "concurrency",
        required_unless_present = "concurrency"
    )]
    pub rate: Option<f64>,
    /// Closed loop: workers sending back to back.
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Measured window in seconds.
    #[arg(long)]
    pub duration_s: f64,
    /// Warm-up before the measured window (sent, not recorded).
    #[arg(long, default_value_t = 0.0)]
    pub warmup_s: f64,
    /// JSONL file with a "prompt" field per line (default: ../shared/eval/prompt-mix.jsonl
    /// from the repository root if present, else "Say hello.").
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// Shuffle the prompts with this seed instead of sending them in file order.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Share of streamed requests, 0.0..=1.0.
    #[arg(long, default_value_t = 0.0)]
    pub stream_share: f64,
    /// `max_tokens` of every request.
    #[arg(long, default_value_t = 16)]
    pub max_tokens: u32,
    /// `model` of every request (`auto` lets quantrouter choose).
    #[arg(long, default_value = "auto")]
    pub model: String,
    /// API to call.
    #[arg(long, value_enum, default_value_t = Endpoint::Chat)]
    pub endpoint: Endpoint,
    /// Name of the run in the results (default: mode and URL).
    #[arg(long)]
    pub label: Option<String>,
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Open-loop cap on requests in flight; the excess counts as `client_overflow`.
    #[arg(long, default_value_t = DEFAULT_MAX_OUTSTANDING)]
    pub max_outstanding: usize,
    /// Per-request timeout in seconds, from send to last byte.
    #[arg(long, default_value_t = 60.0)]
    pub timeout_s: f64,
    /// TCP connect timeout in seconds.
    #[arg(long, default_value_t = 5.0)]
    pub connect_timeout_s: f64,
}

/// `loadtest compare`.
#[derive(Debug, Args)]
pub struct CompareArgs {
    /// Results of the baseline run (e.g. direct to the upstream).
    #[arg(long)]
    pub baseline: PathBuf,
    /// Results of the subject run (e.g. through the router).
    #[arg(long)]
    pub subject: PathBuf,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// A multi-threaded runtime with `threads` workers (tokio's default when `None`).
pub fn build_runtime(threads: Option<usize>) -> anyhow::Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.enable_all();
    if let Some(threads) = threads {
        anyhow::ensure!(threads > 0, "--threads must be at least 1");
        builder.worker_threads(threads);
    }
    Ok(builder.build()?)
}

/// Runs a parsed command line.
pub async fn execute(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Run(args) => run_command(args).await,
        Command::Compare(args) => compare_command(&args),
    }
}

async fn run_command(args: RunArgs) -> anyhow::Result<()> {
    let config = run_config(&args)?;
    let report = run(&config).await?;
    print!("{}", report.render_table());
    if let Some(out) = &args.out {
        report.write_json(out)?;
        println!("wrote {}", out.display());
    }
    Ok(())
}

/// Turns `run` arguments into a [`RunConfig`], loading the prompts.
pub fn run_config(args: &RunArgs) -> anyhow::Result<RunConfig> {
    let mode = match (args.rate, args.concurrency) {
        (Some(rate), None) => LoadMode::Rate(rate),
        (None, Some(workers)) => LoadMode::Concurrency(workers),
        _ => anyhow::bail!("give exactly one of --rate and --concurrency"),
    };
    let (mut prompts, source) = resolve_prompts(args.prompts.as_deref())?;
    if let Some(seed) = args.seed {
        shuffle(&mut prompts, seed);
    }
    eprintln!("loadtest: {} prompts from {source}", prompts.len());
    let label = args.label.clone().unwrap_or_else(|| match mode {
        LoadMode::Rate(rate) => format!("rate{rate} {}", args.url),
        LoadMode::Concurrency(workers) => format!("c{workers} {}", args.url),
    });
    Ok(RunConfig {
        url: args.url.clone(),
        mode,
        duration: seconds("--duration-s", args.duration_s)?,
        warmup: seconds("--warmup-s", args.warmup_s)?,
        prompts,
        stream_share: args.stream_share,
        max_tokens: args.max_tokens,
        model: args.model.clone(),
        endpoint: args.endpoint,
        label,
        max_outstanding: args.max_outstanding,
        request_timeout: seconds("--timeout-s", args.timeout_s)?,
        connect_timeout: seconds("--connect-timeout-s", args.connect_timeout_s)?,
    })
}

fn compare_command(args: &CompareArgs) -> anyhow::Result<()> {
    let baseline = RunReport::read_json(&args.baseline)?;
    let subject = RunReport::read_json(&args.subject)?;
    let comparison = compare(&baseline, &subject);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&comparison)?);
    } else {
        print!("{}", comparison.render_table());
    }
    Ok(())
}

fn seconds(flag: &str, value: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(value).map_err(|_| {
        anyhow::anyhow!("{flag} must be a non-negative number of seconds, got {value}")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("loadtest").chain(args.iter().copied()))
    }

    #[test]
    fn rate_and_concurrency_are_exclusive_and_one_is_required() {
        assert!(parse(&[
            "run",
            "--rate",
            "10",
            "--concurrency",
            "2",
            "--duration-s",
            "1"
        ])
        .is_err());
        assert!(parse(&["run", "--duration-s", "1"]).is_err());
        assert!(parse(&["run", "--concurrency", "2", "--duration-s", "1"]).is_ok());
    }

    #[test]
    fn run_flags_become_a_config() {
        let cli = parse(&[
            "run",
            "--url",
            "http://h:1/",
            "--rate",
            "200",
            "--duration-s",
            "15",
            "--warmup-s",
            "2",
            "--stream-share",
            "1.0",
            "--endpoint",
            "completions",
            "--model",
            "sim-model",
            "--label",
            "direct",
        ])
        .unwrap();
        let Command::Run(args) = cli.command else {
            panic!("not run");
        };
        let config = run_config(&args).unwrap();
        assert_eq!(config.mode, LoadMode::Rate(200.0));
        assert_eq!(config.duration, Duration::from_secs(15));
        assert_eq!(config.warmup, Duration::from_secs(2));
        assert_eq!(config.endpoint, Endpoint::Completions);
        assert_eq!(config.label, "direct");
        assert!(!config.prompts.is_empty());
    }

    #[test]
    fn negative_durations_are_rejected() {
        assert!(seconds("--duration-s", -1.0).is_err());
        assert!(seconds("--duration-s", f64::NAN).is_err());
    }
}
