//! Hot reload from Redis: read `<prefix>:profiles`, SUBSCRIBE to `<prefix>:profiles:updates`,
//! and poll the document as a safety net for missed messages. Reconnects with capped
//! exponential backoff and jitter; requests never wait on Redis, and the last good set stays
//! in force while Redis is down or holds bad data.

use std::collections::BTreeMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::task::JoinHandle;

use super::redis_store::{RedisStore, StoreError};
use super::{ProfileStore, SourceKind};
use crate::telemetry;

/// First reconnect delay: long enough not to hammer a restarting Redis.
const BACKOFF_START: Duration = Duration::from_millis(100);
/// Longest reconnect delay: an outage is noticed and recovered within seconds.
const BACKOFF_CAP: Duration = Duration::from_secs(5);

/// The seed write-ups' key: a plain JSON list of profiles, used when `<prefix>:profiles` is
/// absent.
pub const SEED_KEY: &str = "model_profiles:active";

/// What the source follows.
#[derive(Debug, Clone)]
pub struct RedisSourceConfig {
    pub prefix: String,
    /// Re-read interval, the safety net for missed update messages.
    pub poll: Duration,
    /// Endpoints for seed-format lists: model id → base URL.
    pub seed_endpoints: BTreeMap<String, String>,
}

/// Runs the Redis source until the task is aborted.
pub fn spawn(
    store: Arc<ProfileStore>,
    client: redis::Client,
    config: RedisSourceConfig,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut delay = BACKOFF_START;
        let mut last_rejected = None;
        loop {
            let result = session(&store, &client, &config, &mut delay, &mut last_rejected).await;
            if let Err(error) = result {
                tracing::warn!(%error, "redis profile source disconnected; keeping the active set");
            }
            tokio::time::sleep(jitter(delay)).await;
            delay = (delay * 2).min(BACKOFF_CAP);
        }
    })
}

/// One connected period: subscribe, apply the current document, then follow updates.
async fn session(
    store: &ProfileStore,
    client: &redis::Client,
    config: &RedisSourceConfig,
    delay: &mut Duration,
    last_rejected: &mut Option<String>,
) -> Result<(), StoreError> {
    let redis = RedisStore::connect(client, &config.prefix).await?;
    let mut pubsub = client.get_async_pubsub().await?;
    pubsub.subscribe(&redis.keys().channel).await?;
    *delay = BACKOFF_START;
    tracing::info!(channel = %redis.keys().channel, "redis profile source connected");
    refresh(store, &redis, config, last_rejected).await?;
    let mut messages = pubsub.on_message();
    let mut ticker = tokio::time::interval(config.poll);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            message = messages.next() => {
                if message.is_none() {
                    return Ok(());
                }
            }
            _ = ticker.tick() => {}
        }
        refresh(store, &redis, config, last_rejected).await?;
    }
}

/// Applies the stored document if it is new; rejects it (once per distinct text) if invalid.
async fn refresh(
    store: &ProfileStore,
    redis: &RedisStore,
    config: &RedisSourceConfig,
    last_rejected: &mut Option<String>,
) -> Result<(), StoreError> {
    let Some(text) = redis.active_raw().await? else {
        return refresh_seed(store, redis, config, last_rejected).await;
    };
    let active = store.load();
    if active.source == SourceKind::Redis && stored_version(&text) == Some(active.set.version) {
        return Ok(());
    }
    if last_rejected.as_deref() == Some(text.as_str()) {
        return Ok(());
    }
    let result = quantrouter_policy::ProfileSet::from_json(&text)
        .map_err(super::ReloadError::from)
        .and_then(|set| store.apply(set, SourceKind::Redis, false));
    match &result {
        Ok(()) => {
            tracing::info!(
                version = store.load().set.version,
                "profile set applied from redis"
            );
            *last_rejected = None;
        }
        Err(error) => {
            tracing::warn!(%error, "profile set in redis rejected; keeping the active set");
            *last_rejected = Some(text);
        }
    }
    telemetry::profile_reload("redis", result.is_ok());
    Ok(())
}

/// The seed-format list, converted with the configured endpoints. It carries no version, so
/// a changed list is applied as the next version.
async fn refresh_seed(
    store: &ProfileStore,
    redis: &RedisStore,
    config: &RedisSourceConfig,
    last_seen: &mut Option<String>,
) -> Result<(), StoreError> {
    let Some(text) = redis.raw(SEED_KEY).await? else {
        return Ok(());
    };
    if last_seen.as_deref() == Some(text.as_str()) {
        return Ok(());
    }
    let active = store.load();
    let version = if active.source == SourceKind::RedisSeed {
        active.set.version + 1
    } else {
        1
    };
    let result = quantrouter_policy::from_seed_list(&text, &config.seed_endpoints, version)
        .map_err(super::ReloadError::from)
        .and_then(|set| store.apply(set, SourceKind::RedisSeed, false));
    match &result {
        Ok(()) => tracing::info!(
            key = SEED_KEY,
            version,
            "seed-format profile list applied from redis"
        ),
        Err(error) => tracing::warn!(key = SEED_KEY, %error, "seed-format profile list rejected"),
    }
    telemetry::profile_reload("redis", result.is_ok());
    *last_seen = Some(text);
    Ok(())
}

fn stored_version(text: &str) -> Option<u64> {
    serde_json::from_str::<serde_json::Value>(text).ok()?["version"].as_u64()
}

/// Full jitter: a uniform delay in [delay/2, delay], so replicas do not reconnect in step.
fn jitter(delay: Duration) -> Duration {
    let random = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    let half = delay / 2;
    half + Duration::from_nanos(random % (half.as_nanos() as u64 + 1))
}
