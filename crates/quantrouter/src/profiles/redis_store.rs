//! The profile set in Redis (SPEC §3): the active document, its history and the update
//! channel, and the atomic operations operators use on them.
//!
//! Keys under a configurable prefix (default `quantrouter`):
//! - `<prefix>:profiles` — the active document (JSON);
//! - `<prefix>:profiles:history` — previous documents, newest first, capped at 50;
//! - channel `<prefix>:profiles:updates` — a message with the new version after each push.

use std::path::{Path, PathBuf};
use std::time::Duration;

use quantrouter_policy::{ProfileSet, ProfileSetError, ValidationErrors, MAX_VERSION};
use redis::aio::MultiplexedConnection;
use redis::AsyncCommands;

/// Previous documents kept for rollback; enough for weeks of daily pushes.
pub const HISTORY_CAP: usize = 50;

/// Redis calls never wait longer than this: a router must not stall on Redis, and an
/// operator should get an answer quickly.
const CALL_TIMEOUT: Duration = Duration::from_secs(3);

/// Replaces the active document only if its version is still the one the caller read, so two
/// operators cannot overwrite each other silently; moves the old document onto the capped
/// history and announces the new version, all in one atomic step.
const PUSH_SCRIPT: &str = r#"
local current = redis.call('GET', KEYS[1])
local current_version = -1
if current then
  local ok, doc = pcall(cjson.decode, current)
  if ok and type(doc) == 'table' and type(doc['version']) == 'number' then
    current_version = doc['version']
  else
    current_version = -2
  end
end
if current_version ~= tonumber(ARGV[1]) then
  return {0, current_version}
end
if current then
  redis.call('LPUSH', KEYS[2], current)
  redis.call('LTRIM', KEYS[2], 0, tonumber(ARGV[4]) - 1)
end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('PUBLISH', ARGV[5], ARGV[3])
return {1, tonumber(ARGV[3])}
"#;

/// Key names under one prefix.
#[derive(Debug, Clone)]
pub struct Keys {
    pub active: String,
    pub history: String,
    pub channel: String,
}

/// A connection to the profile keys.
#[derive(Debug, Clone)]
pub struct RedisStore {
    conn: MultiplexedConnection,
    keys: Keys,
}

/// What can go wrong talking to Redis about profiles.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
    #[error(
        "the active document changed (now version {active}) since it was read; nothing was written"
    )]
    Conflict { active: i64 },
    #[error("the document in redis is invalid: {0}")]
    Invalid(ProfileSetError),
    /// The key holds something that cannot be a document (another type, or bytes that are
    /// not UTF-8): a bad document, not a broken connection.
    #[error("{key} does not hold a profile document: {why}")]
    NotADocument { key: String, why: &'static str },
    #[error("no version {0} in the history")]
    NotInHistory(u64),
    #[error("the history is empty")]
    EmptyHistory,
}

/// One history entry.
#[derive(Debug, Clone)]
pub struct HistoryEntry {
    pub version: u64,
    pub updated_at: Option<String>,
    pub profiles: usize,
    pub document: String,
}

/// A Redis client for `redis://` or `rediss://` URLs (credentials in the URL).
///
/// `rediss://` verifies the server against the system roots, or only against `ca_file`
/// (PEM) when one is given, as for a private CA. Nothing connects until first use.
pub fn client(url: &str, ca_file: Option<&Path>) -> Result<redis::Client, ClientError> {
    crate::tls::install_crypto_provider();
    let Some(path) = ca_file else {
        return redis::Client::open(url).map_err(ClientError::Url);
    };
    if !url.starts_with("rediss://") {
        return Err(ClientError::CaWithoutTls);
    }
    let root_cert = std::fs::read(path).map_err(|source| ClientError::ReadCa {
        path: path.to_owned(),
        source,
    })?;
    let certificates = redis::TlsCertificates {
        client_tls: None,
        root_cert: Some(root_cert),
    };
    redis::Client::build_with_tls(url, certificates).map_err(ClientError::Url)
}

/// Why a Redis client could not be configured (before any connection attempt).
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("--redis-url: {0}")]
    Url(redis::RedisError),
    #[error("--redis-ca-file needs a rediss:// URL")]
    CaWithoutTls,
    #[error("--redis-ca-file {path}: {source}")]
    ReadCa {
        path: PathBuf,
        source: std::io::Error,
    },
}

// === impl Keys ===

impl Keys {
    pub fn new(prefix: &str) -> Self {
        Self {
            active: format!("{prefix}:profiles"),
            history: format!("{prefix}:profiles:history"),
            channel: format!("{prefix}:profiles:updates"),
        }
    }
}

// === impl RedisStore ===

impl RedisStore {
    /// Connects (and authenticates, when the URL carries credentials).
    pub async fn connect(client: &redis::Client, prefix: &str) -> Result<Self, StoreError> {
        let conn = timed(client.get_multiplexed_async_connection()).await??;
        Ok(Self {
            conn,
            keys: Keys::new(prefix),
        })
    }

    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// The active document as stored, if any.
    pub async fn active_raw(&self) -> Result<Option<String>, StoreError> {
        self.raw(&self.keys.active).await
    }

