//! Server-sent events, the router's one parser of them: where each event ends, whatever
//! line endings the upstream uses ([`EventEnds`], and [`EventBuffer`] for a reader that
//! wants whole events), an event's data ([`data_of`]), and what the router takes from the
//! events as they pass through ([`EventScan`]) — the first one with generated output (time
//! to first token) and token counts — while cutting out the usage events it asked for on
//! the client's behalf. Pure state machines over the bytes as they arrive: no I/O, every
//! split of the input gives the same events.

use std::ops::Range;

use bytes::{Bytes, BytesMut};
use http::{header, HeaderMap};

use crate::openai::{carries_output, find_usage, is_usage_event, Usage};

/// An unfinished event longer than this is passed on without being looked at: usage and
/// first-token chunks are a few hundred bytes, and holding more would let an upstream that
/// never ends an event grow the router's memory.
const MAX_EVENT: usize = 64 * 1024;

/// Finds the ends of events: an event ends with an empty line, and a line ends with CRLF,
/// LF or CR (the SSE standard), so `\n\n`, `\r\n\r\n` and `\r\r` all end one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EventEnds {
    state: Line,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Line {
    /// Inside a line (or at the start of the stream).
    #[default]
    Text,
    /// A line just ended.
    Ended,
    /// A line ended with CR, unless an LF follows (then CRLF ended it).
    Cr,
    /// A line ended and an empty one followed, ended by a CR that may be the start of CRLF:
    /// the event is over, and the next byte tells whether that LF belongs to it.
    EmptyCr,
}

/// Finds events in an SSE stream as it passes and decides what of it goes on.
#[derive(Debug, Default)]
pub struct EventScan {
    ends: EventEnds,
    /// Usage-only events are cut out (the router asked for them, not the client), so each
    /// event is held until it is whole.
    strip_usage: bool,
    /// Still looking for the first event with generated output.
    awaiting_output: bool,
    /// The unfinished event: held back when stripping, else a copy to look at once whole.
    pending: BytesMut,
    /// The unfinished event outgrew [`MAX_EVENT`]: the rest of it passes unexamined.
    oversize: bool,
    /// Token counts from the last event that carried them.
    pub usage: Option<Usage>,
    /// Events with data passed on (neither `[DONE]` nor a cut usage event): one token each
    /// in vLLM's streams, plus the role and finish events; what a stream that ends without
    /// `usage` is charged.
    pub data_events: u64,
    /// The first bytes of the event being counted unexamined: enough to tell `[DONE]` and
    /// an API's last event.
    head: Vec<u8>,
    /// The last whole event that went on ends the stream ([`ends_stream`]).
    pub last_event: bool,
}

/// Bytes of an event's start that tell whether it is data (not `data: [DONE]`) and whether
/// it ends its stream: `event: response.incomplete` is the longest such start.
const HEAD: usize = 26;

/// What became of one piece of a stream.
#[derive(Debug, Default)]
pub struct Scanned {
    /// What to send on now, if anything.
    pub out: Option<Bytes>,
    /// The first event with generated output ended in this piece.
    pub first_output: bool,
}

/// Whole events out of a stream's pieces, for readers that look at every event (the
/// stream-start check, the agent-API relay).
#[derive(Debug, Default)]
pub struct EventBuffer {
    pending: BytesMut,
    /// Bytes of `pending` already scanned for an event's end.
    scanned: usize,
    ends: EventEnds,
}

/// The output of one piece: a prefix of it (no copy) until something is cut or held-back
/// bytes join it.
enum Out {
    Prefix(usize),
    Built(BytesMut),
}

// === impl EventEnds ===

/// Whether a head announces an event stream (`text/event-stream`, with or without
/// parameters).
pub fn is_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"))
}

impl EventEnds {
    /// The end (exclusive) of the first event that ends in `data[from..]`, with the scan
    /// state carried across calls and pieces. It can be `from` itself: the event ended with
    /// the previous piece, which this piece's first byte confirmed.
    pub fn next_end(&mut self, data: &[u8], from: usize) -> Option<usize> {
        let mut i = from;
        while i < data.len() {
            if self.state == Line::Text {
                // Most bytes are text: jump to the next line end.
                match data[i..].iter().position(|b| matches!(b, b'\n' | b'\r')) {
                    Some(n) => i += n,
                    None => return None,
                }
            }
            let byte = data[i];
            self.state = match (self.state, byte) {
                (Line::EmptyCr, b'\n') | (Line::Ended, b'\n') => {
                    self.state = Line::Text;
                    return Some(i + 1);
                }
                (Line::EmptyCr, _) => {
                    // The CR alone ended the empty line; this byte starts the next event.
                    self.state = Line::Text;
                    return Some(i);
                }
                (Line::Ended | Line::Cr, b'\r') => Line::EmptyCr,
                (Line::Text, b'\r') => Line::Cr,
                (Line::Text | Line::Cr, b'\n') => Line::Ended,
                _ => Line::Text,
            };
            i += 1;
        }
        None
    }
}

