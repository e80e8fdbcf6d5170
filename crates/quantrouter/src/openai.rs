//! OpenAI wire types — only the fields routing needs — and the one place errors become HTTP.
//!
//! The request body is parsed once, borrowing from the received bytes. Everything not named
//! here is ignored by the parser and forwarded upstream byte for byte; only the value of
//! `model` is replaced (see [`ParsedRequest::rewrite_model`]).

use std::borrow::Cow;
use std::ops::Range;

use bytes::{Bytes, BytesMut};
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::Full;
use quantrouter_policy::{AnswerChoice, Prompt, Role, Segment};
use serde::Deserialize;
use serde_json::value::RawValue;

/// The generation endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
    /// Anthropic Messages (see [`crate::apis`]).
    Messages,
    /// OpenAI Responses (see [`crate::apis`]).
    Responses,
}

impl Endpoint {
    /// The generation endpoint served at `path`, if it is one.
    pub fn of_path(path: &str) -> Option<Self> {
        match path {
            "/v1/chat/completions" => Some(Endpoint::Chat),
            "/v1/completions" => Some(Endpoint::Completions),
            "/v1/messages" => Some(Endpoint::Messages),
            "/v1/responses" => Some(Endpoint::Responses),
            _ => None,
        }
    }

    /// The API path, the same upstream as here.
    pub const fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
            Endpoint::Messages => "/v1/messages",
            Endpoint::Responses => "/v1/responses",
        }
    }
}

/// What routing needs from a request, borrowing from the body.
#[derive(Debug)]
pub struct ParsedRequest<'a> {
    pub model: Cow<'a, str>,
    /// Byte range of the `model` value (including quotes) in the body.
    model_span: Range<usize>,
    /// Text parts in request order; owned only where JSON escapes had to be decoded.
    texts: Vec<(Role, Cow<'a, str>)>,
    pub wants_json: bool,
    pub max_tokens: Option<u32>,
    /// Byte range of the output limit's value (`max_tokens`, `max_completion_tokens` or
    /// `max_output_tokens`, the one `max_tokens` came from) in the body.
    max_tokens_span: Option<Range<usize>>,
    /// Bytes of the tool definitions (`tools`, `functions`): the model reads them too.
    pub tools_bytes: usize,
    /// Choices asked for (`n`, at least 1): each may generate up to `max_tokens`.
    pub choices: u32,
    /// The request offers tools or functions (`tools`, `tool_choice`, `functions`,
    /// `function_call`): its answer may be a call that has effects when run.
    pub offers_tools: bool,
    pub stream: bool,
    pub user: Option<Cow<'a, str>>,
    /// The client sent `stream_options` (so the router leaves it alone).
    pub has_stream_options: bool,
    /// The API the request came through.
    pub endpoint: Endpoint,
    /// Responses: the stored response this request continues.
    pub previous_response_id: Option<Cow<'a, str>>,
    /// The client's `cache_salt` (vLLM's KV-cache salt) and the byte range of its value.
    cache_salt: Option<(Cow<'a, str>, Range<usize>)>,
}

/// A request the router answers itself, with an OpenAI-shaped error.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{message}")]
    InvalidRequest {
        message: String,
        param: Option<String>,
    },
    #[error("Incorrect API key provided.")]
    Unauthorized,
    #[error("The model `{0}` does not exist.")]
    ModelNotFound(String),
    #[error("Unknown request URL: {0}.")]
    RouteNotFound(String),
    #[error("Method not allowed.")]
    MethodNotAllowed,
    /// A stored Responses answer the router cannot place (unknown, expired, or stored
    /// through another replica without shared Redis).
    #[error("No stored response with id `{0}` is known to this router.")]
    ResponseNotFound(String),
    #[error("Request body is larger than the limit of {limit} bytes.")]
    PayloadTooLarge { limit: usize },
    #[error("Content-Type must be application/json.")]
    UnsupportedMediaType,
    /// The prompt (with `max_tokens`) does not fit the context of any profile that could
    /// serve it; the message is the upstream's.
    #[error("{0}")]
    ContextLengthExceeded(String),
    #[error("The upstream answered with an invalid response: {0}")]
    BadGateway(String),
    #[error("No healthy profile can serve this request: {0}")]
    Unavailable(String),
    /// The tenant may use no profile of the active set: a configuration error that no
    /// retry mends.
    #[error("{0}")]
    NoAllowedProfile(String),
    #[error("The request did not complete within its deadline: {0}")]
    Timeout(String),
    #[error("Profile {profile} is at capacity: {reason}. Retry after {retry_after_s} s.")]
    Overloaded {
        profile: String,
        reason: String,
        retry_after_s: u32,
    },
    /// The tenant is at a hard limit: a rate (`rate_limit_exceeded`) or a budget
    /// (`insufficient_quota`).
    #[error(transparent)]
    LimitReached(#[from] LimitReached),
}

/// A request refused at a tenant's hard limit: 429 with the limit's OpenAI code. The tenant
/// gate refuses; the error is defined here so that this module depends on no tenant code.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
#[error("{}", limit_message(*limit, *retry_after_s, rate))]
pub struct LimitReached {
    pub limit: quantrouter_policy::limits::LimitKind,
    pub retry_after_s: u64,
    /// The `x-ratelimit-*` values the refusal carries.
    pub rate: quantrouter_policy::limits::RateHeaders,
}

impl LimitReached {
    /// OpenAI's error `type` and `code`: rates can be retried shortly, budgets not.
    pub fn kind(&self) -> (&'static str, &'static str) {
        use quantrouter_policy::limits::LimitKind;
        match self.limit {
            LimitKind::Requests | LimitKind::Tokens => ("rate_limit_error", self.limit.code()),
            LimitKind::BudgetPerDay | LimitKind::BudgetPerMonth => {
                ("insufficient_quota", self.limit.code())
            }
        }
    }
}

/// Adds OpenAI's `x-ratelimit-*` headers of the tenant's rate limits (none it lacks).
pub fn insert_rate_headers(
    headers: &mut http::HeaderMap,
    rate: &quantrouter_policy::limits::RateHeaders,
) {
    for (name, value) in rate.pairs() {
        if let Ok(value) = HeaderValue::from_str(&value) {
            headers.insert(http::HeaderName::from_static(name), value);
        }
    }
}

fn limit_message(
    limit: quantrouter_policy::limits::LimitKind,
    retry_after_s: u64,
    rate: &quantrouter_policy::limits::RateHeaders,
) -> String {
    use quantrouter_policy::limits::LimitKind;
    let of = |state: Option<quantrouter_policy::limits::RateState>| {
        state.map_or_else(String::new, |s| format!(" (limit {})", s.limit))
    };
    match limit {
        LimitKind::Requests => format!(
            "Rate limit reached for requests per minute{}. Retry after {retry_after_s} s.",
            of(rate.requests)
        ),
        LimitKind::Tokens => format!(
            "Rate limit reached for tokens per minute{}. Retry after {retry_after_s} s.",
            of(rate.tokens)
        ),
        LimitKind::BudgetPerDay => {
            format!("You exceeded your daily budget; it resets in {retry_after_s} s.")
        }
        LimitKind::BudgetPerMonth => {
            format!("You exceeded your monthly budget; it resets in {retry_after_s} s.")
        }
    }
}

#[derive(Deserialize)]
struct WireRequest<'a> {
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
    #[serde(borrow, default)]
    messages: Option<Vec<WireMessage<'a>>>,
    #[serde(borrow, default)]
    prompt: Option<WirePrompt<'a>>,
    #[serde(borrow, default)]
    max_tokens: Option<&'a RawValue>,
    #[serde(borrow, default)]
    max_completion_tokens: Option<&'a RawValue>,
    #[serde(default)]
    n: Option<Lenient>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(borrow, default)]
    response_format: Option<WireResponseFormat<'a>>,
    #[serde(borrow, default)]
    user: Option<Cow<'a, str>>,
    #[serde(default)]
    stream_options: Option<serde::de::IgnoredAny>,
    /// Messages: the system prompt, a string or text blocks.
    #[serde(borrow, default)]
    system: Option<WireContent<'a>>,
    /// Responses: the system prompt.
    #[serde(borrow, default)]
    instructions: Option<Cow<'a, str>>,
    /// Responses: a string or input items.
    #[serde(borrow, default)]
    input: Option<TextOr<'a, WireItem<'a>>>,
    #[serde(borrow, default)]
    max_output_tokens: Option<&'a RawValue>,
    /// Responses: `text.format` is its `response_format`.
    #[serde(borrow, default)]
    text: Option<WireTextConfig<'a>>,
    #[serde(borrow, default)]
    previous_response_id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    cache_salt: Option<&'a RawValue>,
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
    #[serde(default)]
    tool_choice: Option<serde::de::IgnoredAny>,
    #[serde(borrow, default)]
    functions: Option<&'a RawValue>,
    #[serde(default)]
    function_call: Option<serde::de::IgnoredAny>,
}

