//! Reading an OpenAI-style SSE stream as the profiler needs it: complete events out of
//! arbitrary chunks, and for each event whether it carries content and how many output
//! tokens the server counted. Pure; the client feeds it bytes.

use serde::Deserialize;

use crate::upstream::sse::{data_of, EventBuffer};

/// An event larger than this is not a token delta; stop instead of buffering without bound.
const MAX_EVENT: usize = 1 << 20;

/// Splits a byte stream into the `data` of complete SSE events (with the router's one SSE
/// parser, [`crate::upstream::sse`]).
#[derive(Debug, Default)]
pub struct EventSplitter {
    events: EventBuffer,
}

/// What one `data` payload says.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EventInfo {
    /// Text, reasoning or a tool call: the first such event is the first token.
    pub has_content: bool,
    /// `usage.completion_tokens`, when the event carries usage.
    pub completion_tokens: Option<u64>,
    /// The `[DONE]` sentinel.
    pub done: bool,
    /// An `{"error": ...}` event: the server gave up mid-stream.
    pub error: Option<String>,
}

/// The stream broke the protocol.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SseError {
    #[error("an SSE event exceeds {MAX_EVENT} bytes")]
    TooLarge,
    #[error("an SSE event is not valid UTF-8")]
    NotUtf8,
}

#[derive(Debug, Deserialize)]
struct ChunkWire {
    #[serde(default)]
    choices: Vec<ChoiceWire>,
    usage: Option<UsageWire>,
    error: Option<serde_json::Value>,
}

#[derive(Debug, Deserialize)]
struct ChoiceWire {
    delta: Option<DeltaWire>,
    /// `/v1/completions` streams put the text here.
    text: Option<String>,
}

#[derive(Debug, Deserialize)]
struct DeltaWire {
    content: Option<String>,
    /// vLLM's and DeepSeek's name for streamed reasoning.
    reasoning_content: Option<String>,
    reasoning: Option<String>,
    tool_calls: Option<Vec<serde_json::Value>>,
}

#[derive(Debug, Deserialize)]
struct UsageWire {
    completion_tokens: Option<u64>,
}

// === impl EventSplitter ===

impl EventSplitter {
    /// Adds bytes and returns the `data` of every event they complete. Lines may end in
    /// `\n` or `\r\n`; `data:` lines of one event are joined with `\n`; comments and other
    /// fields are skipped.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<Vec<String>, SseError> {
        self.events.push(bytes);
        let mut events = Vec::new();
        while let Some(event) = self.events.next_event() {
            if let Some(data) = data_of(&event) {
                let text = std::str::from_utf8(&data).map_err(|_| SseError::NotUtf8)?;
                events.push(text.to_owned());
            }
        }
        if self.events.pending() > MAX_EVENT {
            return Err(SseError::TooLarge);
        }
        Ok(events)
    }

    /// The `data` of a last event the stream ended without a blank line after.
    pub fn finish(&mut self) -> Option<String> {
        let rest = self.events.take_rest();
        let data = data_of(&rest)?;
        std::str::from_utf8(&data).ok().map(str::to_owned)
    }
}

// === impl EventInfo ===

impl EventInfo {
    /// Reads one `data` payload. A payload that is not JSON carries nothing the profiler
    /// counts (servers differ in what else they send), so it is not an error.
    pub fn of(data: &str) -> Self {
        if data.trim() == "[DONE]" {
            return Self {
                done: true,
                ..Self::default()
            };
        }
        let Ok(chunk) = serde_json::from_str::<ChunkWire>(data) else {
            return Self::default();
        };
        let non_empty = |s: &Option<String>| s.as_deref().is_some_and(|s| !s.is_empty());
        let has_content = chunk.choices.iter().any(|choice| {
            non_empty(&choice.text)
                || choice.delta.as_ref().is_some_and(|d| {
                    non_empty(&d.content)
                        || non_empty(&d.reasoning_content)
                        || non_empty(&d.reasoning)
                        || d.tool_calls.as_ref().is_some_and(|t| !t.is_empty())
                })
        });
        Self {
            has_content,
            completion_tokens: chunk.usage.and_then(|u| u.completion_tokens),
            done: false,
            error: chunk
                .error
                .map(|e| match e.get("message").and_then(|m| m.as_str()) {
                    Some(message) => message.to_owned(),
                    None => e.to_string(),
                }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_split_across_chunks_and_line_endings() {
        let mut s = EventSplitter::default();
        assert_eq!(s.feed(b"data: {\"a\"").unwrap(), Vec::<String>::new());
        assert_eq!(
            s.feed(b":1}\n\ndata: x\r\n\r\n: keep-alive\n\n").unwrap(),
            ["{\"a\":1}", "x"]
        );
        assert_eq!(
            s.feed(b"event: e\ndata: one\ndata:two\n\n").unwrap(),
            ["one\ntwo"]
        );
        assert_eq!(s.feed(b"data: [DONE]").unwrap(), Vec::<String>::new());
        assert_eq!(s.finish().as_deref(), Some("[DONE]"));
    }

    #[test]
    fn an_endless_event_is_an_error() {
        let mut s = EventSplitter::default();
        let big = vec![b'x'; MAX_EVENT + 1];
        assert_eq!(s.feed(&big), Err(SseError::TooLarge));
    }

    #[test]
    fn the_role_only_first_chunk_is_not_content() {
        let role = r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#;
        assert!(!EventInfo::of(role).has_content);
        let token = r#"{"choices":[{"index":0,"delta":{"content":" hi"}}]}"#;
        assert!(EventInfo::of(token).has_content);
        let reasoning = r#"{"choices":[{"delta":{"reasoning_content":"Let me"}}]}"#;
        assert!(EventInfo::of(reasoning).has_content);
        let tool = r#"{"choices":[{"delta":{"tool_calls":[{"index":0}]}}]}"#;
        assert!(EventInfo::of(tool).has_content);
        let text = r#"{"choices":[{"text":"4","index":0}]}"#;
        assert!(EventInfo::of(text).has_content);
        let finish = r#"{"choices":[{"delta":{},"finish_reason":"stop"}]}"#;
        assert!(!EventInfo::of(finish).has_content);
    }

    #[test]
    fn usage_done_and_errors_are_read() {
        let usage = r#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":17}}"#;
        assert_eq!(EventInfo::of(usage).completion_tokens, Some(17));
        assert!(EventInfo::of("[DONE]").done);
        let error = r#"{"error":{"message":"overloaded","code":503}}"#;
        assert_eq!(EventInfo::of(error).error.as_deref(), Some("overloaded"));
        assert_eq!(EventInfo::of("not json"), EventInfo::default());
    }
}
