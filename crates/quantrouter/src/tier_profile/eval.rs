//! Eval sets: JSON Lines of `{"prompt", "expected", "task_class", "match"}`, parsed and
//! checked up front so a bad line fails the run before any request is sent.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::matchers::{Expected, MatchKind};

/// The eval set shipped with the repository (`eval/tier-eval.jsonl`), built into the binary
/// so `--eval builtin` works where the repository is not at hand.
pub const BUILTIN: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../eval/tier-eval.jsonl"
));

/// The task classes an eval item can belong to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EvalClass {
    General,
    Code,
    Math,
    Structured,
    Reasoning,
}

/// One checked eval item.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalItem {
    pub prompt: String,
    pub class: EvalClass,
    pub kind: MatchKind,
    pub expected: Expected,
}

/// A line that is not a valid eval item.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("line {line}: {message}")]
pub struct EvalSetError {
    pub line: usize,
    pub message: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ItemWire {
    prompt: String,
    expected: Value,
    /// Absent: `general`, the class a router uses when no other fits.
    #[serde(default = "general")]
    task_class: EvalClass,
    /// Absent: `exact`, the strictest check, so a forgotten field never passes answers.
    #[serde(rename = "match", default = "exact")]
    kind: MatchKind,
    /// Free-form, for the set's authors.
    #[serde(default, rename = "id")]
    _id: Option<serde::de::IgnoredAny>,
}

fn general() -> EvalClass {
    EvalClass::General
}

fn exact() -> MatchKind {
    MatchKind::Exact
}

// === impl EvalClass ===

impl EvalClass {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::General => "general",
            Self::Code => "code",
            Self::Math => "math",
            Self::Structured => "structured",
            Self::Reasoning => "reasoning",
        }
    }
}

/// Parses a whole eval set; blank lines are skipped, and every other line must be an item.
pub fn parse(text: &str) -> Result<Vec<EvalItem>, EvalSetError> {
    let mut items = Vec::new();
    for (index, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let error = |message: String| EvalSetError {
            line: index + 1,
            message,
        };
        let wire: ItemWire = serde_json::from_str(line).map_err(|e| error(e.to_string()))?;
        if wire.prompt.trim().is_empty() {
            return Err(error("`prompt` is empty".to_owned()));
        }
        let expected = Expected::parse(wire.kind, &wire.expected)
            .map_err(|message| error(format!("expected: {message}")))?;
        items.push(EvalItem {
            prompt: wire.prompt,
            class: wire.task_class,
            kind: wire.kind,
            expected,
        });
    }
    if items.is_empty() {
        return Err(EvalSetError {
            line: 0,
            message: "the eval set holds no items".to_owned(),
        });
    }
    Ok(items)
}

/// `n` items spread evenly over the set (every item when `n` covers it), so a run cut short
/// by `--max-requests` keeps the set's mix of classes even when the file is sorted by class.
pub fn spread<T>(items: &[T], n: usize) -> Vec<&T> {
    if n >= items.len() {
        return items.iter().collect();
    }
    (0..n)
        .filter_map(|i| items.get(i * items.len() / n))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_builtin_set_parses_with_every_class() {
        let items = parse(BUILTIN).unwrap();
        assert_eq!(items.len(), 310);
        for class in [
            EvalClass::General,
            EvalClass::Code,
            EvalClass::Math,
            EvalClass::Structured,
            EvalClass::Reasoning,
        ] {
            assert!(items.iter().any(|i| i.class == class), "{class:?}");
        }
    }

    #[test]
    fn missing_class_and_match_default_to_general_and_exact() {
        let items =
            parse("\n{\"prompt\": \"Say yes.\", \"expected\": \"yes\", \"id\": 7}\n").unwrap();
        assert_eq!(items[0].class, EvalClass::General);
        assert_eq!(items[0].kind, MatchKind::Exact);
        assert_eq!(items[0].expected, Expected::Exact("yes".into()));
    }

    #[test]
    fn bad_lines_are_reported_with_their_number() {
        let cases = [
            (
                r#"{"prompt": "x", "expected": 1, "match": "regex"}"#,
                "regex",
            ),
            (
                r#"{"prompt": "x", "expected": 1, "task_class": "maths"}"#,
                "maths",
            ),
            (
                r#"{"prompt": "x", "expected": "four", "match": "number"}"#,
                "number",
            ),
            (r#"{"prompt": " ", "expected": 1}"#, "empty"),
            (r#"{"prompt": "x", "expected": 1, "answer": 2}"#, "answer"),
            (r#"{"prompt": "x""#, "EOF"),
        ];
        for (line, needle) in cases {
            let text = format!("{{\"prompt\": \"ok\", \"expected\": \"ok\"}}\n{line}\n");
            let error = parse(&text).unwrap_err();
            assert_eq!(error.line, 2, "{line}");
            assert!(error.message.contains(needle), "{line}: {error}");
        }
        assert!(parse("\n\n").is_err());
    }

    #[test]
    fn spread_keeps_the_mix_of_a_sorted_set() {
        let sorted: Vec<u32> = (0..100).map(|i| i / 25).collect();
        let picked = spread(&sorted, 8);
        assert_eq!(picked, [&0, &0, &1, &1, &2, &2, &3, &3]);
        assert_eq!(spread(&sorted, 500).len(), 100);
        assert!(spread(&sorted, 0).is_empty());
    }
}
