//! Vocabularies: programming words and science and mathematics words, which the classifier
//! counts as dense inputs, and the words the outcome head reads a request's kind of ask by
//! (write, explain, fix, solve, rewrite, advise; a story or poem), its constraints, steps,
//! and the length and format of the answer it asks for.
//!
//! A bag of n-grams learns only the words its training data happen to use. These lists
//! carry what any reader knows — that "JavaScript", "dataframe" or "recursion" ask for
//! code, and "wavelength" or "irrational" for science — to prompts from sources the data
//! never covered. They are generic vocabularies, not words picked from the data set.
//! Words match on their first eight bytes, lowercased, so "accelerat" covers
//! "accelerates" and "acceleration".

use crate::features::cues::key;

/// Which vocabulary a word belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Domain {
    Code = 1,
    Science,
    /// Asks for something to be made: "write", "create", "build".
    Create,
    /// Asks why or how: "explain", "describe", "compare".
    Explain,
    /// Something is broken: "fix", "error", "traceback".
    Fix,
    /// A problem to work out: "solve", "calculate", "riddle".
    Solve,
    /// Reworks given text: "rewrite", "summarize", "translate".
    Transform,
    /// Asks for a recommendation: "suggest", "recommend", "tips".
    Advice,
    /// Fiction and verse: "story", "poem", "character", "roleplay".
    Creative,
    /// A requirement on the answer: "must", "without", "exactly", "don't".
    Constraint,
    /// Parts in sequence: "first", "then", "finally", "step".
    Steps,
    /// Asks for a short answer: "brief", "concise", "simply".
    Short,
    /// Asks for a long answer: "detailed", "comprehensive", "examples".
    Long,
    /// Asks for a layout: "table", "bullets", "markdown", "list".
    Format,
}

/// Every domain, indexed by its discriminant less one.
const DOMAINS: [Domain; 14] = [
    Domain::Code,
    Domain::Science,
    Domain::Create,
    Domain::Explain,
    Domain::Fix,
    Domain::Solve,
    Domain::Transform,
    Domain::Advice,
    Domain::Creative,
    Domain::Constraint,
    Domain::Steps,
    Domain::Short,
    Domain::Long,
    Domain::Format,
];

const CODE: &[&[u8]] = &[
    // Languages, formats and tools.
    b"python",
    b"java",
    b"javascri",
    b"typescri",
    b"ruby",
    b"php",
    b"perl",
    b"rust",
    b"golang",
    b"kotlin",
    b"swift",
    b"scala",
    b"haskell",
    b"matlab",
    b"fortran",
    b"cobol",
    b"html",
    b"css",
    b"sql",
    b"mysql",
    b"postgres",
    b"sqlite",
    b"mongodb",
    b"json",
    b"xml",
    b"yaml",
    b"regex",
    b"bash",
    b"shell",
    b"powershe",
    b"django",
    b"flask",
    b"react",
    b"angular",
    b"nodejs",
    b"jquery",
    b"pandas",
    b"numpy",
    b"tensorfl",
    b"pytorch",
    b"docker",
    b"git",
    b"linux",
    b"unix",
    b"api",
    b"http",
    b"url",
    b"cpp",
    b"csharp",
    // Constructs and concepts.
    b"function",
    b"method",
    b"methods",
    b"class",
    b"classes",
    b"object",
    b"objects",
    b"array",
    b"arrays",
    b"string",
    b"strings",
    b"substrin",
    b"integer",
    b"integers",
    b"boolean",
    b"variable",
    b"variables",
    b"loop",
    b"loops",
    b"recursio",
    b"recursiv",
    b"algorith",
    b"compile",
    b"compiler",
    b"debug",
    b"syntax",
    b"script",
    b"scripts",
    b"program",
    b"programs",
    b"programm",
    b"code",
    b"snippet",
    b"database",
    b"query",
    b"queries",
    b"datafram",
    b"dictiona",
    b"tuple",
    b"tuples",
    b"hashmap",
    b"stack",
    b"queue",
    b"linked",
    b"pointer",
    b"struct",
    b"interfac",
    b"inherita",
    b"construc",
    b"exceptio",
    b"paramete",
    b"argument",
    b"lambda",
    b"iterate",
    b"iterator",
    b"iteratio",
    b"sorting",
    b"implemen",
    b"refactor",
    b"runtime",
    b"endpoint",
    b"thread",
    b"threads",
    b"async",
    b"callback",
    b"binary",
    b"bitwise",
    b"null",
    b"regexp",
    b"html5",
    b"frontend",
    b"backend",
];

