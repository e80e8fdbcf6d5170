//! Prompt features and the complexity score (`docs/routing.md`).
//!
//! Everything is computed in one pass over a bounded *scoring window* of the prompt, so the
//! cost per request is capped by `policy.complexity.scoring_window_chars` whatever the prompt
//! size. Only the token estimate looks at the whole prompt, and only at its length.

use serde::{Deserialize, Serialize};

use crate::profile::ComplexityWeights;
use cues::Cue;
use scan::{Counts, Scanner};

pub(crate) mod cues;
mod scan;

/// Who wrote a piece of prompt text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    System,
    User,
    Assistant,
    /// Tool results, developer messages and anything else: scored like user text.
    Other,
}

/// One text part of one message (multimodal messages contribute their text parts only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment<'a> {
    pub role: Role,
    pub text: &'a str,
}

/// The parts of a request that features are computed from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Prompt<'a> {
    /// Messages in request order (a completion prompt is one `User` segment).
    pub segments: Vec<Segment<'a>>,
    /// The request asked for JSON output (`response_format` json_object / json_schema).
    pub wants_json: bool,
}

/// The task a prompt asks for; profiles can declare a quality per class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TaskClass {
    Code,
    Math,
    Structured,
    /// Multi-step reasoning asked in prose (science, commonsense, strategy questions).
    Reasoning,
    General,
}

/// Features of one prompt; every score is in [0,1].
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Features {
    /// Shannon entropy of the first kilobyte of the window, mapped from 3..5.5 bits to 0..1.
    pub entropy: f64,
    /// Share of words that are content words (not function words).
    pub lexical: f64,
    pub code: f64,
    pub math: f64,
    pub json: f64,
    /// Numeric words per word, scaled so 25% numbers saturates.
    pub numeric: f64,
    /// Log-scaled window length: ~0 for a short question, 1 at the full window.
    pub length: f64,
    pub task_class: TaskClass,
    /// Weighted sum of the scores above, clamped to [0,1].
    pub complexity: f64,
    /// The classifier's outcome head: the net probability that the cheapest profile's answer
    /// is worse than the reference's, when the head covers this task class; `None` without
    /// one (the policy then uses the required quality alone).
    pub risk: Option<f64>,
    /// Bytes of prompt text in the whole request (not just the window).
    pub prompt_bytes: usize,
    /// Number of messages, for per-message token overhead.
    pub segments: usize,
}

/// A prompt that cannot be routed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FeatureError {
    #[error("prompt is empty")]
    EmptyPrompt,
}

/// Assistant turns are context, not the ask: they get at most this share of the window.
const ASSISTANT_WINDOW_SHARE: usize = 4;
/// Chat templates add a few tokens of framing per message.
const TOKENS_PER_MESSAGE: usize = 4;

// === impl TaskClass ===

impl TaskClass {
    /// The name used in profile documents, metrics and explain.
    pub fn as_str(self) -> &'static str {
        match self {
            TaskClass::Code => "code",
            TaskClass::Math => "math",
            TaskClass::Structured => "structured",
            TaskClass::Reasoning => "reasoning",
            TaskClass::General => "general",
        }
    }
}

// === impl Prompt ===

impl<'a> Prompt<'a> {
    /// One user message and nothing else: how benchmark records and labelled prompts are read.
    pub fn user(text: &'a str) -> Self {
        Self {
            segments: vec![Segment {
                role: Role::User,
                text,
            }],
            wants_json: false,
        }
    }
}

// === impl Features ===

impl Features {
    /// Extracts features from a prompt and scores its complexity with `weights`.
    pub fn extract(prompt: &Prompt<'_>, weights: &ComplexityWeights) -> Result<Self, FeatureError> {
        let prompt_bytes: usize = prompt.segments.iter().map(|s| s.text.len()).sum();
        if prompt
            .segments
            .iter()
            .all(|s| s.text.trim_start().is_empty())
        {
            return Err(FeatureError::EmptyPrompt);
        }

        let mut scan = Scanner::default();
        let window = weights.scoring_window_chars.max(1);
        for_each_scored(prompt, window, |text| scan.feed(text.as_bytes()));
        Ok(scores(
            &scan.finish(),
            prompt.wants_json,
            window,
            weights,
            prompt_bytes,
            prompt.segments.len(),
        ))
    }

    /// Features of a prompt with no text to score (an image-only message, blank content):
    /// scored from nothing, it is the simplest prompt there is, except that a request for
    /// JSON stays structured.
    pub fn without_text(prompt: &Prompt<'_>, weights: &ComplexityWeights) -> Self {
        scores(
            &Scanner::default().finish(),
            prompt.wants_json,
            weights.scoring_window_chars.max(1),
            weights,
            prompt.segments.iter().map(|s| s.text.len()).sum(),
            prompt.segments.len(),
        )
    }

