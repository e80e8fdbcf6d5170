//! Wall time per event of a stream's body on its way to the client, with and without
//! resumption (`policy.stream_resume`): the same vLLM token chunks, one per frame, through
//! [`UpstreamBody`] as the proxy builds it, once plain (`passed`, what `max_resumes: 0`
//! runs) and once resumable (`resumable`: whole events relayed, each looked at, the text
//! kept). Both are measured in one run, so their ratio holds on a noisy machine.
//!
//! ```sh
//! cargo bench -p quantrouter --bench stream_events
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use http_body_util::BodyExt;
use quantrouter::profiles::{PerToken, Snapshot, SourceKind};
use quantrouter::resilience::ResilienceConfig;
use quantrouter::upstream::body::{Asked, Broken, Resumable, Resume, Served};
use quantrouter::upstream::{Reading, TimeLimits, UpstreamBody, UpstreamIncoming};
use quantrouter_policy::{ProfileIndex, ProfileSet, DEFAULT_PROFILE_SET};
use tokio::time::Instant;

/// Token events per stream: an answer of a thousand tokens.
const EVENTS: usize = 1000;

const TOKEN: &[u8] = b"data: {\"id\":\"chatcmpl-9f1c\",\"object\":\"chat.completion.chunk\",\"created\":1795900000,\"model\":\"meta-llama/Llama-3.1-8B-Instruct\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" token\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n";
const FINISH: &[u8] = b"data: {\"id\":\"chatcmpl-9f1c\",\"object\":\"chat.completion.chunk\",\"created\":1795900000,\"model\":\"meta-llama/Llama-3.1-8B-Instruct\",\"choices\":[{\"index\":0,\"delta\":{},\"logprobs\":null,\"finish_reason\":\"length\"}]}\n\ndata: [DONE]\n\n";

/// A whole stream never breaks: the hook is never asked.
struct Unasked;

impl Resume for Unasked {
    fn resume(&self, _: Broken) -> Asked {
        panic!("a whole stream asked for a continuation")
    }

    fn refuse(&self, _: &Broken, _: &'static str) {
        panic!("a whole stream was refused a continuation")
    }
}

/// The stream's frames: a token each, then the finish and `[DONE]`.
fn frames() -> Vec<Bytes> {
    let mut frames = vec![Bytes::from_static(TOKEN); EVENTS];
    frames.push(Bytes::from_static(FINISH));
    frames
}

fn served() -> Served {
    let set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
    let prices = PerToken::of(&set.profiles[0]);
    let config = ResilienceConfig::default();
    let snapshot = Snapshot::build(set, SourceKind::Embedded, None, &config, None);
    let runtime = &snapshot.runtime[ProfileIndex::new(0)];
    Served {
        profile: ProfileIndex::new(0),
        endpoint: Arc::clone(&runtime.pool.endpoints()[0]),
        attempts: 1,
        telemetry: Arc::clone(&runtime.telemetry),
        prices,
    }
}

/// The body of `frames` as the proxy builds it for a stream, resumable or not.
fn body(frames: &[Bytes], resumable: Option<&Served>) -> UpstreamBody {
    let incoming =
        UpstreamIncoming::replaying(frames.to_vec(), UpstreamIncoming::buffered(Bytes::new()));
    let now = Instant::now();
    let idle = Duration::from_secs(60);
    let limits = TimeLimits {
        idle,
        deadline: now + Duration::from_secs(600),
        first_output_by: now + idle,
    };
    let reading = Reading {
        started: now,
        sse: true,
        strip_usage: false,
    };
    let resumable =
        resumable.map(|served| Resumable::new(Box::new(Unasked), served.clone(), 1, idle));
    UpstreamBody::new(incoming, None, limits, reading).resuming(resumable)
}

async fn drain(body: UpstreamBody) {
    let mut body = std::pin::pin!(body);
    while let Some(frame) = body.frame().await {
        black_box(frame.unwrap());
    }
}

fn stream_events(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let _guard = runtime.enter();
    let frames = frames();
    let served = served();
    let mut group = c.benchmark_group("stream_events");
    group.throughput(Throughput::Elements(EVENTS as u64));
    for (name, resumable) in [("passed", None), ("resumable", Some(&served))] {
        group.bench_function(name, |b| {
            b.iter_batched(
                || body(&frames, resumable),
                |body| runtime.block_on(drain(body)),
                BatchSize::SmallInput,
            );
        });
    }
    group.finish();
}

criterion_group!(benches, stream_events);
criterion_main!(benches);
