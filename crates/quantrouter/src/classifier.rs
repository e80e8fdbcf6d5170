//! The prompt classifier a router scores with, and where it comes from: built into the
//! binary, a watched file (`--classifier FILE`) or Redis (`<prefix>:classifier`).
//!
//! Like profile sets, a model is applied whole: a request loads the active one once, a
//! reload validates a new document completely (format, sizes, digest) before swapping it in,
//! and an invalid one never replaces the last good model. Redis outranks the file, which
//! outranks the built-in model. `--classifier off` routes on the structural score alone.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use futures_util::future::BoxFuture;
use quantrouter_policy::classifier::TrainingMetrics;
use quantrouter_policy::{Classifier, ClassifierDocument, DEFAULT_CLASSIFIER};
use serde::Serialize;
use tokio::task::JoinHandle;

use crate::documents::follow::{self, document, stored_version, Follower};
use crate::documents::{Document, RedisStore, StoreError};
use crate::telemetry::{self, ReloadResult};

/// Where the active model came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ClassifierSource {
    Builtin,
    File,
    Redis,
    /// `--classifier off`: no model, the structural score alone.
    Off,
}

/// The model requests are scored with, and what `/admin/classifier` shows of it.
#[derive(Debug)]
pub struct ActiveClassifier {
    pub model: Option<Classifier>,
    pub version: u64,
    pub sha256: String,
    pub metrics: TrainingMetrics,
    pub source: ClassifierSource,
    pub loaded_at: SystemTime,
}

/// The active model, swapped atomically on reload.
#[derive(Debug)]
pub struct ClassifierStore {
    current: ArcSwap<ActiveClassifier>,
    /// Serialises `apply`, so a check against the active model and the swap are one step.
    applying: Mutex<()>,
}

/// Why an offered model was not applied.
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
    #[error("a model from {offered:?} does not replace the active one from {active:?}")]
    Outranked {
        offered: ClassifierSource,
        active: ClassifierSource,
    },
    #[error("the classifier is off")]
    Off,
}

/// Where a router takes its model from.
#[derive(Debug, Clone)]
pub struct ClassifierConfig {
    /// `None`: the built-in model unless Redis holds one.
    pub file: Option<PathBuf>,
    pub off: bool,
    /// How often the file is checked for edits.
    pub file_interval: Duration,
    pub redis: Option<(redis::Client, String)>,
    /// Re-read interval of the Redis key, the safety net for missed update messages.
    pub redis_poll: Duration,
}

/// How long start-up waits for Redis before starting on the file or built-in model.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(1);

// === impl ClassifierSource ===

impl ClassifierSource {
    fn rank(self) -> u8 {
        match self {
            Self::Off | Self::Builtin => 0,
            Self::File => 1,
            Self::Redis => 2,
        }
    }

    fn label(self) -> &'static str {
        match self {
            Self::Builtin => "builtin",
            Self::File => "file",
            Self::Redis => "redis",
            Self::Off => "off",
        }
    }
}

// === impl ActiveClassifier ===

impl ActiveClassifier {
    /// A validated document as the model to score with.
    pub fn from_document(
        doc: &ClassifierDocument,
        source: ClassifierSource,
    ) -> Result<Self, RejectReason> {
        let model = doc
            .classifier()
            .map_err(|e| RejectReason::Invalid(e.to_string()))?;
        Ok(Self {
            model: Some(model),
            version: doc.version,
            sha256: doc.sha256.clone(),
            metrics: doc.metrics.clone(),
            source,
            loaded_at: SystemTime::now(),
        })
    }

    fn off() -> Self {
        Self {
            model: None,
            version: 0,
            sha256: String::new(),
            metrics: TrainingMetrics::default(),
            source: ClassifierSource::Off,
            loaded_at: SystemTime::now(),
        }
    }

    /// What `/admin/classifier` answers.
    pub fn describe(&self) -> serde_json::Value {
        let loaded_at = self
            .loaded_at
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        serde_json::json!({
            "active": self.model.is_some(),
            "version": self.version,
            "sha256": self.sha256,
            "source": self.source,
            "loaded_at_unix": loaded_at,
            "weight_bytes": self.model.as_ref().map_or(0, Classifier::weight_bytes),
            "metrics": self.metrics,
        })
    }
}