/// A Responses input item: a message (`role`, `content`) or another item, of which a tool's
/// result (`function_call_output`, with `output`) is context.
#[derive(Deserialize)]
struct WireItem<'a> {
    #[serde(borrow, default)]
    role: Option<Cow<'a, str>>,
    #[serde(rename = "type", borrow, default)]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<WireContent<'a>>,
    #[serde(borrow, default)]
    output: Option<TextOr<'a, WireText<'a>>>,
}

#[derive(Deserialize)]
struct WireTextConfig<'a> {
    #[serde(borrow, default)]
    format: Option<WireResponseFormat<'a>>,
}

/// A block with text, if any.
#[derive(Deserialize)]
struct WireText<'a> {
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
}

/// A field only counted on, never checked: a number, or anything else (left to the upstream
/// to refuse).
#[derive(Deserialize)]
#[serde(untagged)]
enum Lenient {
    Number(f64),
    Other(serde::de::IgnoredAny),
}

#[derive(Deserialize)]
struct WireMessage<'a> {
    #[serde(borrow)]
    role: Cow<'a, str>,
    #[serde(borrow, default)]
    content: Option<WireContent<'a>>,
}

/// A message's `content`: a string or an array of content parts.
type WireContent<'a> = TextOr<'a, WirePart<'a>>;

/// A content part; images and audio carry no `text` and are ignored for scoring. An
/// Anthropic `tool_result` block carries its text in `content`.
#[derive(Deserialize)]
struct WirePart<'a> {
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(rename = "type", borrow, default)]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<TextOr<'a, WireText<'a>>>,
}

/// A completion `prompt`: a string or an array of strings.
type WirePrompt<'a> = TextOr<'a, Cow<'a, str>>;

/// A JSON string or an array of `T`, told apart by the value's first token. (serde's
/// `untagged` enums buffer the whole value first and then try each variant: that cost a
/// quarter of the request's parse.)
enum TextOr<'a, T> {
    Text(Cow<'a, str>),
    Items(Vec<T>),
}

