//! An upstream's response body on its way to the client, as small wrappers of one concern
//! each, innermost first:
//!
//! 1. [`TimeLimited`]: the header timeout until the first output, then the idle timeout
//!    between frames, and the request deadline throughout;
//! 2. [`Guarded`]: the in-flight count and the admission slot, held until the body ends;
//! 3. [`Resuming`]: a stream that may be resumed (`policy.stream_resume`) goes on with
//!    another upstream's continuation when its upstream breaks; others pass untouched;
//! 4. [`Reader`]: what the router reads as the body passes — an SSE stream's events (the
//!    first output, usage events cut out, events delivered) or a whole answer's usage, and a
//!    copy of a whole answer for calibration;
//! 5. [`UpstreamBody`]: tells the request's [`OnEnd`] hook how the body ended, once, and
//!    turns a failure after the head into an SSE error event (a stream) or an aborted body.

mod guard;
mod limits;
mod reader;
mod resume;

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::time::Instant;

pub use guard::{Guarded, Held};
pub use limits::{AwaitsOutput, BodyError, TimeLimited, TimeLimits};
pub use reader::{reported_usage, Reader, UsageTail};
pub use resume::{Asked, Broken, Continuation, Handover, Resumable, Resume, Resuming, Served};

use super::UpstreamIncoming;
use crate::openai::Usage;

/// The request's end-of-answer hook: told of the first output of a stream, then, once, how
/// the answer ended.
pub trait OnEnd: Send + Sync {
    /// The first event of an SSE stream with generated output (text, reasoning, a tool
    /// call) passed, this long after the request started: the time to first token.
    fn first_output(&mut self, _elapsed: Duration) {}

    /// Continuations on other upstreams generated the answer's later parts, in order
    /// (`policy.stream_resume`); told once, just before [`OnEnd::on_end`].
    fn resumed(&mut self, _handovers: &[Handover]) {}

    /// The body ended; the last call.
    fn on_end(self: Box<Self>, outcome: Outcome);
}

/// How an answer's body ended, and the copy of a whole answer when one was asked for.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub end: BodyEnd,
    /// The whole answer ([`UpstreamBody::copy_answer`]), when it completed within the
    /// copy's limit.
    pub answer: Option<Bytes>,
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
    /// An SSE stream's events with data that went on
    /// ([`crate::upstream::EventScan::data_events`]): what a stream without `usage` (left by
    /// its client, say) delivered.
    pub data_events: u64,
    pub elapsed: Duration,
}

/// How an answer is read: when its request started (for the time to first token), whether
/// it is an SSE stream, and whether to cut usage-only events out of it (the client did not
/// ask for them).
#[derive(Debug, Clone, Copy)]
pub struct Reading {
    pub started: Instant,
    pub sse: bool,
    pub strip_usage: bool,
}

type Layers = Reader<Resuming>;

pin_project_lite::pin_project! {
    /// The upstream response body on its way to the client, frame by frame (see the
    /// module). A failure after bytes were sent cannot be retried: an SSE stream then ends
    /// with a `data: {"error": …}` event, any other body with an aborted connection.
    pub struct UpstreamBody {
        #[pin]
        inner: Layers,
        hook: Option<Box<dyn OnEnd>>,
        started: Instant,
        done: bool,
    }

    impl PinnedDrop for UpstreamBody {
        fn drop(this: Pin<&mut Self>) {
            let mut this = this.project();
            if let Some(mut hook) = this.hook.take() {
                tell_handovers(&mut *hook, this.inner.inner_ref());
                let end = BodyEnd {
                    completed: false,
                    failure: None,
                    usage: this.inner.as_mut().usage_so_far(),
                    data_events: this.inner.data_events(),
                    elapsed: this.started.elapsed(),
                };
                hook.on_end(Outcome { end, answer: None });
            }
        }
    }
}

impl std::fmt::Debug for UpstreamBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamBody").finish_non_exhaustive()
    }
}

// === impl Reading ===

impl Reading {
    /// A whole answer (not a stream).
    pub fn whole(started: Instant) -> Self {
        Self {
            started,
            sse: false,
            strip_usage: false,
        }
    }
}

// === impl UpstreamBody ===

impl UpstreamBody {
    pub fn new(
        incoming: UpstreamIncoming,
        held: Option<Held>,
        limits: TimeLimits,
        reading: Reading,
    ) -> Self {
        let part = Guarded::new(TimeLimited::new(incoming, limits), held);
        let read = Reader::new(Resuming::new(part), reading.sse, reading.strip_usage);
        Self {
            inner: read,
            hook: None,
            started: reading.started,
            done: false,
        }
    }

    /// Tells `hook` how the body ended.
    pub fn on_end(mut self, hook: Box<dyn OnEnd>) -> Self {
        self.hook = Some(hook);
        self
    }

    /// Copies a non-streamed answer as it passes (up to `limit` bytes) for the hook's
    /// [`Outcome::answer`]; a longer answer, one that fails or one the client leaves is not
    /// handed over.
    pub fn copy_answer(mut self, limit: usize) -> Self {
        self.inner.copy_answer(limit);
        self
    }

    /// Continues the stream elsewhere when its upstream breaks after the head
    /// (`policy.stream_resume`); `None` leaves it as it is.
    pub fn resuming(mut self, resumable: Option<Resumable>) -> Self {
        if let Some(resumable) = resumable {
            self.inner.inner_mut().resumable(resumable);
        }
        self
    }

    /// The request's deadline, which the body holds to.
    pub fn deadline(&self) -> Instant {
        self.inner.inner_ref().deadline()
    }

    fn finish(self: Pin<&mut Self>, failure: Option<BodyError>) {
        let mut this = self.project();
        *this.done = true;
        let Some(mut hook) = this.hook.take() else {
            return;
        };
        tell_handovers(&mut *hook, this.inner.inner_ref());
        let answer = match failure {
            None => this.inner.as_mut().take_copy(),
            Some(_) => None,
        };
        let reader = &*this.inner;
        let end = BodyEnd {
            completed: failure.is_none(),
            failure,
            usage: reader.usage(),
            data_events: reader.data_events(),
            elapsed: this.started.elapsed(),
        };
        hook.on_end(Outcome { end, answer });
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        if self.done {
            return Poll::Ready(None);
        }
        let mut this = self.as_mut().project();
        let polled = this.inner.as_mut().poll_frame(cx);
        if this.inner.as_mut().take_first_output() {
            if let Some(hook) = this.hook.as_mut() {
                hook.first_output(this.started.elapsed());
            }
        }
        match polled {
            Poll::Ready(Some(Ok(frame))) => {
                if this.inner.is_end_stream() {
                    self.as_mut().finish(None);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => {
                self.as_mut().finish(None);
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(failure))) => {
                let sse = this.inner.sse();
                self.as_mut().finish(Some(failure));
                match sse {
                    true => Poll::Ready(Some(Ok(Frame::data(sse_error_event(failure))))),
                    false => Poll::Ready(Some(Err(failure))),
                }
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Tells `hook` who generated the later parts of a resumed stream, if any did.
fn tell_handovers(hook: &mut dyn OnEnd, resuming: &Resuming) {
    let handovers = resuming.handovers();
    if !handovers.is_empty() {
        hook.resumed(handovers);
    }
}

/// The last event of a stream that failed after bytes were sent, in the OpenAI error shape.
fn sse_error_event(failure: BodyError) -> Bytes {
    let error = crate::openai::error_body(
        &failure.to_string(),
        "api_error",
        None,
        Some(failure.code()),
    );
    super::sse::data_event(error.to_string().as_bytes())
}
