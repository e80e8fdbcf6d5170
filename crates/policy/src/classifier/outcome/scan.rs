//! What the outcome head reads of a prompt: one pass over the first [`OUTCOME_WINDOW`]
//! bytes of the scoring window that counts numbers, sentences, words of the vocabularies in
//! `lexicon`, lines, list items, code-like lines and answer choices.

use super::super::grams::WORD_BYTE;
use super::super::lexicon::{self, Domain};
use super::{
    OutcomeInputs, CHOICES, INPUT_RANGE, MAX_MEAN_WORD, OUTCOME_FEATURES, OUTCOME_INPUTS,
    OUTCOME_WINDOW,
};
use crate::features::{for_each_scored, Prompt};

// === impl OutcomeInputs ===

impl OutcomeInputs {
    /// The inputs of a prompt's scoring window of `window` bytes, at most
    /// [`OUTCOME_WINDOW`] of it, in one pass.
    pub fn of(prompt: &Prompt<'_>, window: usize) -> Self {
        let mut scan = Scan::default();
        for_each_scored(prompt, window.min(OUTCOME_WINDOW), |text| {
            scan.feed(text.as_bytes())
        });
        scan.inputs()
    }

    /// The inputs of a single user message, as outcome records are read.
    pub fn of_text(text: &str, window: usize) -> Self {
        Self::of(&Prompt::user(text), window)
    }

    /// The text [`Self::of`] reads of a prompt, its pieces joined by blank lines: what a
    /// traffic record logs of the prompt with `--log-prompts`, so the logged text is the
    /// features' own and never longer than the window (plus the joins).
    pub fn scored_text(prompt: &Prompt<'_>, window: usize) -> String {
        let mut text = String::new();
        for_each_scored(prompt, window.min(OUTCOME_WINDOW), |piece| {
            if piece.is_empty() {
                return;
            }
            if !text.is_empty() {
                text.push_str("\n\n");
            }
            text.push_str(piece);
        });
        text
    }

    /// Whether the prompt lists answer choices (a multiple-choice question).
    pub fn choices(&self) -> bool {
        self.0[CHOICES] > 0.5
    }

    /// The inputs by name, zeros left out: what a traffic record stores.
    pub fn named(&self) -> std::collections::BTreeMap<&'static str, f32> {
        OUTCOME_FEATURES
            .iter()
            .zip(self.0)
            .filter(|(_, v)| *v != 0.0)
            .map(|(name, v)| (*name, v))
            .collect()
    }

    /// Inputs from a traffic record's names; a name the head does not read, a count of
    /// inputs other than this head's, or a value outside [`INPUT_RANGE`] (3e38, NaN) is
    /// refused: the record was written by a router with another feature list, or by none,
    /// and its numbers mean something else.
    pub fn from_named(
        named: &std::collections::BTreeMap<String, f32>,
        inputs: Option<usize>,
    ) -> Result<Self, String> {
        if let Some(n) = inputs.filter(|&n| n != OUTCOME_INPUTS) {
            return Err(format!(
                "the record's features come from a head of {n} inputs, this one reads \
                 {OUTCOME_INPUTS} ({OUTCOME_FEATURES:?}): train from records of this version"
            ));
        }
        let mut out = [0f32; OUTCOME_INPUTS];
        for (name, &value) in named {
            let Some(i) = OUTCOME_FEATURES.iter().position(|n| n == name) else {
                return Err(format!(
                    "feature `{name}` is not an input of the outcome head ({OUTCOME_FEATURES:?}): \
                     the record was written by a router with another feature list"
                ));
            };
            if !INPUT_RANGE.contains(&value) {
                return Err(format!(
                    "feature `{name}` is {value}, outside [{}, {}] where every input of this \
                     head lies: the record was not written by it",
                    INPUT_RANGE.start(),
                    INPUT_RANGE.end()
                ));
            }
            out[i] = value;
        }
        Ok(Self(out))
    }
}

