//! The answer to an agent-API request on its way to the client, in the client's API.
//!
//! Which API an answer is in is read from the answer itself, so a request that fell back
//! from a native profile to a translating one (or back) needs no bookkeeping: a chat chunk
//! (`choices`) is translated, an event of the client's API passes as it came, and an
//! OpenAI-shaped error (the router's own, or a chat upstream's) becomes the API's error.
//! A stream is translated event by event as it arrives; a whole answer (small) once read.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::{header, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Either;
use serde_json::Value;

use super::messages::{self, MessagesStream};
use super::responses::{self, ResponsesStream};
use super::AgentApi;
use crate::server::delivery::Relayed;
use crate::server::ResponseBody;
use crate::upstream::{is_event_stream, BodyError};

/// Called with the id of a Responses answer a native upstream stored.
pub type OnStored = Box<dyn FnOnce(String) + Send + Sync>;

/// A whole answer larger than this is passed on untranslated: far above any completion.
const MAX_WHOLE: usize = 16 * 1024 * 1024;

/// An answer relayed in the client's agent API.
pub struct AgentBody {
    inner: Relayed,
    api: AgentApi,
    status: StatusCode,
    sse: bool,
    /// A stream's unfinished event, or a whole answer so far.
    pending: BytesMut,
    translator: Translator,
    /// Chat chunks were seen: the stream's end must be translated too.
    translating: bool,
    on_stored: Option<OnStored>,
    done: bool,
}

enum Translator {
    Messages(MessagesStream),
    Responses(ResponsesStream),
}

/// Wraps a generation answer to an agent-API request. Errors the router answers itself are
/// shaped by the rescue layer; this covers everything that comes through an upstream body.
pub fn relay(
    response: Response<ResponseBody>,
    api: AgentApi,
    on_stored: Option<OnStored>,
) -> Response<ResponseBody> {
    let (mut head, body) = response.into_parts();
    let Either::Right(inner) = body else {
        return Response::from_parts(head, body);
    };
    // The translation changes the length.
    head.headers.remove(header::CONTENT_LENGTH);
    let sse = is_event_stream(&head.headers);
    let translator = match api {
        AgentApi::Messages => Translator::Messages(MessagesStream::default()),
        AgentApi::Responses => Translator::Responses(ResponsesStream::default()),
    };
    let body = AgentBody {
        inner,
        api,
        status: head.status,
        sse,
        pending: BytesMut::new(),
        translator,
        translating: false,
        on_stored,
        done: false,
    };
    Response::from_parts(head, Either::Right(Relayed::Agent(Box::new(body))))
}

impl std::fmt::Debug for AgentBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentBody")
            .field("api", &self.api)
            .field("sse", &self.sse)
            .finish_non_exhaustive()
    }
}

// === impl AgentBody ===

impl AgentBody {
    /// The relayed body underneath (its deadline is the request's).
    pub fn inner(&self) -> &Relayed {
        &self.inner
    }

    /// Complete events of `pending`, translated into `out`.
    fn drain_events(&mut self, out: &mut Vec<u8>) {
        while let Some((end, skip)) = event_end(&self.pending) {
            let event = self.pending.split_to(end + skip).freeze();
            self.event(&event[..end], &event, out);
        }
    }

    /// One SSE event (`text`, without its blank line; `raw`, with it).
    fn event(&mut self, text: &[u8], raw: &Bytes, out: &mut Vec<u8>) {
        let data = sse_data(text);
        let Some(data) = data else {
            // Comments (keep-alives) and events without data pass as they are.
            out.extend_from_slice(raw);
            return;
        };
        if data.trim_ascii() == b"[DONE]" {
            self.end(out);
            return;
        }
        let Ok(value) = serde_json::from_slice::<Value>(&data) else {
            out.extend_from_slice(raw);
            return;
        };
        if value.get("choices").is_some() {
            self.translating = true;
            match &mut self.translator {
                Translator::Messages(t) => t.chunk(&value, out),
                Translator::Responses(t) => t.chunk(&value, out),
            }
        } else if value.get("error").is_some() && value.get("type").is_none() {
            match &mut self.translator {
                Translator::Messages(t) => t.error(&value, out),
                Translator::Responses(t) => t.error(&value, out),
            }
        } else {
            if value["type"] == "response.completed" {
                self.stored(&value["response"]);
            }
            out.extend_from_slice(raw);
        }
    }

