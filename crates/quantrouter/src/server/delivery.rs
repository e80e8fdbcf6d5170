//! The public port's responses on their way to the client.
//!
//! hyper polls a response body only when the client can take more, so a client that stops
//! reading stops the polls, and with them every timeout the upstream body checks when polled:
//! its admission slot and upstream connection would be held until the client went away. So
//! an upstream response has a watchdog task beside it: from the start on HTTP/2 and for
//! streams, and on HTTP/1.1 from the first time its body waits or sends a second frame (an
//! answer that is whole when it arrives goes out without one). An upstream body is always
//! polled again within the idle timeout and at its deadline (its own timer wakes it then, to
//! end it if its upstream is silent or late), unless hyper cannot take a frame. So a body left
//! unpolled past either, by a margin, is waiting on its client: the watchdog ends it. It also
//! ends every response still open when the shutdown grace ends. Ending one frees the slot and
//! closes the upstream connection (which cancels the generation); an HTTP/1.1 connection left
//! mid-response is closed too. An SSE stream gets a last `data: {"error": …}` event when its
//! client reads again — at the end of the grace, that is every stream still reading.
//!
//! A stream that waits for a tier scaling from zero ([`Relayed::ColdStart`]) is watched the
//! same way: its keep-alive comments wake it more often than the idle timeout, and its wait
//! and upstream body end by the deadline.
//!
//! The upstream's side of these limits is the body's own
//! ([`crate::upstream::body::TimeLimited`]); this watchdog and the connection's stall timer
//! are the client's side, which no body can enforce while hyper does not poll it.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use http::Response;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{Either, Full};
use tokio::sync::watch;
use tokio::task::AbortHandle;
use tokio::time::Instant;

use super::connections::{Close, InFlight};
use crate::upstream::keepalive::KeepAlive;
use crate::upstream::{is_event_stream, BodyError, UpstreamBody};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Body of every response: the router's own (errors, JSON) or the upstream's, streamed.
pub type ResponseBody = Either<Full<Bytes>, Relayed>;

/// A response body as the public port sends it.
#[derive(Debug)]
pub enum Delivered {
    /// The router's own answer, complete: nothing to watch.
    Own {
        body: Full<Bytes>,
        _request: InFlight,
    },
    /// An upstream's body and its watchdog, started at once or when the body first has to
    /// wait ([`deliver`] says which).
    Watched {
        shared: Arc<Mutex<Shared>>,
        watchdog: Watchdog,
    },
}

/// A response's watchdog task, or what it needs to start.
#[derive(Debug)]
pub enum Watchdog {
    Running(AbortHandle),
    /// Not started yet: the body has not had to wait, nor sent more than one frame.
    Idle {
        watch: Watch,
        frames: u8,
    },
}

/// An upstream's body on its way to the client.
#[derive(Debug)]
pub enum Relayed {
    /// As the upstream sends it.
    Upstream(UpstreamBody),
    /// A stream whose head went out before a tier scaling from zero could take it:
    /// keep-alive comments, then the upstream's body or an error event.
    ColdStart {
        body: KeepAlive<ColdAnswer, UpstreamBody>,
        deadline: Instant,
    },
    /// An answer to an agent-API request, in that API (translated where it is chat).
    Agent(Box<crate::apis::AgentBody>),
}

/// What a cold-start stream waits for: the upstream's body, or the error event it ends with.
pub type ColdAnswer = Pin<Box<dyn Future<Output = Result<UpstreamBody, Bytes>> + Send>>;

/// An upstream response, between its body (polled by hyper) and its watchdog.
#[derive(Debug)]
pub struct Shared {
    /// `None` once the body ended or the watchdog ended it.
    body: Option<Relayed>,
    request: Option<InFlight>,
    http1: bool,
    sse: bool,
    /// When hyper last polled the body.
    polled: Instant,
    waker: Option<Waker>,
    /// Why the watchdog ended the response, until the client has been told.
    ended: Option<Ended>,
}

/// Why a watchdog ended a response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Ended {
    #[error("the request deadline passed while the client was not reading")]
    Deadline,
    #[error("the client read nothing for over {0:?}")]
    Stalled(Duration),
    #[error("the router is shutting down")]
    Shutdown,
}

