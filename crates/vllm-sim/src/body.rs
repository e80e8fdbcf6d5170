//! The response body: either one buffer, or a channel fed by a generating task so stream
//! events leave as soon as they are produced.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::sync::mpsc;

/// Why a streamed body ended with an error, which makes hyper abort the connection so the
/// client sees an incomplete stream rather than a clean end.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BodyError {
    #[error("stream reset by an injected fault")]
    InjectedReset,
    #[error("failed to encode a stream event: {0}")]
    Encode(#[from] serde_json::Error),
}

/// One item sent by a stream's producer.
pub(crate) type StreamItem = Result<Bytes, BodyError>;

/// A response body.
#[derive(Debug)]
pub(crate) enum SimBody {
    /// A complete body, sent with a `content-length`.
    Full(Option<Bytes>),
    /// Events from a producer task; the channel closing ends the body.
    Channel {
        rx: mpsc::Receiver<StreamItem>,
        /// An event taken from the channel before the head went out, sent first.
        first: Option<Bytes>,
        /// An error received but not yet returned; see `poll_frame`.
        deferred: Option<BodyError>,
        /// The producer finished before the head went out.
        ended: bool,
    },
}

// === impl SimBody ===

impl SimBody {
    pub(crate) fn empty() -> Self {
        Self::Full(None)
    }

    pub(crate) fn full(data: impl Into<Bytes>) -> Self {
        let data = data.into();
        Self::Full((!data.is_empty()).then_some(data))
    }

    /// A streamed body; `first` is what was already taken from `rx` (`Some(None)`: the
    /// channel had closed).
    pub(crate) fn channel(
        first: Option<Option<StreamItem>>,
        rx: mpsc::Receiver<StreamItem>,
    ) -> Self {
        let (first, deferred, ended) = match first {
            None => (None, None, false),
            Some(None) => (None, None, true),
            Some(Some(Ok(data))) => (Some(data), None, false),
            Some(Some(Err(error))) => (None, Some(error), false),
        };
        Self::Channel {
            rx,
            first,
            deferred,
            ended,
        }
    }
}

impl Body for SimBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match self.get_mut() {
            Self::Full(data) => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            Self::Channel {
                rx,
                first,
                deferred,
                ended,
            } => {
                if let Some(data) = first.take() {
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                if let Some(error) = deferred.take() {
                    return Poll::Ready(Some(Err(error)));
                }
                if *ended {
                    return Poll::Ready(None);
                }
                match rx.poll_recv(cx) {
                    Poll::Ready(Some(Ok(data))) => Poll::Ready(Some(Ok(Frame::data(data)))),
                    // hyper drops its write buffer when a body fails, so the events already
                    // handed over could be lost. Returning Pending once lets hyper flush them
                    // first; the self-wake brings it straight back for the error.
                    Poll::Ready(Some(Err(error))) => {
                        *deferred = Some(error);
                        cx.waker().wake_by_ref();
                        Poll::Pending
                    }
                    Poll::Ready(None) => Poll::Ready(None),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, Self::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Self::Full(data) => SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64)),
            Self::Channel { .. } => SizeHint::default(),
        }
    }
}
