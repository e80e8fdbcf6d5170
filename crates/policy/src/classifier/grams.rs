//! What the classifier reads of a prompt: hashed word unigrams and bigrams of the scoring
//! window, and a few dense scores (the structural features plus shape counts).
//!
//! Words are the scanner's words (runs of ASCII letters and digits and non-ASCII bytes),
//! lowercased; every all-digit word is the one token `<num>`, so "246 cards" and "13 cards"
//! read alike. Each text part starts with a `<start>` token, so the first word of the ask
//! ("Write", "Could", "Name") forms a bigram of its own. Tokens are hashed with FNV-1a into
//! `2^bits` buckets; collisions are what keeps the model a fixed, small size.

use super::lexicon::{self, Domain};
use crate::features::{for_each_scored, Features, Prompt};

/// Names of the dense inputs, in weight order; part of the model's format.
pub const DENSE_FEATURES: [&str; DENSE] = [
    "entropy",
    "lexical",
    "code",
    "math",
    "json",
    "numeric",
    "length",
    "question",
    "lines",
    "sentences",
    "code_terms",
    "science_terms",
];
pub const DENSE: usize = 12;

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0100_0000_01b3;
/// Token of every all-digit word.
const NUM: u64 = 0x6e75_6d3c_3e00_0001;
/// Token before the first word of each text part.
const START: u64 = 0x7374_6172_743c_3e01;
const UNIGRAM_SALT: u64 = 0x9e37_79b9_7f4a_7c15;
const BIGRAM_SALT: u64 = 0xc2b2_ae3d_27d4_eb4f;

/// Word bytes, as the scanner counts them.
pub(super) static WORD_BYTE: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        table[b] = (b as u8).is_ascii_alphanumeric() || b >= 0x80;
        b += 1;
    }
    table
};

/// One token as hashed, with its text when the caller wants it (explain).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Gram<'t> {
    Unigram(Token<'t>),
    Bigram(Token<'t>, Token<'t>),
}

/// A word of the text, or one of the two special tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Token<'t> {
    Start,
    Number,
    Word(&'t [u8]),
}

/// Shape counts gathered on the way, for the dense inputs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Shape {
    pub grams: u32,
    pub lines: u32,
    pub sentences: u32,
    /// Words of the programming and the science vocabularies (`lexicon`).
    pub code_terms: u32,
    pub science_terms: u32,
    /// The last non-blank byte of the last text part.
    pub last: u8,
}

/// Calls `f(bucket, gram)` for every gram of the prompt's scoring window, in text order.
/// `with_text` fills in the words of each gram (only explain needs them).
pub(crate) fn for_each_gram<'p>(
    prompt: &Prompt<'p>,
    window: usize,
    bits: u32,
    mut f: impl FnMut(u32, Option<Gram<'p>>),
    with_text: bool,
) -> Shape {
    let mut shape = Shape::default();
    let shift = 64 - bits;
    let bucket = |hash: u64, salt: u64| ((hash ^ salt).wrapping_mul(UNIGRAM_SALT) >> shift) as u32;
    for_each_scored(prompt, window, |text| {
        let bytes = text.as_bytes();
        let mut prev = START;
        let mut prev_token = Token::Start;
        let mut i = 0;
        while i < bytes.len() {
            let b = bytes[i];
            if !WORD_BYTE[usize::from(b)] {
                match b {
                    b'\n' => shape.lines += 1,
                    b'.' | b'!' | b'?' => {
                        let next = bytes.get(i + 1).copied().unwrap_or(b' ');
                        shape.sentences += u32::from(next.is_ascii_whitespace());
                    }
                    _ => {}
                }
                i += 1;
                continue;
            }
            let start = i;
            let mut hash = FNV_OFFSET;
            let mut digits = true;
            let mut key = 0;
            while i < bytes.len() && WORD_BYTE[usize::from(bytes[i])] {
                let c = bytes[i].to_ascii_lowercase();
                digits &= c.is_ascii_digit();
                hash = (hash ^ u64::from(c)).wrapping_mul(FNV_PRIME);
                key = lexicon::push(key, i - start, c);
                i += 1;
            }
            match lexicon::lookup(key) {
                Some(Domain::Code) => shape.code_terms += 1,
                Some(Domain::Science) => shape.science_terms += 1,
                // The outcome head's vocabularies are not the classifier's inputs.
                _ => {}
            }
            let token = if digits { NUM } else { hash };
            let (uni, bi) = if with_text {
                let word = match digits {
                    true => Token::Number,
                    false => Token::Word(&bytes[start..i]),
                };
                let grams = (Gram::Unigram(word), Gram::Bigram(prev_token, word));
                prev_token = word;
                (Some(grams.0), Some(grams.1))
            } else {
                (None, None)
            };
            f(bucket(token, 0), uni);
            f(bucket(prev.rotate_left(23) ^ token, BIGRAM_SALT), bi);
            shape.grams += 2;
            prev = token;
        }
        if let Some(&last) = bytes.iter().rev().find(|b| !b.is_ascii_whitespace()) {
            shape.last = last;
        }
    });
    shape
}

