//! Profile sources and hot reload.
//!
//! The active configuration is one immutable [`Snapshot`] behind an `ArcSwap`: a request
//! loads it once and keeps it to the end, a reload builds a complete new snapshot and swaps
//! it in, and a document that does not validate never replaces the last good one.
//! Every swap bumps a generation counter ([`ProfileStore::subscribe`]) so background tasks
//! (Kubernetes discovery) can follow the profile set without polling.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use quantrouter_policy::{
    ProfileSet, ProfileSetError, ServiceUpstream, Upstream, DEFAULT_PROFILE_SET,
};
use serde::Serialize;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::telemetry;
use crate::upstream::Pool;

pub mod diff;
pub mod redis_source;
pub mod redis_store;

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
    /// Bumped after every swap.
    generation: watch::Sender<u64>,
    /// Where a new pool for a service upstream finds its endpoints (discovery on).
    discovered: OnceLock<Arc<dyn DiscoveredEndpoints>>,
}

/// The last known endpoints of Kubernetes services, as discovery found them.
pub trait DiscoveredEndpoints: Send + Sync + std::fmt::Debug {
    /// Base URLs of the ready endpoints of `service`; `None` until it was first listed.
    fn last_known(&self, service: &ServiceUpstream) -> Option<Vec<String>>;
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
}

// === impl Snapshot ===

impl Snapshot {
    /// Builds pools for `set`, reusing `previous` pools whose profile and URLs are unchanged
    /// so in-flight counts carry over a reload.
    pub fn build(set: ProfileSet, source: SourceKind, previous: Option<&Snapshot>) -> Self {
        Self::build_with(set, source, previous, None)
    }

    /// [`Snapshot::build`], with a new service pool starting from the endpoints discovery
    /// last saw for that service (instead of its DNS name), so a reload never empties it.
    pub fn build_with(
        set: ProfileSet,
        source: SourceKind,
        previous: Option<&Snapshot>,
        discovered: Option<&dyn DiscoveredEndpoints>,
    ) -> Self {
        let old: HashMap<(&str, &[String]), &Arc<Pool>> = previous
            .map(|p| {
                p.set
                    .profiles
                    .iter()
                    .zip(&p.pools)
                    .map(|(profile, pool)| ((profile.id.as_str(), pool.urls.as_slice()), pool))
                    .collect()
            })
            .unwrap_or_default();
        let pools = set
            .profiles
            .iter()
            .map(|p| {
                let urls = p.upstream.base_urls();
                if let Some(pool) = old.get(&(p.id.as_str(), urls.as_slice())) {
                    return Arc::clone(pool);
                }
                let pool = Pool::new(urls);
                if let (Some(discovered), Upstream::Service(service)) = (discovered, &p.upstream) {
                    if let Some(found) = discovered.last_known(service) {
                        pool.set_urls(found);
                    }
                }
                Arc::new(pool)
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

    /// At least one enabled profile has an endpoint to send to.
    pub fn ready(&self) -> bool {
        self.set
            .profiles
            .iter()
            .zip(&self.pools)
            .any(|(p, pool)| p.enabled && pool.has_endpoints())
    }
}

// === impl ProfileStore ===

impl ProfileStore {
    pub fn new(set: ProfileSet, source: SourceKind) -> Self {
        let snapshot = Snapshot::build(set, source, None);
        telemetry::profile_set_applied(&snapshot.set);
        Self {
            current: ArcSwap::from_pointee(snapshot),
            generation: watch::Sender::new(0),
            discovered: OnceLock::new(),
        }
    }

    /// A receiver that changes after every snapshot swap.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
    }

    /// Seeds new service pools from `discovered` from now on (set once: a second call is
    /// ignored and returns false).
    pub fn use_discovered_endpoints(&self, discovered: Arc<dyn DiscoveredEndpoints>) -> bool {
        self.discovered.set(discovered).is_ok()
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
        // A different source is authoritative from the moment it is reachable (Redis over
        // the start-up file); versions only order documents of one source.
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
        let discovered = self.discovered.get().map(|d| d.as_ref());
        let next = Snapshot::build_with(set, source, Some(&active), discovered);
        telemetry::profile_set_applied(&next.set);
        self.current.store(Arc::new(next));
        self.generation.send_modify(|g| *g += 1);
        Ok(())
    }
}

/// The start-up profile set: the `--profiles` file if given, else the embedded default.
pub fn initial_set(path: Option<&Path>) -> Result<(ProfileSet, SourceKind), ReloadError> {
    match path {
        Some(path) => Ok((read_file(path)?, SourceKind::File)),
        None => Ok((
            ProfileSet::from_json(DEFAULT_PROFILE_SET)?,
            SourceKind::Embedded,
        )),
    }
}

fn read_file(path: &Path) -> Result<ProfileSet, ReloadError> {
    let text = std::fs::read_to_string(path).map_err(|source| ReloadError::Read {
        path: path.to_owned(),
        source,
    })?;
    Ok(ProfileSet::from_json(&text)?)
}

/// Watches a profile file by polling its modification time and size (no inotify needed,
/// works on ConfigMap symlink swaps) and applies valid edits.
///
/// A file edit may keep the version number: operators editing a file by hand rarely bump
/// it, and the file is the only writer, so "not older" is enough.
pub fn watch_file(store: Arc<ProfileStore>, path: PathBuf, interval: Duration) -> JoinHandle<()> {
    // Stamp now, not when the task first runs: an edit made in between must count.
    let mut last = stamp(&path);
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            let now = stamp(&path);
            if now == last || now.is_none() {
                continue;
            }
            last = now;
            let result = read_file(&path).and_then(|set| store.apply(set, SourceKind::File, true));
            match &result {
                Ok(()) => {
                    tracing::info!(path = %path.display(), version = store.load().set.version, "profile set reloaded")
                }
                Err(error) => {
                    tracing::warn!(path = %path.display(), %error, "profile file rejected; keeping the active set")
                }
            }
            telemetry::profile_reload("file", result.is_ok());
        }
    })
}

