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
    let out = p.upstream_body(&body, r#""org/model-7b""#);
    assert_eq!(
        &out[..],
        br#"{"messages":[{"role":"user","content":"hi"}], "model" : "org/model-7b", "x":1}"#
    );
    // Same model: the original buffer is reused.
    let same = p.upstream_body(&body, r#""auto""#);
    assert_eq!(same.as_ptr(), body.as_ptr());
}

#[test]
fn streams_without_stream_options_ask_upstream_for_usage() {
    let body = Bytes::from_static(
        br#" {"stream":true,"model":"auto","messages":[{"role":"user","content":"hi"}]}"#,
    );
    let p = ParsedRequest::parse(&body, Endpoint::Chat).unwrap();
    assert!(p.adds_usage());
    let out = p.upstream_body(&body, r#""m""#);
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
        assert_eq!(p.upstream_body(&body, r#""auto""#).as_ptr(), body.as_ptr());
    }
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
