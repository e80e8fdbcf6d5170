//! Compatibility check with the official `openai` Python client against a running router.
//! `scripts/install-tools openai` creates the venv; `QUANTROUTER_PYTHON` points at it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::path::PathBuf;
use std::time::Duration;

use support::{keys, Harness};

fn python() -> PathBuf {
    let path = std::env::var_os("QUANTROUTER_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python")
        });
    assert!(
        path.exists(),
        "{} not found: run `scripts/install-tools openai` (scripts/test does) or set QUANTROUTER_PYTHON",
        path.display()
    );
    path
}

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