/// Counts gathered over the window.
#[derive(Debug, Default)]
struct Scan {
    bytes: usize,
    /// Words with a byte outside ASCII in their first eight: another language's.
    non_ascii: u32,
    question_words: u32,
    numbers: u32,
    distinct: [u64; 32],
    distinct_count: usize,
    sentences: u32,
    questions: u32,
    words: u32,
    long_words: u32,
    word_bytes: usize,
    operators: u32,
    options: u32,
    option_bytes: usize,
    numeric_options: u32,
    statements: bool,
    negations: u32,
    relations: u32,
    money_percent: u32,
    parentheses: u32,
    capitalised: u32,
    decimals: u32,
    fractions: u32,
    /// Words of each vocabulary of `lexicon`, by its discriminant.
    domains: [u32; DOMAIN_SLOTS],
    lines: u32,
    list_items: u32,
    code_lines: u32,
    code_symbols: u32,
    code_fences: u32,
}

/// The shape of the line being read.
#[derive(Debug, Clone, Copy, Default)]
struct Line {
    /// Inside an answer choice (from its letter to the end of its line).
    option: bool,
    option_digit: bool,
    /// Starts with two spaces or a tab.
    indented: bool,
    /// Its last byte other than white space, 0 while it has none.
    last: u8,
}

/// Slots of `Scan::domains`: one per `lexicon::Domain` discriminant, and 0.
const DOMAIN_SLOTS: usize = Domain::Format as usize + 1;

impl Scan {
    fn feed(&mut self, t: &[u8]) {
        self.bytes += t.len();
        let mut i = 0;
        let mut line_start = true;
        let mut line = Line::default();
        let mut after_number = false;
        while i < t.len() {
            let b = t[i];
            if line_start {
                line_start = false;
                if self.start_line(t, i, &mut line) {
                    i += 3;
                    continue;
                }
            }
            if b.is_ascii_digit() {
                i = self.number(t, i, &mut line, after_number);
                after_number = true;
                continue;
            }
            if is_word_byte(b) {
                i = self.read_word(t, i, &mut line);
                after_number = false;
                continue;
            }
            if !b.is_ascii_whitespace() {
                line.last = b;
            }
            self.symbol(t, i, &mut line);
            i += 1;
            // A fraction keeps `after_number` across its slash.
            if b == b'/' {
                continue;
            }
            if b == b'\n' {
                line_start = true;
                line = Line::default();
            }
            self.option_bytes += usize::from(line.option);
            after_number = false;
        }
        self.end_line(line);
    }

    /// Notes what the line starting at `i` is: indented, an item of a list, or an answer
    /// choice (true: its three bytes of label are read).
    fn start_line(&mut self, t: &[u8], i: usize, line: &mut Line) -> bool {
        line.indented = t[i..].starts_with(b"  ") || t[i] == b'\t';
        if is_option_letter(t, i) {
            line.option = true;
            line.option_digit = false;
            line.last = b' ';
            self.options += 1;
            return true;
        }
        self.list_items += u32::from(is_list_item(&t[i..]));
        false
    }

    /// Reads the word starting at `i`; returns where it ends.
    fn read_word(&mut self, t: &[u8], mut i: usize, line: &mut Line) -> usize {
        let start = i;
        // The first eight bytes, lowercased, as one number: the word lists compare numbers,
        // not strings (this pass is on the request path).
        let mut key = 0u64;
        while i < t.len() && is_word_byte(t[i]) {
            if i - start < 8 {
                key |= u64::from(t[i] | 0x20) << (8 * (i - start));
            }
            i += 1;
        }
        let rest = t.get(i..).unwrap_or_default();
        self.word(&t[start..i], key, rest, line.option);
        line.last = t[i - 1];
        i
    }

