//! `loadtest ab`: two or more router builds (say, before and after a change, or one binary
//! with different flags) against one zero-latency simulator, with direct as the baseline and
//! vllm-router beside them when it is installed. Each round runs every target one after the
//! other, so the machine's drift hits all of them alike; CPU per request is the target's
//! user + system time in the measured window over the requests it answered.

use std::fmt::Write as _;
use std::path::Path;

use clap::Args;
use serde_json::json;

use super::services::single_profile;
use super::{describe, write_section, Load, Suite, SuiteOptions, Target};
use crate::run::LoadMode;
use crate::scenario::Scenario;

/// `loadtest ab`.
#[derive(Debug, Args)]
pub struct AbArgs {
    /// Router builds, named A, B, C… in this order: a binary, optionally followed by flags
    /// for its `serve` in the same argument (`"target/release/quantrouter --workers 1"`).
    #[arg(num_args = 2.., required = true)]
    pub routers: Vec<String>,
    /// Open loop at this rate (the default: 200 req/s).
    #[arg(long, conflicts_with = "concurrency")]
    pub rate: Option<f64>,
    /// Closed loop with this many clients.
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Rounds of every target.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Durations, binaries and places (`--router` is not used: the builds above are).
    #[command(flatten)]
    pub options: SuiteOptions,
}

/// Runs `loadtest ab`; the table goes to stdout and `<results>/ab/section.md`.
pub async fn run_ab(args: AbArgs) -> anyhow::Result<()> {
    let mut options = args.options.clone();
    options.router = args.routers.first().map(|spec| binary(spec).into());
    let suite = Suite::new(options)?;
    let result = compare(&suite, &args).await;
    if result.is_err() {
        suite.print_log_tails();
    }
    println!("{}", result?);
    Ok(())
}

/// The binary of a router spec: its first word.
fn binary(spec: &str) -> &str {
    spec.split_whitespace().next().unwrap_or(spec)
}

/// The target name of the `index`th router build: A, B, …, Z, then R27, R28, ….
fn build_name(index: usize) -> String {
    match u8::try_from(index) {
        Ok(i) if i < 26 => char::from(b'A' + i).to_string(),
        _ => format!("R{}", index + 1),
    }
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
    let mut out = format!(
        "Load: {}; {} rounds of {} s. CPU per request: user + system time of the target's \
         processes in the measured window over the requests answered in it.\n\n",
        describe(mode),
        args.rounds,
        suite.options.duration_s
    );
    let mut servers = Vec::new();
    let mut targets = vec![Target::new("direct", &sim.url, "sim-model")];
    for (index, spec) in args.routers.iter().enumerate() {
        let name = build_name(index);
        let flags: Vec<&str> = spec.split_whitespace().skip(1).collect();
        let server = suite
            .start_router_binary(
                &format!("router-{name}"),
                Path::new(binary(spec)),
                &profiles,
                &flags,
                &[],
            )
            .await?;
        let _ = writeln!(out, "- {name} = `{spec}`");
        targets.push(Target::new(&name, &server.url, "auto"));
        servers.push(server);
    }
    if let Some(server) = suite.start_vllm_router(&sim.url).await {
        targets.push(Target::new("vllm-router", &server.url, "sim-model"));
        servers.push(server);
    }
    out.push_str(
        "\n| round | run | throughput (req/s) | p50 (µs) | p99 (µs) | CPU per request |\n\
         |---|---|---|---|---|---|\n",
    );
    // Direct has no process of its own here; the others line up with `servers`.
    let processes: Vec<_> = std::iter::once(None)
        .chain(servers.iter().map(|s| Some(&s.proc)))
        .collect();
    for round in 1..=args.rounds {
        for (target, process) in targets.iter().zip(&processes) {
            suite.settle().await;
            let load = Load::new(Scenario::Overhead, mode, suite.duration())
                .warmup(suite.warmup())
                .max_outstanding(2000);
            let file = dir.join(format!("{}-{round}.json", target.name));
            let (report, cpu) = suite
                .run_load_with_cpu(&target.name, target, &load, &file, *process)
                .await?;
            let cpu = match cpu {
                Some(seconds) if report.ok > 0 => {
                    format!("{:.0} µs", seconds * 1e6 / report.ok as f64)
                }
                _ => "—".to_owned(),
            };
            let _ = writeln!(
                out,
                "| {round} | {} | {:.0} | {} | {} | {cpu} |",
                target.name, report.throughput_rps, report.latency_us.p50, report.latency_us.p99
            );
        }
    }
    drop(processes);
    for server in servers {
        server.proc.kill().await;
    }
    sim.proc.kill().await;
    write_section(&dir, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_are_named_by_letter_and_flags_follow_the_binary() {
        assert_eq!(build_name(0), "A");
        assert_eq!(build_name(25), "Z");
        assert_eq!(build_name(26), "R27");
        assert_eq!(
            binary("target/release/quantrouter --workers 1"),
            "target/release/quantrouter"
        );
        assert_eq!(binary("/tmp/qr-base"), "/tmp/qr-base");
    }
}
