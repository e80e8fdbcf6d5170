//! The one pass over the scoring window that counts what the feature scores need.
//!
//! The text is classified 64 bytes at a time into two bit masks — word bytes, and "specials"
//! (every byte that is neither a word byte nor a space) — and a byte of word-byte flags per
//! byte, with `wide`'s safe SIMD, so it stays portable and free of `unsafe`. Words are then
//! walked with bit operations and counted in registers, without a branch per byte or per
//! word kind. Of the specials, only a few carry meaning that depends on their neighbours
//! (newline, backtick, operators, `{`, `\`); they are rare and handled one at a time, the
//! others are only counted.
//!
//! The byte histogram for the entropy covers the first `ENTROPY_SAMPLE_BYTES` of the window
//! only: one memory increment per byte is the one cost that vector code cannot take off, and
//! a kilobyte already tells prose from dense code.

use wide::{i8x16, CmpEq, CmpLt};

use super::cues::{self, Cue, CUE_KINDS, HOW};

/// What the feature scores are computed from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Counts {
    /// Byte frequencies of the first `ENTROPY_SAMPLE_BYTES` of the window.
    pub byte_counts: [u32; 256],
    /// Bytes in `byte_counts`.
    pub sampled_bytes: usize,
    pub bytes: usize,
    /// Maximal runs of word bytes: ASCII letters and digits and every non-ASCII byte (so
    /// words in any script stay whole).
    pub words: u32,
    /// Words made of ASCII digits only.
    pub numbers: u32,
    /// Other words by `Cue` discriminant (slot 0 stays unused); "many"/"much" only right
    /// after "how".
    pub cues: [u32; CUE_KINDS],
    /// Words (not numbers) right after a backslash: LaTeX commands.
    pub latex: u32,
    /// Bytes of `{}[];<>|&#_`, and `==` pairs.
    pub code_symbols: u32,
    /// `$` and `%`: money and percentages, word-problem vocabulary.
    pub money: u32,
    /// `{` directly followed by `"`: an inline JSON object.
    pub json_braces: u32,
    /// Operators with an operand on each side (see `Scanner::operator`).
    pub math_ops: u32,
    /// Runs of three backticks (see `Scanner::backtick`).
    pub fences: u32,
    /// Lines indented by four or more columns (a tab is four).
    pub indented_lines: u32,
}

/// Counts text fed to it one message at a time.
#[derive(Debug)]
pub(super) struct Scanner {
    counts: Counts,
    /// Key of the last word of the messages fed so far, for "how many" across messages.
    prev_key: u64,
    /// Leading columns of the current line not yet counted as an indented line.
    leading: u32,
    /// Backticks in the current run; the third makes a fence.
    backticks: u32,
    /// Run-breaking specials (symbols and newlines) seen so far, and how many had been
    /// seen at the last backtick: when the two differ, the run is over.
    breaks: u64,
    breaks_at_backtick: u64,
}

/// Counter lanes: 7 bits each in a `u64`, so counting a word is one add in a register. Cue
/// kind `c` has lane `c - 1` (0..=7) and every word that is not a number adds one to lane 8.
/// A 64-byte block holds at most 32 words, so flushing every `FLUSH_BLOCKS` blocks keeps
/// each lane below 2^7.
const LANE_BITS: u32 = 7;
const LANE_MASK: u64 = (1 << LANE_BITS) - 1;
const FLUSH_BLOCKS: usize = 3;
const WORD_LANE: u32 = Cue::ManyMuch as u32 * LANE_BITS;
const MANY_LANE: u32 = (Cue::ManyMuch as u32 - 1) * LANE_BITS;
const _: () = assert!(WORD_LANE + LANE_BITS <= 64 && 32 * FLUSH_BLOCKS as u64 <= LANE_MASK);
/// Lane increments by `Cue` discriminant (0 = no cue). 256 entries, so that indexing with a
/// byte needs no bounds check; only the first few are ever read. "many"/"much" count only
/// right after "how": their lane only says that a block has some, to be checked one by one.
static LANES: [u64; 256] = {
    let mut lanes = [1 << WORD_LANE; 256];
    let mut cue = 1;
    while cue < CUE_KINDS {
        lanes[cue] += 1 << (LANE_BITS * (cue as u32 - 1));
        cue += 1;
    }
    lanes
};

/// The entropy's sample: the first kilobyte of the window.
pub(super) const ENTROPY_SAMPLE_BYTES: usize = 1024;

