//! `overhead`: what the router adds against a zero-latency simulator, beside direct, a
//! do-nothing relay and the alternatives, all in one run.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::process::Proc;
use super::services::{single_profile, Server};
use super::{mib, write_json, write_section, Load, Suite, Target};
use crate::markdown::{runs_table, signed_ms};
use crate::report::RunReport;
use crate::run::LoadMode;
use crate::scenario::Scenario;

/// The loads every target runs: file-name prefix, heading, load.
const LOADS: [(&str, LoadMode, f64); 4] = [
    ("rate200", LoadMode::Rate(200.0), 0.0),
    ("rate1000", LoadMode::Rate(1000.0), 0.0),
    ("c32", LoadMode::Concurrency(32), 0.0),
    ("rate200-stream", LoadMode::Rate(200.0), 1.0),
];

/// Open-loop probes give up at this many outstanding requests: an overload is seen without
/// piling up thousands of connections.
const PROBE_MAX_OUTSTANDING: usize = 256;
/// Probes stop after this many steps down, or at this rate.
const PROBE_LIMIT: u32 = 6;
const PROBE_FLOOR_RPS: u64 = 200;

/// The key of the tenant the `quantrouter-tenants` target sends.
pub(super) const TENANT_KEY: &str = "sk-overhead-tenant-1";

/// One tenant with every kind of limit, all far above what a run sends, and no downgrade:
/// each request costs the admission script and its answer the settle script, and routing is
/// the same as without tenants. Pushed in the push format (`keys`), hashed by the CLI.
pub(super) const TENANTS: &str = r#"{"version": 1, "tenants": [{"id": "overhead", "keys": ["sk-overhead-tenant-1"],
  "limits": {"requests_per_minute": 1000000000000, "tokens_per_minute": 1000000000000,
             "budget_per_day": 1000000000.0, "budget_per_month": 1000000000.0, "soft_limit": 1.0}}]}"#;

/// What the overhead scenario measured besides the run files.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OverheadFacts {
    /// quantrouter's RSS when the first run starts, KiB.
    pub router_rss_start_kib: u64,
    /// Each target's RSS after the scenario, KiB (the router, the alternatives).
    pub rss_end_kib: BTreeMap<String, u64>,
    /// The highest rate quantrouter sustained in a probe.
    pub max_rate: u64,
    /// Per load and target: CPU seconds in the measured window and answers.
    pub cpu: BTreeMap<String, BTreeMap<String, CpuUse>>,
    /// Targets that were measured, in table order.
    pub targets: Vec<String>,
    /// The targets of the paired runs.
    pub paired: Vec<String>,
    /// Rounds of paired runs.
    pub paired_rounds: u32,
    /// vllm-router took part.
    pub vllm_router: bool,
    /// LiteLLM took part.
    pub litellm: bool,
}

/// CPU a target's processes spent on one run's measured window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct CpuUse {
    /// User + system seconds.
    pub seconds: f64,
    /// Answers (2xx) in the window.
    pub answered: u64,
}

