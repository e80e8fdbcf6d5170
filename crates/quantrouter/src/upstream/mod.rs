//! Upstream vLLM servers: a [`Pool`] of endpoints per profile, what the probes
//! ([`crate::probes`]) found on them ([`queue`]), upstream API keys ([`credential`]), the
//! HTTP client ([`client`], hyper-util over rustls),
//! and the response body wrapper that keeps accounting honest for the whole life of a stream
//! (with SSE events found in [`sse`]) and turns a mid-stream failure into an SSE error event.
//! Retrying is not done here: [`crate::resilience::retry`] drives the attempts.

mod client;
pub mod context;
pub mod credential;
pub mod keepalive;
pub mod pool;
pub mod queue;
mod sse;
pub mod stream_check;

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use tokio::time::{Instant, Sleep};

pub use client::{ClientConfig, Sent, Transport, UpstreamClient, UpstreamIncoming};
pub use pool::{placed, Endpoint, InflightGuard, Pick, Placement, Pool};

use crate::openai::{find_usage, Usage};
use sse::Scanned;
pub use sse::{is_event_stream, EventScan};

/// The cause of a failed exchange, as the client library reported it.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why an upstream call failed before a response head arrived.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("invalid upstream URL {0}")]
    InvalidUrl(String),
    /// No connection: refused, unreachable, timed out, or its TLS handshake failed.
    #[error("connecting to {endpoint}: {source}")]
    Connect { endpoint: String, source: BoxError },
    /// The upstream did not take the request: a kept-alive connection closed before it was
    /// written, or an HTTP/2 server refused its stream or went away before it (RFC 9113
    /// §8.7: never processed).
    #[error("{endpoint} did not take the request: {source}")]
    Unsent { endpoint: String, source: BoxError },
    /// The connection failed after the request (or part of it) was written, before a
    /// response head.
    #[error("{endpoint} failed before a response head: {source}")]
    Exchange { endpoint: String, source: BoxError },
    /// The upstream answered, but not with a valid HTTP response head.
    #[error("{endpoint} answered with an invalid response: {source}")]
    InvalidResponse { endpoint: String, source: BoxError },
    #[error("{endpoint} sent no response headers within {timeout:?}")]
    HeaderTimeout { endpoint: String, timeout: Duration },
}

impl UpstreamError {
    /// Whether the request may have reached the upstream.
    pub fn sent(&self) -> Sent {
        match self {
            Self::InvalidUrl(_) | Self::Connect { .. } | Self::Unsent { .. } => Sent::No,
            // The timeout may have struck while connecting, but nobody can tell: assume the
            // upstream has the request.
            Self::Exchange { .. } | Self::InvalidResponse { .. } | Self::HeaderTimeout { .. } => {
                Sent::Possibly
            }
        }
    }
}

pin_project_lite::pin_project! {
    /// The upstream response body on its way to the client, frame by frame.
    ///
    /// Holds the in-flight guard and the admission slot until the body ends or is dropped
    /// (the client went away, which also cancels the upstream request), enforces the time
    /// limits — the header timeout until the first output, then the idle timeout between
    /// chunks, and the request deadline throughout — and reports the first output and how
    /// the body ended. A failure after bytes were sent cannot be retried: an SSE stream then
    /// ends with an `data: {"error": …}` event, any other body with an aborted connection.
    pub struct UpstreamBody {
        #[pin]
        inner: UpstreamIncoming,
        timer: Pin<Box<Sleep>>,
        state: BodyState,
    }

    impl PinnedDrop for UpstreamBody {
        fn drop(this: Pin<&mut Self>) {
            let state = this.project().state;
            if let Some(mut on_event) = state.on_event.take() {
                on_event(BodyEvent::End(BodyEnd {
                    completed: false,
                    failure: None,
                    usage: None,
                    data_events: state.data_events(),
                    elapsed: state.started.elapsed(),
                }));
            }
        }
    }
}

