//! One table of requests through both front doors — the router's HTTP port, and a real Envoy
//! (`manifests/envoy/envoy.yaml`) with the router as its endpoint picker — and the same
//! outcome expected through each: the profile, a conversation's endpoint over its turns,
//! stored Responses placed and their follow-ups pinned, refusals (status and the API's own
//! error shape), and what the model server receives (never the client's key, never a
//! destination the client chose). Requests come from the official `openai` and `anthropic`
//! Python clients (`tests/python/doors.py`), except where a hostile client sends raw headers.
//!
//! One router, one Envoy and one Python process serve every row, in order.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::process::Stdio;
use std::time::Duration;

use quantrouter_policy::{hash_key, StaticUpstream, Upstream, UpstreamApi};
use serde_json::{json, Value};
use support::envoy::Envoy;
use support::{
    capture_upstream, client, eventually, loopback, python, send, tenants_from, Captured, Reply,
    Tiers, CODE, SIMPLE,
};
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout};
use vllm_sim::SimConfig;

/// The tenant every row but the rate's uses, without limits.
const KEY: &str = "sk-doors-team-a-4Fq9";
/// A tenant allowed two requests a minute.
const TIGHT_KEY: &str = "sk-doors-tight-7Rm2";
/// A tenant whose tokens are counted.
const METERED_KEY: &str = "sk-doors-metered-5Vn1";
/// The capture profile's own upstream key.
const UPSTREAM_KEY: &str = "sk-upstream-capture-2Wd8";
/// An endpoint a client would like its request sent to; nothing listens there.
const CHOSEN: &str = "10.255.255.1:9";
/// Sims of the cheapest tier, where simple conversations go: more than one, so that staying
/// on one is the router's doing.
const INT4_SIMS: usize = 3;
/// The profile whose upstream records what it receives; dear, so only a pin reaches it.
const CAPTURE: &str = "capture";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Door {
    /// The router's own port.
    Http,
    /// Envoy, with the router as its endpoint picker.
    Gateway,
}

const DOORS: [Door; 2] = [Door::Http, Door::Gateway];

/// The router (the cheapest tier on three sims, the others on one each — a stored response
/// lives on the one server that stored it — plus the capture profile), Envoy in front of its
/// picker, and the clients.
struct World {
    tiers: Tiers,
    envoy: Envoy,
    captured: Captured,
    clients: Clients,
    _dir: tempfile::TempDir,
}

/// `doors.py`, asked one request at a time.
struct Clients {
    _child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
}

/// A request for the official clients: which client, which call, with which key, extra
/// headers and arguments.
struct Ask {
    client: &'static str,
    kind: &'static str,
    key: &'static str,
    headers: Value,
    body: Value,
}

/// A one-request row: what is asked, and the status both doors must answer with.
struct Case {
    name: &'static str,
    ask: fn() -> Ask,
    status: u16,
}

type Row = for<'a> fn(&'a mut World) -> Pin<Box<dyn Future<Output = ()> + 'a>>;

