//! How well a score ranks prompts for a cheap/reference pair, by RouteLLM's procedure
//! (arXiv 2406.18665; `eval/outcomes/README.md`): the accuracy-vs-reference-share curve over
//! the score's deciles, APGR, CPT(50%) and CPT(80%), and held-out-category
//! cross-validation of the outcome head.

use std::collections::{BTreeMap, HashSet};

use super::data::hash;
use super::metrics::{FoldReport, OutcomeCrossValidation, RoutingCurve, SourceCrossValidation};
use super::noise::HeldOutScores;
use super::outcome::{
    fit_examples, DegenerateHead, OutcomeExample, OutcomeHead, OutcomeRecord, Verdicts,
};
use super::{score, Classifier};
use crate::features::Prompt;
use crate::profile::ComplexityWeights;

/// Folds of a benchmark that has a single category.
pub const FOLDS: u64 = 5;

/// Smallest reference-over-cheap accuracy gap a fold needs to count in the mean.
pub const MIN_GAP: f64 = 0.05;

/// Whether the reference answers at least [`MIN_GAP`] of the records more than the cheap
/// model does (in right answers, or in grades over the scale), counted in records: a
/// difference of two accuracies can round a gap of exactly five points (5 of 100) below it.
fn leads_enough(records: &[&OutcomeRecord]) -> bool {
    let (cheap, reference) = totals(records);
    // Graded totals are sums of fractions: allow for their rounding.
    reference - cheap >= (MIN_GAP * records.len() as f64).ceil() - 1e-9
}

/// The summed scores of the cheap and the reference answers.
fn totals(records: &[&OutcomeRecord]) -> (f64, f64) {
    records.iter().fold((0.0, 0.0), |(c, r), record| {
        let (cheap, reference) = record.verdicts.scores();
        (c + cheap, r + reference)
    })
}

/// The curve of `scores[i]` (higher: send to the reference) over `records[i]`. A graded
/// record's "accuracy" is its grade over the scale, as RouteLLM scores MT-Bench.
pub fn routing_curve(scores: &[f64], records: &[&OutcomeRecord]) -> RoutingCurve {
    let verdicts: Vec<Verdicts> = records.iter().map(|r| r.verdicts).collect();
    curve(scores, &verdicts)
}

/// What a freshly fitted head makes of the examples it was fitted to: its APGR on them
/// (`None` when the reference answers them no better than the cheap model), or why it must
/// not be used — degenerate ([`OutcomeHead::degenerate`]), the same score for every example
/// without answer choices, or a ranking no better than random.
pub fn check_fit(
    head: &OutcomeHead,
    examples: &[OutcomeExample<'_>],
) -> Result<Option<f64>, DegenerateHead> {
    if let Some(degenerate) = head.degenerate() {
        return Err(degenerate);
    }
    let scores: Vec<f64> = examples
        .iter()
        .map(|e| head.logit(&e.inputs, e.task_class))
        .collect();
    let free_form = examples
        .iter()
        .zip(&scores)
        .filter(|(e, _)| !e.inputs.choices())
        .map(|(_, &s)| s);
    let (low, high) = free_form.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), s| {
        (lo.min(s), hi.max(s))
    });
    if low <= high && high - low < 1e-9 {
        return Err(DegenerateHead::Constant);
    }
    let verdicts: Vec<Verdicts> = examples.iter().map(|e| e.verdicts).collect();
    let apgr = curve(&scores, &verdicts).apgr;
    match apgr {
        Some(apgr) if apgr <= 0.5 => Err(DegenerateHead::WorseThanRandom(apgr)),
        _ => Ok(apgr),
    }
}

