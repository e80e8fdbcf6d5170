//! A stream that outlives its upstream (`policy.stream_resume`): when the upstream fails
//! after content reached the client — its connection breaks, it goes silent past the idle
//! timeout, it sends an error event, or its body ends without a finish reason or `[DONE]` —
//! the request's
//! [`Resume`] hook asks another endpoint to continue from the delivered text, and that
//! answer goes on in the same stream ([`super::super::continuation`] makes it fit).
//!
//! A stream that may be resumed is relayed whole event by whole event, so a half-sent event
//! never precedes the continuation; only the delivered text is kept, never the stream. A
//! stream that may not be resumed passes through untouched, as any other body.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use quantrouter_policy::ProfileIndex;
use tokio::time::{Instant, Sleep};

use super::guard::{Guarded, Held};
use super::limits::{AwaitsOutput, BodyError, TimeLimited, TimeLimits};
use crate::profiles::PerToken;
use crate::telemetry::ProfileTelemetry;
use crate::upstream::continuation::{Delivered, Seen};
use crate::upstream::keepalive::MIN_INTERVAL;
use crate::upstream::sse::EventBuffer;
use crate::upstream::{Endpoint, UpstreamIncoming};

/// One upstream's part of the stream, with its own time limits and in-flight accounting.
pub type Part = Guarded<TimeLimited<UpstreamIncoming>>;

/// Asks for continuations of a request's broken stream: the request's own way through the
/// upstreams ([`crate::resilience::resume`]), which also does the bookkeeping of each break.
pub trait Resume: Send + Sync {
    /// A continuation of `broken`, or `None` when none could be had; the stream waits.
    fn resume(&self, broken: Broken) -> Asked;

    /// `broken` is not continued, for the reason given (counted and logged).
    fn refuse(&self, broken: &Broken, why: &'static str);
}

/// A continuation on its way.
pub type Asked = Pin<Box<dyn Future<Output = Option<Continuation>> + Send>>;

/// A stream whose upstream failed after its head reached the client.
#[derive(Debug)]
pub struct Broken {
    /// Who served the part that broke.
    pub served: Served,
    pub failure: BodyError,
    /// The answer text the client has, and the tokens it took.
    pub delivered: String,
    pub tokens: u64,
}

/// The profile and endpoint serving a part of a stream, and the request's attempts so far.
#[derive(Debug, Clone)]
pub struct Served {
    pub profile: ProfileIndex,
    pub endpoint: Arc<Endpoint>,
    pub attempts: u32,
    /// The profile's metric handles and prices: its part is booked at them.
    pub telemetry: Arc<ProfileTelemetry>,
    pub prices: PerToken,
}

/// A continuation that took over the stream: who served it, and the tokens delivered
/// before it (counted as in [`Delivered::tokens`]).
#[derive(Debug, Clone)]
pub struct Handover {
    pub served: Served,
    pub after: u64,
}

/// Another upstream's answer that continues the stream.
#[derive(Debug)]
pub struct Continuation {
    pub incoming: UpstreamIncoming,
    pub held: Option<Held>,
    pub limits: TimeLimits,
    pub served: Served,
}

/// What a stream that may be resumed carries besides its body.
pub struct Resumable {
    hook: Box<dyn Resume>,
    served: Served,
    /// Continuations still allowed (`policy.stream_resume.max_resumes`).
    left: u32,
    delivered: Delivered,
    /// The unfinished event, held until it ends.
    events: EventBuffer,
    /// A continuation being asked for, the failure it answers, and the keep-alive timer.
    asked: Option<(Asked, BodyError, Pin<Box<Sleep>>)>,
    /// How often a stream waiting for its continuation sends an SSE comment: the client
    /// side's watchdog must see it polled within the idle timeout.
    keepalive: Duration,
    /// The current part was told of its first output (its time limit is the idle one now).
    told: bool,
}

pin_project_lite::pin_project! {
    /// The upstream's body, and its continuations when it breaks and may be resumed.
    pub struct Resuming {
        #[pin]
        part: Part,
        resumable: Option<Box<Resumable>>,
        // The continuations that took over, in order, for the books.
        handovers: Vec<Handover>,
    }
}

/// An unfinished event longer than this ends resumption for the stream: it is passed on
/// unexamined, as the SSE scanner does.
const MAX_EVENT: usize = 64 * 1024;

/// What SSE clients ignore, sent while a continuation is asked for.
const COMMENT: &[u8] = b": resuming the stream\n\n";

/// The output of one upstream frame: no copy for a frame of one whole event.
#[derive(Default)]
enum Out {
    #[default]
    Nothing,
    One(Bytes),
    Many(BytesMut),
}

/// What a frame of a part came to.
struct Relayed {
    out: Out,
    /// The part sent an error event: the event, for a stream not resumed.
    error: Option<Bytes>,
}

// === impl Resumable ===

impl Resumable {
    /// `served` answered the stream's head; up to `max_resumes` continuations may follow.
    /// `idle` is the idle timeout, which paces the keep-alive comments of a wait.
    pub fn new(hook: Box<dyn Resume>, served: Served, max_resumes: u32, idle: Duration) -> Self {
        Self {
            hook,
            served,
            left: max_resumes,
            delivered: Delivered::default(),
            events: EventBuffer::default(),
            asked: None,
            keepalive: (idle / 2).clamp(MIN_INTERVAL, Duration::from_secs(5)),
            told: false,
        }
    }

