//! Training: L2-regularised multinomial logistic regression for both heads at once,
//! minimised with L-BFGS over the whole training set.
//!
//! The objective is convex, so full-batch L-BFGS from zero weights reaches the same optimum
//! whatever the order of the data: training is deterministic, and a seed only decides
//! which unsplit prompts are held out (see `data`). Each head weighs its classes by inverse
//! frequency, so a class with few examples (structured) is not drowned by the many.

use std::collections::VecDeque;

use super::data::{LabelledPrompt, Split};
use super::document::{ClassifierDocument, FeatureSettings, TrainingMetrics};
use super::grams::{self, for_each_gram, DENSE};
use super::outcome::{fit_examples, OutcomeHead, OutcomeRecord};
use super::{Classifier, CLASSES, LABELS, OUTPUTS, TASK_CLASSES};
use crate::features::{Features, Prompt, Role, Segment};
use crate::profile::ComplexityWeights;

/// Settings of one training run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrainOptions {
    /// Decides which prompts without a split are held out for dev.
    pub seed: u64,
    /// Hash table size: `2^bits` rows of weights (15: 1 MiB of `f32`).
    pub bits: u32,
    /// Inverse regularisation strength: the loss is `c × Σ weighted log loss + ½‖w‖²`.
    pub c: f64,
    pub max_iterations: usize,
    /// Share of the model's difficulty in the complexity; the rest is the structural score.
    pub blend: f64,
    /// How much a medium prompt counts towards the difficulty (heavy counts 1, light 0).
    pub medium_weight: f64,
}

/// One prompt as the optimiser sees it.
struct Example {
    /// Distinct buckets with their value (count / √grams).
    grams: Vec<(u32, f32)>,
    dense: [f32; DENSE],
    class: Option<usize>,
    label: usize,
    class_weight: f64,
    label_weight: f64,
}

/// Parameters, flat: bucket rows, dense rows, then the biases (not regularised).
struct Layout {
    rows: usize,
}

// === impl TrainOptions ===

impl Default for TrainOptions {
    /// The settings the built-in model is trained with; `docs/routing.md` says why.
    fn default() -> Self {
        Self {
            seed: 0,
            bits: 15,
            c: 1.0,
            max_iterations: 300,
            blend: 0.8,
            medium_weight: 0.7,
        }
    }
}

/// Trains on the `train` split of `data`.
pub fn train(data: &[LabelledPrompt], options: &TrainOptions) -> ClassifierDocument {
    train_with_outcomes(data, &[], options)
}

/// Trains on the `train` split of `data` and, when there are outcome records, the outcome
/// head on all of them.
pub fn train_with_outcomes(
    data: &[LabelledPrompt],
    outcomes: &[OutcomeRecord],
    options: &TrainOptions,
) -> ClassifierDocument {
    let train: Vec<&LabelledPrompt> = data.iter().filter(|p| p.split == Split::Train).collect();
    let mut classifier = fit(&train, options);
    let window = ComplexityWeights::default().scoring_window_chars;
    if !outcomes.is_empty() {
        classifier.outcome = Some(fit_head(&classifier, outcomes, window));
    }
    let mut metrics = TrainingMetrics::counted(data, options.seed);
    metrics.outcome_records = outcomes.len();
    ClassifierDocument::new(&classifier, FeatureSettings::new(options.bits), metrics)
}

/// `base` with its outcome head refitted to `outcomes` alone, every other head kept: the
/// loop that learns from the router's own traffic (`classifier train --base`), which needs
/// no labelled prompts. The base's metrics stay, but for the outcome figures, which described
/// the head replaced.
pub fn retrain_outcomes(
    base: &ClassifierDocument,
    outcomes: &[OutcomeRecord],
) -> Result<ClassifierDocument, super::ClassifierError> {
    let mut classifier = base.classifier()?;
    let window = ComplexityWeights::default().scoring_window_chars;
    classifier.outcome = Some(fit_head(&classifier, outcomes, window));
    let mut metrics = base.metrics.clone();
    metrics.outcome_records = outcomes.len();
    metrics.outcome_training_apgr = None;
    metrics.outcomes = None;
    Ok(ClassifierDocument::new(
        &classifier,
        base.features.clone(),
        metrics,
    ))
}

/// The outcome head of `classifier` fitted to `outcomes`, each in the task class
/// `classifier` gives it.
fn fit_head(classifier: &Classifier, outcomes: &[OutcomeRecord], window: usize) -> OutcomeHead {
    fit_examples(&classifier.outcome_examples(outcomes, window))
}

