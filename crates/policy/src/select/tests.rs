use super::*;
use crate::features::{Prompt, Role, Segment};
use crate::DEFAULT_PROFILE_SET;

fn set() -> ProfileSet {
    ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap()
}

fn features_of(set: &ProfileSet, text: &str) -> Features {
    let prompt = Prompt {
        segments: vec![Segment {
            role: Role::User,
            text,
        }],
        wants_json: false,
    };
    Features::extract(&prompt, &set.policy.complexity).unwrap()
}

fn route(
    set: &ProfileSet,
    text: &str,
    overrides: Overrides<'_>,
    load: &[ProfileLoad],
) -> Result<RoutingDecision, RouteError> {
    let f = features_of(set, text);
    decide(
        set,
        &RouteRequest {
            features: &f,
            max_tokens: Some(64),
            overrides,
            routing_key: "k",
        },
        load,
    )
}

fn tier(set: &ProfileSet, d: &RoutingDecision) -> String {
    set.profiles[d.profile].tier.clone()
}

const SIMPLE: &str = "What is the capital of France?";
const CODE: &str = "Write a Python class for a binary search tree:\n```python\nclass BST:\n    def insert(self, key):\n        pass\n```";

#[test]
fn simple_prompt_goes_to_the_cheapest_profile() {
    let s = set();
    let d = route(&s, SIMPLE, Overrides::default(), &[]).unwrap();
    assert_eq!(tier(&s, &d), "int4");
    assert_eq!(d.reason, Reason::Utility);
    assert_eq!(d.candidates.len(), 3);
    assert!(d.candidates.iter().all(|c| c.feasible));
}

#[test]
fn code_prompt_avoids_the_int4_profile() {
    let s = set();
    let d = route(&s, CODE, Overrides::default(), &[]).unwrap();
    assert_ne!(tier(&s, &d), "int4");
    let awq = d.candidate(s.index_of("llama8b-awq").unwrap()).unwrap();
    assert_eq!(awq.rejected_because, Some(Rejection::QualityBelowRequired));
}

#[test]
fn min_quality_override_raises_the_tier() {
    let s = set();
    let o = Overrides {
        min_quality: Some(0.96),
        ..Overrides::default()
    };
    let d = route(&s, SIMPLE, o, &[]).unwrap();
    assert_eq!(tier(&s, &d), "fp16");
    assert_eq!(d.required_quality, 0.96);
}

#[test]
fn tight_latency_budget_rejects_slow_profiles() {
    let s = set();
    let o = Overrides {
        latency_budget_ms: Some(500.0),
        min_quality: Some(0.96),
        ..Overrides::default()
    };
    let d = route(&s, SIMPLE, o, &[]).unwrap();
    // fp16 meets quality but not the budget; nothing is feasible.
    assert_eq!(d.reason, Reason::ConstraintsUnmet);
    assert_eq!(tier(&s, &d), "fp16");
    let fp16 = d.candidate(d.profile).unwrap();
    assert_eq!(fp16.rejected_because, Some(Rejection::LatencyOverBudget));
}

#[test]
fn queue_wait_shifts_traffic_away_from_a_busy_profile() {
    let s = set();
    let awq = s.index_of("llama8b-awq").unwrap();
    let mut load = vec![ProfileLoad::default(); 3];
    load[awq].queue_wait_ms = 60_000.0;
    let d = route(&s, SIMPLE, Overrides::default(), &load).unwrap();
    assert_ne!(d.profile, awq);
    assert_eq!(
        d.candidate(awq).unwrap().rejected_because,
        Some(Rejection::LatencyOverBudget)
    );
}

#[test]
fn unavailable_profiles_are_never_chosen() {
    let s = set();
    let awq = s.index_of("llama8b-awq").unwrap();
    let mut load = vec![ProfileLoad::default(); 3];
    load[awq].available = false;
    let d = route(&s, SIMPLE, Overrides::default(), &load).unwrap();
    assert_ne!(d.profile, awq);
    let none = vec![
        ProfileLoad {
            available: false,
            ..ProfileLoad::default()
        };
        3
    ];
    assert_eq!(
        route(&s, SIMPLE, Overrides::default(), &none),
        Err(RouteError::NoAvailableProfile)
    );
}

