//! HTTP/1.1 response body framing (RFC 9112 §6): a `Content-Length` body, a chunked body,
//! or a body that ends when the connection closes. A pure state machine over the bytes as
//! they arrive: no I/O, every split of the input gives the same data.

use bytes::{Buf, Bytes};

/// Why a body's framing is broken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FramingError {
    #[error("invalid chunk size line")]
    ChunkSize,
    #[error("chunk data not followed by CRLF")]
    ChunkEnd,
    #[error("the connection closed before the body ended")]
    Truncated,
}

/// Decodes one response body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decoder {
    state: State,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// `Content-Length`: bytes still to come.
    Length(u64),
    /// Until the connection closes (no length, not chunked).
    UntilClose,
    /// Reading a chunk size in hex (`digits` so far, to refuse overflow and empty sizes).
    Size {
        size: u64,
        digits: u8,
    },
    /// After the size: `;extension` or whitespace, up to CR.
    SizeExtension {
        size: u64,
    },
    /// CR seen after the size line; LF next.
    SizeLf {
        size: u64,
    },
    /// Inside a chunk's data.
    Data(u64),
    /// After a chunk's data: CR, then LF.
    DataCr,
    DataLf,
    /// After the last chunk: trailer lines until an empty one. `line_start`: nothing of the
    /// current line read yet.
    Trailer {
        line_start: bool,
    },
    /// CR of the empty line that ends the trailers; LF next.
    TrailerLf,
    Done,
}

// === impl Decoder ===

impl Decoder {
    pub fn length(n: u64) -> Self {
        let state = match n {
            0 => State::Done,
            n => State::Length(n),
        };
        Self { state }
    }

    pub fn chunked() -> Self {
        Self {
            state: State::Size { size: 0, digits: 0 },
        }
    }

    pub fn until_close() -> Self {
        Self {
            state: State::UntilClose,
        }
    }

    /// The whole body has been decoded.
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// The body ends when the connection closes.
    pub fn ends_with_close(&self) -> bool {
        self.state == State::UntilClose
    }

    /// Bytes still to come, when the framing says.
    pub fn remaining(&self) -> Option<u64> {
        match self.state {
            State::Length(n) => Some(n),
            State::Done => Some(0),
            _ => None,
        }
    }

    /// Takes the next piece of body data out of `input` (advancing it past the framing it
    /// consumed). `None`: `input` is used up (or the body is done) with no data in it.
    /// The data is a slice of `input`: no copy.
    pub fn decode(&mut self, input: &mut Bytes) -> Result<Option<Bytes>, FramingError> {
        while !input.is_empty() {
            match self.state {
                State::Done => return Ok(None),
                State::UntilClose => return Ok(Some(input.split_to(input.len()))),
                State::Length(n) | State::Data(n) => {
                    let take = usize::try_from(n).unwrap_or(usize::MAX).min(input.len());
                    let left = n - take as u64;
                    self.state = match (self.state, left) {
                        (State::Length(_), 0) => State::Done,
                        (State::Length(_), left) => State::Length(left),
                        (_, 0) => State::DataCr,
                        (_, left) => State::Data(left),
                    };
                    return Ok(Some(input.split_to(take)));
                }
                _ => {
                    let byte = input[0];
                    input.advance(1);
                    self.state = self.control(byte)?;
                }
            }
        }
        Ok(None)
    }

    /// The connection closed: fine for a body that ends that way or is complete.
    pub fn finish(&mut self) -> Result<(), FramingError> {
        match self.state {
            State::UntilClose | State::Done => {
                self.state = State::Done;
                Ok(())
            }
            _ => Err(FramingError::Truncated),
        }
    }

