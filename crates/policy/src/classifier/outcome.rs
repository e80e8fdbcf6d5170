//! The outcome head: from a prompt's shape, how likely a cheaper tier's answer falls short
//! where the reference's does not (`docs/routing.md` §1c).
//!
//! The task-class and difficulty heads learn labels given per source, so they tell kinds of
//! prompt apart but rank prompts of one kind no better than chance. This head learns from
//! outcome records — per prompt, whether a cheap and a reference model answered correctly —
//! and reads what makes one prompt of a kind harder than another: how many quantities and
//! sentences, operators, fractions and decimals, rare (long) words, negations, and the
//! answer's format.
//!
//! Its target is the soft `(1 + reference_ok − cheap_ok) / 2`, whose expectation `p` makes
//! `2p − 1 = P(cheap worse) − P(cheap better)`: the net probability that the cheaper answer
//! loses what the reference's gets right. That, clamped to [0,1], is the `risk` the policy
//! compares with `risk_tolerance`. A free-form prompt is scored by a logistic regression
//! fitted by Newton's method from zero. A multiple-choice prompt is scored by a small
//! ensemble of boosted regression trees fitted to the target minus its category's mean, so
//! that they learn what ranks questions within a subject rather than what tells subjects
//! apart (the means are dropped afterwards). Both fits are deterministic.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::data::{hash, DataError};
use crate::features::{for_each_scored, Prompt, TaskClass};

/// Names of the head's inputs, in weight order; part of the model's format.
pub const OUTCOME_FEATURES: [&str; OUTCOME_INPUTS] = [
    "length",
    "question_words",
    "quantities",
    "distinct_quantities",
    "sentences",
    "questions",
    "long_words",
    "word_length",
    "operators",
    "choices",
    "choice_length",
    "numeric_choices",
    "statements",
    "negations",
    "relations",
    "money_percent",
    "parentheses",
    "capitalised",
    "decimals",
    "fractions",
];
pub const OUTCOME_INPUTS: usize = 20;
/// Index of the input that says the prompt lists answer choices.
const CHOICES: usize = 9;
/// Parameters: free-form weights, multiple-choice weights, then the bias.
const PARAMETERS: usize = 2 * OUTCOME_INPUTS + 1;
/// Bytes of the scoring window the head reads: a question's shape is in its first lines,
/// and the pass costs about as much per byte as the classifier's own (every outcome record
/// shipped is shorter).
pub const OUTCOME_WINDOW: usize = 2048;
/// L2 penalty on the weights (not the bias): small data, so keep the weights modest.
const PENALTY: f64 = 1.0;
const NEWTON_STEPS: usize = 12;
/// The multiple-choice trees: how many, how deep, how much each adds, and the fewest
/// records a leaf holds (fewer make a leaf's mean mostly noise).
const TREES: usize = 50;
const TREE_DEPTH: u32 = 3;
const LEARNING_RATE: f64 = 0.1;
const MIN_LEAF: usize = 30;
/// Deepest and most trees a document may hold (bounds its size and the decision time).
const MAX_TREE_DEPTH: u32 = 8;
const MAX_TREES: usize = 1000;
/// The trees estimate a probability; it is kept off 0 and 1 before taking its logit.
const P_EDGE: f64 = 0.005;
/// A task class the outcome data covered: at least this share of its records.
const COVERED_SHARE: f64 = 0.10;

/// One prompt with whether a cheap and a reference model answered it correctly: from a
/// benchmark (the prompt's text) or from the router's own traffic (the prompt's inputs as the
/// head read them, and whether the served answer agreed with the reference's).
#[derive(Debug, Clone, PartialEq)]
pub struct OutcomeRecord {
    pub id: String,
    /// The benchmark or stream it came from (`unknown` when not given; `traffic` for a
    /// record the router wrote).
    pub source: String,
    /// The part of the benchmark (an MMLU subject); held out together. A traffic record's is
    /// its task class.
    pub category: String,
    /// Empty for a traffic record written without `--log-prompts`.
    pub prompt: String,
    /// A traffic record's inputs, as the outcome head read the prompt; `None`: read from
    /// `prompt`.
    pub inputs: Option<OutcomeInputs>,
    /// The task class the router gave the prompt (traffic records).
    pub task_class: Option<TaskClass>,
    pub weak_correct: bool,
    pub strong_correct: bool,
}

/// One line as written: a benchmark's (`prompt`, `weak_correct`/`cheap_ok`,
/// `strong_correct`/`reference_ok`) or the router's (`features`, `inputs`, `task_class`,
/// `cheap_profile`, `reference_profile`, `agreed`).
#[derive(Debug, Deserialize)]
struct RawRecord {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    source: Option<String>,
    #[serde(default)]
    category: Option<String>,
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default, alias = "cheap_ok")]
    weak_correct: Option<bool>,
    #[serde(default, alias = "reference_ok")]
    strong_correct: Option<bool>,
    #[serde(default)]
    features: Option<std::collections::BTreeMap<String, f32>>,
    /// How many inputs the head that wrote `features` had.
    #[serde(default)]
    inputs: Option<usize>,
    #[serde(default)]
    task_class: Option<TaskClass>,
    #[serde(default)]
    agreed: Option<bool>,
}

/// What the router writes for one sampled request (`policy.calibration.outcomes`): the
/// prompt's inputs by name (zeros left out), never its text unless asked for.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrafficOutcome {
    pub features: std::collections::BTreeMap<&'static str, f32>,
    /// [`OUTCOME_INPUTS`] of the router that wrote it: a reader with another feature list
    /// refuses the record.
    pub inputs: usize,
    pub task_class: TaskClass,
    pub cheap_profile: String,
    pub reference_profile: String,
    pub agreed: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
}

