//! The client connections of one listener: how many may be open, which to shed, how long a
//! request head may take, how long a client may leave the router's writes blocked, and which
//! close at once when the router stops.
//!
//! Each connection is idle (no request in flight) or busy. Idle ones are kept in the order
//! they became idle, so that at the cap the oldest idle connection is closed to make room for
//! a new one; with none idle, the new connection is closed instead. A connection that has
//! begun sending a request head (its first byte read while idle) must finish it within the
//! header timeout; idle keep-alive connections themselves are not timed, since load
//! balancers keep theirs for minutes and a close would race their next request. A
//! connection whose writes stay blocked for the stall timeout (its client reads nothing) is
//! closed. When the listener stops, idle connections — unfinished heads included — close at
//! once, and busy ones as soon as their last request ends.

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::task::AtomicWaker;
use http::Version;
use http_body::{Body, Frame, SizeHint};
use tokio::time::{Instant, Sleep};

/// Every connection of one listener.
#[derive(Debug)]
pub struct Connections {
    limits: Limits,
    registry: Mutex<Registry>,
}

/// What a listener allows its connections.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Connections open at once.
    pub max: usize,
    /// From the first byte of a request head to its end.
    pub header_timeout: Duration,
    /// How long a write to the client may stay blocked.
    pub stall_timeout: Duration,
}

#[derive(Debug, Default)]
struct Registry {
    /// Connections whose task still runs.
    open: usize,
    /// Of those, connections told to close for room that have not closed yet.
    shedding: usize,
    next_id: u64,
    /// Idle connections by when they became idle, oldest first.
    idle: BTreeMap<(Instant, u64), Weak<Conn>>,
    stopping: bool,
}

/// One client connection, shared by its task, its I/O and its requests in flight.
#[derive(Debug)]
pub struct Conn {
    id: u64,
    connections: Arc<Connections>,
    state: Mutex<ConnState>,
    /// Wakes the connection's task to close it.
    waker: AtomicWaker,
}

#[derive(Debug)]
struct ConnState {
    in_flight: usize,
    /// Its key in [`Registry::idle`] while idle.
    idle_since: Option<Instant>,
    /// When the first byte of a request head was read, until the head is complete.
    head_started: Option<Instant>,
    /// Since when a write to the client has been blocked.
    write_blocked: Option<Instant>,
    /// An HTTP/2 connection: its head deadline ends with its first request (see
    /// [`Conn::read`]).
    http2: bool,
    close: Option<Close>,
}

/// Why the router closes a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Close {
    /// The oldest idle connection, to make room at the cap.
    Shed,
    /// Idle when the listener stopped.
    Stopping,
    /// A request head not finished within the header timeout.
    HeaderTimeout,
    /// A client that stopped reading: its writes blocked past the stall timeout, or a
    /// response it left unread past its deadline (see [`super::delivery`]).
    ClientStalled,
}

pin_project_lite::pin_project! {
    /// A connection's task: `inner` serves it until it ends (`Some` of its output) or the
    /// router closes it (`None`).
    #[derive(Debug)]
    pub struct Serving<F> {
        #[pin]
        inner: F,
        conn: Arc<Conn>,
        timer: Option<Pin<Box<Sleep>>>,
    }

    impl<F> PinnedDrop for Serving<F> {
        fn drop(this: Pin<&mut Self>) {
            this.conn.ended();
        }
    }
}

/// A connection's socket, telling [`Conn`] when a request head begins and while writes are
/// blocked.
#[derive(Debug)]
pub struct Tracked<T> {
    io: T,
    conn: Arc<Conn>,
    /// The last write was blocked (kept here to touch the shared state only on changes).
    blocked: bool,
}

/// A request in flight on a connection; the connection is busy while one exists.
#[derive(Debug)]
pub struct InFlight {
    conn: Arc<Conn>,
}

