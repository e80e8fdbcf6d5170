//! Routers side by side: replicas whose request ids must not collide (every container runs
//! as PID 1), and routers in one network namespace whose fixed default ports do.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::process::Stdio;
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

/// A loopback address no one listens on (the port is free as the test starts).
fn free() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// Runs the binary with `listen`, `admin` and `scaler` for its three ports until it exits;
/// its exit code and what it wrote to stderr.
async fn run_to_exit(
    set: &quantrouter_policy::ProfileSet,
    [listen, admin, scaler]: [SocketAddr; 3],
) -> (Option<i32>, String) {
    let dir = tempfile::tempdir().unwrap();
    let profiles = dir.path().join("profiles.json");
    std::fs::write(&profiles, serde_json::to_string(set).unwrap()).unwrap();
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_quantrouter"))
        .arg("serve")
        .args(["--listen", &listen.to_string()])
        .args(["--admin-listen", &admin.to_string()])
        .args(["--keda-scaler-listen", &scaler.to_string()])
        .arg("--profiles")
        .arg(&profiles)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let output = tokio::time::timeout(Duration::from_secs(20), child.wait_with_output())
        .await
        .expect("the second router kept running on a port already taken")
        .unwrap();
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_router_on_a_taken_port_exits_naming_the_address_and_its_flag() {
    let (set, _sims) = sim_tiers(Duration::ZERO).await;
    let scaler = free();
    let first = RouterProcess::spawn(
        &set,
        &["--keda-scaler-listen", &scaler.to_string()],
        Stdio::null(),
    )
    .await;
    let taken = [first.public, first.admin, scaler];
    for (i, flag) in ["--listen", "--admin-listen", "--keda-scaler-listen"]
        .into_iter()
        .enumerate()
    {
        // The second router's ports are free but for the one under test.
        let mut ports = [free(), free(), free()];
        ports[i] = taken[i];
        let (code, stderr) = run_to_exit(&set, ports).await;
        assert_eq!(code, Some(2), "{flag}: {stderr}");
        let named = format!("binding {flag} {}: ", taken[i]);
        assert!(stderr.contains(&named), "{flag}: {stderr}");
        assert!(stderr.contains("in use"), "{flag}: {stderr}");
    }
    assert_eq!(
        first.get_status("/readyz").await,
        Some(StatusCode::OK),
        "the first router kept serving"
    );
}
