//! The tenant document: who may call the router, with which API keys, and within
//! which limits and routing bounds.
//!
//! ```json
//! {"version": 3, "tenants": [{"id": "team-a", "key_sha256": ["<64 hex>"],
//!   "limits": {"requests_per_minute": 600, "tokens_per_minute": 200000,
//!              "budget_per_day": 20.0, "budget_per_month": 400.0, "soft_limit": 0.8},
//!   "min_quality": 0.85, "allowed_profiles": ["llama8b-fp8", "llama8b-awq"], "priority": 10,
//!   "prefix_cache": "isolated"}]}
//! ```
//!
//! Keys are stored only as lowercase hex SHA-256 digests. `tenants push` also reads a push-only
//! `keys` field of plain keys ([`TenantDocument::from_push_json`]), hashes them and drops them,
//! so a key never reaches Redis; the stored format refuses that field. No message here ever
//! quotes a key or a hash field's value.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::affinity::KeyScope;
use crate::profile::{parse_with_path, FieldError, ProfileSetError, ValidationErrors, MAX_VERSION};

/// The longest API key accepted, in bytes: real keys are 40 to 170 characters, and a bound
/// keeps a hostile header from being hashed at any length.
pub const MAX_KEY_BYTES: usize = 256;

/// Key hashes one document may hold: every request compares its key's hash with each of them
/// in constant time, so the number bounds that work.
pub const MAX_KEYS: usize = 4096;

/// The largest request or token limit: counters are Lua numbers in Redis, exact to 2^53 − 1.
pub const MAX_COUNT_LIMIT: u64 = MAX_VERSION;

/// The largest budget: spend is counted in millionths of the currency unit, and 10^9 units are
/// 10^15 millionths, well inside the 2^53 that Lua numbers hold exactly.
pub const MAX_BUDGET: f64 = 1e9;

/// All tenants of one router fleet.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantDocument {
    /// Monotonic document version; a router never replaces the document with an older one.
    /// At most [`MAX_VERSION`].
    pub version: u64,
    /// When the document was written (RFC 3339), informational.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<String>,
    pub tenants: Vec<Tenant>,
}

/// One application or team calling the router.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tenant {
    /// Name in metrics, logs, `/admin/tenants` and Redis counter keys:
    /// `[A-Za-z0-9][A-Za-z0-9._-]*`, at most 64 characters.
    pub id: String,
    /// Lowercase hex SHA-256 of each API key of the tenant (`quantrouter tenants hash-key`).
    /// A tenant without keys cannot authenticate.
    #[serde(default)]
    pub key_sha256: Vec<String>,
    #[serde(default)]
    pub limits: TenantLimits,
    /// The tenant's quality floor: its requests never route below it, downgraded or not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_quality: Option<f64>,
    /// Profile ids the tenant may use; absent: all of them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allowed_profiles: Option<Vec<String>>,
    /// Replaces the profile set's `policy.risk_tolerance` for this tenant's requests (a
    /// request's `x-quantrouter-risk-tolerance` header replaces both).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub risk_tolerance: Option<f64>,
    /// Order in the admission queue: higher waits less; equal priorities wait first come,
    /// first served.
    #[serde(default)]
    pub priority: i32,
    /// Whether the tenant's prompts may share the model servers' KV cache with other
    /// tenants' (left out when `shared`, so older routers still read the document).
    #[serde(default, skip_serializing_if = "PrefixCache::is_shared")]
    pub prefix_cache: PrefixCache,
    /// Push-only plain keys; never serialised, and refused by the stored format.
    #[serde(default, skip_serializing)]
    pub keys: Vec<String>,
}

/// Rate limits and budgets of one tenant; each absent limit is no limit.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantLimits {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_minute: Option<u64>,
    /// Prompt plus completion tokens per minute (reserved at admission: the prompt's
    /// estimate plus `max_tokens`; settled to the answer's `usage`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_minute: Option<u64>,
    /// Spend per UTC day, in the currency of the profiles' prices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_per_day: Option<f64>,
    /// Spend per UTC calendar month, in the currency of the profiles' prices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_per_month: Option<f64>,
    /// Share of any limit past which requests are routed cheaper (downgraded) instead of
    /// normally; 1 turns downgrading off.
    #[serde(default = "default_soft_limit")]
    pub soft_limit: f64,
}

