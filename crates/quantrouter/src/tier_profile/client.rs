//! Requests to the endpoint being measured: a streamed one timed event by event, and a
//! non-streamed one for its answer. HTTP/1.1 over hyper-util's pooled client, so repeated
//! requests reuse connections as a production client's would.

use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::Deserialize;
use tokio::time::Instant;

use super::sse::{EventInfo, EventSplitter};
use super::stats::StreamSample;

/// A whole (non-streamed) answer larger than this is not a chat completion.
const MAX_ANSWER_BYTES: usize = 8 << 20;
/// Enough of an error body for its message.
const MAX_ERROR_BYTES: usize = 64 << 10;

/// One OpenAI-compatible endpoint and the model to ask for.
#[derive(Debug, Clone)]
pub struct Endpoint {
    /// The URL as given, for reports.
    pub url: String,
    pub model: String,
    chat: Uri,
    authorization: Option<HeaderValue>,
}

/// The HTTP client all requests of a run share.
#[derive(Debug, Clone)]
pub struct TierClient {
    http: Client<HttpConnector, Full<Bytes>>,
}

/// Why one request produced no measurement.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RequestError {
    #[error("cannot connect: {0}")]
    Connect(String),
    #[error("HTTP {status}: {message}")]
    Status { status: u16, message: String },
    #[error("no complete answer in time")]
    Timeout,
    #[error("{0}")]
    Protocol(String),
}

#[derive(Debug, Deserialize)]
struct AnswerWire {
    #[serde(default)]
    choices: Vec<AnswerChoiceWire>,
}

#[derive(Debug, Deserialize)]
struct AnswerChoiceWire {
    message: Option<AnswerMessageWire>,
    text: Option<String>,
}

#[derive(Debug, Deserialize)]
struct AnswerMessageWire {
    content: Option<String>,
}

// === impl Endpoint ===

impl Endpoint {
    /// `url` is the server's base URL, with or without `/v1`; `api_key` is sent as a bearer
    /// token.
    pub fn new(url: &str, model: &str, api_key: Option<&str>) -> Result<Self, String> {
        let uri: Uri = url.parse().map_err(|e| format!("{url}: {e}"))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some("https") => {
                return Err(format!(
                    "{url}: https endpoints are not supported yet; measure a plain-HTTP \
                     address (the service inside the cluster, or `kubectl port-forward`)"
                ))
            }
            _ => return Err(format!("{url}: expected an http:// URL")),
        }
        let authority = uri
            .authority()
            .ok_or_else(|| format!("{url}: no host"))?
            .clone();
        let base = uri.path().trim_end_matches('/');
        let path = if base.ends_with("/v1") {
            format!("{base}/chat/completions")
        } else {
            format!("{base}/v1/chat/completions")
        };
        let chat = Uri::builder()
            .scheme("http")
            .authority(authority)
            .path_and_query(path)
            .build()
            .map_err(|e| format!("{url}: {e}"))?;
        let authorization = api_key
            .map(|key| {
                let mut value = HeaderValue::from_str(&format!("Bearer {}", key.trim()))
                    .map_err(|_| "the API key holds characters a header cannot".to_owned())?;
                value.set_sensitive(true);
                Ok::<_, String>(value)
            })
            .transpose()?;
        Ok(Self {
            url: url.to_owned(),
            model: model.to_owned(),
            chat,
            authorization,
        })
    }

    fn request(&self, body: serde_json::Value) -> Result<Request<Full<Bytes>>, RequestError> {
        let mut builder = Request::post(self.chat.clone())
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::ACCEPT, "application/json, text/event-stream");
        if let Some(value) = &self.authorization {
            builder = builder.header(header::AUTHORIZATION, value.clone());
        }
        builder
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| RequestError::Protocol(e.to_string()))
    }

    /// A chat request for `prompt` at temperature 0, so repeated runs compare like for like.
    fn body(&self, prompt: &str, max_tokens: u32, stream: bool) -> serde_json::Value {
        let mut body = serde_json::json!({
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
        });
        if stream {
            body["stream"] = true.into();
            // The server's own token count, where it sends one.
            body["stream_options"] = serde_json::json!({"include_usage": true});
        }
        body
    }
}

