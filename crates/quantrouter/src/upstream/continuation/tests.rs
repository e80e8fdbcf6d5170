use serde_json::json;

use super::*;

fn event(data: &Value) -> Vec<u8> {
    format!("data: {data}\n\n").into_bytes()
}

fn chunk(id: &str, delta: Value, finish: Option<&str>) -> Vec<u8> {
    event(&json!({
        "id": id, "object": "chat.completion.chunk", "created": 7, "model": "m-int4",
        "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]
    }))
}

fn replaced(seen: Seen) -> Value {
    let Seen::Replace(bytes) = seen else {
        panic!("not replaced: {seen:?}");
    };
    let data = data_of(&bytes).unwrap();
    serde_json::from_slice(&data).unwrap()
}

/// A stream that delivered "Hello world" in two tokens after its role chunk.
fn hello_world() -> Delivered {
    let mut delivered = Delivered::default();
    let role = chunk("a", json!({"role": "assistant", "content": ""}), None);
    for event in [
        role,
        chunk("a", json!({"content": "Hello"}), None),
        chunk("a", json!({"content": " world"}), None),
    ] {
        assert_eq!(delivered.observe(&event), Seen::Pass);
    }
    delivered
}

#[test]
fn the_first_part_passes_as_it_came_and_its_text_is_kept() {
    let mut delivered = hello_world();
    assert_eq!((delivered.text(), delivered.tokens()), ("Hello world", 2));
    assert!(!delivered.finished() && delivered.refused().is_none());
    assert_eq!(delivered.observe(b": keep-alive\n\n"), Seen::Pass);
    // A usage-only event is no error.
    let usage = event(&json!({"choices": [], "usage": {"prompt_tokens": 3}}));
    assert_eq!(delivered.observe(&usage), Seen::Pass);
}

#[test]
fn an_error_event_is_a_broken_stream_and_done_a_whole_one() {
    let mut delivered = hello_world();
    let vllm = br#"data: {"error": {"object": "error", "message": "engine dead", "code": 500}}

"#;
    assert_eq!(delivered.observe(vllm), Seen::ErrorEvent);
    let object = event(&json!({"object": "error", "message": "x"}));
    assert_eq!(delivered.observe(&object), Seen::ErrorEvent);
    let finish = chunk("a", json!({}), Some("stop"));
    assert_eq!(delivered.observe(&finish), Seen::Pass);
    assert!(delivered.finished());

    // A server that says it is done is taken at its word, finish reason or not.
    let mut delivered = hello_world();
    assert_eq!(delivered.observe(b"data: [DONE]\n\n"), Seen::Pass);
    assert!(delivered.finished());
}

#[test]
fn a_continuation_takes_the_streams_identity_and_reports_one_usage() {
    let mut delivered = hello_world();
    delivered.continue_now();
    // Its role chunk was the client's already.
    let role = chunk("b", json!({"role": "assistant", "content": ""}), None);
    assert_eq!(delivered.observe(&role), Seen::Drop);
    let mut text = json!({
        "id": "b", "object": "chat.completion.chunk", "created": 9, "model": "m-fp8",
        "choices": [{"index": 3, "delta": {"role": "assistant", "content": " again"}}]
    });
    let got = replaced(delivered.observe(&event(&text)));
    text["id"] = json!("a");
    text["created"] = json!(7);
    text["model"] = json!("m-int4");
    text["choices"][0] = json!({"index": 0, "delta": {"content": " again"}});
    assert_eq!(got, text);
    let finish = chunk("b", json!({}), Some("length"));
    assert_eq!(
        replaced(delivered.observe(&finish))["choices"][0]["finish_reason"],
        "length"
    );
    // Its usage counts the two delivered tokens as prompt: they are completion.
    let usage = json!({"id": "b", "choices": [], "usage":
        {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14}});
    let got = replaced(delivered.observe(&event(&usage)));
    assert_eq!(
        got["usage"],
        json!({"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14})
    );
    assert_eq!(got["id"], "a");
    assert_eq!(delivered.observe(b"data: [DONE]\n\n"), Seen::Pass);
    assert_eq!(
        (delivered.text(), delivered.tokens()),
        ("Hello world again", 3)
    );
}

#[test]
fn a_continuation_that_fails_is_broken_too() {
    let mut delivered = hello_world();
    delivered.continue_now();
    let error = event(&json!({"error": {"message": "oom"}}));
    assert_eq!(delivered.observe(&error), Seen::ErrorEvent);
}

#[test]
fn tool_calls_reasoning_several_choices_and_long_answers_are_not_continued() {
    let cases = [
        (
            json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"a"}}]}),
            Unresumable::ToolCall,
        ),
        (json!({"reasoning_content": "hmm"}), Unresumable::NotText),
        (json!({"refusal": "no"}), Unresumable::NotText),
    ];
    for (delta, why) in cases {
        let mut delivered = hello_world();
        assert_eq!(delivered.observe(&chunk("a", delta, None)), Seen::Pass);
        assert_eq!(delivered.refused(), Some(why));
        assert_eq!(
            delivered.text(),
            "",
            "nothing kept for a stream never continued"
        );
    }
    let mut delivered = hello_world();
    let second = event(&json!({"choices": [{"index": 1, "delta": {"content": "x"}}]}));
    delivered.observe(&second);
    assert_eq!(delivered.refused(), Some(Unresumable::Choices));

    let mut delivered = Delivered::default();
    let piece = "x".repeat(64 * 1024);
    for _ in 0..4 {
        delivered.observe(&chunk("a", json!({ "content": piece }), None));
    }
    assert_eq!(delivered.refused(), None);
    assert_eq!(delivered.text().len(), MAX_DELIVERED);
    delivered.observe(&chunk("a", json!({"content": "y"}), None));
    assert_eq!(delivered.refused(), Some(Unresumable::TooLong));
    assert_eq!(delivered.text(), "");
}

