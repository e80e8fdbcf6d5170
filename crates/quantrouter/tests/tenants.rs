//! Tenant limits with a real redis-server: replicas share one limit, tokens are corrected
//! from usage, budgets downgrade then refuse and reset with the day, an outage moves
//! decisions to local shares without a request waiting on Redis, and no key text reaches
//! Redis, logs or the usage report. Time is injected: every decision gets its instant.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use quantrouter::tenants::limiter::{unix_ms, CounterSource, Limiter, LimiterConfig};
use quantrouter::tenants::{ActiveTenant, TenantSnapshot, TenantSource, TenantStore};
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
        Some((redis.client(), PREFIX.to_owned())),
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
    // A correction of a request admitted in a minute that is over changes nothing now.
    limiters[1]
        .settle(third.ticket.unwrap(), 10, 0.0, now + 60_000)
        .await;
    let (previous, _) = limiters[0].counters("team-a", now + 2_000).await;
    let (current, _) = limiters[0].counters("team-a", now + 60_000).await;
    assert_eq!((previous.tokens, current.tokens), (950, 0));
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

    // Back (empty: no persistence). What was counted meanwhile is handed over, then
    // requests count in Redis again.
    let _redis = RedisServer::start_on(port, None);
    let back = eventually(Duration::from_secs(10), || async {
        limiters.iter().all(|l| l.stats().redis_up)
    })
    .await;
    assert!(back, "limiters did not reconnect");
    let (counters, source) = limiters[0].counters("team-a", now + 2).await;
    assert_eq!(source, CounterSource::Redis);
    assert_eq!(counters.requests, local_admitted);
    let a = limiters[1].admit(t, 0, now + 3).await;
    assert_eq!(a.source, CounterSource::Redis);
    assert_eq!(limiters[1].stats().redis_decisions, 6);
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
