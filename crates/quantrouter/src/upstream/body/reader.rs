//! What the router reads from an answer as it passes: an SSE stream's events (the first
//! output, usage events cut out of the stream, events delivered), or a whole answer's tail
//! for its `usage`, and a copy of a whole answer when one is asked for.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};

use super::limits::AwaitsOutput;
use crate::openai::{find_usage, Usage};
use crate::upstream::sse::{EventScan, Scanned};

pin_project_lite::pin_project! {
    /// A body read as it passes (see the module).
    pub struct Reader<B> {
        #[pin]
        inner: B,
        read: Read,
    }
}

/// What a [`Reader`] found so far.
struct Read {
    /// An SSE stream's events: the first output, and usage events cut out of the stream
    /// (the router asked for them, not the client).
    events: Option<EventScan>,
    /// No output yet: for a stream, no event with generated output; otherwise no data.
    awaiting_output: bool,
    /// The first output of a stream passed and nobody was told yet.
    first_output: bool,
    // The end of the body so far, to read `usage` from at the end (unused when usage
    // events are stripped: their counts are taken as they pass).
    tail: UsageTail,
    // A copy of a whole answer as it passes, for calibration.
    copy: Option<BytesMut>,
    copy_limit: usize,
    /// The body ended (`Some(usage)` once it did, `usage` itself when reported).
    ended: Option<Option<Usage>>,
}

impl<B> Reader<B> {
    /// Reads an SSE stream's events (cutting usage-only ones out with `strip_usage`), or,
    /// without `sse`, a whole answer.
    pub fn new(inner: B, sse: bool, strip_usage: bool) -> Self {
        Self {
            inner,
            read: Read {
                events: sse.then(|| EventScan::new(strip_usage)),
                awaiting_output: true,
                first_output: false,
                tail: UsageTail::default(),
                copy: None,
                copy_limit: 0,
                ended: None,
            },
        }
    }

    pub fn inner_ref(&self) -> &B {
        &self.inner
    }

    pub fn inner_mut(&mut self) -> &mut B {
        &mut self.inner
    }

    /// Copies a non-streamed answer as it passes, up to `limit` bytes.
    pub fn copy_answer(&mut self, limit: usize) {
        if self.read.events.is_none() {
            self.read.copy = Some(BytesMut::new());
            self.read.copy_limit = limit;
        }
    }

    pub fn sse(&self) -> bool {
        self.read.events.is_some()
    }

    /// An SSE stream's events with data that went on ([`EventScan::data_events`]).
    pub fn data_events(&self) -> u64 {
        self.read.events.as_ref().map_or(0, |e| e.data_events)
    }

    /// The usage the body reported, once it ended.
    pub fn usage(&self) -> Option<Usage> {
        self.read.ended.flatten()
    }

    /// The usage the upstream reported in what was read, for a body left before its end (its
    /// client went away): the counts of a usage event taken as it passed, or those of a
    /// stream whose last event went on before the client left, which then had the whole
    /// answer. `None` otherwise: the answer was cut short of its counts.
    pub fn usage_so_far(self: Pin<&mut Self>) -> Option<Usage> {
        let read = self.project().read;
        match read.ended {
            Some(ended) => ended,
            None => reported_usage(read.events.as_ref(), &mut read.tail, false),
        }
    }

    /// Whether the first output of a stream passed since the last call.
    pub fn take_first_output(self: Pin<&mut Self>) -> bool {
        std::mem::take(&mut self.project().read.first_output)
    }

    /// The copy of a whole answer, when the body completed within the copy's limit.
    pub fn take_copy(self: Pin<&mut Self>) -> Option<Bytes> {
        let read = self.project().read;
        read.ended?;
        read.copy.take().map(BytesMut::freeze)
    }
}

impl<B> Body for Reader<B>
where
    B: Body<Data = Bytes> + AwaitsOutput,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let mut this = self.project();
        let read = this.read;
        if read.ended.is_some() {
            return Poll::Ready(None);
        }
        loop {
            match this.inner.as_mut().poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    let data = match frame.into_data() {
                        Ok(data) => data,
                        Err(other) => return Poll::Ready(Some(Ok(other))),
                    };
                    let awaiting = read.awaiting_output;
                    let out = read.pass(data);
                    if awaiting && !read.awaiting_output {
                        this.inner.as_mut().output_came();
                    }
                    // hyper stops polling a body that reports its end (a sized body after
                    // its last byte), so the end is handled together with the last frame.
                    if !this.inner.is_end_stream() {
                        match out {
                            Some(out) => return Poll::Ready(Some(Ok(Frame::data(out)))),
                            None => continue,
                        }
                    }
                    return Poll::Ready(read.end(out).map(|last| Ok(Frame::data(last))));
                }
                Poll::Ready(None) => {
                    return Poll::Ready(read.end(None).map(|last| Ok(Frame::data(last))));
                }
                Poll::Ready(Some(Err(error))) => {
                    read.copy = None;
                    return Poll::Ready(Some(Err(error)));
                }
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.read.ended.is_some() || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

// === impl Read ===

