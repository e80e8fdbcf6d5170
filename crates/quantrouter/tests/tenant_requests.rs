//! Tenants over real HTTP, with a real redis-server: router replicas share one limit, token
//! counts are corrected from the answers' `usage`, a budget downgrades then refuses and
//! resets with the day, a Redis outage moves decisions to local shares without failing a
//! request, and bad keys get 401 with no key text in logs, metrics or `/admin/tenants`.
//! In-process routers share a manual clock, so windows are chosen, not waited for.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http::StatusCode;
use quantrouter::server::Server;
use quantrouter::tenants::limiter::{unix_ms, CounterKeys, LimiterConfig};
use quantrouter::tenants::{Clock, Tenants, TenantsConfig};
use quantrouter_policy::limits::{Windows, DAY_MS};
use quantrouter_policy::{hash_key, ProfileSet};
use support::redis_server::RedisServer;
use support::{chat, client, eventually, send, sim_tiers, start_router, Reply, SIMPLE};
use tokio::io::AsyncReadExt;
use vllm_sim::SimServer;

const KEY: &str = "sk-team-a-Vq93kLm";
const PREFIX: &str = "qr";

/// Noon (and 30 s) two days from now, UTC: counters written for it do not expire under the
/// real clock while a test runs, and a refusal's wait is exact.
fn future_noon() -> u64 {
    let today = unix_ms(SystemTime::now()) / DAY_MS;
    (today + 2) * DAY_MS + 12 * 3_600_000 + 30_000
}

/// A tenant file of `team-a` (key [`KEY`]) with `limits`, in the stored format.
fn tenant_file(dir: &tempfile::TempDir, limits: &str) -> std::path::PathBuf {
    let path = dir.path().join("tenants.json");
    let doc = format!(
        r#"{{"version": 1, "tenants": [{{"id": "team-a", "key_sha256": ["{}"],
            "limits": {limits}, "priority": 5}}]}}"#,
        hash_key(KEY)
    );
    std::fs::write(&path, doc).unwrap();
    path
}

fn temp_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("qr-tenant-requests-")
        .tempdir()
        .unwrap()
}

/// One replica's tenants: the file's document, counters in `redis`.
async fn tenants(
    file: &std::path::Path,
    redis: &RedisServer,
    replica: usize,
    clock: &Clock,
) -> Arc<Tenants> {
    let config = TenantsConfig {
        file: Some(file.to_owned()),
        file_interval: Duration::from_secs(1),
        redis: None,
        redis_poll: Duration::from_secs(1),
        api_keys: None,
        metrics_top: 50,
    };
    let mut limiter = LimiterConfig::new(
        Some((redis.handle(), PREFIX.to_owned())),
        format!("replica-{replica}"),
    );
    // Quick heartbeats: every replica sees the others within a test's patience; a patient
    // admission call: a burst on a shared test machine must not look like an outage.
    limiter.heartbeat = Duration::from_millis(50);
    limiter.redis_timeout = Duration::from_secs(2);
    Arc::new(
        Tenants::start(config, limiter, clock.clone())
            .await
            .unwrap(),
    )
}

/// `n` router replicas in front of the same simulated tiers, sharing one Redis and clock.
struct Replicas {
    routers: Vec<Server>,
    set: ProfileSet,
    _sims: Vec<SimServer>,
    _dir: tempfile::TempDir,
    clock: Clock,
}

impl Replicas {
    async fn start(n: usize, limits: &str, redis: &RedisServer) -> Self {
        let (set, sims) = sim_tiers(Duration::ZERO).await;
        let dir = temp_dir();
        let file = tenant_file(&dir, limits);
        let clock = Clock::manual(future_noon());
        let mut routers = Vec::new();
        for i in 0..n {
            let tenants = tenants(&file, redis, i, &clock).await;
            routers.push(start_router(set.clone(), |c| c.tenants = Some(tenants)).await);
        }
        let all_see_all = eventually(Duration::from_secs(10), || async {
            routers.iter().all(|r| {
                let stats = r.app.tenants.as_ref().unwrap().limiter.stats();
                stats.redis_up && stats.replicas == n as u64
            })
        })
        .await;
        assert!(all_see_all, "the replicas did not see each other in Redis");
        Self {
            routers,
            set,
            _sims: sims,
            _dir: dir,
            clock,
        }
    }

