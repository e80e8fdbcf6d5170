//! Boosted regression trees for multiple-choice prompts, fitted to each record's target less
//! its category's mean: what ranks questions within a subject, not what tells subjects
//! apart.

use std::collections::BTreeMap;

use super::{ChoiceTrees, OutcomeExample, OutcomeInputs, Tree, OUTCOME_INPUTS, SHAPE_INPUTS};

/// The multiple-choice trees: how many, how deep, how much each adds, and the fewest
/// records a leaf holds (fewer make a leaf's mean mostly noise).
const TREES: usize = 50;
const TREE_DEPTH: u32 = 3;
const LEARNING_RATE: f64 = 0.1;
pub(super) const MIN_LEAF: usize = 30;
/// Deepest and most trees a document may hold (bounds its size and the decision time).
pub(super) const MAX_TREE_DEPTH: u32 = 8;
const MAX_TREES: usize = 1000;
/// The trees estimate a probability; it is kept off 0 and 1 before taking its logit.
const P_EDGE: f64 = 0.005;

// === impl ChoiceTrees ===

impl ChoiceTrees {
    pub(super) fn logit(&self, inputs: &OutcomeInputs) -> f64 {
        let mut p = self.base;
        for tree in &self.trees {
            p += tree.leaf(inputs, self.depth);
        }
        let p = f64::from(p).clamp(P_EDGE, 1.0 - P_EDGE);
        (p / (1.0 - p)).ln()
    }

    pub(super) fn check(&self) -> Result<(), (&'static str, String)> {
        const AT: &str = "weights.outcome.choice_trees";
        if !(1..=MAX_TREE_DEPTH).contains(&self.depth) {
            return Err((AT, format!("depth must be in 1..={MAX_TREE_DEPTH}")));
        }
        if self.trees.len() > MAX_TREES || !self.base.is_finite() {
            return Err((AT, format!("at most {MAX_TREES} trees and a finite base")));
        }
        let splits = (1usize << self.depth) - 1;
        for tree in &self.trees {
            let ok = tree.inputs.len() == splits
                && tree.thresholds.len() == splits
                && tree.leaves.len() == splits + 1
                && tree.inputs.iter().all(|&i| usize::from(i) < OUTCOME_INPUTS)
                && tree
                    .thresholds
                    .iter()
                    .chain(&tree.leaves)
                    .all(|v| v.is_finite());
            if !ok {
                return Err((
                    AT,
                    format!(
                        "every tree needs {splits} inputs below {OUTCOME_INPUTS}, {splits} \
                         finite thresholds and {} finite leaves",
                        splits + 1
                    ),
                ));
            }
        }
        Ok(())
    }
}

impl Tree {
    fn leaf(&self, inputs: &OutcomeInputs, depth: u32) -> f32 {
        let mut node = 0;
        for _ in 0..depth {
            let right = inputs.0[usize::from(self.inputs[node])] > self.thresholds[node];
            node = 2 * node + 1 + usize::from(right);
        }
        self.leaves[node - self.inputs.len()]
    }
}