/// What a special counts as, in 16-bit lanes added up per block: a code symbol, money,
/// the end of a backtick run (any symbol or newline); bit 63 marks the specials that need
/// a look at their neighbours.
const CODE_LANE: u32 = 0;
const MONEY_LANE: u32 = 16;
const BREAKS_LANE: u32 = 32;
const NEEDS_CONTEXT: u64 = 1 << 63;
static SPECIAL_LANES: [u64; 256] = {
    let mut table = [1 << BREAKS_LANE; 256];
    table[b' ' as usize] = 0;
    table[b'\t' as usize] = 0;
    table[b'\r' as usize] = 0;
    table[b'`' as usize] = NEEDS_CONTEXT;
    let context = b"\n{\\+-*/=^";
    let mut i = 0;
    while i < context.len() {
        table[context[i] as usize] |= NEEDS_CONTEXT;
        i += 1;
    }
    let code = b"{}[];<>|&#_";
    let mut i = 0;
    while i < code.len() {
        table[code[i] as usize] |= 1 << CODE_LANE;
        i += 1;
    }
    table[b'$' as usize] |= 1 << MONEY_LANE;
    table[b'%' as usize] |= 1 << MONEY_LANE;
    table
};

fn special_lane(lanes: u64, lane: u32) -> u64 {
    (lanes >> lane) & 0xffff
}

/// Word bytes: ASCII letters and digits and every non-ASCII byte.
static WORD_BYTE: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        table[b] = is_word_byte(b as u8);
        b += 1;
    }
    table
};

const HIGH: u64 = 0x8080_8080_8080_8080;

// === impl Scanner ===

impl Default for Scanner {
    fn default() -> Self {
        Self {
            counts: Counts {
                byte_counts: [0; 256],
                sampled_bytes: 0,
                bytes: 0,
                words: 0,
                numbers: 0,
                cues: [0; CUE_KINDS],
                latex: 0,
                code_symbols: 0,
                money: 0,
                json_braces: 0,
                math_ops: 0,
                fences: 0,
                indented_lines: 0,
            },
            prev_key: 0,
            leading: 0,
            backticks: 0,
            breaks: 0,
            breaks_at_backtick: 0,
        }
    }
}

impl Scanner {
    /// Counts one message. Words, operators and fences do not span messages; the previous
    /// word ("how" many), an unfinished backtick run and the indentation of an unfinished
    /// line carry over.
    pub(super) fn feed(&mut self, text: &[u8]) {
        self.counts.bytes += text.len();
        let sample = text
            .get(..ENTROPY_SAMPLE_BYTES - self.counts.sampled_bytes)
            .unwrap_or(text);
        self.counts.sampled_bytes += sample.len();
        histogram(&mut self.counts.byte_counts, sample);
        self.line_start(text, 0);

        let mut lanes = 0u64;
        let mut carry = 0u64;
        let mut numbers = 0;
        // Word-byte flags (0xff or 0) of this block and the next, so that the eight flags
        // from a word's start give the mask of its key.
        let mut flags = [0u8; 128];
        let mut padded = [b' '; 72];
        let (mut words, mut specials) = block_masks(text, 0, &mut flags[..64]);
        let mut base = 0;
        let mut block = 0;
        while base < text.len() {
            let next = base + 64;
            let (next_words, next_specials) = block_masks(text, next, &mut flags[64..]);
            let starts = words & !((words << 1) | carry);
            carry = words >> 63;
            let window = window(text, base, &mut padded);
            let (block_lanes, block_numbers) = count_words(text, base, window, &flags, starts);
            if (block_lanes >> MANY_LANE) & LANE_MASK != 0 {
                self.counts.cues[Cue::ManyMuch as usize] += self.many_after_how(text, base, starts);
            }
            lanes += block_lanes;
            numbers += block_numbers;
            self.specials(text, base, window, specials);
            block += 1;
            if block % FLUSH_BLOCKS == 0 {
                self.flush(lanes);
                lanes = 0;
            }
            flags.copy_within(64.., 0);
            (words, specials) = (next_words, next_specials);
            base = next;
        }
        self.flush(lanes);
        self.counts.words += numbers;
        self.counts.numbers += numbers;
        if let Some(start) = word_start_before(text, text.len()) {
            self.prev_key = word_key(text, start);
        }
    }

