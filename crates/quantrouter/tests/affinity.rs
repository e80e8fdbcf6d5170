//! Cache-aware placement over real HTTP: a conversation's next turn goes to the endpoint
//! holding its prefix, unless a long prefill queued there would hold it longer than
//! computing it elsewhere; a hot prefix spreads once its endpoint is loaded; and a
//! conversation stays on its profile unless the new turn needs a better one.

mod support;

use std::time::Duration;

use serde_json::{json, Value};
use support::*;
use vllm_sim::SimConfig;

const INT4: usize = 2;

fn cached_sims(itl: Duration) -> impl Fn(usize) -> SimConfig {
    move |_| SimConfig {
        itl,
        prefix_cache_blocks: 4096,
        ..SimConfig::default()
    }
}

fn conversation(model: &str, system: &str, turns: &[&str], max_tokens: u32) -> String {
    let mut messages = vec![json!({"role": "system", "content": system})];
    for (i, turn) in turns.iter().enumerate() {
        if i > 0 {
            messages.push(json!({"role": "assistant", "content": "Sure, here you go."}));
        }
        messages.push(json!({"role": "user", "content": turn}));
    }
    json!({"model": model, "messages": messages, "max_tokens": max_tokens}).to_string()
}

/// Which of the tier's sims served requests since `before` (its request counts then).
fn served_by(tiers: &Tiers, before: &[u64]) -> Vec<usize> {
    tiers.sims[INT4]
        .iter()
        .zip(before)
        .enumerate()
        .filter(|(_, (sim, before))| sim.stats().requests > **before)
        .map(|(i, _)| i)
        .collect()
}