impl Read {
    /// One frame of data: what of it goes on now.
    fn pass(&mut self, data: Bytes) -> Option<Bytes> {
        let Some(events) = &mut self.events else {
            // Not a stream: any data is the answer coming.
            self.awaiting_output = false;
            self.tail.push(&data);
            if let Some(copy) = &mut self.copy {
                match copy.len() + data.len() <= self.copy_limit {
                    true => copy.extend_from_slice(&data),
                    false => self.copy = None,
                }
            }
            return Some(data);
        };
        let scanned = events.feed(data);
        if scanned.first_output {
            self.awaiting_output = false;
            self.first_output = true;
        }
        if let (Some(out), false) = (&scanned.out, self.strips_usage()) {
            self.tail.push(out);
        }
        scanned.out
    }

    /// The body ended after `out`: the last data to send, with anything held back.
    fn end(&mut self, out: Option<Bytes>) -> Option<Bytes> {
        let rest = match &mut self.events {
            Some(events) => events.finish(),
            None => Scanned::default(),
        };
        if rest.first_output {
            self.awaiting_output = false;
            self.first_output = true;
        }
        let last = match (out, rest.out) {
            (out, None) => out,
            (None, rest) => rest,
            // Copied only to append a held-back partial event: a whole answer in one frame
            // goes out as it came.
            (Some(out), Some(rest)) => {
                let mut last = BytesMut::from(out);
                last.extend_from_slice(&rest);
                Some(last.freeze())
            }
        };
        self.ended = Some(reported_usage(self.events.as_ref(), &mut self.tail, true));
        last.filter(|last| !last.is_empty())
    }

    fn strips_usage(&self) -> bool {
        self.events.as_ref().is_some_and(EventScan::strips_usage)
    }
}

/// Bytes kept from the end of a body for its usage: the usage event of a stream (~300
/// bytes with `data: [DONE]`), or the end of a JSON answer, with room to spare.
const USAGE_TAIL: usize = 1024;

/// The last [`USAGE_TAIL`] bytes of an answer on its way out, where its `usage` is: the end
/// of a JSON answer, or of a stream whose usage events go on to the client.
#[derive(Debug, Default)]
pub struct UsageTail(VecDeque<u8>);

impl UsageTail {
    /// Appends `data`, keeping the last [`USAGE_TAIL`] bytes. Copying matters: holding on to
    /// the frames themselves would keep each one's read (up to 8 KiB) alive, per frame and
    /// per stream.
    pub fn push(&mut self, data: &[u8]) {
        let tail = &mut self.0;
        let data = &data[data.len().saturating_sub(USAGE_TAIL)..];
        let excess = (tail.len() + data.len()).saturating_sub(USAGE_TAIL);
        tail.drain(..excess);
        if tail.capacity() == 0 {
            tail.reserve_exact(USAGE_TAIL);
        }
        tail.extend(data);
    }

    fn usage(&mut self) -> Option<Usage> {
        find_usage(self.0.make_contiguous())
    }
}

/// The usage an answer reported, from what was read of it, the same at every door: the
/// counts of the usage events a stream's `events` took as they passed (the events cut for
/// the router), else those in the answer's `tail` once it `ended` or, for a stream, once its
/// last event went on (a client may leave between that and the body's end). `None`: the
/// answer stopped short of its counts.
pub fn reported_usage(
    events: Option<&EventScan>,
    tail: &mut UsageTail,
    ended: bool,
) -> Option<Usage> {
    match events {
        Some(events) if events.strips_usage() => events.usage,
        Some(events) if ended || events.last_event => tail.usage(),
        None if ended => tail.usage(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_keeps_the_last_bytes_across_frames() {
        let mut tail = UsageTail::default();
        let mut body = Vec::new();
        for i in 0..500u32 {
            let frame = format!("data: {{\"n\":{i}}}\n\n");
            tail.push(frame.as_bytes());
            body.extend_from_slice(frame.as_bytes());
        }
        assert_eq!(tail.0.len(), USAGE_TAIL);
        assert_eq!(tail.0.make_contiguous(), &body[body.len() - USAGE_TAIL..]);
        assert_eq!(
            tail.0.capacity(),
            USAGE_TAIL,
            "the tail never grows past its size"
        );

        let big = vec![b'x'; 3 * USAGE_TAIL];
        tail.push(&big);
        assert_eq!(tail.0.make_contiguous(), &big[..USAGE_TAIL]);
    }

    #[test]
    fn usage_is_read_from_the_tail_of_a_long_stream() {
        let mut tail = UsageTail::default();
        for _ in 0..1000 {
            tail.push(b"data: {\"choices\":[{\"delta\":{\"content\":\"tok\"}}]}\n\n");
        }
        let usage = br#"data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":1000,"total_tokens":1007}}"#;
        // Split mid-event, as TCP may deliver it.
        tail.push(&usage[..40]);
        tail.push(&usage[40..]);
        tail.push(b"\n\ndata: [DONE]\n\n");
        let found = tail.usage().unwrap();
        assert_eq!((found.prompt_tokens, found.completion_tokens), (7, 1000));
    }
}
