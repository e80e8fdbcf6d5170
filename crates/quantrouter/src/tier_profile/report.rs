//! Scoring the eval answers and presenting a run: the JSON entry on stdout and a table for
//! people. Pure.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use super::eval::EvalItem;
use super::matchers::agree;
use super::merge::Measured;
use super::run::ItemOutcome;
use super::stats::{ClassTallies, Figure, LevelReport, Spread};

/// What the quality figures written to a profile measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum QualitySource {
    /// Share of eval items answered right.
    Accuracy,
    /// Share of eval items answered as the baseline answered them.
    Agreement,
}

/// One pass over the eval set: accuracy, or agreement with the baseline.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PassReport {
    /// Items the run planned (after `--max-requests`).
    pub items: usize,
    /// Items judged.
    pub answered: u32,
    /// Items not judged because a request failed, by kind.
    pub errors: BTreeMap<String, usize>,
    /// Items the deadline left out.
    pub not_run: usize,
    pub overall: Option<Figure>,
    pub by_class: BTreeMap<&'static str, Figure>,
    #[serde(skip)]
    pub tallies: ClassTallies,
}

/// The JSON printed on stdout: the profile fields to merge, then how they were measured.
#[derive(Debug, Serialize)]
pub struct Report<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<&'a str>,
    pub model: &'a str,
    #[serde(flatten)]
    pub measured: &'a Measured,
    pub measurements: Measurements<'a>,
}

/// The numbers behind the profile fields.
#[derive(Debug, Serialize)]
pub struct Measurements<'a> {
    pub url: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub baseline: Option<&'a str>,
    pub quality_source: QualitySource,
    pub min_items: u32,
    /// Requests sent, to the tier and the baseline.
    pub requests: usize,
    /// The run's deadline cut it short.
    pub timed_out: bool,
    pub levels: &'a [LevelReport],
    /// Items in the eval set, of which `accuracy.items` were planned.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_items_in_set: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub accuracy: Option<&'a PassReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agreement: Option<&'a PassReport>,
}

/// Judges every answer: accuracy against the items, and agreement with the baseline's
/// answers when there was a baseline.
pub fn score(
    items: &[&EvalItem],
    outcomes: &[Option<ItemOutcome>],
    with_baseline: bool,
) -> (PassReport, Option<PassReport>) {
    let mut accuracy = PassReport {
        items: items.len(),
        ..PassReport::default()
    };
    let mut agreement = accuracy.clone();
    for (item, outcome) in items.iter().zip(outcomes) {
        let Some(outcome) = outcome else {
            accuracy.not_run += 1;
            agreement.not_run += 1;
            continue;
        };
        match &outcome.tier {
            Ok(answer) => accuracy.judged(item, item.expected.judge(answer)),
            Err(error) => accuracy.failed(error.kind()),
        }
        match (&outcome.tier, &outcome.baseline) {
            (Ok(answer), Some(Ok(reference))) => {
                agreement.judged(item, agree(item.kind, answer, reference))
            }
            (Err(error), _) => agreement.failed(format!("tier_{}", error.kind())),
            (_, Some(Err(error))) => agreement.failed(format!("baseline_{}", error.kind())),
            (Ok(_), None) => {}
        }
    }
    for pass in [&mut accuracy, &mut agreement] {
        pass.overall = pass.tallies.overall().figure();
        pass.by_class = pass.tallies.figures();
    }
    (accuracy, with_baseline.then_some(agreement))
}

// === impl PassReport ===

impl PassReport {
    fn judged(&mut self, item: &EvalItem, matched: bool) {
        self.answered += 1;
        self.tallies.add(item.class, matched);
    }

    fn failed(&mut self, kind: String) {
        *self.errors.entry(kind).or_default() += 1;
    }
}

/// The run as a table for people (stderr).
pub fn table(report: &Report<'_>) -> String {
    let m = &report.measurements;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "profile-tier {} (model {}): {} requests{}",
        m.url,
        report.model,
        m.requests,
        if m.timed_out {
            ", cut short by --timeout"
        } else {
            ""
        }
    );
    if !m.levels.is_empty() {
        let _ = writeln!(
            out,
            "\n{:>11} {:>8} {:>6} {:>20} {:>18} {:>12} {:>10}",
            "concurrency",
            "requests",
            "errors",
            "ttft p50/p90 ms",
            "itl p50/p90 ms",
            "tokens/s",
            "req/s"
        );
        for level in m.levels {
            let _ = writeln!(
                out,
                "{:>11} {:>8} {:>6} {:>20} {:>18} {:>12.1} {:>10.2}",
                level.concurrency,
                level.requests,
                level.requests - level.succeeded,
                spread_cell(level.ttft_ms),
                spread_cell(level.itl_ms),
                level.output_tokens_per_s,
                level.requests_per_s
            );
        }
    }
    if let Some(accuracy) = m.accuracy {
        eval_table(&mut out, m, accuracy);
    }
    let _ = writeln!(out, "\nprofile entry: {}", entry_line(report.measured));
    out
}

