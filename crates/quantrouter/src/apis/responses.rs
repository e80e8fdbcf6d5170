//! OpenAI Responses ↔ Chat Completions.
//!
//! Request: `instructions` becomes a system message; `input` (a string or items) becomes
//! messages — `function_call` items the assistant's `tool_calls`, `function_call_output`
//! items `tool` messages; function `tools`, `tool_choice`, `text.format`,
//! `max_output_tokens`, `reasoning.effort` map to their chat names. Answer: text and tool
//! calls become `message` and `function_call` output items, `usage` the Responses counts; a
//! stream becomes `response.created` … `response.output_text.delta` …
//! `response.completed`, numbered by `sequence_number`.
//!
//! A translated response is not stored (`"store": false`): the upstream keeps no state, so a
//! follow-up by `previous_response_id` needs a profile that serves Responses natively.

use serde_json::{json, Map, Value};

use super::messages::event;
use super::{chat_functions, check_keys, hosted_tools, joined_text, reasoning_of, Untranslatable};

/// Request keys with a chat form, or hints that ask nothing of the answer's content
/// (`metadata`, `client_metadata`, `store`, `include`, `truncation`, `service_tier`,
/// `prompt_cache_key`, `prompt_cache_retention`); every rule is in `docs/agent-apis.md`.
const KNOWN: &[&str] = &[
    "model",
    "input",
    "instructions",
    "stream",
    "max_output_tokens",
    "temperature",
    "top_p",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "store",
    "metadata",
    "client_metadata",
    "user",
    "safety_identifier",
    "reasoning",
    "include",
    "truncation",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "stream_options",
];

/// A Responses request as a chat request (without `model`).
pub fn to_chat(request: &Value) -> Result<Value, Untranslatable> {
    check_keys(request, KNOWN)?;
    let mut messages = Vec::new();
    if let Some(instructions) = request.get("instructions").and_then(Value::as_str) {
        messages.push(json!({"role": "system", "content": instructions}));
    }
    match request.get("input") {
        Some(Value::String(text)) => messages.push(json!({"role": "user", "content": text})),
        Some(Value::Array(items)) => {
            for item in items {
                push_item(&mut messages, item)?;
            }
        }
        _ => {
            return Err(Untranslatable(
                "an `input` that is neither text nor items".into(),
            ))
        }
    }
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(messages));
    for (from, to) in [
        ("max_output_tokens", "max_tokens"),
        ("stream", "stream"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("parallel_tool_calls", "parallel_tool_calls"),
        ("user", "user"),
        ("safety_identifier", "user"),
    ] {
        if let Some(value) = request.get(from).filter(|v| !v.is_null()) {
            chat.insert(to.into(), value.clone());
        }
    }
    if let Some(effort) = request
        .pointer("/reasoning/effort")
        .filter(|v| !v.is_null())
    {
        chat.insert("reasoning_effort".into(), effort.clone());
    }
    if let Some(format) = request.pointer("/text/format") {
        if let Some(format) = response_format(format)? {
            chat.insert("response_format".into(), format);
        }
    }
    if let Some(functions) = chat_functions(request, hosted, tool) {
        chat.insert("tools".into(), functions?);
    }
    if let Some(choice) = request.get("tool_choice") {
        chat.insert("tool_choice".into(), tool_choice(choice)?);
    }
    Ok(Value::Object(chat))
}

/// The tools of a request that a chat upstream cannot run and the translation leaves out
/// (hosted web search, and `namespace` groups of tools, which chat has no form for), by
/// name or type.
pub fn dropped_tools(request: &Value) -> Vec<String> {
    hosted_tools(request, hosted)
}

/// The request's tools as a translated answer echoes them: those the model was offered.
pub(super) fn offered_tools(request: &Value) -> Value {
    let tools = request.get("tools").and_then(Value::as_array);
    Value::Array(
        tools
            .into_iter()
            .flatten()
            .filter(|t| !hosted(t))
            .cloned()
            .collect(),
    )
}

fn hosted(tool: &Value) -> bool {
    let kind = kind(tool);
    kind.starts_with("web_search") || kind == "namespace"
}

fn kind(item: &Value) -> &str {
    item.get("type").and_then(Value::as_str).unwrap_or_default()
}

