//! Thread-per-core serving of the public port.
//!
//! Each worker is an OS thread with a single-threaded tokio runtime of its own and a
//! listening socket of its own on the public address (`SO_REUSEPORT`: the kernel spreads new
//! connections over the sockets). A client connection, its requests and their upstream
//! connections stay on one thread from accept to close: no work stealing, no wake-up of a
//! second thread per request, and one idle-connection pool per worker (see
//! [`crate::upstream::UpstreamClient`]), so no lock is shared on the request path.
//!
//! Everything else — the admin port, profile sources, discovery, scraping, KEDA — runs on
//! the runtime that started the server.

use std::cell::Cell;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::time::Duration;

use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::oneshot;
use tokio::time::MissedTickBehavior;

thread_local! {
    static WORKER: Cell<usize> = const { Cell::new(0) };
}

/// 1-based index of the worker thread running the caller; 0 on any other thread.
pub fn current() -> usize {
    WORKER.with(Cell::get)
}

/// Makes the calling thread count as worker `index` (0: none).
#[cfg(test)]
pub(crate) fn set_current(index: usize) {
    WORKER.with(|w| w.set(index));
}

/// One worker per CPU the process may use (`available_parallelism` honours a cgroup CPU
/// limit and the affinity mask).
pub fn default_count() -> usize {
    std::thread::available_parallelism().map_or(1, NonZeroUsize::get)
}

/// `count` listening sockets on `addr` (port 0 picks one port for all), bound together with
/// `SO_REUSEPORT`, each deregistered from the calling runtime for a worker to take over.
///
/// The address is first bound alone, without `SO_REUSEPORT`: a port held by anyone else —
/// another router included — is an error here, never a silently shared port.
pub fn bind(
    addr: SocketAddr,
    count: usize,
    backlog: u32,
) -> io::Result<Vec<std::net::TcpListener>> {
    let addr = {
        let probe = socket(addr)?;
        probe.bind(addr)?;
        probe.local_addr()?
    };
    (0..count.max(1))
        .map(|_| {
            let socket = socket(addr)?;
            socket.set_reuseport(true)?;
            socket.bind(addr)?;
            socket.listen(backlog)?.into_std()
        })
        .collect()
}

/// A TCP socket for `addr`'s family with `SO_REUSEADDR` (a restart binds at once).
pub fn socket(addr: SocketAddr) -> io::Result<TcpSocket> {
    let socket = match addr {
        SocketAddr::V4(_) => TcpSocket::new_v4()?,
        SocketAddr::V6(_) => TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    Ok(socket)
}

/// Starts one worker thread per listener; worker `i` (1-based) runs `serve(listener)` on its
/// own runtime. Each returned receiver fires when that worker's `serve` has returned.
pub fn spawn<F, Fut>(
    listeners: Vec<std::net::TcpListener>,
    serve: F,
) -> io::Result<Vec<oneshot::Receiver<()>>>
where
    F: Fn(TcpListener) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = ()>,
{
    listeners
        .into_iter()
        .enumerate()
        .map(|(i, listener)| {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let (done, finished) = oneshot::channel();
            let serve = serve.clone();
            std::thread::Builder::new()
                .name(format!("quantrouter-worker-{}", i + 1))
                .spawn(move || {
                    WORKER.with(|w| w.set(i + 1));
                    runtime.block_on(async move {
                        let tick = tokio::spawn(tick_every_second());
                        match TcpListener::from_std(listener) {
                            Ok(listener) => serve(listener).await,
                            Err(error) => tracing::error!(%error, "worker cannot listen"),
                        }
                        tick.abort();
                    });
                    // Connections still open after `serve` (past the grace period) are
                    // dropped with the runtime.
                    let _ = done.send(());
                })?;
            Ok(finished)
        })
        .collect()
}

/// Keeps a timer due within a second pending on a worker's runtime.
///
/// tokio wakes its own driver — an `eventfd` write, then one more `epoll_wait` — whenever a
/// timer is registered that is due before the driver's planned wake-up, and always when no
/// timer was pending as it went to sleep. A request's header and body timeouts (tens of
/// seconds) were registered on an otherwise timer-free worker, so every request paid those
/// two system calls. With this tick pending the planned wake-up is at most a second away and
/// timeouts longer than that register without one; the cost is a wake-up a second.
async fn tick_every_second() {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeSet, HashSet};
    use std::io::{Read as _, Write as _};
    use std::sync::{Arc, Mutex};

    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;

    const LOOPBACK: SocketAddr =
        SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 0);

    #[tokio::test]
    async fn every_worker_gets_a_socket_on_one_port() {
        let listeners = bind(LOOPBACK, 3, 16).unwrap();
        let ports: BTreeSet<u16> = listeners
            .iter()
            .map(|l| l.local_addr().unwrap().port())
            .collect();
        assert_eq!(listeners.len(), 3);
        assert_eq!(ports.len(), 1, "{ports:?}");
        assert_ne!(ports.first(), Some(&0));
    }

    #[tokio::test]
    async fn a_port_in_use_is_an_error_never_a_shared_port() {
        let plain = std::net::TcpListener::bind(LOOPBACK).unwrap();
        let taken = plain.local_addr().unwrap();
        let error = bind(taken, 2, 16).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::AddrInUse);

        // Another router's SO_REUSEPORT group would take a share of the connections.
        let group = bind(LOOPBACK, 2, 16).unwrap();
        let error = bind(group[0].local_addr().unwrap(), 2, 16).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::AddrInUse);
    }

    #[tokio::test]
    async fn each_worker_serves_on_a_thread_and_runtime_of_its_own() {
        assert_eq!(current(), 0, "the test's thread is no worker");
        let listeners = bind(LOOPBACK, 2, 16).unwrap();
        let addr = listeners[0].local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let record = Arc::clone(&seen);
        // Each worker answers one connection with its index, then returns.
        let finished = spawn(listeners, move |listener: TcpListener| {
            let record = Arc::clone(&record);
            async move {
                let thread = std::thread::current().id();
                record.lock().unwrap().push((current(), thread));
                let (mut conn, _) = listener.accept().await.unwrap();
                let mut byte = [0u8; 1];
                conn.read_exact(&mut byte).await.unwrap();
                conn.write_all(&[current() as u8]).await.unwrap();
            }
        })
        .unwrap();
        // The kernel picks a socket per connection; connect until both workers answered.
        let mut answered = BTreeSet::new();
        for _ in 0..200 {
            if answered.len() == 2 {
                break;
            }
            let mut conn = std::net::TcpStream::connect(addr).unwrap();
            conn.set_read_timeout(Some(std::time::Duration::from_millis(200)))
                .unwrap();
            conn.write_all(b"?").unwrap();
            let mut index = [0u8; 1];
            if conn.read_exact(&mut index).is_ok() {
                answered.insert(index[0]);
            }
        }
        assert_eq!(answered, BTreeSet::from([1, 2]));
        for done in finished {
            done.await.unwrap();
        }
        let seen = seen.lock().unwrap();
        let indices: BTreeSet<usize> = seen.iter().map(|(i, _)| *i).collect();
        let threads: HashSet<_> = seen.iter().map(|(_, t)| *t).collect();
        assert_eq!(indices, BTreeSet::from([1, 2]));
        assert_eq!(threads.len(), 2);
        assert!(!threads.contains(&std::thread::current().id()));
    }
}
