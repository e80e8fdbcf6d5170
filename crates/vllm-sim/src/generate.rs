//! Deterministic answer text: a digest of the prompt, mixed with the simulator's seed, seeds a
//! tiny PRNG that picks words from a fixed vocabulary. Each word is one token.

use serde::Serialize;

/// Words the simulator "generates"; 64 entries so picking one is a cheap modulo.
const VOCAB: [&str; 64] = [
    "the",
    "model",
    "answer",
    "is",
    "a",
    "of",
    "to",
    "and",
    "in",
    "that",
    "for",
    "with",
    "as",
    "on",
    "this",
    "by",
    "quantized",
    "router",
    "token",
    "latency",
    "profile",
    "tier",
    "request",
    "cost",
    "quality",
    "value",
    "result",
    "system",
    "data",
    "function",
    "returns",
    "because",
    "each",
    "when",
    "then",
    "more",
    "less",
    "fast",
    "slow",
    "simple",
    "complex",
    "number",
    "code",
    "math",
    "json",
    "text",
    "prompt",
    "cache",
    "batch",
    "queue",
    "server",
    "client",
    "stream",
    "chunk",
    "time",
    "first",
    "next",
    "last",
    "best",
    "good",
    "small",
    "large",
    "here",
    "done",
];

/// The word a degenerate answer repeats, so quality checks see a maximal repetition ratio.
const DEGENERATE_WORD: &str = "the";

/// Bounds of the answer length a prompt "naturally" produces, before `max_tokens` caps it:
/// long enough to stream several chunks, short enough to keep tests fast.
const MIN_NATURAL_TOKENS: u64 = 8;
const MAX_NATURAL_TOKENS: u64 = 48;

const FNV_OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// splitmix64: tiny, fast and good enough to pick words; no `rand` dependency needed.
#[derive(Debug, Clone)]
pub(crate) struct SplitMix64 {
    state: u64,
}

/// A running hash and size of a prompt's text, fed piece by piece while parsing the request.
#[derive(Debug, Clone)]
pub(crate) struct PromptDigest {
    hash: u64,
    chars: u64,
    /// Prompt tokens counted exactly, not estimated from characters.
    tokens: u64,
}

/// Why generation stopped, serialised as OpenAI's `finish_reason`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum FinishReason {
    /// The answer reached its natural end.
    Stop,
    /// `max_tokens` cut the answer short.
    Length,
    /// The answer is a tool call.
    #[serde(rename = "tool_calls")]
    ToolCalls,
}

/// The plan for one answer: how many tokens, why it ends, and where its words come from.
/// Words are produced lazily so streaming never holds the whole answer.
#[derive(Debug, Clone)]
pub(crate) struct Generation {
    words_seed: u64,
    tokens: u32,
    finish_reason: FinishReason,
    degenerate: bool,
    /// A known answer (to an eval-set prompt) instead of words from the vocabulary.
    fixed: Option<String>,
    /// Words of the answer already given (a continued message): they are not generated.
    skip: u32,
}

/// One token of an answer and the whitespace before it; the pieces concatenate to the text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Piece<'a> {
    pub(crate) sep: &'a str,
    pub(crate) word: &'a str,
}

/// The pieces of a [`Generation`], in order.
#[derive(Debug, Clone)]
pub(crate) struct Words<'a> {
    source: WordSource<'a>,
    remaining: u32,
    first: bool,
}

#[derive(Debug, Clone)]
enum WordSource<'a> {
    Vocab { rng: SplitMix64, degenerate: bool },
    Fixed { rest: &'a str },
}

// === impl SplitMix64 ===

impl SplitMix64 {
    pub(crate) fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

// === impl PromptDigest ===

impl PromptDigest {
    pub(crate) fn new() -> Self {
        Self {
            hash: FNV_OFFSET_BASIS,
            chars: 0,
            tokens: 0,
        }
    }

    /// The digest so far: stable for a given prompt, so per-prompt choices can hang off it.
    pub(crate) fn hash(&self) -> u64 {
        self.hash
    }

    /// Adds text that counts towards the prompt's token estimate.
    pub(crate) fn add_text(&mut self, text: &str) {
        self.mix(text.as_bytes());
        self.chars += text.chars().count() as u64;
    }

    /// Adds text that shapes the answer but is not counted as prompt tokens (e.g. a role), and
    /// separates pieces so `["ab", "c"]` and `["a", "bc"]` hash differently.
    pub(crate) fn add_marker(&mut self, marker: &str) {
        self.mix(marker.as_bytes());
        self.mix(&[0xff]);
    }