fn push_item(messages: &mut Vec<Value>, item: &Value) -> Result<(), Untranslatable> {
    match kind(item) {
        "message" | "" => {
            let role = item.get("role").and_then(Value::as_str).unwrap_or("user");
            let role = match role {
                "developer" => "system",
                "system" | "user" | "assistant" => role,
                other => return Err(Untranslatable(format!("a message with role `{other}`"))),
            };
            messages.push(json!({"role": role, "content": content(&item["content"])?}));
        }
        "function_call" => {
            let call = json!({
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            });
            // Parallel calls are one assistant message with several `tool_calls`.
            match messages.last_mut() {
                Some(last) if last["role"] == "assistant" && last["tool_calls"].is_array() => {
                    if let Some(calls) = last["tool_calls"].as_array_mut() {
                        calls.push(call);
                    }
                }
                _ => messages
                    .push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
            }
        }
        // Earlier reasoning, sent back (Codex includes it encrypted): chat servers take none
        // in a request, so it goes where a chat client's would.
        "reasoning" => {}
        "function_call_output" => {
            let output = joined_text(&item["output"]).ok_or_else(|| {
                Untranslatable("a `function_call_output` with output other than text".into())
            })?;
            messages
                .push(json!({"role": "tool", "tool_call_id": item["call_id"], "content": output}));
        }
        other => return Err(Untranslatable(format!("an input item of type `{other}`"))),
    }
    Ok(())
}

/// A message's content: a string, or text and image parts.
fn content(content: &Value) -> Result<Value, Untranslatable> {
    let Some(parts) = content.as_array() else {
        return Ok(content.clone());
    };
    let mut chat = Vec::with_capacity(parts.len());
    for part in parts {
        chat.push(match kind(part) {
            "input_text" | "output_text" => json!({"type": "text", "text": part["text"]}),
            "refusal" => json!({"type": "text", "text": part["refusal"]}),
            "input_image" if part["image_url"].is_string() => {
                json!({"type": "image_url", "image_url": {"url": part["image_url"]}})
            }
            other => return Err(Untranslatable(format!("a `{other}` content part"))),
        });
    }
    if chat.iter().all(|p| p["type"] == "text") {
        let text: String = chat.iter().filter_map(|p| p["text"].as_str()).collect();
        return Ok(Value::String(text));
    }
    Ok(Value::Array(chat))
}

fn response_format(format: &Value) -> Result<Option<Value>, Untranslatable> {
    Ok(match kind(format) {
        "text" => None,
        "json_object" => Some(json!({"type": "json_object"})),
        "json_schema" => Some(json!({"type": "json_schema", "json_schema": {
            "name": format["name"],
            "schema": format["schema"],
            "strict": format.get("strict").cloned().unwrap_or(Value::Bool(false)),
        }})),
        other => return Err(Untranslatable(format!("`text.format` of type `{other}`"))),
    })
}

fn tool(tool: &Value) -> Result<Value, Untranslatable> {
    if kind(tool) != "function" {
        return Err(Untranslatable(format!(
            "the built-in tool `{}`",
            kind(tool)
        )));
    }
    let mut function = json!({
        "name": tool["name"],
        "parameters": tool.get("parameters").cloned().unwrap_or_else(|| json!({"type": "object"})),
    });
    for key in ["description", "strict"] {
        if let Some(value) = tool.get(key).filter(|v| !v.is_null()) {
            function[key] = value.clone();
        }
    }
    Ok(json!({"type": "function", "function": function}))
}

fn tool_choice(choice: &Value) -> Result<Value, Untranslatable> {
    match choice {
        Value::String(_) => Ok(choice.clone()),
        _ if kind(choice) == "function" => {
            Ok(json!({"type": "function", "function": {"name": choice["name"]}}))
        }
        _ => Err(Untranslatable(format!(
            "`tool_choice` of type `{}`",
            kind(choice)
        ))),
    }
}

/// What the answer items are built from.
#[derive(Debug, Default, Clone)]
struct Output {
    /// The model's reasoning, where the chat upstream returns it.
    reasoning: String,
    text: String,
    refusal: String,
    /// Tool calls: call id, name, arguments.
    calls: Vec<(Value, Value, String)>,
}

