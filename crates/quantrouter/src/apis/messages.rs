//! Anthropic Messages ↔ Chat Completions.
//!
//! Request: `system` (and `system` turns) become system messages; text and image blocks
//! become content parts; `tool_use` blocks become the assistant's `tool_calls` and
//! `tool_result` blocks `tool` messages; `tools`, `tool_choice`, `stop_sequences`,
//! `metadata.user_id`, `thinking` (`reasoning_effort`) and `output_config.format` map to their
//! chat names; hints are left out. Answer: text and tool calls become `text` and `tool_use` blocks, `finish_reason`
//! the `stop_reason`, `usage` Anthropic's token counts; a stream becomes `message_start`,
//! `content_block_start` / `_delta` / `_stop` per block, `message_delta`, `message_stop`.

use serde_json::{json, Map, Value};

use super::{chat_functions, check_keys, hosted_tools, joined_text, reasoning_of, Untranslatable};

/// Request keys with a chat form, or hints that ask nothing of the answer's content
/// (`metadata` but its `user_id`, `service_tier`, `context_management`); every rule is in
/// `docs/agent-apis.md`.
const KNOWN: &[&str] = &[
    "model",
    "messages",
    "system",
    "max_tokens",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "stop_sequences",
    "tools",
    "tool_choice",
    "metadata",
    "thinking",
    "output_config",
    "service_tier",
    "context_management",
];

/// A Messages request as a chat request (without `model`).
pub fn to_chat(request: &Value) -> Result<Value, Untranslatable> {
    check_keys(request, KNOWN)?;
    let mut messages = Vec::new();
    if let Some(system) = request.get("system") {
        messages.push(system_message(system)?);
    }
    let turns = request
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| Untranslatable("a request without `messages`".into()))?;
    for turn in turns {
        push_turn(&mut messages, turn)?;
    }
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(messages));
    for (from, to) in [
        ("max_tokens", "max_tokens"),
        ("stream", "stream"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("stop_sequences", "stop"),
    ] {
        if let Some(value) = request.get(from) {
            chat.insert(to.into(), value.clone());
        }
    }
    if let Some(user) = request.pointer("/metadata/user_id") {
        chat.insert("user".into(), user.clone());
    }
    if let Some(effort) = reasoning_effort(request.get("thinking"))? {
        chat.insert("reasoning_effort".into(), json!(effort));
    }
    if let Some(format) = output_format(request.get("output_config"))? {
        chat.insert("response_format".into(), format);
    }
    if let Some(functions) = chat_functions(request, hosted, tool) {
        chat.insert("tools".into(), functions?);
    }
    if let Some(choice) = request.get("tool_choice") {
        let (choice, parallel) = tool_choice(choice)?;
        chat.insert("tool_choice".into(), choice);
        if !parallel {
            chat.insert("parallel_tool_calls".into(), Value::Bool(false));
        }
    }
    Ok(Value::Object(chat))
}

/// The hosted tools of a request that a chat upstream cannot run and the translation
/// leaves out (Anthropic's server-side web search), by name.
pub fn dropped_tools(request: &Value) -> Vec<String> {
    hosted_tools(request, hosted)
}

/// Anthropic's web search runs on Anthropic's servers: no chat upstream has it.
fn hosted(tool: &Value) -> bool {
    kind(tool).starts_with("web_search_")
}

/// A `system` prompt, or a `system` turn inside `messages`: text only.
fn system_message(content: &Value) -> Result<Value, Untranslatable> {
    let text = joined_text(content)
        .ok_or_else(|| Untranslatable("a `system` block other than text".into()))?;
    Ok(json!({"role": "system", "content": text}))
}

/// Chat's `reasoning_effort` for Anthropic's `thinking`: a budget, in the three steps
/// reasoning chat servers know; `adaptive` leaves the model its own judgment, as chat does
/// by default, and `disabled` asks for nothing.
fn reasoning_effort(thinking: Option<&Value>) -> Result<Option<&'static str>, Untranslatable> {
    let Some(thinking) = thinking else {
        return Ok(None);
    };
    match kind(thinking) {
        "disabled" | "adaptive" => Ok(None),
        "enabled" => Ok(Some(
            match thinking["budget_tokens"].as_u64().unwrap_or(0) {
                0..4_096 => "low",
                4_096..16_384 => "medium",
                _ => "high",
            },
        )),
        other => Err(Untranslatable(format!("`thinking` of type `{other}`"))),
    }
}

