//! Routers side by side: replicas whose request ids must not collide (every container runs
//! as PID 1).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::HashSet;
use std::time::Duration;

use http::StatusCode;
use support::*;

const JSON: (&str, &str) = ("content-type", "application/json");

/// The `<prefix>` of a router-assigned id, `qr-<prefix>-<counter>`.
fn id_prefix(id: &str) -> u32 {
    let prefix = id
        .strip_prefix("qr-")
        .and_then(|rest| rest.split('-').next())
        .unwrap_or_else(|| panic!("not a router-assigned id: {id:?}"));
    u32::from_str_radix(prefix, 16).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_router_gives_its_request_ids_a_prefix_of_its_own() {
    let (set, _sims) = sim_tiers(Duration::ZERO).await;
    let client = client();
    let mut prefixes = Vec::new();
    // Routers in one process share a PID, as replicas in containers (all PID 1) do.
    for _ in 0..8 {
        let router = start_router(set.clone(), |_| {}).await;
        let url = format!("http://{}/v1/chat/completions", router.public_addr());
        let r = send(&client, "POST", &url, &chat("auto", SIMPLE), &[JSON]).await;
        assert_eq!(r.status, StatusCode::OK);
        prefixes.push(id_prefix(r.header("x-request-id")));
        router.shutdown().await;
    }
    let distinct: HashSet<u32> = prefixes.iter().copied().collect();
    assert_eq!(distinct.len(), prefixes.len(), "{prefixes:08x?}");
    // Random prefixes differ in their high half too; a PID mixed with a clock's low bits,
    // or any other constant with a small varying term, would not.
    let high_halves: HashSet<u32> = prefixes.iter().map(|p| p >> 16).collect();
    assert!(high_halves.len() > 1, "{prefixes:08x?}");
}
