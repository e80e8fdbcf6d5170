//! Profile sources and hot reload.
//!
//! The active configuration is one immutable [`Snapshot`] behind an `ArcSwap`: a request
//! loads it once and keeps it to the end, a reload builds a complete new snapshot and swaps
//! it in, and a document that does not validate never replaces the last good one.
//! Every swap bumps a generation counter ([`ProfileStore::subscribe`]) so background tasks
//! (Kubernetes discovery) can follow the profile set without polling.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::SystemTime;

use arc_swap::ArcSwap;
use quantrouter_policy::{Profile, ProfileSet, ProfileSetError, ServiceUpstream, Upstream};
use serde::Serialize;
use tokio::sync::watch;

use crate::documents::Document;
use crate::resilience::ResilienceConfig;
use crate::telemetry::{self, ProfileTelemetry};
use crate::upstream::credential::Credential;
use crate::upstream::{Pool, Transport};

pub mod diff;
pub mod redis_source;
pub mod source;

pub use source::{
    initial_set, read_set_or_seed_list, start, Embedded, FileSource, ProfileSource, Started,
};

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
    /// What the router keeps for each profile of `set`, in the same order.
    pub runtime: Vec<ProfileRuntime>,
    pub source: SourceKind,
    pub loaded_at: SystemTime,
}

/// What the router keeps beside one profile of a snapshot, indexed like the set's profiles
/// (by [`quantrouter_policy::ProfileIndex`]).
#[derive(Debug)]
pub struct ProfileRuntime {
    /// The profile's endpoints, admission queue and breakers.
    pub pool: Arc<Pool>,
    /// The profile's `model` encoded as a JSON string, ready to splice into a body.
    pub model_json: String,
    /// Metric handles and response header values of the profile.
    pub telemetry: Arc<ProfileTelemetry>,
}

/// A profile's prices per token: the one place a cost is computed from token counts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PerToken {
    input: f64,
    output: f64,
}

impl PerToken {
    pub fn of(profile: &quantrouter_policy::Profile) -> Self {
        Self {
            input: profile.cost_per_1m_input_tokens / 1e6,
            output: profile.cost_per_1m_output_tokens / 1e6,
        }
    }

    /// What `usage` costs at these prices.
    pub fn cost(self, usage: crate::openai::Usage) -> f64 {
        usage.prompt_tokens as f64 * self.input + usage.completion_tokens as f64 * self.output
    }
}

/// The active snapshot, swapped atomically on reload.
#[derive(Debug)]
pub struct ProfileStore {
    current: ArcSwap<Snapshot>,
    /// Settings for the pools of every snapshot.
    resilience: ArcSwap<ResilienceConfig>,
    /// Bumped after every swap.
    generation: watch::Sender<u64>,
    /// Where a new pool for a service upstream finds its endpoints (discovery on).
    discovered: OnceLock<Arc<dyn DiscoveredEndpoints>>,
    /// Held from reading the active snapshot to storing its successor, so two sources
    /// applying at once cannot both pass the rank and version checks against the same
    /// snapshot and the later store win regardless of rank.
    swap: Mutex<()>,
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
    #[error("a set from {offered:?} does not replace the active set from {active:?}")]
    Outranked {
        offered: SourceKind,
        active: SourceKind,
    },
}

// === impl Document for ProfileSet ===

impl Document for ProfileSet {
    const KEY: &'static str = "profiles";
    /// Enough for weeks of daily pushes.
    const HISTORY_CAP: usize = 50;

    fn parse(text: &str) -> Result<Self, String> {
        Self::from_json(text).map_err(|e| e.to_string())
    }

    fn version(&self) -> u64 {
        self.version
    }

    fn set_version(&mut self, version: u64) {
        self.version = version;
    }

    fn to_json(&self) -> Result<String, String> {
        serde_json::to_string_pretty(self).map_err(|e| e.to_string())
    }

