//! Counting and enforcing tenant limits across every replica.
//!
//! The counters live in Redis, one key per tenant, kind and window under
//! `<prefix>:tenants:usage:{<tenant>}:` (the hash tag keeps a tenant's keys in one Redis
//! Cluster slot, so every script touches one slot). A request costs one round trip: [`ADMIT_SCRIPT`] reads the
//! tenant's four counters, makes the same comparisons as
//! [`quantrouter_policy::limits::exceeded`] and, when it admits, counts the request and
//! reserves its worst case (tokens and spend), all atomically, so N replicas enforce one
//! limit. When the answer ends, [`Limiter::settle`] turns the reservation into what was
//! used, or [`Limiter::refund`] gives it back when nothing was served ([`APPLY_SCRIPT`]),
//! off the request's path, in the windows the reservation was made in.
//!
//! No request waits on Redis beyond [`LimiterConfig::redis_timeout`]: a failed or slow call
//! marks Redis out of reach, and from then on requests are decided locally, each replica on
//! its share of what was left of each limit (the headroom over the cluster's counters as it
//! last read them, at most a heartbeat old, divided by the replicas seen recently). The
//! heartbeat task notices when Redis is back. If Redis lost the counters meanwhile (a
//! restart without persistence), or holds older ones (a replica promoted by a failover of
//! Sentinel or of a cluster shard), the epoch key [`epoch_key`] is new: each replica first
//! raises them to what it last read, and requests go to Redis only once every replica has
//! had a heartbeat to do so. Then what was counted locally is added, and requests go to
//! Redis again. Without Redis at all, each replica enforces the whole limit.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use quantrouter_policy::limits::{
    admit_on_share, admit_reserving, to_micros, Counters, LimitDecision, Outcome, Reservation,
    WindowedCounters, Windows, MINUTE_MS,
};
use quantrouter_policy::MAX_COUNT_LIMIT;
use tokio::task::JoinHandle;

use super::ActiveTenant;
use crate::redis_conn::{Conn, Link};

/// Checks a request against the tenant's counters and counts it if admitted, atomically.
/// Limits are -1 when absent; the comparisons and their order are those of
/// `quantrouter_policy::limits::exceeded`. ARGV[5] is the tokens reserved, ARGV[6] the
/// minute's expiry, ARGV[7] the spend reserved with the day's and month's expiries after it.
/// Returns the refusing limit (0 none, 1 requests, 2 tokens, 3 daily budget, 4 monthly
/// budget) and the counters before this request.
pub const ADMIT_SCRIPT: &str = r#"
local requests = tonumber(redis.call('GET', KEYS[1]) or '0')
local tokens = tonumber(redis.call('GET', KEYS[2]) or '0')
local day = tonumber(redis.call('GET', KEYS[3]) or '0')
local month = tonumber(redis.call('GET', KEYS[4]) or '0')
local rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local per_day, per_month = tonumber(ARGV[3]), tonumber(ARGV[4])
local estimate = tonumber(ARGV[5])
local refused = 0
if per_month >= 0 and month >= per_month then refused = 4
elseif per_day >= 0 and day >= per_day then refused = 3
elseif rpm >= 0 and requests + 1 > rpm then refused = 1
elseif tpm >= 0 and tokens + estimate > tpm then refused = 2
end
if refused == 0 then
  redis.call('INCR', KEYS[1])
  redis.call('PEXPIREAT', KEYS[1], ARGV[6])
  if estimate > 0 then
    redis.call('INCRBY', KEYS[2], estimate)
    redis.call('PEXPIREAT', KEYS[2], ARGV[6])
  end
  local spend = tonumber(ARGV[7] or '0')
  if spend > 0 then
    redis.call('INCRBY', KEYS[3], spend)
    redis.call('PEXPIREAT', KEYS[3], ARGV[8])
    redis.call('INCRBY', KEYS[4], spend)
    redis.call('PEXPIREAT', KEYS[4], ARGV[9])
  end
end
return {refused, requests, tokens, day, month}
"#;

/// Adds signed amounts to counters (a token correction may be negative) with their expiry;
/// a counter never goes below zero, even when Redis lost what a correction refers to.
/// ARGV holds a delta and an expiry time (Unix ms) per key.
pub const APPLY_SCRIPT: &str = r#"
for i, key in ipairs(KEYS) do
  local delta = tonumber(ARGV[2 * i - 1])
  if delta ~= 0 then
    local value = redis.call('INCRBY', key, delta)
    if value < 0 then
      redis.call('SET', key, 0, 'KEEPTTL')
    end
    redis.call('PEXPIREAT', key, ARGV[2 * i])
  end
end
return 1
"#;

/// Re-seeds counters after a new epoch with what the replicas last read of them: KEYS are
/// pairs of a counter and its floor key for the epoch, ARGV a value and an expiry time per
/// pair. The floor starts at what the counter held when the epoch's re-seeding first touched
/// it (nothing after an empty restart; what a promoted replica had, after a failover) and
/// keeps the largest value offered since; the counter grows by what the floor grows. So the
/// counter ends at the larger of what it held and the largest last read, plus whatever was
/// added meanwhile (the replicas' local counts, [`FLUSH_SCRIPT`]), in whichever order the
/// replicas come.
pub const RAISE_SCRIPT: &str = r#"
for i = 1, #KEYS, 2 do
  local n = (i + 1) / 2
  local offered = tonumber(ARGV[2 * n - 1])
  local known = redis.call('GET', KEYS[i + 1])
  local floor = tonumber(known or redis.call('GET', KEYS[i]) or '0')
  if offered > floor then
    redis.call('INCRBY', KEYS[i], offered - floor)
    redis.call('PEXPIREAT', KEYS[i], ARGV[2 * n])
    floor = offered
    known = nil
  end
  if not known then
    redis.call('SET', KEYS[i + 1], floor, 'PXAT', ARGV[2 * n])
  end
end
return 1
"#;