    pub(super) fn finish(self) -> Counts {
        self.counts
    }

    fn flush(&mut self, lanes: u64) {
        for (cue, count) in self.counts.cues[..Cue::ManyMuch as usize]
            .iter_mut()
            .enumerate()
            .skip(1)
        {
            *count += ((lanes >> (LANE_BITS * (cue as u32 - 1))) & LANE_MASK) as u32;
        }
        self.counts.words += ((lanes >> WORD_LANE) & LANE_MASK) as u32;
    }

    /// "many"/"much" right after "how" among the words starting at the set bits of `starts`
    /// in the block at `base`: the rare blocks that have "many" or "much" at all are looked
    /// at again word by word.
    fn many_after_how(&self, text: &[u8], base: usize, starts: u64) -> u32 {
        let first = base + starts.trailing_zeros() as usize;
        let mut prev_key =
            word_start_before(text, first).map_or(self.prev_key, |s| word_key(text, s));
        let mut many = 0;
        let mut starts = starts;
        while starts != 0 {
            let key = word_key(text, base + starts.trailing_zeros() as usize);
            starts &= starts - 1;
            many += u32::from(cues::lookup(key) == Cue::ManyMuch as u8 && prev_key == HOW);
            prev_key = key;
        }
        many
    }

    /// Handles the specials at the set bits of `specials` in the block at `base`.
    fn specials(&mut self, text: &[u8], base: usize, window: &[u8; 72], specials: u64) {
        let mut specials = specials;
        let mut lanes = 0u64;
        while specials != 0 {
            let i = specials.trailing_zeros() as usize & 63;
            specials &= specials - 1;
            let at = base + i;
            let b = window[i];
            let entry = SPECIAL_LANES[usize::from(b)];
            // Bit 63 of the sum is junk; the lanes below it cannot overflow in a block.
            lanes = lanes.wrapping_add(entry);
            if entry & NEEDS_CONTEXT != 0 {
                let breaks = self.breaks + special_lane(lanes, BREAKS_LANE);
                self.special_in_context(text, at, b, breaks);
            }
        }
        self.counts.code_symbols += special_lane(lanes, CODE_LANE) as u32;
        self.counts.money += special_lane(lanes, MONEY_LANE) as u32;
        self.breaks += special_lane(lanes, BREAKS_LANE);
    }

    fn special_in_context(&mut self, text: &[u8], at: usize, b: u8, breaks: u64) {
        let next = text.get(at + 1).copied().unwrap_or(0);
        match b {
            b'\n' => {
                // A line that started with a word is counted when it ends.
                self.counts.indented_lines += u32::from(self.leading >= 4);
                self.leading = 0;
                self.line_start(text, at + 1);
            }
            b'`' => self.backtick(breaks),
            b'{' => self.counts.json_braces += u32::from(next == b'"'),
            b'\\' => {
                self.counts.latex += u32::from(is_word(next) && !word_is_number(text, at + 1));
            }
            _ => {
                self.counts.code_symbols += u32::from(b == b'=' && next == b'=');
                self.operator(text, at, b);
            }
        }
    }

    /// Measures the indentation of the line starting at `at`; a line whose first token is a
    /// symbol is counted here, one starting with a word at its newline.
    fn line_start(&mut self, text: &[u8], at: usize) {
        for &b in text.get(at..).unwrap_or_default() {
            match b {
                b' ' => self.leading += 1,
                b'\t' => self.leading += 4,
                b'\r' => {}
                b'\n' => return,
                _ => {
                    if !is_word(b) && self.leading >= 4 {
                        self.counts.indented_lines += 1;
                        self.leading = 0;
                    }
                    return;
                }
            }
        }
    }

    /// A fence is three backticks with nothing but words and blanks between them: any
    /// other symbol or a newline ends the run (even across messages).
    fn backtick(&mut self, breaks: u64) {
        if breaks != self.breaks_at_backtick {
            self.backticks = 0;
            self.breaks_at_backtick = breaks;
        }
        self.backticks += 1;
        self.counts.fences += u32::from(self.backticks == 3);
    }

