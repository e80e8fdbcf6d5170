//! A kind of document in Redis: the active document, its history and the
//! update channel, and the atomic operations operators use on them.

use std::marker::PhantomData;
use std::time::Duration;

use quantrouter_policy::MAX_VERSION;
use redis::AsyncCommands;

use super::{Document, Keys};
use crate::redis_conn::{Conn, Redis};

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

/// Copies a document kind's active document and history from the layout before hash tags
/// (`<prefix>:<key>`, `<prefix>:<key>:history`) to the current one, if the current one has
/// no document yet: routers and operators of an upgraded version find what was pushed
/// before. KEYS: the current active and history keys, then the former ones. A single
/// server or Sentinel master only (a cluster never held the former layout).
const MIGRATE_SCRIPT: &str = r#"
if redis.call('EXISTS', KEYS[1]) == 1 or redis.call('TYPE', KEYS[3]).ok ~= 'string' then
  return 0
end
redis.call('SET', KEYS[1], redis.call('GET', KEYS[3]))
if redis.call('EXISTS', KEYS[2]) == 0 and redis.call('TYPE', KEYS[4]).ok == 'list' then
  for _, entry in ipairs(redis.call('LRANGE', KEYS[4], 0, -1)) do
    redis.call('RPUSH', KEYS[2], entry)
  end
end
return 1
"#;

/// A connection to the keys of documents of kind `D`.
#[derive(Debug)]
pub struct RedisStore<D> {
    conn: Conn,
    keys: Keys,
    kind: PhantomData<fn() -> D>,
}

/// What can go wrong talking to Redis about documents.
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
    #[error("the document is invalid: {0}")]
    Invalid(String),
    /// The key holds something that cannot be a document (another type, or bytes that are
    /// not UTF-8): a bad document, not a broken connection.
    #[error("{key} does not hold a document: {why}")]
    NotADocument { key: String, why: &'static str },
    /// The key holds more than `--max-document-bytes`: not read, a bad document.
    #[error("{key} holds {}", super::too_large(*.bytes, *.limit))]
    TooLarge { key: String, bytes: u64, limit: u64 },
    /// The push was sent but its answer never came, and whether it was applied could not
    /// be read back.
    #[error("{0}; the push may have been applied: check with `get`")]
    Unconfirmed(Box<StoreError>),
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
    /// What [`Document::describe`] says of it.
    pub summary: String,
    pub document: String,
}

// === impl RedisStore ===

impl<D> Clone for RedisStore<D> {
    fn clone(&self) -> Self {
        Self {
            conn: self.conn.clone(),
            keys: self.keys.clone(),
            kind: PhantomData,
        }
    }
}

impl<D: Document> RedisStore<D> {
    /// Connects (and authenticates, when the URL carries credentials). On a single server
    /// or Sentinel master, a document kept in the former key layout is first copied to the
    /// current one ([`MIGRATE_SCRIPT`]).
    pub async fn connect(redis: &Redis, prefix: &str) -> Result<Self, StoreError> {
        let conn = timed(redis.connect()).await??;
        let store = Self {
            conn,
            keys: Keys::new(prefix, D::KEY),
            kind: PhantomData,
        };
        if !redis.url().is_cluster() {
            // A user that may not run scripts can still read: the copy is only a convenience.
            if let Err(error) = store.migrate(prefix).await {
                tracing::warn!(%error, key = %store.keys.active, "document of the former key layout not copied");
            }
        }
        Ok(store)
    }

    async fn migrate(&self, prefix: &str) -> Result<(), StoreError> {
        let former = Keys::former(prefix, D::KEY);
        let script = redis::Script::new(MIGRATE_SCRIPT);
        let mut invocation = script.key(&self.keys.active);
        invocation
            .key(&self.keys.history)
            .key(&former.active)
            .key(&former.history);
        let mut conn = self.conn.clone();
        let copied: i64 = timed(invocation.invoke_async(&mut conn)).await??;
        if copied == 1 {
            tracing::info!(
                from = %former.active,
                to = %self.keys.active,
                "document copied from the former key layout"
            );
        }
        Ok(())
    }

    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// The active document as stored, if any.
    pub async fn active_raw(&self) -> Result<Option<String>, StoreError> {
        self.raw(&self.keys.active).await
    }

    /// Any key's string value (the seed-format profile key lives outside the prefix), if
    /// it is at most `--max-document-bytes` long: its length and at most that many bytes
    /// (and one more) are read in one round trip, so a huge value is never read whole. A
    /// push between the two is seen in the bytes, which are checked too.
    pub async fn raw(&self, key: &str) -> Result<Option<String>, StoreError> {
        let mut conn = self.conn.clone();
        let not_a_document = |why| StoreError::NotADocument {
            key: key.to_owned(),
            why,
        };
        let limit = super::max_bytes();
        let mut pipe = redis::pipe();
        pipe.strlen(key)
            .getrange(key, 0, isize::try_from(limit).unwrap_or(isize::MAX));
        let (len, bytes): (u64, Vec<u8>) = match timed(pipe.query_async(&mut conn)).await? {
            Ok(answer) => answer,
            Err(e) if wrong_type(&e) => {
                return Err(not_a_document("it holds another type than a string"))
            }
            Err(e) => return Err(e.into()),
        };
        if len == 0 && bytes.is_empty() {
            return Ok(None);
        }
        if len > limit || bytes.len() as u64 > limit {
            return Err(StoreError::TooLarge {
                key: key.to_owned(),
                bytes: len,
                limit,
            });
        }
        String::from_utf8(bytes)
            .map(Some)
            .map_err(|_| not_a_document("it is not UTF-8 text"))
    }