#[test]
fn chat_continues_an_assistant_message_with_the_tokens_left() {
    let base = json!({"model": "m", "stream": true, "max_tokens": 120,
        "max_completion_tokens": 100, "messages": [{"role": "user", "content": "hi"}]});
    let body = request(base.clone(), Endpoint::Chat, "Hello world", 30).unwrap();
    let body: Value = serde_json::from_slice(&body).unwrap();
    let mut expected = base.clone();
    expected["messages"]
        .as_array_mut()
        .unwrap()
        .push(json!({"role": "assistant", "content": "Hello world"}));
    expected["continue_final_message"] = json!(true);
    expected["add_generation_prompt"] = json!(false);
    expected["max_tokens"] = json!(90);
    expected["max_completion_tokens"] = json!(70);
    assert_eq!(body, expected);

    // A client's own start of the answer grows; one it did not ask to continue cannot.
    let mut prefilled = base.clone();
    prefilled["messages"]
        .as_array_mut()
        .unwrap()
        .push(json!({"role": "assistant", "content": "Sure:"}));
    let without = request(prefilled.clone(), Endpoint::Chat, " x", 1);
    assert_eq!(without, Err(Unresumable::Prompt));
    prefilled["continue_final_message"] = json!(true);
    let body = request(prefilled.clone(), Endpoint::Chat, " x", 1).unwrap();
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["messages"][1]["content"], "Sure: x");
    assert_eq!(body["messages"].as_array().unwrap().len(), 2);

    let spent = request(base.clone(), Endpoint::Chat, "x", 100);
    assert_eq!(spent, Err(Unresumable::Spent));
    // Nothing delivered: the request as it was.
    let fresh = request(base.clone(), Endpoint::Chat, "", 0).unwrap();
    assert_eq!(fresh, base.to_string());
}

#[test]
fn completions_continue_the_prompt_of_one_string() {
    for prompt in [json!("Once"), json!(["Once"])] {
        let base = json!({"model": "m", "stream": true, "max_tokens": 10, "prompt": prompt});
        let body = request(base.clone(), Endpoint::Completions, " upon", 1);
        let body: Value = serde_json::from_slice(&body.unwrap()).unwrap();
        let prompt = body["prompt"].as_str().or(body["prompt"][0].as_str());
        assert_eq!(prompt, Some("Once upon"));
        assert_eq!(body["max_tokens"], 9);
        assert!(body.get("continue_final_message").is_none());
    }
    for refused in [
        json!({"prompt": ["a", "b"]}),
        json!({"prompt": [1, 2, 3]}),
        json!({"prompt": "a", "echo": true}),
        json!({"prompt": "a", "suffix": "z"}),
        json!({"prompt": "a", "best_of": 2}),
    ] {
        let body = request(refused.clone(), Endpoint::Completions, "x", 1);
        assert_eq!(body, Err(Unresumable::Prompt), "{refused}");
    }
}

#[test]
fn answers_bound_to_a_format_are_not_continued() {
    for bound in [
        json!({"response_format": {"type": "json_object"}}),
        json!({"response_format": {"type": "json_schema", "json_schema": {}}}),
        json!({"guided_json": {"type": "object"}}),
        json!({"guided_choice": ["a", "b"]}),
        json!({"grammar": "root ::= \"a\""}),
    ] {
        let mut base = bound.clone();
        base["messages"] = json!([{"role": "user", "content": "hi"}]);
        let body = request(base.clone(), Endpoint::Chat, "x", 1);
        assert_eq!(body, Err(Unresumable::Constrained), "{bound}");
    }
    let text = json!({"response_format": {"type": "text"}, "messages": []});
    assert!(request(text.clone(), Endpoint::Chat, "x", 1).is_ok());
}
