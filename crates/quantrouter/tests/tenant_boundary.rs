//! The tenant boundary (docs/operations.md "Tenant boundaries"): no tenant reads, continues,
//! deletes or steers another tenant's state, and nothing the router answers reveals another
//! tenant's traffic. Stored responses, sessions, the prefix tables, the second opinion and
//! the KV cache (`prefix_cache: "isolated"` sends vLLM's `cache_salt`).
//!
//! Each case is a table of requests — the tenant whose key a request carries, its method,
//! path, headers and body, and what it must get (status, serving profile, error code,
//! headers) — run through both front doors ([`Door`]): the router's HTTP port, and a real
//! Envoy with the router as its endpoint picker, each in a world of its own (sims, router,
//! Redis). What a table cannot see (what reached an upstream) is asserted after it, for
//! each door.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use quantrouter::server::{Server, ServerConfig};
use quantrouter::tenants::limiter::LimiterConfig;
use quantrouter::tenants::Tenants;
use quantrouter_policy::{
    hash_key, ProfileSet, SecondOpinion, StaticUpstream, Upstream, UpstreamApi, DEFAULT_PROFILE_SET,
};
use serde_json::{json, Value};
use support::envoy::Envoy;
use support::redis_server::RedisServer;
use support::{client, loopback, send, start_router, Reply, Tiers, SIMPLE};
use vllm_sim::{Faults, SimConfig, SimServer, WrongWhen};

const FP16: &str = "llama8b-fp16";
const FP8: &str = "llama8b-fp8";
const INT4: &str = "llama8b-awq";

/// A fixed minute (in 2100): rate windows do not roll over while a table runs.
const NOW_MS: u64 = 4_102_444_800_000;

fn key_of(tenant: &str) -> String {
    format!("sk-{tenant}-Vq93kLm")
}

// === the table ===

/// One request of a table and what it must get.
#[derive(Debug, Clone)]
struct Row {
    /// What the row shows, printed when it fails.
    what: &'static str,
    /// The tenant whose key the request carries; `None`: no key.
    tenant: Option<&'static str>,
    method: &'static str,
    /// `$name` is replaced by what an earlier row saved under `name`.
    path: &'static str,
    headers: Vec<(&'static str, &'static str)>,
    /// JSON; `$name` in it is replaced as in `path`. `Null`: no body.
    body: Value,
    /// The replica (of a door with several) the request goes to.
    via: usize,
    expect: Expect,
    /// Saves the answer's `id` under this name.
    saves: Option<&'static str>,
    /// Sent again until it gets what it must (state another replica writes in the
    /// background), for at most five seconds.
    until: bool,
}

/// What a row's answer must be.
#[derive(Debug, Clone, Default)]
struct Expect {
    status: u16,
    /// `x-quantrouter-profile`.
    profile: Option<&'static str>,
    /// `error.code` of OpenAI's error shape.
    code: Option<&'static str>,
    /// Each header's value; `None`: absent; `Some("*")`: present.
    headers: Vec<(&'static str, Option<&'static str>)>,
}

impl Row {
    fn new(what: &'static str, tenant: Option<&'static str>, method: &'static str) -> Self {
        Self {
            what,
            tenant,
            method,
            path: "/v1/chat/completions",
            headers: Vec::new(),
            body: Value::Null,
            via: 0,
            expect: Expect {
                status: 200,
                ..Expect::default()
            },
            saves: None,
            until: false,
        }
    }

    fn post(
        what: &'static str,
        tenant: Option<&'static str>,
        path: &'static str,
        body: Value,
    ) -> Self {
        Self {
            path,
            body,
            ..Self::new(what, tenant, "POST")
        }
    }

    fn chat(what: &'static str, tenant: Option<&'static str>, body: Value) -> Self {
        Self::post(what, tenant, "/v1/chat/completions", body)
    }

