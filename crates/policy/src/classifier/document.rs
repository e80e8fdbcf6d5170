//! The classifier as a versioned JSON document: what is pushed to Redis, watched in a file
//! and embedded in the binary.
//!
//! ```json
//! {"format": "quantrouter-classifier/1", "version": 3,
//!  "features": {"tokens": "words-lowercase-fnv1a", "bits": 15, "ngrams": [1, 2], "dense": [...]},
//!  "weights": {"encoding": "f32-le-base64", "task_classes": [...], "difficulty": [...],
//!              "blend": 0.8, "medium_weight": 0.5, "bias": [...], "dense": [[...]], "buckets": "..."},
//!  "sha256": "<hex of the canonical features + weights>", "metrics": {...}}
//! ```
//!
//! A document is applied only whole and valid: its format and feature settings must be the
//! ones this binary computes, every weight finite, the table the size `bits` says, and the
//! digest must match, so a truncated or hand-edited model never scores a request.

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use super::data::{Difficulty, LabelledPrompt, Split};
use super::eval::{EvalSummary, LosoSummary};
use super::grams::{DENSE, DENSE_FEATURES};
use super::outcome::OutcomeHead;
use super::routing_eval::OutcomeCrossValidation;
use super::{Classifier, CLASSES, LABELS, OUTPUTS, TASK_CLASSES};
use crate::features::TaskClass;

/// The one format this binary reads and writes.
pub const FORMAT: &str = "quantrouter-classifier/1";
const TOKENS: &str = "words-lowercase-fnv1a";
const ENCODING: &str = "f32-le-base64";
/// Table sizes a document may have: 2^16 rows of eight `f32` are 2 MiB.
const BITS: std::ops::RangeInclusive<u32> = 8..=16;
/// Versions must survive a round trip through Redis integers and JSON numbers (2^53 - 1).
pub const MAX_VERSION: u64 = (1 << 53) - 1;

/// A classifier model as stored and pushed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassifierDocument {
    pub format: String,
    /// Monotonic document version; a router never replaces a model with an older one.
    #[serde(default)]
    pub version: u64,
    /// When the document was written (RFC 3339), informational.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<String>,
    pub features: FeatureSettings,
    pub weights: EncodedWeights,
    /// Hex SHA-256 of the canonical JSON of `features` followed by `weights`.
    pub sha256: String,
    #[serde(default)]
    pub metrics: TrainingMetrics,
}

/// How the inputs are computed; must match what this binary does.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FeatureSettings {
    pub tokens: String,
    /// The hash table has `2^bits` rows.
    pub bits: u32,
    pub ngrams: Vec<u8>,
    pub dense: Vec<String>,
}

/// The weights, and how their outputs become a class and a complexity.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EncodedWeights {
    pub encoding: String,
    pub task_classes: Vec<TaskClass>,
    pub difficulty: Vec<String>,
    /// Share of the model's difficulty in the complexity; the rest is the structural score.
    pub blend: f64,
    /// What a medium prompt counts towards the difficulty (heavy 1, light 0).
    pub medium_weight: f64,
    pub bias: Vec<f32>,
    pub dense: Vec<Vec<f32>>,
    /// `2^bits × 8` little-endian `f32`, row by row, base64.
    pub buckets: String,
    /// The outcome head (`docs/routing.md` §1c); absent in a model trained without outcome
    /// records.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<OutcomeHead>,
}

/// How the model was trained and how it did; shown by `/admin/classifier`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainingMetrics {
    pub seed: u64,
    pub train_prompts: usize,
    pub dev_prompts: usize,
    /// Training prompts per difficulty label: heavy, medium, light.
    pub train_labels: [usize; LABELS],
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dev: Option<EvalSummary>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub leave_one_source_out: Option<LosoSummary>,
    /// Outcome records the outcome head was trained on.
    #[serde(skip_serializing_if = "is_zero")]
    pub outcome_records: usize,
    /// The outcome head's APGR on its own training records: above ½, or `classifier train`
    /// would not have written it (and `classifier push` refuses a document that says less).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub outcome_training_apgr: Option<f64>,
    /// Held-out-category figures of the outcome head (`--cross-validate category`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub outcomes: Option<OutcomeCrossValidation>,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// A document that must not be applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClassifierError {
    #[error("invalid classifier JSON at {path}: {message}")]
    Json { path: String, message: String },
    #[error("invalid classifier: {path}: {message}")]
    Invalid { path: String, message: String },
}

// === impl ClassifierDocument ===

