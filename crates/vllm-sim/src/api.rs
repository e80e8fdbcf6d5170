//! OpenAI/vLLM wire shapes: parsing the few request fields the simulator needs, the response,
//! stream-chunk and error bodies, and the single place errors become HTTP responses.

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use serde::{Deserialize, Serialize};

use crate::body::SimBody;
use crate::generate::{FinishReason, PromptDigest};

/// The final event of every stream, as vLLM sends it.
pub(crate) const DONE_EVENT: &[u8] = b"data: [DONE]\n\n";

/// Which completion API a request came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Endpoint {
    Chat,
    Completion,
    /// Anthropic's Messages API.
    Messages,
    /// OpenAI's Responses API.
    Responses,
}

/// The parts of a completion request that shape the simulated answer.
#[derive(Debug)]
pub(crate) struct CompletionRequest {
    pub(crate) model: Option<String>,
    pub(crate) digest: PromptDigest,
    /// The last user message's text (chat) or the single prompt (completions): what an
    /// eval-set prompt is looked up by.
    pub(crate) user_text: Option<String>,
    /// The prompt as the prefix cache sees it: each message's role and text in order, so a
    /// conversation's next turn starts with the same bytes as the turn before.
    pub(crate) cache_text: String,
    pub(crate) max_tokens: Option<u64>,
    pub(crate) ignore_eos: bool,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
    /// `stream_options.continuous_usage_stats`: the opening chunk carries the prompt's
    /// usage too (vLLM's puts it in every chunk).
    pub(crate) continuous_usage: bool,
    /// The tool the answer calls instead of text (see [`crate::agent_api`]).
    pub(crate) tool: Option<String>,
    /// Responses: the stored response this one continues.
    pub(crate) previous_response_id: Option<String>,
    /// Chat with `continue_final_message`: the words (one token each) of the final assistant
    /// message the answer continues; 0 for a new answer.
    pub(crate) continued: u32,
    /// vLLM's `cache_salt`: the prefix cache shares blocks only between equal salts.
    pub(crate) cache_salt: Option<String>,
}

/// Token counts, as in every OpenAI `usage` object.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct Usage {
    pub(crate) prompt_tokens: u64,
    pub(crate) completion_tokens: u64,
    pub(crate) total_tokens: u64,
}

/// What every response body and stream chunk of one request repeats.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ResponseMeta<'a> {
    pub(crate) endpoint: Endpoint,
    pub(crate) id: &'a str,
    pub(crate) created: u64,
    pub(crate) model: &'a str,
    /// The tool the answer calls, if it calls one.
    pub(crate) tool: Option<&'a str>,
    pub(crate) previous_response_id: Option<&'a str>,
}

/// Everything the simulator answers with an error status.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ApiError {
    #[error("{0}")]
    BadRequest(String),
    #[error("The model `{0}` does not exist.")]
    ModelNotFound(String),
    #[error("Route {0} not found.")]
    RouteNotFound(String),
    #[error("Method not allowed.")]
    MethodNotAllowed,
    #[error("Unauthorized: a valid API key is required.")]
    Unauthorized,
    #[error("Request body is larger than {0} bytes.")]
    PayloadTooLarge(usize),
    #[error("Simulated failure (HTTP {}) injected by vllm-sim.", .status.as_u16())]
    Injected {
        status: StatusCode,
        retry_after_s: Option<u64>,
    },
    #[error("Internal error: {0}")]
    Internal(String),
}

// --- request wire types ---

