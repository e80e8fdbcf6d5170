//! The scanner against a plain byte-at-a-time reading of the same rules.

use proptest::prelude::*;

use super::*;

/// The rules of `Counts`, one byte at a time with a state machine, the way the scanner
/// worked before it was rewritten around bit masks.
#[derive(Debug)]
struct Reference {
    counts: Counts,
    prev_key: u64,
    at_line_start: bool,
    leading: u32,
    backticks: u32,
    /// Kind of the last token (not blank), for operator context.
    last: Last,
    /// An operator waiting for its right operand, and whether its left one is a number.
    pending_op: Option<(u8, bool)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Last {
    Nothing,
    Number,
    Word,
    Close,
    Other,
}

impl Reference {
    fn new() -> Self {
        Self {
            counts: Scanner::default().counts,
            prev_key: 0,
            at_line_start: true,
            leading: 0,
            backticks: 0,
            last: Last::Nothing,
            pending_op: None,
        }
    }

    fn feed(&mut self, text: &[u8]) {
        self.counts.bytes += text.len();
        for &b in text {
            if self.counts.sampled_bytes < ENTROPY_SAMPLE_BYTES {
                self.counts.byte_counts[usize::from(b)] += 1;
                self.counts.sampled_bytes += 1;
            }
        }
        let mut i = 0;
        while i < text.len() {
            if is_word_byte(text[i]) {
                let end = (i..text.len())
                    .find(|&j| !is_word_byte(text[j]))
                    .unwrap_or(text.len());
                let before = i.checked_sub(1).map(|j| text[j]);
                self.word(&text[i..end], before);
                i = end;
            } else {
                self.symbol(text[i], text.get(i + 1).copied());
                i += 1;
            }
        }
        self.at_line_start = true;
        self.pending_op = None;
        self.last = Last::Nothing;
    }

    fn word(&mut self, word: &[u8], before: Option<u8>) {
        self.at_line_start = false;
        self.counts.words += 1;
        let is_number = word.iter().all(u8::is_ascii_digit);
        if let Some((op, left_is_number)) = self.pending_op.take() {
            if !matches!(op, b'-' | b'/') || (is_number && left_is_number) {
                self.counts.math_ops += 1;
            }
        }
        let lower: Vec<u8> = word.iter().take(8).map(|b| b | 0x20).collect();
        let key = cues::key(&lower);
        if is_number {
            self.counts.numbers += 1;
            self.last = Last::Number;
        } else {
            self.last = Last::Word;
            let cue = cues::lookup(key);
            if cue != 0 && (cue != Cue::ManyMuch as u8 || self.prev_key == HOW) {
                self.counts.cues[usize::from(cue)] += 1;
            }
            if before == Some(b'\\') {
                self.counts.latex += 1;
            }
        }
        self.prev_key = key;
    }