// === impl EventBuffer ===

impl EventBuffer {
    /// Adds a piece of the stream.
    pub fn push(&mut self, data: &[u8]) {
        self.pending.extend_from_slice(data);
    }

    /// The next whole event (with the blank line that ended it), if one ended.
    pub fn next_event(&mut self) -> Option<Bytes> {
        match self.ends.next_end(&self.pending, self.scanned) {
            Some(end) => {
                self.scanned = 0;
                Some(self.pending.split_to(end).freeze())
            }
            None => {
                self.scanned = self.pending.len();
                None
            }
        }
    }

    /// Bytes of the unfinished event.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// The stream ended: the unfinished event, if any.
    pub fn take_rest(&mut self) -> Bytes {
        self.scanned = 0;
        self.pending.split().freeze()
    }
}

// === impl EventScan ===

impl EventScan {
    pub fn new(strip_usage: bool) -> Self {
        Self {
            strip_usage,
            awaiting_output: true,
            ..Self::default()
        }
    }

    /// Usage-only events are cut out of this stream.
    pub fn strips_usage(&self) -> bool {
        self.strip_usage
    }

    /// Takes one piece of the stream.
    pub fn feed(&mut self, data: Bytes) -> Scanned {
        if !self.strip_usage && !self.awaiting_output {
            self.count_events(&data);
            return Scanned {
                out: Some(data),
                first_output: false,
            };
        }
        let mut first_output = false;
        let mut out = Out::Prefix(0);
        let mut start = 0;
        while let Some(end) = self.ends.next_end(&data, start) {
            let part = start..end;
            start = end;
            if self.oversize {
                self.oversize = false;
                self.data_events += 1;
                out.keep(&data, part);
                continue;
            }
            let held = !self.pending.is_empty();
            if held {
                self.pending.extend_from_slice(&data[part.clone()]);
            }
            let event: &[u8] = if held {
                &self.pending
            } else {
                &data[part.clone()]
            };
            let (keep, usage, output) = self.examine(event);
            if usage.is_some() {
                self.usage = usage;
            }
            if output {
                self.awaiting_output = false;
                first_output = true;
            }
            if keep {
                self.last_event = ends_stream(event);
                if counts_as_data(event) {
                    self.data_events += 1;
                }
            }
            // Held-back bytes were not sent yet; copied ones (not stripping) were.
            match (keep, held && self.strip_usage) {
                (true, true) => out.push(&data, &self.pending),
                (true, false) => out.keep(&data, part),
                (false, _) => {}
            }
            self.pending.clear();
        }
        let rest = start..data.len();
        if !self.strip_usage && !self.awaiting_output {
            // From the next piece on, events pass unexamined: the one under way is counted
            // by its start.
            self.head.clear();
            let take = rest.len().min(HEAD);
            self.head
                .extend_from_slice(&data[rest.start..rest.start + take]);
        }
        if !rest.is_empty() {
            if self.oversize {
                out.keep(&data, rest);
            } else {
                if self.strip_usage || self.awaiting_output {
                    self.pending.extend_from_slice(&data[rest.clone()]);
                }
                if self.pending.len() > MAX_EVENT {
                    self.oversize = true;
                    match self.strip_usage {
                        true => out.push(&data, &self.pending.split()),
                        false => self.pending.clear(),
                    }
                }
                if !self.strip_usage {
                    out.keep(&data, rest);
                }
            }
        }
        Scanned {
            out: out.finish(data),
            first_output,
        }
    }

    /// The stream ended: what is still held back, an event the upstream never ended (or
    /// ended with a lone CR as the stream's last byte, which only the end confirms).
    pub fn finish(&mut self) -> Scanned {
        let mut scanned = Scanned::default();
        if self.pending.is_empty() {
            return scanned;
        }
        let pending = self.pending.split();
        let (keep, usage, output) = match self.ends.state == Line::EmptyCr {
            true => self.examine(&pending),
            false => (true, None, false),
        };
        if usage.is_some() {
            self.usage = usage;
        }
        if output {
            self.awaiting_output = false;
            scanned.first_output = true;
        }
        if keep && counts_as_data(&pending) {
            self.data_events += 1;
        }
        if self.strip_usage && keep {
            scanned.out = Some(pending.freeze());
        }
        scanned
    }

