//! Tenant limits with a real redis-server: replicas share one limit, tokens are corrected
//! from usage, budgets downgrade then refuse and reset with the day, an outage moves
//! decisions to local shares without a request waiting on Redis, and no key text reaches
//! Redis, logs or the usage report. Time is injected: every decision gets its instant.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use quantrouter::tenants::limiter::{unix_ms, CounterSource, Limiter, LimiterConfig};
use quantrouter::tenants::{
    usage, ActiveTenant, Clock, KeyRejected, TenantSnapshot, TenantSource, TenantStore,
};
use quantrouter_policy::limits::{LimitKind, Outcome, Windows, DAY_MS};
use quantrouter_policy::{
    decide, Features, Prompt, Reason, Role, RouteRequest, Segment, TenantDocument,
    DEFAULT_PROFILE_SET,
};
use support::eventually;
use support::redis_server::RedisServer;

const PREFIX: &str = "qr";

/// Noon (and 30 s) two days from now, UTC: windows in the future, so counters written for
/// them are not already expired by the real clock.
fn future_noon() -> u64 {
    let today = unix_ms(SystemTime::now()) / DAY_MS;
    (today + 2) * DAY_MS + 12 * 3_600_000 + 30_000
}

/// Noon on the first day of the month after next.
fn first_of_a_month_noon() -> u64 {
    let next = Windows::at(unix_ms(SystemTime::now())).month_end_ms();
    Windows::at(next).month_end_ms() + 12 * 3_600_000
}

fn snapshot(limits: &str) -> Arc<TenantSnapshot> {
    let doc = TenantDocument::from_push_json(&format!(
        r#"{{"version": 1, "tenants": [{{"id": "team-a", "keys": ["sk-team-a-1"],
            "limits": {limits}, "min_quality": 0.5}}]}}"#
    ))
    .unwrap();
    let store = TenantStore::new(None, 50);
    store.apply(&doc, TenantSource::Redis, false).unwrap();
    store.load()
}

fn team_a(snapshot: &TenantSnapshot) -> &ActiveTenant {
    snapshot.tenant("team-a").unwrap()
}

fn config(redis: &RedisServer, replica: usize) -> LimiterConfig {
    let mut config = LimiterConfig::new(
        Some((redis.handle(), PREFIX.to_owned())),
        format!("replica-{replica}"),
    );
    // Quick heartbeats: outages end within a test's patience.
    config.heartbeat = Duration::from_millis(50);
    config
}

/// `n` limiters on one Redis, as `n` router replicas have, each seeing all `n`.
async fn replicas(redis: &RedisServer, n: usize) -> Vec<Arc<Limiter>> {
    let mut limiters = Vec::new();
    for i in 0..n {
        limiters.push(Arc::new(Limiter::start(config(redis, i)).await));
    }
    let all_see_all = eventually(Duration::from_secs(10), || async {
        limiters
            .iter()
            .all(|l| l.stats().redis_up && l.stats().replicas == n as u64)
    })
    .await;
    assert!(
        all_see_all,
        "{:?}",
        limiters.iter().map(|l| l.stats()).collect::<Vec<_>>()
    );
    limiters
}

