//! Live agreement sampling (`policy.calibration`): sampled answers of a lower tier are asked
//! of the reference tier after the client has them, compared, and counted; the extra cost
//! stays within the hour's budget; `profiles suggest --from` reads the counts.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use quantrouter::calibration::CalibrationReport;
use quantrouter::resilience::BudgetConfig;
use quantrouter::server::{Server, ServerConfig};
use quantrouter_policy::{
    Calibration, ProfileSet, StaticUpstream, TaskClass, Upstream, DEFAULT_PROFILE_SET,
};
use support::{cli, eventually, send, start_router, Tiers, SIMPLE};
use vllm_sim::{Faults, SimConfig};

const FP16: usize = 0;
const INT4: usize = 2;
/// The share of int4's answers the sim gets wrong, for every task class.
const WRONG: f64 = 0.25;

/// Tiers with calibration against fp16 at `sample_rate` 1.0 within `budget` per hour, and
/// no limit on the extra load but the budget (the default would let 1 in 20 through).
async fn calibrated(budget: f64) -> Tiers {
    calibrated_with(budget, 1.0, |_| {}).await
}

/// [`calibrated`] at `sample_rate`, with `edit` applied to the profile set.
async fn calibrated_with(
    budget: f64,
    sample_rate: f64,
    edit: impl FnOnce(&mut ProfileSet),
) -> Tiers {
    Tiers::start(
        [1, 1, 1],
        |_| SimConfig::default(),
        move |set| {
            set.policy.calibration = Some(calibration(sample_rate, budget));
            edit(set);
        },
        unlimited_load,
    )
    .await
}

fn calibration(sample_rate: f64, budget: f64) -> Calibration {
    Calibration {
        sample_rate,
        reference_profile: "llama8b-fp16".into(),
        max_extra_cost_per_hour: budget,
        outcomes: None,
    }
}

fn unlimited_load(c: &mut ServerConfig) {
    c.resilience.calibration = BudgetConfig {
        ratio: 1.0,
        floor: 10_000,
        window: Duration::from_secs(60),
    }
}

/// The shipped eval set's prompts.
fn eval_prompts() -> Vec<String> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../eval/tier-eval.jsonl");
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|line| {
            let item: serde_json::Value = serde_json::from_str(line).unwrap();
            item["prompt"].as_str().unwrap().to_owned()
        })
        .collect()
}

/// Sends every prompt, pinned to int4, eight at a time; every answer must be a 200.
async fn ask_int4(t: &Arc<Tiers>, prompts: Vec<String>) -> Vec<serde_json::Value> {
    let prompts = Arc::new(tokio::sync::Mutex::new(prompts.into_iter().enumerate()));
    let workers: Vec<_> = (0..8)
        .map(|_| {
            let (t, prompts) = (Arc::clone(t), Arc::clone(&prompts));
            tokio::spawn(async move {
                let mut answers = Vec::new();
                loop {
                    let Some((i, prompt)) = prompts.lock().await.next() else {
                        return answers;
                    };
                    let body = serde_json::json!({"model": "llama8b-awq", "max_tokens": 64,
                        "messages": [{"role": "user", "content": prompt}]})
                    .to_string();
                    let r = t.post(&body, &[]).await;
                    assert_eq!(
                        r.status,
                        StatusCode::OK,
                        "{}",
                        String::from_utf8_lossy(&r.body)
                    );
                    answers.push((i, r.json()));
                }
            })
        })
        .collect();
    let mut answers = Vec::new();
    for worker in workers {
        answers.extend(worker.await.unwrap());
    }
    answers.sort_by_key(|(i, _)| *i);
    answers.into_iter().map(|(_, a)| a).collect()
}

async fn report(t: &Tiers) -> CalibrationReport {
    serde_json::from_value(report_json(&t.router).await).unwrap()
}

