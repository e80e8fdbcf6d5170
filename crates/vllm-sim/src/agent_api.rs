//! The agent APIs vLLM serves next to chat: Anthropic's Messages (`/v1/messages`) and OpenAI's
//! Responses (`/v1/responses`). Requests are read for what shapes the answer (text, tools,
//! limits); answers and stream events follow each API's wire shape.
//!
//! Tools: a request that declares tools and does not end with a tool's result is answered with
//! a call of the first tool (arguments `{}`), and the next turn, which carries the result, with
//! text: the shape of one agent step. A prompt holding `[[call:NAME]]` calls the declared
//! tool NAME instead, so a test can pick a tool its client can run.

use bytes::Bytes;
use serde_json::{json, Value};

use crate::api::{ApiError, CompletionRequest, Endpoint, ResponseMeta, Usage};
use crate::generate::{FinishReason, PromptDigest};

/// Arguments of every simulated tool call.
pub(crate) const TOOL_ARGUMENTS: &str = "{}";

/// `POST /v1/messages`: `system`, `messages` (text blocks scored; tool results and images
/// are not text), `max_tokens`, `stream`, `tools`.
pub(crate) fn parse_messages(body: &[u8]) -> Result<CompletionRequest, ApiError> {
    let wire: Value = parse_object(body)?;
    let messages = wire
        .get("messages")
        .and_then(Value::as_array)
        .filter(|m| !m.is_empty())
        .ok_or_else(|| ApiError::BadRequest("`messages` must be a non-empty array.".into()))?;
    let mut digest = PromptDigest::new();
    let mut cache_text = String::new();
    if let Some(system) = wire.get("system") {
        digest.add_marker("system");
        let text = add_texts(&mut digest, system, &["text"]);
        push_turn(&mut cache_text, "system", &text);
    }
    let mut user_text = None;
    for message in messages {
        let role = message.get("role").and_then(Value::as_str).unwrap_or("");
        digest.add_marker(role);
        let content = message.get("content").unwrap_or(&Value::Null);
        let text = add_texts(&mut digest, content, &["text"]);
        push_turn(&mut cache_text, role, &text);
        if role == "user" {
            user_text = Some(text);
        }
    }
    let last_is_result = messages
        .last()
        .and_then(|m| m.get("content"))
        .and_then(Value::as_array)
        .is_some_and(|blocks| blocks.iter().any(|b| kind(b) == "tool_result"));
    let tool = first_tool(&wire, body, |t| t.get("name")).filter(|_| !last_is_result);
    Ok(CompletionRequest {
        model: wire.get("model").and_then(Value::as_str).map(str::to_owned),
        digest,
        user_text,
        cache_text,
        max_tokens: max_tokens(&wire, "max_tokens")?,
        ignore_eos: false,
        stream: wire.get("stream").and_then(Value::as_bool).unwrap_or(false),
        include_usage: true,
        continuous_usage: false,
        tool,
        previous_response_id: None,
        continued: 0,
        cache_salt: None,
    })
}