    fn symbol(&mut self, b: u8, next: Option<u8>) {
        match b {
            b'\n' => {
                if self.leading >= 4 {
                    self.counts.indented_lines += 1;
                }
                self.at_line_start = true;
                self.leading = 0;
                self.backticks = 0;
                return;
            }
            b' ' if self.at_line_start => {
                self.leading += 1;
                return;
            }
            b'\t' if self.at_line_start => {
                self.leading += 4;
                return;
            }
            b' ' | b'\t' | b'\r' => return,
            _ => {}
        }
        if self.at_line_start && self.leading >= 4 {
            self.counts.indented_lines += 1;
            self.leading = 0;
        }
        self.at_line_start = false;
        if b == b'`' {
            self.backticks += 1;
            if self.backticks == 3 {
                self.counts.fences += 1;
            }
        } else {
            self.backticks = 0;
        }
        match b {
            b'{' | b'}' | b'[' | b']' | b';' | b'<' | b'>' | b'|' | b'&' | b'#' | b'_' => {
                self.counts.code_symbols += 1;
                if b == b'{' && next == Some(b'"') {
                    self.counts.json_braces += 1;
                }
            }
            b'$' | b'%' => self.counts.money += 1,
            b'+' | b'-' | b'*' | b'/' | b'=' | b'^' => {
                if matches!(self.last, Last::Number | Last::Word | Last::Close) {
                    self.pending_op = Some((b, self.last == Last::Number));
                }
                if b == b'=' && next == Some(b'=') {
                    self.counts.code_symbols += 1;
                }
                self.last = Last::Other;
                return;
            }
            b')' => {
                self.last = Last::Close;
                return;
            }
            _ => {}
        }
        if b != b'(' {
            self.pending_op = None;
        }
        self.last = Last::Other;
    }
}

fn fast(segments: &[&[u8]]) -> Counts {
    let mut scanner = Scanner::default();
    for segment in segments {
        scanner.feed(segment);
    }
    scanner.finish()
}

fn reference(segments: &[&[u8]]) -> Counts {
    let mut reference = Reference::new();
    for segment in segments {
        reference.feed(segment);
    }
    reference.counts
}

/// Text made of the bytes the rules care about, so that operators, fences, indentation
/// and cue words meet each other often; up to `max_pieces` pieces.
fn dense_text(max_pieces: usize) -> impl Strategy<Value = Vec<u8>> {
    let pieces = prop_oneof![
        Just(b" ".to_vec()),
        Just(b"    ".to_vec()),
        Just(b"\t".to_vec()),
        Just(b"\r\n".to_vec()),
        Just(b"\n".to_vec()),
        Just(b"`".to_vec()),
        Just(b"```".to_vec()),
        Just(b"(".to_vec()),
        Just(b")".to_vec()),
        Just(b"{\"".to_vec()),
        Just(b"==".to_vec()),
        Just(b"\\frac".to_vec()),
        Just(b"\\12".to_vec()),
        Just(b"how many".to_vec()),
        Just(b"HOW much".to_vec()),
        Just(b"much".to_vec()),
        Just(b"the".to_vec()),
        Just(b"calculation".to_vec()),
        Just(b"python".to_vec()),
        Just(b"twice".to_vec()),
        Just(b"12".to_vec()),
        Just(b"1234567890".to_vec()),
        Just(b"123456789x".to_vec()),
        Just(b"x9".to_vec()),
        Just(b"\xc3\xa9t\xc3\xa9".to_vec()),
        Just(b".,;:$%_#".to_vec()),
        "[-+*/=^]".prop_map(String::into_bytes),
        "[a-zA-Z0-9]{1,12}".prop_map(String::into_bytes),
    ];
    proptest::collection::vec(pieces, 0..max_pieces).prop_map(|pieces| pieces.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn counts_match_the_reference_on_arbitrary_bytes(
        segments in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 1..4)
    ) {
        let segments: Vec<&[u8]> = segments.iter().map(Vec::as_slice).collect();
        prop_assert_eq!(fast(&segments), reference(&segments));
    }

    #[test]
    fn counts_match_the_reference_on_arbitrary_utf8(
        segments in proptest::collection::vec(any::<String>(), 1..4)
    ) {
        let segments: Vec<&[u8]> = segments.iter().map(|s| s.as_bytes()).collect();
        prop_assert_eq!(fast(&segments), reference(&segments));
    }

    #[test]
    fn counts_match_the_reference_on_ascii(
        segments in proptest::collection::vec("[ -~\t\r\n]{0,400}", 1..4)
    ) {
        let segments: Vec<&[u8]> = segments.iter().map(|s| s.as_bytes()).collect();
        prop_assert_eq!(fast(&segments), reference(&segments));
    }

    #[test]
    fn counts_match_the_reference_on_dense_text(
        segments in proptest::collection::vec(dense_text(60), 1..4)
    ) {
        let segments: Vec<&[u8]> = segments.iter().map(Vec::as_slice).collect();
        prop_assert_eq!(fast(&segments), reference(&segments));
    }

    #[test]
    fn block_masks_match_a_bytewise_classification(
        block in proptest::collection::vec(any::<u8>(), 64)
    ) {
        let mut array = [0u8; 64];
        array.copy_from_slice(&block);
        let mut flags = [0u8; 64];
        let (words, specials) = classify(&array, &mut flags);
        for (i, &b) in block.iter().enumerate() {
            prop_assert_eq!(words >> i & 1 == 1, b.is_ascii_alphanumeric() || b >= 0x80, "byte {}", b);
            prop_assert_eq!(flags[i], if words >> i & 1 == 1 { 0xff } else { 0 }, "byte {}", b);
            prop_assert_eq!(specials >> i & 1 == 1, b.is_ascii() && !b.is_ascii_alphanumeric() && b != b' ', "byte {}", b);
        }
    }
}

proptest! {
    // Fewer cases: each is kilobytes long.
    #![proptest_config(ProptestConfig::with_cases(50))]

    /// Kilobytes of cue-dense text: many blocks, lane flushes, "how many" in any block.
    #[test]
    fn counts_match_the_reference_on_long_dense_text(
        segments in proptest::collection::vec(dense_text(800), 1..3)
    ) {
        let segments: Vec<&[u8]> = segments.iter().map(Vec::as_slice).collect();
        prop_assert_eq!(fast(&segments), reference(&segments));
    }
}

#[test]
fn counts_match_the_reference_on_hand_picked_text() {
    let samples: [&[&[u8]]; 10] = [
        &[b"Seal releases 3 songs every month.  He gets $2000 per song.  How much money?"],
        &[b"Complete this Python function:\ndef add(a, b):\n    \"\"\"Return a + b.\"\"\"\n"],
        &[b"Evaluate \\int_0^1 x^2 dx and \\frac{1}{2} 3 - 2 6/3 well-known and/or x = -3"],
        &[
            b"```rust\nfn main() { let x: Vec<u8> = vec![]; }\n```",
            b"``",
            b"`",
        ],
        &[b"`x` and `y`", b"  ", b"  x\n\t\tindented\n    {\"a\": 1}"],
        &[b"3 + ) - 4 ( ( 5 ) * ( 6 ) a ==== b"],
        &[b"how", b"many", b"HOW MANY how\nmuch how, much"],
        &[b"12345678 123456789 1234567a 123456789012345678901234567890 \\123 \\x"],
        &[&[b'a'; 200], &[b'7'; 130], b"x"],
        &[
            b"",
            b"\xff\x80\x7f\x00 \xe2\x9c\x93 caf\xc3\xa9 na\xc3\xafve",
        ],
    ];
    for segments in samples {
        assert_eq!(fast(segments), reference(segments), "{segments:?}");
    }
}

#[test]
fn counts_match_the_reference_on_word_dense_blocks() {
    // 32 words in every block: the most a counter lane has to hold between flushes.
    let words = b"a ".repeat(1000);
    let how_many = b"how many ".repeat(200);
    let mut spaced = vec![b' '; 61];
    spaced.extend_from_slice(b"How\n\nmuch 12 much how 7 many");
    let samples: [&[&[u8]]; 4] = [
        &[&words],
        &[&how_many],
        &[&spaced, b"  ", b"many", b"how", b"", b"much"],
        &[&words, b"how", &words[..64], b"many"],
    ];
    for segments in samples {
        assert_eq!(fast(segments), reference(segments), "{segments:?}");
    }
    assert_eq!(fast(&[&words]).words, 1000);
    assert_eq!(fast(&[&how_many]).cues[Cue::ManyMuch as usize], 200);
}

#[test]
fn words_crossing_blocks_keep_their_key() {
    let mut text = vec![b' '; 60];
    text.extend_from_slice(b"Calculation how many 42");
    let counts = fast(&[&text]);
    assert_eq!(counts.words, 4);
    assert_eq!(counts.cues[Cue::Math as usize], 1);
    assert_eq!(counts.cues[Cue::ManyMuch as usize], 1);
    assert_eq!(counts.numbers, 1);
}
