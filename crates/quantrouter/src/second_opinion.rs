//! A second opinion for prompts of uncertain risk (`policy.second_opinion`, docs/routing.md
//! "A second opinion"): before routing, a cheap tier rates the request's difficulty with one
//! digit, under a strict timeout; the rating replaces the outcome head's risk. Ratings are
//! cached by tenant and prompt hash. Which requests are rated and what a digit means is
//! policy ([`quantrouter_policy::SecondOpinion::asks`], [`Rating::risk`]); this module asks.
//!
//! A tenant's prompt goes only to a rating profile its `allowed_profiles` names: for any
//! other tenant nothing is asked and the model's risk routes the request, as on a timeout.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};
use quantrouter_policy::{
    score, KeyScope, Prompt, Rating, Reason, RoutingDecision, SecondOpinion, SecondOpinionUse,
};
use tokio::time::Instant;

use crate::app::App;
use crate::openai::{answer_choices, ParsedRequest};
use crate::profiles::Snapshot;
use crate::resilience::retry::{Forwarder, Outgoing, Plan};
use crate::routing;
use crate::telemetry;
use crate::tenants::ActiveTenant;

/// The rating's instruction, sent as the system message. vllm-sim recognises it.
pub const INSTRUCTION: &str = "Rate how hard the following request is for you to answer \
correctly, from 0 (trivial) to 9 (beyond you). Reply with a single digit.";

/// Response header: the rating that replaced the risk, the model's risk, and whether the
/// route changed (`rating=7; model_risk=0.512; changed=true`).
pub const HEADER: HeaderName = HeaderName::from_static("x-quantrouter-second-opinion");

/// Ratings kept per generation of the cache; two generations at most.
const CACHE_ENTRIES: usize = 4096;
/// The prompt text a rating is asked about: the scoring window's worth.
const MAX_PROMPT_BYTES: usize = 4096;

/// The request a rating may be asked for.
#[derive(Debug, Clone, Copy)]
pub struct Rated<'a> {
    pub snapshot: &'a Arc<Snapshot>,
    pub parsed: &'a ParsedRequest<'a>,
    pub headers: &'a HeaderMap,
    /// Its tenant: only a profile the tenant may use is asked, and ratings are cached per
    /// tenant.
    pub tenant: Option<&'a ActiveTenant>,
}

/// Ratings by tenant and prompt hash, bounded: when the current generation is full it becomes the
/// previous one (the one before is dropped), so a hot prompt stays and memory stays flat.
#[derive(Debug, Default)]
pub struct SecondOpinions {
    cache: Mutex<Generations>,
}

#[derive(Debug, Default)]
struct Generations {
    current: HashMap<u64, Rating>,
    previous: HashMap<u64, Rating>,
}

impl SecondOpinions {
    fn get(&self, key: u64) -> Option<Rating> {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&rating) = cache.current.get(&key) {
            return Some(rating);
        }
        let rating = cache.previous.get(&key).copied()?;
        cache.insert(key, rating);
        Some(rating)
    }

    fn put(&self, key: u64, rating: Rating) {
        self.cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, rating);
    }

    /// Ratings held (both generations).
    pub fn len(&self) -> usize {
        let cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        cache.current.len() + cache.previous.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Generations {
    fn insert(&mut self, key: u64, rating: Rating) {
        if self.current.len() >= CACHE_ENTRIES {
            self.previous = std::mem::take(&mut self.current);
        }
        self.current.insert(key, rating);
    }
}

/// The rating of a request the policy wants one for (its risk in the band, not pinned, not
/// a stream unless allowed), from the cache or asked of the profile within the timeout.
/// `None`: the model's risk stands.
pub async fn consult(app: &App, request: Rated<'_>) -> Option<Rating> {
    let Rated {
        snapshot,
        parsed,
        headers,
        tenant,
    } = request;
    let policy = snapshot.set.policy.second_opinion.as_ref()?;
    // `allowed_profiles` keeps a tenant's prompts off every other tier, the rater's too.
    if tenant.is_some_and(|t| !t.allows(&policy.profile)) {
        return None;
    }
    let prompt = parsed.prompt();
    let classifier = app.config.classifier.load();
    let (features, _) = score(
        &prompt,
        &snapshot.set.policy.complexity,
        classifier.model.as_ref(),
    );
    let by_risk = routing::routes_by_risk(snapshot, parsed, headers, &app.config.aliases);
    if !policy.asks(features.risk, parsed.stream, by_risk) {
        return None;
    }
    let scope = tenant.map_or(KeyScope::NONE, |t| t.keys.scope());
    let key = cache_key(scope, policy, &prompt);
    if let Some(rating) = app.second_opinions.get(key) {
        telemetry::second_opinion("cached", None);
        return Some(rating);
    }
    let started = Instant::now();
    let timeout = Duration::from_millis(policy.timeout_ms);
    let salt = tenant.and_then(|t| t.keys.cache_salt(None));
    let asking = Asking {
        snapshot,
        policy,
        prompt: &prompt,
        cache_salt: salt.as_deref(),
    };
    let asked = tokio::time::timeout(timeout, ask(app, asking)).await;
    let elapsed = started.elapsed();
    match asked {
        Ok(Ok(rating)) => {
            app.second_opinions.put(key, rating);
            telemetry::second_opinion("rated", Some(elapsed));
            Some(rating)
        }
        // The call's own deadline is the timeout too, and usually ends it first.
        Ok(Err(error)) if elapsed < timeout => {
            tracing::debug!(%error, "second opinion: no rating");
            telemetry::second_opinion("error", Some(elapsed));
            None
        }
        Ok(Err(_)) | Err(_) => {
            telemetry::second_opinion("timeout", Some(elapsed));
            None
        }
    }
}

/// The response header for a decision a rating took part in.
pub fn header(decision: &RoutingDecision) -> Option<HeaderValue> {
    let used: &SecondOpinionUse = decision.second_opinion.as_ref()?;
    HeaderValue::from_str(&format!(
        "rating={}; model_risk={:.3}; changed={}",
        used.rating.digit(),
        used.model_risk,
        used.changed
    ))
    .ok()
}

/// The prompt's hash, with the profile asked (another profile may rate it otherwise), within
/// the tenant's scope: a cached rating answers faster, which must say nothing about what
/// another tenant sent.
fn cache_key(scope: KeyScope, policy: &SecondOpinion, prompt: &Prompt<'_>) -> u64 {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    scope.hash(&mut hasher);
    policy.profile.hash(&mut hasher);
    for segment in &prompt.segments {
        (segment.role as u8).hash(&mut hasher);
        segment.text.hash(&mut hasher);
    }
    hasher.finish()
}

/// The text rated: the request's messages, as much of them as the scoring window reads.
fn rated_text(prompt: &Prompt<'_>) -> String {
    let mut text = String::new();
    for segment in &prompt.segments {
        if !text.is_empty() {
            text.push_str("\n\n");
        }
        text.push_str(segment.text);
        if text.len() >= MAX_PROMPT_BYTES {
            let mut end = MAX_PROMPT_BYTES;
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            text.truncate(end);
            break;
        }
    }
    text
}

/// What a rating is asked with.
struct Asking<'a> {
    snapshot: &'a Arc<Snapshot>,
    policy: &'a SecondOpinion,
    prompt: &'a Prompt<'a>,
    /// The tenant's `cache_salt` (`prefix_cache: "isolated"`).
    cache_salt: Option<&'a str>,
}