/// The curve of `scores[i]` over records judged `records[i]`.
pub(crate) fn curve(scores: &[f64], records: &[Verdicts]) -> RoutingCurve {
    let n = records.len().max(1) as f64;
    let (cheap, reference) = records.iter().fold((0.0, 0.0), |(c, r), v| {
        let (cheap, reference) = v.scores();
        (c + cheap, r + reference)
    });
    let (cheap, reference) = (cheap / n, reference / n);
    let mut sorted: Vec<f64> = scores.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mut points = Vec::with_capacity(11);
    if !sorted.is_empty() {
        let last = sorted.len() - 1;
        // Decile edges with linear interpolation, as numpy's percentiles; the first edge
        // sends everything to the reference, one past the last nothing.
        for k in 0..=10 {
            let h = last as f64 * k as f64 / 10.0;
            let lo = h.floor() as usize;
            let hi = (lo + 1).min(last);
            let mut threshold = sorted[lo] + (sorted[hi] - sorted[lo]) * (h - lo as f64);
            if k == 0 {
                threshold = f64::NEG_INFINITY;
            } else if k == 10 {
                threshold = f64::INFINITY;
            }
            let mut strong = 0usize;
            let mut correct = 0.0;
            for (s, r) in scores.iter().zip(records) {
                let to_reference = *s >= threshold;
                let (cheap, reference) = r.scores();
                strong += usize::from(to_reference);
                correct += if to_reference { reference } else { cheap };
            }
            points.push((strong as f64 / n, correct / n));
        }
        points.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
    }
    let gap = reference - cheap;
    let pgr = |accuracy: f64| (accuracy - cheap) / gap;
    let (apgr, cpt50, cpt80) = if gap > 0.0 && points.len() > 1 {
        let area: f64 = points
            .windows(2)
            .map(|w| (w[1].0 - w[0].0) * (pgr(w[1].1) + pgr(w[0].1)) / 2.0)
            .sum();
        let cpt = |target: f64| {
            points.windows(2).find_map(|w| {
                let (a, b) = (pgr(w[0].1), pgr(w[1].1));
                if a >= target {
                    Some(w[0].0)
                } else if b >= target {
                    Some(w[0].0 + (w[1].0 - w[0].0) * (target - a) / (b - a))
                } else {
                    None
                }
            })
        };
        (Some(area), cpt(0.5), cpt(0.8))
    } else {
        (None, None, None)
    };
    RoutingCurve {
        prompts: records.len(),
        cheap_accuracy: cheap,
        reference_accuracy: reference,
        points,
        apgr,
        cpt50,
        cpt80,
    }
}

/// Scores that rank by nothing: a stable hash of each record's id and the seed.
pub fn random_scores(records: &[&OutcomeRecord], seed: u64) -> Vec<f64> {
    records
        .iter()
        .map(|r| hash(seed, &r.id) as f64 / u64::MAX as f64)
        .collect()
}

/// Scores by prompt length in bytes.
pub fn length_scores(records: &[&OutcomeRecord]) -> Vec<f64> {
    records.iter().map(|r| r.prompt.len() as f64).collect()
}

/// Held-out figures: for every benchmark (source), one head per held-out category trained on
/// every other record (all benchmarks), or, for a benchmark of one category, [`FOLDS`] folds
/// by a hash of the prompt and the seed. A held-out prompt is held out from every source:
/// one prompt answered by two model pairs is one prompt. `model` gives each record its task
/// class, and ranks each source by its complexity too (the heads that learned from labelled
/// prompts, not from outcomes).
pub fn cross_validate(
    records: &[OutcomeRecord],
    window: usize,
    seed: u64,
    model: &Classifier,
) -> OutcomeCrossValidation {
    cross_validate_with_scores(records, window, seed, model).0
}

/// [`cross_validate`], with each source's pooled held-out scores and its baselines' (in the
/// order of its sources), which [`paired_bootstrap`](super::paired_bootstrap) resamples.
pub fn cross_validate_with_scores(
    records: &[OutcomeRecord],
    window: usize,
    seed: u64,
    model: &Classifier,
) -> (OutcomeCrossValidation, Vec<HeldOutScores>) {
    let examples = model.outcome_examples(records, window);
    let weights = ComplexityWeights {
        scoring_window_chars: window,
        ..ComplexityWeights::default()
    };
    let mut by_source: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (i, r) in records.iter().enumerate() {
        by_source.entry(&r.source).or_default().push(i);
    }
    let mut held_out_scores = vec![0.0; records.len()];
    let mut sources = Vec::new();
    let mut kept = Vec::new();
    for (source, members) in by_source {
        let (by, groups) = held_out_groups(records, &members, seed);
        let mut folds = Vec::new();
        for (name, held) in &groups {
            let scores = score_held_out(records, &examples, held);
            for (&i, &s) in held.iter().zip(&scores) {
                held_out_scores[i] = s;
            }
            let held_records: Vec<&OutcomeRecord> = held.iter().map(|&i| &records[i]).collect();
            let curve = routing_curve(&scores, &held_records);
            let counted = leads_enough(&held_records);
            folds.push(FoldReport {
                held_out: name.clone(),
                prompts: held.len(),
                apgr: curve.apgr.filter(|_| counted),
            });
        }
        let counted: Vec<f64> = folds.iter().filter_map(|f| f.apgr).collect();
        let mean_apgr =
            (!counted.is_empty()).then(|| counted.iter().sum::<f64>() / counted.len() as f64);
        let all: Vec<&OutcomeRecord> = members.iter().map(|&i| &records[i]).collect();
        let scores = HeldOutScores {
            verdicts: all.iter().map(|r| r.verdicts).collect(),
            head: members.iter().map(|&i| held_out_scores[i]).collect(),
            length: length_scores(&all),
            complexity: complexity_scores(Some(model), &all, &weights),
        };
        sources.push(SourceCrossValidation {
            source: source.to_owned(),
            by,
            folds,
            mean_apgr,
            pooled: curve(&scores.head, &scores.verdicts),
            length: curve(&scores.length, &scores.verdicts),
            complexity: Some(curve(&scores.complexity, &scores.verdicts)),
        });
        kept.push(scores);
    }
    let cv = OutcomeCrossValidation {
        records: records.len(),
        sources,
    };
    (cv, kept)
}

