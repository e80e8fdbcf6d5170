//! Tenant limits that hold under hostile traffic, over real HTTP with a real redis-server
//! and simulated tiers: a stream its client leaves is charged what it delivered, a request
//! reserves its `max_tokens` and worst-case cost, a correction after a minute boundary
//! lands in its minute, a failed request gives its rate back, a tenant allowed no profile
//! gets 403, and three replicas keep the bounds through bursts and an empty Redis restart.
//! In-process routers share a manual clock, so windows are chosen, not waited for.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::StatusCode;
use http_body_util::{BodyExt, Full};
use quantrouter::server::Server;
use quantrouter::tenants::limiter::{unix_ms, LimiterConfig};
use quantrouter::tenants::{Clock, Tenants, TenantsConfig};
use quantrouter_policy::limits::{to_micros, DAY_MS, MINUTE_MS};
use quantrouter_policy::{hash_key, ProfileSet};
use support::redis_server::RedisServer;
use support::{client, eventually, send, sim_tiers, start_router, Reply, SIMPLE};
use vllm_sim::{Faults, SimServer};

const PREFIX: &str = "qr";

/// Noon (and 30 s) two days from now, UTC: counters written for it do not expire under the
/// real clock while a test runs.
fn future_noon() -> u64 {
    let today = unix_ms(SystemTime::now()) / DAY_MS;
    (today + 2) * DAY_MS + 12 * 3_600_000 + 30_000
}

fn key_of(tenant: &str) -> String {
    format!("sk-{tenant}-Vq93kLm")
}

/// A tenant of the document: `id` (key [`key_of`]) with `limits` and `extra` fields.
fn tenant(id: &str, limits: &str, extra: &str) -> String {
    format!(
        r#"{{"id": "{id}", "key_sha256": ["{}"], "limits": {limits}{extra}}}"#,
        hash_key(&key_of(id))
    )
}

/// `n` router replicas in front of the same simulated tiers, sharing one Redis and clock.
struct Fleet {
    routers: Vec<Server>,
    set: ProfileSet,
    sims: Vec<SimServer>,
    _dir: tempfile::TempDir,
    clock: Clock,
}

