//! The latency model, the admission queue, vLLM's metric names and cancellation accounting.

mod common;

use std::time::Duration;

use common::*;
use http::StatusCode;
use serde_json::json;
use tokio::time::Instant;
use vllm_sim::SimConfig;

#[tokio::test]
async fn metrics_export_vllm_names_with_model_label() {
    let sim = start_default().await;
    let mut body = chat(&"abcd".repeat(5));
    body["max_tokens"] = json!(6);
    post(&sim, "/v1/chat/completions", &body).await;
    let reply = get(&sim, "/metrics").await;
    assert!(reply
        .header("content-type")
        .unwrap()
        .starts_with("text/plain"));
    let text = reply.text();
    for gauge in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    ] {
        assert!(text.contains(&format!("# TYPE {gauge} gauge")), "{gauge}");
        assert_eq!(metric(&text, gauge), Some(0.0), "{gauge}");
    }
    for histogram in [
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
    ] {
        assert!(text.contains(&format!("# TYPE {histogram} histogram")));
        assert_eq!(
            metric(&text, &format!("{histogram}_count")),
            Some(1.0),
            "{histogram}"
        );
        assert!(metric(&text, &format!("{histogram}_sum")).is_some());
        let inf = format!("{histogram}_bucket{{model_name=\"{MODEL}\",le=\"+Inf\"}} 1");
        assert!(text.contains(&inf), "{inf}");
    }
    assert_eq!(metric(&text, "vllm:prompt_tokens_total"), Some(5.0));
    assert_eq!(metric(&text, "vllm:generation_tokens_total"), Some(6.0));
    assert_eq!(
        metric(&text, "vllm_sim_requests_cancelled_total"),
        Some(0.0)
    );
}

#[tokio::test]
async fn latency_model_delays_answers_by_ttft_plus_itl_per_token() {
    let config = SimConfig {
        ttft: Duration::from_millis(100),
        itl: Duration::from_millis(20),
        ..SimConfig::default()
    };
    let sim = start(config).await;
    let mut body = chat("timed");
    body["max_tokens"] = json!(5);
    let started = Instant::now();
    let reply = post(&sim, "/v1/chat/completions", &body).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert!(
        started.elapsed() >= Duration::from_millis(200),
        "{:?}",
        started.elapsed()
    );
    let text = scrape(&sim).await;
    // The first token came no earlier than ttft + one itl.
    let ttft_fast =
        format!("vllm:time_to_first_token_seconds_bucket{{model_name=\"{MODEL}\",le=\"0.1\"}} 0");
    assert!(text.contains(&ttft_fast), "{text}");
}

#[tokio::test]
async fn requests_beyond_max_num_seqs_wait_in_the_queue() {
    let config = SimConfig {
        ttft: Duration::from_millis(500),
        max_num_seqs: 1,
        ..SimConfig::default()
    };
    let sim = std::sync::Arc::new(start(config).await);
    let mut requests = Vec::new();
    for prompt in ["first", "second"] {
        let sim = sim.clone();
        requests.push(tokio::spawn(async move {
            let mut body = chat(prompt);
            body["max_tokens"] = json!(1);
            post(&sim, "/v1/chat/completions", &body).await.status
        }));
    }
    eventually("one running and one waiting", || async {
        sim.running() == 1 && sim.waiting() == 1
    })
    .await;
    let text = scrape(&sim).await;
    assert_eq!(metric(&text, "vllm:num_requests_running"), Some(1.0));
    assert_eq!(metric(&text, "vllm:num_requests_waiting"), Some(1.0));
    assert_eq!(metric(&text, "vllm:kv_cache_usage_perc"), Some(1.0));
    for request in requests {
        assert_eq!(request.await.unwrap(), StatusCode::OK);
    }
    assert_eq!((sim.running(), sim.waiting()), (0, 0));
}

#[tokio::test]
async fn client_leaving_mid_stream_counts_as_cancelled() {
    let sim = start(SimConfig {
        itl: Duration::from_millis(50),
        ..SimConfig::default()
    })
    .await;
    let mut body = chat("a long story");
    body["stream"] = json!(true);
    let mut stream = raw_post(sim.local_addr(), "/v1/chat/completions", &body).await;
    read_until_contains(&mut stream, "data: ").await;
    assert_eq!(sim.stats().cancelled, 0);
    drop(stream);
    eventually("cancelled to reach 1", || async {
        sim.stats().cancelled == 1
    })
    .await;
    let text = scrape(&sim).await;
    assert_eq!(
        metric(&text, "vllm_sim_requests_cancelled_total"),
        Some(1.0)
    );
    eventually("the slot to be released", || async { sim.running() == 0 }).await;
}

#[tokio::test]
async fn client_leaving_a_queued_request_counts_as_cancelled() {
    let config = SimConfig {
        ttft: Duration::from_secs(30),
        max_num_seqs: 1,
        ..SimConfig::default()
    };
    let sim = start(config).await;
    let running = raw_post(sim.local_addr(), "/v1/completions", &json!({"prompt": "a"})).await;
    let queued = raw_post(sim.local_addr(), "/v1/completions", &json!({"prompt": "b"})).await;
    eventually("one waiting", || async { sim.waiting() == 1 }).await;
    drop(queued);
    eventually("the queued request to be cancelled", || async {
        sim.stats().cancelled == 1 && sim.waiting() == 0
    })
    .await;
    drop(running);
    eventually("both cancelled", || async {
        sim.stats().cancelled == 2 && sim.running() == 0
    })
    .await;
}

#[tokio::test]
async fn completed_requests_are_not_counted_as_cancelled() {
    let sim = start_default().await;
    let mut body = chat("fine");
    post(&sim, "/v1/chat/completions", &body).await;
    body["stream"] = json!(true);
    post(&sim, "/v1/chat/completions", &body).await;
    let stats = sim.stats();
    assert_eq!(
        (stats.requests, stats.cancelled, stats.faults_injected),
        (2, 0, 0)
    );
}
