//! How well a model routes labelled prompts: task-class accuracy and its confusion
//! matrix, where each difficulty label lands, and leave-one-source-out generalisation.
//!
//! The routing numbers that matter are the share of heavy prompts sent to the cheapest
//! profile (should be near zero) and the share of light prompts sent there (should be
//! high). Prompts from the sources a model was trained on flatter it; leave-one-source-out
//! trains without a source and measures on it, which is closer to traffic it never saw.

use std::collections::BTreeSet;

use super::data::{Difficulty, LabelledPrompt, Split};
use super::metrics::{EvalSummary, LosoSummary, SourceReport};
use super::train::{fit, TrainOptions};
use super::{Classifier, CLASSES, TASK_CLASSES};
use crate::audit::{AuditReport, LabelledText};
use crate::profile::ProfileSet;
use crate::select::RouteError;

/// Routing and classification of a labelled data set.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalReport {
    pub audit: AuditReport,
    pub task_class: Option<ClassReport>,
    /// The cheapest profile by output price, the one the shares below are about.
    pub cheapest: String,
}

/// Task-class accuracy over the prompts that have a labelled class.
#[derive(Debug, Clone, PartialEq)]
pub struct ClassReport {
    pub prompts: usize,
    pub correct: usize,
    /// `confusion[labelled][predicted]`, in [`TASK_CLASSES`] order.
    pub confusion: [[usize; CLASSES]; CLASSES],
}

/// Routes every prompt with `classifier` (none: the structural score alone) and compares
/// with the labels.
pub fn evaluate(
    set: &ProfileSet,
    classifier: Option<&Classifier>,
    data: &[&LabelledPrompt],
) -> Result<EvalReport, RouteError> {
    let mut audit = AuditReport::new(set);
    let mut confusion = [[0usize; CLASSES]; CLASSES];
    for p in data {
        let routed = audit.add(
            set,
            classifier,
            &LabelledText {
                key: &p.id,
                label: p.label.as_str(),
                task_class: p.task_class,
                text: &p.prompt,
            },
        )?;
        if let Some(labelled) = p.task_class {
            let row = TASK_CLASSES.iter().position(|&c| c == labelled);
            let col = TASK_CLASSES.iter().position(|&c| c == routed.task_class);
            if let (Some(r), Some(c)) = (row, col) {
                confusion[r][c] += 1;
            }
        }
    }
    let prompts: usize = confusion.iter().flatten().sum();
    let task_class = (prompts > 0).then(|| ClassReport {
        prompts,
        correct: (0..CLASSES).map(|i| confusion[i][i]).sum(),
        confusion,
    });
    Ok(EvalReport {
        cheapest: set.cheapest().id.clone(),
        audit,
        task_class,
    })
}

/// Trains one model per source without that source's training prompts and measures it on
/// all of that source's prompts. Sources in `always_trained` are never held out (data
/// written to fill a gap of the others, which must not count as one of them).
pub fn leave_one_source_out(
    set: &ProfileSet,
    data: &[LabelledPrompt],
    options: &TrainOptions,
    always_trained: &[String],
) -> Result<LosoSummary, RouteError> {
    let sources: BTreeSet<&str> = data
        .iter()
        .filter(|p| p.split == Split::Train && !always_trained.contains(&p.source))
        .map(|p| p.source.as_str())
        .collect();
    let mut reports = Vec::new();
    for source in sources {
        let train: Vec<&LabelledPrompt> = data
            .iter()
            .filter(|p| p.split == Split::Train && p.source != source)
            .collect();
        let held_out: Vec<&LabelledPrompt> = data.iter().filter(|p| p.source == source).collect();
        let model = fit(&train, options);
        let report = evaluate(set, Some(&model), &held_out)?;
        reports.push(SourceReport {
            source: source.to_owned(),
            summary: report.summary(),
        });
    }
    Ok(LosoSummary::of(reports))
}

// === impl EvalReport ===