#[derive(Debug, Deserialize)]
struct ChatRequestWire {
    model: Option<String>,
    messages: Option<Vec<MessageWire>>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    ignore_eos: Option<bool>,
    stream: Option<bool>,
    stream_options: Option<StreamOptionsWire>,
    /// vLLM's chat-template switches: continue the final (assistant) message instead of
    /// starting a new one; the two cannot both be on, and the second is on by default.
    continue_final_message: Option<bool>,
    add_generation_prompt: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct CompletionRequestWire {
    model: Option<String>,
    prompt: Option<PromptWire>,
    max_tokens: Option<u64>,
    ignore_eos: Option<bool>,
    stream: Option<bool>,
    stream_options: Option<StreamOptionsWire>,
}

#[derive(Debug, Deserialize)]
struct MessageWire {
    role: Option<String>,
    content: Option<ContentWire>,
}

impl MessageWire {
    /// The message's text: the string, or its text parts joined.
    fn text(&self) -> String {
        match &self.content {
            Some(ContentWire::Text(text)) => text.clone(),
            Some(ContentWire::Parts(parts)) => parts
                .iter()
                .filter(|part| part.kind == "text")
                .filter_map(|part| part.text.as_deref())
                .collect(),
            None => String::new(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum ContentWire {
    Text(String),
    Parts(Vec<ContentPartWire>),
}

#[derive(Debug, Deserialize)]
struct ContentPartWire {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum PromptWire {
    Text(String),
    Texts(Vec<String>),
}

#[derive(Debug, Deserialize)]
struct StreamOptionsWire {
    include_usage: Option<bool>,
    continuous_usage_stats: Option<bool>,
}

// --- response wire types ---

#[derive(Serialize)]
struct ChatCompletionWire<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: [ChatChoiceWire<'a>; 1],
    usage: Usage,
}

#[derive(Serialize)]
struct ChatChoiceWire<'a> {
    index: u32,
    message: AssistantMessageWire<'a>,
    logprobs: Option<()>,
    finish_reason: FinishReason,
}

#[derive(Serialize)]
struct AssistantMessageWire<'a> {
    role: &'static str,
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<[ToolCallWire<'a>; 1]>,
}

/// A chat tool call, whole or as a stream delta (which adds `index`).
#[derive(Serialize)]
struct ToolCallWire<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    index: Option<u32>,
    id: String,
    #[serde(rename = "type")]
    kind: &'static str,
    function: FunctionWire<'a>,
}

#[derive(Serialize)]
struct FunctionWire<'a> {
    name: &'a str,
    arguments: &'static str,
}

#[derive(Serialize)]
struct TextCompletionWire<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: [TextChoiceWire<'a>; 1],
    usage: Usage,
}

/// A `text_completion` choice, in whole responses and in stream chunks alike.
#[derive(Serialize)]
struct TextChoiceWire<'a> {
    index: u32,
    text: &'a str,
    logprobs: Option<()>,
    finish_reason: Option<FinishReason>,
}

#[derive(Serialize)]
struct ChunkWire<'a, C> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: &'a [C],
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Usage>,
}

#[derive(Serialize)]
struct ChatChunkChoiceWire<'a> {
    index: u32,
    delta: DeltaWire<'a>,
    logprobs: Option<()>,
    finish_reason: Option<FinishReason>,
}

#[derive(Serialize)]
struct DeltaWire<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<[ToolCallWire<'a>; 1]>,
}

#[derive(Serialize)]
struct ErrorEnvelopeWire<'a> {
    error: ErrorWire<'a>,
}

#[derive(Serialize)]
struct ErrorWire<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    param: Option<()>,
    code: u16,
}

#[derive(Serialize)]
struct ModelListWire<'a> {
    object: &'static str,
    data: [ModelWire<'a>; 1],
}

#[derive(Serialize)]
struct ModelWire<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    owned_by: &'static str,
    root: &'a str,
    parent: Option<()>,
}

// === impl Endpoint ===

impl Endpoint {
    pub(crate) fn id_prefix(self) -> &'static str {
        match self {
            Self::Chat => "chatcmpl",
            Self::Completion => "cmpl",
            Self::Messages => "msg",
            Self::Responses => "resp",
        }
    }
}

// === impl CompletionRequest ===

impl CompletionRequest {
    /// Parses a request body; wrong JSON, wrong types and a missing or empty prompt are 400s.
    pub(crate) fn parse(endpoint: Endpoint, body: &[u8]) -> Result<Self, ApiError> {
        let mut request = match endpoint {
            Endpoint::Chat => Self::parse_chat(body),
            Endpoint::Completion => Self::parse_completion(body),
            Endpoint::Messages => crate::agent_api::parse_messages(body),
            Endpoint::Responses => crate::agent_api::parse_responses(body),
        }?;
        request.cache_salt = cache_salt(body)?;
        Ok(request)
    }