fn counts(tiers: &Tiers) -> Vec<u64> {
    tiers.sims[INT4]
        .iter()
        .map(|s| s.stats().requests)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follow_up_turn_lands_where_its_prefix_is() {
    let tiers = Tiers::start([1, 1, 4], cached_sims(Duration::ZERO), |_| {}, |_| {}).await;
    let model = &tiers.set.profiles[INT4].id;
    let questions = [
        "Where is my parcel?",
        "It was due on Monday.",
        "Can you refund it?",
    ];
    let mut homes = Vec::new();
    for c in 0..8 {
        let system = format!("Agent {c}: you answer questions about orders. ").repeat(12);
        let mut home = None;
        for turn in 1..=questions.len() {
            let before = counts(&tiers);
            let body = conversation(model, &system, &questions[..turn], 4);
            let reply = tiers.post(&body, &[]).await;
            assert_eq!(
                reply.status,
                200,
                "{}",
                String::from_utf8_lossy(&reply.body)
            );
            let [sim] = served_by(&tiers, &before)[..] else {
                panic!("one sim per request");
            };
            match home {
                None => {
                    assert_eq!(reply.header("x-quantrouter-affinity"), "none");
                    home = Some(sim);
                }
                Some(home) => {
                    assert_eq!(sim, home, "conversation {c} turn {turn} left its prefix");
                    assert_eq!(reply.header("x-quantrouter-affinity"), "prefix");
                }
            }
        }
        homes.extend(home);
    }
    // New conversations on an idle tier are spread, not all sent to one endpoint.
    homes.sort_unstable();
    homes.dedup();
    assert!(homes.len() > 1, "every conversation started on {homes:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_prefix_spreads_once_its_endpoint_is_loaded() {
    // Long enough answers that all requests are in flight together.
    let sims = cached_sims(Duration::from_millis(25));
    let tiers = Tiers::start([1, 1, 4], sims, |_| {}, |_| {}).await;
    let model = tiers.set.profiles[INT4].id.clone();
    let hot = "You are the help desk of a large retailer. Be precise. ".repeat(20);
    let tiers = std::sync::Arc::new(tiers);
    let requests: Vec<_> = (0..16)
        .map(|i| {
            let tiers = std::sync::Arc::clone(&tiers);
            let body = conversation(&model, &hot, &[&format!("Question {i}?")], 12);
            tokio::spawn(async move { tiers.post(&body, &[]).await.status })
        })
        .collect();
    for request in requests {
        assert_eq!(request.await.unwrap(), 200);
    }
    let served = counts(&tiers);
    let max = served.iter().copied().max().unwrap_or(0);
    // Mean 4; the bound lets the hot endpoint run half as many again, plus a race or two
    // between picks that read the same loads.
    assert!(
        served.iter().all(|&n| n > 0) && max <= 7,
        "a hot prefix piled up: {served:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_turn_avoids_a_long_prefill_queued_where_its_prefix_is() {
    // Prefill is the time that matters: 0.5 ms per uncached token, one stream per sim.
    let sims = |_| SimConfig {
        prefix_cache_blocks: 4096,
        prefill_per_token: Duration::from_micros(500),
        ..SimConfig::default()
    };
    let tiers = std::sync::Arc::new(Tiers::start([1, 1, 2], sims, |_| {}, |_| {}).await);
    let model = tiers.set.profiles[INT4].id.clone();
    let system = "You answer questions about one customer's orders. ".repeat(20);
    let before = counts(&tiers);
    let first = conversation(&model, &system, &["Where is my parcel?"], 4);
    assert_eq!(tiers.post(&first, &[]).await.status, 200);
    let [home] = served_by(&tiers, &before)[..] else {
        panic!("one sim per request");
    };
    // A branch of the conversation carrying a long document follows its prefix home,
    // where its ~4,500 new tokens keep the prefill stream busy for seconds.
    let document = "Order line, item, quantity, price, status. ".repeat(400);
    let long = conversation(&model, &system, &["Where is my parcel?", &document], 4);
    let before = counts(&tiers);
    let queued = {
        let tiers = std::sync::Arc::clone(&tiers);
        tokio::spawn(async move { tiers.post(&long, &[]).await })
    };
    let sent = eventually(Duration::from_secs(10), || {
        let tiers = std::sync::Arc::clone(&tiers);
        let before = before.clone();
        async move { !served_by(&tiers, &before).is_empty() }
    })
    .await;
    assert!(sent && served_by(&tiers, &before) == [home]);
    // The next short turn holds its prefix at home too, but computing its whole prompt on
    // the idle sim is sooner than waiting behind the document there.
    let before = counts(&tiers);
    let next = conversation(
        &model,
        &system,
        &["Where is my parcel?", "It was due on Monday."],
        4,
    );
    let reply = tiers.post(&next, &[]).await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        served_by(&tiers, &before),
        [1 - home],
        "the warm turn queued behind the document"
    );
    assert_eq!(reply.header("x-quantrouter-affinity"), "none");
    assert_eq!(queued.await.unwrap().status, 200);
}

fn tier(reply: &Reply) -> &str {
    reply.header("x-quantrouter-tier")
}

fn chat_turns(turns: &[&str]) -> String {
    conversation("auto", "Be helpful.", turns, 4)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_keeps_its_tier_unless_quality_rules_it_out() {
    let tiers = Tiers::start([1, 1, 1], cached_sims(Duration::ZERO), |_| {}, |_| {}).await;
    let strict = ("x-quantrouter-min-quality", "0.96");
    let session = |id: &'static str| ("x-session-id", id);

    // A hard first turn goes to FP16; the easy next turn stays there.
    let first = tiers
        .post(&chat_turns(&["Hello there."]), &[session("a"), strict])
        .await;
    assert_eq!(
        (tier(&first), first.header("x-quantrouter-affinity")),
        ("fp16", "none")
    );
    let next = tiers
        .post(&chat_turns(&["Hello there.", "Thanks!"]), &[session("a")])
        .await;
    assert_eq!(
        (tier(&next), next.header("x-quantrouter-affinity")),
        ("fp16", "session")
    );
    assert_eq!(next.header("x-quantrouter-reason"), "utility");
    // The same turn in another conversation goes where utility sends it.
    let other = tiers
        .post(&chat_turns(&["Hello there.", "Thanks!"]), &[session("b")])
        .await;
    assert_ne!(tier(&other), "fp16");
    assert_eq!(other.header("x-quantrouter-affinity"), "none");

    // A turn that needs better than the conversation's tier moves it, and it stays moved.
    let up = tiers
        .post(
            &chat_turns(&["Hello there.", "Thanks!", "One more, please."]),
            &[session("b"), strict],
        )
        .await;
    assert_eq!(
        (tier(&up), up.header("x-quantrouter-affinity")),
        ("fp16", "none")
    );
    let after = tiers
        .post(
            &chat_turns(&["Hello there.", "Thanks!", "One more, please.", "OK."]),
            &[session("b")],
        )
        .await;
    assert_eq!(
        (tier(&after), after.header("x-quantrouter-affinity")),
        ("fp16", "session")
    );

    // Without a session id, the user field, then the opening messages key the conversation.
    let mut with_user: Value = serde_json::from_str(&chat_turns(&["Hi"])).unwrap();
    with_user["user"] = "carol".into();
    tiers.post(&with_user.to_string(), &[strict]).await;
    let mut later: Value = serde_json::from_str(&chat_turns(&["Bye"])).unwrap();
    later["user"] = "carol".into();
    let reply = tiers.post(&later.to_string(), &[]).await;
    assert_eq!(
        (tier(&reply), reply.header("x-quantrouter-affinity")),
        ("fp16", "session")
    );
    let opened = conversation("auto", "Be terse.", &["Name a color."], 4);
    assert_eq!(tier(&tiers.post(&opened, &[strict]).await), "fp16");
    let continued = conversation("auto", "Be terse.", &["Name a color.", "Another."], 4);
    let reply = tiers.post(&continued, &[]).await;
    assert_eq!(
        (tier(&reply), reply.header("x-quantrouter-affinity")),
        ("fp16", "session")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_explains_a_session_decision_without_adding_a_turn() {
    let tiers = Tiers::start([1, 1, 1], cached_sims(Duration::ZERO), |_| {}, |_| {}).await;
    let url = format!("http://{}/v1/route", tiers.router.public_addr());
    let explain = |session: &'static str| {
        let url = url.clone();
        async move {
            let headers = [
                ("content-type", "application/json"),
                ("x-session-id", session),
            ];
            send(&client(), "POST", &url, &chat_turns(&["Thanks!"]), &headers)
                .await
                .json()
        }
    };
    // A dry run of a first turn remembers nothing for the real one.
    let strict = [("x-session-id", "d"), ("x-quantrouter-min-quality", "0.96")];
    send(
        &client(),
        "POST",
        &url,
        &chat_turns(&["Hello there."]),
        &[("content-type", "application/json"), strict[0], strict[1]],
    )
    .await;
    assert_eq!(explain("d").await["affinity"], "none");
    tiers.post(&chat_turns(&["Hello there."]), &strict).await;
    let answer = explain("d").await;
    assert_eq!(
        (answer["affinity"].as_str(), answer["profile"].as_str()),
        (Some("session"), Some("llama8b-fp16"))
    );
}
