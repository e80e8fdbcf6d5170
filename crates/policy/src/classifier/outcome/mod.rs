//! The outcome head: from what a prompt looks like, how much of the answer's quality a
//! cheaper tier is expected to lose against the reference (`docs/routing.md` §1c).
//!
//! The task-class and difficulty heads learn labels given per source, so they tell kinds of
//! prompt apart but rank prompts of one kind no better than chance. This head learns from
//! outcome records — per prompt, how a cheap and a reference model's answers were judged,
//! right or wrong or graded — and reads what makes one prompt harder than another: a
//! question's shape (quantities, sentences, operators, rare words, answer choices) and what a
//! request asks for (the kind of ask, constraints, steps, the answer's length and format,
//! code context).
//!
//! Its target is `(1 + reference − cheap) / 2` of the two answers' scores in [0, 1], whose
//! expectation `p` makes `2p − 1` the quality the cheaper answer is expected to lose. That,
//! clamped to [0,1], is the `risk` the policy compares with `risk_tolerance`, for every
//! prompt. Word problems and other prompts without answer choices are scored by logistic
//! regressions of their own, fitted by Newton's method and drawn towards one row fitted to
//! both; multiple-choice prompts by a small ensemble of boosted regression trees fitted to
//! the target minus its category's mean, so that they learn what ranks questions within a
//! subject rather than what tells subjects apart (the means are dropped afterwards). Every
//! part estimates the same target, so their risks are on one scale. All fits are
//! deterministic.

use serde::{Deserialize, Serialize};

use super::data::{hash, DataError};
use crate::features::TaskClass;
use trees::{boost, MIN_LEAF};

mod scan;
mod trees;

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
    "ask_create",
    "ask_explain",
    "ask_fix",
    "ask_solve",
    "ask_transform",
    "ask_advice",
    "creative",
    "constraints",
    "steps",
    "short_answer",
    "long_answer",
    "format",
    "code_words",
    "science_words",
    "lines",
    "list_items",
    "code_lines",
    "code_symbols",
    "code_fences",
    "non_ascii",
];
pub const OUTCOME_INPUTS: usize = 40;
/// The first inputs describe a question's shape (its numbers, sentences, words and answer
/// choices); the rest, the kind of request and the answer it asks for. The trees split on
/// the shape alone: a multiple-choice question asks one thing, which of its choices holds.
const SHAPE_INPUTS: usize = 20;
/// Index of the input that says the prompt lists answer choices.
const CHOICES: usize = 9;
/// Parameters of a linear row: its weights, then its bias.
const PARAMETERS: usize = OUTCOME_INPUTS + 1;
/// Bytes of the scoring window the head reads: a question's shape is in its first lines,
/// and the pass costs about as much per byte as the classifier's own (every outcome record
/// shipped is shorter).
pub const OUTCOME_WINDOW: usize = 2048;
/// The mean word length the head reads is capped here (a base64 blob is one long word):
/// every input stays within [`INPUT_RANGE`].
const MAX_MEAN_WORD: f64 = 30.0;
/// Every input lies in this range: the counts are of at most [`OUTCOME_WINDOW`] bytes,
/// log-scaled, and the rest are shares. A record claiming a value outside it was not
/// written by this head.
pub const INPUT_RANGE: std::ops::RangeInclusive<f32> = 0.0..=4.0;
/// L2 penalty on the weights (not the bias): small data, so keep the weights modest.
const PENALTY: f64 = 1.0;
const NEWTON_STEPS: usize = 12;
/// Grades run from 0 to this (MT-Bench's scale).
pub const MAX_GRADE: f32 = 10.0;

/// One prompt with how a cheap and a reference model answered it: from a benchmark (the
/// prompt's text) or from the router's own traffic (the prompt's inputs as the head read
/// them, and whether the served answer agreed with the reference's).
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
    pub verdicts: Verdicts,
}

/// How the two answers to one prompt were judged.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdicts {
    /// Right or wrong: a benchmark's check, or a traffic record's agreement with the
    /// reference (which is then taken to be right).
    Correct { cheap: bool, reference: bool },
    /// Graded by a judge from 0 to 10 (MT-Bench's scale; higher is better): open-ended
    /// answers are rarely simply right or wrong.
    Graded { cheap: f32, reference: f32 },
}

