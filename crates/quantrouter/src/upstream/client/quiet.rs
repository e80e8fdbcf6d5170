//! HTTP/1.1 connections that refuse a new request while bytes nobody asked for wait on them.
//!
//! A kept-alive connection can only tell answers apart by their order: bytes a server sent
//! after a complete answer (a second answer, the tail of a broken one) would be read as the
//! answer to the next request, which may be another client's. hyper closes such a connection
//! when it reads them, but only once its reactor has seen them; a request dispatched in the
//! meantime would take them as its answer. So before the first byte of each new request on a
//! reused connection, the kernel is asked whether anything is waiting (or the server closed):
//! then nothing is written, the request comes back as [`Sent::No`](super::Sent::No), and the
//! connection is dropped. HTTP/2 frames its streams itself and is not checked.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use hyper::rt::{Read, ReadBufCursor, Write};
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// The marker error of a request refused by the check: nothing of it was written.
#[derive(Debug, thiserror::Error)]
#[error("the kept-alive connection had unread bytes or was closed; the request was not written")]
pub(super) struct NotQuiet;

/// [`HttpConnector`] whose connections are [`Quiet`]-checked (or not, for HTTP/2).
#[derive(Debug, Clone)]
pub(super) struct QuietConnector {
    pub(super) http: HttpConnector,
    pub(super) check: bool,
}

/// A TCP connection that checks it is quiet before each new request on it.
#[derive(Debug)]
pub(super) struct Quiet {
    io: TokioIo<TcpStream>,
    check: bool,
    /// Bytes were read since the last write: the next write starts a new request.
    read_since_write: bool,
}

// === impl QuietConnector ===

impl tower::Service<http::Uri> for QuietConnector {
    type Response = Quiet;
    type Error = <HttpConnector as tower::Service<http::Uri>>::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Quiet, Self::Error>> + Send + 'static>,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.http.poll_ready(cx)
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let connecting = self.http.call(uri);
        let check = self.check;
        Box::pin(async move {
            let io = connecting.await?;
            Ok(Quiet {
                io,
                check,
                read_since_write: false,
            })
        })
    }
}

// === impl Quiet ===

impl Quiet {
    /// Before a new request on a reused connection: refuse it unless nothing is waiting.
    fn ready_to_write(&mut self) -> io::Result<()> {
        if std::mem::take(&mut self.read_since_write) && self.check && !is_quiet(self.io.inner()) {
            return Err(io::Error::other(NotQuiet));
        }
        Ok(())
    }
}

/// Nothing to read: the server neither closed the connection nor sent bytes nobody asked
/// for. A peek straight to the kernel: tokio's readiness answers from what its reactor has
/// seen, which misses bytes that arrived since its last turn.
fn is_quiet(stream: &TcpStream) -> bool {
    use rustix::net::RecvFlags;
    let mut probe = [0u8; 1];
    let peeked = rustix::net::recv(stream, &mut probe, RecvFlags::PEEK | RecvFlags::DONTWAIT);
    matches!(peeked, Err(e) if e == rustix::io::Errno::AGAIN || e == rustix::io::Errno::WOULDBLOCK)
}

impl Read for Quiet {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        // Data or the end: either way, what comes next is no longer this exchange's.
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = polled {
            self.read_since_write = true;
        }
        polled
    }
}

impl Write for Quiet {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.ready_to_write()?;
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.ready_to_write()?;
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl Connection for Quiet {
    fn connected(&self) -> Connected {
        self.io.connected()
    }
}
