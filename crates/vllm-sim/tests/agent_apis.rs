//! Anthropic's Messages and OpenAI's Responses, as vLLM serves them, and the chat-only mode
//! in which a router must translate.

#![allow(clippy::unwrap_used, clippy::panic)]

mod common;

use common::*;
use http::{Method, StatusCode};
use serde_json::{json, Value};
use vllm_sim::SimConfig;

fn messages(stream: bool) -> Value {
    json!({"model": MODEL, "max_tokens": 512, "stream": stream, "system": "be brief",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "abcd"}]}]})
}

/// The data of each named event, checked to carry its name as `type`.
fn events_of(reply: &Reply) -> Vec<Value> {
    let text = reply.text();
    assert!(text.ends_with("\n\n"), "{text}");
    text.trim_end()
        .split("\n\n")
        .map(|event| {
            let (name, data) = event
                .strip_prefix("event: ")
                .and_then(|e| e.split_once("\ndata: "))
                .unwrap_or_else(|| panic!("not a named event: {event:?}"));
            let data: Value = serde_json::from_str(data).unwrap();
            assert_eq!(data["type"], name);
            data
        })
        .collect()
}

fn types_of(events: &[Value]) -> Vec<&str> {
    events.iter().map(|e| e["type"].as_str().unwrap()).collect()
}

#[tokio::test]
async fn messages_answer_in_anthropic_shape_with_usage() {
    let sim = start_default().await;
    let reply = post(&sim, "/v1/messages", &messages(false)).await;
    assert_eq!(reply.status, StatusCode::OK);
    let body = reply.json();
    assert_eq!(body["type"], "message");
    assert_eq!(body["role"], "assistant");
    assert_eq!(body["content"][0]["type"], "text");
    assert!(!body["content"][0]["text"].as_str().unwrap().is_empty());
    assert_eq!(body["stop_reason"], "end_turn");
    // "be brief" and "abcd": 12 characters, 3 tokens.
    assert_eq!(body["usage"]["input_tokens"], 3);
    assert!(body["usage"]["output_tokens"].as_u64().unwrap() > 0);
}

#[tokio::test]
async fn a_messages_stream_follows_anthropics_event_order() {
    let sim = start_default().await;
    let reply = post(&sim, "/v1/messages", &messages(true)).await;
    assert_eq!(reply.header("content-type"), Some("text/event-stream"));
    assert!(reply.text().starts_with("event: message_start\n"));
    let events = events_of(&reply);
    let types = types_of(&events);
    assert_eq!(
        &types[..3],
        ["message_start", "content_block_start", "ping"]
    );
    assert_eq!(
        &types[types.len() - 3..],
        ["content_block_stop", "message_delta", "message_stop"]
    );
    assert!(types[3..types.len() - 3]
        .iter()
        .all(|t| *t == "content_block_delta"));
    let delta = &events[events.len() - 2];
    assert_eq!(delta["delta"]["stop_reason"], "end_turn");
    assert_eq!(delta["usage"]["output_tokens"], types.len() as u64 - 6);
}

#[tokio::test]
async fn messages_with_tools_call_the_first_tool_until_a_result_comes() {
    let sim = start_default().await;
    let tools =
        json!([{"name": "get_time", "description": "now", "input_schema": {"type": "object"}}]);
    let mut body = messages(false);
    body["tools"] = tools.clone();
    let reply = post(&sim, "/v1/messages", &body).await.json();
    assert_eq!(reply["stop_reason"], "tool_use");
    let call = &reply["content"][0];
    assert_eq!(
        (&call["type"], &call["name"]),
        (&json!("tool_use"), &json!("get_time"))
    );
    body["messages"] = json!([
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": "noon"}]},
    ]);
    let reply = post(&sim, "/v1/messages", &body).await.json();
    assert_eq!(reply["stop_reason"], "end_turn");
    assert_eq!(reply["content"][0]["type"], "text");

    let mut stream = messages(true);
    stream["tools"] = tools;
    let events = events_of(&post(&sim, "/v1/messages", &stream).await);
    assert_eq!(events[1]["content_block"]["type"], "tool_use");
    assert_eq!(events[3]["delta"]["type"], "input_json_delta");
}

