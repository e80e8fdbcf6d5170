//! `burst-memory`: the router's RSS through a burst of connections and after it — 32
//! clients, then 2,000 (a backlog in front of the router opens about that many), then
//! nothing — to see whether what the burst freed goes back to the system.

use std::fmt::Write as _;

use serde_json::json;

use super::services::single_profile;
use super::{mib, write_json, write_section, Load, Suite, Target};
use crate::run::LoadMode;
use crate::scenario::Scenario;

/// Runs the analysis and returns its section (printed, not part of the document).
pub async fn run(suite: &Suite) -> anyhow::Result<String> {
    let dir = suite.scenario_dir("burst-memory")?;
    let sim = suite
        .start_sim("sim", "sim-model", (0, 0), 1024, None)
        .await?;
    let profiles = suite.write_profiles(
        "burst-profiles.json",
        1,
        "sim",
        json!({}),
        &[single_profile(&sim.url, (10, 1), 4096)],
    )?;
    let router = suite
        .start_router("quantrouter", &profiles, &[], &[])
        .await?;
    let target = Target::new("quantrouter", &router.url, "auto");
    // With the default 10 s: 5 s of 32 clients, 4 s of 2,000, 12 s idle.
    let duration = suite.duration();
    let mut steps = vec![("at start".to_owned(), router.proc.rss_kib())];
    for (clients, length) in [(32, duration / 2), (2000, duration * 2 / 5)] {
        let load = Load::new(Scenario::Overhead, LoadMode::Concurrency(clients), length);
        let out = dir.join(format!("c{clients}.json"));
        suite.run_load("quantrouter", &target, &load, &out).await?;
        steps.push((format!("after {clients} clients"), router.proc.rss_kib()));
    }
    let idle = duration * 6 / 5;
    tokio::time::sleep(idle).await;
    steps.push((
        format!("{} s later", idle.as_secs_f64()),
        router.proc.rss_kib(),
    ));
    router.proc.kill().await;
    sim.proc.kill().await;
    write_json(&dir.join("facts.json"), &steps)?;

    let mut out = suite.command_without_warmup("burst-memory");
    out.push_str(&suite.machine());
    out.push_str("\n| step | router RSS |\n|---|---|\n");
    for (step, kib) in &steps {
        let _ = writeln!(out, "| {step} | {} MiB |", mib(*kib));
    }
    write_section(&dir, out)
}
