//! Feature extraction + decision per request, the policy's share of router overhead.
//!
//! `cargo bench -p quantrouter-policy --bench decide`

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use quantrouter_policy::{
    conversation_key, prefer_session, prefix_blocks, Classifier, KeyScope, ProfileIndex,
    ProfileSet, Prompt, Role, RoutingDecision, Segment, DEFAULT_PROFILE_SET,
};

mod workload;

use workload::{prompt_of, route};

/// The default set widened to `n` profiles with varied numbers.
fn set_with(n: usize) -> ProfileSet {
    let mut set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
    let base = set.profiles.clone();
    set.profiles = (0..n)
        .map(|i| {
            let mut p = base[i % base.len()].clone();
            p.id = format!("{}-{i}", p.id);
            p.cost_per_1m_output_tokens *= 1.0 + i as f64 / 10.0;
            p.latency.itl_ms += i as f64 * 0.1;
            p
        })
        .collect();
    set.default_profile = set.profiles[0].id.clone();
    set.validate().unwrap();
    set
}

fn features_and_decision(c: &mut Criterion) {
    let model = Classifier::builtin().unwrap();
    let mut group = c.benchmark_group("features_and_decision");
    for (scorer, classifier) in [("classifier", Some(&model)), ("structural", None)] {
        for profiles in [3, 20] {
            let set = set_with(profiles);
            for len in [200, 4 * 1024, 64 * 1024] {
                let text = prompt_of(len);
                group.throughput(Throughput::Bytes(len as u64));
                let id =
                    BenchmarkId::new(format!("{scorer}/{profiles}_profiles"), format!("{len}B"));
                group.bench_with_input(id, &text, |b, text| {
                    b.iter(|| black_box(route(&set, classifier, black_box(text))))
                });
            }
        }
    }
    // A multiple-choice question: the outcome head scores it by its trees, not a linear row.
    let question = "Which of the following is NOT a property of every group?\n\
                    A. closure\nB. associativity\nC. commutativity\nD. an identity element\n\
                    Answer:";
    let set = set_with(3);
    group.throughput(Throughput::Bytes(question.len() as u64));
    group.bench_function("classifier/3_profiles/choices_132B", |b| {
        b.iter(|| black_box(route(&set, Some(&model), black_box(question))))
    });
    group.finish();
}

/// What session and prefix affinity add to a decision at 4 KB, beside the same decision
/// without them in the same run: the prompt's block hashes, the conversation key and the
/// session preference (the per-endpoint table lookups happen at endpoint choice).
fn affinity(c: &mut Criterion) {
    let model = Classifier::builtin().unwrap();
    let set = set_with(3);
    let text = prompt_of(4 * 1024);
    let mut group = c.benchmark_group("affinity");
    group.throughput(Throughput::Bytes(text.len() as u64));
    group.bench_function("without/4096B", |b| {
        b.iter(|| black_box(route(&set, Some(&model), black_box(&text))))
    });
    group.bench_function("with/4096B", |b| {
        b.iter(|| {
            let mut decision = route(&set, Some(&model), black_box(&text));
            let work = affinity_work(KeyScope::NONE, &text, &mut decision, ProfileIndex::new(0));
            black_box((decision, work))
        })
    });
    // The added work alone: on a loaded machine the two runs above can drift apart by more
    // than the difference they are meant to show.
    let decision = route(&set, Some(&model), &text);
    group.bench_function("added/4096B", |b| {
        let mut decision = decision.clone();
        let session = decision.profile;
        b.iter(|| {
            black_box(affinity_work(
                KeyScope::NONE,
                &text,
                &mut decision,
                black_box(session),
            ))
        })
    });
    // The same for a tenant with `prefix_cache: "isolated"`, whose placement scope is also
    // derived from its `cache_salt` per request.
    let tenant = KeyScope::from_digest(&[7; 32]);
    let salt = "5f".repeat(32);
    group.bench_function("added_isolated/4096B", |b| {
        let mut decision = decision.clone();
        let session = decision.profile;
        b.iter(|| {
            let scope = tenant.salted(black_box(&salt));
            black_box(affinity_work(
                scope,
                &text,
                &mut decision,
                black_box(session),
            ))
        })
    });
    group.finish();
}

/// The prompt's block hashes and its conversation key within `scope`, and the session
/// preference.
fn affinity_work(
    scope: KeyScope,
    text: &str,
    decision: &mut RoutingDecision,
    session: ProfileIndex,
) -> (Vec<u64>, Option<u64>, bool) {
    let prompt = Prompt {
        segments: vec![Segment {
            role: Role::User,
            text: black_box(text),
        }],
        wants_json: false,
    };
    let blocks = prefix_blocks(scope, &prompt);
    let key = conversation_key(scope, Some("session-1"), None, &prompt).map(|c| c.key);
    (blocks, key, prefer_session(decision, session))
}

criterion_group!(benches, features_and_decision, affinity);
criterion_main!(benches);