    fn get(what: &'static str, tenant: Option<&'static str>, path: &'static str) -> Self {
        Self {
            path,
            ..Self::new(what, tenant, "GET")
        }
    }

    fn delete(what: &'static str, tenant: Option<&'static str>, path: &'static str) -> Self {
        Self {
            path,
            ..Self::new(what, tenant, "DELETE")
        }
    }

    fn header(mut self, name: &'static str, value: &'static str) -> Self {
        self.headers.push((name, value));
        self
    }

    fn via(mut self, replica: usize) -> Self {
        self.via = replica;
        self
    }

    fn saves(mut self, name: &'static str) -> Self {
        self.saves = Some(name);
        self
    }

    fn until(mut self) -> Self {
        self.until = true;
        self
    }

    fn status(mut self, status: u16) -> Self {
        self.expect.status = status;
        self
    }

    fn profile(mut self, profile: &'static str) -> Self {
        self.expect.profile = Some(profile);
        self
    }

    fn code(mut self, code: &'static str) -> Self {
        self.expect.code = Some(code);
        self
    }

    fn has(mut self, name: &'static str, value: Option<&'static str>) -> Self {
        self.expect.headers.push((name, value));
        self
    }

    fn affinity(self, value: &'static str) -> Self {
        self.has("x-quantrouter-affinity", Some(value))
    }

    /// Why `reply` is not what the row must get, if it is not.
    fn mismatch(&self, reply: &Reply) -> Option<String> {
        let expect = &self.expect;
        let body = String::from_utf8_lossy(&reply.body);
        if reply.status != expect.status {
            return Some(format!(
                "status {} (want {}): {body}",
                reply.status, expect.status
            ));
        }
        if let Some(profile) = expect.profile {
            let got = reply.header("x-quantrouter-profile");
            if got != profile {
                return Some(format!("profile {got} (want {profile})"));
            }
        }
        if let Some(code) = expect.code {
            let got = serde_json::from_slice::<Value>(&reply.body)
                .ok()
                .and_then(|v| v["error"]["code"].as_str().map(str::to_owned));
            if got.as_deref() != Some(code) {
                return Some(format!("error code {got:?} (want {code}): {body}"));
            }
        }
        for (name, want) in &expect.headers {
            let got = reply.headers.get(*name).map(|v| v.to_str().unwrap());
            let fine = match (want, got) {
                (None, None) => true,
                (Some("*"), Some(_)) => true,
                (Some(want), Some(got)) => *want == got,
                _ => false,
            };
            if !fine {
                return Some(format!("header {name}: {got:?} (want {want:?})"));
            }
        }
        None
    }
}

/// A front door of the router.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Door {
    /// Its own HTTP port.
    Port,
    /// A real Envoy (`manifests/envoy/envoy.yaml`) with the router as its endpoint picker.
    Gateway,
}

/// Runs `case` through each door at once, each with a world of its own: nothing one door's
/// run leaves behind can make the other's pass.
async fn both_doors<F, Fut>(case: F)
where
    F: Fn(Door) -> Fut,
    Fut: Future<Output = ()>,
{
    tokio::join!(case(Door::Port), case(Door::Gateway));
}

/// Opens both doors of a router: the HTTP port, and the picker on a free port.
fn picker(c: &mut ServerConfig) {
    c.epp_listen = Some(loopback());
}

/// The way in through one door, on one or more replicas.
struct Entrance {
    door: Door,
    replicas: Vec<Replica>,
}

struct Replica {
    port: SocketAddr,
    /// In front of the replica's picker, through the Gateway.
    envoy: Option<Envoy>,
}

impl Entrance {
    /// `door` of each router (an Envoy each, started together, through the Gateway).
    async fn open(door: Door, routers: &[&Server]) -> Self {
        let replicas = routers.iter().map(|router| async move {
            let envoy = match door {
                Door::Port => None,
                Door::Gateway => {
                    let picker = router.epp_addr().expect("the router's picker is open");
                    Some(Envoy::start(picker).await)
                }
            };
            Replica {
                port: router.public_addr(),
                envoy,
            }
        });
        let replicas = futures_util::future::join_all(replicas).await;
        Self { door, replicas }
    }