/// The logits of the records at `held` (sorted) by a head fitted to the others
/// ([`trained_on`]).
fn score_held_out(
    records: &[OutcomeRecord],
    examples: &[OutcomeExample<'_>],
    held: &[usize],
) -> Vec<f64> {
    let train: Vec<OutcomeExample<'_>> = trained_on(records, held)
        .into_iter()
        .map(|i| examples[i])
        .collect();
    let head = fit_examples(&train);
    held.iter()
        .map(|&i| head.logit(&examples[i].inputs, examples[i].task_class))
        .collect()
}

/// The records a head that scores those at `held` (sorted) may learn from: every other one
/// whose prompt is none of theirs, whatever its source.
fn trained_on(records: &[OutcomeRecord], held: &[usize]) -> Vec<usize> {
    let prompts: HashSet<&str> = held.iter().map(|&i| records[i].prompt_key()).collect();
    (0..records.len())
        .filter(|i| held.binary_search(i).is_err() && !prompts.contains(records[*i].prompt_key()))
        .collect()
}

/// The held-out groups of one source's records (`members`, in order): its categories, or
/// [`FOLDS`] folds by prompt when it has a single one.
fn held_out_groups(
    records: &[OutcomeRecord],
    members: &[usize],
    seed: u64,
) -> (String, BTreeMap<String, Vec<usize>>) {
    let mut groups: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for &i in members {
        groups
            .entry(records[i].category.clone())
            .or_default()
            .push(i);
    }
    if groups.len() > 1 {
        return ("category".to_owned(), groups);
    }
    groups.clear();
    for &i in members {
        let fold = records[i].fold(seed, FOLDS);
        groups
            .entry(format!("fold {}", fold + 1))
            .or_default()
            .push(i);
    }
    (format!("{FOLDS} folds by prompt"), groups)
}

/// Scores by the complexity `model` gives each record's prompt (without a model: the
/// structural score; 0 for a record without text).
pub fn complexity_scores(
    model: Option<&Classifier>,
    records: &[&OutcomeRecord],
    weights: &ComplexityWeights,
) -> Vec<f64> {
    records
        .iter()
        .map(|r| score(&Prompt::user(&r.prompt), weights, model).0.complexity)
        .collect()
}

fn figure(v: Option<f64>) -> String {
    v.map_or("-".to_owned(), |v| format!("{v:.3}"))
}

impl std::fmt::Display for RoutingCurve {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "APGR {}, CPT(50%) {}, CPT(80%) {}",
            figure(self.apgr),
            self.cpt50
                .map_or("-".into(), |v| format!("{:.1}%", 100.0 * v)),
            self.cpt80
                .map_or("-".into(), |v| format!("{:.1}%", 100.0 * v)),
        )
    }
}

impl std::fmt::Display for OutcomeCrossValidation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for s in &self.sources {
            writeln!(f, "{} (held out by {}):", s.source, s.by)?;
            for fold in &s.folds {
                writeln!(
                    f,
                    "  {:<32} {:>5} prompts  APGR {}",
                    fold.held_out,
                    fold.prompts,
                    figure(fold.apgr)
                )?;
            }
            writeln!(
                f,
                "  mean held-out APGR {} (folds whose reference leads by >= {:.0} points)",
                figure(s.mean_apgr),
                100.0 * MIN_GAP
            )?;
            writeln!(f, "  pooled held-out: {}", s.pooled)?;
            writeln!(f, "  prompt length:   {}", s.length)?;
            if let Some(complexity) = &s.complexity {
                writeln!(f, "  complexity:      {complexity}")?;
            }
        }
        Ok(())
    }
}

// === impl Classifier ===