impl Fleet {
    async fn start(n: usize, tenants: &[String], itl: Duration, redis: &RedisServer) -> Self {
        let (set, sims) = sim_tiers(itl).await;
        let dir = tempfile::Builder::new()
            .prefix("qr-tenant-bounds-")
            .tempdir()
            .unwrap();
        let file = dir.path().join("tenants.json");
        let doc = format!(r#"{{"version": 1, "tenants": [{}]}}"#, tenants.join(","));
        std::fs::write(&file, doc).unwrap();
        let clock = Clock::manual(future_noon());
        let mut routers = Vec::new();
        for i in 0..n {
            let config = TenantsConfig {
                file: Some(file.clone()),
                file_interval: Duration::from_secs(1),
                redis: None,
                redis_poll: Duration::from_secs(1),
                api_keys: None,
                metrics_top: 50,
            };
            let mut limiter = LimiterConfig::new(
                Some((redis.handle(), PREFIX.to_owned())),
                format!("replica-{i}"),
            );
            // Quick heartbeats: outages end within a test's patience; a patient admission
            // call: a burst on a shared test machine must not look like an outage.
            limiter.heartbeat = Duration::from_millis(50);
            limiter.redis_timeout = Duration::from_secs(2);
            let tenants = Tenants::start(config, limiter, clock.clone())
                .await
                .unwrap();
            let tenants = Arc::new(tenants);
            routers.push(start_router(set.clone(), |c| c.tenants = Some(tenants)).await);
        }
        let fleet = Self {
            routers,
            set,
            sims,
            _dir: dir,
            clock,
        };
        assert!(fleet.all_up(n).await, "the replicas did not see each other");
        fleet
    }

    async fn all_up(&self, n: usize) -> bool {
        eventually(Duration::from_secs(15), || async {
            self.routers.iter().all(|r| {
                let stats = r.app.tenants.as_ref().unwrap().limiter.stats();
                stats.redis_up && stats.replicas == n as u64
            })
        })
        .await
    }

    fn url(&self, replica: usize, path: &str) -> String {
        format!("http://{}{path}", self.routers[replica].public_addr())
    }

    async fn post(&self, replica: usize, tenant: &str, body: &str) -> Reply {
        let auth = format!("Bearer {}", key_of(tenant));
        let headers = [
            ("content-type", "application/json"),
            ("authorization", auth.as_str()),
        ];
        let url = self.url(replica, "/v1/chat/completions");
        send(&client(), "POST", &url, body, &headers).await
    }

    /// One tenant's entry of `/admin/tenants` on `replica`.
    async fn usage(&self, replica: usize, tenant: &str) -> serde_json::Value {
        let url = format!(
            "http://{}/admin/tenants",
            self.routers[replica].admin_addr()
        );
        let r = send(&client(), "GET", &url, "", &[]).await;
        assert_eq!(r.status, StatusCode::OK);
        let report = r.json();
        let found = report["tenants"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["id"] == tenant);
        found.cloned().unwrap()
    }

    /// What an answer cost at its serving profile's prices, in millionths.
    fn cost_micros(&self, reply: &Reply, usage: &serde_json::Value) -> f64 {
        let profile = self
            .set
            .profile(reply.header("x-quantrouter-profile"))
            .unwrap();
        let tokens = |name: &str| usage[name].as_f64().unwrap();
        tokens("prompt_tokens") * profile.cost_per_1m_input_tokens
            + tokens("completion_tokens") * profile.cost_per_1m_output_tokens
    }
}

/// A chat request for `SIMPLE` generating exactly `max_tokens` (the simulator honours vLLM's
/// `ignore_eos`), streamed or not.
fn long_chat(max_tokens: u32, stream: bool) -> String {
    let mut body = serde_json::json!({"model": "auto", "max_tokens": max_tokens,
        "ignore_eos": true, "messages": [{"role": "user", "content": SIMPLE}]});
    if stream {
        body["stream"] = true.into();
        body["stream_options"] = serde_json::json!({"include_usage": true});
    }
    body.to_string()
}

/// The `usage` of a whole answer or of a stream's usage event.
fn usage_of(reply: &Reply) -> serde_json::Value {
    if !reply
        .header("content-type")
        .starts_with("text/event-stream")
    {
        return reply.json()["usage"].clone();
    }
    let text = String::from_utf8_lossy(&reply.body);
    let usage = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter_map(|v| v.get("usage").filter(|u| !u.is_null()).cloned())
        .last();
    usage.unwrap_or_else(|| panic!("no usage in {text}"))
}

/// The most a request of `SIMPLE` with `max_tokens` can cost on any enabled profile, in
/// millionths.
fn worst_case_micros(set: &ProfileSet, max_tokens: u64) -> u64 {
    let prompt = prompt_estimate() as f64;
    let enabled = set.profiles.iter().filter(|p| p.enabled);
    enabled
        .map(|p| {
            let cost = prompt * p.cost_per_1m_input_tokens / 1e6
                + max_tokens as f64 * p.cost_per_1m_output_tokens / 1e6;
            to_micros(cost)
        })
        .max()
        .unwrap()
}

/// The prompt estimate a request of `SIMPLE` reserves.
fn prompt_estimate() -> u64 {
    (SIMPLE.len() as u64).div_ceil(4)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_its_client_leaves_before_the_end_is_charged_what_it_delivered() {
    let redis = RedisServer::start(None);
    let limits = r#"{"tokens_per_minute": 10000000, "budget_per_day": 1000.0, "soft_limit": 1.0}"#;
    let fleet = Fleet::start(
        1,
        &[tenant("team-a", limits, "")],
        Duration::from_millis(4),
        &redis,
    )
    .await;
    // Ten streams that could run to 2,000 tokens; each client reads 395 tokens and leaves.
    const READ: usize = 395;
    let streams: Vec<_> = (0..10)
        .map(|_| {
            let url = fleet.url(0, "/v1/chat/completions");
            let body = serde_json::json!({"model": "auto", "stream": true, "max_tokens": 2000,
                "ignore_eos": true, "messages": [{"role": "user", "content": SIMPLE}]});
            tokio::spawn(async move {
                let req = http::Request::post(url)
                    .header("content-type", "application/json")
                    .header("authorization", format!("Bearer {}", key_of("team-a")))
                    .body(Full::new(Bytes::from(body.to_string())))
                    .unwrap();
                let response = client().request(req).await.unwrap();
                assert_eq!(response.status(), StatusCode::OK);
                let profile = response.headers()["x-quantrouter-profile"]
                    .to_str()
                    .unwrap()
                    .to_owned();
                let mut body = response.into_body();
                let mut seen = String::new();
                // The role event, then a token per event.
                while seen.matches("data: ").count() < READ + 1 {
                    let frame = body.frame().await.unwrap().unwrap();
                    if let Ok(data) = frame.into_data() {
                        seen.push_str(&String::from_utf8_lossy(&data));
                    }
                }
                assert!(!seen.contains("[DONE]"));
                profile
            })
        })
        .collect();
    let mut served = Vec::new();
    for stream in streams {
        served.push(stream.await.unwrap());
    }
    // What the router passed on before it noticed each client was gone: the tokens read,
    // and the events in flight meanwhile (more on a loaded machine), never the 2,000
    // reserved.
    let (low, high) = (READ as u64, READ as u64 + 600);
    let prompt = prompt_estimate();
    let cost = |profile: &str, completion: u64| {
        let p = fleet.set.profile(profile).unwrap();
        (prompt as f64 * p.cost_per_1m_input_tokens
            + completion as f64 * p.cost_per_1m_output_tokens)
            / 1e6
    };
    let low_spend: f64 = served.iter().map(|p| cost(p, low)).sum();
    let high_spend: f64 = served.iter().map(|p| cost(p, high)).sum();
    let charged = eventually(Duration::from_secs(10), || async {
        let usage = fleet.usage(0, "team-a").await["usage"].clone();
        let tokens = usage["tokens_this_minute"].as_u64().unwrap();
        let spend = usage["spend_today"].as_f64().unwrap();
        (10 * (prompt + low)..=10 * (prompt + high)).contains(&tokens)
            && (low_spend - 1e-5..=high_spend + 1e-5).contains(&spend)
    })
    .await;
    let usage = fleet.usage(0, "team-a").await["usage"].clone();
    assert!(
        charged,
        "10 streams of {low}..{high} tokens delivered (spend {low_spend:.6}..{high_spend:.6}): {usage}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_per_minute_reserves_max_tokens_so_concurrent_requests_cannot_pass_it() {
    let redis = RedisServer::start(None);
    let limits = r#"{"tokens_per_minute": 2000, "soft_limit": 1.0}"#;
    let fleet =
        Arc::new(Fleet::start(2, &[tenant("team-a", limits, "")], Duration::ZERO, &redis).await);
    // Forty requests of 1,000 tokens at once, half of them streamed.
    let burst: Vec<_> = (0..40)
        .map(|i| {
            let fleet = Arc::clone(&fleet);
            tokio::spawn(async move {
                fleet
                    .post(i % 2, "team-a", &long_chat(1000, i % 4 < 2))
                    .await
            })
        })
        .collect();
    let mut served = 0;
    let mut admitted = 0;
    for task in burst {
        let r = task.await.unwrap();
        match r.status {
            StatusCode::OK => {
                admitted += 1;
                served += usage_of(&r)["total_tokens"].as_u64().unwrap();
            }
            status => assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{:?}", r.body),
        }
    }
    assert!(admitted >= 1, "nothing admitted");
    assert!(
        served <= 2000 + 1000,
        "{admitted} admitted served {served} tokens against 2,000 a minute"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_reserves_max_tokens_for_each_of_its_choices() {
    let redis = RedisServer::start(None);
    let limits = r#"{"tokens_per_minute": 100000, "soft_limit": 1.0}"#;
    let fleet = Fleet::start(1, &[tenant("team-a", limits, "")], Duration::ZERO, &redis).await;
    let body = serde_json::json!({"model": "auto", "max_tokens": 100, "n": 4,
        "messages": [{"role": "user", "content": SIMPLE}]})
    .to_string();
    let r = fleet.post(0, "team-a", &body).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    // Counted at admission: the prompt's estimate and four answers of up to 100 tokens.
    assert_eq!(
        r.header("x-ratelimit-remaining-tokens"),
        (100_000 - prompt_estimate() - 400).to_string()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_ends_in_the_next_minute_is_counted_in_the_minute_it_was_admitted() {
    let redis = RedisServer::start(None);
    let limits = r#"{"tokens_per_minute": 100000, "soft_limit": 1.0}"#;
    let fleet = Fleet::start(
        1,
        &[tenant("team-a", limits, "")],
        Duration::from_millis(2),
        &redis,
    )
    .await;
    // Admitted at :55 of a minute without max_tokens: the reservation is the default's,
    // which the answer's usage then corrects.
    let minute = future_noon() / MINUTE_MS * MINUTE_MS;
    fleet.clock.set(minute + 55_000);
    let body = serde_json::json!({"model": "auto", "stream": true,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": SIMPLE}]})
    .to_string();
    let mut opened = Vec::new();
    for _ in 0..6 {
        let req = http::Request::post(fleet.url(0, "/v1/chat/completions"))
            .header("content-type", "application/json")
            .header("authorization", format!("Bearer {}", key_of("team-a")))
            .body(Full::new(Bytes::from(body.clone())))
            .unwrap();
        let response = client().request(req).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        opened.push(response);
    }
    // The streams end in the next minute.
    fleet.clock.set(minute + 65_000);
    let mut used = 0;
    for response in opened {
        let (head, body) = response.into_parts();
        let body = body.collect().await.unwrap().to_bytes();
        let reply = Reply {
            status: head.status,
            headers: head.headers,
            body,
        };
        used += usage_of(&reply)["total_tokens"].as_u64().unwrap();
    }
    let reserved = 6 * (prompt_estimate() + 4096);
    assert!(used < reserved);
    // Back in the first minute: it holds what the six used, settled; the next minute
    // holds nothing of them.
    let settled = eventually(Duration::from_secs(10), || async {
        fleet.clock.set(minute + 59_000);
        let then = fleet.usage(0, "team-a").await["usage"]["tokens_this_minute"].as_u64();
        fleet.clock.set(minute + 65_000);
        let now = fleet.usage(0, "team-a").await["usage"]["tokens_this_minute"].as_u64();
        then == Some(used) && now == Some(0)
    })
    .await;
    fleet.clock.set(minute + 59_000);
    let usage = fleet.usage(0, "team-a").await["usage"].clone();
    assert!(settled, "{used} tokens used in the first minute: {usage}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_spend_at_most_the_budget_and_one_request_s_worst_case() {
    let redis = RedisServer::start(None);
    let limits = r#"{"budget_per_day": 0.001, "soft_limit": 1.0}"#;
    let fleet =
        Arc::new(Fleet::start(2, &[tenant("team-a", limits, "")], Duration::ZERO, &redis).await);
    let burst: Vec<_> = (0..100)
        .map(|i| {
            let fleet = Arc::clone(&fleet);
            tokio::spawn(async move { fleet.post(i % 2, "team-a", &long_chat(64, false)).await })
        })
        .collect();
    let mut spent = 0.0;
    for task in burst {
        let r = task.await.unwrap();
        match r.status {
            StatusCode::OK => spent += fleet.cost_micros(&r, &usage_of(&r)),
            status => assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{:?}", r.body),
        }
    }
    let worst = worst_case_micros(&fleet.set, 64);
    assert!(spent > 0.0);
    assert!(
        spent <= (to_micros(0.001) + worst) as f64,
        "spent {spent} millionths against a budget of 1000 (worst case of one request {})",
        worst
    );
    // Every reservation settled to what was spent: the counter agrees.
    let settled = eventually(Duration::from_secs(10), || async {
        let counted = fleet.usage(0, "team-a").await["usage"]["spend_today"]
            .as_f64()
            .unwrap();
        (counted * 1e6 - spent).abs() <= 100.0
    })
    .await;
    assert!(settled, "{}", fleet.usage(0, "team-a").await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_that_every_tier_failed_give_the_tenant_s_rate_back() {
    let redis = RedisServer::start(None);
    let limits = r#"{"requests_per_minute": 10, "tokens_per_minute": 100000, "soft_limit": 1.0}"#;
    let fleet = Fleet::start(1, &[tenant("team-a", limits, "")], Duration::ZERO, &redis).await;
    for sim in &fleet.sims {
        sim.set_faults(Faults {
            error_rate: 1.0,
            ..Faults::default()
        });
    }
    for _ in 0..10 {
        let r = fleet
            .post(0, "team-a", &support::chat("auto", SIMPLE))
            .await;
        assert!(r.status.is_server_error(), "{:?}", r.body);
    }
    // Nothing was served: nothing stays counted, and the next request is let through.
    let refunded = eventually(Duration::from_secs(10), || async {
        let t = fleet.usage(0, "team-a").await;
        t["usage"]["requests_this_minute"] == 0
            && t["usage"]["tokens_this_minute"] == 0
            && t["next_request"] == "admit"
    })
    .await;
    assert!(refunded, "{}", fleet.usage(0, "team-a").await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_allowed_no_existing_profile_gets_403_not_a_503_to_retry() {
    let redis = RedisServer::start(None);
    let allowed = r#", "allowed_profiles": ["llama70b-fp16"]"#;
    let limits = r#"{"requests_per_minute": 10}"#;
    let fleet = Fleet::start(
        1,
        &[tenant("team-a", limits, allowed)],
        Duration::ZERO,
        &redis,
    )
    .await;
    for path in ["/v1/chat/completions", "/v1/route"] {
        let auth = format!("Bearer {}", key_of("team-a"));
        let headers = [
            ("content-type", "application/json"),
            ("authorization", auth.as_str()),
        ];
        let url = fleet.url(0, path);
        let r = send(
            &client(),
            "POST",
            &url,
            &support::chat("auto", SIMPLE),
            &headers,
        )
        .await;
        assert_eq!(r.status, StatusCode::FORBIDDEN, "{path}: {:?}", r.body);
        assert_eq!(r.header("retry-after"), "", "{path}");
        let error = &r.json()["error"];
        assert_eq!(error["code"], "no_allowed_profile", "{error}");
        assert_eq!(error["type"], "permission_error", "{error}");
        let message = error["message"].as_str().unwrap();
        assert!(message.contains("allowed_profiles") && message.contains("llama70b-fp16"));
    }
    // The refusal is not counted against the tenant's rate.
    let refunded = eventually(Duration::from_secs(10), || async {
        fleet.usage(0, "team-a").await["usage"]["requests_this_minute"] == 0
    })
    .await;
    assert!(refunded, "{}", fleet.usage(0, "team-a").await);
}

/// Sends `n` requests of `tenant` round-robin over the replicas at once; each reply is
/// counted in `done` as it comes.
fn burst(
    fleet: &Arc<Fleet>,
    tenant: &'static str,
    bodies: impl Fn(usize) -> String,
    n: usize,
    done: &Arc<AtomicUsize>,
) -> Vec<tokio::task::JoinHandle<Reply>> {
    (0..n)
        .map(|i| {
            let fleet = Arc::clone(fleet);
            let done = Arc::clone(done);
            let body = bodies(i);
            tokio::spawn(async move {
                let r = fleet.post(i % fleet.routers.len(), tenant, &body).await;
                done.fetch_add(1, Ordering::Relaxed);
                r
            })
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_hold_every_bound_through_bursts_and_an_empty_redis_restart() {
    let redis = RedisServer::start(None);
    let port = redis.port;
    const REQUESTS: u64 = 90;
    const TOKENS: u64 = 20_000;
    const BUDGET: f64 = 0.002;
    let tenants = [
        tenant(
            "req",
            &format!(r#"{{"requests_per_minute": {REQUESTS}, "soft_limit": 1.0}}"#),
            "",
        ),
        tenant(
            "tok",
            &format!(r#"{{"tokens_per_minute": {TOKENS}, "soft_limit": 1.0}}"#),
            "",
        ),
        tenant(
            "spend",
            &format!(r#"{{"budget_per_day": {BUDGET}, "soft_limit": 1.0}}"#),
            "",
        ),
    ];
    let fleet = Arc::new(Fleet::start(3, &tenants, Duration::ZERO, &redis).await);
    let small = |_| support::chat("auto", SIMPLE);
    // max_tokens-heavy, every other one streamed.
    let heavy = |i: usize| long_chat(1000, i.is_multiple_of(2));
    let priced = |i: usize| long_chat(200, i.is_multiple_of(2));
    let done = Arc::new(AtomicUsize::new(0));
    let mut replies: Vec<(&str, tokio::task::JoinHandle<Reply>)> = Vec::new();
    let mut add = |tenant, tasks: Vec<tokio::task::JoinHandle<Reply>>| {
        replies.extend(tasks.into_iter().map(|t| (tenant, t)));
    };

    // With Redis: half of each limit used.
    add("req", burst(&fleet, "req", small, 45, &done));
    add("tok", burst(&fleet, "tok", heavy, 9, &done));
    add("spend", burst(&fleet, "spend", priced, 8, &done));
    let phase = 45 + 9 + 8;
    assert!(
        eventually(Duration::from_secs(30), || async {
            done.load(Ordering::Relaxed) >= phase
        })
        .await
    );

    // Mid-burst, Redis stops.
    add("req", burst(&fleet, "req", small, 100, &done));
    add("tok", burst(&fleet, "tok", heavy, 30, &done));
    add("spend", burst(&fleet, "spend", priced, 60, &done));
    let stop_at = phase + 40;
    assert!(
        eventually(Duration::from_secs(30), || async {
            done.load(Ordering::Relaxed) >= stop_at
        })
        .await
    );
    drop(redis);
    let phase = phase + 190;
    assert!(
        eventually(Duration::from_secs(60), || async {
            done.load(Ordering::Relaxed) >= phase
        })
        .await
    );

    // Redis comes back empty while another burst is under way.
    let redis = RedisServer::start_on(port, None);
    add("req", burst(&fleet, "req", small, 100, &done));
    add("tok", burst(&fleet, "tok", heavy, 30, &done));
    add("spend", burst(&fleet, "spend", priced, 60, &done));
    assert!(
        fleet.all_up(3).await,
        "the replicas did not come back to Redis"
    );

    // And once more, all through Redis.
    add("req", burst(&fleet, "req", small, 100, &done));
    add("tok", burst(&fleet, "tok", heavy, 30, &done));
    add("spend", burst(&fleet, "spend", priced, 60, &done));

    let (mut admitted, mut tokens, mut spent) = (0u64, 0u64, 0.0);
    for (tenant, task) in replies {
        let r = task.await.unwrap();
        if r.status != StatusCode::OK {
            assert_eq!(
                r.status,
                StatusCode::TOO_MANY_REQUESTS,
                "{tenant}: {:?}",
                r.body
            );
            continue;
        }
        match tenant {
            "req" => admitted += 1,
            "tok" => tokens += usage_of(&r)["total_tokens"].as_u64().unwrap(),
            _ => spent += fleet.cost_micros(&r, &usage_of(&r)),
        }
    }
    let worst = worst_case_micros(&fleet.set, 200);
    eprintln!(
        "admitted {admitted} of {REQUESTS} a minute, {tokens} tokens of {TOKENS}, \
         spent {spent} millionths of {}",
        to_micros(BUDGET)
    );
    let bound = (REQUESTS as f64 * 1.1) as u64 + 3;
    assert!(
        admitted <= bound,
        "{admitted} requests admitted against {REQUESTS} a minute"
    );
    assert!(admitted >= REQUESTS / 2, "only {admitted} admitted");
    assert!(
        tokens <= TOKENS + 1000,
        "{tokens} tokens served against {TOKENS} a minute"
    );
    let budget = to_micros(BUDGET) as f64;
    assert!(
        spent <= budget + worst as f64,
        "spent {spent} millionths against {budget} (one request's worst case {})",
        worst
    );
    drop(redis);
}