    fn parse_chat(body: &[u8]) -> Result<Self, ApiError> {
        let wire: ChatRequestWire = serde_json::from_slice(body).map_err(json_error)?;
        let mut messages = wire
            .messages
            .ok_or_else(|| ApiError::BadRequest("`messages` is required.".to_owned()))?;
        if messages.is_empty() {
            return Err(ApiError::BadRequest(
                "`messages` must not be empty.".to_owned(),
            ));
        }
        // The message to continue is the start of the answer, not part of the prompt: the
        // answer is planned as the uninterrupted one would be, and resumes after its words.
        let continued = match continued_message(
            &wire.continue_final_message,
            &wire.add_generation_prompt,
            &messages,
        )? {
            true => messages.pop().map(|m| m.text()).unwrap_or_default(),
            false => String::new(),
        };
        let mut digest = PromptDigest::new();
        let mut user_text = None;
        let mut cache_text = String::new();
        for message in messages {
            let role = message.role.clone().unwrap_or_default();
            digest.add_marker(&role);
            cache_text.push_str(&role);
            cache_text.push('\n');
            let text = message.content.is_some().then(|| message.text());
            if let Some(text) = &text {
                digest.add_text(text);
            }
            cache_text.push_str(text.as_deref().unwrap_or_default());
            cache_text.push('\n');
            if role == "user" {
                user_text = text;
            }
        }
        let continued_words =
            u32::try_from(continued.split_whitespace().count()).unwrap_or(u32::MAX);
        // The server reads the continued words as prompt, a token each.
        digest.add_tokens(u64::from(continued_words));
        cache_text.push_str(&continued);
        Ok(Self {
            model: wire.model,
            digest,
            user_text,
            cache_text,
            // `max_completion_tokens` is the newer name; vLLM prefers it when both are given.
            max_tokens: validate_max_tokens(wire.max_completion_tokens.or(wire.max_tokens))?,
            ignore_eos: wire.ignore_eos.unwrap_or(false),
            stream: wire.stream.unwrap_or(false),
            include_usage: include_usage(wire.stream_options.as_ref()),
            continuous_usage: wire
                .stream_options
                .as_ref()
                .and_then(|o| o.continuous_usage_stats)
                .unwrap_or(false),
            tool: crate::agent_api::chat_tool(body),
            previous_response_id: None,
            continued: continued_words,
            cache_salt: None,
        })
    }

    fn parse_completion(body: &[u8]) -> Result<Self, ApiError> {
        let wire: CompletionRequestWire = serde_json::from_slice(body).map_err(json_error)?;
        let prompt = wire
            .prompt
            .ok_or_else(|| ApiError::BadRequest("`prompt` is required.".to_owned()))?;
        let mut digest = PromptDigest::new();
        match &prompt {
            PromptWire::Text(text) => digest.add_text(text),
            PromptWire::Texts(texts) if texts.is_empty() => {
                return Err(ApiError::BadRequest(
                    "`prompt` must not be empty.".to_owned(),
                ));
            }
            PromptWire::Texts(texts) => texts.iter().for_each(|text| {
                digest.add_marker("");
                digest.add_text(text);
            }),
        }
        let cache_text = match &prompt {
            PromptWire::Text(text) => text.clone(),
            PromptWire::Texts(texts) => texts.join("\n"),
        };
        let user_text = match prompt {
            PromptWire::Text(text) => Some(text),
            PromptWire::Texts(mut texts) if texts.len() == 1 => texts.pop(),
            PromptWire::Texts(_) => None,
        };
        Ok(Self {
            model: wire.model,
            digest,
            user_text,
            cache_text,
            max_tokens: validate_max_tokens(wire.max_tokens)?,
            ignore_eos: wire.ignore_eos.unwrap_or(false),
            stream: wire.stream.unwrap_or(false),
            include_usage: include_usage(wire.stream_options.as_ref()),
            continuous_usage: false,
            tool: None,
            previous_response_id: None,
            continued: 0,
            cache_salt: None,
        })
    }
}

/// Whether the request continues its final message, as vLLM decides: only with
/// `add_generation_prompt` off, and only an assistant's message.
fn continued_message(
    continue_final: &Option<bool>,
    add_generation_prompt: &Option<bool>,
    messages: &[MessageWire],
) -> Result<bool, ApiError> {
    if *continue_final != Some(true) {
        return Ok(false);
    }
    if add_generation_prompt.unwrap_or(true) {
        return Err(ApiError::BadRequest(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
                .to_owned(),
        ));
    }
    match messages.last().and_then(|m| m.role.as_deref()) {
        Some("assistant") => Ok(true),
        _ => Err(ApiError::BadRequest(
            "`continue_final_message` needs the final message to be the assistant's.".to_owned(),
        )),
    }
}

