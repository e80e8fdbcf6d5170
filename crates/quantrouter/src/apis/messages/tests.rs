use serde_json::{json, Value};

use super::*;

/// The named events of a translated stream, as (name, data).
fn events(out: &[u8]) -> Vec<(String, Value)> {
    let text = std::str::from_utf8(out).unwrap();
    text.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let (name, data) = e
                .strip_prefix("event: ")
                .unwrap()
                .split_once("\ndata: ")
                .unwrap();
            (name.to_owned(), serde_json::from_str(data).unwrap())
        })
        .collect()
}

#[test]
fn a_conversation_with_tools_becomes_chat_messages() {
    let request = json!({
    "model": "claude", "max_tokens": 64, "system": [{"type": "text", "text": "be brief"}],
    "stop_sequences": ["END"], "metadata": {"user_id": "u1"},
    "tools": [{"name": "get_time", "description": "now", "input_schema": {"type": "object"}}],
    "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
    "messages": [
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "checking"},
            {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"tz": "UTC"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "noon"}]},
            {"type": "text", "text": "and tomorrow?"}]},
    ]});
    let chat = to_chat(&request).unwrap();
    assert_eq!(chat["max_tokens"], 64);
    assert_eq!(chat["stop"], json!(["END"]));
    assert_eq!(chat["user"], "u1");
    assert_eq!(chat["tool_choice"], "required");
    assert_eq!(chat["parallel_tool_calls"], false);
    assert_eq!(
        chat["tools"][0]["function"]["parameters"],
        json!({"type": "object"})
    );
    let messages = chat["messages"].as_array().unwrap();
    assert_eq!(
        messages[0],
        json!({"role": "system", "content": "be brief"})
    );
    assert_eq!(messages[2]["content"], "checking");
    assert_eq!(
        messages[2]["tool_calls"][0]["function"]["arguments"],
        r#"{"tz":"UTC"}"#
    );
    // The result comes before the turn's text, as chat wants a tool message right after the call.
    assert_eq!(
        messages[3],
        json!({"role": "tool", "tool_call_id": "toolu_1", "content": "noon"})
    );
    assert_eq!(
        messages[4],
        json!({"role": "user", "content": "and tomorrow?"})
    );
}

#[test]
fn claude_codes_request_becomes_chat_with_its_hints_left_out() {
    // The fields Claude Code sends, as it sends them.
    let request = json!({
    "model": "auto", "max_tokens": 32000, "stream": true,
    "metadata": {"user_id": "{\"device_id\":\"d\"}"},
    "thinking": {"type": "adaptive", "display": "omitted"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "high"},
    "system": [{"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}}],
    "tools": [
        {"name": "Read", "description": "read", "input_schema": {"type": "object"}},
        {"name": "Later", "description": "l", "input_schema": {"type": "object"}, "defer_loading": true},
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
    ],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Say hello"}]},
        {"role": "system", "content": [{"type": "text", "text": "# Environment", "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "", "signature": "sig"},
            {"type": "text", "text": "Hello"}]},
    ]});
    let chat = to_chat(&request).unwrap();
    let messages = chat["messages"].as_array().unwrap();
    assert_eq!(
        messages[2],
        json!({"role": "system", "content": "# Environment"})
    );
    assert_eq!(
        messages[3],
        json!({"role": "assistant", "content": "Hello"})
    );
    assert_eq!(chat.get("reasoning_effort"), None, "adaptive asks nothing");
    let names: Vec<&str> = chat["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["Read", "Later"]);
    assert_eq!(dropped_tools(&request), ["web_search"]);
    for key in [
        "context_management",
        "output_config",
        "metadata",
        "thinking",
    ] {
        assert_eq!(chat.get(key), None, "{key}");
    }
}

#[test]
fn thinking_becomes_a_reasoning_effort_and_a_schema_a_response_format() {
    let base =
        json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]});
    for (budget, effort) in [(1024, "low"), (8000, "medium"), (20000, "high")] {
        let mut thinking = base.clone();
        thinking["thinking"] = json!({"type": "enabled", "budget_tokens": budget});
        assert_eq!(to_chat(&thinking).unwrap()["reasoning_effort"], effort);
    }
    let mut format = base;
    let schema = json!({"type": "object", "properties": {"a": {"type": "string"}}});
    format["output_config"] = json!({"format": {"type": "json_schema", "schema": schema}});
    let chat = to_chat(&format).unwrap();
    assert_eq!(chat["response_format"]["type"], "json_schema");
    assert_eq!(chat["response_format"]["json_schema"]["schema"], schema);
}

#[test]
fn what_chat_cannot_carry_is_refused_by_name() {
    let base =
        json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]});
    let mut server_tool = base.clone();
    server_tool["tools"] = json!([{"type": "bash_20250124", "name": "bash"}]);
    assert!(to_chat(&server_tool)
        .unwrap_err()
        .0
        .contains("bash_20250124"));
    let mut unknown = base.clone();
    unknown["mcp_servers"] = json!([]);
    assert!(to_chat(&unknown).unwrap_err().0.contains("mcp_servers"));
    let mut document = base;
    document["messages"][0]["content"] = json!([{"type": "document", "source": {}}]);
    assert!(to_chat(&document).unwrap_err().0.contains("document"));
}

