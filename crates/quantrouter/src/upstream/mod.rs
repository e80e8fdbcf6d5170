//! Upstream vLLM servers: a [`Pool`] of endpoints per profile, the attempt loop that owns all
//! retrying ([`attempts`]), the queue scraper ([`scrape`]), the keep-alive HTTP/1.1 client
//! ([`client`], with body framing in [`framing`]),
//! and the response body wrapper that keeps accounting honest for the whole life of a stream
//! and turns a mid-stream failure into an SSE error event.

pub mod attempts;
mod client;
mod framing;
pub mod pool;
pub mod scrape;

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::{Instant, Sleep};

pub use client::{ClientConfig, UpstreamClient, UpstreamIncoming};
pub use pool::{Endpoint, InflightGuard, Pick, Pool};

use crate::openai::{find_usage, is_usage_event, Usage};

/// Why an upstream call failed before a response arrived.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("invalid upstream URL {0}")]
    InvalidUrl(String),
    #[error("connecting to {endpoint}: {source}")]
    Connect {
        endpoint: String,
        source: std::io::Error,
    },
    /// The connection failed, or the answer was not HTTP, before a response head.
    #[error("{endpoint} failed before a response head: {source}")]
    Exchange {
        endpoint: String,
        source: std::io::Error,
    },
    #[error("{endpoint} sent no response headers within {timeout:?}")]
    HeaderTimeout { endpoint: String, timeout: Duration },
}

pin_project_lite::pin_project! {
    /// The upstream response body on its way to the client, frame by frame.
    ///
    /// Holds the in-flight guard and the admission slot until the body ends or is dropped
    /// (the client went away, which also cancels the upstream request), enforces the idle
    /// timeout between chunks and the request deadline, and reports how the body ended. A
    /// failure after bytes were sent cannot be retried: an SSE stream then ends with an
    /// `data: {"error": …}` event, any other body with an aborted connection.
    pub struct UpstreamBody {
        #[pin]
        inner: UpstreamIncoming,
        held: Option<(InflightGuard, Option<OwnedSemaphorePermit>)>,
        on_end: Option<Box<dyn FnOnce(BodyEnd) + Send + Sync>>,
        started: Instant,
        timer: Pin<Box<Sleep>>,
        idle: Duration,
        deadline: Instant,
        last_frame: Instant,
        sse: bool,
        done: bool,
        // The end of the body so far, to read `usage` from at the end (unused when usage
        // events are stripped: their counts are taken as they pass).
        tail: VecDeque<u8>,
        // Usage events are cut out of the stream (the router asked for them, not the
        // client); partial events wait here.
        strip_usage: bool,
        carry: BytesMut,
        stripped: Option<Usage>,
    }

    impl PinnedDrop for UpstreamBody {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if let Some(on_end) = this.on_end.take() {
                on_end(BodyEnd { completed: false, failure: None, usage: None, elapsed: this.started.elapsed() });
            }
        }
    }
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
    pub elapsed: Duration,
}

/// Why an upstream body failed after the response headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    #[error("the upstream connection failed mid-response")]
    Upstream,
    #[error("the upstream sent nothing for {0:?}")]
    Idle(Duration),
    #[error("the request deadline passed")]
    Deadline,
}

impl BodyError {
    /// Metric label.
    pub fn kind(self) -> &'static str {
        match self {
            Self::Upstream => "mid_stream",
            Self::Idle(_) => "idle_timeout",
            Self::Deadline => "deadline",
        }
    }
}