/// [`APPLY_SCRIPT`] while an epoch is being re-seeded: KEYS are pairs of a counter and its
/// floor key for the epoch, ARGV a delta and an expiry time per pair. A counter whose floor
/// is not set yet gets it first, from what the counter holds before this delta: a replica's
/// local counts are never taken for what the counter held ([`RAISE_SCRIPT`]).
pub const FLUSH_SCRIPT: &str = r#"
for i = 1, #KEYS, 2 do
  local n = (i + 1) / 2
  local delta = tonumber(ARGV[2 * n - 1])
  if delta ~= 0 then
    if redis.call('EXISTS', KEYS[i + 1]) == 0 then
      local held = tonumber(redis.call('GET', KEYS[i]) or '0')
      redis.call('SET', KEYS[i + 1], held, 'PXAT', ARGV[2 * n])
    end
    local value = redis.call('INCRBY', KEYS[i], delta)
    if value < 0 then
      redis.call('SET', KEYS[i], 0, 'KEEPTTL')
    end
    redis.call('PEXPIREAT', KEYS[i], ARGV[2 * n])
  end
end
return 1
"#;

/// The counters' epoch: `<replication ids>|<id>:<created, Unix ms>`, made by the first
/// replica to find none, or to find that a master it was made with is gone. ARGV[2] holds
/// the replication ids of the masters now (space-separated): a master restarted empty, or a
/// replica promoted with what it had, has a new one. A new epoch means the counters may have
/// lost what was counted. Returns the epoch, Redis's clock, and 0 (the epoch stands), 1 (a
/// new one) or 2 (a new one replacing an epoch of the key layout before hash tags, whose
/// counters are to be carried over).
pub const EPOCH_SCRIPT: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local epoch = redis.call('GET', KEYS[1])
local renewed = 0
if not epoch then
  renewed = 1
else
  local made_with = string.match(epoch, '^(.-)|')
  if not made_with then
    renewed = 2
  else
    local now_ids = ' ' .. ARGV[2] .. ' '
    for id in string.gmatch(made_with, '%S+') do
      if not string.find(now_ids, ' ' .. id .. ' ', 1, true) then
        renewed = 1
      end
    end
  end
end
if renewed > 0 then
  epoch = ARGV[2] .. '|' .. ARGV[1] .. ':' .. now
  redis.call('SET', KEYS[1], epoch)
end
return {epoch, now, renewed}
"#;

/// Calls outside a request (heartbeat, flush) never wait longer than this.
const BACKGROUND_TIMEOUT: Duration = Duration::from_secs(1);

/// How the limiter talks to Redis, with each default's reason.
#[derive(Debug, Clone)]
pub struct LimiterConfig {
    /// The shared counters' Redis and key prefix; `None`: each replica counts alone.
    pub redis: Option<(crate::redis_conn::Redis, String)>,
    /// This replica's name among the replicas seen recently.
    pub replica_id: String,
    /// Longest a request waits for the admission script: a healthy Redis answers in well
    /// under a millisecond, and 50 ms bounds what one request loses to a failing one before
    /// the rest are decided locally.
    pub redis_timeout: Duration,
    /// How often this replica tells Redis it is alive, and, while Redis is out of reach,
    /// tries it again: an outage is over for requests within two seconds of Redis's return.
    pub heartbeat: Duration,
    /// A replica not heard from for this long no longer counts in local shares: five
    /// heartbeats, so one late heartbeat does not change anybody's share.
    pub replica_ttl: Duration,
    /// The clock of the limit windows the heartbeat reads and re-seeds counters in (the
    /// router's, which a test may set).
    pub clock: Clock,
}

/// Counts tenants' usage and decides each request against their limits.
#[derive(Debug)]
pub struct Limiter {
    shared: Arc<Shared>,
    heartbeat: Option<JoinHandle<()>>,
}

/// The decision on one request.
#[derive(Debug)]
pub struct Admission {
    pub decision: LimitDecision,
    /// Where the counters came from.
    pub source: CounterSource,
    /// For [`Limiter::settle`] when the answer ends; `None` when refused.
    pub ticket: Option<Ticket>,
}

/// Whose counters a decision used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CounterSource {
    /// The cluster's, in Redis.
    Redis,
    /// This replica's own, on its share of the limits.
    Local,
}

/// An admitted request whose reservation is still to be settled.
#[derive(Debug, Clone)]
pub struct Ticket {
    tenant: Arc<str>,
    reserved: Reservation,
    admitted_ms: u64,
    /// Admitted by Redis (the reservation is in the cluster's counters as this replica
    /// read them), or locally (in this replica's own).
    source: CounterSource,
}

/// How an admitted request ended, for the correction of its reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Settlement {
    /// Served: it used this many tokens and this spend (millionths).
    Used { tokens: u64, spend: u64 },
    /// Nothing was served: the request, its tokens and spend are given back.
    Unserved,
}

/// What a limiter has done, for tests and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimiterStats {
    pub redis_decisions: u64,
    pub local_decisions: u64,
    /// Requests whose admission call to Redis failed or timed out: each waited at most
    /// [`LimiterConfig::redis_timeout`] and then was decided locally.
    pub redis_failures: u64,
    /// Whether requests currently go to Redis.
    pub redis_up: bool,
    /// Replicas seen recently (this one included); 1 without Redis.
    pub replicas: u64,
    /// Heartbeats that read the followed tenants' counters ([`Limiter::follow`]).
    pub refreshes: u64,
}

struct Shared {
    redis: Option<RedisCounters>,
    replica_id: String,
    redis_timeout: Duration,
    replica_ttl: Duration,
    /// How long after a new epoch requests stay local: every replica beats in that time,
    /// and re-seeds the counters before anybody admits on them.
    reseed_grace: Duration,
    clock: Clock,
    replicas: AtomicU64,
    /// The tenants with limits, read every heartbeat so a replica's view of their counters
    /// is at most a heartbeat old when Redis goes away.
    followed: Mutex<Option<TenantList>>,
    tenants: Mutex<HashMap<Arc<str>, TenantState>>,
    redis_decisions: AtomicU64,
    local_decisions: AtomicU64,
    redis_failures: AtomicU64,
    refreshes: AtomicU64,
}

/// Lists the tenants whose counters a replica keeps an eye on.
pub type TenantList = Box<dyn Fn() -> Vec<Arc<str>> + Send + Sync>;

#[derive(Debug)]
struct RedisCounters {
    link: Link,
    prefix: String,
    /// The connection the scripts were last loaded on.
    loaded: AtomicU64,
    /// Requests go to Redis only while this is set: cleared by any failure, set by the
    /// heartbeat once what was counted locally meanwhile is in Redis.
    up: AtomicBool,
    /// The counters' epoch as last seen, and whether this replica waits out a new one.
    epoch: Mutex<EpochState>,
    admit: redis::Script,
    apply: redis::Script,
    raise: redis::Script,
    flush: redis::Script,
    epoch_script: redis::Script,
}