#[test]
fn context_too_small_is_rejected() {
    let mut s = set();
    let awq = s.index_of("llama8b-awq").unwrap();
    s.profiles[awq].max_context_tokens = 50;
    let d = route(&s, SIMPLE, Overrides::default(), &[]).unwrap();
    assert_ne!(d.profile, awq);
    assert_eq!(
        d.candidate(awq).unwrap().rejected_because,
        Some(Rejection::ContextTooSmall)
    );
}

#[test]
fn with_nothing_feasible_a_profile_the_prompt_fits_beats_a_better_one_it_does_not() {
    let mut s = set();
    let awq = s.index_of("llama8b-awq").unwrap();
    for p in &mut s.profiles {
        p.max_context_tokens = if p.id == "llama8b-awq" { 32_768 } else { 4_096 };
    }
    // About 6,000 tokens: only awq holds it, and a long wait puts it over the budget.
    let prompt = "word ".repeat(4_800);
    let mut load = vec![ProfileLoad::default(); 3];
    load[awq].queue_wait_ms = 10_000.0;
    let d = route(&s, &prompt, Overrides::default(), &load).unwrap();
    assert_eq!(d.reason, Reason::ConstraintsUnmet);
    assert_eq!(d.profile, awq, "the only profile that can answer at all");
    assert_eq!(
        d.candidate(awq).unwrap().rejected_because,
        Some(Rejection::LatencyOverBudget)
    );
    // When no context holds it, the best quality still wins (its upstream says why not).
    load[awq].available = false;
    let d = route(&s, &prompt, Overrides::default(), &load).unwrap();
    assert_eq!(d.reason, Reason::ConstraintsUnmet);
    assert_eq!(tier(&s, &d), "fp16");
}

#[test]
fn a_learned_chars_per_token_replaces_the_profile_figure_in_the_context_check() {
    let mut s = set();
    let awq = s.index_of("llama8b-awq").unwrap();
    // 400 bytes: 100 tokens at the profile's 4.0, 200 at a learned 2.0; plus 64 out.
    s.profiles[awq].max_context_tokens = 250;
    let prompt = "word ".repeat(80);
    let d = route(&s, &prompt, Overrides::default(), &[]).unwrap();
    assert!(d.candidate(awq).unwrap().feasible);
    let mut load = vec![ProfileLoad::default(); 3];
    load[awq].chars_per_token = Some(2.0);
    let d = route(&s, &prompt, Overrides::default(), &load).unwrap();
    let c = d.candidate(awq).unwrap();
    assert_eq!(c.rejected_because, Some(Rejection::ContextTooSmall));
    assert_eq!(c.estimated_input_tokens, 200 + 4);
    // Nonsense figures are ignored, not divided by.
    load[awq].chars_per_token = Some(f64::NAN);
    let d = route(&s, &prompt, Overrides::default(), &load).unwrap();
    assert!(d.candidate(awq).unwrap().feasible);
}

#[test]
fn pinning_by_id_wins_and_unknown_pins_are_errors() {
    let s = set();
    let o = Overrides {
        profile: Some("llama8b-fp16"),
        ..Overrides::default()
    };
    let d = route(&s, SIMPLE, o, &[]).unwrap();
    assert_eq!((tier(&s, &d).as_str(), d.reason), ("fp16", Reason::Pinned));
    assert_eq!(s.profiles[d.adaptive_profile].tier, "int4");
    let o = Overrides {
        profile: Some("gpt-9"),
        ..Overrides::default()
    };
    assert_eq!(
        route(&s, SIMPLE, o, &[]),
        Err(RouteError::UnknownProfile("gpt-9".into()))
    );
}

#[test]
fn disabled_profiles_are_not_candidates() {
    let mut s = set();
    let awq = s.index_of("llama8b-awq").unwrap();
    s.profiles[awq].enabled = false;
    let d = route(&s, SIMPLE, Overrides::default(), &[]).unwrap();
    assert_eq!(d.candidates.len(), 2);
    assert!(d.candidate(awq).is_none());
    let o = Overrides {
        profile: Some("llama8b-awq"),
        ..Overrides::default()
    };
    assert!(matches!(
        route(&s, SIMPLE, o, &[]),
        Err(RouteError::UnknownProfile(_))
    ));
}