// === impl RequestError ===

impl RequestError {
    /// A short label to count failures by.
    pub fn kind(&self) -> String {
        match self {
            Self::Connect(_) => "connect".to_owned(),
            Self::Status { status, .. } => format!("status_{status}"),
            Self::Timeout => "timeout".to_owned(),
            Self::Protocol(_) => "protocol".to_owned(),
        }
    }
}

// === impl TierClient ===

impl TierClient {
    pub fn new(connect_timeout: Duration) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(connect_timeout));
        // Small requests go out at once; Nagle's delay would count as latency.
        connector.set_nodelay(true);
        Self {
            http: Client::builder(TokioExecutor::new()).build(connector),
        }
    }

    /// Streams one answer, timing it from sending the request to the first event that
    /// carries content (not the response head: some servers send it before prefill) and on
    /// to the last one. Gives up at `until`.
    pub async fn stream(
        &self,
        endpoint: &Endpoint,
        prompt: &str,
        max_tokens: u32,
        until: Instant,
    ) -> Result<StreamSample, RequestError> {
        let request = endpoint.request(endpoint.body(prompt, max_tokens, true))?;
        let timed = async {
            let sent = Instant::now();
            let response = self.send(request).await?;
            let mut body = response.into_body();
            let mut splitter = EventSplitter::default();
            let mut timing = StreamTiming::default();
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|e| RequestError::Protocol(e.to_string()))?;
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                let events = splitter
                    .feed(&data)
                    .map_err(|e| RequestError::Protocol(e.to_string()))?;
                let now = Instant::now();
                for event in events {
                    timing.record(&EventInfo::of(&event), now)?;
                }
            }
            if let Some(event) = splitter.finish() {
                timing.record(&EventInfo::of(&event), Instant::now())?;
            }
            timing.sample(sent)
        };
        tokio::time::timeout_at(until, timed)
            .await
            .map_err(|_| RequestError::Timeout)?
    }

    /// Asks for one whole answer and returns its text.
    pub async fn answer(
        &self,
        endpoint: &Endpoint,
        prompt: &str,
        max_tokens: u32,
        until: Instant,
    ) -> Result<String, RequestError> {
        let request = endpoint.request(endpoint.body(prompt, max_tokens, false))?;
        let whole = async {
            let response = self.send(request).await?;
            let body = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
                .collect()
                .await
                .map_err(|e| RequestError::Protocol(format!("reading the answer: {e}")))?
                .to_bytes();
            let wire: AnswerWire = serde_json::from_slice(&body)
                .map_err(|e| RequestError::Protocol(format!("the answer is not JSON: {e}")))?;
            let choice =
                wire.choices.into_iter().next().ok_or_else(|| {
                    RequestError::Protocol("the answer has no choices".to_owned())
                })?;
            // A tool call or a refusal has no text: an answer that cannot match.
            Ok(choice
                .message
                .and_then(|m| m.content)
                .or(choice.text)
                .unwrap_or_default())
        };
        tokio::time::timeout_at(until, whole)
            .await
            .map_err(|_| RequestError::Timeout)?
    }

    /// Sends a request; a non-2xx answer becomes an error carrying the server's message.
    async fn send(
        &self,
        request: Request<Full<Bytes>>,
    ) -> Result<http::Response<hyper::body::Incoming>, RequestError> {
        let response = self.http.request(request).await.map_err(|e| {
            if e.is_connect() {
                RequestError::Connect(error_chain(&e))
            } else {
                RequestError::Protocol(error_chain(&e))
            }
        })?;
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let body = Limited::new(response.into_body(), MAX_ERROR_BYTES)
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        Err(RequestError::Status {
            status: status.as_u16(),
            message: error_message(status, &body),
        })
    }
}

