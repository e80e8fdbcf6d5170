//! The prompt classifier a router scores with, and where it comes from: built into the
//! binary, a watched file (`--classifier FILE`) or Redis (`<prefix>:classifier`).
//!
//! Like profile sets, a model is applied whole: a request loads the active one once, a
//! reload validates a new document completely (format, sizes, digest) before swapping it in,
//! and an invalid one never replaces the last good model. Redis outranks the file, which
//! outranks the built-in model. `--classifier off` routes on the structural score alone.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use quantrouter_policy::classifier::TrainingMetrics;
use quantrouter_policy::{Classifier, ClassifierDocument, DEFAULT_CLASSIFIER};
use serde::Serialize;

use crate::documents::store::{self, DocumentStore, Kind, Rejected, Sources};
use crate::documents::Document;
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
pub type ClassifierStore = DocumentStore<Models>;

/// Why an offered model was not applied.
pub type RejectReason = Rejected<ClassifierSource>;

/// A running store with the tasks that keep it up to date.
pub type Started = store::Started<Models>;

/// Classifier models as a kind of document a [`DocumentStore`] keeps active.
#[derive(Debug)]
pub struct Models;

/// Where a router takes its model from.
#[derive(Debug, Clone)]
pub struct ClassifierConfig {
    /// `None`: the built-in model unless Redis holds one.
    pub file: Option<PathBuf>,
    pub off: bool,
    /// How often the file is checked for edits.
    pub file_interval: Duration,
    pub redis: Option<(crate::redis_conn::Redis, String)>,
    /// Re-read interval of the Redis key, the safety net for missed update messages.
    pub redis_poll: Duration,
}

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
        Self::holding(Models, active)
    }
}

impl ClassifierStore {
    /// No model: the structural score alone.
    pub fn off() -> Self {
        Self::holding(Models, ActiveClassifier::off())
    }
}

// === impl Kind for Models ===

impl Kind for Models {
    type Doc = ClassifierDocument;
    type Active = ActiveClassifier;
    type Source = ClassifierSource;

    const WHAT: &'static str = "classifier";
    const FILE: ClassifierSource = ClassifierSource::File;
    const REDIS: ClassifierSource = ClassifierSource::Redis;
    /// A model is about a megabyte: an unchanged one is recognised without reading it.
    const LARGE: bool = true;

    fn rank(source: ClassifierSource) -> u8 {
        source.rank()
    }

    fn source(active: &ActiveClassifier) -> ClassifierSource {
        active.source
    }

    fn version(active: &ActiveClassifier) -> u64 {
        active.version
    }

    fn summary(active: &ActiveClassifier) -> String {
        format!("sha256 {}", active.sha256)
    }

    fn admit(&self, active: &ActiveClassifier, _: &ClassifierDocument) -> Result<(), RejectReason> {
        match active.source {
            ClassifierSource::Off => Err(RejectReason::Off),
            _ => Ok(()),
        }
    }

    fn build(
        &self,
        doc: &ClassifierDocument,
        source: ClassifierSource,
    ) -> Result<ActiveClassifier, RejectReason> {
        ActiveClassifier::from_document(doc, source)
    }

    fn applied(active: &ActiveClassifier) {
        telemetry::classifier_applied(active.version);
    }

    fn offered(source: ClassifierSource, result: ReloadResult) {
        telemetry::classifier_reload(source.label(), result);
    }
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
    let builtin = builtin()?;
    let sources = Sources {
        file: config.file,
        file_interval: config.file_interval,
        redis: config.redis,
        redis_poll: config.redis_poll,
    };
    store::start(ClassifierStore::holding(Models, builtin), sources).await
}

/// A model file, parsed and validated.
pub fn read_file(path: &Path) -> Result<ClassifierDocument, RejectReason> {
    store::read_file(path)
}