/// `prefix_cache`: whether a tenant's prompts share KV-cache blocks with other tenants'.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefixCache {
    /// One cache for all (the model server's default): the most cache hits, but a tenant can
    /// tell from a quick first token that someone sent the same prefix recently.
    #[default]
    Shared,
    /// Every request carries vLLM's `cache_salt`, derived from the tenant
    /// ([`TenantKeys::cache_salt`]): its prompts share blocks only with its own.
    Isolated,
}

/// What a tenant's state in the router is keyed by, derived once per document from a digest
/// of its id and its keys' hashes. No other tenant can compute them: key hashes are never
/// shown (usage reports show 8 hex characters). A new key set derives new ones, so rotating
/// a tenant's keys starts its sessions and its cache afresh.
#[derive(Clone)]
pub struct TenantKeys {
    secret: [u8; 32],
    scope: KeyScope,
    /// `isolated`: the `cache_salt` of a request that sends none.
    salt: Option<String>,
}

/// Why a tenant document was refused.
#[derive(Debug, thiserror::Error)]
pub enum TenantError {
    /// Not JSON, wrong types or unknown fields.
    #[error("{path}: {message}")]
    Parse { path: String, message: String },
    /// Well-formed but breaks a rule.
    #[error("{0}")]
    Invalid(ValidationErrors),
}

// === impl TenantDocument ===

impl TenantDocument {
    /// Parses and validates a stored document; errors carry the JSON path.
    pub fn from_json(text: &str) -> Result<Self, TenantError> {
        let doc: TenantDocument = parse_with_path(text).map_err(TenantError::from)?;
        doc.validate().map_err(TenantError::Invalid)?;
        Ok(doc)
    }

    /// Parses a document as `tenants push` reads it: besides `key_sha256`, a tenant may list
    /// plain `keys`, which are checked, hashed into `key_sha256` and dropped. The result is a
    /// valid stored document.
    pub fn from_push_json(text: &str) -> Result<Self, TenantError> {
        let mut doc: TenantDocument = parse_with_path(text).map_err(TenantError::from)?;
        let mut errors = Vec::new();
        for (i, tenant) in doc.tenants.iter_mut().enumerate() {
            for (j, key) in std::mem::take(&mut tenant.keys).iter().enumerate() {
                if !is_valid_api_key(key) {
                    errors.push(FieldError {
                        path: format!("tenants[{i}].keys[{j}]"),
                        message: KEY_RULE.to_owned(),
                    });
                    continue;
                }
                let hash = hash_key(key);
                if !tenant.key_sha256.contains(&hash) {
                    tenant.key_sha256.push(hash);
                }
            }
        }
        if !errors.is_empty() {
            return Err(TenantError::Invalid(ValidationErrors(errors)));
        }
        doc.validate().map_err(TenantError::Invalid)?;
        Ok(doc)
    }

    /// Checks every rule and reports all violations, each with its JSON path.
    pub fn validate(&self) -> Result<(), ValidationErrors> {
        let mut errors = Vec::new();
        let mut err = |path: String, message: &str| {
            errors.push(FieldError {
                path,
                message: message.to_owned(),
            })
        };
        if self.version > MAX_VERSION {
            err(
                "version".into(),
                "must be at most 9007199254740991 (2^53 - 1), the largest integer JSON numbers hold exactly",
            );
        }
        if self.tenants.is_empty() {
            err("tenants".into(), "must contain at least one tenant");
        }
        let mut ids = HashSet::new();
        let mut hashes = HashSet::new();
        for (i, tenant) in self.tenants.iter().enumerate() {
            let path = format!("tenants[{i}]");
            if !ids.insert(tenant.id.as_str()) {
                err(format!("{path}.id"), "duplicate tenant id");
            }
            for (j, hash) in tenant.key_sha256.iter().enumerate() {
                if is_key_hash(hash) && !hashes.insert(hash.as_str()) {
                    err(
                        format!("{path}.key_sha256[{j}]"),
                        "duplicate key hash: a key belongs to one tenant",
                    );
                }
            }
            tenant.check(&path, &mut err);
        }
        let keys: usize = self.tenants.iter().map(|t| t.key_sha256.len()).sum();
        if keys > MAX_KEYS {
            err(
                "tenants".into(),
                "holds more than 4096 key hashes in all, the most a router compares per request",
            );
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(ValidationErrors(errors))
        }
    }

    /// The tenant with this id.
    pub fn tenant(&self, id: &str) -> Option<&Tenant> {
        self.tenants.iter().find(|t| t.id == id)
    }
}