impl<'de: 'a, 'a, T: Deserialize<'de>> Deserialize<'de> for TextOr<'a, T> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct TextOrVisitor<'a, T>(std::marker::PhantomData<(&'a (), T)>);

        impl<'de: 'a, 'a, T: Deserialize<'de>> serde::de::Visitor<'de> for TextOrVisitor<'a, T> {
            type Value = TextOr<'a, T>;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string or an array")
            }

            fn visit_borrowed_str<E>(self, text: &'de str) -> Result<Self::Value, E> {
                Ok(TextOr::Text(Cow::Borrowed(text)))
            }

            fn visit_str<E>(self, text: &str) -> Result<Self::Value, E> {
                Ok(TextOr::Text(Cow::Owned(text.to_owned())))
            }

            fn visit_string<E>(self, text: String) -> Result<Self::Value, E> {
                Ok(TextOr::Text(Cow::Owned(text)))
            }

            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Self::Value, A::Error> {
                let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
                while let Some(item) = seq.next_element()? {
                    items.push(item);
                }
                Ok(TextOr::Items(items))
            }
        }

        deserializer.deserialize_any(TextOrVisitor(std::marker::PhantomData))
    }
}

#[derive(Deserialize)]
struct WireResponseFormat<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
}

// === impl ParsedRequest ===

impl<'a> ParsedRequest<'a> {
    /// Parses and validates a request body for `endpoint`.
    pub fn parse(body: &'a [u8], endpoint: Endpoint) -> Result<Self, ApiError> {
        Self::parse_for(body, endpoint, false)
    }

    /// Parses a Messages body to count its tokens (`/v1/messages/count_tokens`), which
    /// sets no `max_tokens`.
    pub fn parse_to_count(body: &'a [u8]) -> Result<Self, ApiError> {
        Self::parse_for(body, Endpoint::Messages, true)
    }

    fn parse_for(body: &'a [u8], endpoint: Endpoint, counting: bool) -> Result<Self, ApiError> {
        // JSON text is UTF-8 (RFC 8259 §8.1), also inside the fields the parser skips without
        // looking, which are forwarded as they are. One pass checks it all; parsing from a
        // `str` then skips the per-string check.
        let text = std::str::from_utf8(body).map_err(|e| ApiError::InvalidRequest {
            message: format!(
                "request body is not valid UTF-8 (invalid byte at offset {})",
                e.valid_up_to()
            ),
            param: None,
        })?;
        // serde would accept a JSON array as a struct in sequence form; requests are objects.
        if text.trim_start().as_bytes().first() != Some(&b'{') {
            let message = match serde_json::from_str::<serde::de::IgnoredAny>(text) {
                Ok(_) => "request body must be a JSON object".to_owned(),
                Err(e) => format!("request body is not valid JSON: {e}"),
            };
            return Err(ApiError::InvalidRequest {
                message,
                param: None,
            });
        }
        // The plain deserializer first; only a failure pays for tracking the JSON path.
        // Nothing but whitespace may follow the object (`end`): bytes after it would be
        // forwarded upstream unseen.
        let de = &mut serde_json::Deserializer::from_str(text);
        let wire = match WireRequest::deserialize(&mut *de) {
            Ok(wire) if de.end().is_ok() => wire,
            _ => {
                let de = &mut serde_json::Deserializer::from_str(text);
                let wire = serde_path_to_error::deserialize::<_, WireRequest<'a>>(&mut *de)
                    .map_err(wire_error)?;
                de.end().map_err(|e| ApiError::InvalidRequest {
                    message: format!("request body is not valid JSON: {e}"),
                    param: None,
                })?;
                wire
            }
        };
        let raw_model = wire
            .model
            .ok_or_else(|| invalid("you must provide a model parameter", "model"))?;
        let model: Cow<'a, str> = serde_json::from_str(raw_model.get())
            .map_err(|_| invalid("model must be a string", "model"))?;
        let model_span = span_in(body, raw_model);
        let cache_salt = match wire.cache_salt {
            Some(raw) => {
                let salt: Cow<'a, str> = serde_json::from_str(raw.get())
                    .map_err(|_| invalid("cache_salt must be a string", "cache_salt"))?;
                Some((salt, span_in(body, raw)))
            }
            None => None,
        };

        let (max_tokens, max_tokens_span) = output_limit(&wire, body, endpoint, counting)?;
        if let Some(t) = wire.temperature {
            if !(0.0..=2.0).contains(&t) {
                return Err(invalid(
                    "temperature must be between 0 and 2",
                    "temperature",
                ));
            }
        }
        if let Some(p) = wire.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(invalid("top_p must be in (0, 1]", "top_p"));
            }
        }
        let format = wire
            .response_format
            .as_ref()
            .or(wire.text.as_ref().and_then(|t| t.format.as_ref()));
        let wants_json = format.is_some_and(|f| f.kind == "json_object" || f.kind == "json_schema");
        let texts = match endpoint {
            Endpoint::Chat => chat_texts(wire.messages)?,
            Endpoint::Completions => prompt_texts(wire.prompt)?,
            Endpoint::Messages => {
                let mut texts = Vec::new();
                push_content(&mut texts, Role::System, wire.system);
                texts.extend(chat_texts(wire.messages)?);
                texts
            }
            Endpoint::Responses => input_texts(wire.instructions, wire.input)?,
        };
        Ok(Self {
            model,
            model_span,
            texts,
            wants_json,
            max_tokens,
            max_tokens_span,
            tools_bytes: [wire.tools, wire.functions]
                .iter()
                .flatten()
                .map(|raw| raw.get().len())
                .sum(),
            // `as` saturates; NaN is 0, then 1.
            choices: match wire.n {
                Some(Lenient::Number(n)) => (n as u32).max(1),
                _ => 1,
            },
            offers_tools: wire.tools.is_some()
                || wire.tool_choice.is_some()
                || wire.functions.is_some()
                || wire.function_call.is_some(),
            stream: wire.stream.unwrap_or(false),
            user: wire.user,
            has_stream_options: wire.stream_options.is_some(),
            endpoint,
            previous_response_id: wire.previous_response_id,
            cache_salt,
        })
    }

    /// The client's `cache_salt`, if it sent one.
    pub fn cache_salt(&self) -> Option<&str> {
        self.cache_salt.as_ref().map(|(salt, _)| salt.as_ref())
    }

    /// The prompt as the policy sees it, borrowing from this request.
    pub fn prompt(&self) -> Prompt<'_> {
        Prompt {
            segments: self
                .texts
                .iter()
                .map(|(role, text)| Segment { role: *role, text })
                .collect(),
            wants_json: self.wants_json,
        }
    }

    /// The router asks upstream for a usage chunk the client did not ask for (and strips
    /// it from the stream): a stream without `stream_options`.
    pub fn adds_usage(&self) -> bool {
        // Messages and Responses streams always report usage.
        let chat_api = matches!(self.endpoint, Endpoint::Chat | Endpoint::Completions);
        chat_api && self.stream && !self.has_stream_options
    }

    /// The body for upstream: see [`BodyRewrite::apply`].
    pub fn upstream_body(&self, body: &Bytes, model_json: &str, edits: BodyEdits<'_>) -> Bytes {
        self.rewrite().apply(body, model_json, edits)
    }

    /// What [`Self::upstream_body`] changes in the body, owned: for the phases after routing,
    /// which keep the body but not its parse.
    pub fn rewrite(&self) -> BodyRewrite {
        BodyRewrite {
            model_span: self.model_span.clone(),
            add_usage: self.adds_usage(),
            cache_salt_span: self.cache_salt.as_ref().map(|(_, span)| span.clone()),
            max_tokens: self.max_tokens,
            max_tokens_span: self.max_tokens_span.clone(),
        }
    }
}