/// One line as written: a benchmark's (`prompt`, `weak_correct`/`cheap_ok` and
/// `strong_correct`/`reference_ok`, or `weak_grade`/`cheap_grade` and
/// `strong_grade`/`reference_grade`) or the router's (`features`, `inputs`, `task_class`,
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
    #[serde(default, alias = "cheap_grade")]
    weak_grade: Option<f32>,
    #[serde(default, alias = "reference_grade")]
    strong_grade: Option<f32>,
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

/// The fitted head, as the classifier document stores it (`weights.outcome`): one part per
/// kind of prompt, each fitted to the same target on the records of its kind, so their risks
/// are on one scale.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutcomeHead {
    /// Input names; must be [`OUTCOME_FEATURES`].
    pub features: Vec<String>,
    /// A math prompt without answer choices (a word problem).
    pub math: LinearRow,
    /// Any other prompt without answer choices: chat, writing, code, extraction.
    pub open: LinearRow,
    /// A multiple-choice prompt, when there are no `choice_trees`.
    pub choices: LinearRow,
    /// What scores a multiple-choice prompt, when the training records had enough.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub choice_trees: Option<ChoiceTrees>,
}

/// A logistic regression on the inputs: `p = σ(weights·x + bias)`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinearRow {
    pub weights: Vec<f32>,
    pub bias: f32,
}

/// Why a fitted head must not be written or pushed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DegenerateHead {
    #[error("the outcome head is invalid: {0}: {1}")]
    Invalid(&'static str, String),
    #[error(
        "the outcome head gives every request without answer choices the same risk: its \
         records hold nothing it can rank by (do the cheap and the reference answers ever \
         differ?)"
    )]
    Constant,
    #[error(
        "the outcome head ranks its own training records no better than random (APGR \
         {0:.3}): it learned nothing"
    )]
    WorseThanRandom(f64),
}

/// Which part of the head scores a prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Part {
    Math,
    Open,
    Choices,
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

/// One outcome as the fit sees it: a prompt's inputs and task class, the two verdicts, and
/// the category held out together (records of one category share a mean the trees do not
/// learn).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OutcomeExample<'a> {
    pub inputs: OutcomeInputs,
    pub task_class: TaskClass,
    pub verdicts: Verdicts,
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
    let verdicts = verdicts(&raw)?;
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
        verdicts,
    })
}

/// The verdicts of a line: exactly one of `agreed`, both correctness fields, or both grades.
fn verdicts(raw: &RawRecord) -> Result<Verdicts, String> {
    let correct = (raw.weak_correct, raw.strong_correct);
    let graded = (raw.weak_grade, raw.strong_grade);
    let given = [
        raw.agreed.is_some(),
        correct != (None, None),
        graded != (None, None),
    ];
    if given.iter().filter(|&&g| g).count() > 1 {
        return Err(
            "give one of `agreed`, `weak_correct` and `strong_correct`, or \
                    `weak_grade` and `strong_grade`"
                .into(),
        );
    }
    let grade = |name: &str, g: f32| match (0.0..=MAX_GRADE).contains(&g) {
        true => Ok(g),
        false => Err(format!("`{name}` must be a grade from 0 to {MAX_GRADE}")),
    };
    match (raw.agreed, correct, graded) {
        (Some(agreed), ..) => Ok(Verdicts::Correct {
            cheap: agreed,
            reference: true,
        }),
        (_, (Some(cheap), Some(reference)), _) => Ok(Verdicts::Correct { cheap, reference }),
        (_, _, (Some(cheap), Some(reference))) => Ok(Verdicts::Graded {
            cheap: grade("weak_grade", cheap)?,
            reference: grade("strong_grade", reference)?,
        }),
        (_, (Some(_), None), _) => Err("missing field `strong_correct`".into()),
        (_, (None, Some(_)), _) => Err("missing field `weak_correct`".into()),
        (_, _, (Some(_), None)) => Err("missing field `strong_grade`".into()),
        (_, _, (None, Some(_))) => Err("missing field `weak_grade`".into()),
        _ => Err(
            "missing field `weak_correct` (or `weak_grade`, or a traffic record's `agreed`)".into(),
        ),
    }
}