    /// The end of a translated stream.
    fn end(&mut self, out: &mut Vec<u8>) {
        if !self.translating {
            return;
        }
        match &mut self.translator {
            Translator::Messages(t) => t.end(out),
            Translator::Responses(t) => t.end(out),
        }
    }

    /// A whole answer, in the client's API.
    fn whole(&mut self, bytes: Bytes) -> Bytes {
        let Ok(value) = serde_json::from_slice::<Value>(&bytes) else {
            return bytes;
        };
        let translated =
            if let (true, Some(error)) = (!self.status.is_success(), value.get("error")) {
                if value.get("type").is_some() {
                    return bytes;
                }
                let kind = error["type"].as_str().unwrap_or("api_error");
                let code = error["code"].as_str();
                let message = error["message"].as_str().unwrap_or("upstream error");
                self.api.error_body(self.status, kind, code, message)
            } else if value.get("choices").is_some() {
                match self.api {
                    AgentApi::Messages => messages::from_chat(&value),
                    AgentApi::Responses => responses::from_chat(&value),
                }
            } else {
                if self.status.is_success() {
                    self.stored(&value);
                }
                return bytes;
            };
        Bytes::from(translated.to_string())
    }

    /// A native Responses answer: the upstream stored it unless told not to.
    fn stored(&mut self, response: &Value) {
        if response["store"] == Value::Bool(false) {
            return;
        }
        if let (Some(on_stored), Some(id)) = (self.on_stored.take(), response["id"].as_str()) {
            on_stored(id.to_owned());
        }
    }
}

impl Body for AgentBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        loop {
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    let data = match frame.into_data() {
                        Ok(data) => data,
                        Err(other) => return Poll::Ready(Some(Ok(other))),
                    };
                    if !this.sse {
                        if this.pending.len() + data.len() > MAX_WHOLE {
                            // Not an answer worth translating: on as it came.
                            let mut out = std::mem::take(&mut this.pending);
                            out.extend_from_slice(&data);
                            this.sse = true;
                            return Poll::Ready(Some(Ok(Frame::data(out.freeze()))));
                        }
                        this.pending.extend_from_slice(&data);
                        continue;
                    }
                    this.pending.extend_from_slice(&data);
                    let mut out = Vec::new();
                    this.drain_events(&mut out);
                    if !out.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(Bytes::from(out)))));
                    }
                }
                Poll::Ready(Some(Err(error))) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(error)));
                }
                Poll::Ready(None) => {
                    this.done = true;
                    let rest = std::mem::take(&mut this.pending).freeze();
                    let out = match this.sse {
                        false => this.whole(rest),
                        true => {
                            let mut out = Vec::new();
                            if !rest.is_empty() {
                                this.event(&rest, &rest, &mut out);
                            }
                            this.end(&mut out);
                            Bytes::from(out)
                        }
                    };
                    return Poll::Ready((!out.is_empty()).then(|| Ok(Frame::data(out))));
                }
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

/// Where the first complete event of `buffer` ends, and the length of the blank line after
/// it (`\n\n` or `\r\n\r\n`).
fn event_end(buffer: &[u8]) -> Option<(usize, usize)> {
    let lf = buffer
        .windows(2)
        .position(|w| w == b"\n\n")
        .map(|at| (at, 2));
    let crlf = buffer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|at| (at, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The data of an SSE event (its `data:` lines joined), if it has any.
fn sse_data(event: &[u8]) -> Option<Vec<u8>> {
    let mut data: Option<Vec<u8>> = None;
    for line in event.split(|b| *b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some(rest) = line.strip_prefix(b"data:") {
            let rest = rest.strip_prefix(b" ").unwrap_or(rest);
            let joined = data.get_or_insert_with(Vec::new);
            if !joined.is_empty() {
                joined.push(b'\n');
            }
            joined.extend_from_slice(rest);
        }
    }
    data
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_end_at_a_blank_line_of_either_kind() {
        assert_eq!(event_end(b"data: 1\n\ndata: 2"), Some((7, 2)));
        assert_eq!(event_end(b"data: 1\r\n\r\n"), Some((7, 4)));
        assert_eq!(event_end(b"data: 1\n"), None);
    }

    #[test]
    fn data_lines_are_joined_and_comments_have_none() {
        assert_eq!(
            sse_data(b"event: x\ndata: {\"a\":\ndata: 1}"),
            Some(b"{\"a\":\n1}".to_vec())
        );
        assert_eq!(sse_data(b": keep-alive"), None);
    }
}
