//! Routing audit: runs a labelled prompt mix through the policy and reports where each label
//! and each task class lands and what it costs compared with sending everything to
//! `default_profile`.

use std::collections::BTreeMap;
use std::fmt;

use serde::Deserialize;

use crate::classifier::{score, Classifier};
use crate::features::{Prompt, Role, Segment, TaskClass};
use crate::profile::ProfileSet;
use crate::select::{decide, Overrides, RouteError, RouteRequest, RoutingDecision};

/// One line of a prompt-mix JSONL file (`eval/prompt-mix.jsonl`).
#[derive(Debug, Deserialize)]
struct MixLine {
    #[serde(default)]
    id: Option<String>,
    label: String,
    #[serde(default)]
    task_class: Option<TaskClass>,
    prompt: String,
}

/// One prompt to audit.
#[derive(Debug, Clone, Copy)]
pub struct LabelledText<'a> {
    /// Canary key.
    pub key: &'a str,
    pub label: &'a str,
    /// The labelled task class; prompts without one are counted under the predicted class.
    pub task_class: Option<TaskClass>,
    pub text: &'a str,
}

/// Routing shares and costs per label and per task class.
#[derive(Debug, Clone, PartialEq)]
pub struct AuditReport {
    /// Profile ids, in profile-set order (columns of `counts`).
    pub profiles: Vec<String>,
    pub labels: BTreeMap<String, LabelStats>,
    /// By labelled task class, or the predicted one where the data has none.
    pub task_classes: BTreeMap<String, LabelStats>,
}

/// Where the prompts of one label (or task class) went.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LabelStats {
    pub total: u64,
    /// Requests per profile, indexed like `AuditReport::profiles`.
    pub counts: Vec<u64>,
    /// Predicted cost of the routed requests, USD.
    pub cost: f64,
    /// Predicted cost had every request gone to `default_profile`, USD.
    pub default_cost: f64,
}

/// A mix file that cannot be audited.
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error("line {line}: {message}")]
    Line { line: usize, message: String },
    #[error("line {line}: {source}")]
    Route { line: usize, source: RouteError },
}

/// Routes every prompt of a JSONL mix (lines of `{"id", "label", "prompt"}`, optionally
/// `"task_class"`) with no load and all profiles available, scoring with `classifier` when
/// given.
pub fn audit(
    set: &ProfileSet,
    classifier: Option<&Classifier>,
    jsonl: &str,
) -> Result<AuditReport, AuditError> {
    let mut report = AuditReport::new(set);
    for (n, raw) in jsonl.lines().enumerate() {
        let line = n + 1;
        if raw.trim().is_empty() {
            continue;
        }
        let item: MixLine = serde_json::from_str(raw).map_err(|e| AuditError::Line {
            line,
            message: e.to_string(),
        })?;
        let text = LabelledText {
            key: item.id.as_deref().unwrap_or_default(),
            label: &item.label,
            task_class: item.task_class,
            text: &item.prompt,
        };
        report
            .add(set, classifier, &text)
            .map_err(|source| AuditError::Route { line, source })?;
    }
    Ok(report)
}

// === impl AuditReport ===

impl AuditReport {
    /// An empty report for `set`'s profiles.
    pub fn new(set: &ProfileSet) -> Self {
        Self {
            profiles: set.profiles.iter().map(|p| p.id.clone()).collect(),
            labels: BTreeMap::new(),
            task_classes: BTreeMap::new(),
        }
    }

    /// Routes one prompt and counts where it went.
    pub fn add(
        &mut self,
        set: &ProfileSet,
        classifier: Option<&Classifier>,
        item: &LabelledText<'_>,
    ) -> Result<RoutingDecision, RouteError> {
        let prompt = Prompt {
            segments: vec![Segment {
                role: Role::User,
                text: item.text,
            }],
            wants_json: false,
        };
        let (features, _) = score(&prompt, &set.policy.complexity, classifier);
        let req = RouteRequest {
            features: &features,
            max_tokens: None,
            overrides: Overrides::default(),
            routing_key: item.key,
        };
        let decision = decide(set, &req, &[])?;
        let cost = decision.chosen().map_or(0.0, |c| c.cost);
        let default_cost = decision
            .candidate(set.default_index())
            .map_or(0.0, |c| c.cost);
        let class = item.task_class.unwrap_or(decision.task_class).as_str();
        let columns = self.profiles.len();
        for stats in [
            self.labels.entry(item.label.to_owned()),
            self.task_classes.entry(class.to_owned()),
        ] {
            let stats = stats.or_insert_with(|| LabelStats {
                counts: vec![0; columns],
                ..LabelStats::default()
            });
            stats.total += 1;
            stats.counts[decision.profile] += 1;
            stats.cost += cost;
            stats.default_cost += default_cost;
        }
        Ok(decision)
    }

    /// Share of `label`'s prompts routed to `profile` (0 when either is unknown).
    pub fn share(&self, label: &str, profile: &str) -> f64 {
        let Some(stats) = self.labels.get(label) else {
            return 0.0;
        };
        let Some(i) = self.profiles.iter().position(|p| p == profile) else {
            return 0.0;
        };
        stats.counts[i] as f64 / stats.total.max(1) as f64
    }

    fn table(
        &self,
        f: &mut fmt::Formatter<'_>,
        title: &str,
        rows: &BTreeMap<String, LabelStats>,
    ) -> fmt::Result {
        write!(f, "{:<10} {:>6}", title, "total")?;
        for p in &self.profiles {
            write!(f, " {:>16}", p)?;
        }
        writeln!(
            f,
            " {:>12} {:>12} {:>8}",
            "cost_usd", "default_usd", "saved"
        )?;
        for (label, s) in rows {
            write!(f, "{:<10} {:>6}", label, s.total)?;
            for &c in &s.counts {
                let pct = 100.0 * c as f64 / s.total.max(1) as f64;
                write!(f, " {:>9} {:>5.1}%", c, pct)?;
            }
            writeln!(
                f,
                " {:>12.6} {:>12.6} {:>7.1}%",
                s.cost,
                s.default_cost,
                saved(s)
            )?;
        }
        Ok(())
    }
}

fn saved(s: &LabelStats) -> f64 {
    if s.default_cost > 0.0 {
        100.0 * (1.0 - s.cost / s.default_cost)
    } else {
        0.0
    }
}

impl fmt::Display for AuditReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.table(f, "label", &self.labels)?;
        writeln!(f)?;
        self.table(f, "task_class", &self.task_classes)?;
        let total = LabelStats {
            cost: self.labels.values().map(|s| s.cost).sum(),
            default_cost: self.labels.values().map(|s| s.default_cost).sum(),
            ..LabelStats::default()
        };
        writeln!(
            f,
            "\nall prompts: {:.6} USD routed, {:.6} USD all-default, {:.1}% saved",
            total.cost,
            total.default_cost,
            saved(&total)
        )
    }
}
