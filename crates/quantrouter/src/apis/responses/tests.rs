use serde_json::{json, Value};

use super::*;

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
fn input_items_with_calls_and_results_become_chat_messages() {
    let request = json!({
    "model": "gpt", "instructions": "be brief", "max_output_tokens": 32,
    "text": {"format": {"type": "json_schema", "name": "t", "schema": {"type": "object"}}},
    "reasoning": {"effort": "low"},
    "tools": [{"type": "function", "name": "get_time", "parameters": {"type": "object"}}],
    "tool_choice": {"type": "function", "name": "get_time"},
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "time?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "noon"},
    ]});
    let chat = to_chat(&request).unwrap();
    assert_eq!(chat["max_tokens"], 32);
    assert_eq!(chat["reasoning_effort"], "low");
    assert_eq!(chat["response_format"]["json_schema"]["name"], "t");
    assert_eq!(
        chat["tool_choice"],
        json!({"type": "function", "function": {"name": "get_time"}})
    );
    let messages = chat["messages"].as_array().unwrap();
    assert_eq!(
        messages[0],
        json!({"role": "system", "content": "be brief"})
    );
    assert_eq!(messages[1], json!({"role": "user", "content": "time?"}));
    // Parallel calls are one assistant turn.
    assert_eq!(messages[2]["tool_calls"].as_array().unwrap().len(), 2);
    assert_eq!(
        messages[3],
        json!({"role": "tool", "tool_call_id": "call_1", "content": "noon"})
    );
}

