//! The listener, one task per connection, and the handle tests and the demo hold.

use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};
use tokio_rustls::TlsAcceptor;

use crate::config::SimConfig;
use crate::faults::Faults;
use crate::metrics::SimStats;
use crate::routes;
use crate::state::SimState;

/// Pause after a failed `accept` (e.g. out of file descriptors) so the loop does not spin.
const ACCEPT_ERROR_BACKOFF: Duration = Duration::from_millis(50);

/// A running simulator bound to a TCP port. Dropping it stops the accept loop and aborts open
/// connections, like [`SimServer::shutdown`] without waiting.
pub struct SimServer {
    state: Arc<SimState>,
    local_addr: SocketAddr,
    /// Serves HTTPS.
    tls: bool,
    stop: watch::Sender<bool>,
    accept_loop: Option<JoinHandle<()>>,
}

/// Like vLLM behind uvicorn (backlog 2048) and more: load tests open thousands of streams at
/// once, and a SYN dropped from a full queue costs a second's retry.
const LISTEN_BACKLOG: u32 = 4096;

fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => TcpSocket::new_v4()?,
        SocketAddr::V6(_) => TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

// === impl SimServer ===

impl SimServer {
    /// Binds `addr` (port 0 picks a free port) and spawns the accept loop on the current tokio
    /// runtime.
    pub async fn bind(addr: SocketAddr, config: SimConfig) -> std::io::Result<SimServer> {
        Self::start(addr, config, None)
    }

    /// [`SimServer::bind`] serving HTTPS with `tls` (see [`crate::tls::server_config`]).
    pub async fn bind_tls(
        addr: SocketAddr,
        config: SimConfig,
        tls: Arc<rustls::ServerConfig>,
    ) -> std::io::Result<SimServer> {
        Self::start(addr, config, Some(TlsAcceptor::from(tls)))
    }

    fn start(
        addr: SocketAddr,
        config: SimConfig,
        tls: Option<TlsAcceptor>,
    ) -> std::io::Result<SimServer> {
        let listener = listen(addr)?;
        let local_addr = listener.local_addr()?;
        let state = Arc::new(SimState::new(config));
        let (stop, stopped) = watch::channel(false);
        let https = tls.is_some();
        let accept_loop = tokio::spawn(accept_loop(listener, state.clone(), tls, stopped));
        tracing::debug!(%local_addr, model = %state.config.model, https, "vllm-sim listening");
        Ok(SimServer {
            state,
            local_addr,
            tls: https,
            stop,
            accept_loop: Some(accept_loop),
        })
    }

    /// The address the listener is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The base URL clients use, e.g. `http://127.0.0.1:8000` (`https://` with TLS); a
    /// wildcard bind address is replaced by loopback because a wildcard cannot be connected
    /// to.
    pub fn url(&self) -> String {
        let mut addr = self.local_addr;
        if addr.ip().is_unspecified() {
            addr.set_ip(match addr {
                SocketAddr::V4(_) => Ipv4Addr::LOCALHOST.into(),
                SocketAddr::V6(_) => Ipv6Addr::LOCALHOST.into(),
            });
        }
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://{addr}")
    }

    /// The counters `GET /sim/stats` reports.
    pub fn stats(&self) -> SimStats {
        self.state.metrics.stats()
    }

    /// Replaces the fault set in force (like `POST /sim/faults`). Out-of-range values are
    /// clamped: an error rate to 0.0..=1.0, a non-error status to 503.
    pub fn set_faults(&self, faults: Faults) {
        self.state.faults.set(faults);
    }

    /// Removes every fault (like `DELETE /sim/faults`).
    pub fn clear_faults(&self) {
        self.state.faults.clear();
    }

    /// The body of the last completion request received (like `GET /sim/last-request`).
    pub fn last_request(&self) -> Option<bytes::Bytes> {
        self.state.last_request()
    }

    /// Requests currently generating.
    pub fn running(&self) -> usize {
        self.state.metrics.running.load(Ordering::Relaxed)
    }

    /// Requests queued for a free sequence slot.
    pub fn waiting(&self) -> usize {
        self.state.metrics.waiting.load(Ordering::Relaxed)
    }

    /// Tokens generated so far (`vllm:generation_tokens_total`); a stream's count stops
    /// growing while its client does not read.
    pub fn generated_tokens(&self) -> u64 {
        self.state.metrics.generation_tokens.load(Ordering::Relaxed)
    }

    /// Stops accepting, closes the listener and aborts open connections; once it returns the
    /// port refuses connections.
    pub async fn shutdown(mut self) {
        // Send fails only when the loop already ended, which is what we want anyway.
        let _ = self.stop.send(true);
        if let Some(accept_loop) = self.accept_loop.take() {
            // A JoinError means the loop was aborted or panicked: it is gone either way.
            let _ = accept_loop.await;
        }
    }
}

impl fmt::Debug for SimServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimServer")
            .field("local_addr", &self.local_addr)
            .field("model", &self.state.config.model)
            .finish_non_exhaustive()
    }
}

impl Drop for SimServer {
    fn drop(&mut self) {
        if let Some(accept_loop) = self.accept_loop.take() {
            // Aborting drops the listener and the JoinSet, which aborts every connection.
            accept_loop.abort();
        }
    }
}

/// Accepts connections until told to stop, then drops the listener and aborts connections.
async fn accept_loop(
    listener: TcpListener,
    state: Arc<SimState>,
    tls: Option<TlsAcceptor>,
    mut stop: watch::Receiver<bool>,
) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            biased;
            // Err means the SimServer was dropped: stop as well.
            changed = stop.changed() => if changed.is_err() || *stop.borrow() { break },
            // Reap finished connection tasks so the set does not grow without bound.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    connections.spawn(serve_connection(stream, peer, state.clone(), tls.clone()));
                }
                Err(error) => {
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(ACCEPT_ERROR_BACKOFF).await;
                }
            },
        }
    }
    drop(listener);
    connections.shutdown().await;
}

/// One connection: HTTP/1.1, or HTTP/2 when the client starts with its preface (h2c with
/// prior knowledge, or h2 chosen by ALPN); over TLS when the server has a certificate.
async fn serve_connection(
    stream: TcpStream,
    peer: SocketAddr,
    state: Arc<SimState>,
    tls: Option<TlsAcceptor>,
) {
    // Stream events are small writes that must leave at once, not wait for Nagle.
    if let Err(error) = stream.set_nodelay(true) {
        tracing::debug!(%error, "set TCP_NODELAY failed");
    }
    let service = service_fn(move |request| routes::dispatch(state.clone(), request));
    let builder = auto::Builder::new(TokioExecutor::new());
    let served = match tls {
        None => {
            builder
                .serve_connection(TokioIo::new(stream), service)
                .await
        }
        Some(tls) => match tls.accept(stream).await {
            Ok(stream) => {
                builder
                    .serve_connection(TokioIo::new(stream), service)
                    .await
            }
            Err(error) => {
                tracing::debug!(%peer, %error, "TLS handshake failed");
                return;
            }
        },
    };
    if let Err(error) = served {
        // Clients leaving mid-request and injected resets both end up here; neither is news.
        tracing::debug!(%peer, %error, "connection ended with an error");
    }
}
