use super::*;
use crate::features::Segment;
use crate::{decide, Features, Overrides, ProfileSet, RouteRequest, DEFAULT_PROFILE_SET};

fn prompt<'a>(messages: &[(Role, &'a str)]) -> Prompt<'a> {
    Prompt {
        segments: messages
            .iter()
            .map(|&(role, text)| Segment { role, text })
            .collect(),
        wants_json: false,
    }
}

fn load(load: u64, matched_blocks: usize) -> EndpointLoad {
    EndpointLoad {
        load,
        queued_blocks: 0,
        kv_usage: None,
        matched_blocks,
    }
}

fn queued(load: u64, queued_blocks: u64, matched_blocks: usize) -> EndpointLoad {
    EndpointLoad {
        queued_blocks,
        ..self::load(load, matched_blocks)
    }
}

/// The default rule with another load factor.
fn bounded(max_load_factor: f64) -> Affinity {
    Affinity {
        max_load_factor,
        ..Affinity::default()
    }
}

/// A prompt of 40 blocks, the default rule.
fn choose(endpoints: &[EndpointLoad], tie: u64) -> Option<EndpointChoice> {
    choose_endpoint(endpoints, 40, &Affinity::default(), tie)
}

#[test]
fn a_follow_up_turn_shares_the_blocks_of_the_turn_before() {
    let system = "You are a support agent for a bank. ".repeat(20);
    let first = prompt(&[(Role::System, &system), (Role::User, "My card is blocked.")]);
    let answer = "I am sorry to hear that. ".repeat(5);
    let second = prompt(&[
        (Role::System, &system),
        (Role::User, "My card is blocked."),
        (Role::Assistant, &answer),
        (Role::User, "It says PIN locked."),
    ]);
    let a = prefix_blocks(KeyScope::NONE, &first);
    let b = prefix_blocks(KeyScope::NONE, &second);
    assert_eq!(
        a.len(),
        (system.len() + 2 + 1 + 2 + 19) / PREFIX_BLOCK_BYTES
    );
    assert!(b.len() > a.len());
    assert_eq!(
        a[..],
        b[..a.len()],
        "the next turn starts with the same blocks"
    );
    // The same text in another role, or behind another system prompt, shares nothing.
    let other = prompt(&[(Role::User, &system)]);
    assert_ne!(prefix_blocks(KeyScope::NONE, &other)[0], a[0]);
    let tail_only = prompt(&[(Role::System, "Be terse."), (Role::User, &system)]);
    assert!(prefix_blocks(KeyScope::NONE, &tail_only)
        .iter()
        .all(|h| !a.contains(h)));
}

#[test]
fn prefix_hashing_is_bounded_and_independent_of_message_splits() {
    let huge = "x".repeat(10 * MAX_PREFIX_BYTES);
    let blocks = prefix_blocks(KeyScope::NONE, &prompt(&[(Role::User, &huge)]));
    assert_eq!(blocks.len(), MAX_PREFIX_BYTES / PREFIX_BLOCK_BYTES);
    // Word-aligned or not, the bytes decide the hashes.
    let mut split = BlockHasher::new(usize::MAX, KeyScope::NONE);
    split.feed(b"abc");
    split.feed(&[b'd'; 125]);
    let mut whole = BlockHasher::new(usize::MAX, KeyScope::NONE);
    let mut bytes = b"abc".to_vec();
    bytes.extend([b'd'; 125]);
    whole.feed(&bytes);
    assert_eq!(split.blocks, whole.blocks);
    assert_eq!(split.blocks.len(), 2);
}

#[test]
fn conversation_key_prefers_session_then_user_then_opening_messages() {
    let key = |session, user, prompt: &Prompt<'_>| {
        conversation_key(KeyScope::NONE, session, user, prompt).map(|c| c.key)
    };
    let turn1 = prompt(&[(Role::System, "Be kind."), (Role::User, "Hi")]);
    let turn2 = prompt(&[
        (Role::System, "Be kind."),
        (Role::User, "Hi"),
        (Role::Assistant, "Hello!"),
        (Role::User, "Tell me a joke."),
    ]);
    let other = prompt(&[(Role::System, "Be kind."), (Role::User, "Hello")]);
    let opening = key(None, None, &turn1);
    assert!(opening.is_some());
    assert_eq!(opening, key(None, None, &turn2));
    assert_ne!(opening, key(None, None, &other));
    let by_user = key(None, Some("alice"), &turn1);
    assert_eq!(by_user, key(None, Some("alice"), &other));
    assert_ne!(by_user, opening);
    let by_session = key(Some("s-1"), Some("alice"), &turn1);
    assert_ne!(by_session, by_user);
    assert_eq!(by_session, key(Some("s-1"), Some("bob"), &other));
    // A session id and a user of the same text are different keys; empty ones are absent.
    assert_ne!(key(Some("x"), None, &turn1), key(None, Some("x"), &turn1));
    assert_eq!(key(Some(""), Some(""), &turn1), opening);
    assert_eq!(key(None, None, &prompt(&[])), None);
}