    /// Estimated prompt tokens for a tokenizer averaging `chars_per_token`.
    pub fn estimated_input_tokens(&self, chars_per_token: f64) -> u64 {
        let per_char = if chars_per_token > 0.0 {
            chars_per_token
        } else {
            4.0
        };
        (self.prompt_bytes as f64 / per_char).ceil() as u64
            + (self.segments * TOKENS_PER_MESSAGE) as u64
    }
}

/// Calls `f` with each piece of text in the scoring window of `window` bytes: the ask
/// (system and user messages) first, then assistant context if room is left, capped at
/// a quarter of the window. Inlined, so that each caller's loop is compiled with its closure
/// (out of line, the gram pass kept its sums in memory: a sixth more instructions).
#[inline]
pub(crate) fn for_each_scored<'p>(prompt: &Prompt<'p>, window: usize, mut f: impl FnMut(&'p str)) {
    let mut assistant_left = window / ASSISTANT_WINDOW_SHARE;
    let mut left = window;
    for pass_assistant in [false, true] {
        for seg in &prompt.segments {
            if (seg.role == Role::Assistant) != pass_assistant || left == 0 {
                continue;
            }
            let mut budget = left;
            if pass_assistant {
                budget = budget.min(assistant_left);
            }
            let text = truncate_at_char(seg.text, budget);
            f(text);
            left -= text.len();
            if pass_assistant {
                assistant_left -= text.len();
            }
        }
    }
}

fn truncate_at_char(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Turns the counts of the scoring window into the feature scores (`docs/routing.md`).
fn scores(
    c: &Counts,
    wants_json: bool,
    window: usize,
    w: &ComplexityWeights,
    prompt_bytes: usize,
    segments: usize,
) -> Features {
    let cue = |kind: Cue| c.cues[kind as usize];
    let function_words = cue(Cue::Function);
    let math_words = c.money + cue(Cue::Math) + cue(Cue::QuantityMath);
    let quantities = c.numbers + cue(Cue::Quantity) + cue(Cue::QuantityMath);
    let words = f64::from(c.words.max(1));
    let entropy = scale(shannon_entropy(&c.byte_counts, c.sampled_bytes), 3.0, 5.5);
    let lexical = if c.words == 0 {
        0.0
    } else {
        1.0 - f64::from(function_words) / words
    };
    let code = clamp01(
        0.6 * f64::from(c.fences.min(1))
            + 0.2 * f64::from(cue(Cue::CodeKeyword).min(4))
            + 0.25 * f64::from(cue(Cue::CodeIntent).min(2))
            + 0.1 * f64::from(c.indented_lines.min(5))
            + 4.0 * f64::from(c.code_symbols) / c.bytes.max(1) as f64,
    );
    let word_problem = if quantities >= 2 {
        0.2 * f64::from(math_words.min(3)) + 0.4 * f64::from(cue(Cue::ManyMuch).min(1))
    } else {
        0.0
    };
    let math = clamp01(
        0.35 * f64::from(c.math_ops.min(3))
            + 0.4 * f64::from(c.latex.min(2))
            + 0.1 * f64::from(quantities.min(4))
            + word_problem,
    );
    let json = if wants_json {
        1.0
    } else {
        clamp01(0.6 * f64::from(cue(Cue::Json).min(1)) + 0.3 * f64::from(c.json_braces.min(2)))
    };
    let numeric = clamp01(4.0 * f64::from(c.numbers) / words);
    let length = scale(
        (1.0 + c.bytes as f64).ln(),
        (1.0 + 32.0f64).ln(),
        (1.0 + window as f64).ln(),
    );
    let task_class = if code >= 0.5 && code >= math {
        TaskClass::Code
    } else if math >= 0.5 {
        TaskClass::Math
    } else if json >= 0.5 {
        TaskClass::Structured
    } else {
        TaskClass::General
    };
    let complexity = clamp01(
        w.entropy * entropy
            + w.lexical * lexical
            + w.code * code
            + w.math * math
            + w.json * json
            + w.numeric * numeric
            + w.length * length,
    );
    Features {
        entropy,
        lexical,
        code,
        math,
        json,
        numeric,
        length,
        task_class,
        complexity,
        risk: None,
        prompt_bytes,
        segments,
    }
}

/// Bits per byte, 0 for empty input.
fn shannon_entropy(counts: &[u32; 256], total: usize) -> f64 {
    if total == 0 {
        return 0.0;
    }
    let n = total as f64;
    counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let p = f64::from(c) / n;
            -p * p.log2()
        })
        .sum()
}

fn scale(value: f64, lo: f64, hi: f64) -> f64 {
    clamp01((value - lo) / (hi - lo))
}

