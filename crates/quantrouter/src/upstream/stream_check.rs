//! The stream-start check (`policy.stream_check`): hold the first events of a streamed
//! answer from a tier that has a better one above it, judge their text, and either let the
//! held frames go out followed by the rest of the stream, or give the stream up before the
//! client saw a byte, so the request can go to the next tier.
//!
//! The hold is bounded twice: by the number of content events (about one token each) and by
//! `max_hold_ms`, after which the stream is committed as it is. A tool or function call, or
//! a stream that ends, is judged at once.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body::Body;
use http_body_util::BodyExt;
use quantrouter_policy::{check_answer, check_stream_start, AnswerProblem, StreamCheck};
use tokio::time::Instant;

use super::sse::EventEnds;
use crate::openai::chunk_output;

/// What holding the start of a stream decided.
pub enum Held<B> {
    /// Send `frames` first, then the rest of `body`.
    Pass {
        frames: Vec<Bytes>,
        body: B,
        /// Why it passed without a full check: the hold ran out, or nothing to judge.
        unchecked: bool,
    },
    /// Nothing was sent; the answer starts badly.
    Fail(AnswerProblem),
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
    let until = Instant::now() + Duration::from_millis(check.max_hold_ms);
    let mut frames = Vec::new();
    let mut pending = BytesMut::new();
    let mut ends = EventEnds::default();
    let mut text = String::new();
    let mut tokens = 0u32;
    loop {
        let frame = match tokio::time::timeout_at(until, body.frame()).await {
            // Too slow to judge within the hold: commit the stream as it is.
            Err(_) => {
                return Ok(Held::Pass {
                    frames,
                    body,
                    unchecked: true,
                })
            }
            Ok(None) => {
                // The whole answer arrived within the hold: judge it as a whole answer.
                return Ok(verdict(
                    check_answer(&text, wants_json, max_repetition_ratio),
                    frames,
                    body,
                ));
            }
            Ok(Some(frame)) => frame?,
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        // Bytes of `pending` before this frame were scanned already.
        let mut scanned = pending.len();
        pending.extend_from_slice(&data);
        frames.push(data);
        while let Some(end) = ends.next_end(&pending, scanned) {
            let event = pending.split_to(end).freeze();
            scanned = 0;
            let Some(payload) = data_of(&event) else {
                continue;
            };
            if payload.trim_ascii() == b"[DONE]" {
                return Ok(verdict(
                    check_answer(&text, wants_json, max_repetition_ratio),
                    frames,
                    body,
                ));
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
            if !output.text.is_empty() || output.other {
                tokens += 1;
                text.push_str(&output.text);
            }
            if tokens >= check.tokens {
                return Ok(verdict(
                    check_stream_start(&text, wants_json, max_repetition_ratio),
                    frames,
                    body,
                ));
            }
        }
        if pending.len() > MAX_EVENT {
            // An event that never ends is not judged, nor held without bound.
            return Ok(Held::Pass {
                frames,
                body,
                unchecked: true,
            });
        }
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

/// The data of an SSE event (its `data:` lines joined), if it has any.
fn data_of(event: &[u8]) -> Option<Vec<u8>> {
    let mut data: Option<Vec<u8>> = None;
    for line in event.split(|&b| b == b'\n' || b == b'\r') {
        let Some(rest) = line.strip_prefix(b"data:") else {
            continue;
        };
        let rest = rest.strip_prefix(b" ").unwrap_or(rest);
        match &mut data {
            Some(joined) => {
                joined.push(b'\n');
                joined.extend_from_slice(rest);
            }
            None => data = Some(rest.to_vec()),
        }
    }
    data
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
            "the hold ran out after 800 ms"
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
