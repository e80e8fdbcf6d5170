use super::*;
use quantrouter_policy::limits::{LimitKind, DAY_MS};
use quantrouter_policy::TenantLimits;

use crate::tenants::ActiveTenant;

fn tenant(limits: TenantLimits) -> ActiveTenant {
    ActiveTenant::new("team-a", limits)
}

/// 2026-03-15T12:00:30Z.
const NOON: u64 = 1_773_576_030_000;

#[test]
fn counter_keys_name_the_tenant_and_window_and_outlive_it_briefly() {
    let keys = CounterKeys::new("qr", "team-a", Windows::at(NOON));
    assert_eq!(
        keys.requests,
        "qr:tenants:usage:{team-a}:requests:202603151200"
    );
    assert_eq!(keys.tokens, "qr:tenants:usage:{team-a}:tokens:202603151200");
    assert_eq!(keys.spend_day, "qr:tenants:usage:{team-a}:spend:20260315");
    assert_eq!(keys.spend_month, "qr:tenants:usage:{team-a}:spend:202603");
    // One hash tag: a cluster keeps the tenant's keys, and so every script, in one slot.
    let tag = |key: &str| key[key.find('{').unwrap()..=key.find('}').unwrap()].to_owned();
    assert!(keys.all().iter().all(|k| tag(k) == "{team-a}"));
    let former = CounterKeys::former("qr", "team-a", Windows::at(NOON));
    assert_eq!(
        former.requests,
        "qr:tenants:usage:team-a:requests:202603151200"
    );
    let w = Windows::at(NOON);
    assert_eq!(keys.minute_expiry_ms, w.minute_end_ms() + 60_000);
    assert_eq!(keys.day_expiry_ms, w.day_end_ms() + 3_600_000);
    assert_eq!(keys.month_expiry_ms, w.month_end_ms() + DAY_MS);
    assert_eq!(replicas_key("qr"), "qr:tenants:replicas");
}

#[tokio::test]
async fn without_redis_a_replica_enforces_the_whole_limit_itself() {
    let limiter = Limiter::start(LimiterConfig::new(None, "r1".into())).await;
    let t = tenant(TenantLimits {
        requests_per_minute: Some(10),
        ..TenantLimits::default()
    });
    let mut outcomes = Vec::new();
    for _ in 0..12 {
        outcomes.push(limiter.admit(&t, 0, NOON).await);
    }
    assert!(outcomes.iter().all(|a| a.source == CounterSource::Local));
    let refused: Vec<_> = outcomes
        .iter()
        .filter_map(|a| match a.decision.outcome {
            Outcome::Refuse { limit, .. } => Some(limit),
            _ => None,
        })
        .collect();
    assert_eq!(refused, [LimitKind::Requests, LimitKind::Requests]);
    // The 8th to 10th are past the soft limit: downgraded.
    assert_eq!(outcomes[7].decision.outcome, Outcome::Downgrade);
    assert!(outcomes[7].ticket.is_some() && outcomes[10].ticket.is_none());
    // The next minute starts afresh.
    let next = limiter.admit(&t, 0, NOON + 60_000).await;
    assert_eq!(next.decision.outcome, Outcome::Admit);
    let stats = limiter.stats();
    assert_eq!(
        (stats.local_decisions, stats.redis_decisions, stats.replicas),
        (13, 0, 1)
    );
    assert!(!stats.redis_up);
}

#[tokio::test]
async fn without_redis_settling_corrects_tokens_and_counts_spend() {
    let limiter = Limiter::start(LimiterConfig::new(None, "r1".into())).await;
    let t = tenant(TenantLimits {
        tokens_per_minute: Some(1000),
        budget_per_day: Some(1.0),
        ..TenantLimits::default()
    });
    let a = limiter.admit(&t, 600, NOON).await;
    assert_eq!(limiter.admit(&t, 600, NOON).await.ticket.map(|_| ()), None);
    limiter.settle(a.ticket.unwrap(), 100, 0.9, NOON + 1).await;
    let (counters, source) = limiter.counters("team-a", NOON + 2).await;
    assert_eq!(source, CounterSource::Local);
    assert_eq!((counters.tokens, counters.spend_day), (100, 900_000));
    let b = limiter.admit(&t, 600, NOON + 3).await;
    assert_eq!(
        b.decision.outcome,
        Outcome::Downgrade,
        "0.9 of the day's budget spent"
    );
    limiter.settle(b.ticket.unwrap(), 600, 0.2, NOON + 4).await;
    let c = limiter.admit(&t, 1, NOON + 5).await;
    assert_eq!(
        c.decision.outcome,
        Outcome::Refuse {
            limit: LimitKind::BudgetPerDay,
            retry_after_s: (Windows::at(NOON).day_end_ms() - NOON - 5).div_ceil(1000)
        }
    );
}