#[derive(Debug, Default)]
struct EpochState {
    seen: Option<String>,
    /// Redis came back empty: requests stay local until the epoch is older than the grace.
    waiting: bool,
    /// The counters of the former key layout are still to be carried over.
    former: bool,
}

/// What this replica knows of one tenant.
#[derive(Debug, Default)]
struct TenantState {
    /// The cluster's counters as Redis last answered (this replica's charges since added).
    seen: Option<WindowedCounters>,
    /// What this replica counted since Redis last answered for the tenant.
    own: Option<WindowedCounters>,
    /// Amounts counted locally that Redis does not have yet, by counter key.
    unsynced: HashMap<String, Pending>,
}

#[derive(Debug, Clone, Copy)]
struct Pending {
    delta: i64,
    expire_at_ms: u64,
}

/// The counter keys of one tenant in one set of windows, with when each expires.
#[derive(Debug, Clone)]
pub struct CounterKeys {
    pub requests: String,
    pub tokens: String,
    pub spend_day: String,
    pub spend_month: String,
    pub minute_expiry_ms: u64,
    pub day_expiry_ms: u64,
    pub month_expiry_ms: u64,
}

/// Why a Redis exchange failed.
#[derive(Debug, thiserror::Error)]
enum CounterError {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("replica_id", &self.replica_id)
            .finish_non_exhaustive()
    }
}

/// Unix milliseconds for limit windows: the system clock, or one a test sets, so a test
/// can move a tenant into tomorrow's window without waiting for it.
#[derive(Debug, Clone, Default)]
pub struct Clock {
    manual: Option<Arc<AtomicU64>>,
}

// === impl Clock ===

impl Clock {
    /// The system clock.
    pub fn system() -> Self {
        Self::default()
    }

    /// A clock that reads `start_ms` until [`Clock::set`] moves it.
    pub fn manual(start_ms: u64) -> Self {
        Self {
            manual: Some(Arc::new(AtomicU64::new(start_ms))),
        }
    }

    /// Moves a manual clock (the system clock ignores it).
    pub fn set(&self, unix_ms: u64) {
        if let Some(manual) = &self.manual {
            manual.store(unix_ms, Ordering::Relaxed);
        }
    }

    pub fn now_ms(&self) -> u64 {
        match &self.manual {
            Some(manual) => manual.load(Ordering::Relaxed),
            None => unix_ms(SystemTime::now()),
        }
    }
}

// === impl LimiterConfig ===

impl LimiterConfig {
    /// Defaults for a replica named `replica_id` counting in `redis`, if any.
    pub fn new(redis: Option<(crate::redis_conn::Redis, String)>, replica_id: String) -> Self {
        Self {
            redis,
            replica_id,
            redis_timeout: Duration::from_millis(50),
            heartbeat: Duration::from_secs(2),
            replica_ttl: Duration::from_secs(10),
            clock: Clock::system(),
        }
    }
}

// === impl CounterKeys ===

impl CounterKeys {
    /// `<prefix>:tenants:usage:{<tenant>}:{requests,tokens}:<YYYYMMDDHHMM>` and
    /// `…:spend:<YYYYMMDD>` / `…:spend:<YYYYMM>`. Each expires a little after its window, so
    /// a replica whose clock is slightly behind still finds it.
    pub fn new(prefix: &str, tenant: &str, windows: Windows) -> Self {
        Self::under(format!("{prefix}:tenants:usage:{{{tenant}}}"), windows)
    }

    /// The keys of the layout before hash tags (`…:usage:<tenant>:…`), carried over once.
    pub fn former(prefix: &str, tenant: &str, windows: Windows) -> Self {
        Self::under(format!("{prefix}:tenants:usage:{tenant}"), windows)
    }

    fn under(base: String, windows: Windows) -> Self {
        let minute = windows.minute_label();
        Self {
            requests: format!("{base}:requests:{minute}"),
            tokens: format!("{base}:tokens:{minute}"),
            spend_day: format!("{base}:spend:{}", windows.day_label()),
            spend_month: format!("{base}:spend:{}", windows.month_label()),
            minute_expiry_ms: windows.minute_end_ms().saturating_add(MINUTE_MS),
            day_expiry_ms: windows.day_end_ms().saturating_add(3_600_000),
            month_expiry_ms: windows.month_end_ms().saturating_add(86_400_000),
        }
    }

    /// The four keys in the order the scripts and usage reads take them.
    pub fn all(&self) -> [&str; 4] {
        [
            &self.requests,
            &self.tokens,
            &self.spend_day,
            &self.spend_month,
        ]
    }
}

/// `<prefix>:tenants:replicas`: a sorted set of replica ids scored by their last heartbeat.
pub fn replicas_key(prefix: &str) -> String {
    format!("{prefix}:tenants:replicas")
}

/// `<prefix>:tenants:epoch`: made once per life of Redis's data ([`EPOCH_SCRIPT`]).
pub fn epoch_key(prefix: &str) -> String {
    format!("{prefix}:tenants:epoch")
}

// === impl Limiter ===

impl Limiter {
    /// A limiter; with Redis it first tries to reach it (at most a second) so the first
    /// requests already count cluster-wide, then keeps a heartbeat running until dropped.
    pub async fn start(config: LimiterConfig) -> Self {
        let redis = config.redis.map(|(redis, prefix)| RedisCounters {
            link: Link::new(redis),
            prefix,
            loaded: AtomicU64::new(0),
            up: AtomicBool::new(false),
            epoch: Mutex::new(EpochState::default()),
            admit: redis::Script::new(ADMIT_SCRIPT),
            apply: redis::Script::new(APPLY_SCRIPT),
            raise: redis::Script::new(RAISE_SCRIPT),
            flush: redis::Script::new(FLUSH_SCRIPT),
            epoch_script: redis::Script::new(EPOCH_SCRIPT),
        });
        let shared = Arc::new(Shared {
            redis,
            replica_id: config.replica_id,
            redis_timeout: config.redis_timeout,
            replica_ttl: config.replica_ttl,
            // Two heartbeats and a timed-out call: every live replica has beaten by then.
            reseed_grace: config.heartbeat * 2 + BACKGROUND_TIMEOUT,
            clock: config.clock,
            replicas: AtomicU64::new(1),
            followed: Mutex::new(None),
            tenants: Mutex::new(HashMap::new()),
            redis_decisions: AtomicU64::new(0),
            local_decisions: AtomicU64::new(0),
            redis_failures: AtomicU64::new(0),
            refreshes: AtomicU64::new(0),
        });
        let heartbeat = match shared.redis.is_some() {
            true => {
                shared.beat().await;
                let shared = Arc::clone(&shared);
                let interval = config.heartbeat;
                Some(tokio::spawn(async move {
                    let mut ticker = tokio::time::interval(interval);
                    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    ticker.tick().await;
                    loop {
                        ticker.tick().await;
                        shared.beat().await;
                    }
                }))
            }
            false => None,
        };
        Self { shared, heartbeat }
    }