#[test]
fn codexs_request_becomes_chat_with_its_hints_and_hosted_tools_left_out() {
    // The fields Codex sends, as it sends them.
    let request = json!({
    "model": "auto", "stream": true, "store": false, "parallel_tool_calls": true,
    "tool_choice": "auto", "reasoning": {"effort": "low", "summary": "auto"},
    "include": ["reasoning.encrypted_content"], "prompt_cache_key": "k",
    "client_metadata": {"turn_id": "t"}, "text": {"verbosity": "low"},
    "tools": [
        {"type": "function", "name": "exec_command", "strict": false,
         "description": "run", "parameters": {"type": "object"}},
        {"type": "namespace", "name": "multi_agent_v1", "description": "agents",
         "tools": [{"type": "function", "name": "spawn_agent", "parameters": {}}]},
        {"type": "web_search", "external_web_access": false},
    ],
    "input": [
        {"type": "message", "id": "msg_1", "role": "developer",
         "content": [{"type": "input_text", "text": "be useful"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "e"},
        {"type": "function_call", "call_id": "c1", "name": "exec_command", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
    ]});
    let chat = to_chat(&request).unwrap();
    assert_eq!(chat["reasoning_effort"], "low");
    assert_eq!(chat["tools"].as_array().unwrap().len(), 1);
    assert_eq!(chat["tools"][0]["function"]["name"], "exec_command");
    let roles: Vec<&str> = chat["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["system", "user", "assistant", "tool"]);
    assert_eq!(dropped_tools(&request), ["multi_agent_v1", "web_search"]);
    let echo = echo(&request);
    assert_eq!(echo["tools"].as_array().unwrap().len(), 1);
    assert_eq!(echo["tool_choice"], "auto");
}

#[test]
fn built_in_tools_and_unknown_items_are_refused() {
    let search = json!({"model": "m", "input": "x", "tools": [{"type": "file_search"}]});
    assert!(to_chat(&search).unwrap_err().0.contains("file_search"));
    let reference = json!({"model": "m", "input": [{"type": "item_reference", "id": "x"}]});
    assert!(to_chat(&reference)
        .unwrap_err()
        .0
        .contains("item_reference"));
    let background = json!({"model": "m", "input": "x", "background": true});
    assert!(to_chat(&background).unwrap_err().0.contains("background"));
    let follow_up = json!({"model": "m", "input": "x", "previous_response_id": "resp_1"});
    assert!(to_chat(&follow_up)
        .unwrap_err()
        .0
        .contains("previous_response_id"));
}

#[test]
fn a_chat_answer_becomes_an_unstored_response() {
    let chat = json!({"id": "chatcmpl-abc", "created": 5, "model": "m", "choices": [{
        "message": {"role": "assistant", "content": "hi", "tool_calls": [{"id": "call_1",
            "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        "finish_reason": "tool_calls"}], "usage": {"prompt_tokens": 4, "completion_tokens": 2}});
    let tools = json!([{"type": "function", "name": "f", "parameters": {}}]);
    let response = from_chat(&chat, &json!({"tools": tools, "tool_choice": "required"}));
    assert_eq!(response["id"], "resp_abc");
    // The tools the request offered, not `[]`.
    assert_eq!(response["tools"], tools);
    assert_eq!(response["tool_choice"], "required");
    assert_eq!(response["status"], "completed");
    assert_eq!(response["store"], false);
    assert_eq!(
        response["output"][0]["content"][0],
        json!({"type": "output_text", "text": "hi", "annotations": []})
    );
    assert_eq!(response["output"][1]["type"], "function_call");
    assert_eq!(response["output"][1]["call_id"], "call_1");
    assert_eq!(response["usage"]["total_tokens"], 6);
    let cut = json!({"choices": [{"message": {"content": "a"}, "finish_reason": "length"}]});
    let cut = from_chat(&cut, &Value::Null);
    assert_eq!(
        (
            cut["status"].as_str(),
            cut["incomplete_details"]["reason"].as_str()
        ),
        (Some("incomplete"), Some("max_output_tokens"))
    );
}

#[test]
fn a_chat_stream_becomes_numbered_responses_events() {
    let mut stream = ResponsesStream::default();
    let mut out = Vec::new();
    let chunks = [
        json!({"id": "chatcmpl-1", "created": 5, "model": "m", "choices": [{"delta": {"role": "assistant", "content": ""}}]}),
        json!({"choices": [{"delta": {"content": "Hel"}}]}),
        json!({"choices": [{"delta": {"content": "lo"}, "finish_reason": "stop"}]}),
        json!({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}),
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
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed"
        ]
    );
    for (i, (name, data)) in events.iter().enumerate() {
        assert_eq!(&data["type"], name);
        assert_eq!(data["sequence_number"], i as u64);
    }
    assert_eq!(events[6].1["text"], "Hello");
    let done = &events[9].1["response"];
    assert_eq!(done["output"][0]["content"][0]["text"], "Hello");
    assert_eq!(done["usage"]["input_tokens"], 5);
}

#[test]
fn a_streamed_tool_call_is_a_function_call_item() {
    let mut stream = ResponsesStream::default();
    let mut out = Vec::new();
    stream.chunk(
        &json!({"id": "chatcmpl-1", "choices": [{"delta": {"tool_calls": [{"index": 0,
        "id": "call_9", "function": {"name": "f", "arguments": "{\"a\""}}]}}]}),
        &mut out,
    );
    stream.chunk(
        &json!({"choices": [{"delta": {"tool_calls": [{"index": 0,
        "function": {"arguments": ":1}"}}]}, "finish_reason": "tool_calls"}]}),
        &mut out,
    );
    stream.end(&mut out);
    let events = events(&out);
    assert_eq!(events[2].1["item"]["type"], "function_call");
    assert_eq!(events[2].1["item"]["call_id"], "call_9");
    let done = events
        .iter()
        .find(|(n, _)| n == "response.function_call_arguments.done")
        .unwrap();
    assert_eq!(done.1["arguments"], "{\"a\":1}");
    assert_eq!(
        events.last().unwrap().1["response"]["output"][0]["arguments"],
        "{\"a\":1}"
    );
}

#[test]
fn a_chat_upstreams_reasoning_becomes_a_reasoning_item_whole_and_streamed() {
    let chat = json!({"id": "chatcmpl-r", "model": "m", "choices": [{"message": {
        "role": "assistant", "reasoning": "2+2 is 4", "content": "4"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 5,
            "completion_tokens_details": {"reasoning_tokens": 4}}});
    let response = from_chat(&chat, &Value::Null);
    assert_eq!(response["output"][0]["type"], "reasoning");
    assert_eq!(response["output"][0]["content"][0]["text"], "2+2 is 4");
    assert_eq!(response["output"][1]["type"], "message");
    assert_eq!(
        response["usage"]["output_tokens_details"]["reasoning_tokens"],
        4
    );

    let mut stream = ResponsesStream::default();
    let mut out = Vec::new();
    for chunk in [
        json!({"id": "chatcmpl-r", "model": "m", "choices": [{"delta": {"reasoning_content": "2+2"}}]}),
        json!({"choices": [{"delta": {"content": "4"}, "finish_reason": "stop"}]}),
    ] {
        stream.chunk(&chunk, &mut out);
    }
    stream.end(&mut out);
    let events = events(&out);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        &names[2..6],
        [
            "response.output_item.added",
            "response.reasoning_text.delta",
            "response.reasoning_text.done",
            "response.output_item.done"
        ]
    );
    let done = &events.last().unwrap().1["response"];
    assert_eq!(done["output"][0]["content"][0]["text"], "2+2");
    assert_eq!(done["output"][1]["content"][0]["text"], "4");
}
