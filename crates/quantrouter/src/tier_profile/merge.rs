//! From measurements to profile fields: which quality figures a run supports, and writing
//! them with the measured latency into one profile of a set. Pure; the caller reads and
//! writes the file or Redis.

use std::collections::BTreeMap;

use quantrouter_policy::{ProfileSet, Quality, ValidationErrors};
use serde::Serialize;

use super::eval::EvalClass;
use super::stats::{ClassTallies, Tally};

/// Task classes with a quality field of their own in the profile schema. A class missing
/// here is served with `quality.default`, so its items count towards that figure.
const FIELD_CLASSES: [EvalClass; 4] = [
    EvalClass::Code,
    EvalClass::Math,
    EvalClass::Structured,
    EvalClass::Reasoning,
];

/// The profile fields a run measured.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Measured {
    /// Absent when no streamed request completed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub latency: Option<MeasuredLatency>,
    /// Empty without an eval set (or without enough items).
    #[serde(skip_serializing_if = "QualityFigures::is_empty")]
    pub quality: QualityFigures,
}

/// `latency.ttft_ms` and `latency.itl_ms`: medians at the lowest concurrency measured, since
/// the router adds queueing from live load itself.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct MeasuredLatency {
    pub ttft_ms: f64,
    /// Absent when every answer was a single token.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub itl_ms: Option<f64>,
}

/// `quality.default` and per-class figures, each backed by enough items.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct QualityFigures {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub default: Option<f64>,
    #[serde(flatten)]
    pub classes: BTreeMap<EvalClass, f64>,
}

/// Why a measurement could not be written into a set.
#[derive(Debug, thiserror::Error)]
pub enum MergeError {
    #[error("no profile `{0}` in the set (add it with its upstream and costs first)")]
    UnknownProfile(String),
    #[error("the set would be invalid:\n{0}")]
    Invalid(ValidationErrors),
}

// === impl QualityFigures ===

impl QualityFigures {
    /// Figures from per-class tallies: a class with a field of its own gets one when it has
    /// at least `min_items` answers; `quality.default` is the rate over the classes without
    /// one (what the router uses it for), or over every class when those are too few.
    pub fn from_tallies(tallies: &ClassTallies, min_items: u32) -> Self {
        let enough = |t: Tally| (t.total >= min_items.max(1)).then(|| t.rate()).flatten();
        let classes = FIELD_CLASSES
            .iter()
            .filter_map(|&class| Some((class, round(enough(tallies.get(class))?, 3))))
            .collect();
        let without_field = tallies
            .0
            .iter()
            .filter(|(class, _)| !FIELD_CLASSES.contains(class))
            .fold(Tally::default(), |mut all, (_, t)| {
                all.merge(*t);
                all
            });
        let default = enough(without_field)
            .or_else(|| enough(tallies.overall()))
            .map(|rate| round(rate, 3));
        Self { default, classes }
    }

    pub fn is_empty(&self) -> bool {
        self.default.is_none() && self.classes.is_empty()
    }

    fn write_into(&self, quality: &mut Quality) {
        if let Some(default) = self.default {
            quality.default = default;
        }
        for (&class, &rate) in &self.classes {
            let field = match class {
                EvalClass::Code => &mut quality.code,
                EvalClass::Math => &mut quality.math,
                EvalClass::Structured => &mut quality.structured,
                EvalClass::Reasoning => &mut quality.reasoning,
                // No field of its own (FIELD_CLASSES never yields it).
                EvalClass::General => continue,
            };
            *field = Some(rate);
        }
    }
}

/// Writes the measured fields into profile `id` and validates the whole set. Fields the run
/// did not measure keep their values. On error `set` may be partly changed: callers work on
/// a copy.
pub fn apply(set: &mut ProfileSet, id: &str, measured: &Measured) -> Result<(), MergeError> {
    let profile = set
        .profiles
        .iter_mut()
        .find(|p| p.id == id)
        .ok_or_else(|| MergeError::UnknownProfile(id.to_owned()))?;
    if let Some(latency) = measured.latency {
        profile.latency.ttft_ms = positive(latency.ttft_ms);
        if let Some(itl) = latency.itl_ms {
            profile.latency.itl_ms = positive(itl);
        }
    }
    measured.quality.write_into(&mut profile.quality);
    set.validate().map_err(MergeError::Invalid)
}

