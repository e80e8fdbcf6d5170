//! Command-line interface: `loadtest run`, `compare`, `table`, `suite` and `ab`.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::client::Transport;
use crate::compare::compare;
use crate::markdown;
use crate::report::RunReport;
use crate::run::{run, LoadMode, RunConfig, DEFAULT_MAX_OUTSTANDING};
use crate::scenario::Scenario;
use crate::suite::{run_ab, run_suite, AbArgs, SuiteArgs};
use crate::workload::{resolve_prompts, shuffle, Endpoint, TokenMix};

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
    Run(Box<RunArgs>),
    /// Print the latency a subject run adds over a baseline run.
    Compare(CompareArgs),
    /// Print a Markdown table of runs with ratios to the first (the baseline).
    Table(TableArgs),
    /// Run benchmark scenarios end to end: start the simulators, the router and the
    /// alternatives it is compared with, drive them, and write the results and the tables
    /// of docs/performance.md.
    Suite(Box<SuiteArgs>),
    /// Compare two router binaries in one run, round by round, with direct as the baseline.
    Ab(Box<AbArgs>),
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
    /// JSONL file with a "prompt" field per line (default: eval/prompt-mix.jsonl
    /// from the repository root if present, else "Say hello.").
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// Shuffle the prompts with this seed instead of sending them in file order.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Scenario preset for the request shape (stream share, `max_tokens` mix, answer
    /// checks); explicit flags win.
    #[arg(long, value_enum)]
    pub preset: Option<Scenario>,
    /// Share of streamed requests, 0.0..=1.0 (default 0, or the preset's).
    #[arg(long)]
    pub stream_share: Option<f64>,
    /// `max_tokens`: one value (`16`) or a weighted mix (`16:60,64:30,256:10`); default 16,
    /// or the preset's.
    #[arg(long)]
    pub max_tokens: Option<String>,
    /// Check that every non-streamed 200 is a completion (error bodies are always checked).
    #[arg(long)]
    pub check_answers: bool,
    /// Send vLLM's `ignore_eos`: every answer runs to its `max_tokens` (default off, or the
    /// preset's).
    #[arg(long)]
    pub ignore_eos: bool,
    /// `model` of every request (`auto` lets quantrouter choose).
    #[arg(long, default_value = "auto")]
    pub model: String,
    /// API key sent as `Authorization: Bearer KEY` (a router with tenants or API keys).
    #[arg(long)]
    pub api_key: Option<String>,
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
    /// Speak HTTP/2 with prior knowledge (h2c) over this many connections, requests spread
    /// round-robin, instead of HTTP/1.1 with a connection per request in flight.
    #[arg(long, value_name = "CONNECTIONS", value_parser = clap::value_parser!(u32).range(1..))]
    pub http2: Option<u32>,
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

/// `loadtest table`.
#[derive(Debug, Args)]
pub struct TableArgs {
    /// Result files; the first is the baseline the ratios refer to.
    #[arg(required = true)]
    pub runs: Vec<PathBuf>,
    /// Add per-tier rows (tier mix, p99 TTFT per tier).
    #[arg(long)]
    pub tiers: bool,
    /// Add the lost-request accounting columns.
    #[arg(long)]
    pub answers: bool,
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
        Command::Run(args) => run_command(*args).await,
        Command::Compare(args) => compare_command(&args),
        Command::Table(args) => table_command(&args),
        Command::Suite(args) => until_interrupted(run_suite(*args)).await,
        Command::Ab(args) => until_interrupted(run_ab(*args)).await,
    }
}

