//! Properties of features and selection that must hold for any input.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use proptest::prelude::*;
use quantrouter_policy::{
    decide, ComplexityWeights, Features, Overrides, ProfileLoad, ProfileSet, Prompt, Role,
    RouteRequest, Segment, DEFAULT_PROFILE_SET,
};

fn default_set() -> ProfileSet {
    ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap()
}

fn features(text: &str, wants_json: bool) -> Option<Features> {
    let prompt = Prompt {
        segments: vec![Segment {
            role: Role::User,
            text,
        }],
        wants_json,
    };
    Features::extract(&prompt, &ComplexityWeights::default()).ok()
}

/// Text that mixes ASCII, code, digits, RTL, emoji and control characters.
fn any_text() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        "[ -~\\n]{0,600}",
        "[\u{0590}-\u{05FF}\u{0600}-\u{06FF} ]{1,200}",
        "[\u{1F300}-\u{1F6FF}0-9+*/=^ ]{1,200}",
        proptest::collection::vec(any::<u8>(), 0..2000)
            .prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
    ]
}

fn loads() -> impl Strategy<Value = Vec<ProfileLoad>> {
    proptest::collection::vec(
        (any::<bool>(), 0.0f64..20_000.0).prop_map(|(available, queue_wait_ms)| ProfileLoad {
            available,
            queue_wait_ms,
            chars_per_token: None,
        }),
        3,
    )
}

