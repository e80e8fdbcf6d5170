use super::*;

const HASH_A: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";
const HASH_B: &str = "60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752";

fn doc() -> TenantDocument {
    TenantDocument::from_json(&format!(
        r#"{{"version": 2, "tenants": [
            {{"id": "team-a", "key_sha256": ["{HASH_A}"],
              "limits": {{"requests_per_minute": 60, "tokens_per_minute": 10000,
                          "budget_per_day": 5.0, "budget_per_month": 100.0, "soft_limit": 0.8}},
              "min_quality": 0.85, "allowed_profiles": ["llama8b-fp8"], "priority": 10}},
            {{"id": "team_b.batch", "key_sha256": ["{HASH_B}"]}}
        ]}}"#
    ))
    .unwrap()
}

fn errors_of(doc: &TenantDocument) -> Vec<String> {
    match doc.validate() {
        Ok(()) => vec![],
        Err(e) => {
            e.0.iter()
                .map(|e| format!("{}: {}", e.path, e.message))
                .collect()
        }
    }
}

#[test]
fn a_full_document_parses_with_defaults_and_round_trips() {
    let d = doc();
    let b = d.tenant("team_b.batch").unwrap();
    assert_eq!(b.limits, TenantLimits::default());
    assert_eq!(b.limits.soft_limit, 0.8);
    assert_eq!(b.priority, 0);
    assert!(b.allows("anything"));
    let a = d.tenant("team-a").unwrap();
    assert!(a.allows("llama8b-fp8") && !a.allows("llama8b-fp16"));
    let json = serde_json::to_string(&d).unwrap();
    assert!(!json.contains("\"keys\""), "{json}");
    assert_eq!(TenantDocument::from_json(&json).unwrap(), d);
}

#[test]
fn hash_key_is_lowercase_hex_sha256() {
    // SHA-256("test"), a published test vector.
    assert_eq!(hash_key("test"), HASH_A);
    assert_eq!(parse_key_hash(HASH_A).unwrap()[..2], [0x9f, 0x86]);
    assert_eq!(parse_key_hash(&HASH_A.to_uppercase()), None);
    assert_eq!(parse_key_hash(&HASH_A[1..]), None);
}

#[test]
fn keys_must_be_short_visible_ascii() {
    assert!(is_valid_api_key("sk-proj-AbC_123.x"));
    assert!(is_valid_api_key(&"k".repeat(MAX_KEY_BYTES)));
    for bad in [
        "",
        " ",
        "sk abc",
        " sk-abc",
        "sk-abc\n",
        "sk-\u{e9}t\u{e9}",
        "sk-\u{0}",
        &"k".repeat(MAX_KEY_BYTES + 1),
    ] {
        assert!(!is_valid_api_key(bad), "{bad:?}");
    }
}

#[test]
fn every_broken_rule_names_its_path() {
    let mut d = doc();
    d.version = MAX_VERSION + 1;
    d.tenants[0].id = "team a".into();
    d.tenants[0].key_sha256.push("not-a-hash".into());
    d.tenants[0].limits.requests_per_minute = Some(0);
    d.tenants[0].limits.tokens_per_minute = Some(MAX_COUNT_LIMIT + 1);
    d.tenants[0].limits.budget_per_day = Some(f64::NAN);
    d.tenants[0].limits.budget_per_month = Some(-1.0);
    d.tenants[0].limits.soft_limit = 0.0;
    d.tenants[0].min_quality = Some(1.5);
    d.tenants[0].allowed_profiles = Some(vec!["a".into(), " ".into(), "a".into()]);
    d.tenants[1].id = "team a".into();
    d.tenants[1].key_sha256 = vec![HASH_A.into()];
    let errors = errors_of(&d);
    let paths: Vec<&str> = errors
        .iter()
        .map(|e| e.split(':').next().unwrap())
        .collect();
    assert_eq!(
        paths,
        [
            "version",
            "tenants[0].id",
            "tenants[0].key_sha256[1]",
            "tenants[0].limits.requests_per_minute",
            "tenants[0].limits.tokens_per_minute",
            "tenants[0].limits.budget_per_day",
            "tenants[0].limits.budget_per_month",
            "tenants[0].limits.soft_limit",
            "tenants[0].min_quality",
            "tenants[0].allowed_profiles[1]",
            "tenants[0].allowed_profiles[2]",
            "tenants[1].id",
            "tenants[1].key_sha256[0]",
            "tenants[1].id",
        ],
        "{errors:#?}"
    );
    assert!(
        errors[12].contains("a key belongs to one tenant"),
        "{errors:?}"
    );
}

#[test]
fn empty_lists_are_refused_with_a_hint() {
    let mut d = doc();
    d.tenants[0].allowed_profiles = Some(vec![]);
    assert_eq!(
        errors_of(&d),
        ["tenants[0].allowed_profiles: must name at least one profile; omit it to allow every profile"]
    );
    d.tenants.clear();
    assert_eq!(errors_of(&d), ["tenants: must contain at least one tenant"]);
}

#[test]
fn ids_are_bounded_to_a_label_safe_charset() {
    let mut d = doc();
    for good in ["a", "A-1", "team.a_b-c", &"x".repeat(64)] {
        d.tenants[0].id = good.to_owned();
        assert!(errors_of(&d).is_empty(), "{good}");
    }
    for bad in ["", "-a", ".a", "a:b", "a b", "é", "other", &"x".repeat(65)] {
        d.tenants[0].id = bad.to_owned();
        assert_eq!(errors_of(&d).len(), 1, "{bad:?}");
    }
}

