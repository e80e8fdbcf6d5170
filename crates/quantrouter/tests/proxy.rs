//! The router over real loopback HTTP in front of simulated vLLM tiers: routing, pinning,
//! byte-for-byte forwarding, streaming, cancellation and every bad-input answer.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use http_body_util::BodyExt;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use quantrouter_policy::{ProfileSet, StaticUpstream, Upstream, DEFAULT_PROFILE_SET};
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simple_prompt_goes_to_the_cheapest_tier_and_code_does_not() {
    let h = Harness::start().await;
    let simple = h.post("/v1/chat/completions", &chat("auto", SIMPLE)).await;
    assert_eq!(simple.status, StatusCode::OK, "{:?}", simple.body);
    assert_eq!(simple.header("x-quantrouter-tier"), "int4");
    assert_eq!(simple.header("x-quantrouter-reason"), "utility");
    assert_eq!(simple.header("x-quantrouter-attempts"), "1");
    assert!(simple
        .header("x-quantrouter-complexity")
        .parse::<f64>()
        .is_ok());
    assert!(!simple.header("x-request-id").is_empty());
    let body = simple.json();
    let int4 = h.set.profiles.iter().find(|p| p.tier == "int4").unwrap();
    assert_eq!(
        body["model"],
        int4.model.as_str(),
        "model rewritten to the profile's"
    );
    assert!(!body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .is_empty());

    let code = h.post("/v1/chat/completions", &chat("auto", CODE)).await;
    assert_eq!(code.status, StatusCode::OK);
    assert_ne!(code.header("x-quantrouter-tier"), "int4");
    assert_eq!(
        h.sim("int4").stats().requests,
        1,
        "only the simple prompt reached int4"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_naming_a_profile_pins_it_and_the_header_pins_too() {
    let h = Harness::start().await;
    let r = h
        .post("/v1/chat/completions", &chat("llama8b-fp16", SIMPLE))
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(
        (
            r.header("x-quantrouter-profile"),
            r.header("x-quantrouter-reason")
        ),
        ("llama8b-fp16", "pinned")
    );
    // The served model name pins as well.
    let r = h
        .post(
            "/v1/chat/completions",
            &chat("neuralmagic/Meta-Llama-3.1-8B-Instruct-FP8", SIMPLE),
        )
        .await;
    assert_eq!(r.header("x-quantrouter-profile"), "llama8b-fp8");
    let r = h
        .post_with(
            "/v1/chat/completions",
            &chat("auto", SIMPLE),
            &[
                ("content-type", "application/json"),
                ("x-quantrouter-profile", "llama8b-fp8"),
            ],
        )
        .await;
    assert_eq!(
        (
            r.header("x-quantrouter-profile"),
            r.header("x-quantrouter-reason")
        ),
        ("llama8b-fp8", "pinned")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_headers_override_quality_and_budget() {
    let h = Harness::start().await;
    let r = h
        .post_with(
            "/v1/chat/completions",
            &chat("auto", SIMPLE),
            &[
                ("content-type", "application/json"),
                ("x-quantrouter-min-quality", "0.96"),
            ],
        )
        .await;
    assert_eq!(r.header("x-quantrouter-tier"), "fp16");
    for (name, value) in [
        ("x-quantrouter-min-quality", "1.5"),
        ("x-quantrouter-latency-budget-ms", "-3"),
    ] {
        let r = h
            .post_with(
                "/v1/chat/completions",
                &chat("auto", SIMPLE),
                &[("content-type", "application/json"), (name, value)],
            )
            .await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST);
        assert_eq!(r.json()["error"]["param"], name);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn body_is_forwarded_byte_for_byte_except_the_model() {
    let (url, seen) = support::capture_upstream().await;
    let mut set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
    for p in &mut set.profiles {
        p.upstream = Upstream::Static(StaticUpstream::new(vec![url.clone()]));
    }
    let router = start_router(set, |_| {}).await;
    // Odd spacing, unknown fields, escapes, unicode and a tools array must survive intact.
    let body = "{ \"messages\" : [{\"role\":\"user\",\"content\":\"Say \\\"hi\\\" \\u00e9 ✓\"}],\n  \"model\":\"auto\" ,\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{}}}],\"logprobs\":true,\"top_logprobs\":2,\"x_vendor\":{\"a\":[1,2.50,null]} }";
    let r = send(
        &client(),
        "POST",
        &format!("http://{}/v1/chat/completions", router.public_addr()),
        body,
        &[("content-type", "application/json")],
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    let profile = r.header("x-quantrouter-profile").to_owned();
    let model = ProfileSet::from_json(DEFAULT_PROFILE_SET)
        .unwrap()
        .profile(&profile)
        .unwrap()
        .model
        .clone();
    let expected = body.replace("\"model\":\"auto\"", &format!("\"model\":\"{model}\""));
    let received = seen.lock().unwrap().clone();
    assert_eq!(received.len(), 1);
    assert_eq!(std::str::from_utf8(&received[0].1).unwrap(), expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_pass_through_chunk_by_chunk() {
    let h = Harness::start_with(Duration::from_millis(40), |_| {}).await;
    let body = simple_stream(6);
    let response = h.open("/v1/chat/completions", &body).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    assert_eq!(response.headers()["x-quantrouter-tier"], "int4");
    let mut body = response.into_body();
    let mut text = String::new();
    let mut frames = 0;
    while let Some(frame) = body.frame().await {
        let data = frame.unwrap().into_data().unwrap();
        if frames == 0 {
            // The first chunk arrived while the upstream was still generating: no buffering.
            assert_eq!(
                h.sim("int4").running(),
                1,
                "first chunk must not wait for the whole answer"
            );
        }
        frames += 1;
        text.push_str(std::str::from_utf8(&data).unwrap());
    }
    assert!(frames >= 3, "{frames} frames");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let deltas = text.matches("\"delta\"").count();
    assert!(deltas >= 6, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_clients_are_served_on_the_same_port() {
    let h = Harness::start_with(Duration::from_millis(5), |_| {}).await;
    // Prior knowledge (h2c): this client cannot fall back to HTTP/1.1, so an answer at all
    // means the port spoke HTTP/2.
    let h2 = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build(HttpConnector::new());
    let url = h.url("/v1/chat/completions");
    let json = [("content-type", "application/json")];
    let (simple, stream) = (chat("auto", SIMPLE), simple_stream(4));
    let (plain, streamed, bad) = tokio::join!(
        send(&h2, "POST", &url, &simple, &json),
        send(&h2, "POST", &url, &stream, &json),
        send(&h2, "POST", &url, "{not json", &json),
    );

    assert_eq!(plain.status, StatusCode::OK, "{:?}", plain.body);
    assert_eq!(plain.header("x-quantrouter-tier"), "int4");
    assert!(plain.json()["choices"][0]["message"]["content"].is_string());

    assert_eq!(streamed.status, StatusCode::OK);
    assert_eq!(streamed.header("content-type"), "text/event-stream");
    let text = std::str::from_utf8(&streamed.body).unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    // The role chunk, four tokens and the chunk with `finish_reason`.
    assert_eq!(text.matches("\"delta\"").count(), 1 + 4 + 1, "{text}");

    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    assert_eq!(bad.json()["error"]["type"], "invalid_request_error");
    assert_eq!(h.sim("int4").stats().requests, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_cancels_the_upstream_request() {
    let h = Harness::start_with(Duration::from_millis(200), |_| {}).await;
    let body = simple_stream(50);
    let response = h.open("/v1/chat/completions", &body).await;
    let mut body = response.into_body();
    body.frame().await.unwrap().unwrap();
    drop(body);
    let sim = h.sim("int4");
    assert!(
        eventually(Duration::from_secs(5), || async {
            sim.stats().cancelled == 1
        })
        .await,
        "upstream never saw the cancellation: {:?}",
        sim.stats()
    );
    assert!(
        eventually(Duration::from_secs(5), || async {
            h.router.app.store.load().pools().all(|p| p.inflight() == 0)
        })
        .await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_openai_errors_with_the_right_status() {
    let h = Harness::start_with(Duration::ZERO, |c| c.body_limit = 4096).await;
    let cases: Vec<(&str, String, u16, Option<&str>)> = vec![
        ("malformed json", "{\"model\": \"auto\", ".into(), 400, None),
        ("not an object", "[1, 2]".into(), 400, None),
        (
            "missing model",
            r#"{"messages":[{"role":"user","content":"hi"}]}"#.into(),
            400,
            Some("model"),
        ),
        (
            "missing messages",
            r#"{"model":"auto"}"#.into(),
            400,
            Some("messages"),
        ),
        (
            "empty messages",
            r#"{"model":"auto","messages":[]}"#.into(),
            400,
            Some("messages"),
        ),
        (
            "wrong type",
            r#"{"model":"auto","messages":[{"role":"user","content":"hi"}],"max_tokens":"ten"}"#
                .into(),
            400,
            Some("max_tokens"),
        ),
        (
            "wrong message type",
            r#"{"model":"auto","messages":[{"role":5,"content":"hi"}]}"#.into(),
            400,
            Some("messages[0].role"),
        ),
        (
            "max_tokens zero",
            r#"{"model":"auto","messages":[{"role":"user","content":"hi"}],"max_tokens":0}"#.into(),
            400,
            Some("max_tokens"),
        ),
        (
            "temperature",
            r#"{"model":"auto","messages":[{"role":"user","content":"hi"}],"temperature":3}"#
                .into(),
            400,
            Some("temperature"),
        ),
        (
            "top_p",
            r#"{"model":"auto","messages":[{"role":"user","content":"hi"}],"top_p":0}"#.into(),
            400,
            Some("top_p"),
        ),
        ("unknown model", chat("gpt-9", "hi"), 404, None),
        ("too large", chat("auto", &"x".repeat(5000)), 413, None),
    ];
    for (name, body, status, param) in cases {
        let r = h.post("/v1/chat/completions", &body).await;
        assert_eq!(
            r.status.as_u16(),
            status,
            "{name}: {}",
            String::from_utf8_lossy(&r.body)
        );
        let error = &r.json()["error"];
        assert!(
            error["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{name}"
        );
        assert!(
            error["type"].is_string() && error.get("code").is_some(),
            "{name}"
        );
        if let Some(param) = param {
            assert_eq!(error["param"], param, "{name}");
        }
    }
    let r = h
        .post("/v1/completions", r#"{"model":"auto","prompt":""}"#)
        .await;
    assert_eq!(
        (r.status.as_u16(), r.json()["error"]["param"].as_str()),
        (400, Some("prompt"))
    );
    let r = h
        .post_with(
            "/v1/chat/completions",
            &chat("auto", "hi"),
            &[("content-type", "text/plain")],
        )
        .await;
    assert_eq!(r.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    let r = h.get(&h.url("/v1/chat/completions")).await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
    let r = h.get(&h.url("/nope")).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    // Nothing reached an upstream.
    assert!(h.sims.iter().all(|s| s.stats().requests == 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_are_enforced_when_configured() {
    let h = Harness::start_with(Duration::ZERO, |c| c.api_keys = keys(&["k1"])).await;
    let r = h.post("/v1/chat/completions", &chat("auto", SIMPLE)).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert_eq!(r.json()["error"]["code"], "invalid_api_key");
    // Rejected before its body was read: the connection is closed, and the answer says so,
    // so no client sends its next request into a closing connection.
    assert_eq!(r.header("connection"), "close");
    let auth = [
        ("content-type", "application/json"),
        ("authorization", "Bearer k1"),
    ];
    let r = h
        .post_with("/v1/chat/completions", &chat("auto", SIMPLE), &auth)
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let r = h.get(&h.url("/v1/models")).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    // No body to leave behind: the connection stays open.
    assert_eq!(r.header("connection"), "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_is_down_gives_503_fast() {
    let (_refusing, address) = refusing_address();
    let url = format!("http://{address}");
    let mut set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
    for p in &mut set.profiles {
        p.upstream = Upstream::Static(StaticUpstream::new(vec![url.clone()]));
    }
    let router = start_router(set, |_| {}).await;
    let r = send(
        &client(),
        "POST",
        &format!("http://{}/v1/chat/completions", router.public_addr()),
        &chat("auto", SIMPLE),
        &[("content-type", "application/json")],
    )
    .await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(r.headers.contains_key("retry-after"));
    assert_eq!(r.json()["error"]["code"], "no_healthy_profile");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_route_and_admin_endpoints() {
    let h = Harness::start_with(Duration::ZERO, |c| c.aliases = vec!["gpt-4o".into()]).await;
    let models = h.get(&h.url("/v1/models")).await.json();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(
        ids,
        [
            "auto",
            "gpt-4o",
            "llama8b-fp16",
            "llama8b-fp8",
            "llama8b-awq"
        ]
    );
    // The alias routes adaptively.
    let r = h
        .post("/v1/chat/completions", &chat("gpt-4o", SIMPLE))
        .await;
    assert_eq!(r.header("x-quantrouter-reason"), "utility");

    let before: u64 = h.sims.iter().map(|s| s.stats().requests).sum();
    let route = h.post("/v1/route", &chat("auto", CODE)).await.json();
    for key in [
        "profile",
        "tier",
        "reason",
        "complexity",
        "task_class",
        "estimated_input_tokens",
        "decision_us",
    ] {
        assert!(route.get(key).is_some(), "missing {key}: {route}");
    }
    assert_eq!(route["task_class"], "code");
    let candidates = route["candidates"].as_array().unwrap();
    assert_eq!(candidates.len(), 3);
    let awq = candidates
        .iter()
        .find(|c| c["profile"] == "llama8b-awq")
        .unwrap();
    assert_eq!(
        (awq["feasible"].as_bool(), awq["rejected_because"].as_str()),
        (Some(false), Some("quality_below_required"))
    );
    let completion_route = h
        .post(
            "/v1/route",
            r#"{"model":"auto","prompt":"Once upon a time"}"#,
        )
        .await
        .json();
    assert_eq!(completion_route["tier"], "int4");
    let after: u64 = h.sims.iter().map(|s| s.stats().requests).sum();
    assert_eq!(before, after, "dry runs never call upstream");

    assert_eq!(h.get(&h.admin_url("/healthz")).await.status, StatusCode::OK);
    assert_eq!(h.get(&h.admin_url("/readyz")).await.status, StatusCode::OK);
    let profiles = h.get(&h.admin_url("/admin/profiles")).await.json();
    assert_eq!(
        (profiles["source"].as_str(), profiles["version"].as_u64()),
        (Some("embedded"), Some(1))
    );
    let metrics = String::from_utf8(h.get(&h.admin_url("/metrics")).await.body.to_vec()).unwrap();
    for name in [
        "quantrouter_requests_total",
        "quantrouter_router_overhead_seconds",
        "quantrouter_complexity_score",
        "quantrouter_profile_set_version",
    ] {
        assert!(metrics.contains(name), "{name} missing from /metrics");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_and_multimodal_chat_are_routed() {
    let h = Harness::start().await;
    let r = h
        .post(
            "/v1/completions",
            r#"{"model":"auto","prompt":["Once upon a time"],"max_tokens":5}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json()["object"], "text_completion");
    let body = r#"{"model":"auto","max_tokens":5,"messages":[{"role":"user","content":[
        {"type":"text","text":"What is in this picture?"},
        {"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}]}]}"#;
    let r = h.post("/v1/chat/completions", body).await;
    assert_eq!(
        r.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&r.body)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_an_open_stream_finish() {
    let h = Harness::start_with(Duration::from_millis(30), |_| {}).await;
    let body = simple_stream(10);
    let response = h.open("/v1/chat/completions", &body).await;
    let Harness { router, sims, .. } = h;
    let app = Arc::clone(&router.app);
    let stopping = tokio::spawn(router.shutdown());
    assert!(
        eventually(Duration::from_secs(2), || async { !app.ready() }).await,
        "readiness turns false"
    );
    let text = response.into_body().collect().await.unwrap().to_bytes();
    assert!(String::from_utf8_lossy(&text).contains("[DONE]"));
    stopping.await.unwrap();
    drop(sims);
}
