//! Streams that outlive their upstream (`policy.stream_resume`), over real processes: a
//! vllm-sim process killed mid-stream (SIGKILL), and simulators whose streams end without a
//! finish, stall past the idle timeout or send an error event. The official `openai` client
//! reads one well-formed stream to its full length, the continuing endpoint's request holds
//! the delivered text, and the tenant, the tokens and the resume metric count the answer
//! once. With `max_resumes: 0` the stream ends with the error event it always did.
//!
//! Every simulator serves one model with one seed, so the healthy one's answer, asked
//! directly, is the uninterrupted answer the resumed stream must equal. llama.cpp's
//! `llama-server`, greedy on a tiny model whose next token depends on the last one alone,
//! continues through its assistant prefill to the very answer it gives uninterrupted.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use quantrouter::profiles::SourceKind;
use quantrouter::resilience::BudgetConfig;
use quantrouter::server::{Server, ServerConfig};
use quantrouter::tenants::limiter::LimiterConfig;
use quantrouter::traces::Traces;
use quantrouter_policy::{ProfileSet, StaticUpstream, Upstream, DEFAULT_PROFILE_SET};
use serde_json::{json, Value};
use support::llama::LlamaServer;
use support::otlp::{attribute, hex, otlp_receiver};
use support::redis_server::RedisServer;
use support::sim_process::{serve_when_spawned, SimProcess};
use support::{client, eventually, loopback, send, start_router, SIMPLE};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::net::TcpStream;
use tokio::process::{Child, ChildStdin, ChildStdout};
use vllm_sim::{Faults, SimConfig, SimServer, StreamBreak};

const KEY: &str = "sk-resume-7Qm2";
const MODEL: &str = "shared-model";
/// The key prefix of the tenants' counters in Redis.
const PREFIX: &str = "qr-resume";

/// A router over `set` for the tenant `team` (key [`KEY`], counted locally in a fixed
/// minute), with an idle timeout of a second, so a stalled stream breaks quickly.
async fn router(set: ProfileSet) -> (Server, tempfile::TempDir) {
    let team = json!({"id": "team", "limits": {"tokens_per_minute": 1_000_000}});
    router_with(set, team, None, |_| {}).await
}

/// [`router`] for `tenant` (its key [`KEY`]), counted in `redis` if given, with `tweak`
/// to the configuration.
async fn router_with(
    set: ProfileSet,
    mut tenant: Value,
    redis: Option<&RedisServer>,
    tweak: impl FnOnce(&mut ServerConfig),
) -> (Server, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    tenant["key_sha256"] = json!([quantrouter_policy::hash_key(KEY)]);
    let doc = json!({"version": 1, "tenants": [tenant]});
    let shared = redis.map(|redis| (redis.handle(), PREFIX.to_owned()));
    let mut limiter = LimiterConfig::new(shared, "replica-0".to_owned());
    // A loaded machine's Redis is slow now and then; the request waits rather than being
    // counted locally.
    limiter.redis_timeout = Duration::from_secs(2);
    let tenants =
        support::tenants_counted_by(dir.path(), &doc.to_string(), limiter, 4_102_444_800_000).await;
    let router = start_router(set, |c| {
        c.tenants = Some(tenants);
        c.resilience.idle_timeout = Duration::from_secs(1);
        tweak(c);
    })
    .await;
    (router, dir)
}

/// The default profile set with every profile serving [`MODEL`] at `urls`, by profile id,
/// each id prefixed with `test` (tests share one process's metrics).
fn profile_set(test: &str, urls: &[(&str, Vec<String>)]) -> ProfileSet {
    let mut set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
    for profile in &mut set.profiles {
        profile.model = MODEL.to_owned();
        let (_, at) = urls.iter().find(|(id, _)| *id == profile.id).unwrap();
        profile.upstream = Upstream::Static(StaticUpstream::new(at.clone()));
        profile.id = format!("{test}-{}", profile.id);
    }
    set.default_profile = format!("{test}-{}", set.default_profile);
    set
}

/// The official `openai` client, reading streams one request line at a time.
struct OpenAiClient {
    child: Child,
    stdin: ChildStdin,
    stdout: Lines<BufReader<ChildStdout>>,
}

impl OpenAiClient {
    fn start(router: &Server) -> Self {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/stream_resume.py");
        let mut child = tokio::process::Command::new(support::python())
            .arg(script)
            .arg(format!("http://{}/v1", router.public_addr()))
            .env("OPENAI_API_KEY", KEY)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap()).lines();
        Self {
            child,
            stdin,
            stdout,
        }
    }

    async fn send(&mut self, api: &str, body: &Value) {
        let line = format!("{}\n", json!({"api": api, "body": body}));
        self.stdin.write_all(line.as_bytes()).await.unwrap();
    }

    /// What the client saw of the stream sent last.
    async fn seen(&mut self) -> Value {
        let line = tokio::time::timeout(Duration::from_secs(60), self.stdout.next_line());
        match line
            .await
            .expect("the client answers within a minute")
            .unwrap()
        {
            Some(line) => serde_json::from_str(&line).unwrap(),
            None => panic!("the client exited: {:?}", self.child.wait().await),
        }
    }

    async fn stream(&mut self, api: &str, body: &Value) -> Value {
        self.send(api, body).await;
        self.seen().await
    }
}

