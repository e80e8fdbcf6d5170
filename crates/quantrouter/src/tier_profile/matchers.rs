//! Answer checks: whether an answer satisfies an eval item (`exact`, `number`, `contains`,
//! `json`), and whether two tiers' answers to one prompt agree. Pure functions of text.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Two prose answers agree when at least this share of their words match (Sørensen–Dice over
/// word multisets): rewordings of one answer share most words, different answers to the same
/// question share little beyond the question's own terms.
pub const PROSE_AGREEMENT: f64 = 0.6;

/// Relative tolerance of `number`: printed decimals and float arithmetic differ in the last
/// digits, not in the first six.
const NUMBER_TOLERANCE: f64 = 1e-6;

/// How an answer is checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MatchKind {
    /// Equal to `expected` after [`normalise`].
    Exact,
    /// The last number in the answer equals `expected` numerically.
    Number,
    /// `expected` (or one of a list) appears in the answer as whole words, ignoring case.
    Contains,
    /// The answer is JSON (a Markdown fence around it is fine) with the expected keys.
    Json,
}

/// What an answer must satisfy, parsed from an eval item's `expected`.
#[derive(Debug, Clone, PartialEq)]
pub enum Expected {
    Exact(String),
    Number(f64),
    /// Any of these, as whole words.
    Contains(Vec<String>),
    Json(KeyShape),
}

/// Keys a JSON answer must have, each with the keys its own object value must have.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct KeyShape(pub Vec<(String, KeyShape)>);

// === impl Expected ===

impl Expected {
    /// Reads `expected` for `kind`; the error says what that kind needs.
    pub fn parse(kind: MatchKind, expected: &Value) -> Result<Self, String> {
        match kind {
            MatchKind::Exact => scalar_text(expected)
                .map(Self::Exact)
                .ok_or_else(|| "`exact` needs a string, number or boolean".to_owned()),
            MatchKind::Number => number_value(expected)
                .map(Self::Number)
                .ok_or_else(|| "`number` needs a number (or a string holding one)".to_owned()),
            MatchKind::Contains => {
                let texts = match expected {
                    Value::Array(items) => items.iter().map(scalar_text).collect(),
                    other => scalar_text(other).map(|t| vec![t]),
                };
                match texts {
                    Some(texts)
                        if !texts.is_empty() && texts.iter().all(|t| !t.trim().is_empty()) =>
                    {
                        Ok(Self::Contains(texts))
                    }
                    _ => Err("`contains` needs a non-empty string or list of strings".to_owned()),
                }
            }
            MatchKind::Json => KeyShape::from_expected(expected)
                .map(Self::Json)
                .ok_or_else(|| "`json` needs a list of key names or an object".to_owned()),
        }
    }

    /// Whether `answer` satisfies this expectation.
    pub fn judge(&self, answer: &str) -> bool {
        match self {
            Self::Exact(expected) => normalise(answer) == normalise(expected),
            Self::Number(expected) => {
                last_number(answer).is_some_and(|n| same_number(n, *expected))
            }
            Self::Contains(any) => any.iter().any(|needle| contains_words(answer, needle)),
            Self::Json(shape) => json_payload(answer).is_some_and(|value| shape.holds(&value)),
        }
    }
}

// === impl KeyShape ===

impl KeyShape {
    /// A list of key names, or an object whose keys (recursively) must be present.
    fn from_expected(expected: &Value) -> Option<Self> {
        match expected {
            Value::Array(keys) => keys
                .iter()
                .map(|key| key.as_str().map(|k| (k.to_owned(), Self::default())))
                .collect::<Option<Vec<_>>>()
                .map(Self),
            Value::Object(_) => Some(Self::of(expected)),
            _ => None,
        }
    }

    /// The keys of `value` and of its nested objects.
    fn of(value: &Value) -> Self {
        match value {
            Value::Object(map) => Self(
                map.iter()
                    .map(|(key, value)| (key.clone(), Self::of(value)))
                    .collect(),
            ),
            _ => Self::default(),
        }
    }

    /// Whether `value` has every key, and every nested object its keys.
    fn holds(&self, value: &Value) -> bool {
        if self.0.is_empty() {
            return true;
        }
        let Value::Object(map) = value else {
            return false;
        };
        self.0.iter().all(|(key, inner)| {
            map.get(key)
                .is_some_and(|v| inner.0.is_empty() || inner.holds(v))
        })
    }
}

/// Whether `candidate` agrees with `reference`, another tier's answer to the same prompt: the
/// item's own check with the reference's answer as `expected`, or, where the reference
/// gives that check nothing to hold on to (no number, no JSON), prose similarity.
pub fn agree(kind: MatchKind, candidate: &str, reference: &str) -> bool {
    let from_reference = match kind {
        MatchKind::Exact => Some(Expected::Exact(reference.to_owned())),
        MatchKind::Number => last_number(reference).map(Expected::Number),
        MatchKind::Json => json_payload(reference).map(|v| Expected::Json(KeyShape::of(&v))),
        MatchKind::Contains => {
            return contains_words(candidate, reference)
                || contains_words(reference, candidate)
                || similarity(candidate, reference) >= PROSE_AGREEMENT;
        }
    };
    match from_reference {
        Some(expected) => expected.judge(candidate),
        None => similarity(candidate, reference) >= PROSE_AGREEMENT,
    }
}