const SCIENCE: &[&[u8]] = &[
    // Physics.
    b"physics",
    b"velocity",
    b"accelera",
    b"force",
    b"forces",
    b"mass",
    b"energy",
    b"momentum",
    b"friction",
    b"gravity",
    b"gravitat",
    b"electric",
    b"magnetic",
    b"voltage",
    b"resistan",
    b"circuit",
    b"waveleng",
    b"frequenc",
    b"photon",
    b"electron",
    b"proton",
    b"neutron",
    b"nucleus",
    b"quantum",
    b"orbit",
    b"lens",
    b"refracti",
    b"density",
    b"kinetic",
    b"inertia",
    b"torque",
    b"pressure",
    b"tempera",
    b"thermody",
    b"entropy",
    b"radiatio",
    b"particle",
    b"oscillat",
    b"pendulum",
    b"projecti",
    // Chemistry and biology.
    b"chemical",
    b"chemistr",
    b"molecule",
    b"molecula",
    b"atom",
    b"atoms",
    b"atomic",
    b"reaction",
    b"acid",
    b"oxidatio",
    b"equilibr",
    b"isotope",
    b"compound",
    b"enzyme",
    b"protein",
    b"genetic",
    b"dna",
    b"species",
    // Mathematics and statistics.
    b"theorem",
    b"prove",
    b"proof",
    b"lemma",
    b"derivati",
    b"integral",
    b"matrix",
    b"vector",
    b"eigenval",
    b"polynomi",
    b"equation",
    b"equations",
    b"irration",
    b"rational",
    b"prime",
    b"divisibl",
    b"factoria",
    b"logarith",
    b"exponent",
    b"geometry",
    b"triangle",
    b"angle",
    b"radius",
    b"circle",
    b"perimete",
    b"probabil",
    b"variance",
    b"deviatio",
    b"statisti",
    b"hypothes",
    b"regressi",
    b"coeffici",
    b"converge",
    b"infinite",
    b"infinity",
    b"modulo",
    b"algebra",
    b"calculus",
    b"sqrt",
    b"square",
    b"root",
];

// The outcome head's vocabularies: what kind of answer a request asks for. Words already in
// the lists above keep their domain ("debug" is code, "prove" science).

const CREATE: &[&[u8]] = &[
    b"write",
    b"writes",
    b"writing",
    b"create",
    b"creates",
    b"creating",
    b"generate",
    b"generati",
    b"make",
    b"build",
    b"design",
    b"develop",
    b"compose",
    b"draft",
    b"craft",
    b"produce",
];

const EXPLAIN: &[&[u8]] = &[
    b"explain",
    b"explains",
    b"explanat",
    b"describe",
    b"descript",
    b"why",
    b"differen",
    b"compare",
    b"comparis",
    b"meaning",
    b"means",
    b"elaborat",
    b"understa",
    b"discuss",
    b"clarify",
    b"interpre",
    b"analyze",
    b"analyse",
    b"analysis",
];

const FIX: &[&[u8]] = &[
    b"fix",
    b"fixes",
    b"fixing",
    b"fixed",
    b"error",
    b"errors",
    b"bug",
    b"bugs",
    b"buggy",
    b"tracebac",
    b"crash",
    b"crashes",
    b"crashed",
    b"fails",
    b"failed",
    b"failing",
    b"failure",
    b"broken",
    b"warning",
    b"wrong",
    b"troubles",
];

const SOLVE: &[&[u8]] = &[
    b"solve",
    b"solves",
    b"solving",
    b"solution",
    b"calculat",
    b"compute",
    b"computes",
    b"computin",
    b"derive",
    b"find",
    b"determin",
    b"evaluate",
    b"evaluati",
    b"simplify",
    b"estimate",
    b"optimize",
    b"optimise",
    b"minimize",
    b"maximize",
    b"optimal",
    b"puzzle",
    b"riddle",
    b"logic",
    b"logical",
];

const TRANSFORM: &[&[u8]] = &[
    b"rewrite",
    b"rephrase",
    b"paraphra",
    b"summariz",
    b"summaris",
    b"summary",
    b"translat",
    b"proofrea",
    b"correct",
    b"edit",
    b"improve",
    b"shorten",
    b"convert",
    b"extract",
    b"classify",
    b"reword",
    b"polish",
];

const ADVICE: &[&[u8]] = &[
    b"recommen",
    b"suggest",
    b"suggesti",
    b"advice",
    b"advise",
    b"tips",
    b"ideas",
    b"idea",
    b"opinion",
    b"plan",
    b"planning",
    b"best",
    b"pros",
    b"cons",
];

const CREATIVE: &[&[u8]] = &[
    b"story",
    b"stories",
    b"poem",
    b"poems",
    b"poetry",
    b"song",
    b"lyrics",
    b"essay",
    b"novel",
    b"fiction",
    b"fictiona",
    b"characte",
    b"roleplay",
    b"role",
    b"imagine",
    b"pretend",
    b"joke",
    b"jokes",
    b"haiku",
    b"fantasy",
    b"dialogue",
    b"scene",
    b"tale",
    b"narrativ",
    b"persona",
    b"rap",
    b"sonnet",
    b"limerick",
    b"creative",
    b"funny",
    b"humor",
    b"humorous",
];