/// Everything of an [`UpstreamBody`] but the body and its timer.
struct BodyState {
    held: Option<Held>,
    on_event: Option<Box<dyn FnMut(BodyEvent) + Send + Sync>>,
    started: Instant,
    idle: Duration,
    deadline: Instant,
    /// Until the first output, the latest it may come (`None` once it came). Servers that
    /// send their head before the prompt is processed (llama.cpp) leave the whole prefill to
    /// this wait, so it gets the header timeout, not the idle one.
    first_output_by: Option<Instant>,
    last_frame: Instant,
    sse: bool,
    done: bool,
    // The end of the body so far, to read `usage` from at the end (unused when usage
    // events are stripped: their counts are taken as they pass).
    tail: VecDeque<u8>,
    // An SSE stream's events: the first output, and usage events cut out of the stream (the
    // router asked for them, not the client).
    events: Option<EventScan>,
    // A copy of a whole answer as it passes, for calibration.
    copy: Option<AnswerCopy>,
}

/// A copy of a non-streamed answer, handed over with its usage once the body completed.
struct AnswerCopy {
    data: BytesMut,
    limit: usize,
    on_end: Box<dyn FnOnce(Bytes, Option<Usage>) + Send + Sync>,
}

/// In-flight accounting on the endpoint and the profile's admission slot: held until the
/// answer's body ends.
pub type Held = (InflightGuard, Option<crate::resilience::admission::Permit>);

/// What an [`UpstreamBody`] reports as it goes.
#[derive(Debug, Clone, Copy)]
pub enum BodyEvent {
    /// The first event of an SSE stream with generated output (text, reasoning, a tool
    /// call) passed, this long after the request started: the time to first token.
    FirstOutput(Duration),
    /// The body ended; the last event.
    End(BodyEnd),
}

/// How an upstream body ended.
#[derive(Debug, Clone, Copy)]
pub struct BodyEnd {
    /// The last frame was delivered (false: dropped early or failed).
    pub completed: bool,
    /// Why the body failed, when it did (not when the client left).
    pub failure: Option<BodyError>,
    /// Token counts, when the upstream reported them.
    pub usage: Option<Usage>,
    /// An SSE stream's events with data that went on ([`sse::EventScan::data_events`]):
    /// what a stream without `usage` (left by its client, say) delivered.
    pub data_events: u64,
    pub elapsed: Duration,
}

/// Why an upstream body failed after the response headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    #[error("the upstream connection failed mid-response")]
    Upstream,
    #[error("the upstream sent nothing for {0:?}")]
    Idle(Duration),
    #[error("the upstream sent no output within the header timeout")]
    FirstOutput,
    #[error("the request deadline passed")]
    Deadline,
}

impl BodyError {
    /// Metric label.
    pub fn kind(self) -> &'static str {
        match self {
            Self::Upstream => "mid_stream",
            Self::Idle(_) => "idle_timeout",
            Self::FirstOutput => "header_timeout",
            Self::Deadline => "deadline",
        }
    }
}

/// Limits on a response body in flight.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimits {
    pub idle: Duration,
    pub deadline: Instant,
    /// The latest the first output may come: the request was sent + the header timeout.
    pub first_output_by: Instant,
    /// The response is an SSE stream (`text/event-stream`).
    pub sse: bool,
    /// Cut usage-only events out of the stream (the client did not ask for them).
    pub strip_usage: bool,
}

impl std::fmt::Debug for UpstreamBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamBody").finish_non_exhaustive()
    }
}

// === impl UpstreamBody ===

impl UpstreamBody {
    pub fn new(
        inner: UpstreamIncoming,
        held: Option<Held>,
        started: Instant,
        limits: BodyLimits,
        on_event: Box<dyn FnMut(BodyEvent) + Send + Sync>,
    ) -> Self {
        let now = Instant::now();
        let state = BodyState {
            held,
            on_event: Some(on_event),
            started,
            idle: limits.idle,
            deadline: limits.deadline,
            first_output_by: Some(limits.first_output_by.min(limits.deadline)),
            last_frame: now,
            sse: limits.sse,
            done: false,
            tail: VecDeque::new(),
            events: limits.sse.then(|| EventScan::new(limits.strip_usage)),
            copy: None,
        };
        let (until, _) = state.expiry();
        Self {
            inner,
            timer: Box::pin(tokio::time::sleep_until(until)),
            state,
        }
    }

    /// The request's deadline, which the body holds to.
    pub fn deadline(&self) -> Instant {
        self.state.deadline
    }