/// Where a parsed body's `model`, `cache_salt` and output limit are, and whether a usage
/// chunk is asked for: all it takes to write the body a profile is sent.
#[derive(Debug, Clone)]
pub struct BodyRewrite {
    /// Byte range of the `model` value (including quotes) in the body.
    model_span: Range<usize>,
    /// `"stream_options":{"include_usage":true}` goes in ([`ParsedRequest::adds_usage`]).
    add_usage: bool,
    /// Byte range of the client's `cache_salt` value, if it sent one.
    cache_salt_span: Option<Range<usize>>,
    /// The client's output limit, and the byte range of its value.
    max_tokens: Option<u32>,
    max_tokens_span: Option<Range<usize>>,
}

impl BodyRewrite {
    /// The body for upstream, with the few edits routing makes and every other byte
    /// unchanged (no copy when nothing changes): `model` set to `model_json` (an already
    /// JSON-encoded string); for a stream without `stream_options`,
    /// `"stream_options":{"include_usage":true}` added first, so token counts arrive; the
    /// output limit lowered to `edits.ceiling` when it is above (an upstream refuses a limit
    /// its context cannot hold); and `edits.cache_salt` set, replacing the client's. `body`
    /// is the one this rewrite was parsed from.
    pub fn apply(&self, body: &Bytes, model_json: &str, edits: BodyEdits<'_>) -> Bytes {
        const USAGE: &[u8] = br#""stream_options":{"include_usage":true},"#;
        // Parsing succeeded, so the first non-space byte is the object's `{`.
        let open = body.iter().position(|b| *b == b'{').map_or(0, |i| i + 1);
        // At most four splices, kept on the stack: the usage option, the salt, the limit,
        // the model.
        let mut splices: [(Range<usize>, &[u8]); 4] = Default::default();
        let mut count = 0;
        if self.add_usage {
            splices[count] = (open..open, USAGE);
            count += 1;
        }
        let salt_json = edits
            .cache_salt
            .map(|salt| serde_json::Value::from(salt).to_string());
        let salt_field;
        match (&salt_json, &self.cache_salt_span) {
            (Some(json), Some(span)) => {
                splices[count] = (span.clone(), json.as_bytes());
                count += 1;
            }
            (Some(json), None) => {
                salt_field = format!(r#""cache_salt":{json},"#);
                splices[count] = (open..open, salt_field.as_bytes());
                count += 1;
            }
            (None, _) => {}
        }
        let lowered = match (edits.ceiling, self.max_tokens, &self.max_tokens_span) {
            (Some(ceiling), Some(limit), Some(span)) if ceiling < limit => {
                Some((span.clone(), ceiling.to_string()))
            }
            _ => None,
        };
        if let Some((span, digits)) = &lowered {
            splices[count] = (span.clone(), digits.as_bytes());
            count += 1;
        }
        let span = self.model_span.clone();
        if body[span.clone()] != *model_json.as_bytes() {
            splices[count] = (span, model_json.as_bytes());
            count += 1;
        }
        let splices = &mut splices[..count];
        if splices.is_empty() {
            return body.clone();
        }
        // Stable: what is inserted at the same place keeps its order.
        splices.sort_by_key(|(range, _)| range.start);
        let added: usize = splices.iter().map(|(_, with)| with.len()).sum();
        let mut out = BytesMut::with_capacity(body.len() + added);
        let mut from = 0;
        for (range, with) in splices.iter() {
            out.extend_from_slice(&body[from..range.start]);
            out.extend_from_slice(with);
            from = range.end;
        }
        out.extend_from_slice(&body[from..]);
        out.freeze()
    }

    /// Whether a usage chunk the client did not ask for is added (and must be cut from the
    /// stream on its way back).
    pub fn adds_usage(&self) -> bool {
        self.add_usage
    }

    /// Asks for no usage chunk: for a door that cannot cut it from the stream.
    pub fn without_usage(self) -> Self {
        Self {
            add_usage: false,
            ..self
        }
    }

    /// The `model` the client named, decoded from `body` (the one this was parsed from).
    pub fn model(&self, body: &[u8]) -> String {
        body.get(self.model_span.clone())
            .and_then(|raw| serde_json::from_slice(raw).ok())
            .unwrap_or_default()
    }
}

/// What routing changes in a request's body on its way to one profile
/// ([`ParsedRequest::upstream_body`]); the default changes nothing but `model`.
#[derive(Debug, Clone, Copy, Default)]
pub struct BodyEdits<'e> {
    /// The output limit that profile's context holds, when the request's is only a ceiling
    /// (`policy.output_ceiling`) and above it.
    pub ceiling: Option<u32>,
    /// The tenant's KV-cache salt (`prefix_cache: "isolated"`), replacing the client's.
    pub cache_salt: Option<&'e str>,
}

