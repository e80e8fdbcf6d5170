//! What a model's metrics keep of its evaluations ([`super::TrainingMetrics`]): the
//! labelled-prompt summaries of [`super::eval`] and the outcome cross-validation of
//! [`super::routing_eval`]. Plain data, so the model document can hold them without
//! depending on the code that measures them.

use serde::{Deserialize, Serialize};

/// The headline numbers of an evaluation, kept in a model's metrics.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvalSummary {
    pub prompts: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub task_class_accuracy: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub heavy_to_cheapest: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub light_to_cheapest: Option<f64>,
}

/// One held-out source.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SourceReport {
    pub source: String,
    #[serde(flatten)]
    pub summary: EvalSummary,
}

/// Leave-one-source-out: every source measured by a model trained without it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LosoSummary {
    pub sources: Vec<SourceReport>,
    /// Mean over the sources that have heavy prompts, and the worst of them.
    pub mean_heavy_to_cheapest: f64,
    pub worst_heavy_to_cheapest: f64,
    /// Mean over the sources that have light prompts, and the worst of them.
    pub mean_light_to_cheapest: f64,
    pub worst_light_to_cheapest: f64,
}

/// The routing curve of one score over a set of records.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoutingCurve {
    pub prompts: usize,
    /// Accuracy with every prompt on the cheap model, and on the reference.
    pub cheap_accuracy: f64,
    pub reference_accuracy: f64,
    /// `(share of reference calls, accuracy)`, by share.
    pub points: Vec<(f64, f64)>,
    /// `None` when the reference is no better than the cheap model (no gap to recover).
    pub apgr: Option<f64>,
    pub cpt50: Option<f64>,
    pub cpt80: Option<f64>,
}

/// One held-out group of a cross-validation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FoldReport {
    pub held_out: String,
    pub prompts: usize,
    pub apgr: Option<f64>,
}

/// Held-out figures of one benchmark (source).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SourceCrossValidation {
    pub source: String,
    /// `category` (one model per held-out category) or [`FOLDS`](super::FOLDS) folds (a single category).
    pub by: String,
    pub folds: Vec<FoldReport>,
    /// Mean over folds whose reference is better than the cheap model by at least
    /// [`MIN_GAP`](super::MIN_GAP) (smaller gaps make a fold's APGR a ratio of noise).
    pub mean_apgr: Option<f64>,
    /// APGR of the held-out scores of the whole benchmark, pooled.
    pub pooled: RoutingCurve,
    /// The same benchmark by prompt length alone.
    pub length: RoutingCurve,
    /// By the model's complexity, when a model was given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub complexity: Option<RoutingCurve>,
}

/// The whole cross-validation, kept in a model's metrics.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct OutcomeCrossValidation {
    pub records: usize,
    pub sources: Vec<SourceCrossValidation>,
}