    /// Counts the events that end in `data`, passing through unexamined, each judged by
    /// its first bytes (kept across pieces).
    fn count_events(&mut self, data: &[u8]) {
        let mut start = 0;
        loop {
            let end = self.ends.next_end(data, start);
            let stop = end.unwrap_or(data.len());
            let take = HEAD.saturating_sub(self.head.len()).min(stop - start);
            self.head.extend_from_slice(&data[start..start + take]);
            let Some(end) = end else {
                return;
            };
            if counts_as_data(&self.head) {
                self.data_events += 1;
            }
            self.last_event = ends_stream(&self.head);
            self.head.clear();
            start = end;
        }
    }

    /// Whether to pass `event` on, the usage it carries and whether it carries output.
    fn examine(&self, event: &[u8]) -> (bool, Option<Usage>, bool) {
        const USAGE_KEY: &[u8] = b"\"usage\"";
        let mut keep = true;
        let mut usage = None;
        if event.windows(USAGE_KEY.len()).any(|w| w == USAGE_KEY) {
            usage = find_usage(event);
            // Only the usage-only events the router asked for are cut; usage inside a choice
            // chunk (llama.cpp) is the upstream's own and passes, counted.
            keep = !(self.strip_usage && is_usage_event(event));
        }
        let output = self.awaiting_output && data_of(event).is_some_and(|d| carries_output(&d));
        (keep, usage, output)
    }
}

/// Whether an event (or its first bytes) ends its stream: chat's `[DONE]`, Anthropic's
/// `message_stop`, or a Responses stream's last event, which carries the whole response.
fn ends_stream(event: &[u8]) -> bool {
    const LAST: [&[u8]; 5] = [
        b"data: [DONE]",
        b"event: message_stop",
        b"event: response.completed",
        b"event: response.incomplete",
        b"event: response.failed",
    ];
    let event = event.trim_ascii_start();
    LAST.iter().any(|last| event.starts_with(last))
}

/// Whether an event (or the rest of one) is data worth a token: not a comment, not an
/// empty line, not the closing `[DONE]`.
fn counts_as_data(event: &[u8]) -> bool {
    let event = event.trim_ascii_start();
    !event.is_empty()
        && !event.starts_with(b":")
        && !event.starts_with(b"data: [DONE]")
        && !event.starts_with(b"data:[DONE]")
}

/// One SSE event carrying `data` (a JSON document, so on one line).
pub fn data_event(data: &[u8]) -> Bytes {
    let mut event = Vec::with_capacity(data.len() + 8);
    event.extend_from_slice(b"data: ");
    event.extend_from_slice(data);
    event.extend_from_slice(b"\n\n");
    Bytes::from(event)
}

/// The data of an event: its `data:` lines joined by LF, without the field name and the
/// one optional space; `None` for an event with no data.
pub fn data_of(event: &[u8]) -> Option<std::borrow::Cow<'_, [u8]>> {
    let mut lines = event
        .split(|b| matches!(b, b'\n' | b'\r'))
        .filter_map(|line| line.strip_prefix(b"data:"))
        .map(|value| value.strip_prefix(b" ").unwrap_or(value));
    let first = lines.next()?;
    let Some(second) = lines.next() else {
        return Some(std::borrow::Cow::Borrowed(first));
    };
    let mut joined = first.to_vec();
    for line in std::iter::once(second).chain(lines) {
        joined.push(b'\n');
        joined.extend_from_slice(line);
    }
    Some(std::borrow::Cow::Owned(joined))
}

// === impl Out ===

impl Out {
    /// Sends `range` of the piece on.
    fn keep(&mut self, data: &Bytes, range: Range<usize>) {
        match self {
            Out::Prefix(end) if *end == range.start => *end = range.end,
            Out::Prefix(end) => {
                let mut built = BytesMut::with_capacity(*end + range.len());
                built.extend_from_slice(&data[..*end]);
                built.extend_from_slice(&data[range]);
                *self = Out::Built(built);
            }
            Out::Built(built) => built.extend_from_slice(&data[range]),
        }
    }

    /// Sends bytes held from earlier pieces on.
    fn push(&mut self, data: &Bytes, bytes: &[u8]) {
        match self {
            Out::Prefix(end) => {
                let mut built = BytesMut::with_capacity(*end + bytes.len());
                built.extend_from_slice(&data[..*end]);
                built.extend_from_slice(bytes);
                *self = Out::Built(built);
            }
            Out::Built(built) => built.extend_from_slice(bytes),
        }
    }

    fn finish(self, data: Bytes) -> Option<Bytes> {
        match self {
            Out::Prefix(0) => None,
            Out::Prefix(end) if end == data.len() => Some(data),
            Out::Prefix(end) => Some(data.slice(..end)),
            Out::Built(built) if built.is_empty() => None,
            Out::Built(built) => Some(built.freeze()),
        }
    }
}

#[cfg(test)]
mod tests;