/// The request fields a Response repeats, as the request gave them (the tools: those the
/// model was offered).
pub fn echo(request: &Value) -> Value {
    let mut echo = Map::new();
    for key in [
        "instructions",
        "max_output_tokens",
        "metadata",
        "parallel_tool_calls",
        "temperature",
        "tool_choice",
        "top_p",
        "user",
    ] {
        if let Some(value) = request.get(key).filter(|v| !v.is_null()) {
            echo.insert(key.into(), value.clone());
        }
    }
    echo.insert("tools".into(), offered_tools(request));
    Value::Object(echo)
}

/// A whole chat completion as a Response, with the request's `echo`.
pub fn from_chat(chat: &Value, echo: &Value) -> Value {
    let message = &chat["choices"][0]["message"];
    let output = Output {
        reasoning: reasoning_of(message).unwrap_or_default().to_owned(),
        text: message["content"].as_str().unwrap_or_default().to_owned(),
        refusal: message["refusal"].as_str().unwrap_or_default().to_owned(),
        calls: message["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| {
                let arguments = c["function"]["arguments"].as_str().unwrap_or("{}");
                (
                    c["id"].clone(),
                    c["function"]["name"].clone(),
                    arguments.to_owned(),
                )
            })
            .collect(),
    };
    let id = response_id(chat["id"].as_str());
    let finish = chat["choices"][0]["finish_reason"].as_str();
    response(&id, (chat, echo), Some((&output, finish, &chat["usage"])))
}

fn response_id(chat_id: Option<&str>) -> String {
    let id = chat_id.unwrap_or_default();
    format!("resp_{}", id.strip_prefix("chatcmpl-").unwrap_or(id))
}

/// A `response` object of a chat answer and the request's echo: in progress (`None`), or
/// done with its output, finish reason and chat usage.
fn response(
    id: &str,
    (chat, echo): (&Value, &Value),
    done: Option<(&Output, Option<&str>, &Value)>,
) -> Value {
    let (status, incomplete, items, usage) = match done {
        None => ("in_progress", Value::Null, Vec::new(), Value::Null),
        Some((output, finish, usage)) => {
            let (status, incomplete) = match finish {
                Some("length") => ("incomplete", json!({"reason": "max_output_tokens"})),
                Some("content_filter") => ("incomplete", json!({"reason": "content_filter"})),
                _ => ("completed", Value::Null),
            };
            (
                status,
                incomplete,
                items(id, output, "completed"),
                responses_usage(usage),
            )
        }
    };
    let mut response = json!({
        "id": id,
        "object": "response",
        "created_at": chat["created"],
        "status": status,
        "error": null,
        "incomplete_details": incomplete,
        "model": chat["model"],
        "output": items,
        "parallel_tool_calls": true,
        "tool_choice": "auto",
        "tools": [],
        "previous_response_id": null,
        "store": false,
        "metadata": {},
        "usage": usage,
    });
    for (key, value) in echo.as_object().into_iter().flatten() {
        response[key] = value.clone();
    }
    response
}

fn items(id: &str, output: &Output, status: &str) -> Vec<Value> {
    let mut items = Vec::new();
    if !output.reasoning.is_empty() {
        items.push(reasoning_item(id, &output.reasoning, status));
    }
    if !output.text.is_empty() || !output.refusal.is_empty() {
        items.push(message_item(id, output, status));
    }
    for (n, (call_id, name, arguments)) in output.calls.iter().enumerate() {
        items.push(call_item((id, n), (call_id, name), arguments, status));
    }
    items
}

/// The model's reasoning as a `reasoning` item, its text whole (no summary: chat has none).
fn reasoning_item(id: &str, reasoning: &str, status: &str) -> Value {
    json!({"type": "reasoning", "id": format!("rs_{id}"), "status": status, "summary": [],
        "content": [{"type": "reasoning_text", "text": reasoning}]})
}

fn message_item(id: &str, output: &Output, status: &str) -> Value {
    let mut content = Vec::new();
    if !output.text.is_empty() {
        content.push(json!({"type": "output_text", "text": output.text, "annotations": []}));
    }
    if !output.refusal.is_empty() {
        content.push(json!({"type": "refusal", "refusal": output.refusal}));
    }
    json!({"type": "message", "id": format!("msg_{id}"), "status": status,
        "role": "assistant", "content": content})
}