/// The dense inputs of a prompt, each in [0,1].
pub(crate) fn dense(features: &Features, shape: &Shape) -> [f32; DENSE] {
    let capped = |n: u32, cap: u32| n.min(cap) as f32 / cap as f32;
    [
        features.entropy as f32,
        features.lexical as f32,
        features.code as f32,
        features.math as f32,
        features.json as f32,
        features.numeric as f32,
        features.length as f32,
        f32::from(u8::from(shape.last == b'?')),
        capped(shape.lines, 10),
        capped(shape.sentences, 10),
        capped(shape.code_terms, 3),
        capped(shape.science_terms, 3),
    ]
}

// === impl Token ===

impl Token<'_> {
    /// The token as explain shows it.
    pub(crate) fn text(&self) -> String {
        match self {
            Token::Start => "<start>".into(),
            Token::Number => "<num>".into(),
            Token::Word(w) => String::from_utf8_lossy(w).to_lowercase(),
        }
    }
}

impl Gram<'_> {
    pub(crate) fn text(&self) -> String {
        match self {
            Gram::Unigram(t) => t.text(),
            Gram::Bigram(a, b) => format!("{} {}", a.text(), b.text()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::features::{Role, Segment};

    fn prompt(text: &str) -> Prompt<'_> {
        Prompt {
            segments: vec![Segment {
                role: Role::User,
                text,
            }],
            wants_json: false,
        }
    }

    fn grams(text: &str) -> Vec<(u32, String)> {
        let mut out = Vec::new();
        let p = prompt(text);
        for_each_gram(
            &p,
            4096,
            16,
            |b, g| out.push((b, g.map(|g| g.text()).unwrap_or_default())),
            true,
        );
        out
    }

    #[test]
    fn words_are_lowercased_numbers_are_one_token_and_each_part_starts_fresh() {
        let a = grams("Write 246 cards");
        let texts: Vec<&str> = a.iter().map(|(_, t)| t.as_str()).collect();
        assert_eq!(
            texts,
            [
                "write",
                "<start> write",
                "<num>",
                "write <num>",
                "cards",
                "<num> cards"
            ]
        );
        let b = grams("WRITE 13 Cards");
        assert_eq!(
            a.iter().map(|g| g.0).collect::<Vec<_>>(),
            b.iter().map(|g| g.0).collect::<Vec<_>>()
        );
    }

    #[test]
    fn buckets_fit_the_table_and_text_is_optional() {
        let p = prompt("Prove that the square root of two is irrational?");
        let mut with = Vec::new();
        let mut without = Vec::new();
        let shape = for_each_gram(&p, 4096, 10, |b, _| with.push(b), true);
        for_each_gram(&p, 4096, 10, |b, g| without.push((b, g)), false);
        assert!(with.iter().all(|&b| b < 1024));
        assert_eq!(with, without.iter().map(|g| g.0).collect::<Vec<_>>());
        assert!(without.iter().all(|g| g.1.is_none()));
        assert_eq!(shape.grams as usize, with.len());
        assert_eq!(shape.last, b'?');
    }

    #[test]
    fn shape_counts_lines_and_sentences() {
        let p = prompt("One. Two!\nThree? 3.5 is a number\n");
        let shape = for_each_gram(&p, 4096, 12, |_, _| {}, false);
        assert_eq!(shape.lines, 2);
        assert_eq!(shape.sentences, 3);
        assert_eq!(shape.last, b'r');
    }
}