    /// Sends `row`'s request with `saved` substituted; the tenant's key as a bearer token.
    /// Through the Gateway, a generation request goes to Envoy; reading or deleting a stored
    /// response goes to the replica's HTTP port, as a deployment routes those paths.
    async fn send(&self, row: &Row, saved: &Saved) -> Reply {
        let fill = |text: &str| {
            saved.iter().fold(text.to_owned(), |text, (name, value)| {
                text.replace(&format!("${name}"), value)
            })
        };
        let replica = &self.replicas[row.via];
        let envoy = replica.envoy.as_ref().filter(|_| row.method == "POST");
        let address = envoy.map_or(replica.port, |envoy| envoy.listener);
        let url = format!("http://{address}{}", fill(row.path));
        let auth = row.tenant.map(|t| format!("Bearer {}", key_of(t)));
        let mut headers = vec![("content-type", "application/json")];
        headers.extend(auth.as_deref().map(|a| ("authorization", a)));
        headers.extend(row.headers.iter().copied());
        let body = match &row.body {
            Value::Null => String::new(),
            body => fill(&body.to_string()),
        };
        let reply = send(&client(), row.method, &url, &body, &headers).await;
        // Envoy names itself in every answer it relays or makes: the row went through it.
        if envoy.is_some() {
            assert_eq!(
                reply.header("server"),
                "envoy",
                "{}: not through Envoy",
                row.what
            );
        }
        reply
    }
}

/// What rows saved, by name.
type Saved = HashMap<&'static str, String>;

/// Runs a table through an entrance, row by row, adding what its rows save to `saved`.
async fn run(entrance: &Entrance, table: &[Row], saved: &mut Saved) {
    for (n, row) in table.iter().enumerate() {
        // A row sent `until` it matches is polled, within a deadline.
        let until = tokio::time::Instant::now() + Duration::from_secs(5);
        let mut poll = tokio::time::interval(Duration::from_millis(10));
        let reply = loop {
            poll.tick().await;
            let reply = entrance.send(row, saved).await;
            let mismatch = row.mismatch(&reply);
            match mismatch {
                None => break reply,
                Some(_) if row.until && tokio::time::Instant::now() < until => continue,
                Some(why) => panic!("{:?}: row {n} ({}): {why}", entrance.door, row.what),
            }
        };
        if let Some(name) = row.saves {
            let id = reply.json()["id"].as_str().unwrap().to_owned();
            saved.insert(name, id);
        }
    }
}

// === fixtures ===

/// Tenants from `(id, extra fields)`, each with the key [`key_of`] its id, on a manual clock.
async fn tenants(specs: &[(&str, Value)]) -> (Arc<Tenants>, tempfile::TempDir) {
    let dir = tempfile::Builder::new()
        .prefix("qr-tenant-boundary-")
        .tempdir()
        .unwrap();
    let list: Vec<Value> = specs
        .iter()
        .map(|(id, extra)| {
            let mut tenant = json!({"id": id, "key_sha256": [hash_key(&key_of(id))]});
            if let (Value::Object(tenant), Value::Object(extra)) = (&mut tenant, extra) {
                tenant.extend(extra.clone());
            }
            tenant
        })
        .collect();
    let doc = json!({"version": 1, "tenants": list}).to_string();
    let limiter = LimiterConfig::new(None, "replica-0".to_owned());
    let tenants = support::tenants_counted_by(dir.path(), &doc, limiter, NOW_MS).await;
    (tenants, dir)
}

/// Both doors open, and `tenants`.
fn with_tenants(tenants: &Arc<Tenants>) -> impl Fn(&mut ServerConfig) + '_ {
    move |c| {
        picker(c);
        c.tenants = Some(Arc::clone(tenants));
    }
}