/// `POST /v1/responses`: `instructions`, `input` (a string or items), `max_output_tokens`,
/// `stream`, `tools`, `previous_response_id`.
pub(crate) fn parse_responses(body: &[u8]) -> Result<CompletionRequest, ApiError> {
    let wire: Value = parse_object(body)?;
    let input = wire
        .get("input")
        .ok_or_else(|| ApiError::BadRequest("`input` is required.".into()))?;
    let mut digest = PromptDigest::new();
    let mut cache_text = String::new();
    if let Some(instructions) = wire.get("instructions") {
        digest.add_marker("system");
        let text = add_texts(&mut digest, instructions, &["input_text"]);
        push_turn(&mut cache_text, "system", &text);
    }
    let mut user_text = None;
    let mut last_is_result = false;
    match input {
        Value::String(text) => {
            digest.add_marker("user");
            digest.add_text(text);
            push_turn(&mut cache_text, "user", text);
            user_text = Some(text.clone());
        }
        Value::Array(items) => {
            for item in items {
                let role = item.get("role").and_then(Value::as_str).unwrap_or("");
                digest.add_marker(role);
                let content = item.get("content").unwrap_or(&Value::Null);
                let text = add_texts(&mut digest, content, &["input_text", "output_text"]);
                push_turn(&mut cache_text, role, &text);
                if role == "user" {
                    user_text = Some(text);
                }
                last_is_result = kind(item) == "function_call_output";
            }
        }
        _ => {
            return Err(ApiError::BadRequest(
                "`input` must be a string or an array.".into(),
            ))
        }
    }
    let tool = first_tool(&wire, body, |t| t.get("name")).filter(|_| !last_is_result);
    Ok(CompletionRequest {
        model: wire.get("model").and_then(Value::as_str).map(str::to_owned),
        digest,
        user_text,
        cache_text,
        max_tokens: max_tokens(&wire, "max_output_tokens")?,
        ignore_eos: false,
        stream: wire.get("stream").and_then(Value::as_bool).unwrap_or(false),
        include_usage: true,
        continuous_usage: false,
        tool,
        previous_response_id: wire
            .get("previous_response_id")
            .and_then(Value::as_str)
            .map(str::to_owned),
        continued: 0,
        cache_salt: None,
    })
}

/// The tool a chat request's answer calls: the first declared, unless the conversation ends
/// with a tool's result.
pub(crate) fn chat_tool(body: &[u8]) -> Option<String> {
    let wire: Value = serde_json::from_slice(body).ok()?;
    let last_role = wire
        .get("messages")?
        .as_array()?
        .last()?
        .get("role")?
        .as_str()?
        .to_owned();
    if last_role == "tool" {
        return None;
    }
    first_tool(&wire, body, |t| {
        t.get("function").and_then(|f| f.get("name"))
    })
}

fn parse_object(body: &[u8]) -> Result<Value, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::BadRequest(format!("Malformed JSON body: {e}")))?;
    match value.is_object() {
        true => Ok(value),
        false => Err(ApiError::BadRequest(
            "The body must be a JSON object.".into(),
        )),
    }
}

fn kind(value: &Value) -> &str {
    value.get("type").and_then(Value::as_str).unwrap_or("")
}

/// The tool an answer calls: the one `[[call:NAME]]` in the request asks for, else the first
/// declared.
fn first_tool(
    wire: &Value,
    body: &[u8],
    name: impl Fn(&Value) -> Option<&Value>,
) -> Option<String> {
    if wire.get("tool_choice").and_then(Value::as_str) == Some("none") {
        return None;
    }
    let tools = wire.get("tools")?.as_array()?;
    let names = tools.iter().filter_map(|t| name(t)?.as_str());
    match asked_tool(body) {
        Some(asked) => names.into_iter().find(|n| *n == asked),
        None => names.into_iter().next(),
    }
    .map(str::to_owned)
}

/// The NAME of a `[[call:NAME]]` anywhere in the request body.
fn asked_tool(body: &[u8]) -> Option<&str> {
    const MARK: &[u8] = b"[[call:";
    let at = body.windows(MARK.len()).position(|w| w == MARK)? + MARK.len();
    let len = body[at..].windows(2).position(|w| w == b"]]")?;
    std::str::from_utf8(&body[at..at + len]).ok()
}

fn max_tokens(wire: &Value, field: &str) -> Result<Option<u64>, ApiError> {
    match wire.get(field).map(Value::as_u64) {
        None => Ok(None),
        Some(Some(0) | None) => Err(ApiError::BadRequest(format!(
            "`{field}` must be a positive integer."
        ))),
        Some(n) => Ok(n),
    }
}

/// Adds the text of `content` (a string, or blocks of the given types) to the digest and
/// returns it joined.
/// Appends a turn to the text the prefix cache hashes, laid out as chat's is.
fn push_turn(cache_text: &mut String, role: &str, text: &str) {
    cache_text.push_str(role);
    cache_text.push('\n');
    cache_text.push_str(text);
    cache_text.push('\n');
}