    async fn post(&self, replica: usize, body: &str) -> Reply {
        let url = format!(
            "http://{}/v1/chat/completions",
            self.routers[replica].public_addr()
        );
        let auth = format!("Bearer {KEY}");
        let headers = [
            ("content-type", "application/json"),
            ("authorization", auth.as_str()),
        ];
        send(&client(), "POST", &url, body, &headers).await
    }

    async fn usage_report(&self, replica: usize) -> serde_json::Value {
        let url = format!(
            "http://{}/admin/tenants",
            self.routers[replica].admin_addr()
        );
        let r = send(&client(), "GET", &url, "", &[]).await;
        assert_eq!(r.status, StatusCode::OK);
        r.json()
    }

    /// The cheapest profile whose quality meets the request's required quality lowered by
    /// the downgrade, from the dry run's candidates.
    async fn cheapest_feasible_when_downgraded(&self, body: &str) -> String {
        let url = format!("http://{}/v1/route", self.routers[0].public_addr());
        let auth = format!("Bearer {KEY}");
        let headers = [
            ("content-type", "application/json"),
            ("authorization", auth.as_str()),
        ];
        let route = send(&client(), "POST", &url, body, &headers).await.json();
        let required = route["required_quality"].as_f64().unwrap()
            - quantrouter_policy::Downgrade::NEAR_LIMIT.quality_drop;
        let candidates = route["candidates"].as_array().unwrap();
        let feasible = candidates
            .iter()
            .filter(|c| c["quality"].as_f64().unwrap() >= required - 1e-9);
        let cheapest = feasible
            .min_by(|a, b| {
                a["cost"]
                    .as_f64()
                    .unwrap()
                    .total_cmp(&b["cost"].as_f64().unwrap())
            })
            .unwrap();
        cheapest["profile"].as_str().unwrap().to_owned()
    }

    fn tier(&self, reply: &Reply) -> String {
        reply.header("x-quantrouter-tier").to_owned()
    }
}

