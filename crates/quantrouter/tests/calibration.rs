//! Live agreement sampling (`policy.calibration`): sampled answers of a lower tier are asked
//! of the reference tier after the client has them, compared, and counted; the extra cost
//! stays within the hour's budget; `profiles suggest --from` reads the counts.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use quantrouter::calibration::CalibrationReport;
use quantrouter::resilience::BudgetConfig;
use quantrouter_policy::{Calibration, TaskClass};
use support::{cli, eventually, send, Tiers, SIMPLE};
use vllm_sim::{Faults, SimConfig};

const FP16: usize = 0;
const INT4: usize = 2;
/// The share of int4's answers the sim gets wrong, for every task class.
const WRONG: f64 = 0.25;

/// Tiers with calibration against fp16 at `sample_rate` 1.0 within `budget` per hour, and
/// no limit on the extra load but the budget (the default would let 1 in 20 through).
async fn calibrated(budget: f64) -> Tiers {
    Tiers::start(
        [1, 1, 1],
        |_| SimConfig::default(),
        move |set| {
            set.policy.calibration = Some(Calibration {
                sample_rate: 1.0,
                reference_profile: "llama8b-fp16".into(),
                max_extra_cost_per_hour: budget,
            })
        },
        |c| {
            c.resilience.calibration = BudgetConfig {
                ratio: 1.0,
                floor: 10_000,
                window: Duration::from_secs(60),
            }
        },
    )
    .await
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
    let url = format!("http://{}/admin/calibration", t.router.admin_addr());
    let r = send(&support::client(), "GET", &url, "", &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    serde_json::from_slice(&r.body).unwrap()
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
    // The budget is charged the most a reference answer can cost: max_tokens output tokens.
    let per_sample = (prompt_tokens as f64 * 0.2 + 64.0 * 0.6) / 1e6;
    let expected = (0.0005 / per_sample).floor() as u64;
    assert!(expected > 0 && expected < 40, "{expected}");
    let settled = eventually(Duration::from_secs(30), || async {
        let report = report(&t).await;
        let (agree, disagree) = agreement(&report, "llama8b-awq");
        agree + disagree + report.skipped == 40 && t.requests(FP16) == agree + disagree
    })
    .await;
    let report = report(&t).await;
    assert!(settled, "{report:?}");
    let (agree, disagree) = agreement(&report, "llama8b-awq");
    assert_eq!(agree + disagree, expected, "{report:?}");
    assert_eq!(
        t.requests(FP16),
        expected,
        "no reference request past the budget"
    );
    assert!(
        report.spent_last_hour <= report.limit_per_hour,
        "{report:?}"
    );
    assert!(
        report.limit_per_hour - report.spent_last_hour < per_sample,
        "sampling went on until the next one would not fit: {report:?}"
    );
}