fn add_texts(digest: &mut PromptDigest, content: &Value, types: &[&str]) -> String {
    let mut joined = String::new();
    match content {
        Value::String(text) => {
            digest.add_text(text);
            joined.push_str(text);
        }
        Value::Array(blocks) => {
            for block in blocks.iter().filter(|b| types.contains(&kind(b))) {
                if let Some(text) = block.get("text").and_then(Value::as_str) {
                    digest.add_text(text);
                    joined.push_str(text);
                }
            }
        }
        _ => {}
    }
    joined
}

// === answers ===

/// A whole answer of `meta.endpoint` (Messages or Responses).
pub(crate) fn whole_body(
    meta: &ResponseMeta<'_>,
    text: &str,
    finish: FinishReason,
    usage: Usage,
) -> Value {
    match meta.endpoint {
        Endpoint::Messages => json!({
            "id": meta.id,
            "type": "message",
            "role": "assistant",
            "model": meta.model,
            "content": [message_block(meta, text)],
            "stop_reason": stop_reason(finish),
            "stop_sequence": null,
            "usage": {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens},
        }),
        _ => response_object(meta, Some((text, finish, usage))),
    }
}

fn message_block(meta: &ResponseMeta<'_>, text: &str) -> Value {
    match meta.tool {
        Some(name) => json!({
            "type": "tool_use",
            "id": call_id(meta, "toolu"),
            "name": name,
            "input": {},
        }),
        None => json!({"type": "text", "text": text}),
    }
}

fn stop_reason(finish: FinishReason) -> &'static str {
    match finish {
        FinishReason::Stop => "end_turn",
        FinishReason::Length => "max_tokens",
        FinishReason::ToolCalls => "tool_use",
    }
}

fn call_id(meta: &ResponseMeta<'_>, prefix: &str) -> String {
    let hex = meta.id.rsplit('-').next().unwrap_or(meta.id);
    format!("{prefix}_{hex}")
}

/// A Responses `response` object: in progress (`None`) or finished.
fn response_object(meta: &ResponseMeta<'_>, done: Option<(&str, FinishReason, Usage)>) -> Value {
    let (status, output, usage, incomplete) = match done {
        None => ("in_progress", json!([]), Value::Null, Value::Null),
        Some((text, finish, usage)) => {
            let (status, incomplete) = match finish {
                FinishReason::Length => ("incomplete", json!({"reason": "max_output_tokens"})),
                _ => ("completed", Value::Null),
            };
            let usage = json!({
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage.total_tokens,
            });
            (
                status,
                json!([output_item(meta, text, status)]),
                usage,
                incomplete,
            )
        }
    };
    json!({
        "id": meta.id,
        "object": "response",
        "created_at": meta.created,
        "status": status,
        "error": null,
        "incomplete_details": incomplete,
        "model": meta.model,
        "output": output,
        "parallel_tool_calls": true,
        "tool_choice": "auto",
        "tools": [],
        "previous_response_id": meta.previous_response_id,
        "store": true,
        "metadata": {},
        "usage": usage,
    })
}

fn output_item(meta: &ResponseMeta<'_>, text: &str, status: &str) -> Value {
    match meta.tool {
        Some(name) => json!({
            "type": "function_call",
            "id": call_id(meta, "fc"),
            "call_id": call_id(meta, "call"),
            "name": name,
            "arguments": if status == "in_progress" { "" } else { TOOL_ARGUMENTS },
            "status": status,
        }),
        None => {
            let content = match status {
                "in_progress" => json!([]),
                _ => json!([{"type": "output_text", "text": text, "annotations": []}]),
            };
            json!({
                "type": "message",
                "id": call_id(meta, "msg"),
                "status": status,
                "role": "assistant",
                "content": content,
            })
        }
    }
}

// === stream events ===

/// Events of one agent-API stream, numbered as the Responses API numbers them.
#[derive(Debug, Default)]
pub(crate) struct AgentStream {
    sequence: u64,
}

