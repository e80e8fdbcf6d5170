//! Stream resumption's pure half: what a stream delivered to its client ([`Delivered`]), the
//! request that asks another upstream to go on from there ([`request`]), and that upstream's
//! events made to fit the stream the client already reads: the same `id`, `model` and choice,
//! no second role, one `usage` for both parts. No I/O; [`super::body::Resuming`] drives it.
//!
//! The rules (docs/resilience.md, "Resuming a broken stream"): only answer text is continued.
//! A choice that streamed a tool call, reasoning or a refusal, a stream of several choices,
//! an answer bound to a format (JSON, a grammar), and a completion whose prompt is not one
//! string are not resumed: no server continues those faithfully.

use bytes::Bytes;
use serde::Deserialize;
use serde_json::Value;

use super::sse::{data_event, data_of};
use crate::openai::{chunk_output, ChunkOutput, Endpoint};

/// The most answer text a stream keeps for its continuation: a few tens of thousands of
/// tokens. A longer answer is not resumed, so a stream never holds more than this.
pub const MAX_DELIVERED: usize = 256 * 1024;

/// What a stream delivered so far, and whether it can be continued.
#[derive(Debug, Default)]
pub struct Delivered {
    /// The answer's text (chat `delta.content`, completions `text`), up to [`MAX_DELIVERED`].
    text: String,
    /// Chunks that carried text: tokens delivered, one per chunk in the streams of vLLM,
    /// SGLang and llama.cpp.
    tokens: u64,
    /// The answer's finish reason, or the stream's `[DONE]`, came: it is whole.
    finished: bool,
    /// Why the stream cannot be continued, once something delivered says so.
    refused: Option<Unresumable>,
    /// `id`, `model` and `created` of the stream's first chunk, which a continuation's
    /// chunks take over.
    identity: Option<Identity>,
    /// While a continuation is relayed: the tokens delivered before it, which its `usage`
    /// (that counts them as prompt) moves back to the completion.
    continuing: Option<u64>,
}

/// Why a stream cannot be continued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unresumable {
    /// A tool or function call was streamed: no server continues a half-sent call.
    ToolCall,
    /// Reasoning or a refusal was streamed, which an assistant message cannot carry.
    NotText,
    /// More than one choice: each would need a continuation of its own.
    Choices,
    /// More text than [`MAX_DELIVERED`].
    TooLong,
    /// The answer is bound to a format (JSON, a grammar, a choice), which a server applies
    /// to the continuation alone.
    Constrained,
    /// A completion prompt that is not one string, an echoed or suffixed completion, or a
    /// chat that already ends with an assistant message it does not continue.
    Prompt,
    /// `max_tokens` was reached: nothing is left to generate.
    Spent,
}

/// What to do with one event of the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seen {
    /// Pass it on as it came.
    Pass,
    /// Pass this instead: a continuation's event made to fit the stream.
    Replace(Bytes),
    /// Leave it out: a continuation's role chunk, which the client already had.
    Drop,
    /// The upstream failed: it sent an error event (vLLM's `data: {"error": …}`).
    ErrorEvent,
}

#[derive(Debug, Clone)]
struct Identity {
    id: Value,
    model: Value,
    created: Value,
}

// === impl Delivered ===

impl Delivered {
    /// One whole SSE event of the stream, as it arrives: what to do with it.
    pub fn observe(&mut self, event: &[u8]) -> Seen {
        let Some(data) = data_of(event) else {
            return Seen::Pass;
        };
        let data = data.trim_ascii();
        if data == b"[DONE]" {
            // The server says the answer is whole, finish reason or not.
            self.finished = true;
            return Seen::Pass;
        }
        match self.continuing {
            None => self.original(data),
            Some(before) => self.continued(data, before),
        }
    }

    /// A continuation takes over from here: its events are made to fit the stream.
    pub fn continue_now(&mut self) {
        self.continuing = Some(self.tokens);
    }

    /// The answer text delivered.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Tokens delivered.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// The answer's finish reason, or `[DONE]`, was delivered.
    pub fn finished(&self) -> bool {
        self.finished
    }

    /// Why the stream cannot be continued, if it cannot.
    pub fn refused(&self) -> Option<Unresumable> {
        self.refused
    }