/// The `n`th function call item of response `id`, its `call_id` and `name` as the chat
/// answer gave them.
fn call_item(
    (id, n): (&str, usize),
    (call_id, name): (&Value, &Value),
    arguments: &str,
    status: &str,
) -> Value {
    json!({"type": "function_call", "id": format!("fc_{id}_{n}"), "call_id": call_id,
        "name": name, "arguments": arguments, "status": status})
}

fn responses_usage(usage: &Value) -> Value {
    let input = usage["prompt_tokens"].as_u64().unwrap_or(0);
    let output = usage["completion_tokens"].as_u64().unwrap_or(0);
    let cached = usage["prompt_tokens_details"]["cached_tokens"].as_u64();
    let reasoning = usage["completion_tokens_details"]["reasoning_tokens"].as_u64();
    json!({
        "input_tokens": input,
        "input_tokens_details": {"cached_tokens": cached.unwrap_or(0)},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": reasoning.unwrap_or(0)},
        "total_tokens": input + output,
    })
}

/// A chat stream becoming a Responses stream, chunk by chunk.
#[derive(Debug, Default)]
pub struct ResponsesStream {
    /// The request fields every `response` object repeats.
    echo: Value,
    /// The first chunk: id, model and creation time of the whole response.
    head: Option<Value>,
    id: String,
    sequence: u64,
    output: Output,
    /// The open output item: the message (text) or a tool call (its chat index), and its
    /// output index.
    open: Option<(Item, usize)>,
    items: usize,
    finish: Option<String>,
    usage: Value,
    ended: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Item {
    Reasoning,
    Message,
    Call(usize),
}

impl ResponsesStream {
    /// The request fields the `response` objects repeat ([`echo`]), before the first chunk.
    pub fn echo(&mut self, echo: &Value) {
        self.echo = echo.clone();
    }

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
        if let Some(reasoning) = reasoning_of(delta) {
            self.open_item(Item::Reasoning, out);
            self.output.reasoning.push_str(reasoning);
            let (item_id, index) = (format!("rs_{}", self.id), self.items - 1);
            self.emit(
                out,
                json!({"type": "response.reasoning_text.delta", "item_id": item_id,
                "output_index": index, "content_index": 0, "delta": reasoning}),
            );
        }
        if let Some(text) = delta["content"].as_str().filter(|t| !t.is_empty()) {
            self.open_item(Item::Message, out);
            self.output.text.push_str(text);
            let (item_id, index) = (self.message_id(), self.items - 1);
            self.emit(
                out,
                json!({"type": "response.output_text.delta", "item_id": item_id,
                "output_index": index, "content_index": 0, "delta": text, "logprobs": []}),
            );
        }
        if let Some(refusal) = delta["refusal"].as_str().filter(|t| !t.is_empty()) {
            self.output.refusal.push_str(refusal);
        }
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            if call.get("id").is_some_and(|id| !id.is_null()) {
                self.output.calls.push((
                    call["id"].clone(),
                    call["function"]["name"].clone(),
                    String::new(),
                ));
                let n = self.output.calls.len() - 1;
                self.open_item(Item::Call(n), out);
            }
            let Some(n) = self.output.calls.len().checked_sub(1) else {
                continue;
            };
            if let Some(part) = call["function"]["arguments"]
                .as_str()
                .filter(|a| !a.is_empty())
            {
                self.output.calls[n].2.push_str(part);
                let (item_id, index) = (format!("fc_{}_{n}", self.id), self.items - 1);
                self.emit(
                    out,
                    json!({"type": "response.function_call_arguments.delta",
                    "item_id": item_id, "output_index": index, "delta": part}),
                );
            }
        }
        if let Some(finish) = choice["finish_reason"].as_str() {
            self.finish = Some(finish.to_owned());
        }
    }

    /// The closing events, once the chat stream ended.
    pub fn end(&mut self, out: &mut Vec<u8>) {
        if self.ended {
            return;
        }
        self.ended = true;
        self.start(&Value::Null, out);
        self.close_item(out);
        let head = self.head.clone().unwrap_or(Value::Null);
        let done = response(
            &self.id,
            (&head, &self.echo),
            Some((&self.output, self.finish.as_deref(), &self.usage)),
        );
        let name = match done["status"].as_str() {
            Some("incomplete") => "response.incomplete",
            _ => "response.completed",
        };
        self.emit(out, json!({"type": name, "response": done}));
    }

    /// A failure after the stream began, as the Responses `error` event.
    pub fn error(&mut self, body: &Value, out: &mut Vec<u8>) {
        self.ended = true;
        let error = &body["error"];
        self.emit(
            out,
            json!({"type": "error", "code": error["code"],
            "message": error["message"], "param": null}),
        );
    }

    fn start(&mut self, chunk: &Value, out: &mut Vec<u8>) {
        if self.head.is_some() {
            return;
        }
        self.id = response_id(chunk["id"].as_str());
        self.head = Some(chunk.clone());
        let created = response(&self.id, (chunk, &self.echo), None);
        self.emit(
            out,
            json!({"type": "response.created", "response": created}),
        );
        self.emit(
            out,
            json!({"type": "response.in_progress", "response": created}),
        );
    }

    fn message_id(&self) -> String {
        format!("msg_{}", self.id)
    }

    fn open_item(&mut self, item: Item, out: &mut Vec<u8>) {
        if self.open.map(|(i, _)| i) == Some(item) {
            return;
        }
        self.close_item(out);
        let index = self.items;
        self.items += 1;
        self.open = Some((item, index));
        let added = match item {
            Item::Reasoning => {
                json!({"type": "reasoning", "id": format!("rs_{}", self.id),
                "status": "in_progress", "summary": [], "content": []})
            }
            Item::Message => {
                json!({"type": "message", "id": self.message_id(), "status": "in_progress",
                "role": "assistant", "content": []})
            }
            Item::Call(n) => {
                let (call_id, name, _) = &self.output.calls[n];
                call_item((&self.id, n), (call_id, name), "", "in_progress")
            }
        };
        self.emit(
            out,
            json!({"type": "response.output_item.added", "output_index": index, "item": added}),
        );
        if item == Item::Message {
            let item_id = self.message_id();
            self.emit(
                out,
                json!({"type": "response.content_part.added", "item_id": item_id,
                "output_index": index, "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": []}}),
            );
        }
    }

    fn close_item(&mut self, out: &mut Vec<u8>) {
        let Some((item, index)) = self.open.take() else {
            return;
        };
        let done = match item {
            Item::Reasoning => {
                let text = self.output.reasoning.clone();
                self.emit(
                    out,
                    json!({"type": "response.reasoning_text.done",
                    "item_id": format!("rs_{}", self.id), "output_index": index,
                    "content_index": 0, "text": text}),
                );
                reasoning_item(&self.id, &text, "completed")
            }
            Item::Message => {
                let (item_id, text) = (self.message_id(), self.output.text.clone());
                self.emit(
                    out,
                    json!({"type": "response.output_text.done", "item_id": item_id,
                    "output_index": index, "content_index": 0, "text": text, "logprobs": []}),
                );
                self.emit(
                    out,
                    json!({"type": "response.content_part.done", "item_id": item_id,
                    "output_index": index, "content_index": 0,
                    "part": {"type": "output_text", "text": text, "annotations": []}}),
                );
                message_item(&self.id, &self.output, "completed")
            }
            Item::Call(n) => {
                let (call_id, name, arguments) = self.output.calls[n].clone();
                let item_id = format!("fc_{}_{n}", self.id);
                self.emit(
                    out,
                    json!({"type": "response.function_call_arguments.done",
                    "item_id": item_id, "output_index": index, "arguments": arguments}),
                );
                call_item((&self.id, n), (&call_id, &name), &arguments, "completed")
            }
        };
        self.emit(
            out,
            json!({"type": "response.output_item.done", "output_index": index, "item": done}),
        );
    }

    fn emit(&mut self, out: &mut Vec<u8>, mut data: Value) {
        data["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        let name = data["type"].as_str().unwrap_or_default().to_owned();
        event(out, &name, &data);
    }
}

#[cfg(test)]
mod tests;