    /// One frame of the current part: its whole events, passed, replaced or dropped, up to
    /// one that says the part broke.
    fn relay(&mut self, data: &[u8]) -> Relayed {
        self.events.push(data);
        let mut out = Out::Nothing;
        while let Some(event) = self.events.next_event() {
            match self.delivered.observe(&event) {
                Seen::Pass => out.push(event),
                Seen::Replace(event) => out.push(event),
                Seen::Drop => {}
                Seen::ErrorEvent => {
                    return Relayed {
                        out,
                        error: Some(event),
                    }
                }
            }
        }
        Relayed { out, error: None }
    }

    /// Starts asking for a continuation after `failure`; false when the stream is not to
    /// be resumed (then it ends as it would without resumption).
    fn ask(&mut self, failure: BodyError) -> bool {
        let delivered = &self.delivered;
        if delivered.finished() {
            // The answer is whole; only what follows its finish is lost.
            return false;
        }
        let broken = Broken {
            served: self.served.clone(),
            failure,
            delivered: delivered.text().to_owned(),
            tokens: delivered.tokens(),
        };
        let refused = match (failure, delivered.refused()) {
            (BodyError::Deadline, _) => Some("the deadline passed"),
            (_, Some(why)) => Some(why.as_str()),
            _ if self.left == 0 => Some("no resumes are left"),
            _ => None,
        };
        if let Some(why) = refused {
            self.hook.refuse(&broken, why);
            return false;
        }
        let timer = Box::pin(tokio::time::sleep(self.keepalive));
        self.asked = Some((self.hook.resume(broken), failure, timer));
        self.events = EventBuffer::default();
        true
    }

    /// A continuation takes over.
    fn took_over(&mut self, served: Served) {
        self.served = served;
        self.left -= 1;
        self.delivered.continue_now();
        self.told = false;
    }
}

impl std::fmt::Debug for Resumable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Resumable")
            .field("served", &self.served)
            .field("left", &self.left)
            .finish_non_exhaustive()
    }
}

// === impl Resuming ===

impl Resuming {
    pub fn new(part: Part) -> Self {
        Self {
            part,
            resumable: None,
            handovers: Vec::new(),
        }
    }

    /// Continues the stream elsewhere when its upstream breaks.
    pub fn resumable(&mut self, resumable: Resumable) {
        self.resumable = Some(Box::new(resumable));
    }

    /// The request's deadline, which every part holds to.
    pub fn deadline(&self) -> Instant {
        self.part.inner_ref().deadline()
    }

    /// The continuations that took over the stream so far.
    pub fn handovers(&self) -> &[Handover] {
        &self.handovers
    }
}

impl AwaitsOutput for Resuming {
    fn output_came(self: Pin<&mut Self>) {
        self.project().part.inner_pin().output_came();
    }
}

