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
use super::{AgentApi, RequestSlot};
use crate::server::delivery::Relayed;
use crate::server::ResponseBody;
use crate::upstream::sse::{data_of, EventBuffer};
use crate::upstream::{is_event_stream, BodyError};

/// Called with the id of a Responses answer a native upstream stored.
pub type OnStored = Box<dyn FnOnce(String) + Send + Sync>;

/// A whole answer larger than this is passed on untranslated: far above any completion.
pub(crate) const MAX_WHOLE: usize = 16 * 1024 * 1024;

/// An answer relayed in the client's agent API.
pub struct AgentBody {
    inner: Relayed,
    api: AgentApi,
    status: StatusCode,
    sse: bool,
    /// A whole answer so far.
    pending: BytesMut,
    /// A stream's events.
    events: EventBuffer,
    translator: Translator,
    /// Chat chunks were seen: the stream's end must be translated too.
    translating: bool,
    /// What the request's translation reported (the answer's echo), once known.
    slot: RequestSlot,
    /// The stream ended as its API ends one: a finish, a final event or an error event.
    concluded: bool,
    /// The last `sequence_number` of a native Responses stream.
    sequence: Option<u64>,
    on_stored: Option<OnStored>,
    done: bool,
}

enum Translator {
    Messages(MessagesStream),
    Responses(ResponsesStream),
}

/// The id of a native Responses answer (the `response` of a `response.completed` event, or
/// a whole answer), when its upstream stored it: unless it was told not to (`store: false`).
pub fn stored_id(response: &Value) -> Option<&str> {
    match response["store"] == Value::Bool(false) {
        true => None,
        false => response["id"].as_str(),
    }
}

