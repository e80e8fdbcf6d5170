//! Cluster-wide tier numbers through Redis. Every replica writes its share of each tier
//! once a second to `<prefix>:keda:<tier>:<replica>` with a short TTL (`SET … PX`), so a
//! replica that dies drops out within seconds; any replica reads the others' shares with
//! SCAN (of every master, in a Redis Cluster) + MGET to answer for the cluster.
//!
//! Requests never wait on any of this: publishing runs in its own task, reading happens
//! only when KEDA asks, every Redis call is bounded by a timeout, and an outage costs the
//! cluster view (answers fall back to this replica's own numbers), never a request.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{local_shares, KedaConfig, TierShare};
use crate::profiles::ProfileStore;
use crate::redis_conn::{Conn, Link, Redis};
use crate::resilience::backoff::Backoff;
use crate::telemetry;

/// A publish or a cleanup never waits longer than this (the profile store's bound).
const CALL_TIMEOUT: Duration = Duration::from_secs(3);
/// Longest wait between publish attempts while Redis is down: the TTL, so a recovered
/// Redis has this replica's numbers again about as fast as a dead replica's expire.
const BACKOFF_CAP: Duration = Duration::from_secs(5);
/// Keys per SCAN step: big enough that a dedicated Redis answers in one or two round trips.
const SCAN_COUNT: u64 = 1000;

/// The Redis that replicas share their numbers through.
#[derive(Debug, Clone)]
pub struct RedisTarget {
    pub redis: Redis,
    /// Key prefix, the same as the profile keys' (`--redis-prefix`).
    pub prefix: String,
}

/// Publishes this replica's share of every tier until stopped.
#[derive(Debug)]
pub struct Publisher {
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

/// Reads the other replicas' shares.
#[derive(Debug)]
pub struct ClusterReader {
    redis: Connection,
    prefix: String,
    replica_id: String,
}

/// Why a Redis exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum KedaRedisError {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
    #[error("encoding a tier share: {0}")]
    Encode(#[from] serde_json::Error),
}

/// What one replica writes for one tier.
#[derive(Debug, Serialize, Deserialize)]
struct Record {
    tier: String,
    replica: String,
    #[serde(flatten)]
    share: TierShare,
}

/// One connection, made on first use and again after any failure.
#[derive(Debug)]
struct Connection {
    link: Link,
}

/// `<prefix>:keda:<tier>:<replica>`.
pub fn key(prefix: &str, tier: &str, replica: &str) -> String {
    format!("{prefix}:keda:{tier}:{replica}")
}

// === impl Publisher ===

impl Publisher {
    /// Starts publishing the shares of `store`'s active snapshot.
    pub fn start(store: Arc<ProfileStore>, target: RedisTarget, config: &KedaConfig) -> Self {
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(run(
            store,
            target,
            config.replica_id.clone(),
            config.publish_interval,
            config.ttl,
            stopped,
        ));
        Self { stop, task }
    }

    /// Stops and removes this replica's keys, so it drops out of the sums at once (call it
    /// after in-flight requests have drained: until then they are still load).
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        let mut task = self.task;
        if tokio::time::timeout(CALL_TIMEOUT * 2, &mut task)
            .await
            .is_err()
        {
            task.abort();
        }
    }

    /// Stops at once and leaves the keys to expire, as a crashed replica would.
    pub fn abort(&self) {
        self.task.abort();
    }
}

async fn run(
    store: Arc<ProfileStore>,
    target: RedisTarget,
    replica: String,
    interval: Duration,
    ttl: Duration,
    mut stopped: watch::Receiver<bool>,
) {
    let redis = Connection::new(target.redis);
    let mut backoff = Backoff {
        base: interval,
        cap: BACKOFF_CAP,
        retry_after_cap: Duration::ZERO,
    }
    .schedule();
    let mut published: Vec<String> = Vec::new();
    loop {
        let result = publish(&redis, &store, &target.prefix, &replica, ttl, &published).await;
        let wait = match result {
            Ok(keys) => {
                if backoff.retries() > 0 {
                    tracing::info!("redis is back: publishing tier numbers again");
                }
                published = keys;
                backoff.reset();
                telemetry::redis_up(true);
                interval
            }
            Err(error) => {
                let failures = backoff.retries();
                if failures == 0 {
                    tracing::warn!(%error, "publishing tier numbers to redis failed; KEDA sees this replica's numbers only until it is back");
                } else {
                    tracing::debug!(%error, failures, "publishing tier numbers to redis failed again");
                }
                telemetry::redis_up(false);
                backoff.next_delay().max(interval / 2)
            }
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            // Stopped, or the handle dropped: either way, done.
            _ = stopped.changed() => break,
        }
    }
    if !published.is_empty() {
        let removed = redis
            .run(CALL_TIMEOUT, |conn| async move {
                // One command per key: a cluster keeps them in different slots.
                each(
                    conn,
                    published.iter().map(|key| {
                        let mut del = redis::cmd("DEL");
                        del.arg(key);
                        del
                    }),
                )
                .await
            })
            .await;
        if let Err(error) = removed {
            tracing::debug!(%error, "removing this replica's tier numbers failed; they expire");
        }
    }
}