    /// Decides one request of `tenant` estimated at `tokens` tokens at `now_ms` (Unix ms),
    /// and counts it if admitted.
    pub async fn admit(&self, tenant: &ActiveTenant, tokens: u64, now_ms: u64) -> Admission {
        self.reserve(tenant, Reservation::tokens(tokens), now_ms)
            .await
    }

    /// Decides one request of `tenant` that may use up to `reserved` at `now_ms` (Unix ms),
    /// and if admitted counts it and holds its reservation until it is settled.
    pub async fn reserve(
        &self,
        tenant: &ActiveTenant,
        reserved: Reservation,
        now_ms: u64,
    ) -> Admission {
        let reserved = tenant.quota.reservable(Reservation {
            tokens: reserved.tokens.min(MAX_COUNT_LIMIT),
            spend: reserved.spend.min(MAX_COUNT_LIMIT),
        });
        let shared = &self.shared;
        if let Some(redis) = shared.redis.as_ref() {
            if let Some(conn) = redis.connection_if_up() {
                let call = redis.admit_call(conn, tenant, reserved, now_ms);
                let answer = match tokio::time::timeout(shared.redis_timeout, call).await {
                    Ok(answer) => answer,
                    Err(_) => Err(CounterError::Timeout(shared.redis_timeout)),
                };
                match answer {
                    Ok(before) => return shared.decided_by_redis(tenant, before, reserved, now_ms),
                    Err(error) => {
                        shared.redis_failures.fetch_add(1, Ordering::Relaxed);
                        redis.mark_down(&error);
                    }
                }
            }
        }
        shared.admit_locally(tenant, reserved, now_ms)
    }

    /// Turns an admitted request's reservation into what its answer used: `tokens`, and
    /// `cost` (in the profiles' currency) of spend, at `now_ms`, in the windows it was
    /// admitted in. Returns once the correction is in Redis or, failing that, counted
    /// locally for later.
    pub async fn settle(&self, ticket: Ticket, tokens: u64, cost: f64, now_ms: u64) {
        let used = Settlement::Used {
            tokens: tokens.min(MAX_COUNT_LIMIT),
            spend: to_micros(cost).min(MAX_COUNT_LIMIT),
        };
        self.close(ticket, used, now_ms).await;
    }

    /// Gives back everything an admitted request counted (the request, its tokens and
    /// spend): nothing was served.
    pub async fn refund(&self, ticket: Ticket, now_ms: u64) {
        self.close(ticket, Settlement::Unserved, now_ms).await;
    }

    async fn close(&self, ticket: Ticket, settlement: Settlement, now_ms: u64) {
        let shared = &self.shared;
        let (requests, tokens, spend) = match settlement {
            Settlement::Used { tokens, spend } => {
                let (tokens, spend) = ticket.reserved.settle(tokens, spend);
                (0, tokens, spend)
            }
            Settlement::Unserved => {
                let signed = |n: u64| -i64::try_from(n).unwrap_or(i64::MAX);
                (
                    -1,
                    signed(ticket.reserved.tokens),
                    signed(ticket.reserved.spend),
                )
            }
        };
        if requests == 0 && tokens == 0 && spend == 0 {
            return;
        }
        let correction = Correction {
            admitted_ms: ticket.admitted_ms,
            requests,
            tokens,
            spend,
        };
        if let Some(redis) = shared.redis.as_ref() {
            let updates = correction.updates(&redis.prefix, &ticket.tenant);
            if let Some(conn) = redis.connection_if_up() {
                let call = redis.apply_call(conn, &updates);
                match tokio::time::timeout(BACKGROUND_TIMEOUT, call).await {
                    Ok(Ok(())) => {
                        shared.note_correction(&ticket.tenant, correction);
                        return;
                    }
                    Ok(Err(error)) => redis.mark_down(&error),
                    Err(_) => redis.mark_down(&CounterError::Timeout(BACKGROUND_TIMEOUT)),
                }
            }
            shared.keep_unsynced(&ticket.tenant, &updates);
        }
        match ticket.source {
            // Its reservation is in the cluster's counters as last read, not in this
            // replica's own: correcting those would free this replica's share.
            CounterSource::Redis => shared.note_correction(&ticket.tenant, correction),
            CounterSource::Local => shared.correct_locally(&ticket.tenant, correction, now_ms),
        }
    }

    /// Reads the counters of `tenants` (those with limits) every heartbeat, so that when
    /// Redis goes away this replica's shares start from numbers at most a heartbeat old,
    /// even for a tenant it never admitted a request of.
    pub fn follow(&self, tenants: TenantList) {
        *self
            .shared
            .followed
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(tenants);
    }

    /// What this limiter has done so far.
    pub fn stats(&self) -> LimiterStats {
        let shared = &self.shared;
        LimiterStats {
            redis_decisions: shared.redis_decisions.load(Ordering::Relaxed),
            local_decisions: shared.local_decisions.load(Ordering::Relaxed),
            redis_failures: shared.redis_failures.load(Ordering::Relaxed),
            redis_up: shared
                .redis
                .as_ref()
                .is_some_and(|r| r.up.load(Ordering::Acquire)),
            replicas: shared.replicas.load(Ordering::Relaxed),
            refreshes: shared.refreshes.load(Ordering::Relaxed),
        }
    }

    /// The counters of `tenant` in the windows of `now_ms`: the cluster's from Redis when it
    /// answers, else what this replica knows (its last read plus its own since), and which.
    pub async fn counters(&self, tenant: &str, now_ms: u64) -> (Counters, CounterSource) {
        let ids = [tenant];
        let mut read = self.read_counters(&ids, now_ms).await;
        read.0
            .pop()
            .map_or((Counters::default(), read.1), |c| (c, read.1))
    }

