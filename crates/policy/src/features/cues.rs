//! Cue words: the vocabulary the scanner recognises, and a collision-free hash table built
//! at compile time so that looking a word up is one multiply, one load and one compare.

/// What a cue word signals; the discriminant indexes `Counts::cues` (0 = no cue).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum Cue {
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

/// Slots in `Counts::cues`: "no cue" plus one per `Cue`.
pub(super) const CUE_KINDS: usize = Cue::ManyMuch as usize + 1;

pub(super) const HOW: u64 = key(b"how");

/// The lookup key of a word: its first 8 bytes, lowercase, little-endian, zero padded.
pub(crate) const fn key(word: &[u8]) -> u64 {
    let mut bytes = [0u8; 8];
    let mut i = 0;
    while i < word.len() && i < 8 {
        bytes[i] = word[i];
        i += 1;
    }
    u64::from_le_bytes(bytes)
}

pub(super) const CUE_WORDS: &[(Cue, &[&[u8]])] = &[
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

#[cfg(test)]
const CUE_COUNT: usize = {
    let mut n = 0;
    let mut i = 0;
    while i < CUE_WORDS.len() {
        n += CUE_WORDS[i].1.len();
        i += 1;
    }
    n
};

/// log2 of the table size. 1024 slots for ~200 words: small enough to stay in L1.
const SLOT_BITS: u32 = 10;
const SLOTS: usize = 1 << SLOT_BITS;

/// A multiplier under which every cue word hashes to its own slot, so a lookup never
/// probes further: a slot holding another key means "no cue". Adding a cue word may make
/// two words collide; the table below then fails to compile. A new one is found by trying odd
/// 64-bit candidates (e.g. splitmix64 outputs `| 1`) until `slot(key(word), m)` differs for
/// every cue word: a few times 10^8 candidates, about a minute in a release build.
pub(super) const MULTIPLIER: u64 = 0xb52b_1953_edd5_3a9d;

pub(super) const fn slot(key: u64, multiplier: u64) -> usize {
    (key.wrapping_mul(multiplier) >> (64 - SLOT_BITS)) as usize
}

/// Keys by slot (0 = empty; no word has key 0) and, alongside, their `Cue` discriminants.
static TABLE: ([u64; SLOTS], [u8; SLOTS]) = {
    let mut keys = [0u64; SLOTS];
    let mut cues = [0u8; SLOTS];
    let mut g = 0;
    while g < CUE_WORDS.len() {
        let (cue, words) = CUE_WORDS[g];
        let mut w = 0;
        while w < words.len() {
            let k = key(words[w]);
            let i = slot(k, MULTIPLIER);
            assert!(
                keys[i] == 0,
                "two cue words share a slot: pick a new MULTIPLIER"
            );
            keys[i] = k;
            cues[i] = cue as u8;
            w += 1;
        }
        g += 1;
    }
    (keys, cues)
};

/// The `Cue` discriminant of a word key, 0 when it is no cue word. Branch-free: whether a
/// word is a cue is as unpredictable as the text.
pub(super) fn lookup(key: u64) -> u8 {
    let i = slot(key, MULTIPLIER);
    let (keys, cues) = &TABLE;
    // A mask rather than an `if`, which the compiler turns into a branch.
    cues[i] & u8::from(keys[i] == key).wrapping_neg()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_cue_word_has_its_own_slot() {
        let filled = TABLE.0.iter().filter(|&&k| k != 0).count();
        assert_eq!(filled, CUE_COUNT);
        assert_eq!(lookup(key(b"calculat")), Cue::Math as u8);
        assert_eq!(lookup(key(b"the")), Cue::Function as u8);
        assert_eq!(lookup(key(b"how")), Cue::Function as u8);
        assert_eq!(lookup(key(b"zebra")), 0);
        assert_eq!(lookup(0), 0, "an empty slot is no cue");
    }
}