fn chat(model: &str, content: &str) -> Value {
    json!({"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": content}]})
}

/// A conversation of `turns` user messages, each answered but the last.
fn turns(turns: &[&str]) -> Value {
    let mut messages = vec![json!({"role": "system", "content": "Be helpful."})];
    for (i, turn) in turns.iter().enumerate() {
        if i > 0 {
            messages.push(json!({"role": "assistant", "content": "Sure, here you go."}));
        }
        messages.push(json!({"role": "user", "content": turn}));
    }
    json!({"model": "auto", "max_tokens": 4, "messages": messages})
}

fn response(input: &str) -> Value {
    json!({"model": "auto", "input": input, "instructions": "Answer briefly."})
}

fn native_agent_apis(set: &mut ProfileSet) {
    for profile in &mut set.profiles {
        if let Upstream::Static(upstream) = &mut profile.upstream {
            upstream
                .apis
                .extend([UpstreamApi::Messages, UpstreamApi::Responses]);
        }
    }
}

fn cached_sims(_: usize) -> SimConfig {
    SimConfig {
        prefix_cache_blocks: 4096,
        ..SimConfig::default()
    }
}

/// `vllm:prefix_cache_hits_total` of a sim.
async fn cache_hits(sim: &SimServer) -> f64 {
    let page = send(&client(), "GET", &format!("{}/metrics", sim.url()), "", &[]).await;
    let text = String::from_utf8(page.body.to_vec()).unwrap();
    text.lines()
        .find(|l| l.starts_with("vllm:prefix_cache_hits_total"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap()
}

// === stored responses ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_tenants_stored_response_does_not_exist_on_any_replica() {
    both_doors(stored_responses).await;
}

/// Through the Gateway the responses are stored through the picker and read, or deleted,
/// on the replica's HTTP port: a response the picker stored is placed with its tenant.
async fn stored_responses(door: Door) {
    let redis = RedisServer::start(None);
    let limited = json!({"limits": {"requests_per_minute": 2}});
    let (tenants, _dir) = tenants(&[
        ("team-a", json!({})),
        ("team-b", json!({})),
        ("reader", limited.clone()),
        ("reader-py", limited),
    ])
    .await;
    let shared = |c: &mut ServerConfig| {
        picker(c);
        c.stored_responses.redis = Some((redis.handle(), "qr".into()));
        c.tenants = Some(Arc::clone(&tenants));
    };
    let t = Tiers::start(
        [1, 1, 1],
        |_| SimConfig::default(),
        native_agent_apis,
        shared,
    )
    .await;
    // A second replica: it finds A's response only through Redis.
    let other = start_router(t.set.clone(), shared).await;
    let (a, b) = (Some("team-a"), Some("team-b"));
    let own = "/v1/responses/$a";
    let mut follow = response("And in German?");
    follow["previous_response_id"] = "$a".into();
    let table = [
        Row::post("A stores a response", a, "/v1/responses", response(SIMPLE))
            .profile(INT4)
            .saves("a"),
        Row::get("the other replica finds it in Redis", a, own)
            .via(1)
            .until(),
        Row::get("B reads it here", b, own)
            .status(404)
            .code("response_not_found"),
        Row::get("B reads it there", b, own)
            .via(1)
            .status(404)
            .code("response_not_found"),
        Row::post("B continues it", b, "/v1/responses", follow.clone())
            .status(404)
            .code("response_not_found"),
        Row::post("B continues it there", b, "/v1/responses", follow.clone())
            .via(1)
            .status(404)
            .code("response_not_found"),
        Row::delete("B deletes it", b, own)
            .status(404)
            .code("response_not_found"),
        Row::delete("B deletes it there", b, own)
            .via(1)
            .status(404)
            .code("response_not_found"),
        Row::get("A still reads it", a, own),
        Row::get("A still reads it there", a, own).via(1),
    ];
    let entrance = Entrance::open(door, &[&t.router, &other]).await;
    let mut saved = Saved::new();
    run(&entrance, &table, &mut saved).await;
    // The shared record names the tenant.
    let key = format!("qr:responses:{}", saved["a"]);
    let mut conn = redis
        .client()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let record: String = redis::AsyncCommands::get(&mut conn, &key).await.unwrap();
    let record: Value = serde_json::from_str(&record).unwrap();
    assert_eq!(
        record,
        json!({"profile": INT4, "tenant": "team-a"}),
        "{door:?}"
    );

    let table = [
        Row::post("A continues it, on its profile", a, "/v1/responses", follow).profile(INT4),
        Row::delete("A deletes it", a, own),
        Row::get("then it is gone", a, own)
            .status(404)
            .code("response_not_found"),
    ];
    run(&entrance, &table, &mut saved).await;

    // Reads count against the tenant's request limit: a store, a read, then a 429.
    let reads = [
        Row::post(
            "it stores a response",
            Some("reader"),
            "/v1/responses",
            response(SIMPLE),
        )
        .saves("r"),
        Row::get(
            "the first read is counted",
            Some("reader"),
            "/v1/responses/$r",
        )
        .has("x-ratelimit-remaining-requests", Some("0")),
        Row::get("the next is refused", Some("reader"), "/v1/responses/$r")
            .status(429)
            .code("rate_limit_exceeded")
            .has("retry-after", Some("*")),
        Row::delete("so is a delete", Some("reader"), "/v1/responses/$r")
            .status(429)
            .code("rate_limit_exceeded"),
    ];
    run(&entrance, &reads, &mut Saved::new()).await;

    // The same through the official client, on the HTTP port.
    if door == Door::Port {
        let url = format!("http://{}", t.router.public_addr());
        let keys = ["team-a", "team-b", "reader-py"].map(key_of);
        support::python_checks("tenant_boundary.py", &[&[url][..], &keys[..]].concat()).await;
    }
}

// === sessions ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_turn_or_a_pinned_one_chooses_no_tier_for_later_turns() {
    both_doors(first_and_pinned_turns).await;
}

