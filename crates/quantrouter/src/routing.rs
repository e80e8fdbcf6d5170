//! Glue from a parsed request to a policy decision: request controls from headers and the
//! `model` field, the live load of each profile, and the policy call itself. No I/O.

use http::{HeaderMap, HeaderName};
use std::time::Duration;

use quantrouter_policy::classifier::{Contribution, TASK_CLASSES};
use quantrouter_policy::{
    conversation_key, decide, prefix_blocks, score, AffinityUse, Classification, Classifier,
    Conversation, KeyScope, Overrides, ProfileIndex, ProfileLoad, ProfileSet, Rating, Reason,
    RouteError, RouteRequest, RoutingDecision, UpstreamApi,
};

use crate::openai::{ApiError, Endpoint, ParsedRequest, Usage};
use crate::profiles::Snapshot;
use crate::tenants::ActiveTenant;
use crate::upstream::{Placement, Pool};

/// Header: latency budget for this request, in milliseconds.
pub const LATENCY_BUDGET_HEADER: HeaderName =
    HeaderName::from_static("x-quantrouter-latency-budget-ms");
/// Header: minimum quality in [0,1] for this request.
pub const MIN_QUALITY_HEADER: HeaderName = HeaderName::from_static("x-quantrouter-min-quality");
/// Header: the highest risk in [0,1] accepted for a cheaper profile (`policy.risk_tolerance`).
pub const RISK_TOLERANCE_HEADER: HeaderName =
    HeaderName::from_static("x-quantrouter-risk-tolerance");
/// Header: pin this request to a profile id.
pub const PROFILE_HEADER: HeaderName = HeaderName::from_static("x-quantrouter-profile");

/// Header: the conversation a request belongs to, for session affinity.
pub const SESSION_HEADER: HeaderName = HeaderName::from_static("x-session-id");

/// Header: overall deadline for this request, in milliseconds.
pub const TIMEOUT_HEADER: HeaderName = HeaderName::from_static("x-quantrouter-timeout-ms");

/// The model name that asks for adaptive routing.
pub const AUTO_MODEL: &str = "auto";

/// Largest time a request header may give, in milliseconds: a day. No generation runs that
/// long, and the bound keeps a deadline (the request's start plus the header) representable;
/// anything above is a 400, never a panic.
const MAX_HEADER_MS: f64 = 86_400_000.0;

/// A tenant whose `allowed_profiles` names no enabled profile of the set can never be
/// served: 403 with what is wrong, not a 503 its clients would retry forever.
fn check_allowed(set: &ProfileSet, tenant: &ActiveTenant) -> Result<(), ApiError> {
    let Some(allowed) = tenant.allowed_profiles.as_deref() else {
        return Ok(());
    };
    if set
        .profiles
        .iter()
        .any(|p| p.enabled && allowed.contains(&p.id))
    {
        return Ok(());
    }
    Err(ApiError::NoAllowedProfile(format!(
        "Tenant {} may use only the profiles {}, none of which is an enabled profile of the \
         active profile set (version {}); its allowed_profiles must be corrected.",
        tenant.id,
        allowed.join(", "),
        set.version
    )))
}

/// What a request is routed with, besides the snapshot and the parsed request.
#[derive(Debug, Clone, Copy)]
pub struct RouteInput<'a> {
    /// Scores the prompt (none: the structural score alone).
    pub classifier: Option<&'a Classifier>,
    pub headers: &'a HeaderMap,
    /// Extra model names that mean adaptive routing.
    pub aliases: &'a [String],
    /// Keys canary assignment when the request names no `user`.
    pub request_key: &'a str,
    /// Bounds the choice by the caller's quality floor and allowed profiles, and routes it
    /// cheaper when it is past a soft limit (`true`).
    pub tenant: Option<(&'a ActiveTenant, bool)>,
    /// The only profiles available (by index): the endpoint picker's subset hint leaves some
    /// tiers without an endpoint it may choose.
    pub among: Option<&'a [bool]>,
    /// A second opinion's rating (`policy.second_opinion`), in place of the outcome head's
    /// risk.
    pub rating: Option<Rating>,
}