/// A chat request of `max_tokens`, as the client sends it: the simulators generate exactly
/// that many tokens (`ignore_eos`), so the answer's length is known.
fn chat(model: &str, max_tokens: u32) -> Value {
    json!({"model": model, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": SIMPLE}],
        "stream_options": {"include_usage": true},
        "extra_body": {"ignore_eos": true}})
}

/// `request` as it goes over the wire: the client's `extra_body` merged in.
fn on_the_wire(request: &Value) -> Value {
    let mut body = request.clone();
    let fields = body.as_object_mut().unwrap();
    if let Some(Value::Object(extra)) = fields.remove("extra_body") {
        fields.extend(extra);
    }
    body
}

/// The same request sent whole, straight to a simulator: the uninterrupted answer.
async fn uninterrupted(url: &str, request: &Value) -> Value {
    let mut body = on_the_wire(request);
    body.as_object_mut().unwrap().remove("stream_options");
    body["model"] = json!(MODEL);
    let path = match body.get("messages") {
        Some(_) => "/v1/chat/completions",
        None => "/v1/completions",
    };
    let headers = [("content-type", "application/json")];
    let reply = send(
        &client(),
        "POST",
        &format!("{url}{path}"),
        &body.to_string(),
        &headers,
    )
    .await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    reply.json()
}

fn answer_text(answer: &Value) -> &str {
    let choice = &answer["choices"][0];
    choice["message"]["content"]
        .as_str()
        .or(choice["text"].as_str())
        .unwrap()
}

/// The last request a simulator got (the continuation), as JSON.
async fn last_request(url: &str) -> Value {
    let reply = send(
        &client(),
        "GET",
        &format!("{url}/sim/last-request"),
        "",
        &[],
    )
    .await;
    assert_eq!(reply.status, 200);
    reply.json()
}

