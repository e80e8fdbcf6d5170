use super::*;
use crate::DEFAULT_PROFILE_SET;

fn default_set() -> ProfileSet {
    ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap()
}

fn errors_of(set: &ProfileSet) -> Vec<String> {
    match set.validate() {
        Ok(()) => vec![],
        Err(e) => {
            e.0.iter()
                .map(|e| format!("{}: {}", e.path, e.message))
                .collect()
        }
    }
}

#[test]
fn default_set_is_valid_and_round_trips() {
    let set = default_set();
    assert_eq!(set.profiles.len(), 3);
    let json = serde_json::to_string(&set).unwrap();
    assert_eq!(ProfileSet::from_json(&json).unwrap(), set);
}

#[test]
fn unknown_field_names_its_path() {
    let text = DEFAULT_PROFILE_SET.replace("\"ttft_ms\": 60", "\"ttft_ms\": 60, \"bogus\": 1");
    let err = ProfileSet::from_json(&text).unwrap_err();
    let ProfileSetError::Parse { path, message } = err else {
        panic!("expected a parse error, got {err:?}");
    };
    assert_eq!(path, "profiles[0].latency.bogus");
    assert!(message.contains("bogus"), "{message}");
}

#[test]
fn wrong_type_names_its_path() {
    let text = DEFAULT_PROFILE_SET.replace(
        "\"max_context_tokens\": 16384,\n      \"max_concurrency\": 192",
        "\"max_context_tokens\": \"big\",\n      \"max_concurrency\": 192",
    );
    let err = ProfileSet::from_json(&text).unwrap_err().to_string();
    assert!(err.starts_with("profiles[1].max_context_tokens:"), "{err}");
}

#[test]
fn duplicate_ids_are_rejected() {
    let mut set = default_set();
    set.profiles[2].id = set.profiles[0].id.clone();
    assert_eq!(
        errors_of(&set),
        vec!["profiles[2].id: duplicate profile id"]
    );
}

#[test]
fn unknown_default_profile_is_rejected() {
    let mut set = default_set();
    set.default_profile = "nope".into();
    assert_eq!(
        errors_of(&set),
        vec!["default_profile: must name a profile in `profiles`"]
    );
}

#[test]
fn out_of_range_numbers_are_rejected_with_paths() {
    let mut set = default_set();
    set.policy.weights.cost = -0.1;
    set.policy.required_quality.max = 1.5;
    set.profiles[1].quality.default = 1.2;
    set.profiles[1].quality.math = Some(-0.5);
    set.profiles[2].latency.itl_ms = 0.0;
    set.profiles[2].cost_per_1m_input_tokens = -1.0;
    set.profiles[0].max_context_tokens = 0;
    let errors = errors_of(&set);
    for expected in [
        "policy.weights.cost: must be in [0, 1]",
        "policy.required_quality.max: must be in [0, 1]",
        "profiles[1].quality.default: must be in [0, 1]",
        "profiles[1].quality.math: must be in [0, 1]",
        "profiles[2].latency.itl_ms: must be > 0",
        "profiles[2].cost_per_1m_input_tokens: must be > 0",
        "profiles[0].max_context_tokens: must be > 0",
    ] {
        assert!(
            errors.iter().any(|e| e == expected),
            "missing {expected:?} in {errors:#?}"
        );
    }
}

#[test]
fn empty_and_all_disabled_sets_are_rejected() {
    let mut set = default_set();
    for p in &mut set.profiles {
        p.enabled = false;
    }
    assert_eq!(
        errors_of(&set),
        vec!["profiles: at least one profile must be enabled"]
    );
    set.profiles.clear();
    assert!(errors_of(&set).contains(&"profiles: must contain at least one profile".to_owned()));
}

