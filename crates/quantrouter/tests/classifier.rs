//! The prompt classifier in a running router: explained in `/v1/route` and `/admin`,
//! pushed through a real Redis to every replica, rolled back, watched in a file, and never
//! replaced by an invalid model — without dropping a request.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::Arc;
use std::time::Duration;

use quantrouter::classifier::{self, ClassifierConfig, ClassifierStore};
use quantrouter::documents::RedisStore;
use quantrouter::server::ServerConfig;
use quantrouter_policy::classifier::{parse_labelled, train, TrainOptions};
use quantrouter_policy::ClassifierDocument;
use support::redis_server::RedisServer;
use support::{eventually, Harness};

/// Greets land on the cheapest tier with the built-in model.
const GREETING: &str = "Say hello in French.";

/// A model trained on heavy code prompts only: it calls every prompt heavy code, so a
/// greeting it scores leaves the cheapest tier.
fn everything_is_code(seed: u64) -> ClassifierDocument {
    let data: String = (0..24)
        .map(|i| {
            let prompt =
                format!("Write a Python function number {i} that sorts a list of {seed} items.");
            format!(
                "{}\n",
                serde_json::json!({"id": format!("c{i}"), "prompt": prompt, "label": "heavy",
                    "task_class": "code", "split": "train"})
            )
        })
        .collect();
    let options = TrainOptions {
        bits: 10,
        ..TrainOptions::default()
    };
    train(&parse_labelled(&data, seed).unwrap(), &options)
}

/// `/v1/route` for one user message.
async fn route(h: &Harness, text: &str) -> serde_json::Value {
    let body =
        serde_json::json!({"model": "auto", "messages": [{"role": "user", "content": text}]});
    let reply = h.post("/v1/route", &body.to_string()).await;
    assert_eq!(
        reply.status,
        200,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    reply.json()
}

async fn admin_classifier(h: &Harness) -> serde_json::Value {
    h.get(&h.admin_url("/admin/classifier")).await.json()
}

fn classifier_reloads(source: &str, result: &str) -> u64 {
    quantrouter::telemetry::metrics_handle()
        .render()
        .lines()
        .find(|l| {
            l.starts_with("quantrouter_classifier_reloads_total{")
                && l.contains(&format!("source=\"{source}\""))
                && l.contains(&format!("result=\"{result}\""))
        })
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0)
}

async fn with_classifier(config: ClassifierConfig) -> Harness {
    let store = classifier::start(config).await.unwrap().store;
    Harness::start_with(Duration::ZERO, move |c: &mut ServerConfig| {
        c.classifier = store
    })
    .await
}

fn config() -> ClassifierConfig {
    ClassifierConfig {
        file: None,
        off: false,
        file_interval: Duration::from_millis(20),
        redis: None,
        redis_poll: Duration::from_millis(50),
    }
}

