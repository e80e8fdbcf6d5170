//! The OpenAI/vLLM wire contract: shapes, usage numbers, determinism, streaming and errors.

mod common;

use std::time::Duration;

use common::*;
use http::StatusCode;
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use vllm_sim::SimConfig;

#[tokio::test]
async fn chat_completion_has_vllm_shape_and_usage() {
    let sim = start_default().await;
    // 40 characters of content -> 10 prompt tokens.
    let reply = post(&sim, "/v1/chat/completions", &chat(&"abcd".repeat(10))).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.header("content-type"), Some("application/json"));
    let body = reply.json();
    let id = body["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-"), "{id}");
    assert!(id["chatcmpl-".len()..]
        .chars()
        .all(|c| c.is_ascii_hexdigit()));
    assert_eq!(body["object"], "chat.completion");
    assert!(body["created"].as_u64().unwrap() > 1_600_000_000);
    assert_eq!(body["model"], MODEL);
    let choice = &body["choices"][0];
    assert_eq!(body["choices"].as_array().unwrap().len(), 1);
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["logprobs"], Value::Null);
    assert_eq!(choice["finish_reason"], "stop");
    let words = chat_content(&reply).split(' ').count() as u64;
    assert!((8..=48).contains(&words), "{words}");
    assert_eq!(body["usage"]["prompt_tokens"], 10);
    assert_eq!(body["usage"]["completion_tokens"], words);
    assert_eq!(body["usage"]["total_tokens"], 10 + words);
}

#[tokio::test]
async fn chat_prompt_tokens_count_every_message_and_text_parts() {
    let sim = start_default().await;
    let body = json!({"model": MODEL, "messages": [
        {"role": "system", "content": "abcdefgh"},
        {"role": "user", "content": [{"type": "text", "text": "abcdefgh"}, {"type": "text", "text": "abcd"}]},
    ]});
    let reply = post(&sim, "/v1/chat/completions", &body).await;
    assert_eq!(reply.json()["usage"]["prompt_tokens"], 5);
}