/// Runs the scenario and returns its section.
pub async fn run(suite: &Suite) -> anyhow::Result<String> {
    let dir = suite.scenario_dir("overhead")?;
    let sim = suite
        .start_sim("sim", "sim-model", (0, 0), 1024, None)
        .await?;
    let profiles = suite.write_profiles(
        "overhead-profiles.json",
        1,
        "sim",
        json!({}),
        &[single_profile(&sim.url, (10, 1), 4096)],
    )?;
    // The same router on one worker thread, as in a pod with a 1-CPU limit: on a small
    // machine the load generator and the simulator need the other cores.
    let router_1w = suite
        .start_router(
            "quantrouter-1-worker",
            &profiles,
            &[],
            &[("QUANTROUTER_WORKERS", "1")],
        )
        .await?;
    let router = suite
        .start_router("quantrouter", &profiles, &[], &[])
        .await?;
    // The same router with a tenant whose limits are checked in Redis: tenants on vs off.
    let (redis, redis_url) = suite
        .redis_with_tenants("overhead-tenants.json", TENANTS)
        .await?;
    let router_tenants = suite
        .start_router(
            "quantrouter-tenants",
            &profiles,
            &["--redis-url", &redis_url],
            &[],
        )
        .await?;
    let socat = suite.start_socat(sim.port).await?;
    let vllm_router = suite.start_vllm_router(&sim.url).await;
    let litellm = suite.start_litellm(&sim.url, "sim-model").await;

    let mut facts = OverheadFacts {
        router_rss_start_kib: router.proc.rss_kib(),
        vllm_router: vllm_router.is_some(),
        litellm: litellm.is_some(),
        paired_rounds: suite.options.paired_rounds,
        ..OverheadFacts::default()
    };
    // The baseline first; a target's process, when it has one of its own, for CPU and RSS.
    let mut targets: Vec<(Target, Option<&Proc>)> = vec![
        (Target::new("direct", &sim.url, "sim-model"), None),
        (
            Target::new("quantrouter", &router.url, "auto"),
            Some(&router.proc),
        ),
        (
            Target::new("quantrouter-1-worker", &router_1w.url, "auto"),
            Some(&router_1w.proc),
        ),
        (
            Target::new("quantrouter-tenants", &router_tenants.url, "auto")
                .with_api_key(TENANT_KEY),
            Some(&router_tenants.proc),
        ),
    ];
    for (name, server) in [
        ("socat", &socat),
        ("vllm-router", &vllm_router),
        ("litellm", &litellm),
    ] {
        if let Some(server) = server {
            targets.push((
                Target::new(name, &server.url, "sim-model"),
                Some(&server.proc),
            ));
        }
    }
    facts.targets = targets.iter().map(|(t, _)| t.name.clone()).collect();

    let common = |mode: LoadMode| {
        Load::new(Scenario::Overhead, mode, suite.duration())
            .warmup(suite.warmup())
            .max_outstanding(2000)
    };
    for (prefix, mode, stream_share) in LOADS {
        for (target, process) in &targets {
            suite.settle().await;
            let load = common(mode).stream_share(stream_share);
            let out = dir.join(format!("{prefix}-{}.json", target.name));
            let (report, cpu) = suite
                .run_load_with_cpu(&target.name, target, &load, &out, *process)
                .await?;
            if let Some(seconds) = cpu {
                facts.cpu.entry(prefix.to_owned()).or_default().insert(
                    target.name.clone(),
                    CpuUse {
                        seconds,
                        answered: report.ok,
                    },
                );
            }
        }
    }

    facts.max_rate = highest_sustained_rate(suite, &dir, &targets[1].0).await?;
    for (target, _) in &targets[..2] {
        suite.settle().await;
        let load = common(LoadMode::Rate(facts.max_rate as f64));
        let out = dir.join(format!("ratemax-{}.json", target.name));
        suite.run_load(&target.name, target, &load, &out).await?;
    }

    // Paired: at 200 req/s each target also runs in the same window as a direct run (two
    // load generators at once); added = the target's p50 − the p50 of the direct run beside
    // it, so the machine's drift between runs, as large as what is measured, cancels.
    let direct = targets[0].0.clone();
    for round in 1..=suite.options.paired_rounds {
        for (target, _) in &targets[1..] {
            // LiteLLM does not sustain 200 req/s on a small machine.
            if target.name == "litellm" {
                continue;
            }
            if round == 1 {
                facts.paired.push(target.name.clone());
            }
            suite.settle().await;
            let load = common(LoadMode::Rate(200.0));
            let beside = dir.join(format!("paired-{round}-{}-direct.json", target.name));
            let out = dir.join(format!("paired-{round}-{}.json", target.name));
            let (direct_report, report) = tokio::join!(
                suite.run_load("direct", &direct, &load, &beside),
                suite.run_load(&target.name, target, &load, &out),
            );
            direct_report?;
            report?;
        }
    }

    for (target, process) in &targets[1..] {
        if let Some(process) = process {
            facts
                .rss_end_kib
                .insert(target.name.clone(), process.rss_kib());
        }
    }
    write_json(&dir.join("facts.json"), &facts)?;
    drop(targets);
    stop_all([
        Some(router),
        Some(router_1w),
        Some(router_tenants),
        socat,
        vllm_router,
        litellm,
    ])
    .await;
    redis.kill().await;
    sim.proc.kill().await;
    write_section(&dir, render(suite, &dir, &facts)?)
}

async fn stop_all<const N: usize>(servers: [Option<Server>; N]) {
    for server in servers.into_iter().flatten() {
        server.proc.kill().await;
    }
}

