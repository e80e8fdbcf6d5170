//! Instruction counts of feature extraction + decision, stable on a noisy machine.
//!
//! Run under `valgrind --tool=callgrind` (see `docs/performance.md` for the commands); run
//! directly it just executes the workload: `ITERATIONS` decisions for one prompt size, with
//! the built-in classifier (`structural` as a second argument: the structural score alone).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::hint::black_box;

use quantrouter_policy::{Classifier, ProfileSet, DEFAULT_PROFILE_SET};

mod workload;

const ITERATIONS: usize = 1000;

fn main() {
    let set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
    let len: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(4096);
    let model = Classifier::builtin().unwrap();
    let classifier = match std::env::args().nth(2).as_deref() {
        Some("structural") => None,
        _ => Some(&model),
    };
    let text = workload::prompt_of(len);
    for _ in 0..ITERATIONS {
        black_box(workload::route(&set, classifier, black_box(&text)));
    }
}