impl Classifier {
    /// The outcome head against the records it was fitted to ([`check_fit`]): its APGR on
    /// them, or why it must not be used. A model without a head passes.
    pub fn check_outcome_fit(
        &self,
        records: &[OutcomeRecord],
        window: usize,
    ) -> Result<Option<f64>, DegenerateHead> {
        match &self.outcome {
            Some(head) => check_fit(head, &self.outcome_examples(records, window)),
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(i: usize, weak: bool, strong: bool) -> OutcomeRecord {
        OutcomeRecord {
            id: i.to_string(),
            source: "s".into(),
            category: "c".into(),
            prompt: "p".repeat(i + 1),
            inputs: None,
            task_class: None,
            verdicts: Verdicts::Correct {
                cheap: weak,
                reference: strong,
            },
        }
    }

    #[test]
    fn a_perfect_ranking_recovers_the_gap_early_and_a_reversed_one_late() {
        // Ten prompts: the reference alone is right on the first five.
        let records: Vec<OutcomeRecord> = (0..10).map(|i| record(i, i >= 5, true)).collect();
        let refs: Vec<&OutcomeRecord> = records.iter().collect();
        let good: Vec<f64> = (0..10).map(|i| -(i as f64)).collect();
        let bad: Vec<f64> = (0..10).map(|i| i as f64).collect();
        let g = routing_curve(&good, &refs);
        let b = routing_curve(&bad, &refs);
        assert_eq!(g.cheap_accuracy, 0.5);
        assert_eq!(g.reference_accuracy, 1.0);
        assert_eq!(g.points.first(), Some(&(0.0, 0.5)));
        assert_eq!(g.points.last(), Some(&(1.0, 1.0)));
        assert!(g.apgr.unwrap() > 0.7, "{g:?}");
        assert!(b.apgr.unwrap() < 0.3, "{b:?}");
        assert!((g.apgr.unwrap() + b.apgr.unwrap() - 1.0).abs() < 0.11);
        assert!(
            g.cpt50.unwrap() < 0.35 && b.cpt50.unwrap() > 0.65,
            "{g:?} {b:?}"
        );
        assert!(g.cpt80.unwrap() <= b.cpt80.unwrap());
    }

    /// A lead of exactly `MIN_GAP` counts (86 against 81 of 100: as a difference of two
    /// accuracies it rounds to just under 0.05), one question less does not.
    #[test]
    fn a_lead_of_exactly_the_minimum_gap_counts() {
        let of = |strong: usize, weak: usize| -> Vec<OutcomeRecord> {
            (0..100).map(|i| record(i, i < weak, i < strong)).collect()
        };
        let leads = |r: Vec<OutcomeRecord>| leads_enough(&r.iter().collect::<Vec<_>>());
        const { assert!(86.0 / 100.0 - 81.0 / 100.0 < MIN_GAP) };
        assert!(leads(of(86, 81)));
        assert!(!leads(of(85, 81)));
    }

    /// The same prompt answered by two model pairs is one prompt: holding it out of one pair's
    /// file holds it out of the other's too. A traffic record without text is its own prompt.
    #[test]
    fn a_held_out_prompt_is_held_out_of_every_source() {
        let mut records: Vec<OutcomeRecord> = (0..6).map(|i| record(i, false, true)).collect();
        for r in &mut records[3..] {
            r.source = "other pair".into();
        }
        // Records 0 and 3, 1 and 4 share their prompts; 2 and 5 do not.
        records[3].prompt = records[0].prompt.clone();
        records[4].prompt = records[1].prompt.clone();
        records.push(OutcomeRecord {
            prompt: String::new(),
            ..record(6, true, true)
        });
        records.push(OutcomeRecord {
            prompt: String::new(),
            ..record(7, true, true)
        });
        assert_eq!(trained_on(&records, &[0]), vec![1, 2, 4, 5, 6, 7]);
        assert_eq!(trained_on(&records, &[1, 2]), vec![0, 3, 5, 6, 7]);
        assert_eq!(trained_on(&records, &[6]), vec![0, 1, 2, 3, 4, 5, 7]);
        assert_eq!(records[0].fold(0, 5), records[3].fold(0, 5));
    }

    #[test]
    fn no_gap_means_no_apgr() {
        let records: Vec<OutcomeRecord> = (0..10).map(|i| record(i, true, true)).collect();
        let refs: Vec<&OutcomeRecord> = records.iter().collect();
        let curve = routing_curve(&length_scores(&refs), &refs);
        assert_eq!(curve.apgr, None);
        assert_eq!(curve.cpt50, None);
    }
}