    /// [`Limiter::counters`] of several tenants in one round trip.
    pub async fn read_counters(
        &self,
        tenants: &[&str],
        now_ms: u64,
    ) -> (Vec<Counters>, CounterSource) {
        let shared = &self.shared;
        if let Some(redis) = shared.redis.as_ref() {
            if let Some(mut conn) = redis.connection_if_up() {
                let read = super::usage::read_counters(&mut conn, &redis.prefix, tenants, now_ms);
                if let Ok(Ok(counters)) = tokio::time::timeout(BACKGROUND_TIMEOUT, read).await {
                    return (counters, CounterSource::Redis);
                }
            }
        }
        let states = shared.lock_tenants();
        let counters = tenants
            .iter()
            .map(|id| {
                states.get(*id).map_or_else(Counters::default, |s| {
                    let seen = s.seen.map_or_else(Counters::default, |c| c.at(now_ms));
                    let own = s.own.map_or_else(Counters::default, |c| c.at(now_ms));
                    Counters {
                        requests: seen.requests.saturating_add(own.requests),
                        tokens: seen.tokens.saturating_add(own.tokens),
                        spend_day: seen.spend_day.saturating_add(own.spend_day),
                        spend_month: seen.spend_month.saturating_add(own.spend_month),
                    }
                })
            })
            .collect();
        (counters, CounterSource::Local)
    }
}

impl Drop for Limiter {
    fn drop(&mut self) {
        if let Some(task) = &self.heartbeat {
            task.abort();
        }
    }
}

/// A settlement or refund of one request: signed amounts in the windows it was admitted in.
#[derive(Debug, Clone, Copy)]
struct Correction {
    admitted_ms: u64,
    requests: i64,
    tokens: i64,
    spend: i64,
}

impl Correction {
    /// As counter updates, each in the window the request was counted in: a correction
    /// that arrives after that minute (or day) ended still reaches it.
    fn updates(&self, prefix: &str, tenant: &str) -> Vec<(String, Pending)> {
        let keys = CounterKeys::new(prefix, tenant, Windows::at(self.admitted_ms));
        [
            (keys.requests, self.requests, keys.minute_expiry_ms),
            (keys.tokens, self.tokens, keys.minute_expiry_ms),
            (keys.spend_day, self.spend, keys.day_expiry_ms),
            (keys.spend_month, self.spend, keys.month_expiry_ms),
        ]
        .into_iter()
        .filter(|(_, delta, _)| *delta != 0)
        .map(|(key, delta, expire_at_ms)| {
            (
                key,
                Pending {
                    delta,
                    expire_at_ms,
                },
            )
        })
        .collect()
    }
}

// === impl Shared ===

impl Shared {
    fn lock_tenants(&self) -> std::sync::MutexGuard<'_, HashMap<Arc<str>, TenantState>> {
        self.tenants.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn decided_by_redis(
        &self,
        tenant: &ActiveTenant,
        before: Counters,
        reserved: Reservation,
        now_ms: u64,
    ) -> Admission {
        self.redis_decisions.fetch_add(1, Ordering::Relaxed);
        let decision = admit_reserving(&tenant.quota, &before, reserved, now_ms);
        let admitted = !matches!(decision.outcome, Outcome::Refuse { .. });
        let after = if admitted {
            before.plus(reserved)
        } else {
            before
        };
        let mut states = self.lock_tenants();
        let state = states.entry(Arc::clone(&tenant.id)).or_default();
        state.seen = Some(WindowedCounters {
            windows: Windows::at(now_ms),
            counters: after,
        });
        state.own = None;
        Admission {
            decision,
            source: CounterSource::Redis,
            ticket: admitted.then(|| Ticket {
                tenant: Arc::clone(&tenant.id),
                reserved,
                admitted_ms: now_ms,
                source: CounterSource::Redis,
            }),
        }
    }

    /// Decides on this replica's share of what the cluster had left when last read.
    fn admit_locally(
        &self,
        tenant: &ActiveTenant,
        reserved: Reservation,
        now_ms: u64,
    ) -> Admission {
        self.local_decisions.fetch_add(1, Ordering::Relaxed);
        let mut states = self.lock_tenants();
        let state = states.entry(Arc::clone(&tenant.id)).or_default();
        let quota = match &self.redis {
            Some(_) => {
                let seen = state.seen.map_or_else(Counters::default, |s| s.at(now_ms));
                tenant
                    .quota
                    .local_share(&seen, self.replicas.load(Ordering::Relaxed))
            }
            None => tenant.quota,
        };
        let own = state
            .own
            .get_or_insert_with(|| WindowedCounters::new(now_ms));
        let mut decision = match &self.redis {
            Some(_) => admit_on_share(&quota, &own.at(now_ms), reserved, now_ms),
            None => admit_reserving(&quota, &own.at(now_ms), reserved, now_ms),
        };
        // Clients see the tenant's limits, not the share: only what remains is this
        // replica's.
        let headers = &mut decision.headers;
        for (state, limit) in [
            (&mut headers.requests, tenant.quota.requests_per_minute),
            (&mut headers.tokens, tenant.quota.tokens_per_minute),
        ] {
            if let (Some(state), Some(limit)) = (state.as_mut(), limit) {
                state.limit = limit;
            }
        }
        let admitted = !matches!(decision.outcome, Outcome::Refuse { .. });
        if admitted {
            let signed = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
            own.charge(now_ms, 1, signed(reserved.tokens), reserved.spend);
            if let Some(redis) = &self.redis {
                let keys = CounterKeys::new(&redis.prefix, &tenant.id, Windows::at(now_ms));
                let counted = [
                    (keys.requests, 1, keys.minute_expiry_ms),
                    (keys.tokens, signed(reserved.tokens), keys.minute_expiry_ms),
                    (keys.spend_day, signed(reserved.spend), keys.day_expiry_ms),
                    (
                        keys.spend_month,
                        signed(reserved.spend),
                        keys.month_expiry_ms,
                    ),
                ];
                for (key, delta, expire_at_ms) in counted {
                    if delta != 0 {
                        add_pending(&mut state.unsynced, key, delta, expire_at_ms);
                    }
                }
            }
        }
        Admission {
            decision,
            source: CounterSource::Local,
            ticket: admitted.then(|| Ticket {
                tenant: Arc::clone(&tenant.id),
                reserved,
                admitted_ms: now_ms,
                source: CounterSource::Local,
            }),
        }
    }

