//! The prompt classifier: a linear model over hashed word n-grams and the structural
//! scores that predicts a prompt's task class and its difficulty (`docs/routing.md` §1).
//!
//! Two softmax heads share one weight table: five task classes and three difficulty labels
//! (heavy, medium, light). Scoring a prompt is one pass over its scoring window that adds
//! a row of eight weights per gram, so it costs microseconds, not the milliseconds of a
//! transformer. The complexity the policy uses is the expected difficulty, blended with
//! the structural complexity score.
//!
//! [`Classifier`] is what a router holds; [`ClassifierDocument`] is the versioned JSON form
//! that is pushed, stored and validated; [`train`] makes one from labelled prompts.

use std::collections::HashMap;

use serde::Serialize;

use crate::features::{FeatureError, Features, Prompt, TaskClass};
use crate::profile::ComplexityWeights;
use grams::{for_each_gram, Gram, DENSE, DENSE_FEATURES};

mod data;
mod document;
mod eval;
mod grams;
mod lexicon;
mod metrics;
mod noise;
mod outcome;
mod routing_eval;
mod train;

pub use data::{parse_labelled, DataError, Difficulty, LabelledPrompt, Split};
pub use document::{ClassifierDocument, ClassifierError, FeatureSettings, TrainingMetrics};
pub use eval::{evaluate, leave_one_source_out, ClassReport, EvalReport};
pub use metrics::{
    FoldReport, OutcomeCrossValidation, RoutingCurve, SourceCrossValidation, SourceReport,
};
pub use noise::{
    paired_bootstrap, seed_spread, Difference, HeldOutScores, PairedBootstrap, SeedSpread,
};
pub use outcome::{
    fit_examples, fit_outcomes, outcome_from_value, parse_outcomes, ChoiceTrees, DegenerateHead,
    LinearRow, OutcomeExample, OutcomeHead, OutcomeInputs, OutcomeRecord, TrafficOutcome, Tree,
    Verdicts, INPUT_RANGE, MAX_GRADE, OUTCOME_FEATURES, OUTCOME_INPUTS,
};
pub use routing_eval::{
    check_fit, complexity_scores, cross_validate, cross_validate_with_scores, length_scores,
    random_scores, routing_curve, FOLDS, MIN_GAP,
};
pub use train::{fit, retrain_outcomes, train, train_with_outcomes, TrainOptions};

/// Task classes in output order.
pub const TASK_CLASSES: [TaskClass; 5] = [
    TaskClass::Code,
    TaskClass::Math,
    TaskClass::Structured,
    TaskClass::Reasoning,
    TaskClass::General,
];
const CLASSES: usize = TASK_CLASSES.len();
const LABELS: usize = Difficulty::ALL.len();
/// Outputs per weight row: the class logits, then the difficulty logits.
pub(crate) const OUTPUTS: usize = CLASSES + LABELS;

/// The built-in model (`crates/policy/classifier/default.json`, made by
/// `scripts/train-classifier` from the train split of the data in `eval/`).
pub const DEFAULT_CLASSIFIER: &str = include_str!("../../classifier/default.json");

/// A validated model, ready to score prompts.
#[derive(Clone, PartialEq)]
pub struct Classifier {
    bits: u32,
    /// `2^bits` rows of `OUTPUTS` weights.
    buckets: Vec<[f32; OUTPUTS]>,
    dense: [[f32; OUTPUTS]; DENSE],
    bias: [f32; OUTPUTS],
    blend: f64,
    medium_weight: f64,
    /// Absent in a model trained without outcome records.
    outcome: Option<OutcomeHead>,
}

/// What the classifier says of one prompt.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Classification {
    /// Probability of each class, in [`TASK_CLASSES`] order.
    pub class_probabilities: [f64; CLASSES],
    /// Probability of heavy, medium, light.
    pub difficulty_probabilities: [f64; LABELS],
    /// `P(heavy) + medium_weight × P(medium)`, in [0,1].
    pub difficulty: f64,
    pub task_class: TaskClass,
    /// What the policy uses: the difficulty blended with the structural complexity.
    pub complexity: f64,
    /// The outcome head's net probability that the cheapest profile's answer is worse than
    /// the reference's, for a model with a head.
    pub risk: Option<f64>,
}

/// One input that moved a prompt's scores, for explain.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Contribution {
    /// The word, bigram or dense input.
    pub feature: String,
    /// Push towards heavy (positive) or light (negative): its share of the difference of
    /// the two logits.
    pub difficulty: f64,
    /// Push towards the predicted task class against the mean of the others.
    pub task_class: f64,
}

