//! Labelled prompts (JSONL) for training and evaluation.
//!
//! One object a line: `{"prompt", "label": "heavy|medium|light"}` plus, optionally,
//! `"task_class"`, `"source"`, `"id"` and `"split": "train|dev"` — the layout of
//! `eval/train-dev-mix.jsonl`, and `prompt-mix.jsonl` (which has no task class) fits
//! it too. Lines without a split are put in dev by a stable hash of their id (or text) and
//! the seed, 15% of them, so any labelled traffic can be used as it is.

use serde::Deserialize;

use crate::features::TaskClass;

/// How demanding a prompt is, as labelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Difficulty {
    /// Keep off the lowest-precision tier.
    Heavy,
    Medium,
    /// Fine on the cheapest tier.
    Light,
}

/// Which part of the data a prompt belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    Train,
    Dev,
}

/// One labelled prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct LabelledPrompt {
    pub id: String,
    /// The data set it came from (`unknown` when not given).
    pub source: String,
    pub label: Difficulty,
    /// Absent in data labelled for difficulty only: such prompts train that head only.
    pub task_class: Option<TaskClass>,
    pub prompt: String,
    pub split: Split,
}

/// A data file that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DataError {
    #[error("line {line}: {message}")]
    Line { line: usize, message: String },
    #[error("no labelled prompts")]
    Empty,
}

#[derive(Deserialize)]
struct Line {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    source: Option<String>,
    label: Difficulty,
    #[serde(default)]
    task_class: Option<TaskClass>,
    prompt: String,
    #[serde(default)]
    split: Option<Split>,
}

/// Share of unsplit prompts held out for dev, as in `eval/train-dev-mix.jsonl`.
const DEV_PERCENT: u64 = 15;

// === impl Difficulty ===

impl Difficulty {
    /// Every label, in output order.
    pub const ALL: [Difficulty; 3] = [Difficulty::Heavy, Difficulty::Medium, Difficulty::Light];

    pub fn as_str(self) -> &'static str {
        match self {
            Difficulty::Heavy => "heavy",
            Difficulty::Medium => "medium",
            Difficulty::Light => "light",
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

/// Parses labelled JSONL; unknown fields are ignored (data sets carry their own).
pub fn parse_labelled(jsonl: &str, seed: u64) -> Result<Vec<LabelledPrompt>, DataError> {
    let mut out = Vec::new();
    for (n, raw) in jsonl.lines().enumerate() {
        let line = n + 1;
        if raw.trim().is_empty() {
            continue;
        }
        let item: Line = serde_json::from_str(raw).map_err(|e| DataError::Line {
            line,
            message: e.to_string(),
        })?;
        let id = item.id.unwrap_or_else(|| format!("line-{line}"));
        let split = item.split.unwrap_or_else(|| {
            let key = if id.starts_with("line-") {
                &item.prompt
            } else {
                &id
            };
            match hash(seed, key) % 100 < DEV_PERCENT {
                true => Split::Dev,
                false => Split::Train,
            }
        });
        out.push(LabelledPrompt {
            id,
            source: item.source.unwrap_or_else(|| "unknown".into()),
            label: item.label,
            task_class: item.task_class,
            prompt: item.prompt,
            split,
        });
    }
    if out.is_empty() {
        return Err(DataError::Empty);
    }
    Ok(out)
}

/// FNV-1a over the seed and the key: stable across runs and platforms.
pub(crate) fn hash(seed: u64, key: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in seed.to_le_bytes().iter().chain(key.as_bytes()) {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_shared_layout_and_splits_the_rest_by_seed() {
        let data = r#"{"id": "a", "source": "s", "label": "heavy", "task_class": "reasoning", "prompt": "Why?", "split": "dev", "category": "x"}

{"label": "light", "prompt": "hi"}"#;
        let rows = parse_labelled(data, 1).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].task_class, Some(TaskClass::Reasoning));
        assert_eq!(rows[0].split, Split::Dev);
        assert_eq!(rows[1].source, "unknown");
        assert_eq!(rows[1].task_class, None);
        assert_eq!(parse_labelled(data, 1).unwrap(), rows);
    }

    #[test]
    fn a_seed_holds_out_about_fifteen_percent() {
        let data: String = (0..2000)
            .map(|i| format!("{{\"id\": \"{i}\", \"label\": \"light\", \"prompt\": \"p\"}}\n"))
            .collect();
        let dev = |seed| -> Vec<String> {
            parse_labelled(&data, seed)
                .unwrap()
                .into_iter()
                .filter(|r| r.split == Split::Dev)
                .map(|r| r.id)
                .collect()
        };
        assert!((200..400).contains(&dev(7).len()), "{}", dev(7).len());
        assert_eq!(dev(7), dev(7));
        assert_ne!(dev(7), dev(8));
    }

    #[test]
    fn bad_lines_name_their_number() {
        let err = parse_labelled(
            "{\"label\": \"light\", \"prompt\": \"a\"}\n{\"label\": \"hard\", \"prompt\": \"b\"}",
            0,
        )
        .unwrap_err();
        assert!(matches!(err, DataError::Line { line: 2, .. }), "{err}");
        assert_eq!(parse_labelled("\n\n", 0), Err(DataError::Empty));
    }
}
