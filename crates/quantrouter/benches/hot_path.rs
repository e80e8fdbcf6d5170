//! Instruction counts of the proxy's per-request work that is not I/O: parse the body, classify
//! and decide,
//! rewrite `model` into the upstream body. Stable on a noisy machine, so a regression shows
//! up as a number.
//!
//! ```sh
//! cargo bench -p quantrouter --bench hot_path --no-run
//! valgrind --tool=callgrind --callgrind-out-file=hot_path.out \
//!     target/release/deps/hot_path-<hash> chat-short
//! callgrind_annotate hot_path.out | head -40
//! ```
//!
//! Run directly it just executes `ITERATIONS` requests of the named kind (`chat-short`: a
//! 60-byte chat prompt; `chat-4k`: a 4 KB one; `stream`: a short streamed chat request without
//! `stream_options`, which the router rewrites twice) and prints the total instructions'
//! denominator, so callgrind's total / ITERATIONS is the cost of one request. Two kinds are
//! a stream's events instead, `ITERATIONS` vLLM token chunks each: `events-passed`, what the
//! reader does to every event once the first output passed, and `events-resumable`, that and
//! what a stream that may be resumed adds (`policy.stream_resume`: whole events, the text kept).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::hint::black_box;

use bytes::Bytes;
use http::HeaderMap;
use quantrouter::openai::{BodyEdits, Endpoint, ParsedRequest};
use quantrouter::profiles::{Snapshot, SourceKind};
use quantrouter::resilience::ResilienceConfig;
use quantrouter::routing::{route, RouteInput};
use quantrouter::upstream::continuation::Delivered;
use quantrouter::upstream::sse::{EventBuffer, EventScan};
use quantrouter_policy::{Classifier, ProfileSet, DEFAULT_PROFILE_SET};

const ITERATIONS: usize = 1000;

fn body(kind: &str) -> Bytes {
    let (prompt, stream) = match kind {
        "chat-short" => (
            "What is the capital of France? Answer in one word.".to_owned(),
            false,
        ),
        "chat-4k" => {
            let unit = "Summarise the quarterly report: revenue grew 12% to $4.2M while costs \
                        fell. Then write a Python function `def growth(a, b): return (b - a) / a` \
                        and explain it. ";
            (unit.repeat(4096 / unit.len() + 1)[..4096].to_owned(), false)
        }
        "stream" => ("Write a haiku about routers.".to_owned(), true),
        other => panic!("unknown kind {other}: chat-short, chat-4k or stream"),
    };
    let value = serde_json::json!({
        "model": "auto",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": prompt},
        ],
        "max_tokens": 64,
        "temperature": 0.7,
        "stream": stream,
    });
    Bytes::from(serde_json::to_vec(&value).unwrap())
}

/// One request's non-I/O work, as the server does it.
fn handle(
    snapshot: &Snapshot,
    classifier: &Classifier,
    headers: &HeaderMap,
    body: &Bytes,
) -> Bytes {
    let parsed = ParsedRequest::parse(body, Endpoint::Chat).unwrap();
    let input = RouteInput {
        classifier: Some(classifier),
        headers,
        aliases: &[],
        request_key: "bench-request",
        tenant: None,
        rating: None,
        among: None,
    };
    let routed = route(snapshot, &parsed, input).unwrap();
    let profile = routed.decision.profile;
    let edits = BodyEdits {
        cache_salt: routed.cache_salt.as_deref(),
        ..BodyEdits::default()
    };
    parsed.upstream_body(body, &snapshot.runtime[profile].model_json, edits)
}

/// `ITERATIONS` token chunks of a stream through the per-event work of its body.
fn events(resumable: bool) {
    let chunk = Bytes::from_static(
        b"data: {\"id\":\"chatcmpl-9f1c\",\"object\":\"chat.completion.chunk\",\"created\":1795900000,\"model\":\"meta-llama/Llama-3.1-8B-Instruct\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" token\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n",
    );
    let mut scan = EventScan::new(true);
    let mut buffer = EventBuffer::default();
    let mut delivered = Delivered::default();
    for _ in 0..ITERATIONS {
        if resumable {
            buffer.push(black_box(&chunk));
            while let Some(event) = buffer.next_event() {
                black_box(delivered.observe(&event));
                black_box(scan.feed(event));
            }
        } else {
            black_box(scan.feed(black_box(chunk.clone())));
        }
    }
}

fn main() {
    let kind = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "chat-short".to_owned());
    if let Some(resumable) = match kind.as_str() {
        "events-passed" => Some(false),
        "events-resumable" => Some(true),
        _ => None,
    } {
        events(resumable);
        println!("{kind}: {ITERATIONS} events");
        return;
    }
    let set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
    let snapshot = Snapshot::build(
        set,
        SourceKind::Embedded,
        None,
        &ResilienceConfig::default(),
        None,
    );
    let classifier = Classifier::builtin().unwrap();
    let headers = HeaderMap::new();
    let body = body(&kind);
    for _ in 0..ITERATIONS {
        black_box(handle(
            &snapshot,
            &classifier,
            black_box(&headers),
            black_box(&body),
        ));
    }
    println!("{kind}: {ITERATIONS} requests");
}
