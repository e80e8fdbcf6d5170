//! A second opinion (`policy.second_opinion`, docs/routing.md "A second opinion"): a prompt
//! whose outcome-head risk falls inside the band is rated by the cheap tier with one digit
//! before routing, and the rating replaces the risk; outside the band, for streams, on a
//! timeout and for a prompt already rated, the tier is not asked (again).
//!
//! The cheap sim answers word problems with more than four numbers wrongly and rates them
//! 7 to 9 (`wrong_when`); the problems here have six.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use quantrouter::server::Server;
use std::time::Duration;

use quantrouter_policy::SecondOpinion;
use support::{send, start_router, Reply};
use vllm_sim::{Faults, SimServer, WrongWhen};

/// Six numbers: the cheap sim gets it wrong and rates it 8.
const HARD: &str = "Ana brings 12 shells. Bo brings 7 shells. Chen brings 30 shells. Dara \
    brings 4 shells. Eli brings 9 shells. Farah brings 15 shells. How many shells are there \
    altogether?";

const CHEAP: &str = "llama8b-fp8";

fn faults(delay_ms: u64, quantities_over: Option<u32>) -> Faults {
    Faults {
        delay_ms,
        wrong_when: Some(WrongWhen {
            quantities_over,
            ..WrongWhen::default()
        }),
        ..Faults::default()
    }
}

/// The reference (fp16) and the cheap tier (fp8, rating with the rule) behind a router whose
/// set has `second_opinion`.
async fn router(
    second_opinion: Option<SecondOpinion>,
    rating_delay_ms: u64,
) -> (Server, Vec<SimServer>) {
    let (mut set, sims) = support::sim_tiers(Duration::ZERO).await;
    for (profile, sim) in set.profiles.iter().zip(&sims) {
        sim.set_faults(match profile.id == CHEAP {
            true => faults(rating_delay_ms, Some(4)),
            false => faults(0, None),
        });
    }
    set.profiles.retain(|p| p.tier != "int4");
    assert_eq!(set.profiles[1].id, CHEAP);
    set.policy.second_opinion = second_opinion;
    set.validate().unwrap();
    (start_router(set, |_| {}).await, sims)
}

fn opinion(band: [f64; 2], timeout_ms: u64) -> Option<SecondOpinion> {
    Some(SecondOpinion {
        band,
        profile: CHEAP.into(),
        timeout_ms,
        streams: false,
    })
}

fn body(stream: bool) -> String {
    serde_json::json!({"model": "auto", "stream": stream,
        "messages": [{"role": "user", "content": HARD}]})
    .to_string()
}

async fn post(router: &Server, path: &str, body: &str, tolerance: f64) -> Reply {
    let url = format!("http://{}{path}", router.public_addr());
    let tolerance = tolerance.to_string();
    send(
        &support::client(),
        "POST",
        &url,
        body,
        &[
            ("content-type", "application/json"),
            ("x-quantrouter-risk-tolerance", &tolerance),
        ],
    )
    .await
}

/// The model's risk for [`HARD`], and a tolerance just above it: the model alone sends the
/// problem to the cheap tier, a rating of 8 (risk 0.89) does not.
async fn model_risk() -> (f64, f64) {
    let (plain, _sims) = router(None, 0).await;
    let answer = post(&plain, "/v1/route", &body(false), 1.0).await.json();
    let risk = answer["risk"].as_f64().unwrap();
    assert!(risk < 0.8, "{answer}");
    let tolerance = risk + 0.05;
    let answer = post(&plain, "/v1/route", &body(false), tolerance)
        .await
        .json();
    assert_eq!(answer["profile"], CHEAP, "{answer}");
    assert!(answer.get("second_opinion").is_none());
    (risk, tolerance)
}

/// `quantrouter_second_opinions_total{result}` as exported now.
fn opinions(result: &str) -> u64 {
    let label = format!("{{result=\"{result}\"}} ");
    quantrouter::telemetry::metrics_handle()
        .render()
        .lines()
        .find_map(|l| {
            l.strip_prefix("quantrouter_second_opinions_total")?
                .strip_prefix(&label)
        })
        .map_or(0, |n| n.parse().unwrap())
}

/// Requests the cheap sim has had.
fn asked(sims: &[SimServer]) -> u64 {
    sims[1].stats().requests
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_the_band_the_rating_is_asked_once_and_changes_the_route() {
    let (risk, tolerance) = model_risk().await;
    let (router, sims) = router(opinion([0.0, 1.0], 2000), 0).await;
    let answer = post(&router, "/v1/route", &body(false), tolerance)
        .await
        .json();
    assert_eq!(asked(&sims), 1, "one rating call");
    assert_eq!(answer["profile"], "llama8b-fp16", "{answer}");
    assert_eq!(answer["second_opinion"]["rating"], 8, "{answer}");
    assert_eq!(answer["second_opinion"]["changed"], true, "{answer}");
    assert!((answer["second_opinion"]["model_risk"].as_f64().unwrap() - risk).abs() < 1e-9);
    assert!((answer["risk"].as_f64().unwrap() - 8.0 / 9.0).abs() < 1e-9);

    // The same prompt again, now served: the cached rating decides, nothing is asked.
    let reply = post(&router, "/v1/chat/completions", &body(false), tolerance).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("x-quantrouter-tier"), "fp16");
    assert_eq!(
        reply.header("x-quantrouter-second-opinion"),
        format!("rating=8; model_risk={risk:.3}; changed=true")
    );
    assert_eq!(asked(&sims), 1, "cached");

    // A stream waits for no rating: the model's risk routes it.
    let reply = post(&router, "/v1/route", &body(true), tolerance).await;
    assert_eq!(reply.json()["profile"], CHEAP, "{}", reply.json());
    assert!(reply.json().get("second_opinion").is_none());
    assert_eq!(asked(&sims), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outside_the_band_nothing_is_asked() {
    let (risk, tolerance) = model_risk().await;
    let band = match risk < 0.5 {
        true => [risk + 0.01, 1.0],
        false => [0.0, risk - 0.01],
    };
    let (router, sims) = router(opinion(band, 2000), 0).await;
    let answer = post(&router, "/v1/route", &body(false), tolerance)
        .await
        .json();
    assert_eq!(asked(&sims), 0);
    assert_eq!(answer["profile"], CHEAP, "{answer}");
    assert!(answer.get("second_opinion").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_timeout_the_models_risk_stands() {
    let (risk, tolerance) = model_risk().await;
    // The rating would take a second; the router waits 50 ms.
    let (router, sims) = router(opinion([0.0, 1.0], 50), 1000).await;
    let before = [opinions("timeout"), opinions("error")];
    let answer = post(&router, "/v1/route", &body(false), tolerance)
        .await
        .json();
    assert_eq!(asked(&sims), 1, "asked");
    // Counted as late, not as failed (no other test here times out or fails a rating).
    assert_eq!(
        [opinions("timeout"), opinions("error")],
        [before[0] + 1, before[1]]
    );
    assert_eq!(answer["profile"], CHEAP, "{answer}");
    assert!(answer.get("second_opinion").is_none(), "{answer}");
    assert!((answer["risk"].as_f64().unwrap() - risk).abs() < 1e-9);
}

#[test]
fn the_instruction_is_the_one_the_sim_rates() {
    assert_eq!(
        quantrouter::second_opinion::INSTRUCTION,
        vllm_sim::RATING_INSTRUCTION
    );
}