impl EvalReport {
    /// Share of `label`'s prompts on the cheapest profile, if there are any.
    pub fn to_cheapest(&self, label: Difficulty) -> Option<f64> {
        self.audit
            .labels
            .contains_key(label.as_str())
            .then(|| self.audit.share(label.as_str(), &self.cheapest))
    }

    pub fn summary(&self) -> EvalSummary {
        EvalSummary {
            prompts: self.audit.labels.values().map(|s| s.total as usize).sum(),
            task_class_accuracy: self.task_class.as_ref().map(ClassReport::accuracy),
            heavy_to_cheapest: self.to_cheapest(Difficulty::Heavy),
            light_to_cheapest: self.to_cheapest(Difficulty::Light),
        }
    }
}

impl std::fmt::Display for EvalReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.audit)?;
        for label in [Difficulty::Heavy, Difficulty::Light] {
            if let Some(share) = self.to_cheapest(label) {
                writeln!(
                    f,
                    "{} -> cheapest ({}): {:.1}%",
                    label.as_str(),
                    self.cheapest,
                    100.0 * share
                )?;
            }
        }
        if let Some(classes) = &self.task_class {
            write!(f, "{classes}")?;
        }
        Ok(())
    }
}

// === impl ClassReport ===

impl ClassReport {
    pub fn accuracy(&self) -> f64 {
        self.correct as f64 / self.prompts.max(1) as f64
    }
}

impl std::fmt::Display for ClassReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "task class accuracy: {:.1}% of {} (rows: labelled, columns: predicted)",
            100.0 * self.accuracy(),
            self.prompts
        )?;
        write!(f, "{:<12}", "")?;
        for c in TASK_CLASSES {
            write!(f, " {:>10}", c.as_str())?;
        }
        writeln!(f)?;
        for (c, row) in TASK_CLASSES.iter().zip(&self.confusion) {
            write!(f, "{:<12}", c.as_str())?;
            for n in row {
                write!(f, " {n:>10}")?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}

// === impl LosoSummary ===

impl LosoSummary {
    fn of(sources: Vec<SourceReport>) -> Self {
        let stats =
            |pick: fn(&EvalSummary) -> Option<f64>, worst: fn(f64, f64) -> f64, start: f64| {
                let values: Vec<f64> = sources.iter().filter_map(|s| pick(&s.summary)).collect();
                let mean = values.iter().sum::<f64>() / values.len().max(1) as f64;
                (mean, values.iter().copied().fold(start, worst))
            };
        let (mean_heavy, worst_heavy) = stats(|s| s.heavy_to_cheapest, f64::max, 0.0);
        let (mean_light, worst_light) = stats(|s| s.light_to_cheapest, f64::min, 1.0);
        Self {
            sources,
            mean_heavy_to_cheapest: mean_heavy,
            worst_heavy_to_cheapest: worst_heavy,
            mean_light_to_cheapest: mean_light,
            worst_light_to_cheapest: worst_light,
        }
    }
}

impl std::fmt::Display for LosoSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{:<16} {:>7} {:>18} {:>18} {:>10}",
            "held-out source", "prompts", "heavy->cheapest", "light->cheapest", "class acc"
        )?;
        let pct = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{:.1}%", 100.0 * v));
        for s in &self.sources {
            writeln!(
                f,
                "{:<16} {:>7} {:>18} {:>18} {:>10}",
                s.source,
                s.summary.prompts,
                pct(s.summary.heavy_to_cheapest),
                pct(s.summary.light_to_cheapest),
                pct(s.summary.task_class_accuracy)
            )?;
        }
        writeln!(
            f,
            "mean heavy->cheapest {:.1}% (worst {:.1}%), mean light->cheapest {:.1}% (worst {:.1}%)",
            100.0 * self.mean_heavy_to_cheapest,
            100.0 * self.worst_heavy_to_cheapest,
            100.0 * self.mean_light_to_cheapest,
            100.0 * self.worst_light_to_cheapest
        )
    }
}
