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
    let (lines, _) = exchange_logs(set, args, &[], &chat("auto", SECRET), StatusCode::OK).await;
    lines
}

/// Sends `body` to the binary started with `args` and `env`, expects `status`; returns the
/// process's log lines and the response body.
async fn exchange_logs(
    set: &ProfileSet,
    args: &[&str],
    env: &[(&str, &str)],
    body: &str,
    status: StatusCode,
) -> (Vec<serde_json::Value>, String) {
    let mut all = vec!["--log-format", "json"];
    all.extend_from_slice(args);
    let mut router = RouterProcess::spawn_with_env(set, &all, env, Stdio::piped()).await;
    let r = send(
        &client(),
        "POST",
        &router.url("/v1/chat/completions"),
        body,
        &[
            ("content-type", "application/json"),
            ("x-request-id", "req-42"),
        ],
    )
    .await;
    assert_eq!(r.status, status, "{:?}", r.body);
    let answer = String::from_utf8_lossy(&r.body).into_owned();
    router.terminate();
    let mut stderr = router.child.stderr.take().unwrap();
    let mut text = String::new();
    stderr.read_to_string(&mut text).await.unwrap();
    router.child.wait().await.unwrap();
    let lines = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    (lines, answer)
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

/// `serve --config` with JSON booleans: the file turns prompt logging on, the environment
/// turns it back off, and the command line's `--log-format json` beats the file's `text`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_json_config_file_sets_switches_under_the_environment_and_flags() {
    let (set, _sims) = sim_tiers(Duration::ZERO).await;
    let dir = tempfile::Builder::new()
        .prefix("qr-config-")
        .tempdir()
        .unwrap();
    let config = dir.path().join("router.json");
    std::fs::write(&config, r#"{"log_prompts": true, "log-format": "text"}"#).unwrap();
    let config = config.to_str().unwrap();
    let routed = |lines: &[serde_json::Value]| {
        let line = lines.iter().find(|l| l["fields"]["message"] == "routed");
        line.cloned()
            .unwrap_or_else(|| panic!("no routed line in {lines:?}"))
    };

    let body = chat("auto", SECRET);
    let (from_file, _) =
        exchange_logs(&set, &["--config", config], &[], &body, StatusCode::OK).await;
    let prompt = routed(&from_file)["fields"]["prompt"].clone();
    assert!(
        prompt
            .as_str()
            .is_some_and(|p| p.contains("secret-marker-7")),
        "{prompt}"
    );

    let env = [("QUANTROUTER_LOG_PROMPTS", "false")];
    let (env_wins, _) =
        exchange_logs(&set, &["--config", config], &env, &body, StatusCode::OK).await;
    assert!(!env_wins.is_empty());
    assert!(
        env_wins
            .iter()
            .all(|l| !l.to_string().contains("secret-marker-7")),
        "the environment's false beats the file's true"
    );
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejections_at_debug_quote_no_prompt_text_unless_prompts_may_be_logged() {
    let (set, _sims) = sim_tiers(Duration::ZERO).await;
    // The parser's message quotes the value it could not take: here, the prompt.
    let body = serde_json::json!({"model": "auto", "messages": SECRET}).to_string();
    let debug = [("RUST_LOG", "debug")];
    let (quiet, answer) = exchange_logs(&set, &[], &debug, &body, StatusCode::BAD_REQUEST).await;
    assert!(
        answer.contains("secret-marker-7"),
        "the client sees its input: {answer}"
    );
    let rejected: Vec<_> = quiet
        .iter()
        .filter(|l| l["fields"]["message"] == "request rejected")
        .collect();
    assert!(
        quiet
            .iter()
            .all(|l| !l.to_string().contains("secret-marker-7")),
        "no prompt text at debug: {quiet:?}"
    );
    assert_eq!(rejected.len(), 1, "{quiet:?}");
    assert_eq!(rejected[0]["fields"]["code"], "invalid_request");

    let (verbose, _) = exchange_logs(
        &set,
        &["--log-prompts"],
        &debug,
        &body,
        StatusCode::BAD_REQUEST,
    )
    .await;
    assert!(
        verbose
            .iter()
            .any(|l| l["fields"]["message"] == "request rejected"
                && l.to_string().contains("secret-marker-7")),
        "{verbose:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_addresses_stay_in_the_logs_and_out_of_the_answer() {
    let (mut set, _sims) = sim_tiers(Duration::ZERO).await;
    let (_refusing, address) = support::refusing_address();
    let address = address.to_string();
    for p in &mut set.profiles {
        p.upstream =
            quantrouter_policy::Upstream::Static(quantrouter_policy::StaticUpstream::new(vec![
                format!("http://{address}"),
            ]));
    }
    let (lines, answer) = exchange_logs(
        &set,
        &[],
        &[],
        &chat("auto", SECRET),
        StatusCode::SERVICE_UNAVAILABLE,
    )
    .await;
    assert!(!answer.contains(&address), "{answer}");
    assert!(
        lines
            .iter()
            .any(|l| l["fields"]["message"] == "upstream attempt failed"
                && l.to_string().contains(&address)),
        "{lines:?}"
    );
}

/// A profile set can name any path as its outcome file (`policy.calibration.outcomes.file`),
/// and anyone who can write to Redis can push one: a file that is not the router's own log is
/// reported when the set is loaded, and left as it was by the sampled traffic after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_outcome_file_is_reported_at_load_and_left_alone() {
    let (mut set, _sims) = sim_tiers(Duration::ZERO).await;
    let dir = tempfile::tempdir().unwrap();
    let notes = dir.path().join("notes.txt");
    std::fs::write(&notes, "one\ntwo\n").unwrap();
    let reference = set.profiles.iter().find(|p| p.tier == "fp16").unwrap();
    set.policy.calibration = Some(quantrouter_policy::Calibration {
        sample_rate: 1.0,
        reference_profile: reference.id.clone(),
        max_extra_cost_per_hour: 1e6,
        outcomes: Some(quantrouter_policy::OutcomeSink {
            redis: false,
            file: Some(notes.to_str().unwrap().into()),
            max_len: 1,
            ttl_s: 60,
        }),
    });
    set.validate().unwrap();
    let lines = log_lines_with(&set, &[]).await;
    let refused = lines
        .iter()
        .find(|l| {
            l["fields"]["message"]
                .as_str()
                .unwrap_or_default()
                .starts_with("outcome file refused")
        })
        .unwrap_or_else(|| panic!("no refusal in {lines:?}"));
    assert_eq!(refused["level"], "ERROR");
    assert!(refused["fields"]["reason"]
        .as_str()
        .unwrap()
        .contains("line 1 is not an outcome record"));
    assert_eq!(std::fs::read_to_string(&notes).unwrap(), "one\ntwo\n");
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        1,
        "nothing beside it"
    );
}
