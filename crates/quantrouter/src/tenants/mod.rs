//! Tenants: who may call the router, with which key, within which limits and
//! routing bounds; where that document comes from; and the check of a request's key.
//! [`limiter`] counts and enforces the limits cluster-wide, [`usage`] reports them.
//!
//! Like profile sets and classifier models, a tenant document is applied whole: a request
//! loads the active [`TenantSnapshot`] once, a reload validates a new document completely
//! before swapping it in, and an invalid one never replaces the last good one. Redis
//! (`<prefix>:tenants`) outranks the `--tenants` file. The keys of `--api-keys-file` form the
//! implicit tenant `default` (no limits unless the document defines a `default` tenant, whose
//! keys they then join). With neither, no key is required, as before tenants existed.
//!
//! Keys are held only as SHA-256 digests; nothing here logs, shows or stores a key.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use futures_util::future::BoxFuture;
use quantrouter_policy::limits::Quota;
use quantrouter_policy::{
    is_valid_api_key, parse_key_hash, Downgrade, Overrides, TenantDocument, TenantLimits,
};
use serde::Serialize;
use sha2::{Digest as _, Sha256};
use tokio::task::JoinHandle;

use crate::documents::follow::{self, document, stored_version, Follower};
use crate::documents::{Document, RedisStore, StoreError};
use crate::telemetry::TenantTelemetry;

pub mod diff;
pub mod gate;
pub mod keys;
pub mod labels;
pub mod limiter;
pub mod usage;

pub use gate::{Grant, LimitReached, Tenants};
pub use keys::{bearer, KeyIndex, KeyRejected};
pub use limiter::Clock;

/// The id of the tenant `--api-keys-file` keys belong to.
pub const IMPLICIT_TENANT: &str = "default";

/// Hex characters of a key hash that `/admin/tenants` shows: enough to tell keys apart, far
/// too few to search for the key.
pub const HASH_PREFIX_CHARS: usize = 8;

/// How long start-up waits for Redis before starting on the file or no document.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(1);

/// Where the active document came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TenantSource {
    /// No document: only the implicit tenant of `--api-keys-file`, if any.
    None,
    File,
    Redis,
}

/// One tenant as requests see it.
#[derive(Debug)]
pub struct ActiveTenant {
    pub id: Arc<str>,
    pub limits: TenantLimits,
    pub quota: Quota,
    pub min_quality: Option<f64>,
    pub allowed_profiles: Option<Vec<String>>,
    pub risk_tolerance: Option<f64>,
    pub priority: i32,
    /// The first [`HASH_PREFIX_CHARS`] hex characters of each key's hash.
    pub key_prefixes: Vec<String>,
    /// The `tenant` label of its metrics: its id, or `other` outside the top N
    /// ([`labels::assign`]).
    pub label: Arc<str>,
    /// The handles of its metrics, under `label`.
    pub metrics: TenantTelemetry,
}

/// The active tenants and the index of their keys, swapped whole on reload.
#[derive(Debug)]
pub struct TenantSnapshot {
    pub tenants: Vec<Arc<ActiveTenant>>,
    keys: KeyIndex,
    pub version: u64,
    pub source: TenantSource,
    pub loaded_at: SystemTime,
}

/// The keys of `--api-keys-file`, as digests.
#[derive(Debug, Clone, Default)]
pub struct ImplicitKeys {
    digests: Vec<[u8; 32]>,
}

/// The active snapshot, swapped atomically on reload.
#[derive(Debug)]
pub struct TenantStore {
    current: ArcSwap<TenantSnapshot>,
    implicit: Option<ImplicitKeys>,
    metrics_top: usize,
    /// Serialises `apply`, so a check against the active document and the swap are one step.
    applying: Mutex<()>,
}

/// Why an offered document was not applied.
#[derive(Debug, thiserror::Error)]
pub enum RejectReason {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Invalid(String),
    #[error("version {offered} is older than the active version {active}")]
    Stale { offered: u64, active: u64 },
    #[error("a document from {offered:?} does not replace the active one from {active:?}")]
    Outranked {
        offered: TenantSource,
        active: TenantSource,
    },
}