    /// Adds `tokens` to the prompt's count without shaping the answer: the words of a
    /// message the answer continues, one token each as the answer counted them.
    pub(crate) fn add_tokens(&mut self, tokens: u64) {
        self.tokens += tokens;
    }

    /// vLLM counts real tokenizer tokens; about four characters per token is the usual rule of
    /// thumb for English text, and every request has at least one token.
    pub(crate) fn prompt_tokens(&self) -> u64 {
        (self.chars / 4).max(1) + self.tokens
    }

    fn mix(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.hash ^= u64::from(b);
            self.hash = self.hash.wrapping_mul(FNV_PRIME);
        }
    }
}

// === impl Generation ===

impl Generation {
    /// Plans the answer to a prompt. `max_tokens` caps the natural length (finish reason
    /// `length`); with `ignore_eos` (a vLLM extension load tests use) the answer runs to exactly
    /// `max_tokens`.
    pub(crate) fn plan(
        digest: &PromptDigest,
        seed: u64,
        max_tokens: Option<u64>,
        ignore_eos: bool,
        degenerate: bool,
    ) -> Self {
        // Whiten the seed first so seeds 0 and 1 do not just flip one bit of the hash.
        let mut rng = SplitMix64::new(digest.hash ^ SplitMix64::new(seed).next_u64());
        let span = MAX_NATURAL_TOKENS - MIN_NATURAL_TOKENS + 1;
        let natural = MIN_NATURAL_TOKENS + rng.next_u64() % span;
        let (tokens, finish_reason) = match max_tokens {
            Some(cap) if cap < natural || (ignore_eos && cap != natural) => {
                (cap, FinishReason::Length)
            }
            _ => (natural, FinishReason::Stop),
        };
        Self {
            words_seed: rng.next_u64(),
            tokens: u32::try_from(tokens).unwrap_or(u32::MAX),
            finish_reason,
            degenerate,
            fixed: None,
            skip: 0,
        }
    }

    /// Plans a known answer: one token per whitespace-separated word, cut at `max_tokens`.
    pub(crate) fn fixed(text: String, max_tokens: Option<u64>) -> Self {
        let natural = text.split_whitespace().count() as u64;
        let (tokens, finish_reason) = match max_tokens {
            Some(cap) if cap < natural => (cap, FinishReason::Length),
            _ => (natural, FinishReason::Stop),
        };
        Self {
            words_seed: 0,
            tokens: u32::try_from(tokens).unwrap_or(u32::MAX),
            finish_reason,
            degenerate: false,
            fixed: Some(text),
            skip: 0,
        }
    }

    /// The rest of this answer after its first `words` words, which the request gave as the
    /// start of the message to continue. Plan it with `max_tokens` raised by `words`, so the
    /// two parts together are the uninterrupted answer.
    pub(crate) fn after(mut self, words: u32) -> Self {
        self.skip = words.min(self.tokens);
        self
    }

    /// Tokens to generate.
    pub(crate) fn tokens(&self) -> u32 {
        self.tokens - self.skip
    }

    pub(crate) fn finish_reason(&self) -> FinishReason {
        self.finish_reason
    }

    pub(crate) fn words(&self) -> Words<'_> {
        let source = match &self.fixed {
            Some(text) => WordSource::Fixed { rest: text },
            None => WordSource::Vocab {
                rng: SplitMix64::new(self.words_seed),
                degenerate: self.degenerate,
            },
        };
        let mut words = Words {
            source,
            remaining: self.tokens,
            first: true,
        };
        for _ in 0..self.skip {
            words.next();
        }
        words
    }

    /// The whole answer, exactly what the stream's deltas concatenate to.
    pub(crate) fn text(&self) -> String {
        let mut text = String::with_capacity(self.tokens() as usize * 8);
        for piece in self.words() {
            text.push_str(piece.sep);
            text.push_str(piece.word);
        }
        text
    }
}

// === impl Words ===

impl<'a> Iterator for Words<'a> {
    type Item = Piece<'a>;

