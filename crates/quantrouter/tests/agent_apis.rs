//! Anthropic Messages and OpenAI Responses through the router: routed like chat, forwarded
//! natively to upstreams that serve them and translated to chat for those that do not,
//! streamed event by event, with fallbacks, quality checks and stored responses.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use quantrouter::server::ServerConfig;
use quantrouter_policy::{StreamCheck, Upstream, UpstreamApi};
use redis::AsyncCommands;
use serde_json::{json, Value};
use support::redis_server::RedisServer;
use support::{client, eventually, send, start_router, Reply, Tiers, CODE, SIMPLE};
use vllm_sim::{Faults, SimConfig};

const FP8: usize = 1;
const INT4: usize = 2;

async fn tiers(native: bool) -> Tiers {
    support::agent_tiers(native, |_| {}).await
}

async fn post(t: &Tiers, path: &str, body: &Value) -> Reply {
    let url = format!("http://{}{path}", t.router.public_addr());
    let headers = [("content-type", "application/json")];
    send(&client(), "POST", &url, &body.to_string(), &headers).await
}

fn message(content: &str, stream: bool) -> Value {
    json!({"model": "auto", "max_tokens": 512, "stream": stream, "system": "Answer briefly.",
        "messages": [{"role": "user", "content": [{"type": "text", "text": content}]}]})
}

fn response(content: &str, stream: bool) -> Value {
    json!({"model": "auto", "stream": stream, "instructions": "Answer briefly.", "input": content})
}

/// The named events of a stream, each checked to carry its name as `type`.
fn events(reply: &Reply) -> Vec<Value> {
    let text = String::from_utf8(reply.body.to_vec()).unwrap();
    assert!(text.ends_with("\n\n"), "{text}");
    text.trim_end()
        .split("\n\n")
        .map(|event| {
            let (name, data) = event
                .strip_prefix("event: ")
                .and_then(|e| e.split_once("\ndata: "))
                .unwrap_or_else(|| panic!("not a named event: {event:?} in {text}"));
            let data: Value = serde_json::from_str(data).unwrap();
            assert_eq!(data["type"], name, "{text}");
            data
        })
        .collect()
}

fn types(events: &[Value]) -> Vec<&str> {
    events.iter().map(|e| e["type"].as_str().unwrap()).collect()
}

/// The text of a Messages stream.
fn streamed_text(events: &[Value]) -> String {
    events
        .iter()
        .filter_map(|e| e["delta"]["text"].as_str())
        .collect()
}