/// Wraps a generation answer to an agent-API request, whose translation (if any) reports
/// to `slot`. Errors the router answers itself are shaped by the rescue layer; this covers
/// everything that comes through an upstream body.
pub fn relay(
    response: Response<ResponseBody>,
    api: AgentApi,
    slot: RequestSlot,
    on_stored: Option<OnStored>,
) -> Response<ResponseBody> {
    let (mut head, body) = response.into_parts();
    let Either::Right(inner) = body else {
        return Response::from_parts(head, body);
    };
    if let Some(retry) = crate::openai::status_should_retry(head.status) {
        let value = crate::openai::should_retry_value(retry);
        head.headers
            .entry(crate::openai::SHOULD_RETRY)
            .or_insert(value);
    }
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
        events: EventBuffer::default(),
        translator,
        translating: false,
        slot,
        concluded: false,
        sequence: None,
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

    /// Complete events of the stream, translated into `out`.
    fn drain_events(&mut self, out: &mut Vec<u8>) {
        while let Some(event) = self.events.next_event() {
            self.event(&event, out);
        }
    }

    /// One SSE event (`raw`, with the blank line that ended it).
    fn event(&mut self, raw: &Bytes, out: &mut Vec<u8>) {
        let data = data_of(raw);
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
            if !self.translating {
                self.translating = true;
                if let (Translator::Responses(t), Some(request)) =
                    (&mut self.translator, self.slot.0.get())
                {
                    t.echo(&request.echo);
                }
            }
            match &mut self.translator {
                Translator::Messages(t) => t.chunk(&value, out),
                Translator::Responses(t) => t.chunk(&value, out),
            }
        } else if value.get("error").is_some() && value.get("type").is_none() {
            self.concluded = true;
            match &mut self.translator {
                Translator::Messages(t) => t.error(&value, out),
                Translator::Responses(t) => t.error(&value, out),
            }
        } else {
            if value["type"] == "response.completed" {
                self.stored(&value["response"]);
            }
            self.sequence = value["sequence_number"].as_u64().or(self.sequence);
            self.concluded |= matches!(
                value["type"].as_str(),
                Some(
                    "message_stop"
                        | "error"
                        | "response.completed"
                        | "response.incomplete"
                        | "response.failed"
                )
            );
            out.extend_from_slice(raw);
        }
    }

    /// The end of a stream (`[DONE]`, or the end of its body): a translated one closes as
    /// its API does when the chat stream said how it finished. One that did not (an
    /// upstream cut off cleanly, by a crash behind a proxy or an idle timeout between)
    /// ends with the API's error event, as a broken connection does: the client must not
    /// take a cut answer for a whole one.
    fn end(&mut self, out: &mut Vec<u8>) {
        if self.concluded {
            return;
        }
        self.concluded = true;
        let finished = match &self.translator {
            Translator::Messages(t) => t.finished(),
            Translator::Responses(t) => t.finished(),
        };
        let error = crate::openai::error_body(
            "the upstream's stream ended before its answer was finished",
            "upstream_error",
            None,
            Some("stream_truncated"),
        );
        match (&mut self.translator, self.translating, finished) {
            (Translator::Messages(t), true, true) => t.end(out),
            (Translator::Responses(t), true, true) => t.end(out),
            (Translator::Messages(t), true, false) => t.error(&error, out),
            (Translator::Responses(t), true, false) => t.error(&error, out),
            (_, false, _) => self.native_error(&error, out),
        }
    }

    /// A native stream that ended without its final event: the API's error event.
    fn native_error(&mut self, error: &Value, out: &mut Vec<u8>) {
        let message = &error["error"]["message"];
        let event = match self.api {
            AgentApi::Messages => {
                super::anthropic_error("api_error", message.as_str().unwrap_or_default())
            }
            AgentApi::Responses => serde_json::json!({"type": "error",
                "code": error["error"]["code"], "message": message, "param": null,
                "sequence_number": self.sequence.map_or(0, |n| n + 1)}),
        };
        let name = event["type"].as_str().unwrap_or("error").to_owned();
        messages::event(out, &name, &event);
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
                    AgentApi::Responses => {
                        let request = self.slot.0.get();
                        let echo = request.map_or(&Value::Null, |r| &r.echo);
                        responses::from_chat(&value, echo)
                    }
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
        if let (Some(id), Some(on_stored)) = (stored_id(response), self.on_stored.take()) {
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
                            // Passed on as a stream of bytes, never ended as an event stream.
                            this.sse = true;
                            this.concluded = true;
                            return Poll::Ready(Some(Ok(Frame::data(out.freeze()))));
                        }
                        this.pending.extend_from_slice(&data);
                        continue;
                    }
                    this.events.push(&data);
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
                    let out = match this.sse {
                        false => {
                            let whole = std::mem::take(&mut this.pending).freeze();
                            this.whole(whole)
                        }
                        true => {
                            let mut out = Vec::new();
                            let rest = this.events.take_rest();
                            if !rest.is_empty() {
                                this.event(&rest, &mut out);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn events(stream: &[u8]) -> (Vec<Bytes>, Bytes) {
        let mut buffer = EventBuffer::default();
        buffer.push(stream);
        let whole = std::iter::from_fn(|| buffer.next_event()).collect();
        (whole, buffer.take_rest())
    }

    #[test]
    fn events_end_at_a_blank_line_of_either_kind() {
        let (whole, rest) = events(b"data: 1\n\ndata: 2");
        assert_eq!(
            (whole, rest),
            (
                vec![Bytes::from_static(b"data: 1\n\n")],
                Bytes::from_static(b"data: 2")
            )
        );
        let (whole, rest) = events(b"data: 1\r\n\r\n");
        assert_eq!(
            (whole, rest),
            (vec![Bytes::from_static(b"data: 1\r\n\r\n")], Bytes::new())
        );
        assert_eq!(events(b"data: 1\n").0, Vec::<Bytes>::new());
    }

    #[test]
    fn data_lines_are_joined_and_comments_have_none() {
        assert_eq!(
            data_of(b"event: x\ndata: {\"a\":\ndata: 1}").as_deref(),
            Some(b"{\"a\":\n1}".as_slice())
        );
        assert_eq!(data_of(b": keep-alive"), None);
    }
}
