//! The APIs agents speak — Anthropic's Messages (`/v1/messages`) and OpenAI's Responses
//! (`/v1/responses`) — next to chat: which profiles serve them natively, the translation to
//! and from Chat Completions for those that do not ([`messages`], [`responses`]), each API's
//! error shape, and the body that carries an answer back in the client's API ([`relay`]).
//!
//! Translation is pure: JSON in, JSON out. Every field has a rule (`docs/agent-apis.md`):
//! mapped, dropped as a hint that asks nothing of the answer, or — where dropping it would
//! change the answer — refused before anything is sent ([`Untranslatable`], a 400). Hosted
//! tools no chat upstream can run are left out and named in `x-quantrouter-dropped-tools`.

pub mod messages;
pub mod relay;
pub mod responses;
pub mod stored;
mod wire;

use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::Full;
use quantrouter_policy::{ProfileIndex, ProfileSet, UpstreamApi};
use serde_json::{json, Value};

use crate::openai::{ApiError, BodyEdits, Endpoint};

pub use relay::AgentBody;
pub use wire::Untranslatable;
pub(crate) use wire::{
    anthropic_error, chat_functions, check_keys, hosted_tools, joined_text, reasoning_of,
};

/// An agent API the router serves on its public port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentApi {
    Messages,
    Responses,
}

/// An agent-API request, ready for profiles that serve its API and for those that do not.
#[derive(Debug)]
pub struct Translation {
    api: AgentApi,
    /// The request as chat (`model` to be set), when some profile needs it and it has one.
    chat: Option<Value>,
    /// Some profile lacks the API but the request has no chat form: only native profiles
    /// may serve it.
    native_only: bool,
    /// What the relay of a translated answer needs from the request.
    request: Option<Arc<TranslatedRequest>>,
}

/// What the relay of a translated answer needs from the request: the fields a Responses
/// answer echoes and the tools the translation left out.
#[derive(Debug, Default)]
pub struct TranslatedRequest {
    /// Responses: the request fields its answer repeats (`tools`, `tool_choice`, …).
    pub echo: Value,
    /// Tools no chat upstream can run, left out (`x-quantrouter-dropped-tools`).
    pub dropped_tools: Vec<String>,
}

/// A request extension the agent endpoints add, which the forward phase fills once a
/// request has a translation: the relay, created before, reads it when it translates.
#[derive(Debug, Clone, Default)]
pub struct RequestSlot(pub Arc<OnceLock<Arc<TranslatedRequest>>>);

/// Response header: the tools a translated request left out, comma-separated.
pub const DROPPED_TOOLS_HEADER: http::HeaderName =
    http::HeaderName::from_static("x-quantrouter-dropped-tools");

// === impl AgentApi ===

impl AgentApi {
    /// The agent API of an endpoint, if it is one.
    pub fn of(endpoint: Endpoint) -> Option<Self> {
        match endpoint {
            Endpoint::Messages => Some(Self::Messages),
            Endpoint::Responses => Some(Self::Responses),
            Endpoint::Chat | Endpoint::Completions => None,
        }
    }

    /// The `upstream.apis` entry that says a profile serves this API.
    pub fn upstream(self) -> UpstreamApi {
        match self {
            Self::Messages => UpstreamApi::Messages,
            Self::Responses => UpstreamApi::Responses,
        }
    }

    pub fn endpoint(self) -> Endpoint {
        match self {
            Self::Messages => Endpoint::Messages,
            Self::Responses => Endpoint::Responses,
        }
    }

    /// The request as Chat Completions, for `model` (a JSON-encoded string); streams ask for
    /// usage, which the answer's translation reports: in every chunk where the upstream can
    /// (vLLM's `continuous_usage_stats`), so the first event can say the prompt's tokens.
    pub fn to_chat(self, request: &Value, model_json: &str) -> Result<Value, Untranslatable> {
        let mut chat = match self {
            Self::Messages => messages::to_chat(request)?,
            Self::Responses => responses::to_chat(request)?,
        };
        chat["model"] = serde_json::from_str(model_json).unwrap_or(Value::Null);
        if chat.get("stream").and_then(Value::as_bool) == Some(true) {
            chat["stream_options"] = json!({"include_usage": true, "continuous_usage_stats": true});
        }
        Ok(chat)
    }

    /// What the relay needs of a request translated to chat.
    fn translated(self, request: &Value) -> TranslatedRequest {
        match self {
            Self::Messages => TranslatedRequest {
                echo: Value::Null,
                dropped_tools: messages::dropped_tools(request),
            },
            Self::Responses => TranslatedRequest {
                echo: responses::echo(request),
                dropped_tools: responses::dropped_tools(request),
            },
        }
    }

    /// The error body of this API for an OpenAI-shaped error `message` of `kind` (OpenAI's
    /// `type`) and `status`.
    pub fn error_body(
        self,
        status: StatusCode,
        kind: &str,
        code: Option<&str>,
        message: &str,
    ) -> Value {
        match self {
            Self::Messages => anthropic_error(anthropic_error_type(status, kind), message),
            Self::Responses => crate::openai::error_body(message, kind, None, code),
        }
    }
}