async fn first_and_pinned_turns(door: Door) {
    // The demo's finding, on a router without tenants: one request pinned to fp16, then
    // the same single-turn prompt routed by the router itself.
    let t = Tiers::start([1, 1, 1], cached_sims, |_| {}, picker).await;
    let spain = "What is the capital of Spain?";
    let strict = ("x-quantrouter-min-quality", "0.96");
    let table = [
        Row::chat("pinned to fp16 by its model", None, chat(FP16, spain)).profile(FP16),
        Row::chat("the same prompt, auto", None, chat("auto", spain))
            .profile(INT4)
            .affinity("none"),
        Row::chat("and again", None, chat("auto", spain))
            .profile(INT4)
            .affinity("none"),
        Row::chat("pinned by header in a session", None, chat("auto", SIMPLE))
            .header("x-session-id", "s-1")
            .header("x-quantrouter-profile", FP16)
            .profile(FP16),
        Row::chat(
            "the session's next auto turn",
            None,
            turns(&[SIMPLE, "Thanks!"]),
        )
        .header("x-session-id", "s-1")
        .profile(INT4)
        .affinity("none"),
        // Routed to fp16 by the router itself: a conversation continuing it stays there.
        Row::chat(
            "a first turn that needs fp16",
            None,
            turns(&["Hello there."]),
        )
        .header(strict.0, strict.1)
        .profile(FP16),
        Row::chat("its same opening alone", None, turns(&["Hello there."]))
            .profile(INT4)
            .affinity("none"),
        Row::chat(
            "the conversation's next turn",
            None,
            turns(&["Hello there.", "Thanks!"]),
        )
        .profile(INT4)
        .affinity("none"),
    ];
    let entrance = Entrance::open(door, &[&t.router]).await;
    run(&entrance, &table, &mut Saved::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_follows_only_its_own_tenants_turns() {
    both_doors(conversations_by_tenant).await;
}

async fn conversations_by_tenant(door: Door) {
    let (tenants, _dir) = tenants(&[("team-a", json!({})), ("team-b", json!({}))]).await;
    let t = Tiers::start([1, 1, 1], cached_sims, |_| {}, with_tenants(&tenants)).await;
    let (a, b) = (Some("team-a"), Some("team-b"));
    let strict = ("x-quantrouter-min-quality", "0.96");
    let table = [
        Row::chat("A opens session s-1", a, turns(&["Hello there."]))
            .header("x-session-id", "s-1")
            .profile(INT4),
        Row::chat("B's hard turn in its own s-1", b, turns(&["Hello there."]))
            .header("x-session-id", "s-1")
            .header(strict.0, strict.1)
            .profile(FP16),
        Row::chat(
            "A's next turn stays A's",
            a,
            turns(&["Hello there.", "Thanks!"]),
        )
        .header("x-session-id", "s-1")
        .profile(INT4)
        .affinity("none"),
        Row::chat(
            "B's next turn stays B's",
            b,
            turns(&["Hello there.", "Thanks!"]),
        )
        .header("x-session-id", "s-1")
        .profile(FP16)
        .affinity("session"),
        // Keyed by the opening messages: a continued conversation is the tenant's own.
        Row::chat(
            "B opens a conversation on fp16",
            b,
            turns(&["Name a color."]),
        )
        .header(strict.0, strict.1)
        .profile(FP16),
        Row::chat(
            "A continues the same opening",
            a,
            turns(&["Name a color.", "Another."]),
        )
        .profile(INT4)
        .affinity("none"),
        Row::chat("B continues it", b, turns(&["Name a color.", "Another."]))
            .profile(FP16)
            .affinity("session"),
    ];
    let entrance = Entrance::open(door, &[&t.router]).await;
    run(&entrance, &table, &mut Saved::new()).await;
}

// === prefix tables and the KV cache ===

/// A long prompt for `model`: a dozen prefix blocks.
fn long_prompt(model: &str) -> Value {
    let system = "You answer questions about one customer's orders. ".repeat(12);
    json!({"model": model, "max_tokens": 4, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "Where is my parcel?"}]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_affinity_header_reports_only_the_tenants_own_traffic() {
    both_doors(affinity_by_tenant).await;
}

async fn affinity_by_tenant(door: Door) {
    let (tenants, _dir) = tenants(&[("team-a", json!({})), ("team-b", json!({}))]).await;
    // Two endpoints for int4: the prompt's cached prefix picks one.
    let t = Tiers::start([1, 1, 2], cached_sims, |_| {}, with_tenants(&tenants)).await;
    let (a, b) = (Some("team-a"), Some("team-b"));
    let table = [
        Row::chat("A sends a long prompt", a, long_prompt(INT4)).affinity("none"),
        Row::chat("A sends it again", a, long_prompt(INT4)).affinity("prefix"),
        Row::chat("B sends the same", b, long_prompt(INT4)).affinity("none"),
        Row::chat("B sends it again", b, long_prompt(INT4)).affinity("prefix"),
    ];
    let entrance = Entrance::open(door, &[&t.router]).await;
    run(&entrance, &table, &mut Saved::new()).await;
}

/// Two tenants with the default `prefix_cache` and two isolated ones.
async fn shared_and_isolated() -> (Arc<Tenants>, tempfile::TempDir) {
    let isolated = json!({"prefix_cache": "isolated"});
    let specs = [
        ("team-a", json!({})),
        ("team-b", json!({})),
        ("iso-a", isolated.clone()),
        ("iso-b", isolated),
    ];
    tenants(&specs).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_isolated_tenant_shares_no_kv_cache_block() {
    both_doors(isolated_kv_cache).await;
}

async fn isolated_kv_cache(door: Door) {
    let (tenants, _dir) = shared_and_isolated().await;
    let t = Tiers::start([1, 1, 2], cached_sims, |_| {}, with_tenants(&tenants)).await;
    let entrance = Entrance::open(door, &[&t.router]).await;
    // The router's table: an isolated tenant's prompt is placed under its salt.
    let table = [
        Row::chat("A sends a long prompt", Some("team-a"), long_prompt(INT4)).affinity("none"),
        Row::chat(
            "an isolated tenant sends it",
            Some("iso-a"),
            long_prompt(INT4),
        )
        .affinity("none"),
        Row::chat("and again", Some("iso-a"), long_prompt(INT4)).affinity("prefix"),
    ];
    run(&entrance, &table, &mut Saved::new()).await;

    // The model server's cache (fp8 has one endpoint): shared tenants share it, an
    // isolated one shares it with no one but itself.
    let sim = &t.sims[1][0];
    let fp8 = |what, tenant| [Row::chat(what, Some(tenant), long_prompt(FP8)).profile(FP8)];
    run(&entrance, &fp8("A warms fp8", "team-a"), &mut Saved::new()).await;
    let cold = cache_hits(sim).await;
    run(
        &entrance,
        &fp8("B hits A's blocks", "team-b"),
        &mut Saved::new(),
    )
    .await;
    let shared = cache_hits(sim).await;
    assert!(
        shared > cold,
        "{door:?}: shared tenants share the cache: {cold} -> {shared}"
    );
    for tenant in ["iso-a", "iso-b"] {
        run(
            &entrance,
            &fp8("an isolated tenant", tenant),
            &mut Saved::new(),
        )
        .await;
        assert_eq!(
            cache_hits(sim).await,
            shared,
            "{door:?}: {tenant} hit someone's blocks"
        );
    }
    run(&entrance, &fp8("iso-a again", "iso-a"), &mut Saved::new()).await;
    assert!(
        cache_hits(sim).await > shared,
        "{door:?}: iso-a hits its own blocks"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_isolated_tenants_requests_carry_its_cache_salt_upstream() {
    both_doors(cache_salts_upstream).await;
}

/// Messages go to the one profile that serves them natively (fp16) through the Gateway,
/// which cannot translate, and to the cheapest, translated to chat, on the HTTP port: the
/// salt is in both bodies.
async fn cache_salts_upstream(door: Door) {
    let (tenants, _dir) = shared_and_isolated().await;
    let (url, seen) = support::capture_upstream().await;
    let mut set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
    for profile in &mut set.profiles {
        let mut upstream = StaticUpstream::new(vec![url.clone()]);
        if profile.id == FP16 {
            upstream.apis.push(UpstreamApi::Messages);
        }
        profile.upstream = Upstream::Static(upstream);
    }
    let router = start_router(set, with_tenants(&tenants)).await;
    let mut own_salt = chat("auto", SIMPLE);
    own_salt["cache_salt"] = "user-1".into();
    let mut streamed = chat("auto", SIMPLE);
    streamed["stream"] = true.into();
    let message = json!({"model": "auto", "max_tokens": 8,
        "messages": [{"role": "user", "content": SIMPLE}]});
    let table = [
        Row::chat("a shared tenant", Some("team-a"), chat("auto", SIMPLE)),
        Row::chat(
            "a shared tenant's own salt",
            Some("team-a"),
            own_salt.clone(),
        ),
        Row::chat("an isolated tenant", Some("iso-a"), chat("auto", SIMPLE)),
        Row::chat("its client's own salt", Some("iso-a"), own_salt),
        Row::chat(
            "another isolated tenant",
            Some("iso-b"),
            chat("auto", SIMPLE),
        ),
        Row::chat("a stream", Some("iso-a"), streamed),
        Row::post("Messages", Some("iso-a"), "/v1/messages", message),
    ];
    let entrance = Entrance::open(door, &[&router]).await;
    run(&entrance, &table, &mut Saved::new()).await;
    let salts: Vec<Option<String>> = seen
        .lock()
        .unwrap()
        .iter()
        .map(|(_, body)| {
            let body: Value = serde_json::from_slice(body).unwrap();
            body["cache_salt"].as_str().map(str::to_owned)
        })
        .collect();
    let [shared, shared_own, iso_a, iso_a_user, iso_b, stream, messages] = &salts[..] else {
        panic!("{door:?}: {salts:?}");
    };
    assert_eq!(
        shared, &None,
        "{door:?}: a shared tenant's body goes as sent"
    );
    assert_eq!(shared_own.as_deref(), Some("user-1"), "{door:?}");
    let iso_a = iso_a.as_deref().unwrap();
    assert!(
        iso_a.len() == 64 && iso_a.bytes().all(|c| c.is_ascii_hexdigit()),
        "{door:?}: {iso_a}"
    );
    let iso_a_user = iso_a_user.as_deref().unwrap();
    assert!(
        iso_a_user != iso_a && iso_a_user != "user-1",
        "{door:?}: {iso_a_user}"
    );
    assert_ne!(iso_b.as_deref().unwrap(), iso_a, "{door:?}");
    assert_eq!(stream.as_deref(), Some(iso_a), "{door:?}");
    assert_eq!(messages.as_deref(), Some(iso_a), "{door:?}");
    // Nothing but the salt changed: the body is the client's, model aside.
    let (_, body) = seen.lock().unwrap()[2].clone();
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        body["messages"],
        chat("auto", SIMPLE)["messages"],
        "{door:?}"
    );
}

// === the second opinion ===

/// Six numbers: the cheap sim rates it 8.
const HARD: &str = "Ana brings 12 shells. Bo brings 7 shells. Chen brings 30 shells. Dara \
    brings 4 shells. Eli brings 9 shells. Farah brings 15 shells. How many shells are there \
    altogether?";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_second_opinion_asks_only_a_profile_the_tenant_may_use() {
    both_doors(second_opinion).await;
}

async fn second_opinion(door: Door) {
    let (tenants, _dir) = tenants(&[
        ("rated-a", json!({})),
        ("rated-b", json!({})),
        ("kept-off", json!({"allowed_profiles": [FP16]})),
    ])
    .await;
    let (mut set, sims) = support::sim_tiers(Duration::ZERO).await;
    let rater = &sims[1];
    rater.set_faults(Faults {
        wrong_when: Some(WrongWhen {
            quantities_over: Some(4),
            ..WrongWhen::default()
        }),
        ..Faults::default()
    });
    set.profiles.retain(|p| p.tier != "int4");
    set.policy.second_opinion = Some(SecondOpinion {
        band: [0.0, 1.0],
        profile: FP8.into(),
        timeout_ms: 5000,
        streams: false,
    });
    set.validate().unwrap();
    let router = start_router(set, with_tenants(&tenants)).await;
    let rated = Some("*");
    let table = [
        Row::chat(
            "a tenant kept off the rater",
            Some("kept-off"),
            chat("auto", HARD),
        )
        .profile(FP16)
        .has("x-quantrouter-second-opinion", None),
        Row::chat("a tenant allowed it", Some("rated-a"), chat("auto", HARD))
            .profile(FP16)
            .has("x-quantrouter-second-opinion", rated),
        Row::chat(
            "another tenant allowed it",
            Some("rated-b"),
            chat("auto", HARD),
        )
        .profile(FP16)
        .has("x-quantrouter-second-opinion", rated),
    ];
    let entrance = Entrance::open(door, &[&router]).await;
    run(&entrance, &table, &mut Saved::new()).await;
    // Asked once per allowed tenant (every answer came from fp16): a rating cached for one
    // tenant is no other's.
    assert_eq!(rater.stats().requests, 2, "{door:?}");
}
