//! `mixed`: three tiers with realistic latency and the prompt mix; latency and cost against
//! sending everything to the default tier.

use std::fmt::Write as _;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::http::{get, metric_sum};
use super::services::ProfileSpec;
use super::{write_json, write_section, Load, Suite, Target};
use crate::markdown::{runs_table, stream_check_table, tiers_table};
use crate::report::RunReport;
use crate::run::LoadMode;
use crate::scenario::Scenario;

/// What the mixed scenario measured besides the run files.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MixedFacts {
    /// Arrival rate.
    pub rate: f64,
    /// Dollars through quantrouter (its `/metrics`, warm-up included).
    pub cost_usd: f64,
    /// Dollars the same tokens would have cost on the default profile.
    pub counterfactual_usd: f64,
    /// Targets in table order.
    pub targets: Vec<String>,
    /// vllm-router took part.
    pub vllm_router: bool,
    /// LiteLLM took part.
    pub litellm: bool,
    /// Fallbacks of the router with the stream-start check (a failed check is one).
    #[serde(default)]
    pub stream_check_fallbacks: u64,
}

/// The stream-start check measured in the `mixed` rows: the policy's example values
/// (docs/routing.md).
const STREAM_CHECK: (u32, u64) = (24, 800);
/// Names of the stream-only runs, without and with the stream-start check.
const STREAM_RUNS: [&str; 2] = ["quantrouter-streams", "quantrouter-streams-checked"];