// === impl OutcomeRecord ===

impl OutcomeRecord {
    /// The head's soft target (see [`Verdicts::target`]).
    pub fn target(&self) -> f64 {
        self.verdicts.target()
    }

    /// What holds records out together: the prompt (one prompt in two model pairs' files is
    /// one prompt), or the id of a record without text (a traffic record).
    pub fn prompt_key(&self) -> &str {
        match self.prompt.is_empty() {
            true => &self.id,
            false => &self.prompt,
        }
    }

    /// The fold of a record for `k`-fold cross-validation, by a stable hash of its prompt.
    pub fn fold(&self, seed: u64, k: u64) -> u64 {
        hash(seed, self.prompt_key()) % k.max(1)
    }

    /// What the head reads of the record: a traffic record's stored inputs, else its prompt.
    pub fn inputs(&self, window: usize) -> OutcomeInputs {
        self.inputs
            .unwrap_or_else(|| OutcomeInputs::of_text(&self.prompt, window))
    }
}

// === impl Verdicts ===

impl Verdicts {
    /// The head's soft target, `(1 + reference − cheap) / 2` of the two answers' scores
    /// ([`Verdicts::scores`]). Its expectation `p` makes `2p − 1` the quality the cheap answer
    /// is expected to lose: for right-or-wrong answers P(cheap worse) − P(cheap better); for
    /// grades the same net probability averaged over every margin a grade can fall short by
    /// (0, 1, … points), so a grade that falls far counts for more than one that falls a
    /// little.
    pub fn target(self) -> f64 {
        let (cheap, reference) = self.scores();
        0.5 * (1.0 + reference - cheap)
    }

    /// How good the cheap and the reference answers were, in [0, 1] (right 1, wrong 0; a
    /// grade over [`MAX_GRADE`]): what a routing curve averages.
    pub fn scores(self) -> (f64, f64) {
        match self {
            Self::Correct { cheap, reference } => {
                (f64::from(u8::from(cheap)), f64::from(u8::from(reference)))
            }
            Self::Graded { cheap, reference } => (
                f64::from(cheap / MAX_GRADE),
                f64::from(reference / MAX_GRADE),
            ),
        }
    }
}

// === impl OutcomeHead ===

impl OutcomeHead {
    /// The head's logit for a prompt of `class`: higher means the reference is more likely
    /// needed.
    pub fn logit(&self, inputs: &OutcomeInputs, class: TaskClass) -> f64 {
        match (Part::of(inputs, class), &self.choice_trees) {
            (Part::Choices, Some(trees)) => trees.logit(inputs),
            (Part::Choices, None) => self.choices.logit(inputs),
            (Part::Math, _) => self.math.logit(inputs),
            (Part::Open, _) => self.open.logit(inputs),
        }
    }

    /// `risk` from a logit: the net probability that the cheaper answer is worse, in [0,1].
    pub fn risk_of(logit: f64) -> f64 {
        let p = 1.0 / (1.0 + (-logit).exp());
        (2.0 * p - 1.0).clamp(0.0, 1.0)
    }

    /// What makes a head unfit to route by, as a document shows it: a non-finite or
    /// misshapen part, or rows for requests without answer choices that read nothing (all
    /// their weights zero: every such request would get one risk).
    pub fn degenerate(&self) -> Option<DegenerateHead> {
        if let Err((path, message)) = self.check() {
            return Some(DegenerateHead::Invalid(path, message));
        }
        let reads_nothing = |row: &LinearRow| row.weights.iter().all(|&w| w == 0.0);
        (reads_nothing(&self.math) && reads_nothing(&self.open)).then_some(DegenerateHead::Constant)
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
        for (path, row) in [
            ("weights.outcome.math", &self.math),
            ("weights.outcome.open", &self.open),
            ("weights.outcome.choices", &self.choices),
        ] {
            if row.weights.len() != OUTCOME_INPUTS
                || !row.weights.iter().chain([&row.bias]).all(|w| w.is_finite())
            {
                return Err((
                    path,
                    format!("must have {OUTCOME_INPUTS} finite weights and a finite bias"),
                ));
            }
        }
        match &self.choice_trees {
            Some(trees) => trees.check(),
            None => Ok(()),
        }
    }
}

