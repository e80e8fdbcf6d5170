//! Prompt features and the complexity score (SPEC §1 step 2, `docs/routing.md`).
//!
//! Everything is computed in one pass over a bounded *scoring window* of the prompt, so the
//! cost per request is capped by `policy.complexity.scoring_window_chars` whatever the prompt
//! size. Only the token estimate looks at the whole prompt, and only at its length.

use serde::{Deserialize, Serialize};

use crate::profile::ComplexityWeights;

/// Who wrote a piece of prompt text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    System,
    User,
    Assistant,
    /// Tool results, developer messages and anything else: scored like user text.
    Other,
}

/// One text part of one message (multimodal messages contribute their text parts only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment<'a> {
    pub role: Role,
    pub text: &'a str,
}

/// The parts of a request that features are computed from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Prompt<'a> {
    /// Messages in request order (a completion prompt is one `User` segment).
    pub segments: Vec<Segment<'a>>,
    /// The request asked for JSON output (`response_format` json_object / json_schema).
    pub wants_json: bool,
}

/// The task a prompt asks for; profiles can declare a quality per class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TaskClass {
    Code,
    Math,
    Structured,
    General,
}

/// Features of one prompt; every score is in [0,1].
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Features {
    /// Shannon entropy of the window's bytes, mapped from 3..5.5 bits to 0..1.
    pub entropy: f64,
    /// Share of words that are content words (not function words).
    pub lexical: f64,
    pub code: f64,
    pub math: f64,
    pub json: f64,
    /// Numeric words per word, scaled so 25% numbers saturates.
    pub numeric: f64,
    /// Log-scaled window length: ~0 for a short question, 1 at the full window.
    pub length: f64,
    pub task_class: TaskClass,
    /// Weighted sum of the scores above, clamped to [0,1].
    pub complexity: f64,
    /// Bytes of prompt text in the whole request (not just the window).
    pub prompt_bytes: usize,
    /// Number of messages, for per-message token overhead.
    pub segments: usize,
}

/// A prompt that cannot be routed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FeatureError {
    #[error("prompt is empty")]
    EmptyPrompt,
}

/// Assistant turns are context, not the ask: they get at most this share of the window.
const ASSISTANT_WINDOW_SHARE: usize = 4;
/// Chat templates add a few tokens of framing per message.
const TOKENS_PER_MESSAGE: usize = 4;

// === impl Features ===

impl Features {
    /// Extracts features from a prompt and scores its complexity with `weights`.
    pub fn extract(prompt: &Prompt<'_>, weights: &ComplexityWeights) -> Result<Self, FeatureError> {
        let prompt_bytes: usize = prompt.segments.iter().map(|s| s.text.len()).sum();
        if prompt
            .segments
            .iter()
            .all(|s| s.text.trim_start().is_empty())
        {
            return Err(FeatureError::EmptyPrompt);
        }

        let mut scan = Scanner::default();
        let window = weights.scoring_window_chars.max(1);
        let mut assistant_left = window / ASSISTANT_WINDOW_SHARE;
        let mut left = window;
        // The ask (system + user) first, then assistant context if room is left.
        for pass_assistant in [false, true] {
            for seg in &prompt.segments {
                if (seg.role == Role::Assistant) != pass_assistant || left == 0 {
                    continue;
                }
                let mut budget = left;
                if pass_assistant {
                    budget = budget.min(assistant_left);
                }
                let text = truncate_at_char(seg.text, budget);
                scan.feed(text);
                left -= text.len();
                if pass_assistant {
                    assistant_left -= text.len();
                }
            }
        }
        Ok(scan.finish(
            prompt.wants_json,
            window,
            weights,
            prompt_bytes,
            prompt.segments.len(),
        ))
    }

    /// Estimated prompt tokens for a tokenizer averaging `chars_per_token`.
    pub fn estimated_input_tokens(&self, chars_per_token: f64) -> u64 {
        let per_char = if chars_per_token > 0.0 {
            chars_per_token
        } else {
            4.0
        };
        (self.prompt_bytes as f64 / per_char).ceil() as u64
            + (self.segments * TOKENS_PER_MESSAGE) as u64
    }
}