/// Runs the scenario and returns its section.
pub async fn run(suite: &Suite) -> anyhow::Result<String> {
    let dir = suite.scenario_dir("mixed")?;
    // Three tiers, fastest and cheapest last; latencies as in the profiles, scaled so that a
    // run stays short.
    let fp16 = suite
        .start_sim("fp16", "llama-fp16", (40, 4), 16, None)
        .await?;
    let fp8 = suite
        .start_sim("fp8", "llama-fp8", (30, 3), 24, None)
        .await?;
    let int4 = suite
        .start_sim("int4", "llama-int4", (20, 2), 32, None)
        .await?;
    let tier = |id, model, url: &str, cost, latency_ms, max_concurrency, quality| ProfileSpec {
        id,
        model,
        tier: id,
        urls: vec![url.to_owned()],
        cost,
        latency_ms,
        max_concurrency,
        quality,
    };
    let tiers = [
        tier(
            "fp16",
            "llama-fp16",
            &fp16.url,
            (0.20, 0.60),
            (40, 4),
            16,
            json!({"default": 0.97, "code": 0.95, "math": 0.93, "structured": 0.96}),
        ),
        tier(
            "fp8",
            "llama-fp8",
            &fp8.url,
            (0.12, 0.36),
            (30, 3),
            24,
            json!({"default": 0.95, "code": 0.92, "math": 0.90, "structured": 0.94}),
        ),
        tier(
            "int4",
            "llama-int4",
            &int4.url,
            (0.06, 0.18),
            (20, 2),
            32,
            json!({"default": 0.90, "code": 0.80, "math": 0.78, "structured": 0.86}),
        ),
    ];
    let policy = json!({"latency_budget_ms": 8000, "expected_output_tokens": 64});
    let profiles =
        suite.write_profiles("mixed-profiles.json", 1, "fp16", policy.clone(), &tiers)?;
    let mut checked_policy = policy;
    checked_policy["stream_check"] =
        json!({"tokens": STREAM_CHECK.0, "max_hold_ms": STREAM_CHECK.1});
    let checked_profiles =
        suite.write_profiles("mixed-checked.json", 1, "fp16", checked_policy, &tiers)?;
    let router = suite
        .start_router("quantrouter", &profiles, &[], &[])
        .await?;
    let checked = suite
        .start_router("quantrouter-checked", &checked_profiles, &[], &[])
        .await?;
    let vllm_router = suite.start_vllm_router(&fp16.url).await;
    let litellm = suite.start_litellm(&fp16.url, "llama-fp16").await;

    let mut targets = vec![
        Target::new("direct-fp16", &fp16.url, "llama-fp16"),
        Target::new("quantrouter", &router.url, "auto"),
    ];
    if let Some(server) = &vllm_router {
        targets.push(Target::new("vllm-router", &server.url, "llama-fp16"));
    }
    if let Some(server) = &litellm {
        targets.push(Target::new("litellm", &server.url, "llama-fp16"));
    }
    let rate = suite.options.mixed_rate;
    for target in &targets {
        let mut load = Load::new(Scenario::Mixed, LoadMode::Rate(rate), suite.duration() * 3)
            .warmup(suite.warmup())
            .timeout(Duration::from_secs(30));
        load.seed = Some(1);
        let out = dir.join(format!("{}.json", target.name));
        suite.run_load(&target.name, target, &load, &out).await?;
    }
    // The same streams through both routers: what holding their start adds to the TTFT.
    for (name, server) in STREAM_RUNS.iter().zip([&router, &checked]) {
        let target = Target::new(name, &server.url, "auto");
        let mut load = Load::new(Scenario::Mixed, LoadMode::Rate(rate), suite.duration())
            .warmup(suite.warmup())
            .timeout(Duration::from_secs(30))
            .stream_share(1.0);
        load.seed = Some(1);
        let out = dir.join(format!("{name}.json"));
        suite.run_load(name, &target, &load, &out).await?;
    }
    let (_, checked_page) = get(&format!("{}/metrics", checked.admin_url)).await?;
    let (_, page) = get(&format!("{}/metrics", router.admin_url)).await?;
    let facts = MixedFacts {
        rate,
        cost_usd: metric_sum(&page, "quantrouter_cost_usd_total"),
        counterfactual_usd: metric_sum(&page, "quantrouter_counterfactual_cost_usd_total"),
        targets: targets.iter().map(|t| t.name.clone()).collect(),
        vllm_router: vllm_router.is_some(),
        litellm: litellm.is_some(),
        stream_check_fallbacks: metric_sum(&checked_page, "quantrouter_fallbacks_total") as u64,
    };
    write_json(&dir.join("facts.json"), &facts)?;
    for server in [Some(router), Some(checked), vllm_router, litellm]
        .into_iter()
        .flatten()
    {
        server.proc.kill().await;
    }
    for sim in [fp16, fp8, int4] {
        sim.proc.kill().await;
    }

    let runs = facts
        .targets
        .iter()
        .map(|name| RunReport::read_json(&dir.join(format!("{name}.json"))))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut out = suite.command("mixed");
    out.push_str(&suite.machine());
    let _ = write!(
        out,
        "Three vllm-sim tiers: fp16 (TTFT 40 ms, ITL 4 ms/token, max-num-seqs 16), fp8 (30 ms,\n\
         3 ms, 24), int4 (20 ms, 2 ms, 32); the prompt mix (`eval/prompt-mix.jsonl`,\n\
         seed 1), 10% streamed, max_tokens 16/64/256 with weights 50/30/20, {rate} req/s open loop.\n\
         The baseline sends everything straight to the default tier (fp16), as a deployment\n\
         without quantrouter would; vllm-router and LiteLLM forward to that same fp16 simulator.\n\n\
         {}\n{}\n",
        runs_table(&runs),
        tiers_table(&runs)
    );
    let saved = if facts.counterfactual_usd > 0.0 {
        (1.0 - facts.cost_usd / facts.counterfactual_usd) * 100.0
    } else {
        0.0
    };
    let _ = writeln!(
        out,
        "Cost through quantrouter (its `/metrics`, warm-up included): ${:.6}, versus ${:.6} \
         for the same tokens on the default profile: **{saved:.1}% saved**.",
        facts.cost_usd, facts.counterfactual_usd
    );
    let [plain, held] =
        STREAM_RUNS.map(|name| RunReport::read_json(&dir.join(format!("{name}.json"))));
    let (plain, held) = (plain?, held?);
    let _ = write!(
        out,
        "\n**Stream-start check** (`policy.stream_check: {{\"tokens\": {}, \"max_hold_ms\": {}}}`): \
         the same mix, every request streamed, {rate} req/s, through quantrouter without and \
         with the check. Streams from fp8 and int4 are held until {} content events (or the \
         end, or when they fall behind the hold's pace of {} ms for all) and checked; fp16 \
         has no better tier and is never held. Fallbacks \
         through the checked router (a failed check is one): {}.\n\n{}",
        STREAM_CHECK.0,
        STREAM_CHECK.1,
        STREAM_CHECK.0,
        STREAM_CHECK.1,
        facts.stream_check_fallbacks,
        stream_check_table(&plain, &held)
    );
    write_section(&dir, out)
}