// === impl Document for ClassifierDocument ===

impl Document for ClassifierDocument {
    const KEY: &'static str = "classifier";
    /// A model is about 1.4 MB of JSON; ten of them are plenty to roll back a bad retrain.
    const HISTORY_CAP: usize = 10;

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
        Ok(ClassifierDocument::to_json(self))
    }

    fn describe(document: &serde_json::Value) -> String {
        let sha = document["sha256"].as_str().unwrap_or_default();
        let dev = &document["metrics"]["dev"];
        let pct = |v: &serde_json::Value| {
            v.as_f64()
                .map_or("-".to_owned(), |v| format!("{:.1}%", 100.0 * v))
        };
        format!(
            "sha256 {}  dev: class accuracy {}, heavy->cheapest {}, light->cheapest {}",
            sha.get(..12).unwrap_or(sha),
            pct(&dev["task_class_accuracy"]),
            pct(&dev["heavy_to_cheapest"]),
            pct(&dev["light_to_cheapest"])
        )
    }
}

/// The built-in model, parsed and checked once per process.
fn builtin() -> Result<Arc<ActiveClassifier>, RejectReason> {
    static BUILTIN: OnceLock<Result<Arc<ActiveClassifier>, String>> = OnceLock::new();
    BUILTIN
        .get_or_init(|| {
            let doc =
                ClassifierDocument::from_json(DEFAULT_CLASSIFIER).map_err(|e| e.to_string())?;
            ActiveClassifier::from_document(&doc, ClassifierSource::Builtin)
                .map(Arc::new)
                .map_err(|e| e.to_string())
        })
        .clone()
        .map_err(RejectReason::Invalid)
}

// === impl ClassifierStore ===

impl Default for ClassifierStore {
    /// The built-in model (off, should it fail to load: a build that cannot is caught by
    /// the crate's tests).
    fn default() -> Self {
        let active = builtin().unwrap_or_else(|error| {
            tracing::error!(%error, "the built-in classifier is invalid; routing on the structural score");
            Arc::new(ActiveClassifier::off())
        });
        Self::with(active)
    }
}

impl ClassifierStore {
    fn with(active: Arc<ActiveClassifier>) -> Self {
        telemetry::classifier_applied(active.version);
        Self {
            current: ArcSwap::new(active),
            applying: Mutex::new(()),
        }
    }

    /// No model: the structural score alone.
    pub fn off() -> Self {
        Self::with(Arc::new(ActiveClassifier::off()))
    }

    pub fn load(&self) -> Arc<ActiveClassifier> {
        self.current.load_full()
    }

    /// Swaps in `doc` unless it is invalid, older than the active model of the same
    /// source, or from a lesser source than the active one.
    pub fn apply(
        &self,
        doc: &ClassifierDocument,
        source: ClassifierSource,
        allow_same_version: bool,
    ) -> Result<(), RejectReason> {
        let _serialised = self.applying.lock().unwrap_or_else(|e| e.into_inner());
        let active = self.current.load();
        if active.source == ClassifierSource::Off {
            return Err(RejectReason::Off);
        }
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
        let next = ActiveClassifier::from_document(doc, source)?;
        telemetry::classifier_applied(next.version);
        self.current.store(Arc::new(next));
        Ok(())
    }
}

/// A running store with the tasks that keep it up to date.
#[derive(Debug)]
pub struct Started {
    pub store: Arc<ClassifierStore>,
    pub tasks: Vec<JoinHandle<()>>,
}