/// Rows of one request each: the same status through both doors, and the same profile
/// (an answer) or the same error body in the API's shape (a refusal).
const CASES: &[Case] = &[
    Case {
        name: "a chat is routed by the policy",
        ask: || Ask::chat(KEY, SIMPLE),
        status: 200,
    },
    Case {
        name: "a streamed chat is routed by the policy",
        ask: || Ask::chat(KEY, CODE).kind("stream"),
        status: 200,
    },
    Case {
        name: "a completion is routed by the policy",
        ask: || Ask {
            kind: "completion",
            body: json!({"model": "auto", "prompt": SIMPLE, "max_tokens": 8}),
            ..Ask::chat(KEY, SIMPLE)
        },
        status: 200,
    },
    Case {
        name: "Anthropic's client is known by its x-api-key",
        ask: || Ask::messages(KEY, SIMPLE),
        status: 200,
    },
    Case {
        name: "Anthropic's client counts a prompt's tokens",
        ask: || Ask::messages(KEY, CODE).kind("count_tokens"),
        status: 200,
    },
    Case {
        name: "an unknown key counts no tokens",
        ask: || Ask::messages("sk-nobody", CODE).kind("count_tokens"),
        status: 401,
    },
    Case {
        name: "a 2 MB chat body goes through",
        ask: || Ask::chat(KEY, &"Summarise the log below.\n".repeat(90_000)),
        status: 200,
    },
    Case {
        name: "an unknown key is refused in OpenAI's shape",
        ask: || Ask::chat("sk-nobody", SIMPLE),
        status: 401,
    },
    Case {
        name: "an unknown key is refused in Anthropic's shape",
        ask: || Ask::messages("sk-nobody", SIMPLE),
        status: 401,
    },
    Case {
        name: "an unknown model is refused",
        ask: || Ask::chat(KEY, SIMPLE).field("model", json!("no-such-model")),
        status: 404,
    },
    Case {
        name: "an unknown model is refused in Anthropic's shape",
        ask: || Ask::messages(KEY, SIMPLE).field("model", json!("no-such-model")),
        status: 404,
    },
    Case {
        name: "an invalid field is refused",
        ask: || Ask::chat(KEY, SIMPLE).field("temperature", json!(5)),
        status: 400,
    },
];