#[test]
fn a_chat_answer_with_a_tool_call_becomes_a_message() {
    let chat = json!({"id": "chatcmpl-abc", "model": "m", "choices": [{"index": 0,
        "message": {"role": "assistant", "content": "let me see",
            "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_time", "arguments": "{\"tz\":\"UTC\"}"}}]},
        "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}});
    let message = from_chat(&chat);
    assert_eq!(message["id"], "msg_abc");
    assert_eq!(message["stop_reason"], "tool_use");
    assert_eq!(
        message["content"][0],
        json!({"type": "text", "text": "let me see"})
    );
    assert_eq!(
        message["content"][1],
        json!({"type": "tool_use", "id": "call_1", "name": "get_time", "input": {"tz": "UTC"}})
    );
    assert_eq!(
        message["usage"],
        json!({"input_tokens": 7, "output_tokens": 3})
    );
    let cut = json!({"choices": [{"message": {"content": "a"}, "finish_reason": "length"}]});
    assert_eq!(from_chat(&cut)["stop_reason"], "max_tokens");
}

#[test]
fn a_chat_stream_becomes_anthropics_events_in_order() {
    let mut stream = MessagesStream::default();
    let mut out = Vec::new();
    let chunks = [
        json!({"id": "chatcmpl-1", "model": "m", "choices": [{"delta": {"role": "assistant", "content": ""}}]}),
        json!({"choices": [{"delta": {"content": "Hel"}}]}),
        json!({"choices": [{"delta": {"content": "lo"}}]}),
        json!({"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": ""}}]}}]}),
        json!({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}}]}),
        json!({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]}),
        json!({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}}),
    ];
    for chunk in &chunks {
        stream.chunk(chunk, &mut out);
    }
    stream.end(&mut out);
    let events = events(&out);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    for (name, data) in &events {
        assert_eq!(&data["type"], name);
    }
    assert_eq!(events[0].1["message"]["id"], "msg_1");
    assert_eq!(
        events[2].1["delta"],
        json!({"type": "text_delta", "text": "Hel"})
    );
    assert_eq!(events[5].1["index"], 1);
    assert_eq!(events[5].1["content_block"]["type"], "tool_use");
    assert_eq!(
        events[6].1["delta"],
        json!({"type": "input_json_delta", "partial_json": "{}"})
    );
    assert_eq!(events[8].1["delta"]["stop_reason"], "tool_use");
    assert_eq!(
        events[8].1["usage"],
        json!({"input_tokens": 5, "output_tokens": 4})
    );
}

#[test]
fn an_error_mid_stream_is_anthropics_error_event() {
    let mut stream = MessagesStream::default();
    let mut out = Vec::new();
    stream.error(
        &json!({"error": {"message": "the upstream connection failed"}}),
        &mut out,
    );
    let events = events(&out);
    assert_eq!(events[0].0, "error");
    assert_eq!(events[0].1["error"]["type"], "api_error");
    // An ended stream is not ended twice.
    let before = out.len();
    stream.end(&mut out);
    assert_eq!(out.len(), before);
}

#[test]
fn a_chat_upstreams_reasoning_becomes_thinking_whole_and_streamed() {
    let chat = json!({"id": "chatcmpl-r", "model": "m", "choices": [{"message": {
        "role": "assistant", "reasoning_content": "2+2 is 4", "content": "4"},
        "finish_reason": "stop"}], "usage": {"prompt_tokens": 3, "completion_tokens": 5}});
    let message = from_chat(&chat);
    assert_eq!(
        message["content"],
        json!([{"type": "thinking", "thinking": "2+2 is 4", "signature": ""},
            {"type": "text", "text": "4"}])
    );

    let mut stream = MessagesStream::default();
    let mut out = Vec::new();
    for chunk in [
        json!({"id": "chatcmpl-r", "model": "m", "choices": [{"delta": {"role": "assistant"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 0}}),
        json!({"choices": [{"delta": {"reasoning": "2+2"}}]}),
        json!({"choices": [{"delta": {"content": "4"}, "finish_reason": "stop"}]}),
    ] {
        stream.chunk(&chunk, &mut out);
    }
    stream.end(&mut out);
    let events = events(&out);
    // The prompt's tokens from the first chunk (`continuous_usage_stats`).
    assert_eq!(events[0].1["message"]["usage"]["input_tokens"], 3);
    assert_eq!(events[1].1["content_block"]["type"], "thinking");
    assert_eq!(
        events[2].1["delta"],
        json!({"type": "thinking_delta", "thinking": "2+2"})
    );
    assert_eq!(events[4].1["content_block"]["type"], "text");
}