const CONSTRAINT: &[&[u8]] = &[
    b"must",
    b"without",
    b"only",
    b"exactly",
    b"ensure",
    b"require",
    b"required",
    b"requirem",
    b"requires",
    b"avoid",
    b"strictly",
    b"limit",
    b"limited",
    b"maximum",
    b"minimum",
    b"should",
    b"always",
    b"don",
    b"doesn",
    b"mustn",
    b"shouldn",
    b"specific",
    b"constrai",
];

const STEPS: &[&[u8]] = &[
    b"also",
    b"then",
    b"first",
    b"second",
    b"third",
    b"finally",
    b"next",
    b"step",
    b"steps",
    b"part",
    b"parts",
    b"afterwar",
    b"furtherm",
    b"moreover",
    b"lastly",
    b"stage",
];

const SHORT: &[&[u8]] = &[
    b"brief",
    b"briefly",
    b"short",
    b"shorter",
    b"concise",
    b"concisel",
    b"quick",
    b"quickly",
    b"simple",
    b"simply",
    b"tldr",
    b"succinct",
];

const LONG: &[&[u8]] = &[
    b"detailed",
    b"detail",
    b"details",
    b"comprehe",
    b"thorough",
    b"extensiv",
    b"complete",
    b"full",
    b"depth",
    b"words",
    b"pages",
    b"paragrap",
    b"examples",
    b"example",
    b"long",
    b"lengthy",
];

const FORMAT: &[&[u8]] = &[
    b"table",
    b"tables",
    b"bullet",
    b"bullets",
    b"markdown",
    b"format",
    b"formatte",
    b"outline",
    b"diagram",
    b"chart",
    b"template",
    b"headings",
    b"heading",
    b"columns",
    b"column",
    b"list",
];

const SLOT_BITS: u32 = 11;
const SLOTS: usize = 1 << SLOT_BITS;

const fn slot(key: u64) -> usize {
    (key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - SLOT_BITS)) as usize
}

/// Open addressing with linear probing: keys (0 = empty) and their domains.
static TABLE: ([u64; SLOTS], [u8; SLOTS]) = {
    let mut keys = [0u64; SLOTS];
    let mut domains = [0u8; SLOTS];
    let lists: [(&[&[u8]], Domain); DOMAINS.len()] = [
        (CODE, Domain::Code),
        (SCIENCE, Domain::Science),
        (CREATE, Domain::Create),
        (EXPLAIN, Domain::Explain),
        (FIX, Domain::Fix),
        (SOLVE, Domain::Solve),
        (TRANSFORM, Domain::Transform),
        (ADVICE, Domain::Advice),
        (CREATIVE, Domain::Creative),
        (CONSTRAINT, Domain::Constraint),
        (STEPS, Domain::Steps),
        (SHORT, Domain::Short),
        (LONG, Domain::Long),
        (FORMAT, Domain::Format),
    ];
    let mut l = 0;
    while l < lists.len() {
        let (words, domain) = lists[l];
        let mut w = 0;
        while w < words.len() {
            let k = key(words[w]);
            let mut i = slot(k);
            while keys[i] != 0 && keys[i] != k {
                i = (i + 1) % SLOTS;
            }
            // A word in two lists would silently take the last one's domain.
            assert!(
                keys[i] == 0 || domains[i] == domain as u8,
                "a word is in two lists"
            );
            keys[i] = k;
            domains[i] = domain as u8;
            w += 1;
        }
        l += 1;
    }
    (keys, domains)
};

/// The domain of a word's key, if it has one.
pub(crate) fn lookup(key: u64) -> Option<Domain> {
    let (keys, domains) = &TABLE;
    let mut i = slot(key);
    while keys[i] != 0 {
        if keys[i] == key {
            return DOMAINS
                .get(usize::from(domains[i]).wrapping_sub(1))
                .copied();
        }
        i = (i + 1) % SLOTS;
    }
    None
}

/// Accumulates the key of a word one lowercased byte at a time.
pub(crate) fn push(key: u64, len: usize, byte: u8) -> u64 {
    if len < 8 {
        key | u64::from(byte) << (8 * len)
    } else {
        key
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn word(w: &str) -> Option<Domain> {
        let k = w
            .bytes()
            .enumerate()
            .fold(0, |k, (i, b)| push(k, i, b.to_ascii_lowercase()));
        lookup(k)
    }

    #[test]
    fn words_match_on_their_first_eight_bytes() {
        assert_eq!(word("JavaScript"), Some(Domain::Code));
        assert_eq!(word("recursion"), Some(Domain::Code));
        assert_eq!(word("accelerates"), Some(Domain::Science));
        assert_eq!(word("irrational"), Some(Domain::Science));
        assert_eq!(word("the"), None);
        assert_eq!(word("weather"), None);
        assert_eq!(lookup(0), None);
    }
}