/// Rounded to 0.01 ms and at least that: the schema wants latencies above zero, and a
/// loopback server can answer faster than rounding shows.
fn positive(ms: f64) -> f64 {
    round(ms, 2).max(0.01)
}

fn round(value: f64, decimals: i32) -> f64 {
    let scale = 10f64.powi(decimals);
    (value * scale).round() / scale
}

#[cfg(test)]
mod tests {
    use quantrouter_policy::DEFAULT_PROFILE_SET;

    use super::*;

    fn tallies(entries: &[(EvalClass, u32, u32)]) -> ClassTallies {
        let mut t = ClassTallies::default();
        for &(class, matched, total) in entries {
            t.0.insert(class, Tally { matched, total });
        }
        t
    }

    #[test]
    fn classes_need_enough_items_and_default_covers_classes_without_a_field() {
        let t = tallies(&[
            (EvalClass::Math, 80, 100),
            (EvalClass::Code, 4, 5),
            (EvalClass::General, 55, 60),
            (EvalClass::Reasoning, 35, 40),
        ]);
        let q = QualityFigures::from_tallies(&t, 10);
        assert_eq!(
            q.classes,
            BTreeMap::from([(EvalClass::Math, 0.8), (EvalClass::Reasoning, 0.875)])
        );
        assert_eq!(q.default, Some(0.917));
    }

    #[test]
    fn default_falls_back_to_every_class_and_then_to_nothing() {
        let t = tallies(&[(EvalClass::Math, 90, 100), (EvalClass::General, 1, 2)]);
        let q = QualityFigures::from_tallies(&t, 10);
        assert_eq!(q.default, Some(0.892));
        assert!(QualityFigures::from_tallies(&tallies(&[(EvalClass::Math, 1, 2)]), 10).is_empty());
    }

    #[test]
    fn apply_writes_measured_fields_and_keeps_the_rest() {
        let mut set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
        let id = set.profiles[2].id.clone();
        let before = set.profiles[2].clone();
        let measured = Measured {
            latency: Some(MeasuredLatency {
                ttft_ms: 41.234,
                itl_ms: None,
            }),
            quality: QualityFigures {
                default: Some(0.91),
                classes: BTreeMap::from([(EvalClass::Math, 0.7)]),
            },
        };
        apply(&mut set, &id, &measured).unwrap();
        let after = &set.profiles[2];
        assert_eq!(after.latency.ttft_ms, 41.23);
        assert_eq!(after.latency.itl_ms, before.latency.itl_ms);
        assert_eq!(after.quality.default, 0.91);
        assert_eq!(after.quality.math, Some(0.7));
        assert_eq!(after.quality.code, before.quality.code);
        assert_eq!(
            after.cost_per_1m_input_tokens,
            before.cost_per_1m_input_tokens
        );
    }

    #[test]
    fn apply_rejects_unknown_ids_and_never_writes_zero_latency() {
        let mut set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
        let err = apply(&mut set, "nope", &Measured::default()).unwrap_err();
        assert!(matches!(err, MergeError::UnknownProfile(_)));
        let id = set.profiles[0].id.clone();
        let fast = Measured {
            latency: Some(MeasuredLatency {
                ttft_ms: 0.0004,
                itl_ms: Some(0.0),
            }),
            ..Measured::default()
        };
        apply(&mut set, &id, &fast).unwrap();
        assert_eq!(set.profiles[0].latency.ttft_ms, 0.01);
        assert_eq!(set.profiles[0].latency.itl_ms, 0.01);
    }

    #[test]
    fn figures_serialise_as_quality_fields() {
        let q = QualityFigures {
            default: Some(0.9),
            classes: BTreeMap::from([(EvalClass::Structured, 0.85)]),
        };
        assert_eq!(
            serde_json::to_value(&q).unwrap(),
            serde_json::json!({"default": 0.9, "structured": 0.85})
        );
    }
}