#[test]
fn the_stored_format_refuses_plain_keys_without_quoting_them() {
    let text = r#"{"version": 1, "tenants": [{"id": "a", "keys": ["sk-secret-value"]}]}"#;
    let err = TenantDocument::from_json(text).unwrap_err().to_string();
    assert!(err.starts_with("tenants[0].keys: plain keys"), "{err}");
    assert!(!err.contains("sk-secret"), "{err}");
}

#[test]
fn push_format_hashes_plain_keys_and_drops_them() {
    let text = format!(
        r#"{{"version": 1, "tenants": [{{"id": "a", "key_sha256": ["{HASH_A}"],
            "keys": ["test", "sk-other"]}}]}}"#
    );
    let d = TenantDocument::from_push_json(&text).unwrap();
    assert_eq!(
        d.tenants[0].key_sha256,
        [HASH_A.to_owned(), hash_key("sk-other")]
    );
    assert!(d.tenants[0].keys.is_empty());
    let stored = serde_json::to_string(&d).unwrap();
    assert!(!stored.contains("sk-other"), "{stored}");
    assert_eq!(TenantDocument::from_json(&stored).unwrap(), d);
}

#[test]
fn push_format_refuses_bad_keys_by_path_without_quoting_them() {
    let text = r#"{"version": 1, "tenants": [{"id": "a", "keys": ["ok-key", "sk bad secret"]}]}"#;
    let err = TenantDocument::from_push_json(text)
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "tenants[0].keys[1]: must be 1 to 256 visible ASCII characters (no spaces)"
    );
}

#[test]
fn parse_errors_do_not_quote_string_values() {
    // A key pasted where a list of hashes belongs.
    let text = r#"{"version": 1, "tenants": [{"id": "a", "key_sha256": "sk-secret-\"value"}]}"#;
    let err = TenantDocument::from_json(text).unwrap_err();
    let TenantError::Parse { path, message } = &err else {
        panic!("expected a parse error, got {err:?}");
    };
    assert_eq!(path, "tenants[0].key_sha256");
    assert!(
        !message.contains("secret") && !message.contains("value"),
        "{message}"
    );
    assert!(message.contains("expected a sequence"), "{message}");
}

#[test]
fn unknown_fields_and_trailing_bytes_are_refused() {
    let err = TenantDocument::from_json(r#"{"version": 1, "tenants": [{"id": "a", "quota": 1}]}"#)
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("tenants[0].quota:"), "{err}");
    let err = TenantDocument::from_json(r#"{"version": 1, "tenants": [{"id": "a"}]} {}"#)
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("$:"), "{err}");
}

#[test]
fn too_many_keys_are_refused() {
    let mut d = doc();
    d.tenants[1].key_sha256 = (0..MAX_KEYS).map(|i| hash_key(&format!("k{i}"))).collect();
    assert_eq!(
        errors_of(&d),
        ["tenants: holds more than 4096 key hashes in all, the most a router compares per request"]
    );
}

#[test]
fn prefix_cache_defaults_to_shared_and_is_written_only_when_isolated() {
    let d = doc();
    assert_eq!(
        d.tenant("team-a").unwrap().prefix_cache,
        PrefixCache::Shared
    );
    assert!(!serde_json::to_string(&d).unwrap().contains("prefix_cache"));
    let text = format!(
        r#"{{"version": 1, "tenants": [{{"id": "a", "key_sha256": ["{HASH_A}"],
            "prefix_cache": "isolated"}}]}}"#
    );
    let isolated = TenantDocument::from_json(&text).unwrap();
    assert_eq!(isolated.tenants[0].prefix_cache, PrefixCache::Isolated);
    let json = serde_json::to_string(&isolated).unwrap();
    assert!(json.contains(r#""prefix_cache":"isolated""#));
    assert_eq!(TenantDocument::from_json(&json).unwrap(), isolated);
    let wrong = text.replace("isolated", "private");
    let error = TenantDocument::from_json(&wrong).unwrap_err().to_string();
    assert!(error.starts_with("tenants[0].prefix_cache"), "{error}");
}

#[test]
fn tenant_keys_differ_between_tenants_and_follow_the_key_set() {
    let digest = |hash: &str| parse_key_hash(hash).unwrap();
    let (a, b) = (digest(HASH_A), digest(HASH_B));
    let keys = |id, digests: &[[u8; 32]]| TenantKeys::derive(id, digests, PrefixCache::Isolated);
    let team = keys("team-a", &[a, b]);
    let salt = team.cache_salt(None).unwrap().into_owned();
    assert_eq!(salt.len(), 64);
    assert!(salt.bytes().all(|c| c.is_ascii_hexdigit()));
    // The order of the hashes does not matter; the id and every key do.
    assert_eq!(keys("team-a", &[b, a]).cache_salt(None).unwrap(), salt);
    assert_eq!(keys("team-a", &[b, a]).scope(), team.scope());
    for other in [keys("team-b", &[a, b]), keys("team-a", &[a])] {
        assert_ne!(other.cache_salt(None).unwrap(), salt);
        assert_ne!(other.scope(), team.scope());
    }
    // A client's own salt splits the tenant's, never reaching another tenant's.
    let user_1 = team.cache_salt(Some("user-1")).unwrap().into_owned();
    assert_ne!(user_1, salt);
    assert_ne!(team.cache_salt(Some("user-2")).unwrap(), user_1);
    assert_ne!(
        keys("team-b", &[a, b]).cache_salt(Some("user-1")).unwrap(),
        user_1
    );
    // Shared: no salt, the same scope.
    let shared = TenantKeys::derive("team-a", &[a, b], PrefixCache::Shared);
    assert_eq!(shared.cache_salt(Some("user-1")), None);
    assert_eq!(shared.scope(), team.scope());
    assert!(!format!("{team:?}").contains(&salt));
}