#[test]
fn shadow_mode_sends_everything_to_the_default() {
    let mut s = set();
    s.policy.mode = Mode::Shadow;
    let d = route(&s, SIMPLE, Overrides::default(), &[]).unwrap();
    assert_eq!((d.profile, d.reason), (s.default_index(), Reason::Shadow));
    assert_eq!(s.profiles[d.adaptive_profile].tier, "int4");
}

#[test]
fn canary_splits_by_stable_key() {
    let mut s = set();
    s.policy.mode = Mode::Canary;
    s.policy.canary_percent = 30;
    let f = features_of(&s, SIMPLE);
    let mut adaptive = 0;
    for i in 0..1000 {
        let key = format!("user-{i}");
        let req = RouteRequest {
            features: &f,
            max_tokens: None,
            overrides: Overrides::default(),
            routing_key: &key,
        };
        let d = decide(&s, &req, &[]).unwrap();
        let again = decide(&s, &req, &[]).unwrap();
        assert_eq!(d.profile, again.profile, "same key, same group");
        match d.reason {
            Reason::Utility => adaptive += 1,
            Reason::CanaryControl => assert_eq!(d.profile, s.default_index()),
            other => panic!("unexpected reason {other:?}"),
        }
    }
    assert!(
        (220..=380).contains(&adaptive),
        "{adaptive} of 1000 adaptive at 30%"
    );
}

#[test]
fn ties_go_to_the_cheaper_profile_then_the_id() {
    let mut s = set();
    let (quality, latency) = (s.profiles[0].quality, s.profiles[0].latency);
    for p in &mut s.profiles {
        p.quality = quality;
        p.latency = latency;
        p.cost_per_1m_input_tokens = 1.0;
        p.cost_per_1m_output_tokens = 1.0;
    }
    let d = route(&s, SIMPLE, Overrides::default(), &[]).unwrap();
    assert_eq!(
        s.profiles[d.profile].id, "llama8b-awq",
        "all equal: smallest id"
    );
    s.profiles[1].cost_per_1m_output_tokens = 0.5;
    s.policy.weights.cost = 0.0;
    let d = route(&s, SIMPLE, Overrides::default(), &[]).unwrap();
    assert_eq!(
        d.profile,
        ProfileIndex::new(1),
        "equal utility: cheaper wins"
    );
}

#[test]
fn fallback_orders_prefer_equal_or_better_quality() {
    let s = set();
    let d = route(&s, SIMPLE, Overrides::default(), &[]).unwrap();
    let awq = s.index_of("llama8b-awq").unwrap();
    let fp8 = s.index_of("llama8b-fp8").unwrap();
    let fp16 = s.index_of("llama8b-fp16").unwrap();
    assert_eq!(d.next_after_error(&[awq]), Some(fp8));
    assert_eq!(d.next_after_error(&[awq, fp8]), Some(fp16));
    assert_eq!(d.next_after_error(&[awq, fp8, fp16]), None);
    assert_eq!(d.next_higher_quality(awq), Some(fp8));
    assert_eq!(d.next_higher_quality(fp8), Some(fp16));
    assert_eq!(d.next_higher_quality(fp16), None);
    // A quality fallback from fp8 never comes back to it nor goes below it.
    assert_eq!(d.no_better_than(fp8), vec![fp8, awq]);
    assert_eq!(d.next_after_error(&[fp8, awq, fp16]), None);
}

#[test]
fn cost_and_latency_follow_the_formulas() {
    let s = set();
    let f = features_of(&s, SIMPLE);
    let d = decide(
        &s,
        &RouteRequest {
            features: &f,
            max_tokens: Some(100),
            overrides: Overrides::default(),
            routing_key: "",
        },
        &[],
    )
    .unwrap();
    let fp16 = &s.profiles[0];
    let c = d.candidate(ProfileIndex::new(0)).unwrap();
    let input = f.estimated_input_tokens(4.0) as f64;
    assert!((c.predicted_latency_ms - (60.0 + 12.0 * 100.0)).abs() < 1e-9);
    let cost =
        input * fp16.cost_per_1m_input_tokens / 1e6 + 100.0 * fp16.cost_per_1m_output_tokens / 1e6;
    assert!((c.cost - cost).abs() < 1e-15);
    // fp16 is the costliest candidate, so its cost term is exactly w_c.
    let u = 1.0 * c.quality - 0.3 * c.predicted_latency_ms / 8000.0 - 0.5;
    assert!((c.utility - u).abs() < 1e-12);
}