impl ClassifierDocument {
    /// The document of a trained model (version 0: a push assigns the next version).
    pub(crate) fn new(
        model: &Classifier,
        features: FeatureSettings,
        metrics: TrainingMetrics,
    ) -> Self {
        let mut bytes = Vec::with_capacity(model.buckets.len() * OUTPUTS * 4);
        for row in &model.buckets {
            for w in row {
                bytes.extend_from_slice(&w.to_le_bytes());
            }
        }
        let weights = EncodedWeights {
            encoding: ENCODING.into(),
            task_classes: TASK_CLASSES.to_vec(),
            difficulty: Difficulty::ALL
                .iter()
                .map(|d| d.as_str().to_owned())
                .collect(),
            blend: model.blend,
            medium_weight: model.medium_weight,
            bias: model.bias.to_vec(),
            dense: model.dense.iter().map(|r| r.to_vec()).collect(),
            buckets: base64::engine::general_purpose::STANDARD.encode(&bytes),
            outcome: model.outcome.clone(),
        };
        let sha256 = digest(&features, &weights);
        Self {
            format: FORMAT.into(),
            version: 0,
            updated_at: None,
            features,
            weights,
            sha256,
            metrics,
        }
    }

    /// Parses and validates a document.
    pub fn from_json(json: &str) -> Result<Self, ClassifierError> {
        let de = &mut serde_json::Deserializer::from_str(json);
        let doc: Self =
            serde_path_to_error::deserialize(de).map_err(|e| ClassifierError::Json {
                path: e.path().to_string(),
                message: e.inner().to_string(),
            })?;
        doc.classifier()?;
        Ok(doc)
    }