/// `output_config`: its JSON schema (structured output) becomes `response_format`; the
/// effort is a hint of how hard to work, which chat has no field for.
fn output_format(config: Option<&Value>) -> Result<Option<Value>, Untranslatable> {
    let Some(config) = config else {
        return Ok(None);
    };
    check_keys(config, &["effort", "format"])
        .map_err(|e| Untranslatable(format!("`output_config` key {}", e.0)))?;
    let Some(format) = config.get("format").filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    match kind(format) {
        "json_schema" => Ok(Some(json!({"type": "json_schema", "json_schema": {
            "name": "output", "schema": format["schema"], "strict": true,
        }}))),
        other => Err(Untranslatable(format!(
            "`output_config.format` of type `{other}`"
        ))),
    }
}

/// One Messages turn as chat messages: a user turn's tool results come first, as `tool`
/// messages, then its other content.
fn push_turn(messages: &mut Vec<Value>, turn: &Value) -> Result<(), Untranslatable> {
    let role = turn.get("role").and_then(Value::as_str).unwrap_or_default();
    if role == "system" {
        // Claude Code sends its environment as a system turn between the others.
        messages.push(system_message(turn.get("content").unwrap_or(&Value::Null))?);
        return Ok(());
    }
    if !matches!(role, "user" | "assistant") {
        return Err(Untranslatable(format!("a message with role `{role}`")));
    }
    let blocks = match turn.get("content") {
        Some(Value::String(text)) => {
            messages.push(json!({"role": role, "content": text}));
            return Ok(());
        }
        Some(Value::Array(blocks)) => blocks,
        _ => return Err(Untranslatable("a message without `content`".into())),
    };
    let mut parts = Vec::new();
    let mut calls = Vec::new();
    for block in blocks {
        match (role, kind(block)) {
            (_, "text") => parts.push(json!({"type": "text", "text": block["text"]})),
            ("user", "image") => parts.push(image(block)?),
            ("user", "tool_result") => messages.push(tool_result(block)?),
            ("assistant", "tool_use") => calls.push(json!({
                "id": block["id"],
                "type": "function",
                "function": {"name": block["name"], "arguments": block["input"].to_string()},
            })),
            // Earlier reasoning, sent back: chat servers take none in a request (vLLM's
            // templates drop it), so it goes where a chat client's would.
            ("assistant", "thinking" | "redacted_thinking") => {}
            (_, other) => return Err(Untranslatable(format!("a `{other}` content block"))),
        }
    }
    let only_text = parts.iter().all(|p| p["type"] == "text");
    let content = match (only_text, parts.is_empty()) {
        (_, true) => Value::Null,
        // Plain text for assistants and text-only turns: every chat server takes a string.
        (true, false) => Value::String(parts.iter().filter_map(|p| p["text"].as_str()).collect()),
        (false, false) => Value::Array(parts),
    };
    match role {
        "assistant" => {
            let mut message = json!({"role": "assistant", "content": content});
            if !calls.is_empty() {
                message["tool_calls"] = Value::Array(calls);
            }
            messages.push(message);
        }
        _ if !content.is_null() => messages.push(json!({"role": "user", "content": content})),
        _ => {}
    }
    Ok(())
}

fn kind(block: &Value) -> &str {
    block
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or_default()
}

fn image(block: &Value) -> Result<Value, Untranslatable> {
    let source = &block["source"];
    let url = match kind(source) {
        "base64" => format!(
            "data:{};base64,{}",
            source["media_type"].as_str().unwrap_or_default(),
            source["data"].as_str().unwrap_or_default()
        ),
        "url" => source["url"].as_str().unwrap_or_default().to_owned(),
        other => return Err(Untranslatable(format!("an image from a `{other}` source"))),
    };
    Ok(json!({"type": "image_url", "image_url": {"url": url}}))
}

fn tool_result(block: &Value) -> Result<Value, Untranslatable> {
    let text = joined_text(block.get("content").unwrap_or(&Value::Null))
        .ok_or_else(|| Untranslatable("a `tool_result` with content other than text".into()))?;
    // Chat has no error flag on a tool's result: the text says it.
    let text = match block.get("is_error").and_then(Value::as_bool) {
        Some(true) => format!("[tool error] {text}"),
        _ => text,
    };
    Ok(json!({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}))
}