#[test]
fn max_tokens_caps_the_expected_output() {
    let s = set();
    let f = features_of(&s, SIMPLE);
    let req = |m| RouteRequest {
        features: &f,
        max_tokens: m,
        overrides: Overrides::default(),
        routing_key: "",
    };
    assert_eq!(
        decide(&s, &req(Some(10)), &[])
            .unwrap()
            .expected_output_tokens,
        10
    );
    assert_eq!(
        decide(&s, &req(Some(100_000)), &[])
            .unwrap()
            .expected_output_tokens,
        256
    );
    assert_eq!(
        decide(&s, &req(None), &[]).unwrap().expected_output_tokens,
        256
    );
    // A huge max_tokens does not fit any context: nothing feasible.
    let d = decide(&s, &req(Some(100_000)), &[]).unwrap();
    assert!(d
        .candidates
        .iter()
        .all(|c| c.rejected_because == Some(Rejection::ContextTooSmall)));
    assert_eq!(d.reason, Reason::ConstraintsUnmet);
    // As a ceiling (an agent API's reading) it excludes nothing: routed by utility.
    let ceiling = RouteRequest {
        overrides: Overrides {
            output_ceiling: true,
            ..Overrides::default()
        },
        ..req(Some(100_000))
    };
    let d = decide(&s, &ceiling, &[]).unwrap();
    assert_eq!(d.reason, Reason::Utility);
    assert!(d.candidates.iter().all(|c| c.feasible));
    assert_eq!(d.expected_output_tokens, 256);
}

#[test]
fn a_ceiling_is_cut_to_the_context_left_beside_the_prompt() {
    let rule = crate::OutputCeiling::default();
    // 16,384 − ⌈4,000 × 1.1⌉ = 11,984.
    assert_eq!(rule.clamp(32_000, 16_384, 4_000), 11_984);
    assert_eq!(rule.clamp(512, 16_384, 4_000), 512);
    // A prompt that fills the context leaves the least there is.
    assert_eq!(rule.clamp(32_000, 16_384, 16_000), 1);
    let exact = crate::OutputCeiling {
        prompt_margin: 0.0,
        ..rule
    };
    assert_eq!(exact.clamp(32_000, 16_384, 4_000), 12_384);
}

#[test]
fn queue_wait_grows_with_load_beyond_capacity() {
    let s = set();
    let p = &s.profiles[0];
    assert_eq!(queue_wait_ms(p, u64::from(p.max_concurrency), 0, 100), 0.0);
    let one_round = p.latency.ttft_ms + p.latency.itl_ms * 100.0;
    let w = queue_wait_ms(p, u64::from(p.max_concurrency) * 2, 0, 100);
    assert!((w - one_round).abs() < 1e-9, "{w}");
    assert!(queue_wait_ms(p, 0, 10, 100) > 0.0);
}

#[test]
fn all_lists_every_reason_once_in_order() {
    for (i, reason) in Reason::ALL.iter().enumerate() {
        // Exhaustive: a new variant does not compile here until `ALL` has it too.
        let position = match reason {
            Reason::Utility => 0,
            Reason::Pinned => 1,
            Reason::ConstraintsUnmet => 2,
            Reason::Shadow => 3,
            Reason::CanaryControl => 4,
            Reason::FallbackError => 5,
            Reason::FallbackQuality => 6,
            Reason::ColdStartAvoided => 7,
            Reason::BudgetDowngrade => 8,
        };
        assert_eq!(i, position, "{}", reason.as_str());
        assert_eq!(reason.index(), i, "{}", reason.as_str());
    }
}

#[test]
fn a_downgrade_routes_a_code_prompt_to_the_cheapest_feasible_tier() {
    let s = set();
    let normal = route(&s, CODE, Overrides::default(), &[]).unwrap();
    assert_ne!(tier(&s, &normal), "int4");
    let o = Overrides {
        downgrade: Some(Downgrade::NEAR_LIMIT),
        ..Overrides::default()
    };
    let d = route(&s, CODE, o, &[]).unwrap();
    assert_eq!(tier(&s, &d), "int4");
    assert_eq!(d.reason, Reason::BudgetDowngrade);
    assert!((d.required_quality - (normal.required_quality - 0.1)).abs() < 1e-12);
    assert_eq!(d.reason.as_str(), "budget_downgrade");
}