/// Asks `policy.profile` for the digit: a pinned, non-streamed chat request of one token
/// (admission and breaker as for any request to it, no fallback).
async fn ask(app: &App, asking: Asking<'_>) -> Result<Rating, String> {
    let Asking {
        snapshot,
        policy,
        prompt,
        cache_salt,
    } = asking;
    let profile = snapshot
        .set
        .index_of(&policy.profile)
        .ok_or("the second opinion's profile is not in the set")?;
    let model: serde_json::Value =
        serde_json::from_str(&snapshot.runtime[profile].model_json).map_err(|e| e.to_string())?;
    let mut body = serde_json::json!({
        "model": model,
        "messages": [
            {"role": "system", "content": INSTRUCTION},
            {"role": "user", "content": rated_text(prompt)},
        ],
        "max_tokens": 1,
        "temperature": 0,
    });
    if let Some(salt) = cache_salt {
        body["cache_salt"] = salt.into();
    }
    let body = Bytes::from(body.to_string());
    let decision = RoutingDecision {
        profile,
        reason: Reason::Pinned,
        adaptive_profile: profile,
        complexity: 0.0,
        task_class: quantrouter_policy::TaskClass::General,
        required_quality: 0.0,
        risk: None,
        risk_tolerance: 0.0,
        second_opinion: None,
        latency_budget_ms: policy.timeout_ms as f64,
        expected_output_tokens: 1,
        candidates: Vec::new(),
    };
    let started = Instant::now();
    let deadline = started + Duration::from_millis(policy.timeout_ms);
    let mut headers = HeaderMap::new();
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let plan = Plan {
        snapshot,
        decision: &decision,
        pinned: true,
        stream: false,
        wants_json: false,
        headers: &headers,
        started,
        deadline,
        trace: None,
        request_id: "second-opinion",
        priority: 0,
        placement: &crate::upstream::Placement::default(),
    };
    let body_for = |_| Outgoing {
        path: "/v1/chat/completions",
        body: body.clone(),
    };
    let whole = Forwarder::new(&app.client, &app.config.resilience, plan, &body_for)
        .ask()
        .await?;
    let text = match answer_choices(&whole).and_then(|c| c.into_iter().next()) {
        Some(quantrouter_policy::AnswerChoice::Text(text)) => text.into_owned(),
        _ => return Err("no text in the answer".into()),
    };
    Rating::parse(&text).ok_or_else(|| format!("not a digit: {text:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_keeps_two_generations_at_most() {
        let opinions = SecondOpinions::default();
        let rating = Rating::new(5).unwrap();
        for key in 0..(3 * CACHE_ENTRIES as u64) {
            opinions.put(key, rating);
        }
        assert!(opinions.len() <= 2 * CACHE_ENTRIES);
        assert_eq!(opinions.get(3 * CACHE_ENTRIES as u64 - 1), Some(rating));
        assert_eq!(opinions.get(0), None, "the oldest went");
    }

    #[test]
    fn a_hit_in_the_previous_generation_is_kept() {
        let opinions = SecondOpinions::default();
        let rating = Rating::new(2).unwrap();
        opinions.put(u64::MAX, rating);
        for key in 0..CACHE_ENTRIES as u64 {
            opinions.put(key, rating);
        }
        assert_eq!(
            opinions.get(u64::MAX),
            Some(rating),
            "moved back to current"
        );
        for key in CACHE_ENTRIES as u64..(2 * CACHE_ENTRIES as u64 - 1) {
            opinions.put(key, rating);
        }
        assert_eq!(opinions.get(u64::MAX), Some(rating));
    }
}