/// Features of a prompt as the policy routes it: the structural scores, then, with a
/// classifier, its task class and complexity. A prompt with no text (an image-only message)
/// is the simplest prompt, and there is nothing for a classifier to read.
pub fn score(
    prompt: &Prompt<'_>,
    weights: &ComplexityWeights,
    classifier: Option<&Classifier>,
) -> (Features, Option<Classification>) {
    match Features::extract(prompt, weights) {
        Ok(mut features) => {
            let classification = classifier
                .map(|c| c.apply(prompt, &mut features, weights.scoring_window_chars.max(1)));
            (features, classification)
        }
        Err(FeatureError::EmptyPrompt) => (Features::without_text(prompt, weights), None),
    }
}

// === impl Classifier ===

impl Classifier {
    /// Scores a prompt whose structural `features` were extracted with a scoring window of
    /// `window` bytes.
    pub fn classify(
        &self,
        prompt: &Prompt<'_>,
        features: &Features,
        window: usize,
    ) -> Classification {
        let mut sums = [0f32; OUTPUTS];
        let shape = for_each_gram(
            prompt,
            window,
            self.bits,
            |bucket, _| add(&mut sums, &self.buckets[bucket as usize]),
            false,
        );
        let logits = self.logits(&sums, shape.grams, &grams::dense(features, &shape));
        let mut c = self.decide(&logits, prompt.wants_json, features.complexity);
        if let Some(head) = &self.outcome {
            let inputs = OutcomeInputs::of(prompt, window);
            c.risk = Some(OutcomeHead::risk_of(head.logit(&inputs, c.task_class)));
        }
        c
    }

    /// The outcome head's logit for a prompt (higher: the reference is more likely needed),
    /// if the model has one: the score `classifier eval --outcomes` ranks by.
    pub fn outcome_logit(&self, prompt: &Prompt<'_>, window: usize) -> Option<f64> {
        let head = self.outcome.as_ref()?;
        let class = self.task_class(prompt, window);
        Some(head.logit(&OutcomeInputs::of(prompt, window), class))
    }

    /// The task class the policy gives a record's prompt: a traffic record carries the one
    /// the router gave it.
    pub fn record_class(&self, record: &OutcomeRecord, window: usize) -> TaskClass {
        record
            .task_class
            .unwrap_or_else(|| self.task_class(&Prompt::user(&record.prompt), window))
    }

