//! Fixed tables the generator draws from: facts with one uncontested short answer, and
//! made-up names and values for the extraction and reasoning items.

/// Countries and capitals whose spelling in English has no accent or common variant.
pub(super) const CAPITALS: [(&str, &str); 30] = [
    ("France", "Paris"),
    ("Germany", "Berlin"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Portugal", "Lisbon"),
    ("Japan", "Tokyo"),
    ("Canada", "Ottawa"),
    ("Australia", "Canberra"),
    ("Egypt", "Cairo"),
    ("Kenya", "Nairobi"),
    ("Russia", "Moscow"),
    ("Norway", "Oslo"),
    ("Sweden", "Stockholm"),
    ("Finland", "Helsinki"),
    ("Denmark", "Copenhagen"),
    ("Poland", "Warsaw"),
    ("Greece", "Athens"),
    ("Turkey", "Ankara"),
    ("Ireland", "Dublin"),
    ("Austria", "Vienna"),
    ("Hungary", "Budapest"),
    ("the Czech Republic", "Prague"),
    ("South Korea", "Seoul"),
    ("Thailand", "Bangkok"),
    ("Vietnam", "Hanoi"),
    ("Peru", "Lima"),
    ("Cuba", "Havana"),
    ("Ghana", "Accra"),
    ("the Philippines", "Manila"),
    ("New Zealand", "Wellington"),
];

/// Chemical symbols and the element's English name.
pub(super) const ELEMENTS: [(&str, &str); 15] = [
    ("Fe", "iron"),
    ("Au", "gold"),
    ("Ag", "silver"),
    ("Na", "sodium"),
    ("K", "potassium"),
    ("Pb", "lead"),
    ("Cu", "copper"),
    ("Hg", "mercury"),
    ("Sn", "tin"),
    ("O", "oxygen"),
    ("H", "hydrogen"),
    ("He", "helium"),
    ("C", "carbon"),
    ("N", "nitrogen"),
    ("Ca", "calcium"),
];

/// Short factual questions; every accepted answer is listed.
pub(super) const TRIVIA: [(&str, &[&str]); 15] = [
    ("Which planet is known as the Red Planet?", &["Mars"]),
    (
        "What is the largest planet in the solar system?",
        &["Jupiter"],
    ),
    ("Which planet is closest to the Sun?", &["Mercury"]),
    ("Who wrote the play Romeo and Juliet?", &["Shakespeare"]),
    ("Who painted the Mona Lisa?", &["Leonardo", "da Vinci"]),
    ("What is the largest ocean on Earth?", &["Pacific"]),
    ("What is the highest mountain on Earth?", &["Everest"]),
    (
        "Which gas do plants take in from the air for photosynthesis?",
        &["carbon dioxide", "CO2"],
    ),
    ("What is the hardest natural substance?", &["diamond"]),
    (
        "What is the main language spoken in Brazil?",
        &["Portuguese"],
    ),
    ("What is the currency of Japan?", &["yen"]),
    (
        "Who was the first person to walk on the Moon?",
        &["Armstrong"],
    ),
    ("Who wrote the novel Nineteen Eighty-Four?", &["Orwell"]),
    ("What is the fastest land animal?", &["cheetah"]),
    ("What is the largest mammal?", &["blue whale"]),
];

pub(super) const FIRST_NAMES: [&str; 16] = [
    "Maria", "Ahmed", "Chen", "Olivia", "Kofi", "Ingrid", "Rahul", "Sofia", "Tomas", "Yuki",
    "Amara", "Lucas", "Priya", "Mateo", "Hana", "Jonas",
];

pub(super) const LAST_NAMES: [&str; 12] = [
    "Lopez", "Okafor", "Nakamura", "Schmidt", "Haddad", "Novak", "Silva", "Kowalski", "Dubois",
    "Larsen", "Moreau", "Petrov",
];

pub(super) const CITIES: [&str; 12] = [
    "Lisbon", "Toronto", "Osaka", "Nairobi", "Krakow", "Lyon", "Porto", "Bergen", "Seville",
    "Leeds", "Graz", "Tampere",
];

pub(super) const JOBS: [&str; 8] = [
    "nurse",
    "engineer",
    "teacher",
    "baker",
    "pilot",
    "chemist",
    "carpenter",
    "librarian",
];

pub(super) const PRODUCTS: [&str; 10] = [
    "desk lamp",
    "coffee grinder",
    "backpack",
    "kettle",
    "bike helmet",
    "phone case",
    "yoga mat",
    "water bottle",
    "notebook",
    "headphones",
];

pub(super) const EVENTS: [&str; 8] = [
    "board meeting",
    "book club",
    "product launch",
    "team offsite",
    "charity run",
    "code review",
    "science fair",
    "wedding rehearsal",
];

pub(super) const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

pub(super) const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// Made-up plural nouns for syllogisms, so no item can be answered from world knowledge.
pub(super) const NONSENSE: [&str; 12] = [
    "bloops", "razzies", "lazzies", "florps", "wumps", "grindles", "zorbs", "plinks", "quibs",
    "snarfs", "tovs", "vexels",
];

/// Words for the string-manipulation code items.
pub(super) const CODE_WORDS: [&str; 12] = [
    "router", "kernel", "socket", "matrix", "python", "buffer", "thread", "vector", "cursor",
    "lambda", "tensor", "packet",
];