/// Whether the request is routed by the risk rule at all: not pinned (by header or model
/// name) and without its own minimum quality. A malformed header counts as no: routing
/// refuses it anyway.
pub fn routes_by_risk(
    snapshot: &Snapshot,
    parsed: &ParsedRequest<'_>,
    headers: &HeaderMap,
    aliases: &[String],
) -> bool {
    !headers.contains_key(PROFILE_HEADER)
        && !headers.contains_key(MIN_QUALITY_HEADER)
        && matches!(resolve_model(snapshot, &parsed.model, aliases), Ok(None))
}

/// Routes one request against a snapshot.
pub fn route(
    snapshot: &Snapshot,
    parsed: &ParsedRequest<'_>,
    input: RouteInput<'_>,
) -> Result<Routed, ApiError> {
    let RouteInput {
        classifier,
        headers,
        aliases,
        request_key,
        tenant,
        among,
        rating,
    } = input;
    let set = &snapshot.set;
    let pinned = match header_str(headers, PROFILE_HEADER)? {
        Some(id) => Some(id),
        None => resolve_model(snapshot, &parsed.model, aliases)?,
    };
    let overrides = Overrides {
        latency_budget_ms: header_number(headers, LATENCY_BUDGET_HEADER, |v| {
            v > 0.0 && v <= MAX_HEADER_MS
        })?,
        min_quality: header_number(headers, MIN_QUALITY_HEADER, |v| (0.0..=1.0).contains(&v))?,
        risk_tolerance: header_number(headers, RISK_TOLERANCE_HEADER, |v| {
            (0.0..=1.0).contains(&v)
        })?,
        profile: pinned,
        second_opinion: rating,
        output_ceiling: set
            .policy
            .output_ceiling
            .applies_to(api_of(parsed.endpoint)),
        ..Overrides::default()
    };
    let overrides = match tenant {
        Some((tenant, downgraded)) => {
            check_allowed(set, tenant)?;
            tenant.overrides(overrides, downgraded)
        }
        None => overrides,
    };
    let prompt = parsed.prompt();
    // A request with no text (an image-only message) is valid and routes as the simplest.
    let (features, classification) = score(&prompt, &set.policy.complexity, classifier);
    let mut load = live_load(snapshot);
    if let Some(among) = among {
        for (load, allowed) in load.iter_mut().zip(among) {
            load.available &= *allowed;
        }
    }
    let request = RouteRequest {
        features: &features,
        max_tokens: parsed.max_tokens,
        overrides,
        routing_key: parsed.user.as_deref().unwrap_or(request_key),
    };
    let warm = decide(set, &request, &load);
    let cold = cold_start(snapshot, &request, &load, &warm);
    let cold_preferred = match &cold {
        Some(ColdStart::Avoided { preferred }) => Some(*preferred),
        _ => None,
    };
    let wait_for = match &cold {
        Some(ColdStart::Wait {
            profile, timeout, ..
        }) => Some((*profile, *timeout)),
        _ => None,
    };
    let decision = match (warm, cold) {
        (_, Some(ColdStart::Wait { decision, .. })) => decision,
        (Ok(mut warm), Some(ColdStart::Avoided { .. })) => {
            warm.reason = Reason::ColdStartAvoided;
            warm
        }
        (warm, _) => warm.map_err(|e| match e {
            RouteError::UnknownProfile(id) => ApiError::ModelNotFound(id),
            RouteError::NoAvailableProfile => ApiError::Unavailable(e.to_string()),
        })?,
    };
    let tenant = tenant.map(|(tenant, _)| tenant);
    let scope = tenant.map_or(KeyScope::NONE, |t| t.keys.scope());
    let conversation = match set.policy.affinity.session {
        true => conversation_key(
            scope,
            header_str(headers, SESSION_HEADER)?,
            parsed.user.as_deref(),
            &prompt,
        ),
        false => None,
    };
    let (cache_salt, placed_in) = cache_keying(tenant, parsed.cache_salt());
    Ok(Routed {
        decision,
        classification,
        wait_for,
        cold_preferred,
        placement: Placement::new(prefix_blocks(placed_in, &prompt))
            .with_prompt_bytes(features.prompt_bytes),
        conversation,
        cache_salt,
        affinity: AffinityUse::None,
        prompt: PromptSize {
            bytes: features.prompt_bytes,
            // The estimate's own count for text that costs nothing: its per-message framing.
            overhead_tokens: features.estimated_input_tokens(f64::INFINITY),
        },
    })
}