    /// Reads the number starting at `i`; returns where it ends.
    fn number(&mut self, t: &[u8], mut i: usize, line: &mut Line, after_number: bool) -> usize {
        let start = i;
        let mut decimal = false;
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        while i < t.len() {
            let c = t[i];
            if c.is_ascii_digit() {
                h = (h ^ u64::from(c)).wrapping_mul(0x0100_0000_01b3);
                i += 1;
            } else if (c == b'.' || c == b',') && t.get(i + 1).is_some_and(u8::is_ascii_digit) {
                decimal = true;
                i += 1;
            } else {
                break;
            }
        }
        if after_number && start > 0 && t[start - 1] == b'/' {
            self.fractions += 1;
        }
        self.numbers += 1;
        self.decimals += u32::from(decimal);
        self.remember(h);
        line.option_digit |= line.option;
        line.last = t[i - 1];
        if !line.option {
            self.question_words += 1;
        }
        i
    }

    /// A byte that is neither a word's nor a number's.
    fn symbol(&mut self, t: &[u8], i: usize, line: &mut Line) {
        match t[i] {
            b'\n' => self.end_line(*line),
            b'.' | b'!' | b'?' if !line.option => {
                let next = t.get(i + 1).copied().unwrap_or(b' ');
                if next.is_ascii_whitespace() {
                    self.sentences += 1;
                }
                self.questions += u32::from(t[i] == b'?');
            }
            b'+' | b'-' | b'*' | b'=' | b'^' | b'<' | b'>' | b'/' => self.operators += 1,
            b'%' | b'$' => self.money_percent += 1,
            b'(' => self.parentheses += 1,
            b'{' | b'}' | b'[' | b']' | b';' | b'_' => self.code_symbols += 1,
            b'`' => {
                self.code_symbols += 1;
                self.code_fences += u32::from(t[i..].starts_with(b"```"));
            }
            _ => {}
        }
    }

    fn end_line(&mut self, line: Line) {
        self.end_option(line);
        if line.last != 0 {
            self.lines += 1;
            let code = (line.indented && !line.option) || matches!(line.last, b';' | b'{' | b'}');
            self.code_lines += u32::from(code);
        }
    }

    fn end_option(&mut self, line: Line) {
        if line.option {
            self.numeric_options += u32::from(line.option_digit);
        }
    }

    fn remember(&mut self, h: u64) {
        let seen = &self.distinct[..self.distinct_count];
        if !seen.contains(&h) && self.distinct_count < self.distinct.len() {
            self.distinct[self.distinct_count] = h;
            self.distinct_count += 1;
        }
    }

    fn word(&mut self, w: &[u8], key: u64, rest: &[u8], option: bool) {
        self.words += 1;
        self.word_bytes += w.len();
        self.non_ascii += u32::from(key & 0x8080_8080_8080_8080 != 0);
        if option {
            self.option_bytes += w.len();
        } else {
            self.question_words += 1;
        }
        self.long_words += u32::from(w.len() >= 9);
        self.capitalised += u32::from(w[0].is_ascii_uppercase());
        // A key of a word of eight bytes or fewer is the word itself; the nine-letter words
        // also need their length.
        match key {
            NOT | EXCEPT | FALSE | LEAST | NEVER | CANNOT => self.negations += 1,
            INCORRECT if w.len() == 9 => self.negations += 1,
            TWICE | HALF | TIMES | PERCENT | EACH | EVERY | PER | REST | TOTAL => {
                self.relations += 1
            }
            REMAINING if w.len() == 9 => self.relations += 1,
            STATEMENT
                if w.len() == 9
                    && rest.len() >= 2
                    && rest[0] == b' '
                    && rest[1].is_ascii_digit() =>
            {
                self.statements = true
            }
            // Every word of the vocabularies has three letters or more.
            _ if w.len() >= 3 => {
                if let Some(domain) = lexicon::lookup(key) {
                    self.domains[domain as usize] += 1;
                }
            }
            _ => {}
        }
    }