/// Fits a model to `data` (all of it, whatever its split).
pub fn fit(data: &[&LabelledPrompt], options: &TrainOptions) -> Classifier {
    let bits = options.bits;
    let mut examples: Vec<Example> = data.iter().map(|p| encode(p, bits)).collect();
    balance(&mut examples);
    let layout = Layout {
        rows: (1usize << bits) + DENSE,
    };
    let theta = lbfgs(&examples, &layout, options.c, options.max_iterations);
    let row = |r: usize| -> [f32; OUTPUTS] {
        let mut out = [0f32; OUTPUTS];
        for (o, v) in out.iter_mut().zip(&theta[r * OUTPUTS..(r + 1) * OUTPUTS]) {
            *o = *v as f32;
        }
        out
    };
    let buckets = (0..1usize << bits).map(row).collect();
    let mut dense = [[0f32; OUTPUTS]; DENSE];
    for (i, d) in dense.iter_mut().enumerate() {
        *d = row((1 << bits) + i);
    }
    Classifier {
        bits,
        buckets,
        dense,
        bias: row(layout.rows),
        blend: options.blend,
        medium_weight: options.medium_weight,
        outcome: None,
    }
}

fn encode(p: &LabelledPrompt, bits: u32) -> Example {
    let weights = ComplexityWeights::default();
    let prompt = Prompt {
        segments: vec![Segment {
            role: Role::User,
            text: &p.prompt,
        }],
        wants_json: false,
    };
    let window = weights.scoring_window_chars;
    let features = Features::extract(&prompt, &weights)
        .unwrap_or_else(|_| Features::without_text(&prompt, &weights));
    let mut buckets = Vec::new();
    let shape = for_each_gram(&prompt, window, bits, |b, _| buckets.push(b), false);
    buckets.sort_unstable();
    let scale = 1.0 / (shape.grams.max(1) as f32).sqrt();
    let mut grams: Vec<(u32, f32)> = Vec::new();
    for b in buckets {
        match grams.last_mut() {
            Some((last, v)) if *last == b => *v += scale,
            _ => grams.push((b, scale)),
        }
    }
    Example {
        grams,
        dense: grams::dense(&features, &shape),
        class: p
            .task_class
            .and_then(|c| TASK_CLASSES.iter().position(|&t| t == c)),
        label: p.label.index(),
        class_weight: 0.0,
        label_weight: 0.0,
    }
}

/// Inverse-frequency weights per head: `n / (k × n_class)` over the k classes present.
fn balance(examples: &mut [Example]) {
    let mut classes = [0usize; CLASSES];
    let mut labels = [0usize; LABELS];
    for e in examples.iter() {
        if let Some(c) = e.class {
            classes[c] += 1;
        }
        labels[e.label] += 1;
    }
    let weight = |counts: &[usize], i: usize| {
        let n: usize = counts.iter().sum();
        let k = counts.iter().filter(|&&c| c > 0).count();
        n as f64 / (k * counts[i].max(1)) as f64
    };
    for e in examples.iter_mut() {
        e.class_weight = e.class.map_or(0.0, |c| weight(&classes, c));
        e.label_weight = weight(&labels, e.label);
    }
}

/// The objective and its gradient at `theta`.
fn loss_and_gradient(
    examples: &[Example],
    layout: &Layout,
    c: f64,
    theta: &[f64],
    grad: &mut [f64],
) -> f64 {
    let regularised = layout.rows * OUTPUTS;
    let bias_at = layout.rows * OUTPUTS;
    let dense_at = (layout.rows - DENSE) * OUTPUTS;
    grad.fill(0.0);
    let mut loss = 0.0;
    for e in examples {
        let mut z = [0f64; OUTPUTS];
        z.copy_from_slice(&theta[bias_at..bias_at + OUTPUTS]);
        for &(b, v) in &e.grams {
            let row = &theta[b as usize * OUTPUTS..(b as usize + 1) * OUTPUTS];
            for (zk, w) in z.iter_mut().zip(row) {
                *zk += w * f64::from(v);
            }
        }
        for (i, &x) in e.dense.iter().enumerate() {
            let row = &theta[dense_at + i * OUTPUTS..dense_at + (i + 1) * OUTPUTS];
            for (zk, w) in z.iter_mut().zip(row) {
                *zk += w * f64::from(x);
            }
        }
        let mut dz = [0f64; OUTPUTS];
        if let Some(class) = e.class {
            loss += head(&z[..CLASSES], class, c * e.class_weight, &mut dz[..CLASSES]);
        }
        loss += head(
            &z[CLASSES..],
            e.label,
            c * e.label_weight,
            &mut dz[CLASSES..],
        );
        for &(b, v) in &e.grams {
            let row = &mut grad[b as usize * OUTPUTS..(b as usize + 1) * OUTPUTS];
            for (g, d) in row.iter_mut().zip(&dz) {
                *g += d * f64::from(v);
            }
        }
        for (i, &x) in e.dense.iter().enumerate() {
            let row = &mut grad[dense_at + i * OUTPUTS..dense_at + (i + 1) * OUTPUTS];
            for (g, d) in row.iter_mut().zip(&dz) {
                *g += d * f64::from(x);
            }
        }
        for (g, d) in grad[bias_at..].iter_mut().zip(&dz) {
            *g += d;
        }
    }
    for (g, w) in grad[..regularised].iter_mut().zip(&theta[..regularised]) {
        *g += w;
        loss += 0.5 * w * w;
    }
    loss
}