    /// The length and first bytes of the active document: enough to tell, without reading
    /// a large document, that it has not changed since it was last read (a push rewrites the
    /// version near its start).
    pub async fn fingerprint(&self) -> Result<Option<(usize, Vec<u8>)>, StoreError> {
        const HEAD: isize = 255;
        let mut conn = self.conn.clone();
        let mut pipe = redis::pipe();
        pipe.strlen(&self.keys.active)
            .getrange(&self.keys.active, 0, HEAD);
        let answer: Result<(usize, Vec<u8>), redis::RedisError> =
            timed(pipe.query_async(&mut conn)).await?;
        match answer {
            Ok((0, _)) => Ok(None),
            Ok(found) => Ok(Some(found)),
            Err(e) if wrong_type(&e) => Err(StoreError::NotADocument {
                key: self.keys.active.clone(),
                why: "it holds another type than a string",
            }),
            Err(e) => Err(e.into()),
        }
    }

    /// The active document, validated.
    pub async fn active(&self) -> Result<Option<D>, StoreError> {
        match self.active_raw().await? {
            None => Ok(None),
            Some(text) => D::parse(&text).map(Some).map_err(StoreError::Invalid),
        }
    }

    /// Writes `doc` as the next version after the active one (`active + 1`, or its own
    /// version, at least 1, when Redis holds none) with compare-and-set; returns the new
    /// version.
    pub async fn push(&self, mut doc: D) -> Result<u64, StoreError> {
        let expected = match self.active_raw().await? {
            Some(text) => version_of(&text),
            None => -1,
        };
        if expected >= 0 {
            doc.set_version(expected as u64 + 1);
        } else if doc.version() == 0 {
            // Versions start at 1: 0 is what a freshly trained, never pushed model carries.
            doc.set_version(1);
        }
        self.push_expecting(&doc, expected).await
    }

    /// Compare-and-set: writes `doc` only if the active version is `expected` (-1: none).
    /// The document is validated first, as stored: what Redis holds must be a document
    /// every router accepts (a version past [`MAX_VERSION`] would come back rounded and
    /// break the next push).
    pub async fn push_expecting(&self, doc: &D, expected: i64) -> Result<u64, StoreError> {
        if expected > MAX_VERSION as i64 {
            return Err(StoreError::Invalid(format!(
                "version: the expected version {expected} is past {MAX_VERSION}"
            )));
        }
        let document = doc.to_json().map_err(StoreError::Invalid)?;
        let limit = super::max_bytes();
        if document.len() as u64 > limit {
            return Err(StoreError::TooLarge {
                key: self.keys.active.clone(),
                bytes: document.len() as u64,
                limit,
            });
        }
        D::parse(&document).map_err(StoreError::Invalid)?;
        let mut conn = self.conn.clone();
        let script = redis::Script::new(PUSH_SCRIPT);
        let mut invocation = script.key(&self.keys.active);
        invocation
            .key(&self.keys.history)
            .arg(expected)
            .arg(&document)
            .arg(doc.version())
            .arg(D::HISTORY_CAP)
            .arg(&self.keys.channel);
        let answer: Result<(i64, i64), StoreError> = timed(invocation.invoke_async(&mut conn))
            .await
            .and_then(|answer| answer.map_err(StoreError::from));
        let (written, version) = match answer {
            Ok(answer) => answer,
            Err(lost @ (StoreError::Timeout(_) | StoreError::Redis(_))) => {
                // The script may have run though its answer was lost: what Redis holds now
                // says whether the push happened.
                return match self.active_raw().await {
                    Ok(Some(active)) if active == document => Ok(doc.version()),
                    Ok(_) => Err(lost),
                    Err(_) => Err(StoreError::Unconfirmed(Box::new(lost))),
                };
            }
            Err(other) => return Err(other),
        };
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
                    summary: D::describe(&value),
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
        let doc = D::parse(&entry.document).map_err(StoreError::Invalid)?;
        self.push(doc).await
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

/// Whether Redis refused a command (or one of a pipeline's) for the key's type.
fn wrong_type(e: &redis::RedisError) -> bool {
    // A pipeline's server errors carry no code of their own.
    e.code() == Some("WRONGTYPE")
        || e.clone()
            .into_server_errors()
            .is_some_and(|errors| errors.iter().any(|(_, e)| e.code() == "WRONGTYPE"))
}

async fn timed<F: std::future::Future>(future: F) -> Result<F::Output, StoreError> {
    tokio::time::timeout(CALL_TIMEOUT, future)
        .await
        .map_err(|_| StoreError::Timeout(CALL_TIMEOUT))
}