/// A custom tool as a chat function. Its hints (`cache_control`, `defer_loading`,
/// `eager_input_streaming`, `input_examples`) are left out: the function is offered whole.
fn tool(tool: &Value) -> Result<Value, Untranslatable> {
    match tool.get("type").and_then(Value::as_str) {
        None | Some("custom") => {}
        Some(other) => return Err(Untranslatable(format!("the server tool `{other}`"))),
    }
    let mut function = json!({
        "name": tool["name"],
        "parameters": tool.get("input_schema").cloned().unwrap_or_else(|| json!({"type": "object"})),
    });
    for key in ["description", "strict"] {
        if let Some(value) = tool.get(key).filter(|v| !v.is_null()) {
            function[key] = value.clone();
        }
    }
    Ok(json!({"type": "function", "function": function}))
}

/// Chat's `tool_choice`, and whether parallel calls stay allowed.
fn tool_choice(choice: &Value) -> Result<(Value, bool), Untranslatable> {
    let parallel = choice
        .get("disable_parallel_tool_use")
        .and_then(Value::as_bool)
        != Some(true);
    let chat = match kind(choice) {
        "auto" => json!("auto"),
        "any" => json!("required"),
        "none" => json!("none"),
        "tool" => json!({"type": "function", "function": {"name": choice["name"]}}),
        other => return Err(Untranslatable(format!("`tool_choice` of type `{other}`"))),
    };
    Ok((chat, parallel))
}

/// Anthropic's `stop_reason` for chat's `finish_reason`.
fn stop_reason(finish: Option<&str>) -> &'static str {
    match finish {
        Some("length") => "max_tokens",
        Some("tool_calls" | "function_call") => "tool_use",
        Some("content_filter") => "refusal",
        _ => "end_turn",
    }
}

/// A whole chat completion as a Message.
pub fn from_chat(chat: &Value) -> Value {
    let choice = &chat["choices"][0];
    let message = &choice["message"];
    let mut content = Vec::new();
    // A chat upstream's reasoning is Anthropic's thinking (with no signature: no Anthropic
    // server signed it).
    if let Some(thinking) = reasoning_of(message) {
        content.push(json!({"type": "thinking", "thinking": thinking, "signature": ""}));
    }
    for text in [&message["content"], &message["refusal"]] {
        if let Some(text) = text.as_str().filter(|t| !t.is_empty()) {
            content.push(json!({"type": "text", "text": text}));
        }
    }
    for call in message["tool_calls"].as_array().into_iter().flatten() {
        content.push(tool_use(
            &call["id"],
            &call["function"]["name"],
            call["function"]["arguments"].as_str().unwrap_or("{}"),
        ));
    }
    let finish = match message["refusal"].as_str() {
        Some(r) if !r.is_empty() => Some("content_filter"),
        _ => choice["finish_reason"].as_str(),
    };
    json!({
        "id": message_id(chat["id"].as_str()),
        "type": "message",
        "role": "assistant",
        "model": chat["model"],
        "content": content,
        "stop_reason": stop_reason(finish),
        "stop_sequence": null,
        "usage": usage(&chat["usage"]),
    })
}

fn tool_use(id: &Value, name: &Value, arguments: &str) -> Value {
    let input: Value = serde_json::from_str(arguments).unwrap_or_else(|_| json!({}));
    json!({"type": "tool_use", "id": id, "name": name, "input": input})
}

fn usage(usage: &Value) -> Value {
    json!({
        "input_tokens": usage["prompt_tokens"].as_u64().unwrap_or(0),
        "output_tokens": usage["completion_tokens"].as_u64().unwrap_or(0),
    })
}

fn message_id(chat_id: Option<&str>) -> String {
    let id = chat_id.unwrap_or_default();
    format!("msg_{}", id.strip_prefix("chatcmpl-").unwrap_or(id))
}

/// A chat stream becoming a Messages stream, chunk by chunk.
#[derive(Debug, Default)]
pub struct MessagesStream {
    started: bool,
    /// The open content block: its index and whether it is text (else a tool call, by the
    /// chat tool call index).
    open: Option<(usize, Block)>,
    blocks: usize,
    finish: Option<String>,
    usage: Value,
    ended: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Block {
    Thinking,
    Text,
    Tool(u64),
}

impl MessagesStream {
    /// Whether the chat stream said how it finished (a `finish_reason`).
    pub fn finished(&self) -> bool {
        self.finish.is_some()
    }