/// The OpenAI error's `message`, else the start of the body.
fn error_message(status: StatusCode, body: &[u8]) -> String {
    let parsed: Option<serde_json::Value> = serde_json::from_slice(body).ok();
    if let Some(message) = parsed
        .as_ref()
        .and_then(|v| v["error"]["message"].as_str().or(v["message"].as_str()))
    {
        return message.to_owned();
    }
    let text = String::from_utf8_lossy(body);
    let text: String = text.chars().take(200).collect();
    if text.trim().is_empty() {
        status.canonical_reason().unwrap_or("error").to_owned()
    } else {
        text
    }
}

fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(inner) = source {
        text.push_str(": ");
        text.push_str(&inner.to_string());
        source = inner.source();
    }
    text
}

/// When content arrived in one stream, and how many tokens the server counted.
#[derive(Debug, Default)]
struct StreamTiming {
    first: Option<Instant>,
    last: Option<Instant>,
    content_events: u64,
    usage_tokens: Option<u64>,
}

impl StreamTiming {
    fn record(&mut self, event: &EventInfo, at: Instant) -> Result<(), RequestError> {
        if let Some(message) = &event.error {
            return Err(RequestError::Protocol(format!(
                "the stream ended with an error: {message}"
            )));
        }
        if event.has_content {
            self.first.get_or_insert(at);
            self.last = Some(at);
            self.content_events += 1;
        }
        if let Some(tokens) = event.completion_tokens {
            self.usage_tokens = Some(tokens);
        }
        Ok(())
    }

    fn sample(self, sent: Instant) -> Result<StreamSample, RequestError> {
        let (Some(first), Some(last)) = (self.first, self.last) else {
            return Err(RequestError::Protocol(
                "the stream carried no content".to_owned(),
            ));
        };
        Ok(StreamSample {
            ttft: first.duration_since(sent),
            decode: last.duration_since(first),
            output_tokens: self.usage_tokens.unwrap_or(self.content_events),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chat_path_is_added_to_the_base_url_once() {
        for (url, path) in [
            ("http://vllm:8000", "/v1/chat/completions"),
            ("http://vllm:8000/", "/v1/chat/completions"),
            ("http://vllm:8000/v1", "/v1/chat/completions"),
            ("http://gw:80/llm/v1/", "/llm/v1/chat/completions"),
        ] {
            let endpoint = Endpoint::new(url, "m", None).unwrap();
            assert_eq!(endpoint.chat.path(), path, "{url}");
        }
        assert!(Endpoint::new("https://api:443", "m", None)
            .unwrap_err()
            .contains("https"));
        assert!(Endpoint::new("vllm:8000", "m", None).is_err());
        assert!(Endpoint::new("http://vllm:8000", "m", Some("a\nb")).is_err());
    }

    #[test]
    fn errors_carry_the_servers_message() {
        let body = br#"{"error":{"message":"model not found","type":"NotFoundError"}}"#;
        assert_eq!(
            error_message(StatusCode::NOT_FOUND, body),
            "model not found"
        );
        assert_eq!(error_message(StatusCode::BAD_GATEWAY, b""), "Bad Gateway");
        assert_eq!(
            RequestError::Status {
                status: 503,
                message: String::new()
            }
            .kind(),
            "status_503"
        );
    }

    #[test]
    fn a_stream_is_timed_from_its_first_content_event() {
        let sent = Instant::now();
        let mut timing = StreamTiming::default();
        let role = EventInfo::default();
        let token = EventInfo {
            has_content: true,
            ..EventInfo::default()
        };
        timing
            .record(&role, sent + Duration::from_millis(5))
            .unwrap();
        timing
            .record(&token, sent + Duration::from_millis(100))
            .unwrap();
        timing
            .record(&token, sent + Duration::from_millis(130))
            .unwrap();
        let sample = timing.sample(sent).unwrap();
        assert_eq!(sample.ttft, Duration::from_millis(100));
        assert_eq!(sample.decode, Duration::from_millis(30));
        assert_eq!(sample.output_tokens, 2);
        assert!(StreamTiming::default().sample(sent).is_err());
    }
}
