//! Hot reload from Redis: `<prefix>:{profiles}` (or a seed-format list), followed through its
//! update channel and polled ([`crate::documents::follow`]). The last good set stays in force
//! while Redis is down or holds bad data.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::task::JoinHandle;

use quantrouter_policy::{ProfileSet, ProfileSetError};

use super::{ProfileSource, ProfileStore, ReloadError, SourceKind};
use crate::documents::follow::{self, document, stored_version, Follower};
use crate::documents::{RedisStore, StoreError};
use crate::redis_conn::Redis;
use crate::telemetry::{self, ReloadResult};

/// The seed write-ups' key: a plain JSON list of profiles, used when `<prefix>:{profiles}`
/// is absent.
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

/// `--redis-url`: the document in `<prefix>:{profiles}` (or a seed-format list).
#[derive(Debug, Clone)]
pub struct RedisSource {
    pub redis: Redis,
    pub config: RedisSourceConfig,
}

impl ProfileSource for RedisSource {
    fn load(&self) -> BoxFuture<'_, Result<Option<(ProfileSet, SourceKind)>, ReloadError>> {
        Box::pin(async {
            match tokio::time::timeout(STARTUP_TIMEOUT, self.fetch()).await {
                Ok(Ok(found)) => Ok(found),
                Ok(Err(error)) => {
                    tracing::warn!(%error, redis = %self.redis.url(), "redis unreachable at start-up; starting without it");
                    Ok(None)
                }
                Err(_) => {
                    tracing::warn!(timeout = ?STARTUP_TIMEOUT, redis = %self.redis.url(), "redis did not answer at start-up; starting without it");
                    Ok(None)
                }
            }
        })
    }

    fn follow(self: Arc<Self>, store: Arc<ProfileStore>) -> Option<JoinHandle<()>> {
        Some(spawn(store, self.redis.clone(), self.config.clone()))
    }
}

/// Applies the profile documents Redis holds to a store.
struct ProfileFollower {
    store: Arc<ProfileStore>,
    config: RedisSourceConfig,
    seen: Seen,
}

impl Follower for ProfileFollower {
    type Doc = ProfileSet;
    const WHAT: &'static str = "profile set";

    fn refresh<'a>(
        &'a mut self,
        redis: &'a RedisStore<ProfileSet>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(refresh(&self.store, redis, &self.config, &mut self.seen))
    }
}

impl RedisSource {
    /// The valid document Redis holds now, if any; an invalid one is logged and counted.
    async fn fetch(&self) -> Result<Option<(ProfileSet, SourceKind)>, StoreError> {
        let redis = RedisStore::<ProfileSet>::connect(&self.redis, &self.config.prefix).await?;
        let (parsed, kind) = match document(redis.active_raw().await)? {
            Some(Ok(text)) => (ProfileSet::from_json(&text), SourceKind::Redis),
            Some(Err(unreadable)) => (Err(not_a_document(unreadable)), SourceKind::Redis),
            None => match document(redis.raw(SEED_KEY).await)? {
                Some(Ok(text)) => (
                    quantrouter_policy::from_seed_list(&text, &self.config.seed_endpoints, 1),
                    SourceKind::RedisSeed,
                ),
                Some(Err(unreadable)) => (Err(not_a_document(unreadable)), SourceKind::RedisSeed),
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
pub fn spawn(store: Arc<ProfileStore>, redis: Redis, config: RedisSourceConfig) -> JoinHandle<()> {
    let prefix = config.prefix.clone();
    let poll = config.poll;
    let follower = ProfileFollower {
        store,
        config,
        seen: Seen::default(),
    };
    follow::spawn(redis, prefix, poll, follower)
}

/// Texts already handled, so an unchanged document is not re-parsed (and a bad one not
/// re-counted) on every poll.
#[derive(Debug, Default)]
struct Seen {
    /// The last `<prefix>:{profiles}` text that was rejected.
    rejected: Option<String>,
    /// The last seed-format list handled, applied or not.
    seed: Option<String>,
}

/// Applies the stored document if it is new, else the seed-format list if there is one.
async fn refresh(
    store: &ProfileStore,
    redis: &RedisStore<ProfileSet>,
    config: &RedisSourceConfig,
    seen: &mut Seen,
) -> Result<(), StoreError> {
    let text = match document(redis.active_raw().await)? {
        None => return refresh_seed(store, redis, config, seen).await,
        Some(Ok(text)) => text,
        Some(Err(unreadable)) => {
            if seen.rejected.as_deref() != Some(unreadable.as_str()) {
                apply(
                    store,
                    Err(not_a_document(unreadable.clone())),
                    SourceKind::Redis,
                );
                seen.rejected = Some(unreadable);
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
    redis: &RedisStore<ProfileSet>,
    config: &RedisSourceConfig,
    seen: &mut Seen,
) -> Result<(), StoreError> {
    let text = match document(redis.raw(SEED_KEY).await)? {
        None => return Ok(()),
        Some(Ok(text)) => text,
        Some(Err(unreadable)) => {
            if seen.seed.as_deref() != Some(unreadable.as_str()) {
                apply(
                    store,
                    Err(not_a_document(unreadable.clone())),
                    SourceKind::RedisSeed,
                );
                seen.seed = Some(unreadable);
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

fn not_a_document(why: String) -> ProfileSetError {
    ProfileSetError::Parse {
        path: "$".into(),
        message: why,
    }
}
