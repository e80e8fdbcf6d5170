//! Answers to the shipped eval set's prompts (`eval/tier-eval.jsonl`): the right one, or a
//! wrong one when `wrong_rate` picks the prompt.
//!
//! The simulator knows the set because it generates it ([`crate::tier_eval`]); a prompt is
//! known when the last user message (or the completion prompt) is exactly an item's prompt.
//! Every other prompt keeps the vocabulary answer and counts as `general`.

use std::collections::HashMap;
use std::sync::LazyLock;

use serde_json::{Map, Value};

use crate::faults::WrongWhen;
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

/// The instruction of a difficulty rating (`policy.second_opinion`), as the router sends it
/// in the system message.
pub const RATING_INSTRUCTION: &str = "Rate how hard the following request is for you to \
answer correctly, from 0 (trivial) to 9 (beyond you). Reply with a single digit.";

/// Whether a chat request is the router's difficulty rating: its system message, first,
/// is the rating instruction (`cache_text` is each message's role and text, a line each).
pub(crate) fn is_rating(cache_text: &str) -> bool {
    cache_text
        .strip_prefix("system\n")
        .is_some_and(|rest| rest.starts_with(RATING_INSTRUCTION))
}

/// The numbers of a text: runs of digits, with a decimal point inside.
pub(crate) fn quantities(text: &str) -> Vec<f64> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if !bytes[i].is_ascii_digit() {
            i += 1;
            continue;
        }
        let start = i;
        while i < bytes.len()
            && (bytes[i].is_ascii_digit()
                || (bytes[i] == b'.' && bytes.get(i + 1).is_some_and(u8::is_ascii_digit)))
        {
            i += 1;
        }
        if let Ok(n) = text[start..i].parse::<f64>() {
            out.push(n);
        }
    }
    out
}

/// A word problem's answer under `wrong_when`: the sum of its numbers, or, wrong, the sum
/// plus 1 to 9 (`shape`), as the last number of the text.
pub(crate) fn word_problem_answer(numbers: &[f64], wrong: bool, shape: u64) -> String {
    let sum: f64 = numbers.iter().sum();
    let answer = match wrong {
        true => sum + (1 + (shape >> 8) % 9) as f64,
        false => sum,
    };
    match answer.fract() == 0.0 && answer.abs() < 1e15 {
        true => format!("The answer is {}.", answer as i64),
        false => format!("The answer is {answer}."),
    }
}

/// The digit a rating answers with: 7 to 9 for a message the rule answers wrongly (more so
/// the further past its limit), 0 to 3 for one it answers rightly (more numbers, or for a
/// message without numbers more listed items, higher).
pub(crate) fn rating(text: &str, rule: Option<WrongWhen>) -> u8 {
    let quantities = quantities(text).len();
    let (count, limit, wrong) = match rule {
        Some(rule) if quantities == 0 && rule.items_over.is_some() => {
            let items = list_items(text);
            (items, rule.items_over, rule.wrong_items(items))
        }
        _ => (
            quantities,
            rule.and_then(|r| r.quantities_over),
            rule.is_some_and(|r| r.wrong(quantities)),
        ),
    };
    match (wrong, limit) {
        (true, Some(limit)) => 7 + (count - limit as usize - 1).min(2) as u8,
        (true, None) => 9,
        (false, Some(limit)) => (3 * count / (limit as usize + 1)).min(3) as u8,
        (false, None) => (count / 2).min(3) as u8,
    }
}

/// The items a text lists: lines starting `- ` or `* ` (after any indentation).
pub(crate) fn list_items(text: &str) -> usize {
    text.lines()
        .filter(|line| {
            let line = line.trim_start();
            line.starts_with("- ") || line.starts_with("* ")
        })
        .count()
}

/// The draw that shapes a wrong answer, for callers outside this module.
pub(crate) fn shape(prompt_hash: u64, seed: u64) -> u64 {
    draw(prompt_hash, seed, SHAPE_STREAM)
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
    fn word_problems_sum_their_numbers_and_ratings_follow_the_rule() {
        let numbers = quantities("Ann has 3 apples, buys 12 more at 1.5 each; 2024 total?");
        assert_eq!(numbers, vec![3.0, 12.0, 1.5, 2024.0]);
        assert_eq!(
            word_problem_answer(&[3.0, 12.0], false, 0),
            "The answer is 15."
        );
        assert_ne!(
            word_problem_answer(&[3.0, 12.0], true, 0),
            "The answer is 15."
        );
        assert_eq!(word_problem_answer(&[1.5], false, 0), "The answer is 1.5.");
        let rule = Some(WrongWhen {
            quantities_over: Some(4),
            items_over: Some(2),
        });
        let numbers = |n: usize| (1..=n).map(|k| format!("{k} ")).collect::<String>();
        assert!((0..=4).all(|n| rating(&numbers(n), rule) <= 3));
        assert!((5..=20).all(|n| rating(&numbers(n), rule) >= 7));
        assert!(rating(&numbers(2), rule) < rating(&numbers(4), rule));
        // Without numbers, the listed items decide.
        let items = |n: usize| "Write a note.\n".to_owned() + &"- mention the sea\n".repeat(n);
        assert_eq!(list_items(&items(3)), 3);
        assert!((0..=2).all(|n| rating(&items(n), rule) <= 3));
        assert!((3..=6).all(|n| rating(&items(n), rule) >= 7));
        assert!(is_rating(&format!(
            "system\n{RATING_INSTRUCTION}\nuser\n1 2\n"
        )));
        assert!(!is_rating("user\nRate how hard\n"));
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
