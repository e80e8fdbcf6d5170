//! Logs of the real binary: JSON lines, the request id on every line of a request, and no
//! prompt text unless `--log-prompts` is set.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::process::Stdio;
use std::time::Duration;

use http::StatusCode;
use quantrouter_policy::ProfileSet;
use support::{chat, client, send, sim_tiers, RouterProcess};
use tokio::io::AsyncReadExt;

const SECRET: &str = "What is the capital of the secret-marker-7 kingdom?";

/// Runs one request through the binary with `args` and returns its stderr lines.
async fn log_lines(args: &[&str]) -> Vec<serde_json::Value> {
    let (set, _sims) = sim_tiers(Duration::ZERO).await;
    log_lines_with(&set, args).await
}

/// [`log_lines`] in front of the given profile set.
async fn log_lines_with(set: &ProfileSet, args: &[&str]) -> Vec<serde_json::Value> {
    let mut all = vec!["--log-format", "json"];
    all.extend_from_slice(args);
    let mut router = RouterProcess::spawn(set, &all, Stdio::piped()).await;
    let r = send(
        &client(),
        "POST",
        &router.url("/v1/chat/completions"),
        &chat("auto", SECRET),
        &[
            ("content-type", "application/json"),
            ("x-request-id", "req-42"),
        ],
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    router.terminate();
    let mut stderr = router.child.stderr.take().unwrap();
    let mut text = String::new();
    stderr.read_to_string(&mut text).await.unwrap();
    router.child.wait().await.unwrap();
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_are_logged_only_when_asked_and_lines_carry_the_request_id() {
    let quiet = log_lines(&[]).await;
    assert!(!quiet.is_empty());
    assert!(
        quiet
            .iter()
            .all(|l| !l.to_string().contains("secret-marker-7")),
        "no prompt text by default"
    );

    let verbose = log_lines(&["--log-prompts"]).await;
    let routed: Vec<_> = verbose
        .iter()
        .filter(|l| l["fields"]["message"] == "routed")
        .collect();
    assert_eq!(routed.len(), 1, "{verbose:?}");
    let line = routed[0];
    assert!(line["fields"]["prompt"]
        .as_str()
        .unwrap()
        .contains("secret-marker-7"));
    assert_eq!(
        line["fields"]["request_id"], "req-42",
        "the request id is on the line: {line}"
    );
    assert_eq!(line["fields"]["profile"], "llama8b-awq");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_upstream_attempt_is_logged_with_the_request_id() {
    let (set, mut sims) = sim_tiers(Duration::ZERO).await;
    // The cheapest tier, where the prompt goes, is down: the attempt fails and the request
    // moves to another tier.
    let int4 = set.profiles.iter().position(|p| p.tier == "int4").unwrap();
    sims.remove(int4).shutdown().await;
    let lines = log_lines_with(&set, &[]).await;
    let failed: Vec<_> = lines
        .iter()
        .filter(|l| l["fields"]["message"] == "upstream attempt failed")
        .collect();
    assert!(!failed.is_empty(), "{lines:?}");
    for line in failed {
        assert_eq!(line["fields"]["request_id"], "req-42", "{line}");
        assert_eq!(line["level"], "WARN", "{line}");
    }
}