/// The request's `cache_salt`, which vLLM takes on every generation endpoint and refuses
/// unless it is a non-empty string.
fn cache_salt(body: &[u8]) -> Result<Option<String>, ApiError> {
    #[derive(Deserialize)]
    struct Salted {
        #[serde(default)]
        cache_salt: Option<serde_json::Value>,
    }
    let salted: Salted = serde_json::from_slice(body).map_err(json_error)?;
    match salted.cache_salt {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(salt)) if !salt.is_empty() => Ok(Some(salt)),
        Some(_) => Err(ApiError::BadRequest(
            "Parameter 'cache_salt' must be a non-empty string if provided.".to_owned(),
        )),
    }
}

fn include_usage(options: Option<&StreamOptionsWire>) -> bool {
    options.and_then(|o| o.include_usage).unwrap_or(false)
}

fn validate_max_tokens(max_tokens: Option<u64>) -> Result<Option<u64>, ApiError> {
    match max_tokens {
        Some(0) => Err(ApiError::BadRequest(
            "`max_tokens` must be at least 1, got 0.".to_owned(),
        )),
        other => Ok(other),
    }
}

fn json_error(error: serde_json::Error) -> ApiError {
    use serde_json::error::Category;
    let what = match error.classify() {
        Category::Syntax | Category::Eof | Category::Io => "Malformed JSON body",
        Category::Data => "Invalid request",
    };
    ApiError::BadRequest(format!("{what}: {error}"))
}

// === impl Usage ===

impl Usage {
    pub(crate) fn new(prompt_tokens: u64, completion_tokens: u64) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }
    }
}

// === impl ResponseMeta ===