/// Limits on a response body in flight.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimits {
    pub idle: Duration,
    pub deadline: Instant,
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
        held: (InflightGuard, Option<OwnedSemaphorePermit>),
        started: Instant,
        limits: BodyLimits,
        on_end: Box<dyn FnOnce(BodyEnd) + Send + Sync>,
    ) -> Self {
        let now = Instant::now();
        Self {
            inner,
            held: Some(held),
            on_end: Some(on_end),
            started,
            timer: Box::pin(tokio::time::sleep_until(
                (now + limits.idle).min(limits.deadline),
            )),
            idle: limits.idle,
            deadline: limits.deadline,
            last_frame: now,
            sse: limits.sse,
            done: false,
            tail: VecDeque::new(),
            strip_usage: limits.sse && limits.strip_usage,
            carry: BytesMut::new(),
            stripped: None,
        }
    }

    /// The request's deadline, which the body holds to.
    pub fn deadline(&self) -> Instant {
        self.deadline
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
        if *this.done {
            return Poll::Ready(None);
        }
        let failure = loop {
            match this.inner.as_mut().poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    // Re-arming the timer per chunk would cost a timer-wheel update per
                    // token; noting the time and re-arming lazily when it fires is enough.
                    *this.last_frame = Instant::now();
                    // An upstream with data always ready never lets the timer fire.
                    if *this.last_frame >= *this.deadline {
                        break BodyError::Deadline;
                    }
                    let frame = match frame.into_data() {
                        Ok(data) => data,
                        Err(other) => return Poll::Ready(Some(Ok(other))),
                    };
                    let out = match *this.strip_usage {
                        true => strip_usage_events(this.carry, this.stripped, frame),
                        false => {
                            keep_tail(this.tail, &frame);
                            Some(frame)
                        }
                    };
                    // hyper stops polling a body that reports its end (a sized body after
                    // its last byte), so the end is handled together with the last frame.
                    if !this.inner.is_end_stream() {
                        match out {
                            Some(out) => return Poll::Ready(Some(Ok(Frame::data(out)))),
                            None => continue,
                        }
                    }
                    // Copied only to append a held-back partial event: a whole answer in
                    // one frame goes out as it came.
                    let out = out.unwrap_or_default();
                    let last = match this.carry.is_empty() {
                        true => out,
                        false => {
                            let mut last = BytesMut::from(out);
                            last.extend_from_slice(&this.carry.split());
                            last.freeze()
                        }
                    };
                    let usage = body_usage(*this.strip_usage, *this.stripped, this.tail);
                    finish(
                        this.held,
                        this.on_end,
                        this.done,
                        *this.started,
                        None,
                        usage,
                    );
                    if last.is_empty() {
                        return Poll::Ready(None);
                    }
                    return Poll::Ready(Some(Ok(Frame::data(last))));
                }
                Poll::Ready(None) => {
                    let usage = body_usage(*this.strip_usage, *this.stripped, this.tail);
                    finish(
                        this.held,
                        this.on_end,
                        this.done,
                        *this.started,
                        None,
                        usage,
                    );
                    if this.carry.is_empty() {
                        return Poll::Ready(None);
                    }
                    return Poll::Ready(Some(Ok(Frame::data(this.carry.split().freeze()))));
                }
                Poll::Ready(Some(Err(_))) => break BodyError::Upstream,
                Poll::Pending => {
                    let expired = loop {
                        if this.timer.as_mut().poll(cx).is_pending() {
                            return Poll::Pending;
                        }
                        let now = Instant::now();
                        if now >= *this.deadline {
                            break BodyError::Deadline;
                        }
                        let idle_until = *this.last_frame + *this.idle;
                        if now >= idle_until {
                            break BodyError::Idle(*this.idle);
                        }
                        this.timer.as_mut().reset(idle_until.min(*this.deadline));
                    };
                    break expired;
                }
            }
        };
        finish(
            this.held,
            this.on_end,
            this.done,
            *this.started,
            Some(failure),
            None,
        );
        if *this.sse {
            Poll::Ready(Some(Ok(Frame::data(sse_error_event(failure)))))
        } else {
            Poll::Ready(Some(Err(failure)))
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

fn finish(
    held: &mut Option<(InflightGuard, Option<OwnedSemaphorePermit>)>,
    on_end: &mut Option<Box<dyn FnOnce(BodyEnd) + Send + Sync>>,
    done: &mut bool,
    started: Instant,
    failure: Option<BodyError>,
    usage: Option<Usage>,
) {
    *done = true;
    held.take();
    if let Some(on_end) = on_end.take() {
        on_end(BodyEnd {
            completed: failure.is_none(),
            failure,
            usage,
            elapsed: started.elapsed(),
        });
    }
}

/// Usage of a finished body: the stripped usage event, or the last `usage` in its tail.
fn body_usage(
    stripped_mode: bool,
    stripped: Option<Usage>,
    tail: &mut VecDeque<u8>,
) -> Option<Usage> {
    match stripped_mode {
        true => stripped,
        false => find_usage(tail.make_contiguous()),
    }
}

/// Bytes kept from the end of a body for [`body_usage`]: the usage event of a stream
/// (~300 bytes with `data: [DONE]`), or the end of a JSON answer, with room to spare.
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

/// Passes SSE events through except usage-only ones, whose counts go to `stripped`.
/// Returns what to send now, if anything. Whole events without usage pass untouched.
fn strip_usage_events(
    carry: &mut BytesMut,
    stripped: &mut Option<Usage>,
    data: Bytes,
) -> Option<Bytes> {
    const USAGE_KEY: &[u8] = b"\"usage\"";
    let whole = data.ends_with(b"\n\n");
    if carry.is_empty() && whole && !data.windows(USAGE_KEY.len()).any(|w| w == USAGE_KEY) {
        return Some(data);
    }
    carry.extend_from_slice(&data);
    let mut out = BytesMut::new();
    while let Some(end) = carry.windows(2).position(|w| w == b"\n\n") {
        let event = carry.split_to(end + 2);
        if is_usage_event(&event) {
            *stripped = find_usage(&event);
        } else {
            out.extend_from_slice(&event);
        }
    }
    (!out.is_empty()).then(|| out.freeze())
}

/// The last event of a stream that failed after bytes were sent, in the OpenAI error shape.
fn sse_error_event(failure: BodyError) -> Bytes {
    let code = match failure {
        BodyError::Upstream => "upstream_error",
        BodyError::Idle(_) | BodyError::Deadline => "timeout",
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
        let found = body_usage(false, None, &mut tail).unwrap();
        assert_eq!((found.prompt_tokens, found.completion_tokens), (7, 1000));
    }
}