#[test]
fn malformed_urls_are_rejected() {
    let mut set = default_set();
    let bad = [
        "ftp://x:1",
        "http://",
        "http://host:notaport",
        "http://host:0",
        "http://ho st:80",
        "localhost:8000",
        "http://[::1",
        "http://::1:80",
        "http://[::1]x",
    ];
    set.profiles[0].upstream = Upstream::Static(StaticUpstream::new(
        bad.iter().map(|s| (*s).to_owned()).collect(),
    ));
    let errors = errors_of(&set);
    assert_eq!(errors.len(), bad.len(), "{errors:#?}");
    for i in 0..bad.len() {
        assert!(
            errors[i].starts_with(&format!("profiles[0].upstream.urls[{i}]:")),
            "{errors:#?}"
        );
    }
    set.profiles[0].upstream = Upstream::Static(StaticUpstream::new(vec![
        "http://127.0.0.1:8000".into(),
        "https://vllm.example:443/base".into(),
        "http://[::1]:80".into(),
        "http://[::1]".into(),
    ]));
    assert!(errors_of(&set).is_empty());
}

#[test]
fn service_upstream_defaults_and_dns_url() {
    let up: Upstream = serde_json::from_str(r#"{"service": "vllm-int4"}"#).unwrap();
    assert_eq!(up.base_urls(), vec!["http://vllm-int4.default.svc:8000"]);
    let mut set = default_set();
    set.profiles[0].upstream = serde_json::from_str(r#"{"service": "Bad_Name"}"#).unwrap();
    assert_eq!(
        errors_of(&set),
        vec!["profiles[0].upstream.service: must be a DNS-1123 label"]
    );
}

#[test]
fn policy_fields_default_when_omitted() {
    let text = r#"{"version": 2, "default_profile": "a", "profiles": [{"id": "a", "model": "m",
        "quantization": "fp16", "tier": "fp16", "upstream": {"urls": ["http://127.0.0.1:1"]},
        "cost_per_1m_input_tokens": 1, "cost_per_1m_output_tokens": 1,
        "latency": {"ttft_ms": 1, "itl_ms": 1}, "quality": {"default": 0.9},
        "max_context_tokens": 100}]}"#;
    let set = ProfileSet::from_json(text).unwrap();
    assert_eq!(set.policy, Policy::default());
    assert_eq!(set.profiles[0].max_concurrency, 256);
    assert!(set.profiles[0].enabled);
}

#[test]
fn quality_for_falls_back_to_default() {
    let set = default_set();
    let awq = set.profile("llama8b-awq").unwrap();
    assert_eq!(awq.quality_for(TaskClass::Math), 0.78);
    assert_eq!(awq.quality_for(TaskClass::General), 0.90);
}

#[test]
fn versions_beyond_what_json_numbers_hold_exactly_are_rejected() {
    let mut set = default_set();
    set.version = MAX_VERSION;
    assert!(errors_of(&set).is_empty());
    for version in [MAX_VERSION + 1, u64::MAX] {
        set.version = version;
        let errors = errors_of(&set);
        assert_eq!(errors.len(), 1, "{errors:#?}");
        assert!(errors[0].starts_with("version: must be at most 9007199254740991"));
    }
    let text = DEFAULT_PROFILE_SET.replace("\"version\": 1,", "\"version\": 18446744073709551615,");
    assert_ne!(text, DEFAULT_PROFILE_SET);
    let err = ProfileSet::from_json(&text).unwrap_err().to_string();
    assert!(err.starts_with("version: "), "{err}");
}