/// Writes every tier's share in one pipeline and deletes keys of tiers no longer in the
/// profile set; returns the keys written.
async fn publish(
    redis: &Connection,
    store: &ProfileStore,
    prefix: &str,
    replica: &str,
    ttl: Duration,
    previous: &[String],
) -> Result<Vec<String>, KedaRedisError> {
    let shares = local_shares(&store.load(), Instant::now());
    let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
    let mut commands = Vec::with_capacity(shares.len());
    let mut keys = Vec::with_capacity(shares.len());
    for (tier, share) in shares {
        let key = key(prefix, &tier, replica);
        let record = Record {
            tier,
            replica: replica.to_owned(),
            share,
        };
        let mut set = redis::cmd("SET");
        set.arg(&key)
            .arg(serde_json::to_string(&record)?)
            .arg("PX")
            .arg(ttl_ms);
        commands.push(set);
        keys.push(key);
    }
    for gone in previous.iter().filter(|k| !keys.contains(k)) {
        let mut del = redis::cmd("DEL");
        del.arg(gone);
        commands.push(del);
    }
    // One command per key, sent together: a cluster keeps the keys in different slots, and
    // a connection pipelines concurrent commands anyway.
    redis.run(CALL_TIMEOUT, |conn| each(conn, commands)).await?;
    Ok(keys)
}

/// Runs `commands` at once on `conn`; the first error fails the lot.
async fn each(
    conn: Conn,
    commands: impl IntoIterator<Item = redis::Cmd>,
) -> Result<(), redis::RedisError> {
    let calls = commands.into_iter().map(|cmd| {
        let mut conn = conn.clone();
        async move { cmd.query_async::<()>(&mut conn).await }
    });
    futures_util::future::try_join_all(calls).await.map(drop)
}

// === impl ClusterReader ===

impl ClusterReader {
    pub fn new(target: RedisTarget, replica_id: String) -> Self {
        Self {
            redis: Connection::new(target.redis),
            prefix: target.prefix,
            replica_id,
        }
    }

    /// The live shares of `tier` from every other replica, or `None` when Redis did not
    /// answer within `timeout`.
    pub async fn others(&self, tier: &str, timeout: Duration) -> Option<Vec<TierShare>> {
        let pattern = key(&self.prefix, &glob_escape(tier), "*");
        let values = self
            .redis
            .run(timeout, |mut conn| async move {
                let keys: std::collections::BTreeSet<String> =
                    conn.scan(&pattern, SCAN_COUNT).await?.into_iter().collect();
                if keys.is_empty() {
                    return Ok(Vec::new());
                }
                redis::cmd("MGET")
                    .arg(keys.into_iter().collect::<Vec<_>>())
                    .query_async::<Vec<Option<String>>>(&mut conn)
                    .await
            })
            .await;
        let values = match values {
            Ok(values) => values,
            Err(error) => {
                tracing::debug!(%error, tier, "reading other replicas' numbers failed; answering with this replica's");
                return None;
            }
        };
        // A key may have expired between SCAN and MGET, and a tier name with `:` could
        // match another tier's keys: trust the record, not the key.
        let mut by_replica = BTreeMap::new();
        for value in values.into_iter().flatten() {
            match serde_json::from_str::<Record>(&value) {
                Ok(r) if r.tier == tier && r.replica != self.replica_id => {
                    by_replica.insert(r.replica, r.share);
                }
                Ok(_) => {}
                Err(error) => tracing::debug!(%error, "ignoring a malformed tier record"),
            }
        }
        Some(by_replica.into_values().collect())
    }
}

/// `text` matched literally by a Redis glob pattern.
fn glob_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

// === impl Connection ===

impl Connection {
    fn new(redis: Redis) -> Self {
        Self {
            link: Link::new(redis),
        }
    }

    /// Runs `call` on the connection (connecting first if needed) within `timeout`; any
    /// failure drops the connection so the next call starts afresh.
    async fn run<T, F, Fut>(&self, timeout: Duration, call: F) -> Result<T, KedaRedisError>
    where
        F: FnOnce(Conn) -> Fut,
        Fut: Future<Output = Result<T, redis::RedisError>>,
    {
        let attempt = async {
            let conn = self.link.get().await?;
            call(conn).await
        };
        let result = match tokio::time::timeout(timeout, attempt).await {
            Ok(Ok(value)) => return Ok(value),
            Ok(Err(error)) => KedaRedisError::Redis(error),
            Err(_) => KedaRedisError::Timeout(timeout),
        };
        self.link.reset();
        Err(result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glob_characters_in_tier_names_match_literally() {
        assert_eq!(glob_escape("int4"), "int4");
        assert_eq!(glob_escape("a*b?[c]"), "a\\*b\\?\\[c\\]");
    }

    #[test]
    fn a_record_is_flat_json() {
        let record = Record {
            tier: "int4".into(),
            replica: "pod-a".into(),
            share: TierShare {
                admission_waiting: 1,
                inflight: 2,
                endpoints: BTreeMap::new(),
            },
        };
        let json = serde_json::to_value(&record).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"tier": "int4", "replica": "pod-a", "admission_waiting": 1,
                "inflight": 2, "endpoints": {}})
        );
    }
}