pin_project_lite::pin_project! {
    /// A response body that keeps its request in flight until hyper drops it (sent, or the
    /// connection gone).
    #[derive(Debug)]
    pub struct InFlightBody<B> {
        #[pin]
        inner: B,
        _request: InFlight,
    }
}

// === impl Connections ===

impl Connections {
    pub fn new(limits: Limits) -> Arc<Self> {
        Arc::new(Self {
            limits: Limits {
                max: limits.max.max(1),
                ..limits
            },
            registry: Mutex::default(),
        })
    }

    /// Registers a newly accepted connection, first shedding the oldest idle one when the
    /// listener is at its cap. `None`: every connection is busy, so the new one is refused.
    pub fn accept(self: &Arc<Self>) -> Option<Arc<Conn>> {
        let now = Instant::now();
        let mut registry = self.lock();
        if registry.open - registry.shedding >= self.limits.max {
            let oldest = loop {
                let Some((_, weak)) = registry.idle.pop_first() else {
                    break None;
                };
                // A connection whose task just ended is no longer in the way.
                if let Some(conn) = weak.upgrade() {
                    break Some(conn);
                }
            };
            let oldest = oldest?;
            let mut state = oldest.lock();
            state.idle_since = None;
            if state.close.is_none() {
                registry.shedding += 1;
                state.close = Some(Close::Shed);
                oldest.waker.wake();
            }
        }
        registry.open += 1;
        registry.next_id += 1;
        let conn = Arc::new(Conn {
            id: registry.next_id,
            connections: Arc::clone(self),
            state: Mutex::new(ConnState {
                in_flight: 0,
                idle_since: Some(now),
                head_started: None,
                write_blocked: None,
                http2: false,
                close: None,
            }),
            waker: AtomicWaker::new(),
        });
        registry.idle.insert((now, conn.id), Arc::downgrade(&conn));
        Some(conn)
    }

    /// Connections told to close for room have not closed yet: their tasks should run
    /// before more are accepted, so the process never holds both.
    pub fn shedding(&self) -> bool {
        self.lock().shedding > 0
    }

    /// The listener stopped: idle connections close now, busy ones when they turn idle.
    pub fn stop(&self) {
        let mut registry = self.lock();
        registry.stopping = true;
        for (_, weak) in std::mem::take(&mut registry.idle) {
            if let Some(conn) = weak.upgrade() {
                let mut state = conn.lock();
                state.idle_since = None;
                conn.close(&mut state, Close::Stopping);
            }
        }
    }

    /// Connections open now.
    #[cfg(test)]
    fn open(&self) -> usize {
        self.lock().open
    }

    fn lock(&self) -> MutexGuard<'_, Registry> {
        // Every step under the lock leaves the registry whole: a poisoned one is still valid.
        self.registry
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

// === impl Conn ===

impl Conn {
    /// Serves the connection with `inner` until it ends or the router closes it.
    pub fn serve<F: Future>(self: &Arc<Self>, inner: F) -> Serving<F> {
        Serving {
            inner,
            conn: Arc::clone(self),
            timer: None,
        }
    }

    /// The connection's socket, watched for the start of request heads.
    pub fn track<T>(self: &Arc<Self>, io: T) -> Tracked<T> {
        Tracked {
            io,
            conn: Arc::clone(self),
            blocked: false,
        }
    }

    /// A request's head is complete: the connection is busy until the guard drops.
    pub fn request(self: &Arc<Self>, version: Version) -> InFlight {
        let mut registry = self.connections.lock();
        let mut state = self.lock();
        if let Some(since) = state.idle_since.take() {
            registry.idle.remove(&(since, self.id));
        }
        state.in_flight += 1;
        state.head_started = None;
        state.http2 |= version == Version::HTTP_2;
        InFlight {
            conn: Arc::clone(self),
        }
    }

    /// Asks the connection's task to close it (after the current poll, if it is polling).
    pub fn close_now(&self, why: Close) {
        let mut state = self.lock();
        self.close(&mut state, why);
    }