// === impl Translation ===

impl Translation {
    /// The translation of a request to `endpoint` for the profiles of `set`; `None` for chat
    /// and completions. A request the chosen profile cannot take natively and that has no
    /// chat form is refused here, before anything is sent.
    pub fn prepare(
        endpoint: Endpoint,
        body: &[u8],
        set: &ProfileSet,
        chosen: ProfileIndex,
    ) -> Result<Option<Self>, ApiError> {
        let Some(api) = AgentApi::of(endpoint) else {
            return Ok(None);
        };
        let lacking = |p: &quantrouter_policy::Profile| !p.upstream.serves(api.upstream());
        if !set.profiles.iter().any(|p| p.enabled && lacking(p)) {
            return Ok(Some(Self {
                api,
                chat: None,
                native_only: false,
                request: None,
            }));
        }
        let request: Value =
            serde_json::from_slice(body).map_err(|e| ApiError::InvalidRequest {
                message: format!("request body is not valid JSON: {e}"),
                param: None,
            })?;
        let chat = api.to_chat(&request, "null").map(|mut chat| {
            // vLLM's KV-cache salt is no field of either API, but a client may send it.
            if let Some(salt) = request.get("cache_salt") {
                chat["cache_salt"] = salt.clone();
            }
            chat
        });
        match chat {
            Ok(chat) => Ok(Some(Self {
                api,
                chat: Some(chat),
                native_only: false,
                request: Some(Arc::new(api.translated(&request))),
            })),
            Err(refused) if lacking(&set.profiles[chosen]) => Err(ApiError::InvalidRequest {
                message: format!("{refused} (profile {})", set.profiles[chosen].id),
                param: None,
            }),
            Err(_) => Ok(Some(Self {
                api,
                chat: None,
                native_only: true,
                request: None,
            })),
        }
    }

    /// Hands the relay what it needs of a translated request, through the request's
    /// [`RequestSlot`] (when the endpoint added one).
    pub fn report(translation: Option<&Self>, extensions: &http::Extensions) {
        let found = translation.and_then(|t| t.request.as_ref());
        if let (Some(request), Some(slot)) = (found, extensions.get::<RequestSlot>()) {
            let _ = slot.0.set(Arc::clone(request));
        }
    }

    /// Only profiles serving the API natively may take the request: no fallback elsewhere.
    pub fn native_only(&self) -> bool {
        self.native_only
    }

    /// The chat body for a profile without the API, with `model_json` (a JSON-encoded
    /// string) and `edits` made (the output limit lowered to the ceiling when it is above,
    /// the tenant's `cache_salt` in place of the client's); `None` for a profile that serves
    /// the API.
    pub fn chat_body(
        &self,
        set: &ProfileSet,
        profile: ProfileIndex,
        model_json: &str,
        edits: BodyEdits<'_>,
    ) -> Option<Bytes> {
        if set.profiles[profile].upstream.serves(self.api.upstream()) {
            return None;
        }
        let mut chat = self.chat.clone()?;
        chat["model"] = serde_json::from_str(model_json).unwrap_or(Value::Null);
        let limit = chat.get("max_tokens").and_then(Value::as_u64);
        if let (Some(ceiling), Some(limit)) = (edits.ceiling, limit) {
            if u64::from(ceiling) < limit {
                chat["max_tokens"] = json!(ceiling);
            }
        }
        if let Some(salt) = edits.cache_salt {
            chat["cache_salt"] = salt.into();
        }
        Some(Bytes::from(chat.to_string()))
    }
}

/// Anthropic's error `type` for a status (its documented list); the OpenAI `type` decides
/// where the status does not.
fn anthropic_error_type(status: StatusCode, kind: &str) -> &'static str {
    match status.as_u16() {
        400 | 405 | 415 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        504 => "timeout_error",
        _ if kind == "invalid_request_error" => "invalid_request_error",
        _ => "api_error",
    }
}

/// The router's own error on `/v1/messages`, in Anthropic's shape: the same status and
/// headers as the OpenAI-shaped one ([`ApiError::into_response`]), another body.
pub fn anthropic_error_response(error: ApiError) -> Response<Full<Bytes>> {
    let status = error.status();
    let (kind, _) = error.kind();
    let body = AgentApi::Messages.error_body(status, kind, None, &error.to_string());
    let mut response = error.into_response();
    *response.body_mut() = Full::new(Bytes::from(body.to_string()));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anthropic_errors_name_anthropics_types() {
        let body = AgentApi::Messages.error_body(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            None,
            "slow down",
        );
        assert_eq!(
            body,
            json!({"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}})
        );
        let unknown = ApiError::RouteNotFound("/v1/nothing".into());
        let response = anthropic_error_response(unknown);
        assert_eq!(response.status(), StatusCode::NOT_FOUND);
    }
}