#[tokio::test]
async fn responses_are_stored_and_continued_by_id() {
    let sim = start_default().await;
    let body = json!({"model": MODEL, "instructions": "be brief", "input": "abcd"});
    let first = post(&sim, "/v1/responses", &body).await.json();
    assert_eq!(first["object"], "response");
    assert_eq!(first["status"], "completed");
    assert_eq!(first["output"][0]["content"][0]["type"], "output_text");
    assert_eq!(first["usage"]["input_tokens"], 3);
    let id = first["id"].as_str().unwrap();
    assert!(id.starts_with("resp-"), "{id}");

    let stored = get(&sim, &format!("/v1/responses/{id}")).await.json();
    assert_eq!(stored, first);
    let follow = json!({"model": MODEL, "input": "more", "previous_response_id": id});
    let second = post(&sim, "/v1/responses", &follow).await.json();
    assert_eq!(second["previous_response_id"], id);
    let unknown = json!({"model": MODEL, "input": "more", "previous_response_id": "resp-none"});
    let reply = post(&sim, "/v1/responses", &unknown).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);

    let deleted = request(&sim, Method::DELETE, &format!("/v1/responses/{id}"), None).await;
    assert_eq!(deleted.json()["deleted"], true);
    assert_eq!(
        get(&sim, &format!("/v1/responses/{id}")).await.status,
        StatusCode::NOT_FOUND
    );
}

#[tokio::test]
async fn a_responses_stream_numbers_its_events_and_completes() {
    let sim = start_default().await;
    let body = json!({"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_text", "text": "abcd"}]}],
        "stream": true});
    let reply = post(&sim, "/v1/responses", &body).await;
    let events = events_of(&reply);
    let types = types_of(&events);
    assert_eq!(
        &types[..4],
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added"
        ]
    );
    assert_eq!(types.last(), Some(&"response.completed"));
    for (i, event) in events.iter().enumerate() {
        assert_eq!(event["sequence_number"], i as u64);
    }
    let text: String = events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    let done = &events.last().unwrap()["response"];
    assert_eq!(done["output"][0]["content"][0]["text"], text);
    assert!(done["usage"]["output_tokens"].as_u64().unwrap() > 0);

    let tools = json!({"model": MODEL, "input": "time?", "stream": true,
        "tools": [{"type": "function", "name": "get_time", "parameters": {}}]});
    let events = events_of(&post(&sim, "/v1/responses", &tools).await);
    assert_eq!(events[2]["item"]["type"], "function_call");
    assert!(types_of(&events).contains(&"response.function_call_arguments.delta"));
}

#[tokio::test]
async fn chat_with_tools_answers_with_a_tool_call() {
    let sim = start_default().await;
    let mut body = chat("time?");
    body["tools"] =
        json!([{"type": "function", "function": {"name": "get_time", "parameters": {}}}]);
    let reply = post(&sim, "/v1/chat/completions", &body).await.json();
    let choice = &reply["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert_eq!(
        choice["message"]["tool_calls"][0]["function"]["name"],
        "get_time"
    );
    assert_eq!(choice["message"]["content"], Value::Null);
    body["stream"] = json!(true);
    let reply = post(&sim, "/v1/chat/completions", &body).await;
    let chunks = sse_data(&reply.text());
    assert!(
        chunks[1].contains(r#""tool_calls":[{"index":0"#),
        "{}",
        chunks[1]
    );
}

#[tokio::test]
async fn chat_only_serves_neither_agent_api() {
    let sim = start(SimConfig {
        chat_only: true,
        ..SimConfig::default()
    })
    .await;
    assert_eq!(
        post(&sim, "/v1/messages", &messages(false)).await.status,
        StatusCode::NOT_FOUND
    );
    let responses = json!({"model": MODEL, "input": "x"});
    assert_eq!(
        post(&sim, "/v1/responses", &responses).await.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        post(&sim, "/v1/chat/completions", &chat("x")).await.status,
        StatusCode::OK
    );
}