fn eval_table(out: &mut String, m: &Measurements<'_>, accuracy: &PassReport) {
    let _ = writeln!(
        out,
        "\neval set: {} of {} items{}",
        accuracy.items,
        m.eval_items_in_set.unwrap_or(accuracy.items),
        match m.baseline {
            Some(url) => format!(", agreement with {url}"),
            None => String::new(),
        }
    );
    let _ = writeln!(
        out,
        "{:<12} {:>18} {:>18}",
        "class", "accuracy", "agreement"
    );
    let rows = accuracy
        .by_class
        .iter()
        .map(|(class, figure)| (*class, Some(*figure)))
        .chain([("all", accuracy.overall)]);
    for (class, figure) in rows {
        let agreed = m.agreement.and_then(|a| match class {
            "all" => a.overall,
            class => a.by_class.get(class).copied(),
        });
        let _ = writeln!(
            out,
            "{:<12} {:>18} {:>18}",
            class,
            figure_cell(figure),
            figure_cell(agreed)
        );
    }
    for (name, pass) in [("accuracy", Some(accuracy)), ("agreement", m.agreement)] {
        let Some(pass) = pass else { continue };
        if !pass.errors.is_empty() || pass.not_run > 0 {
            let errors: Vec<String> = pass
                .errors
                .iter()
                .map(|(k, n)| format!("{k} x{n}"))
                .collect();
            let _ = writeln!(
                out,
                "{name}: {} not judged ({}), {} not run",
                pass.errors.values().sum::<usize>(),
                errors.join(", "),
                pass.not_run
            );
        }
    }
}

fn spread_cell(spread: Option<Spread>) -> String {
    spread.map_or_else(
        || "-".to_owned(),
        |s| format!("{:.1} / {:.1}", s.p50, s.p90),
    )
}

fn figure_cell(figure: Option<Figure>) -> String {
    figure.map_or_else(
        || "-".to_owned(),
        |f| format!("{}/{} {:.3}", f.matched, f.total, f.rate),
    )
}

fn entry_line(measured: &Measured) -> String {
    let mut parts = Vec::new();
    if let Some(latency) = measured.latency {
        let itl = latency
            .itl_ms
            .map_or_else(|| "-".to_owned(), |v| format!("{v:.2}"));
        parts.push(format!(
            "latency.ttft_ms {:.2}, latency.itl_ms {itl}",
            latency.ttft_ms
        ));
    }
    if let Some(default) = measured.quality.default {
        parts.push(format!("quality.default {default:.3}"));
    }
    for (class, rate) in &measured.quality.classes {
        parts.push(format!("quality.{} {rate:.3}", class.as_str()));
    }
    if parts.is_empty() {
        "nothing measured".to_owned()
    } else {
        parts.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::tier_profile::client::RequestError;
    use crate::tier_profile::eval;

    fn items() -> Vec<EvalItem> {
        eval::parse(
            r#"{"prompt": "2+2?", "expected": 4, "task_class": "math", "match": "number"}
{"prompt": "3+3?", "expected": 6, "task_class": "math", "match": "number"}
{"prompt": "Capital of France?", "expected": "Paris", "match": "contains"}
{"prompt": "Say yes.", "expected": "yes", "task_class": "reasoning"}"#,
        )
        .unwrap()
    }

    fn answered(tier: &str, baseline: Option<&str>) -> Option<ItemOutcome> {
        Some(ItemOutcome {
            tier: Ok(tier.to_owned()),
            baseline: baseline.map(|b| Ok(b.to_owned())),
        })
    }

    #[test]
    fn score_judges_answers_and_counts_failures_apart() {
        let items = items();
        let refs: Vec<&EvalItem> = items.iter().collect();
        let outcomes = [
            answered("It is 4.", Some("4")),
            answered("7", Some("6")),
            Some(ItemOutcome {
                tier: Err(RequestError::Status {
                    status: 503,
                    message: String::new(),
                }),
                baseline: Some(Ok("Paris".into())),
            }),
            None,
        ];
        let (accuracy, agreement) = score(&refs, &outcomes, true);
        assert_eq!(accuracy.answered, 2);
        assert_eq!(accuracy.by_class["math"].rate, 0.5);
        assert_eq!(accuracy.errors, BTreeMap::from([("status_503".into(), 1)]));
        assert_eq!(accuracy.not_run, 1);
        let agreement = agreement.unwrap();
        assert_eq!(
            agreement.overall.map(|f| (f.matched, f.total)),
            Some((1, 2))
        );
        assert_eq!(
            agreement.errors,
            BTreeMap::from([("tier_status_503".into(), 1)])
        );
        let (_, none) = score(&refs, &outcomes, false);
        assert!(none.is_none());
    }

    #[test]
    fn the_report_puts_profile_fields_first_and_the_table_shows_them() {
        let measured = Measured {
            latency: Some(crate::tier_profile::merge::MeasuredLatency {
                ttft_ms: 42.0,
                itl_ms: Some(8.5),
            }),
            quality: crate::tier_profile::merge::QualityFigures {
                default: Some(0.9),
                classes: BTreeMap::new(),
            },
        };
        let items = items();
        let refs: Vec<&EvalItem> = items.iter().collect();
        let outcomes: Vec<_> = ["4", "6", "Paris", "yes"]
            .iter()
            .map(|a| answered(a, None))
            .collect();
        let (accuracy, _) = score(&refs, &outcomes, false);
        let report = Report {
            id: Some("tier-a"),
            model: "m",
            measured: &measured,
            measurements: Measurements {
                url: "http://x:1",
                baseline: None,
                quality_source: QualitySource::Accuracy,
                min_items: 10,
                requests: 12,
                timed_out: false,
                levels: &[],
                eval_items_in_set: Some(4),
                accuracy: Some(&accuracy),
                agreement: None,
            },
        };
        let value = serde_json::to_value(&report).unwrap();
        assert_eq!(value["latency"], json!({"ttft_ms": 42.0, "itl_ms": 8.5}));
        assert_eq!(value["quality"], json!({"default": 0.9}));
        assert_eq!(value["measurements"]["accuracy"]["overall"]["rate"], 1.0);
        let text = table(&report);
        assert!(text.contains("math"), "{text}");
        assert!(text.contains("4/4 1.000"), "{text}");
        assert!(text.contains("quality.default 0.900"), "{text}");
    }
}
