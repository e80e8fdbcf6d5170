//! Run-time fault injection through `/sim/faults` and the library API.

mod common;

use std::time::Duration;

use common::*;
use http::{Method, StatusCode};
use serde_json::{json, Value};
use tokio::io::AsyncReadExt;
use tokio::time::Instant;
use vllm_sim::{Faults, SimConfig, SimStats};

async fn set_faults(sim: &vllm_sim::SimServer, faults: Value) {
    let reply = post(sim, "/sim/faults", &faults).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
}

fn stream_body(prompt: &str) -> Value {
    let mut body = chat(prompt);
    body["stream"] = json!(true);
    body
}

#[tokio::test]
async fn error_rate_one_fails_every_request_with_status_and_retry_after() {
    let sim = start_default().await;
    set_faults(
        &sim,
        json!({"error_rate": 1.0, "error_status": 429, "retry_after_s": 7}),
    )
    .await;
    for _ in 0..3 {
        let reply = post(&sim, "/v1/chat/completions", &chat("hi")).await;
        assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(reply.header("retry-after"), Some("7"));
        let error = reply.json();
        assert_eq!(error["error"]["code"], 429);
        assert_eq!(error["error"]["type"], "RateLimitError");
        assert_eq!(error["error"]["param"], Value::Null);
    }
    let stats = sim.stats();
    assert_eq!(
        stats,
        SimStats {
            requests: 3,
            cancelled: 0,
            faults_injected: 3,
            http2_requests: 0,
        }
    );
}

#[tokio::test]
async fn default_error_status_is_503_without_retry_after() {
    let sim = start_default().await;
    set_faults(&sim, json!({"error_rate": 1.0})).await;
    let reply = post(
        &sim,
        "/v1/completions",
        &json!({"prompt": "x", "stream": true}),
    )
    .await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(reply.header("retry-after"), None);
    assert_eq!(reply.header("content-type"), Some("application/json"));
}

#[tokio::test]
async fn error_rate_half_fails_every_other_request() {
    let sim = start_default().await;
    set_faults(&sim, json!({"error_rate": 0.5})).await;
    let mut failed = 0;
    for _ in 0..10 {
        if post(&sim, "/v1/chat/completions", &chat("hi")).await.status != StatusCode::OK {
            failed += 1;
        }
    }
    assert_eq!(failed, 5);
    assert_eq!(sim.stats().faults_injected, 5);
}

#[tokio::test]
async fn delete_clears_faults() {
    let sim = start_default().await;
    set_faults(&sim, json!({"error_rate": 1.0})).await;
    assert_eq!(get(&sim, "/sim/faults").await.json()["error_rate"], 1.0);
    let cleared = request(&sim, Method::DELETE, "/sim/faults", None).await;
    assert_eq!(cleared.status, StatusCode::OK);
    assert_eq!(cleared.json()["error_rate"], 0.0);
    let reply = post(&sim, "/v1/chat/completions", &chat("hi")).await;
    assert_eq!(reply.status, StatusCode::OK);
}

#[tokio::test]
async fn bad_fault_json_is_400_and_keeps_the_old_faults() {
    let sim = start_default().await;
    set_faults(&sim, json!({"degenerate": true})).await;
    for body in [
        r#"{"error_rate": "#,
        r#"{"error_rate": 1.5}"#,
        r#"{"error_status": 200}"#,
        r#"{"hnag": true}"#,
        r#"{"delay_ms": -1}"#,
    ] {
        let reply = post_raw(&sim, "/sim/faults", body).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(reply.json()["error"]["code"], 400);
    }
    assert_eq!(get(&sim, "/sim/faults").await.json()["degenerate"], true);
}

#[tokio::test]
async fn delay_holds_back_the_response_headers() {
    let sim = start_default().await;
    set_faults(&sim, json!({"delay_ms": 300})).await;
    let started = Instant::now();
    let reply = post(&sim, "/v1/chat/completions", &stream_body("hi")).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(sim.stats().faults_injected, 1);
}