/// The fitted head, as the classifier document stores it (`weights.outcome`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutcomeHead {
    /// Input names; must be [`OUTCOME_FEATURES`].
    pub features: Vec<String>,
    /// Weights for a prompt without answer choices.
    pub free_form: Vec<f32>,
    /// Linear weights for a multiple-choice prompt, used when there are no `choice_trees`
    /// (documents written before them).
    pub choices: Vec<f32>,
    pub bias: f32,
    /// The task classes the outcome data covered; the policy uses the risk of these only.
    pub task_classes: Vec<TaskClass>,
    /// What scores a multiple-choice prompt, when the training records had any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub choice_trees: Option<ChoiceTrees>,
}

/// Boosted regression trees: `p = base + Σ leaf` estimates the soft target of a prompt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChoiceTrees {
    /// Every tree is complete and this deep: `2^depth − 1` splits, `2^depth` leaves.
    pub depth: u32,
    /// The mean target of the training records.
    pub base: f32,
    pub trees: Vec<Tree>,
}

/// One complete binary tree, splits in breadth-first order (the children of split `k` are
/// `2k + 1` and `2k + 2`); an input above the threshold goes right.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tree {
    /// Index of the input each split reads.
    pub inputs: Vec<u8>,
    pub thresholds: Vec<f32>,
    /// What each leaf adds to `p`, left to right.
    pub leaves: Vec<f32>,
}

/// One outcome as the fit sees it: a prompt's inputs, the two verdicts, and the category
/// held out together (records of one category share a mean the trees do not learn).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OutcomeExample<'a> {
    pub inputs: OutcomeInputs,
    pub cheap_ok: bool,
    pub reference_ok: bool,
    pub category: &'a str,
}

/// What one prompt looks like to the head.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OutcomeInputs(pub [f32; OUTCOME_INPUTS]);

fn unknown() -> String {
    "unknown".into()
}

/// Parses outcome JSONL: `{"prompt", "weak_correct", "strong_correct"}` (or `cheap_ok`,
/// `reference_ok`), optionally `id`, `source`, `category`; or the router's traffic records
/// (`features`, `inputs`, `task_class`, `agreed`). Other fields are ignored.
pub fn parse_outcomes(jsonl: &str) -> Result<Vec<OutcomeRecord>, DataError> {
    let mut out = Vec::new();
    for (n, raw) in jsonl.lines().enumerate() {
        if raw.trim().is_empty() {
            continue;
        }
        let line = |message: String| DataError::Line {
            line: n + 1,
            message,
        };
        let value = serde_json::from_str(raw).map_err(|e| line(e.to_string()))?;
        let record = outcome_from_value(value, &format!("line-{}", n + 1)).map_err(line)?;
        out.push(record);
    }
    if out.is_empty() {
        return Err(DataError::Empty);
    }
    Ok(out)
}

/// One outcome record from its JSON; `fallback_id` names it when it carries no `id`. A
/// traffic record's `agreed` counts as `cheap_ok = agreed, reference_ok = true`: the
/// reference is the yardstick, and agreeing with it is what the cheap tier can be right by.
pub fn outcome_from_value(
    value: serde_json::Value,
    fallback_id: &str,
) -> Result<OutcomeRecord, String> {
    let raw: RawRecord = serde_json::from_value(value).map_err(|e| e.to_string())?;
    let inputs = match &raw.features {
        Some(features) => Some(OutcomeInputs::from_named(features, raw.inputs)?),
        None => None,
    };
    if inputs.is_none() && raw.prompt.is_none() {
        return Err("missing field `prompt` (or a traffic record's `features`)".into());
    }
    if inputs.is_some() && raw.task_class.is_none() {
        return Err("a record with `features` needs its `task_class`".into());
    }
    let (weak, strong) = match (raw.weak_correct, raw.strong_correct, raw.agreed) {
        (Some(weak), Some(strong), None) => (weak, strong),
        (None, None, Some(agreed)) => (agreed, true),
        (None, _, None) => return Err("missing field `weak_correct` (or `agreed`)".into()),
        (_, None, None) => return Err("missing field `strong_correct` (or `agreed`)".into()),
        (_, _, Some(_)) => {
            return Err(
                "give either `agreed` or `weak_correct` and `strong_correct`, not both".into(),
            )
        }
    };
    let traffic = inputs.is_some();
    Ok(OutcomeRecord {
        id: raw
            .id
            .filter(|id| !id.is_empty())
            .unwrap_or_else(|| fallback_id.to_owned()),
        source: raw.source.unwrap_or_else(|| match traffic {
            true => "traffic".into(),
            false => unknown(),
        }),
        category: raw.category.unwrap_or_else(|| match raw.task_class {
            Some(class) if traffic => class.as_str().to_owned(),
            _ => unknown(),
        }),
        prompt: raw.prompt.unwrap_or_default(),
        inputs,
        task_class: raw.task_class,
        weak_correct: weak,
        strong_correct: strong,
    })
}

// === impl OutcomeRecord ===

impl OutcomeRecord {
    /// The head's soft target: 1 when only the reference was right, 0 when only the cheap
    /// model was, ½ when they agree.
    #[cfg(test)]
    fn target(&self) -> f64 {
        soft_target(self.weak_correct, self.strong_correct)
    }

    /// The fold of a record for `k`-fold cross-validation, by a stable hash of its id.
    pub fn fold(&self, seed: u64, k: u64) -> u64 {
        hash(seed, &self.id) % k.max(1)
    }

    /// What the head reads of the record: a traffic record's stored inputs, else its prompt.
    pub fn inputs(&self, window: usize) -> OutcomeInputs {
        self.inputs
            .unwrap_or_else(|| OutcomeInputs::of_text(&self.prompt, window))
    }
}

// === impl OutcomeInputs ===

impl OutcomeInputs {
    /// The inputs of a prompt's scoring window of `window` bytes, at most
    /// [`OUTCOME_WINDOW`] of it, in one pass.
    pub fn of(prompt: &Prompt<'_>, window: usize) -> Self {
        let mut scan = Scan::default();
        for_each_scored(prompt, window.min(OUTCOME_WINDOW), |text| {
            scan.feed(text.as_bytes())
        });
        scan.inputs()
    }