#[test]
fn the_quality_floor_bounds_a_downgrade_and_raises_normal_routing() {
    let s = set();
    let o = Overrides {
        downgrade: Some(Downgrade::NEAR_LIMIT),
        quality_floor: Some(0.9),
        ..Overrides::default()
    };
    let d = route(&s, CODE, o, &[]).unwrap();
    assert_eq!(d.required_quality, 0.9);
    assert_ne!(
        tier(&s, &d),
        "int4",
        "int4's code quality 0.80 is under the floor"
    );
    let o = Overrides {
        quality_floor: Some(0.96),
        ..Overrides::default()
    };
    let d = route(&s, SIMPLE, o, &[]).unwrap();
    assert_eq!(tier(&s, &d), "fp16");
}

#[test]
fn a_downgrade_does_not_move_a_pinned_request() {
    let s = set();
    let o = Overrides {
        downgrade: Some(Downgrade::NEAR_LIMIT),
        profile: Some("llama8b-fp16"),
        ..Overrides::default()
    };
    let d = route(&s, SIMPLE, o, &[]).unwrap();
    assert_eq!(
        (tier(&s, &d), d.reason),
        ("fp16".to_owned(), Reason::Pinned)
    );
}

#[test]
fn profiles_outside_the_allowed_list_are_not_candidates_nor_pinnable() {
    let s = set();
    let allowed = ["llama8b-fp8".to_owned(), "llama8b-fp16".to_owned()];
    let o = Overrides {
        allowed_profiles: Some(&allowed),
        ..Overrides::default()
    };
    let d = route(&s, SIMPLE, o, &[]).unwrap();
    assert_eq!(tier(&s, &d), "fp8");
    assert_eq!(d.candidates.len(), 2);
    let pinned = Overrides {
        profile: Some("llama8b-awq"),
        ..o
    };
    assert_eq!(
        route(&s, SIMPLE, pinned, &[]).unwrap_err(),
        RouteError::UnknownProfile("llama8b-awq".into())
    );
    // Only int4 allowed, and it is down: nothing else may stand in.
    let only_int4 = ["llama8b-awq".to_owned()];
    let o = Overrides {
        allowed_profiles: Some(&only_int4),
        ..Overrides::default()
    };
    let load = [
        ProfileLoad::default(),
        ProfileLoad::default(),
        ProfileLoad {
            available: false,
            ..ProfileLoad::default()
        },
    ];
    assert_eq!(
        route(&s, SIMPLE, o, &load).unwrap_err(),
        RouteError::NoAvailableProfile
    );
}

/// A hard math prompt, as the classifier scores a GSM8K problem: complexity high enough
/// that no profile meets the required quality, and the outcome head's `risk`.
fn hard_math(set: &ProfileSet, risk: Option<f64>) -> Features {
    let mut f = features_of(
        set,
        "Sam has 3 boxes of 12 pens. He gives away 5. How many are left?",
    );
    f.task_class = TaskClass::Math;
    f.complexity = 0.95;
    f.risk = risk;
    f
}

fn route_features(set: &ProfileSet, f: &Features, overrides: Overrides<'_>) -> RoutingDecision {
    decide(
        set,
        &RouteRequest {
            features: f,
            max_tokens: Some(64),
            overrides,
            routing_key: "k",
        },
        &[],
    )
    .unwrap()
}

fn with_tolerance(t: f64) -> ProfileSet {
    let mut s = set();
    s.policy.risk_tolerance = t;
    s
}