/// A short GSM8K problem (test set): the cheap model of the outcome data answers it.
const EASY_WORD_PROBLEM: &str = "James decides to run 3 sprints 3 times a week.  He runs 60 \
    meters each sprint.  How many total meters does he run a week?";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_reports_the_risk_and_the_header_sets_the_tolerance() {
    let h = Harness::start().await;
    let body = serde_json::json!({"model": "auto",
        "messages": [{"role": "user", "content": EASY_WORD_PROBLEM}]})
    .to_string();
    let answer = route(&h, EASY_WORD_PROBLEM).await;
    let risk = answer["risk"].as_f64().unwrap();
    assert!((0.0..=0.25).contains(&risk), "{answer}");
    assert_eq!(answer["task_class"], "math", "{answer}");
    assert_eq!(answer["tier"], "fp8", "{answer}");
    let fp8 = answer["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["profile"] == "llama8b-fp8")
        .unwrap();
    assert!(fp8["risk"].as_f64().unwrap() < risk, "{answer}");
    // The request's tolerance replaces the profile set's: 0 turns the rule off.
    let off = h
        .post_with(
            "/v1/route",
            &body,
            &[
                ("content-type", "application/json"),
                ("x-quantrouter-risk-tolerance", "0"),
            ],
        )
        .await
        .json();
    assert_eq!(off["tier"], "fp16", "{off}");
    for bad in ["1.5", "-0.1", "lots", "NaN"] {
        let r = h
            .post_with(
                "/v1/route",
                &body,
                &[
                    ("content-type", "application/json"),
                    ("x-quantrouter-risk-tolerance", bad),
                ],
            )
            .await;
        assert_eq!(r.status, 400, "{bad}");
        assert_eq!(r.json()["error"]["param"], "x-quantrouter-risk-tolerance");
    }
    // Every prompt has a risk, whatever its class: chat and code too.
    for text in [GREETING, CODE_REQUEST] {
        let answer = route(&h, text).await;
        let risk = answer["risk"].as_f64();
        assert!(risk.is_some_and(|r| (0.0..=1.0).contains(&r)), "{answer}");
    }
}

/// A request the difficulty head keeps on the reference tier.
const CODE_REQUEST: &str = "Write a Python function that parses an ISO 8601 duration string \
    and returns the number of seconds, with tests for the edge cases.";

/// `route --json` scores like `/v1/route`: a risk for every prompt, chat and code too.
#[test]
fn route_json_gives_a_risk_for_every_prompt() {
    for text in [GREETING, CODE_REQUEST, EASY_WORD_PROBLEM] {
        let (code, stdout, stderr) = support::cli(&["route", "--json", text]);
        assert_eq!(code, 0, "{stderr}");
        let answer: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        let risk = answer["risk"].as_f64();
        assert!(risk.is_some_and(|r| (0.0..=1.0).contains(&r)), "{answer}");
    }
}

/// Issue: `policy.risk_tolerance` moved only math and reasoning prompts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_risk_tolerance_moves_a_code_request_too() {
    let h = Harness::start().await;
    let body = serde_json::json!({"model": "auto",
        "messages": [{"role": "user", "content": CODE_REQUEST}]})
    .to_string();
    let tier = |tolerance: &'static str| {
        let (h, body) = (&h, &body);
        async move {
            let headers = [
                ("content-type", "application/json"),
                ("x-quantrouter-risk-tolerance", tolerance),
            ];
            let answer = h.post_with("/v1/route", body, &headers).await.json();
            assert_eq!(answer["task_class"], "code", "{answer}");
            answer["tier"].as_str().unwrap().to_owned()
        }
    };
    assert_eq!(tier("0").await, "fp16");
    assert_eq!(tier("1").await, "fp8");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_explains_the_class_probabilities_and_the_words_that_moved_them() {
    let h = Harness::start().await;
    let answer = route(
        &h,
        "Write a function that returns the k-th smallest element of a binary search tree \
         without recursion and explain its complexity",
    )
    .await;
    assert_eq!(answer["task_class"], "code", "{answer}");
    assert_ne!(answer["tier"], "int4", "{answer}");
    let probabilities = answer["class_probabilities"].as_object().unwrap();
    assert_eq!(probabilities.len(), 5, "{answer}");
    let total: f64 = probabilities.values().map(|p| p.as_f64().unwrap()).sum();
    assert!((total - 1.0).abs() < 1e-6, "{answer}");
    assert!(probabilities["code"].as_f64().unwrap() > 0.5, "{answer}");
    let top = answer["top_features"].as_array().unwrap();
    assert!(!top.is_empty() && top.len() <= 10, "{answer}");
    assert!(
        top.iter()
            .any(|f| f["feature"] == "function" || f["feature"] == "[code_terms]"),
        "the code words should be among what moved it: {answer}"
    );
    let greeting = route(&h, GREETING).await;
    assert_eq!(greeting["tier"], "int4", "{greeting}");
    let admin = admin_classifier(&h).await;
    assert_eq!(admin["source"], "builtin");
    assert_eq!(admin["active"], true);
    assert!(
        admin["metrics"]["dev"]["task_class_accuracy"]
            .as_f64()
            .unwrap()
            >= 0.85,
        "{admin}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_classifier_off_routing_uses_the_structural_score() {
    let h = with_classifier(ClassifierConfig {
        off: true,
        ..config()
    })
    .await;
    let answer = route(&h, GREETING).await;
    assert!(answer.get("class_probabilities").is_none(), "{answer}");
    assert_eq!(admin_classifier(&h).await["active"], false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pushed_model_reaches_every_replica_and_rolls_back() {
    let redis = RedisServer::start(None);
    let redis_config = || ClassifierConfig {
        redis: Some((redis.handle(), "qr".into())),
        ..config()
    };
    let replicas = [
        with_classifier(redis_config()).await,
        with_classifier(redis_config()).await,
    ];
    for h in &replicas {
        assert_eq!(route(h, GREETING).await["tier"], "int4");
    }
    let ops = RedisStore::<ClassifierDocument>::connect(&redis.handle(), "qr")
        .await
        .unwrap();
    let code = everything_is_code(1);
    let v1 = ops.push(code.clone()).await.unwrap();
    for h in &replicas {
        assert!(serving(h, v1, &code).await, "{}", admin_classifier(h).await);
        let answer = route(h, GREETING).await;
        assert_eq!(answer["task_class"], "code", "{answer}");
        assert_ne!(answer["tier"], "int4", "{answer}");
    }
    let other = everything_is_code(2);
    assert_ne!(other.sha256, code.sha256);
    let v2 = ops.push(other.clone()).await.unwrap();
    for h in &replicas {
        assert!(
            serving(h, v2, &other).await,
            "{}",
            admin_classifier(h).await
        );
    }

    // Written past the CLI, a model whose digest does not match is rejected everywhere.
    let rejected = classifier_reloads("redis", "rejected");
    let mut tampered: serde_json::Value = serde_json::from_str(&other.to_json()).unwrap();
    tampered["version"] = serde_json::json!(v2 + 1);
    tampered["weights"]["bias"][0] = serde_json::json!(9.5);
    let mut conn = redis
        .client()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    redis::cmd("SET")
        .arg("qr:{classifier}")
        .arg(tampered.to_string())
        .query_async::<()>(&mut conn)
        .await
        .unwrap();
    let counted = eventually(Duration::from_secs(5), || async {
        classifier_reloads("redis", "rejected") >= rejected + 2
    })
    .await;
    assert!(counted, "both replicas reject it");
    for h in &replicas {
        assert_eq!(
            admin_classifier(h).await["version"],
            v2,
            "the last good model stays"
        );
    }

    // Rollback re-publishes an earlier model over the bad document.
    let v4 = ops.rollback(Some(v1)).await.unwrap();
    assert_eq!(v4, v2 + 2);
    for h in &replicas {
        assert!(serving(h, v4, &code).await, "{}", admin_classifier(h).await);
    }
}

/// Waits until `h` scores with `doc` as version `version`.
async fn serving(h: &Harness, version: u64, doc: &ClassifierDocument) -> bool {
    eventually(Duration::from_secs(5), || async {
        let admin = admin_classifier(h).await;
        admin["version"] == version && admin["sha256"] == doc.sha256.as_str()
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_in_flight_while_models_change_all_succeed() {
    let redis = RedisServer::start(None);
    let h = with_classifier(ClassifierConfig {
        redis: Some((redis.handle(), "qr".into())),
        ..config()
    })
    .await;
    let workers = support::steady_requests(&h.url("/v1/chat/completions"), 6, 25, GREETING);
    let ops = RedisStore::<ClassifierDocument>::connect(&redis.handle(), "qr")
        .await
        .unwrap();
    let models = [everything_is_code(1), everything_is_code(2)];
    let mut last = 0;
    for i in 0..10 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        last = ops.push(models[i % 2].clone()).await.unwrap();
    }
    let mut failures = Vec::new();
    for w in workers {
        failures.extend(w.await.unwrap());
    }
    assert!(
        failures.is_empty(),
        "{} failed: {:?}",
        failures.len(),
        &failures[..failures.len().min(3)]
    );
    let applied = eventually(Duration::from_secs(5), || async {
        admin_classifier(&h).await["version"] == last
    })
    .await;
    assert!(applied);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watched_model_file_is_applied_and_a_bad_edit_is_ignored() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.json");
    let builtin = ClassifierDocument::from_json(quantrouter_policy::DEFAULT_CLASSIFIER).unwrap();
    std::fs::write(&path, builtin.to_json()).unwrap();
    let h = with_classifier(ClassifierConfig {
        file: Some(path.clone()),
        ..config()
    })
    .await;
    assert_eq!(admin_classifier(&h).await["source"], "file");
    assert_eq!(route(&h, GREETING).await["tier"], "int4");

    let code = everything_is_code(1);
    std::fs::write(&path, code.to_json()).unwrap();
    let applied = eventually(Duration::from_secs(5), || async {
        admin_classifier(&h).await["sha256"] == code.sha256.as_str()
    })
    .await;
    assert!(applied);
    assert_ne!(route(&h, GREETING).await["tier"], "int4");

    let rejected = classifier_reloads("file", "rejected");
    std::fs::write(&path, &code.to_json()[..1000]).unwrap();
    let counted = eventually(Duration::from_secs(5), || async {
        classifier_reloads("file", "rejected") > rejected
    })
    .await;
    assert!(counted);
    assert_eq!(admin_classifier(&h).await["sha256"], code.sha256.as_str());
}

#[test]
fn an_unreadable_model_file_at_start_up_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.json");
    std::fs::write(&path, "{\"format\": \"quantrouter-classifier/1\"}").unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let started = runtime.block_on(classifier::start(ClassifierConfig {
        file: Some(path),
        ..config()
    }));
    assert!(started.is_err());
    let _ = Arc::new(ClassifierStore::default());
}

#[test]
fn the_cli_trains_evaluates_and_publishes_models() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("labels.jsonl");
    let lines: String = [
        ("Write a Python function that merges two sorted lists.", "heavy", "code"),
        ("Implement a queue with two stacks.", "heavy", "code"),
        ("A shop sells 3 apples for $2. How much do 12 apples cost?", "heavy", "math"),
        ("Solve for x: 4x - 6 = 10.", "heavy", "math"),
        ("What is the capital of Italy?", "light", "general"),
        ("Say good night in Spanish.", "light", "general"),
    ]
    .iter()
    .cycle()
    .take(48)
    .enumerate()
    .map(|(i, (p, l, c))| format!("{}\n", serde_json::json!({"prompt": format!("{p} #{i}"), "label": l, "task_class": c, "source": if i % 2 == 0 { "a" } else { "b" }})))
    .collect();
    std::fs::write(&data, lines).unwrap();
    let data = data.to_str().unwrap();
    let out = dir.path().join("model.json");
    let out = out.to_str().unwrap();
    let train_args = [
        "classifier",
        "train",
        "--data",
        data,
        "--out",
        out,
        "--bits",
        "10",
        "--seed",
        "7",
        "--leave-one-source-out",
    ];
    let (code, stdout, stderr) = support::cli(&train_args);
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(stdout.contains("task class accuracy"), "{stdout}");
    assert!(stdout.contains("held-out source"), "{stdout}");
    let first = std::fs::read(out).unwrap();
    let (code, _, _) = support::cli(&train_args);
    assert_eq!(code, 0);
    assert_eq!(
        std::fs::read(out).unwrap(),
        first,
        "the same data and seed give the same bytes"
    );
    let doc = ClassifierDocument::from_json(std::str::from_utf8(&first).unwrap()).unwrap();
    assert!(doc.metrics.leave_one_source_out.is_some());

    let (code, stdout, _) = support::cli(&["classifier", "eval", "--model", out, "--data", data]);
    assert_eq!(code, 0);
    assert!(stdout.contains("heavy -> cheapest"), "{stdout}");
    let (code, _, stderr) = support::cli(&["classifier", "eval", "--data", "/nonexistent.jsonl"]);
    assert_eq!(code, 1, "{stderr}");

    let redis = RedisServer::start(None);
    let url = redis.url();
    let (code, stdout, stderr) = support::cli(&["classifier", "push", out, "--redis-url", &url]);
    assert_eq!((code, stdout.trim()), (0, "pushed version 1"), "{stderr}");
    let (code, stdout, _) = support::cli(&["classifier", "push", out, "--redis-url", &url]);
    assert_eq!((code, stdout.trim()), (0, "pushed version 2"));
    let (code, stdout, _) = support::cli(&["classifier", "get", "--redis-url", &url]);
    assert_eq!(code, 0);
    assert_eq!(ClassifierDocument::from_json(&stdout).unwrap().version, 2);
    let (code, stdout, _) = support::cli(&["classifier", "history", "--redis-url", &url]);
    assert_eq!(code, 0);
    assert!(
        stdout.contains("version     1") && stdout.contains(&doc.sha256[..12]),
        "{stdout}"
    );
    let (code, stdout, _) = support::cli(&["classifier", "rollback", "--redis-url", &url]);
    assert_eq!(
        (code, stdout.trim()),
        (0, "rolled back: published as version 3")
    );

    let bad = dir.path().join("bad.json");
    let mut tampered: serde_json::Value = serde_json::from_slice(&first).unwrap();
    tampered["weights"]["blend"] = serde_json::json!(0.1);
    std::fs::write(&bad, tampered.to_string()).unwrap();
    let (code, _, stderr) = support::cli(&[
        "classifier",
        "push",
        bad.to_str().unwrap(),
        "--redis-url",
        &url,
    ]);
    assert_eq!(
        code, 1,
        "an invalid model is refused before Redis is touched: {stderr}"
    );
    assert!(stderr.contains("sha256"), "{stderr}");
    let (code, _, _) = support::cli(&["classifier", "get", "--redis-url", "redis://127.0.0.1:1"]);
    assert_eq!(code, 2);
}

/// Writes `doc` to a file in `dir` and returns its path.
fn model_file(dir: &tempfile::TempDir, doc: &ClassifierDocument) -> String {
    let path = dir.path().join(format!("model-{}.json", &doc.sha256[..8]));
    std::fs::write(&path, doc.to_json()).unwrap();
    path.to_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_redis_answers_late_is_waited_for_and_reported_as_pushed() {
    let redis = RedisServer::start(None);
    let url = redis.url();
    let dir = tempfile::tempdir().unwrap();
    let model = model_file(&dir, &everything_is_code(5));
    // Redis holds every write for 1.5 s: less than the 3 s a call may take.
    let paused = std::process::Command::new("redis-cli")
        .args([
            "-p",
            &redis.port.to_string(),
            "CLIENT",
            "PAUSE",
            "1500",
            "WRITE",
        ])
        .output()
        .unwrap();
    assert!(paused.status.success(), "{paused:?}");
    let (code, stdout, stderr) = tokio::task::spawn_blocking(move || {
        support::cli(&["classifier", "push", &model, "--redis-url", &url])
    })
    .await
    .unwrap();
    assert_eq!((code, stdout.trim()), (0, "pushed version 1"), "{stderr}");
    let ops = RedisStore::<ClassifierDocument>::connect(&redis.handle(), "quantrouter")
        .await
        .unwrap();
    assert_eq!(ops.active().await.unwrap().unwrap().version, 1);
}

/// Runs `quantrouter serve` with `args`, which must make it stop at start: exit code and
/// stderr.
async fn serve_refused(args: &[&str]) -> (i32, String) {
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_quantrouter"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .args(["--keda-scaler-listen", "off"])
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let out = tokio::time::timeout(Duration::from_secs(10), child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("`serve {}` did not stop", args.join(" ")))
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out.status.code().unwrap_or(-1), stderr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn documents_over_the_size_limit_are_refused_on_push_and_on_load() {
    let redis = RedisServer::start(None);
    let url = redis.url();
    let dir = tempfile::tempdir().unwrap();
    let doc = everything_is_code(6);
    let model = model_file(&dir, &doc);
    let limit = (doc.to_json().len() / 2).to_string();

    // Push: refused before Redis is touched.
    let push = ["classifier", "push", &model, "--redis-url", &url];
    let (code, _, stderr) = support::cli(&[&push[..], &["--max-document-bytes", &limit]].concat());
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("more than the document limit"), "{stderr}");
    let (code, _, stderr) = support::cli(&["classifier", "get", "--redis-url", &url]);
    assert_eq!(code, 1, "nothing was pushed: {stderr}");

    // Redis: pushed within the default limit, it is not loaded by a router with a smaller
    // one, which keeps the model it has.
    let (code, _, stderr) = support::cli(&push);
    assert_eq!(code, 0, "{stderr}");
    let set =
        quantrouter_policy::ProfileSet::from_json(quantrouter_policy::DEFAULT_PROFILE_SET).unwrap();
    let args = ["--redis-url", &url, "--max-document-bytes", &limit];
    let router = support::RouterProcess::spawn(&set, &args, std::process::Stdio::null()).await;
    let metrics = format!("http://{}/metrics", router.admin);
    let rejected = eventually(Duration::from_secs(10), || async {
        let page = support::send(&support::client(), "GET", &metrics, "", &[]).await;
        String::from_utf8_lossy(&page.body).lines().any(|l| {
            l.starts_with("quantrouter_classifier_reloads_total{")
                && l.contains("source=\"redis\"")
                && l.contains("result=\"rejected\"")
        })
    })
    .await;
    assert!(rejected, "the model in Redis was rejected");
    let admin = format!("http://{}/admin/classifier", router.admin);
    let active = support::send(&support::client(), "GET", &admin, "", &[]).await;
    let active: serde_json::Value = serde_json::from_slice(&active.body).unwrap();
    assert_ne!(active["sha256"], doc.sha256.as_str(), "{active}");

    // A file: a router does not start on a profile file over the limit.
    let profiles = dir.path().join("profiles.json");
    std::fs::write(&profiles, quantrouter_policy::DEFAULT_PROFILE_SET).unwrap();
    let (code, stderr) = serve_refused(&[
        "--profiles",
        profiles.to_str().unwrap(),
        "--max-document-bytes",
        "1024",
    ])
    .await;
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("more than the document limit"), "{stderr}");
}

#[test]
fn the_cli_trains_and_evaluates_the_outcome_head() {
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    let data = path("data.jsonl");
    std::fs::write(
        &data,
        (0..12)
            .map(|i| {
                format!(
                    "{}\n",
                    serde_json::json!({"prompt": format!("Say hello number {i}."),
                        "label": if i % 2 == 0 { "light" } else { "heavy" },
                        "task_class": "general", "split": "train"})
                )
            })
            .collect::<String>(),
    )
    .unwrap();
    // Word problems the cheap model misses once they hold many quantities, in two
    // categories, so each is held out by a head that learned it from the other.
    let outcomes = path("outcomes.jsonl");
    std::fs::write(
        &outcomes,
        (0..80)
            .map(|i| {
                let n = 1 + i % 8;
                let prompt: String = (0..n)
                    .map(|k| format!("Ann has {} pens. ", k + i))
                    .collect();
                format!(
                    "{}\n",
                    serde_json::json!({"id": format!("p{i}"), "source": "sim",
                        "category": if i % 2 == 0 { "a" } else { "b" },
                        "prompt": prompt + "How many pens?", "cheap_ok": n <= 4,
                        "reference_ok": true})
                )
            })
            .collect::<String>(),
    )
    .unwrap();
    let out = path("model.json");
    let (code, stdout, stderr) = support::cli(&[
        "classifier",
        "train",
        "--data",
        &data,
        "--bits",
        "10",
        "--outcomes",
        &outcomes,
        "--cross-validate",
        "category",
        "--out",
        &out,
    ]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(stdout.contains("sim (held out by category)"), "{stdout}");
    let doc = ClassifierDocument::from_json(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert!(doc.weights.outcome.is_some());
    let cv = doc.metrics.outcomes.unwrap();
    assert!(cv.sources[0].pooled.apgr.unwrap() > 0.7, "{stdout}");

    let (code, stdout, stderr) = support::cli(&[
        "classifier",
        "eval",
        "--model",
        &out,
        "--outcomes",
        &outcomes,
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("ranked by: outcome head"), "{stdout}");
    for line in [
        "router ",
        "random ",
        "prompt length ",
        "reference share",
        "CPT(80%)",
    ] {
        assert!(stdout.contains(line), "{line}: {stdout}");
    }
    // Held out by folds of prompts (a single category), with the noise of the comparison.
    let folded = path("folded.jsonl");
    let text = std::fs::read_to_string(&outcomes).unwrap();
    std::fs::write(
        &folded,
        text.replace("\"category\":\"b\"", "\"category\":\"a\""),
    )
    .unwrap();
    let held_out = |extra: &[&str]| {
        let mut args = vec!["classifier", "eval", "--outcomes", &folded];
        args.extend_from_slice(extra);
        support::cli(&args)
    };
    let (code, stdout, stderr) = held_out(&[
        "--cross-validate",
        "category",
        "--bootstrap",
        "100",
        "--fold-seeds",
        "0,1",
    ]);
    assert_eq!(code, 0, "{stderr}");
    for line in [
        "sim (held out by 5 folds by prompt)",
        "100 resamples of the prompts",
        "less prompt length: ",
        "less complexity: ",
        "sim (pooled held-out APGR by fold seed):\n  0: 0.",
        ", 1: 0.",
    ] {
        assert!(stdout.contains(line), "{line}: {stdout}");
    }
    let (code, _, stderr) = held_out(&["--bootstrap", "100"]);
    assert_ne!(code, 0, "{stderr}");
    let (code, _, stderr) = support::cli(&["classifier", "eval"]);
    assert_eq!(code, 1, "{stderr}");
    let (code, _, stderr) = support::cli(&[
        "classifier",
        "train",
        "--data",
        &data,
        "--cross-validate",
        "category",
        "--out",
        &out,
    ]);
    assert_eq!(code, 1, "{stderr}");
}

/// Outcome lines of a traffic record each, `quantities` set to each value in turn, agreed or
/// not by `agreed(i)`.
fn traffic_lines(values: &[f64], agreed: impl Fn(usize) -> bool) -> String {
    values
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let line = serde_json::json!({"features": {"length": 0.5, "quantities": v},
                "inputs": quantrouter_policy::classifier::OUTCOME_INPUTS,
                "task_class": "math", "cheap_profile": "a", "reference_profile": "b",
                "agreed": agreed(i)});
            format!("{line}\n")
        })
        .collect()
}

/// Issue: a record with a finite but absurd feature value (3e38) trained an all-zero outcome
/// head, which `train` wrote and `push` published. Now the record is refused with its line,
/// a head that learned nothing is not written, and `push` refuses one.
#[test]
fn absurd_records_and_heads_that_learned_nothing_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    let train = |records: &str, out: &str| {
        support::cli(&[
            "classifier",
            "train",
            "--base",
            "builtin",
            "--outcomes",
            records,
            "--out",
            out,
        ])
    };
    let values: Vec<f64> = (0..40).map(|i| f64::from(i % 8) / 10.0).collect();
    let good = path("good.jsonl");
    std::fs::write(&good, traffic_lines(&values, |i| i % 8 < 4)).unwrap();
    let (code, stdout, stderr) = train(&good, &path("good.json"));
    assert_eq!(code, 0, "{stdout}{stderr}");

    let mut absurd = values.clone();
    absurd[2] = 3e38;
    let records = path("absurd.jsonl");
    std::fs::write(&records, traffic_lines(&absurd, |i| i % 8 < 4)).unwrap();
    let out = path("absurd.json");
    let (code, _, stderr) = train(&records, &out);
    assert_ne!(code, 0, "{stderr}");
    assert!(
        stderr.contains("line 3") && stderr.contains("`quantities`"),
        "{stderr}"
    );
    assert!(!std::path::Path::new(&out).exists());

    // Every answer agreed: nothing to rank by, so every prompt would get one risk.
    let records = path("agreed.jsonl");
    std::fs::write(&records, traffic_lines(&values, |_| true)).unwrap();
    let out = path("agreed.json");
    let (code, _, stderr) = train(&records, &out);
    assert_ne!(code, 0, "{stderr}");
    assert!(stderr.contains("same risk"), "{stderr}");
    assert!(!std::path::Path::new(&out).exists());

    // Such a head, made without the command's checks, is refused by `push` before Redis
    // holds it.
    let agreed =
        quantrouter_policy::classifier::parse_outcomes(&std::fs::read_to_string(&records).unwrap())
            .unwrap();
    let base = ClassifierDocument::from_json(quantrouter_policy::DEFAULT_CLASSIFIER).unwrap();
    let constant = quantrouter_policy::classifier::retrain_outcomes(&base, &agreed).unwrap();
    let constant_file = path("constant.json");
    std::fs::write(&constant_file, constant.to_json()).unwrap();
    // And one whose training figures say it ranks no better than random.
    let mut random: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path("good.json")).unwrap()).unwrap();
    random["metrics"]["outcome_training_apgr"] = serde_json::json!(0.42);
    let random_file = path("random.json");
    std::fs::write(&random_file, random.to_string()).unwrap();
    let redis = RedisServer::start(None);
    for (file, says) in [(&constant_file, "same risk"), (&random_file, "0.420")] {
        let (code, _, stderr) =
            support::cli(&["classifier", "push", file, "--redis-url", &redis.url()]);
        assert_ne!(code, 0, "{stderr}");
        assert!(
            stderr.contains("not pushing") && stderr.contains(says),
            "{stderr}"
        );
    }
    let (code, stdout, stderr) = support::cli(&["classifier", "get", "--redis-url", &redis.url()]);
    assert_ne!(code, 0, "nothing was pushed: {stdout}{stderr}");
    let (code, stdout, stderr) = support::cli(&[
        "classifier",
        "push",
        &path("good.json"),
        "--redis-url",
        &redis.url(),
    ]);
    assert_eq!((code, stdout.trim()), (0, "pushed version 1"), "{stderr}");
}