/// Starts on Redis's model if it has a valid one within a second, else the file's, else the
/// built-in one; then follows the file and Redis. An unreadable or invalid `--classifier`
/// file at start-up is an error: the operator asked for that model.
pub async fn start(config: ClassifierConfig) -> Result<Started, RejectReason> {
    if config.off {
        tracing::info!("classifier off: routing on the structural score");
        return Ok(Started {
            store: Arc::new(ClassifierStore::off()),
            tasks: Vec::new(),
        });
    }
    let store = Arc::new(ClassifierStore::with(builtin()?));
    if let Some(path) = &config.file {
        let doc = read_file(path)?;
        store.apply(&doc, ClassifierSource::File, true)?;
    }
    let mut tasks = Vec::new();
    if let Some((client, prefix)) = &config.redis {
        let at_start = tokio::time::timeout(STARTUP_TIMEOUT, async {
            let redis = RedisStore::<ClassifierDocument>::connect(client, prefix).await?;
            let mut follower = ClassifierFollower::new(Arc::clone(&store));
            follower.refresh(&redis).await
        })
        .await;
        if !matches!(at_start, Ok(Ok(()))) {
            tracing::warn!("redis did not give a classifier at start-up; starting without it");
        }
        let follower = ClassifierFollower::new(Arc::clone(&store));
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
                offer(&store, read_file(path), ClassifierSource::File, true);
            },
        ));
    }
    let active = store.load();
    tracing::info!(version = active.version, sha256 = %active.sha256, source = ?active.source, "classifier loaded");
    Ok(Started { store, tasks })
}

/// A model file, parsed and validated.
pub fn read_file(path: &Path) -> Result<ClassifierDocument, RejectReason> {
    let text = crate::documents::read_file(path).map_err(|source| RejectReason::Read {
        path: path.to_owned(),
        source,
    })?;
    ClassifierDocument::from_json(&text)
        .map_err(|e| RejectReason::Invalid(format!("{}: {e}", path.display())))
}

/// Applies an offered model or keeps the active one; logs and counts either way.
fn offer(
    store: &ClassifierStore,
    doc: Result<ClassifierDocument, RejectReason>,
    source: ClassifierSource,
    allow_same_version: bool,
) -> bool {
    let result = doc.and_then(|doc| store.apply(&doc, source, allow_same_version));
    let counted = match &result {
        Ok(()) => {
            let active = store.load();
            tracing::info!(version = active.version, sha256 = %active.sha256, ?source, "classifier applied");
            ReloadResult::Applied
        }
        Err(error @ RejectReason::Outranked { .. }) => {
            tracing::info!(%error, ?source, "classifier not applied");
            ReloadResult::Ignored
        }
        Err(error) => {
            tracing::warn!(%error, ?source, "classifier rejected; keeping the active model");
            ReloadResult::Rejected
        }
    };
    telemetry::classifier_reload(source.label(), counted);
    result.is_ok()
}

/// Applies the models Redis holds to a store.
struct ClassifierFollower {
    store: Arc<ClassifierStore>,
    /// Length and head of the last document handled: a model is about a megabyte, so an
    /// unchanged one is recognised without reading it.
    seen: Option<(usize, Vec<u8>)>,
    /// Why the key could not hold a document, when that was last reported.
    unreadable: Option<String>,
}

impl ClassifierFollower {
    fn new(store: Arc<ClassifierStore>) -> Self {
        Self {
            store,
            seen: None,
            unreadable: None,
        }
    }
}

impl Follower for ClassifierFollower {
    type Doc = ClassifierDocument;
    const WHAT: &'static str = "classifier";

    fn refresh<'a>(
        &'a mut self,
        redis: &'a RedisStore<ClassifierDocument>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let fingerprint = match redis.fingerprint().await {
                Ok(fingerprint) => fingerprint,
                Err(StoreError::NotADocument { .. }) => None,
                Err(error) => return Err(error),
            };
            if fingerprint.is_some() && fingerprint == self.seen {
                return Ok(());
            }
            let text = match document(redis.active_raw().await)? {
                None => return Ok(()),
                Some(Err(unreadable)) => {
                    if self.unreadable.as_deref() != Some(unreadable.as_str()) {
                        let reason = RejectReason::Invalid(unreadable.clone());
                        offer(&self.store, Err(reason), ClassifierSource::Redis, false);
                        self.unreadable = Some(unreadable);
                    }
                    return Ok(());
                }
                Some(Ok(text)) => text,
            };
            self.seen = fingerprint;
            self.unreadable = None;
            let active = self.store.load();
            let applied = active.source == ClassifierSource::Redis
                && stored_version(&text) == Some(active.version);
            if !applied {
                let doc = ClassifierDocument::from_json(&text)
                    .map_err(|e| RejectReason::Invalid(e.to_string()));
                offer(&self.store, doc, ClassifierSource::Redis, false);
            }
            Ok(())
        })
    }
}