    /// Applies a settlement or refund to this replica's own counters.
    fn correct_locally(&self, tenant: &Arc<str>, correction: Correction, now_ms: u64) {
        let mut states = self.lock_tenants();
        let state = states.entry(Arc::clone(tenant)).or_default();
        let own = state
            .own
            .get_or_insert_with(|| WindowedCounters::new(now_ms));
        own.roll(now_ms);
        own.correct(
            correction.admitted_ms,
            correction.requests,
            correction.tokens,
            correction.spend,
        );
    }

    /// Keeps a settlement or refund in the last read of the cluster's counters, so the
    /// local shares after an outage start from it.
    fn note_correction(&self, tenant: &Arc<str>, correction: Correction) {
        let mut states = self.lock_tenants();
        if let Some(seen) = states.get_mut(tenant).and_then(|s| s.seen.as_mut()) {
            seen.correct(
                correction.admitted_ms,
                correction.requests,
                correction.tokens,
                correction.spend,
            );
        }
    }

    fn keep_unsynced(&self, tenant: &Arc<str>, updates: &[(String, Pending)]) {
        let mut states = self.lock_tenants();
        let state = states.entry(Arc::clone(tenant)).or_default();
        for (key, pending) in updates {
            add_pending(
                &mut state.unsynced,
                key.clone(),
                pending.delta,
                pending.expire_at_ms,
            );
        }
    }

    /// One heartbeat: say this replica is alive and count the replicas seen recently; if
    /// Redis lost its counters (or holds older ones), raise them to what this replica last
    /// read; hand Redis what was counted locally; only then (and, after a loss, once every
    /// replica had the time to do the same) do requests go to Redis again.
    async fn beat(&self) {
        let Some(redis) = self.redis.as_ref() else {
            return;
        };
        let now_ms = unix_ms(SystemTime::now());
        let (conn, replicas, epoch) =
            match tokio::time::timeout(BACKGROUND_TIMEOUT, self.announce(redis, now_ms)).await {
                Ok(Ok(answer)) => answer,
                Ok(Err(error)) => return redis.mark_down(&error),
                Err(_) => return redis.mark_down(&CounterError::Timeout(BACKGROUND_TIMEOUT)),
            };
        let (lost, waiting, former) = self.observe_epoch(redis, &epoch);
        // While the others have not beaten since Redis came back empty, fewer replicas are
        // registered than exist: keep the larger count for the local shares until then.
        let known = self.replicas.load(Ordering::Relaxed);
        let replicas = match waiting {
            true => replicas.max(known),
            false => replicas,
        };
        self.replicas.store(replicas.max(1), Ordering::Relaxed);
        if lost {
            let floors = self.last_read(&redis.prefix);
            if let Err(error) = bounded(redis.raise_all(&conn, &floors, &epoch.tag)).await {
                // Seen again as lost at the next beat: the epoch is not taken as known.
                return redis.mark_down(&error);
            }
            tracing::warn!(
                tenants = floors.len(),
                "redis lost or rolled back the tenant counters; re-seeded them from what this replica last read"
            );
        }
        if former {
            match bounded(self.carry_former(redis, &conn)).await {
                Ok(carried) => redis.lock_epoch().former = !carried,
                Err(error) => return redis.mark_down(&error),
            }
        }
        redis.lock_epoch().seen = Some(epoch.value);
        let reseeding = waiting.then_some(epoch.tag.as_str());
        if let Err(error) = self.flush(redis, &conn, now_ms, reseeding).await {
            return redis.mark_down(&error);
        }
        if waiting {
            return;
        }
        self.refresh_seen(redis, conn, self.clock.now_ms()).await;
        // A failed request may have dropped the connection this beat used: requests need one.
        if let Err(error) = bounded(redis.connection()).await {
            return redis.mark_down(&error);
        }
        if !redis.up.swap(true, Ordering::AcqRel) {
            tracing::info!(replicas, "tenant limits counted in redis");
        }
        crate::telemetry::tenant_limits_local(false);
    }