    /// The inputs of a single user message, as outcome records are read.
    pub fn of_text(text: &str, window: usize) -> Self {
        let prompt = Prompt {
            segments: vec![crate::features::Segment {
                role: crate::features::Role::User,
                text,
            }],
            wants_json: false,
        };
        Self::of(&prompt, window)
    }

    /// The text [`Self::of`] reads of a prompt, its pieces joined by blank lines: what a
    /// traffic record logs of the prompt with `--log-prompts`, so the logged text is the
    /// features' own and never longer than the window (plus the joins).
    pub fn scored_text(prompt: &Prompt<'_>, window: usize) -> String {
        let mut text = String::new();
        for_each_scored(prompt, window.min(OUTCOME_WINDOW), |piece| {
            if piece.is_empty() {
                return;
            }
            if !text.is_empty() {
                text.push_str("\n\n");
            }
            text.push_str(piece);
        });
        text
    }

    fn choices(&self) -> bool {
        self.0[CHOICES] > 0.5
    }

    /// The inputs by name, zeros left out: what a traffic record stores.
    pub fn named(&self) -> std::collections::BTreeMap<&'static str, f32> {
        OUTCOME_FEATURES
            .iter()
            .zip(self.0)
            .filter(|(_, v)| *v != 0.0)
            .map(|(name, v)| (*name, v))
            .collect()
    }

    /// Inputs from a traffic record's names; a name the head does not read, a count of
    /// inputs other than this head's, or a non-finite value is refused: the record was
    /// written by a router with another feature list, and its numbers mean something else.
    pub fn from_named(
        named: &std::collections::BTreeMap<String, f32>,
        inputs: Option<usize>,
    ) -> Result<Self, String> {
        if let Some(n) = inputs.filter(|&n| n != OUTCOME_INPUTS) {
            return Err(format!(
                "the record's features come from a head of {n} inputs, this one reads \
                 {OUTCOME_INPUTS} ({OUTCOME_FEATURES:?}): train from records of this version"
            ));
        }
        let mut out = [0f32; OUTCOME_INPUTS];
        for (name, &value) in named {
            let Some(i) = OUTCOME_FEATURES.iter().position(|n| n == name) else {
                return Err(format!(
                    "feature `{name}` is not an input of the outcome head ({OUTCOME_FEATURES:?}): \
                     the record was written by a router with another feature list"
                ));
            };
            if !value.is_finite() {
                return Err(format!("feature `{name}` is not a finite number"));
            }
            out[i] = value;
        }
        Ok(Self(out))
    }
}

/// Counts gathered over the window.
#[derive(Debug, Default)]
struct Scan {
    bytes: usize,
    question_words: u32,
    numbers: u32,
    distinct: [u64; 32],
    distinct_count: usize,
    sentences: u32,
    questions: u32,
    words: u32,
    long_words: u32,
    word_bytes: usize,
    operators: u32,
    options: u32,
    option_bytes: usize,
    numeric_options: u32,
    statements: bool,
    negations: u32,
    relations: u32,
    money_percent: u32,
    parentheses: u32,
    capitalised: u32,
    decimals: u32,
    fractions: u32,
}

impl Scan {
    fn feed(&mut self, t: &[u8]) {
        self.bytes += t.len();
        let mut i = 0;
        let mut line_start = true;
        // Inside an answer choice (from its letter to the end of its line).
        let mut option = false;
        let mut option_digit = false;
        let mut after_number = false;
        while i < t.len() {
            let b = t[i];
            if line_start && is_option_letter(t, i) {
                self.end_option(option, option_digit);
                option = true;
                option_digit = false;
                self.options += 1;
                i += 3;
                line_start = false;
                continue;
            }
            line_start = false;
            if b.is_ascii_digit() {
                let start = i;
                let mut decimal = false;
                let mut h: u64 = 0xcbf2_9ce4_8422_2325;
                while i < t.len() {
                    let c = t[i];
                    if c.is_ascii_digit() {
                        h = (h ^ u64::from(c)).wrapping_mul(0x0100_0000_01b3);
                        i += 1;
                    } else if (c == b'.' || c == b',')
                        && t.get(i + 1).is_some_and(u8::is_ascii_digit)
                    {
                        decimal = true;
                        i += 1;
                    } else {
                        break;
                    }
                }
                if after_number && start > 0 && t[start - 1] == b'/' {
                    self.fractions += 1;
                }
                self.numbers += 1;
                self.decimals += u32::from(decimal);
                self.remember(h);
                option_digit |= option;
                if !option {
                    self.question_words += 1;
                }
                after_number = true;
                continue;
            }
            if is_word_byte(b) {
                let start = i;
                // The first eight bytes, lowercased, as one number: the word lists compare
                // numbers, not strings (this pass is on the request path).
                let mut key = 0u64;
                while i < t.len() && is_word_byte(t[i]) {
                    if i - start < 8 {
                        key |= u64::from(t[i] | 0x20) << (8 * (i - start));
                    }
                    i += 1;
                }
                self.word(&t[start..i], key, t.get(i..).unwrap_or_default(), option);
                after_number = false;
                continue;
            }
            match b {
                b'\n' => {
                    line_start = true;
                    self.end_option(option, option_digit);
                    option = false;
                    option_digit = false;
                }
                b'.' | b'!' | b'?' if !option => {
                    let next = t.get(i + 1).copied().unwrap_or(b' ');
                    if next.is_ascii_whitespace() {
                        self.sentences += 1;
                    }
                    self.questions += u32::from(b == b'?');
                }
                b'+' | b'-' | b'*' | b'=' | b'^' | b'<' | b'>' => self.operators += 1,
                b'/' => {
                    self.operators += 1;
                    // A fraction keeps `after_number` across its slash.
                    i += 1;
                    continue;
                }
                b'%' | b'$' => self.money_percent += 1,
                b'(' => self.parentheses += 1,
                _ => {}
            }
            if option {
                self.option_bytes += 1;
            }
            after_number = false;
            i += 1;
        }
        self.end_option(option, option_digit);
    }