// === impl Tenant ===

impl Tenant {
    fn check(&self, path: &str, err: &mut impl FnMut(String, &str)) {
        if !is_tenant_id(&self.id) {
            err(
                format!("{path}.id"),
                "must be 1 to 64 characters of [A-Za-z0-9._-], starting with a letter or digit",
            );
        } else if self.id == "other" {
            err(
                format!("{path}.id"),
                "`other` is reserved: it labels the metrics of the tenants outside the top N",
            );
        }
        for (j, hash) in self.key_sha256.iter().enumerate() {
            if !is_key_hash(hash) {
                err(
                    format!("{path}.key_sha256[{j}]"),
                    "must be 64 lowercase hex characters: the SHA-256 of a key, as `quantrouter tenants hash-key` prints it",
                );
            }
        }
        if !self.keys.is_empty() {
            err(
                format!("{path}.keys"),
                "plain keys are read only by `quantrouter tenants push`, which stores their hashes; store key_sha256 instead",
            );
        }
        self.limits.check(&format!("{path}.limits"), err);
        if let Some(q) = self.min_quality {
            if !(0.0..=1.0).contains(&q) {
                err(format!("{path}.min_quality"), "must be in [0, 1]");
            }
        }
        if let Some(t) = self.risk_tolerance {
            if !(0.0..=1.0).contains(&t) {
                err(format!("{path}.risk_tolerance"), "must be in [0, 1]");
            }
        }
        if let Some(allowed) = &self.allowed_profiles {
            if allowed.is_empty() {
                err(
                    format!("{path}.allowed_profiles"),
                    "must name at least one profile; omit it to allow every profile",
                );
            }
            for (j, id) in allowed.iter().enumerate() {
                if id.trim().is_empty() {
                    err(format!("{path}.allowed_profiles[{j}]"), "must not be empty");
                } else if allowed[..j].contains(id) {
                    err(
                        format!("{path}.allowed_profiles[{j}]"),
                        "duplicate profile id",
                    );
                }
            }
        }
    }

    /// Whether the tenant may use the profile with this id.
    pub fn allows(&self, profile: &str) -> bool {
        self.allowed_profiles
            .as_ref()
            .is_none_or(|allowed| allowed.iter().any(|p| p == profile))
    }
}

// === impl PrefixCache ===

impl PrefixCache {
    fn is_shared(&self) -> bool {
        *self == Self::Shared
    }
}

// === impl TenantKeys ===

impl TenantKeys {
    /// The keys of tenant `id` whose API keys have these SHA-256 digests.
    pub fn derive(id: &str, key_digests: &[[u8; 32]], prefix_cache: PrefixCache) -> Self {
        let mut digests = key_digests.to_vec();
        digests.sort_unstable();
        digests.dedup();
        let mut hasher = Sha256::new()
            .chain_update(b"quantrouter tenant\0")
            .chain_update(id.as_bytes())
            .chain_update(b"\0");
        for digest in &digests {
            hasher.update(digest);
        }
        let secret: [u8; 32] = hasher.finalize().into();
        let scope = KeyScope::from_digest(&derive(&secret, b"scope", None));
        let mut keys = Self {
            secret,
            scope,
            salt: None,
        };
        if prefix_cache == PrefixCache::Isolated {
            keys.salt = Some(hex(&derive(&secret, b"cache_salt", None)));
        }
        keys
    }

    /// Scopes the tenant's sessions, prefix tables and cached ratings.
    pub fn scope(&self) -> KeyScope {
        self.scope
    }

    /// vLLM's `cache_salt` for a request of an `isolated` tenant (`None` when `shared`): 256
    /// bits in hex, as vLLM asks for. A client that sends its own salt (to keep its users
    /// apart) gets one derived from both, so its requests stay apart from each other and
    /// from every other tenant's.
    pub fn cache_salt(&self, client: Option<&str>) -> Option<std::borrow::Cow<'_, str>> {
        let own = self.salt.as_deref()?;
        Some(match client {
            None => own.into(),
            Some(client) => hex(&derive(&self.secret, b"client cache_salt", Some(client))).into(),
        })
    }
}

impl std::fmt::Debug for TenantKeys {
    /// The secret and the salt stay out of logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TenantKeys")
            .field("isolated", &self.salt.is_some())
            .finish_non_exhaustive()
    }
}

