//! Versioned JSON documents kept in Redis: profile sets and classifier models (each kind's
//! [`Document`] impl lives with it, in `profiles` and `classifier`).
//!
//! Each kind of document lives under `<prefix>:<key>` (the active document),
//! `<prefix>:<key>:history` (previous documents, newest first, capped) and the pub/sub channel
//! `<prefix>:<key>:updates` (the new version after each push). Operators push with
//! compare-and-set on `version` ([`RedisStore`]); routers follow the active document
//! ([`follow`]) and never let an invalid one replace the last good one.

pub mod file;
pub mod follow;
pub mod redis;

pub use redis::{client, ClientError, HistoryEntry, RedisStore, StoreError};

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
    pub fn new(prefix: &str, key: &str) -> Self {
        Self {
            active: format!("{prefix}:{key}"),
            history: format!("{prefix}:{key}:history"),
            channel: format!("{prefix}:{key}:updates"),
        }
    }
}