/// The `upstream.apis` name of an endpoint's API.
fn api_of(endpoint: Endpoint) -> UpstreamApi {
    match endpoint {
        Endpoint::Chat => UpstreamApi::Chat,
        Endpoint::Completions => UpstreamApi::Completions,
        Endpoint::Messages => UpstreamApi::Messages,
        Endpoint::Responses => UpstreamApi::Responses,
    }
}

/// The output limit to send `profile`, when the request's is only a ceiling
/// (`policy.output_ceiling`) and above what the profile's context holds beside the prompt
/// (its estimate, tool definitions included); `None`: the request's own limit is sent.
pub fn output_ceiling(
    snapshot: &Snapshot,
    decision: &RoutingDecision,
    parsed: &ParsedRequest<'_>,
    profile: ProfileIndex,
) -> Option<u32> {
    let rule = &snapshot.set.policy.output_ceiling;
    let max_tokens = parsed.max_tokens?;
    if !rule.applies_to(api_of(parsed.endpoint)) {
        return None;
    }
    let tools = tool_tokens(snapshot, profile, parsed.tools_bytes);
    let prompt = decision.candidate(profile)?.estimated_input_tokens + tools;
    let context = snapshot.set.profiles[profile].max_context_tokens;
    let ceiling = rule.clamp(max_tokens, context, prompt);
    (ceiling < max_tokens).then_some(ceiling)
}

/// The tokens of `bytes` of tool definitions at `profile`'s characters per token.
pub fn tool_tokens(snapshot: &Snapshot, profile: ProfileIndex, bytes: usize) -> u64 {
    (bytes as f64 / chars_per_token(snapshot, profile)).ceil() as u64
}

/// `profile`'s characters per token: learned from its upstream's counts, else configured.
pub fn chars_per_token(snapshot: &Snapshot, profile: ProfileIndex) -> f64 {
    let configured = snapshot.set.profiles[profile].chars_per_token;
    snapshot.runtime[profile]
        .pool
        .chars_per_token(configured)
        .filter(|c| c.is_finite() && *c > 0.0)
        .unwrap_or(configured)
}

/// A routing decision, and the scaled-to-zero profile it must wait for, if any.
#[derive(Debug)]
pub struct Routed {
    pub decision: RoutingDecision,
    /// What the classifier said of the prompt, when one scored it.
    pub classification: Option<Classification>,
    /// Wait up to this long for the profile's first endpoint before sending.
    pub wait_for: Option<(ProfileIndex, Duration)>,
    /// A scaled-to-zero profile that would have won; a warm one serves instead, but the
    /// demand should still wake the cold tier.
    pub cold_preferred: Option<ProfileIndex>,
    /// The prompt as the context check sized it.
    pub prompt: PromptSize,
    /// The prompt's blocks, for the endpoint holding its cached prefix.
    pub placement: Placement,
    /// The conversation's key (within the tenant's), when session affinity is on.
    pub conversation: Option<Conversation>,
    /// vLLM's `cache_salt` for the upstream body, in place of the client's: set for a tenant
    /// whose `prefix_cache` is `isolated`; otherwise the body goes as the client sent it.
    pub cache_salt: Option<String>,
    /// Whether the conversation's earlier turns decided the profile.
    pub affinity: AffinityUse,
}

impl Routed {
    /// What decided where the request went: the conversation's profile (session) before
    /// the endpoint's cached prefix, once an endpoint was picked.
    pub fn affinity_used(&self) -> AffinityUse {
        match self.affinity {
            AffinityUse::None if self.placement.by_prefix() => AffinityUse::Prefix,
            used => used,
        }
    }
}

/// The `cache_salt` a request's upstream body gets (see [`Routed::cache_salt`]) and the
/// scope its prompt's blocks are placed in: the tenant's, narrowed by the salt the model
/// server will see, since the server shares KV blocks only between equal salts.
fn cache_keying(tenant: Option<&ActiveTenant>, client: Option<&str>) -> (Option<String>, KeyScope) {
    let scope = tenant.map_or(KeyScope::NONE, |t| t.keys.scope());
    let salt = tenant.and_then(|t| t.keys.cache_salt(client));
    let placed_in = match (salt.as_deref(), client) {
        (Some(salt), _) | (None, Some(salt)) => scope.salted(salt),
        (None, None) => scope,
    };
    (salt.map(std::borrow::Cow::into_owned), placed_in)
}

