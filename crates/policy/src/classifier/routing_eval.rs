//! How well a score ranks prompts for a cheap/reference pair, by RouteLLM's procedure
//! (arXiv 2406.18665; `eval/outcomes/README.md`): the accuracy-vs-reference-share curve over
//! the score's deciles, APGR, CPT(50%) and CPT(80%), and held-out-category
//! cross-validation of the outcome head.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::data::hash;
use super::outcome::{fit_outcomes, OutcomeRecord};
use crate::features::TaskClass;

/// Folds of a benchmark that has a single category.
pub const FOLDS: u64 = 5;

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
    /// `category` (one model per held-out category) or [`FOLDS`] folds (a single category).
    pub by: String,
    pub folds: Vec<FoldReport>,
    /// Mean over folds whose reference is better than the cheap model by at least
    /// [`MIN_GAP`] (smaller gaps make a fold's APGR a ratio of noise).
    pub mean_apgr: Option<f64>,
    /// APGR of the held-out scores of the whole benchmark, pooled.
    pub pooled: RoutingCurve,
    /// The same benchmark by prompt length alone.
    pub length: RoutingCurve,
}

/// The whole cross-validation, kept in a model's metrics.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct OutcomeCrossValidation {
    pub records: usize,
    pub sources: Vec<SourceCrossValidation>,
}

/// Smallest reference-over-cheap accuracy gap a fold needs to count in the mean.
pub const MIN_GAP: f64 = 0.05;

/// Whether the reference answers at least [`MIN_GAP`] of the records more than the cheap
/// model does, counted in records: a difference of two accuracies can round a gap of
/// exactly five points (5 of 100) below it.
fn leads_enough(records: &[&OutcomeRecord]) -> bool {
    let count = |ok: fn(&OutcomeRecord) -> bool| records.iter().filter(|r| ok(r)).count();
    let lead = count(|r| r.strong_correct) as f64 - count(|r| r.weak_correct) as f64;
    lead >= (MIN_GAP * records.len() as f64).ceil()
}

/// The curve of `scores[i]` (higher: send to the reference) over `records[i]`.
pub fn routing_curve(scores: &[f64], records: &[&OutcomeRecord]) -> RoutingCurve {
    let n = records.len().max(1) as f64;
    let cheap = records.iter().filter(|r| r.weak_correct).count() as f64 / n;
    let reference = records.iter().filter(|r| r.strong_correct).count() as f64 / n;
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
            let mut correct = 0usize;
            for (s, r) in scores.iter().zip(records) {
                let to_reference = *s >= threshold;
                strong += usize::from(to_reference);
                correct += usize::from(if to_reference {
                    r.strong_correct
                } else {
                    r.weak_correct
                });
            }
            points.push((strong as f64 / n, correct as f64 / n));
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
/// by a hash of the id and the seed.
pub fn cross_validate(
    records: &[OutcomeRecord],
    window: usize,
    seed: u64,
) -> OutcomeCrossValidation {
    let mut by_source: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (i, r) in records.iter().enumerate() {
        by_source.entry(&r.source).or_default().push(i);
    }
    let mut held_out_scores = vec![0.0; records.len()];
    let mut sources = Vec::new();
    for (source, members) in by_source {
        let mut groups: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        for &i in &members {
            groups
                .entry(records[i].category.clone())
                .or_default()
                .push(i);
        }
        let by = if groups.len() > 1 {
            "category".to_owned()
        } else {
            groups.clear();
            for &i in &members {
                let fold = records[i].fold(seed, FOLDS);
                groups
                    .entry(format!("fold {}", fold + 1))
                    .or_default()
                    .push(i);
            }
            format!("{FOLDS} folds")
        };
        let mut folds = Vec::new();
        for (name, held) in &groups {
            let train: Vec<&OutcomeRecord> = records
                .iter()
                .enumerate()
                .filter(|(i, r)| !(r.source == source && held.binary_search(i).is_ok()))
                .map(|(_, r)| r)
                .collect();
            let head = fit_outcomes(&train, window, Vec::<TaskClass>::new());
            let held_records: Vec<&OutcomeRecord> = held.iter().map(|&i| &records[i]).collect();
            let scores: Vec<f64> = held_records
                .iter()
                .map(|r| head.logit(&r.inputs(window)))
                .collect();
            for (&i, &s) in held.iter().zip(&scores) {
                held_out_scores[i] = s;
            }
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
        let scores: Vec<f64> = members.iter().map(|&i| held_out_scores[i]).collect();
        sources.push(SourceCrossValidation {
            source: source.to_owned(),
            by,
            folds,
            mean_apgr,
            pooled: routing_curve(&scores, &all),
            length: routing_curve(&length_scores(&all), &all),
        });
    }
    OutcomeCrossValidation {
        records: records.len(),
        sources,
    }
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
        }
        Ok(())
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
            weak_correct: weak,
            strong_correct: strong,
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

    #[test]
    fn no_gap_means_no_apgr() {
        let records: Vec<OutcomeRecord> = (0..10).map(|i| record(i, true, true)).collect();
        let refs: Vec<&OutcomeRecord> = records.iter().collect();
        let curve = routing_curve(&length_scores(&refs), &refs);
        assert_eq!(curve.apgr, None);
        assert_eq!(curve.cpt50, None);
    }
}