fn truncate_at_char(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// One pass over the window text, counting what the scores need.
#[derive(Debug)]
struct Scanner {
    byte_counts: [u32; 256],
    bytes: usize,
    words: u32,
    function_words: u32,
    numbers: u32,
    /// Digits plus number words ("three", "twice", "quarter"): quantities in word problems.
    quantities: u32,
    code_keywords: u32,
    code_intent: u32,
    code_symbols: u32,
    fences: u32,
    indented_lines: u32,
    math_ops: u32,
    math_words: u32,
    latex: u32,
    quantity_cues: u32,
    json_words: u32,
    /// Cue words seen, by `Cue` discriminant.
    cues: [u32; CUE_KINDS],
    json_braces: u32,
    /// Key of the previous word (for two-word cues such as "how many").
    prev_word: u64,
    /// Kind of the last non-space byte, for operator context.
    last: Last,
    /// An operator waiting to see what follows it, and whether a number preceded it.
    pending_op: Option<(u8, bool)>,
    at_line_start: bool,
    leading_spaces: u32,
    backticks: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Last {
    Nothing,
    Digit,
    Alpha,
    Close,
    Other,
}

impl Default for Scanner {
    fn default() -> Self {
        Self {
            byte_counts: [0; 256],
            bytes: 0,
            words: 0,
            function_words: 0,
            numbers: 0,
            quantities: 0,
            code_keywords: 0,
            code_intent: 0,
            code_symbols: 0,
            fences: 0,
            indented_lines: 0,
            math_ops: 0,
            math_words: 0,
            latex: 0,
            quantity_cues: 0,
            json_words: 0,
            cues: [0; CUE_KINDS],
            json_braces: 0,
            prev_word: 0,
            last: Last::Nothing,
            pending_op: None,
            at_line_start: true,
            leading_spaces: 0,
            backticks: 0,
        }
    }
}

impl Scanner {
    fn feed(&mut self, text: &str) {
        let bytes = text.as_bytes();
        self.bytes += bytes.len();
        self.histogram(bytes);
        let mut i = 0;
        while i < bytes.len() {
            let b = bytes[i];
            if BYTE_CLASS[b as usize] & WORD == 0 {
                // Spaces between words carry no cue (operators survive them).
                if b != b' ' || self.at_line_start {
                    self.symbol(b, bytes.get(i + 1).copied());
                }
                i += 1;
                continue;
            }
            let before = i.checked_sub(1).map(|j| bytes[j]);
            let (end, key, is_number) = scan_word(bytes, i);
            self.word(key, end - i, is_number, before);
            i = end;
        }
        // Segments are separate messages: no cue spans them.
        self.at_line_start = true;
        self.pending_op = None;
        self.last = Last::Nothing;
    }

    /// Byte frequencies for the entropy.
    fn histogram(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.byte_counts[b as usize] += 1;
        }
    }

    fn word(&mut self, key: u64, len: usize, is_number: bool, before: Option<u8>) {
        self.at_line_start = false;
        self.words += 1;
        if let Some((op, left_is_number)) = self.pending_op.take() {
            // "well-known" and "and/or" are not arithmetic; "3 - 2" and "6/3" are.
            let operand_ok = match op {
                b'-' | b'/' => is_number && left_is_number,
                _ => true,
            };
            if operand_ok {
                self.math_ops += 1;
            }
        }
        if is_number {
            self.numbers += 1;
            self.quantities += 1;
            self.last = Last::Digit;
        } else {
            self.last = Last::Alpha;
            self.classify_word(key, len <= 8, before);
        }
        self.prev_word = key;
    }

    /// Counts the word's cue without branching on its kind: the category indexes a counter,
    /// so words of mixed kinds do not mispredict a dispatch per word.
    fn classify_word(&mut self, key: u64, whole: bool, before: Option<u8>) {
        let cue = lookup_cue(key);
        // Function words count only when whole; "many"/"much" only right after "how".
        let drop = (cue == Cue::Function as u8 && !whole)
            | (cue == Cue::ManyMuch as u8 && self.prev_word != HOW);
        self.cues[usize::from(cue) * usize::from(!drop)] += 1;
        self.latex += u32::from(before == Some(b'\\'));
    }

    fn symbol(&mut self, b: u8, next: Option<u8>) {
        match b {
            b'\n' => {
                if self.leading_spaces >= 4 {
                    self.indented_lines += 1;
                }
                self.at_line_start = true;
                self.leading_spaces = 0;
                self.backticks = 0;
                return;
            }
            b' ' | b'\t' if self.at_line_start => {
                self.leading_spaces += if b == b'\t' { 4 } else { 1 };
                return;
            }
            b' ' | b'\t' | b'\r' => return,
            _ => {}
        }
        if self.at_line_start && self.leading_spaces >= 4 {
            self.indented_lines += 1;
            self.leading_spaces = 0;
        }
        self.at_line_start = false;
        if b == b'`' {
            self.backticks += 1;
            if self.backticks == 3 {
                self.fences += 1;
            }
        } else {
            self.backticks = 0;
        }
        match b {
            b'{' | b'}' | b';' | b'[' | b']' | b'<' | b'>' | b'|' | b'&' | b'#' | b'_' => {
                self.code_symbols += 1;
                if b == b'{' && next == Some(b'"') {
                    self.json_braces += 1;
                }
            }
            b'$' | b'%' => self.math_words += 1,
            b'\\' => {}
            b'+' | b'-' | b'*' | b'/' | b'=' | b'^' => {
                if matches!(self.last, Last::Digit | Last::Alpha | Last::Close) {
                    self.pending_op = Some((b, self.last == Last::Digit));
                }
                if b == b'=' && next == Some(b'=') {
                    self.code_symbols += 1;
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

    fn finish(
        mut self,
        wants_json: bool,
        window: usize,
        w: &ComplexityWeights,
        prompt_bytes: usize,
        segments: usize,
    ) -> Features {
        let cues = self.cues;
        self.function_words += cues[Cue::Function as usize];
        self.code_keywords += cues[Cue::CodeKeyword as usize];
        self.code_intent += cues[Cue::CodeIntent as usize];
        self.json_words += cues[Cue::Json as usize];
        self.math_words += cues[Cue::Math as usize] + cues[Cue::QuantityMath as usize];
        self.quantities += cues[Cue::Quantity as usize] + cues[Cue::QuantityMath as usize];
        self.quantity_cues += cues[Cue::ManyMuch as usize];
        let words = f64::from(self.words.max(1));
        let entropy = scale(shannon_entropy(&self.byte_counts, self.bytes), 3.0, 5.5);
        let lexical = if self.words == 0 {
            0.0
        } else {
            1.0 - f64::from(self.function_words) / words
        };
        let code = clamp01(
            0.6 * f64::from(self.fences.min(1))
                + 0.2 * f64::from(self.code_keywords.min(4))
                + 0.25 * f64::from(self.code_intent.min(2))
                + 0.1 * f64::from(self.indented_lines.min(5))
                + 4.0 * f64::from(self.code_symbols) / self.bytes.max(1) as f64,
        );
        let quantities = f64::from(self.quantities.min(4));
        let word_problem = if self.quantities >= 2 {
            0.2 * f64::from(self.math_words.min(3)) + 0.4 * f64::from(self.quantity_cues.min(1))
        } else {
            0.0
        };
        let math = clamp01(
            0.35 * f64::from(self.math_ops.min(3))
                + 0.4 * f64::from(self.latex.min(2))
                + 0.1 * quantities
                + word_problem,
        );
        let json = if wants_json {
            1.0
        } else {
            clamp01(
                0.6 * f64::from(self.json_words.min(1)) + 0.3 * f64::from(self.json_braces.min(2)),
            )
        };
        let numeric = clamp01(4.0 * f64::from(self.numbers) / words);
        let length = scale(
            (1.0 + self.bytes as f64).ln(),
            (1.0 + 32.0f64).ln(),
            (1.0 + window as f64).ln(),
        );
        let task_class = if code >= 0.5 && code >= math {
            TaskClass::Code
        } else if math >= 0.5 {
            TaskClass::Math
        } else if json >= 0.5 {
            TaskClass::Structured
        } else {
            TaskClass::General
        };
        let complexity = clamp01(
            w.entropy * entropy
                + w.lexical * lexical
                + w.code * code
                + w.math * math
                + w.json * json
                + w.numeric * numeric
                + w.length * length,
        );
        Features {
            entropy,
            lexical,
            code,
            math,
            json,
            numeric,
            length,
            task_class,
            complexity,
            prompt_bytes,
            segments,
        }
    }
}

/// Byte classes: word bytes are ASCII letters and digits and every non-ASCII byte (so
/// words in any script stay whole).
const WORD: u8 = 1;
const DIGIT: u8 = WORD | 2;

static BYTE_CLASS: [u8; 256] = {
    let mut table = [0u8; 256];
    let mut b = 0;
    while b < 256 {
        let byte = b as u8;
        table[b] = if byte.is_ascii_digit() {
            DIGIT
        } else if byte.is_ascii_alphabetic() || byte >= 0x80 {
            WORD
        } else {
            0
        };
        b += 1;
    }
    table
};

/// What a cue word signals; the discriminant indexes `Scanner::cues` (0 = no cue).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Cue {
    /// One of the commonest English function words; other words count as content words.
    Function = 1,
    CodeKeyword,
    /// Asks for code: names a language or a programming task.
    CodeIntent,
    Json,
    /// Word-problem vocabulary (stems up to 8 bytes: "calculat" matches "calculate").
    Math,
    /// A number word.
    Quantity,
    /// "twice", "half": both a quantity and arithmetic.
    QuantityMath,
    /// "many"/"much", a quantity question after "how".
    ManyMuch,
}

/// Slots in `Scanner::cues`: "no cue" plus one per `Cue`.
const CUE_KINDS: usize = Cue::ManyMuch as usize + 1;

const HOW: u64 = key(b"how");

const HIGH: u64 = 0x8080_8080_8080_8080;

const fn splat(b: u8) -> u64 {
    0x0101_0101_0101_0101 * b as u64
}

/// For 8 bytes read little-endian: bit 7 of each byte is set in the first mask when that byte
/// is a word byte (ASCII letter or digit, or any non-ASCII byte) and in the second when it is
/// an ASCII digit. Each range test adds a constant to the 7-bit value of every byte at once;
/// no sum exceeds 0xff, so nothing carries into the next byte.
fn word_bits(x: u64) -> (u64, u64) {
    let ascii = !x & HIGH;
    let y = x & !HIGH;
    let digit = (y + splat(0x80 - b'0')) & !(y + splat(0x7f - b'9')) & ascii;
    let z = y | splat(0x20);
    let letter = (z + splat(0x80 - b'a')) & !(z + splat(0x7f - b'z')) & ascii;
    (digit | letter | (x & HIGH), digit)
}

/// Mask of the low `n` bytes (n < 8).
fn low_bytes(n: u32) -> u64 {
    (1u64 << (8 * n)) - 1
}

/// Scans the word starting at `bytes[start]` (a word byte) with 8-byte loads. Returns where
/// it ends, its lookup key (first 8 bytes lowercased, big-endian, zero padded: setting bit 5
/// lowercases ASCII letters and leaves digits, which have it, and non-ASCII bytes, which keep
/// bit 7 and never equal an ASCII cue word) and whether it is all ASCII digits.
fn scan_word(bytes: &[u8], start: usize) -> (usize, u64, bool) {
    let Some(x) = load8(bytes, start) else {
        return scan_word_bytewise(bytes, start);
    };
    let (word, digit) = word_bits(x);
    let stop = !word & HIGH;
    if stop != 0 {
        // The common case: the whole word is inside this load.
        let len = stop.trailing_zeros() / 8;
        let keep = low_bytes(len);
        let key = ((x | splat(0x20)) & keep).swap_bytes();
        let is_number = digit & keep == HIGH & keep;
        return (start + len as usize, key, is_number);
    }
    let key = (x | splat(0x20)).swap_bytes();
    let mut is_number = digit == HIGH;
    let mut i = start + 8;
    while let Some(x) = load8(bytes, i) {
        let (word, digit) = word_bits(x);
        let stop = !word & HIGH;
        if stop != 0 {
            let len = stop.trailing_zeros() / 8;
            let keep = low_bytes(len);
            is_number &= digit & keep == HIGH & keep;
            return (i + len as usize, key, is_number);
        }
        is_number &= digit == HIGH;
        i += 8;
    }
    while i < bytes.len() && BYTE_CLASS[bytes[i] as usize] & WORD != 0 {
        is_number &= BYTE_CLASS[bytes[i] as usize] == DIGIT;
        i += 1;
    }
    (i, key, is_number)
}

fn load8(bytes: &[u8], at: usize) -> Option<u64> {
    let chunk = bytes.get(at..at + 8)?;
    let mut buf = [0u8; 8];
    buf.copy_from_slice(chunk);
    Some(u64::from_le_bytes(buf))
}

/// The tail of a buffer, shorter than one load.
fn scan_word_bytewise(bytes: &[u8], start: usize) -> (usize, u64, bool) {
    let mut i = start;
    let mut key = 0u64;
    let mut is_number = true;
    while i < bytes.len() {
        let class = BYTE_CLASS[bytes[i] as usize];
        if class & WORD == 0 {
            break;
        }
        if i - start < 8 {
            key |= u64::from(bytes[i] | 0x20) << (8 * (7 - (i - start)));
        }
        is_number &= class == DIGIT;
        i += 1;
    }
    (i, key, is_number)
}

/// Packs the first 8 bytes of a lowercase word into a big-endian u64 (zero padded).
const fn key(word: &[u8]) -> u64 {
    let mut bytes = [0u8; 8];
    let mut i = 0;
    while i < word.len() && i < 8 {
        bytes[i] = word[i];
        i += 1;
    }
    u64::from_be_bytes(bytes)
}

const CUE_WORDS: &[(Cue, &[&[u8]])] = &[
    (
        Cue::Function,
        &[
            b"a", b"an", b"the", b"and", b"or", b"but", b"if", b"of", b"to", b"in", b"on", b"at",
            b"by", b"for", b"with", b"from", b"as", b"is", b"are", b"was", b"were", b"be", b"been",
            b"it", b"its", b"this", b"that", b"these", b"those", b"he", b"she", b"they", b"we",
            b"you", b"i", b"me", b"my", b"your", b"his", b"her", b"their", b"our", b"do", b"does",
            b"did", b"have", b"has", b"had", b"will", b"would", b"can", b"could", b"should",
            b"not", b"no", b"so", b"than", b"then", b"there", b"what", b"which", b"who", b"how",
            b"about", b"into", b"some", b"any", b"all",
        ],
    ),
    (
        Cue::CodeKeyword,
        &[
            b"def", b"fn", b"class", b"import", b"return", b"elif", b"lambda", b"const", b"let",
            b"var", b"void", b"struct", b"impl", b"self", b"public", b"private", b"static",
            b"async", b"await", b"null", b"none", b"true", b"false", b"int", b"str", b"bool",
            b"println", b"printf", b"include",
        ],
    ),
    (
        Cue::CodeIntent,
        &[
            b"python",
            b"java",
            b"rust",
            b"golang",
            b"sql",
            b"regex",
            b"code",
            b"function",
            b"program",
            b"script",
            b"compile",
            b"debug",
            b"bug",
            b"api",
            b"html",
            b"css",
            b"bash",
            b"query",
            b"array",
            b"string",
            b"integer",
            b"method",
            b"variable",
            b"loop",
        ],
    ),
    (Cue::Json, &[b"json", b"yaml", b"xml", b"csv", b"schema"]),
    (
        Cue::Math,
        &[
            b"calculat",
            b"solve",
            b"equation",
            b"sum",
            b"average",
            b"percent",
            b"product",
            b"total",
            b"times",
            b"remainin",
            b"altogeth",
            b"profit",
            b"cost",
            b"costs",
            b"spend",
            b"spent",
            b"earn",
            b"earns",
            b"paid",
            b"pays",
            b"per",
            b"each",
            b"every",
            b"minutes",
            b"hours",
            b"dollars",
            b"cents",
            b"miles",
            b"integral",
            b"derivati",
            b"probabil",
            b"fraction",
            b"ratio",
            b"rate",
            b"older",
            b"younger",
            b"combined",
            b"price",
            b"sold",
            b"sells",
            b"buys",
            b"bought",
            b"fewer",
            b"left",
        ],
    ),
    (
        Cue::Quantity,
        &[
            b"one",
            b"two",
            b"three",
            b"four",
            b"five",
            b"six",
            b"seven",
            b"eight",
            b"nine",
            b"ten",
            b"eleven",
            b"twelve",
            b"fifteen",
            b"twenty",
            b"thirty",
            b"forty",
            b"fifty",
            b"hundred",
            b"thousand",
            b"million",
            b"third",
            b"quarter",
            b"double",
            b"triple",
            b"dozen",
        ],
    ),
    (Cue::QuantityMath, &[b"twice", b"half"]),
    (Cue::ManyMuch, &[b"many", b"much"]),
];

const CUE_COUNT: usize = {
    let mut n = 0;
    let mut i = 0;
    while i < CUE_WORDS.len() {
        n += CUE_WORDS[i].1.len();
        i += 1;
    }
    n
};

/// Slots of the cue hash table: a power of two over twice the word count keeps probe
/// chains short.
const CUE_SLOTS: usize = 512;

const fn slot(key: u64) -> usize {
    // Fibonacci hashing: the top bits of a multiply spread packed ASCII well.
    (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - CUE_SLOTS.trailing_zeros())) as usize
}

/// Every cue word by key in an open-addressing table built at compile time (key 0 = empty;
/// no word packs to 0). A lookup is a multiply and, almost always, one comparison.
static CUE_TABLE: [(u64, u8); CUE_SLOTS] = {
    assert!(CUE_COUNT * 2 <= CUE_SLOTS);
    let mut table = [(0u64, 0u8); CUE_SLOTS];
    let mut g = 0;
    while g < CUE_WORDS.len() {
        let (cue, words) = CUE_WORDS[g];
        let mut w = 0;
        while w < words.len() {
            let k = key(words[w]);
            let mut i = slot(k);
            while table[i].0 != 0 {
                assert!(table[i].0 != k, "duplicate cue word");
                i = (i + 1) % CUE_SLOTS;
            }
            table[i] = (k, cue as u8);
            w += 1;
        }
        g += 1;
    }
    table
};

/// The `Cue` discriminant of a word key, 0 when it is no cue word.
fn lookup_cue(key: u64) -> u8 {
    let mut i = slot(key);
    loop {
        let (k, cue) = CUE_TABLE[i];
        if k == key {
            return cue;
        }
        if k == 0 {
            return 0;
        }
        i = (i + 1) % CUE_SLOTS;
    }
}

/// Bits per byte, 0 for empty input.
fn shannon_entropy(counts: &[u32; 256], total: usize) -> f64 {
    if total == 0 {
        return 0.0;
    }
    let n = total as f64;
    counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let p = f64::from(c) / n;
            -p * p.log2()
        })
        .sum()
}

fn scale(value: f64, lo: f64, hi: f64) -> f64 {
    clamp01((value - lo) / (hi - lo))
}

fn clamp01(x: f64) -> f64 {
    if x.is_nan() {
        0.0
    } else {
        x.clamp(0.0, 1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn features(text: &str) -> Features {
        let prompt = Prompt {
            segments: vec![Segment {
                role: Role::User,
                text,
            }],
            wants_json: false,
        };
        Features::extract(&prompt, &ComplexityWeights::default()).unwrap()
    }

    #[test]
    fn cue_table_holds_every_word_once() {
        let filled = CUE_TABLE.iter().filter(|(k, _)| *k != 0).count();
        assert_eq!(filled, CUE_COUNT, "every cue word has its own slot");
        assert_eq!(lookup_cue(key(b"calculat")), Cue::Math as u8);
        assert_eq!(lookup_cue(key(b"the")), Cue::Function as u8);
        assert_eq!(lookup_cue(key(b"zebra")), 0);
        let text = b"x CALCULATION How def";
        assert_eq!(scan_word(text, 2), (13, key(b"calculat"), false));
        assert_eq!(scan_word(text, 14), (17, key(b"how"), false));
        assert_eq!(
            scan_word(text, 18),
            (21, key(b"def"), false),
            "at the end of the buffer"
        );
        assert_eq!(scan_word(b"42", 0), (2, key(b"42"), true));
    }

    #[test]
    fn word_scan_matches_a_bytewise_scan_on_any_input() {
        let samples: [&[u8]; 6] = [
            b"Hello, World! 12345 x9 0.5 \\frac{a}{b} snake_case \xc3\xa9t\xc3\xa9",
            b"1234567890123 abcdefghijklmnop ABCDEFGH 12345678 a",
            b"@[`{/:~ 09AZaz",
            b"   leading and trailing   ",
            b"\xff\x80\x7f\x00 \xe2\x9c\x93",
            b"z",
        ];
        for text in samples {
            let mut i = 0;
            while i < text.len() {
                if BYTE_CLASS[text[i] as usize] & WORD == 0 {
                    i += 1;
                    continue;
                }
                let fast = scan_word(text, i);
                let slow = scan_word_bytewise(text, i);
                assert_eq!(
                    fast,
                    slow,
                    "word at {i} of {:?}",
                    String::from_utf8_lossy(text)
                );
                i = fast.0;
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn word_scan_matches_a_bytewise_scan_on_arbitrary_bytes(
            text in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..80)
        ) {
            for i in 0..text.len() {
                if BYTE_CLASS[text[i] as usize] & WORD != 0 {
                    proptest::prop_assert_eq!(scan_word(&text, i), scan_word_bytewise(&text, i));
                }
            }
        }
    }

    #[test]
    fn empty_and_whitespace_prompts_are_rejected() {
        let w = ComplexityWeights::default();
        for text in ["", "   \n\t "] {
            let prompt = Prompt {
                segments: vec![Segment {
                    role: Role::User,
                    text,
                }],
                wants_json: false,
            };
            assert_eq!(
                Features::extract(&prompt, &w),
                Err(FeatureError::EmptyPrompt)
            );
        }
        assert_eq!(
            Features::extract(&Prompt::default(), &w),
            Err(FeatureError::EmptyPrompt)
        );
    }

    #[test]
    fn python_function_is_code() {
        let f = features(
            "Complete this Python function:\ndef add(a, b):\n    \"\"\"Return a + b.\"\"\"\n",
        );
        assert_eq!(f.task_class, TaskClass::Code);
        assert!(f.code >= 0.5, "{f:?}");
    }

    #[test]
    fn word_problem_is_math() {
        let f = features(
            "Seal releases 3 songs every month. He gets $2000 per song. How much money does he get in his first 3 years?",
        );
        assert_eq!(f.task_class, TaskClass::Math);
    }

    #[test]
    fn latex_is_math() {
        let f = features(r"Evaluate \int_0^1 x^2 dx and \frac{1}{2}");
        assert_eq!(f.task_class, TaskClass::Math);
    }

    #[test]
    fn json_request_is_structured() {
        let prompt = Prompt {
            segments: vec![Segment {
                role: Role::User,
                text: "List three colours.",
            }],
            wants_json: true,
        };
        let f = Features::extract(&prompt, &ComplexityWeights::default()).unwrap();
        assert_eq!(f.task_class, TaskClass::Structured);
        assert_eq!(f.json, 1.0);
    }

    #[test]
    fn short_chat_is_simple_general() {
        let f = features("Give three tips for staying healthy.");
        assert_eq!(f.task_class, TaskClass::General);
        assert!(f.complexity < 0.4, "{f:?}");
    }

    #[test]
    fn complexity_grows_with_code_content() {
        let simple = features("Say hello to my friend.");
        let code =
            features("```rust\nfn main() { let x: Vec<u8> = vec![]; println!(\"{x:?}\"); }\n```");
        assert!(
            code.complexity > simple.complexity + 0.2,
            "{simple:?} {code:?}"
        );
    }

    #[test]
    fn system_prompt_counts_and_assistant_is_capped() {
        let w = ComplexityWeights {
            scoring_window_chars: 64,
            ..ComplexityWeights::default()
        };
        let long = "x".repeat(1000);
        let prompt = Prompt {
            segments: vec![
                Segment {
                    role: Role::Assistant,
                    text: &long,
                },
                Segment {
                    role: Role::System,
                    text: "You write Python code.",
                },
                Segment {
                    role: Role::User,
                    text: "hi",
                },
            ],
            wants_json: false,
        };
        let f = Features::extract(&prompt, &w).unwrap();
        assert!(f.code > 0.0, "system prompt must be scored: {f:?}");
        assert_eq!(f.prompt_bytes, 1000 + 22 + 2);
        assert_eq!(f.estimated_input_tokens(4.0), 256 + 12);
    }

    #[test]
    fn window_bounds_the_scored_text_at_a_char_boundary() {
        let w = ComplexityWeights {
            scoring_window_chars: 5,
            ..ComplexityWeights::default()
        };
        let prompt = Prompt {
            segments: vec![Segment {
                role: Role::User,
                text: "ééééé",
            }],
            wants_json: false,
        };
        assert!(Features::extract(&prompt, &w).is_ok());
    }
}