    /// One byte of chunked framing (sizes, extensions, line ends, trailers).
    fn control(&self, byte: u8) -> Result<State, FramingError> {
        Ok(match (self.state, byte) {
            (State::Size { size, digits }, _) if byte.is_ascii_hexdigit() => {
                // 16 hex digits fill a u64; more is no size a server means.
                if digits >= 16 {
                    return Err(FramingError::ChunkSize);
                }
                let digit = u64::from(match byte {
                    b'0'..=b'9' => byte - b'0',
                    _ => (byte | 0x20) - b'a' + 10,
                });
                State::Size {
                    size: size << 4 | digit,
                    digits: digits + 1,
                }
            }
            (State::Size { digits: 0, .. }, _) => return Err(FramingError::ChunkSize),
            (State::Size { size, .. }, b'\r') => State::SizeLf { size },
            (State::Size { size, .. }, b';' | b' ' | b'\t') => State::SizeExtension { size },
            (State::Size { .. }, _) => return Err(FramingError::ChunkSize),
            (State::SizeExtension { size }, b'\r') => State::SizeLf { size },
            (State::SizeExtension { .. }, b'\n') => return Err(FramingError::ChunkSize),
            (State::SizeExtension { size }, _) => State::SizeExtension { size },
            (State::SizeLf { size: 0 }, b'\n') => State::Trailer { line_start: true },
            (State::SizeLf { size }, b'\n') => State::Data(size),
            (State::SizeLf { .. }, _) => return Err(FramingError::ChunkSize),
            (State::DataCr, b'\r') => State::DataLf,
            (State::DataLf, b'\n') => State::Size { size: 0, digits: 0 },
            (State::DataCr | State::DataLf, _) => return Err(FramingError::ChunkEnd),
            (State::Trailer { line_start: true }, b'\r') => State::TrailerLf,
            (State::Trailer { .. }, b'\n') => State::Trailer { line_start: true },
            (State::Trailer { .. }, _) => State::Trailer { line_start: false },
            (State::TrailerLf, b'\n') => State::Done,
            (State::TrailerLf, _) => return Err(FramingError::ChunkSize),
            // Data states never reach here (decode slices them).
            (State::Length(_) | State::Data(_) | State::UntilClose | State::Done, _) => self.state,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Feeds `wire` to `decoder` in pieces cut at `cuts`; returns the data and whether the
    /// body ended.
    fn feed(
        mut decoder: Decoder,
        wire: &[u8],
        cuts: &[usize],
    ) -> Result<(Vec<u8>, bool), FramingError> {
        let mut out = Vec::new();
        let mut at = 0;
        let mut ends: Vec<usize> = cuts.iter().map(|c| c % (wire.len() + 1)).collect();
        ends.push(wire.len());
        ends.sort_unstable();
        for end in ends {
            let mut piece = Bytes::copy_from_slice(&wire[at..end.max(at)]);
            at = end.max(at);
            while let Some(data) = decoder.decode(&mut piece)? {
                out.extend_from_slice(&data);
            }
            assert!(piece.is_empty() || decoder.is_done());
        }
        Ok((out, decoder.is_done()))
    }

    fn chunk(data: &[u8]) -> Vec<u8> {
        let mut wire = format!("{:x}\r\n", data.len()).into_bytes();
        wire.extend_from_slice(data);
        wire.extend_from_slice(b"\r\n");
        wire
    }

    #[test]
    fn chunked_body_with_extensions_and_trailers() {
        let wire = b"5;name=value\r\nhello\r\nA \r\n, world!!!\r\n0\r\nx-trailer: 1\r\n\r\n";
        let (data, done) = feed(Decoder::chunked(), wire, &[]).unwrap();
        assert_eq!(data, b"hello, world!!!");
        assert!(done);
    }

    #[test]
    fn chunked_body_ends_only_after_the_empty_line() {
        let (data, done) = feed(Decoder::chunked(), b"3\r\nabc\r\n0\r\n", &[]).unwrap();
        assert_eq!(data, b"abc");
        assert!(!done, "the final CRLF has not arrived");
    }

    #[test]
    fn bytes_after_the_body_are_left_alone() {
        let mut decoder = Decoder::length(3);
        let mut input = Bytes::from_static(b"abcHTTP/1.1");
        assert_eq!(decoder.decode(&mut input).unwrap().unwrap(), "abc");
        assert!(decoder.is_done());
        assert_eq!(decoder.decode(&mut input).unwrap(), None);
        assert_eq!(input, "HTTP/1.1");
    }

    #[test]
    fn broken_chunk_framing_is_an_error() {
        for wire in [
            &b"\r\nabc"[..],
            b"zz\r\n",
            b"3\r\nabcX",
            b"11111111111111111\r\n",
            b"3\n",
        ] {
            assert!(feed(Decoder::chunked(), wire, &[]).is_err(), "{wire:?}");
        }
    }

    #[test]
    fn a_close_ends_only_bodies_that_end_that_way() {
        let mut length = Decoder::length(10);
        let mut input = Bytes::from_static(b"12345");
        length.decode(&mut input).unwrap();
        assert_eq!(length.finish(), Err(FramingError::Truncated));
        assert_eq!(Decoder::chunked().finish(), Err(FramingError::Truncated));
        assert_eq!(Decoder::until_close().finish(), Ok(()));
        assert_eq!(Decoder::length(0).finish(), Ok(()));
    }

    proptest! {
        #[test]
        fn chunked_data_survives_any_split(
            chunks in prop::collection::vec(prop::collection::vec(any::<u8>(), 1..300), 0..8),
            cuts in prop::collection::vec(any::<usize>(), 0..12),
        ) {
            let mut wire = Vec::new();
            for c in &chunks {
                wire.extend(chunk(c));
            }
            wire.extend_from_slice(b"0\r\n\r\n");
            let (data, done) = feed(Decoder::chunked(), &wire, &cuts).unwrap();
            prop_assert_eq!(data, chunks.concat());
            prop_assert!(done);
        }

        #[test]
        fn length_data_survives_any_split(
            body in prop::collection::vec(any::<u8>(), 0..2000),
            cuts in prop::collection::vec(any::<usize>(), 0..12),
        ) {
            let (data, done) = feed(Decoder::length(body.len() as u64), &body, &cuts).unwrap();
            prop_assert_eq!(data, body);
            prop_assert!(done);
        }
    }
}
