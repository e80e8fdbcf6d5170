//! Checks on a finished answer for quality fallback (seed 000): an empty, degenerate or
//! (when JSON was asked for) unparseable answer from a cheaper profile is re-run on a better
//! one.

use std::borrow::Cow;
use std::collections::HashSet;

/// What is wrong with an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnswerProblem {
    Empty,
    /// Repetition ratio over the policy's limit.
    Degenerate,
    /// JSON output was requested and the answer does not parse.
    InvalidJson,
}

impl AnswerProblem {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Empty => "empty",
            Self::Degenerate => "degenerate",
            Self::InvalidJson => "invalid_json",
        }
    }
}

/// Share of repeated word trigrams: 0 for text that never repeats a three-word run, near 1
/// for one phrase looped. Ordinary prose stays well under 0.2; texts under five words are 0.
pub fn repetition_ratio(text: &str) -> f64 {
    let words: Vec<&str> = text.split_whitespace().collect();
    if words.len() < 5 {
        return 0.0;
    }
    let trigrams = words.windows(3);
    let total = trigrams.len();
    let distinct: HashSet<&[&str]> = trigrams.collect();
    1.0 - distinct.len() as f64 / total as f64
}

/// The first problem found with `answer`, if any.
pub fn check_answer(
    answer: &str,
    wants_json: bool,
    max_repetition_ratio: f64,
) -> Option<AnswerProblem> {
    if answer.trim().is_empty() {
        return Some(AnswerProblem::Empty);
    }
    if repetition_ratio(answer) > max_repetition_ratio {
        return Some(AnswerProblem::Degenerate);
    }
    if wants_json && serde_json::from_str::<serde::de::IgnoredAny>(strip_fence(answer)).is_err() {
        return Some(AnswerProblem::InvalidJson);
    }
    None
}

/// The first problem with the start of a streamed answer (`policy.stream_check`): the text
/// of its first content events, not a whole answer. Empty and degenerate as for a whole
/// answer; and when JSON was asked for, the start must open a JSON object or array (after
/// white space and an optional Markdown fence), as a prefix cannot be parsed whole.
pub fn check_stream_start(
    start: &str,
    wants_json: bool,
    max_repetition_ratio: f64,
) -> Option<AnswerProblem> {
    if start.trim().is_empty() {
        return Some(AnswerProblem::Empty);
    }
    if repetition_ratio(start) > max_repetition_ratio {
        return Some(AnswerProblem::Degenerate);
    }
    if wants_json && !opens_json(start) {
        return Some(AnswerProblem::InvalidJson);
    }
    None
}

/// Whether `start` begins a JSON object or array, allowing a fence that may still be open.
fn opens_json(start: &str) -> bool {
    let mut rest = start.trim_start();
    if let Some(fenced) = rest.strip_prefix("```") {
        // The fence's language tag and newline may not have arrived yet.
        let Some(newline) = fenced.find('\n') else {
            return fenced.chars().all(|c| c.is_ascii_alphanumeric());
        };
        rest = fenced[newline + 1..].trim_start();
        if rest.is_empty() {
            return true;
        }
    }
    rest.starts_with(['{', '['])
}

/// One choice of an answer, as the checks see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AnswerChoice<'a> {
    /// Generated text (empty when the choice had none).
    Text(Cow<'a, str>),
    /// A tool or function call, or a refusal: a complete answer with no text to judge.
    NotText,
}

/// The first problem with any choice of an answer, each judged on its own (an `n > 1`
/// answer is several answers, not one text); an answer without choices is empty.
pub fn check_choices(
    choices: &[AnswerChoice<'_>],
    wants_json: bool,
    max_repetition_ratio: f64,
) -> Option<AnswerProblem> {
    if choices.is_empty() {
        return Some(AnswerProblem::Empty);
    }
    choices.iter().find_map(|choice| match choice {
        AnswerChoice::Text(text) => check_answer(text, wants_json, max_repetition_ratio),
        AnswerChoice::NotText => None,
    })
}

/// One choice of a held stream start, as the stream-start check sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StartChoice<'a> {
    /// The choice's text so far.
    pub text: &'a str,
    /// The choice ended within the hold: its text is whole.
    pub finished: bool,
}

