//! Scale from zero: a preferred tier with no endpoint (KEDA scaled it to zero) and a
//! cold-start allowance makes requests wait, counted in its queue depth, unless a warm tier
//! fits; the wait ends when an endpoint appears or the allowance runs out.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use quantrouter::keda::local_tiers;
use support::{chat, eventually, Tiers, SIMPLE};
use tokio::time::Instant;
use vllm_sim::SimConfig;

const INT4: usize = 2;

async fn tiers(cold_start_ms: u64) -> Tiers {
    Tiers::start(
        [1, 1, 1],
        |_| SimConfig::default(),
        move |set| set.profiles[INT4].cold_start_timeout_ms = cold_start_ms,
        |_| {},
    )
    .await
}

/// Scales `profiles` to zero (what discovery does when a Deployment has no ready pod).
fn scale_to_zero(t: &Tiers, profiles: &[usize]) {
    let snapshot = t.router.app.store.load();
    for &p in profiles {
        snapshot.runtime[p].pool.set_urls(&[]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waits_for_a_cold_tier_and_counts_in_its_queue_depth() {
    let t = Arc::new(tiers(10_000).await);
    scale_to_zero(&t, &[0, 1, 2]);
    let request = {
        let t = Arc::clone(&t);
        tokio::spawn(async move { t.post(&chat("auto", SIMPLE), &[]).await })
    };
    let queued = eventually(Duration::from_secs(5), || async {
        let snapshot = t.router.app.store.load();
        local_tiers(&snapshot, Instant::now())["int4"].queue_depth == 1
    })
    .await;
    assert!(queued, "the waiting request is in int4's queue depth");
    let demand = &t.router.app.keda.demand;
    assert!(demand.recent("int4", Duration::from_secs(60), Instant::now()));
    assert!(!request.is_finished());
    // The tier comes up.
    let url = t.sims[INT4][0].url();
    t.router.app.store.load().runtime[INT4]
        .pool
        .set_urls(&[url]);
    let r = request.await.unwrap();
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("x-quantrouter-tier"), "int4");
    let snapshot = t.router.app.store.load();
    assert_eq!(
        local_tiers(&snapshot, Instant::now())["int4"].queue_depth,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_tier_that_stays_down_answers_503_after_its_allowance() {
    let t = tiers(200).await;
    scale_to_zero(&t, &[0, 1, 2]);
    let r = t.post(&chat("auto", SIMPLE), &[]).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.json()["error"]["code"], "no_healthy_profile");
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("scaled to zero"));
    assert_eq!(r.header("retry-after"), "1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_tier_within_budget_serves_instead_and_says_why() {
    // The allowance counts as queue wait: 2 s still fits int4 in the 8 s budget.
    let t = tiers(2_000).await;
    scale_to_zero(&t, &[INT4]);
    let started = Instant::now();
    let r = t.post(&chat("auto", SIMPLE), &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("x-quantrouter-tier"), "fp8");
    assert_eq!(r.header("x-quantrouter-reason"), "cold_start_avoided");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "no cold-start wait"
    );
    let demand = &t.router.app.keda.demand;
    assert!(
        demand.recent("int4", Duration::from_secs(60), Instant::now()),
        "the cold tier is still woken for KEDA"
    );
    assert!(!demand.recent("fp8", Duration::from_secs(60), Instant::now()));
    // An allowance beyond the budget, or none, makes the cold tier simply unavailable.
    let t = tiers(10_000).await;
    scale_to_zero(&t, &[INT4]);
    let r = t.post(&chat("auto", SIMPLE), &[]).await;
    assert_eq!(r.header("x-quantrouter-reason"), "utility");
    let t = tiers(0).await;
    scale_to_zero(&t, &[INT4]);
    let r = t.post(&chat("auto", SIMPLE), &[]).await;
    assert_eq!(r.header("x-quantrouter-reason"), "utility");
}