/// Runs `work` unless SIGINT or SIGTERM comes first; then `work` is dropped, which kills
/// every process it started.
async fn until_interrupted(
    work: impl std::future::Future<Output = anyhow::Result<()>>,
) -> anyhow::Result<()> {
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        result = work => result,
        _ = tokio::signal::ctrl_c() => anyhow::bail!("interrupted"),
        _ = terminate.recv() => anyhow::bail!("terminated"),
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
    let preset = args.preset.map(Scenario::preset);
    let stream_share = args
        .stream_share
        .or(preset.as_ref().map(|p| p.stream_share))
        .unwrap_or(0.0);
    let max_tokens = match (&args.max_tokens, &preset) {
        (Some(text), _) => TokenMix::parse(text).map_err(|e| e.context("--max-tokens"))?,
        (None, Some(preset)) => preset.max_tokens.clone(),
        (None, None) => TokenMix::fixed(16),
    };
    let check_answers = args.check_answers || preset.as_ref().is_some_and(|p| p.check_answers);
    let ignore_eos = args.ignore_eos || preset.as_ref().is_some_and(|p| p.ignore_eos);
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
        stream_share,
        max_tokens,
        check_answers,
        ignore_eos,
        model: args.model.clone(),
        endpoint: args.endpoint,
        label,
        max_outstanding: args.max_outstanding,
        request_timeout: seconds("--timeout-s", args.timeout_s)?,
        connect_timeout: seconds("--connect-timeout-s", args.connect_timeout_s)?,
        transport: args
            .http2
            .map_or(Transport::Http1, |connections| Transport::Http2 {
                connections: connections as usize,
            }),
        api_key: args.api_key.clone(),
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

fn table_command(args: &TableArgs) -> anyhow::Result<()> {
    let reports = args
        .runs
        .iter()
        .map(|path| RunReport::read_json(path))
        .collect::<anyhow::Result<Vec<_>>>()?;
    print!("{}", markdown::runs_table(&reports));
    if args.answers {
        println!();
        print!("{}", markdown::answers_table(&reports));
    }
    if args.tiers {
        println!();
        print!("{}", markdown::tiers_table(&reports));
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
        assert_eq!(config.stream_share, 1.0);
        assert_eq!(config.max_tokens, TokenMix::fixed(16));
        assert!(!config.check_answers);
        assert_eq!(config.mode, LoadMode::Rate(200.0));
        assert_eq!(config.duration, Duration::from_secs(15));
        assert_eq!(config.warmup, Duration::from_secs(2));
        assert_eq!(config.endpoint, Endpoint::Completions);
        assert_eq!(config.label, "direct");
        assert!(!config.prompts.is_empty());
    }

    fn run_args(args: &[&str]) -> RunArgs {
        let mut all = vec!["run", "--rate", "10", "--duration-s", "1"];
        all.extend_from_slice(args);
        match parse(&all).unwrap().command {
            Command::Run(args) => *args,
            other => panic!("not run: {other:?}"),
        }
    }

    #[test]
    fn a_preset_sets_the_request_shape_and_flags_override_it() {
        let config = run_config(&run_args(&["--preset", "mixed"])).unwrap();
        assert_eq!(config.stream_share, 0.1);
        assert_eq!(
            config.max_tokens,
            TokenMix::parse(crate::scenario::MIXED_TOKENS).unwrap()
        );
        let config = run_config(&run_args(&[
            "--preset",
            "mixed",
            "--stream-share",
            "0.5",
            "--max-tokens",
            "8:1,9:1",
        ]))
        .unwrap();
        assert_eq!(config.stream_share, 0.5);
        assert_eq!(config.max_tokens.values().collect::<Vec<_>>(), [8, 9]);
        assert!(
            run_config(&run_args(&["--preset", "chaos"]))
                .unwrap()
                .check_answers
        );
        assert!(parse(&[
            "run",
            "--rate",
            "1",
            "--duration-s",
            "1",
            "--preset",
            "nope"
        ])
        .is_err());
        let error = run_config(&run_args(&["--max-tokens", "16:x"])).unwrap_err();
        assert!(format!("{error:#}").contains("--max-tokens"), "{error:#}");
    }

    #[test]
    fn negative_durations_are_rejected() {
        assert!(seconds("--duration-s", -1.0).is_err());
        assert!(seconds("--duration-s", f64::NAN).is_err());
    }
}
