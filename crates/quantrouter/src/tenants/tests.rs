use super::*;
use quantrouter_policy::hash_key;

fn doc(version: u64) -> TenantDocument {
    TenantDocument::from_push_json(&format!(
        r#"{{"version": {version}, "tenants": [
            {{"id": "team-a", "keys": ["sk-a-1", "sk-a-2"],
              "limits": {{"requests_per_minute": 60, "budget_per_month": 10.0}},
              "min_quality": 0.85, "allowed_profiles": ["llama8b-fp8"], "priority": 3,
              "risk_tolerance": 0.2}},
            {{"id": "team-b", "keys": ["sk-b-1"], "priority": 3}},
            {{"id": "batch", "keys": ["sk-c-1"], "priority": -1}}
        ]}}"#
    ))
    .unwrap()
}

fn id(
    tenant: Result<Option<&Arc<ActiveTenant>>, KeyRejected>,
) -> Result<Option<String>, KeyRejected> {
    tenant.map(|t| t.map(|t| t.id.to_string()))
}

#[test]
fn without_tenants_or_keys_no_key_is_required() {
    let store = TenantStore::new(None, 10);
    let snapshot = store.load();
    assert!(!snapshot.requires_key());
    assert_eq!(id(snapshot.authenticate(None)), Ok(None));
    assert_eq!(id(snapshot.authenticate(Some("anything"))), Ok(None));
}

#[test]
fn each_key_authenticates_its_tenant_and_every_other_key_is_refused() {
    let store = TenantStore::new(None, 10);
    store.apply(&doc(1), TenantSource::File, true).unwrap();
    let s = store.load();
    assert!(s.requires_key());
    assert_eq!(
        id(s.authenticate(Some("sk-a-2"))),
        Ok(Some("team-a".into()))
    );
    assert_eq!(
        id(s.authenticate(Some("sk-b-1"))),
        Ok(Some("team-b".into()))
    );
    assert_eq!(id(s.authenticate(None)), Err(KeyRejected::Missing));
    assert_eq!(
        id(s.authenticate(Some("sk-a-3"))),
        Err(KeyRejected::Unknown)
    );
    for malformed in ["", " ", "sk-a-1 ", "sk-\u{e9}", &"k".repeat(300)] {
        assert_eq!(
            id(s.authenticate(Some(malformed))),
            Err(KeyRejected::Malformed)
        );
    }
    let a = s.tenant("team-a").unwrap();
    assert_eq!(
        a.key_prefixes,
        [&hash_key("sk-a-1")[..8], &hash_key("sk-a-2")[..8]]
    );
    assert_eq!(a.quota.requests_per_minute, Some(60));
    assert_eq!(a.quota.budget_per_month, Some(10_000_000));
}

#[test]
fn api_keys_file_keys_are_the_default_tenant_or_join_the_document_s() {
    let implicit = ImplicitKeys::from_keys(["legacy-1", "legacy-2"]).unwrap();
    let store = TenantStore::new(Some(implicit), 10);
    let s = store.load();
    assert_eq!(
        id(s.authenticate(Some("legacy-2"))),
        Ok(Some("default".into()))
    );
    assert!(!s.tenant("default").unwrap().quota.is_limited());

    store.apply(&doc(1), TenantSource::Redis, false).unwrap();
    let s = store.load();
    assert_eq!(
        id(s.authenticate(Some("legacy-1"))),
        Ok(Some("default".into()))
    );
    assert_eq!(
        id(s.authenticate(Some("sk-b-1"))),
        Ok(Some("team-b".into()))
    );

    let mut with_default = doc(2);
    with_default.tenants[2].id = "default".into();
    store
        .apply(&with_default, TenantSource::Redis, false)
        .unwrap();
    let s = store.load();
    assert_eq!(
        s.tenants.len(),
        3,
        "the keys joined the document's default tenant"
    );
    assert_eq!(
        id(s.authenticate(Some("legacy-1"))),
        Ok(Some("default".into()))
    );
    assert_eq!(
        id(s.authenticate(Some("sk-c-1"))),
        Ok(Some("default".into()))
    );
    assert_eq!(s.tenant("default").unwrap().priority, -1);
}