/// Where a router takes its tenants from.
#[derive(Debug, Clone)]
pub struct TenantsConfig {
    /// `serve --tenants FILE`, watched for edits.
    pub file: Option<PathBuf>,
    /// How often the file is checked for edits.
    pub file_interval: Duration,
    pub redis: Option<(redis::Client, String)>,
    /// Re-read interval of the Redis key, the safety net for missed update messages.
    pub redis_poll: Duration,
    /// `--api-keys-file`'s keys.
    pub api_keys: Option<ImplicitKeys>,
    /// Tenants whose metrics carry their own label ([`labels::DEFAULT_TOP`]).
    pub metrics_top: usize,
}

/// A running store with the tasks that keep it up to date.
#[derive(Debug)]
pub struct Started {
    pub store: Arc<TenantStore>,
    pub tasks: Vec<JoinHandle<()>>,
}

// === impl TenantSource ===

impl TenantSource {
    fn rank(self) -> u8 {
        match self {
            Self::None => 0,
            Self::File => 1,
            Self::Redis => 2,
        }
    }

    /// The label in logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::File => "file",
            Self::Redis => "redis",
        }
    }
}

// === impl ActiveTenant ===

impl ActiveTenant {
    fn new(id: &str, limits: TenantLimits) -> Self {
        Self {
            id: Arc::from(id),
            quota: Quota::from(&limits),
            limits,
            min_quality: None,
            allowed_profiles: None,
            risk_tolerance: None,
            priority: 0,
            key_prefixes: Vec::new(),
            label: Arc::from(id),
            metrics: TenantTelemetry::new(id),
        }
    }

    /// The routing overrides of this tenant's request: its quality floor, allowed profiles
    /// and risk tolerance, and the downgrade when it is past a soft limit; `base` carries
    /// the request's own (headers, pinned model; its risk tolerance wins).
    pub fn overrides<'a>(&'a self, base: Overrides<'a>, downgraded: bool) -> Overrides<'a> {
        Overrides {
            quality_floor: self.min_quality,
            allowed_profiles: self.allowed_profiles.as_deref(),
            downgrade: downgraded.then_some(Downgrade::NEAR_LIMIT),
            risk_tolerance: base.risk_tolerance.or(self.risk_tolerance),
            ..base
        }
    }
}

// === impl TenantSnapshot ===

impl TenantSnapshot {
    /// The tenants of `doc` (if any) and the implicit tenant of `implicit` (if any), the
    /// first `metrics_top` of them with a metric label of their own.
    pub fn build(
        doc: Option<&TenantDocument>,
        implicit: Option<&ImplicitKeys>,
        source: TenantSource,
        metrics_top: usize,
    ) -> Self {
        let mut tenants = Vec::new();
        let mut keys = KeyIndex::default();
        for tenant in doc.map_or(&[][..], |d| &d.tenants[..]) {
            let mut active = ActiveTenant::new(&tenant.id, tenant.limits);
            active.min_quality = tenant.min_quality;
            active.allowed_profiles = tenant.allowed_profiles.clone();
            active.risk_tolerance = tenant.risk_tolerance;
            active.priority = tenant.priority;
            for hash in &tenant.key_sha256 {
                // The document was validated: every hash parses.
                if let Some(digest) = parse_key_hash(hash) {
                    keys.insert(digest, tenants.len());
                    active.key_prefixes.push(prefix_of(hash));
                }
            }
            tenants.push(active);
        }
        if let Some(implicit) = implicit.filter(|i| !i.digests.is_empty()) {
            let at = match tenants.iter().position(|t| &*t.id == IMPLICIT_TENANT) {
                Some(at) => at,
                None => {
                    tenants.push(ActiveTenant::new(IMPLICIT_TENANT, TenantLimits::default()));
                    tenants.len() - 1
                }
            };
            let mut index = KeyIndex::default();
            for digest in &implicit.digests {
                index.insert(*digest, at);
                tenants[at].key_prefixes.push(prefix_of(&hex(digest)));
            }
            // The document's entries go last: for a key in both, its tenant wins.
            index.extend(keys);
            keys = index;
        }
        labels::assign(&mut tenants, metrics_top);
        for tenant in &mut tenants {
            tenant.metrics = TenantTelemetry::new(&tenant.label);
        }
        Self {
            tenants: tenants.into_iter().map(Arc::new).collect(),
            keys,
            version: doc.map_or(0, |d| d.version),
            source,
            loaded_at: SystemTime::now(),
        }
    }