/// Lower case, whitespace collapsed, and the wrapping a model adds to a short answer removed:
/// surrounding quotes, backticks and `**`, and a final `.`, `!` or `?`.
pub fn normalise(text: &str) -> String {
    let mut s = text.trim();
    loop {
        let before = s;
        s = s.trim_end_matches(['.', '!']).trim();
        for wrap in ["**", "`", "\"", "'"] {
            if s.len() >= 2 * wrap.len() && s.starts_with(wrap) && s.ends_with(wrap) {
                s = s[wrap.len()..s.len() - wrap.len()].trim();
            }
        }
        if s == before {
            break;
        }
    }
    s.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .to_lowercase()
}

/// The last number in `text`: an optional minus sign (not after a letter or digit, so `x-1`
/// is 1), digits with optional thousands commas (`1,181`), optional decimals.
pub fn last_number(text: &str) -> Option<f64> {
    let bytes = text.as_bytes();
    let mut last = None;
    let mut i = 0;
    while i < bytes.len() {
        if !bytes[i].is_ascii_digit() {
            i += 1;
            continue;
        }
        let start = i;
        let mut digits = String::new();
        while i < bytes.len() {
            match bytes[i] {
                b @ b'0'..=b'9' => digits.push(char::from(b)),
                // A thousands separator only before exactly three digits.
                b',' if is_group(bytes, i + 1) => {}
                _ => break,
            }
            i += 1;
        }
        if i + 1 < bytes.len() && bytes[i] == b'.' && bytes[i + 1].is_ascii_digit() {
            digits.push('.');
            i += 1;
            while i < bytes.len() && bytes[i].is_ascii_digit() {
                digits.push(char::from(bytes[i]));
                i += 1;
            }
        }
        let negative = start > 0
            && bytes[start - 1] == b'-'
            && (start < 2 || !bytes[start - 2].is_ascii_alphanumeric());
        if let Ok(value) = digits.parse::<f64>() {
            last = Some(if negative { -value } else { value });
        }
    }
    last
}

/// Three digits at `at`, then no fourth.
fn is_group(bytes: &[u8], at: usize) -> bool {
    bytes.len() >= at + 3
        && bytes[at..at + 3].iter().all(u8::is_ascii_digit)
        && bytes.get(at + 3).is_none_or(|b| !b.is_ascii_digit())
}

fn same_number(a: f64, b: f64) -> bool {
    (a - b).abs() <= NUMBER_TOLERANCE * b.abs().max(1.0)
}

/// Whether `needle` occurs in `haystack` with no letter or digit right before or after it,
/// ignoring case and runs of whitespace.
pub fn contains_words(haystack: &str, needle: &str) -> bool {
    let collapse = |s: &str| {
        s.split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
            .to_lowercase()
    };
    let (haystack, needle) = (collapse(haystack), collapse(needle));
    if needle.is_empty() {
        return false;
    }
    let boundary = |c: Option<char>| c.is_none_or(|c| !c.is_alphanumeric());
    haystack.match_indices(&needle).any(|(at, found)| {
        boundary(haystack[..at].chars().next_back())
            && boundary(haystack[at + found.len()..].chars().next())
    })
}

/// The JSON in an answer: the whole answer, or else the first Markdown code fence in it.
pub fn json_payload(answer: &str) -> Option<Value> {
    if let Ok(value) = serde_json::from_str(answer.trim()) {
        return Some(value);
    }
    let (_, after_fence) = answer.split_once("```")?;
    // The rest of the fence's first line is its language tag (`json`), if any.
    let (_, body) = after_fence.split_once('\n')?;
    let (body, _) = body.split_once("```")?;
    serde_json::from_str(body.trim()).ok()
}

/// Sørensen–Dice similarity of two texts' word multisets (words: lower-cased runs of letters
/// and digits), in [0, 1]; two empty texts are equal.
pub fn similarity(a: &str, b: &str) -> f64 {
    let words = |s: &str| -> Vec<String> {
        let mut words: Vec<String> = s
            .split(|c: char| !c.is_alphanumeric())
            .filter(|w| !w.is_empty())
            .map(str::to_lowercase)
            .collect();
        words.sort_unstable();
        words
    };
    let (a, b) = (words(a), words(b));
    if a.is_empty() && b.is_empty() {
        return 1.0;
    }
    // Multiset intersection of two sorted lists.
    let (mut i, mut j, mut common) = (0, 0, 0usize);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                common += 1;
                i += 1;
                j += 1;
            }
        }
    }
    2.0 * common as f64 / (a.len() + b.len()) as f64
}

fn scalar_text(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

fn number_value(value: &Value) -> Option<f64> {
    match value {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.trim().parse::<f64>().ok().filter(|n| n.is_finite()),
        _ => None,
    }
}

#[cfg(test)]
mod tests;