proptest! {
    #[test]
    fn complexity_is_always_a_unit_score(text in any_text(), json in any::<bool>()) {
        if let Some(f) = features(&text, json) {
            for v in [f.complexity, f.entropy, f.lexical, f.code, f.math, f.json, f.numeric, f.length] {
                prop_assert!((0.0..=1.0).contains(&v), "{f:?}");
            }
        } else {
            prop_assert!(text.trim().is_empty());
        }
    }

    #[test]
    fn decision_is_an_enabled_available_profile_when_one_exists(
        text in "[ -~]{1,300}", load in loads(), disabled in 0usize..4
    ) {
        let mut set = default_set();
        if disabled < 3 {
            set.profiles[disabled].enabled = false;
        }
        let Some(f) = features(&text, false) else { return Ok(()) };
        let req = RouteRequest { features: &f, max_tokens: Some(64), overrides: Overrides::default(), routing_key: "k" };
        let any_ok = set.profiles.iter().zip(&load).any(|(p, l)| p.enabled && l.available);
        match decide(&set, &req, &load) {
            Ok(d) => {
                prop_assert!(set.profiles[d.profile].enabled);
                prop_assert!(load[d.profile].available);
            }
            Err(_) => prop_assert!(!any_ok),
        }
    }

    #[test]
    fn raising_the_budget_never_shrinks_the_feasible_set(
        text in "[ -~]{1,300}", load in loads(), low in 100.0f64..10_000.0, extra in 0.0f64..10_000.0
    ) {
        let set = default_set();
        let Some(f) = features(&text, false) else { return Ok(()) };
        let feasible = |budget: f64| {
            let req = RouteRequest {
                features: &f,
                max_tokens: Some(128),
                overrides: Overrides { latency_budget_ms: Some(budget), ..Overrides::default() },
                routing_key: "k",
            };
            decide(&set, &req, &load)
                .map(|d| d.candidates.iter().filter(|c| c.feasible).map(|c| c.profile).collect::<Vec<_>>())
                .unwrap_or_default()
        };
        let small = feasible(low);
        let large = feasible(low + extra);
        prop_assert!(small.iter().all(|p| large.contains(p)), "{small:?} ⊄ {large:?}");
    }

    #[test]
    fn a_dominated_profile_never_wins(
        text in "[ -~]{1,300}", q in 0.5f64..0.99, dq in 0.0f64..0.01,
        cost in 0.01f64..1.0, dc in 0.0f64..1.0, ttft in 1.0f64..100.0, dl in 0.0f64..50.0
    ) {
        // Profile 0 is at least as good as profile 1 on quality, latency and cost.
        let mut set = default_set();
        set.profiles.truncate(2);
        set.default_profile = set.profiles[0].id.clone();
        let (a, b) = (0, 1);
        for (i, (quality, cost, ttft)) in [(q + dq, cost, ttft), (q, cost + dc, ttft + dl)].into_iter().enumerate() {
            let p = &mut set.profiles[i];
            p.quality = quantrouter_policy::Quality { default: quality, code: None, math: None, structured: None, reasoning: None };
            p.cost_per_1m_input_tokens = cost;
            p.cost_per_1m_output_tokens = cost;
            p.latency.ttft_ms = ttft;
            p.latency.itl_ms = 5.0;
        }
        prop_assume!(dq > 0.0 || dc > 0.0 || dl > 0.0);
        let Some(f) = features(&text, false) else { return Ok(()) };
        let req = RouteRequest { features: &f, max_tokens: Some(64), overrides: Overrides::default(), routing_key: "k" };
        let d = decide(&set, &req, &[]).unwrap();
        prop_assert_eq!(d.profile.get(), a, "dominated profile {} won", b);
    }

    #[test]
    fn under_a_ceiling_only_a_prompt_too_long_excludes_a_profile(
        words in 1usize..6_000, max_tokens in 1u32..200_000, context in 256u32..20_000
    ) {
        let mut set = default_set();
        for p in &mut set.profiles {
            p.max_context_tokens = context;
        }
        let text = "word ".repeat(words);
        let Some(f) = features(&text, false) else { return Ok(()) };
        let req = RouteRequest {
            features: &f,
            max_tokens: Some(max_tokens),
            overrides: Overrides { output_ceiling: true, ..Overrides::default() },
            routing_key: "k",
        };
        let d = decide(&set, &req, &[]).unwrap();
        for c in &d.candidates {
            let too_long = c.estimated_input_tokens >= u64::from(context);
            let excluded = c.rejected_because == Some(quantrouter_policy::Rejection::ContextTooSmall);
            prop_assert_eq!(excluded, too_long, "{:?}", c);
        }
        // Latency and cost are predicted for the expected output, never the ceiling.
        prop_assert!(d.expected_output_tokens <= set.policy.expected_output_tokens);
        // What each upstream is sent: never above the request's, and within its context
        // beside the prompt with the margin whenever that leaves any room.
        let rule = &set.policy.output_ceiling;
        for c in &d.candidates {
            let sent = rule.clamp(max_tokens, context, c.estimated_input_tokens);
            prop_assert!(sent >= 1 && sent <= max_tokens);
            let prompt = (c.estimated_input_tokens as f64 * (1.0 + rule.prompt_margin)).ceil();
            if prompt < f64::from(context) {
                prop_assert!(f64::from(sent) + prompt <= f64::from(context));
            }
        }
    }

    #[test]
    fn decisions_are_deterministic(text in any_text(), key in "[a-z0-9]{0,12}", load in loads()) {
        let mut set = default_set();
        set.policy.mode = quantrouter_policy::Mode::Canary;
        set.policy.canary_percent = 50;
        let Some(f) = features(&text, false) else { return Ok(()) };
        let req = RouteRequest { features: &f, max_tokens: None, overrides: Overrides::default(), routing_key: &key };
        prop_assert_eq!(decide(&set, &req, &load), decide(&set, &req, &load));
    }
}

#[test]
fn complexity_of_a_megabyte_prompt_is_bounded_and_counts_every_byte() {
    let text = "∑ x^2 = 42; fn main() {} مرحبا 🚀 ".repeat(40_000);
    assert!(text.len() > 1_000_000);
    let f = features(&text, false).unwrap();
    assert!((0.0..=1.0).contains(&f.complexity));
    assert_eq!(f.prompt_bytes, text.len());
}
