//! `chaos`: steady load while endpoints die, fail and hang, profile sets are pushed and
//! Redis restarts empty; every answer is checked.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use http::Method;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::time::Instant;

use super::http::{call, get};
use super::process::free_port;
use super::services::ProfileSpec;
use super::{write_json, write_section, Load, Suite, Target};
use crate::markdown::{answers_table, runs_table};
use crate::report::RunReport;
use crate::run::LoadMode;
use crate::scenario::Scenario;

/// Arrival rate of the chaos load.
const RATE: f64 = 100.0;

/// What the chaos scenario did and saw besides the run file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChaosFacts {
    /// Arrival rate.
    pub rate: f64,
    /// Length of the run in seconds.
    pub duration_s: f64,
    /// Profile sets pushed during the run (of 20).
    pub pushed: u32,
    /// The router's active profile version after the run.
    pub applied_version: Option<u64>,
    /// What happened when, `t=Ns what`.
    pub events: Vec<String>,
}

/// Runs the scenario and returns its section.
pub async fn run(suite: &Suite) -> anyhow::Result<String> {
    let dir = suite.scenario_dir("chaos")?;
    let redis_port = free_port()?;
    let redis = suite.start_redis(redis_port).await?;
    let redis_url = format!("redis://127.0.0.1:{redis_port}");

    let a = suite.start_sim("a", "sim-fp16", (5, 1), 64, None).await?;
    let b = suite.start_sim("b", "sim-fp16", (5, 1), 64, None).await?;
    let c = suite.start_sim("c", "sim-int4", (5, 1), 64, None).await?;
    let fp16_urls = vec![a.url.clone(), b.url.clone()];
    let int4_urls = vec![c.url.clone()];
    // The chaos profile set at a version and canary share.
    let write_set = |file: &str, version: u64, canary: u64| -> anyhow::Result<PathBuf> {
        let tier = |id, model, urls: &Vec<String>, cost, quality| ProfileSpec {
            id,
            model,
            tier: id,
            urls: urls.clone(),
            cost,
            latency_ms: (5, 1),
            max_concurrency: 128,
            quality,
        };
        suite.write_profiles(
            file,
            version,
            "fp16",
            json!({"canary_percent": canary}),
            &[
                tier(
                    "fp16",
                    "sim-fp16",
                    &fp16_urls,
                    (0.20, 0.60),
                    json!({"default": 0.97, "code": 0.95, "math": 0.93}),
                ),
                tier(
                    "int4",
                    "sim-int4",
                    &int4_urls,
                    (0.06, 0.18),
                    json!({"default": 0.90, "code": 0.80, "math": 0.78}),
                ),
            ],
        )
    };
    let first = write_set("chaos-1.json", 1, 100)?;
    anyhow::ensure!(
        suite.push_profiles(&first, &redis_url).await,
        "cannot push the first chaos profile set to {redis_url}"
    );
    let router = suite
        .start_router(
            "quantrouter",
            &first,
            &[
                "--redis-url",
                &redis_url,
                "--redis-poll-ms",
                "1000",
                "--header-timeout-ms",
                "1000",
            ],
            &[],
        )
        .await?;

    let duration = suite.duration() * 6;
    let load =
        Load::new(Scenario::Chaos, LoadMode::Rate(RATE), duration).timeout(Duration::from_secs(30));
    let target = Target::new("quantrouter", &router.url, "auto");
    let out = dir.join("quantrouter.json");
    let t0 = Instant::now();
    let mut events = Vec::new();
    let mut pushed = 0;
    let timeline = async {
        // The timeline is written for a 60 s run and stretched to the one asked for.
        let at = |second: u32| tokio::time::sleep_until(t0 + duration * second / 60);
        let mut event = |what: String| {
            let line = format!("t={}s {what}", t0.elapsed().as_secs());
            println!("{line}");
            events.push(line);
        };
        at(5).await;
        b.proc.kill().await;
        event("SIGKILL fp16 endpoint b".to_owned());
        at(12).await;
        let b = suite
            .start_sim("b", "sim-fp16", (5, 1), 64, Some(b.port))
            .await?;
        event("restarted fp16 endpoint b".to_owned());
        at(18).await;
        faults(
            &c.url,
            Some(json!({"error_rate": 0.5, "error_status": 503})),
        )
        .await?;
        event("int4: 50% 503".to_owned());
        at(24).await;
        faults(&c.url, None).await?;
        event("int4: faults cleared".to_owned());
        at(28).await;
        faults(&a.url, Some(json!({"hang": true}))).await?;
        event("fp16 endpoint a: hang".to_owned());
        at(33).await;
        faults(&a.url, None).await?;
        event("fp16 endpoint a: faults cleared".to_owned());
        at(36).await;
        for version in 2..=21 {
            let canary = if version % 2 == 0 { 100 } else { 50 };
            let file = write_set("chaos-push.json", version, canary)?;
            pushed += u32::from(suite.push_profiles(&file, &redis_url).await);
        }
        event(format!("pushed {pushed} profile sets"));
        at(46).await;
        redis.kill().await;
        event("SIGKILL redis-server".to_owned());
        at(49).await;
        let redis = suite.start_redis(redis_port).await?;
        event("restarted redis-server (empty)".to_owned());
        let last = write_set("chaos-100.json", 100, 100)?;
        if suite.push_profiles(&last, &redis_url).await {
            event("pushed profile set version 100 to the new redis".to_owned());
        }
        anyhow::Ok((b, redis))
    };
    let (report, restarted) = tokio::join!(
        suite.run_load("quantrouter", &target, &load, &out),
        timeline
    );
    report?;
    let (b, redis) = restarted?;
    let applied_version = get(&format!("{}/admin/profiles", router.admin_url))
        .await
        .ok()
        .and_then(|(_, body)| serde_json::from_str::<Value>(&body).ok()?["version"].as_u64());
    let line = format!(
        "t={}s router's active profile version after the run: {}",
        t0.elapsed().as_secs(),
        applied_version.map_or_else(|| "unknown".to_owned(), |v| v.to_string())
    );
    println!("{line}");
    events.push(line);
    let facts = ChaosFacts {
        rate: RATE,
        duration_s: duration.as_secs_f64(),
        pushed,
        applied_version,
        events,
    };
    write_json(&dir.join("facts.json"), &facts)?;
    std::fs::write(dir.join("events.txt"), facts.events.join("\n") + "\n")?;
    router.proc.kill().await;
    for process in [a.proc, b.proc, c.proc, redis] {
        process.kill().await;
    }

    let runs = [RunReport::read_json(&out)?];
    let mut text = suite.command_without_warmup("chaos");
    text.push_str(&suite.machine());
    let _ = writeln!(
        text,
        "{RATE} req/s for {} s (20% streamed, max_tokens 16/64 at 70/30, every answer\n\
         checked) through quantrouter with profiles from a real redis-server: tier fp16 has two\n\
         vllm-sim endpoints (a, b), tier int4 one (c); header timeout 1 s. Events:\n",
        facts.duration_s
    );
    for event in &facts.events {
        let _ = writeln!(text, "- {event}");
    }
    let _ = write!(text, "\n{}\n{}", runs_table(&runs), answers_table(&runs));
    write_section(&dir, text)
}

/// Sets (`Some`) or clears (`None`) a simulator's faults.
async fn faults(sim_url: &str, set: Option<Value>) -> anyhow::Result<()> {
    let url = format!("{sim_url}/sim/faults");
    let (status, body) = match set {
        Some(faults) => call(Method::POST, &url, Some(&faults.to_string())).await?,
        None => call(Method::DELETE, &url, None).await?,
    };
    anyhow::ensure!(
        (200..300).contains(&status),
        "{url} answered {status}: {body}"
    );
    Ok(())
}
