//! The endpoint picker behind a real Envoy (`scripts/install-tools envoy`), started from the
//! repository's example configuration (`manifests/envoy/envoy.yaml`), in front of simulated
//! tiers; requests come from the official `openai` Python client (`QUANTROUTER_PYTHON`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::path::PathBuf;
use std::time::Duration;

use quantrouter::server::Server;
use quantrouter_policy::{hash_key, ProfileSet, StaticUpstream, Upstream, UpstreamApi};
use support::envoy::Envoy;
use support::{
    client, loopback, python, send, sim_tiers, start_router, tenants_from, CODE, SIMPLE,
};
use vllm_sim::{Faults, SimConfig, SimServer};

/// What the client saw of one request through the gateway (`through_gateway.py`).
async fn through(envoy: &Envoy, key: &str, kind: &str, prompt: &str) -> serde_json::Value {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/through_gateway.py");
    let output = tokio::process::Command::new(python())
        .arg(script)
        .args([&envoy.base_url(), key, kind, prompt])
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "openai client failed:\n{stdout}\n{stderr}"
    );
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

/// The router with its endpoint picker on, over `set`.
async fn picker(
    set: ProfileSet,
    tweak: impl FnOnce(&mut quantrouter::server::ServerConfig),
) -> Server {
    start_router(set, |c| {
        c.epp_listen = Some(loopback());
        tweak(c);
    })
    .await
}

/// The profile the HTTP port's dry run picks for `body`: what the picker must pick too.
async fn policy_pick(router: &Server, body: &str) -> String {
    let url = format!("http://{}/v1/route", router.public_addr());
    let reply = send(
        &client(),
        "POST",
        &url,
        body,
        &[("content-type", "application/json")],
    )
    .await;
    reply.json()["profile"].as_str().unwrap().to_owned()
}