    /// Says this replica is alive, counts the replicas seen recently, and reads (or makes)
    /// the counters' epoch.
    async fn announce(
        &self,
        redis: &RedisCounters,
        now_ms: u64,
    ) -> Result<(Conn, u64, Epoch), CounterError> {
        let mut conn = redis.connection().await?;
        let key = replicas_key(&redis.prefix);
        let ttl_ms = u64::try_from(self.replica_ttl.as_millis()).unwrap_or(u64::MAX);
        let mut pipe = redis::pipe();
        pipe.zadd(&key, &self.replica_id, now_ms)
            .ignore()
            .cmd("ZREMRANGEBYSCORE")
            .arg(&key)
            .arg("-inf")
            .arg(now_ms.saturating_sub(ttl_ms))
            .ignore()
            .cmd("PEXPIRE")
            .arg(&key)
            .arg(ttl_ms.saturating_mul(2))
            .ignore()
            .zcard(&key);
        let (replicas,): (u64,) = pipe.query_async(&mut conn).await?;
        let masters = match conn.replication_ids().await {
            Ok(ids) => ids.join(" "),
            // A user that may not run INFO (an ACL without it): failovers then go unseen,
            // as before replication ids were compared, and an empty restart still is seen.
            Err(error) if !(error.is_io_error() || error.is_unrecoverable_error()) => {
                tracing::debug!(%error, "replication ids unreadable; only an emptied redis renews the counters' epoch");
                String::new()
            }
            Err(error) => return Err(error.into()),
        };
        let mut epoch = redis.epoch_script.key(epoch_key(&redis.prefix));
        let (value, redis_now_ms, renewed): (String, u64, u8) = epoch
            .arg(format!("{}-{now_ms}", self.replica_id))
            .arg(masters)
            .invoke_async(&mut conn)
            .await?;
        let created_ms = value
            .rsplit(':')
            .next()
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0);
        let epoch = Epoch {
            value,
            tag: created_ms.to_string(),
            created_ms,
            redis_now_ms,
            former: renewed == 2,
        };
        Ok((conn, replicas, epoch))
    }

    /// Compares the epoch with the one last seen: whether the counters were lost, whether
    /// requests wait out the re-seeding grace, and whether former-layout counters are still
    /// to be carried over.
    fn observe_epoch(&self, redis: &RedisCounters, epoch: &Epoch) -> (bool, bool, bool) {
        let mut state = redis.lock_epoch();
        let lost = state.seen.as_ref().is_some_and(|seen| *seen != epoch.value);
        let created_ms = epoch.created_ms;
        let grace = u64::try_from(self.reseed_grace.as_millis()).unwrap_or(u64::MAX);
        state.former |= epoch.former;
        state.waiting = (state.waiting || lost || state.former)
            && epoch.redis_now_ms < created_ms.saturating_add(grace);
        (lost, state.waiting, state.former)
    }

    /// Raises the followed tenants' counters to what the key layout before hash tags holds
    /// for the current windows, the way a lost Redis is re-seeded. Returns whether it could:
    /// the tenants are known only once the tenant store follows them.
    async fn carry_former(&self, redis: &RedisCounters, conn: &Conn) -> Result<bool, CounterError> {
        let Some(tenants) = self.followed_tenants() else {
            return Ok(false);
        };
        let windows = Windows::at(self.clock.now_ms());
        let former: Vec<CounterKeys> = tenants
            .iter()
            .map(|tenant| CounterKeys::former(&redis.prefix, tenant, windows))
            .collect();
        let read = super::usage::read_keys(&mut conn.clone(), &former).await?;
        let floors: Vec<Vec<(String, Pending)>> = tenants
            .iter()
            .zip(read)
            .map(|(tenant, counters)| {
                floors(&CounterKeys::new(&redis.prefix, tenant, windows), &counters)
            })
            .filter(|floors| !floors.is_empty())
            .collect();
        let tag = Windows::at(self.clock.now_ms()).minute_label();
        redis
            .raise_all(conn, &floors, &format!("former-{tag}"))
            .await?;
        if !floors.is_empty() {
            tracing::info!(
                tenants = floors.len(),
                "tenant counters carried over from the key layout before hash tags"
            );
        }
        Ok(true)
    }

    /// Hands Redis what was counted locally, one tenant (one cluster slot) at a time; what
    /// could not be delivered waits for the next beat. While the epoch `reseeding` is
    /// re-seeded, the counts go in beside its floors ([`FLUSH_SCRIPT`]).
    async fn flush(
        &self,
        redis: &RedisCounters,
        conn: &Conn,
        now_ms: u64,
        reseeding: Option<&str>,
    ) -> Result<(), CounterError> {
        let pending = self.take_unsynced(now_ms.max(self.clock.now_ms()));
        if pending.is_empty() {
            return Ok(());
        }
        let mut by_tenant: HashMap<Arc<str>, Vec<(String, Pending)>> = HashMap::new();
        for (tenant, key, p) in pending {
            by_tenant.entry(tenant).or_default().push((key, p));
        }
        let counters: usize = by_tenant.values().map(Vec::len).sum();
        let mut tenants = by_tenant.into_iter();
        while let Some((tenant, updates)) = tenants.next() {
            let delivered = match reseeding {
                Some(tag) => bounded(redis.flush_call(conn.clone(), &updates, tag)).await,
                None => bounded(redis.apply_call(conn.clone(), &updates)).await,
            };
            if let Err(error) = delivered {
                let undelivered = std::iter::once((tenant, updates)).chain(tenants);
                self.return_unsynced(undelivered.flat_map(|(tenant, updates)| {
                    updates
                        .into_iter()
                        .map(move |(key, p)| (Arc::clone(&tenant), key, p))
                }));
                return Err(error);
            }
        }
        tracing::info!(
            counters,
            "tenant usage counted during the redis outage is in redis"
        );
        Ok(())
    }

    fn followed_tenants(&self) -> Option<Vec<Arc<str>>> {
        self.followed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|list| list())
    }

    /// The cluster's counters as this replica last read them, in the windows it read them
    /// in, as floors for a Redis that lost them: one list per tenant.
    fn last_read(&self, prefix: &str) -> Vec<Vec<(String, Pending)>> {
        let states = self.lock_tenants();
        states
            .iter()
            .filter_map(|(tenant, state)| {
                let WindowedCounters { windows, counters } = state.seen?;
                let floors = floors(&CounterKeys::new(prefix, tenant, windows), &counters);
                (!floors.is_empty()).then_some(floors)
            })
            .collect()
    }

    /// Reads the followed tenants' counters into this replica's last read of them.
    async fn refresh_seen(&self, redis: &RedisCounters, mut conn: Conn, now_ms: u64) {
        let Some(tenants) = self.followed_tenants() else {
            return;
        };
        if tenants.is_empty() {
            return;
        }
        let ids: Vec<&str> = tenants.iter().map(|t| &**t).collect();
        let read = super::usage::read_counters(&mut conn, &redis.prefix, &ids, now_ms);
        let Ok(Ok(counters)) = tokio::time::timeout(BACKGROUND_TIMEOUT, read).await else {
            return;
        };
        let windows = Windows::at(now_ms);
        let mut states = self.lock_tenants();
        for (tenant, read) in tenants.into_iter().zip(counters) {
            let state = states.entry(tenant).or_default();
            // A decision since the read may have seen more: keep the larger of the two.
            let merged = match state.seen.map(|s| s.at(now_ms)) {
                Some(seen) => Counters {
                    requests: seen.requests.max(read.requests),
                    tokens: seen.tokens.max(read.tokens),
                    spend_day: seen.spend_day.max(read.spend_day),
                    spend_month: seen.spend_month.max(read.spend_month),
                },
                None => read,
            };
            state.seen = Some(WindowedCounters {
                windows,
                counters: merged,
            });
        }
        self.refreshes.fetch_add(1, Ordering::Relaxed);
    }

    /// Every tenant's unsynced amounts whose windows are not over, taken out.
    fn take_unsynced(&self, now_ms: u64) -> Vec<(Arc<str>, String, Pending)> {
        let mut states = self.lock_tenants();
        let mut taken = Vec::new();
        for (tenant, state) in states.iter_mut() {
            for (key, pending) in state.unsynced.drain() {
                if pending.expire_at_ms > now_ms && pending.delta != 0 {
                    taken.push((Arc::clone(tenant), key, pending));
                }
            }
        }
        taken
    }

    /// Puts back amounts a flush could not deliver, for the next one.
    fn return_unsynced(&self, pending: impl IntoIterator<Item = (Arc<str>, String, Pending)>) {
        let mut states = self.lock_tenants();
        for (tenant, key, p) in pending {
            let state = states.entry(tenant).or_default();
            add_pending(&mut state.unsynced, key, p.delta, p.expire_at_ms);
        }
    }
}

/// The counters' epoch as a heartbeat read it.
#[derive(Debug)]
struct Epoch {
    value: String,
    /// Names its floor keys (`<counter>:floor:<tag>`): the time it was made.
    tag: String,
    created_ms: u64,
    redis_now_ms: u64,
    /// It replaced an epoch of the key layout before hash tags.
    former: bool,
}