/// The byte range of a value borrowed from `body`.
fn span_in(body: &[u8], raw: &RawValue) -> Range<usize> {
    let start = raw.get().as_ptr() as usize - body.as_ptr() as usize;
    start..start + raw.get().len()
}

type Texts<'a> = Vec<(Role, Cow<'a, str>)>;

fn chat_texts<'a>(messages: Option<Vec<WireMessage<'a>>>) -> Result<Texts<'a>, ApiError> {
    let messages = messages.ok_or_else(|| invalid("messages is required", "messages"))?;
    if messages.is_empty() {
        return Err(invalid(
            "messages must contain at least one message",
            "messages",
        ));
    }
    let mut segments = Vec::with_capacity(messages.len());
    for m in messages {
        let role = match m.role.as_ref() {
            "system" | "developer" => Role::System,
            "user" => Role::User,
            "assistant" => Role::Assistant,
            _ => Role::Other,
        };
        push_content(&mut segments, role, m.content);
    }
    // Messages without text (an image, audio, a tool call) are valid: routing scores what
    // text there is, none included.
    Ok(segments)
}

/// The text of a message's content; a tool's result (Anthropic's `tool_result` block) is
/// context, as a chat `tool` message is.
fn push_content<'a>(segments: &mut Texts<'a>, role: Role, content: Option<WireContent<'a>>) {
    match content {
        Some(TextOr::Text(text)) => segments.push((role, text)),
        Some(TextOr::Items(parts)) => {
            for part in parts {
                if let Some(text) = part.text {
                    segments.push((role, text));
                } else if part.kind.as_deref() == Some("tool_result") {
                    push_texts(segments, Role::Other, part.content);
                }
            }
        }
        None => {}
    }
}

fn push_texts<'a>(segments: &mut Texts<'a>, role: Role, texts: Option<TextOr<'a, WireText<'a>>>) {
    match texts {
        Some(TextOr::Text(text)) => segments.push((role, text)),
        Some(TextOr::Items(items)) => {
            segments.extend(items.into_iter().filter_map(|t| t.text).map(|t| (role, t)));
        }
        None => {}
    }
}

/// Responses: `instructions`, then `input` (a string, or items whose messages are scored by
/// role and whose tool results are context).
fn input_texts<'a>(
    instructions: Option<Cow<'a, str>>,
    input: Option<TextOr<'a, WireItem<'a>>>,
) -> Result<Texts<'a>, ApiError> {
    let mut segments: Texts<'a> = instructions
        .map(|i| (Role::System, i))
        .into_iter()
        .collect();
    match input.ok_or_else(|| invalid("input is required", "input"))? {
        TextOr::Text(text) => segments.push((Role::User, text)),
        TextOr::Items(items) => {
            for item in items {
                let role = match item.role.as_deref() {
                    Some("system" | "developer") => Role::System,
                    Some("user") => Role::User,
                    Some("assistant") => Role::Assistant,
                    _ => Role::Other,
                };
                match item.kind.as_deref() {
                    Some("function_call_output" | "custom_tool_call_output") => {
                        push_texts(&mut segments, Role::Other, item.output);
                    }
                    _ => push_content(&mut segments, role, item.content),
                }
            }
        }
    }
    Ok(segments)
}

fn prompt_texts<'a>(prompt: Option<WirePrompt<'a>>) -> Result<Texts<'a>, ApiError> {
    let mut segments = Vec::new();
    match prompt.ok_or_else(|| invalid("prompt is required", "prompt"))? {
        TextOr::Text(text) => segments.push((Role::User, text)),
        TextOr::Items(texts) => {
            for text in texts {
                segments.push((Role::User, text));
            }
        }
    }
    if segments.iter().all(|(_, text)| text.trim().is_empty()) {
        return Err(invalid("prompt must not be empty", "prompt"));
    }
    Ok(segments)
}

/// The output limit a request sets, and where its value is in `body`: the first of
/// `max_completion_tokens`, `max_tokens` and `max_output_tokens`. Anthropic's Messages API
/// requires `max_tokens`, and so does the router there.
fn output_limit(
    wire: &WireRequest<'_>,
    body: &[u8],
    endpoint: Endpoint,
    counting: bool,
) -> Result<(Option<u32>, Option<Range<usize>>), ApiError> {
    let named = [
        ("max_completion_tokens", wire.max_completion_tokens),
        ("max_tokens", wire.max_tokens),
        ("max_output_tokens", wire.max_output_tokens),
    ];
    if endpoint == Endpoint::Messages && wire.max_tokens.is_none() && !counting {
        return Err(invalid("max_tokens: Field required", "max_tokens"));
    }
    let Some((param, raw)) = named.into_iter().find_map(|(p, raw)| Some((p, raw?))) else {
        return Ok((None, None));
    };
    let n: i64 = serde_json::from_str(raw.get())
        .map_err(|_| invalid(&format!("{param} must be an integer"), param))?;
    if n < 1 {
        return Err(invalid(
            &format!("{param} must be at least 1, got {n}"),
            param,
        ));
    }
    let limit = u32::try_from(n).unwrap_or(u32::MAX);
    Ok((Some(limit), Some(span_in(body, raw))))
}

fn invalid(message: &str, param: &str) -> ApiError {
    ApiError::InvalidRequest {
        message: message.to_owned(),
        param: Some(param.to_owned()),
    }
}

