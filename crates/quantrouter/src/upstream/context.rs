//! Recognising an upstream's "the prompt does not fit my context" answer, whatever the
//! server: vLLM and SGLang answer 400 with a message about the context length, llama.cpp 400
//! with `exceed_context_size_error`, TGI 422 about `max_new_tokens`, OpenAI-style proxies
//! `context_length_exceeded`. The attempt loop then tries a profile with a larger context,
//! or answers the client in OpenAI's own shape for it.

use std::time::Duration;

use http::{Response, StatusCode};
use http_body_util::{BodyExt, Limited};

use super::UpstreamIncoming;

/// Error answers are small; a larger body is not one worth reading for its message.
const MAX_ERROR_BODY: usize = 64 * 1024;
/// What the client is told of the upstream's message, at most.
const MAX_MESSAGE: usize = 512;

/// Lower-cased phrases that mark an over-long prompt in the servers' error bodies.
const MARKERS: [&str; 5] = [
    // vLLM ("This model's maximum context length is 8192 tokens…"), SGLang ("…longer than
    // the model's context length…").
    "context length",
    // OpenAI and proxies that mimic it.
    "context_length_exceeded",
    // llama.cpp.
    "exceed_context_size_error",
    "available context size",
    // TGI ("`inputs` tokens + `max_new_tokens` must be <= 4096").
    "`max_new_tokens` must be <=",
];

/// An upstream answer looked into.
#[derive(Debug)]
pub enum Checked {
    /// Not an overflow: the answer, its body intact.
    Answer(Response<UpstreamIncoming>),
    /// The prompt does not fit; the upstream's message.
    Overflow(String),
    /// An error answer whose body could not be read in time or in bounds.
    Unreadable(String),
}

/// Passes most answers through untouched; reads the body of the statuses a context
/// overflow comes with (within `timeout`) to tell an overflow from another error.
pub async fn check(response: Response<UpstreamIncoming>, timeout: Duration) -> Checked {
    if !matches!(response.status().as_u16(), 400 | 413 | 422) {
        return Checked::Answer(response);
    }
    let (head, body) = response.into_parts();
    let read = Limited::new(body, MAX_ERROR_BODY).collect();
    let bytes = match tokio::time::timeout(timeout, read).await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) => return Checked::Unreadable(format!("reading an error answer: {e}")),
        Err(_) => return Checked::Unreadable(format!("an error answer took over {timeout:?}")),
    };
    match overflow_message(head.status, &bytes) {
        Some(message) => Checked::Overflow(message),
        None => Checked::Answer(Response::from_parts(
            head,
            UpstreamIncoming::buffered(bytes),
        )),
    }
}

/// The upstream's message when `body` says the prompt exceeds the context.
pub fn overflow_message(status: StatusCode, body: &[u8]) -> Option<String> {
    if !matches!(status.as_u16(), 400 | 413 | 422) {
        return None;
    }
    let text = String::from_utf8_lossy(body);
    let lower = text.to_lowercase();
    if !MARKERS.iter().any(|m| lower.contains(m)) {
        return None;
    }
    let json: Option<serde_json::Value> = serde_json::from_slice(body).ok();
    let message = json
        .as_ref()
        .and_then(|v| {
            v.pointer("/error/message")
                .or_else(|| v.get("message"))
                .or_else(|| v.get("error"))
                .and_then(serde_json::Value::as_str)
        })
        .unwrap_or(&text)
        .trim();
    let mut message: String = message.chars().take(MAX_MESSAGE).collect();
    if message.is_empty() {
        message = "The prompt and max_tokens exceed the model's context length.".to_owned();
    }
    Some(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_each_servers_overflow_and_nothing_else() {
        let bad = StatusCode::BAD_REQUEST;
        let cases: [(StatusCode, &str, &str); 5] = [
            (
                bad,
                r#"{"object":"error","message":"This model's maximum context length is 8192 tokens. However, you requested 9000 tokens.","type":"BadRequestError","param":null,"code":400}"#,
                "This model's maximum context length is 8192 tokens. However, you requested 9000 tokens.",
            ),
            (
                bad,
                r#"{"error":{"code":400,"message":"the request exceeds the available context size, try increasing it","type":"exceed_context_size_error","n_prompt_tokens":9000,"n_ctx":8192}}"#,
                "the request exceeds the available context size, try increasing it",
            ),
            (
                StatusCode::UNPROCESSABLE_ENTITY,
                r#"{"error":"Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096. Given: 5000 `inputs` tokens and 20 `max_new_tokens`","error_type":"validation"}"#,
                "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096. Given: 5000 `inputs` tokens and 20 `max_new_tokens`",
            ),
            (
                bad,
                r#"{"error":{"message":"too long","type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}"#,
                "too long",
            ),
            (bad, "prompt is longer than the model's context length", "prompt is longer than the model's context length"),
        ];
        for (status, body, message) in cases {
            assert_eq!(
                overflow_message(status, body.as_bytes()).as_deref(),
                Some(message),
                "{body}"
            );
        }
        for (status, body) in [
            (bad, r#"{"error":{"message":"temperature must be <= 2"}}"#),
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                r#"{"error":"maximum context length"}"#,
            ),
            (StatusCode::OK, "context length"),
        ] {
            assert_eq!(overflow_message(status, body.as_bytes()), None, "{body}");
        }
        let long = format!("context length {}", "x".repeat(5000));
        assert_eq!(
            overflow_message(bad, long.as_bytes())
                .unwrap()
                .chars()
                .count(),
            MAX_MESSAGE
        );
    }
}
