//! What each tenant used in the current windows: the body of `GET /admin/tenants` and what
//! `quantrouter tenants usage` prints. Never a key, and of a key's hash only its first
//! [`super::HASH_PREFIX_CHARS`] characters.

use quantrouter_policy::limits::{
    admit, from_micros, reset_value, used_share, Counters, Outcome, Windows,
};
use quantrouter_policy::TenantLimits;
use serde::Serialize;

use super::limiter::{CounterKeys, CounterSource, Limiter};
use super::{TenantSnapshot, TenantSource};
use crate::redis_conn::Conn;

/// Every tenant's usage, as `/admin/tenants` answers.
#[derive(Debug, Clone, Serialize)]
pub struct UsageReport {
    /// Version of the active tenant document (0: none).
    pub version: u64,
    /// Where the document came from.
    pub source: TenantSource,
    /// `redis`: the cluster's counters; `local`: Redis is out of reach and these are what
    /// this replica last read plus what it counted since.
    pub counters: &'static str,
    pub windows: WindowsReport,
    pub tenants: Vec<TenantUsage>,
}

/// The current windows (UTC) and when each ends.
#[derive(Debug, Clone, Serialize)]
pub struct WindowsReport {
    pub minute: String,
    pub day: String,
    pub month: String,
    pub minute_resets_in: String,
    pub day_resets_in: String,
    pub month_resets_in: String,
}

/// One tenant's limits and usage.
#[derive(Debug, Clone, Serialize)]
pub struct TenantUsage {
    pub id: String,
    pub priority: i32,
    /// The first characters of each key's SHA-256.
    pub key_sha256_prefixes: Vec<String>,
    pub limits: TenantLimits,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_quality: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allowed_profiles: Option<Vec<String>>,
    pub usage: UsageNumbers,
    /// The largest share of any limit in use.
    pub used: f64,
    /// What the tenant's next request would get: `admit`, `downgrade`, or `refuse`.
    pub next_request: &'static str,
    /// The limit that refuses it, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refused_by: Option<&'static str>,
}

/// Counters in the units operators read: spend in the profiles' currency.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct UsageNumbers {
    pub requests_this_minute: u64,
    pub tokens_this_minute: u64,
    pub spend_today: f64,
    pub spend_this_month: f64,
}

/// The counters of `tenants` in the windows of `now_ms`, in one round trip (MGET; a cluster
/// asks each master for its slots' keys); a missing or unreadable counter is 0.
pub async fn read_counters(
    conn: &mut Conn,
    prefix: &str,
    tenants: &[&str],
    now_ms: u64,
) -> Result<Vec<Counters>, redis::RedisError> {
    let windows = Windows::at(now_ms);
    let keys: Vec<CounterKeys> = tenants
        .iter()
        .map(|id| CounterKeys::new(prefix, id, windows))
        .collect();
    read_keys(conn, &keys).await
}

/// The counters under each of `keys`, in their order.
pub async fn read_keys(
    conn: &mut Conn,
    keys: &[CounterKeys],
) -> Result<Vec<Counters>, redis::RedisError> {
    if keys.is_empty() {
        return Ok(Vec::new());
    }
    let keys: Vec<&str> = keys.iter().flat_map(CounterKeys::all).collect();
    let values: Vec<Option<String>> = redis::cmd("MGET").arg(&keys).query_async(conn).await?;
    let number = |v: &Option<String>| v.as_deref().and_then(|v| v.parse().ok()).unwrap_or(0);
    Ok(values
        .chunks(4)
        .map(|c| Counters {
            requests: number(&c[0]),
            tokens: number(&c[1]),
            spend_day: number(&c[2]),
            spend_month: number(&c[3]),
        })
        .collect())
}