impl AgentStream {
    /// The events before the first token.
    pub(crate) fn opening(&mut self, meta: &ResponseMeta<'_>, prompt_tokens: u64) -> Vec<Bytes> {
        match meta.endpoint {
            Endpoint::Messages => {
                let start = json!({"type": "message_start", "message": {
                    "id": meta.id, "type": "message", "role": "assistant", "model": meta.model,
                    "content": [], "stop_reason": null, "stop_sequence": null,
                    "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
                }});
                let block = json!({"type": "content_block_start", "index": 0,
                    "content_block": message_block(meta, "")});
                vec![
                    named("message_start", &start),
                    named("content_block_start", &block),
                    named("ping", &json!({"type": "ping"})),
                ]
            }
            _ => {
                let response = response_object(meta, None);
                let mut events = vec![
                    self.numbered(json!({"type": "response.created", "response": response})),
                    self.numbered(json!({"type": "response.in_progress", "response": response})),
                    self.numbered(
                        json!({"type": "response.output_item.added", "output_index": 0,
                        "item": output_item(meta, "", "in_progress")}),
                    ),
                ];
                if meta.tool.is_none() {
                    events.push(self.numbered(json!({"type": "response.content_part.added",
                        "item_id": call_id(meta, "msg"), "output_index": 0, "content_index": 0,
                        "part": {"type": "output_text", "text": "", "annotations": []}})));
                }
                events
            }
        }
    }

    /// One token's text, or the whole of a tool call's arguments.
    pub(crate) fn delta(&mut self, meta: &ResponseMeta<'_>, piece: &str) -> Bytes {
        match (meta.endpoint, meta.tool) {
            (Endpoint::Messages, None) => named(
                "content_block_delta",
                &json!({"type": "content_block_delta", "index": 0,
                    "delta": {"type": "text_delta", "text": piece}}),
            ),
            (Endpoint::Messages, Some(_)) => named(
                "content_block_delta",
                &json!({"type": "content_block_delta", "index": 0,
                    "delta": {"type": "input_json_delta", "partial_json": piece}}),
            ),
            (_, None) => self.numbered(json!({"type": "response.output_text.delta",
                "item_id": call_id(meta, "msg"), "output_index": 0, "content_index": 0,
                "delta": piece, "logprobs": []})),
            (_, Some(_)) => self.numbered(json!({"type": "response.function_call_arguments.delta",
                "item_id": call_id(meta, "fc"), "output_index": 0, "delta": piece})),
        }
    }

    /// The events after the last token: the block's or item's end, the stop reason and usage.
    pub(crate) fn closing(
        &mut self,
        meta: &ResponseMeta<'_>,
        text: &str,
        finish: FinishReason,
        usage: Usage,
    ) -> Vec<Bytes> {
        match meta.endpoint {
            Endpoint::Messages => vec![
                named(
                    "content_block_stop",
                    &json!({"type": "content_block_stop", "index": 0}),
                ),
                named(
                    "message_delta",
                    &json!({"type": "message_delta",
                        "delta": {"stop_reason": stop_reason(finish), "stop_sequence": null},
                        "usage": {"input_tokens": usage.prompt_tokens,
                            "output_tokens": usage.completion_tokens}}),
                ),
                named("message_stop", &json!({"type": "message_stop"})),
            ],
            _ => {
                let done = response_object(meta, Some((text, finish, usage)));
                let status = done["status"].as_str().unwrap_or("completed").to_owned();
                let item = output_item(meta, text, &status);
                let mut events = Vec::with_capacity(5);
                match meta.tool {
                    Some(_) => events.push(self.numbered(json!({
                        "type": "response.function_call_arguments.done",
                        "item_id": call_id(meta, "fc"), "output_index": 0,
                        "arguments": TOOL_ARGUMENTS}))),
                    None => {
                        let item_id = call_id(meta, "msg");
                        events.push(self.numbered(json!({"type": "response.output_text.done",
                            "item_id": item_id, "output_index": 0, "content_index": 0,
                            "text": text, "logprobs": []})));
                        events.push(self.numbered(json!({"type": "response.content_part.done",
                            "item_id": item_id, "output_index": 0, "content_index": 0,
                            "part": {"type": "output_text", "text": text, "annotations": []}})));
                    }
                }
                events.push(self.numbered(json!({"type": "response.output_item.done",
                    "output_index": 0, "item": item})));
                let last = match status.as_str() {
                    "incomplete" => "response.incomplete",
                    _ => "response.completed",
                };
                events.push(self.numbered(json!({"type": last, "response": done})));
                events
            }
        }
    }