    fn next(&mut self) -> Option<Piece<'a>> {
        if self.remaining == 0 {
            return None;
        }
        self.remaining -= 1;
        let sep = if std::mem::take(&mut self.first) {
            ""
        } else {
            " "
        };
        match &mut self.source {
            WordSource::Vocab {
                degenerate: true, ..
            } => Some(Piece {
                sep,
                word: DEGENERATE_WORD,
            }),
            WordSource::Vocab { rng, .. } => {
                let index = (rng.next_u64() % VOCAB.len() as u64) as usize;
                VOCAB.get(index).map(|&word| Piece { sep, word })
            }
            WordSource::Fixed { rest } => {
                let text: &'a str = rest;
                let start = text.find(|c: char| !c.is_whitespace())?;
                let end = text[start..]
                    .find(char::is_whitespace)
                    .map_or(text.len(), |n| start + n);
                *rest = &text[end..];
                Some(Piece {
                    sep: &text[..start],
                    word: &text[start..end],
                })
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.remaining as usize;
        (n, Some(n))
    }
}

/// A few words from the vocabulary, as a deterministic stand-in for a wrong answer.
pub(crate) fn filler(seed: u64, words: usize) -> String {
    let mut rng = SplitMix64::new(seed);
    let mut out = String::new();
    for i in 0..words {
        if i > 0 {
            out.push(' ');
        }
        let index = (rng.next_u64() % VOCAB.len() as u64) as usize;
        out.push_str(VOCAB.get(index).copied().unwrap_or(DEGENERATE_WORD));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(text: &str) -> PromptDigest {
        let mut d = PromptDigest::new();
        d.add_marker("user");
        d.add_text(text);
        d
    }

    #[test]
    fn same_prompt_and_seed_give_same_text() {
        let a = Generation::plan(&digest("hello"), 7, None, false, false);
        let b = Generation::plan(&digest("hello"), 7, None, false, false);
        assert_eq!(a.text(), b.text());
    }

    #[test]
    fn different_seeds_give_different_text() {
        let a = Generation::plan(&digest("hello"), 0, None, false, false);
        let b = Generation::plan(&digest("hello"), 1, None, false, false);
        assert_ne!(a.text(), b.text());
    }

    #[test]
    fn natural_length_stays_in_bounds_and_varies() {
        let lengths: Vec<u32> = (0..200)
            .map(|i| Generation::plan(&digest(&format!("prompt {i}")), 0, None, false, false))
            .map(|g| g.tokens())
            .collect();
        assert!(lengths.iter().all(|&n| (8..=48).contains(&n)));
        assert!(lengths.iter().any(|&n| n != lengths[0]));
    }

    #[test]
    fn max_tokens_caps_with_length_reason() {
        let g = Generation::plan(&digest("hello"), 0, Some(3), false, false);
        assert_eq!(g.tokens(), 3);
        assert_eq!(g.finish_reason(), FinishReason::Length);
        assert_eq!(g.text().split(' ').count(), 3);
        let big = Generation::plan(&digest("hello"), 0, Some(10_000), false, false);
        assert_eq!(big.finish_reason(), FinishReason::Stop);
    }

    #[test]
    fn ignore_eos_runs_to_max_tokens() {
        let g = Generation::plan(&digest("hello"), 0, Some(300), true, false);
        assert_eq!(g.tokens(), 300);
        assert_eq!(g.finish_reason(), FinishReason::Length);
    }

    #[test]
    fn degenerate_repeats_one_word() {
        let g = Generation::plan(&digest("hello"), 0, None, false, true);
        assert!(g.words().all(|p| p.word == DEGENERATE_WORD));
    }

    #[test]
    fn fixed_answers_keep_their_whitespace_and_stop_at_max_tokens() {
        let text = "```json\n{\"a\": 1,  \"b\": 2}\n```";
        let g = Generation::fixed(text.to_owned(), None);
        assert_eq!(g.text(), text);
        assert_eq!(g.tokens(), 6);
        assert_eq!(g.finish_reason(), FinishReason::Stop);
        let pieces: Vec<Piece<'_>> = g.words().collect();
        assert_eq!(
            pieces[1],
            Piece {
                sep: "\n",
                word: "{\"a\":"
            }
        );
        assert_eq!(
            pieces[2],
            Piece {
                sep: " ",
                word: "1,"
            }
        );
        assert_eq!(
            pieces[3],
            Piece {
                sep: "  ",
                word: "\"b\":"
            }
        );
        let cut = Generation::fixed(text.to_owned(), Some(2));
        assert_eq!(cut.text(), "```json\n{\"a\":");
        assert_eq!(cut.finish_reason(), FinishReason::Length);
    }

    #[test]
    fn prompt_tokens_are_a_quarter_of_chars_at_least_one() {
        assert_eq!(digest("").prompt_tokens(), 1);
        assert_eq!(digest("abcdefgh").prompt_tokens(), 2);
    }
}