    /// Copies a non-streamed answer as it passes (up to `limit` bytes) and hands it to
    /// `on_end` with its usage once the client had the whole answer; a longer answer, one
    /// that fails or one the client leaves is not handed over.
    pub fn copy_answer(
        mut self,
        limit: usize,
        on_end: Box<dyn FnOnce(Bytes, Option<Usage>) + Send + Sync>,
    ) -> Self {
        if self.state.events.is_none() {
            self.state.copy = Some(AnswerCopy {
                data: BytesMut::new(),
                limit,
                on_end,
            });
        }
        self
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let mut this = self.project();
        let state = this.state;
        if state.done {
            return Poll::Ready(None);
        }
        let failure = loop {
            match this.inner.as_mut().poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    // Re-arming the timer per chunk would cost a timer-wheel update per
                    // token; noting the time and re-arming lazily when it fires is enough.
                    state.last_frame = Instant::now();
                    // An upstream with data always ready never lets the timer fire.
                    if state.last_frame >= state.deadline {
                        break BodyError::Deadline;
                    }
                    let data = match frame.into_data() {
                        Ok(data) => data,
                        Err(other) => return Poll::Ready(Some(Ok(other))),
                    };
                    let awaiting_output = state.first_output_by.is_some();
                    let out = state.pass(data);
                    if awaiting_output && state.first_output_by.is_none() {
                        // The wait for the first output may have been the longer one: the
                        // idle timeout applies from now on.
                        let (until, _) = state.expiry();
                        if until < this.timer.deadline() {
                            this.timer.as_mut().reset(until);
                        }
                    }
                    // hyper stops polling a body that reports its end (a sized body after
                    // its last byte), so the end is handled together with the last frame.
                    if !this.inner.is_end_stream() {
                        match out {
                            Some(out) => return Poll::Ready(Some(Ok(Frame::data(out)))),
                            None => continue,
                        }
                    }
                    return Poll::Ready(state.end(out).map(|last| Ok(Frame::data(last))));
                }
                Poll::Ready(None) => {
                    return Poll::Ready(state.end(None).map(|last| Ok(Frame::data(last))));
                }
                Poll::Ready(Some(Err(_))) => break BodyError::Upstream,
                Poll::Pending => {
                    let expired = loop {
                        if this.timer.as_mut().poll(cx).is_pending() {
                            return Poll::Pending;
                        }
                        let (until, failure) = state.expiry();
                        if Instant::now() >= until {
                            break failure;
                        }
                        this.timer.as_mut().reset(until);
                    };
                    break expired;
                }
            }
        };
        state.finish(Some(failure), None);
        if state.sse {
            Poll::Ready(Some(Ok(Frame::data(sse_error_event(failure)))))
        } else {
            Poll::Ready(Some(Err(failure)))
        }
    }

    fn is_end_stream(&self) -> bool {
        self.state.done || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

// === impl BodyState ===

impl BodyState {
    /// One frame of data: what of it goes on now.
    fn pass(&mut self, data: Bytes) -> Option<Bytes> {
        let Some(events) = &mut self.events else {
            // Not a stream: any data is the answer coming.
            self.first_output_by = None;
            keep_tail(&mut self.tail, &data);
            if let Some(copy) = &mut self.copy {
                match copy.data.len() + data.len() <= copy.limit {
                    true => copy.data.extend_from_slice(&data),
                    false => self.copy = None,
                }
            }
            return Some(data);
        };
        let scanned = events.feed(data);
        if scanned.first_output {
            self.first_output();
        }
        if let (Some(out), false) = (&scanned.out, self.strips_usage()) {
            keep_tail(&mut self.tail, out);
        }
        scanned.out
    }

    /// The body ended after `out`: the last data to send, with anything held back.
    fn end(&mut self, out: Option<Bytes>) -> Option<Bytes> {
        let rest = match &mut self.events {
            Some(events) => events.finish(),
            None => Scanned::default(),
        };
        if rest.first_output {
            self.first_output();
        }
        let last = match (out, rest.out) {
            (out, None) => out,
            (None, rest) => rest,
            // Copied only to append a held-back partial event: a whole answer in one frame
            // goes out as it came.
            (Some(out), Some(rest)) => {
                let mut last = BytesMut::from(out);
                last.extend_from_slice(&rest);
                Some(last.freeze())
            }
        };
        let usage = match (self.strips_usage(), &self.events) {
            (true, Some(events)) => events.usage,
            _ => find_usage(self.tail.make_contiguous()),
        };
        self.finish(None, usage);
        last.filter(|last| !last.is_empty())
    }

    fn strips_usage(&self) -> bool {
        self.events.as_ref().is_some_and(EventScan::strips_usage)
    }

    fn data_events(&self) -> u64 {
        self.events.as_ref().map_or(0, |e| e.data_events)
    }

    fn first_output(&mut self) {
        self.first_output_by = None;
        if let Some(on_event) = &mut self.on_event {
            on_event(BodyEvent::FirstOutput(self.started.elapsed()));
        }
    }

    /// When the body times out if nothing comes, and what the failure then is.
    fn expiry(&self) -> (Instant, BodyError) {
        let idle_until = self.last_frame + self.idle;
        let (until, failure) = match self.first_output_by {
            Some(by) if by > idle_until => (by, BodyError::FirstOutput),
            _ => (idle_until, BodyError::Idle(self.idle)),
        };
        match until < self.deadline {
            true => (until, failure),
            false => (self.deadline, BodyError::Deadline),
        }
    }

    fn finish(&mut self, failure: Option<BodyError>, usage: Option<Usage>) {
        self.done = true;
        self.held.take();
        if let (None, Some(copy)) = (failure, self.copy.take()) {
            (copy.on_end)(copy.data.freeze(), usage);
        }
        if let Some(mut on_event) = self.on_event.take() {
            on_event(BodyEvent::End(BodyEnd {
                completed: failure.is_none(),
                failure,
                usage,
                data_events: self.data_events(),
                elapsed: self.started.elapsed(),
            }));
        }
    }
}

/// Bytes kept from the end of a body for its usage: the usage event of a stream (~300
/// bytes with `data: [DONE]`), or the end of a JSON answer, with room to spare.
const USAGE_TAIL: usize = 1024;

/// Appends `data` to the copied tail of a body, keeping its last [`USAGE_TAIL`] bytes.
/// Copying matters: holding on to the frames themselves would keep each one's read (up to 8 KiB)
/// alive, per frame and per stream.
fn keep_tail(tail: &mut VecDeque<u8>, data: &[u8]) {
    let data = &data[data.len().saturating_sub(USAGE_TAIL)..];
    let excess = (tail.len() + data.len()).saturating_sub(USAGE_TAIL);
    tail.drain(..excess);
    if tail.capacity() == 0 {
        tail.reserve_exact(USAGE_TAIL);
    }
    tail.extend(data);
}

/// The last event of a stream that failed after bytes were sent, in the OpenAI error shape.
fn sse_error_event(failure: BodyError) -> Bytes {
    let code = match failure {
        BodyError::Upstream => "upstream_error",
        BodyError::Idle(_) | BodyError::FirstOutput | BodyError::Deadline => "timeout",
    };
    let error = serde_json::json!({"error": {
        "message": failure.to_string(),
        "type": "api_error",
        "param": null,
        "code": code,
    }});
    Bytes::from(format!("data: {error}\n\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_keeps_the_last_bytes_across_frames() {
        let mut tail = VecDeque::new();
        let mut body = Vec::new();
        for i in 0..500u32 {
            let frame = format!("data: {{\"n\":{i}}}\n\n");
            keep_tail(&mut tail, frame.as_bytes());
            body.extend_from_slice(frame.as_bytes());
        }
        assert_eq!(tail.len(), USAGE_TAIL);
        assert_eq!(tail.make_contiguous(), &body[body.len() - USAGE_TAIL..]);
        assert_eq!(
            tail.capacity(),
            USAGE_TAIL,
            "the tail never grows past its size"
        );

        let big = vec![b'x'; 3 * USAGE_TAIL];
        keep_tail(&mut tail, &big);
        assert_eq!(tail.make_contiguous(), &big[..USAGE_TAIL]);
    }

    #[test]
    fn usage_is_read_from_the_tail_of_a_long_stream() {
        let mut tail = VecDeque::new();
        for _ in 0..1000 {
            keep_tail(
                &mut tail,
                b"data: {\"choices\":[{\"delta\":{\"content\":\"tok\"}}]}\n\n",
            );
        }
        let usage = br#"data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":1000,"total_tokens":1007}}"#;
        // Split mid-event, as TCP may deliver it.
        keep_tail(&mut tail, &usage[..40]);
        keep_tail(&mut tail, &usage[40..]);
        keep_tail(&mut tail, b"\n\ndata: [DONE]\n\n");
        let found = find_usage(tail.make_contiguous()).unwrap();
        assert_eq!((found.prompt_tokens, found.completion_tokens), (7, 1000));
    }
}