#[test]
fn only_a_named_or_continued_conversation_follows_its_earlier_turns() {
    let recall = |session, prompt: &Prompt<'_>| {
        conversation_key(KeyScope::NONE, session, None, prompt).map(|c| c.recall)
    };
    let first = prompt(&[(Role::User, "What is the capital of Spain?")]);
    assert_eq!(
        recall(None, &first),
        Some(false),
        "a first turn keeps nothing"
    );
    assert_eq!(
        recall(Some("s-1"), &first),
        Some(true),
        "a named session does"
    );
    let answered = prompt(&[
        (Role::User, "What is the capital of Spain?"),
        (Role::Assistant, "Madrid."),
        (Role::User, "And of France?"),
    ]);
    assert_eq!(recall(None, &answered), Some(true));
    // A tool's result implies the assistant's call before it, text or not.
    let tool = prompt(&[(Role::User, "Weather?"), (Role::Other, "{\"temp\": 21}")]);
    assert_eq!(recall(None, &tool), Some(true));
}

#[test]
fn keys_of_different_scopes_never_match() {
    let a = KeyScope::from_digest(&[1; 32]);
    let b = KeyScope::from_digest(&[2; 32]);
    let text = "You answer questions about one customer's orders. ".repeat(8);
    let turn = prompt(&[(Role::User, &text)]);
    let of = |scope| prefix_blocks(scope, &turn);
    assert_eq!(of(a), of(a));
    for (x, y) in [(a, b), (a, KeyScope::NONE)] {
        assert!(of(x).iter().all(|block| !of(y).contains(block)));
        let session = |scope| conversation_key(scope, Some("s-1"), None, &turn);
        assert_ne!(session(x), session(y));
        let opening = |scope| conversation_key(scope, None, None, &turn);
        assert_ne!(opening(x), opening(y));
    }
    // Salts split a scope: equal salts share, others do not.
    assert_eq!(a.salted("s"), a.salted("s"));
    assert_ne!(a.salted("s"), a.salted("t"));
    assert_ne!(a.salted("s"), b.salted("s"));
    assert_ne!(a.salted("s"), a);
}

#[test]
fn only_the_routers_own_choices_are_remembered() {
    let set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
    let turn = prompt(&[(Role::User, "Say hello.")]);
    let features = Features::extract(&turn, &set.policy.complexity).unwrap();
    let route = |profile| {
        let request = RouteRequest {
            features: &features,
            max_tokens: Some(8),
            overrides: Overrides {
                profile,
                ..Overrides::default()
            },
            routing_key: "r",
        };
        decide(&set, &request, &[]).unwrap()
    };
    assert!(remembers(&route(None)));
    assert!(!remembers(&route(Some("llama8b-fp16"))));
}

#[test]
fn a_prompt_goes_where_its_prefix_is_within_the_load_bound() {
    let endpoints = [load(1, 0), load(1, 12), load(0, 3)];
    let choice = choose(&endpoints, 0).unwrap();
    assert_eq!(
        choice,
        EndpointChoice {
            index: 1,
            uncached_blocks: 28,
            by_prefix: true
        }
    );
}

#[test]
fn a_warm_turn_leaves_its_cache_only_for_a_queue_longer_than_recomputing() {
    // 38 of the prompt's 40 blocks are cached at 0, where 100 blocks of cold prefill wait;
    // 1 runs nothing: 100 + 4 * 2 = 108 blocks of wait at 0 against 4 * 40 = 160 at 1.
    let home = |queued_blocks| queued(1, queued_blocks, 38);
    let choice = choose(&[home(100), load(0, 0)], 0).unwrap();
    assert_eq!((choice.index, choice.uncached_blocks), (0, 2));
    // Twice that queued there: computing the whole prompt at 1 is sooner.
    let choice = choose(&[home(200), load(0, 0)], 0).unwrap();
    assert_eq!(
        choice,
        EndpointChoice {
            index: 1,
            uncached_blocks: 40,
            by_prefix: false
        }
    );
    // Weighing recomputation as queued prefill, the turn leaves sooner.
    let eager = Affinity {
        recompute_weight: 1.0,
        ..Affinity::default()
    };
    let choice = choose_endpoint(&[home(100), load(0, 0)], 40, &eager, 0).unwrap();
    assert_eq!(choice.index, 1);
    // Among endpoints holding the same prefix, the one with less queued goes first, then
    // the less loaded.
    let endpoints = [queued(0, 30, 38), queued(2, 10, 38), queued(1, 10, 38)];
    assert_eq!(choose(&endpoints, 0).unwrap().index, 2);
    // Queued prefill never lifts an endpoint over the load bound.
    let endpoints = [queued(3, 0, 38), queued(1, 500, 0)];
    assert_eq!(choose(&endpoints, 0).unwrap().index, 1);
}

