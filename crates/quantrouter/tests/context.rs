//! Prompts that do not fit: an upstream's context overflow moves the request to a profile
//! with room (or becomes OpenAI's `context_length_exceeded`), and the context check learns
//! each profile's characters per token from the token counts its upstream reports.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::StatusCode;
use support::{Tiers, SIMPLE};
use vllm_sim::SimConfig;

const FP16: usize = 0;
const FP8: usize = 1;
const INT4: usize = 2;

/// An upstream that answers every completion with `answer(request body)` (JSON) and `GET`s
/// with 200; returns its URL and a count of completions.
async fn scripted<F>(answer: F) -> (String, Arc<AtomicU64>)
where
    F: Fn(&serde_json::Value) -> (StatusCode, String) + Send + Sync + 'static,
{
    support::scripted_upstream(move |body| {
        let (status, text) = answer(body);
        (status, "application/json", text)
    })
    .await
}

const VLLM_OVERFLOW: &str = r#"{"object":"error","message":"This model's maximum context length is 8192 tokens. However, you requested 9000 tokens (8992 in the messages, 8 in the completion). Please reduce the length of the messages or completion.","type":"BadRequestError","param":null,"code":400}"#;
const LLAMACPP_OVERFLOW: &str = r#"{"error":{"code":400,"message":"the request exceeds the available context size, try increasing it","type":"exceed_context_size_error","n_prompt_tokens":9000,"n_ctx":8192}}"#;

/// The three embedded tiers on sims, except int4 on `url` with a smaller context.
async fn tiers_with_int4_on(url: &str) -> Tiers {
    let url = url.to_owned();
    Tiers::start(
        [1, 1, 0],
        |_| SimConfig::default(),
        move |set| {
            set.profiles[INT4].upstream =
                serde_json::from_value(serde_json::json!({"urls": [url]})).unwrap();
            set.profiles[INT4].max_context_tokens = 8192;
        },
        |_| {},
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_context_overflow_moves_to_a_profile_with_room_before_any_byte_is_sent() {
    let (url, overflows) = scripted(|_| (StatusCode::BAD_REQUEST, VLLM_OVERFLOW.into())).await;
    let t = tiers_with_int4_on(&url).await;
    for stream in [false, true] {
        let body = serde_json::json!({"model": "auto", "stream": stream, "max_tokens": 8,
            "messages": [{"role": "user", "content": SIMPLE}]});
        let r = t.post(&body.to_string(), &[]).await;
        assert_eq!(
            r.status,
            StatusCode::OK,
            "{}",
            String::from_utf8_lossy(&r.body)
        );
        let fallback = r.header("x-quantrouter-fallback");
        assert!(
            fallback.starts_with("from=llama8b-awq; to=llama8b-fp")
                && fallback.ends_with("reason=context"),
            "{fallback}"
        );
        let text = String::from_utf8_lossy(&r.body);
        assert!(!text.contains("maximum context length"), "{text}");
        if stream {
            assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        }
    }
    assert_eq!(
        overflows.load(Ordering::Relaxed),
        2,
        "int4 was tried first, once per request"
    );
    assert_eq!(t.requests(FP16) + t.requests(FP8), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overflow_with_no_larger_profile_is_context_length_exceeded_and_other_400s_pass() {
    let (url, _) = scripted(|body| {
        let content = body["messages"][0]["content"].as_str().unwrap_or_default();
        if content.contains("not overflow") {
            (
                StatusCode::BAD_REQUEST,
                r#"{"error":{"message":"temperature must be <= 2","type":"BadRequestError"}}"#
                    .into(),
            )
        } else {
            (StatusCode::BAD_REQUEST, LLAMACPP_OVERFLOW.into())
        }
    })
    .await;
    let t = tiers_with_int4_on(&url).await;
    // Pinned: no other profile may serve it.
    let r = t.post(&support::chat("llama8b-awq", SIMPLE), &[]).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    let error = r.json();
    assert_eq!(error["error"]["type"], "invalid_request_error", "{error}");
    assert_eq!(error["error"]["code"], "context_length_exceeded", "{error}");
    assert_eq!(error["error"]["param"], "messages", "{error}");
    assert_eq!(
        error["error"]["message"],
        "the request exceeds the available context size, try increasing it"
    );
    // Any other 400 reaches the client as the upstream sent it.
    let r = t
        .post(&support::chat("llama8b-awq", "this is not overflow"), &[])
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        r.body,
        Bytes::from_static(
            br#"{"error":{"message":"temperature must be <= 2","type":"BadRequestError"}}"#
        )
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_context_check_learns_characters_per_token_from_reported_usage() {
    // An upstream whose tokenizer makes a token of every 2 bytes of text (plus 4 tokens of
    // framing per message), where the profile assumes 4.
    let (url, _) = scripted(|body| {
        let messages = body["messages"].as_array().unwrap();
        let bytes: usize = messages
            .iter()
            .map(|m| m["content"].as_str().unwrap_or_default().len())
            .sum();
        let prompt_tokens = bytes / 2 + 4 * messages.len();
        let answer = serde_json::json!({"id": "x", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop",
                "message": {"role": "assistant", "content": "Paris is the capital of France."}}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 7,
                "total_tokens": prompt_tokens + 7}});
        (StatusCode::OK, answer.to_string())
    })
    .await;
    let t = Tiers::start(
        [1, 1, 0],
        |_| SimConfig::default(),
        move |set| {
            set.profiles[INT4].upstream =
                serde_json::from_value(serde_json::json!({"urls": [url]})).unwrap();
            set.profiles[INT4].max_context_tokens = 1000;
        },
        |_| {},
    )
    .await;
    // 3000 bytes: 750 tokens at 4 per token, fits 1000; 1500 at the upstream's 2 does not.
    let prompt = "word ".repeat(600);
    let body = support::chat("auto", &prompt);
    let int4 = || async {
        let url = format!("http://{}/v1/route", t.router.public_addr());
        let r = support::send(
            &support::client(),
            "POST",
            &url,
            &body,
            &[("content-type", "application/json")],
        )
        .await;
        r.json()["candidates"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["profile"] == "llama8b-awq")
            .cloned()
            .unwrap()
    };
    let before = int4().await;
    assert_eq!(
        before["rejected_because"],
        serde_json::Value::Null,
        "{before}"
    );
    let pinned = support::chat("llama8b-awq", &prompt);
    for _ in 0..8 {
        let r = t.post(&pinned, &[]).await;
        assert_eq!(r.status, StatusCode::OK);
    }
    let after = int4().await;
    assert_eq!(after["rejected_because"], "context_too_small", "{after}");
    // The route answer shows the chosen profile's estimate; the tokens int4 would see are
    // what its context check compared.
    let r = support::send(
        &support::client(),
        "POST",
        &format!("http://{}/v1/route", t.router.public_addr()),
        &pinned,
        &[("content-type", "application/json")],
    )
    .await;
    let estimated = r.json()["estimated_input_tokens"].as_u64().unwrap();
    assert!(
        (1200..=1600).contains(&estimated),
        "learned about 2 bytes per token: {estimated} tokens for 3000 bytes"
    );
}
