//! Tokens and cost from upstream `usage`: streams ask upstream for a usage chunk and strip
//! it when the client did not ask for one.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use http::StatusCode;
use support::{simple_stream, Harness, SIMPLE};

fn metric(page: &str, name: &str, labels: &[&str]) -> f64 {
    page.lines()
        .find(|l| l.starts_with(name) && labels.iter().all(|label| l.contains(label)))
        .and_then(|l| l.rsplit(' ').next())
        .map_or(0.0, |v| v.parse().unwrap())
}

fn events(body: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(body)
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_is_counted_and_the_extra_usage_chunk_never_reaches_the_client() {
    let h = Harness::start().await;
    let profile = ["profile=\"llama8b-awq\""];
    let before = h.get(&h.admin_url("/metrics")).await;
    let before = String::from_utf8_lossy(&before.body).into_owned();

    // A stream without stream_options: upstream is asked for usage, the client gets none.
    let stream = simple_stream(5);
    let r = h.post("/v1/chat/completions", &stream).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("x-quantrouter-tier"), "int4");
    let seen = events(&r.body);
    assert_eq!(seen.last().unwrap(), "data: [DONE]");
    assert!(seen.iter().all(|e| !e.contains("\"usage\"")), "{seen:?}");
    // The role chunk, five tokens, the finish chunk and [DONE]: nothing else.
    assert_eq!(seen.len(), 1 + 5 + 1 + 1, "{seen:?}");

    // A client that asks for usage gets it.
    let asking = serde_json::json!({"model": "auto", "stream": true, "max_tokens": 5,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": SIMPLE}]})
    .to_string();
    let r = h.post("/v1/chat/completions", &asking).await;
    let seen = events(&r.body);
    assert!(
        seen.iter()
            .any(|e| e.contains("\"usage\"") && e.contains("\"choices\":[]")),
        "{seen:?}"
    );

    // Non-streamed.
    let r = h
        .post("/v1/chat/completions", &support::chat("auto", SIMPLE))
        .await;
    let usage = r.json()["usage"].clone();
    let output: f64 = 5.0 + 5.0 + usage["completion_tokens"].as_f64().unwrap();

    let after = h.get(&h.admin_url("/metrics")).await;
    let after = String::from_utf8_lossy(&after.body).into_owned();
    let tokens = |page: &str, direction: &str| {
        let d = format!("direction=\"{direction}\"");
        metric(page, "quantrouter_tokens_total{", &[profile[0], &d])
    };
    assert_eq!(tokens(&after, "output") - tokens(&before, "output"), output);
    let input = tokens(&after, "input") - tokens(&before, "input");
    assert!(input >= 3.0 * usage["prompt_tokens"].as_f64().unwrap() - 0.5);
    let cost = metric(&after, "quantrouter_cost_usd_total{", &profile)
        - metric(&before, "quantrouter_cost_usd_total{", &profile);
    let counterfactual = metric(
        &after,
        "quantrouter_counterfactual_cost_usd_total{",
        &profile,
    ) - metric(
        &before,
        "quantrouter_counterfactual_cost_usd_total{",
        &profile,
    );
    let set = &h.set;
    let awq = set.profile("llama8b-awq").unwrap();
    let fp16 = set.profile(&set.default_profile).unwrap();
    let expect = |p: &quantrouter_policy::Profile| {
        (input * p.cost_per_1m_input_tokens + output * p.cost_per_1m_output_tokens) / 1e6
    };
    assert!(
        (cost - expect(awq)).abs() < 1e-12,
        "{cost} vs {}",
        expect(awq)
    );
    assert!((counterfactual - expect(fp16)).abs() < 1e-12);
    assert!(counterfactual > cost, "routing to int4 saved money");
    // Every series appears once (a duplicate would make sums wrong).
    let series: Vec<&str> = after
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.rsplit_once(' ').unwrap().0)
        .collect();
    let unique: std::collections::HashSet<&str> = series.iter().copied().collect();
    assert_eq!(unique.len(), series.len(), "duplicate series on /metrics");
}

/// Messages natively (its `message_delta` usage) and Responses translated (chat's usage chunk,
/// which the client sees as Responses counts): both counted, exactly what the client saw.
/// Pinned to a profile no other test here uses, so the counts are this test's alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_api_usage_is_counted_from_each_apis_own_counts() {
    use quantrouter_policy::{Upstream, UpstreamApi};
    use serde_json::{json, Value};
    let t = support::Tiers::start(
        [1, 1, 1],
        |_| vllm_sim::SimConfig::default(),
        |set| {
            for profile in &mut set.profiles {
                if let Upstream::Static(upstream) = &mut profile.upstream {
                    upstream.apis.push(UpstreamApi::Messages);
                }
            }
        },
        |_| {},
    )
    .await;
    let profile = "profile=\"llama8b-fp16\"";
    let page = || async {
        let url = format!("http://{}/metrics", t.router.admin_addr());
        let reply = support::send(&support::client(), "GET", &url, "", &[]).await;
        String::from_utf8_lossy(&reply.body).into_owned()
    };
    let tokens = |page: &str, direction: &str| {
        let d = format!("direction=\"{direction}\"");
        metric(page, "quantrouter_tokens_total{", &[profile, &d])
    };
    let before = page().await;
    let post = |path: &'static str, body: Value| {
        let url = format!("http://{}{path}", t.router.public_addr());
        async move {
            let headers = [("content-type", "application/json")];
            support::send(
                &support::client(),
                "POST",
                &url,
                &body.to_string(),
                &headers,
            )
            .await
        }
    };
    let data = |reply: &support::Reply| -> Vec<Value> {
        events(&reply.body)
            .iter()
            .map(|e| serde_json::from_str(e.split_once("data: ").unwrap().1).unwrap())
            .collect()
    };
    let messages = post(
        "/v1/messages",
        json!({"model": "llama8b-fp16", "max_tokens": 7,
        "stream": true, "messages": [{"role": "user", "content": SIMPLE}]}),
    )
    .await;
    assert_eq!(messages.header("x-quantrouter-profile"), "llama8b-fp16");
    let events = data(&messages);
    assert!(
        events[0]["message"]["id"]
            .as_str()
            .unwrap()
            .starts_with("msg-"),
        "native"
    );
    let native = &events[events.len() - 2]["usage"];
    let responses = post(
        "/v1/responses",
        json!({"model": "llama8b-fp16",
        "max_output_tokens": 5, "stream": true, "input": SIMPLE}),
    )
    .await;
    let events = data(&responses);
    let translated = &events.last().unwrap()["response"]["usage"];
    assert!(
        events[0]["response"]["id"]
            .as_str()
            .unwrap()
            .starts_with("resp_"),
        "translated"
    );

    let after = page().await;
    let seen = |field: &str| native[field].as_f64().unwrap() + translated[field].as_f64().unwrap();
    assert_eq!(
        tokens(&after, "output") - tokens(&before, "output"),
        seen("output_tokens")
    );
    assert_eq!(
        tokens(&after, "input") - tokens(&before, "input"),
        seen("input_tokens")
    );
    assert!(seen("input_tokens") > 0.0 && seen("output_tokens") == 12.0);
}