impl ResponseMeta<'_> {
    /// The complete (non-streamed) response body.
    pub(crate) fn completion_body(
        &self,
        text: &str,
        finish_reason: FinishReason,
        usage: Usage,
    ) -> Result<Vec<u8>, serde_json::Error> {
        match self.endpoint {
            Endpoint::Messages | Endpoint::Responses => serde_json::to_vec(
                &crate::agent_api::whole_body(self, text, finish_reason, usage),
            ),
            Endpoint::Chat => serde_json::to_vec(&ChatCompletionWire {
                id: self.id,
                object: "chat.completion",
                created: self.created,
                model: self.model,
                choices: [ChatChoiceWire {
                    index: 0,
                    message: AssistantMessageWire {
                        role: "assistant",
                        content: self.tool.is_none().then_some(text),
                        tool_calls: self.tool_call(None),
                    },
                    logprobs: None,
                    finish_reason,
                }],
                usage,
            }),
            Endpoint::Completion => serde_json::to_vec(&TextCompletionWire {
                id: self.id,
                object: "text_completion",
                created: self.created,
                model: self.model,
                choices: [TextChoiceWire {
                    index: 0,
                    text,
                    logprobs: None,
                    finish_reason: Some(finish_reason),
                }],
                usage,
            }),
        }
    }

    /// The chat stream's opening event, announcing the assistant role (with `usage` when
    /// asked for continuous usage); `None` for completions, which vLLM streams without one.
    pub(crate) fn role_event(
        &self,
        usage: Option<Usage>,
    ) -> Option<Result<Bytes, serde_json::Error>> {
        let delta = DeltaWire {
            role: Some("assistant"),
            content: Some(""),
            tool_calls: None,
        };
        let choice = [ChatChunkChoiceWire {
            index: 0,
            delta,
            logprobs: None,
            finish_reason: None,
        }];
        (self.endpoint == Endpoint::Chat).then(|| self.event(&choice, usage))
    }

    /// An event carrying one token's text.
    pub(crate) fn token_event(&self, piece: &str) -> Result<Bytes, serde_json::Error> {
        let delta = DeltaWire {
            role: None,
            content: Some(piece),
            tool_calls: None,
        };
        self.choice_event(delta, piece, None)
    }

    /// A chat stream's whole tool call, in one delta.
    pub(crate) fn tool_event(&self) -> Result<Bytes, serde_json::Error> {
        let delta = DeltaWire {
            role: None,
            content: None,
            tool_calls: self.tool_call(Some(0)),
        };
        self.choice_event(delta, "", None)
    }

    fn tool_call(&self, index: Option<u32>) -> Option<[ToolCallWire<'_>; 1]> {
        let name = self.tool?;
        let hex = self.id.rsplit('-').next().unwrap_or(self.id);
        Some([ToolCallWire {
            index,
            id: format!("call_{hex}"),
            kind: "function",
            function: FunctionWire {
                name,
                arguments: crate::agent_api::TOOL_ARGUMENTS,
            },
        }])
    }

    /// The event closing the choice, with an empty delta and the finish reason.
    pub(crate) fn finish_event(
        &self,
        finish_reason: FinishReason,
    ) -> Result<Bytes, serde_json::Error> {
        let delta = DeltaWire {
            role: None,
            content: None,
            tool_calls: None,
        };
        self.choice_event(delta, "", Some(finish_reason))
    }

    /// The usage event sent when `stream_options.include_usage` is set: no choices.
    pub(crate) fn usage_event(&self, usage: Usage) -> Result<Bytes, serde_json::Error> {
        match self.endpoint {
            Endpoint::Chat => self.event::<ChatChunkChoiceWire<'_>>(&[], Some(usage)),
            Endpoint::Completion | Endpoint::Messages | Endpoint::Responses => {
                self.event::<TextChoiceWire<'_>>(&[], Some(usage))
            }
        }
    }

    fn choice_event(
        &self,
        delta: DeltaWire<'_>,
        text: &str,
        finish_reason: Option<FinishReason>,
    ) -> Result<Bytes, serde_json::Error> {
        match self.endpoint {
            Endpoint::Chat => self.event(
                &[ChatChunkChoiceWire {
                    index: 0,
                    delta,
                    logprobs: None,
                    finish_reason,
                }],
                None,
            ),
            Endpoint::Completion | Endpoint::Messages | Endpoint::Responses => self.event(
                &[TextChoiceWire {
                    index: 0,
                    text,
                    logprobs: None,
                    finish_reason,
                }],
                None,
            ),
        }
    }

    fn event<C: Serialize>(
        &self,
        choices: &[C],
        usage: Option<Usage>,
    ) -> Result<Bytes, serde_json::Error> {
        let chunk = ChunkWire {
            id: self.id,
            object: match self.endpoint {
                Endpoint::Chat => "chat.completion.chunk",
                Endpoint::Completion | Endpoint::Messages | Endpoint::Responses => {
                    "text_completion"
                }
            },
            created: self.created,
            model: self.model,
            choices,
            usage,
        };
        let mut out = Vec::with_capacity(256);
        out.extend_from_slice(b"data: ");
        serde_json::to_writer(&mut out, &chunk)?;
        out.extend_from_slice(b"\n\n");
        Ok(Bytes::from(out))
    }
}

/// `GET /v1/models`: the one served model.
pub(crate) fn model_list(model: &str, created: u64) -> Result<Vec<u8>, serde_json::Error> {
    serde_json::to_vec(&ModelListWire {
        object: "list",
        data: [ModelWire {
            id: model,
            object: "model",
            created,
            owned_by: "vllm",
            root: model,
            parent: None,
        }],
    })
}