#[test]
fn a_low_risk_prompt_goes_to_a_cheaper_profile_within_the_tolerance() {
    let s = with_tolerance(0.1);
    // Without a risk (no outcome head for this class) the required quality alone decides.
    let none = route_features(&s, &hard_math(&s, None), Overrides::default());
    assert_eq!(tier(&s, &none), "fp16");
    assert_eq!(none.reason, Reason::ConstraintsUnmet);
    // FP8 gives up a fifth of FP16-to-INT4's math quality gap: a fifth of the risk.
    let low = route_features(&s, &hard_math(&s, Some(0.3)), Overrides::default());
    assert_eq!(tier(&s, &low), "fp8");
    let fp8 = low.candidate(s.index_of("llama8b-fp8").unwrap()).unwrap();
    assert!((fp8.risk.unwrap() - 0.06).abs() < 1e-9, "{fp8:?}");
    assert_eq!(low.risk, Some(0.3));
    let high = route_features(&s, &hard_math(&s, Some(0.8)), Overrides::default());
    assert_eq!(tier(&s, &high), "fp16");
    // However low its risk, a hard prompt does not reach the tier kept for light ones...
    let lowest = route_features(&s, &hard_math(&s, Some(0.01)), Overrides::default());
    assert_eq!(tier(&s, &lowest), "fp8");
    // ...but a prompt of middling complexity does: the cheapest carries the whole risk.
    let mut medium = hard_math(&s, Some(0.05));
    medium.task_class = TaskClass::Reasoning;
    medium.complexity = 0.3;
    let d = route_features(&s, &medium, Overrides::default());
    assert_eq!(tier(&s, &d), "int4");
    medium.risk = Some(0.2);
    assert_eq!(
        tier(&s, &route_features(&s, &medium, Overrides::default())),
        "fp8"
    );
    medium.risk = None;
    assert_eq!(
        tier(&s, &route_features(&s, &medium, Overrides::default())),
        "fp8"
    );
}

#[test]
fn the_risk_tolerance_comes_from_the_request_before_the_set_and_zero_is_off() {
    let s = with_tolerance(0.1);
    let f = hard_math(&s, Some(0.3));
    let off = Overrides {
        risk_tolerance: Some(0.0),
        ..Overrides::default()
    };
    assert_eq!(tier(&s, &route_features(&s, &f, off)), "fp16");
    let strict = Overrides {
        risk_tolerance: Some(0.05),
        ..Overrides::default()
    };
    let d = route_features(&s, &f, strict);
    assert_eq!(tier(&s, &d), "fp16");
    assert_eq!(d.risk_tolerance, 0.05);
    assert_eq!(
        tier(&s, &route_features(&s, &f, Overrides::default())),
        "fp8"
    );
    assert_eq!(
        tier(
            &s,
            &route_features(&with_tolerance(0.0), &f, Overrides::default())
        ),
        "fp16"
    );
}

#[test]
fn the_risk_rule_keeps_the_tenant_floor_and_an_explicit_minimum_quality() {
    let s = with_tolerance(0.5);
    let f = hard_math(&s, Some(0.3));
    assert_eq!(
        tier(&s, &route_features(&s, &f, Overrides::default())),
        "fp8"
    );
    let floor = Overrides {
        quality_floor: Some(0.91),
        ..Overrides::default()
    };
    assert_eq!(tier(&s, &route_features(&s, &f, floor)), "fp16");
    let explicit = Overrides {
        min_quality: Some(0.92),
        ..Overrides::default()
    };
    assert_eq!(tier(&s, &route_features(&s, &f, explicit)), "fp16");
}

#[test]
fn a_second_opinion_replaces_the_risk_where_the_head_speaks() {
    let s = with_tolerance(0.1);
    let rated = |digit| Overrides {
        second_opinion: crate::Rating::new(digit),
        ..Overrides::default()
    };
    // The head's 0.3 sends the hard problem to FP8; a rating of 9 (risk 1) keeps it on FP16.
    let f = hard_math(&s, Some(0.3));
    let d = route_features(&s, &f, rated(9));
    assert_eq!(tier(&s, &d), "fp16");
    assert_eq!(d.risk, Some(1.0));
    let used = d.second_opinion.unwrap();
    assert_eq!(
        (used.rating.digit(), used.model_risk, used.changed),
        (9, 0.3, true)
    );
    // A rating that agrees with the head changes nothing, and says so.
    let d = route_features(&s, &f, rated(1));
    assert_eq!(tier(&s, &d), "fp8");
    assert!(!d.second_opinion.unwrap().changed);
    // Without the head's risk (its class uncovered) a rating is not used.
    let d = route_features(&s, &hard_math(&s, None), rated(0));
    assert_eq!(tier(&s, &d), "fp16");
    assert_eq!((d.risk, d.second_opinion), (None, None));
}