    fn inputs(&self) -> OutcomeInputs {
        let ln = |x: f64| x.ln_1p() as f32;
        let count = |n: u32, scale: f32| ln(f64::from(n)) / scale;
        let vocabulary = |d: Domain| count(self.domains[d as usize], 2.0);
        let choices = self.options >= 2;
        let option_mean = if self.options > 0 {
            self.option_bytes as f64 / f64::from(self.options)
        } else {
            0.0
        };
        let mean_word = self.word_bytes as f64 / f64::from(self.words.max(1));
        OutcomeInputs([
            ln(self.bytes as f64) / 8.0,
            count(self.question_words, 6.0),
            count(self.numbers, 4.0),
            ln(self.distinct_count as f64) / 4.0,
            count(self.sentences + 1, 3.0),
            count(self.questions, 2.0),
            self.long_words as f32 / self.words.max(1) as f32,
            (mean_word.min(MAX_MEAN_WORD) / 10.0) as f32,
            count(self.operators, 3.0),
            f32::from(u8::from(choices)),
            ln(option_mean) / 5.0,
            count(self.numeric_options, 2.0),
            f32::from(u8::from(self.statements)),
            count(self.negations, 2.0),
            count(self.relations, 2.0),
            count(self.money_percent, 2.0),
            count(self.parentheses, 2.0),
            count(self.capitalised, 3.0),
            count(self.decimals, 2.0),
            count(self.fractions, 2.0),
            vocabulary(Domain::Create),
            vocabulary(Domain::Explain),
            vocabulary(Domain::Fix),
            vocabulary(Domain::Solve),
            vocabulary(Domain::Transform),
            vocabulary(Domain::Advice),
            vocabulary(Domain::Creative),
            vocabulary(Domain::Constraint),
            vocabulary(Domain::Steps),
            vocabulary(Domain::Short),
            vocabulary(Domain::Long),
            vocabulary(Domain::Format),
            vocabulary(Domain::Code),
            vocabulary(Domain::Science),
            count(self.lines, 3.0),
            count(self.list_items, 2.0),
            count(self.code_lines, 3.0),
            count(self.code_symbols, 4.0),
            count(self.code_fences, 2.0),
            self.non_ascii as f32 / self.words.max(1) as f32,
        ])
    }
}

/// The lowercase first eight bytes of a word as the scan packs them.
const fn pack(word: &[u8]) -> u64 {
    let mut key = 0u64;
    let mut i = 0;
    while i < word.len() && i < 8 {
        key |= ((word[i] | 0x20) as u64) << (8 * i);
        i += 1;
    }
    key
}

const NOT: u64 = pack(b"not");
const EXCEPT: u64 = pack(b"except");
const FALSE: u64 = pack(b"false");
const INCORRECT: u64 = pack(b"incorrect");
const LEAST: u64 = pack(b"least");
const NEVER: u64 = pack(b"never");
const CANNOT: u64 = pack(b"cannot");
const TWICE: u64 = pack(b"twice");
const HALF: u64 = pack(b"half");
const TIMES: u64 = pack(b"times");
const PERCENT: u64 = pack(b"percent");
const EACH: u64 = pack(b"each");
const EVERY: u64 = pack(b"every");
const PER: u64 = pack(b"per");
const REMAINING: u64 = pack(b"remaining");
const REST: u64 = pack(b"rest");
const TOTAL: u64 = pack(b"total");
const STATEMENT: u64 = pack(b"statement");

/// A line that is an item of a list: `- `, `* `, `+ `, or a number and `. ` or `) `.
fn is_list_item(t: &[u8]) -> bool {
    let digits = t.iter().take_while(|b| b.is_ascii_digit()).count();
    match (digits, t.first()) {
        (0, Some(b'-' | b'*' | b'+')) => t.get(1) == Some(&b' '),
        (1..=3, _) => {
            matches!(t.get(digits), Some(b'.' | b')')) && t.get(digits + 1) == Some(&b' ')
        }
        _ => false,
    }
}

/// A line that starts an answer choice: `A. `, `B) ` ... `E. `.
fn is_option_letter(t: &[u8], i: usize) -> bool {
    matches!(t[i], b'A'..=b'E')
        && t.get(i + 1).is_some_and(|&c| c == b'.' || c == b')')
        && t.get(i + 2) == Some(&b' ')
}

fn is_word_byte(b: u8) -> bool {
    WORD_BYTE[usize::from(b)]
}
