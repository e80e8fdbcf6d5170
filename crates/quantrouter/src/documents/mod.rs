//! Versioned JSON documents kept in Redis and files: profile sets, classifier models and
//! tenant documents (each kind's [`Document`] impl lives with it, in `profiles`,
//! `classifier` and `tenants`). [`store::DocumentStore`] keeps a kind's active value and
//! starts following its sources.
//!
//! Each kind of document lives under `<prefix>:{<key>}` (the active document),
//! `<prefix>:{<key>}:history` (previous documents, newest first, capped) and the pub/sub
//! channel `<prefix>:{<key>}:updates` (the new version after each push); the hash tag keeps a
//! kind's keys in one Redis Cluster slot. Operators push with
//! compare-and-set on `version` ([`RedisStore`]); routers follow the active document
//! ([`follow`]) and never let an invalid one replace the last good one.

use std::io::Read;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

pub mod file;
pub mod follow;
pub mod redis;
pub mod store;

pub use redis::{HistoryEntry, RedisStore, StoreError};

/// The largest document read from a file or Redis, or pushed, unless `--max-document-bytes`
/// says otherwise. The largest classifier model (the most hashed rows `train` makes, as
/// base64 weights) is under 3 MiB; profile sets and tenant documents are kilobytes to a
/// few hundred. A bigger one is a mistake, or a way to fill every replica's memory.
pub const DEFAULT_MAX_BYTES: u64 = 8 * 1024 * 1024;

/// The limit in force: set once at start from the command line.
static MAX_BYTES: AtomicU64 = AtomicU64::new(DEFAULT_MAX_BYTES);

/// A kind of versioned document.
pub trait Document: Sized + Send + Sync + 'static {
    /// The key under the prefix.
    const KEY: &'static str;
    /// Previous documents kept for rollback.
    const HISTORY_CAP: usize;

    /// Parses and validates a stored document; the error names what is wrong and where.
    fn parse(text: &str) -> Result<Self, String>;
    fn version(&self) -> u64;
    fn set_version(&mut self, version: u64);
    /// The document as stored.
    fn to_json(&self) -> Result<String, String>;
    /// What `history` shows of a stored document besides its version and date.
    fn describe(document: &serde_json::Value) -> String;
}

/// Key names of one kind of document under one prefix.
#[derive(Debug, Clone)]
pub struct Keys {
    pub active: String,
    pub history: String,
    pub channel: String,
}

// === impl Keys ===

impl Keys {
    /// `<prefix>:{<key>}`, `<prefix>:{<key>}:history` and `<prefix>:{<key>}:updates`: the
    /// hash tag puts a kind's keys in one cluster slot, as its push script needs.
    pub fn new(prefix: &str, key: &str) -> Self {
        Self {
            active: format!("{prefix}:{{{key}}}"),
            history: format!("{prefix}:{{{key}}}:history"),
            channel: format!("{prefix}:{{{key}}}:updates"),
        }
    }

    /// The layout before hash tags: `<prefix>:<key>` and so on.
    pub fn former(prefix: &str, key: &str) -> Self {
        Self {
            active: format!("{prefix}:{key}"),
            history: format!("{prefix}:{key}:history"),
            channel: format!("{prefix}:{key}:updates"),
        }
    }
}

/// Sets the largest document read or pushed from now on (`--max-document-bytes`).
pub fn set_max_bytes(limit: u64) {
    MAX_BYTES.store(limit.max(1), Ordering::Relaxed);
}

/// The largest document read or pushed.
pub fn max_bytes() -> u64 {
    MAX_BYTES.load(Ordering::Relaxed)
}

/// Why a document is refused for its size alone.
pub fn too_large(bytes: u64, limit: u64) -> String {
    format!("{bytes} bytes, more than the document limit of {limit} (--max-document-bytes)")
}

/// A document file's text: a regular file (a FIFO or a device would wait for a writer, or
/// never end) of at most [`max_bytes`].
pub fn read_file(path: &Path) -> std::io::Result<String> {
    use std::io::{Error, ErrorKind};
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(Error::new(ErrorKind::InvalidInput, "not a regular file"));
    }
    let limit = max_bytes();
    if meta.len() > limit {
        return Err(Error::new(
            ErrorKind::InvalidData,
            too_large(meta.len(), limit),
        ));
    }
    // The file may grow between the size check and the read.
    let mut text = String::new();
    std::fs::File::open(path)?
        .take(limit.saturating_add(1))
        .read_to_string(&mut text)?;
    if text.len() as u64 > limit {
        return Err(Error::new(
            ErrorKind::InvalidData,
            too_large(text.len() as u64, limit),
        ));
    }
    Ok(text)
}