/// Fits the head to outcome records (all of them); `classes[i]` is the task class of
/// `records[i]` as the router gives it.
/// Gradient boosting with squared loss on the target less its category's mean: within a
/// category, which questions the reference is more likely needed for.
pub(super) fn boost(examples: &[&OutcomeExample<'_>]) -> ChoiceTrees {
    let n = examples.len();
    let targets: Vec<f64> = examples.iter().map(|e| e.verdicts.target()).collect();
    let base = targets.iter().sum::<f64>() / n as f64;
    let mut categories: BTreeMap<&str, (f64, usize)> = BTreeMap::new();
    for (e, t) in examples.iter().zip(&targets) {
        let c = categories.entry(e.category).or_default();
        c.0 += t;
        c.1 += 1;
    }
    let mut residual: Vec<f64> = examples
        .iter()
        .zip(&targets)
        .map(|(e, t)| {
            let (sum, count) = categories[e.category];
            t - sum / count as f64
        })
        .collect();
    // The records in order of each input's value (ties by position): a split search is one
    // pass per input and level.
    let order: Vec<Vec<usize>> = (0..SHAPE_INPUTS)
        .map(|f| {
            let mut at: Vec<usize> = (0..n).collect();
            at.sort_by(|&a, &b| {
                examples[a].inputs.0[f]
                    .total_cmp(&examples[b].inputs.0[f])
                    .then(a.cmp(&b))
            });
            at
        })
        .collect();
    let trees = (0..TREES)
        .map(|_| {
            let tree = grow(examples, &order, &residual);
            for (r, e) in residual.iter_mut().zip(examples) {
                *r -= f64::from(tree.leaf(&e.inputs, TREE_DEPTH));
            }
            tree
        })
        .collect();
    ChoiceTrees {
        depth: TREE_DEPTH,
        base: base as f32,
        trees,
    }
}

/// One regression tree of [`TREE_DEPTH`] on the residuals, grown level by level: each node
/// takes the split that most reduces the squared error, leaving at least [`MIN_LEAF`]
/// records on either side; a node without one sends everything left.
fn grow(examples: &[&OutcomeExample<'_>], order: &[Vec<usize>], residual: &[f64]) -> Tree {
    let splits = (1usize << TREE_DEPTH) - 1;
    let mut inputs = vec![0u8; splits];
    let mut thresholds = vec![f32::MAX; splits];
    let mut node = vec![0usize; examples.len()];
    for level in 0..TREE_DEPTH {
        let first = (1usize << level) - 1;
        let width = 1usize << level;
        let mut total = vec![(0.0f64, 0usize); width];
        for (i, &k) in node.iter().enumerate() {
            total[k - first].0 += residual[i];
            total[k - first].1 += 1;
        }
        // Per node: (reduction of the squared error, input, threshold).
        let mut best: Vec<Option<(f64, usize, f32)>> = vec![None; width];
        for (f, sorted) in order.iter().enumerate() {
            let mut left = vec![(0.0f64, 0usize); width];
            let mut last = vec![f32::NEG_INFINITY; width];
            for &i in sorted {
                let k = node[i] - first;
                let v = examples[i].inputs.0[f];
                let (sl, nl) = left[k];
                let (s, n) = total[k];
                if nl >= MIN_LEAF && n - nl >= MIN_LEAF && v > last[k] {
                    let (sr, nr) = (s - sl, n - nl);
                    let gain = sl * sl / nl as f64 + sr * sr / nr as f64 - s * s / n as f64;
                    if best[k].map_or(gain > 1e-12, |b| gain > b.0) {
                        best[k] = Some((gain, f, between(last[k], v)));
                    }
                }
                left[k].0 += residual[i];
                left[k].1 += 1;
                last[k] = v;
            }
        }
        for (k, b) in best.iter().enumerate() {
            if let Some((_, f, t)) = *b {
                inputs[first + k] = f as u8;
                thresholds[first + k] = t;
            }
        }
        for (i, k) in node.iter_mut().enumerate() {
            let right = examples[i].inputs.0[usize::from(inputs[*k])] > thresholds[*k];
            *k = 2 * *k + 1 + usize::from(right);
        }
    }
    let mut sums = vec![(0.0f64, 0usize); splits + 1];
    for (i, &k) in node.iter().enumerate() {
        sums[k - splits].0 += residual[i];
        sums[k - splits].1 += 1;
    }
    let leaves = sums
        .iter()
        .map(|&(s, n)| {
            if n == 0 {
                0.0
            } else {
                (LEARNING_RATE * s / n as f64) as f32
            }
        })
        .collect();
    Tree {
        inputs,
        thresholds,
        leaves,
    }
}

/// A threshold that sends `low` left and `high` right.
fn between(low: f32, high: f32) -> f32 {
    let t = (f64::from(low) + (f64::from(high) - f64::from(low)) / 2.0) as f32;
    if t >= high {
        low
    } else {
        t
    }
}