/// A prompt's size as the context check estimates it, to compare with the tokens the
/// upstream counted.
#[derive(Debug, Clone, Copy)]
pub struct PromptSize {
    pub bytes: usize,
    /// Tokens the estimate adds for message framing, whatever the text.
    pub overhead_tokens: u64,
}

impl PromptSize {
    /// Learns the serving profile's characters per token from the `usage` it reported.
    pub fn observe(self, pool: &Pool, usage: Usage) {
        pool.observe_prompt(self.bytes, self.overhead_tokens, usage.prompt_tokens);
    }
}

/// Scale from zero: a profile with no endpoint (scaled to zero) and a cold-start allowance
/// is scored as if it were up, with its allowance as queue wait.
enum ColdStart {
    /// It would win, but a warm profile meets the constraints: serve there instead.
    Avoided { preferred: ProfileIndex },
    /// It would win and nothing warm fits: wait for it.
    Wait {
        decision: RoutingDecision,
        profile: ProfileIndex,
        timeout: Duration,
    },
}

fn cold_start(
    snapshot: &Snapshot,
    request: &RouteRequest<'_>,
    load: &[ProfileLoad],
    warm: &Result<RoutingDecision, RouteError>,
) -> Option<ColdStart> {
    let profiles = &snapshot.set.profiles;
    let cold = |i: ProfileIndex| {
        profiles[i].enabled
            && profiles[i].cold_start_timeout_ms > 0
            && !snapshot.runtime[i].pool.has_endpoints()
    };
    if !snapshot.set.indexed().any(|(i, _)| cold(i)) {
        return None;
    }
    // A pinned cold profile waits whatever else is warm.
    if let Some(pinned) = warm.as_ref().ok().filter(|d| d.reason == Reason::Pinned) {
        let profile = pinned.profile;
        return cold(profile).then(|| ColdStart::Wait {
            decision: pinned.clone(),
            profile,
            timeout: Duration::from_millis(profiles[profile].cold_start_timeout_ms),
        });
    }
    let hopeful: Vec<ProfileLoad> = load
        .iter()
        .enumerate()
        .map(|(i, l)| match cold(ProfileIndex::new(i)) {
            true => ProfileLoad {
                available: true,
                queue_wait_ms: profiles[i].cold_start_timeout_ms as f64,
                ..*l
            },
            false => *l,
        })
        .collect();
    let preferred = decide(&snapshot.set, request, &hopeful).ok()?;
    if !cold(preferred.profile) {
        return None;
    }
    let warm_fits = warm
        .as_ref()
        .is_ok_and(|d| d.reason != Reason::ConstraintsUnmet);
    if warm_fits {
        return Some(ColdStart::Avoided {
            preferred: preferred.profile,
        });
    }
    let profile = preferred.profile;
    Some(ColdStart::Wait {
        decision: preferred,
        profile,
        timeout: Duration::from_millis(profiles[profile].cold_start_timeout_ms),
    })
}

/// The inputs that moved the classifier's scores of a request most (explain only: it
/// keeps the text of every word, which the request path does not).
pub fn top_features(
    set: &ProfileSet,
    classifier: &Classifier,
    prompt: &quantrouter_policy::Prompt<'_>,
) -> Vec<Contribution> {
    const TOP: usize = 10;
    let weights = &set.policy.complexity;
    match quantrouter_policy::Features::extract(prompt, weights) {
        Ok(features) => {
            classifier.explain(prompt, &features, weights.scoring_window_chars.max(1), TOP)
        }
        Err(_) => Vec::new(),
    }
}

/// The client's overall deadline, if it set one (at most [`MAX_HEADER_MS`]).
pub fn timeout(headers: &HeaderMap) -> Result<Option<Duration>, ApiError> {
    let ms = header_number(headers, TIMEOUT_HEADER, |v| v > 0.0 && v <= MAX_HEADER_MS)?;
    Ok(ms.and_then(|ms| Duration::try_from_secs_f64(ms / 1000.0).ok()))
}