/// What a watchdog needs to know about its response.
#[derive(Debug, Clone)]
pub struct Watch {
    pub deadline: Instant,
    /// The idle timeout, applied to the client's side.
    pub idle: Duration,
    /// Turns true when the shutdown grace is over.
    pub grace_over: watch::Receiver<bool>,
}

/// The response the stack below made, as the public port sends it: an upstream body with a
/// watchdog, the router's own as it is. `request` keeps the connection busy meanwhile.
pub fn deliver(
    response: Response<ResponseBody>,
    request: InFlight,
    http1: bool,
    watch: impl FnOnce(Instant) -> Watch,
) -> Response<Delivered> {
    let (head, body) = response.into_parts();
    let body = match body {
        Either::Left(body) => {
            let body = Delivered::Own {
                body,
                _request: request,
            };
            return Response::from_parts(head, body);
        }
        Either::Right(body) => body,
    };
    let watch = watch(body.deadline());
    let sse = is_event_stream(&head.headers);
    // An HTTP/1.1 answer that is whole when it comes goes out in a poll or two; a task, a
    // timer and a wake-up of another worker for it would cost more than the rest of its
    // way. hyper polls an HTTP/1.1 body as soon as the head is out, and a client that
    // stops reading blocks the connection's writes, which the connection's stall timer
    // ends. HTTP/2 may leave a body unpolled (no window), and streams last: watched at once.
    let lazy = http1 && !sse && matches!(body, Relayed::Upstream(_));
    let shared = Arc::new(Mutex::new(Shared {
        body: Some(body),
        request: Some(request),
        http1,
        sse,
        polled: Instant::now(),
        waker: None,
        ended: None,
    }));
    let watchdog = match lazy {
        true => Watchdog::Idle { watch, frames: 0 },
        false => Watchdog::Running(start(&shared, watch)),
    };
    Response::from_parts(head, Delivered::Watched { shared, watchdog })
}

fn start(shared: &Arc<Mutex<Shared>>, watch: Watch) -> AbortHandle {
    tokio::spawn(guard(Arc::clone(shared), watch)).abort_handle()
}

/// How long past the moment a body should have been polled (its idle timeout or deadline)
/// the watchdog waits before deciding that hyper cannot poll it: far above any scheduling
/// delay, so a body that could end itself does.
const MARGIN: Duration = Duration::from_secs(1);

/// The watchdog: ends the response once its body went unpolled past the idle timeout or the
/// deadline (by [`MARGIN`]), or when the grace ends. Re-checks lazily: a timer re-armed per
/// poll would cost a timer-wheel update per token.
async fn guard(shared: Arc<Mutex<Shared>>, watch: Watch) {
    let Watch {
        deadline,
        idle,
        mut grace_over,
    } = watch;
    loop {
        let due = {
            let state = lock(&shared);
            if state.body.is_none() {
                return;
            }
            (state.polled + idle).min(deadline) + MARGIN
        };
        let now = Instant::now();
        if now >= due {
            let why = match now >= deadline + MARGIN {
                true => Ended::Deadline,
                false => Ended::Stalled(idle),
            };
            return end(&shared, why);
        }
        tokio::select! {
            () = tokio::time::sleep_until(due) => {}
            over = async { grace_over.wait_for(|over| *over).await.is_ok() } => match over {
                true => return end(&shared, Ended::Shutdown),
                // The server is gone without a shutdown: nothing more to wait for.
                false => std::future::pending().await,
            },
        }
    }
}

/// Ends a response: frees its slot and upstream connection at once. A client that stopped
/// reading has its HTTP/1.1 connection closed; at the end of the grace a reading client
/// gets the last event first, and the connection closes after it.
fn end(shared: &Mutex<Shared>, why: Ended) {
    let mut state = lock(shared);
    let Some(body) = state.body.take() else {
        return;
    };
    state.ended = Some(why);
    let request = match why {
        Ended::Shutdown => None,
        Ended::Deadline | Ended::Stalled(_) => state.request.take(),
    };
    let waker = state.waker.take();
    let http1 = state.http1;
    drop(state);
    tracing::debug!(%why, "response ended on the client's side");
    drop(body);
    if let Some(request) = request {
        if http1 {
            request.close_connection(Close::ClientStalled);
        }
    }
    if let Some(waker) = waker {
        waker.wake();
    }
}