/// The first problem with any choice of a held stream start, each judged on its own (the
/// choices of an `n > 1` stream arrive interleaved, and joined they would read as a loop):
/// a finished choice as a whole answer, the others as a start. No choice at all is empty.
pub fn check_stream_choices(
    choices: &[StartChoice<'_>],
    wants_json: bool,
    max_repetition_ratio: f64,
) -> Option<AnswerProblem> {
    if choices.is_empty() {
        return Some(AnswerProblem::Empty);
    }
    choices.iter().find_map(|choice| match choice.finished {
        true => check_answer(choice.text, wants_json, max_repetition_ratio),
        false => check_stream_start(choice.text, wants_json, max_repetition_ratio),
    })
}

/// Models often wrap JSON in a Markdown fence; the JSON inside still counts.
fn strip_fence(answer: &str) -> &str {
    let trimmed = answer.trim();
    trimmed
        .strip_prefix("```json")
        .or_else(|| trimmed.strip_prefix("```"))
        .and_then(|rest| rest.strip_suffix("```"))
        .map_or(trimmed, str::trim)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prose_passes_and_loops_fail() {
        let prose = "The capital of France is Paris. It sits on the Seine and has been the \
                     country's political centre for most of its history.";
        assert!(repetition_ratio(prose) < 0.1);
        assert_eq!(check_answer(prose, false, 0.5), None);
        let looped = "the the the the the the the the the the the the";
        assert!(repetition_ratio(looped) > 0.8);
        assert_eq!(
            check_answer(looped, false, 0.5),
            Some(AnswerProblem::Degenerate)
        );
        assert_eq!(check_answer("  \n", false, 0.5), Some(AnswerProblem::Empty));
    }

    #[test]
    fn json_is_checked_only_when_asked_for() {
        assert_eq!(check_answer("{\"a\": 1}", true, 0.5), None);
        assert_eq!(
            check_answer("```json\n{\"a\": [1, 2]}\n```", true, 0.5),
            None
        );
        assert_eq!(
            check_answer("{\"a\": ", true, 0.5),
            Some(AnswerProblem::InvalidJson)
        );
        assert_eq!(check_answer("sure: {\"a\": 1}", false, 0.5), None);
    }

    #[test]
    fn a_stream_start_is_judged_as_a_prefix() {
        let check = |start, json| check_stream_start(start, json, 0.5);
        assert_eq!(check("  \n", false), Some(AnswerProblem::Empty));
        assert_eq!(check("The capital of France is", false), None);
        assert_eq!(
            check(
                "again and again and again and again and again and again",
                false
            ),
            Some(AnswerProblem::Degenerate)
        );
        assert_eq!(check("{\"name\": \"Ann\", \"age\"", true), None);
        assert_eq!(check("```json\n[{\"a\":", true), None);
        assert_eq!(
            check("```js", true),
            None,
            "the fence line is not complete yet"
        );
        assert_eq!(
            check("Sure! Here is the JSON you asked", true),
            Some(AnswerProblem::InvalidJson)
        );
        assert_eq!(
            check("```\nHere it is", true),
            Some(AnswerProblem::InvalidJson)
        );
    }

    #[test]
    fn each_choice_is_judged_on_its_own_and_calls_are_answers() {
        let text = |t: &'static str| AnswerChoice::Text(Cow::Borrowed(t));
        let two_objects = [text("{\"a\":8}"), text("{\"a\":8}")];
        assert_eq!(check_choices(&two_objects, true, 0.5), None);
        let short = "The capital of France is Paris. ";
        assert_eq!(
            check_choices(&[text(short), text(short), text(short)], false, 0.5),
            None
        );
        assert_eq!(
            check_choices(&[text(short), text(" ")], false, 0.5),
            Some(AnswerProblem::Empty)
        );
        assert_eq!(check_choices(&[AnswerChoice::NotText], true, 0.5), None);
        assert_eq!(check_choices(&[], false, 0.5), Some(AnswerProblem::Empty));
    }

    #[test]
    fn each_choice_of_a_stream_start_is_judged_on_its_own() {
        let start = |text, finished| StartChoice { text, finished };
        let same = [start("The capital of France", false); 8];
        assert_eq!(check_stream_choices(&same, false, 0.5), None);
        // A finished choice is a whole answer: an unclosed object fails it.
        let json = [start("{\"a\": 1}", true), start("{\"a\":", true)];
        assert_eq!(
            check_stream_choices(&json, true, 0.5),
            Some(AnswerProblem::InvalidJson)
        );
        assert_eq!(check_stream_choices(&json[..1], true, 0.5), None);
        let looped = start("again and again and again and again and again", false);
        assert_eq!(
            check_stream_choices(&[same[0], looped], false, 0.5),
            Some(AnswerProblem::Degenerate)
        );
        assert_eq!(
            check_stream_choices(&[], false, 0.5),
            Some(AnswerProblem::Empty)
        );
    }
}
