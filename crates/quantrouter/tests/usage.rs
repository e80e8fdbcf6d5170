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