impl Body for Resuming {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let mut this = self.project();
        let Some(resumable) = this.resumable.as_deref_mut() else {
            return this.part.poll_frame(cx);
        };
        loop {
            if let Some((asked, failure, timer)) = &mut resumable.asked {
                match asked.as_mut().poll(cx) {
                    Poll::Ready(Some(continuation)) => {
                        resumable.asked = None;
                        let Continuation {
                            incoming,
                            held,
                            limits,
                            served,
                        } = continuation;
                        let part = Guarded::new(TimeLimited::new(incoming, limits), held);
                        this.part.set(part);
                        let after = resumable.delivered.tokens();
                        this.handovers.push(Handover {
                            served: served.clone(),
                            after,
                        });
                        resumable.took_over(served);
                    }
                    Poll::Ready(None) => {
                        let failure = *failure;
                        *this.resumable = None;
                        return Poll::Ready(Some(Err(failure)));
                    }
                    Poll::Pending => {
                        if timer.as_mut().poll(cx).is_pending() {
                            return Poll::Pending;
                        }
                        let next = Instant::now() + resumable.keepalive;
                        timer.as_mut().reset(next);
                        return Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(COMMENT)))));
                    }
                }
            }
            let failure = match this.part.as_mut().poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(frame))) => {
                    let data = match frame.into_data() {
                        Ok(data) => data,
                        Err(other) => return Poll::Ready(Some(Ok(other))),
                    };
                    let Relayed { mut out, error } = resumable.relay(&data);
                    if !resumable.told && !out.is_empty() && resumable.delivered.tokens() > 0 {
                        // A continuation's first output: the idle timeout applies from here.
                        resumable.told = true;
                        this.part.as_mut().inner_pin().output_came();
                    }
                    let Some(event) = error else {
                        if resumable.events.pending() > MAX_EVENT {
                            // Not examined any more: the stream passes on as it comes.
                            out.push(resumable.events.take_rest());
                            *this.resumable = None;
                            return Poll::Ready(out.into_frame());
                        }
                        match out.into_frame() {
                            Some(frame) => return Poll::Ready(Some(frame)),
                            None => continue,
                        }
                    };
                    if resumable.ask(BodyError::ErrorEvent) {
                        close(this.part.as_mut());
                        match out.into_frame() {
                            Some(frame) => return Poll::Ready(Some(frame)),
                            None => continue,
                        }
                    }
                    // Not resumed: the rest passes as it came, as without resumption.
                    out.push(event);
                    out.push(resumable.events.take_rest());
                    *this.resumable = None;
                    return Poll::Ready(out.into_frame());
                }
                Poll::Ready(None) if resumable.delivered.finished() => {
                    let rest = resumable.events.take_rest();
                    *this.resumable = None;
                    return Poll::Ready((!rest.is_empty()).then(|| Ok(Frame::data(rest))));
                }
                Poll::Ready(None) => BodyError::Incomplete,
                Poll::Ready(Some(Err(failure))) => failure,
            };
            if resumable.ask(failure) {
                close(this.part.as_mut());
                continue;
            }
            let rest = resumable.events.take_rest();
            *this.resumable = None;
            return Poll::Ready(match failure {
                // A body that ended: the event it never ended goes out, as without resumption.
                BodyError::Incomplete => (!rest.is_empty()).then(|| Ok(Frame::data(rest))),
                failure => Some(Err(failure)),
            });
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.resumable {
            Some(resumable) if resumable.asked.is_some() => false,
            Some(resumable) => {
                resumable.delivered.finished()
                    && self.part.is_end_stream()
                    && resumable.events.pending() == 0
            }
            None => self.part.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.resumable {
            Some(_) => SizeHint::default(),
            None => self.part.size_hint(),
        }
    }
}

/// Ends a broken part at once: its upstream request is cancelled and its endpoint and
/// admission slot freed before a continuation is asked for.
fn close(mut part: Pin<&mut Part>) {
    let deadline = part.as_ref().get_ref().inner_ref().deadline();
    let limits = TimeLimits {
        idle: Duration::ZERO,
        deadline,
        first_output_by: deadline,
    };
    let ended = UpstreamIncoming::buffered(Bytes::new());
    part.set(Guarded::new(TimeLimited::new(ended, limits), None));
}

// === impl Out ===

impl Out {
    fn push(&mut self, bytes: Bytes) {
        if bytes.is_empty() {
            return;
        }
        *self = match std::mem::take(self) {
            Out::Nothing => Out::One(bytes),
            Out::One(first) => {
                let mut many = BytesMut::with_capacity(first.len() + bytes.len());
                many.extend_from_slice(&first);
                many.extend_from_slice(&bytes);
                Out::Many(many)
            }
            Out::Many(mut many) => {
                many.extend_from_slice(&bytes);
                Out::Many(many)
            }
        };
    }

    fn is_empty(&self) -> bool {
        matches!(self, Out::Nothing)
    }

    fn into_frame(self) -> Option<Result<Frame<Bytes>, BodyError>> {
        match self {
            Out::Nothing => None,
            Out::One(bytes) => Some(Ok(Frame::data(bytes))),
            Out::Many(many) => Some(Ok(Frame::data(many.freeze()))),
        }
    }
}

#[cfg(test)]
mod tests;