    /// Records as the outcome head's fit sees them, each in the task class this model gives
    /// it.
    pub fn outcome_examples<'a>(
        &self,
        records: &'a [OutcomeRecord],
        window: usize,
    ) -> Vec<OutcomeExample<'a>> {
        records
            .iter()
            .map(|r| OutcomeExample {
                inputs: r.inputs(window),
                task_class: self.record_class(r, window),
                verdicts: r.verdicts,
                category: &r.category,
            })
            .collect()
    }

    fn task_class(&self, prompt: &Prompt<'_>, window: usize) -> TaskClass {
        let weights = ComplexityWeights {
            scoring_window_chars: window,
            ..ComplexityWeights::default()
        };
        let features = Features::extract(prompt, &weights)
            .unwrap_or_else(|_| Features::without_text(prompt, &weights));
        self.classify(prompt, &features, window).task_class
    }

    /// The outcome head, if the model has one.
    pub fn outcome(&self) -> Option<&OutcomeHead> {
        self.outcome.as_ref()
    }

    /// Classifies and writes the task class and complexity into `features`.
    pub fn apply(
        &self,
        prompt: &Prompt<'_>,
        features: &mut Features,
        window: usize,
    ) -> Classification {
        let c = self.classify(prompt, features, window);
        features.task_class = c.task_class;
        features.complexity = c.complexity;
        features.risk = c.risk;
        c
    }

    /// The `top` inputs that moved this prompt's scores most (off the hot path: it keeps
    /// the text of every gram).
    pub fn explain(
        &self,
        prompt: &Prompt<'_>,
        features: &Features,
        window: usize,
        top: usize,
    ) -> Vec<Contribution> {
        let mut grams: Vec<(u32, Gram<'_>)> = Vec::new();
        let mut sums = [0f32; OUTPUTS];
        let shape = for_each_gram(
            prompt,
            window,
            self.bits,
            |bucket, gram| {
                add(&mut sums, &self.buckets[bucket as usize]);
                if let Some(gram) = gram {
                    grams.push((bucket, gram));
                }
            },
            true,
        );
        let dense = grams::dense(features, &shape);
        let chosen = self.decide(
            &self.logits(&sums, shape.grams, &dense),
            prompt.wants_json,
            features.complexity,
        );
        let class = TASK_CLASSES
            .iter()
            .position(|&c| c == chosen.task_class)
            .unwrap_or(0);
        let scale = 1.0 / (shape.grams.max(1) as f32).sqrt();
        let push = |row: &[f32; OUTPUTS], x: f32| {
            let heavy = f64::from((row[CLASSES] - row[CLASSES + 2]) * x);
            let others = (row[..CLASSES].iter().sum::<f32>() - row[class]) / (CLASSES - 1) as f32;
            (heavy, f64::from((row[class] - others) * x))
        };
        // A gram that occurs several times moved the scores several times.
        let mut by_text: HashMap<String, (f64, f64)> = HashMap::new();
        for (bucket, gram) in &grams {
            let (difficulty, task_class) = push(&self.buckets[*bucket as usize], scale);
            let sum = by_text.entry(gram.text()).or_default();
            sum.0 += difficulty;
            sum.1 += task_class;
        }
        let mut merged: Vec<Contribution> = by_text
            .into_iter()
            .map(|(feature, (difficulty, task_class))| Contribution {
                feature,
                difficulty,
                task_class,
            })
            .collect();
        for (i, &x) in dense.iter().enumerate() {
            let (difficulty, task_class) = push(&self.dense[i], x);
            merged.push(Contribution {
                feature: format!("[{}]", DENSE_FEATURES[i]),
                difficulty,
                task_class,
            });
        }
        let weight = |c: &Contribution| c.difficulty.abs() + c.task_class.abs();
        merged.sort_by(|a, b| {
            weight(b)
                .total_cmp(&weight(a))
                .then_with(|| a.feature.cmp(&b.feature))
        });
        merged.truncate(top);
        merged
    }

    /// Bytes of weights held in memory.
    pub fn weight_bytes(&self) -> usize {
        std::mem::size_of_val(self.buckets.as_slice()) + std::mem::size_of_val(&self.dense)
    }

    fn logits(&self, sums: &[f32; OUTPUTS], grams: u32, dense: &[f32; DENSE]) -> [f32; OUTPUTS] {
        let mut logits = self.bias;
        let scale = 1.0 / (grams.max(1) as f32).sqrt();
        for (logit, sum) in logits.iter_mut().zip(sums) {
            *logit += sum * scale;
        }
        for (row, &x) in self.dense.iter().zip(dense) {
            for (logit, w) in logits.iter_mut().zip(row) {
                *logit += w * x;
            }
        }
        logits
    }

    fn decide(&self, logits: &[f32; OUTPUTS], wants_json: bool, structural: f64) -> Classification {
        let class_probabilities = softmax(&logits[..CLASSES]);
        let difficulty_probabilities = softmax(&logits[CLASSES..]);
        let best = (0..CLASSES)
            .max_by(|&a, &b| {
                class_probabilities[a]
                    .total_cmp(&class_probabilities[b])
                    .then(b.cmp(&a))
            })
            .unwrap_or(CLASSES - 1);
        let mut task_class = TASK_CLASSES[best];
        // A request for JSON output is structured by what it asks of the answer.
        if wants_json && task_class == TaskClass::General {
            task_class = TaskClass::Structured;
        }
        let difficulty =
            clamp01(difficulty_probabilities[0] + self.medium_weight * difficulty_probabilities[1]);
        let complexity = clamp01(self.blend * difficulty + (1.0 - self.blend) * structural);
        Classification {
            class_probabilities,
            difficulty_probabilities,
            difficulty,
            task_class,
            complexity,
            risk: None,
        }
    }
}

impl std::fmt::Debug for Classifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Classifier")
            .field("bits", &self.bits)
            .field("blend", &self.blend)
            .field("medium_weight", &self.medium_weight)
            .finish_non_exhaustive()
    }
}

fn add(sums: &mut [f32; OUTPUTS], row: &[f32; OUTPUTS]) {
    for (s, w) in sums.iter_mut().zip(row) {
        *s += w;
    }
}

/// Probabilities that sum to 1 and are finite for any finite logits.
fn softmax<const N: usize>(logits: &[f32]) -> [f64; N] {
    let mut out = [0f64; N];
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut total = 0.0;
    for (o, &l) in out.iter_mut().zip(logits) {
        *o = f64::from(l - max).exp();
        total += *o;
    }
    if !(total.is_finite() && total > 0.0) {
        return [1.0 / N as f64; N];
    }
    for o in &mut out {
        *o /= total;
    }
    out
}

fn clamp01(x: f64) -> f64 {
    if x.is_nan() {
        0.0
    } else {
        x.clamp(0.0, 1.0)
    }
}
