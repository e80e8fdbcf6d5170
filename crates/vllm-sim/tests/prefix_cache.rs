//! The prefix cache: a conversation's next turn reuses the blocks of the turns before it,
//! only uncached tokens cost prefill time, and vLLM's counters say so.

mod common;

use std::time::Duration;

use common::*;
use http::StatusCode;
use serde_json::{json, Value};
use tokio::time::Instant;
use vllm_sim::SimConfig;

fn cached(prefill_us: u64) -> SimConfig {
    SimConfig {
        prefix_cache_blocks: 1024,
        prefill_per_token: Duration::from_micros(prefill_us),
        ..SimConfig::default()
    }
}

fn turn(system: &str, history: &[(&str, &str)], user: &str) -> Value {
    let mut messages = vec![json!({"role": "system", "content": system})];
    for (asked, answered) in history {
        messages.push(json!({"role": "user", "content": asked}));
        messages.push(json!({"role": "assistant", "content": answered}));
    }
    messages.push(json!({"role": "user", "content": user}));
    json!({"model": MODEL, "messages": messages, "max_tokens": 4})
}

/// The hit and query counters; a page without them counts as -1 so the test fails.
async fn counters(sim: &vllm_sim::SimServer) -> (f64, f64) {
    let text = scrape(sim).await;
    let read = |name| metric(&text, name).unwrap_or(-1.0);
    (
        read("vllm:prefix_cache_hits_total"),
        read("vllm:prefix_cache_queries_total"),
    )
}

#[tokio::test]
async fn a_follow_up_turn_hits_the_blocks_of_the_turn_before() {
    let sim = start(cached(0)).await;
    let system = "You are a careful assistant. ".repeat(40);
    let first = post(&sim, "/v1/chat/completions", &turn(&system, &[], "Hello?")).await;
    assert_eq!(first.status, StatusCode::OK);
    let first_tokens = first.json()["usage"]["prompt_tokens"].as_f64().unwrap();
    assert_eq!(counters(&sim).await, (0.0, first_tokens), "a cold cache");

    let answer = chat_content(&first);
    let body = turn(&system, &[("Hello?", &answer)], "And then?");
    let second = post(&sim, "/v1/chat/completions", &body).await;
    let second_tokens = second.json()["usage"]["prompt_tokens"].as_f64().unwrap();
    let (hits, queries) = counters(&sim).await;
    assert_eq!(queries, first_tokens + second_tokens);
    // Every full block of the system prompt is shared; the new turn's tail is not.
    let system_blocks = (system.len() / 64) as f64 * 16.0;
    assert!(
        hits >= system_blocks && hits < second_tokens,
        "hits {hits}, system blocks {system_blocks}, prompt {second_tokens}"
    );

    // Another system prompt shares no block, even with the same user text.
    let other = "You answer in verse only. ".repeat(40);
    post(&sim, "/v1/chat/completions", &turn(&other, &[], "Hello?")).await;
    assert_eq!(counters(&sim).await.0, hits);
}

#[tokio::test]
async fn uncached_prompt_tokens_delay_the_first_token() {
    // 500 tokens at 400 us each: at least 200 ms before the answer.
    let sim = start(cached(400)).await;
    let body = chat(&"wxyz".repeat(500));
    let started = Instant::now();
    let reply = post(&sim, "/v1/chat/completions", &body).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert!(
        started.elapsed() >= Duration::from_millis(200),
        "{:?}",
        started.elapsed()
    );
    let (hits, queries) = counters(&sim).await;
    assert_eq!((hits, queries), (0.0, 500.0));
    // The same prompt again is served from the cache: the full blocks it fills (the role
    // marker makes 2006 bytes, 31 blocks of 16 four-byte tokens); the partial one is not kept.
    post(&sim, "/v1/chat/completions", &body).await;
    assert_eq!(counters(&sim).await, (496.0, 1000.0));
}

#[tokio::test]
async fn without_a_cache_nothing_is_counted_and_usage_is_the_slot_share() {
    let sim = start_default().await;
    post(&sim, "/v1/chat/completions", &chat(&"wxyz".repeat(100))).await;
    post(&sim, "/v1/chat/completions", &chat(&"wxyz".repeat(100))).await;
    assert_eq!(counters(&sim).await, (0.0, 0.0));
    let text = scrape(&sim).await;
    assert_eq!(metric(&text, "vllm:kv_cache_usage_perc"), Some(0.0));
}

#[tokio::test]
async fn prompts_with_different_cache_salts_share_no_block() {
    let sim = start(cached(0)).await;
    let system = "You are a careful assistant. ".repeat(40);
    let salted = |salt: Option<&str>| {
        let mut body = turn(&system, &[], "Hello?");
        if let Some(salt) = salt {
            body["cache_salt"] = salt.into();
        }
        body
    };
    let send = |body: Value| {
        let sim = &sim;
        async move {
            let reply = post(sim, "/v1/chat/completions", &body).await;
            assert_eq!(reply.status, StatusCode::OK);
        }
    };
    send(salted(Some("tenant-a"))).await;
    // The same prompt without a salt, or with another, is computed again.
    send(salted(None)).await;
    send(salted(Some("tenant-b"))).await;
    assert_eq!(counters(&sim).await.0, 0.0, "no block was shared");
    // With the first salt again, it hits.
    send(salted(Some("tenant-a"))).await;
    assert!(counters(&sim).await.0 > 0.0);

    for bad in [json!(""), json!(7)] {
        let mut body = salted(None);
        body["cache_salt"] = bad;
        let reply = post(&sim, "/v1/chat/completions", &body).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    }
}