/// A sample of the router's `/metrics`, 0 when absent.
async fn metric(router: &Server, name: &str, labels: &[&str]) -> f64 {
    let url = format!("http://{}/metrics", router.admin_addr());
    let page = send(&client(), "GET", &url, "", &[]).await;
    String::from_utf8_lossy(&page.body)
        .lines()
        .find(|l| l.starts_with(&format!("{name}{{")) && labels.iter().all(|x| l.contains(x)))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

/// The tenant's tokens this minute.
async fn tenant_tokens(router: &Server) -> u64 {
    let url = format!("http://{}/admin/tenants", router.admin_addr());
    let report = send(&client(), "GET", &url, "", &[]).await.json();
    report["tenants"][0]["usage"]["tokens_this_minute"]
        .as_u64()
        .unwrap()
}

/// The client read one well-formed stream: `text`, one finish, one id, one choice.
fn assert_whole(seen: &Value, text: &str, finish: &str) {
    assert_eq!(seen["error"], Value::Null, "{seen}");
    assert_eq!(seen["text"], text, "{seen}");
    assert_eq!(seen["finish_reasons"], json!([finish]), "{seen}");
    assert_eq!(seen["ids"].as_array().unwrap().len(), 1, "{seen}");
    assert_eq!(seen["indexes"], json!([0]), "{seen}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_sim_process_is_killed_reaches_the_openai_client_whole() {
    serve_when_spawned().await;
    const TEST: &str = "a_stream_whose_sim_process_is_killed_reaches_the_openai_client_whole";
    let itl = Duration::from_millis(20);
    let mut sims = [
        SimProcess::spawn(TEST, MODEL, itl).await,
        SimProcess::spawn(TEST, MODEL, itl).await,
    ];
    let both: Vec<String> = sims.iter().map(|s| s.url().to_owned()).collect();
    // fp8 is pinned: the stream goes on on its other endpoint.
    let set = profile_set(
        "kill",
        &[
            ("llama8b-fp16", both.clone()),
            ("llama8b-fp8", both.clone()),
            ("llama8b-awq", both.clone()),
        ],
    );
    let (router, _dir) = router(set).await;
    let mut openai = OpenAiClient::start(&router);
    let request = chat("kill-llama8b-fp8", 120);
    openai.send("chat", &request).await;

    // Whichever simulator took the stream dies once some 30 tokens went out.
    let serving = serving_sim(&sims, 30.0).await;
    sims[serving].kill().await;
    let seen = openai.seen().await;

    let survivor = sims[1 - serving].url().to_owned();
    let continued = last_request(&survivor).await;
    let whole = uninterrupted(&survivor, &request).await;
    let full = answer_text(&whole);
    assert_eq!(full.split(' ').count(), 120);
    assert_whole(&seen, full, "length");
    let usage = &whole["usage"];
    assert_eq!(
        seen["usage"]["prompt_tokens"], usage["prompt_tokens"],
        "{seen}"
    );
    assert_eq!(seen["usage"]["completion_tokens"], 120, "{seen}");

    // The survivor was asked to go on from what the client had.
    let messages = continued["messages"].as_array().unwrap();
    let delivered = messages.last().unwrap()["content"].as_str().unwrap();
    assert_eq!(messages.last().unwrap()["role"], "assistant");
    let words = delivered.split(' ').count() as u64;
    assert!(words >= 25 && full.starts_with(delivered), "{delivered:?}");
    assert_eq!(continued["continue_final_message"], true);
    assert_eq!(continued["add_generation_prompt"], false);
    assert_eq!(continued["max_tokens"], 120 - words);

    // Booked once: the tenant's tokens are the uninterrupted answer's.
    let total = usage["total_tokens"].as_u64().unwrap();
    assert!(
        eventually(Duration::from_secs(5), || async {
            tenant_tokens(&router).await == total
        })
        .await,
        "the tenant is charged {total} tokens, not {}",
        tenant_tokens(&router).await
    );
    let profile = "profile=\"kill-llama8b-fp8\"";
    let resumes = "quantrouter_stream_resumes_total";
    assert_eq!(
        metric(&router, resumes, &[profile, "result=\"resumed\""]).await,
        1.0
    );
    let errors = "quantrouter_upstream_errors_total";
    assert_eq!(
        metric(&router, errors, &[profile, "kind=\"mid_stream\""]).await,
        1.0
    );
    let output = ["quantrouter_tokens_total", profile, "direction=\"output\""];
    assert_eq!(metric(&router, output[0], &output[1..]).await, 120.0);
}

/// The simulator that has generated `tokens`, waited for within 30 s.
async fn serving_sim(sims: &[SimProcess], tokens: f64) -> usize {
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut poll = tokio::time::interval(Duration::from_millis(10));
    while tokio::time::Instant::now() < until {
        poll.tick().await;
        for (i, sim) in sims.iter().enumerate() {
            if sim.metric("vllm:generation_tokens_total").await >= tokens {
                return i;
            }
        }
    }
    panic!("no simulator generated {tokens} tokens within 30 s");
}

/// Breaks the streams of `sim` after ten events (a chat's role and nine tokens), `how`.
fn break_after_ten(sim: &SimServer, how: StreamBreak) {
    sim.set_faults(Faults {
        reset_after_chunks: Some(10),
        stream_break: how,
        ..Faults::default()
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_that_end_stall_or_send_an_error_go_on_from_the_next_profile() {
    // The int4 profile, which the router picks, has the breaking simulator; the others
    // share the healthy one. Both serve chat only: agent APIs are translated.
    let config = SimConfig {
        model: MODEL.to_owned(),
        chat_only: true,
        ..SimConfig::default()
    };
    let breaking = SimServer::bind(loopback(), config.clone()).await.unwrap();
    let healthy = SimServer::bind(loopback(), config).await.unwrap();
    let mut set = profile_set(
        "break",
        &[
            ("llama8b-fp16", vec![healthy.url()]),
            ("llama8b-fp8", vec![healthy.url()]),
            ("llama8b-awq", vec![breaking.url()]),
        ],
    );
    let (router, _dir) = router(set.clone()).await;
    let mut openai = OpenAiClient::start(&router);
    let request = chat("auto", 40);
    let whole = uninterrupted(&healthy.url(), &request).await;
    let full = answer_text(&whole);
    let nine: Vec<&str> = full.split(' ').take(9).collect();
    let nine = nine.join(" ");

    for how in [
        StreamBreak::End,
        StreamBreak::Stall,
        StreamBreak::ErrorEvent,
    ] {
        break_after_ten(&breaking, how);
        let seen = openai.stream("chat", &request).await;
        assert_whole(&seen, full, "length");
        assert_eq!(seen["usage"]["completion_tokens"], 40, "{how:?}: {seen}");
        assert_eq!(
            seen["usage"]["prompt_tokens"],
            whole["usage"]["prompt_tokens"]
        );
        let continued = last_request(&healthy.url()).await;
        assert_eq!(
            continued["messages"][1],
            json!({"role": "assistant", "content": nine}),
            "{how:?}"
        );
        assert_eq!(continued["max_tokens"], 31);
    }

    // Completions: the prompt with the delivered text appended.
    break_after_ten(&breaking, StreamBreak::End);
    let completion = json!({"model": "auto", "prompt": SIMPLE, "max_tokens": 40,
        "stream_options": {"include_usage": true}, "extra_body": {"ignore_eos": true}});
    let seen = openai.stream("completions", &completion).await;
    let continued = last_request(&healthy.url()).await;
    let delivered = continued["prompt"]
        .as_str()
        .unwrap()
        .strip_prefix(SIMPLE)
        .unwrap();
    // A completion stream has no role event: ten tokens.
    assert_eq!(delivered.split(' ').filter(|w| !w.is_empty()).count(), 10);
    let mut rest = continued.clone();
    rest["stream"] = json!(false);
    rest.as_object_mut().unwrap().remove("stream_options");
    let rest = send(
        &client(),
        "POST",
        &format!("{}/v1/completions", healthy.url()),
        &rest.to_string(),
        &[("content-type", "application/json")],
    )
    .await;
    assert_whole(
        &seen,
        &format!("{delivered}{}", answer_text(&rest.json())),
        "length",
    );
    assert_eq!(seen["usage"]["completion_tokens"], 40, "{seen}");

    // Translated agent APIs resume the same way, to the answer's natural end.
    let mut natural = request.clone();
    natural.as_object_mut().unwrap().remove("extra_body");
    let natural = uninterrupted(&healthy.url(), &natural).await;
    let full = answer_text(&natural);
    assert!(
        full.split(' ').count() > 10,
        "the break comes first: {full:?}"
    );
    break_after_ten(&breaking, StreamBreak::End);
    let messages = agent_stream(
        &router,
        "/v1/messages",
        json!({"model": "auto",
        "max_tokens": 40, "stream": true, "messages": [{"role": "user", "content": SIMPLE}]}),
    )
    .await;
    assert_eq!(
        agent_text(&messages, "content_block_delta", "/delta/text"),
        full
    );
    assert_eq!(
        messages
            .iter()
            .filter(|e| e["type"] == "message_stop")
            .count(),
        1
    );
    break_after_ten(&breaking, StreamBreak::End);
    let responses = agent_stream(
        &router,
        "/v1/responses",
        json!({"model": "auto",
        "max_output_tokens": 40, "stream": true, "input": SIMPLE}),
    )
    .await;
    assert_eq!(
        agent_text(&responses, "response.output_text.delta", "/delta"),
        full
    );
    assert_eq!(
        responses
            .iter()
            .filter(|e| e["type"] == "response.completed")
            .count(),
        1
    );

    let int4 = "profile=\"break-llama8b-awq\"";
    let resumes = "quantrouter_stream_resumes_total";
    let resumed = [int4, "result=\"resumed\""];
    assert_eq!(metric(&router, resumes, &resumed).await, 6.0);
    let errors = "quantrouter_upstream_errors_total";
    for (kind, count) in [
        ("incomplete", 4.0),
        ("idle_timeout", 1.0),
        ("error_event", 1.0),
    ] {
        let labels = [int4, &format!("kind=\"{kind}\"")];
        assert_eq!(metric(&router, errors, &labels).await, count, "{kind}");
    }

    // Resumption off: a reset ends the stream with the error event, as it always did.
    set.version += 1;
    set.policy.stream_resume.max_resumes = 0;
    router
        .app
        .store
        .apply(set, SourceKind::Embedded, false)
        .unwrap();
    break_after_ten(&breaking, StreamBreak::Reset);
    let seen = openai.stream("chat", &request).await;
    assert_eq!(seen["text"], nine, "{seen}");
    assert_eq!(seen["finish_reasons"], json!([]), "{seen}");
    let error = seen["error"].as_str().unwrap_or_default();
    assert!(error.contains("mid-response"), "{seen}");
    assert_eq!(metric(&router, resumes, &resumed).await, 6.0);
    assert_eq!(
        metric(&router, resumes, &[int4, "result=\"not_resumable\""]).await,
        0.0
    );
}

/// An agent-API stream through the router, as its events' JSON.
async fn agent_stream(router: &Server, path: &str, body: Value) -> Vec<Value> {
    let reply = post_stream(router, path, &body, &[]).await;
    let events = data_events(&reply.body);
    let failed =
        |e: &&Value| ["error", "response.failed"].contains(&e["type"].as_str().unwrap_or_default());
    assert!(!events.iter().any(|e| failed(&e)), "{:?}", reply.body);
    events
}

/// `body` posted to the router's `path` with the tenant's key and `headers`: a 200 whose
/// whole body is read.
async fn post_stream(
    router: &Server,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> support::Reply {
    let url = format!("http://{}{path}", router.public_addr());
    let auth = format!("Bearer {KEY}");
    let mut all = vec![
        ("content-type", "application/json"),
        ("authorization", auth.as_str()),
    ];
    all.extend_from_slice(headers);
    let reply = send(&client(), "POST", &url, &body.to_string(), &all).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    reply
}

/// The JSON of a stream's data events (`[DONE]` left out).
fn data_events(body: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(body)
        .split("\n\n")
        .filter_map(|event| event.lines().find_map(|l| l.strip_prefix("data: ")))
        .filter_map(|data| serde_json::from_str(data).ok())
        .collect()
}

/// A chat stream of `request` through the router, as a client without the `openai`
/// package reads it: its text, its finish reasons, its usage and its last event.
async fn chat_stream(router: &Server, request: &Value, headers: &[(&str, &str)]) -> ChatSeen {
    let mut body = on_the_wire(request);
    body["stream"] = json!(true);
    let reply = post_stream(router, "/v1/chat/completions", &body, headers).await;
    let events = data_events(&reply.body);
    let choices = events
        .iter()
        .flat_map(|e| e["choices"].as_array().cloned().unwrap_or_default());
    let mut seen = ChatSeen {
        profile: reply.header("x-quantrouter-profile").to_owned(),
        last: events.last().cloned().unwrap_or_default(),
        usage: events
            .iter()
            .rev()
            .find(|e| e["usage"].is_object())
            .map(|e| e["usage"].clone()),
        ..ChatSeen::default()
    };
    for choice in choices {
        seen.text
            .push_str(choice["delta"]["content"].as_str().unwrap_or_default());
        if let Some(finish) = choice["finish_reason"].as_str() {
            seen.finish_reasons.push(finish.to_owned());
        }
    }
    seen
}

/// What a client read of a chat stream ([`chat_stream`]).
#[derive(Debug, Default)]
struct ChatSeen {
    /// `x-quantrouter-profile`: the profile that started the answer.
    profile: String,
    text: String,
    finish_reasons: Vec<String>,
    usage: Option<Value>,
    last: Value,
}

/// The text of an agent-API stream: its events of `kind`, each's text at `pointer`.
fn agent_text(events: &[Value], kind: &str, pointer: &str) -> String {
    events
        .iter()
        .filter(|e| e["type"] == kind)
        .filter_map(|e| e.pointer(pointer)?.as_str())
        .collect()
}

/// What `input` and `output` tokens cost at `profile`'s prices.
fn cost(profile: &quantrouter_policy::Profile, input: u64, output: u64) -> f64 {
    input as f64 * (profile.cost_per_1m_input_tokens / 1e6)
        + output as f64 * (profile.cost_per_1m_output_tokens / 1e6)
}

/// A simulator serving [`MODEL`] on loopback.
async fn sim() -> SimServer {
    let config = SimConfig {
        model: MODEL.to_owned(),
        ..SimConfig::default()
    };
    SimServer::bind(loopback(), config).await.unwrap()
}

/// The spend counters of `tenant` in Redis (the day's and the month's), in millionths.
async fn redis_spend(redis: &RedisServer, tenant: &str) -> Vec<i64> {
    let pattern = format!("{PREFIX}:tenants:usage:{{{tenant}}}:spend:*");
    let mut connection = redis
        .client()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let mut spend = Vec::new();
    for key in redis.keys(&pattern).await {
        let micros: i64 = redis::cmd("GET")
            .arg(&key)
            .query_async(&mut connection)
            .await
            .unwrap();
        spend.push(micros);
    }
    spend
}

fn assert_close(got: f64, want: f64, what: &str) {
    assert!(
        (got - want).abs() <= want.abs() * 1e-9,
        "{what}: {got}, not {want}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continuation_on_another_profile_is_booked_at_its_prices_and_breaks_its_breaker() {
    // int4, which the router picks, breaks; the tenant may use fp8 besides, so fp8
    // continues. Each part is charged at the prices of the profile that generated it, and
    // the tenant's spend is counted in Redis.
    let redis = RedisServer::start(None);
    let (breaking, fp8, fp16) = (sim().await, sim().await, sim().await);
    let set = profile_set(
        "books",
        &[
            ("llama8b-fp16", vec![fp16.url()]),
            ("llama8b-fp8", vec![fp8.url()]),
            ("llama8b-awq", vec![breaking.url()]),
        ],
    );
    let mut set = set;
    for profile in &mut set.profiles {
        // Prices a thousand times the default ones: the spend counted in Redis, in
        // millionths, tells each part's price from another's.
        profile.cost_per_1m_input_tokens *= 1000.0;
        profile.cost_per_1m_output_tokens *= 1000.0;
    }
    let tenant = json!({"id": "books",
        "limits": {"tokens_per_minute": 1_000_000, "budget_per_day": 1000.0, "soft_limit": 1.0},
        "allowed_profiles": ["books-llama8b-awq", "books-llama8b-fp8"]});
    // A breaker that opens at half of two outcomes: one broken stream shows whether the
    // break was counted (its head already counted as a success).
    let (router, _dir) = router_with(set.clone(), tenant, Some(&redis), |c| {
        c.resilience.breaker.min_volume = 2
    })
    .await;
    let request = chat("auto", 40);
    let whole = uninterrupted(&fp8.url(), &request).await;
    let prompt = whole["usage"]["prompt_tokens"].as_u64().unwrap();
    break_after_ten(&breaking, StreamBreak::Reset);

    let seen = chat_stream(&router, &request, &[]).await;
    assert_eq!(seen.profile, "books-llama8b-awq");
    assert_eq!(seen.text, answer_text(&whole), "{seen:?}");
    assert_eq!(seen.finish_reasons, ["length"], "{seen:?}");
    let usage =
        json!({"prompt_tokens": prompt, "completion_tokens": 40, "total_tokens": prompt + 40});
    assert_eq!(seen.usage, Some(usage), "{seen:?}");
    let continued = last_request(&fp8.url()).await;
    assert_eq!(continued["continue_final_message"], true);
    assert_eq!(continued["max_tokens"], 31);
    assert_eq!(fp16.stats().requests, 0, "the tenant may not use fp16");

    // int4 generated the prompt's answer up to the break (nine tokens), fp8 the rest; the
    // prompt is charged once, at int4; fp8's second prefill of the nine is charged to no one.
    let (int4, fp8_id) = (
        "profile=\"books-llama8b-awq\"",
        "profile=\"books-llama8b-fp8\"",
    );
    let tokens = "quantrouter_tokens_total";
    for (profile, direction, want) in [
        (int4, "input", prompt),
        (int4, "output", 9),
        (fp8_id, "input", 0),
        (fp8_id, "output", 31),
    ] {
        let labels = [profile, &format!("direction=\"{direction}\"")];
        let got = metric(&router, tokens, &labels).await;
        assert_eq!(got, want as f64, "{profile} {direction}");
    }
    let profiles = &set.profiles;
    let (fp16_p, fp8_p, int4_p) = (&profiles[0], &profiles[1], &profiles[2]);
    let int4_cost = cost(int4_p, prompt, 9);
    let fp8_cost = cost(fp8_p, 0, 31);
    let cost_total = "quantrouter_cost_usd_total";
    assert_close(
        metric(&router, cost_total, &[int4]).await,
        int4_cost,
        "int4 cost",
    );
    assert_close(
        metric(&router, cost_total, &[fp8_id]).await,
        fp8_cost,
        "fp8 cost",
    );
    // Savings are against the default profile (fp16) generating each part.
    let counterfactual = "quantrouter_counterfactual_cost_usd_total";
    let (int4_would, fp8_would) = (cost(fp16_p, prompt, 9), cost(fp16_p, 0, 31));
    assert_close(
        metric(&router, counterfactual, &[int4]).await,
        int4_would,
        "int4 would",
    );
    assert_close(
        metric(&router, counterfactual, &[fp8_id]).await,
        fp8_would,
        "fp8 would",
    );
    let tenant = ["tenant=\"books\""];
    let spend = metric(&router, "quantrouter_tenant_spend_total", &tenant).await;
    assert_close(spend, int4_cost + fp8_cost, "the tenant's spend");
    // Redis holds the day's and the month's spend, in millionths (rounded up), once the
    // reservation is settled; all at int4's prices would be about half of it.
    let want = ((int4_cost + fp8_cost) * 1e6).ceil() as i64;
    let spent = eventually(Duration::from_secs(5), || async {
        let kept = redis_spend(&redis, "books").await;
        kept.len() == 2 && kept.iter().all(|micros| (micros - want).abs() <= 1)
    })
    .await;
    let kept = redis_spend(&redis, "books").await;
    assert!(spent, "Redis keeps {kept:?} of spend, not {want} twice");
    assert!(
        eventually(Duration::from_secs(5), || async {
            tenant_tokens(&router).await == prompt + 40
        })
        .await,
        "the tenant is charged {} tokens, not {}",
        prompt + 40,
        tenant_tokens(&router).await
    );

    // The endpoint that broke counted a failure (`Endpoint::failed_mid_answer`).
    let snapshot = router.app.store.load();
    let endpoints = snapshot.runtime[2].pool.endpoints();
    assert_eq!(endpoints[0].base(), breaking.url());
    let state = endpoints[0].circuit(tokio::time::Instant::now());
    assert_eq!(state, quantrouter::resilience::CircuitState::Open);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_on_the_same_profile_is_a_retry_within_the_budget_and_traced() {
    let (collector, spans) = otlp_receiver().await;
    // fp8, pinned, has two endpoints that both break a stream after its role and nine
    // tokens: a twelve-token answer breaks, and its three-token continuation does not.
    let (first, second, other) = (sim().await, sim().await, sim().await);
    let set = profile_set(
        "budget",
        &[
            ("llama8b-fp16", vec![other.url()]),
            ("llama8b-fp8", vec![first.url(), second.url()]),
            ("llama8b-awq", vec![other.url()]),
        ],
    );
    let traces = Traces::to_endpoint(&collector).unwrap();
    let exporter = traces.clone();
    let tenant = json!({"id": "budget", "limits": {"tokens_per_minute": 1_000_000}});
    let (router, _dir) = router_with(set, tenant, None, move |c| {
        c.traces = Some(traces);
        // One retry in the budget, whatever the requests, for as long as the test runs.
        c.resilience.budget = BudgetConfig {
            ratio: 0.0,
            floor: 1,
            window: Duration::from_secs(600),
        };
    })
    .await;
    let request = chat("budget-llama8b-fp8", 12);
    let whole = uninterrupted(&other.url(), &request).await;
    for sim in [&first, &second] {
        break_after_ten(sim, StreamBreak::Reset);
    }
    let sent = || first.stats().requests + second.stats().requests;
    let (resumed_trace, failed_trace) = (
        "4bf92f3577b34da6a3ce929d0e0e4736",
        "5c0a3e8f9b1d4c2e8a7f6b5d4c3b2a19",
    );
    let traceparent = |trace: &str| format!("00-{trace}-00f067aa0ba902b7-01");

    // The first break takes the budget's one retry: the other endpoint continues.
    let header = traceparent(resumed_trace);
    let seen = chat_stream(&router, &request, &[("traceparent", &header)]).await;
    assert_eq!(seen.text, answer_text(&whole), "{seen:?}");
    assert_eq!(seen.finish_reasons, ["length"], "{seen:?}");
    assert_eq!(sent(), 2);
    let fp8 = "profile=\"budget-llama8b-fp8\"";
    let (retries, resumes) = (
        "quantrouter_retries_total",
        "quantrouter_stream_resumes_total",
    );
    assert_eq!(metric(&router, retries, &[fp8]).await, 1.0);
    assert_eq!(
        metric(&router, resumes, &[fp8, "result=\"resumed\""]).await,
        1.0
    );

    // The second finds the budget spent: no continuation, and the client gets the error
    // event of the break, as without resumption.
    let header = traceparent(failed_trace);
    let seen = chat_stream(&router, &request, &[("traceparent", &header)]).await;
    let nine: Vec<&str> = answer_text(&whole).split(' ').take(9).collect();
    assert_eq!(seen.text, nine.join(" "), "{seen:?}");
    assert!(seen.finish_reasons.is_empty(), "{seen:?}");
    assert_eq!(seen.last["error"]["code"], "upstream_error", "{seen:?}");
    assert_eq!(sent(), 3, "no continuation was asked for");
    assert_eq!(metric(&router, retries, &[fp8]).await, 1.0);
    assert_eq!(
        metric(&router, resumes, &[fp8, "result=\"failed\""]).await,
        1.0
    );

    // Both traces show the break beside the attempts, under the request's span.
    exporter.flush();
    let exported = eventually(Duration::from_secs(5), || async {
        let spans = spans.lock().unwrap();
        let requests = spans.iter().filter(|s| s.name.starts_with("POST "));
        requests.count() >= 2
    })
    .await;
    assert!(exported, "both requests' spans reach the collector");
    let spans = spans.lock().unwrap().clone();
    let of = |trace: &str| -> Vec<Span> {
        spans
            .iter()
            .filter(|s| hex(&s.trace_id) == trace)
            .cloned()
            .collect()
    };
    let (resumed, failed) = (of(resumed_trace), of(failed_trace));
    let text = |span: &Span, key: &str| match attribute(span, key) {
        Some(AnyValue::StringValue(v)) => v,
        other => panic!("{key}: {other:?}"),
    };
    let int = |span: &Span, key: &str| match attribute(span, key) {
        Some(AnyValue::IntValue(v)) => v,
        other => panic!("{key}: {other:?}"),
    };
    let named = |spans: &[Span], name: &str| -> Vec<Span> {
        spans.iter().filter(|s| s.name == name).cloned().collect()
    };
    let request_span = &named(&resumed, "POST /v1/chat/completions")[0];
    let attempts = named(&resumed, "upstream attempt");
    let breaks = named(&resumed, "stream resume");
    assert_eq!((attempts.len(), breaks.len()), (2, 1), "{resumed:#?}");
    let (broke, continued) = match int(&attempts[0], "quantrouter.retry") {
        0 => (&attempts[0], &attempts[1]),
        _ => (&attempts[1], &attempts[0]),
    };
    assert_eq!(int(continued, "quantrouter.retry"), 1);
    assert_ne!(
        text(broke, "server.address"),
        text(continued, "server.address")
    );
    let resume = &breaks[0];
    assert_eq!(
        text(resume, "server.address"),
        text(broke, "server.address")
    );
    assert_eq!(text(resume, "quantrouter.profile"), "budget-llama8b-fp8");
    assert_eq!(text(resume, "quantrouter.failure"), "mid_stream");
    assert_eq!(text(resume, "quantrouter.result"), "resumed");
    assert_eq!(int(resume, "quantrouter.delivered_tokens"), 9);
    for span in [broke, continued, resume] {
        assert_eq!(span.parent_span_id, request_span.span_id, "{span:#?}");
    }
    assert!(resume.start_time_unix_nano >= broke.start_time_unix_nano);
    assert!(continued.start_time_unix_nano >= resume.start_time_unix_nano);
    let attempts = named(&failed, "upstream attempt");
    let breaks = named(&failed, "stream resume");
    assert_eq!((attempts.len(), breaks.len()), (1, 1), "{failed:#?}");
    assert_eq!(text(&breaks[0], "quantrouter.result"), "failed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_the_rules_leave_alone_end_as_they_always_did() {
    // int4, which the router picks, is a scripted server that ends each stream without a
    // finish: after a tool call's first delta, after two choices' text, or after a `[DONE]`
    // that came without a finish reason. A resumed stream would go on at the simulator.
    let (scripted, _) = support::scripted_upstream(|body| {
        let script = if body["tools"].is_array() {
            tool_call_stream()
        } else if body["n"] == 2 {
            two_choices_stream()
        } else {
            done_without_finish_stream()
        };
        (http::StatusCode::OK, "text/event-stream", script)
    })
    .await;
    let healthy = sim().await;
    let set = profile_set(
        "rules",
        &[
            ("llama8b-fp16", vec![healthy.url()]),
            ("llama8b-fp8", vec![healthy.url()]),
            ("llama8b-awq", vec![scripted]),
        ],
    );
    let (router, _dir) = router(set).await;
    let base = json!({"model": "auto", "stream": true, "max_tokens": 40,
        "messages": [{"role": "user", "content": SIMPLE}],
        "stream_options": {"include_usage": true}});
    let mut tool = base.clone();
    tool["tools"] = json!([{"type": "function", "function": {"name": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let mut two = base.clone();
    two["n"] = json!(2);
    for (request, script) in [
        (&tool, tool_call_stream()),
        (&two, two_choices_stream()),
        (&base, done_without_finish_stream()),
    ] {
        let reply = post_stream(&router, "/v1/chat/completions", request, &[]).await;
        assert_eq!(reply.header("x-quantrouter-profile"), "rules-llama8b-awq");
        // Every byte as the upstream sent it, and nothing after.
        assert_eq!(String::from_utf8_lossy(&reply.body), script);
    }
    assert_eq!(healthy.stats().requests, 0, "nothing was continued");
    // The tool call broke and was not resumed; several choices are not watched, and a
    // `[DONE]` ends a whole answer.
    let resumes = "quantrouter_stream_resumes_total";
    let int4 = "profile=\"rules-llama8b-awq\"";
    for (result, count) in [("not_resumable", 1.0), ("resumed", 0.0), ("failed", 0.0)] {
        let labels = [int4, &format!("result=\"{result}\"")];
        assert_eq!(metric(&router, resumes, &labels).await, count, "{result}");
    }
}

/// A chat chunk of the scripted streams, with `choices`.
fn scripted_chunk(choices: Value) -> Value {
    json!({"id": "chatcmpl-s", "object": "chat.completion.chunk", "created": 1,
        "model": MODEL, "choices": choices})
}

/// `chunks` as an SSE stream, ended by `[DONE]` when `done`.
fn sse(chunks: &[Value], done: bool) -> String {
    let mut stream: String = chunks.iter().map(|c| format!("data: {c}\n\n")).collect();
    if done {
        stream.push_str("data: [DONE]\n\n");
    }
    stream
}

/// Text, then the first delta of a tool call, then the end.
fn tool_call_stream() -> String {
    let call = json!({"index": 0, "id": "call_1", "type": "function",
        "function": {"name": "weather", "arguments": "{\"city\": \"Par"}});
    sse(
        &[
            scripted_chunk(json!([{"index": 0, "delta": {"role": "assistant", "content": ""}}])),
            scripted_chunk(json!([{"index": 0, "delta": {"content": "Let me look."}}])),
            scripted_chunk(json!([{"index": 0, "delta": {"tool_calls": [call]}}])),
        ],
        false,
    )
}

/// Two choices' text, then the end.
fn two_choices_stream() -> String {
    sse(
        &[
            scripted_chunk(
                json!([{"index": 0, "delta": {"role": "assistant", "content": "Paris"}}]),
            ),
            scripted_chunk(
                json!([{"index": 1, "delta": {"role": "assistant", "content": "It is"}}]),
            ),
            scripted_chunk(json!([{"index": 1, "delta": {"content": " Paris"}}])),
        ],
        false,
    )
}

/// Text, then `[DONE]` without a finish reason before it.
fn done_without_finish_stream() -> String {
    sse(
        &[
            scripted_chunk(
                json!([{"index": 0, "delta": {"role": "assistant", "content": "Paris"}}]),
            ),
            scripted_chunk(json!([{"index": 0, "delta": {"content": "."}}])),
        ],
        true,
    )
}

/// llama.cpp's server, real and greedy: the router's continuation of a stream it broke
/// goes on through its assistant prefill exactly where the uninterrupted answer would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llama_server_continues_a_broken_stream_through_its_assistant_prefill() {
    let llama = LlamaServer::start().await;
    // The int4 profile reaches it through a relay that cuts the stream after its role and
    // eleven tokens; the others through one that records the requests.
    let cutting = Relay::start(llama.addr(), Some(12)).await;
    let recording = Relay::start(llama.addr(), None).await;
    let set = profile_set(
        "llama",
        &[
            ("llama8b-fp16", vec![recording.url()]),
            ("llama8b-fp8", vec![recording.url()]),
            ("llama8b-awq", vec![cutting.url()]),
        ],
    );
    let (router, _dir) = router(set).await;
    let mut openai = OpenAiClient::start(&router);
    let request = json!({"model": "auto", "max_tokens": 60, "temperature": 0,
        "messages": [{"role": "user", "content": SIMPLE}],
        "stream_options": {"include_usage": true}});
    let seen = openai.stream("chat", &request).await;
    let whole = uninterrupted(&llama.url(), &request).await;
    let full = answer_text(&whole);
    assert_eq!(full.len(), 60, "one token per character: {full:?}");
    assert_whole(&seen, full, "length");
    assert_eq!(
        seen["usage"]["prompt_tokens"],
        whole["usage"]["prompt_tokens"]
    );
    assert_eq!(seen["usage"]["completion_tokens"], 60, "{seen}");

    // The relay cuts after the read that brought the twelfth event: at least eleven
    // tokens (one character each) reached the client, and the server went on from them.
    let continued = recording.last_request();
    let message = &continued["messages"][1];
    let delivered = message["content"].as_str().unwrap();
    assert_eq!(message["role"], "assistant", "{continued}");
    assert!(
        delivered.len() >= 11 && full.starts_with(delivered),
        "{continued}"
    );
    assert_eq!(continued["continue_final_message"], true);
    assert_eq!(continued["add_generation_prompt"], false);
    assert_eq!(continued["max_tokens"], 60 - delivered.len());
}

/// A TCP relay to `upstream` that records the bodies of the requests it passes and, with
/// `cut_after`, closes both connections once that many `data:` events went back.
struct Relay {
    addr: SocketAddr,
    bodies: Arc<Mutex<Vec<Vec<u8>>>>,
}

impl Relay {
    async fn start(upstream: SocketAddr, cut_after: Option<usize>) -> Self {
        let listener = tokio::net::TcpListener::bind(loopback()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let kept = Arc::clone(&bodies);
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let bodies = Arc::clone(&kept);
                tokio::spawn(relay(client, upstream, cut_after, bodies));
            }
        });
        Self { addr, bodies }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The body of the last request relayed, as JSON.
    fn last_request(&self) -> Value {
        let bodies = self.bodies.lock().unwrap();
        serde_json::from_slice(bodies.last().expect("a request was relayed")).unwrap()
    }
}

async fn relay(
    client: TcpStream,
    upstream: SocketAddr,
    cut_after: Option<usize>,
    bodies: Arc<Mutex<Vec<Vec<u8>>>>,
) {
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    let ((mut from_client, mut to_client), (mut from_server, mut to_server)) =
        (client.into_split(), server.into_split());
    let requests = async {
        let (mut buf, mut seen) = (vec![0u8; 16 * 1024], Vec::new());
        while let Ok(n @ 1..) = from_client.read(&mut buf).await {
            seen.extend_from_slice(&buf[..n]);
            take_bodies(&mut seen, &bodies);
            if to_server.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    let answers = async {
        let (mut buf, mut events) = (vec![0u8; 16 * 1024], 0);
        while let Ok(n @ 1..) = from_server.read(&mut buf).await {
            events += buf[..n].windows(6).filter(|w| w == b"data: ").count();
            if to_client.write_all(&buf[..n]).await.is_err() {
                return;
            }
            if cut_after.is_some_and(|cut| events >= cut) {
                return;
            }
        }
    };
    // Either side ending ends both: a cut closes the client's connection mid-stream.
    tokio::select! {
        () = requests => {}
        () = answers => {}
    }
}

/// Moves the bodies of the whole requests at the start of `seen` to `bodies`.
fn take_bodies(seen: &mut Vec<u8>, bodies: &Mutex<Vec<Vec<u8>>>) {
    loop {
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut request = httparse::Request::new(&mut headers);
        let Ok(httparse::Status::Complete(head)) = request.parse(seen) else {
            return;
        };
        let length = request
            .headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case("content-length"))
            .map_or(0, |h| {
                std::str::from_utf8(h.value).unwrap().parse().unwrap()
            });
        if seen.len() < head + length {
            return;
        }
        let body = seen[head..head + length].to_vec();
        seen.drain(..head + length);
        if !body.is_empty() {
            bodies.lock().unwrap().push(body);
        }
    }
}
