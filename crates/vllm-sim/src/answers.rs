//! Answers to the shipped eval set's prompts (`eval/tier-eval.jsonl`): the right one, or a
//! wrong one when `wrong_rate` picks the prompt.
//!
//! The simulator knows the set because it generates it ([`crate::tier_eval`]); a prompt is
//! known when the last user message (or the completion prompt) is exactly an item's prompt.
//! Every other prompt keeps the vocabulary answer and counts as `general`.

use std::collections::HashMap;
use std::sync::LazyLock;

use serde_json::{Map, Value};

use crate::generate::{filler, SplitMix64};
use crate::tier_eval::{self, MatchKind, TaskClass};

/// What the simulator knows about one eval prompt.
#[derive(Debug)]
pub(crate) struct Known {
    class: TaskClass,
    kind: MatchKind,
    expected: Value,
}

/// Independent streams of per-prompt randomness, so the wrong/right choice and the shape of
/// the answer do not move together.
const WRONG_STREAM: u64 = 0x0077_726f_6e67;
const SHAPE_STREAM: u64 = 0x0073_6861_7065;

static KNOWN: LazyLock<HashMap<String, Known>> = LazyLock::new(|| {
    tier_eval::items()
        .into_iter()
        .map(|item| {
            let known = Known {
                class: item.task_class,
                kind: item.match_kind,
                expected: item.expected,
            };
            (item.prompt, known)
        })
        .collect()
});

/// The eval item whose prompt this is, if any.
pub(crate) fn lookup(prompt: Option<&str>) -> Option<&'static Known> {
    KNOWN.get(prompt?)
}

/// Whether the answer to the prompt with this digest is wrong at `rate` on a simulator with
/// this seed: a fixed draw per (seed, prompt), so asking again gives the same answer and the
/// share of wrong answers over many prompts approaches `rate`.
pub(crate) fn answers_wrong(prompt_hash: u64, seed: u64, rate: f64) -> bool {
    rate > 0.0 && unit(draw(prompt_hash, seed, WRONG_STREAM)) < rate
}

/// A per-(seed, prompt) number for one purpose.
pub(crate) fn draw(prompt_hash: u64, seed: u64, stream: u64) -> u64 {
    SplitMix64::new(prompt_hash ^ SplitMix64::new(seed ^ stream).next_u64()).next_u64()
}

/// The top 53 bits as a float in [0, 1).
fn unit(x: u64) -> f64 {
    (x >> 11) as f64 / (1u64 << 53) as f64
}

// === impl Known ===

impl Known {
    pub(crate) fn class(&self) -> TaskClass {
        self.class
    }

    /// The answer text: right, or wrong in the way the item's check notices (another number,
    /// other words, a JSON object missing a key). `shape` varies the wording per prompt.
    pub(crate) fn answer(&self, wrong: bool, prompt_hash: u64, seed: u64) -> String {
        let shape = draw(prompt_hash, seed, SHAPE_STREAM);
        match (self.kind, wrong) {
            (MatchKind::Number, false) => format!("The answer is {}.", self.expected),
            (MatchKind::Number, true) => {
                format!("The answer is {}.", off_by(&self.expected, shape))
            }
            (MatchKind::Exact, false) => text_of(&self.expected),
            (MatchKind::Contains, false) => format!("{}.", first_text(&self.expected)),
            (MatchKind::Exact | MatchKind::Contains, true) => {
                filler(shape, 3 + (shape % 4) as usize)
            }
            (MatchKind::Json, wrong) => {
                let mut object = object_of(&self.expected);
                if let Some(first) = object.keys().next().cloned().filter(|_| wrong) {
                    object.remove(&first);
                }
                let body = Value::Object(object).to_string();
                if shape & 1 == 1 {
                    format!("```json\n{body}\n```")
                } else {
                    body
                }
            }
        }
    }
}