/// Rows of several requests each.
fn rows() -> Vec<(&'static str, Row)> {
    vec![
        ("a conversation's turns stay on one endpoint", |w| {
            Box::pin(a_conversation_stays_on_one_endpoint(w))
        }),
        (
            "a stored response's follow-up is pinned, through either door",
            |w| Box::pin(a_follow_up_is_pinned_through_either_door(w)),
        ),
        ("a tenant over its rate is refused", |w| {
            Box::pin(a_tenant_over_its_rate_is_refused(w))
        }),
        (
            "the model server gets no client key and no client destination",
            |w| Box::pin(the_model_server_gets_no_client_credential(w)),
        ),
        ("a client cannot choose the endpoint", |w| {
            Box::pin(a_client_cannot_choose_the_endpoint(w))
        }),
        (
            "a native agent stream is charged the upstream's count",
            |w| Box::pin(a_native_agent_stream_is_charged_the_upstreams_count(w)),
        ),
        // The tenant-isolation tables run through both doors in tests/tenant_boundary.rs.
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_doors_give_the_same_outcome() {
    let mut world = World::start().await;
    let mut differences = Vec::new();
    for case in CASES {
        if let Err(difference) = world.both_doors(case).await {
            differences.push(format!("{}: {difference}", case.name));
        }
    }
    assert!(differences.is_empty(), "{}", differences.join("\n"));
    for (_name, row) in rows() {
        row(&mut world).await;
    }
}

/// Conversations of three turns each on the tier with a choice of endpoints, by
/// `x-session-id` with a long shared prefix: every turn of one conversation reaches the
/// endpoint holding its prefix.
async fn a_conversation_stays_on_one_endpoint(world: &mut World) {
    let int4 = world.tiers.set.profiles[2].id.clone();
    let questions = [
        "Where is my parcel?",
        "It was due on Monday.",
        "Can you refund it?",
    ];
    for door in DOORS {
        for c in 0..6 {
            let system =
                format!("Agent {door:?} {c}: you answer questions about orders. ").repeat(12);
            let session = format!("conv-{door:?}-{c}");
            let mut homes = Vec::new();
            for turn in 1..=questions.len() {
                let mut messages = vec![json!({"role": "system", "content": system})];
                for (i, question) in questions[..turn].iter().enumerate() {
                    if i > 0 {
                        messages.push(json!({"role": "assistant", "content": "Sure."}));
                    }
                    messages.push(json!({"role": "user", "content": question}));
                }
                let before = world.counts();
                let ask = Ask {
                    headers: json!({"x-session-id": session}),
                    body: json!({"model": int4, "max_tokens": 4, "messages": messages}),
                    ..Ask::chat(KEY, SIMPLE)
                };
                let answer = world.ask(door, ask).await;
                assert_eq!(answer["status"], 200, "{door:?}: {answer}");
                homes.push(world.served_since(&before));
            }
            assert!(
                homes.windows(2).all(|w| w[0] == w[1]),
                "{door:?}: conversation {c} moved between endpoints: {homes:?}"
            );
            let first_int4 = world.counts().len() - INT4_SIMS;
            assert!(
                homes[0] >= first_int4,
                "{door:?}: not on the tier with a choice"
            );
        }
    }
}

/// A Responses answer stored through one door is placed, and its follow-up through the
/// other door goes to the profile that stored it, whatever its own prompt would get.
async fn a_follow_up_is_pinned_through_either_door(world: &mut World) {
    let follow_up = "Thanks!";
    let unpinned = world
        .policy_pick(
            &json!({"model": "auto", "messages": [{"role": "user", "content": follow_up}]}),
        )
        .await;
    for (first, then) in [(Door::Http, Door::Gateway), (Door::Gateway, Door::Http)] {
        let created = world.ask(first, Ask::responses(CODE, None)).await;
        assert_eq!(created["status"], 200, "{first:?}: {created}");
        let stored_on = created["headers"]["x-quantrouter-profile"].clone();
        assert_ne!(stored_on, unpinned, "the follow-up would go there anyway");
        let id = created["id"].as_str().unwrap().to_owned();
        let answer = world.ask(then, Ask::responses(follow_up, Some(&id))).await;
        assert_eq!(answer["status"], 200, "{first:?} then {then:?}: {answer}");
        assert_eq!(
            answer["headers"]["x-quantrouter-profile"], stored_on,
            "{first:?} then {then:?}: {answer}"
        );
        assert_eq!(answer["headers"]["x-quantrouter-reason"], "pinned");
    }
}

/// Two requests a minute: the first through each door passes, the second is refused with
/// OpenAI's code and the rate headers.
async fn a_tenant_over_its_rate_is_refused(world: &mut World) {
    for (step, status) in [(1, 200), (2, 429)] {
        for door in DOORS {
            let answer = world.ask(door, Ask::chat(TIGHT_KEY, SIMPLE)).await;
            assert_eq!(
                answer["status"], status,
                "request {step}, {door:?}: {answer}"
            );
            assert!(
                answer["headers"]["x-ratelimit-limit-requests"].is_string(),
                "{door:?}: {answer}"
            );
            if status == 429 {
                // The client's parse of OpenAI's error object.
                let error = &answer["error"];
                assert_eq!(error["code"], "rate_limit_exceeded", "{door:?}: {answer}");
                assert_eq!(error["type"], "rate_limit_error", "{door:?}: {answer}");
            }
        }
    }
}

/// A streamed Messages and a streamed Responses answer, served natively, charge the metered
/// tenant the tokens the upstream reported in the stream, through either door.
async fn a_native_agent_stream_is_charged_the_upstreams_count(world: &mut World) {
    let asks = [
        (
            "/v1/messages",
            json!({"model": "auto", "max_tokens": 16, "stream": true,
            "messages": [{"role": "user", "content": SIMPLE}]}),
        ),
        (
            "/v1/responses",
            json!({"model": "auto", "max_output_tokens": 16, "stream": true,
            "input": SIMPLE}),
        ),
    ];
    for door in DOORS {
        for (path, body) in &asks {
            let before = world.metered_tokens().await;
            let url = format!("{}{path}", world.base(door));
            let reply = post_as(METERED_KEY, &url, body, &[]).await;
            assert_eq!(reply.status, 200, "{door:?} {path}: {:?}", reply.body);
            let reported = streamed_usage(&String::from_utf8_lossy(&reply.body));
            assert!(reported > 0, "{door:?} {path}: no usage in the stream");
            let charged = eventually(Duration::from_secs(5), || async {
                world.metered_tokens().await == before + reported
            })
            .await;
            assert!(
                charged,
                "{door:?} {path}: charged {} for the {reported} tokens the stream reported",
                world.metered_tokens().await - before
            );
        }
    }
}

/// The tokens an agent stream reports: Messages' input in `message_start` and output in
/// `message_delta`, or the usage of Responses' last event (`response.completed` or `.incomplete`).
fn streamed_usage(stream: &str) -> u64 {
    let events = stream
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter_map(|data| serde_json::from_str::<Value>(data).ok());
    let count = |usage: &Value, key: &str| usage[key].as_u64().unwrap_or(0);
    events
        .map(|event| match event["type"].as_str() {
            Some("message_start") => count(&event["message"]["usage"], "input_tokens"),
            Some("message_delta") => count(&event["usage"], "output_tokens"),
            Some("response.completed" | "response.incomplete") => {
                let usage = &event["response"]["usage"];
                count(usage, "input_tokens") + count(usage, "output_tokens")
            }
            _ => 0,
        })
        .sum()
}

/// Pinned to the profile whose upstream records its requests, with the client's key in
/// both headers and destinations of its own: the model server sees its own key only.
async fn the_model_server_gets_no_client_credential(world: &mut World) {
    for door in DOORS {
        world.captured.lock().unwrap().clear();
        let ask = Ask {
            headers: json!({
                "x-api-key": KEY,
                "x-quantrouter-profile": CAPTURE,
                "x-gateway-destination-endpoint": CHOSEN,
                "x-gateway-destination-endpoint-fallback": CHOSEN,
            }),
            // A prompt of its own: a pinned turn is remembered for the conversation it starts.
            ..Ask::chat(KEY, "Name a prime number.")
        };
        let answer = world.ask(door, ask).await;
        assert_eq!(answer["status"], 200, "{door:?}: {answer}");
        assert_eq!(answer["headers"]["x-quantrouter-profile"], CAPTURE);
        let captured = world.captured.lock().unwrap();
        let [(headers, _)] = &captured[..] else {
            panic!(
                "{door:?}: the capture upstream got {} requests",
                captured.len()
            );
        };
        let expected = format!("Bearer {UPSTREAM_KEY}");
        assert_eq!(
            headers.get("authorization").unwrap(),
            expected.as_str(),
            "{door:?}"
        );
        for (name, value) in headers {
            let value = value.to_str().unwrap_or_default();
            assert!(
                !value.contains(KEY) && !value.contains(CHOSEN),
                "{door:?}: the model server got {name}: {value}"
            );
        }
        assert!(!headers.contains_key("x-api-key"), "{door:?}: {headers:?}");
    }
}

/// A hostile client names the capture upstream as its destination and its fallback; the
/// request goes where the policy sends it, and the capture upstream hears nothing.
async fn a_client_cannot_choose_the_endpoint(world: &mut World) {
    let capture = world.capture_address();
    let body = json!({"model": "auto", "max_tokens": 8,
        "messages": [{"role": "user", "content": SIMPLE}]});
    // The policy's choice for this very body: `max_tokens` is part of the decision.
    let expected = world.policy_pick(&body).await;
    for door in DOORS {
        world.captured.lock().unwrap().clear();
        let url = format!("{}/v1/chat/completions", world.base(door));
        let destinations = [
            ("x-gateway-destination-endpoint", capture.as_str()),
            ("x-gateway-destination-endpoint-fallback", capture.as_str()),
        ];
        let reply = post_as(KEY, &url, &body, &destinations).await;
        assert_eq!(reply.status, 200, "{door:?}: {:?}", reply.body);
        assert_eq!(reply.header("x-quantrouter-profile"), expected, "{door:?}");
        let captured = world.captured.lock().unwrap();
        assert!(
            captured.is_empty(),
            "{door:?}: the client's destination got the request: {captured:?}"
        );
    }
}

/// `body` POSTed to `url` with `key` as a bearer token and `extra` headers.
async fn post_as(key: &str, url: &str, body: &Value, extra: &[(&str, &str)]) -> Reply {
    let bearer = format!("Bearer {key}");
    let mut headers = vec![
        ("content-type", "application/json"),
        ("authorization", bearer.as_str()),
    ];
    headers.extend_from_slice(extra);
    send(&client(), "POST", url, &body.to_string(), &headers).await
}

// === impl World ===

impl World {
    async fn start() -> Self {
        let dir = tempfile::Builder::new()
            .prefix("qr-doors-")
            .tempdir()
            .unwrap();
        let (capture_url, captured) = capture_upstream().await;
        let key_file = dir.path().join("upstream-key");
        std::fs::write(&key_file, UPSTREAM_KEY).unwrap();
        // One tenant without limits, one allowed two requests a minute, one whose tokens
        // are counted.
        let doc = json!({"version": 1, "tenants": [
            {"id": "team-a", "key_sha256": [hash_key(KEY)]},
            {"id": "tight", "key_sha256": [hash_key(TIGHT_KEY)],
             "limits": {"requests_per_minute": 2}},
            {"id": "metered", "key_sha256": [hash_key(METERED_KEY)],
             "limits": {"tokens_per_minute": 100_000_000}},
        ]});
        let tenants = tenants_from(&dir, &doc.to_string()).await;
        let sims = |_| SimConfig {
            prefix_cache_blocks: 4096,
            ..SimConfig::default()
        };
        let edit = |set: &mut quantrouter_policy::ProfileSet| {
            for profile in &mut set.profiles {
                // A 2 MB prompt fits; the context check is not what these rows are about.
                profile.max_context_tokens = 4_000_000;
                if let Upstream::Static(upstream) = &mut profile.upstream {
                    upstream
                        .apis
                        .extend([UpstreamApi::Messages, UpstreamApi::Responses]);
                }
            }
            let mut capture = set.profiles[0].clone();
            capture.id = CAPTURE.to_owned();
            capture.tier = CAPTURE.to_owned();
            capture.cost_per_1m_input_tokens *= 100.0;
            capture.cost_per_1m_output_tokens *= 100.0;
            let mut upstream = StaticUpstream::new(vec![capture_url.clone()]);
            upstream.api_key_file = Some(key_file.to_string_lossy().into_owned());
            capture.upstream = Upstream::Static(upstream);
            set.profiles.push(capture);
        };
        let tiers = Tiers::start([1, 1, INT4_SIMS], sims, edit, |c| {
            c.epp_listen = Some(loopback());
            c.tenants = Some(tenants);
        })
        .await;
        let envoy = Envoy::start(tiers.router.epp_addr().unwrap()).await;
        Self {
            tiers,
            envoy,
            captured,
            clients: Clients::start(),
            _dir: dir,
        }
    }

    /// The metered tenant's tokens this minute, from the admin port.
    async fn metered_tokens(&self) -> u64 {
        let url = format!("http://{}/admin/tenants", self.tiers.router.admin_addr());
        let report = send(&client(), "GET", &url, "", &[]).await.json();
        let tenants = report["tenants"].as_array().unwrap();
        let metered = tenants.iter().find(|t| t["id"] == "metered").unwrap();
        metered["usage"]["tokens_this_minute"].as_u64().unwrap()
    }

    fn base(&self, door: Door) -> String {
        match door {
            Door::Http => format!("http://{}", self.tiers.router.public_addr()),
            Door::Gateway => format!("http://{}", self.envoy.listener),
        }
    }

    async fn ask(&mut self, door: Door, ask: Ask) -> Value {
        let request = json!({
            "base_url": self.base(door),
            "api_key": ask.key,
            "client": ask.client,
            "kind": ask.kind,
            "headers": ask.headers,
            "body": ask.body,
        });
        self.clients.ask(&request).await
    }

    /// One case through both doors: the same status, and the same profile (an answer), the
    /// same count (a token count) or the same error body in the API's shape (a refusal).
    async fn both_doors(&mut self, case: &Case) -> Result<(), String> {
        let http = self.ask(Door::Http, (case.ask)()).await;
        let gateway = self.ask(Door::Gateway, (case.ask)()).await;
        for (door, answer) in [(Door::Http, &http), (Door::Gateway, &gateway)] {
            if answer["status"] != case.status {
                return Err(format!("{door:?} answered {answer}"));
            }
        }
        let same = match case.status {
            200 if (case.ask)().kind == "count_tokens" => {
                http["text"]
                    .as_str()
                    .is_some_and(|n| n.parse::<u64>().is_ok_and(|n| n > 0))
                    && http["text"] == gateway["text"]
            }
            200 => {
                let profile = &http["headers"]["x-quantrouter-profile"];
                profile.is_string() && profile == &gateway["headers"]["x-quantrouter-profile"]
            }
            _ => http["error"] == gateway["error"],
        };
        match same {
            true => Ok(()),
            false => Err(format!("the doors differ:\n  {http}\n  {gateway}")),
        }
    }

    /// The profile `/v1/route` gives a chat `body`.
    async fn policy_pick(&self, body: &Value) -> String {
        let url = format!("{}/v1/route", self.base(Door::Http));
        let reply = post_as(KEY, &url, body, &[]).await;
        reply.json()["profile"].as_str().unwrap().to_owned()
    }

    /// Requests each sim has served, tier by tier.
    fn counts(&self) -> Vec<u64> {
        let sims = self.tiers.sims.iter().flatten();
        sims.map(|s| s.stats().requests).collect()
    }

    /// The one sim that served a request since `before`.
    fn served_since(&self, before: &[u64]) -> usize {
        let served: Vec<usize> = (self.counts().iter().zip(before))
            .enumerate()
            .filter(|(_, (now, then))| now > then)
            .map(|(i, _)| i)
            .collect();
        let [sim] = served[..] else {
            panic!("one sim per request, got {served:?}");
        };
        sim
    }

    /// The capture upstream as a Gateway names endpoints, `ip:port`.
    fn capture_address(&self) -> String {
        let snapshot = self.tiers.router.app.store.load();
        let i = snapshot.set.index_of(CAPTURE).unwrap();
        let endpoints = snapshot.runtime[i].pool.endpoints();
        let base = endpoints[0].base().to_owned();
        base.trim_start_matches("http://")
            .trim_end_matches('/')
            .to_owned()
    }
}

// === impl Ask ===

impl Ask {
    fn chat(key: &'static str, prompt: &str) -> Self {
        Self {
            client: "openai",
            kind: "chat",
            key,
            headers: json!({}),
            body: json!({"model": "auto", "max_tokens": 8,
                "messages": [{"role": "user", "content": prompt}]}),
        }
    }

    fn messages(key: &'static str, prompt: &str) -> Self {
        Self {
            client: "anthropic",
            kind: "messages",
            key,
            headers: json!({}),
            body: json!({"model": "auto", "max_tokens": 8,
                "messages": [{"role": "user", "content": prompt}]}),
        }
    }

    fn responses(input: &str, previous: Option<&str>) -> Self {
        let mut body = json!({"model": "auto", "input": input, "max_output_tokens": 16});
        if let Some(previous) = previous {
            body["previous_response_id"] = previous.into();
        }
        Self {
            client: "openai",
            kind: "responses",
            key: KEY,
            headers: json!({}),
            body,
        }
    }

    fn kind(self, kind: &'static str) -> Self {
        Self { kind, ..self }
    }

    /// The same request with `key` of its body set to `value`.
    fn field(mut self, key: &str, value: Value) -> Self {
        self.body[key] = value;
        self
    }
}

// === impl Clients ===

impl Clients {
    fn start() -> Self {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/doors.py");
        let mut child = tokio::process::Command::new(python())
            .arg(script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        Self {
            _child: child,
            stdin,
            lines,
        }
    }

    async fn ask(&mut self, request: &Value) -> Value {
        let line = format!("{request}\n");
        self.stdin.write_all(line.as_bytes()).await.unwrap();
        self.stdin.flush().await.unwrap();
        let answer = tokio::time::timeout(Duration::from_secs(90), self.lines.next_line())
            .await
            .expect("the client answers within 90 s")
            .unwrap()
            .expect("the client printed what it saw (its errors are above)");
        serde_json::from_str(&answer).unwrap_or_else(|e| panic!("{e}: {answer}"))
    }
}