#[test]
fn upstream_api_keys_and_metric_names_are_checked() {
    let mut set = default_set();
    set.profiles[0].upstream = serde_json::from_str(
        r#"{"urls": ["http://127.0.0.1:1"], "api_key_env": "VLLM_KEY",
            "metrics": {"waiting": "sglang:num_queue_reqs", "running": "sglang:num_running_reqs"}}"#,
    )
    .unwrap();
    set.profiles[1].upstream =
        serde_json::from_str(r#"{"service": "vllm-fp8", "api_key_file": "/run/key"}"#).unwrap();
    assert!(errors_of(&set).is_empty(), "{:#?}", errors_of(&set));
    assert_eq!(
        set.profiles[0].upstream.api_key(),
        Some(ApiKeySource::Env("VLLM_KEY"))
    );
    assert_eq!(
        set.profiles[1].upstream.api_key(),
        Some(ApiKeySource::File("/run/key"))
    );
    assert_eq!(set.profiles[2].upstream.api_key(), None);
    assert_eq!(
        set.profiles[0]
            .upstream
            .queue_metrics()
            .and_then(|m| m.waiting.as_deref()),
        Some("sglang:num_queue_reqs")
    );

    set.profiles[0].upstream = serde_json::from_str(
        r#"{"urls": ["http://127.0.0.1:1"], "api_key_env": "1-BAD",
            "metrics": {"waiting": "has space"}}"#,
    )
    .unwrap();
    set.profiles[1].upstream = serde_json::from_str(
        r#"{"service": "vllm-fp8", "api_key_env": "A", "api_key_file": "/run/key"}"#,
    )
    .unwrap();
    set.profiles[2].upstream =
        serde_json::from_str(r#"{"service": "vllm-int4", "api_key_file": " "}"#).unwrap();
    assert_eq!(
        errors_of(&set),
        vec![
            "profiles[0].upstream.api_key_env: must be an environment variable name ([A-Za-z_][A-Za-z0-9_]*)",
            "profiles[0].upstream.metrics.waiting: must be a Prometheus metric name ([a-zA-Z_:][a-zA-Z0-9_:]*)",
            "profiles[1].upstream.api_key_file: set api_key_env or api_key_file, not both",
            "profiles[2].upstream.api_key_file: must not be empty",
        ]
    );
    // The document names where the key is, never the key: an unknown field is refused.
    assert!(
        serde_json::from_str::<Upstream>(r#"{"urls": ["http://a:1"], "api_key": "sk-1"}"#).is_err()
    );
}

#[test]
fn upstream_transport_defaults_to_http1_on_system_roots_and_ca_files_need_https() {
    let mut set = default_set();
    assert_eq!(set.profiles[0].upstream.transport(), Transport::default());
    set.profiles[0].upstream = serde_json::from_str(
        r#"{"urls": ["https://vllm.example:8443", "http://10.0.0.1:8000"], "ca_file": "/etc/ca.pem", "http2": true}"#,
    )
    .unwrap();
    set.profiles[1].upstream =
        serde_json::from_str(r#"{"service": "vllm-fp8", "http2": true}"#).unwrap();
    assert!(errors_of(&set).is_empty(), "{:#?}", errors_of(&set));
    assert_eq!(
        set.profiles[0].upstream.transport(),
        Transport {
            ca_file: Some("/etc/ca.pem"),
            http2: true
        }
    );
    assert!(set.profiles[1].upstream.transport().http2);
    // Written back, the defaults stay out of the document.
    let written = serde_json::to_value(&set.profiles[2].upstream).unwrap();
    assert!(written.get("http2").is_none() && written.get("ca_file").is_none());

    set.profiles[0].upstream =
        serde_json::from_str(r#"{"urls": ["http://127.0.0.1:1"], "ca_file": "/etc/ca.pem"}"#)
            .unwrap();
    set.profiles[1].upstream =
        serde_json::from_str(r#"{"service": "vllm-fp8", "ca_file": "/etc/ca.pem"}"#).unwrap();
    set.profiles[2].upstream =
        serde_json::from_str(r#"{"urls": ["https://a:1"], "ca_file": " "}"#).unwrap();
    assert_eq!(
        errors_of(&set),
        vec![
            "profiles[0].upstream.ca_file: only https:// URLs use a CA file, and this upstream has none",
            "profiles[1].upstream.ca_file: only https:// URLs use a CA file, and this upstream has none",
            "profiles[2].upstream.ca_file: must not be empty",
        ]
    );
}

#[test]
fn stream_check_and_calibration_are_optional_and_checked() {
    let set = ProfileSet::from_json(&DEFAULT_PROFILE_SET.replace(
        "\"policy\": {",
        "\"policy\": {\"stream_check\": {}, \"calibration\": {\"sample_rate\": 0.05, \
             \"reference_profile\": \"llama8b-fp16\", \"max_extra_cost_per_hour\": 2.5},",
    ))
    .unwrap();
    assert_eq!(set.policy.stream_check, Some(StreamCheck::default()));
    assert_eq!(set.policy.calibration.as_ref().unwrap().sample_rate, 0.05);
    let plain = default_set();
    let written = serde_json::to_value(&plain.policy).unwrap();
    assert!(written.get("stream_check").is_none() && written.get("calibration").is_none());

    let mut bad = set.clone();
    bad.policy.stream_check = Some(StreamCheck {
        tokens: 0,
        max_hold_ms: 0,
    });
    bad.policy.calibration = Some(Calibration {
        sample_rate: 1.5,
        reference_profile: "nope".into(),
        max_extra_cost_per_hour: 0.0,
        outcomes: None,
    });
    assert_eq!(
        errors_of(&bad),
        vec![
            "policy.stream_check.tokens: must be > 0",
            "policy.stream_check.max_hold_ms: must be > 0",
            "policy.calibration.sample_rate: must be in [0, 1]",
            "policy.calibration.max_extra_cost_per_hour: must be > 0",
            "policy.calibration.reference_profile: must name an enabled profile in `profiles`",
        ]
    );
}

#[test]
fn upstream_apis_default_to_chat_and_completions_and_must_include_chat() {
    let mut set = default_set();
    let upstream = &set.profiles[0].upstream;
    assert!(upstream.serves(UpstreamApi::Chat) && upstream.serves(UpstreamApi::Completions));
    assert!(!upstream.serves(UpstreamApi::Messages));
    let written = serde_json::to_value(upstream).unwrap();
    assert!(
        written.get("apis").is_none(),
        "the default stays out of the document"
    );

    set.profiles[0].upstream = serde_json::from_str(
        r#"{"service": "vllm-int4", "apis": ["chat", "completions", "messages", "responses"]}"#,
    )
    .unwrap();
    assert!(set.profiles[0].upstream.serves(UpstreamApi::Responses));
    assert!(errors_of(&set).is_empty(), "{:#?}", errors_of(&set));

    set.profiles[1].upstream =
        serde_json::from_str(r#"{"urls": ["http://127.0.0.1:1"], "apis": ["messages"]}"#).unwrap();
    let errors = errors_of(&set);
    assert!(
        errors
            .iter()
            .any(|e| e.contains("profiles[1].upstream.apis")),
        "{errors:#?}"
    );
    let unknown = serde_json::from_str::<Upstream>(r#"{"service": "s", "apis": ["embeddings"]}"#);
    assert!(unknown.is_err());
}

#[test]
fn streams_resume_once_by_default_on_upstreams_that_continue() {
    let mut set = default_set();
    assert_eq!(set.policy.stream_resume.max_resumes, 1);
    assert!(set.profiles.iter().all(|p| p.upstream.resumes()));
    set.profiles[0].upstream =
        serde_json::from_str(r#"{"urls": ["http://a:1"], "resume": false}"#).unwrap();
    set.profiles[1].upstream =
        serde_json::from_str(r#"{"service": "llama", "resume": false}"#).unwrap();
    assert!(!set.profiles[0].upstream.resumes() && !set.profiles[1].upstream.resumes());
    // Written back, only the exception is in the document.
    let written = serde_json::to_value(&set.profiles[0].upstream).unwrap();
    assert_eq!(written["resume"], false);
    let written = serde_json::to_value(&set.profiles[2].upstream).unwrap();
    assert!(written.get("resume").is_none());

    set.policy.stream_resume.max_resumes = 0;
    assert!(errors_of(&set).is_empty());
    set.policy.stream_resume.max_resumes = 4;
    assert_eq!(
        errors_of(&set),
        ["policy.stream_resume.max_resumes: must be in [0, 3]"]
    );
}