/// The highest rate the router sustains: probes start at 60% of its saturation throughput
/// at 32 clients and step down by a fifth until one is sustained (every request answered,
/// none refused or timed out, p99 under the limit). Past that point an open loop only
/// measures the backlog.
async fn highest_sustained_rate(suite: &Suite, dir: &Path, router: &Target) -> anyhow::Result<u64> {
    let saturation = RunReport::read_json(&dir.join(format!("c32-{}.json", router.name)))?;
    let mut rate = (((saturation.throughput_rps * 0.6) / 100.0).floor() as u64 * 100).max(100);
    let probe = Duration::from_secs_f64((suite.options.duration_s + 1.0) / 2.0);
    let p99_limit_us = (suite.options.sustain_p99_ms * 1000.0) as u64;
    let probe_file = suite.work().join("probe.json");
    for probes in 1.. {
        let load = Load::new(Scenario::Overhead, LoadMode::Rate(rate as f64), probe)
            .warmup(suite.warmup().min(Duration::from_secs(1)))
            .max_outstanding(PROBE_MAX_OUTSTANDING);
        let report = suite
            .run_load("quantrouter probe", router, &load, &probe_file)
            .await?;
        let sustained = report.ok == report.requests && report.latency_us.p99 <= p99_limit_us;
        if sustained || probes >= PROBE_LIMIT || rate <= PROBE_FLOOR_RPS {
            break;
        }
        rate = (rate * 4 / 5 / 100 * 100).max(100);
    }
    Ok(rate)
}

fn render(suite: &Suite, dir: &Path, facts: &OverheadFacts) -> anyhow::Result<String> {
    let mut out = suite.command("overhead");
    out.push_str(&suite.machine());
    out.push_str(
        "Zero-latency vllm-sim, max_tokens 16; `× baseline` is throughput relative to direct\n\
         in the same run; added = run − direct at that percentile. `quantrouter` runs with\n\
         its default worker count (one per CPU it may use); `quantrouter-1-worker` is the same\n\
         binary with `QUANTROUTER_WORKERS=1`, as in a pod limited to one CPU.\n",
    );
    if !facts.vllm_router {
        out.push_str("vllm-router was not installed or did not start in this run.\n");
    }
    if !facts.litellm {
        out.push_str("LiteLLM was not installed or did not start in this run.\n");
    }
    let headings = [
        (
            "rate200",
            "**200 req/s, open loop, non-streamed**".to_owned(),
        ),
        (
            "rate1000",
            "**1,000 req/s, open loop, non-streamed**".to_owned(),
        ),
        (
            "ratemax",
            format!(
                "**{} req/s (the highest rate quantrouter sustained: every request answered, \
                 p99 ≤ {} ms in a probe), open loop**",
                facts.max_rate, suite.options.sustain_p99_ms
            ),
        ),
        (
            "c32",
            "**32 concurrent clients, closed loop (saturation), non-streamed**".to_owned(),
        ),
        (
            "rate200-stream",
            "**200 req/s, open loop, every request streamed**".to_owned(),
        ),
    ];
    for (prefix, heading) in headings {
        let runs = facts
            .targets
            .iter()
            .map(|name| dir.join(format!("{prefix}-{name}.json")))
            .filter(|path| path.is_file())
            .map(|path| RunReport::read_json(&path))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let _ = write!(out, "\n{heading}\n\n{}", runs_table(&runs));
    }
    let _ = write!(
        out,
        "\n**200 req/s, paired with direct in the same window** ({} rounds: each run\n\
         beside a direct run of its own, two load generators at once; added = run − the direct\n\
         run beside it)\n\n\
         | run | rounds | added p50, median | added p50, range | added p99, median |\n\
         |---|---|---|---|---|\n",
        facts.paired_rounds
    );
    for name in &facts.paired {
        out.push_str(&paired_row(dir, name, facts.paired_rounds)?);
    }
    out.push_str(&tenants_table(dir, facts)?);
    out.push_str(&cpu_table(facts));
    let _ = writeln!(
        out,
        "\nRouter RSS: {} MiB at start, **{} MiB after the scenario**.",
        mib(facts.router_rss_start_kib),
        mib(facts.rss_end_kib.get("quantrouter").copied().unwrap_or(0))
    );
    for (name, title) in [("vllm-router", "vllm-router"), ("litellm", "LiteLLM proxy")] {
        if let Some(kib) = facts.rss_end_kib.get(name) {
            let _ = writeln!(out, "{title} after the scenario: {} MiB.", mib(*kib));
        }
    }
    Ok(out)
}