/// The report of `snapshot`'s tenants with their `counters` (in the same order).
pub fn report(
    snapshot: &TenantSnapshot,
    counters: &[Counters],
    source: CounterSource,
    now_ms: u64,
) -> UsageReport {
    let windows = Windows::at(now_ms);
    let tenants = snapshot
        .tenants
        .iter()
        .zip(counters)
        .map(|(tenant, counters)| {
            let next = admit(&tenant.quota, counters, 0, now_ms);
            let (next_request, refused_by) = match next.outcome {
                Outcome::Admit => ("admit", None),
                Outcome::Downgrade => ("downgrade", None),
                Outcome::Refuse { limit, .. } => ("refuse", Some(limit.as_str())),
            };
            TenantUsage {
                id: tenant.id.to_string(),
                priority: tenant.priority,
                key_sha256_prefixes: tenant.key_prefixes.clone(),
                limits: tenant.limits,
                min_quality: tenant.min_quality,
                allowed_profiles: tenant.allowed_profiles.clone(),
                usage: UsageNumbers {
                    requests_this_minute: counters.requests,
                    tokens_this_minute: counters.tokens,
                    spend_today: from_micros(counters.spend_day),
                    spend_this_month: from_micros(counters.spend_month),
                },
                used: used_share(&tenant.quota, counters),
                next_request,
                refused_by,
            }
        })
        .collect();
    UsageReport {
        version: snapshot.version,
        source: snapshot.source,
        counters: match source {
            CounterSource::Redis => "redis",
            CounterSource::Local => "local",
        },
        windows: WindowsReport {
            minute: windows.minute_label(),
            day: windows.day_label(),
            month: windows.month_label(),
            minute_resets_in: reset_value(windows.minute_end_ms().saturating_sub(now_ms)),
            day_resets_in: reset_value(windows.day_end_ms().saturating_sub(now_ms)),
            month_resets_in: reset_value(windows.month_end_ms().saturating_sub(now_ms)),
        },
        tenants,
    }
}

/// The report of `snapshot`'s tenants with the counters `limiter` reads.
pub async fn usage(limiter: &Limiter, snapshot: &TenantSnapshot, now_ms: u64) -> UsageReport {
    let ids: Vec<&str> = snapshot.tenants.iter().map(|t| &*t.id).collect();
    let (counters, source) = limiter.read_counters(&ids, now_ms).await;
    report(snapshot, &counters, source, now_ms)
}

/// The report as the table `quantrouter tenants usage` prints.
pub fn table(report: &UsageReport) -> String {
    let mut out = format!(
        "tenants version {} ({}), counters from {}; minute {} resets in {}, day {} in {}, month {} in {}\n",
        report.version,
        report.source.as_str(),
        report.counters,
        report.windows.minute,
        report.windows.minute_resets_in,
        report.windows.day,
        report.windows.day_resets_in,
        report.windows.month,
        report.windows.month_resets_in,
    );
    out.push_str(&format!(
        "{:<24} {:>5} {:>15} {:>19} {:>21} {:>21} {:>6}  next\n",
        "tenant", "prio", "requests/min", "tokens/min", "spend today", "spend this month", "used"
    ));
    for t in &report.tenants {
        let of = |used: String, limit: Option<String>| match limit {
            Some(limit) => format!("{used}/{limit}"),
            None => used,
        };
        let next = match t.refused_by {
            Some(limit) => format!("refuse ({limit})"),
            None => t.next_request.to_owned(),
        };
        out.push_str(&format!(
            "{:<24} {:>5} {:>15} {:>19} {:>21} {:>21} {:>5.0}%  {next}\n",
            t.id,
            t.priority,
            of(
                t.usage.requests_this_minute.to_string(),
                t.limits.requests_per_minute.map(|l| l.to_string())
            ),
            of(
                t.usage.tokens_this_minute.to_string(),
                t.limits.tokens_per_minute.map(|l| l.to_string())
            ),
            of(
                format!("{:.2}", t.usage.spend_today),
                t.limits.budget_per_day.map(|l| format!("{l:.2}"))
            ),
            of(
                format!("{:.2}", t.usage.spend_this_month),
                t.limits.budget_per_month.map(|l| format!("{l:.2}"))
            ),
            100.0 * t.used,
        ));
    }
    out
}
