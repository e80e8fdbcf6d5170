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
//!
//! When the process has exactly one CPU per worker (a dedicated CPU set, a whole machine),
//! each worker is also pinned to a CPU of its own ([`Pinning`]). Unpinned, the scheduler
//! moved a worker 1.5 times per request at 200 requests/s on the benchmark machine, onto
//! cores whose caches held other data; pinned, the router was ahead in 15 of 20 same-run
//! rounds, by up to ~45 µs of p50 (docs/performance.md).

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

/// One worker per CPU the process may use (`available_parallelism` honours a cgroup CPU
/// limit and the affinity mask).
pub fn default_count() -> usize {
    std::thread::available_parallelism().map_or(1, NonZeroUsize::get)
}

/// Whether each worker thread is pinned to a CPU of its own (`--pin-workers`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Pinning {
    /// Pin when the process may run on exactly as many CPUs as there are workers: a CPU set
    /// of its own (Kubernetes' static CPU manager, `taskset`) or a whole machine. With more
    /// CPUs allowed than workers (a CPU limit on a shared node) the scheduler places them.
    #[default]
    Auto,
    /// Pin worker i to the i-th CPU the process may use (round robin when workers outnumber
    /// CPUs).
    On,
    /// Leave the workers' placement to the scheduler.
    Off,
}

/// The CPU each of `count` workers is pinned to, or `None` to leave them unpinned, given the
/// CPUs the process may run on (its affinity mask).
fn placement(pinning: Pinning, count: usize, allowed: &[usize]) -> Option<Vec<usize>> {
    let pin = match pinning {
        Pinning::Off => false,
        Pinning::Auto => allowed.len() == count,
        Pinning::On => true,
    };
    (pin && !allowed.is_empty()).then(|| (0..count).map(|i| allowed[i % allowed.len()]).collect())
}

/// [`placement`] for the CPUs the calling thread may run on.
pub fn cpus(pinning: Pinning, count: usize) -> Option<Vec<usize>> {
    placement(pinning, count, &allowed_cpus())
}

/// The CPUs the calling thread may run on (its affinity mask; empty if unreadable).
fn allowed_cpus() -> Vec<usize> {
    core_affinity::get_core_ids()
        .unwrap_or_default()
        .into_iter()
        .map(|core| core.id)
        .collect()
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
/// own runtime, pinned to `cpus[i - 1]` when `cpus` is given. Each returned receiver fires
/// when that worker's `serve` has returned.
pub fn spawn<F, Fut>(
    listeners: Vec<std::net::TcpListener>,
    cpus: Option<&[usize]>,
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
            let cpu = cpus.and_then(|cpus| cpus.get(i).copied());
            std::thread::Builder::new()
                .name(format!("quantrouter-worker-{}", i + 1))
                .spawn(move || {
                    WORKER.with(|w| w.set(i + 1));
                    if let Some(cpu) = cpu {
                        if !core_affinity::set_for_current(core_affinity::CoreId { id: cpu }) {
                            tracing::warn!(worker = i + 1, cpu, "cannot pin the worker to its CPU");
                        }
                    }
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
        let finished = spawn(listeners, None, move |listener: TcpListener| {
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

    #[test]
    fn auto_pins_only_when_the_process_has_one_cpu_per_worker() {
        assert_eq!(placement(Pinning::Auto, 2, &[4, 7]), Some(vec![4, 7]));
        assert_eq!(placement(Pinning::Auto, 2, &[0, 1, 2, 3]), None);
        assert_eq!(placement(Pinning::Auto, 4, &[0, 1]), None);
        assert_eq!(placement(Pinning::Off, 2, &[4, 7]), None);
        assert_eq!(
            placement(Pinning::On, 3, &[0, 1, 2, 3]),
            Some(vec![0, 1, 2])
        );
        assert_eq!(placement(Pinning::On, 3, &[5, 6]), Some(vec![5, 6, 5]));
        // No mask could be read: nothing to pin to.
        assert_eq!(placement(Pinning::On, 2, &[]), None);
    }

    #[tokio::test]
    async fn a_pinned_worker_runs_only_on_its_cpu() {
        let allowed = allowed_cpus();
        // Worker 1 on the last CPU the test may use, worker 2 on the first.
        let cpus = [*allowed.last().unwrap(), allowed[0]];
        let seen = Arc::new(Mutex::new(Vec::new()));
        let record = Arc::clone(&seen);
        let finished = spawn(
            bind(LOOPBACK, 2, 16).unwrap(),
            Some(&cpus),
            move |_listener: TcpListener| {
                let record = Arc::clone(&record);
                async move {
                    record.lock().unwrap().push((current(), allowed_cpus()));
                }
            },
        )
        .unwrap();
        for done in finished {
            done.await.unwrap();
        }
        let mut seen = seen.lock().unwrap().clone();
        seen.sort();
        assert_eq!(seen, vec![(1, vec![cpus[0]]), (2, vec![cpus[1]])]);
        assert_eq!(allowed_cpus(), allowed, "the caller stays unpinned");
    }
}
