//! `loadtest ab`: two router binaries (say, before and after a change) against one
//! zero-latency simulator, with direct as the baseline. Each round runs direct, A and B one
//! after the other, so the machine's drift hits all three alike.

use std::fmt::Write as _;
use std::path::PathBuf;

use clap::Args;
use serde_json::json;

use super::services::single_profile;
use super::{describe, write_section, Load, Suite, SuiteOptions, Target};
use crate::run::LoadMode;
use crate::scenario::Scenario;

/// `loadtest ab`.
#[derive(Debug, Args)]
pub struct AbArgs {
    /// Router binary A (say, before the change).
    pub a: PathBuf,
    /// Router binary B.
    pub b: PathBuf,
    /// Open loop at this rate (the default: 200 req/s).
    #[arg(long, conflicts_with = "concurrency")]
    pub rate: Option<f64>,
    /// Closed loop with this many clients.
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Rounds of direct, A, B.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Durations, binaries and places (`--router` is not used: A and B are).
    #[command(flatten)]
    pub options: SuiteOptions,
}

/// Runs `loadtest ab`; the table goes to stdout and `<results>/ab/section.md`.
pub async fn run_ab(args: AbArgs) -> anyhow::Result<()> {
    let mut options = args.options.clone();
    options.router = Some(args.a.clone());
    let suite = Suite::new(options)?;
    let result = compare(&suite, &args).await;
    if result.is_err() {
        suite.print_log_tails();
    }
    println!("{}", result?);
    Ok(())
}

async fn compare(suite: &Suite, args: &AbArgs) -> anyhow::Result<String> {
    let dir = suite.scenario_dir("ab")?;
    let mode = match (args.rate, args.concurrency) {
        (_, Some(clients)) => LoadMode::Concurrency(clients),
        (rate, None) => LoadMode::Rate(rate.unwrap_or(200.0)),
    };
    let sim = suite
        .start_sim("sim", "sim-model", (0, 0), 1024, None)
        .await?;
    let profiles = suite.write_profiles(
        "ab-profiles.json",
        1,
        "sim",
        json!({}),
        &[single_profile(&sim.url, (10, 1), 4096)],
    )?;
    let a = suite
        .start_router_binary("router-a", &args.a, &profiles, &[], &[])
        .await?;
    let b = suite
        .start_router_binary("router-b", &args.b, &profiles, &[], &[])
        .await?;
    let targets = [
        Target::new("direct", &sim.url, "sim-model"),
        Target::new("A", &a.url, "auto"),
        Target::new("B", &b.url, "auto"),
    ];
    let mut out = format!(
        "A = `{}`, B = `{}`; load: {}; {} rounds of {} s\n\n\
         | round | run | throughput (req/s) | p50 (µs) | p99 (µs) |\n|---|---|---|---|---|\n",
        args.a.display(),
        args.b.display(),
        describe(mode),
        args.rounds,
        suite.options.duration_s
    );
    for round in 1..=args.rounds {
        for target in &targets {
            suite.settle().await;
            let load = Load::new(Scenario::Overhead, mode, suite.duration())
                .warmup(suite.warmup())
                .max_outstanding(2000);
            let file = dir.join(format!("{}-{round}.json", target.name));
            let report = suite.run_load(&target.name, target, &load, &file).await?;
            let _ = writeln!(
                out,
                "| {round} | {} | {:.0} | {} | {} |",
                target.name, report.throughput_rps, report.latency_us.p50, report.latency_us.p99
            );
        }
    }
    for server in [a, b] {
        server.proc.kill().await;
    }
    sim.proc.kill().await;
    write_section(&dir, out)
}
