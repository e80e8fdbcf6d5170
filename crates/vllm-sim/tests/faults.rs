//! Run-time fault injection through `/sim/faults` and the library API.

mod common;

use std::time::Duration;

use common::*;
use http::{Method, StatusCode};
use serde_json::{json, Value};
use tokio::io::AsyncReadExt;
use tokio::time::Instant;
use vllm_sim::tier_eval::{self, EvalItem, TaskClass};
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
        r#"{"wrong_rate": {"math": 1.5}}"#,
        r#"{"wrong_rate": {"maths": 0.5}}"#,
        r#"{"wrong_rate": {"math": "high"}}"#,
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

/// The shipped eval items of one class.
fn eval_items(class: TaskClass) -> Vec<EvalItem> {
    tier_eval::items()
        .into_iter()
        .filter(|item| item.task_class == class)
        .collect()
}

async fn answer(sim: &vllm_sim::SimServer, prompt: &str) -> String {
    let reply = post(sim, "/v1/chat/completions", &chat(prompt)).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    chat_content(&reply)
}

/// The number a simulated math answer ends with.
fn number_in(answer: &str) -> Option<i64> {
    answer
        .trim_start_matches("The answer is ")
        .trim_end_matches('.')
        .parse()
        .ok()
}

#[tokio::test]
async fn eval_prompts_get_their_right_answer_whole_and_streamed() {
    let sim = start_default().await;
    let math = &eval_items(TaskClass::Math)[0];
    let whole = answer(&sim, &math.prompt).await;
    assert_eq!(number_in(&whole), math.expected.as_i64());
    let streamed = post(&sim, "/v1/chat/completions", &stream_body(&math.prompt)).await;
    let text: String = sse_data(&streamed.text())
        .iter()
        .filter(|data| *data != "[DONE]")
        .filter_map(|data| {
            let event: Value = serde_json::from_str(data).unwrap();
            event["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(text, whole);
    let json_item = &eval_items(TaskClass::Structured)[0];
    let reply = answer(&sim, &json_item.prompt).await;
    let body = reply
        .trim_start_matches("```json\n")
        .trim_end_matches("\n```");
    assert_eq!(
        serde_json::from_str::<Value>(body).unwrap(),
        json_item.expected
    );
    assert_eq!(sim.stats().faults_injected, 0);
}

#[tokio::test]
async fn wrong_rate_one_answers_only_its_class_wrongly() {
    let sim = start_default().await;
    set_faults(&sim, json!({"wrong_rate": {"math": 1.0}})).await;
    for item in eval_items(TaskClass::Math).iter().take(5) {
        let reply = answer(&sim, &item.prompt).await;
        assert!(number_in(&reply).is_some(), "{reply}");
        assert_ne!(number_in(&reply), item.expected.as_i64(), "{reply}");
    }
    let general = &eval_items(TaskClass::General)[0];
    let reply = answer(&sim, &general.prompt).await;
    assert!(
        reply.contains(general.expected.as_str().unwrap()),
        "{reply}"
    );
    assert_eq!(sim.stats().faults_injected, 5);
}

#[tokio::test]
async fn wrong_answers_are_fixed_per_seed_and_prompt_and_follow_the_rate() {
    let seeded = |seed| SimConfig {
        seed,
        ..SimConfig::default()
    };
    let (a, b) = (start(seeded(1)).await, start(seeded(2)).await);
    for sim in [&a, &b] {
        set_faults(sim, json!({"wrong_rate": {"math": 0.5}})).await;
    }
    let math = eval_items(TaskClass::Math);
    let mut picks = Vec::new();
    for sim in [&a, &a, &b] {
        let mut wrong = Vec::new();
        for item in &math {
            let reply = answer(sim, &item.prompt).await;
            wrong.push(number_in(&reply) != item.expected.as_i64());
        }
        picks.push(wrong);
    }
    assert_eq!(
        picks[0], picks[1],
        "asking again must give the same answers"
    );
    assert_ne!(picks[0], picks[2], "another seed picks other prompts");
    let share = picks[0].iter().filter(|&&w| w).count() as f64 / math.len() as f64;
    assert!((0.35..=0.65).contains(&share), "{share}");
}

#[tokio::test]
async fn other_prompts_keep_their_answer_unless_general_is_wrong() {
    let (clean, faulty) = (start_default().await, start_default().await);
    let before = answer(&clean, "hello there").await;
    set_faults(&faulty, json!({"wrong_rate": {"math": 1.0}})).await;
    assert_eq!(answer(&faulty, "hello there").await, before);
    set_faults(&faulty, json!({"wrong_rate": {"general": 1.0}})).await;
    let wrong = answer(&faulty, "hello there").await;
    assert_ne!(wrong, before);
    assert_eq!(answer(&faulty, "hello there").await, wrong);
    assert_eq!(
        get(&faulty, "/sim/faults").await.json()["wrong_rate"],
        json!({"general": 1.0})
    );
}

#[tokio::test]
async fn streams_break_by_ending_stalling_or_sending_an_error_event() {
    let sim = start_default().await;
    set_faults(
        &sim,
        json!({"reset_after_chunks": 3, "stream_break": "end"}),
    )
    .await;
    // A well-framed end: the last chunk, and the connection kept for the next request.
    let mut stream = raw_post(sim.local_addr(), "/v1/chat/completions", &stream_body("hi")).await;
    let raw = read_until_contains(&mut stream, "\r\n0\r\n\r\n").await;
    assert_eq!(raw.matches("data: ").count(), 3, "{raw}");
    assert!(
        !raw.contains("finish_reason\":\"") && !raw.contains("[DONE]"),
        "{raw}"
    );

    set_faults(
        &sim,
        json!({"reset_after_chunks": 2, "stream_break": "error_event"}),
    )
    .await;
    let mut stream = raw_post(sim.local_addr(), "/v1/chat/completions", &stream_body("hi")).await;
    let raw = read_until_contains(&mut stream, "\r\n0\r\n\r\n").await;
    assert_eq!(raw.matches("data: ").count(), 4, "{raw}");
    assert!(
        raw.contains("data: {\"error\": {\"object\": \"error\""),
        "{raw}"
    );
    assert!(raw.contains("data: [DONE]"), "{raw}");

    set_faults(
        &sim,
        json!({"reset_after_chunks": 2, "stream_break": "stall"}),
    )
    .await;
    let mut stream = raw_post(sim.local_addr(), "/v1/chat/completions", &stream_body("hi")).await;
    let raw = read_until_contains(&mut stream, "content").await;
    let mut more = [0u8; 1024];
    let silent = tokio::time::timeout(Duration::from_millis(300), stream.read(&mut more)).await;
    assert!(silent.is_err(), "nothing more after two events: {raw}");
    drop(stream);
    eventually("the stalled stream's client to count as gone", || async {
        sim.stats().cancelled == 1
    })
    .await;
}
