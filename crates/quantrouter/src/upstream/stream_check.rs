//! The stream-start check (`policy.stream_check`): hold the first events of a streamed
//! answer from a tier that has a better one above it, judge their text, and either let the
//! held frames go out followed by the rest of the stream, or give the stream up before the
//! client saw a byte, so the request can go to the next tier.
//!
//! Each choice of an `n > 1` stream is judged on its own text. The hold ends once every
//! choice has `tokens` content events (about one token each), or has finished, and the
//! check runs at once. It is paced, so that what it costs follows what it checks: after
//! the first content event each next one is due within `max_hold_ms / tokens`, and all by
//! `max_hold_ms`; a stream that falls behind is committed unchecked as soon as it does,
//! rather than held for the whole window while it is too slow to be judged in it. A tool
//! or function call, or a stream that ends, is judged at once.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use http_body::Body;
use http_body_util::BodyExt;
use quantrouter_policy::{check_stream_choices, AnswerProblem, StartChoice, StreamCheck};
use tokio::time::Instant;

use super::sse::{data_of, EventBuffer};
use crate::openai::{chunk_output, ChunkOutput};

/// What holding the start of a stream decided.
pub enum Held<B> {
    /// Send `frames` first, then the rest of `body`.
    Pass {
        frames: Vec<Bytes>,
        body: B,
        /// Why it passed without a full check: the stream fell behind the hold's pace, or
        /// nothing to judge.
        unchecked: bool,
    },
    /// Nothing was sent; the answer starts badly.
    Fail(AnswerProblem),
}

/// The text held so far, choice by choice, and the hold's clock.
struct Start {
    tokens: u32,
    /// The hold's end, whatever the pace.
    until: Instant,
    /// The time each content event after the first may take, on average.
    pace: Duration,
    first_content: Option<Instant>,
    choices: BTreeMap<u32, HeldChoice>,
}

#[derive(Default)]
struct HeldChoice {
    text: String,
    tokens: u32,
    finished: bool,
}

/// Holds the start of `body` (an SSE stream) and judges it; an error of the body is
/// returned as it is, with nothing sent.
pub async fn hold_start<B>(
    mut body: B,
    check: &StreamCheck,
    wants_json: bool,
    max_repetition_ratio: f64,
) -> Result<Held<B>, B::Error>
where
    B: Body<Data = Bytes> + Unpin,
{
    let mut start = Start::new(check, Instant::now());
    let judge = |start: &Start, whole: bool| {
        check_stream_choices(&start.choices(whole), wants_json, max_repetition_ratio)
    };
    let mut frames = Vec::new();
    let mut events = EventBuffer::default();
    loop {
        let frame = match tokio::time::timeout_at(start.next_due(), body.frame()).await {
            // Behind the hold's pace: commit the stream as it is.
            Err(_) => {
                return Ok(Held::Pass {
                    frames,
                    body,
                    unchecked: true,
                })
            }
            // The whole answer arrived within the hold: judge it as a whole answer.
            Ok(None) => return Ok(verdict(judge(&start, true), frames, body)),
            Ok(Some(frame)) => frame?,
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        events.push(&data);
        frames.push(data);
        while let Some(event) = events.next_event() {
            let Some(payload) = data_of(&event) else {
                continue;
            };
            if payload.trim_ascii() == b"[DONE]" {
                return Ok(verdict(judge(&start, true), frames, body));
            }
            let output = chunk_output(&payload);
            if output.call {
                // A call is an answer no text check applies to.
                return Ok(Held::Pass {
                    frames,
                    body,
                    unchecked: true,
                });
            }
            if start.add(output, Instant::now()) {
                return Ok(verdict(judge(&start, false), frames, body));
            }
        }
        if events.pending() > MAX_EVENT {
            // An event that never ends is not judged, nor held without bound.
            return Ok(Held::Pass {
                frames,
                body,
                unchecked: true,
            });
        }
    }
}

// === impl Start ===

impl Start {
    fn new(check: &StreamCheck, now: Instant) -> Self {
        let hold = Duration::from_millis(check.max_hold_ms);
        Self {
            tokens: check.tokens.max(1),
            until: now + hold,
            pace: hold / check.tokens.max(1),
            first_content: None,
            choices: BTreeMap::new(),
        }
    }

    /// Counts an event's output; says whether every choice now has enough to be judged.
    fn add(&mut self, output: ChunkOutput, now: Instant) -> bool {
        for choice in output.choices {
            let held = self.choices.entry(choice.index).or_default();
            if choice.generated() {
                held.tokens += 1;
                held.text.push_str(&choice.text);
                self.first_content.get_or_insert(now);
            }
            held.finished |= choice.finished;
        }
        let ready = |c: &HeldChoice| c.finished || c.tokens >= self.tokens;
        self.first_content.is_some() && self.choices.values().all(ready)
    }

    /// When the next content event is due: the leading choice's next token within its
    /// share of the hold after the first, and everything by the hold's end.
    fn next_due(&self) -> Instant {
        let Some(first) = self.first_content else {
            return self.until;
        };
        let lead = self.choices.values().map(|c| c.tokens).max().unwrap_or(0);
        (first + self.pace * lead).min(self.until)
    }

    /// The choices to judge; with `whole`, the stream ended and every one is finished.
    fn choices(&self, whole: bool) -> Vec<StartChoice<'_>> {
        self.choices
            .values()
            .map(|c| StartChoice {
                text: &c.text,
                finished: whole || c.finished,
            })
            .collect()
    }
}