fn stamp(path: &Path) -> Option<(SystemTime, u64)> {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Discovery that knows one service.
    #[derive(Debug)]
    struct KnowsFp16(Vec<String>);

    impl DiscoveredEndpoints for KnowsFp16 {
        fn last_known(&self, service: &ServiceUpstream) -> Option<Vec<String>> {
            (service.service == "vllm-fp16").then(|| self.0.clone())
        }
    }

    fn default_set(version: u64) -> ProfileSet {
        let mut set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
        set.version = version;
        set
    }

    #[test]
    fn new_service_pools_start_from_discovered_endpoints_and_reused_pools_stay() {
        let store = ProfileStore::new(default_set(1), SourceKind::Embedded);
        let before = store.load();
        assert_eq!(
            before.pools[0].endpoint_urls(),
            ["http://vllm-fp16.llm.svc:8000"]
        );
        let pods = vec!["http://10.0.0.1:8000".to_owned()];
        assert!(store.use_discovered_endpoints(Arc::new(KnowsFp16(pods.clone()))));

        // Same profiles: pools carry over untouched.
        store
            .apply(default_set(2), SourceKind::Embedded, false)
            .unwrap();
        assert!(Arc::ptr_eq(&before.pools[0], &store.load().pools[0]));

        // A renamed profile gets a new pool, seeded from discovery; an unknown service
        // keeps its DNS name.
        let mut set = default_set(3);
        set.profiles[0].id = "llama8b-fp16-b".into();
        set.default_profile = "llama8b-fp16-b".into();
        set.profiles[1].id = "llama8b-fp8-b".into();
        store.apply(set, SourceKind::Embedded, false).unwrap();
        let after = store.load();
        assert_eq!(after.pools[0].endpoint_urls(), pods);
        assert_eq!(after.pools[0].urls, ["http://vllm-fp16.llm.svc:8000"]);
        assert_eq!(
            after.pools[1].endpoint_urls(),
            ["http://vllm-fp8.llm.svc:8000"]
        );
    }

    #[test]
    fn every_swap_bumps_the_generation() {
        let store = ProfileStore::new(default_set(1), SourceKind::Embedded);
        let mut changes = store.subscribe();
        assert!(!changes.has_changed().unwrap());
        store
            .apply(default_set(2), SourceKind::Embedded, false)
            .unwrap();
        assert!(changes.has_changed().unwrap());
        assert_eq!(*changes.borrow_and_update(), 1);
        assert!(store
            .apply(default_set(2), SourceKind::Embedded, false)
            .is_err());
        assert!(!changes.has_changed().unwrap());
    }
}
