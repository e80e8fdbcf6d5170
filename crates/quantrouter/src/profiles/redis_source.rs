//! Hot reload from Redis: read `<prefix>:profiles`, SUBSCRIBE to `<prefix>:profiles:updates`,
//! and poll the document as a safety net for missed messages. Reconnects with capped
//! exponential backoff and jitter; requests never wait on Redis, and the last good set stays
//! in force while Redis is down or holds bad data.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use futures_util::StreamExt;
use tokio::task::JoinHandle;

use super::redis_store::{RedisStore, StoreError};
use quantrouter_policy::{ProfileSet, ProfileSetError};

use super::{ProfileSource, ProfileStore, ReloadError, SourceKind};
use crate::resilience::{Backoff, Schedule};
use crate::telemetry::{self, ReloadResult};

/// Reconnect waits: a first ceiling of 100 ms does not hammer a restarting Redis; at most
/// 5 s, so an outage is recovered from within seconds.
const BACKOFF: Backoff = Backoff {
    base: Duration::from_millis(100),
    cap: Duration::from_secs(5),
    retry_after_cap: Duration::ZERO,
};

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

/// How long start-up waits for Redis before starting on the file or embedded set; the
/// source keeps trying in the background and takes over when Redis answers.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(1);

/// `--redis-url`: the document in `<prefix>:profiles` (or a seed-format list).
#[derive(Debug, Clone)]
pub struct RedisSource {
    pub client: redis::Client,
    pub config: RedisSourceConfig,
}

impl ProfileSource for RedisSource {
    fn load(&self) -> BoxFuture<'_, Result<Option<(ProfileSet, SourceKind)>, ReloadError>> {
        Box::pin(async {
            match tokio::time::timeout(STARTUP_TIMEOUT, self.fetch()).await {
                Ok(Ok(found)) => Ok(found),
                Ok(Err(error)) => {
                    tracing::warn!(%error, "redis unreachable at start-up; starting without it");
                    Ok(None)
                }
                Err(_) => {
                    tracing::warn!(timeout = ?STARTUP_TIMEOUT, "redis did not answer at start-up; starting without it");
                    Ok(None)
                }
            }
        })
    }

    fn follow(self: Arc<Self>, store: Arc<ProfileStore>) -> Option<JoinHandle<()>> {
        Some(spawn(store, self.client.clone(), self.config.clone()))
    }
}

impl RedisSource {
    /// The valid document Redis holds now, if any; an invalid one is logged and counted.
    async fn fetch(&self) -> Result<Option<(ProfileSet, SourceKind)>, StoreError> {
        let redis = RedisStore::connect(&self.client, &self.config.prefix).await?;
        let (parsed, kind) = match document(redis.active_raw().await)? {
            Some(Ok(text)) => (ProfileSet::from_json(&text), SourceKind::Redis),
            Some(Err(unreadable)) => (Err(unreadable), SourceKind::Redis),
            None => match document(redis.raw(SEED_KEY).await)? {
                Some(Ok(text)) => (
                    quantrouter_policy::from_seed_list(&text, &self.config.seed_endpoints, 1),
                    SourceKind::RedisSeed,
                ),
                Some(Err(unreadable)) => (Err(unreadable), SourceKind::RedisSeed),
                None => return Ok(None),
            },
        };
        match parsed {
            Ok(set) => Ok(Some((set, kind))),
            Err(error) => {
                tracing::warn!(%error, source = ?kind, "profile set in redis rejected at start-up");
                telemetry::profile_reload("redis", ReloadResult::Rejected);
                Ok(None)
            }
        }
    }
}

/// Runs the Redis source until the task is aborted.
pub fn spawn(
    store: Arc<ProfileStore>,
    client: redis::Client,
    config: RedisSourceConfig,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut backoff = BACKOFF.schedule();
        let mut seen = Seen::default();
        loop {
            let result = session(&store, &client, &config, &mut backoff, &mut seen).await;
            if let Err(error) = result {
                tracing::warn!(%error, "redis profile source disconnected; keeping the active set");
            }
            tokio::time::sleep(backoff.next_delay()).await;
        }
    })
}

/// One connected period: subscribe, apply the current document, then follow updates.
async fn session(
    store: &ProfileStore,
    client: &redis::Client,
    config: &RedisSourceConfig,
    backoff: &mut Schedule,
    seen: &mut Seen,
) -> Result<(), StoreError> {
    let redis = RedisStore::connect(client, &config.prefix).await?;
    let mut pubsub = client.get_async_pubsub().await?;
    pubsub.subscribe(&redis.keys().channel).await?;
    tracing::info!(channel = %redis.keys().channel, "redis profile source connected");
    refresh(store, &redis, config, seen).await?;
    // Only a session that got as far as reading the document resets the backoff: one that
    // fails right after connecting must not reconnect at the starting delay forever.
    backoff.reset();
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
        refresh(store, &redis, config, seen).await?;
    }
}