    fn close(&self, state: &mut ConnState, why: Close) {
        if state.close.is_none() {
            state.close = Some(why);
            self.waker.wake();
        }
    }

    /// Bytes were read. Idle, they begin a request head, which must be complete within the
    /// header timeout. On HTTP/2 only the first head is timed: later bytes on an idle
    /// connection may be pings or settings, and its streams' heads are frames, never
    /// trickled into a half-parsed state that holds a request open.
    fn read(&self) {
        let mut state = self.lock();
        if state.in_flight == 0 && state.head_started.is_none() && !state.http2 {
            state.head_started = Some(Instant::now());
        }
    }

    /// A write to the client blocked (`true`) or went through (`false`).
    fn write_blocked(&self, blocked: bool) {
        self.lock().write_blocked = blocked.then(Instant::now);
    }

    fn request_ended(self: &Arc<Self>) {
        let mut registry = self.connections.lock();
        let mut state = self.lock();
        state.in_flight -= 1;
        if state.in_flight > 0 || state.close.is_some() {
            return;
        }
        if registry.stopping {
            self.close(&mut state, Close::Stopping);
            return;
        }
        let now = Instant::now();
        state.idle_since = Some(now);
        registry.idle.insert((now, self.id), Arc::downgrade(self));
    }

    /// The connection's task ended.
    fn ended(&self) {
        let mut registry = self.connections.lock();
        let state = self.lock();
        registry.open -= 1;
        if state.close == Some(Close::Shed) {
            registry.shedding -= 1;
        }
        if let Some(since) = state.idle_since {
            registry.idle.remove(&(since, self.id));
        }
    }

    fn lock(&self) -> MutexGuard<'_, ConnState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

// === impl Serving ===

impl<F: Future> Future for Serving<F> {
    type Output = Option<F::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<F::Output>> {
        let this = self.project();
        let conn = &**this.conn;
        // Registered before the flag is read, so a close asked for in between wakes us.
        conn.waker.register(cx.waker());
        if conn.lock().close.is_some() {
            return Poll::Ready(None);
        }
        if let Poll::Ready(output) = this.inner.poll(cx) {
            return Poll::Ready(Some(output));
        }
        let limits = &conn.connections.limits;
        let (head, write) = {
            let state = conn.lock();
            if state.close.is_some() {
                return Poll::Ready(None);
            }
            let head = state
                .head_started
                .map(|t| (t + limits.header_timeout, Close::HeaderTimeout));
            let write = state
                .write_blocked
                .map(|t| (t + limits.stall_timeout, Close::ClientStalled));
            (head, write)
        };
        // One timer for the earlier of the two deadlines; re-armed as they change.
        let Some((due, why)) = head.into_iter().chain(write).min_by_key(|(due, _)| *due) else {
            *this.timer = None;
            return Poll::Pending;
        };
        let timer = this
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(due)));
        if timer.deadline() != due {
            timer.as_mut().reset(due);
        }
        if timer.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        tracing::debug!(?why, "closing a client connection");
        conn.close_now(why);
        Poll::Ready(None)
    }
}

// === impl Tracked ===

impl<T: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Tracked<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let read = Pin::new(&mut this.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            this.conn.read();
        }
        read
    }
}

impl<T> Tracked<T> {
    fn wrote<R>(&mut self, written: Poll<R>) -> Poll<R> {
        let blocked = written.is_pending();
        if blocked != self.blocked {
            self.blocked = blocked;
            self.conn.write_blocked(blocked);
        }
        written
    }
}

impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Tracked<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.io).poll_write(cx, buf);
        this.wrote(written)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.wrote(written)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

// === impl InFlight ===

impl InFlight {
    /// Closes the request's connection now (it cannot carry another request).
    pub fn close_connection(&self, why: Close) {
        self.conn.close_now(why);
    }