/// Completion chunks are a few hundred bytes; an unfinished event longer than this is not one.
const MAX_EVENT: usize = 64 * 1024;

impl<B> std::fmt::Debug for Held<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Held::Pass {
                frames, unchecked, ..
            } => f
                .debug_struct("Pass")
                .field("frames", &frames.len())
                .field("unchecked", unchecked)
                .finish_non_exhaustive(),
            Held::Fail(problem) => f.debug_tuple("Fail").field(problem).finish(),
        }
    }
}

fn verdict<B>(problem: Option<AnswerProblem>, frames: Vec<Bytes>, body: B) -> Held<B> {
    match problem {
        Some(problem) => Held::Fail(problem),
        None => Held::Pass {
            frames,
            body,
            unchecked: false,
        },
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use http_body_util::StreamBody;

    use super::*;

    type Frames = StreamBody<
        futures_util::stream::BoxStream<'static, Result<http_body::Frame<Bytes>, Infallible>>,
    >;

    fn delta(text: &str) -> String {
        format!(
            "data: {}\n\n",
            serde_json::json!({"choices": [{"index": 0, "delta": {"content": text}}]})
        )
    }

    /// A body of `events`, then, with `hang`, one that never ends.
    fn body(events: Vec<String>, hang: bool) -> Frames {
        use futures_util::StreamExt;
        let frames = futures_util::stream::iter(
            events
                .into_iter()
                .map(|e| Ok(http_body::Frame::data(Bytes::from(e)))),
        );
        let stream = if hang {
            frames.chain(futures_util::stream::pending()).boxed()
        } else {
            frames.boxed()
        };
        StreamBody::new(stream)
    }

    fn check() -> StreamCheck {
        StreamCheck {
            tokens: 4,
            max_hold_ms: 800,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_good_start_passes_with_every_held_frame() {
        let events: Vec<String> = ["The", " capital", " of", " France", " is"]
            .iter()
            .map(|t| delta(t))
            .collect();
        let held = hold_start(body(events.clone(), true), &check(), false, 0.5)
            .await
            .unwrap();
        let Held::Pass {
            frames, unchecked, ..
        } = held
        else {
            panic!("{held:?}");
        };
        assert!(!unchecked);
        assert_eq!(frames.len(), 4, "held until the fourth token");
        assert_eq!(frames[0], Bytes::from(events[0].clone()));
    }

    #[tokio::test(start_paused = true)]
    async fn a_loop_or_prose_instead_of_json_fails_before_anything_is_sent() {
        let looped: Vec<String> = (0..8).map(|_| delta("again and ")).collect();
        let eight = StreamCheck {
            tokens: 8,
            ..check()
        };
        let held = hold_start(body(looped, true), &eight, false, 0.5)
            .await
            .unwrap();
        assert!(
            matches!(held, Held::Fail(AnswerProblem::Degenerate)),
            "{held:?}"
        );
        let prose: Vec<String> = ["Sure", "!", " Here", " it is"]
            .iter()
            .map(|t| delta(t))
            .collect();
        let held = hold_start(body(prose, true), &check(), true, 0.5)
            .await
            .unwrap();
        assert!(
            matches!(held, Held::Fail(AnswerProblem::InvalidJson)),
            "{held:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_answer_that_ends_within_the_hold_is_judged_whole() {
        let empty = vec![delta(""), "data: [DONE]\n\n".to_owned()];
        let held = hold_start(body(empty, false), &check(), false, 0.5)
            .await
            .unwrap();
        assert!(matches!(held, Held::Fail(AnswerProblem::Empty)), "{held:?}");
        let short = vec![delta("{\"a\": 1}"), "data: [DONE]\n\n".to_owned()];
        let held = hold_start(body(short, false), &check(), true, 0.5)
            .await
            .unwrap();
        assert!(
            matches!(
                held,
                Held::Pass {
                    unchecked: false,
                    ..
                }
            ),
            "{held:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn tool_calls_pass_and_a_slow_start_is_committed_unchecked() {
        let call = format!(
            "data: {}\n\n",
            serde_json::json!({"choices": [{"delta": {"content": null, "tool_calls": [{"index": 0,
                "function": {"name": "get_weather", "arguments": ""}}]}}]})
        );
        let held = hold_start(body(vec![call], true), &check(), true, 0.5)
            .await
            .unwrap();
        assert!(
            matches!(
                held,
                Held::Pass {
                    unchecked: true,
                    ..
                }
            ),
            "{held:?}"
        );
        let slow = vec![delta("Hel")];
        let held = hold_start(body(slow, true), &check(), false, 0.5)
            .await
            .unwrap();
        let Held::Pass {
            frames, unchecked, ..
        } = held
        else {
            panic!("{held:?}");
        };
        assert!(
            unchecked && frames.len() == 1,
            "the second token was due 200 ms after the first"
        );
    }

    /// A body of `events`, each sent `every` after the one before, then one that never ends.
    fn paced(events: Vec<String>, every: Duration) -> Frames {
        use futures_util::StreamExt;
        let frames = futures_util::stream::iter(events).then(move |e| async move {
            tokio::time::sleep(every).await;
            Ok(http_body::Frame::data(Bytes::from(e)))
        });
        StreamBody::new(frames.chain(futures_util::stream::pending()).boxed())
    }

    #[tokio::test(start_paused = true)]
    async fn the_hold_costs_what_it_checks_and_a_slow_stream_is_let_go_when_it_falls_behind() {
        let words: Vec<String> = (0..8).map(|i| delta(&format!(" word{i}"))).collect();
        // 4 tokens within 800 ms: each next one is due 200 ms after the one before.
        let started = Instant::now();
        let held = hold_start(
            paced(words.clone(), Duration::from_millis(150)),
            &check(),
            false,
            0.5,
        )
        .await
        .unwrap();
        assert!(
            matches!(
                held,
                Held::Pass {
                    unchecked: false,
                    ..
                }
            ),
            "{held:?}"
        );
        assert_eq!(
            started.elapsed(),
            Duration::from_millis(600),
            "held for the four tokens only"
        );
        // At 300 ms a token, the second is late: committed when it was due, not at 800 ms.
        let started = Instant::now();
        let held = hold_start(
            paced(words, Duration::from_millis(300)),
            &check(),
            false,
            0.5,
        )
        .await
        .unwrap();
        let Held::Pass {
            frames, unchecked, ..
        } = held
        else {
            panic!("{held:?}");
        };
        assert!(unchecked && frames.len() == 1);
        assert_eq!(started.elapsed(), Duration::from_millis(300 + 200));
    }

    #[tokio::test(start_paused = true)]
    async fn each_choice_of_an_interleaved_stream_is_judged_on_its_own() {
        let choice = |i: u32, text: &str| {
            format!(
                "data: {}\n\n",
                serde_json::json!({"choices": [{"index": i, "delta": {"content": text}}]})
            )
        };
        // Eight choices of one good answer, a token each in turn: joined, a loop.
        let interleaved: Vec<String> = ["The", " capital", " of", " France", " is"]
            .iter()
            .flat_map(|token| (0..8).map(move |i| choice(i, token)))
            .collect();
        let held = hold_start(body(interleaved.clone(), true), &check(), false, 0.5)
            .await
            .unwrap();
        let Held::Pass {
            frames, unchecked, ..
        } = held
        else {
            panic!("{held:?}");
        };
        assert!(!unchecked);
        assert_eq!(
            frames.len(),
            4 * 8,
            "held until every choice had four tokens"
        );
        // One choice looping is a bad answer, however good the others are.
        let words = [
            "The", " capital", " of", " France", " is", " a", " fine", " city",
        ];
        let looped: Vec<String> = words
            .iter()
            .flat_map(|token| {
                (0..8).map(move |i| choice(i, if i == 3 { " again and" } else { token }))
            })
            .collect();
        let eight = StreamCheck {
            tokens: 8,
            ..check()
        };
        let held = hold_start(body(looped, true), &eight, false, 0.5)
            .await
            .unwrap();
        assert!(
            matches!(held, Held::Fail(AnswerProblem::Degenerate)),
            "{held:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn events_split_across_frames_and_crlf_are_counted_once() {
        let whole: String = ["one", " two", " three", " four"]
            .iter()
            .map(|t| delta(t).replace("\n\n", "\r\n\r\n"))
            .collect();
        let (a, b) = whole.split_at(37);
        let held = hold_start(body(vec![a.into(), b.into()], true), &check(), false, 0.5)
            .await
            .unwrap();
        assert!(
            matches!(
                held,
                Held::Pass {
                    unchecked: false,
                    ..
                }
            ),
            "{held:?}"
        );
    }
}
