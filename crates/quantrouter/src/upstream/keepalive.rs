//! A streamed answer that has to wait for a tier scaling from zero: the response head goes
//! out at once, SSE comments keep the connection alive while the tier comes up (proxies and
//! clients with idle timeouts would otherwise give up), then the upstream's stream follows.
//! If the wait fails, the stream ends with an SSE error event, as any failure after the
//! first byte does.

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::time::Sleep;

/// What SSE clients ignore: a comment line.
pub const COMMENT: &[u8] = b": waiting for a tier to start\n\n";

/// The shortest interval between two comments: more often keeps nothing more alive, and
/// a tiny idle timeout would otherwise turn a wait into a flood of comments.
pub const MIN_INTERVAL: Duration = Duration::from_millis(250);

/// A body that sends [`COMMENT`] every `interval` (at least [`MIN_INTERVAL`]) until
/// `answer` resolves, then `answer`'s body, or the error event it resolves to.
pub struct KeepAlive<F, B> {
    state: State<F, B>,
    interval: Duration,
    timer: Pin<Box<Sleep>>,
}

enum State<F, B> {
    Waiting(Pin<Box<F>>),
    Streaming(B),
    /// The error event is sent; the body is over.
    Done,
}

// === impl KeepAlive ===

impl<F, B> KeepAlive<F, B>
where
    F: Future<Output = Result<B, Bytes>>,
{
    pub fn new(answer: F, interval: Duration) -> Self {
        let interval = interval.max(MIN_INTERVAL);
        Self {
            state: State::Waiting(Box::pin(answer)),
            interval,
            timer: Box::pin(tokio::time::sleep(interval)),
        }
    }
}

impl<F, B> std::fmt::Debug for KeepAlive<F, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match self.state {
            State::Waiting(_) => "waiting",
            State::Streaming(_) => "streaming",
            State::Done => "done",
        };
        f.debug_struct("KeepAlive").field("state", &state).finish()
    }
}

impl<F, B> Body for KeepAlive<F, B>
where
    F: Future<Output = Result<B, Bytes>>,
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        // Every field is Unpin (the future and the timer are boxed).
        let this = self.get_mut();
        loop {
            match &mut this.state {
                State::Waiting(answer) => match answer.as_mut().poll(cx) {
                    Poll::Ready(Ok(body)) => this.state = State::Streaming(body),
                    Poll::Ready(Err(event)) => {
                        this.state = State::Done;
                        return Poll::Ready(Some(Ok(Frame::data(event))));
                    }
                    Poll::Pending => {
                        ready!(this.timer.as_mut().poll(cx));
                        let next = tokio::time::Instant::now() + this.interval;
                        this.timer.as_mut().reset(next);
                        return Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(COMMENT)))));
                    }
                },
                State::Streaming(body) => return Pin::new(body).poll_frame(cx),
                State::Done => return Poll::Ready(None),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.state {
            State::Streaming(body) => body.is_end_stream(),
            State::Waiting(_) => false,
            State::Done => true,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.state {
            State::Streaming(body) => body.size_hint(),
            _ => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::{BodyExt, Full};

    use super::*;

    async fn frames(
        mut body: impl Body<Data = Bytes, Error = std::convert::Infallible> + Unpin,
    ) -> Vec<Bytes> {
        let mut out = Vec::new();
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame.unwrap().into_data() {
                out.push(data);
            }
        }
        out
    }

    #[tokio::test(start_paused = true)]
    async fn comments_flow_until_the_tier_answers_then_its_stream() {
        let answer = async {
            tokio::time::sleep(Duration::from_secs(12)).await;
            Ok(Full::new(Bytes::from_static(
                b"data: {\"choices\": []}\n\n",
            )))
        };
        let got = frames(KeepAlive::new(answer, Duration::from_secs(5))).await;
        assert_eq!(got.len(), 3, "{got:?}");
        assert_eq!(got[0], Bytes::from_static(COMMENT));
        assert_eq!(got[1], Bytes::from_static(COMMENT));
        assert!(got[2].starts_with(b"data: "));
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_wait_ends_with_its_error_event_and_a_quick_one_sends_no_comment() {
        let failed = async {
            tokio::time::sleep(Duration::from_secs(7)).await;
            Err::<Full<Bytes>, _>(Bytes::from_static(b"data: {\"error\": {}}\n\n"))
        };
        let got = frames(KeepAlive::new(failed, Duration::from_secs(5))).await;
        assert_eq!(
            got,
            [
                Bytes::from_static(COMMENT),
                Bytes::from_static(b"data: {\"error\": {}}\n\n")
            ]
        );
        let quick = async { Ok(Full::new(Bytes::from_static(b"data: x\n\n"))) };
        let got = frames(KeepAlive::new(quick, Duration::from_secs(5))).await;
        assert_eq!(got, [Bytes::from_static(b"data: x\n\n")]);
    }

    #[tokio::test(start_paused = true)]
    async fn comments_come_no_more_often_than_the_floor() {
        let answer = async {
            tokio::time::sleep(Duration::from_millis(5_100)).await;
            Ok(Full::new(Bytes::new()))
        };
        let got = frames(KeepAlive::new(answer, Duration::from_millis(1))).await;
        let comments = got.iter().filter(|f| f == &&Bytes::from_static(COMMENT));
        assert_eq!(
            comments.count(),
            20,
            "one every 250 ms, not every millisecond"
        );
    }
}
