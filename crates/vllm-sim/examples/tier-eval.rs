//! Writes the shipped tier eval set to stdout:
//! `cargo run -p vllm-sim --example tier-eval > eval/tier-eval.jsonl`.

use std::io::Write as _;

fn main() -> std::io::Result<()> {
    std::io::stdout().write_all(vllm_sim::tier_eval::jsonl().as_bytes())
}