/// Texts already handled, so an unchanged document is not re-parsed (and a bad one not
/// re-counted) on every poll.
#[derive(Debug, Default)]
struct Seen {
    /// The last `<prefix>:profiles` text that was rejected.
    rejected: Option<String>,
    /// The last seed-format list handled, applied or not.
    seed: Option<String>,
}

/// Applies the stored document if it is new, else the seed-format list if there is one.
async fn refresh(
    store: &ProfileStore,
    redis: &RedisStore,
    config: &RedisSourceConfig,
    seen: &mut Seen,
) -> Result<(), StoreError> {
    let text = match document(redis.active_raw().await)? {
        None => return refresh_seed(store, redis, config, seen).await,
        Some(Ok(text)) => text,
        Some(Err(unreadable)) => {
            let marker = unreadable.to_string();
            if seen.rejected.as_deref() != Some(marker.as_str()) {
                apply(store, Err(unreadable), SourceKind::Redis);
                seen.rejected = Some(marker);
            }
            return Ok(());
        }
    };
    let active = store.load();
    let unchanged =
        active.source == SourceKind::Redis && stored_version(&text) == Some(active.set.version);
    if unchanged || seen.rejected.as_deref() == Some(text.as_str()) {
        return Ok(());
    }
    let applied = apply(store, ProfileSet::from_json(&text), SourceKind::Redis);
    seen.rejected = (!applied).then_some(text);
    Ok(())
}

/// The seed-format list, converted with the configured endpoints. It carries no version, so
/// a changed list is applied as the next version.
async fn refresh_seed(
    store: &ProfileStore,
    redis: &RedisStore,
    config: &RedisSourceConfig,
    seen: &mut Seen,
) -> Result<(), StoreError> {
    let text = match document(redis.raw(SEED_KEY).await)? {
        None => return Ok(()),
        Some(Ok(text)) => text,
        Some(Err(unreadable)) => {
            let marker = unreadable.to_string();
            if seen.seed.as_deref() != Some(marker.as_str()) {
                apply(store, Err(unreadable), SourceKind::RedisSeed);
                seen.seed = Some(marker);
            }
            return Ok(());
        }
    };
    if seen.seed.as_deref() == Some(text.as_str()) {
        return Ok(());
    }
    let active = store.load();
    let version = match active.source {
        // Past the version bound the list is refused by validation, not wrapped.
        SourceKind::RedisSeed => active.set.version.saturating_add(1),
        _ => 1,
    };
    let set = quantrouter_policy::from_seed_list(&text, &config.seed_endpoints, version);
    apply(store, set, SourceKind::RedisSeed);
    seen.seed = Some(text);
    Ok(())
}

/// Swaps in a parsed document, or keeps the active set; logs and counts either way.
fn apply(
    store: &ProfileStore,
    parsed: Result<ProfileSet, ProfileSetError>,
    source: SourceKind,
) -> bool {
    let result = parsed
        .map_err(ReloadError::from)
        .and_then(|set| store.apply(set, source, false));
    match &result {
        Ok(()) => {
            tracing::info!(
                version = store.load().set.version,
                ?source,
                "profile set applied from redis"
            )
        }
        Err(error) => {
            tracing::warn!(%error, ?source, "profile set in redis rejected; keeping the active set")
        }
    }
    let counted = match &result {
        Ok(()) => ReloadResult::Applied,
        Err(ReloadError::Outranked { .. }) => ReloadResult::Ignored,
        Err(_) => ReloadResult::Rejected,
    };
    telemetry::profile_reload("redis", counted);
    result.is_ok()
}

/// A key's text (`Some(Ok)`), or why it cannot be a document (`Some(Err)`, a rejected
/// document); connection failures stay errors.
fn document(
    read: Result<Option<String>, StoreError>,
) -> Result<Option<Result<String, ProfileSetError>>, StoreError> {
    match read {
        Ok(text) => Ok(text.map(Ok)),
        Err(error @ StoreError::NotADocument { .. }) => Ok(Some(Err(ProfileSetError::Parse {
            path: "$".into(),
            message: error.to_string(),
        }))),
        Err(error) => Err(error),
    }
}

fn stored_version(text: &str) -> Option<u64> {
    serde_json::from_str::<serde_json::Value>(text).ok()?["version"].as_u64()
}
