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
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use quantrouter_policy::limits::Quota;
use quantrouter_policy::{
    is_valid_api_key, parse_key_hash, Downgrade, Overrides, PrefixCache, TenantDocument,
    TenantKeys, TenantLimits,
};
use serde::Serialize;
use sha2::{Digest as _, Sha256};

use crate::documents::store::{self, DocumentStore, Kind, Rejected, Sources};
use crate::documents::Document;
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
    /// What the tenant's sessions, prefix tables and ratings are keyed by, and its
    /// `cache_salt` when its `prefix_cache` is `isolated`.
    pub keys: TenantKeys,
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
pub type TenantStore = DocumentStore<TenantDocs>;

/// Why an offered document was not applied.
pub type RejectReason = Rejected<TenantSource>;

/// A running store with the tasks that keep it up to date.
pub type Started = store::Started<TenantDocs>;

/// Tenant documents as a kind of document a [`DocumentStore`] keeps active, with what every
/// snapshot is built with besides the document.
#[derive(Debug)]
pub struct TenantDocs {
    implicit: Option<ImplicitKeys>,
    metrics_top: usize,
}

/// Where a router takes its tenants from.
#[derive(Debug, Clone)]
pub struct TenantsConfig {
    /// `serve --tenants FILE`, watched for edits.
    pub file: Option<PathBuf>,
    /// How often the file is checked for edits.
    pub file_interval: Duration,
    pub redis: Option<(crate::redis_conn::Redis, String)>,
    /// Re-read interval of the Redis key, the safety net for missed update messages.
    pub redis_poll: Duration,
    /// `--api-keys-file`'s keys.
    pub api_keys: Option<ImplicitKeys>,
    /// Tenants whose metrics carry their own label ([`labels::DEFAULT_TOP`]).
    pub metrics_top: usize,
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
            keys: TenantKeys::derive(id, &[], PrefixCache::Shared),
            label: Arc::from(id),
            metrics: TenantTelemetry::new(id),
        }
    }

    /// Whether the tenant may use the profile with this id (`allowed_profiles`).
    pub fn allows(&self, profile: &str) -> bool {
        self.allowed_profiles
            .as_ref()
            .is_none_or(|allowed| allowed.iter().any(|p| p == profile))
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
        // Each tenant's key digests and `prefix_cache`, for its derived keys.
        let mut secrets = Vec::new();
        for tenant in doc.map_or(&[][..], |d| &d.tenants[..]) {
            let mut active = ActiveTenant::new(&tenant.id, tenant.limits);
            active.min_quality = tenant.min_quality;
            active.allowed_profiles = tenant.allowed_profiles.clone();
            active.risk_tolerance = tenant.risk_tolerance;
            active.priority = tenant.priority;
            let mut digests = Vec::new();
            for hash in &tenant.key_sha256 {
                // The document was validated: every hash parses.
                if let Some(digest) = parse_key_hash(hash) {
                    keys.insert(digest, tenants.len());
                    active.key_prefixes.push(prefix_of(hash));
                    digests.push(digest);
                }
            }
            tenants.push(active);
            secrets.push((digests, tenant.prefix_cache));
        }
        if let Some(implicit) = implicit.filter(|i| !i.digests.is_empty()) {
            let at = match tenants.iter().position(|t| &*t.id == IMPLICIT_TENANT) {
                Some(at) => at,
                None => {
                    tenants.push(ActiveTenant::new(IMPLICIT_TENANT, TenantLimits::default()));
                    secrets.push((Vec::new(), PrefixCache::Shared));
                    tenants.len() - 1
                }
            };
            let mut index = KeyIndex::default();
            for digest in &implicit.digests {
                index.insert(*digest, at);
                tenants[at].key_prefixes.push(prefix_of(&hex(digest)));
                secrets[at].0.push(*digest);
            }
            // The document's entries go last: for a key in both, its tenant wins.
            index.extend(keys);
            keys = index;
        }
        for (tenant, (digests, prefix_cache)) in tenants.iter_mut().zip(&secrets) {
            tenant.keys = TenantKeys::derive(&tenant.id, digests, *prefix_cache);
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
        let kind = TenantDocs {
            implicit,
            metrics_top,
        };
        Self::holding(kind, snapshot)
    }
}

// === impl Kind for TenantDocs ===

impl Kind for TenantDocs {
    type Doc = TenantDocument;
    type Active = TenantSnapshot;
    type Source = TenantSource;

    const WHAT: &'static str = "tenants";
    const FILE: TenantSource = TenantSource::File;
    const REDIS: TenantSource = TenantSource::Redis;

    fn rank(source: TenantSource) -> u8 {
        source.rank()
    }

    fn source(active: &TenantSnapshot) -> TenantSource {
        active.source
    }

    fn version(active: &TenantSnapshot) -> u64 {
        active.version
    }

    fn summary(active: &TenantSnapshot) -> String {
        format!("{} tenants", active.tenants.len())
    }

    fn admit(&self, _: &TenantSnapshot, doc: &TenantDocument) -> Result<(), RejectReason> {
        doc.validate()
            .map_err(|e| RejectReason::Invalid(e.to_string()))
    }

    fn build(
        &self,
        doc: &TenantDocument,
        source: TenantSource,
    ) -> Result<TenantSnapshot, RejectReason> {
        let implicit = self.implicit.as_ref();
        Ok(TenantSnapshot::build(
            Some(doc),
            implicit,
            source,
            self.metrics_top,
        ))
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
    let store = TenantStore::new(config.api_keys, config.metrics_top);
    let sources = Sources {
        file: config.file,
        file_interval: config.file_interval,
        redis: config.redis,
        redis_poll: config.redis_poll,
    };
    store::start(store, sources).await
}

/// A tenant file, parsed and validated (the stored format: hashes, no plain keys).
pub fn read_file(path: &Path) -> Result<TenantDocument, RejectReason> {
    store::read_file(path)
}

#[cfg(test)]
mod tests;