    /// Whether requests must carry a key: some tenant has one.
    pub fn requires_key(&self) -> bool {
        !self.keys.is_empty()
    }

    /// The tenant of a request's key (`None` in: no key sent). `Ok(None)` when no key is
    /// required and none was checked.
    pub fn authenticate(
        &self,
        key: Option<&str>,
    ) -> Result<Option<&Arc<ActiveTenant>>, KeyRejected> {
        if !self.requires_key() {
            return Ok(None);
        }
        let key = key.ok_or(KeyRejected::Missing)?;
        let at = self.keys.find(key)?;
        self.tenants.get(at).map(Some).ok_or(KeyRejected::Unknown)
    }

    /// The tenant with this id.
    pub fn tenant(&self, id: &str) -> Option<&Arc<ActiveTenant>> {
        self.tenants.iter().find(|t| &*t.id == id)
    }
}

fn prefix_of(hash: &str) -> String {
    hash.chars().take(HASH_PREFIX_CHARS).collect()
}

fn hex(digest: &[u8; 32]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

// === impl ImplicitKeys ===

impl ImplicitKeys {
    /// Digests of `--api-keys-file`'s keys. A key that can never match a request (empty,
    /// whitespace or non-ASCII characters, over 256 bytes) is an error naming only its
    /// position.
    pub fn from_keys<'a>(keys: impl IntoIterator<Item = &'a str>) -> Result<Self, String> {
        let mut digests = Vec::new();
        for (n, key) in keys.into_iter().enumerate() {
            if !is_valid_api_key(key) {
                return Err(format!(
                    "API key number {} is not 1 to 256 visible ASCII characters",
                    n + 1
                ));
            }
            digests.push(Sha256::digest(key.as_bytes()).into());
        }
        Ok(Self { digests })
    }
}

// === impl TenantStore ===

impl TenantStore {
    /// No document yet: the implicit tenant alone, or no tenants at all. Snapshots label the
    /// metrics of `metrics_top` tenants with their id.
    pub fn new(implicit: Option<ImplicitKeys>, metrics_top: usize) -> Self {
        let snapshot =
            TenantSnapshot::build(None, implicit.as_ref(), TenantSource::None, metrics_top);
        Self {
            current: ArcSwap::from_pointee(snapshot),
            implicit,
            metrics_top,
            applying: Mutex::new(()),
        }
    }

    /// The active snapshot; a request keeps the one it loaded.
    pub fn load(&self) -> Arc<TenantSnapshot> {
        self.current.load_full()
    }

    /// Swaps in `doc` unless it is invalid, older than the active document of the same
    /// source, or from a lesser source than the active one.
    pub fn apply(
        &self,
        doc: &TenantDocument,
        source: TenantSource,
        allow_same_version: bool,
    ) -> Result<(), RejectReason> {
        let _serialised = self.applying.lock().unwrap_or_else(|e| e.into_inner());
        doc.validate()
            .map_err(|e| RejectReason::Invalid(e.to_string()))?;
        let active = self.current.load();
        if source.rank() < active.source.rank() {
            return Err(RejectReason::Outranked {
                offered: source,
                active: active.source,
            });
        }
        let stale = active.source == source
            && if allow_same_version {
                doc.version < active.version
            } else {
                doc.version <= active.version
            };
        if stale {
            return Err(RejectReason::Stale {
                offered: doc.version,
                active: active.version,
            });
        }
        let next =
            TenantSnapshot::build(Some(doc), self.implicit.as_ref(), source, self.metrics_top);
        self.current.store(Arc::new(next));
        Ok(())
    }
}

// === impl Document for TenantDocument ===

impl Document for TenantDocument {
    const KEY: &'static str = "tenants";
    /// Tenant documents are small; fifty versions go back weeks of edits, as for profiles.
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
        let tenants = document["tenants"]
            .as_array()
            .map_or(&[][..], Vec::as_slice);
        let keys: usize = tenants
            .iter()
            .map(|t| t["key_sha256"].as_array().map_or(0, Vec::len))
            .sum();
        format!("{} tenants, {keys} keys", tenants.len())
    }
}