#[test]
fn a_hot_prefix_spreads_once_its_endpoint_is_loaded() {
    // Least load 4: the bound is 6.
    let endpoints = [load(7, 40), load(4, 0), load(5, 2)];
    let choice = choose(&endpoints, 0).unwrap();
    assert_eq!(
        choice,
        EndpointChoice {
            index: 2,
            uncached_blocks: 38,
            by_prefix: true
        }
    );
    let endpoints = [load(7, 40), load(4, 0), load(7, 2)];
    let choice = choose(&endpoints, 0).unwrap();
    assert_eq!(
        choice,
        EndpointChoice {
            index: 1,
            uncached_blocks: 40,
            by_prefix: false
        }
    );
    // With the least loaded idle, one request more is within the bound, two are not.
    assert_eq!(choose(&[load(1, 5), load(0, 0)], 0).unwrap().index, 0);
    assert_eq!(choose(&[load(2, 5), load(0, 0)], 0).unwrap().index, 1);
    // A larger factor lets the cache keep more.
    let endpoints = [load(4, 5), load(2, 0)];
    assert_eq!(choose(&endpoints, 0).unwrap().index, 1);
    let roomy = choose_endpoint(&endpoints, 40, &bounded(3.0), 0);
    assert_eq!(roomy.unwrap().index, 0);
}

#[test]
fn without_a_prefix_the_least_loaded_then_emptiest_cache_wins_and_ties_split() {
    let mut endpoints = [load(3, 0), load(2, 0), load(2, 0), load(5, 0)];
    let picks: Vec<usize> = (0..4)
        .map(|tie| choose(&endpoints, tie).unwrap().index)
        .collect();
    assert_eq!(picks, [1, 2, 1, 2]);
    assert!(!choose(&endpoints, 0).unwrap().by_prefix);
    endpoints[1].kv_usage = Some(0.9);
    endpoints[2].kv_usage = Some(0.2);
    assert_eq!(choose(&endpoints, 0).unwrap().index, 2);
    assert_eq!(choose(&[], 0), None);
    // The blocks past the hashed prefix count too.
    assert_eq!(prompt_blocks(MAX_PREFIX_BYTES * 2 + 1), 1025);
}

#[test]
fn prefix_table_forgets_least_recently_used_tails_first() {
    let mut table = PrefixTable::new(4);
    let conversation = [1, 2, 3];
    table.record(&conversation);
    assert_eq!(table.matched(&[1, 2, 3, 9]), 3);
    assert_eq!(
        table.matched(&[9, 2, 3]),
        0,
        "a match starts at the first block"
    );
    table.record(&[7, 8]);
    assert_eq!(table.len(), 4);
    assert_eq!(table.matched(&conversation), 2, "the tail went first");
    // Touching blocks again many times does not grow the table's bookkeeping without end.
    for _ in 0..100 {
        table.record(&[7, 8]);
    }
    assert!(table.uses.len() <= 2 * 4 + 2);
    assert_eq!(table.matched(&[7, 8]), 2);
}

fn decision_for(text: &str, min_quality: Option<f64>) -> (ProfileSet, RoutingDecision) {
    let set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
    let prompt = prompt(&[(Role::User, text)]);
    let features = Features::extract(&prompt, &set.policy.complexity).unwrap();
    let request = RouteRequest {
        features: &features,
        max_tokens: Some(64),
        overrides: Overrides {
            min_quality,
            ..Overrides::default()
        },
        routing_key: "k",
    };
    let decision = decide(&set, &request, &[]).unwrap();
    (set, decision)
}

#[test]
fn a_session_stays_on_its_profile_unless_quality_rules_it_out() {
    let (set, mut decision) = decision_for("Say hello.", None);
    let cheap = decision.profile;
    let best = set
        .indexed()
        .max_by(|a, b| a.1.quality.default.total_cmp(&b.1.quality.default))
        .unwrap()
        .0;
    assert_ne!(cheap, best);
    // The conversation ran on the best profile: it stays there.
    assert!(prefer_session(&mut decision, best));
    assert_eq!((decision.profile, decision.adaptive_profile), (best, best));
    assert_eq!(decision.reason, Reason::Utility);
    // Asked for more quality than the cheap profile has, a session there moves up.
    let (_, mut strict) = decision_for(
        "Say hello.",
        Some(0.99 * set.profiles[best].quality.default),
    );
    assert_eq!(strict.profile, best);
    assert!(!prefer_session(&mut strict, cheap));
    assert_eq!(strict.profile, best);
    // Pins are the client's word.
    let (_, mut pinned) = decision_for("Say hello.", None);
    pinned.reason = Reason::Pinned;
    assert!(!prefer_session(&mut pinned, best));
    assert_eq!(pinned.profile, cheap);
}

#[test]
fn a_load_factor_or_recompute_weight_below_one_is_refused_with_its_path() {
    let mut set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
    set.policy.affinity.max_load_factor = 0.9;
    set.policy.affinity.recompute_weight = f64::NAN;
    let errors = set.validate().unwrap_err();
    for path in [
        "policy.affinity.max_load_factor",
        "policy.affinity.recompute_weight",
    ] {
        assert!(errors.0.iter().any(|e| e.path == path), "{errors}");
    }
}