/// A digest of `secret` for one `purpose`, and of `extra` if given.
fn derive(secret: &[u8; 32], purpose: &[u8], extra: Option<&str>) -> [u8; 32] {
    let mut hasher = Sha256::new()
        .chain_update(purpose)
        .chain_update(b"\0")
        .chain_update(secret);
    if let Some(extra) = extra {
        hasher.update(extra.as_bytes());
    }
    hasher.finalize().into()
}

// === impl TenantLimits ===

impl Default for TenantLimits {
    fn default() -> Self {
        Self {
            requests_per_minute: None,
            tokens_per_minute: None,
            budget_per_day: None,
            budget_per_month: None,
            soft_limit: default_soft_limit(),
        }
    }
}

impl TenantLimits {
    fn check(&self, path: &str, err: &mut impl FnMut(String, &str)) {
        for (name, value) in [
            ("requests_per_minute", self.requests_per_minute),
            ("tokens_per_minute", self.tokens_per_minute),
        ] {
            match value {
                Some(0) => err(
                    format!("{path}.{name}"),
                    "must be > 0; omit it for no limit",
                ),
                Some(v) if v > MAX_COUNT_LIMIT => err(
                    format!("{path}.{name}"),
                    "must be at most 9007199254740991 (2^53 - 1), the largest count Redis counters hold exactly",
                ),
                _ => {}
            }
        }
        for (name, value) in [
            ("budget_per_day", self.budget_per_day),
            ("budget_per_month", self.budget_per_month),
        ] {
            if let Some(v) = value {
                if !(v > 0.0 && v <= MAX_BUDGET) {
                    err(
                        format!("{path}.{name}"),
                        "must be > 0 and at most 1e9; omit it for no budget",
                    );
                }
            }
        }
        if !(self.soft_limit > 0.0 && self.soft_limit <= 1.0) {
            err(
                format!("{path}.soft_limit"),
                "must be in (0, 1]; 1 turns downgrading off",
            );
        }
    }
}

/// 80 % leaves a fifth of each limit to route cheaper before anything is refused.
fn default_soft_limit() -> f64 {
    0.8
}

// === impl TenantError ===

impl From<ProfileSetError> for TenantError {
    fn from(e: ProfileSetError) -> Self {
        match e {
            ProfileSetError::Parse { path, message } => TenantError::Parse {
                path,
                message: redact_strings(&message),
            },
            ProfileSetError::Invalid(errors) => TenantError::Invalid(errors),
        }
    }
}

/// A parse error's message without the string values it quotes (`invalid type: string "…"`):
/// the value may be a key pasted into the wrong field.
fn redact_strings(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut chars = message.chars();
    while let Some(c) = chars.next() {
        out.push(c);
        if c != '"' {
            continue;
        }
        out.push('…');
        while let Some(c) = chars.next() {
            match c {
                '\\' => {
                    chars.next();
                }
                '"' => {
                    out.push('"');
                    break;
                }
                _ => {}
            }
        }
    }
    out
}

const KEY_RULE: &str = "must be 1 to 256 visible ASCII characters (no spaces)";

/// Whether `key` can be an API key: 1 to [`MAX_KEY_BYTES`] visible ASCII characters. Anything
/// else (empty, whitespace, control or non-ASCII characters, too long) is refused before it
/// is hashed or compared.
pub fn is_valid_api_key(key: &str) -> bool {
    !key.is_empty() && key.len() <= MAX_KEY_BYTES && key.bytes().all(|b| b.is_ascii_graphic())
}

/// The lowercase hex SHA-256 of an API key, as documents store it.
pub fn hash_key(key: &str) -> String {
    hex(&Sha256::digest(key.as_bytes()))
}

/// The 32 bytes of a stored key hash, if it is one.
pub fn parse_key_hash(hash: &str) -> Option<[u8; 32]> {
    if !is_key_hash(hash) {
        return None;
    }
    let mut out = [0u8; 32];
    for (byte, pair) in out.iter_mut().zip(hash.as_bytes().chunks_exact(2)) {
        *byte = (nibble(pair[0])? << 4) | nibble(pair[1])?;
    }
    Some(out)
}

fn is_key_hash(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

fn nibble(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    }
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
    out
}

/// Tenant ids go into Redis keys, metric labels and log fields unquoted, hence the charset.
fn is_tenant_id(s: &str) -> bool {
    let mut bytes = s.bytes();
    s.len() <= 64
        && bytes.next().is_some_and(|b| b.is_ascii_alphanumeric())
        && bytes.all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

#[cfg(test)]
mod tests;