    fn describe(document: &serde_json::Value) -> String {
        let profiles = document["profiles"].as_array().map_or(0, Vec::len);
        format!("{profiles} profiles")
    }
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
    /// admission queues carry over a reload. With `discovered`, a new service pool starts
    /// from the endpoints discovery last saw for that service (not its DNS name), so a
    /// reload never empties it.
    pub fn build(
        set: ProfileSet,
        source: SourceKind,
        previous: Option<&Snapshot>,
        config: &ResilienceConfig,
        discovered: Option<&dyn DiscoveredEndpoints>,
    ) -> Self {
        let reusable = |p: &Profile| {
            let previous = previous?;
            previous
                .set
                .profiles
                .iter()
                .zip(&previous.runtime)
                .find(|(old, _)| {
                    old.id == p.id
                        && old.upstream == p.upstream
                        && old.max_concurrency == p.max_concurrency
                })
                .map(|(_, runtime)| Arc::clone(&runtime.pool))
        };
        let new_pool = |p: &Profile| {
            let found = match (discovered, &p.upstream) {
                (Some(discovered), Upstream::Service(service)) => discovered.last_known(service),
                _ => None,
            };
            let urls = found.unwrap_or_else(|| p.upstream.base_urls());
            let credential = p.upstream.api_key().map(Credential::new);
            Arc::new(
                Pool::new(&urls, p.max_concurrency, config)
                    .with_credential(credential)
                    .with_transport(Transport::of(&p.upstream)),
            )
        };
        let runtime = set
            .profiles
            .iter()
            .map(|p| ProfileRuntime {
                pool: reusable(p).unwrap_or_else(|| new_pool(p)),
                model_json: serde_json::Value::from(p.model.as_str()).to_string(),
                telemetry: Arc::new(ProfileTelemetry::new(p)),
            })
            .collect();
        Self {
            set,
            runtime,
            source,
            loaded_at: SystemTime::now(),
        }
    }

    /// Every profile's upstream pool, in profile-set order.
    pub fn pools(&self) -> impl Iterator<Item = &Arc<Pool>> {
        self.runtime.iter().map(|r| &r.pool)
    }

    /// At least one enabled profile has an endpoint whose circuit is not open.
    pub fn ready(&self) -> bool {
        let now = tokio::time::Instant::now();
        self.set
            .profiles
            .iter()
            .zip(&self.runtime)
            .any(|(p, runtime)| p.enabled && runtime.pool.available(now))
    }
}

// === impl ProfileStore ===

impl ProfileStore {
    pub fn new(set: ProfileSet, source: SourceKind) -> Self {
        let config = ResilienceConfig::default();
        let snapshot = Snapshot::build(set, source, None, &config, None);
        telemetry::profile_set_applied(&snapshot.set);
        Self {
            current: ArcSwap::from_pointee(snapshot),
            resilience: ArcSwap::from_pointee(config),
            generation: watch::Sender::new(0),
            discovered: OnceLock::new(),
            swap: Mutex::new(()),
        }
    }

    /// The swap lock; poisoning is ignored because a panic cannot leave a half-made swap
    /// (the store is one pointer write).
    fn lock_swap(&self) -> MutexGuard<'_, ()> {
        self.swap.lock().unwrap_or_else(PoisonError::into_inner)
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

    fn discovered(&self) -> Option<&dyn DiscoveredEndpoints> {
        self.discovered.get().map(|d| d.as_ref())
    }

    /// Rebuilds every pool with new resilience settings (at server start, before traffic).
    pub fn configure(&self, config: ResilienceConfig) {
        let _swap = self.lock_swap();
        self.resilience.store(Arc::new(config));
        let active = self.current.load();
        let discovered = self.discovered();
        let next = Snapshot::build(active.set.clone(), active.source, None, &config, discovered);
        self.current.store(Arc::new(next));
        self.generation.send_modify(|g| *g += 1);
    }