fn admitted(outcome: Outcome) -> bool {
    !matches!(outcome, Outcome::Refuse { .. })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_share_sixty_requests_per_minute_in_a_burst_of_two_hundred() {
    let redis = RedisServer::start(None);
    let limiters = replicas(&redis, 3).await;
    let snapshot = snapshot(r#"{"requests_per_minute": 60}"#);
    let now = future_noon();
    let burst: Vec<_> = (0..200)
        .map(|i| {
            let limiter = Arc::clone(&limiters[i % 3]);
            let snapshot = Arc::clone(&snapshot);
            tokio::spawn(async move { limiter.admit(team_a(&snapshot), 0, now).await })
        })
        .collect();
    let mut admissions = Vec::new();
    for task in burst {
        admissions.push(task.await.unwrap());
    }
    let admitted_count = admissions
        .iter()
        .filter(|a| admitted(a.decision.outcome))
        .count();
    assert!(
        (57..=63).contains(&admitted_count),
        "{admitted_count} admitted"
    );
    assert!(admissions.iter().all(|a| a.source == CounterSource::Redis));
    for a in admissions.iter().filter(|a| !admitted(a.decision.outcome)) {
        assert_eq!(
            a.decision.outcome,
            Outcome::Refuse {
                limit: LimitKind::Requests,
                retry_after_s: 30
            }
        );
        assert_eq!(LimitKind::Requests.code(), "rate_limit_exceeded");
        let headers = a.decision.headers.pairs();
        assert!(headers.contains(&("x-ratelimit-remaining-requests", "0".to_owned())));
        assert!(headers.contains(&("x-ratelimit-reset-requests", "30s".to_owned())));
    }
    let (counters, source) = limiters[1].counters("team-a", now).await;
    assert_eq!(
        (counters.requests, source),
        (admitted_count as u64, CounterSource::Redis)
    );
    // The next minute is a new window on every replica.
    let next = limiters[2].admit(team_a(&snapshot), 0, now + 60_000).await;
    assert_eq!(next.decision.outcome, Outcome::Admit);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_limits_are_corrected_from_the_usage_of_answers() {
    let redis = RedisServer::start(None);
    let limiters = replicas(&redis, 2).await;
    let snapshot = snapshot(r#"{"tokens_per_minute": 1000}"#);
    let t = team_a(&snapshot);
    let now = future_noon();
    let first = limiters[0].admit(t, 600, now).await;
    assert!(admitted(first.decision.outcome));
    let second = limiters[1].admit(t, 600, now).await;
    assert!(
        matches!(
            second.decision.outcome,
            Outcome::Refuse {
                limit: LimitKind::Tokens,
                ..
            }
        ),
        "600 + 600 estimated tokens pass 1000"
    );
    // The answer used 150 tokens, not the 600 estimated.
    limiters[0]
        .settle(first.ticket.unwrap(), 150, 0.0, now + 1_000)
        .await;
    let (counters, _) = limiters[1].counters("team-a", now + 1_000).await;
    assert_eq!(counters.tokens, 150);
    let third = limiters[1].admit(t, 800, now + 2_000).await;
    assert!(admitted(third.decision.outcome), "{:?}", third.decision);
    let headers = third.decision.headers.pairs();
    assert!(
        headers.contains(&("x-ratelimit-remaining-tokens", "50".to_owned())),
        "{headers:?}"
    );
    // A correction that arrives after its minute ended lands in that minute, not in the
    // next one, and is not dropped.
    limiters[1]
        .settle(third.ticket.unwrap(), 10, 0.0, now + 60_000)
        .await;
    let (previous, _) = limiters[0].counters("team-a", now + 2_000).await;
    let (current, _) = limiters[0].counters("team-a", now + 60_000).await;
    assert_eq!((previous.tokens, current.tokens), (160, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_near_its_daily_budget_is_downgraded_then_refused_and_the_next_day_resets() {
    let redis = RedisServer::start(None);
    let limiters = replicas(&redis, 3).await;
    let snapshot = snapshot(r#"{"budget_per_day": 1.0, "budget_per_month": 100.0}"#);
    let t = team_a(&snapshot);
    let day = first_of_a_month_noon();

    let first = limiters[0].admit(t, 10, day).await;
    assert_eq!(first.decision.outcome, Outcome::Admit);
    limiters[0]
        .settle(first.ticket.unwrap(), 10, 0.85, day + 1)
        .await;

    // 85 % of the day's budget: downgraded, and routed to the cheapest feasible tier.
    let second = limiters[1].admit(t, 10, day + 2).await;
    assert_eq!(second.decision.outcome, Outcome::Downgrade);
    assert!((second.decision.used - 0.85).abs() < 1e-9);
    let set = quantrouter_policy::ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
    let prompt = Prompt {
        segments: vec![Segment {
            role: Role::User,
            text: "Write a Python function that merges two sorted lists.",
        }],
        wants_json: false,
    };
    let features = Features::extract(&prompt, &set.policy.complexity).unwrap();
    let route = |downgraded| {
        let request = RouteRequest {
            features: &features,
            max_tokens: Some(64),
            overrides: t.overrides(Default::default(), downgraded),
            routing_key: "k",
        };
        decide(&set, &request, &[]).unwrap()
    };
    let (normal, cheaper) = (route(false), route(true));
    assert_ne!(set.profiles[normal.profile].tier, "int4");
    assert_eq!(set.profiles[cheaper.profile].tier, "int4");
    assert_eq!(cheaper.reason, Reason::BudgetDowngrade);
    limiters[1]
        .settle(second.ticket.unwrap(), 10, 0.15, day + 3)
        .await;

    // 100 %: refused with insufficient_quota until midnight, on every replica.
    for limiter in &limiters {
        let refused = limiter.admit(t, 10, day + 4).await;
        assert_eq!(
            refused.decision.outcome,
            Outcome::Refuse {
                limit: LimitKind::BudgetPerDay,
                retry_after_s: 12 * 3600
            }
        );
    }
    assert_eq!(LimitKind::BudgetPerDay.code(), "insufficient_quota");

    // The next day's window starts empty; the month keeps counting.
    let tomorrow = day + DAY_MS;
    let fresh = limiters[2].admit(t, 10, tomorrow).await;
    assert_eq!(fresh.decision.outcome, Outcome::Admit);
    let (counters, _) = limiters[0].counters("team-a", tomorrow).await;
    assert_eq!((counters.spend_day, counters.spend_month), (0, 1_000_000));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_stopped_decisions_go_on_under_local_shares_and_counters_resume() {
    let redis = RedisServer::start(None);
    let port = redis.port;
    let limiters = replicas(&redis, 3).await;
    let snapshot = snapshot(r#"{"requests_per_minute": 60}"#);
    let t = team_a(&snapshot);
    let now = future_noon();
    for i in 0..15 {
        let a = limiters[i % 3].admit(t, 0, now).await;
        assert_eq!(a.source, CounterSource::Redis);
    }

    drop(redis);
    let mut local_admitted = 0;
    for i in 0..90 {
        let a = limiters[i % 3].admit(t, 0, now + 1).await;
        assert_eq!(a.source, CounterSource::Local);
        if admitted(a.decision.outcome) {
            local_admitted += 1;
        } else {
            assert!(matches!(
                a.decision.outcome,
                Outcome::Refuse {
                    limit: LimitKind::Requests,
                    ..
                }
            ));
        }
    }
    // Each replica took its share of the 45 left: the cluster stayed at its limit.
    assert!(
        (42..=48).contains(&local_admitted),
        "{local_admitted} admitted locally"
    );
    for limiter in &limiters {
        let stats = limiter.stats();
        assert!(!stats.redis_up);
        assert!(
            stats.redis_failures <= 1,
            "more than one request tried Redis: {stats:?}"
        );
        assert_eq!(stats.local_decisions, 30);
    }

    // Back (empty: no persistence). The replicas re-seed the counters from what they last
    // read (the 15 counted before the outage), add what they counted meanwhile, then
    // requests count in Redis again: the minute's limit still holds.
    let _redis = RedisServer::start_on(port, None);
    let back = eventually(Duration::from_secs(10), || async {
        limiters.iter().all(|l| l.stats().redis_up)
    })
    .await;
    assert!(back, "limiters did not reconnect");
    let (counters, source) = limiters[0].counters("team-a", now + 2).await;
    assert_eq!(source, CounterSource::Redis);
    assert_eq!(counters.requests, 15 + local_admitted);
    let a = limiters[1].admit(t, 0, now + 3).await;
    assert_eq!(a.source, CounterSource::Redis);
    assert_eq!(limiters[1].stats().redis_decisions, 6);
    assert!(
        15 + local_admitted >= 60 && !admitted(a.decision.outcome),
        "the restart gave the minute's requests back: {:?}",
        a.decision
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_that_never_admitted_a_tenant_share_only_what_it_has_left_in_an_outage() {
    let redis = RedisServer::start(None);
    // The heartbeats read the counters in the windows of this clock.
    let now = future_noon();
    let mut limiters = Vec::new();
    for i in 0..3 {
        let config = LimiterConfig {
            clock: Clock::manual(now),
            ..config(&redis, i)
        };
        let limiter = Limiter::start(config).await;
        limiter.follow(Box::new(|| vec![Arc::from("team-a")]));
        limiters.push(limiter);
    }
    let snapshot = snapshot(r#"{"requests_per_minute": 90}"#);
    let t = team_a(&snapshot);
    // Half the minute's limit, all through one replica.
    for _ in 0..45 {
        let a = limiters[0].admit(t, 0, now).await;
        assert_eq!(a.source, CounterSource::Redis);
    }
    // Each replica has read the counters since (two heartbeats: one may have begun before).
    let before: Vec<u64> = limiters.iter().map(|l| l.stats().refreshes).collect();
    let read = eventually(Duration::from_secs(10), || async {
        limiters
            .iter()
            .zip(&before)
            .all(|(l, b)| l.stats().refreshes >= b + 2)
    })
    .await;
    assert!(read, "the heartbeats did not read the counters");

    drop(redis);
    let mut local_admitted = 0;
    for i in 0..150 {
        let a = limiters[i % 3].admit(t, 0, now + 1).await;
        assert_eq!(a.source, CounterSource::Local);
        local_admitted += u64::from(admitted(a.decision.outcome));
    }
    // The 45 left, shared by three: not 30 for each replica that had seen nothing.
    assert!(
        (42..=48).contains(&local_admitted),
        "{local_admitted} admitted locally where 45 were left"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_redis_costs_one_request_its_timeout_and_the_rest_go_local() {
    let redis = RedisServer::start(None);
    let limiters = replicas(&redis, 1).await;
    let limiter = &limiters[0];
    let snapshot = snapshot(r#"{"requests_per_minute": 1000}"#);
    let t = team_a(&snapshot);
    let now = future_noon();
    assert_eq!(limiter.admit(t, 0, now).await.source, CounterSource::Redis);

    redis.pause();
    for _ in 0..20 {
        let a = limiter.admit(t, 0, now).await;
        assert_eq!(a.source, CounterSource::Local);
        assert!(admitted(a.decision.outcome));
    }
    let stats = limiter.stats();
    assert!(stats.redis_failures <= 1, "{stats:?}");
    assert_eq!(stats.local_decisions, 20);

    redis.resume();
    let back = eventually(Duration::from_secs(10), || async {
        limiter.stats().redis_up
    })
    .await;
    assert!(back, "the limiter did not come back to Redis");
    // The request that timed out was counted locally; its script, already on the wire,
    // may also have run once Redis thawed.
    let (counters, source) = limiter.counters("team-a", now).await;
    assert_eq!(source, CounterSource::Redis);
    assert!((21..=22).contains(&counters.requests), "{counters:?}");
}

/// Log lines written while it is installed.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Captured;
    fn make_writer(&'a self) -> Captured {
        self.clone()
    }
}

#[tokio::test(flavor = "current_thread")]
async fn bad_keys_are_refused_and_no_key_text_reaches_redis_logs_or_the_report() {
    let logs = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(logs.clone())
        .with_max_level(tracing::Level::TRACE)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let redis = RedisServer::start(None);
    let secret = "sk-live-Zq8mWv3x";
    let dir = tempfile::Builder::new()
        .prefix("qr-tenants-")
        .tempdir()
        .unwrap();
    let file = dir.path().join("tenants.json");
    std::fs::write(
        &file,
        format!(
            r#"{{"version": 1, "tenants": [{{"id": "team-a", "keys": ["{secret}"],
                "limits": {{"requests_per_minute": 5}}}}]}}"#
        ),
    )
    .unwrap();
    let (code, out, err) = support::cli(&[
        "tenants",
        "push",
        file.to_str().unwrap(),
        "--redis-url",
        &redis.url(),
    ]);
    assert_eq!((code, out.trim()), (0, "pushed version 1"), "{err}");
    assert!(!out.contains(secret) && !err.contains(secret));

    // Routers follow the document from Redis; the key works, every other is refused.
    let config = quantrouter::tenants::TenantsConfig {
        file: None,
        file_interval: Duration::from_secs(1),
        redis: Some((redis.handle(), "quantrouter".to_owned())),
        redis_poll: Duration::from_millis(50),
        api_keys: None,
        metrics_top: 50,
    };
    let started = quantrouter::tenants::start(config).await.unwrap();
    let snapshot = started.store.load();
    assert_eq!(snapshot.version, 1);
    let tenant = snapshot.authenticate(Some(secret)).unwrap().unwrap();
    assert_eq!(&*tenant.id, "team-a");
    let long = "k".repeat(10_000);
    for (key, why) in [
        (Some("sk-live-unknown"), KeyRejected::Unknown),
        (Some(""), KeyRejected::Malformed),
        (Some("   "), KeyRejected::Malformed),
        (Some(" sk-live-Zq8mWv3x"), KeyRejected::Malformed),
        (Some(long.as_str()), KeyRejected::Malformed),
        (
            Some("sk-live-\u{17c}\u{f3}\u{142}w"),
            KeyRejected::Malformed,
        ),
        (None, KeyRejected::Missing),
    ] {
        assert_eq!(snapshot.authenticate(key).err(), Some(why), "{key:?}");
    }

    let limiter = Limiter::start(LimiterConfig::new(
        Some((redis.handle(), "quantrouter".to_owned())),
        "replica-0".into(),
    ))
    .await;
    let now = future_noon();
    for _ in 0..6 {
        limiter.admit(tenant, 10, now).await;
    }
    let report = usage::usage(&limiter, &snapshot, now).await;
    let json = serde_json::to_string(&report).unwrap();
    assert_eq!(report.tenants[0].usage.requests_this_minute, 5);
    assert_eq!(report.tenants[0].next_request, "refuse");
    let hash = quantrouter_policy::hash_key(secret);
    assert!(json.contains(&hash[..8]), "{json}");
    let table = usage::table(&report);
    for shown in [&json, &table] {
        assert!(
            !shown.contains(secret) && !shown.contains(&hash[8..16]),
            "{shown}"
        );
    }

    // Nothing in Redis holds the key: not the document, its history or any counter.
    let keys = redis.keys("*").await;
    assert!(
        keys.iter().any(|k| k.contains(":tenants:usage:{team-a}:")),
        "{keys:?}"
    );
    let mut conn = redis
        .client()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    for key in keys {
        assert!(!key.contains(secret));
        let dump: Option<Vec<u8>> = redis::cmd("DUMP")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .unwrap();
        let dump = String::from_utf8_lossy(&dump.unwrap_or_default()).into_owned();
        assert!(!dump.contains(secret), "{key} holds the key");
    }
    let (code, out, _) = support::cli(&["tenants", "get", "--redis-url", &redis.url()]);
    assert_eq!(code, 0);
    assert!(out.contains(&hash) && !out.contains(secret));

    let logs = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    assert!(logs.contains("tenants loaded"), "{logs}");
    assert!(
        !logs.contains(secret) && !logs.contains(&hash[..16]),
        "{logs}"
    );
    for task in started.tasks {
        task.abort();
    }
}

/// Runs the CLI with `input` on standard input.
fn cli_with_input(args: &[&str], input: &str) -> (i32, String, String) {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_quantrouter"))
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn cli_push_get_diff_history_rollback_usage_hash_key_and_exit_codes() {
    let redis = RedisServer::start(Some("s3cret"));
    let url = redis.url();
    let dir = tempfile::Builder::new()
        .prefix("qr-tenants-cli-")
        .tempdir()
        .unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_owned()
    };
    let (code, out, err) = cli_with_input(&["tenants", "hash-key"], "sk-team-a-1\nsk-team-b-1\r\n");
    assert_eq!(code, 0, "{err}");
    let hashes: Vec<&str> = out.lines().collect();
    assert_eq!(
        hashes,
        [
            quantrouter_policy::hash_key("sk-team-a-1"),
            quantrouter_policy::hash_key("sk-team-b-1"),
        ]
    );
    for bad in ["", "\n", "sk team\n", "sk-\u{e9}\n"] {
        let (code, _, err) = cli_with_input(&["tenants", "hash-key"], bad);
        assert_eq!(code, 1, "{bad:?}: {err}");
        assert!(!err.contains("sk"), "{err}");
    }

    let v1 = write(
        "v1.json",
        &format!(
            r#"{{"version": 1, "tenants": [{{"id": "team-a", "key_sha256": ["{}"],
                "limits": {{"requests_per_minute": 60, "budget_per_day": 5.0}}}}]}}"#,
            hashes[0]
        ),
    );
    let v2 = write(
        "v2.json",
        r#"{"version": 1, "tenants": [
            {"id": "team-a", "keys": ["sk-team-a-1"], "limits": {"requests_per_minute": 120}},
            {"id": "team-b", "keys": ["sk-team-b-1"]}]}"#,
    );
    let (code, out, err) = support::cli(&["tenants", "diff", &v1, "--redis-url", &url]);
    assert_eq!(
        (code, out.trim()),
        (0, "no active document: every tenant would be added"),
        "{err}"
    );
    let (code, out, _) = support::cli(&["tenants", "push", &v1, "--redis-url", &url]);
    assert_eq!((code, out.trim()), (0, "pushed version 1"));
    let (code, out, _) = support::cli(&["tenants", "diff", &v2, "--redis-url", &url]);
    assert_eq!(code, 0);
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        [
            "~ team-a.limits.budget_per_day: 5.0 -> null",
            "~ team-a.limits.requests_per_minute: 60 -> 120",
            "+ team-b (1 keys)",
        ]
    );
    let (code, out, _) = support::cli(&["tenants", "push", &v2, "--redis-url", &url]);
    assert_eq!((code, out.trim()), (0, "pushed version 2"));
    let (code, out, _) = support::cli(&["tenants", "get", "--redis-url", &url]);
    assert_eq!(code, 0);
    let active = TenantDocument::from_json(&out).unwrap();
    assert_eq!((active.version, active.tenants.len()), (2, 2));
    let (code, out, _) = support::cli(&["tenants", "history", "--redis-url", &url]);
    assert_eq!(code, 0);
    assert!(out.trim_start().starts_with("version     1"), "{out}");
    assert!(out.contains("1 tenants, 1 keys"), "{out}");

    // A pipeline that diffed against version 1 must not overwrite version 2: exit 3.
    let (code, _, err) = support::cli(&[
        "tenants",
        "push",
        &v1,
        "--expect-version",
        "1",
        "--redis-url",
        &url,
    ]);
    assert_eq!(code, 3, "{err}");
    let (code, out, _) = support::cli(&["tenants", "rollback", "--redis-url", &url]);
    assert_eq!(
        (code, out.trim()),
        (0, "rolled back: published as version 3")
    );

    let (code, out, err) = support::cli(&["tenants", "usage", "--redis-url", &url]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("tenants version 3 (redis), counters from redis"),
        "{out}"
    );
    assert!(
        out.lines()
            .any(|l| l.starts_with("team-a") && l.contains("0/60")),
        "{out}"
    );
    let (code, out, _) = support::cli(&["tenants", "usage", "--json", "--redis-url", &url]);
    assert_eq!(code, 0);
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["tenants"][0]["id"], "team-a");
    assert_eq!(report["tenants"][0]["next_request"], "admit");

    // Invalid input: exit 1 with the JSON path, before any network call; the key unquoted.
    let bad = write(
        "bad.json",
        r#"{"version": 1, "tenants": [{"id": "a", "keys": ["sk bad-key"]}]}"#,
    );
    let (code, _, err) = support::cli(&[
        "tenants",
        "push",
        &bad,
        "--redis-url",
        "redis://127.0.0.1:1",
    ]);
    assert_eq!(code, 1);
    assert!(
        err.contains("tenants[0].keys[0]: must be 1 to 256"),
        "{err}"
    );
    assert!(!err.contains("bad-key"), "{err}");

    // Wrong password and unreachable Redis: exit 2.
    let wrong = format!("redis://:nope@127.0.0.1:{}", redis.port);
    let (code, _, err) = support::cli(&["tenants", "get", "--redis-url", &wrong]);
    assert_eq!(code, 2, "{err}");
    let (code, _, _) = support::cli(&["tenants", "usage", "--redis-url", "redis://127.0.0.1:1"]);
    assert_eq!(code, 2);
    // Nothing to report on: exit 1.
    let empty = RedisServer::start(None);
    let (code, _, err) = support::cli(&["tenants", "usage", "--redis-url", &empty.url()]);
    assert_eq!(code, 1, "{err}");
}

#[tokio::test(flavor = "current_thread")]
async fn the_admission_script_makes_the_policy_s_comparisons() {
    use quantrouter::tenants::limiter::{CounterKeys, ADMIT_SCRIPT};
    use quantrouter_policy::limits::{exceeded, Counters, Quota};

    let redis = RedisServer::start(None);
    let mut conn = redis
        .client()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let script = redis::Script::new(ADMIT_SCRIPT);
    let now = future_noon();
    let keys = CounterKeys::new(PREFIX, "t", Windows::at(now));
    let mut rng = fastrand::Rng::with_seed(24);
    // Values around each limit, so every comparison is tried on both sides and at equality.
    let near = |rng: &mut fastrand::Rng, limit: u64| limit.saturating_sub(2) + rng.u64(0..5);
    for case in 0..400 {
        let limit = |rng: &mut fastrand::Rng| (rng.u8(0..4) > 0).then(|| rng.u64(1..100));
        let quota = Quota {
            requests_per_minute: limit(&mut rng),
            tokens_per_minute: limit(&mut rng),
            budget_per_day: limit(&mut rng),
            budget_per_month: limit(&mut rng),
            soft_limit: 0.8,
        };
        let before = Counters {
            requests: near(&mut rng, quota.requests_per_minute.unwrap_or(50)),
            tokens: near(&mut rng, quota.tokens_per_minute.unwrap_or(50)),
            spend_day: near(&mut rng, quota.budget_per_day.unwrap_or(50)),
            spend_month: near(&mut rng, quota.budget_per_month.unwrap_or(50)),
        };
        let estimate = rng.u64(0..4);
        let values = [
            before.requests,
            before.tokens,
            before.spend_day,
            before.spend_month,
        ];
        for (key, value) in keys.all().into_iter().zip(values) {
            redis::cmd("SET")
                .arg(key)
                .arg(value)
                .query_async::<()>(&mut conn)
                .await
                .unwrap();
        }
        let arg = |l: Option<u64>| l.map_or(-1, |l| l as i64);
        let mut call = script.prepare_invoke();
        for key in keys.all() {
            call.key(key);
        }
        call.arg(arg(quota.requests_per_minute))
            .arg(arg(quota.tokens_per_minute))
            .arg(arg(quota.budget_per_day))
            .arg(arg(quota.budget_per_month))
            .arg(estimate)
            .arg(keys.minute_expiry_ms);
        let (refused, requests, tokens, day, month): (u8, u64, u64, u64, u64) =
            call.invoke_async(&mut conn).await.unwrap();
        let expected = match exceeded(&quota, &before, estimate) {
            None => 0,
            Some(LimitKind::Requests) => 1,
            Some(LimitKind::Tokens) => 2,
            Some(LimitKind::BudgetPerDay) => 3,
            Some(LimitKind::BudgetPerMonth) => 4,
        };
        assert_eq!(
            refused, expected,
            "case {case}: {quota:?} {before:?} +{estimate}"
        );
        assert_eq!([requests, tokens, day, month], values, "case {case}");
        let after: Vec<u64> = redis::cmd("MGET")
            .arg(&keys.all()[..2])
            .query_async(&mut conn)
            .await
            .unwrap();
        let counted = if refused == 0 { (1, estimate) } else { (0, 0) };
        assert_eq!(
            after,
            [before.requests + counted.0, before.tokens + counted.1],
            "case {case}"
        );
    }
}