    fn numbered(&mut self, mut event: Value) -> Bytes {
        event["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        let name = event["type"].as_str().unwrap_or("").to_owned();
        named(&name, &event)
    }
}

/// One SSE event with its name (both agent APIs name their events).
fn named(name: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {data}\n\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(endpoint: Endpoint, tool: Option<&'static str>) -> ResponseMeta<'static> {
        ResponseMeta {
            endpoint,
            id: "msg-00ab",
            created: 5,
            model: "m",
            tool,
            previous_response_id: None,
        }
    }

    #[test]
    fn messages_score_system_and_text_blocks_and_call_a_declared_tool() {
        let body = br#"{"model":"m","max_tokens":9,"system":"be brief","tools":[{"name":"get_time","input_schema":{}}],
            "messages":[{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image","source":{}}]}]}"#;
        let request = parse_messages(body).unwrap();
        assert_eq!(request.user_text.as_deref(), Some("hi"));
        assert_eq!(request.tool.as_deref(), Some("get_time"));
        assert_eq!(request.max_tokens, Some(9));
    }

    #[test]
    fn a_prompt_names_the_tool_its_answer_calls() {
        let body = br#"{"model":"m","tools":[{"type":"function","function":{"name":"a"}},{"type":"function","function":{"name":"b"}}],
            "messages":[{"role":"user","content":"use it [[call:b]]"}]}"#;
        assert_eq!(chat_tool(body).as_deref(), Some("b"));
        // A tool the request does not declare is not called.
        let body = br#"{"model":"m","max_tokens":9,"tools":[{"name":"a","input_schema":{}}],
            "messages":[{"role":"user","content":"[[call:z]]"}]}"#;
        assert_eq!(parse_messages(body).unwrap().tool, None);
    }

    #[test]
    fn a_tool_result_is_answered_with_text() {
        let body = br#"{"model":"m","max_tokens":9,"tools":[{"name":"t","input_schema":{}}],
            "messages":[{"role":"user","content":"go"},
              {"role":"assistant","content":[{"type":"tool_use","id":"x","name":"t","input":{}}]},
              {"role":"user","content":[{"type":"tool_result","tool_use_id":"x","content":"12:00"}]}]}"#;
        assert_eq!(parse_messages(body).unwrap().tool, None);
        let body = br#"{"model":"m","tools":[{"type":"function","name":"t"}],
            "input":[{"role":"user","content":"go"},{"type":"function_call_output","call_id":"c","output":"1"}]}"#;
        assert_eq!(parse_responses(body).unwrap().tool, None);
    }

    #[test]
    fn a_messages_stream_opens_with_message_start_and_ends_with_message_stop() {
        let meta = meta(Endpoint::Messages, None);
        let mut stream = AgentStream::default();
        let opening = stream.opening(&meta, 7);
        assert!(opening[0].starts_with(b"event: message_start\n"));
        let closing = stream.closing(&meta, "a b", FinishReason::Length, Usage::new(7, 2));
        let delta = String::from_utf8(closing[1].to_vec()).unwrap();
        assert!(delta.contains(r#""stop_reason":"max_tokens""#), "{delta}");
        assert!(closing[2].starts_with(b"event: message_stop\n"));
    }

    #[test]
    fn a_responses_stream_numbers_its_events_and_completes_with_usage() {
        let meta = meta(Endpoint::Responses, None);
        let mut stream = AgentStream::default();
        let opening = stream.opening(&meta, 3);
        assert_eq!(opening.len(), 4);
        let delta = String::from_utf8(stream.delta(&meta, "hi").to_vec()).unwrap();
        assert!(delta.contains(r#""sequence_number":4"#), "{delta}");
        let closing = stream.closing(&meta, "hi", FinishReason::Stop, Usage::new(3, 1));
        let last = String::from_utf8(closing.last().unwrap().to_vec()).unwrap();
        assert!(last.starts_with("event: response.completed\n"), "{last}");
        assert!(last.contains(r#""output_tokens":1"#), "{last}");
    }
}
