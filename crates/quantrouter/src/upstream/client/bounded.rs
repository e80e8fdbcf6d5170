//! Connecting within the connect timeout, the TLS handshake included.
//!
//! hyper-util's `HttpConnector` bounds the TCP connect alone; a server that accepts the
//! connection and never answers the TLS ClientHello would leave the request to the header
//! timeout, and the failure would look like one that may have reached the upstream. Bounding
//! the whole connect keeps it a connect error: nothing was sent, another endpoint may do.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::upstream::BoxError;

/// A connector whose every connect ends within `timeout`.
#[derive(Debug, Clone)]
pub(super) struct Bounded<C> {
    pub(super) inner: C,
    pub(super) timeout: Duration,
}

/// The connect, TLS handshake included, took longer than the connect timeout.
#[derive(Debug, thiserror::Error)]
#[error("no connection (TLS handshake included) within {0:?}")]
pub(super) struct ConnectTimeout(Duration);

// === impl Bounded ===

impl<C> tower::Service<http::Uri> for Bounded<C>
where
    C: tower::Service<http::Uri>,
    C::Future: Send + 'static,
    C::Error: Into<BoxError>,
{
    type Response = C::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<C::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let connecting = self.inner.call(uri);
        let timeout = self.timeout;
        Box::pin(async move {
            match tokio::time::timeout(timeout, connecting).await {
                Ok(connected) => connected.map_err(Into::into),
                // Dropping the connect closes its socket.
                Err(_) => Err(ConnectTimeout(timeout).into()),
            }
        })
    }
}