    /// The events for one chat chunk, appended to `out`.
    pub fn chunk(&mut self, chunk: &Value, out: &mut Vec<u8>) {
        self.start(chunk, out);
        if chunk["usage"].is_object() {
            self.usage = chunk["usage"].clone();
        }
        let Some(choice) = chunk["choices"].get(0) else {
            return;
        };
        let delta = &choice["delta"];
        if let Some(thinking) = reasoning_of(delta) {
            let start = || json!({"type": "thinking", "thinking": "", "signature": ""});
            self.open_block(Block::Thinking, start, out);
            let index = self.blocks - 1;
            event(
                out,
                "content_block_delta",
                &json!({"type": "content_block_delta",
                "index": index, "delta": {"type": "thinking_delta", "thinking": thinking}}),
            );
        }
        for text in [&delta["content"], &delta["refusal"]] {
            if let Some(text) = text.as_str().filter(|t| !t.is_empty()) {
                self.open_block(Block::Text, || json!({"type": "text", "text": ""}), out);
                let index = self.blocks - 1;
                event(
                    out,
                    "content_block_delta",
                    &json!({"type": "content_block_delta",
                    "index": index, "delta": {"type": "text_delta", "text": text}}),
                );
            }
        }
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            let n = call["index"].as_u64().unwrap_or(0);
            let start = || tool_use(&call["id"], &call["function"]["name"], "{}");
            if call.get("id").is_some_and(|id| !id.is_null()) {
                self.close_block(out);
            }
            self.open_block(Block::Tool(n), start, out);
            if let Some(part) = call["function"]["arguments"]
                .as_str()
                .filter(|a| !a.is_empty())
            {
                let index = self.blocks - 1;
                event(
                    out,
                    "content_block_delta",
                    &json!({"type": "content_block_delta",
                    "index": index, "delta": {"type": "input_json_delta", "partial_json": part}}),
                );
            }
        }
        if let Some(finish) = choice["finish_reason"].as_str() {
            self.finish = Some(finish.to_owned());
        }
    }

    /// The closing events, once the chat stream ended (`[DONE]` or its last chunk).
    pub fn end(&mut self, out: &mut Vec<u8>) {
        if self.ended {
            return;
        }
        self.ended = true;
        self.start(&Value::Null, out);
        self.close_block(out);
        let usage = usage(&self.usage);
        event(
            out,
            "message_delta",
            &json!({"type": "message_delta",
            "delta": {"stop_reason": stop_reason(self.finish.as_deref()), "stop_sequence": null},
            "usage": usage}),
        );
        event(out, "message_stop", &json!({"type": "message_stop"}));
    }

    /// A failure after the stream began, as Anthropic's error event.
    pub fn error(&mut self, body: &Value, out: &mut Vec<u8>) {
        self.ended = true;
        let message = body["error"]["message"]
            .as_str()
            .unwrap_or("upstream error");
        event(out, "error", &super::anthropic_error("api_error", message));
    }

    fn start(&mut self, chunk: &Value, out: &mut Vec<u8>) {
        if self.started {
            return;
        }
        self.started = true;
        event(
            out,
            "message_start",
            &json!({"type": "message_start", "message": {
                "id": message_id(chunk["id"].as_str()),
                "type": "message",
                "role": "assistant",
                "model": chunk["model"],
                "content": [],
                "stop_reason": null,
                "stop_sequence": null,
                // The prompt's tokens, where the upstream counts them in every chunk
                // (`continuous_usage_stats`); `message_delta` carries both counts anyway.
                "usage": {
                    "input_tokens": chunk["usage"]["prompt_tokens"].as_u64().unwrap_or(0),
                    "output_tokens": 0,
                },
            }}),
        );
    }

    fn open_block(&mut self, block: Block, start: impl FnOnce() -> Value, out: &mut Vec<u8>) {
        if self.open.map(|(_, b)| b) == Some(block) {
            return;
        }
        self.close_block(out);
        let index = self.blocks;
        self.blocks += 1;
        self.open = Some((index, block));
        event(
            out,
            "content_block_start",
            &json!({"type": "content_block_start",
            "index": index, "content_block": start()}),
        );
    }

    fn close_block(&mut self, out: &mut Vec<u8>) {
        if let Some((index, _)) = self.open.take() {
            event(
                out,
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": index}),
            );
        }
    }
}

/// One named SSE event.
pub(crate) fn event(out: &mut Vec<u8>, name: &str, data: &Value) {
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b"\ndata: ");
    out.extend_from_slice(data.to_string().as_bytes());
    out.extend_from_slice(b"\n\n");
}

#[cfg(test)]
mod tests;