/// `expected` plus 1 to 9, so a wrong number is never the right one.
fn off_by(expected: &Value, shape: u64) -> Value {
    let delta = 1 + (shape >> 8) % 9;
    match expected.as_i64() {
        Some(n) => Value::from(n.saturating_add(delta as i64)),
        None => Value::from(expected.as_f64().unwrap_or(0.0) + delta as f64),
    }
}

fn text_of(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// The answer for a `contains` item: its text, or the first of its accepted texts.
fn first_text(value: &Value) -> String {
    match value {
        Value::Array(items) => items.first().map(text_of).unwrap_or_default(),
        other => text_of(other),
    }
}

/// The object a `json` item expects: itself, or its list of keys with placeholder values.
fn object_of(expected: &Value) -> Map<String, Value> {
    match expected {
        Value::Object(object) => object.clone(),
        Value::Array(keys) => keys
            .iter()
            .map(|key| (text_of(key), Value::from("value")))
            .collect(),
        _ => Map::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tier_eval::items;

    fn normalise(text: &str) -> String {
        text.trim().trim_end_matches('.').to_lowercase()
    }

    #[test]
    fn every_shipped_prompt_is_known() {
        for item in items() {
            let known = lookup(Some(&item.prompt)).unwrap();
            assert_eq!(known.class, item.task_class);
        }
        assert!(lookup(Some("What is the capital of Atlantis?")).is_none());
        assert!(lookup(None).is_none());
    }

    #[test]
    fn right_answers_carry_the_expected_value_and_wrong_ones_do_not() {
        for seed in [0, 1, 42] {
            for item in items() {
                let known = lookup(Some(&item.prompt)).unwrap();
                let hash = item.prompt.len() as u64 * 7919;
                let right = known.answer(false, hash, seed);
                let wrong = known.answer(true, hash, seed);
                assert_ne!(right, wrong);
                match item.match_kind {
                    MatchKind::Number => {
                        let number = |s: &str| {
                            s.trim_start_matches("The answer is ")
                                .trim_end_matches('.')
                                .parse::<i64>()
                                .unwrap()
                        };
                        assert_eq!(number(&right), item.expected.as_i64().unwrap());
                        assert_ne!(number(&wrong), item.expected.as_i64().unwrap());
                    }
                    MatchKind::Exact => {
                        assert_eq!(normalise(&right), normalise(&text_of(&item.expected)));
                        assert_ne!(normalise(&wrong), normalise(&text_of(&item.expected)));
                    }
                    MatchKind::Contains => {
                        let expected = first_text(&item.expected).to_lowercase();
                        assert!(right.to_lowercase().contains(&expected), "{right}");
                        assert!(!wrong.to_lowercase().contains(&expected), "{wrong}");
                    }
                    MatchKind::Json => {
                        let strip = |s: &str| {
                            s.trim_start_matches("```json\n")
                                .trim_end_matches("\n```")
                                .to_owned()
                        };
                        let right: Value = serde_json::from_str(&strip(&right)).unwrap();
                        let wrong: Value = serde_json::from_str(&strip(&wrong)).unwrap();
                        assert_eq!(right, item.expected);
                        assert!(
                            wrong.as_object().unwrap().len() < right.as_object().unwrap().len()
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn wrong_answers_follow_the_rate_and_stay_put_per_prompt() {
        let wrong = (0..10_000u64)
            .filter(|&h| answers_wrong(h.wrapping_mul(0x9e37_79b9_7f4a_7c15), 3, 0.2))
            .count();
        assert!((1_800..=2_200).contains(&wrong), "{wrong}");
        assert!((0..1000).all(|h| answers_wrong(h, 3, 1.0)));
        assert!((0..1000).all(|h| !answers_wrong(h, 3, 0.0)));
        let picks = |seed| {
            (0..200u64)
                .map(|h| answers_wrong(h, seed, 0.5))
                .collect::<Vec<_>>()
        };
        assert_eq!(picks(3), picks(3));
        assert_ne!(picks(3), picks(4));
    }
}