    fn end_option(&mut self, option: bool, digit: bool) {
        if option {
            self.numeric_options += u32::from(digit);
        }
    }

    fn remember(&mut self, h: u64) {
        let seen = &self.distinct[..self.distinct_count];
        if !seen.contains(&h) && self.distinct_count < self.distinct.len() {
            self.distinct[self.distinct_count] = h;
            self.distinct_count += 1;
        }
    }

    fn word(&mut self, w: &[u8], key: u64, rest: &[u8], option: bool) {
        self.words += 1;
        self.word_bytes += w.len();
        if option {
            self.option_bytes += w.len();
        } else {
            self.question_words += 1;
        }
        self.long_words += u32::from(w.len() >= 9);
        self.capitalised += u32::from(w[0].is_ascii_uppercase());
        // A key of a word of eight bytes or fewer is the word itself; the nine-letter words
        // also need their length.
        match key {
            NOT | EXCEPT | FALSE | LEAST | NEVER | CANNOT => self.negations += 1,
            INCORRECT if w.len() == 9 => self.negations += 1,
            TWICE | HALF | TIMES | PERCENT | EACH | EVERY | PER | REST | TOTAL => {
                self.relations += 1
            }
            REMAINING if w.len() == 9 => self.relations += 1,
            STATEMENT
                if w.len() == 9
                    && rest.len() >= 2
                    && rest[0] == b' '
                    && rest[1].is_ascii_digit() =>
            {
                self.statements = true
            }
            _ => {}
        }
    }

    fn inputs(&self) -> OutcomeInputs {
        let ln = |x: f64| x.ln_1p() as f32;
        let choices = self.options >= 2;
        let option_mean = if self.options > 0 {
            self.option_bytes as f64 / f64::from(self.options)
        } else {
            0.0
        };
        OutcomeInputs([
            ln(self.bytes as f64) / 8.0,
            ln(f64::from(self.question_words)) / 6.0,
            ln(f64::from(self.numbers)) / 4.0,
            ln(self.distinct_count as f64) / 4.0,
            ln(f64::from(self.sentences + 1)) / 3.0,
            ln(f64::from(self.questions)) / 2.0,
            self.long_words as f32 / self.words.max(1) as f32,
            (self.word_bytes as f64 / f64::from(self.words.max(1)) / 10.0) as f32,
            ln(f64::from(self.operators)) / 3.0,
            f32::from(u8::from(choices)),
            ln(option_mean) / 5.0,
            ln(f64::from(self.numeric_options)) / 2.0,
            f32::from(u8::from(self.statements)),
            ln(f64::from(self.negations)) / 2.0,
            ln(f64::from(self.relations)) / 2.0,
            ln(f64::from(self.money_percent)) / 2.0,
            ln(f64::from(self.parentheses)) / 2.0,
            ln(f64::from(self.capitalised)) / 3.0,
            ln(f64::from(self.decimals)) / 2.0,
            ln(f64::from(self.fractions)) / 2.0,
        ])
    }
}

/// The lowercase first eight bytes of a word as the scan packs them.
const fn pack(word: &[u8]) -> u64 {
    let mut key = 0u64;
    let mut i = 0;
    while i < word.len() && i < 8 {
        key |= ((word[i] | 0x20) as u64) << (8 * i);
        i += 1;
    }
    key
}

const NOT: u64 = pack(b"not");
const EXCEPT: u64 = pack(b"except");
const FALSE: u64 = pack(b"false");
const INCORRECT: u64 = pack(b"incorrect");
const LEAST: u64 = pack(b"least");
const NEVER: u64 = pack(b"never");
const CANNOT: u64 = pack(b"cannot");
const TWICE: u64 = pack(b"twice");
const HALF: u64 = pack(b"half");
const TIMES: u64 = pack(b"times");
const PERCENT: u64 = pack(b"percent");
const EACH: u64 = pack(b"each");
const EVERY: u64 = pack(b"every");
const PER: u64 = pack(b"per");
const REMAINING: u64 = pack(b"remaining");
const REST: u64 = pack(b"rest");
const TOTAL: u64 = pack(b"total");
const STATEMENT: u64 = pack(b"statement");

/// A line that starts an answer choice: `A. `, `B) ` ... `E. `.
fn is_option_letter(t: &[u8], i: usize) -> bool {
    matches!(t[i], b'A'..=b'E')
        && t.get(i + 1).is_some_and(|&c| c == b'.' || c == b')')
        && t.get(i + 2) == Some(&b' ')
}

fn is_word_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b >= 0x80
}

// === impl OutcomeHead ===

impl OutcomeHead {
    /// The head's logit for a prompt: higher means the reference is more likely needed.
    pub fn logit(&self, inputs: &OutcomeInputs) -> f64 {
        if let (true, Some(trees)) = (inputs.choices(), &self.choice_trees) {
            return trees.logit(inputs);
        }
        let w = if inputs.choices() {
            &self.choices
        } else {
            &self.free_form
        };
        let z: f32 = w.iter().zip(&inputs.0).map(|(w, x)| w * x).sum::<f32>() + self.bias;
        f64::from(z)
    }

    /// `risk` from a logit: the net probability that the cheaper answer is worse, in [0,1].
    pub fn risk_of(logit: f64) -> f64 {
        let p = 1.0 / (1.0 + (-logit).exp());
        (2.0 * p - 1.0).clamp(0.0, 1.0)
    }

    /// Whether the policy may use the risk of a prompt of this class.
    pub fn covers(&self, class: TaskClass) -> bool {
        self.task_classes.contains(&class)
    }

