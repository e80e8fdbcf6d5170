//! Profile sources and hot reload.
//!
//! The active configuration is one immutable [`Snapshot`] behind an `ArcSwap`: a request
//! loads it once and keeps it to the end, a reload builds a complete new snapshot and swaps
//! it in, and a document that does not validate never replaces the last good one.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use arc_swap::ArcSwap;
use quantrouter_policy::{Profile, ProfileSet, ProfileSetError, DEFAULT_PROFILE_SET};
use serde::Serialize;

use crate::resilience::ResilienceConfig;
use crate::telemetry;
use crate::upstream::Pool;

pub mod diff;
pub mod redis_source;
pub mod redis_store;
pub mod source;

pub use source::{start, Embedded, FileSource, ProfileSource, Started};

/// Where the active profile set came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SourceKind {
    Embedded,
    File,
    Redis,
    /// The seed write-ups' list format in `model_profiles:active`.
    RedisSeed,
}

/// One complete, validated routing configuration with its upstream pools.
#[derive(Debug)]
pub struct Snapshot {
    pub set: ProfileSet,
    /// `pools[i]` serves `set.profiles[i]`.
    pub pools: Vec<Arc<Pool>>,
    /// `model_json[i]` is `set.profiles[i].model` encoded as a JSON string, ready to splice.
    pub model_json: Vec<String>,
    pub source: SourceKind,
    pub loaded_at: SystemTime,
}

/// The active snapshot, swapped atomically on reload.
#[derive(Debug)]
pub struct ProfileStore {
    current: ArcSwap<Snapshot>,
    /// Settings for the pools of every snapshot.
    resilience: ArcSwap<ResilienceConfig>,
}

/// Why a new document was not applied.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Invalid(#[from] ProfileSetError),
    #[error("version {offered} is older than the active version {active}")]
    Stale { offered: u64, active: u64 },
    #[error("a set from {offered:?} does not replace the active set from {active:?}")]
    Outranked {
        offered: SourceKind,
        active: SourceKind,
    },
}

// === impl SourceKind ===

impl SourceKind {
    /// Preference between sources; both Redis formats rank the same.
    fn rank(self) -> u8 {
        match self {
            Self::Embedded => 0,
            Self::File => 1,
            Self::Redis | Self::RedisSeed => 2,
        }
    }
}

// === impl Snapshot ===

impl Snapshot {
    /// Builds pools for `set`, reusing `previous` pools whose profile id, upstream and
    /// concurrency limit are unchanged, so endpoint state (in-flight counts, circuits) and
    /// admission queues carry over a reload.
    pub fn build(
        set: ProfileSet,
        source: SourceKind,
        previous: Option<&Snapshot>,
        config: &ResilienceConfig,
    ) -> Self {
        let reusable = |p: &Profile| {
            let previous = previous?;
            previous
                .set
                .profiles
                .iter()
                .zip(&previous.pools)
                .find(|(old, _)| {
                    old.id == p.id
                        && old.upstream == p.upstream
                        && old.max_concurrency == p.max_concurrency
                })
                .map(|(_, pool)| Arc::clone(pool))
        };
        let pools = set
            .profiles
            .iter()
            .map(|p| {
                reusable(p).unwrap_or_else(|| {
                    Arc::new(Pool::new(
                        &p.upstream.base_urls(),
                        p.max_concurrency,
                        config,
                    ))
                })
            })
            .collect();
        let model_json = set
            .profiles
            .iter()
            .map(|p| serde_json::Value::from(p.model.as_str()).to_string())
            .collect();
        Self {
            set,
            pools,
            model_json,
            source,
            loaded_at: SystemTime::now(),
        }
    }

    /// At least one enabled profile has an endpoint whose circuit is not open.
    pub fn ready(&self) -> bool {
        let now = tokio::time::Instant::now();
        self.set
            .profiles
            .iter()
            .zip(&self.pools)
            .any(|(p, pool)| p.enabled && pool.available(now))
    }
}

// === impl ProfileStore ===

impl ProfileStore {
    pub fn new(set: ProfileSet, source: SourceKind) -> Self {
        let config = ResilienceConfig::default();
        let snapshot = Snapshot::build(set, source, None, &config);
        telemetry::profile_set_applied(&snapshot.set);
        Self {
            current: ArcSwap::from_pointee(snapshot),
            resilience: ArcSwap::from_pointee(config),
        }
    }

    /// Rebuilds every pool with new resilience settings (at server start, before traffic).
    pub fn configure(&self, config: ResilienceConfig) {
        self.resilience.store(Arc::new(config));
        let active = self.current.load();
        let next = Snapshot::build(active.set.clone(), active.source, None, &config);
        self.current.store(Arc::new(next));
    }

    /// The active snapshot; hold it for the whole request.
    pub fn load(&self) -> Arc<Snapshot> {
        self.current.load_full()
    }

    /// Swaps in `set` unless it is older than the active one.
    pub fn apply(
        &self,
        set: ProfileSet,
        source: SourceKind,
        allow_same_version: bool,
    ) -> Result<(), ReloadError> {
        let active = self.current.load();
        // Redis outranks the file, which outranks the embedded set: a preferred source takes
        // over the moment it is reachable, and a lesser one never overrides it.
        if source.rank() < active.source.rank() {
            return Err(ReloadError::Outranked {
                offered: source,
                active: active.source,
            });
        }
        // Versions only order documents of one source.
        let stale = if active.source != source {
            false
        } else if allow_same_version {
            set.version < active.set.version
        } else {
            set.version <= active.set.version
        };
        if stale {
            return Err(ReloadError::Stale {
                offered: set.version,
                active: active.set.version,
            });
        }
        let next = Snapshot::build(set, source, Some(&active), &self.resilience.load());
        telemetry::profile_set_applied(&next.set);
        self.current.store(Arc::new(next));
        Ok(())
    }
}

/// The start-up profile set: the `--profiles` file if given, else the embedded default.
pub fn initial_set(path: Option<&Path>) -> Result<(ProfileSet, SourceKind), ReloadError> {
    match path {
        Some(path) => Ok((source::read_file(path)?, SourceKind::File)),
        None => Ok((
            ProfileSet::from_json(DEFAULT_PROFILE_SET)?,
            SourceKind::Embedded,
        )),
    }
}