    /// An event of the stream's first part: passed as it came, looked at.
    fn original(&mut self, data: &[u8]) -> Seen {
        let output = chunk_output(data);
        if output.choices.is_empty() {
            return match is_error(data) {
                true => Seen::ErrorEvent,
                false => Seen::Pass,
            };
        }
        if self.identity.is_none() {
            self.identity = Identity::of(data);
        }
        self.note(&output);
        Seen::Pass
    }

    /// An event of a continuation: given the stream's identity and choice, its role
    /// dropped, its usage made the whole answer's.
    fn continued(&mut self, data: &[u8], before: u64) -> Seen {
        let Ok(mut chunk) = serde_json::from_slice::<Value>(data) else {
            return Seen::Pass;
        };
        if is_error_value(&chunk) {
            return Seen::ErrorEvent;
        }
        if let Some(identity) = &self.identity {
            identity.stamp(&mut chunk);
        }
        for choice in chunk["choices"].as_array_mut().into_iter().flatten() {
            choice["index"] = Value::from(0);
            if let Some(delta) = choice.get_mut("delta").and_then(Value::as_object_mut) {
                delta.remove("role");
            }
        }
        let usage = chunk.get_mut("usage").filter(|u| u.is_object());
        let has_usage = usage.is_some();
        if let Some(usage) = usage {
            whole_usage(usage, before);
        }
        let data = chunk.to_string();
        let output = chunk_output(data.as_bytes());
        self.note(&output);
        let carries = output.choices.iter().any(|c| c.generated() || c.finished);
        match carries || has_usage || output.choices.is_empty() {
            true => Seen::Replace(data_event(data.as_bytes())),
            false => Seen::Drop,
        }
    }

    /// What a chunk delivered: text, tokens, the finish, and what rules a continuation out.
    fn note(&mut self, output: &ChunkOutput) {
        if output.call {
            self.refuse(Unresumable::ToolCall);
        }
        for choice in &output.choices {
            if choice.index != 0 {
                self.refuse(Unresumable::Choices);
            }
            if choice.other && !output.call {
                self.refuse(Unresumable::NotText);
            }
            if !choice.text.is_empty() {
                self.tokens += 1;
                if self.text.len() + choice.text.len() > MAX_DELIVERED {
                    self.refuse(Unresumable::TooLong);
                }
                if self.refused.is_none() {
                    self.text.push_str(&choice.text);
                }
            }
            self.finished |= choice.finished;
        }
    }

    fn refuse(&mut self, why: Unresumable) {
        if self.refused.is_none() {
            self.refused = Some(why);
            // Nothing will be continued: the text is no longer needed.
            self.text = String::new();
        }
    }
}

// === impl Unresumable ===

impl Unresumable {
    /// For logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ToolCall => "a tool call was streamed",
            Self::NotText => "reasoning or a refusal was streamed",
            Self::Choices => "the stream has several choices",
            Self::TooLong => "the answer is too long to keep",
            Self::Constrained => "the answer is bound to a format",
            Self::Prompt => "the prompt cannot be continued",
            Self::Spent => "max_tokens is reached",
        }
    }
}

// === impl Identity ===

impl Identity {
    fn of(data: &[u8]) -> Option<Self> {
        #[derive(Deserialize)]
        struct Head {
            #[serde(default)]
            id: Value,
            #[serde(default)]
            model: Value,
            #[serde(default)]
            created: Value,
        }
        let head: Head = serde_json::from_slice(data).ok()?;
        Some(Self {
            id: head.id,
            model: head.model,
            created: head.created,
        })
    }

    /// Gives `chunk` the stream's identity, where both have the field.
    fn stamp(&self, chunk: &mut Value) {
        for (key, value) in [
            ("id", &self.id),
            ("model", &self.model),
            ("created", &self.created),
        ] {
            if let (Some(field), false) = (chunk.get_mut(key), value.is_null()) {
                *field = value.clone();
            }
        }
    }
}

/// A continuation's `usage` counts the tokens delivered `before` it as prompt: they move
/// back to the completion, so the stream reports its prompt once and every token generated.
fn whole_usage(usage: &mut Value, before: u64) {
    let count = |key: &str| usage.get(key).and_then(Value::as_u64).unwrap_or(0);
    let prompt = count("prompt_tokens").saturating_sub(before);
    let completion = count("completion_tokens") + before;
    usage["prompt_tokens"] = Value::from(prompt);
    usage["completion_tokens"] = Value::from(completion);
    usage["total_tokens"] = Value::from(prompt + completion);
}

