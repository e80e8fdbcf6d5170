//! The time limits of an upstream body: the header timeout until the first output, then the
//! idle timeout between frames, and the request deadline throughout.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::time::{Instant, Sleep};

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
    #[error("the upstream ended the stream before its answer finished")]
    Incomplete,
    #[error("the upstream sent an error event mid-stream")]
    ErrorEvent,
}

/// Limits on a response body in flight.
#[derive(Debug, Clone, Copy)]
pub struct TimeLimits {
    pub idle: Duration,
    pub deadline: Instant,
    /// The latest the first output may come: the request was sent + the header timeout.
    pub first_output_by: Instant,
}

pin_project_lite::pin_project! {
    /// A body that fails with a [`BodyError`] when its upstream is silent or late.
    pub struct TimeLimited<B> {
        #[pin]
        inner: B,
        timer: Pin<Box<Sleep>>,
        idle: Duration,
        deadline: Instant,
        // Until the first output, the latest it may come (`None` once it came). Servers
        // that send their head before the prompt is processed (llama.cpp) leave the whole
        // prefill to this wait, so it gets the header timeout, not the idle one.
        first_output_by: Option<Instant>,
        last_frame: Instant,
    }
}

/// A body told when the first output passed, after which only the idle timeout applies.
pub trait AwaitsOutput {
    fn output_came(self: Pin<&mut Self>);
}

impl<B> TimeLimited<B> {
    pub fn new(inner: B, limits: TimeLimits) -> Self {
        let first_output_by = Some(limits.first_output_by.min(limits.deadline));
        let (until, _) = expiry(
            limits.idle,
            limits.deadline,
            first_output_by,
            Instant::now(),
        );
        Self {
            inner,
            timer: Box::pin(tokio::time::sleep_until(until)),
            idle: limits.idle,
            deadline: limits.deadline,
            first_output_by,
            last_frame: Instant::now(),
        }
    }

    /// The request's deadline, which the body holds to.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }
}

impl<B> AwaitsOutput for TimeLimited<B> {
    fn output_came(self: Pin<&mut Self>) {
        let this = self.project();
        if this.first_output_by.take().is_none() {
            return;
        }
        // The wait for the first output may have been the longer one: the idle timeout
        // applies from now on.
        let (until, _) = expiry(*this.idle, *this.deadline, None, *this.last_frame);
        if until < this.timer.deadline() {
            this.timer.as_mut().reset(until);
        }
    }
}

/// When a body times out if nothing comes, and what the failure then is.
fn expiry(
    idle: Duration,
    deadline: Instant,
    first_output_by: Option<Instant>,
    last_frame: Instant,
) -> (Instant, BodyError) {
    let idle_until = last_frame + idle;
    let (until, failure) = match first_output_by {
        Some(by) if by > idle_until => (by, BodyError::FirstOutput),
        _ => (idle_until, BodyError::Idle(idle)),
    };
    match until < deadline {
        true => (until, failure),
        false => (deadline, BodyError::Deadline),
    }
}

impl<B: Body<Data = Bytes>> Body for TimeLimited<B> {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let mut this = self.project();
        match this.inner.as_mut().poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                // Re-arming the timer per chunk would cost a timer-wheel update per token;
                // noting the time and re-arming lazily when it fires is enough.
                *this.last_frame = Instant::now();
                // An upstream with data always ready never lets the timer fire.
                if *this.last_frame >= *this.deadline {
                    return Poll::Ready(Some(Err(BodyError::Deadline)));
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Ready(Some(Err(_))) => Poll::Ready(Some(Err(BodyError::Upstream))),
            Poll::Pending => loop {
                if this.timer.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                let (until, failure) = expiry(
                    *this.idle,
                    *this.deadline,
                    *this.first_output_by,
                    *this.last_frame,
                );
                if Instant::now() >= until {
                    return Poll::Ready(Some(Err(failure)));
                }
                this.timer.as_mut().reset(until);
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

// === impl BodyError ===

impl BodyError {
    /// Metric label.
    pub fn kind(self) -> &'static str {
        match self {
            Self::Upstream => "mid_stream",
            Self::Idle(_) => "idle_timeout",
            Self::FirstOutput => "header_timeout",
            Self::Deadline => "deadline",
            Self::Incomplete => "incomplete",
            Self::ErrorEvent => "error_event",
        }
    }

    /// The `code` of the error event a stream that failed ends with.
    pub(super) fn code(self) -> &'static str {
        match self {
            BodyError::Upstream | BodyError::Incomplete | BodyError::ErrorEvent => "upstream_error",
            BodyError::Idle(_) | BodyError::FirstOutput | BodyError::Deadline => "timeout",
        }
    }
}
