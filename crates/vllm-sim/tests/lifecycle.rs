//! Starting and stopping the library handle.
//!
//! The binary's test lives in `binary.rs`: spawning a process forks this one, and until the
//! child execs it holds a copy of every open socket, so a listener closed meanwhile would
//! still accept. Separate test binaries never run at the same time.

mod common;

use std::time::Duration;

use common::*;
use http::StatusCode;
use tokio::net::TcpStream;
use vllm_sim::SimConfig;

#[tokio::test]
async fn shutdown_closes_the_port_and_aborts_open_connections() {
    let sim = start(SimConfig {
        itl: Duration::from_secs(1),
        ..SimConfig::default()
    })
    .await;
    let addr = sim.local_addr();
    assert_eq!(sim.url(), format!("http://127.0.0.1:{}", addr.port()));
    let mut body = chat("never finishes in time");
    body["stream"] = serde_json::json!(true);
    let mut open = raw_post(addr, "/v1/chat/completions", &body).await;
    read_until_contains(&mut open, "200 OK").await;
    sim.shutdown().await;
    if let Ok(stream) = TcpStream::connect(addr).await {
        panic!(
            "port still accepts: local {:?} peer {:?}",
            stream.local_addr(),
            stream.peer_addr()
        );
    }
    // The open stream is cut rather than left hanging.
    let rest = read_until_closed(&mut open).await;
    assert!(!rest.contains("[DONE]"));
}

#[tokio::test]
async fn dropping_the_server_stops_it() {
    let sim = start_default().await;
    let addr = sim.local_addr();
    assert_eq!(get(&sim, "/health").await.status, StatusCode::OK);
    drop(sim);
    eventually("the port to refuse connections", || async {
        TcpStream::connect(addr).await.is_err()
    })
    .await;
}