/// `auto` and aliases route adaptively; a profile id or a profile's served model name pins.
fn resolve_model<'s>(
    snapshot: &'s Snapshot,
    model: &str,
    aliases: &[String],
) -> Result<Option<&'s str>, ApiError> {
    if model == AUTO_MODEL || aliases.iter().any(|a| a == model) {
        return Ok(None);
    }
    snapshot
        .set
        .profiles
        .iter()
        .filter(|p| p.enabled)
        .find(|p| p.id == model)
        .or_else(|| {
            snapshot
                .set
                .profiles
                .iter()
                .find(|p| p.enabled && p.model == model)
        })
        .map(|p| Some(p.id.as_str()))
        .ok_or_else(|| ApiError::ModelNotFound(model.to_owned()))
}

/// What the router observes of each profile right now.
///
/// Requests waiting for admission count as in flight beyond `max_concurrency`; the
/// upstream's own queue comes from the scraper, and the characters per token from what the
/// upstream counted for earlier prompts.
fn live_load(snapshot: &Snapshot) -> Vec<ProfileLoad> {
    let expected = snapshot.set.policy.expected_output_tokens;
    let now = tokio::time::Instant::now();
    snapshot
        .set
        .profiles
        .iter()
        .zip(snapshot.pools())
        .map(|(profile, pool)| ProfileLoad {
            available: pool.available(now),
            queue_wait_ms: quantrouter_policy::queue_wait_ms(
                profile,
                pool.inflight() + pool.admission.waiting(),
                pool.upstream_waiting(),
                expected,
            ),
            chars_per_token: pool.chars_per_token(profile.chars_per_token),
        })
        .collect()
}

/// Header names are constants, so a lookup does not re-parse and lowercase the name.
fn header_str(headers: &HeaderMap, name: HeaderName) -> Result<Option<&str>, ApiError> {
    headers
        .get(&name)
        .map(|v| {
            v.to_str().map_err(|_| ApiError::InvalidRequest {
                message: format!("header {name} must be visible ASCII"),
                param: Some(name.as_str().into()),
            })
        })
        .transpose()
}

fn header_number(
    headers: &HeaderMap,
    name: HeaderName,
    valid: impl Fn(f64) -> bool,
) -> Result<Option<f64>, ApiError> {
    let Some(raw) = header_str(headers, name.clone())? else {
        return Ok(None);
    };
    match raw.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && valid(v) => Ok(Some(v)),
        _ => Err(ApiError::InvalidRequest {
            message: format!("header {name} has an invalid value `{raw}`"),
            param: Some(name.as_str().into()),
        }),
    }
}

/// The `POST /v1/route` answer, but for `decision_us`, which the caller times and adds.
pub fn explain(
    set: &ProfileSet,
    decision: &RoutingDecision,
    classification: Option<&Classification>,
    top_features: &[Contribution],
) -> serde_json::Value {
    let profile = &set.profiles[decision.profile];
    let candidates: Vec<serde_json::Value> = decision
        .candidates
        .iter()
        .map(|c| {
            serde_json::json!({
                "profile": set.profiles[c.profile].id,
                "feasible": c.feasible,
                "utility": c.utility,
                "predicted_latency_ms": c.predicted_latency_ms,
                "quality": c.quality,
                "cost": c.cost,
                "rejected_because": c.rejected_because.map(|r| r.as_str()),
                "risk": c.risk,
            })
        })
        .collect();
    let mut answer = serde_json::json!({
        "profile": profile.id,
        "tier": profile.tier,
        "reason": decision.reason.as_str(),
        "complexity": decision.complexity,
        "task_class": decision.task_class,
        "required_quality": decision.required_quality,
        "risk": decision.risk,
        "estimated_input_tokens": decision.chosen().map_or(0, |c| c.estimated_input_tokens),
        "candidates": candidates,
    });
    if let Some(used) = &decision.second_opinion {
        answer["second_opinion"] = serde_json::json!({
            "rating": used.rating.digit(),
            "model_risk": used.model_risk,
            "changed": used.changed,
        });
    }
    if let Some(c) = classification {
        let classes: serde_json::Map<String, serde_json::Value> = TASK_CLASSES
            .iter()
            .zip(c.class_probabilities)
            .map(|(class, p)| (class.as_str().to_owned(), p.into()))
            .collect();
        let [heavy, medium, light] = c.difficulty_probabilities;
        answer["class_probabilities"] = classes.into();
        answer["difficulty"] = serde_json::json!({
            "heavy": heavy, "medium": medium, "light": light, "score": c.difficulty,
        });
        answer["top_features"] = serde_json::to_value(top_features).unwrap_or_default();
    }
    answer
}
