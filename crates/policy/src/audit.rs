//! Routing audit: runs a labelled prompt mix through the policy and reports where each label
//! lands and what it costs compared with sending everything to `default_profile`.

use std::collections::BTreeMap;
use std::fmt;

use serde::Deserialize;

use crate::features::{FeatureError, Features, Prompt, Role, Segment};
use crate::profile::ProfileSet;
use crate::select::{decide, Overrides, RouteError, RouteRequest};

/// One line of a prompt-mix JSONL file (`shared/eval/prompt-mix.jsonl`).
#[derive(Debug, Deserialize)]
struct MixLine {
    #[serde(default)]
    id: Option<String>,
    label: String,
    prompt: String,
}

/// Per-label routing shares and costs.
#[derive(Debug, Clone, PartialEq)]
pub struct AuditReport {
    /// Profile ids, in profile-set order (columns of `counts`).
    pub profiles: Vec<String>,
    pub labels: BTreeMap<String, LabelStats>,
}

/// Where the prompts of one label went.
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

/// Routes every prompt of a JSONL mix (lines of `{"id", "label", "prompt"}`) with no load
/// and all profiles available.
pub fn audit(set: &ProfileSet, jsonl: &str) -> Result<AuditReport, AuditError> {
    let profiles: Vec<String> = set.profiles.iter().map(|p| p.id.clone()).collect();
    let mut labels: BTreeMap<String, LabelStats> = BTreeMap::new();
    let default = set.default_index();
    for (n, raw) in jsonl.lines().enumerate() {
        let line = n + 1;
        if raw.trim().is_empty() {
            continue;
        }
        let item: MixLine = serde_json::from_str(raw).map_err(|e| AuditError::Line {
            line,
            message: e.to_string(),
        })?;
        let prompt = Prompt {
            segments: vec![Segment {
                role: Role::User,
                text: &item.prompt,
            }],
            wants_json: false,
        };
        let features =
            Features::extract(&prompt, &set.policy.complexity).map_err(|e: FeatureError| {
                AuditError::Line {
                    line,
                    message: e.to_string(),
                }
            })?;
        let req = RouteRequest {
            features: &features,
            max_tokens: None,
            overrides: Overrides::default(),
            routing_key: item.id.as_deref().unwrap_or_default(),
        };
        let decision =
            decide(set, &req, &[]).map_err(|source| AuditError::Route { line, source })?;
        let stats = labels.entry(item.label).or_insert_with(|| LabelStats {
            counts: vec![0; profiles.len()],
            ..LabelStats::default()
        });
        stats.total += 1;
        stats.counts[decision.profile] += 1;
        stats.cost += decision.chosen().map_or(0.0, |c| c.cost);
        stats.default_cost += decision.candidate(default).map_or(0.0, |c| c.cost);
    }
    Ok(AuditReport { profiles, labels })
}

// === impl AuditReport ===

impl AuditReport {
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
}

impl fmt::Display for AuditReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:<10} {:>6}", "label", "total")?;
        for p in &self.profiles {
            write!(f, " {:>16}", p)?;
        }
        writeln!(
            f,
            " {:>12} {:>12} {:>8}",
            "cost_usd", "default_usd", "saved"
        )?;
        for (label, s) in &self.labels {
            write!(f, "{:<10} {:>6}", label, s.total)?;
            for &c in &s.counts {
                let pct = 100.0 * c as f64 / s.total.max(1) as f64;
                write!(f, " {:>9} {:>5.1}%", c, pct)?;
            }
            let saved = if s.default_cost > 0.0 {
                100.0 * (1.0 - s.cost / s.default_cost)
            } else {
                0.0
            };
            writeln!(
                f,
                " {:>12.6} {:>12.6} {:>7.1}%",
                s.cost, s.default_cost, saved
            )?;
        }
        Ok(())
    }
}