fn wire_error(e: serde_path_to_error::Error<serde_json::Error>) -> ApiError {
    let path = e.path().to_string();
    let inner = e.into_inner();
    match inner.classify() {
        serde_json::error::Category::Syntax | serde_json::error::Category::Eof => {
            ApiError::InvalidRequest {
                message: format!("request body is not valid JSON: {inner}"),
                param: None,
            }
        }
        _ => ApiError::InvalidRequest {
            message: format!("{path}: {inner}"),
            param: Some(path),
        },
    }
}

/// The choices of a non-streamed completion as the answer checks see them, or `None` when
/// the body is not a completion. A choice is its text (`message.content` or `text`), or
/// [`AnswerChoice::NotText`] when it calls a tool or function or refuses: `content` is then
/// `null` (vLLM, OpenAI) or `""` (llama.cpp), and the answer is complete.
pub fn answer_choices(body: &[u8]) -> Option<Vec<AnswerChoice<'_>>> {
    #[derive(Deserialize)]
    struct Completion<'a> {
        #[serde(borrow)]
        choices: Vec<Choice<'a>>,
    }
    #[derive(Deserialize)]
    struct Choice<'a> {
        #[serde(borrow, default)]
        message: Option<Message<'a>>,
        #[serde(borrow, default)]
        text: Option<Cow<'a, str>>,
    }
    #[derive(Deserialize)]
    struct Message<'a> {
        #[serde(borrow, default)]
        content: Option<Cow<'a, str>>,
        #[serde(borrow, default)]
        refusal: Option<Cow<'a, str>>,
        #[serde(default)]
        tool_calls: Option<Vec<serde::de::IgnoredAny>>,
        #[serde(default)]
        function_call: Option<serde::de::IgnoredAny>,
    }
    let Ok(completion) = serde_json::from_slice::<Completion<'_>>(body) else {
        return agent_answer(body).map(|choice| vec![choice]);
    };
    let choices = completion
        .choices
        .into_iter()
        .map(|choice| match choice.message {
            Some(m)
                if m.tool_calls.as_ref().is_some_and(|calls| !calls.is_empty())
                    || m.function_call.is_some()
                    || m.refusal.as_ref().is_some_and(|r| !r.is_empty()) =>
            {
                AnswerChoice::NotText
            }
            Some(m) => AnswerChoice::Text(m.content.unwrap_or_default()),
            None => AnswerChoice::Text(choice.text.unwrap_or_default()),
        });
    Some(choices.collect())
}

/// A whole Anthropic Message or Responses answer as the answer checks see it: its text, or
/// [`AnswerChoice::NotText`] when it calls a tool or refuses.
fn agent_answer(body: &[u8]) -> Option<AnswerChoice<'static>> {
    let answer: serde_json::Value = serde_json::from_slice(body).ok()?;
    let (parts, text_kind) = match (answer["type"].as_str(), answer["object"].as_str()) {
        (Some("message"), _) => (answer["content"].as_array()?.clone(), "text"),
        (_, Some("response")) => {
            let mut parts = Vec::new();
            for item in answer["output"].as_array()? {
                match item["type"].as_str() {
                    Some("message") => parts.extend(item["content"].as_array()?.iter().cloned()),
                    _ => parts.push(item.clone()),
                }
            }
            (parts, "output_text")
        }
        _ => return None,
    };
    let mut text = String::new();
    for part in &parts {
        match part["type"].as_str() {
            Some(kind) if kind == text_kind => text.push_str(part["text"].as_str()?),
            // Reasoning is not the answer; anything else (a tool call, a refusal) is one no
            // text check applies to.
            Some("thinking" | "redacted_thinking" | "reasoning") => {}
            _ => return Some(AnswerChoice::NotText),
        }
    }
    if answer["stop_reason"] == "refusal" {
        return Some(AnswerChoice::NotText);
    }
    Some(AnswerChoice::Text(Cow::Owned(text)))
}

/// A streamed chunk (an SSE event's data) that carries generated output: text, reasoning,
/// a refusal or a tool call, in any choice. Role-only and finish chunks, usage chunks,
/// errors and `[DONE]` carry none.
pub fn carries_output(chunk: &[u8]) -> bool {
    chunk_output(chunk)
        .choices
        .iter()
        .any(ChoiceOutput::generated)
}

/// What a streamed chunk generated, choice by choice.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChunkOutput {
    /// The chunk's choices, in its order.
    pub choices: Vec<ChoiceOutput>,
    /// A tool or function call in any choice, which no text check applies to.
    pub call: bool,
}

/// What a streamed chunk generated for one choice.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChoiceOutput {
    /// The choice's `index` (its position in the chunk when it has none).
    pub index: u32,
    /// Answer text (`delta.content`, or `text` for completions).
    pub text: String,
    /// Output that is not answer text: reasoning, a refusal, a tool or function call.
    pub other: bool,
    /// The chunk carries the choice's `finish_reason`: its text is whole.
    pub finished: bool,
}

impl ChoiceOutput {
    /// Whether the choice generated anything in this chunk.
    pub fn generated(&self) -> bool {
        !self.text.is_empty() || self.other
    }
}

