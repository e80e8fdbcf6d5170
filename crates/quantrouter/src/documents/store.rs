//! The active document of one kind, and starting it: the one [`DocumentStore`] behind the
//! classifier and the tenants.
//!
//! A document is applied whole: a request loads the active value once, a reload validates a
//! new document completely before swapping it in, and an invalid one never replaces the last
//! good one. Redis outranks the file, which outranks what the router starts with.
//! [`start`] starts on Redis's document if it has a valid one within a second, else the
//! file's, then follows both.

use std::fmt::Debug;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use futures_util::future::BoxFuture;
use tokio::task::JoinHandle;

use super::follow::{self, document, stored_version, Follower};
use super::{Document, RedisStore, StoreError};
use crate::telemetry::ReloadResult;

/// How long start-up waits for Redis before starting on the file or what the store holds.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(1);

/// A kind of document a router keeps active, and how a stored one becomes what requests
/// load.
pub trait Kind: Debug + Send + Sync + 'static {
    /// The stored document.
    type Doc: Document;
    /// What requests load, built from a document.
    type Active: Debug + Send + Sync + 'static;
    /// Where the active value came from.
    type Source: Copy + Eq + Debug + Send + Sync + 'static;

    /// What the logs call it.
    const WHAT: &'static str;
    /// The sources a document is read from.
    const FILE: Self::Source;
    const REDIS: Self::Source;
    /// A large document is recognised as unchanged in Redis by its length and head, without
    /// reading it; a small one is compared whole.
    const LARGE: bool = false;

    /// Higher outranks lower.
    fn rank(source: Self::Source) -> u8;
    fn source(active: &Self::Active) -> Self::Source;
    fn version(active: &Self::Active) -> u64;
    /// What the logs show of an active value besides its version and source.
    fn summary(active: &Self::Active) -> String;
    /// Checks before the rank and version ones: a store that takes no documents, a document
    /// that is invalid for this kind.
    fn admit(&self, active: &Self::Active, doc: &Self::Doc) -> Result<(), Rejected<Self::Source>>;
    /// The value requests load from `doc`.
    fn build(
        &self,
        doc: &Self::Doc,
        source: Self::Source,
    ) -> Result<Self::Active, Rejected<Self::Source>>;
    /// A value became active (for a metric).
    fn applied(_active: &Self::Active) {}
    /// An offered document was applied, ignored (a lesser source) or rejected (for a
    /// metric).
    fn offered(_source: Self::Source, _result: ReloadResult) {}
}

/// Why an offered document was not applied.
#[derive(Debug, thiserror::Error)]
pub enum Rejected<S: Debug> {
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
    Outranked { offered: S, active: S },
    /// The store was started with this kind of document off.
    #[error("turned off at start-up")]
    Off,
}

/// The active value of one kind, swapped atomically on reload.
#[derive(Debug)]
pub struct DocumentStore<K: Kind> {
    current: ArcSwap<K::Active>,
    kind: K,
    /// Serialises `apply`, so a check against the active value and the swap are one step.
    applying: Mutex<()>,
}

/// Where a store's documents come from.
#[derive(Debug, Clone)]
pub struct Sources {
    /// A file, watched for edits; unreadable or invalid at start-up is an error: the
    /// operator asked for it.
    pub file: Option<PathBuf>,
    /// How often the file is checked for edits.
    pub file_interval: Duration,
    pub redis: Option<(crate::redis_conn::Redis, String)>,
    /// Re-read interval of the Redis key, the safety net for missed update messages.
    pub redis_poll: Duration,
}

/// A running store with the tasks that keep it up to date.
#[derive(Debug)]
pub struct Started<K: Kind> {
    pub store: Arc<DocumentStore<K>>,
    pub tasks: Vec<JoinHandle<()>>,
}

// === impl DocumentStore ===

impl<K: Kind> DocumentStore<K> {
    /// A store holding `active` until a document replaces it.
    pub fn holding(kind: K, active: impl Into<Arc<K::Active>>) -> Self {
        let active = active.into();
        K::applied(&active);
        Self {
            current: ArcSwap::new(active),
            kind,
            applying: Mutex::new(()),
        }
    }

    /// The active value; a request keeps the one it loaded.
    pub fn load(&self) -> Arc<K::Active> {
        self.current.load_full()
    }

    pub fn kind(&self) -> &K {
        &self.kind
    }

    /// Swaps in `doc` unless it is invalid, older than the active document of the same
    /// source, or from a lesser source than the active one.
    pub fn apply(
        &self,
        doc: &K::Doc,
        source: K::Source,
        allow_same_version: bool,
    ) -> Result<(), Rejected<K::Source>> {
        let _serialised = self.applying.lock().unwrap_or_else(|e| e.into_inner());
        let active = self.current.load();
        self.kind.admit(&active, doc)?;
        let active_source = K::source(&active);
        if K::rank(source) < K::rank(active_source) {
            return Err(Rejected::Outranked {
                offered: source,
                active: active_source,
            });
        }
        let (offered, active_version) = (doc.version(), K::version(&active));
        let stale = active_source == source
            && if allow_same_version {
                offered < active_version
            } else {
                offered <= active_version
            };
        if stale {
            return Err(Rejected::Stale {
                offered,
                active: active_version,
            });
        }
        let next = self.kind.build(doc, source)?;
        K::applied(&next);
        self.current.store(Arc::new(next));
        Ok(())
    }