    /// Checks the stored form; the message names what is wrong.
    pub(crate) fn check(&self) -> Result<(), (&'static str, String)> {
        if !self
            .features
            .iter()
            .map(String::as_str)
            .eq(OUTCOME_FEATURES.iter().copied())
        {
            return Err((
                "weights.outcome.features",
                format!("must be {OUTCOME_FEATURES:?}"),
            ));
        }
        for (path, w) in [
            ("weights.outcome.free_form", &self.free_form),
            ("weights.outcome.choices", &self.choices),
        ] {
            if w.len() != OUTCOME_INPUTS || !w.iter().all(|w| w.is_finite()) {
                return Err((path, format!("must be {OUTCOME_INPUTS} finite numbers")));
            }
        }
        if !self.bias.is_finite() {
            return Err(("weights.outcome.bias", "must be finite".into()));
        }
        match &self.choice_trees {
            Some(trees) => trees.check(),
            None => Ok(()),
        }
    }
}

// === impl ChoiceTrees ===

impl ChoiceTrees {
    fn logit(&self, inputs: &OutcomeInputs) -> f64 {
        let mut p = self.base;
        for tree in &self.trees {
            p += tree.leaf(inputs, self.depth);
        }
        let p = f64::from(p).clamp(P_EDGE, 1.0 - P_EDGE);
        (p / (1.0 - p)).ln()
    }

    fn check(&self) -> Result<(), (&'static str, String)> {
        const AT: &str = "weights.outcome.choice_trees";
        if !(1..=MAX_TREE_DEPTH).contains(&self.depth) {
            return Err((AT, format!("depth must be in 1..={MAX_TREE_DEPTH}")));
        }
        if self.trees.len() > MAX_TREES || !self.base.is_finite() {
            return Err((AT, format!("at most {MAX_TREES} trees and a finite base")));
        }
        let splits = (1usize << self.depth) - 1;
        for tree in &self.trees {
            let ok = tree.inputs.len() == splits
                && tree.thresholds.len() == splits
                && tree.leaves.len() == splits + 1
                && tree.inputs.iter().all(|&i| usize::from(i) < OUTCOME_INPUTS)
                && tree
                    .thresholds
                    .iter()
                    .chain(&tree.leaves)
                    .all(|v| v.is_finite());
            if !ok {
                return Err((
                    AT,
                    format!(
                        "every tree needs {splits} inputs below {OUTCOME_INPUTS}, {splits} \
                         finite thresholds and {} finite leaves",
                        splits + 1
                    ),
                ));
            }
        }
        Ok(())
    }
}

impl Tree {
    fn leaf(&self, inputs: &OutcomeInputs, depth: u32) -> f32 {
        let mut node = 0;
        for _ in 0..depth {
            let right = inputs.0[usize::from(self.inputs[node])] > self.thresholds[node];
            node = 2 * node + 1 + usize::from(right);
        }
        self.leaves[node - self.inputs.len()]
    }
}

/// Fits the head to outcome records (all of them), with the given covered task classes.
pub fn fit_outcomes(
    records: &[&OutcomeRecord],
    window: usize,
    task_classes: Vec<TaskClass>,
) -> OutcomeHead {
    let examples: Vec<OutcomeExample<'_>> = records
        .iter()
        .map(|r| OutcomeExample {
            inputs: r.inputs(window),
            cheap_ok: r.weak_correct,
            reference_ok: r.strong_correct,
            category: &r.category,
        })
        .collect();
    fit_examples(&examples, task_classes)
}

/// Fits the head to prompts already turned into inputs: the linear rows on all of them, the
/// trees on the multiple-choice ones (when there are enough to split).
pub fn fit_examples(examples: &[OutcomeExample<'_>], task_classes: Vec<TaskClass>) -> OutcomeHead {
    let rows: Vec<(OutcomeInputs, f64)> = examples.iter().map(|e| (e.inputs, e.target())).collect();
    let theta = newton(&rows);
    let choices: Vec<&OutcomeExample<'_>> =
        examples.iter().filter(|e| e.inputs.choices()).collect();
    let to_f32 = |s: &[f64]| s.iter().map(|&v| v as f32).collect::<Vec<f32>>();
    OutcomeHead {
        features: OUTCOME_FEATURES.iter().map(|s| (*s).to_owned()).collect(),
        free_form: to_f32(&theta[..OUTCOME_INPUTS]),
        choices: to_f32(&theta[OUTCOME_INPUTS..2 * OUTCOME_INPUTS]),
        bias: theta[2 * OUTCOME_INPUTS] as f32,
        task_classes,
        choice_trees: (choices.len() >= 2 * MIN_LEAF).then(|| boost(&choices)),
    }
}

// === impl OutcomeExample ===

impl OutcomeExample<'_> {
    fn target(&self) -> f64 {
        soft_target(self.cheap_ok, self.reference_ok)
    }
}

/// 1 when only the reference was right, 0 when only the cheap model was, ½ when they agree.
fn soft_target(cheap_ok: bool, reference_ok: bool) -> f64 {
    0.5 + 0.5 * (f64::from(u8::from(reference_ok)) - f64::from(u8::from(cheap_ok)))
}