/// Tenants on (`quantrouter-tenants`: one admission script per request, one settle script
/// per answer, in a local Redis) against off (`quantrouter`), from the same run: requests/s
/// at saturation and the median added p50 of the paired runs.
fn tenants_table(dir: &Path, facts: &OverheadFacts) -> anyhow::Result<String> {
    const OFF: &str = "quantrouter";
    const ON: &str = "quantrouter-tenants";
    if !facts.targets.iter().any(|t| t == ON) {
        return Ok(String::new());
    }
    let throughput = |name: &str| {
        RunReport::read_json(&dir.join(format!("c32-{name}.json"))).map(|r| r.throughput_rps)
    };
    let added_p50 = |name: &str| -> anyhow::Result<Option<i64>> {
        if !facts.paired.iter().any(|p| p == name) {
            return Ok(None);
        }
        let (mut p50, _) = paired_added(dir, name, facts.paired_rounds)?;
        p50.sort_unstable();
        Ok(p50.get(p50.len().saturating_sub(1) / 2).copied())
    };
    let cell = |v: Option<i64>| v.map_or_else(|| "n/a".to_owned(), signed_ms);
    let (off_rps, on_rps) = (throughput(OFF)?, throughput(ON)?);
    let (off_p50, on_p50) = (added_p50(OFF)?, added_p50(ON)?);
    let mut out = String::from(
        "\n**Tenants on vs off** (same run; on: a tenant with every limit, checked in a local\n\
         Redis by one script per request and settled by one per answer)\n\n\
         | router | req/s, 32 clients | added p50 at 200 req/s (paired median) |\n\
         |---|---|---|\n",
    );
    let _ = writeln!(out, "| tenants off | {off_rps:.0} | {} |", cell(off_p50));
    let _ = writeln!(out, "| tenants on | {on_rps:.0} | {} |", cell(on_p50));
    let diff = on_p50.zip(off_p50).map(|(on, off)| on - off);
    let _ = writeln!(
        out,
        "| on − off | {:+.0} | {} |",
        on_rps - off_rps,
        cell(diff)
    );
    Ok(out)
}

/// A paired target's added p50 and p99 per round: its latency minus that of the direct run
/// beside it.
fn paired_added(dir: &Path, name: &str, rounds: u32) -> anyhow::Result<(Vec<i64>, Vec<i64>)> {
    let mut p50 = Vec::new();
    let mut p99 = Vec::new();
    for round in 1..=rounds {
        let run = RunReport::read_json(&dir.join(format!("paired-{round}-{name}.json")))?;
        let beside = RunReport::read_json(&dir.join(format!("paired-{round}-{name}-direct.json")))?;
        let added = crate::compare::compare(&beside, &run).added_latency_us;
        p50.push(added.p50);
        p99.push(added.p99);
    }
    Ok((p50, p99))
}

/// One target's row of the paired table: per round, its latency minus that of the direct
/// run beside it; the lower middle as median.
fn paired_row(dir: &Path, name: &str, rounds: u32) -> anyhow::Result<String> {
    let (mut p50, mut p99) = paired_added(dir, name, rounds)?;
    p50.sort_unstable();
    p99.sort_unstable();
    let median = |values: &[i64]| values.get(values.len().saturating_sub(1) / 2).copied();
    let (Some(p50_median), Some(p99_median), Some(low), Some(high)) = (
        median(&p50),
        median(&p99),
        p50.first().copied(),
        p50.last().copied(),
    ) else {
        return Ok(String::new());
    };
    Ok(format!(
        "| {name} | {} | {} | {} to {} | {} |\n",
        p50.len(),
        signed_ms(p50_median),
        signed_ms(low),
        signed_ms(high),
        signed_ms(p99_median)
    ))
}

/// CPU per answered request by target and load: the process tree's user + system time over
/// the measured window.
fn cpu_table(facts: &OverheadFacts) -> String {
    let mut out = String::from(
        "\n**CPU per request** (user + system time of the target's processes in the measured\n\
         window, over the requests answered in it)\n\n\
         | run | 200 req/s | 1,000 req/s | 32 clients | 200 req/s streamed |\n\
         |---|---|---|---|---|\n",
    );
    for name in facts.targets.iter().skip(1) {
        let cells: Vec<String> = LOADS
            .iter()
            .map(|(prefix, _, _)| {
                facts
                    .cpu
                    .get(*prefix)
                    .and_then(|by_target| by_target.get(name))
                    .filter(|cpu| cpu.answered > 0)
                    .map_or_else(
                        || "n/a".to_owned(),
                        |cpu| format!("{:.0} µs", cpu.seconds * 1e6 / cpu.answered as f64),
                    )
            })
            .collect();
        let _ = writeln!(out, "| {name} | {} |", cells.join(" | "));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_table_divides_window_cpu_by_answers() {
        let mut facts = OverheadFacts {
            targets: vec!["direct".into(), "quantrouter".into(), "socat".into()],
            ..OverheadFacts::default()
        };
        facts.cpu.entry("rate200".into()).or_default().insert(
            "quantrouter".into(),
            CpuUse {
                seconds: 0.5,
                answered: 2000,
            },
        );
        let table = cpu_table(&facts);
        assert!(
            table.contains("| quantrouter | 250 µs | n/a | n/a | n/a |"),
            "{table}"
        );
        assert!(table.contains("| socat | n/a |"), "{table}");
        assert!(!table.contains("| direct |"), "{table}");
    }
}
