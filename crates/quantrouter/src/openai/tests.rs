use super::*;

fn parse(body: &str) -> Result<ParsedRequest<'_>, ApiError> {
    ParsedRequest::parse(body.as_bytes(), Endpoint::Chat)
}

fn param_of(err: ApiError) -> Option<String> {
    match err {
        ApiError::InvalidRequest { param, .. } => param,
        other => panic!("expected invalid request, got {other:?}"),
    }
}

#[test]
fn parses_what_routing_needs_and_ignores_the_rest() {
    let body = r#"{"model":"auto","messages":[{"role":"system","content":"Be brief."},
        {"role":"user","content":[{"type":"text","text":"Describe"},{"type":"image_url","image_url":{"url":"x"}}]},
        {"role":"assistant","content":null,"tool_calls":[]}],
        "max_completion_tokens":32,"stream":true,"response_format":{"type":"json_object"},
        "user":"u-1","tools":[],"seed":3}"#;
    let p = parse(body).unwrap();
    assert_eq!(p.model, "auto");
    assert_eq!(p.max_tokens, Some(32));
    assert!(p.stream && p.wants_json);
    assert_eq!(p.user.as_deref(), Some("u-1"));
    let prompt = p.prompt();
    let texts: Vec<(Role, &str)> = prompt.segments.iter().map(|s| (s.role, s.text)).collect();
    assert_eq!(
        texts,
        [(Role::System, "Be brief."), (Role::User, "Describe")]
    );
}