fn check_messages_stream(events: &[Value]) {
    let types = types(events);
    assert_eq!(types[0], "message_start", "{types:?}");
    assert_eq!(types[1], "content_block_start", "{types:?}");
    assert_eq!(&types[types.len() - 2..], ["message_delta", "message_stop"]);
    assert!(types.contains(&"content_block_stop"), "{types:?}");
    assert!(!streamed_text(events).is_empty());
    let delta = &events[events.len() - 2];
    assert_eq!(delta["delta"]["stop_reason"], "end_turn");
    assert!(delta["usage"]["output_tokens"].as_u64().unwrap() > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_go_natively_to_upstreams_that_serve_them() {
    let t = tiers(true).await;
    let reply = post(&t, "/v1/messages", &message(SIMPLE, false)).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    assert_eq!(reply.header("x-quantrouter-tier"), "int4");
    let body = reply.json();
    // The sim's own id: the answer came from its /v1/messages.
    assert!(body["id"].as_str().unwrap().starts_with("msg-"), "{body}");
    assert_eq!(body["model"], t.set.profiles[INT4].model);
    assert_eq!(body["content"][0]["type"], "text");
    assert!(body["usage"]["input_tokens"].as_u64().unwrap() > 0);

    let reply = post(&t, "/v1/messages", &message(SIMPLE, true)).await;
    assert_eq!(reply.header("content-type"), "text/event-stream");
    let events = events(&reply);
    check_messages_stream(&events);
    assert!(events[0]["message"]["id"]
        .as_str()
        .unwrap()
        .starts_with("msg-"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_are_translated_for_chat_only_upstreams() {
    let t = tiers(false).await;
    let reply = post(&t, "/v1/messages", &message(SIMPLE, false)).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    let body = reply.json();
    assert!(body["id"].as_str().unwrap().starts_with("msg_"), "{body}");
    assert_eq!(body["type"], "message");
    assert_eq!(body["stop_reason"], "end_turn");
    assert!(!body["content"][0]["text"].as_str().unwrap().is_empty());
    assert!(body["usage"]["input_tokens"].as_u64().unwrap() > 0);
    assert!(reply
        .headers
        .get("content-length")
        .is_none_or(|len| { len.to_str().unwrap() == reply.body.len().to_string() }));

    let reply = post(&t, "/v1/messages", &message(SIMPLE, true)).await;
    let events = events(&reply);
    check_messages_stream(&events);
    // The prompt's tokens from the start, as Anthropic's `message_start` gives them.
    assert!(
        events[0]["message"]["usage"]["input_tokens"]
            .as_u64()
            .unwrap()
            > 0,
        "{}",
        events[0]
    );
    // The usage the router added for itself arrives as Anthropic's counts, not as a chunk.
    assert!(
        events[events.len() - 2]["usage"]["input_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_use_round_trips_natively_and_translated() {
    for native in [true, false] {
        let t = tiers(native).await;
        let tools = json!([{"name": "get_time", "description": "The time now.",
            "input_schema": {"type": "object", "properties": {}}}]);
        let mut ask = message("What time is it?", false);
        ask["tools"] = tools.clone();
        let reply = post(&t, "/v1/messages", &ask).await.json();
        assert_eq!(reply["stop_reason"], "tool_use", "native={native}: {reply}");
        let call = reply["content"]
            .as_array()
            .unwrap()
            .iter()
            .find(|b| b["type"] == "tool_use")
            .unwrap()
            .clone();
        assert_eq!(call["name"], "get_time");
        ask["messages"] = json!([
            {"role": "user", "content": "What time is it?"},
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": "noon"}]},
        ]);
        let reply = post(&t, "/v1/messages", &ask).await.json();
        assert_eq!(reply["stop_reason"], "end_turn", "native={native}: {reply}");

        let mut streamed = message("What time is it?", true);
        streamed["tools"] = tools;
        let events = events(&post(&t, "/v1/messages", &streamed).await);
        let start = events
            .iter()
            .find(|e| e["type"] == "content_block_start")
            .unwrap();
        assert_eq!(
            start["content_block"]["type"], "tool_use",
            "native={native}"
        );
        assert_eq!(events[events.len() - 2]["delta"]["stop_reason"], "tool_use");

        let call = json!({"model": "auto", "input": "What time is it?",
            "tools": [{"type": "function", "name": "get_time", "parameters": {"type": "object"}}]});
        let reply = post(&t, "/v1/responses", &call).await.json();
        let item = &reply["output"][0];
        assert_eq!(item["type"], "function_call", "native={native}: {reply}");
        if !native {
            // The tools the model was offered, not `[]`.
            assert_eq!(reply["tools"], call["tools"], "{reply}");
        }
        let result = json!({"model": "auto", "input": [
            {"role": "user", "content": "What time is it?"},
            {"type": "function_call", "call_id": item["call_id"], "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": item["call_id"], "output": "noon"},
        ]});
        let reply = post(&t, "/v1/responses", &result).await.json();
        assert_eq!(
            reply["output"][0]["type"], "message",
            "native={native}: {reply}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_are_served_natively_and_translated_streamed_and_not() {
    for native in [true, false] {
        let t = tiers(native).await;
        let reply = post(&t, "/v1/responses", &response(SIMPLE, false)).await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        let body = reply.json();
        let prefix = if native { "resp-" } else { "resp_" };
        assert!(body["id"].as_str().unwrap().starts_with(prefix), "{body}");
        assert_eq!(body["object"], "response");
        assert_eq!(body["status"], "completed");
        let text = body["output"][0]["content"][0]["text"].as_str().unwrap();
        assert!(!text.is_empty());
        assert!(body["usage"]["output_tokens"].as_u64().unwrap() > 0);

        let reply = post(&t, "/v1/responses", &response(SIMPLE, true)).await;
        let events = events(&reply);
        let types = types(&events);
        assert_eq!(
            &types[..2],
            ["response.created", "response.in_progress"],
            "{types:?}"
        );
        assert_eq!(types.last(), Some(&"response.completed"));
        for (i, event) in events.iter().enumerate() {
            assert_eq!(event["sequence_number"], i as u64, "native={native}");
        }
        let deltas: String = events
            .iter()
            .filter(|e| e["type"] == "response.output_text.delta")
            .map(|e| e["delta"].as_str().unwrap())
            .collect();
        let done = &events.last().unwrap()["response"];
        assert_eq!(done["output"][0]["content"][0]["text"], deltas);
        assert!(done["usage"]["input_tokens"].as_u64().unwrap() > 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_cannot_be_translated_is_refused_in_each_apis_error_shape() {
    let t = tiers(false).await;
    let mut document = message(SIMPLE, false);
    document["messages"][0]["content"] = json!([{"type": "document", "source": {}}]);
    let reply = post(&t, "/v1/messages", &document).await;
    assert_eq!(reply.status, 400);
    assert_eq!(reply.header("x-should-retry"), "false");
    let body = reply.json();
    assert_eq!(body["type"], "error");
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("document"),
        "{body}"
    );

    let mut search = response(SIMPLE, false);
    search["tools"] = json!([{"type": "file_search", "vector_store_ids": ["vs"]}]);
    let reply = post(&t, "/v1/responses", &search).await;
    assert_eq!(reply.status, 400);
    assert!(reply.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("file_search"));
    assert_eq!(t.requests(INT4) + t.requests(FP8), 0, "nothing was sent");

    // Hosted web search and namespaces are left out, and the answer says so.
    let mut hosted = response(SIMPLE, false);
    hosted["tools"] = json!([{"type": "web_search"},
        {"type": "namespace", "name": "multi_agent_v1", "tools": []}]);
    let reply = post(&t, "/v1/responses", &hosted).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    assert_eq!(
        reply.header("x-quantrouter-dropped-tools"),
        "web_search, multi_agent_v1"
    );
    assert_eq!(reply.json()["tools"], json!([]));
    let mut hosted = message(SIMPLE, false);
    hosted["tools"] = json!([{"type": "web_search_20250305", "name": "web_search"}]);
    let reply = post(&t, "/v1/messages", &hosted).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    assert_eq!(reply.header("x-quantrouter-dropped-tools"), "web_search");

    // The router's own errors on /v1/messages are Anthropic's too.
    let mut unknown = message(SIMPLE, false);
    unknown["model"] = json!("no-such-model");
    let reply = post(&t, "/v1/messages", &unknown).await;
    assert_eq!(reply.status, 404);
    assert_eq!(reply.json()["error"]["type"], "not_found_error");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_tier_falls_back_across_tiers_for_both_apis() {
    for native in [true, false] {
        let t = tiers(native).await;
        t.sims[INT4][0].set_faults(Faults {
            error_rate: 1.0,
            error_status: 503,
            ..Faults::default()
        });
        let reply = post(&t, "/v1/messages", &message(SIMPLE, true)).await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.header("x-quantrouter-reason"), "fallback_error");
        check_messages_stream(&events(&reply));
        let reply = post(&t, "/v1/responses", &response(SIMPLE, false)).await;
        assert_eq!(reply.status, 200);
        assert_ne!(reply.header("x-quantrouter-tier"), "int4");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn degenerate_answers_fail_the_quality_checks_in_every_api() {
    for native in [true, false] {
        let t = Tiers::start(
            [1, 1, 1],
            |_| SimConfig {
                chat_only: !native,
                ..SimConfig::default()
            },
            |set| {
                set.policy.stream_check = Some(StreamCheck {
                    tokens: 8,
                    max_hold_ms: 5_000,
                });
                for profile in &mut set.profiles {
                    if let (true, Upstream::Static(upstream)) = (native, &mut profile.upstream) {
                        upstream
                            .apis
                            .extend([UpstreamApi::Messages, UpstreamApi::Responses]);
                    }
                }
            },
            |_| {},
        )
        .await;
        t.sims[INT4][0].set_faults(Faults {
            degenerate: true,
            ..Faults::default()
        });
        for (path, body) in [
            ("/v1/messages", message(SIMPLE, false)),
            ("/v1/messages", message(SIMPLE, true)),
            ("/v1/responses", response(SIMPLE, false)),
            ("/v1/responses", response(SIMPLE, true)),
        ] {
            let reply = post(&t, path, &body).await;
            assert_eq!(reply.status, 200);
            assert_eq!(
                reply.header("x-quantrouter-reason"),
                "fallback_quality",
                "native={native} {path} stream={}",
                body["stream"]
            );
            assert_eq!(reply.header("x-quantrouter-tier"), "fp8");
        }
        // A tool call is an answer the text checks pass.
        let mut call = message("What time is it?", false);
        call["tools"] = json!([{"name": "get_time", "input_schema": {"type": "object"}}]);
        let reply = post(&t, "/v1/messages", &call).await;
        assert_eq!(
            reply.header("x-quantrouter-tier"),
            "int4",
            "native={native}"
        );
        assert_eq!(reply.json()["stop_reason"], "tool_use");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follow_up_goes_to_the_profile_that_stored_the_response() {
    let t = tiers(true).await;
    let first = post(&t, "/v1/responses", &response(SIMPLE, false)).await;
    assert_eq!(first.header("x-quantrouter-tier"), "int4");
    let id = first.json()["id"].as_str().unwrap().to_owned();
    // Alone, this prompt routes to a better tier; as a follow-up it must reach int4's sim,
    // the only one that knows the response (any other answers 400).
    let alone = post(&t, "/v1/responses", &response(CODE, false)).await;
    assert_ne!(alone.header("x-quantrouter-tier"), "int4");
    let mut follow = response(CODE, true);
    follow["previous_response_id"] = json!(id);
    let reply = post(&t, "/v1/responses", &follow).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    assert_eq!(reply.header("x-quantrouter-tier"), "int4");
    let events = events(&reply);
    assert_eq!(
        events.last().unwrap()["response"]["previous_response_id"],
        id.as_str()
    );

    let url = format!("http://{}/v1/responses/{id}", t.router.public_addr());
    let stored = send(&client(), "GET", &url, "", &[]).await;
    assert_eq!(stored.status, 200);
    assert_eq!(stored.json()["id"], id.as_str());

    let mut unknown = response(SIMPLE, false);
    unknown["previous_response_id"] = json!("resp-unknown");
    let reply = post(&t, "/v1/responses", &unknown).await;
    assert_eq!(reply.status, 404);
    assert_eq!(reply.json()["error"]["code"], "response_not_found");

    let deleted = send(&client(), "DELETE", &url, "", &[]).await;
    assert_eq!(deleted.json()["deleted"], true);
    assert_eq!(send(&client(), "GET", &url, "", &[]).await.status, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_stored_responses_through_redis_and_not_without_it() {
    let redis = RedisServer::start(None);
    let shared = |c: &mut ServerConfig| {
        c.stored_responses.redis = Some((redis.handle(), "qr".into()));
    };
    let native = |set: &mut quantrouter_policy::ProfileSet| {
        for profile in &mut set.profiles {
            if let Upstream::Static(upstream) = &mut profile.upstream {
                upstream
                    .apis
                    .extend([UpstreamApi::Messages, UpstreamApi::Responses]);
            }
        }
    };
    let t = Tiers::start([1, 1, 1], |_| SimConfig::default(), native, shared).await;
    let other = start_router(t.set.clone(), shared).await;
    let alone = start_router(t.set.clone(), |_| {}).await;

    let first = post(&t, "/v1/responses", &response(SIMPLE, false)).await;
    let id = first.json()["id"].as_str().unwrap().to_owned();
    let key = format!("qr:responses:{id}");
    let mut conn = redis
        .client()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let stored = eventually(Duration::from_secs(5), || {
        let mut conn = conn.clone();
        let key = key.clone();
        async move { conn.exists::<_, bool>(&key).await.unwrap() }
    })
    .await;
    assert!(stored, "the placement reached redis");
    // The profile that stored it, and no tenant: this router has none.
    let record: Value = serde_json::from_str(&conn.get::<_, String>(&key).await.unwrap()).unwrap();
    assert_eq!(record, json!({"profile": t.set.profiles[INT4].id}));
    assert!(conn.ttl::<_, i64>(&key).await.unwrap() > 0);

    let mut follow = response(CODE, false);
    follow["previous_response_id"] = json!(id);
    let headers = [("content-type", "application/json")];
    let via = |server: &quantrouter::server::Server| {
        format!("http://{}/v1/responses", server.public_addr())
    };
    let reply = send(
        &client(),
        "POST",
        &via(&other),
        &follow.to_string(),
        &headers,
    )
    .await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    assert_eq!(reply.header("x-quantrouter-tier"), "int4");
    // A replica without the shared store cannot place it, and says so.
    let reply = send(
        &client(),
        "POST",
        &via(&alone),
        &follow.to_string(),
        &headers,
    )
    .await;
    assert_eq!(reply.status, 404);
    assert_eq!(reply.json()["error"]["code"], "response_not_found");
}

/// The official `anthropic` and `openai` Python clients against the router
/// (`scripts/install-tools openai anthropic`; `QUANTROUTER_PYTHON` points at the venv).
async fn official_clients(t: &Tiers, extra: &[&str]) {
    let python = support::python();
    let script =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/agents_compat.py");
    let output = tokio::process::Command::new(python)
        .arg(script)
        .arg(format!("http://{}", t.router.public_addr()))
        .args(extra)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("{stdout}");
    assert!(
        output.status.success() && stdout.contains("checks passed"),
        "agent clients failed:\n{stdout}\n{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_clients_work_against_native_upstreams() {
    let t = tiers(true).await;
    official_clients(&t, &["--stateful"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_clients_work_against_chat_only_upstreams() {
    let t = tiers(false).await;
    official_clients(&t, &["--translated"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_clients_authenticate_with_x_api_key() {
    let t = Tiers::start(
        [1, 1, 1],
        |_| SimConfig::default(),
        |_| {},
        |c| c.api_keys = support::keys(&["test-key"]),
    )
    .await;
    let url = format!("http://{}/v1/messages", t.router.public_addr());
    let body = message(SIMPLE, false).to_string();
    let json = ("content-type", "application/json");
    let reply = send(
        &client(),
        "POST",
        &url,
        &body,
        &[json, ("x-api-key", "test-key")],
    )
    .await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    let reply = send(
        &client(),
        "POST",
        &url,
        &body,
        &[json, ("x-api-key", "wrong")],
    )
    .await;
    assert_eq!(reply.status, 401);
    assert_eq!(reply.json()["error"]["type"], "authentication_error");
    let bearer = ("authorization", "Bearer test-key");
    let reply = send(&client(), "POST", &url, &body, &[json, bearer]).await;
    assert_eq!(reply.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_translated_stream_is_relayed_as_it_comes_not_when_it_ends() {
    use http_body_util::{BodyExt, Full};
    // The first token comes a minute after the role chunk: a translation that held the
    // stream would send nothing for a minute.
    let t = Tiers::start(
        [1, 1, 1],
        |_| SimConfig {
            chat_only: true,
            itl: Duration::from_secs(60),
            ..SimConfig::default()
        },
        |_| {},
        |_| {},
    )
    .await;
    for (path, body) in [
        ("/v1/messages", message(SIMPLE, true)),
        ("/v1/responses", response(SIMPLE, true)),
    ] {
        let url = format!("http://{}{path}", t.router.public_addr());
        let request = http::Request::post(url)
            .header("content-type", "application/json")
            .body(Full::new(bytes::Bytes::from(body.to_string())))
            .unwrap();
        let response = client().request(request).await.unwrap();
        assert_eq!(response.status(), 200);
        let mut body = response.into_body();
        let first = tokio::time::timeout(Duration::from_secs(20), body.frame())
            .await
            .expect("the stream's start within 20 s, long before its end")
            .unwrap()
            .unwrap()
            .into_data()
            .unwrap();
        let first = String::from_utf8_lossy(&first);
        let opening = if path == "/v1/messages" {
            "event: message_start"
        } else {
            "event: response.created"
        };
        assert!(first.starts_with(opening), "{first}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_cut_short_ends_with_the_apis_error_event() {
    for native in [true, false] {
        let t = tiers(native).await;
        for sim in t.sims.iter().flatten() {
            sim.set_faults(Faults {
                reset_after_chunks: Some(6),
                ..Faults::default()
            });
        }
        let reply = post(&t, "/v1/messages", &message(SIMPLE, true)).await;
        let seen = events(&reply);
        let last = seen.last().unwrap();
        assert_eq!(last["type"], "error", "native={native}: {seen:?}");
        assert_eq!(last["error"]["type"], "api_error");
        assert!(!last["error"]["message"].as_str().unwrap().is_empty());
        assert_eq!(seen[0]["type"], "message_start");

        let reply = post(&t, "/v1/responses", &response(SIMPLE, true)).await;
        let seen = events(&reply);
        let last = seen.last().unwrap();
        assert_eq!(last["type"], "error", "native={native}: {seen:?}");
        assert!(!last["message"].as_str().unwrap().is_empty());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_over_its_rate_is_refused_in_each_apis_shape() {
    let dir = tempfile::tempdir().unwrap();
    let doc = json!({"version": 1, "tenants": [{"id": "agents",
        "key_sha256": [quantrouter_policy::hash_key("sk-agents")],
        "limits": {"requests_per_minute": 2}}]});
    let tenants = support::file_tenants(dir.path(), &doc).await;
    let t = Tiers::start(
        [1, 1, 1],
        |_| SimConfig::default(),
        |_| {},
        |c| c.tenants = Some(tenants),
    )
    .await;
    let json = ("content-type", "application/json");
    let send_as = |path: &str, body: Value, key: (&'static str, &'static str)| {
        let url = format!("http://{}{path}", t.router.public_addr());
        async move { send(&client(), "POST", &url, &body.to_string(), &[json, key]).await }
    };
    let anthropic_key = ("x-api-key", "sk-agents");
    let bearer = ("authorization", "Bearer sk-agents");
    let first = send_as("/v1/messages", message(SIMPLE, false), anthropic_key).await;
    assert_eq!(first.status, 200, "{:?}", first.body);
    let second = send_as("/v1/responses", response(SIMPLE, false), bearer).await;
    assert_eq!(second.status, 200, "{:?}", second.body);

    let refused = send_as("/v1/messages", message(SIMPLE, false), anthropic_key).await;
    assert_eq!(refused.status, 429, "{:?}", refused.body);
    assert_eq!(refused.json()["type"], "error");
    assert_eq!(refused.json()["error"]["type"], "rate_limit_error");
    assert!(!refused.header("retry-after").is_empty());
    assert_eq!(refused.header("x-should-retry"), "true");
    let refused = send_as("/v1/responses", response(SIMPLE, false), bearer).await;
    assert_eq!(refused.status, 429, "{:?}", refused.body);
    assert_eq!(refused.json()["error"]["code"], "rate_limit_exceeded");
    // Neither refusal reached an upstream.
    assert_eq!((0..3).map(|p| t.requests(p)).sum::<u64>(), 2);
}

/// A chat upstream (with `upstream.apis` left at chat) for edge cases: a prompt holding
/// "cut me off" is streamed for five chunks and then the body ends cleanly, with no
/// `finish_reason` and no `[DONE]`, as a crashed server behind a proxy ends one; any other
/// request is answered with the `max_tokens` it was sent, as its text.
async fn edge_upstream() -> Tiers {
    let (url, _) = support::scripted_upstream(|request| {
        let id = json!({"id": "chatcmpl-edge", "object": "chat.completion.chunk", "model": "m"});
        let chunk = |delta: Value, finish: Value| {
            let mut chunk = id.clone();
            chunk["choices"] = json!([{"index": 0, "delta": delta, "finish_reason": finish}]);
            format!("data: {chunk}\n\n")
        };
        let text = format!("max_tokens={}", request["max_tokens"]);
        let stream = request["stream"] == true;
        let sse = "text/event-stream";
        if request["messages"].to_string().contains("cut me off") {
            let words = ["Once", " upon", " a", " time", ","];
            let cut: String = words
                .iter()
                .map(|w| chunk(json!({"content": w}), Value::Null))
                .collect();
            return (http::StatusCode::OK, sse, cut);
        }
        if stream {
            let usage = json!({"id": "chatcmpl-edge", "choices": [],
                "usage": {"prompt_tokens": 7, "completion_tokens": 1}});
            let whole = chunk(json!({"role": "assistant", "content": text}), Value::Null)
                + &chunk(json!({}), json!("stop"))
                + &format!("data: {usage}\n\ndata: [DONE]\n\n");
            return (http::StatusCode::OK, sse, whole);
        }
        let answer = json!({"id": "chatcmpl-edge", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 1}});
        (http::StatusCode::OK, "application/json", answer.to_string())
    })
    .await;
    Tiers::start(
        [0, 0, 0],
        |_| SimConfig::default(),
        move |set| {
            for profile in &mut set.profiles {
                profile.upstream = serde_json::from_value(json!({"urls": [url]})).unwrap();
            }
        },
        |_| {},
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_ends_without_a_finish_is_an_error_in_both_apis() {
    let t = edge_upstream().await;
    let seen = events(&post(&t, "/v1/messages", &message("cut me off", true)).await);
    let names = types(&seen);
    assert_eq!(names[0], "message_start");
    assert_eq!(names.last(), Some(&"error"), "{names:?}");
    assert!(!names.contains(&"message_stop"), "{names:?}");
    assert_eq!(seen.last().unwrap()["error"]["type"], "api_error");

    let seen = events(&post(&t, "/v1/responses", &response("cut me off", true)).await);
    let names = types(&seen);
    assert_eq!(names.last(), Some(&"error"), "{names:?}");
    assert!(!names.contains(&"response.completed"), "{names:?}");
    assert_eq!(seen.last().unwrap()["code"], "stream_truncated");

    // The official clients see an error, never a finished answer.
    official_clients(&t, &["--truncated"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agents_large_ceiling_is_routed_by_the_policy_and_cut_to_each_context() {
    let t = edge_upstream().await;
    let context = t.set.profiles[INT4].max_context_tokens;
    let sent = |reply: &Reply, text: &str| -> u32 {
        let n = text.strip_prefix("max_tokens=").unwrap().parse().unwrap();
        assert_eq!(reply.header("x-quantrouter-reason"), "utility", "{text}");
        n
    };
    // Claude Code's ceiling, far above every profile's context.
    let mut ask = message(SIMPLE, false);
    ask["max_tokens"] = json!(32_000);
    let reply = post(&t, "/v1/messages", &ask).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    let text = reply.json()["content"][0]["text"]
        .as_str()
        .unwrap()
        .to_owned();
    let n = sent(&reply, &text);
    assert!(n < context && n > context - 100, "{n} within {context}");
    // A ceiling the context holds is sent as it is.
    ask["max_tokens"] = json!(300);
    let reply = post(&t, "/v1/messages", &ask).await;
    let text = reply.json()["content"][0]["text"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(sent(&reply, &text), 300);

    let mut ask = response(SIMPLE, false);
    ask["max_output_tokens"] = json!(100_000);
    let reply = post(&t, "/v1/responses", &ask).await;
    let text = reply.json()["output"][0]["content"][0]["text"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(sent(&reply, &text) < context);

    // Chat keeps OpenAI's reading: a limit no context holds fits no profile.
    let chat = json!({"model": "auto", "max_tokens": 32_000,
        "messages": [{"role": "user", "content": SIMPLE}]});
    let reply = post(&t, "/v1/chat/completions", &chat).await;
    assert_eq!(reply.header("x-quantrouter-reason"), "constraints_unmet");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_say_whether_to_retry_and_count_tokens_is_served() {
    let t = Tiers::start(
        [1, 1, 1],
        |_| SimConfig {
            chat_only: true,
            ..SimConfig::default()
        },
        |_| {},
        |c| c.api_keys = support::keys(&["test-key"]),
    )
    .await;
    let json_type = ("content-type", "application/json");
    let key = ("x-api-key", "test-key");
    let at = |path: &str| format!("http://{}{path}", t.router.public_addr());
    let call = |path: &'static str, body: Value, key: (&'static str, &'static str)| {
        let url = at(path);
        async move {
            send(
                &client(),
                "POST",
                &url,
                &body.to_string(),
                &[json_type, key],
            )
            .await
        }
    };
    // Anthropic requires max_tokens, and so does the router.
    let mut unbounded = message(SIMPLE, false);
    unbounded.as_object_mut().unwrap().remove("max_tokens");
    let reply = call("/v1/messages", unbounded.clone(), key).await;
    assert_eq!(reply.status, 400, "{:?}", reply.body);
    assert_eq!(reply.json()["type"], "error");
    assert_eq!(reply.json()["error"]["type"], "invalid_request_error");
    assert!(reply.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("max_tokens"));
    assert_eq!(reply.header("x-should-retry"), "false");
    assert_eq!((0..3).map(|p| t.requests(p)).sum::<u64>(), 0);

    let wrong = ("x-api-key", "wrong");
    let reply = call("/v1/messages", message(SIMPLE, false), wrong).await;
    assert_eq!(reply.status, 401);
    assert_eq!(reply.header("x-should-retry"), "false");
    let bearer = ("authorization", "Bearer wrong");
    let reply = call("/v1/responses", response(SIMPLE, false), bearer).await;
    assert_eq!(reply.status, 401);
    assert_eq!(reply.header("x-should-retry"), "false");
    let mut unknown = response(SIMPLE, false);
    unknown["model"] = json!("no-such-model");
    let reply = call(
        "/v1/responses",
        unknown,
        ("authorization", "Bearer test-key"),
    )
    .await;
    assert_eq!(reply.status, 404);
    assert_eq!(reply.header("x-should-retry"), "false");

    // count_tokens: an estimate, in Anthropic's shape, growing with the prompt and tools.
    let count = |body: Value| call("/v1/messages/count_tokens", body, key);
    let short = count(unbounded.clone()).await;
    assert_eq!(short.status, 200, "{:?}", short.body);
    let short = short.json()["input_tokens"].as_u64().unwrap();
    assert!(short > 0);
    let mut long = message(&"word ".repeat(400), false);
    long["tools"] = json!([{"name": "get_time", "description": "The time now.",
        "input_schema": {"type": "object", "properties": {}}}]);
    let long = count(long).await.json()["input_tokens"].as_u64().unwrap();
    assert!(long > short + 400, "{short} then {long}");
    let refused = call("/v1/messages/count_tokens", unbounded, wrong).await;
    assert_eq!(refused.status, 401);
    assert_eq!(refused.json()["error"]["type"], "authentication_error");
    assert_eq!(
        (0..3).map(|p| t.requests(p)).sum::<u64>(),
        0,
        "nothing was sent"
    );
}

/// An upstream that answers every `POST` with `events`, an SSE stream, and then keeps the
/// body open, as a server does between its last event and the end of its body; `GET`s
/// (probes) get an empty 200.
async fn lingering_upstream(events: &'static str) -> String {
    use http_body_util::{BodyExt as _, Full, StreamBody};
    let listener = tokio::net::TcpListener::bind(support::loopback())
        .await
        .unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let service = hyper::service::service_fn(move |req: http::Request<_>| async move {
                type Frames = std::convert::Infallible;
                let body = match req.method() == http::Method::POST {
                    true => {
                        let first = hyper::body::Frame::data(bytes::Bytes::from(events));
                        let frames = futures_util::stream::iter([Ok::<_, Frames>(first)]);
                        let open =
                            futures_util::StreamExt::chain(frames, futures_util::stream::pending());
                        StreamBody::new(open).boxed()
                    }
                    false => Full::new(bytes::Bytes::new()).boxed(),
                };
                let mut response = http::Response::new(body);
                response.headers_mut().insert(
                    http::header::CONTENT_TYPE,
                    http::HeaderValue::from_static("text/event-stream"),
                );
                Ok::<_, Frames>(response)
            });
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service),
            );
        }
    });
    url
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_left_after_its_last_event_is_charged_the_upstreams_count() {
    use http_body_util::BodyExt as _;
    // Counts no estimate could reach from a two-word prompt.
    const EVENTS: &str = concat!(
        "event: response.created\ndata: {\"type\":\"response.created\",\"response\":",
        "{\"id\":\"resp_linger\",\"status\":\"in_progress\",\"output\":[],\"usage\":null}}\n\n",
        "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",",
        "\"item_id\":\"msg_1\",\"output_index\":0,\"content_index\":0,\"delta\":\"Hi\"}\n\n",
        "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":",
        "{\"id\":\"resp_linger\",\"status\":\"completed\",\"store\":false,\"output\":[],",
        "\"usage\":{\"input_tokens\":1234,\"output_tokens\":56,\"total_tokens\":1290}}}\n\n",
    );
    let url = lingering_upstream(EVENTS).await;
    let dir = tempfile::tempdir().unwrap();
    let key = "sk-lingering-3Qe7";
    let doc = json!({"version": 1, "tenants": [{"id": "team", "key_sha256": [quantrouter_policy::hash_key(key)],
        "limits": {"tokens_per_minute": 1_000_000}}]});
    let tenants = support::file_tenants(dir.path(), &doc).await;
    let t = Tiers::start(
        [0, 0, 0],
        |_| SimConfig::default(),
        move |set| {
            for profile in &mut set.profiles {
                profile.upstream =
                    serde_json::from_value(json!({"urls": [url], "apis": ["chat", "responses"]}))
                        .unwrap();
            }
        },
        |c| c.tenants = Some(tenants),
    )
    .await;
    let request = http::Request::post(format!("http://{}/v1/responses", t.router.public_addr()))
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {key}"))
        .body(http_body_util::Full::new(bytes::Bytes::from(
            response("Say hi", true).to_string(),
        )))
        .unwrap();
    let mut answer = client().request(request).await.unwrap();
    assert_eq!(answer.status(), 200);
    // Read up to the last event, then leave: the body never ended.
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("\"response.completed\"") {
        let frame = answer.body_mut().frame().await.unwrap().unwrap();
        seen.extend_from_slice(&frame.into_data().unwrap());
    }
    drop(answer);
    let admin = format!("http://{}/admin/tenants", t.router.admin_addr());
    let charged = || async {
        let report = send(&client(), "GET", &admin, "", &[]).await.json();
        report["tenants"][0]["usage"]["tokens_this_minute"].as_u64()
    };
    let exact = eventually(Duration::from_secs(10), || async {
        charged().await == Some(1234 + 56)
    })
    .await;
    assert!(
        exact,
        "charged {:?}, not the upstream's 1290",
        charged().await
    );
}