/// Weighted cross-entropy of one softmax head; writes its gradient w.r.t. the logits.
fn head(z: &[f64], target: usize, weight: f64, dz: &mut [f64]) -> f64 {
    let max = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let total: f64 = z.iter().map(|l| (l - max).exp()).sum();
    let log_total = total.ln() + max;
    for (k, (d, l)) in dz.iter_mut().zip(z).enumerate() {
        let p = (l - log_total).exp();
        *d = weight * (p - f64::from(u8::from(k == target)));
    }
    weight * (log_total - z[target])
}

/// Limited-memory BFGS (ten pairs) with a backtracking Armijo line search, from zero.
fn lbfgs(examples: &[Example], layout: &Layout, c: f64, max_iterations: usize) -> Vec<f64> {
    const MEMORY: usize = 10;
    const ARMIJO: f64 = 1e-4;
    let n = (layout.rows + 1) * OUTPUTS;
    let mut theta = vec![0.0; n];
    let mut grad = vec![0.0; n];
    let mut loss = loss_and_gradient(examples, layout, c, &theta, &mut grad);
    let mut history: VecDeque<(Vec<f64>, Vec<f64>, f64)> = VecDeque::new();
    let mut next = vec![0.0; n];
    let mut next_grad = vec![0.0; n];
    for iteration in 0..max_iterations {
        let direction = two_loop(&grad, &history);
        let slope = dot(&grad, &direction);
        if slope >= 0.0 {
            // Not a descent direction: start over from the gradient, unless that is zero.
            if history.is_empty() {
                break;
            }
            history.clear();
            continue;
        }
        let mut step = if iteration == 0 {
            1.0 / norm(&grad).max(1.0)
        } else {
            1.0
        };
        let mut next_loss = f64::INFINITY;
        for _ in 0..30 {
            for ((x, t), d) in next.iter_mut().zip(&theta).zip(&direction) {
                *x = t + step * d;
            }
            next_loss = loss_and_gradient(examples, layout, c, &next, &mut next_grad);
            if next_loss <= loss + ARMIJO * step * slope {
                break;
            }
            step *= 0.5;
        }
        if next_loss > loss {
            break;
        }
        let s: Vec<f64> = next.iter().zip(&theta).map(|(a, b)| a - b).collect();
        let y: Vec<f64> = next_grad.iter().zip(&grad).map(|(a, b)| a - b).collect();
        let sy = dot(&s, &y);
        if sy > 1e-10 {
            if history.len() == MEMORY {
                history.pop_front();
            }
            history.push_back((s, y, 1.0 / sy));
        }
        std::mem::swap(&mut theta, &mut next);
        std::mem::swap(&mut grad, &mut next_grad);
        let improvement = loss - next_loss;
        loss = next_loss;
        if improvement <= 1e-9 * loss.abs().max(1.0) {
            break;
        }
    }
    theta
}

/// The L-BFGS search direction `-H·g` from the stored pairs.
fn two_loop(grad: &[f64], history: &VecDeque<(Vec<f64>, Vec<f64>, f64)>) -> Vec<f64> {
    let mut q: Vec<f64> = grad.to_vec();
    let mut alphas = Vec::with_capacity(history.len());
    for (s, y, rho) in history.iter().rev() {
        let alpha = rho * dot(s, &q);
        for (qi, yi) in q.iter_mut().zip(y) {
            *qi -= alpha * yi;
        }
        alphas.push(alpha);
    }
    if let Some((s, y, _)) = history.back() {
        let gamma = dot(s, y) / dot(y, y).max(f64::MIN_POSITIVE);
        for qi in &mut q {
            *qi *= gamma;
        }
    }
    for ((s, y, rho), alpha) in history.iter().zip(alphas.iter().rev()) {
        let beta = rho * dot(y, &q);
        for (qi, si) in q.iter_mut().zip(s) {
            *qi += (alpha - beta) * si;
        }
    }
    for qi in &mut q {
        *qi = -*qi;
    }
    q
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn norm(a: &[f64]) -> f64 {
    dot(a, a).sqrt()
}