    /// Counts `op` as arithmetic when a word or `)` precedes it and a word follows it,
    /// across blanks, newlines, parentheses and further operators ("x = -3"); `-` and `/`
    /// only between numbers, so "well-known" and "and/or" do not count. An operator after
    /// a `)` that stands between the two takes the right operand over.
    fn operator(&mut self, text: &[u8], at: usize, op: u8) {
        let before = text.get(..at).unwrap_or_default();
        let Some(left) = before.iter().rposition(|&b| !is_blank(b)) else {
            return;
        };
        let left_byte = before.get(left).copied().unwrap_or(0);
        let needs_numbers = matches!(op, b'-' | b'/');
        // Without an operand on the left nothing counts, and `-` and `/` need a number
        // there (a `)` is none): most hyphens and slashes in prose end here.
        let left_counts = if is_word(left_byte) {
            !needs_numbers || word_before_is_number(before, left + 1)
        } else {
            left_byte == b')' && !needs_numbers
        };
        if !left_counts {
            return;
        }
        let mut after_close = false;
        for (i, &b) in text.iter().enumerate().skip(at + 1) {
            if is_word(b) {
                let counts = !needs_numbers || word_is_number(text, i);
                self.counts.math_ops += u32::from(counts);
                return;
            }
            match b {
                b' ' | b'\t' | b'\r' | b'\n' => {}
                b'(' => after_close = false,
                b')' => after_close = true,
                b'+' | b'-' | b'*' | b'/' | b'=' | b'^' if !after_close => {}
                _ => return,
            }
        }
    }
}

/// Counts the words starting at the set bits of `starts` in the block at `base` (`window`:
/// its bytes and the 8 after; `flags`: word-byte flags of this block and the next); returns
/// the lanes to add and the number words. A free function with few live values, and not
/// inlined: inside `feed` the block loop's state crowds the registers, and the table
/// addresses and the multiplier would be reloaded for every word.
#[inline(never)]
fn count_words(
    text: &[u8],
    base: usize,
    window: &[u8; 72],
    flags: &[u8; 128],
    starts: u64,
) -> (u64, u32) {
    let mut lanes = 0u64;
    let mut numbers = 0;
    let mut starts = starts;
    while starts != 0 {
        let s = starts.trailing_zeros() as usize & 63;
        starts &= starts - 1;
        let x = load8(window, s);
        // The lowest flag byte that is 0 is the first byte past the word: isolating its
        // lowest bit and subtracting one masks the bytes before it (all 8 when there is none).
        let past = !load8(flags, s);
        let keep = (past & past.wrapping_neg()).wrapping_sub(1);
        if (x as u8).wrapping_sub(b'0') < 10 && is_number(text, base + s, x, keep) {
            numbers += 1;
        } else {
            // Setting bit 5 lowercases ASCII letters and keeps digits, which have it; bytes
            // past the word are masked off, so short words are zero padded like `cues::key`.
            let key = (x | splat(0x20)) & keep;
            lanes += LANES[usize::from(cues::lookup(key))];
        }
    }
    (lanes, numbers)
}

/// The lookup key of the word starting at `start`, as `count_words` computes it.
fn word_key(text: &[u8], start: usize) -> u64 {
    let mut bytes = [0u8; 8];
    let word = text.get(start..).unwrap_or_default();
    for (byte, &b) in bytes
        .iter_mut()
        .zip(word.iter().take_while(|&&b| is_word(b)))
    {
        *byte = b | 0x20;
    }
    u64::from_le_bytes(bytes)
}

/// Where the last word that starts before `end` starts, if any.
fn word_start_before(text: &[u8], end: usize) -> Option<usize> {
    let before = text.get(..end).unwrap_or_default();
    let last = before.iter().rposition(|&b| is_word(b))?;
    Some(
        before[..last]
            .iter()
            .rposition(|&b| !is_word(b))
            .map_or(0, |i| i + 1),
    )
}

/// The 8 bytes at `at` of `bytes`, little-endian.
fn load8<const N: usize>(bytes: &[u8; N], at: usize) -> u64 {
    let mut buf = [0u8; 8];
    buf.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(buf)
}

/// The 72 bytes at `base`: a block and the 8 bytes after it, which a word starting at the
/// block's end may need; borrowed from `text` where it is long enough, else copied into
/// `padded` with spaces past the end of `text`.
fn window<'a>(text: &'a [u8], base: usize, padded: &'a mut [u8; 72]) -> &'a [u8; 72] {
    let bytes = text.get(base..).unwrap_or_default();
    if let Some(window) = bytes.get(..72).and_then(|w| <&[u8; 72]>::try_from(w).ok()) {
        return window;
    }
    padded.fill(b' ');
    padded[..bytes.len()].copy_from_slice(bytes);
    padded
}