    /// Keeps the request in flight until hyper drops `body`.
    pub fn hold<B>(self, body: B) -> InFlightBody<B> {
        InFlightBody {
            inner: body,
            _request: self,
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.conn.request_ended();
    }
}

impl<B: Body> Body for InFlightBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        self.project().inner.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn connections(max: usize) -> Arc<Connections> {
        Connections::new(Limits {
            max,
            header_timeout: Duration::from_secs(10),
            stall_timeout: Duration::from_secs(30),
        })
    }

    fn closing(conn: &Conn) -> Option<Close> {
        conn.lock().close
    }

    #[tokio::test(start_paused = true)]
    async fn at_the_cap_the_oldest_idle_connection_is_shed_and_busy_ones_never_are() {
        let conns = connections(2);
        let oldest = conns.accept().unwrap();
        tokio::time::advance(Duration::from_secs(1)).await;
        let busy = conns.accept().unwrap();
        let _request = busy.request(Version::HTTP_11);
        let newer = conns.accept().unwrap();
        assert_eq!(closing(&oldest), Some(Close::Shed));
        assert_eq!(closing(&busy), None);
        assert!(conns.shedding());
        // Its task ends: the room it made is taken by `newer`.
        drop(oldest.serve(std::future::pending::<()>()));
        assert!(!conns.shedding());
        assert_eq!(conns.open(), 2);

        // Every connection busy: a new one is refused, nothing is shed.
        let _also_busy = newer.request(Version::HTTP_11);
        assert!(conns.accept().is_none());
        assert_eq!((closing(&busy), closing(&newer)), (None, None));
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_idle_again_is_shed_by_when_it_became_idle() {
        let conns = connections(2);
        let first = conns.accept().unwrap();
        let second = conns.accept().unwrap();
        // `first` serves a request after `second` went idle: `second` is now the older idle.
        tokio::time::advance(Duration::from_secs(1)).await;
        drop(first.request(Version::HTTP_11));
        let _third = conns.accept().unwrap();
        assert_eq!(closing(&second), Some(Close::Shed));
        assert_eq!(closing(&first), None);
    }

    #[tokio::test(start_paused = true)]
    async fn stopping_closes_idle_connections_now_and_busy_ones_when_their_request_ends() {
        let conns = connections(8);
        let idle = conns.accept().unwrap();
        let half_sent = conns.accept().unwrap();
        half_sent.read();
        let busy = conns.accept().unwrap();
        let request = busy.request(Version::HTTP_11);
        conns.stop();
        assert_eq!(closing(&idle), Some(Close::Stopping));
        assert_eq!(closing(&half_sent), Some(Close::Stopping));
        assert_eq!(closing(&busy), None);
        drop(request);
        assert_eq!(closing(&busy), Some(Close::Stopping));
    }

    #[tokio::test(start_paused = true)]
    async fn heads_are_timed_from_their_first_byte_on_http2_only_until_the_first_request() {
        let conns = connections(8);
        let http1 = conns.accept().unwrap();
        assert_eq!(
            http1.lock().head_started,
            None,
            "an idle connection is not timed"
        );
        http1.read();
        let started = http1.lock().head_started;
        assert!(started.is_some());
        tokio::time::advance(Duration::from_secs(1)).await;
        http1.read();
        assert_eq!(
            http1.lock().head_started,
            started,
            "timed from the first byte"
        );
        drop(http1.request(Version::HTTP_11));
        assert_eq!(http1.lock().head_started, None);
        http1.read();
        assert!(
            http1.lock().head_started.is_some(),
            "each HTTP/1.1 head is timed"
        );

        let http2 = conns.accept().unwrap();
        http2.read();
        assert!(http2.lock().head_started.is_some(), "the preface is timed");
        drop(http2.request(Version::HTTP_2));
        http2.read();
        assert_eq!(
            http2.lock().head_started,
            None,
            "pings on an idle HTTP/2 connection"
        );
    }
}