fn counter(metrics: &str, name: &str, labels: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(name) && labels.split(',').all(|label| l.contains(label)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn metrics(router: &Server) -> String {
    let url = format!("http://{}/metrics", router.admin_addr());
    String::from_utf8_lossy(&send(&client(), "GET", &url, "", &[]).await.body).into_owned()
}

/// Envoy streaming the request body (GIE's mode) and sending every answer's body whole,
/// instead of the example's buffered request and answers read only when their books need
/// them (Envoy then takes no mode override).
const OTHER_MODES: [(&str, &str); 4] = [
    (
        "request_body_mode: BUFFERED",
        "request_body_mode: FULL_DUPLEX_STREAMED",
    ),
    ("request_trailer_mode: SKIP", "request_trailer_mode: SEND"),
    ("response_body_mode: NONE", "response_body_mode: BUFFERED"),
    ("response_trailer_mode: SKIP", "response_trailer_mode: SEND"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_stream_and_completion_are_routed_by_the_picker_through_envoy() {
    routed_by_the_picker(&[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_in_envoys_other_modes_are_routed_alike() {
    routed_by_the_picker(&OTHER_MODES).await;
}

/// Chat, a streamed chat and a completion through Envoy reach the tier the HTTP port's
/// policy picks, with `model` rewritten to that tier's.
async fn routed_by_the_picker(edits: &[(&str, &str)]) {
    let (set, sims) = sim_tiers(Duration::ZERO).await;
    let router = picker(set.clone(), |_| {}).await;
    let envoy = Envoy::start_with(router.epp_addr().unwrap(), edits).await;
    for (kind, prompt) in [("chat", SIMPLE), ("stream", CODE), ("completion", SIMPLE)] {
        let body = match kind {
            "completion" => serde_json::json!({"model": "auto", "prompt": prompt, "max_tokens": 8}),
            _ => serde_json::json!({"model": "auto", "max_tokens": 8,
                "messages": [{"role": "user", "content": prompt}]}),
        };
        let expected = policy_pick(&router, &body.to_string()).await;
        let i = set.profiles.iter().position(|p| p.id == expected).unwrap();
        let before = sims[i].stats().requests;
        let seen = through(&envoy, "unused", kind, prompt).await;
        assert_eq!(seen["status"], 200, "{kind}: {seen}");
        assert_eq!(
            seen["headers"]["x-quantrouter-profile"], expected,
            "{kind}: {seen}"
        );
        // `auto` rewritten to the tier's model: the simulator answers only its own name.
        assert_eq!(seen["model"], set.profiles[i].model, "{kind}: {seen}");
        assert!(!seen["text"].as_str().unwrap().is_empty(), "{kind}: {seen}");
        assert_eq!(
            sims[i].stats().requests,
            before + 1,
            "{kind}: the picked tier served it"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_is_counted_from_the_streamed_answer_and_hidden_from_the_client() {
    let (set, _sims) = sim_tiers(Duration::ZERO).await;
    // `--epp-usage always`: every answer streams through the picker.
    let router = picker(set.clone(), |c| c.epp_reads_answers = true).await;
    let envoy = Envoy::start(router.epp_addr().unwrap()).await;
    let seen = through(&envoy, "unused", "stream", SIMPLE).await;
    assert_eq!(seen["status"], 200, "{seen}");
    // The picker asked the tier for a usage chunk the client did not ask for, and cut it.
    assert_eq!(seen["usage_chunks"], 0, "{seen}");
    let profile = seen["headers"]["x-quantrouter-profile"].as_str().unwrap();
    let label = format!("profile=\"{profile}\"");
    let counted = support::eventually(Duration::from_secs(5), || async {
        let text = metrics(&router).await;
        counter(
            &text,
            "quantrouter_tokens_total",
            &format!("{label},direction=\"output\""),
        ) > 0.0
            && counter(&text, "quantrouter_cost_usd_total", &label) > 0.0
    })
    .await;
    assert!(counted, "no usage counted:\n{}", metrics(&router).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_endpoint_is_retried_on_the_fallback_tier() {
    // Quantizations of one model, served under one name: the body Envoy replays on the
    // fallback tier names the model that tier serves too.
    let (mut set, _) = sim_tiers(Duration::ZERO).await;
    let mut sims: Vec<SimServer> = Vec::new();
    for profile in &mut set.profiles {
        profile.model = "shared-model".to_owned();
        let config = SimConfig {
            model: profile.model.clone(),
            ..SimConfig::default()
        };
        let sim = SimServer::bind(loopback(), config).await.unwrap();
        profile.upstream = Upstream::Static(StaticUpstream::new(vec![sim.url()]));
        sims.push(sim);
    }
    let router = picker(set.clone(), |_| {}).await;
    let envoy = Envoy::start(router.epp_addr().unwrap()).await;
    let body = serde_json::json!({"model": "auto", "max_tokens": 8,
        "messages": [{"role": "user", "content": SIMPLE}]});
    let first = policy_pick(&router, &body.to_string()).await;
    let i = set.profiles.iter().position(|p| p.id == first).unwrap();
    sims[i].set_faults(Faults {
        error_rate: 1.0,
        error_status: 503,
        ..Faults::default()
    });
    let seen = through(&envoy, "unused", "chat", SIMPLE).await;
    assert_eq!(seen["status"], 200, "{seen}");
    assert_ne!(seen["headers"]["x-quantrouter-profile"], first, "{seen}");
    assert_eq!(
        seen["headers"]["x-quantrouter-reason"], "fallback_error",
        "{seen}"
    );
    assert_eq!(
        sims[i].stats().requests,
        1,
        "the picked tier was tried first"
    );
    assert_eq!(
        envoy.stat("cluster.inference_pool.upstream_rq_retry").await,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_picker_down_envoy_fails_closed_with_503() {
    let (socket, refusing) = support::refusing_address();
    let envoy = Envoy::start(refusing).await;
    let seen = through(&envoy, "unused", "chat", SIMPLE).await;
    assert_eq!(seen["status"], 503, "{seen}");
    drop(socket);
}

const KEY: &str = "sk-gateway-team-7Hq2";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_over_its_limit_gets_429_in_openai_shape_and_a_bad_key_401() {
    let dir = tempfile::Builder::new()
        .prefix("qr-epp-")
        .tempdir()
        .unwrap();
    let doc = format!(
        r#"{{"version": 1, "tenants": [{{"id": "team-g", "key_sha256": ["{}"],
            "limits": {{"requests_per_minute": 1}}}}]}}"#,
        hash_key(KEY)
    );
    let tenants = tenants_from(&dir, &doc).await;
    let (set, _sims) = sim_tiers(Duration::ZERO).await;
    let router = picker(set, |c| c.tenants = Some(tenants)).await;
    let envoy = Envoy::start(router.epp_addr().unwrap()).await;
    let first = through(&envoy, KEY, "chat", SIMPLE).await;
    assert_eq!(first["status"], 200, "{first}");
    let refused = through(&envoy, KEY, "chat", SIMPLE).await;
    assert_eq!(refused["status"], 429, "{refused}");
    assert_eq!(refused["error"]["type"], "rate_limit_error", "{refused}");
    assert_eq!(refused["error"]["code"], "rate_limit_exceeded", "{refused}");
    let unknown = through(&envoy, "sk-nobody", "chat", SIMPLE).await;
    assert_eq!(unknown["status"], 401, "{unknown}");
    assert_eq!(unknown["error"]["code"], "invalid_api_key", "{unknown}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_subset_hint_limits_the_endpoints_the_picker_chooses_from() {
    let (set, sims) = sim_tiers(Duration::ZERO).await;
    let router = picker(set.clone(), |_| {}).await;
    // The hint allows one endpoint only, of the tier the policy would not pick for this
    // prompt: the request goes there all the same.
    let body = serde_json::json!({"model": "auto", "max_tokens": 8,
        "messages": [{"role": "user", "content": SIMPLE}]});
    let preferred = policy_pick(&router, &body.to_string()).await;
    let other = set.profiles.iter().position(|p| p.id != preferred).unwrap();
    let allowed = sims[other].url().trim_start_matches("http://").to_owned();
    let hint = |address: &str| {
        format!(
            "                http_filters:
                  - name: envoy.filters.http.set_metadata
                    typed_config:
                      \"@type\": type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config
                      metadata:
                        - metadata_namespace: envoy.lb.subset_hint
                          value: {{ x-gateway-destination-endpoint-subset: [\"{address}\"] }}
"
        )
    };
    let filters = "                http_filters:\n";
    let envoy = Envoy::start_with(router.epp_addr().unwrap(), &[(filters, &hint(&allowed))]).await;
    let seen = through(&envoy, "unused", "chat", SIMPLE).await;
    assert_eq!(seen["status"], 200, "{seen}");
    assert_eq!(
        seen["headers"]["x-quantrouter-profile"], set.profiles[other].id,
        "{seen}"
    );
    assert_eq!(sims[other].stats().requests, 1);
    // No endpoint of the hint can serve: 503, as the protocol asks.
    let nowhere = Envoy::start_with(
        router.epp_addr().unwrap(),
        &[(filters, &hint("10.255.255.1:1"))],
    )
    .await;
    let refused = through(&nowhere, "unused", "chat", SIMPLE).await;
    assert_eq!(refused["status"], 503, "{refused}");
    assert_eq!(refused["error"]["type"], "server_error", "{refused}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_cannot_choose_where_envoy_sends_or_retries_its_request() {
    // One enabled tier, failing: the picker has no fallback to name, so Envoy's retry goes
    // wherever the fallback header says — which must never be the client's choice.
    let (mut set, sims) = sim_tiers(Duration::ZERO).await;
    for profile in &mut set.profiles[1..] {
        profile.enabled = false;
    }
    sims[0].set_faults(Faults {
        error_rate: 1.0,
        error_status: 503,
        ..Faults::default()
    });
    let (elsewhere, received) = support::capture_upstream().await;
    let elsewhere = elsewhere.trim_start_matches("http://").to_owned();
    let router = picker(set, |_| {}).await;
    let envoy = Envoy::start(router.epp_addr().unwrap()).await;
    let body = serde_json::json!({"model": "auto", "max_tokens": 8,
        "messages": [{"role": "user", "content": SIMPLE}]});
    let url = format!("{}/chat/completions", envoy.base_url());
    let steered = send(
        &client(),
        "POST",
        &url,
        &body.to_string(),
        &[
            ("content-type", "application/json"),
            ("x-gateway-destination-endpoint", &elsewhere),
            ("x-gateway-destination-endpoint-fallback", &elsewhere),
        ],
    )
    .await;
    assert_eq!(steered.status, 503, "{:?}", steered.body);
    assert!(
        received.lock().unwrap().is_empty(),
        "the client's chosen endpoint got the request"
    );
    assert!(sims[0].stats().requests >= 1, "the picked tier was tried");
}

/// One request with the official clients (`tests/python/doors.py`): what the client saw.
async fn with_client(request: serde_json::Value) -> serde_json::Value {
    use tokio::io::AsyncWriteExt as _;
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/doors.py");
    let mut child = tokio::process::Command::new(python())
        .arg(script)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin
        .write_all(format!("{request}\n").as_bytes())
        .await
        .unwrap();
    drop(stdin);
    let output = child.wait_with_output().await.unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "the client failed: {stdout}");
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

fn messages(base_url: &str, prompt: &str) -> serde_json::Value {
    serde_json::json!({"base_url": base_url, "api_key": "unused", "client": "anthropic",
        "kind": "messages", "headers": {},
        "body": {"model": "auto", "max_tokens": 8, "messages": [{"role": "user", "content": prompt}]}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_apis_go_through_the_picker_only_to_profiles_that_serve_them_natively() {
    let (mut set, sims) = sim_tiers(Duration::ZERO).await;
    // Only the dearest tier says it serves Messages; the HTTP port would translate a simple
    // prompt to chat for the cheapest, which the Gateway cannot.
    if let Upstream::Static(upstream) = &mut set.profiles[0].upstream {
        upstream.apis.push(UpstreamApi::Messages);
    }
    let router = picker(set.clone(), |_| {}).await;
    let envoy = Envoy::start(router.epp_addr().unwrap()).await;
    let gateway = format!("http://{}", envoy.listener);
    let http = format!("http://{}", router.public_addr());
    let through_http = with_client(messages(&http, SIMPLE)).await;
    assert_eq!(through_http["status"], 200, "{through_http}");
    assert_ne!(
        through_http["headers"]["x-quantrouter-profile"], set.profiles[0].id,
        "the policy's own pick is another tier: {through_http}"
    );
    let before = sims[0].stats().requests;
    let through_gateway = with_client(messages(&gateway, SIMPLE)).await;
    assert_eq!(through_gateway["status"], 200, "{through_gateway}");
    assert_eq!(
        through_gateway["headers"]["x-quantrouter-profile"], set.profiles[0].id,
        "{through_gateway}"
    );
    assert_eq!(sims[0].stats().requests, before + 1);
    // Without a native profile: refused before anything is sent, in Anthropic's shape.
    let responses = serde_json::json!({"base_url": gateway, "api_key": "unused",
        "client": "openai", "kind": "responses", "headers": {},
        "body": {"model": "auto", "input": SIMPLE, "max_output_tokens": 8}});
    let refused = with_client(responses).await;
    assert_eq!(refused["status"], 400, "{refused}");
    assert_eq!(refused["error"]["code"], "invalid_request", "{refused}");
    let mut chat_only = set.clone();
    for profile in &mut chat_only.profiles {
        if let Upstream::Static(upstream) = &mut profile.upstream {
            upstream.apis.retain(|api| *api != UpstreamApi::Messages);
        }
    }
    chat_only.version += 1;
    let embedded = quantrouter::profiles::SourceKind::Embedded;
    router.app.store.apply(chat_only, embedded, false).unwrap();
    let refused = with_client(messages(&gateway, SIMPLE)).await;
    assert_eq!(refused["status"], 400, "{refused}");
    assert_eq!(refused["error"]["type"], "error", "{refused}");
    assert_eq!(
        refused["error"]["error"]["type"], "invalid_request_error",
        "{refused}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_the_limit_is_refused_by_the_picker_with_413_in_the_apis_shape() {
    let (set, _sims) = sim_tiers(Duration::ZERO).await;
    let router = picker(set, |c| c.body_limit = 1024 * 1024).await;
    let envoy = Envoy::start(router.epp_addr().unwrap()).await;
    let gateway = format!("http://{}", envoy.listener);
    let prompt = "Summarise the log below.\n".repeat(90_000);
    let chat = serde_json::json!({"base_url": gateway, "api_key": "unused", "client": "openai",
        "kind": "chat", "headers": {},
        "body": {"model": "auto", "max_tokens": 8, "messages": [{"role": "user", "content": prompt}]}});
    let refused = with_client(chat).await;
    assert_eq!(refused["status"], 413, "{refused}");
    assert_eq!(refused["error"]["code"], "request_too_large", "{refused}");
    let refused = with_client(messages(&gateway, &prompt)).await;
    assert_eq!(refused["status"], 413, "{refused}");
    assert_eq!(
        refused["error"]["error"]["type"], "request_too_large",
        "{refused}"
    );
}

/// Messages Envoy sent the picker so far, over every stream.
async fn sent_to_picker(envoy: &Envoy) -> u64 {
    envoy.stat("http.gateway.ext_proc.stream_msgs_sent").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answers_body_is_read_only_when_its_books_need_it() {
    let dir = tempfile::Builder::new()
        .prefix("qr-epp-")
        .tempdir()
        .unwrap();
    // One tenant without limits, one whose tokens are counted.
    let doc = serde_json::json!({"version": 1, "tenants": [
        {"id": "free", "key_sha256": [hash_key("sk-free-1")]},
        {"id": "metered", "key_sha256": [hash_key("sk-metered-1")],
         "limits": {"tokens_per_minute": 1_000_000}},
    ]});
    let tenants = tenants_from(&dir, &doc.to_string()).await;
    let (set, _sims) = sim_tiers(Duration::ZERO).await;
    let router = picker(set, |c| c.tenants = Some(tenants)).await;
    let envoy = Envoy::start(router.epp_addr().unwrap()).await;
    for (key, kind, reads) in [
        ("sk-free-1", "chat", false),
        ("sk-free-1", "stream", false),
        ("sk-metered-1", "chat", true),
        ("sk-metered-1", "stream", true),
    ] {
        let before = sent_to_picker(&envoy).await;
        let seen = through(&envoy, key, kind, SIMPLE).await;
        assert_eq!(seen["status"], 200, "{seen}");
        assert!(!seen["text"].as_str().unwrap().is_empty(), "{seen}");
        // The head comes to the picker either way: the router's headers are on the answer.
        assert!(
            seen["headers"]["x-quantrouter-profile"].is_string(),
            "{seen}"
        );
        assert_eq!(seen["usage_chunks"], 0, "{seen}");
        let sent = sent_to_picker(&envoy).await - before;
        // The request's headers and body and the answer's headers; the body's pieces too
        // only when the tenant's usage is counted.
        match reads {
            false => assert_eq!(
                sent, 3,
                "{key} {kind}: Envoy sent the picker {sent} messages"
            ),
            true => assert!(
                sent > 3,
                "{key} {kind}: Envoy sent the picker {sent} messages"
            ),
        }
    }
    let text = metrics(&router).await;
    assert!(
        counter(&text, "quantrouter_tokens_total", "direction=\"output\"") > 0.0,
        "the metered tenant's usage was counted:\n{text}"
    );
}