// === impl LinearRow ===

impl LinearRow {
    fn logit(&self, inputs: &OutcomeInputs) -> f64 {
        let z: f32 = self
            .weights
            .iter()
            .zip(&inputs.0)
            .map(|(w, x)| w * x)
            .sum::<f32>()
            + self.bias;
        f64::from(z)
    }

    fn of(theta: &[f64]) -> Self {
        Self {
            weights: theta[..OUTCOME_INPUTS].iter().map(|&v| v as f32).collect(),
            bias: theta[OUTCOME_INPUTS] as f32,
        }
    }
}

// === impl Part ===

impl Part {
    fn of(inputs: &OutcomeInputs, class: TaskClass) -> Self {
        match (inputs.choices(), class) {
            (true, _) => Self::Choices,
            (false, TaskClass::Math) => Self::Math,
            (false, _) => Self::Open,
        }
    }
}

pub fn fit_outcomes(
    records: &[&OutcomeRecord],
    classes: &[TaskClass],
    window: usize,
) -> OutcomeHead {
    let examples: Vec<OutcomeExample<'_>> = records
        .iter()
        .zip(classes)
        .map(|(r, &task_class)| OutcomeExample {
            inputs: r.inputs(window),
            task_class,
            verdicts: r.verdicts,
            category: &r.category,
        })
        .collect();
    fit_examples(&examples)
}

/// Fits the head to prompts already turned into inputs. The rows for prompts without
/// answer choices are fitted to the records of their kind, each drawn towards one row
/// fitted to all of them (so a kind with few records keeps what the others say, and every
/// row estimates the same target); the multiple-choice row and trees to the
/// multiple-choice records.
pub fn fit_examples(examples: &[OutcomeExample<'_>]) -> OutcomeHead {
    let rows = |part: Option<Part>| -> Vec<(OutcomeInputs, f64)> {
        examples
            .iter()
            .filter(|e| {
                let of = Part::of(&e.inputs, e.task_class);
                part.map_or(of != Part::Choices, |p| p == of)
            })
            .map(|e| (e.inputs, e.verdicts.target()))
            .collect()
    };
    let shared = newton(&rows(None), &[0.0; PARAMETERS]);
    let choices: Vec<&OutcomeExample<'_>> =
        examples.iter().filter(|e| e.inputs.choices()).collect();
    OutcomeHead {
        features: OUTCOME_FEATURES.iter().map(|s| (*s).to_owned()).collect(),
        math: LinearRow::of(&newton(&rows(Some(Part::Math)), &shared)),
        open: LinearRow::of(&newton(&rows(Some(Part::Open)), &shared)),
        choices: LinearRow::of(&newton(&rows(Some(Part::Choices)), &[0.0; PARAMETERS])),
        choice_trees: (choices.len() >= 2 * MIN_LEAF).then(|| boost(&choices)),
    }
}

/// Newton's method for logistic regression with soft targets, its weights (not its bias)
/// penalised by their L2 distance from `prior`; from `prior`, which the result is when there
/// are no examples.
fn newton(examples: &[(OutcomeInputs, f64)], prior: &[f64; PARAMETERS]) -> [f64; PARAMETERS] {
    let design = |inputs: &OutcomeInputs| {
        let mut x = [1f64; PARAMETERS];
        for (x, &v) in x.iter_mut().zip(&inputs.0) {
            *x = f64::from(v);
        }
        x
    };
    let rows: Vec<([f64; PARAMETERS], f64)> =
        examples.iter().map(|(x, y)| (design(x), *y)).collect();
    let mut theta = *prior;
    if rows.is_empty() {
        return theta;
    }
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
            grad[a] += PENALTY * (theta[a] - prior[a]);
            hess[a][a] += PENALTY;
        }
        // Soft targets of ½ everywhere leave the bias flat: keep its curvature positive.
        hess[PARAMETERS - 1][PARAMETERS - 1] += 1e-9;
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
mod tests;