#[tokio::test]
async fn hang_never_answers_and_counts_a_cancel_when_the_client_gives_up() {
    let sim = start_default().await;
    set_faults(&sim, json!({"hang": true})).await;
    let mut stream = raw_post(sim.local_addr(), "/v1/chat/completions", &chat("hi")).await;
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(Duration::from_millis(300), stream.read(&mut buf)).await;
    assert!(read.is_err(), "the hung request answered: {read:?}");
    eventually("the request to be counted", || async {
        sim.stats().requests == 1
    })
    .await;
    assert_eq!(sim.stats().cancelled, 0);
    drop(stream);
    eventually("cancelled to reach 1", || async {
        sim.stats().cancelled == 1
    })
    .await;
    assert_eq!(sim.stats().faults_injected, 1);
    let text = scrape(&sim).await;
    assert_eq!(
        metric(&text, "vllm_sim_requests_cancelled_total"),
        Some(1.0)
    );
}

#[tokio::test]
async fn reset_after_chunks_cuts_the_stream_without_a_clean_end() {
    let sim = start_default().await;
    set_faults(&sim, json!({"reset_after_chunks": 3})).await;
    let mut stream = raw_post(sim.local_addr(), "/v1/chat/completions", &stream_body("hi")).await;
    let raw = read_until_closed(&mut stream).await;
    assert!(raw.starts_with("HTTP/1.1 200 OK\r\n"), "{raw}");
    assert!(raw
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked"));
    assert_eq!(raw.matches("data: ").count(), 3, "{raw}");
    assert!(!raw.contains("[DONE]"));
    // No terminating zero-length chunk: the client must see an incomplete body.
    assert!(!raw.ends_with("0\r\n\r\n"), "{raw}");
    // A server-side reset is not a client cancellation.
    assert_eq!(sim.stats().cancelled, 0);
}

#[tokio::test]
async fn reset_aborts_a_non_streamed_request_before_any_response() {
    let sim = start_default().await;
    set_faults(&sim, json!({"reset_after_chunks": 0})).await;
    let mut stream = raw_post(
        sim.local_addr(),
        "/v1/completions",
        &json!({"prompt": "hi"}),
    )
    .await;
    assert_eq!(read_until_closed(&mut stream).await, "");
    assert_eq!(sim.stats().faults_injected, 1);
    assert_eq!(sim.stats().cancelled, 0);
}

#[tokio::test]
async fn degenerate_answers_repeat_one_word() {
    let sim = start_default().await;
    let normal = post(&sim, "/v1/chat/completions", &chat("explain routing"))
        .await
        .json();
    set_faults(&sim, json!({"degenerate": true})).await;
    let reply = post(&sim, "/v1/chat/completions", &chat("explain routing"))
        .await
        .json();
    let text = reply["choices"][0]["message"]["content"].as_str().unwrap();
    let words: Vec<&str> = text.split(' ').collect();
    assert!(words.len() >= 8);
    assert!(words.iter().all(|w| *w == words[0]), "{text}");
    // Same length as the healthy answer: only the words change.
    assert_eq!(reply["usage"], normal["usage"]);
}

#[tokio::test]
async fn library_api_sets_and_clears_faults() {
    let sim = start(SimConfig::default()).await;
    sim.set_faults(Faults {
        error_rate: 1.0,
        error_status: 502,
        ..Faults::default()
    });
    let reply = post(&sim, "/v1/chat/completions", &chat("hi")).await;
    assert_eq!(reply.status, StatusCode::BAD_GATEWAY);
    sim.clear_faults();
    let reply = post(&sim, "/v1/chat/completions", &chat("hi")).await;
    assert_eq!(reply.status, StatusCode::OK);
    let stats: SimStats = serde_json::from_value(get(&sim, "/sim/stats").await.json()).unwrap();
    assert_eq!(
        stats,
        SimStats {
            requests: 2,
            cancelled: 0,
            faults_injected: 1,
            http2_requests: 0,
        }
    );
    assert_eq!(stats, sim.stats());
}