    /// The active snapshot; hold it for the whole request.
    pub fn load(&self) -> Arc<Snapshot> {
        self.current.load_full()
    }

    /// Swaps in `set` unless it is older than the active one or a preferred source's set is
    /// active. Applies are serialised: each checks against the snapshot it replaces.
    pub fn apply(
        &self,
        set: ProfileSet,
        source: SourceKind,
        allow_same_version: bool,
    ) -> Result<(), ReloadError> {
        let _swap = self.lock_swap();
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
        let config = self.resilience.load();
        let next = Snapshot::build(set, source, Some(&active), &config, self.discovered());
        telemetry::profile_set_applied(&next.set);
        self.current.store(Arc::new(next));
        self.generation.send_modify(|g| *g += 1);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use quantrouter_policy::DEFAULT_PROFILE_SET;

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
            before.runtime[0].pool.endpoint_urls(),
            ["http://vllm-fp16.llm.svc:8000"]
        );
        let pods = vec!["http://10.0.0.1:8000".to_owned()];
        assert!(store.use_discovered_endpoints(Arc::new(KnowsFp16(pods.clone()))));

        // Same profiles: pools carry over untouched.
        store
            .apply(default_set(2), SourceKind::Embedded, false)
            .unwrap();
        assert!(Arc::ptr_eq(
            &before.runtime[0].pool,
            &store.load().runtime[0].pool
        ));

        // A renamed profile gets a new pool, seeded from discovery; an unknown service
        // keeps its DNS name.
        let mut set = default_set(3);
        set.profiles[0].id = "llama8b-fp16-b".into();
        set.default_profile = "llama8b-fp16-b".into();
        set.profiles[1].id = "llama8b-fp8-b".into();
        store.apply(set, SourceKind::Embedded, false).unwrap();
        let after = store.load();
        assert_eq!(after.runtime[0].pool.endpoint_urls(), pods);
        assert_eq!(
            after.runtime[1].pool.endpoint_urls(),
            ["http://vllm-fp8.llm.svc:8000"]
        );
    }

    /// Many file applies race a few Redis ones; without serialised applies a file apply
    /// that read the active snapshot before a Redis swap stores over it after.
    #[test]
    fn a_lower_ranked_source_never_overwrites_a_higher_ranked_one() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Barrier;
        const FILE_THREADS: u64 = 3;
        for _round in 0..60 {
            let store = ProfileStore::new(default_set(1), SourceKind::Embedded);
            let barrier = Barrier::new(FILE_THREADS as usize + 2);
            let done = AtomicBool::new(false);
            std::thread::scope(|s| {
                // Watches every snapshot: (rank, version) never goes down.
                let watcher = s.spawn(|| {
                    let mut seen = (0, 0);
                    barrier.wait();
                    while !done.load(Ordering::Relaxed) {
                        let now = store.load();
                        let key = (now.source.rank(), now.set.version);
                        assert!(key >= seen, "went from {seen:?} to {key:?}");
                        seen = key;
                    }
                });
                let files: Vec<_> = (0..FILE_THREADS)
                    .map(|t| {
                        let (store, barrier) = (&store, &barrier);
                        s.spawn(move || {
                            barrier.wait();
                            for v in 0..60 {
                                let set = default_set(2 + v * FILE_THREADS + t);
                                let _ = store.apply(set, SourceKind::File, false);
                            }
                        })
                    })
                    .collect();
                barrier.wait();
                for version in 1..=3 {
                    std::thread::yield_now();
                    let _ = store.apply(default_set(version), SourceKind::Redis, false);
                }
                for file in files {
                    file.join().unwrap();
                }
                done.store(true, Ordering::Relaxed);
                watcher.join().unwrap();
            });
            let active = store.load();
            assert_eq!(active.source, SourceKind::Redis);
            assert_eq!(active.set.version, 3);
        }
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
