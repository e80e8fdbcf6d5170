//! Compatibility check with the official `openai` Python client against a running router.
//! `scripts/install-tools openai` creates the venv; `QUANTROUTER_PYTHON` points at it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::path::PathBuf;
use std::time::Duration;

use quantrouter_policy::{repetition_ratio, StreamCheck};
use support::{eventually, keys, python, Harness, Tiers, SIMPLE};
use vllm_sim::{Faults, SimConfig};

const FP8: usize = 1;
const INT4: usize = 2;

async fn run_script(base_url: String, extra: &[&str]) {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/openai_compat.py");
    let output = tokio::process::Command::new(python())
        .arg(script)
        .arg(base_url)
        .args(extra)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("{stdout}");
    assert!(
        output.status.success(),
        "openai client failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("checks passed"), "{stdout}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_openai_client_works_against_the_router() {
    let h = Harness::start_with(Duration::from_millis(1), |_| {}).await;
    run_script(h.url("/v1"), &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_openai_client_sees_auth_errors() {
    let h = Harness::start_with(Duration::ZERO, |c| c.api_keys = keys(&["test-key"])).await;
    run_script(h.url("/v1"), &["--check-auth"]).await;
}

/// What `stream_once.py` saw of one streamed chat completion.
#[derive(Debug, serde::Deserialize)]
struct Streamed {
    headers: std::collections::HashMap<String, String>,
    text: String,
}

/// Streams `prompt` from `base_url` as `model` with the official client.
async fn stream_once(base_url: &str, model: &str, prompt: &str, max_tokens: u32) -> Streamed {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/stream_once.py");
    let output = tokio::process::Command::new(python())
        .arg(script)
        .args([base_url, model, prompt, &max_tokens.to_string()])
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "openai client failed:\n{stdout}\n{stderr}"
    );
    serde_json::from_str(stdout.trim()).unwrap()
}

/// Tiers whose int4 sim streams a token every 10 ms (so a stream dropped after its start is
/// still running), with the stream-start check on.
async fn checked_tiers() -> Tiers {
    Tiers::start(
        [1, 1, 1],
        |i| SimConfig {
            itl: Duration::from_millis(if i == INT4 { 10 } else { 0 }),
            ..SimConfig::default()
        },
        |set| {
            set.policy.stream_check = Some(StreamCheck {
                tokens: 8,
                // Far above the hold's ~80 ms: a loaded test machine must not commit it.
                max_hold_ms: 5_000,
            })
        },
        |_| {},
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_degenerate_cheap_stream_is_replaced_before_the_openai_client_sees_a_byte() {
    let t = checked_tiers().await;
    t.sims[INT4][0].set_faults(Faults {
        degenerate: true,
        ..Faults::default()
    });
    let router = format!("http://{}/v1", t.router.public_addr());
    let seen = stream_once(&router, "auto", SIMPLE, 64).await;
    assert_eq!(seen.headers["x-quantrouter-tier"], "fp8", "{seen:?}");
    assert_eq!(seen.headers["x-quantrouter-reason"], "fallback_quality");
    assert_eq!(
        seen.headers["x-quantrouter-fallback"],
        "from=llama8b-awq; to=llama8b-fp8; reason=quality"
    );
    // Exactly fp8's stream: not one token of the degenerate start before it.
    let fp8 = format!("{}/v1", t.sims[FP8][0].url());
    let good = stream_once(&fp8, &t.set.profiles[FP8].model, SIMPLE, 64).await;
    assert!(!good.text.is_empty());
    assert_eq!(seen.text, good.text);
    assert!(repetition_ratio(&seen.text) < 0.5, "{}", seen.text);
    assert_eq!(t.requests(INT4), 1);
    let dropped = eventually(Duration::from_secs(5), || async {
        t.sims[INT4][0].stats().cancelled == 1
    })
    .await;
    assert!(
        dropped,
        "the degenerate stream's upstream request is closed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_good_cheap_stream_passes_the_check_whole_and_unchanged() {
    let t = checked_tiers().await;
    let router = format!("http://{}/v1", t.router.public_addr());
    let seen = stream_once(&router, "auto", SIMPLE, 64).await;
    assert_eq!(seen.headers["x-quantrouter-tier"], "int4", "{seen:?}");
    assert!(!seen.headers.contains_key("x-quantrouter-fallback"));
    let int4 = format!("{}/v1", t.sims[INT4][0].url());
    let direct = stream_once(&int4, &t.set.profiles[INT4].model, SIMPLE, 64).await;
    assert!(direct.text.split_whitespace().count() > 8, "{direct:?}");
    assert_eq!(seen.text, direct.text, "held frames first, then the rest");
    assert_eq!(t.requests(FP8), 0);
}