/// A `200 OK` JSON response.
pub(crate) fn json_response(body: impl Into<Bytes>) -> Response<SimBody> {
    let mut response = Response::new(SimBody::full(body));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

// === impl ApiError ===

impl ApiError {
    pub(crate) fn status(&self) -> StatusCode {
        match self {
            Self::BadRequest(_) => StatusCode::BAD_REQUEST,
            Self::ModelNotFound(_) | Self::RouteNotFound(_) => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Injected { status, .. } => *status,
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The OpenAI error `type`, named as the openai Python client names its exceptions.
    fn kind(&self) -> &'static str {
        match self.status() {
            StatusCode::BAD_REQUEST => "BadRequestError",
            StatusCode::UNAUTHORIZED => "AuthenticationError",
            StatusCode::FORBIDDEN => "PermissionDeniedError",
            StatusCode::NOT_FOUND => "NotFoundError",
            StatusCode::UNPROCESSABLE_ENTITY => "UnprocessableEntityError",
            StatusCode::TOO_MANY_REQUESTS => "RateLimitError",
            status if status.is_server_error() => "InternalServerError",
            _ => "APIError",
        }
    }

    /// The one place an error becomes an HTTP response.
    pub(crate) fn into_response(self) -> Response<SimBody> {
        let status = self.status();
        let message = self.to_string();
        let body = serde_json::to_vec(&ErrorEnvelopeWire {
            error: ErrorWire {
                message: &message,
                kind: self.kind(),
                param: None,
                code: status.as_u16(),
            },
        })
        // Serialising a struct of strings and numbers cannot fail; an empty body beats a panic.
        .unwrap_or_default();
        let mut response = json_response(body);
        *response.status_mut() = status;
        if let Self::Injected {
            retry_after_s: Some(seconds),
            ..
        } = self
        {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(endpoint: Endpoint) -> ResponseMeta<'static> {
        ResponseMeta {
            endpoint,
            id: "x-1",
            created: 5,
            model: "m",
            tool: None,
            previous_response_id: None,
        }
    }

    #[test]
    fn chat_content_parts_count_only_text() {
        let with_parts = br#"{"messages":[{"role":"user","content":[{"type":"text","text":"abcdefgh"},{"type":"image_url","image_url":{"url":"data:"}}]}]}"#;
        let plain = br#"{"messages":[{"role":"user","content":"abcdefgh"}]}"#;
        let a = CompletionRequest::parse(Endpoint::Chat, with_parts).unwrap();
        let b = CompletionRequest::parse(Endpoint::Chat, plain).unwrap();
        assert_eq!(a.digest.prompt_tokens(), 2);
        assert_eq!(b.digest.prompt_tokens(), 2);
    }

    #[test]
    fn the_last_user_message_is_the_lookup_text() {
        let body = br#"{"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"first"},{"role":"assistant","content":"ok"},{"role":"user","content":[{"type":"text","text":"sec"},{"type":"text","text":"ond"}]}]}"#;
        let request = CompletionRequest::parse(Endpoint::Chat, body).unwrap();
        assert_eq!(request.user_text.as_deref(), Some("second"));
        let body = br#"{"prompt":["only"]}"#;
        let request = CompletionRequest::parse(Endpoint::Completion, body).unwrap();
        assert_eq!(request.user_text.as_deref(), Some("only"));
    }

    #[test]
    fn max_completion_tokens_wins_over_max_tokens() {
        let body = br#"{"messages":[{"role":"user","content":"x"}],"max_tokens":9,"max_completion_tokens":3}"#;
        let request = CompletionRequest::parse(Endpoint::Chat, body).unwrap();
        assert_eq!(request.max_tokens, Some(3));
    }

    #[test]
    fn rejects_missing_empty_and_mistyped_prompts() {
        for (endpoint, body) in [
            (Endpoint::Chat, &br#"{"model":"m"}"#[..]),
            (Endpoint::Chat, br#"{"messages":[]}"#),
            (Endpoint::Chat, br#"{"messages":"hi"}"#),
            (Endpoint::Completion, br#"{"prompt":[]}"#),
            (Endpoint::Completion, br#"{"prompt":"x","max_tokens":0}"#),
            (Endpoint::Completion, br#"{"prompt":"x""#),
        ] {
            let error = CompletionRequest::parse(endpoint, body).unwrap_err();
            assert_eq!(error.status(), StatusCode::BAD_REQUEST, "{error}");
        }
    }

    #[test]
    fn chunks_are_sse_events_with_vllm_objects() {
        let event = meta(Endpoint::Chat).token_event(" hi").unwrap();
        let text = std::str::from_utf8(&event).unwrap();
        assert!(text.starts_with("data: {") && text.ends_with("}\n\n"));
        assert!(text.contains(r#""object":"chat.completion.chunk""#));
        assert!(text.contains(r#""delta":{"content":" hi"}"#));
        let finish = meta(Endpoint::Completion)
            .finish_event(FinishReason::Length)
            .unwrap();
        let text = std::str::from_utf8(&finish).unwrap();
        assert!(text.contains(
            r#""choices":[{"index":0,"text":"","logprobs":null,"finish_reason":"length"}]"#
        ));
        assert!(meta(Endpoint::Completion).role_event(None).is_none());
    }

    #[test]
    fn injected_errors_carry_retry_after() {
        let response = ApiError::Injected {
            status: StatusCode::TOO_MANY_REQUESTS,
            retry_after_s: Some(3),
        }
        .into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()[header::RETRY_AFTER], "3");
    }
}