/// Starts on Redis's document if it has a valid one within a second, else the file's, else
/// none; then follows the file and Redis. An unreadable or invalid `--tenants` file at
/// start-up is an error: the operator asked for those tenants.
pub async fn start(config: TenantsConfig) -> Result<Started, RejectReason> {
    let store = Arc::new(TenantStore::new(
        config.api_keys.clone(),
        config.metrics_top,
    ));
    if let Some(path) = &config.file {
        let doc = read_file(path)?;
        store.apply(&doc, TenantSource::File, true)?;
    }
    let mut tasks = Vec::new();
    if let Some((client, prefix)) = &config.redis {
        let at_start = tokio::time::timeout(STARTUP_TIMEOUT, async {
            let redis = RedisStore::<TenantDocument>::connect(client, prefix).await?;
            TenantFollower::new(Arc::clone(&store))
                .refresh(&redis)
                .await
        })
        .await;
        if !matches!(at_start, Ok(Ok(()))) {
            tracing::warn!("redis did not give a tenant document at start-up; starting without it");
        }
        let follower = TenantFollower::new(Arc::clone(&store));
        tasks.push(follow::spawn(
            client.clone(),
            prefix.clone(),
            config.redis_poll,
            follower,
        ));
    }
    if let Some(path) = config.file {
        let store = Arc::clone(&store);
        tasks.push(crate::documents::file::watch(
            path,
            config.file_interval,
            move |path| {
                offer(&store, read_file(path), TenantSource::File, true);
            },
        ));
    }
    let active = store.load();
    tracing::info!(
        version = active.version,
        source = active.source.as_str(),
        tenants = active.tenants.len(),
        "tenants loaded"
    );
    Ok(Started { store, tasks })
}

/// A tenant file, parsed and validated (the stored format: hashes, no plain keys).
pub fn read_file(path: &Path) -> Result<TenantDocument, RejectReason> {
    let text = crate::documents::read_file(path).map_err(|source| RejectReason::Read {
        path: path.to_owned(),
        source,
    })?;
    TenantDocument::from_json(&text)
        .map_err(|e| RejectReason::Invalid(format!("{}: {e}", path.display())))
}

/// Applies an offered document or keeps the active one; logs either way.
fn offer(
    store: &TenantStore,
    doc: Result<TenantDocument, RejectReason>,
    source: TenantSource,
    allow_same_version: bool,
) -> bool {
    let result = doc.and_then(|doc| store.apply(&doc, source, allow_same_version));
    match &result {
        Ok(()) => {
            let active = store.load();
            tracing::info!(
                version = active.version,
                source = source.as_str(),
                tenants = active.tenants.len(),
                "tenants applied"
            );
        }
        Err(error @ RejectReason::Outranked { .. }) => {
            tracing::info!(%error, source = source.as_str(), "tenant document not applied");
        }
        Err(error) => {
            tracing::warn!(%error, source = source.as_str(), "tenant document rejected; keeping the active one");
        }
    }
    result.is_ok()
}

/// Applies the documents Redis holds to a store.
struct TenantFollower {
    store: Arc<TenantStore>,
    /// The last document text handled: a rejected one is reported once, not every poll.
    seen: Option<String>,
    /// Why the key could not hold a document, when that was last reported.
    unreadable: Option<String>,
}

impl TenantFollower {
    fn new(store: Arc<TenantStore>) -> Self {
        Self {
            store,
            seen: None,
            unreadable: None,
        }
    }
}

impl Follower for TenantFollower {
    type Doc = TenantDocument;
    const WHAT: &'static str = "tenants";

    fn refresh<'a>(
        &'a mut self,
        redis: &'a RedisStore<TenantDocument>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let text = match document(redis.active_raw().await)? {
                None => return Ok(()),
                Some(Err(unreadable)) => {
                    if self.unreadable.as_deref() != Some(unreadable.as_str()) {
                        let reason = RejectReason::Invalid(unreadable.clone());
                        offer(&self.store, Err(reason), TenantSource::Redis, false);
                        self.unreadable = Some(unreadable);
                    }
                    return Ok(());
                }
                Some(Ok(text)) => text,
            };
            self.unreadable = None;
            if self.seen.as_deref() == Some(text.as_str()) {
                return Ok(());
            }
            let active = self.store.load();
            let applied = active.source == TenantSource::Redis
                && stored_version(&text) == Some(active.version);
            if !applied {
                let doc = TenantDocument::from_json(&text)
                    .map_err(|e| RejectReason::Invalid(e.to_string()));
                offer(&self.store, doc, TenantSource::Redis, false);
            }
            self.seen = Some(text);
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests;