    /// Applies an offered document or keeps the active one; logs and counts either way.
    fn offer(
        &self,
        doc: Result<K::Doc, Rejected<K::Source>>,
        source: K::Source,
        allow_same_version: bool,
    ) -> bool {
        let result = doc.and_then(|doc| self.apply(&doc, source, allow_same_version));
        let what = K::WHAT;
        let outcome = match &result {
            Ok(()) => {
                let active = self.load();
                let version = K::version(&active);
                let summary = K::summary(&active);
                tracing::info!(version, ?source, %summary, "{what} applied");
                ReloadResult::Applied
            }
            Err(error @ Rejected::Outranked { .. }) => {
                tracing::info!(%error, ?source, "{what} not applied");
                ReloadResult::Ignored
            }
            Err(error) => {
                tracing::warn!(%error, ?source, "{what} rejected; keeping the active one");
                ReloadResult::Rejected
            }
        };
        K::offered(source, outcome);
        result.is_ok()
    }
}

/// A document file, read within the size limit and parsed.
pub fn read_file<D: Document, S: Debug>(path: &Path) -> Result<D, Rejected<S>> {
    let text = super::read_file(path).map_err(|source| Rejected::Read {
        path: path.to_owned(),
        source,
    })?;
    D::parse(&text).map_err(|e| Rejected::Invalid(format!("{}: {e}", path.display())))
}

/// Starts `store` on Redis's document if it has a valid one within a second, else the
/// file's, else what it holds; then follows the file and Redis.
pub async fn start<K: Kind>(
    store: DocumentStore<K>,
    sources: Sources,
) -> Result<Started<K>, Rejected<K::Source>> {
    let store = Arc::new(store);
    if let Some(path) = &sources.file {
        let doc = read_file(path)?;
        store.apply(&doc, K::FILE, true)?;
    }
    let mut tasks = Vec::new();
    if let Some((redis, prefix)) = &sources.redis {
        let at_start = tokio::time::timeout(STARTUP_TIMEOUT, async {
            let connected = RedisStore::<K::Doc>::connect(redis, prefix).await?;
            Follow::new(Arc::clone(&store)).refresh(&connected).await
        })
        .await;
        let why = match at_start {
            Ok(Ok(())) => None,
            Ok(Err(error)) => Some(error.to_string()),
            Err(_) => Some(format!("no answer within {STARTUP_TIMEOUT:?}")),
        };
        if let Some(error) = why {
            let what = K::WHAT;
            tracing::warn!(%error, redis = %redis.url(), "redis did not give the {what} at start-up; starting without it");
        }
        tasks.push(follow::spawn(
            redis.clone(),
            prefix.clone(),
            sources.redis_poll,
            Follow::new(Arc::clone(&store)),
        ));
    }
    if let Some(path) = sources.file {
        let store = Arc::clone(&store);
        tasks.push(super::file::watch(
            path,
            sources.file_interval,
            move |path| {
                store.offer(read_file(path), K::FILE, true);
            },
        ));
    }
    let active = store.load();
    let version = K::version(&active);
    let summary = K::summary(&active);
    let (what, source) = (K::WHAT, K::source(&active));
    tracing::info!(version, ?source, %summary, "{what} loaded");
    Ok(Started { store, tasks })
}

/// Applies the documents Redis holds to a store.
struct Follow<K: Kind> {
    store: Arc<DocumentStore<K>>,
    /// The last document handled, whole or (for a large one) its length and head: a
    /// rejected one is reported once, not every poll.
    seen: Option<Seen>,
    /// Why the key could not hold a document, when that was last reported.
    unreadable: Option<String>,
}

#[derive(PartialEq)]
enum Seen {
    Text(String),
    Fingerprint(usize, Vec<u8>),
}

impl<K: Kind> Follow<K> {
    fn new(store: Arc<DocumentStore<K>>) -> Self {
        Self {
            store,
            seen: None,
            unreadable: None,
        }
    }
}

impl<K: Kind> Follower for Follow<K> {
    type Doc = K::Doc;
    const WHAT: &'static str = K::WHAT;

    fn refresh<'a>(
        &'a mut self,
        redis: &'a RedisStore<K::Doc>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let mut fingerprint = None;
            if K::LARGE {
                fingerprint = match redis.fingerprint().await {
                    Ok(found) => found.map(|(len, head)| Seen::Fingerprint(len, head)),
                    Err(StoreError::NotADocument { .. }) => None,
                    Err(error) => return Err(error),
                };
                if fingerprint.is_some() && fingerprint == self.seen {
                    return Ok(());
                }
            }
            let text = match document(redis.active_raw().await)? {
                None => return Ok(()),
                Some(Err(unreadable)) => {
                    if self.unreadable.as_deref() != Some(unreadable.as_str()) {
                        let reason = Rejected::Invalid(unreadable.clone());
                        self.store.offer(Err(reason), K::REDIS, false);
                        self.unreadable = Some(unreadable);
                    }
                    return Ok(());
                }
                Some(Ok(text)) => text,
            };
            self.unreadable = None;
            let seen = match K::LARGE {
                true => fingerprint,
                false => Some(Seen::Text(text.clone())),
            };
            if !K::LARGE && seen == self.seen {
                return Ok(());
            }
            let active = self.store.load();
            let applied = K::source(&active) == K::REDIS
                && stored_version(&text) == Some(K::version(&active));
            if !applied {
                let doc = K::Doc::parse(&text).map_err(Rejected::Invalid);
                self.store.offer(doc, K::REDIS, false);
            }
            self.seen = seen;
            Ok(())
        })
    }
}