/// `/admin/calibration` as JSON, so that a test can wait for a field an older router
/// lacks instead of failing to build against it.
async fn report_json(router: &Server) -> serde_json::Value {
    let url = format!("http://{}/admin/calibration", router.admin_addr());
    let r = send(&support::client(), "GET", &url, "", &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    serde_json::from_slice(&r.body).unwrap()
}

/// Agreements and disagreements counted, over every profile and task class.
fn compared(report: &serde_json::Value) -> u64 {
    report["tallies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| row["agree"].as_u64().unwrap() + row["disagree"].as_u64().unwrap())
        .sum()
}

/// Posts a chat request to `router`; it must be answered 200.
async fn ask(
    router: &Server,
    body: serde_json::Value,
    headers: &[(&str, &str)],
) -> serde_json::Value {
    let mut all = vec![("content-type", "application/json")];
    all.extend_from_slice(headers);
    let url = format!("http://{}/v1/chat/completions", router.public_addr());
    let r = send(&support::client(), "POST", &url, &body.to_string(), &all).await;
    assert_eq!(
        r.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    r.json()
}

/// Requests received per model by a [`scripted_tiers`] upstream.
type PerModel = Arc<Mutex<BTreeMap<String, u64>>>;

/// One upstream for every tier that answers like vLLM with `n`: `n` choices and usage for
/// all of them. The prompt is 20 tokens; each choice is `max_tokens` long, or without
/// one 30 tokens from fp16 and 10 from the others.
async fn scripted_tiers() -> (String, PerModel) {
    let listener = tokio::net::TcpListener::bind(support::loopback())
        .await
        .unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen = PerModel::default();
    let record = Arc::clone(&seen);
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let record = Arc::clone(&record);
            let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                let record = Arc::clone(&record);
                async move {
                    let post = req.method() == http::Method::POST;
                    let body = req.into_body().collect().await.unwrap().to_bytes();
                    if !post {
                        let mut missing = http::Response::new(Full::new(Bytes::new()));
                        *missing.status_mut() = StatusCode::NOT_FOUND;
                        return Ok::<_, std::convert::Infallible>(missing);
                    }
                    let request: serde_json::Value = serde_json::from_slice(&body).unwrap();
                    let model = request["model"].as_str().unwrap().to_owned();
                    let n = request["n"].as_u64().unwrap_or(1);
                    let each = request["max_tokens"].as_u64().unwrap_or(
                        if model == "meta-llama/Llama-3.1-8B-Instruct" {
                            30
                        } else {
                            10
                        },
                    );
                    *record.lock().unwrap().entry(model).or_default() += 1;
                    let choices: Vec<serde_json::Value> = (0..n)
                        .map(|i| {
                            serde_json::json!({"index": i, "finish_reason": "length",
                            "message": {"role": "assistant", "content": "Paris."}})
                        })
                        .collect();
                    let answer = serde_json::json!({"id": "x", "object": "chat.completion",
                        "choices": choices, "usage": {"prompt_tokens": 20,
                        "completion_tokens": n * each, "total_tokens": 20 + n * each}});
                    let mut response =
                        http::Response::new(Full::new(Bytes::from(answer.to_string())));
                    response.headers_mut().insert(
                        http::header::CONTENT_TYPE,
                        http::HeaderValue::from_static("application/json"),
                    );
                    Ok(response)
                }
            });
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (url, seen)
}

/// A router over [`scripted_tiers`] with calibration at rate 1.0 within `budget`.
async fn scripted_router(upstream: &str, budget: f64) -> Server {
    let mut set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
    for p in &mut set.profiles {
        p.upstream = Upstream::Static(StaticUpstream::new(vec![upstream.to_owned()]));
    }
    set.policy.calibration = Some(calibration(1.0, budget));
    start_router(set, unlimited_load).await
}

/// (agree, disagree) of `profile`, over every task class.
fn agreement(report: &CalibrationReport, profile: &str) -> (u64, u64) {
    report
        .tallies
        .iter()
        .filter(|row| row.profile == profile)
        .fold((0, 0), |(a, d), row| {
            (a + row.tally.agree, d + row.tally.disagree)
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampled_agreement_converges_to_the_tiers_real_error_rate() {
    let t = Arc::new(calibrated(1.0).await);
    let rates: BTreeMap<String, f64> = ["general", "code", "math", "structured", "reasoning"]
        .iter()
        .map(|class| ((*class).to_owned(), WRONG))
        .collect();
    t.sims[INT4][0].set_faults(Faults {
        wrong_rate: rates,
        ..Faults::default()
    });
    let prompts = eval_prompts();
    let n = prompts.len() as u64;
    assert!(n >= 300, "a few hundred samples");
    ask_int4(&t, prompts).await;
    let compared = eventually(Duration::from_secs(30), || async {
        let (agree, disagree) = agreement(&report(&t).await, "llama8b-awq");
        agree + disagree == n
    })
    .await;
    let report = report(&t).await;
    assert!(compared, "every answer was compared: {report:?}");
    let (agree, disagree) = agreement(&report, "llama8b-awq");
    // Every wrong answer the sim gave, and only those, disagreed with the reference.
    assert_eq!(disagree, t.sims[INT4][0].stats().faults_injected);
    let measured = agree as f64 / n as f64;
    assert!(
        (measured - (1.0 - WRONG)).abs() <= 0.05,
        "agreement {measured} against {}",
        1.0 - WRONG
    );
    assert_eq!(t.requests(FP16), n, "one reference request per sample");
    assert_eq!(report.skipped, 0);
    assert!(report.spent_last_hour > 0.0 && report.spent_last_hour <= 1.0);
    let math = report
        .tallies
        .iter()
        .find(|row| row.profile == "llama8b-awq" && row.task_class == TaskClass::Math)
        .expect("math prompts were classified as math");
    let page = send(
        &support::client(),
        "GET",
        &format!("http://{}/metrics", t.router.admin_addr()),
        "",
        &[],
    )
    .await;
    let page = String::from_utf8_lossy(&page.body);
    assert!(
        page.lines()
            .any(|l| l.starts_with("quantrouter_tier_agreement_total{")
                && l.contains("profile=\"llama8b-awq\"")
                && l.contains("task_class=\"math\"")
                && l.contains("result=\"disagree\"")),
        "{page}"
    );

    // `profiles suggest` proposes fp16's quality times the measured agreement.
    let admin = format!("http://{}", t.router.admin_addr());
    let (code, stdout, stderr) = tokio::task::spawn_blocking(move || {
        cli(&[
            "profiles",
            "suggest",
            "--from",
            &admin,
            "--min-samples",
            "20",
            "--json",
        ])
    })
    .await
    .unwrap();
    assert_eq!(code, 0, "{stderr}");
    let suggestions: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let suggestion = suggestions
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["profile"] == "llama8b-awq" && s["task_class"] == "math")
        .unwrap_or_else(|| panic!("{stdout}"));
    let rate = math.tally.agree as f64 / math.tally.samples() as f64;
    assert_eq!(suggestion["samples"], math.tally.samples());
    assert_eq!(suggestion["current"], 0.78);
    let estimate = suggestion["estimate"].as_f64().unwrap();
    assert!((estimate - 0.93 * rate).abs() < 1e-9, "{suggestion}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampling_stops_at_the_hours_budget() {
    // fp16's prices: $0.2 and $0.6 per million input and output tokens.
    let t = Arc::new(calibrated(0.0005).await);
    let answers = ask_int4(&t, vec![SIMPLE.to_owned(); 40]).await;
    let prompt_tokens = answers[0]["usage"]["prompt_tokens"].as_u64().unwrap();
    // A sample is charged the most a reference answer can cost (max_tokens output tokens)
    // until the answer's usage replaces that with what it cost, so at least this many fit.
    let per_sample = (prompt_tokens as f64 * 0.2 + 64.0 * 0.6) / 1e6;
    let at_least = (0.0005 / per_sample).floor() as u64;
    assert!(at_least > 0 && at_least < 40, "{at_least}");
    let settled = eventually(Duration::from_secs(30), || async {
        let report = report(&t).await;
        let (agree, disagree) = agreement(&report, "llama8b-awq");
        agree + disagree + report.skipped == 40 && t.requests(FP16) == agree + disagree
    })
    .await;
    let report = report(&t).await;
    assert!(settled, "{report:?}");
    let (agree, disagree) = agreement(&report, "llama8b-awq");
    assert!(agree + disagree >= at_least, "{report:?}");
    assert!(report.skipped > 0, "the budget ran out: {report:?}");
    assert!(
        report.spent_last_hour <= report.limit_per_hour,
        "{report:?}"
    );
}

/// fp16's prices, per token: $0.2 and $0.6 per million input and output tokens.
const FP16_IN: f64 = 0.2e-6;
const FP16_OUT: f64 = 0.6e-6;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_budget_is_charged_for_every_choice_and_settled_at_the_actual_cost() {
    let (upstream, per_model) = scripted_tiers().await;
    let fp16 = "meta-llama/Llama-3.1-8B-Instruct";
    let requests_to_fp16 = || per_model.lock().unwrap().get(fp16).copied().unwrap_or(0);
    // n = 4 with max_tokens 64: the reference may answer 4 × 64 tokens, and does here.
    let worst = 20.0 * FP16_IN + 4.0 * 64.0 * FP16_OUT;
    let router = scripted_router(&upstream, 3.5 * worst).await;
    let body = serde_json::json!({"model": "llama8b-awq", "n": 4, "max_tokens": 64,
        "messages": [{"role": "user", "content": SIMPLE}]});
    for _ in 0..10 {
        ask(&router, body.clone(), &[]).await;
    }
    let settled = eventually(Duration::from_secs(30), || async {
        let report = report_json(&router).await;
        compared(&report) + report["skipped"].as_u64().unwrap() == 10
    })
    .await;
    let report = report_json(&router).await;
    assert!(settled, "{report}");
    assert_eq!(
        requests_to_fp16(),
        3,
        "three answers of four choices fit: {report}"
    );
    let spent = report["spent_last_hour"].as_f64().unwrap();
    assert!((spent - 3.0 * worst).abs() < 1e-12, "{report}");

    // Without max_tokens the estimate is the served answer's length (2 × 10 tokens); the
    // reference's answer is longer (2 × 30), and that is what stays charged.
    let router = scripted_router(&upstream, 1.0).await;
    let before = requests_to_fp16();
    let body = serde_json::json!({"model": "llama8b-awq", "n": 2,
        "messages": [{"role": "user", "content": SIMPLE}]});
    ask(&router, body, &[]).await;
    let actual = 20.0 * FP16_IN + 60.0 * FP16_OUT;
    let settled = eventually(Duration::from_secs(30), || async {
        let spent = report_json(&router).await["spent_last_hour"]
            .as_f64()
            .unwrap();
        (spent - actual).abs() < 1e-12
    })
    .await;
    let report = report_json(&router).await;
    assert!(settled, "charged the reference's usage, {actual}: {report}");
    assert_eq!(requests_to_fp16(), before + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_the_reference_cannot_answer_alike_are_not_sent_to_it() {
    // fp16 holds 200 tokens; int4 the embedded 16,384.
    let t = calibrated_with(1.0, 1.0, |set| set.profiles[FP16].max_context_tokens = 200).await;
    let tools = serde_json::json!({"model": "llama8b-awq", "max_tokens": 16,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]});
    ask(&t.router, tools, &[]).await;
    let chosen = serde_json::json!({"model": "llama8b-awq", "max_tokens": 16,
        "tool_choice": "none", "messages": [{"role": "user", "content": SIMPLE}]});
    ask(&t.router, chosen, &[]).await;
    // 1,000 characters: 250 prompt tokens for the simulator.
    let long = serde_json::json!({"model": "llama8b-awq", "max_tokens": 16,
        "messages": [{"role": "user", "content": "word ".repeat(200)}]});
    ask(&t.router, long, &[]).await;
    // A request the reference can answer, so the comparisons are known to run.
    let plain = serde_json::json!({"model": "llama8b-awq", "max_tokens": 16,
        "messages": [{"role": "user", "content": SIMPLE}]});
    ask(&t.router, plain, &[]).await;
    let settled = eventually(Duration::from_secs(30), || async {
        let report = report_json(&t.router).await;
        compared(&report) == 1 && report["not_comparable"] == 3
    })
    .await;
    let report = report_json(&t.router).await;
    assert!(settled, "{report}");
    assert_eq!(t.requests(FP16), 1, "only the plain request: {report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sample_is_drawn_by_the_router_whatever_request_id_the_client_sends() {
    let t = calibrated_with(1.0, 0.5, |_| {}).await;
    let body = serde_json::json!({"model": "llama8b-awq", "max_tokens": 16,
        "messages": [{"role": "user", "content": SIMPLE}]});
    for _ in 0..60 {
        ask(&t.router, body.clone(), &[("x-request-id", "the-same-id")]).await;
    }
    let settled = eventually(Duration::from_secs(30), || async {
        let report = report_json(&t.router).await;
        report["eligible"] == 60 && report["sampled"].as_u64() == Some(compared(&report))
    })
    .await;
    let report = report_json(&t.router).await;
    assert!(settled, "{report}");
    // One id sampled all or nothing before; half of sixty is drawn, so neither here (the
    // chance of either is 2 in 2^60).
    let sampled = t.requests(FP16);
    assert!(sampled > 0 && sampled < 60, "{sampled} of 60: {report}");
    assert_eq!(report["sampled"], sampled);
}