/// `counters` as floors of `keys`' counters, with each one's expiry (zeros left out).
fn floors(keys: &CounterKeys, counters: &Counters) -> Vec<(String, Pending)> {
    let signed = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    [
        (&keys.requests, counters.requests, keys.minute_expiry_ms),
        (&keys.tokens, counters.tokens, keys.minute_expiry_ms),
        (&keys.spend_day, counters.spend_day, keys.day_expiry_ms),
        (
            &keys.spend_month,
            counters.spend_month,
            keys.month_expiry_ms,
        ),
    ]
    .into_iter()
    .filter(|(_, value, _)| *value > 0)
    .map(|(key, value, expire_at_ms)| {
        let floor = Pending {
            delta: signed(value),
            expire_at_ms,
        };
        (key.clone(), floor)
    })
    .collect()
}

/// A background call within [`BACKGROUND_TIMEOUT`].
async fn bounded<T>(
    call: impl std::future::Future<Output = Result<T, CounterError>>,
) -> Result<T, CounterError> {
    tokio::time::timeout(BACKGROUND_TIMEOUT, call)
        .await
        .unwrap_or(Err(CounterError::Timeout(BACKGROUND_TIMEOUT)))
}

fn add_pending(
    unsynced: &mut HashMap<String, Pending>,
    key: String,
    delta: i64,
    expire_at_ms: u64,
) {
    let entry = unsynced.entry(key).or_insert(Pending {
        delta: 0,
        expire_at_ms,
    });
    entry.delta = entry.delta.saturating_add(delta);
}

// === impl RedisCounters ===

impl RedisCounters {
    fn connection_if_up(&self) -> Option<Conn> {
        if !self.up.load(Ordering::Acquire) {
            return None;
        }
        self.link.current()
    }

    /// The open connection, or a new one (with Sentinel, to the master of the moment).
    async fn connection(&self) -> Result<Conn, CounterError> {
        let mut conn = self.link.get().await?;
        // Loaded now, a script costs requests one round trip even right after a restart of
        // Redis (otherwise the first call finds it missing and loads it on the way).
        if self.loaded.load(Ordering::Relaxed) != conn.id() {
            let scripts = [
                &self.admit,
                &self.apply,
                &self.raise,
                &self.flush,
                &self.epoch_script,
            ];
            for script in scripts {
                script.load_async(&mut conn).await?;
            }
            self.loaded.store(conn.id(), Ordering::Relaxed);
        }
        Ok(conn)
    }

    fn lock_epoch(&self) -> std::sync::MutexGuard<'_, EpochState> {
        self.epoch.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sends requests local until the heartbeat has Redis back.
    fn mark_down(&self, error: &CounterError) {
        self.link.reset();
        crate::telemetry::tenant_limits_local(true);
        if self.up.swap(false, Ordering::AcqRel) {
            tracing::warn!(%error, "tenant counters in redis out of reach; deciding on local shares of the limits");
        }
    }

    /// Raises counters to floors, one tenant (one cluster slot) per script.
    async fn raise_all(
        &self,
        conn: &Conn,
        floors: &[Vec<(String, Pending)>],
        tag: &str,
    ) -> Result<(), CounterError> {
        for tenant in floors {
            self.raise_call(conn.clone(), tenant, tag).await?;
        }
        Ok(())
    }

    async fn admit_call(
        &self,
        mut conn: Conn,
        tenant: &ActiveTenant,
        reserved: Reservation,
        now_ms: u64,
    ) -> Result<Counters, CounterError> {
        let keys = CounterKeys::new(&self.prefix, &tenant.id, Windows::at(now_ms));
        let limit = |l: Option<u64>| l.map_or(-1, |l| i64::try_from(l).unwrap_or(i64::MAX));
        let quota = &tenant.quota;
        let mut invocation = self.admit.prepare_invoke();
        for key in keys.all() {
            invocation.key(key);
        }
        invocation
            .arg(limit(quota.requests_per_minute))
            .arg(limit(quota.tokens_per_minute))
            .arg(limit(quota.budget_per_day))
            .arg(limit(quota.budget_per_month))
            .arg(reserved.tokens)
            .arg(keys.minute_expiry_ms)
            .arg(reserved.spend)
            .arg(keys.day_expiry_ms)
            .arg(keys.month_expiry_ms);
        let (_refused, requests, tokens, spend_day, spend_month): (i64, u64, u64, u64, u64) =
            invocation.invoke_async(&mut conn).await?;
        Ok(Counters {
            requests,
            tokens,
            spend_day,
            spend_month,
        })
    }

    async fn raise_call(
        &self,
        conn: Conn,
        floors: &[(String, Pending)],
        tag: &str,
    ) -> Result<(), CounterError> {
        self.with_floors(&self.raise, conn, floors, tag).await
    }

    async fn flush_call(
        &self,
        conn: Conn,
        updates: &[(String, Pending)],
        tag: &str,
    ) -> Result<(), CounterError> {
        self.with_floors(&self.flush, conn, updates, tag).await
    }

    /// `script` on each counter and its floor key of the epoch `tag`, with the counter's
    /// amount and expiry.
    async fn with_floors(
        &self,
        script: &redis::Script,
        mut conn: Conn,
        counters: &[(String, Pending)],
        tag: &str,
    ) -> Result<(), CounterError> {
        if counters.is_empty() {
            return Ok(());
        }
        let mut invocation = script.prepare_invoke();
        for (key, amount) in counters {
            invocation
                .key(key)
                .key(format!("{key}:floor:{tag}"))
                .arg(amount.delta)
                .arg(amount.expire_at_ms);
        }
        let _: i64 = invocation.invoke_async(&mut conn).await?;
        Ok(())
    }

    async fn apply_call(
        &self,
        mut conn: Conn,
        updates: &[(String, Pending)],
    ) -> Result<(), CounterError> {
        if updates.is_empty() {
            return Ok(());
        }
        let mut invocation = self.apply.prepare_invoke();
        for (key, pending) in updates {
            invocation
                .key(key)
                .arg(pending.delta)
                .arg(pending.expire_at_ms);
        }
        let _: i64 = invocation.invoke_async(&mut conn).await?;
        Ok(())
    }
}

/// Unix milliseconds of a time (0 before the epoch).
pub fn unix_ms(time: SystemTime) -> u64 {
    time.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests;