    /// Any key's string value (the seed-format key lives outside the prefix).
    pub async fn raw(&self, key: &str) -> Result<Option<String>, StoreError> {
        let mut conn = self.conn.clone();
        let not_a_document = |why| StoreError::NotADocument {
            key: key.to_owned(),
            why,
        };
        let bytes: Option<Vec<u8>> = match timed(conn.get(key)).await? {
            Ok(bytes) => bytes,
            Err(e) if e.code() == Some("WRONGTYPE") => {
                return Err(not_a_document("it holds another type than a string"))
            }
            Err(e) => return Err(e.into()),
        };
        bytes
            .map(String::from_utf8)
            .transpose()
            .map_err(|_| not_a_document("it is not UTF-8 text"))
    }

    /// The active document, validated.
    pub async fn active(&self) -> Result<Option<ProfileSet>, StoreError> {
        match self.active_raw().await? {
            None => Ok(None),
            Some(text) => ProfileSet::from_json(&text)
                .map(Some)
                .map_err(StoreError::Invalid),
        }
    }

    /// Writes `set` as the next version after the active one (`active + 1`, or its own
    /// version when Redis holds none) with compare-and-set; returns the new version.
    pub async fn push(&self, mut set: ProfileSet) -> Result<u64, StoreError> {
        let expected = match self.active_raw().await? {
            Some(text) => version_of(&text),
            None => -1,
        };
        if expected >= 0 {
            set.version = expected as u64 + 1;
        }
        self.push_expecting(&set, expected).await
    }

    /// Compare-and-set: writes `set` only if the active version is `expected` (-1: none).
    /// The set is validated first: what Redis holds must be a document every router accepts
    /// (a version past [`MAX_VERSION`] would come back rounded and break the next push).
    pub async fn push_expecting(&self, set: &ProfileSet, expected: i64) -> Result<u64, StoreError> {
        set.validate()
            .map_err(|e| StoreError::Invalid(ProfileSetError::Invalid(e)))?;
        if expected > MAX_VERSION as i64 {
            return Err(StoreError::Invalid(ProfileSetError::Invalid(
                ValidationErrors(vec![quantrouter_policy::FieldError {
                    path: "version".into(),
                    message: format!("the expected version {expected} is past {MAX_VERSION}"),
                }]),
            )));
        }
        let document = serde_json::to_string_pretty(set).map_err(|e| {
            StoreError::Invalid(ProfileSetError::Parse {
                path: "$".into(),
                message: e.to_string(),
            })
        })?;
        let mut conn = self.conn.clone();
        let script = redis::Script::new(PUSH_SCRIPT);
        let mut invocation = script.key(&self.keys.active);
        invocation
            .key(&self.keys.history)
            .arg(expected)
            .arg(&document)
            .arg(set.version)
            .arg(HISTORY_CAP)
            .arg(&self.keys.channel);
        let (written, version): (i64, i64) = timed(invocation.invoke_async(&mut conn)).await??;
        if written == 1 {
            Ok(version as u64)
        } else {
            Err(StoreError::Conflict { active: version })
        }
    }

    /// Previous documents, newest first.
    pub async fn history(&self) -> Result<Vec<HistoryEntry>, StoreError> {
        let mut conn = self.conn.clone();
        let docs: Vec<String> = timed(conn.lrange(&self.keys.history, 0, -1)).await??;
        Ok(docs
            .into_iter()
            .map(|document| {
                let value: serde_json::Value = serde_json::from_str(&document).unwrap_or_default();
                HistoryEntry {
                    version: value["version"].as_u64().unwrap_or_default(),
                    updated_at: value["updated_at"].as_str().map(str::to_owned),
                    profiles: value["profiles"].as_array().map_or(0, Vec::len),
                    document,
                }
            })
            .collect())
    }

    /// Re-publishes a previous document (the newest, or version `to`) as a new version.
    pub async fn rollback(&self, to: Option<u64>) -> Result<u64, StoreError> {
        let history = self.history().await?;
        let entry = match to {
            Some(v) => history
                .iter()
                .find(|e| e.version == v)
                .ok_or(StoreError::NotInHistory(v))?,
            None => history.first().ok_or(StoreError::EmptyHistory)?,
        };
        let set = ProfileSet::from_json(&entry.document).map_err(StoreError::Invalid)?;
        self.push(set).await
    }
}

/// The `version` of a stored document; -2 when it has none (so a compare-and-set against it
/// fails rather than silently replacing an unreadable document).
fn version_of(text: &str) -> i64 {
    serde_json::from_str::<serde_json::Value>(text)
        .ok()
        .and_then(|v| v["version"].as_i64())
        .unwrap_or(-2)
}

async fn timed<F: std::future::Future>(future: F) -> Result<F::Output, StoreError> {
    tokio::time::timeout(CALL_TIMEOUT, future)
        .await
        .map_err(|_| StoreError::Timeout(CALL_TIMEOUT))
}