fn assert_openai_error(r: &Reply, kind: &str, code: &str) {
    let error = &r.json()["error"];
    assert_eq!(error["type"], kind, "{error}");
    assert_eq!(error["code"], code, "{error}");
    assert!(error["message"].as_str().is_some_and(|m| !m.is_empty()));
    assert!(error.get("param").is_some(), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_share_sixty_requests_a_minute_over_http() {
    let redis = RedisServer::start(None);
    let replicas = Arc::new(Replicas::start(3, r#"{"requests_per_minute": 60}"#, &redis).await);
    let burst: Vec<_> = (0..200)
        .map(|i| {
            let replicas = Arc::clone(&replicas);
            tokio::spawn(async move { replicas.post(i % 3, &chat("auto", SIMPLE)).await })
        })
        .collect();
    let mut replies = Vec::new();
    for task in burst {
        replies.push(task.await.unwrap());
    }
    let ok: Vec<&Reply> = replies
        .iter()
        .filter(|r| r.status == StatusCode::OK)
        .collect();
    assert!((57..=63).contains(&ok.len()), "{} admitted", ok.len());
    for r in &ok {
        assert_eq!(r.header("x-ratelimit-limit-requests"), "60");
        let remaining: u64 = r.header("x-ratelimit-remaining-requests").parse().unwrap();
        assert!(remaining < 60);
    }
    for r in replies.iter().filter(|r| r.status != StatusCode::OK) {
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{:?}", r.body);
        assert_openai_error(r, "rate_limit_error", "rate_limit_exceeded");
        // The clock stands 30 s into its minute.
        assert_eq!(r.header("retry-after"), "30");
        assert_eq!(r.header("x-ratelimit-limit-requests"), "60");
        assert_eq!(r.header("x-ratelimit-remaining-requests"), "0");
        assert_eq!(r.header("x-ratelimit-reset-requests"), "30s");
        // No token limit: no token headers.
        assert_eq!(r.header("x-ratelimit-limit-tokens"), "");
    }
    let report = replicas.usage_report(1).await;
    assert_eq!(report["counters"], "redis");
    assert_eq!(
        report["tenants"][0]["usage"]["requests_this_minute"],
        ok.len()
    );
    assert_eq!(report["tenants"][0]["next_request"], "refuse");
    // The next minute is a new window on every replica.
    replicas.clock.set(future_noon() + 60_000);
    let r = replicas.post(2, &chat("auto", SIMPLE)).await;
    assert_eq!(r.status, StatusCode::OK);
}

/// The `usage` of an answer: the body's, or a stream's last event before `[DONE]`.
fn total_tokens(r: &Reply) -> u64 {
    let text = String::from_utf8_lossy(&r.body);
    let usage = if r.header("content-type").starts_with("text/event-stream") {
        let last = text
            .trim_end()
            .trim_end_matches("data: [DONE]")
            .trim_end()
            .to_owned();
        support::last_sse_event(&last)["usage"].clone()
    } else {
        r.json()["usage"].clone()
    };
    usage["total_tokens"].as_u64().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_counts_are_corrected_from_usage_streamed_answers_included() {
    let redis = RedisServer::start(None);
    let replicas = Replicas::start(
        2,
        r#"{"tokens_per_minute": 100000, "soft_limit": 1.0}"#,
        &redis,
    )
    .await;
    let whole = chat("auto", SIMPLE);
    let streamed = serde_json::json!({"model": "auto", "stream": true, "max_tokens": 8,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": SIMPLE}]})
    .to_string();
    let r = replicas.post(0, &whole).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    let whole_tokens = total_tokens(&r);
    let r = replicas.post(1, &streamed).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    let stream_tokens = total_tokens(&r);
    // A stream without `stream_options`: the router asks for usage itself and strips it;
    // the simulator counts the same prompt and output the same way.
    let r = replicas.post(0, &support::simple_stream(8)).await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(!String::from_utf8_lossy(&r.body).contains("\"usage\""));
    let counted = whole_tokens + 2 * stream_tokens;
    let settled = eventually(Duration::from_secs(5), || async {
        let report = replicas.usage_report(0).await;
        report["tenants"][0]["usage"]["tokens_this_minute"].as_u64() == Some(counted)
    })
    .await;
    let report = replicas.usage_report(1).await;
    assert!(settled, "{counted} tokens expected: {report}");
    // Reserved at admission (a quarter of the prompt's bytes, plus max_tokens), then
    // settled: the next request's headers count the settled tokens plus its reservation.
    let reserved = (SIMPLE.len() as u64).div_ceil(4) + 8;
    assert_ne!(
        reserved, whole_tokens,
        "the test needs usage unlike the reservation"
    );
    let r = replicas.post(1, &whole).await;
    assert_eq!(r.header("x-ratelimit-limit-tokens"), "100000");
    assert_eq!(
        r.header("x-ratelimit-remaining-tokens"),
        (100_000 - counted - reserved).to_string()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_near_its_daily_budget_routes_cheapest_then_is_refused_until_tomorrow() {
    let redis = RedisServer::start(None);
    let replicas = Replicas::start(2, r#"{"budget_per_day": 1.0}"#, &redis).await;
    // A code prompt that routes above int4 unless downgraded (the outcome head's risk rule
    // covers math and reasoning only, so only the budget can move it).
    let code = serde_json::json!({"model": "auto", "max_tokens": 64, "messages": [{"role": "user",
        "content": support::CODE}]})
    .to_string();
    let cheapest = replicas.cheapest_feasible_when_downgraded(&code).await;
    let normal = replicas.post(0, &code).await;
    assert_eq!(normal.status, StatusCode::OK);
    let normal_tier = replicas.tier(&normal);
    assert_ne!(normal_tier, "int4", "the prompt needs more than int4");
    assert_ne!(normal.header("x-quantrouter-reason"), "budget_downgrade");

    // The first answer's spend is settled in a task of its own: wait for it, so the spend
    // set below is not added to afterwards.
    let settled = eventually(Duration::from_secs(5), || async {
        let report = replicas.usage_report(0).await;
        report["tenants"][0]["usage"]["spend_today"].as_f64() > Some(0.0)
    })
    .await;
    assert!(settled, "{}", replicas.usage_report(0).await);

    // 85 % of today's budget spent: the cheapest feasible tier, and the response says why.
    let today = CounterKeys::new(PREFIX, "team-a", Windows::at(future_noon()));
    redis.raw_set(&today.spend_day, "850000", None).await;
    let cheaper = replicas.post(1, &code).await;
    assert_eq!(cheaper.status, StatusCode::OK);
    assert_eq!(cheaper.header("x-quantrouter-profile"), cheapest);
    assert_ne!(replicas.tier(&cheaper), normal_tier);
    assert_eq!(cheaper.header("x-quantrouter-reason"), "budget_downgrade");
    // Its cost, at the serving profile's prices, is added to the day's spend.
    let usage = cheaper.json()["usage"].clone();
    let served = replicas.set.profile(&cheapest).unwrap();
    let cost = usage["prompt_tokens"].as_f64().unwrap() * served.cost_per_1m_input_tokens / 1e6
        + usage["completion_tokens"].as_f64().unwrap() * served.cost_per_1m_output_tokens / 1e6;
    let spent = eventually(Duration::from_secs(5), || async {
        let report = replicas.usage_report(0).await;
        let spend = report["tenants"][0]["usage"]["spend_today"]
            .as_f64()
            .unwrap();
        (spend - (0.85 + cost)).abs() < 2e-6
    })
    .await;
    assert!(spent, "{}", replicas.usage_report(0).await);

    // The whole budget: refused with insufficient_quota until midnight, on every replica.
    redis.raw_set(&today.spend_day, "1000000", None).await;
    for replica in 0..2 {
        let r = replicas.post(replica, &code).await;
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{:?}", r.body);
        assert_openai_error(&r, "insufficient_quota", "insufficient_quota");
        assert_eq!(r.header("retry-after"), (12 * 3600 - 30).to_string());
    }
    let report = replicas.usage_report(1).await;
    assert_eq!(report["tenants"][0]["refused_by"], "budget_per_day");

    // Tomorrow is a new window: routed as before the budget ran low.
    replicas.clock.set(future_noon() + DAY_MS);
    let r = replicas.post(0, &code).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(replicas.tier(&r), normal_tier);
    assert_ne!(r.header("x-quantrouter-reason"), "budget_downgrade");
}

/// The real binary with tenants from a file and counters in `redis`, logging at debug.
async fn router_process(
    set: &ProfileSet,
    tenants: &std::path::Path,
    redis: &RedisServer,
) -> support::RouterProcess {
    let url = redis.url();
    let args = [
        "--tenants",
        tenants.to_str().unwrap(),
        "--redis-url",
        url.as_str(),
        "--log-format",
        "text",
    ];
    support::RouterProcess::spawn_with_env(set, &args, &[("RUST_LOG", "debug")], Stdio::piped())
        .await
}

async fn post_as(router: &support::RouterProcess, authorization: Option<&[u8]>) -> Reply {
    let mut req = http::Request::post(router.url("/v1/chat/completions"))
        .header("content-type", "application/json");
    if let Some(value) = authorization {
        req = req.header(
            "authorization",
            http::HeaderValue::from_bytes(value).unwrap(),
        );
    }
    let req = req
        .body(http_body_util::Full::new(bytes::Bytes::from(chat(
            "auto", SIMPLE,
        ))))
        .unwrap();
    let response = client().request(req).await.unwrap();
    let (parts, body) = response.into_parts();
    let body = http_body_util::BodyExt::collect(body)
        .await
        .unwrap()
        .to_bytes();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

async fn admin_page(router: &support::RouterProcess, path: &str) -> String {
    let r = send(
        &client(),
        "GET",
        &format!("http://{}{path}", router.admin),
        "",
        &[],
    )
    .await;
    String::from_utf8_lossy(&r.body).into_owned()
}

/// A metric's value in a `/metrics` page (the first series of it).
fn metric(page: &str, name: &str) -> Option<f64> {
    page.lines()
        .find(|l| l.starts_with(name) && !l.starts_with('#'))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_stopped_requests_flow_on_local_shares_and_counting_resumes() {
    let redis = RedisServer::start(None);
    let port = redis.port;
    let (set, _sims) = sim_tiers(Duration::ZERO).await;
    let dir = temp_dir();
    let file = tenant_file(&dir, r#"{"requests_per_minute": 10000}"#);
    let router = router_process(&set, &file, &redis).await;
    let auth = format!("Bearer {KEY}");
    for _ in 0..5 {
        assert_eq!(
            post_as(&router, Some(auth.as_bytes())).await.status,
            StatusCode::OK
        );
    }
    let page = admin_page(&router, "/metrics").await;
    assert_eq!(metric(&page, "quantrouter_tenant_limits_local"), Some(0.0));

    drop(redis);
    for _ in 0..30 {
        let r = post_as(&router, Some(auth.as_bytes())).await;
        assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
        assert_eq!(r.header("x-ratelimit-limit-requests"), "10000");
    }
    let page = admin_page(&router, "/metrics").await;
    assert_eq!(metric(&page, "quantrouter_tenant_limits_local"), Some(1.0));
    let report: serde_json::Value =
        serde_json::from_str(&admin_page(&router, "/admin/tenants").await).unwrap();
    assert_eq!(report["counters"], "local");
    assert!(report["tenants"][0]["usage"]["requests_this_minute"].as_u64() >= Some(1));

    // Back (empty): what was counted meanwhile is handed over, and requests count in Redis.
    let redis = RedisServer::start_on(port, None);
    let back = eventually(Duration::from_secs(15), || async {
        metric(
            &admin_page(&router, "/metrics").await,
            "quantrouter_tenant_limits_local",
        ) == Some(0.0)
    })
    .await;
    assert!(back, "the router did not come back to Redis");
    assert_eq!(
        post_as(&router, Some(auth.as_bytes())).await.status,
        StatusCode::OK
    );
    let keys = redis
        .keys("quantrouter:tenants:usage:{team-a}:requests:*")
        .await;
    let counted: u64 = match keys.as_slice() {
        [] => 0,
        keys => {
            let mut conn = redis
                .client()
                .get_multiplexed_async_connection()
                .await
                .unwrap();
            let values: Vec<u64> = redis::cmd("MGET")
                .arg(keys)
                .query_async(&mut conn)
                .await
                .unwrap();
            values.iter().sum()
        }
    };
    // The outage's requests of this minute (all 30 unless a minute ended meanwhile) and
    // the one after.
    assert!(counted >= 1, "nothing counted in Redis after the outage");
    let report: serde_json::Value =
        serde_json::from_str(&admin_page(&router, "/admin/tenants").await).unwrap();
    assert_eq!(report["counters"], "redis");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_keys_get_401_and_no_key_text_reaches_logs_metrics_or_admin() {
    let redis = RedisServer::start(None);
    let (set, _sims) = sim_tiers(Duration::ZERO).await;
    let dir = temp_dir();
    let file = tenant_file(&dir, r#"{"requests_per_minute": 100}"#);
    let mut router = router_process(&set, &file, &redis).await;
    let auth = format!("Bearer {KEY}");
    let ok = post_as(&router, Some(auth.as_bytes())).await;
    assert_eq!(ok.status, StatusCode::OK);

    let unknown = "Bearer sk-team-a-Vq93kLn";
    let long = format!("Bearer {}", "Zk".repeat(5_000));
    let bad: Vec<(&str, Option<Vec<u8>>)> = vec![
        ("missing", None),
        ("unknown", Some(unknown.as_bytes().to_vec())),
        ("empty", Some(b"Bearer ".to_vec())),
        ("whitespace", Some(b"Bearer    ".to_vec())),
        ("padded", Some(format!("Bearer  {KEY}").into_bytes())),
        ("long", Some(long.as_bytes().to_vec())),
        (
            "non-ascii",
            Some("Bearer sk-\u{17c}\u{f3}\u{142}w-key".as_bytes().to_vec()),
        ),
        ("not bearer", Some(format!("Basic {KEY}").into_bytes())),
    ];
    for (what, value) in &bad {
        let r = post_as(&router, value.as_deref()).await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{what}");
        assert_openai_error(&r, "invalid_request_error", "invalid_api_key");
        assert!(!String::from_utf8_lossy(&r.body).contains("sk-"), "{what}");
    }

    let hash = hash_key(KEY);
    let texts = [
        KEY,
        &hash[8..24],
        "Vq93kLn",
        "ZkZkZkZkZkZkZkZk",
        "\u{17c}\u{f3}\u{142}w",
    ];
    let metrics = admin_page(&router, "/metrics").await;
    assert!(metrics.contains("quantrouter_tenant_requests_total{tenant=\"team-a\"}"));
    let admin = admin_page(&router, "/admin/tenants").await;
    assert!(admin.contains(&hash[..8]), "{admin}");
    router.terminate();
    let mut stderr = router.child.stderr.take().unwrap();
    let mut logs = String::new();
    stderr.read_to_string(&mut logs).await.unwrap();
    router.child.wait().await.unwrap();
    assert!(logs.contains("api key refused"), "{logs}");
    for (page, name) in [(&metrics, "metrics"), (&admin, "admin"), (&logs, "logs")] {
        for text in texts {
            assert!(!page.contains(text), "{name} holds {text:?}");
        }
    }
}