#[test]
fn an_unusable_api_keys_file_key_is_an_error_that_does_not_quote_it() {
    let err = ImplicitKeys::from_keys(["good", "bad key"]).unwrap_err();
    assert_eq!(
        err,
        "API key number 2 is not 1 to 256 visible ASCII characters"
    );
}

#[test]
fn redis_outranks_the_file_and_older_versions_are_refused() {
    let store = TenantStore::new(None, 10);
    store.apply(&doc(5), TenantSource::Redis, false).unwrap();
    assert!(matches!(
        store.apply(&doc(9), TenantSource::File, true),
        Err(RejectReason::Outranked { .. })
    ));
    assert!(matches!(
        store.apply(&doc(5), TenantSource::Redis, false),
        Err(RejectReason::Stale {
            offered: 5,
            active: 5
        })
    ));
    assert!(matches!(
        store.apply(&doc(4), TenantSource::Redis, false),
        Err(RejectReason::Stale { .. })
    ));
    store.apply(&doc(6), TenantSource::Redis, false).unwrap();
    assert_eq!(store.load().version, 6);
    let mut invalid = doc(7);
    invalid.tenants[1].id = "team-a".into();
    assert!(matches!(
        store.apply(&invalid, TenantSource::Redis, false),
        Err(RejectReason::Invalid(_))
    ));
    assert_eq!(
        store.load().version,
        6,
        "an invalid document never replaces a good one"
    );
}

#[test]
fn overrides_carry_the_floor_the_allowed_profiles_and_the_downgrade() {
    let store = TenantStore::new(None, 10);
    store.apply(&doc(1), TenantSource::File, true).unwrap();
    let s = store.load();
    let a = s.tenant("team-a").unwrap();
    let base = Overrides {
        profile: Some("llama8b-fp8"),
        ..Overrides::default()
    };
    let o = a.overrides(base, true);
    assert_eq!(o.profile, Some("llama8b-fp8"));
    assert_eq!(o.quality_floor, Some(0.85));
    assert_eq!(o.allowed_profiles, Some(&["llama8b-fp8".to_owned()][..]));
    assert_eq!(o.downgrade, Some(Downgrade::NEAR_LIMIT));
    assert_eq!(a.overrides(base, false).downgrade, None);
    // The tenant's risk tolerance, unless the request named its own.
    assert_eq!(o.risk_tolerance, Some(0.2));
    let own = Overrides {
        risk_tolerance: Some(0.01),
        ..base
    };
    assert_eq!(a.overrides(own, false).risk_tolerance, Some(0.01));
    assert_eq!(
        s.tenant("team-b")
            .unwrap()
            .overrides(base, false)
            .risk_tolerance,
        None
    );
}

#[test]
fn only_the_top_tenants_get_a_metric_label_of_their_own() {
    let store = TenantStore::new(None, 2);
    store.apply(&doc(1), TenantSource::File, true).unwrap();
    let s = store.load();
    let label = |id: &str| s.tenant(id).unwrap().label.to_string();
    // Equal priority 3: team-a has a monthly budget, team-b none (unlimited ranks first).
    assert_eq!(label("team-b"), "team-b");
    assert_eq!(label("team-a"), "team-a");
    assert_eq!(label("batch"), "other");
    let store = TenantStore::new(None, 1);
    store.apply(&doc(1), TenantSource::File, true).unwrap();
    let s = store.load();
    assert_eq!(&*s.tenant("team-a").unwrap().label, "other");
    assert_eq!(&*s.tenant("team-b").unwrap().label, "team-b");
}

#[test]
fn history_describes_tenants_and_keys_without_them() {
    let value = serde_json::to_value(doc(1)).unwrap();
    assert_eq!(TenantDocument::describe(&value), "3 tenants, 4 keys");
}