/// An error event: vLLM's and SGLang's `{"error": …}`, or an `"object": "error"` body.
fn is_error(data: &[u8]) -> bool {
    #[derive(Deserialize)]
    struct Maybe<'a> {
        #[serde(default)]
        error: Option<serde::de::IgnoredAny>,
        #[serde(borrow, default)]
        object: Option<&'a str>,
    }
    serde_json::from_slice::<Maybe<'_>>(data)
        .is_ok_and(|m| m.error.is_some() || m.object == Some("error"))
}

fn is_error_value(chunk: &Value) -> bool {
    chunk.get("error").is_some() || chunk["object"] == "error"
}

/// The request that continues a stream: `body` (the JSON an attempt on the profile sends to
/// `endpoint`) with the `delivered` text, `tokens` of it, as the start of the answer. Chat:
/// the messages plus an assistant message holding it, continued (`"continue_final_message":
/// true, "add_generation_prompt": false`); completions: the prompt with it appended.
/// `max_tokens` shrinks by what was delivered. Nothing delivered yet: `body` as it is, for
/// a fresh answer.
pub fn request(
    mut body: Value,
    endpoint: Endpoint,
    delivered: &str,
    tokens: u64,
) -> Result<Bytes, Unresumable> {
    if constrained(&body) {
        return Err(Unresumable::Constrained);
    }
    if !delivered.is_empty() {
        match endpoint {
            Endpoint::Chat => continue_message(&mut body, delivered)?,
            Endpoint::Completions => continue_prompt(&mut body, delivered)?,
            Endpoint::Messages | Endpoint::Responses => return Err(Unresumable::Prompt),
        }
    }
    for key in ["max_tokens", "max_completion_tokens"] {
        if let Some(limit) = body.get(key).and_then(Value::as_u64) {
            let left = limit.saturating_sub(tokens);
            if left == 0 {
                return Err(Unresumable::Spent);
            }
            body[key] = Value::from(left);
        }
    }
    Ok(Bytes::from(body.to_string()))
}

/// A format the server holds the answer to: it would hold the continuation alone to it.
fn constrained(body: &Value) -> bool {
    const GUIDES: [&str; 7] = [
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "structured_outputs",
        "grammar",
        "json_schema",
    ];
    let format = body["response_format"]["type"].as_str();
    GUIDES.iter().any(|key| !body[key].is_null()) || format.is_some_and(|f| f != "text")
}

/// Chat: the assistant message holding `delivered`, to be continued.
fn continue_message(body: &mut Value, delivered: &str) -> Result<(), Unresumable> {
    let continues = body["continue_final_message"] == Value::Bool(true);
    let messages = body["messages"].as_array_mut().ok_or(Unresumable::Prompt)?;
    let last_is_assistant = messages.last().is_some_and(|m| m["role"] == "assistant");
    match (last_is_assistant, continues) {
        // The client's own start of the answer, which the stream went on from.
        (true, true) => {
            let content = messages.last_mut().map(|m| &mut m["content"]);
            let Some(Value::String(text)) = content else {
                return Err(Unresumable::Prompt);
            };
            text.push_str(delivered);
        }
        (true, false) => return Err(Unresumable::Prompt),
        (false, _) => messages.push(serde_json::json!({"role": "assistant", "content": delivered})),
    }
    body["continue_final_message"] = Value::Bool(true);
    body["add_generation_prompt"] = Value::Bool(false);
    Ok(())
}

/// Completions: the prompt with `delivered` appended.
fn continue_prompt(body: &mut Value, delivered: &str) -> Result<(), Unresumable> {
    let echoes = body["echo"] == Value::Bool(true);
    let several = body["best_of"].as_u64().is_some_and(|n| n > 1);
    if echoes || several || !body["suffix"].is_null() {
        return Err(Unresumable::Prompt);
    }
    let prompt = match &mut body["prompt"] {
        Value::String(prompt) => prompt,
        Value::Array(prompts) if prompts.len() == 1 => match &mut prompts[0] {
            Value::String(prompt) => prompt,
            _ => return Err(Unresumable::Prompt),
        },
        _ => return Err(Unresumable::Prompt),
    };
    prompt.push_str(delivered);
    Ok(())
}

#[cfg(test)]
mod tests;