#[test]
fn escaped_text_is_decoded() {
    let p = parse(r#"{"model":"auto","messages":[{"role":"user","content":"line\nnext \u00e9"}]}"#)
        .unwrap();
    assert_eq!(p.prompt().segments[0].text, "line\nnext é");
}

#[test]
fn rewrite_replaces_only_the_model_value() {
    let body = Bytes::from_static(
        br#"{"messages":[{"role":"user","content":"hi"}], "model" : "auto", "x":1}"#,
    );
    let p = ParsedRequest::parse(&body, Endpoint::Chat).unwrap();
    let out = p.upstream_body(&body, r#""org/model-7b""#, BodyEdits::default());
    assert_eq!(
        &out[..],
        br#"{"messages":[{"role":"user","content":"hi"}], "model" : "org/model-7b", "x":1}"#
    );
    // Same model: the original buffer is reused.
    let same = p.upstream_body(&body, r#""auto""#, BodyEdits::default());
    assert_eq!(same.as_ptr(), body.as_ptr());
}

#[test]
fn streams_without_stream_options_ask_upstream_for_usage() {
    let body = Bytes::from_static(
        br#" {"stream":true,"model":"auto","messages":[{"role":"user","content":"hi"}]}"#,
    );
    let p = ParsedRequest::parse(&body, Endpoint::Chat).unwrap();
    assert!(p.adds_usage());
    let out = p.upstream_body(&body, r#""m""#, BodyEdits::default());
    assert_eq!(
        std::str::from_utf8(&out).unwrap(),
        r#" {"stream_options":{"include_usage":true},"stream":true,"model":"m","messages":[{"role":"user","content":"hi"}]}"#
    );
    // The client's own stream_options are left alone, and so are non-streamed requests.
    for text in [
        r#"{"stream":true,"stream_options":{"include_usage":false},"model":"auto","messages":[{"role":"user","content":"hi"}]}"#,
        r#"{"model":"auto","messages":[{"role":"user","content":"hi"}]}"#,
    ] {
        let body = Bytes::from(text);
        let p = ParsedRequest::parse(&body, Endpoint::Chat).unwrap();
        assert!(!p.adds_usage());
        assert_eq!(
            p.upstream_body(&body, r#""auto""#, BodyEdits::default())
                .as_ptr(),
            body.as_ptr()
        );
    }
}

#[test]
fn a_cache_salt_is_added_or_replaces_the_clients_where_it_stands() {
    let text = |b: &Bytes| std::str::from_utf8(b).unwrap().to_owned();
    let body =
        Bytes::from_static(br#"{"model":"auto","messages":[{"role":"user","content":"hi"}]}"#);
    let p = ParsedRequest::parse(&body, Endpoint::Chat).unwrap();
    assert_eq!(p.cache_salt(), None);
    assert_eq!(
        text(&p.upstream_body(&body, r#""m""#, salted("ab12"))),
        r#"{"cache_salt":"ab12","model":"m","messages":[{"role":"user","content":"hi"}]}"#
    );
    let body = Bytes::from_static(
        br#"{"stream":true,"cache_salt":"mine","model":"auto","messages":[{"role":"user","content":"hi"}]}"#,
    );
    let p = ParsedRequest::parse(&body, Endpoint::Chat).unwrap();
    assert_eq!(p.cache_salt(), Some("mine"));
    assert_eq!(
        text(&p.upstream_body(&body, r#""auto""#, salted("ab12"))),
        r#"{"stream_options":{"include_usage":true},"stream":true,"cache_salt":"ab12","model":"auto","messages":[{"role":"user","content":"hi"}]}"#
    );
    // Without one to set, the client's goes as sent.
    assert!(
        text(&p.upstream_body(&body, r#""auto""#, BodyEdits::default()))
            .contains(r#""cache_salt":"mine""#)
    );
    let err =
        parse(r#"{"model":"auto","cache_salt":5,"messages":[{"role":"user","content":"hi"}]}"#)
            .unwrap_err();
    assert_eq!(param_of(err).as_deref(), Some("cache_salt"));
}

#[test]
fn completion_prompts_accept_strings_and_lists() {
    let p = ParsedRequest::parse(
        br#"{"model":"m","prompt":["a","b"]}"#,
        Endpoint::Completions,
    )
    .unwrap();
    assert_eq!(p.prompt().segments.len(), 2);
    let err = ParsedRequest::parse(br#"{"model":"m"}"#, Endpoint::Completions).unwrap_err();
    assert_eq!(param_of(err).as_deref(), Some("prompt"));
}

#[test]
fn invalid_requests_name_their_param() {
    let cases = [
        (
            r#"{"model":1,"messages":[{"role":"user","content":"hi"}]}"#,
            Some("model"),
        ),
        (r#"{"model":"a","messages":"hi"}"#, Some("messages")),
        (
            r#"{"model":"a","messages":[{"role":"user","content":"hi"}],"stream":"yes"}"#,
            Some("stream"),
        ),
        (
            r#"{"model":"a","messages":[{"role":"user","content":"hi"}],"max_tokens":-5}"#,
            Some("max_tokens"),
        ),
        (
            r#"{"model":"a","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":0}"#,
            Some("max_completion_tokens"),
        ),
        (
            r#"{"model":"a","messages":[{"role":"user","content":"hi"}],"temperature":-0.1}"#,
            Some("temperature"),
        ),
        (
            r#"{"model":"a","messages":[{"role":"user","content":"hi"}],"top_p":1.5}"#,
            Some("top_p"),
        ),
        ("[]", None),
        ("{", None),
        ("", None),
    ];
    for (body, param) in cases {
        let err = parse(body).unwrap_err();
        assert_eq!(err.status(), StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(param_of(err).as_deref(), param, "{body}");
    }
}

#[test]
fn error_responses_have_the_openai_shape() {
    let response = ApiError::Unavailable("all tiers down".into()).into_response();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(response.headers()[header::RETRY_AFTER], "1");
    let response = ApiError::ModelNotFound("gpt-9".into()).into_response();
    assert_eq!(response.status(), StatusCode::NOT_FOUND);
    assert_eq!(response.headers()[header::CONTENT_TYPE], "application/json");
}

#[test]
fn agent_requests_score_system_text_and_tool_results_as_context() {
    let body = br#"{"model":"auto","max_tokens":9,"system":[{"type":"text","text":"be brief"}],
        "messages":[{"role":"user","content":[{"type":"text","text":"hi"},
          {"type":"tool_result","tool_use_id":"t","content":"noon"},{"type":"image","source":{}}]}]}"#;
    let p = ParsedRequest::parse(body, Endpoint::Messages).unwrap();
    let segments: Vec<(Role, &str)> = p
        .prompt()
        .segments
        .iter()
        .map(|s| (s.role, s.text))
        .collect();
    assert_eq!(
        segments,
        [
            (Role::System, "be brief"),
            (Role::User, "hi"),
            (Role::Other, "noon")
        ]
    );
    assert_eq!(p.max_tokens, Some(9));
    assert!(!p.stream && !p.adds_usage());

    let body = br#"{"model":"auto","instructions":"be brief","max_output_tokens":5,"stream":true,
        "text":{"format":{"type":"json_object"}},"previous_response_id":"resp_1",
        "input":[{"role":"user","content":[{"type":"input_text","text":"hi"}]},
          {"type":"function_call_output","call_id":"c","output":"noon"}]}"#;
    let p = ParsedRequest::parse(body, Endpoint::Responses).unwrap();
    let segments: Vec<(Role, &str)> = p
        .prompt()
        .segments
        .iter()
        .map(|s| (s.role, s.text))
        .collect();
    assert_eq!(
        segments,
        [
            (Role::System, "be brief"),
            (Role::User, "hi"),
            (Role::Other, "noon")
        ]
    );
    assert!(p.wants_json);
    assert_eq!(p.max_tokens, Some(5));
    assert_eq!(p.previous_response_id.as_deref(), Some("resp_1"));
    // Responses streams report usage themselves: nothing is added.
    assert!(!p.adds_usage());
    let missing = ParsedRequest::parse(br#"{"model":"auto"}"#, Endpoint::Responses).unwrap_err();
    assert_eq!(param_of(missing).as_deref(), Some("input"));
}

#[test]
fn agent_answers_are_checked_by_their_text_and_tool_calls_pass() {
    let text = br#"{"type":"message","content":[{"type":"text","text":"hello"}],"stop_reason":"end_turn"}"#;
    assert!(matches!(&answer_choices(text).unwrap()[..], [AnswerChoice::Text(t)] if t == "hello"));
    let tool =
        br#"{"type":"message","content":[{"type":"tool_use","id":"t","name":"f","input":{}}]}"#;
    assert!(matches!(
        answer_choices(tool).unwrap()[..],
        [AnswerChoice::NotText]
    ));
    let empty = br#"{"object":"response","output":[{"type":"message","content":[{"type":"output_text","text":""}]}]}"#;
    assert!(matches!(&answer_choices(empty).unwrap()[..], [AnswerChoice::Text(t)] if t.is_empty()));
    let call =
        br#"{"object":"response","output":[{"type":"function_call","name":"f","arguments":"{}"}]}"#;
    assert!(matches!(
        answer_choices(call).unwrap()[..],
        [AnswerChoice::NotText]
    ));
}

#[test]
fn agent_stream_events_carry_text_or_calls() {
    let text = chunk_output(
        br#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"hi"}}"#,
    );
    assert_eq!((text.choices[0].text.as_str(), text.call), ("hi", false));
    let call = chunk_output(br#"{"type":"content_block_start","index":0,"content_block":{"type":"tool_use","id":"t","name":"f","input":{}}}"#);
    assert!(call.call);
    let delta =
        chunk_output(br#"{"type":"response.output_text.delta","delta":"yo","sequence_number":4}"#);
    assert_eq!(delta.choices[0].text, "yo");
    let added =
        chunk_output(br#"{"type":"response.output_item.added","item":{"type":"function_call"}}"#);
    assert!(added.call);
    assert!(!carries_output(
        br#"{"type":"message_start","message":{"usage":{"input_tokens":3}}}"#
    ));
    let usage =
        find_usage(br#"{"type":"message_delta","usage":{"input_tokens":3,"output_tokens":7}}"#)
            .unwrap();
    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (3, 7));
}

// === The parser under arbitrary input ===
//
// Properties run by `cargo test` (a few hundred cases each, so CI runs them for a bounded
// time) and a corpus of regression inputs kept in `tests/data/request-corpus/`: files named
// `ok-*` must be accepted, `bad-*` rejected; every file also seeds the mutation property.

mod fuzz {
    use std::path::PathBuf;

    use proptest::prelude::*;
    use serde_json::{json, Value};

    use super::*;

    fn corpus_dir() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/request-corpus")
    }

    /// The corpus: (file name, bytes), sorted by name.
    fn corpus() -> Vec<(String, Vec<u8>)> {
        let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(corpus_dir())
            .unwrap()
            .map(|entry| {
                let path = entry.unwrap().path();
                let name = path.file_name().unwrap().to_string_lossy().into_owned();
                (name, std::fs::read(&path).unwrap())
            })
            .collect();
        files.sort();
        files
    }

    fn endpoint_of(name: &str) -> Endpoint {
        match name.contains("completion") {
            true => Endpoint::Completions,
            false => Endpoint::Chat,
        }
    }

    /// Whatever `body` is: no panic, a 400 or a request whose rewrite parses again.
    fn parse_anything(body: &[u8], endpoint: Endpoint) -> bool {
        match ParsedRequest::parse(body, endpoint) {
            Ok(parsed) => {
                let _ = parsed.prompt();
                let bytes = Bytes::copy_from_slice(body);
                let rewritten =
                    parsed.upstream_body(&bytes, r#""org/model""#, BodyEdits::default());
                let again = ParsedRequest::parse(&rewritten, endpoint).unwrap();
                assert_eq!(again.model, "org/model");
                true
            }
            Err(error) => {
                assert_eq!(error.status(), StatusCode::BAD_REQUEST, "{error}");
                false
            }
        }
    }

    #[test]
    fn corpus_inputs_get_their_expected_answer() {
        let files = corpus();
        assert!(files.len() >= 20, "the corpus is in the repository");
        for (name, body) in files {
            let accepted = parse_anything(&body, endpoint_of(&name));
            assert_eq!(accepted, name.starts_with("ok-"), "{name}");
        }
    }

    /// JSON values of any shape, with the keys the parser reads among random ones.
    fn json_value() -> impl Strategy<Value = Value> {
        let key = prop_oneof![
            3 => prop::sample::select(vec![
                "model", "messages", "prompt", "role", "content", "text", "type", "max_tokens",
                "max_completion_tokens", "stream", "temperature", "top_p", "response_format",
                "user", "stream_options", "n", "tools", "image_url",
            ])
            .prop_map(str::to_owned),
            1 => ".{0,8}",
        ];
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<f64>().prop_map(|f| json!(f)),
            prop::sample::select(vec!["auto", "user", "json_object", "text", ""])
                .prop_map(Value::from),
            ".{0,24}".prop_map(Value::from),
        ];
        leaf.prop_recursive(5, 96, 8, move |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::vec((key.clone(), inner), 0..8)
                    .prop_map(|fields| Value::Object(fields.into_iter().collect())),
            ]
        })
    }

    /// A message's content as generated: text, parts (`None` is an image) or null.
    #[derive(Debug, Clone)]
    enum Content {
        Text(String),
        Parts(Vec<Option<String>>),
        Null,
    }

    fn message() -> impl Strategy<Value = (&'static str, Content)> {
        let role = prop::sample::select(vec!["system", "developer", "user", "assistant", "tool"]);
        let content = prop_oneof![
            3 => any::<String>().prop_map(Content::Text),
            1 => prop::collection::vec(proptest::option::of(any::<String>()), 0..4)
                .prop_map(Content::Parts),
            1 => Just(Content::Null),
        ];
        (role, content)
    }

    fn role_of(role: &str) -> Role {
        match role {
            "system" | "developer" => Role::System,
            "user" => Role::User,
            "assistant" => Role::Assistant,
            _ => Role::Other,
        }
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(body in prop::collection::vec(any::<u8>(), 0..600)) {
            parse_anything(&body, Endpoint::Chat);
            parse_anything(&body, Endpoint::Completions);
        }

        #[test]
        fn arbitrary_json_never_panics(value in json_value(), pretty in any::<bool>()) {
            let text = match pretty {
                true => serde_json::to_string_pretty(&value).unwrap(),
                false => value.to_string(),
            };
            parse_anything(text.as_bytes(), Endpoint::Chat);
            parse_anything(text.as_bytes(), Endpoint::Completions);
        }

        #[test]
        fn mutated_corpus_inputs_never_panic_and_only_json_is_accepted(
            seed in prop::sample::select(corpus()),
            edits in prop::collection::vec((any::<usize>(), any::<u8>(), 0u8..3), 1..6),
        ) {
            let (name, mut body) = seed;
            for (at, byte, kind) in edits {
                let at = at % (body.len() + 1);
                match kind {
                    0 => body.insert(at, byte),
                    1 if at < body.len() => body[at] = byte,
                    _ => body.truncate(at),
                }
            }
            if parse_anything(&body, endpoint_of(&name)) {
                // Accepted means one valid JSON document, nothing before or after it.
                let text = std::str::from_utf8(&body);
                prop_assert!(text.is_ok_and(|t| serde_json::from_str::<serde::de::IgnoredAny>(t).is_ok()));
            }
        }

        #[test]
        fn accepted_requests_round_trip_what_routing_needs(
            model in any::<String>(),
            messages in prop::collection::vec(message(), 1..5),
            max_tokens in proptest::option::of(1u32..),
            stream in any::<bool>(),
            wants_json in any::<bool>(),
            user in proptest::option::of(any::<String>()),
            stream_options in any::<bool>(),
            extra in prop::collection::vec(("x_[a-z]{1,6}", json_value()), 0..3),
            pretty in any::<bool>(),
            new_model in any::<String>(),
        ) {
            let wire_messages: Vec<Value> = messages
                .iter()
                .map(|(role, content)| {
                    let content = match content {
                        Content::Text(text) => json!(text),
                        Content::Parts(parts) => Value::Array(parts.iter().map(|p| match p {
                            Some(text) => json!({"type": "text", "text": text}),
                            None => json!({"type": "image_url", "image_url": {"url": "data:,"}}),
                        }).collect()),
                        Content::Null => Value::Null,
                    };
                    json!({"role": role, "content": content})
                })
                .collect();
            let mut request = json!({"model": model, "messages": wire_messages, "stream": stream});
            let fields = request.as_object_mut().unwrap();
            for (key, value) in extra {
                fields.insert(key, value);
            }
            if let Some(n) = max_tokens {
                fields.insert("max_tokens".into(), json!(n));
            }
            if wants_json {
                fields.insert("response_format".into(), json!({"type": "json_object"}));
            }
            if let Some(user) = &user {
                fields.insert("user".into(), json!(user));
            }
            if stream_options {
                fields.insert("stream_options".into(), json!({"include_usage": true}));
            }
            let body = Bytes::from(match pretty {
                true => serde_json::to_string_pretty(&request).unwrap(),
                false => request.to_string(),
            });

            let parsed = ParsedRequest::parse(&body, Endpoint::Chat).unwrap();
            prop_assert_eq!(&parsed.model, &model);
            prop_assert_eq!(parsed.max_tokens, max_tokens);
            prop_assert_eq!(parsed.stream, stream);
            prop_assert_eq!(parsed.wants_json, wants_json);
            prop_assert_eq!(parsed.user.as_deref(), user.as_deref());
            prop_assert_eq!(parsed.has_stream_options, stream_options);
            let expected: Vec<(Role, &str)> = messages
                .iter()
                .flat_map(|(role, content)| {
                    let texts: Vec<&str> = match content {
                        Content::Text(text) => vec![text.as_str()],
                        Content::Parts(parts) => parts.iter().flatten().map(String::as_str).collect(),
                        Content::Null => vec![],
                    };
                    texts.into_iter().map(move |text| (role_of(role), text))
                })
                .collect();
            let prompt = parsed.prompt();
            let texts: Vec<(Role, &str)> = prompt.segments.iter().map(|s| (s.role, s.text)).collect();
            prop_assert_eq!(texts, expected);

            // The upstream body is the request with only `model` (and, for a stream the
            // client asked no usage of, `stream_options`) changed.
            let rewritten = parsed.upstream_body(&body, &serde_json::to_string(&new_model).unwrap(), BodyEdits::default());
            // Compared as parsed from text, both: float parsing need not round-trip.
            let mut want: Value = serde_json::from_slice(&body).unwrap();
            want["model"] = json!(new_model);
            if stream && !stream_options {
                want["stream_options"] = json!({"include_usage": true});
            }
            let got: Value = serde_json::from_slice(&rewritten).unwrap();
            prop_assert_eq!(got, want);
            let again = ParsedRequest::parse(&rewritten, Endpoint::Chat).unwrap();
            prop_assert_eq!(&again.model, &new_model);
        }
    }
}

#[test]
fn the_number_of_choices_is_read_and_never_refused() {
    let body = |n: &str| {
        format!(r#"{{"model":"a","messages":[{{"role":"user","content":"hi"}}],"n":{n}}}"#)
    };
    for (n, choices) in [
        ("4", 4),
        ("2.0", 2),
        ("0", 1),
        ("-3", 1),
        ("\"x\"", 1),
        ("null", 1),
    ] {
        let text = body(n);
        assert_eq!(parse(&text).unwrap().choices, choices, "n: {n}");
    }
    assert_eq!(
        parse(r#"{"model":"a","messages":[{"role":"user","content":"hi"}]}"#)
            .unwrap()
            .choices,
        1
    );
}

#[test]
fn messages_require_max_tokens_as_anthropic_does_but_count_tokens_does_not() {
    let body = br#"{"model":"auto","messages":[{"role":"user","content":"hi"}]}"#;
    let err = ParsedRequest::parse(body, Endpoint::Messages).unwrap_err();
    assert_eq!(err.status(), StatusCode::BAD_REQUEST);
    assert_eq!(param_of(err).as_deref(), Some("max_tokens"));
    assert!(ParsedRequest::parse_to_count(body).is_ok());
    // Chat and Responses leave it optional.
    assert!(ParsedRequest::parse(body, Endpoint::Chat).is_ok());
    let wrong = br#"{"model":"auto","max_tokens":"9","messages":[{"role":"user","content":"hi"}]}"#;
    let err = ParsedRequest::parse(wrong, Endpoint::Messages).unwrap_err();
    assert_eq!(param_of(err).as_deref(), Some("max_tokens"));
}

#[test]
fn a_ceiling_lowers_only_the_output_limit_and_only_when_above() {
    let body = Bytes::from_static(
        br#"{"max_tokens" : 32000,"model":"auto","stream":true,"messages":[{"role":"user","content":"hi"}],"tools":[{"a":1}]}"#,
    );
    let p = ParsedRequest::parse(&body, Endpoint::Chat).unwrap();
    assert_eq!(p.tools_bytes, r#"[{"a":1}]"#.len());
    let out = p.upstream_body(&body, r#""m""#, ceiling(9000));
    assert_eq!(
        std::str::from_utf8(&out).unwrap(),
        r#"{"stream_options":{"include_usage":true},"max_tokens" : 9000,"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}],"tools":[{"a":1}]}"#
    );
    let out = p.upstream_body(&body, r#""m""#, ceiling(64_000));
    assert!(std::str::from_utf8(&out)
        .unwrap()
        .contains(r#""max_tokens" : 32000"#));
    let body = Bytes::from_static(br#"{"model":"auto","input":"hi","max_output_tokens":500}"#);
    let p = ParsedRequest::parse(&body, Endpoint::Responses).unwrap();
    assert_eq!(
        &p.upstream_body(&body, r#""auto""#, ceiling(100))[..],
        br#"{"model":"auto","input":"hi","max_output_tokens":100}"#
    );
}

#[test]
fn refusals_say_whether_a_retry_can_help() {
    let says = |error: ApiError| {
        let response = error.into_response();
        let value = response.headers()["x-should-retry"].to_str().unwrap();
        (response.status().as_u16(), value.to_owned())
    };
    let invalid = ApiError::InvalidRequest {
        message: "bad".into(),
        param: None,
    };
    assert_eq!(says(invalid), (400, "false".into()));
    assert_eq!(says(ApiError::Unauthorized), (401, "false".into()));
    assert_eq!(
        says(ApiError::NoAllowedProfile("x".into())),
        (403, "false".into())
    );
    assert_eq!(
        says(ApiError::ModelNotFound("x".into())),
        (404, "false".into())
    );
    assert_eq!(
        says(ApiError::Unavailable("x".into())),
        (503, "true".into())
    );
    let overloaded = ApiError::Overloaded {
        profile: "p".into(),
        reason: "full".into(),
        retry_after_s: 1,
    };
    assert_eq!(says(overloaded), (429, "true".into()));
    assert_eq!(status_should_retry(StatusCode::OK), None);
    assert_eq!(status_should_retry(StatusCode::NOT_FOUND), Some(false));
    assert_eq!(status_should_retry(StatusCode::BAD_GATEWAY), Some(true));
}

fn salted(salt: &str) -> BodyEdits<'_> {
    BodyEdits {
        cache_salt: Some(salt),
        ..BodyEdits::default()
    }
}

fn ceiling(ceiling: u32) -> BodyEdits<'static> {
    BodyEdits {
        ceiling: Some(ceiling),
        ..BodyEdits::default()
    }
}
