//! `overload`: five times a tier's capacity, direct (no admission control) and through the
//! router (429 with `Retry-After` past its queue).

use std::fmt::Write as _;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::services::single_profile;
use super::{mib, write_json, write_section, Load, Suite, Target};
use crate::markdown::{answers_table, runs_table};
use crate::report::RunReport;
use crate::run::LoadMode;
use crate::scenario::Scenario;

/// The tier: requests at once, TTFT and inter-token latency in ms, tokens per answer (the
/// overload preset's fixed `max_tokens`).
const SEQS: usize = 8;
const TTFT_MS: u64 = 20;
const ITL_MS: u64 = 2;
const TOKENS: u64 = 32;
/// How often the router's RSS is sampled for its peak.
const RSS_SAMPLE: Duration = Duration::from_millis(500);

/// What the overload scenario measured besides the run files.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OverloadFacts {
    /// The tier's capacity in requests/s.
    pub capacity: u64,
    /// The offered rate.
    pub rate: u64,
    /// Router RSS before, at its peak during and after the routed run, KiB.
    pub router_rss_start_kib: u64,
    /// Peak during the run.
    pub router_rss_peak_kib: u64,
    /// After the run.
    pub router_rss_end_kib: u64,
}

/// Capacity = max-num-seqs / (TTFT + max_tokens × ITL), in requests/s.
pub fn capacity() -> u64 {
    ((SEQS as f64 * 1000.0) / (TTFT_MS + TOKENS * ITL_MS) as f64).round() as u64
}

/// Runs the scenario and returns its section.
pub async fn run(suite: &Suite) -> anyhow::Result<String> {
    let dir = suite.scenario_dir("overload")?;
    let capacity = capacity();
    let rate = capacity * 5;
    let sim = suite
        .start_sim("sim", "sim-model", (TTFT_MS, ITL_MS), SEQS, None)
        .await?;
    let profiles = suite.write_profiles(
        "overload-profiles.json",
        1,
        "sim",
        json!({}),
        &[single_profile(&sim.url, (TTFT_MS, ITL_MS), SEQS)],
    )?;
    let router = suite
        .start_router("quantrouter", &profiles, &[], &[])
        .await?;
    let mut facts = OverloadFacts {
        capacity,
        rate,
        router_rss_start_kib: router.proc.rss_kib(),
        ..OverloadFacts::default()
    };
    let load = Load::new(
        Scenario::Overload,
        LoadMode::Rate(rate as f64),
        suite.duration() * 2,
    )
    .warmup(suite.warmup())
    .max_outstanding(20_000);
    let direct = Target::new("direct", &sim.url, "sim-model");
    suite
        .run_load("direct", &direct, &load, &dir.join("direct.json"))
        .await?;
    let routed = Target::new("quantrouter", &router.url, "auto");
    let routed_file = dir.join("quantrouter.json");
    let run = suite.run_load("quantrouter", &routed, &load, &routed_file);
    tokio::pin!(run);
    let mut ticks = tokio::time::interval(RSS_SAMPLE);
    loop {
        tokio::select! {
            result = &mut run => { result?; break; }
            _ = ticks.tick() => {
                facts.router_rss_peak_kib = facts.router_rss_peak_kib.max(router.proc.rss_kib());
            }
        }
    }
    facts.router_rss_end_kib = router.proc.rss_kib();
    write_json(&dir.join("facts.json"), &facts)?;
    router.proc.kill().await;
    sim.proc.kill().await;

    let runs = [
        RunReport::read_json(&dir.join("direct.json"))?,
        RunReport::read_json(&dir.join("quantrouter.json"))?,
    ];
    let mut out = suite.command("overload");
    out.push_str(&suite.machine());
    let _ = write!(
        out,
        "One vllm-sim tier (max-num-seqs {SEQS}, TTFT {TTFT_MS} ms, ITL {ITL_MS} ms/token, \
         max_tokens {TOKENS}): capacity\n≈ {capacity} req/s; offered {rate} req/s (5×) for {} s, \
         open loop; the\nrouter's profile has max_concurrency {SEQS} (so {SEQS} more may queue, \
         for at most 2 s).\nDirect has no admission control: the simulator's own queue grows \
         without bound\n(10 s client timeout).\n\n{}\n{}\n",
        suite.options.duration_s * 2.0,
        runs_table(&runs),
        answers_table(&runs)
    );
    let _ = writeln!(
        out,
        "Router RSS: {} MiB before, peak {} MiB during, {} MiB after.",
        mib(facts.router_rss_start_kib),
        mib(facts.router_rss_peak_kib),
        mib(facts.router_rss_end_kib)
    );
    write_section(&dir, out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn capacity_follows_the_latency_model() {
        // 8 / (20 ms + 32 × 2 ms) = 95.2 req/s.
        assert_eq!(super::capacity(), 95);
    }
}