/// Byte frequencies for the entropy.
fn histogram(counts: &mut [u32; 256], text: &[u8]) {
    for &b in text {
        counts[usize::from(b)] += 1;
    }
}

/// Word-byte and special masks of the 64 bytes at `base` (bit i = byte `base + i`), and
/// the word-byte flags in `flags`; past the end of `text` the block reads as spaces, which
/// are neither.
fn block_masks(text: &[u8], base: usize, flags: &mut [u8]) -> (u64, u64) {
    if let Some(block) = text
        .get(base..base + 64)
        .and_then(|b| <&[u8; 64]>::try_from(b).ok())
    {
        return classify(block, flags);
    }
    let tail = text.get(base..).unwrap_or_default();
    let mut block = [b' '; 64];
    block[..tail.len()].copy_from_slice(tail);
    classify(&block, flags)
}

/// Word-byte and special masks of one block, and its word-byte flags (0xff or 0) in the
/// first 64 bytes of `flags`. Sixteen bytes at a time with `wide`'s safe SIMD (SSE2 on
/// x86_64, NEON on aarch64, plain arrays elsewhere): a few signed compares classify the
/// bytes and one `move_mask` gathers each class into bits.
pub(super) fn classify(block: &[u8; 64], flags: &mut [u8]) -> (u64, u64) {
    // Unsigned range tests as signed compares: adding `0x80 - lo` maps `lo..lo + n` onto
    // the n smallest values of `i8`.
    let to_lowest = |lo: u8| i8x16::splat(0x80u8.wrapping_sub(lo) as i8);
    let below = |n: i8| i8x16::splat(i8::MIN + n);
    let mut words = 0u64;
    let mut blanks_or_words = 0u64;
    for (j, flags) in flags.chunks_exact_mut(16).take(4).enumerate() {
        let mut bytes = [0u8; 16];
        bytes.copy_from_slice(&block[16 * j..16 * j + 16]);
        let v = i8x16::from(bytes.map(|b| b as i8));
        let letter = ((v | i8x16::splat(0x20)) + to_lowest(b'a')).cmp_lt(below(26));
        let digit = (v + to_lowest(b'0')).cmp_lt(below(10));
        let non_ascii = v.cmp_lt(i8x16::ZERO);
        let word = letter | digit | non_ascii;
        let space = v.cmp_eq(i8x16::splat(b' ' as i8));
        words |= u64::from(word.move_mask() as u16) << (16 * j);
        blanks_or_words |= u64::from((word | space).move_mask() as u16) << (16 * j);
        for (flag, w) in flags.iter_mut().zip(word.to_array()) {
            *flag = w as u8;
        }
    }
    (words, !blanks_or_words)
}

/// For 8 bytes read little-endian: bit 7 of each byte set when that byte is an ASCII digit.
fn digit_bytes(x: u64) -> u64 {
    let y = x & !HIGH;
    (y + splat(0x80 - b'0')) & !(y + splat(0x7f - b'9')) & !x & HIGH
}

const fn splat(b: u8) -> u64 {
    0x0101_0101_0101_0101 * b as u64
}

/// Whether the word at `at` (first 8 bytes `x`, of which `keep` masks the word's) is made
/// of ASCII digits only.
fn is_number(text: &[u8], at: usize, x: u64, keep: u64) -> bool {
    if (digit_bytes(x) | !keep) & HIGH != HIGH {
        return false;
    }
    keep != u64::MAX || word_is_number(text, at + 8)
}

/// Whether the word bytes from `at` on (possibly none) are all ASCII digits.
fn word_is_number(text: &[u8], at: usize) -> bool {
    text.get(at..)
        .unwrap_or_default()
        .iter()
        .take_while(|&&b| is_word(b))
        .all(u8::is_ascii_digit)
}

/// Whether the word ending just before `end` is made of ASCII digits only.
fn word_before_is_number(text: &[u8], end: usize) -> bool {
    text.get(..end)
        .unwrap_or_default()
        .iter()
        .rev()
        .take_while(|&&b| is_word(b))
        .all(u8::is_ascii_digit)
}

const fn is_word_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b >= 0x80
}

fn is_word(b: u8) -> bool {
    WORD_BYTE[usize::from(b)]
}

fn is_blank(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\r' | b'\n')
}

#[cfg(test)]
mod tests;