    /// The model, after checking everything a router relies on.
    pub fn classifier(&self) -> Result<Classifier, ClassifierError> {
        let invalid = |path: &str, message: String| ClassifierError::Invalid {
            path: path.into(),
            message,
        };
        if self.format != FORMAT {
            return Err(invalid(
                "format",
                format!("`{}` is not `{FORMAT}`", self.format),
            ));
        }
        if self.version > MAX_VERSION {
            return Err(invalid("version", format!("must be at most {MAX_VERSION}")));
        }
        let expected = FeatureSettings::new(self.features.bits);
        if self.features.tokens != expected.tokens {
            return Err(invalid("features.tokens", format!("must be `{TOKENS}`")));
        }
        if !BITS.contains(&self.features.bits) {
            return Err(invalid(
                "features.bits",
                format!("must be in {}..={}", BITS.start(), BITS.end()),
            ));
        }
        if self.features.ngrams != expected.ngrams {
            return Err(invalid("features.ngrams", "must be [1, 2]".into()));
        }
        if self.features.dense != expected.dense {
            return Err(invalid(
                "features.dense",
                format!("must be {:?}", DENSE_FEATURES),
            ));
        }
        let w = &self.weights;
        if w.encoding != ENCODING {
            return Err(invalid("weights.encoding", format!("must be `{ENCODING}`")));
        }
        if w.task_classes != TASK_CLASSES {
            return Err(invalid(
                "weights.task_classes",
                format!("must be {:?}", TASK_CLASSES),
            ));
        }
        if !w
            .difficulty
            .iter()
            .map(String::as_str)
            .eq(Difficulty::ALL.iter().map(|d| d.as_str()))
        {
            return Err(invalid(
                "weights.difficulty",
                "must be [\"heavy\", \"medium\", \"light\"]".into(),
            ));
        }
        for (path, v) in [
            ("weights.blend", w.blend),
            ("weights.medium_weight", w.medium_weight),
        ] {
            if !(0.0..=1.0).contains(&v) {
                return Err(invalid(path, "must be in [0, 1]".into()));
            }
        }
        let bias = row(&w.bias)
            .ok_or_else(|| invalid("weights.bias", format!("must be {OUTPUTS} finite numbers")))?;
        if w.dense.len() != DENSE {
            return Err(invalid("weights.dense", format!("must have {DENSE} rows")));
        }
        let mut dense = [[0f32; OUTPUTS]; DENSE];
        for (i, (d, r)) in dense.iter_mut().zip(&w.dense).enumerate() {
            *d = row(r).ok_or_else(|| {
                invalid(
                    &format!("weights.dense[{i}]"),
                    format!("must be {OUTPUTS} finite numbers"),
                )
            })?;
        }
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(&w.buckets)
            .map_err(|e| invalid("weights.buckets", format!("not base64: {e}")))?;
        let rows = 1usize << self.features.bits;
        if bytes.len() != rows * OUTPUTS * 4 {
            return Err(invalid(
                "weights.buckets",
                format!(
                    "holds {} bytes, 2^{} rows need {}",
                    bytes.len(),
                    self.features.bits,
                    rows * OUTPUTS * 4
                ),
            ));
        }
        let mut buckets = vec![[0f32; OUTPUTS]; rows];
        for (r, chunk) in buckets.iter_mut().zip(bytes.chunks_exact(OUTPUTS * 4)) {
            for (w, b) in r.iter_mut().zip(chunk.chunks_exact(4)) {
                *w = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
            if !r.iter().all(|w| w.is_finite()) {
                return Err(invalid(
                    "weights.buckets",
                    "holds a weight that is not finite".into(),
                ));
            }
        }
        if let Some(head) = &w.outcome {
            head.check()
                .map_err(|(path, message)| invalid(path, message))?;
        }
        let actual = digest(&self.features, &self.weights);
        if actual != self.sha256.to_ascii_lowercase() {
            return Err(invalid(
                "sha256",
                format!("does not match the document (computed {actual})"),
            ));
        }
        Ok(Classifier {
            bits: self.features.bits,
            buckets,
            dense,
            bias,
            blend: w.blend,
            medium_weight: w.medium_weight,
            outcome: w.outcome.clone(),
        })
    }

    /// The document as JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

// === impl FeatureSettings ===

impl FeatureSettings {
    pub(crate) fn new(bits: u32) -> Self {
        Self {
            tokens: TOKENS.into(),
            bits,
            ngrams: vec![1, 2],
            dense: DENSE_FEATURES.iter().map(|s| (*s).to_owned()).collect(),
        }
    }
}

// === impl TrainingMetrics ===

impl TrainingMetrics {
    pub(crate) fn counted(data: &[LabelledPrompt], seed: u64) -> Self {
        let mut train_labels = [0; LABELS];
        for p in data.iter().filter(|p| p.split == Split::Train) {
            train_labels[p.label.index()] += 1;
        }
        Self {
            seed,
            train_prompts: train_labels.iter().sum(),
            dev_prompts: data.iter().filter(|p| p.split == Split::Dev).count(),
            train_labels,
            dev: None,
            leave_one_source_out: None,
            outcome_records: 0,
            outcome_training_apgr: None,
            outcomes: None,
        }
    }
}

fn row(values: &[f32]) -> Option<[f32; OUTPUTS]> {
    let row: [f32; OUTPUTS] = values.try_into().ok()?;
    row.iter().all(|w| w.is_finite()).then_some(row)
}

fn digest(features: &FeatureSettings, weights: &EncodedWeights) -> String {
    let mut hasher = Sha256::new();
    hasher.update(serde_json::to_vec(features).unwrap_or_default());
    hasher.update(serde_json::to_vec(weights).unwrap_or_default());
    hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

const _: () = assert!(CLASSES + LABELS == OUTPUTS);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::classifier::DEFAULT_CLASSIFIER;

    fn edited(
        edit: impl FnOnce(&mut serde_json::Value),
    ) -> Result<ClassifierDocument, ClassifierError> {
        let mut doc: serde_json::Value = serde_json::from_str(DEFAULT_CLASSIFIER).unwrap();
        edit(&mut doc);
        ClassifierDocument::from_json(&doc.to_string())
    }

    fn path_of(result: Result<ClassifierDocument, ClassifierError>) -> String {
        match result {
            Err(ClassifierError::Invalid { path, .. } | ClassifierError::Json { path, .. }) => path,
            Ok(_) => panic!("accepted"),
        }
    }

    #[test]
    fn each_problem_names_where_it_is() {
        assert_eq!(
            path_of(edited(|d| d["format"] = "quantrouter-classifier/9".into())),
            "format"
        );
        assert_eq!(
            path_of(edited(|d| d["version"] = serde_json::json!(MAX_VERSION + 1))),
            "version"
        );
        assert_eq!(
            path_of(edited(
                |d| d["features"]["ngrams"] = serde_json::json!([1, 2, 3])
            )),
            "features.ngrams"
        );
        assert_eq!(
            path_of(edited(|d| d["features"]["bits"] = serde_json::json!(20))),
            "features.bits"
        );
        assert_eq!(
            path_of(edited(|d| d["weights"]["bias"] = serde_json::json!([0.0]))),
            "weights.bias"
        );
        assert_eq!(
            path_of(edited(|d| d["weights"]["buckets"] = "AAAA".into())),
            "weights.buckets"
        );
        assert_eq!(
            path_of(edited(|d| d["weights"]["blend"] = serde_json::json!(0.5))),
            "sha256"
        );
        assert_eq!(
            path_of(edited(|d| d["extra"] = serde_json::json!(1))),
            "extra"
        );
        assert_eq!(
            path_of(edited(
                |d| d["weights"]["outcome"]["choices"]["weights"] = serde_json::json!([1.0])
            )),
            "weights.outcome.choices"
        );
        // A head of the twenty-input format, before the parts by kind of prompt.
        assert_eq!(
            path_of(edited(|d| {
                d["weights"]["outcome"]["free_form"] = serde_json::json!(vec![0.0; 20])
            })),
            "weights.outcome.free_form"
        );
        assert_eq!(
            path_of(edited(
                |d| d["weights"]["outcome"]["features"] = serde_json::json!(["length"])
            )),
            "weights.outcome.features"
        );
        assert!(edited(|d| d["version"] = serde_json::json!(MAX_VERSION)).is_ok());
    }

    #[test]
    fn a_digest_in_capitals_is_the_same_digest() {
        let doc = edited(|d| {
            let upper = d["sha256"].as_str().unwrap().to_ascii_uppercase();
            d["sha256"] = upper.into();
        });
        assert!(doc.is_ok());
    }
}