fn lock(shared: &Mutex<Shared>) -> MutexGuard<'_, Shared> {
    // Every step under the lock leaves the state whole: a poisoned one is still valid.
    shared
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The last event of a stream the router ended, in the OpenAI error shape.
fn sse_error_event(why: Ended) -> Bytes {
    let code = match why {
        Ended::Deadline | Ended::Stalled(_) => "timeout",
        Ended::Shutdown => "shutting_down",
    };
    let error = crate::openai::error_body(&why.to_string(), "api_error", None, Some(code));
    crate::upstream::sse::data_event(error.to_string().as_bytes())
}

// === impl Relayed ===

impl Relayed {
    /// The request's deadline, which the body holds to.
    fn deadline(&self) -> Instant {
        match self {
            Relayed::Upstream(body) => body.deadline(),
            Relayed::ColdStart { deadline, .. } => *deadline,
            Relayed::Agent(body) => body.inner().deadline(),
        }
    }
}

impl From<UpstreamBody> for Relayed {
    fn from(body: UpstreamBody) -> Self {
        Relayed::Upstream(body)
    }
}

impl Body for Relayed {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match self.get_mut() {
            Relayed::Upstream(body) => Pin::new(body).poll_frame(cx),
            Relayed::ColdStart { body, .. } => Pin::new(body).poll_frame(cx),
            Relayed::Agent(body) => Pin::new(body.as_mut()).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Relayed::Upstream(body) => body.is_end_stream(),
            Relayed::ColdStart { body, .. } => body.is_end_stream(),
            Relayed::Agent(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Relayed::Upstream(body) => body.size_hint(),
            Relayed::ColdStart { body, .. } => body.size_hint(),
            Relayed::Agent(body) => body.size_hint(),
        }
    }
}

// === impl Delivered ===

impl Body for Delivered {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let (shared, watchdog) = match self.get_mut() {
            Delivered::Own { body, .. } => {
                return Pin::new(body)
                    .poll_frame(cx)
                    .map_err(|never| match never {})
            }
            Delivered::Watched { shared, watchdog } => (shared, watchdog),
        };
        let mut state = lock(shared);
        state.polled = Instant::now();
        let Some(body) = state.body.as_mut() else {
            return Poll::Ready(state.ended.take().map(|why| match state.sse {
                true => Ok(Frame::data(sse_error_event(why))),
                false => Err(why.into()),
            }));
        };
        let polled = Pin::new(&mut *body).poll_frame(cx);
        let frame = match &polled {
            Poll::Ready(Some(Ok(_))) => true,
            Poll::Ready(None | Some(Err(_))) => {
                state.body = None;
                false
            }
            Poll::Pending => {
                if !state
                    .waker
                    .as_ref()
                    .is_some_and(|w| w.will_wake(cx.waker()))
                {
                    state.waker = Some(cx.waker().clone());
                }
                false
            }
        };
        let open = state.body.is_some();
        drop(state);
        // A body that has to wait, or sends a second frame, is no longer a whole answer.
        if let Watchdog::Idle { watch, frames } = watchdog {
            *frames += u8::from(frame);
            if open && (polled.is_pending() || *frames > 1) {
                *watchdog = Watchdog::Running(start(shared, watch.clone()));
            }
        }
        polled.map_err(Into::into)
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Delivered::Own { body, .. } => body.is_end_stream(),
            Delivered::Watched { shared, .. } => {
                let state = lock(shared);
                state.ended.is_none() && state.body.as_ref().is_none_or(Body::is_end_stream)
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Delivered::Own { body, .. } => body.size_hint(),
            Delivered::Watched { shared, .. } => lock(shared)
                .body
                .as_ref()
                .map_or_else(SizeHint::default, Body::size_hint),
        }
    }
}

impl Drop for Delivered {
    fn drop(&mut self) {
        if let Delivered::Watched {
            watchdog: Watchdog::Running(watchdog),
            ..
        } = self
        {
            watchdog.abort();
        }
    }
}
