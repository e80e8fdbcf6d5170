//! Instruction counts of feature extraction + decision, stable on a noisy machine.
//!
//! `scripts/bench-instructions` runs this under `valgrind --tool=callgrind`; run directly it
//! just executes the workload: `ITERATIONS` decisions for each prompt size.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::hint::black_box;

use quantrouter_policy::{
    decide, Features, Overrides, ProfileSet, Prompt, Role, RouteRequest, Segment,
    DEFAULT_PROFILE_SET,
};

const ITERATIONS: usize = 1000;

fn main() {
    let set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
    let len: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(4096);
    let unit = "Summarise the quarterly report: revenue grew 12% to $4.2M while costs fell. \
                Then write a Python function `def growth(a, b): return (b - a) / a` and explain it. ";
    let text = unit.repeat(len / unit.len() + 1)[..len].to_owned();
    for _ in 0..ITERATIONS {
        let prompt = Prompt {
            segments: vec![Segment {
                role: Role::User,
                text: black_box(&text),
            }],
            wants_json: false,
        };
        let features = Features::extract(&prompt, &set.policy.complexity).unwrap();
        let req = RouteRequest {
            features: &features,
            max_tokens: Some(256),
            overrides: Overrides::default(),
            routing_key: "bench",
        };
        black_box(decide(&set, &req, &[]).unwrap());
    }
}