/// Gradient boosting with squared loss on the target less its category's mean: within a
/// category, which questions the reference is more likely needed for.
fn boost(examples: &[&OutcomeExample<'_>]) -> ChoiceTrees {
    let n = examples.len();
    let targets: Vec<f64> = examples.iter().map(|e| e.target()).collect();
    let base = targets.iter().sum::<f64>() / n as f64;
    let mut categories: BTreeMap<&str, (f64, usize)> = BTreeMap::new();
    for (e, t) in examples.iter().zip(&targets) {
        let c = categories.entry(e.category).or_default();
        c.0 += t;
        c.1 += 1;
    }
    let mut residual: Vec<f64> = examples
        .iter()
        .zip(&targets)
        .map(|(e, t)| {
            let (sum, count) = categories[e.category];
            t - sum / count as f64
        })
        .collect();
    // The records in order of each input's value (ties by position): a split search is one
    // pass per input and level.
    let order: Vec<Vec<usize>> = (0..OUTCOME_INPUTS)
        .map(|f| {
            let mut at: Vec<usize> = (0..n).collect();
            at.sort_by(|&a, &b| {
                examples[a].inputs.0[f]
                    .total_cmp(&examples[b].inputs.0[f])
                    .then(a.cmp(&b))
            });
            at
        })
        .collect();
    let trees = (0..TREES)
        .map(|_| {
            let tree = grow(examples, &order, &residual);
            for (r, e) in residual.iter_mut().zip(examples) {
                *r -= f64::from(tree.leaf(&e.inputs, TREE_DEPTH));
            }
            tree
        })
        .collect();
    ChoiceTrees {
        depth: TREE_DEPTH,
        base: base as f32,
        trees,
    }
}

/// One regression tree of [`TREE_DEPTH`] on the residuals, grown level by level: each node
/// takes the split that most reduces the squared error, leaving at least [`MIN_LEAF`]
/// records on either side; a node without one sends everything left.
fn grow(examples: &[&OutcomeExample<'_>], order: &[Vec<usize>], residual: &[f64]) -> Tree {
    let splits = (1usize << TREE_DEPTH) - 1;
    let mut inputs = vec![0u8; splits];
    let mut thresholds = vec![f32::MAX; splits];
    let mut node = vec![0usize; examples.len()];
    for level in 0..TREE_DEPTH {
        let first = (1usize << level) - 1;
        let width = 1usize << level;
        let mut total = vec![(0.0f64, 0usize); width];
        for (i, &k) in node.iter().enumerate() {
            total[k - first].0 += residual[i];
            total[k - first].1 += 1;
        }
        // Per node: (reduction of the squared error, input, threshold).
        let mut best: Vec<Option<(f64, usize, f32)>> = vec![None; width];
        for (f, sorted) in order.iter().enumerate() {
            let mut left = vec![(0.0f64, 0usize); width];
            let mut last = vec![f32::NEG_INFINITY; width];
            for &i in sorted {
                let k = node[i] - first;
                let v = examples[i].inputs.0[f];
                let (sl, nl) = left[k];
                let (s, n) = total[k];
                if nl >= MIN_LEAF && n - nl >= MIN_LEAF && v > last[k] {
                    let (sr, nr) = (s - sl, n - nl);
                    let gain = sl * sl / nl as f64 + sr * sr / nr as f64 - s * s / n as f64;
                    if best[k].map_or(gain > 1e-12, |b| gain > b.0) {
                        best[k] = Some((gain, f, between(last[k], v)));
                    }
                }
                left[k].0 += residual[i];
                left[k].1 += 1;
                last[k] = v;
            }
        }
        for (k, b) in best.iter().enumerate() {
            if let Some((_, f, t)) = *b {
                inputs[first + k] = f as u8;
                thresholds[first + k] = t;
            }
        }
        for (i, k) in node.iter_mut().enumerate() {
            let right = examples[i].inputs.0[usize::from(inputs[*k])] > thresholds[*k];
            *k = 2 * *k + 1 + usize::from(right);
        }
    }
    let mut sums = vec![(0.0f64, 0usize); splits + 1];
    for (i, &k) in node.iter().enumerate() {
        sums[k - splits].0 += residual[i];
        sums[k - splits].1 += 1;
    }
    let leaves = sums
        .iter()
        .map(|&(s, n)| {
            if n == 0 {
                0.0
            } else {
                (LEARNING_RATE * s / n as f64) as f32
            }
        })
        .collect();
    Tree {
        inputs,
        thresholds,
        leaves,
    }
}

/// A threshold that sends `low` left and `high` right.
fn between(low: f32, high: f32) -> f32 {
    let t = (f64::from(low) + (f64::from(high) - f64::from(low)) / 2.0) as f32;
    if t >= high {
        low
    } else {
        t
    }
}

/// The classes holding at least a tenth of the records, by the class each was given.
pub(crate) fn covered_classes(classes: impl Iterator<Item = TaskClass>) -> Vec<TaskClass> {
    let mut counts = [0usize; super::CLASSES];
    let mut total = 0;
    for class in classes {
        if let Some(i) = super::TASK_CLASSES.iter().position(|&c| c == class) {
            counts[i] += 1;
            total += 1;
        }
    }
    super::TASK_CLASSES
        .iter()
        .zip(counts)
        .filter(|&(_, n)| total > 0 && n as f64 >= COVERED_SHARE * total as f64)
        .map(|(&c, _)| c)
        .collect()
}

/// The row of parameters an example touches, as a dense vector with the bias last.
fn design(inputs: &OutcomeInputs) -> [f64; PARAMETERS] {
    let mut x = [0f64; PARAMETERS];
    let at = if inputs.choices() { OUTCOME_INPUTS } else { 0 };
    for (i, &v) in inputs.0.iter().enumerate() {
        x[at + i] = f64::from(v);
    }
    x[PARAMETERS - 1] = 1.0;
    x
}

/// Newton's method for L2-penalised logistic regression with soft targets.
fn newton(examples: &[(OutcomeInputs, f64)]) -> Vec<f64> {
    let rows: Vec<([f64; PARAMETERS], f64)> =
        examples.iter().map(|(x, y)| (design(x), *y)).collect();
    let mut theta = vec![0.0; PARAMETERS];
    for _ in 0..NEWTON_STEPS {
        let mut grad = vec![0.0; PARAMETERS];
        let mut hess = vec![vec![0.0; PARAMETERS]; PARAMETERS];
        for (x, y) in &rows {
            let z: f64 = x.iter().zip(&theta).map(|(a, b)| a * b).sum();
            let p = 1.0 / (1.0 + (-z).exp());
            let s = p * (1.0 - p);
            for a in 0..PARAMETERS {
                if x[a] == 0.0 {
                    continue;
                }
                grad[a] += (p - y) * x[a];
                for b in 0..PARAMETERS {
                    hess[a][b] += s * x[a] * x[b];
                }
            }
        }
        for a in 0..PARAMETERS - 1 {
            grad[a] += PENALTY * theta[a];
            hess[a][a] += PENALTY;
        }
        // A parameter no example touches (no multiple-choice prompts) keeps a unit curvature.
        for (a, row) in hess.iter_mut().enumerate() {
            if row[a] == 0.0 {
                row[a] = 1.0;
            }
        }
        let Some(step) = solve(hess, grad) else {
            break;
        };
        let mut largest: f64 = 0.0;
        for (t, s) in theta.iter_mut().zip(&step) {
            *t -= s;
            largest = largest.max(s.abs());
        }
        if largest < 1e-10 {
            break;
        }
    }
    theta
}

/// Solves `a·x = b` by Gaussian elimination with partial pivoting; `None` when singular.
fn solve(mut a: Vec<Vec<f64>>, mut b: Vec<f64>) -> Option<Vec<f64>> {
    let n = b.len();
    for col in 0..n {
        let pivot = (col..n).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[pivot][col].abs() < 1e-12 {
            return None;
        }
        a.swap(col, pivot);
        b.swap(col, pivot);
        let (upper, lower) = a.split_at_mut(col + 1);
        let pivot_row = &upper[col];
        for (offset, row) in lower.iter_mut().enumerate() {
            let k = row[col] / pivot_row[col];
            if k == 0.0 {
                continue;
            }
            for (x, p) in row[col..].iter_mut().zip(&pivot_row[col..]) {
                *x -= k * p;
            }
            b[col + 1 + offset] -= k * b[col];
        }
    }
    let mut x = vec![0.0; n];
    for row in (0..n).rev() {
        let tail: f64 = (row + 1..n).map(|j| a[row][j] * x[j]).sum();
        x[row] = (b[row] - tail) / a[row][row];
    }
    Some(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_quantities_choices_and_statements() {
        let gsm = OutcomeInputs::of_text(
            "Sam buys 3 apples at $1.50 each and 1/2 of a pie. How much does he pay?",
            4096,
        );
        let mcq = OutcomeInputs::of_text(
            "Statement 1 | Every group is cyclic. Which is NOT true?\nA. 12\nB. x\nC. 4\nD. none",
            4096,
        );
        let at = |name: &str| OUTCOME_FEATURES.iter().position(|n| *n == name).unwrap();
        assert_eq!(gsm.0[at("choices")], 0.0);
        assert_eq!(mcq.0[at("choices")], 1.0);
        assert!(gsm.0[at("quantities")] > mcq.0[at("quantities")] * 0.0);
        assert!(gsm.0[at("decimals")] > 0.0 && gsm.0[at("fractions")] > 0.0);
        assert!(gsm.0[at("relations")] > 0.0 && gsm.0[at("money_percent")] > 0.0);
        assert_eq!(mcq.0[at("statements")], 1.0);
        assert!(mcq.0[at("negations")] > 0.0);
        assert!(mcq.0[at("numeric_choices")] > 0.0);
        assert_eq!(gsm.0[at("numeric_choices")], 0.0);
        assert!(gsm
            .0
            .iter()
            .chain(&mcq.0)
            .all(|v| v.is_finite() && *v >= 0.0));
    }

    #[test]
    fn the_scored_text_is_the_ask_first_within_the_window() {
        use crate::features::{Role, Segment};
        let history = "é".repeat(3000);
        let ask = "How many apples? ".repeat(200);
        let prompt = Prompt {
            segments: vec![
                Segment {
                    role: Role::Assistant,
                    text: &history,
                },
                Segment {
                    role: Role::User,
                    text: &ask,
                },
            ],
            wants_json: false,
        };
        let text = OutcomeInputs::scored_text(&prompt, 1 << 20);
        // The ask fills the window; the history gets what is left of its share, whole chars.
        assert!(text.starts_with("How many apples?"));
        assert!(text.len() <= OUTCOME_WINDOW + 2, "{}", text.len());
        assert_eq!(
            OutcomeInputs::of_text(&text, OUTCOME_WINDOW),
            OutcomeInputs::of(&prompt, 1 << 20)
        );
        assert!(OutcomeInputs::scored_text(&prompt, 10).len() <= 10);
    }

    #[test]
    fn fitting_is_deterministic_and_learns_the_direction() {
        let records: Vec<OutcomeRecord> = (0..200)
            .map(|i| {
                let n = i % 8;
                let prompt = (0..=n).map(|k| format!("{k} apples. ")).collect::<String>();
                OutcomeRecord {
                    id: i.to_string(),
                    source: "s".into(),
                    category: "c".into(),
                    prompt,
                    inputs: None,
                    task_class: None,
                    weak_correct: n < 4 || i % 5 == 0,
                    strong_correct: true,
                }
            })
            .collect();
        let refs: Vec<&OutcomeRecord> = records.iter().collect();
        let a = fit_outcomes(&refs, 4096, vec![TaskClass::Math]);
        assert_eq!(a, fit_outcomes(&refs, 4096, vec![TaskClass::Math]));
        let easy = a.logit(&OutcomeInputs::of_text("1 apples.", 4096));
        let hard = a.logit(&OutcomeInputs::of_text(
            "1 apples. 2 apples. 3 apples. 4 apples. 5 apples. 6 apples. 7 apples.",
            4096,
        ));
        assert!(hard > easy, "{hard} <= {easy}");
        assert!(OutcomeHead::risk_of(hard) > OutcomeHead::risk_of(easy));
        assert!(a.check().is_ok());
    }

    /// A multiple-choice question of `category`: long or short, with or without a negation.
    fn question(i: usize, long: bool, not: bool, verdicts: (bool, bool)) -> OutcomeRecord {
        let stem = if long {
            "Which property of the described system holds, given the lengthy setup above"
        } else {
            "Which holds"
        };
        let not = if not { " NOT" } else { "" };
        OutcomeRecord {
            id: i.to_string(),
            source: "s".into(),
            category: if long { "long" } else { "short" }.into(),
            prompt: format!("{stem}{not}?\nA. one\nB. two\nC. three\nD. four\nAnswer:"),
            inputs: None,
            task_class: None,
            weak_correct: verdicts.0,
            strong_correct: verdicts.1,
        }
    }

    /// Between the two categories, length says almost everything (the long one's questions
    /// need the reference far more often); within each, a negation adds a little. The trees
    /// learn the within-category difference, which is all that ranks a workload of one kind.
    #[test]
    fn choice_trees_rank_within_a_category_not_between() {
        let (need, agree, cheap_only) = ((false, true), (true, true), (true, false));
        let mut records = Vec::new();
        for i in 0..40 {
            records.push(question(i, true, true, need));
            records.push(question(
                100 + i,
                true,
                false,
                if i < 30 { need } else { agree },
            ));
            records.push(question(
                200 + i,
                false,
                true,
                if i < 10 { agree } else { cheap_only },
            ));
            records.push(question(300 + i, false, false, cheap_only));
        }
        let refs: Vec<&OutcomeRecord> = records.iter().collect();
        let head = fit_outcomes(&refs, 4096, vec![TaskClass::Reasoning]);
        assert_eq!(head, fit_outcomes(&refs, 4096, vec![TaskClass::Reasoning]));
        assert!(head.choice_trees.is_some() && head.check().is_ok());
        let logit = |r: OutcomeRecord| head.logit(&OutcomeInputs::of_text(&r.prompt, 4096));
        let short_not = logit(question(0, false, true, agree));
        let long_plain = logit(question(0, true, false, agree));
        assert!(short_not > long_plain, "{short_not} <= {long_plain}");
        assert!(logit(question(0, true, true, agree)) > long_plain);
        // Calibrated on the records as a whole: the mean target is 0.46, a risk near zero.
        let risk = OutcomeHead::risk_of(logit(question(0, true, true, agree)));
        assert!((0.0..0.5).contains(&risk), "{risk}");
    }

    #[test]
    fn a_head_without_trees_scores_choices_linearly_and_bad_trees_are_named() {
        let records: Vec<OutcomeRecord> = (0..80)
            .map(|i| question(i, i % 2 == 0, i % 3 == 0, (i % 4 == 0, true)))
            .collect();
        let refs: Vec<&OutcomeRecord> = records.iter().collect();
        let head = fit_outcomes(&refs, 4096, vec![]);
        let mut json = serde_json::to_value(&head).unwrap();
        json.as_object_mut().unwrap().remove("choice_trees");
        let linear: OutcomeHead = serde_json::from_value(json).unwrap();
        assert!(linear.choice_trees.is_none() && linear.check().is_ok());
        let inputs = OutcomeInputs::of_text(&records[0].prompt, 4096);
        let row: f32 = linear
            .choices
            .iter()
            .zip(&inputs.0)
            .map(|(w, x)| w * x)
            .sum();
        assert_eq!(linear.logit(&inputs), f64::from(row + linear.bias));
        assert_ne!(head.logit(&inputs), linear.logit(&inputs));
        let broken = |edit: fn(&mut ChoiceTrees)| {
            let mut head = head.clone();
            edit(head.choice_trees.as_mut().unwrap());
            head.check().unwrap_err().0
        };
        let at = "weights.outcome.choice_trees";
        assert_eq!(broken(|t| t.trees[0].inputs[0] = OUTCOME_INPUTS as u8), at);
        assert_eq!(broken(|t| t.trees[0].leaves.push(0.0)), at);
        assert_eq!(broken(|t| t.trees[1].thresholds[2] = f32::NAN), at);
        assert_eq!(broken(|t| t.depth = MAX_TREE_DEPTH + 1), at);
    }

    #[test]
    fn outcome_lines_take_either_name_and_default_the_rest() {
        let rows = parse_outcomes(
            "{\"prompt\": \"a\", \"cheap_ok\": false, \"reference_ok\": true}\n\n\
             {\"id\": \"x\", \"source\": \"s\", \"category\": \"c\", \"prompt\": \"b\", \
             \"weak_correct\": true, \"strong_correct\": true, \"extra\": 1}",
        )
        .unwrap();
        assert_eq!(rows[0].id, "line-1");
        assert_eq!(rows[0].source, "unknown");
        assert!(rows[0].target() > 0.99);
        assert_eq!(rows[1].target(), 0.5);
        assert!(matches!(
            parse_outcomes("{\"prompt\": \"a\"}"),
            Err(DataError::Line { line: 1, .. })
        ));
    }

    #[test]
    fn traffic_records_read_their_inputs_and_refuse_another_feature_list() {
        let inputs = OutcomeInputs::of_text("Sam buys 3 apples at $1.50 each.", 4096);
        let line = serde_json::json!({"features": inputs.named(), "inputs": OUTCOME_INPUTS,
            "task_class": "math", "cheap_profile": "a", "reference_profile": "b",
            "agreed": false});
        let rows = parse_outcomes(&line.to_string()).unwrap();
        assert_eq!(rows[0].inputs, Some(inputs));
        assert_eq!(rows[0].inputs(4096), inputs);
        assert!(!rows[0].weak_correct && rows[0].strong_correct);
        assert_eq!(
            (rows[0].source.as_str(), rows[0].category.as_str()),
            ("traffic", "math")
        );

        let mut renamed = line.clone();
        renamed["features"]["bogus"] = 0.5.into();
        let error = parse_outcomes(&renamed.to_string())
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("`bogus`") && error.contains("another feature list"),
            "{error}"
        );
        let mut counted = line.clone();
        counted["inputs"] = (OUTCOME_INPUTS + 1).into();
        let error = parse_outcomes(&counted.to_string())
            .unwrap_err()
            .to_string();
        assert!(error.contains("21 inputs"), "{error}");
        let mut classless = line;
        classless.as_object_mut().unwrap().remove("task_class");
        assert!(parse_outcomes(&classless.to_string()).is_err());
    }

    #[test]
    fn covered_classes_are_those_with_a_tenth_of_the_records() {
        let classes = [TaskClass::Math; 18]
            .into_iter()
            .chain([TaskClass::Reasoning; 3])
            .chain([TaskClass::Code]);
        assert_eq!(
            covered_classes(classes),
            vec![TaskClass::Math, TaskClass::Reasoning]
        );
    }
}