/// The output of a streamed chunk; nothing for a chunk that is not a completion chunk.
pub fn chunk_output(chunk: &[u8]) -> ChunkOutput {
    #[derive(Deserialize)]
    struct Chunk<'a> {
        #[serde(borrow, default)]
        choices: Vec<ChunkChoice<'a>>,
        /// An Anthropic or Responses event.
        #[serde(rename = "type", borrow, default)]
        kind: Option<Cow<'a, str>>,
        #[serde(default)]
        delta: Option<serde_json::Value>,
        #[serde(default)]
        content_block: Option<serde_json::Value>,
        #[serde(default)]
        item: Option<serde_json::Value>,
    }
    #[derive(Deserialize)]
    struct ChunkChoice<'a> {
        #[serde(default)]
        index: Option<u32>,
        #[serde(borrow, default)]
        delta: Option<Delta<'a>>,
        #[serde(borrow, default)]
        text: Option<Cow<'a, str>>,
        #[serde(borrow, default)]
        finish_reason: Option<Cow<'a, str>>,
    }
    #[derive(Deserialize)]
    struct Delta<'a> {
        #[serde(borrow, default)]
        content: Option<Cow<'a, str>>,
        #[serde(borrow, default)]
        reasoning_content: Option<Cow<'a, str>>,
        #[serde(borrow, default)]
        reasoning: Option<Cow<'a, str>>,
        #[serde(borrow, default)]
        refusal: Option<Cow<'a, str>>,
        #[serde(default)]
        tool_calls: Option<Vec<serde::de::IgnoredAny>>,
        #[serde(default)]
        function_call: Option<serde::de::IgnoredAny>,
    }
    let filled = |s: &Option<Cow<'_, str>>| s.as_deref().is_some_and(|s| !s.is_empty());
    let mut output = ChunkOutput::default();
    let Ok(chunk) = serde_json::from_slice::<Chunk<'_>>(chunk) else {
        return output;
    };
    if let Some(kind) = chunk.kind.as_deref() {
        let (choice, call) =
            agent_event_output(kind, &chunk.delta, &chunk.content_block, &chunk.item);
        output.call = call;
        output.choices.push(choice);
        return output;
    }
    for (position, choice) in chunk.choices.iter().enumerate() {
        let mut out = ChoiceOutput {
            index: choice
                .index
                .unwrap_or(u32::try_from(position).unwrap_or(u32::MAX)),
            finished: choice.finish_reason.is_some(),
            ..ChoiceOutput::default()
        };
        if let Some(text) = &choice.text {
            out.text.push_str(text);
        }
        if let Some(d) = &choice.delta {
            if let Some(content) = &d.content {
                out.text.push_str(content);
            }
            let call = d.tool_calls.as_ref().is_some_and(|calls| !calls.is_empty())
                || d.function_call.is_some();
            output.call |= call;
            out.other =
                call || filled(&d.reasoning_content) || filled(&d.reasoning) || filled(&d.refusal);
        }
        output.choices.push(out);
    }
    output
}

/// The output of an Anthropic Messages or Responses stream event, as its one choice, and
/// whether it is a tool call.
fn agent_event_output(
    kind: &str,
    delta: &Option<serde_json::Value>,
    content_block: &Option<serde_json::Value>,
    item: &Option<serde_json::Value>,
) -> (ChoiceOutput, bool) {
    let mut out = ChoiceOutput::default();
    let type_of = |v: &Option<serde_json::Value>| {
        v.as_ref()
            .and_then(|v| v.get("type"))
            .and_then(|t| t.as_str())
            .map(str::to_owned)
    };
    let mut call = false;
    match kind {
        "content_block_delta" => match type_of(delta).as_deref() {
            Some("text_delta") => {
                let text = delta.as_ref().and_then(|d| d["text"].as_str());
                out.text.push_str(text.unwrap_or_default());
            }
            Some("input_json_delta") => call = true,
            _ => out.other = true,
        },
        "content_block_start" if type_of(content_block).as_deref() == Some("tool_use") => {
            call = true;
        }
        "response.output_text.delta" => {
            out.text
                .push_str(delta.as_ref().and_then(|d| d.as_str()).unwrap_or_default());
        }
        "response.function_call_arguments.delta" => call = true,
        "response.output_item.added" if type_of(item).as_deref() == Some("function_call") => {
            call = true;
        }
        "response.refusal.delta"
        | "response.reasoning_text.delta"
        | "response.reasoning_summary_text.delta" => out.other = true,
        // The answer's text is whole: nothing more to hold for.
        "message_delta" | "message_stop" | "response.completed" | "response.incomplete" => {
            out.finished = true;
        }
        _ => {}
    }
    out.other |= call;
    (out, call)
}

/// Token counts from an upstream `usage` object.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub struct Usage {
    /// Anthropic's and Responses' `input_tokens` too.
    #[serde(default, alias = "input_tokens")]
    pub prompt_tokens: u64,
    /// Anthropic's and Responses' `output_tokens` too.
    #[serde(default, alias = "output_tokens")]
    pub completion_tokens: u64,
}

/// The last `"usage": {…}` object in `bytes` (the end of a completion body or stream).
pub fn find_usage(bytes: &[u8]) -> Option<Usage> {
    const KEY: &[u8] = b"\"usage\":";
    let at = bytes.windows(KEY.len()).rposition(|w| w == KEY)?;
    let rest = &bytes[at + KEY.len()..];
    serde_json::Deserializer::from_slice(rest)
        .into_iter::<Option<Usage>>()
        .next()?
        .ok()
        .flatten()
}

/// An SSE event that carries only usage (`"choices":[]`), as sent for `include_usage`.
pub fn is_usage_event(event: &[u8]) -> bool {
    if find_usage(event).is_none() {
        return false;
    }
    let key = b"\"choices\":";
    let Some(at) = event.windows(key.len()).position(|w| w == key) else {
        return false;
    };
    let rest = event[at + key.len()..].trim_ascii_start();
    rest.starts_with(b"[]")
}

// === impl ApiError ===