fn clamp01(x: f64) -> f64 {
    if x.is_nan() {
        0.0
    } else {
        x.clamp(0.0, 1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn features(text: &str) -> Features {
        let prompt = Prompt {
            segments: vec![Segment {
                role: Role::User,
                text,
            }],
            wants_json: false,
        };
        Features::extract(&prompt, &ComplexityWeights::default()).unwrap()
    }

    #[test]
    fn empty_and_whitespace_prompts_are_rejected() {
        let w = ComplexityWeights::default();
        for text in ["", "   \n\t "] {
            let prompt = Prompt {
                segments: vec![Segment {
                    role: Role::User,
                    text,
                }],
                wants_json: false,
            };
            assert_eq!(
                Features::extract(&prompt, &w),
                Err(FeatureError::EmptyPrompt)
            );
        }
        assert_eq!(
            Features::extract(&Prompt::default(), &w),
            Err(FeatureError::EmptyPrompt)
        );
    }

    #[test]
    fn a_prompt_without_text_is_the_simplest_prompt() {
        let w = ComplexityWeights::default();
        let plain = Features::without_text(&Prompt::default(), &w);
        assert_eq!(plain.complexity, 0.0, "{plain:?}");
        assert_eq!(plain.task_class, TaskClass::General);
        assert_eq!(plain.estimated_input_tokens(4.0), 0);
        let shortest = features("Hi");
        assert!(plain.complexity <= shortest.complexity);
        let json = Prompt {
            segments: vec![],
            wants_json: true,
        };
        assert_eq!(
            Features::without_text(&json, &w).task_class,
            TaskClass::Structured
        );
    }

    #[test]
    fn python_function_is_code() {
        let f = features(
            "Complete this Python function:\ndef add(a, b):\n    \"\"\"Return a + b.\"\"\"\n",
        );
        assert_eq!(f.task_class, TaskClass::Code);
        assert!(f.code >= 0.5, "{f:?}");
    }

    #[test]
    fn word_problem_is_math() {
        let f = features(
            "Seal releases 3 songs every month. He gets $2000 per song. How much money does he get in his first 3 years?",
        );
        assert_eq!(f.task_class, TaskClass::Math);
    }

    #[test]
    fn latex_is_math() {
        let f = features(r"Evaluate \int_0^1 x^2 dx and \frac{1}{2}");
        assert_eq!(f.task_class, TaskClass::Math);
    }

    #[test]
    fn json_request_is_structured() {
        let prompt = Prompt {
            segments: vec![Segment {
                role: Role::User,
                text: "List three colours.",
            }],
            wants_json: true,
        };
        let f = Features::extract(&prompt, &ComplexityWeights::default()).unwrap();
        assert_eq!(f.task_class, TaskClass::Structured);
        assert_eq!(f.json, 1.0);
    }

    #[test]
    fn short_chat_is_simple_general() {
        let f = features("Give three tips for staying healthy.");
        assert_eq!(f.task_class, TaskClass::General);
        assert!(f.complexity < 0.4, "{f:?}");
    }

    #[test]
    fn complexity_grows_with_code_content() {
        let simple = features("Say hello to my friend.");
        let code =
            features("```rust\nfn main() { let x: Vec<u8> = vec![]; println!(\"{x:?}\"); }\n```");
        assert!(
            code.complexity > simple.complexity + 0.2,
            "{simple:?} {code:?}"
        );
    }

    #[test]
    fn system_prompt_counts_and_assistant_is_capped() {
        let w = ComplexityWeights {
            scoring_window_chars: 64,
            ..ComplexityWeights::default()
        };
        let long = "x".repeat(1000);
        let prompt = Prompt {
            segments: vec![
                Segment {
                    role: Role::Assistant,
                    text: &long,
                },
                Segment {
                    role: Role::System,
                    text: "You write Python code.",
                },
                Segment {
                    role: Role::User,
                    text: "hi",
                },
            ],
            wants_json: false,
        };
        let f = Features::extract(&prompt, &w).unwrap();
        assert!(f.code > 0.0, "system prompt must be scored: {f:?}");
        assert_eq!(f.prompt_bytes, 1000 + 22 + 2);
        assert_eq!(f.estimated_input_tokens(4.0), 256 + 12);
    }

    #[test]
    fn window_bounds_the_scored_text_at_a_char_boundary() {
        let w = ComplexityWeights {
            scoring_window_chars: 5,
            ..ComplexityWeights::default()
        };
        let prompt = Prompt {
            segments: vec![Segment {
                role: Role::User,
                text: "ééééé",
            }],
            wants_json: false,
        };
        assert!(Features::extract(&prompt, &w).is_ok());
    }
}