#[tokio::test]
async fn text_completion_has_vllm_shape_and_usage() {
    let sim = start_default().await;
    let reply = post(
        &sim,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "abcdefghijkl"}),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    let body = reply.json();
    assert!(body["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["model"], MODEL);
    let choice = &body["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["logprobs"], Value::Null);
    assert_eq!(choice["finish_reason"], "stop");
    let words = choice["text"].as_str().unwrap().split(' ').count() as u64;
    assert_eq!(body["usage"]["prompt_tokens"], 3);
    assert_eq!(body["usage"]["completion_tokens"], words);
    assert_eq!(body["usage"]["total_tokens"], 3 + words);
}

#[tokio::test]
async fn same_prompt_and_seed_give_the_same_answer_and_others_differ() {
    let sim = start_default().await;
    let first = chat_content(&post(&sim, "/v1/chat/completions", &chat("what is 2+2?")).await);
    let again = chat_content(&post(&sim, "/v1/chat/completions", &chat("what is 2+2?")).await);
    let other = chat_content(&post(&sim, "/v1/chat/completions", &chat("write a poem")).await);
    assert_eq!(first, again);
    assert_ne!(first, other);

    let reseeded = start(SimConfig {
        seed: 42,
        ..SimConfig::default()
    })
    .await;
    let with_seed =
        chat_content(&post(&reseeded, "/v1/chat/completions", &chat("what is 2+2?")).await);
    assert_ne!(first, with_seed);
}

#[tokio::test]
async fn max_tokens_truncates_with_finish_reason_length() {
    let sim = start_default().await;
    let mut body = chat("tell me everything");
    body["max_tokens"] = json!(5);
    let reply = post(&sim, "/v1/chat/completions", &body).await.json();
    assert_eq!(reply["choices"][0]["finish_reason"], "length");
    assert_eq!(reply["usage"]["completion_tokens"], 5);
    let text = reply["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(text.split(' ').count(), 5);

    let mut body = chat("tell me everything");
    body["max_completion_tokens"] = json!(2);
    let reply = post(&sim, "/v1/chat/completions", &body).await.json();
    assert_eq!(reply["usage"]["completion_tokens"], 2);

    let body = json!({"model": MODEL, "prompt": "x", "max_tokens": 1});
    let reply = post(&sim, "/v1/completions", &body).await.json();
    assert_eq!(reply["choices"][0]["finish_reason"], "length");
    assert_eq!(reply["usage"]["completion_tokens"], 1);

    // A cap above the natural length changes nothing.
    let mut body = chat("tell me everything");
    body["max_tokens"] = json!(1000);
    let reply = post(&sim, "/v1/chat/completions", &body).await.json();
    assert_eq!(reply["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn chat_stream_sends_role_tokens_finish_usage_and_done_in_order() {
    let sim = start_default().await;
    let mut body = chat("stream this please");
    let whole = post(&sim, "/v1/chat/completions", &body).await.json();
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let reply = post(&sim, "/v1/chat/completions", &body).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.header("content-type"), Some("text/event-stream"));
    let events = sse_data(&reply.text());
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let id = chunks[0]["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-"));
    for chunk in &chunks {
        assert_eq!(chunk["object"], "chat.completion.chunk");
        assert_eq!(chunk["id"], id);
        assert_eq!(chunk["model"], MODEL);
    }
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    assert_eq!(chunks[0]["choices"][0]["finish_reason"], Value::Null);
    let tokens = whole["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    // role + tokens + finish + usage
    assert_eq!(chunks.len(), tokens + 3);
    let mut text = String::new();
    for chunk in &chunks[1..=tokens] {
        assert_eq!(chunk["choices"][0]["finish_reason"], Value::Null);
        text.push_str(chunk["choices"][0]["delta"]["content"].as_str().unwrap());
    }
    assert_eq!(
        text,
        whole["choices"][0]["message"]["content"].as_str().unwrap()
    );
    let finish = &chunks[tokens + 1];
    assert_eq!(finish["choices"][0]["delta"], json!({}));
    assert_eq!(finish["choices"][0]["finish_reason"], "stop");
    assert!(finish.get("usage").is_none());
    let usage = &chunks[tokens + 2];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"], whole["usage"]);
}

#[tokio::test]
async fn completion_stream_sends_text_chunks_without_usage_unless_asked() {
    let sim = start_default().await;
    let body =
        json!({"model": MODEL, "prompt": "once upon a time", "max_tokens": 4, "stream": true});
    let reply = post(&sim, "/v1/completions", &body).await;
    let events = sse_data(&reply.text());
    // 4 tokens + finish + [DONE]; no role event for completions, no usage without the option.
    assert_eq!(events.len(), 6, "{events:?}");
    assert_eq!(events[5], "[DONE]");
    let chunks: Vec<Value> = events[..5]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    for chunk in &chunks {
        assert_eq!(chunk["object"], "text_completion");
        assert!(chunk["id"].as_str().unwrap().starts_with("cmpl-"));
        assert!(chunk.get("usage").is_none());
        assert_eq!(chunk["choices"][0]["logprobs"], Value::Null);
    }
    assert_eq!(chunks[4]["choices"][0]["text"], "");
    assert_eq!(chunks[4]["choices"][0]["finish_reason"], "length");
    let text: String = chunks[..4]
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(text.split(' ').count(), 4);
}

#[tokio::test]
async fn stream_events_leave_one_frame_at_a_time() {
    let sim = start(SimConfig {
        itl: Duration::from_millis(100),
        ..SimConfig::default()
    })
    .await;
    let mut body = chat("slowly");
    body["stream"] = json!(true);
    body["max_tokens"] = json!(3);
    let client = Client::builder(TokioExecutor::new()).build_http();
    let request = http::Request::post(format!("{}/v1/chat/completions", sim.url()))
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_string(),
        )))
        .unwrap();
    let mut response = client.request(request).await.unwrap();
    let first = response
        .body_mut()
        .frame()
        .await
        .unwrap()
        .unwrap()
        .into_data()
        .unwrap();
    let first = String::from_utf8(first.to_vec()).unwrap();
    // The role event leaves alone, before the first token exists.
    assert_eq!(sse_data(&first).len(), 1, "{first:?}");
    assert!(first.contains(r#""role":"assistant""#));
    let mut frames = 1;
    while let Some(frame) = response.body_mut().frame().await {
        frame.unwrap();
        frames += 1;
    }
    // role, 3 tokens, finish, [DONE]
    assert!(frames >= 4, "{frames} frames");
}

#[tokio::test]
async fn unknown_model_is_404_with_openai_error() {
    let sim = start_default().await;
    let mut body = chat("hi");
    body["model"] = json!("gpt-9");
    let reply = post(&sim, "/v1/chat/completions", &body).await;
    assert_eq!(reply.status, StatusCode::NOT_FOUND);
    assert_eq!(
        reply.json(),
        json!({"error": {"message": "The model `gpt-9` does not exist.", "type": "NotFoundError", "param": null, "code": 404}})
    );
    let reply = post(
        &sim,
        "/v1/completions",
        &json!({"model": "x", "prompt": "hi"}),
    )
    .await;
    assert_eq!(reply.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn malformed_json_and_missing_prompt_are_400() {
    let sim = start_default().await;
    for (path, body) in [
        (
            "/v1/chat/completions",
            r#"{"model": "sim-model", "messages": ["#,
        ),
        ("/v1/chat/completions", r#"{"model": "sim-model"}"#),
        (
            "/v1/chat/completions",
            r#"{"model": "sim-model", "messages": []}"#,
        ),
        (
            "/v1/chat/completions",
            r#"{"model": "sim-model", "messages": 3}"#,
        ),
        ("/v1/completions", r#"{"model": "sim-model"}"#),
        ("/v1/completions", "not json"),
    ] {
        let reply = post_raw(&sim, path, body).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{body}");
        let error = reply.json();
        assert_eq!(error["error"]["type"], "BadRequestError", "{body}");
        assert_eq!(error["error"]["code"], 400);
        assert_eq!(error["error"]["param"], Value::Null);
        assert!(error["error"]["message"].as_str().unwrap().len() > 5);
    }
    // Every completion request counts, errors included.
    assert_eq!(sim.stats().requests, 6);
}

#[tokio::test]
async fn models_health_and_unknown_routes() {
    let sim = start_default().await;
    let models = get(&sim, "/v1/models").await;
    assert_eq!(models.status, StatusCode::OK);
    let models = models.json();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], MODEL);
    assert_eq!(models["data"][0]["object"], "model");

    let health = get(&sim, "/health").await;
    assert_eq!(health.status, StatusCode::OK);
    assert!(health.body.is_empty());

    let missing = get(&sim, "/v1/nothing").await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    assert_eq!(missing.json()["error"]["code"], 404);
    let wrong_method = get(&sim, "/v1/chat/completions").await;
    assert_eq!(wrong_method.status, StatusCode::METHOD_NOT_ALLOWED);
}

#[tokio::test]
async fn a_continued_assistant_message_gets_the_rest_of_the_uninterrupted_answer() {
    let sim = start_default().await;
    let mut whole = chat("tell me about quantized routers");
    whole["max_tokens"] = json!(40);
    whole["ignore_eos"] = json!(true);
    let uninterrupted = post(&sim, "/v1/chat/completions", &whole).await;
    let full = chat_content(&uninterrupted);
    let words: Vec<&str> = full.split(' ').collect();
    assert_eq!(words.len(), 40);

    // The first 15 words reached the client; the rest is asked for with 25 tokens left.
    let delivered = words[..15].join(" ");
    let mut rest = whole.clone();
    rest["messages"]
        .as_array_mut()
        .unwrap()
        .push(json!({"role": "assistant", "content": delivered}));
    rest["continue_final_message"] = json!(true);
    rest["add_generation_prompt"] = json!(false);
    rest["max_tokens"] = json!(25);
    let continued = post(&sim, "/v1/chat/completions", &rest).await;
    assert_eq!(continued.status, StatusCode::OK, "{}", continued.text());
    assert_eq!(
        format!("{delivered}{}", chat_content(&continued)),
        full,
        "the two parts are the uninterrupted answer"
    );
    let (a, b) = (
        uninterrupted.json()["usage"].clone(),
        continued.json()["usage"].clone(),
    );
    assert_eq!(b["completion_tokens"], 25);
    assert_eq!(
        b["prompt_tokens"].as_u64().unwrap(),
        a["prompt_tokens"].as_u64().unwrap() + 15,
        "the continued words are read as prompt"
    );
    assert_eq!(continued.json()["choices"][0]["finish_reason"], "length");
    assert_eq!(
        sim.last_request().unwrap(),
        serde_json::to_vec(&rest).unwrap()
    );

    // vLLM's rules: not with a generation prompt (on by default), and only an assistant's.
    rest.as_object_mut()
        .unwrap()
        .remove("add_generation_prompt");
    let refused = post(&sim, "/v1/chat/completions", &rest).await;
    assert_eq!(
        refused.status,
        StatusCode::BAD_REQUEST,
        "{}",
        refused.text()
    );
    let mut user_last = chat("hi");
    user_last["continue_final_message"] = json!(true);
    user_last["add_generation_prompt"] = json!(false);
    let refused = post(&sim, "/v1/chat/completions", &user_last).await;
    assert_eq!(
        refused.status,
        StatusCode::BAD_REQUEST,
        "{}",
        refused.text()
    );
}