impl ApiError {
    /// HTTP status; the only place that decides it.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidRequest { .. } | ApiError::ContextLengthExceeded(_) => {
                StatusCode::BAD_REQUEST
            }
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::NoAllowedProfile(_) => StatusCode::FORBIDDEN,
            ApiError::ModelNotFound(_)
            | ApiError::RouteNotFound(_)
            | ApiError::ResponseNotFound(_) => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::BadGateway(_) => StatusCode::BAD_GATEWAY,
            ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ApiError::Overloaded { .. } | ApiError::LimitReached(_) => {
                StatusCode::TOO_MANY_REQUESTS
            }
        }
    }

    /// OpenAI `type` and `code`; `code` doubles as the low-cardinality metrics label.
    pub fn kind(&self) -> (&'static str, &'static str) {
        match self {
            ApiError::InvalidRequest { .. } => ("invalid_request_error", "invalid_request"),
            ApiError::Unauthorized => ("invalid_request_error", "invalid_api_key"),
            ApiError::NoAllowedProfile(_) => ("permission_error", "no_allowed_profile"),
            ApiError::ModelNotFound(_) => ("invalid_request_error", "model_not_found"),
            ApiError::RouteNotFound(_) => ("invalid_request_error", "unknown_url"),
            ApiError::MethodNotAllowed => ("invalid_request_error", "method_not_allowed"),
            ApiError::ResponseNotFound(_) => ("invalid_request_error", "response_not_found"),
            ApiError::PayloadTooLarge { .. } => ("invalid_request_error", "request_too_large"),
            ApiError::UnsupportedMediaType => ("invalid_request_error", "unsupported_media_type"),
            ApiError::ContextLengthExceeded(_) => {
                ("invalid_request_error", "context_length_exceeded")
            }
            ApiError::BadGateway(_) => ("upstream_error", "bad_gateway"),
            ApiError::Unavailable(_) => ("server_error", "no_healthy_profile"),
            ApiError::Timeout(_) => ("timeout_error", "deadline_exceeded"),
            ApiError::Overloaded { .. } => ("rate_limit_error", "tier_overloaded"),
            ApiError::LimitReached(limit) => limit.kind(),
        }
    }

    /// The message may quote what the client sent (a field's value, prompt text
    /// included), so it stays out of logs unless prompts may be logged.
    pub fn quotes_request(&self) -> bool {
        matches!(self, ApiError::InvalidRequest { .. })
    }

    /// Raised before the request body is read (so the body may still be on the wire).
    pub fn before_body(&self) -> bool {
        matches!(
            self,
            ApiError::Unauthorized
                | ApiError::UnsupportedMediaType
                | ApiError::PayloadTooLarge { .. }
                | ApiError::MethodNotAllowed
                | ApiError::RouteNotFound(_)
        )
    }

    /// Whether the same request may succeed when sent again: what the `x-should-retry`
    /// header tells Anthropic's and OpenAI's SDKs, which otherwise retry by status alone
    /// (and so retry a wrong key ten times, for minutes).
    pub fn should_retry(&self) -> bool {
        match self {
            ApiError::InvalidRequest { .. }
            | ApiError::Unauthorized
            | ApiError::ModelNotFound(_)
            | ApiError::RouteNotFound(_)
            | ApiError::MethodNotAllowed
            | ApiError::ResponseNotFound(_)
            | ApiError::PayloadTooLarge { .. }
            | ApiError::UnsupportedMediaType
            | ApiError::ContextLengthExceeded(_)
            | ApiError::NoAllowedProfile(_) => false,
            // A budget resets only at the end of its day or month.
            ApiError::LimitReached(limit) => limit.kind().0 == "rate_limit_error",
            ApiError::BadGateway(_)
            | ApiError::Unavailable(_)
            | ApiError::Timeout(_)
            | ApiError::Overloaded { .. } => true,
        }
    }

    /// Seconds a client should wait before retrying, when that is known.
    fn retry_after(&self) -> Option<u32> {
        match self {
            ApiError::Unavailable(_) => Some(1),
            ApiError::Overloaded { retry_after_s, .. } => Some(*retry_after_s),
            ApiError::LimitReached(limit) => {
                Some(u32::try_from(limit.retry_after_s).unwrap_or(u32::MAX))
            }
            _ => None,
        }
    }

    /// The OpenAI-shaped error response.
    pub fn into_response(self) -> Response<Full<Bytes>> {
        let status = self.status();
        let (kind, code) = self.kind();
        let param = match &self {
            ApiError::InvalidRequest { param, .. } => param.clone(),
            ApiError::ContextLengthExceeded(_) => Some("messages".to_owned()),
            _ => None,
        };
        let body = error_body(&self.to_string(), kind, param.as_deref(), Some(code));
        let mut response = Response::new(Full::new(Bytes::from(body.to_string())));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(secs) = self.retry_after() {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        headers.insert(SHOULD_RETRY, should_retry_value(self.should_retry()));
        if let ApiError::LimitReached(limit) = &self {
            insert_rate_headers(headers, &limit.rate);
        }
        response
    }
}

/// Response header: whether a client should send the request again (honoured by the
/// Anthropic and OpenAI SDKs).
pub const SHOULD_RETRY: http::HeaderName = http::HeaderName::from_static("x-should-retry");

pub fn should_retry_value(retry: bool) -> HeaderValue {
    HeaderValue::from_static(if retry { "true" } else { "false" })
}

/// Whether an upstream's error status is worth a client's retry, for an error answer the
/// router relays: what the SDKs retry by default (408, 409, 429 and 5xx), said explicitly;
/// `None` for a success.
pub fn status_should_retry(status: StatusCode) -> Option<bool> {
    match status.as_u16() {
        200..=399 => None,
        408 | 409 | 429 | 500..=599 => Some(true),
        _ => Some(false),
    }
}

/// The OpenAI error object, `{"error": {"message", "type", "param", "code"}}`: the one
/// place it is built, for the router's own errors and the events that end a stream.
pub fn error_body(
    message: &str,
    kind: &str,
    param: Option<&str>,
    code: Option<&str>,
) -> serde_json::Value {
    serde_json::json!({"error": {
        "message": message,
        "type": kind,
        "param": param,
        "code": code,
    }})
}

#[cfg(test)]
mod tests;
