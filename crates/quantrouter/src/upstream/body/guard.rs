//! The in-flight count on the endpoint and the admission slot, held until the body ends.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

use crate::upstream::InflightGuard;

/// In-flight accounting on the endpoint and the profile's admission slot: held until the
/// answer's body ends.
pub type Held = (InflightGuard, Option<crate::resilience::admission::Permit>);

pin_project_lite::pin_project! {
    /// A body that holds [`Held`] until it ends, fails or is dropped.
    pub struct Guarded<B> {
        #[pin]
        inner: B,
        held: Option<Held>,
    }
}

impl<B> Guarded<B> {
    pub fn new(inner: B, held: Option<Held>) -> Self {
        Self { inner, held }
    }

    pub fn inner_ref(&self) -> &B {
        &self.inner
    }

    pub fn inner_mut(&mut self) -> &mut B {
        &mut self.inner
    }

    pub fn inner_pin(self: Pin<&mut Self>) -> Pin<&mut B> {
        self.project().inner
    }
}

impl<B: Body<Data = Bytes>> Body for Guarded<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let mut this = self.project();
        let polled = this.inner.as_mut().poll_frame(cx);
        let ended = match &polled {
            Poll::Ready(None | Some(Err(_))) => true,
            Poll::Ready(Some(Ok(_))) => this.inner.is_end_stream(),
            Poll::Pending => false,
        };
        if ended {
            this.held.take();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
