//! Utility selection: hard constraints, utility, tie-breaks, modes.
//!
//! [`decide`] is a pure function of the profile snapshot, the prompt features, the request's
//! overrides and the live load the caller observed. It records no metrics and logs nothing;
//! the caller does both with the decision it gets back.

use serde::Serialize;

use crate::features::{Features, TaskClass};
use crate::profile::{Mode, Profile, ProfileIndex, ProfileSet};
use crate::second_opinion::{Rating, SecondOpinionUse};

/// What the caller knows about one request besides its features.
#[derive(Debug, Clone, Copy)]
pub struct RouteRequest<'a> {
    pub features: &'a Features,
    /// The request's `max_tokens` (or `max_completion_tokens`), if any.
    pub max_tokens: Option<u32>,
    pub overrides: Overrides<'a>,
    /// Stable key for canary assignment: the `user` field or the request id.
    pub routing_key: &'a str,
}

/// Per-request controls from headers or the `model` field.
#[derive(Debug, Clone, Copy, Default)]
pub struct Overrides<'a> {
    pub latency_budget_ms: Option<f64>,
    /// Replaces the complexity-derived required quality.
    pub min_quality: Option<f64>,
    /// Route to this profile id regardless of utility.
    pub profile: Option<&'a str>,
    /// A tenant's quality floor: the required quality never goes below it, downgraded or
    /// not.
    pub quality_floor: Option<f64>,
    /// The profile ids a tenant may use; `None`: every profile. Others are not candidates,
    /// and pinning one is an unknown profile.
    pub allowed_profiles: Option<&'a [String]>,
    /// A tenant near one of its limits: route cheaper.
    pub downgrade: Option<Downgrade>,
    /// Replaces `policy.risk_tolerance` (a tenant's, or a request header's).
    pub risk_tolerance: Option<f64>,
    /// A tier's rating of the prompt (`policy.second_opinion`): replaces the outcome head's
    /// risk, where the head speaks for the prompt.
    pub second_opinion: Option<Rating>,
    /// The request's `max_tokens` is only a ceiling (`policy.output_ceiling` covers its
    /// API): a profile is excluded only when the prompt itself does not fit its context.
    pub output_ceiling: bool,
}

/// How a request of a tenant past its soft limit is routed: the cost weight is multiplied
/// and the required quality lowered (never below the tenant's floor), so cheaper tiers become
/// feasible and preferred.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Downgrade {
    pub cost_weight_factor: f64,
    pub quality_drop: f64,
}

/// Live state of one profile, observed by the caller.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProfileLoad {
    /// At least one endpoint can take a request (not all circuit-open, some ready).
    pub available: bool,
    /// Expected wait before the upstream starts the request.
    pub queue_wait_ms: f64,
    /// Characters per token learned from what the upstream reported for earlier prompts;
    /// `None` uses the profile's `chars_per_token`.
    pub chars_per_token: Option<f64>,
}

/// Why a profile was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// Highest utility among feasible profiles.
    Utility,
    /// The request named the profile.
    Pinned,
    /// Nothing was feasible; the highest-quality available profile was used (one whose
    /// context holds the request, if any).
    ConstraintsUnmet,
    /// Shadow mode sends everything to the default profile.
    Shadow,
    /// Canary mode's control group goes to the default profile.
    CanaryControl,
    /// The chosen profile failed and another was tried.
    FallbackError,
    /// The chosen profile's answer was degenerate and a better one was tried.
    FallbackQuality,
    /// The preferred profile is scaled to zero; a warm one within budget serves instead.
    ColdStartAvoided,
    /// Highest utility with the tenant past its soft limit ([`Downgrade`]).
    BudgetDowngrade,
}

/// Why a candidate is not feasible.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Rejection {
    /// No endpoint can take a request.
    Unavailable,
    /// Prompt plus `max_tokens` exceed `max_context_tokens` (the prompt alone, when
    /// `max_tokens` is only a ceiling).
    ContextTooSmall,
    /// Quality for the task class is below the required quality.
    QualityBelowRequired,
    /// Predicted latency exceeds the budget.
    LatencyOverBudget,
}

/// One enabled profile as scored for a request.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Candidate {
    pub profile: ProfileIndex,
    pub feasible: bool,
    pub rejected_because: Option<Rejection>,
    pub predicted_latency_ms: f64,
    pub quality: f64,
    /// Predicted cost of this request in USD.
    pub cost: f64,
    pub utility: f64,
    pub estimated_input_tokens: u64,
    /// The prompt's risk scaled to this profile's quality gap to the reference: the net
    /// probability that its answer is worse (`None`: no outcome head speaks for the prompt).
    pub risk: Option<f64>,
}

/// The outcome of routing one request.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RoutingDecision {
    /// The profile to use.
    pub profile: ProfileIndex,
    pub reason: Reason,
    /// What adaptive routing picked, also when the mode sent the request elsewhere.
    pub adaptive_profile: ProfileIndex,
    pub complexity: f64,
    pub task_class: TaskClass,
    pub required_quality: f64,
    /// The outcome head's risk for the cheapest profile, when it speaks for this prompt.
    pub risk: Option<f64>,
    /// The risk tolerance the request was routed with.
    pub risk_tolerance: f64,
    /// The second opinion that replaced the risk, when one did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub second_opinion: Option<SecondOpinionUse>,
    pub latency_budget_ms: f64,
    pub expected_output_tokens: u32,
    /// Every enabled profile the request may use, in profile-set order.
    pub candidates: Vec<Candidate>,
}

/// A request that cannot be routed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    #[error("the model `{0}` does not exist")]
    UnknownProfile(String),
    #[error("no profile has an available endpoint")]
    NoAvailableProfile,
}

const AVAILABLE: ProfileLoad = ProfileLoad {
    available: true,
    queue_wait_ms: 0.0,
    chars_per_token: None,
};

/// Chooses a profile for one request.
///
/// `load[i]` describes `set.profiles[i]`; missing entries mean idle and available.
pub fn decide(
    set: &ProfileSet,
    req: &RouteRequest<'_>,
    load: &[ProfileLoad],
) -> Result<RoutingDecision, RouteError> {
    let policy = &set.policy;
    let features = req.features;
    let budget = req
        .overrides
        .latency_budget_ms
        .unwrap_or(policy.latency_budget_ms);
    let rq = &policy.required_quality;
    let downgrade = req.overrides.downgrade;
    let required = req
        .overrides
        .min_quality
        .unwrap_or(rq.base + (rq.max - rq.base) * features.complexity)
        - downgrade.map_or(0.0, |d| d.quality_drop.max(0.0));
    let required = required.max(req.overrides.quality_floor.unwrap_or(0.0));
    let allowed = |p: &Profile| {
        req.overrides
            .allowed_profiles
            .is_none_or(|ids| ids.contains(&p.id))
    };
    let expected_out = req
        .max_tokens
        .map_or(policy.expected_output_tokens, |m| {
            m.min(policy.expected_output_tokens)
        })
        .max(1);
    // A ceiling reserves no room: the prompt and one token of answer must fit.
    let context_out = match req.overrides.output_ceiling {
        true => 1,
        false => u64::from(req.max_tokens.unwrap_or(expected_out)),
    };
    // A second opinion stands in for the head's risk, where the head speaks at all.
    let rated = req
        .overrides
        .second_opinion
        .filter(|_| features.risk.is_some());
    let prompt_risk = rated.map(Rating::risk).or(features.risk);
    // An explicit minimum quality is the caller's own bar: the risk rule stays out of it.
    let risk = prompt_risk
        .filter(|_| req.overrides.min_quality.is_none())
        .map(|r| Risk {
            risk: r,
            tolerance: req
                .overrides
                .risk_tolerance
                .unwrap_or(policy.risk_tolerance),
            floor: (required - RISK_REACH * (rq.max - rq.base))
                .max(req.overrides.quality_floor.unwrap_or(0.0)),
            span: quality_span(set, features.task_class, &allowed),
        });

    let mut candidates: Vec<Candidate> = set
        .indexed()
        .filter(|(_, p)| p.enabled && allowed(p))
        .map(|(i, p)| {
            let load = load.get(i.get()).copied().unwrap_or(AVAILABLE);
            score(
                p,
                i,
                features,
                &load,
                expected_out,
                context_out,
                required,
                budget,
                risk.as_ref(),
            )
        })
        .collect();
    let cost_factor = downgrade.map_or(1.0, |d| d.cost_weight_factor.max(1.0));
    apply_utility(&mut candidates, set, cost_factor);

    let utility = match downgrade {
        Some(_) => Reason::BudgetDowngrade,
        None => Reason::Utility,
    };
    let adaptive = best_feasible(&candidates, set)
        .map(|c| (c.profile, utility))
        .or_else(|| best_quality(&candidates, set).map(|c| (c.profile, Reason::ConstraintsUnmet)));

    let (profile, reason) = if let Some(id) = req.overrides.profile {
        let pinned = set
            .index_of(id)
            .filter(|&i| set.profiles[i].enabled && allowed(&set.profiles[i]))
            .ok_or_else(|| RouteError::UnknownProfile(id.to_owned()))?;
        (pinned, Reason::Pinned)
    } else {
        let adaptive = adaptive.ok_or(RouteError::NoAvailableProfile)?;
        apply_mode(set, &candidates, adaptive, req.routing_key)
    };

    Ok(RoutingDecision {
        profile,
        reason,
        adaptive_profile: adaptive.map_or(profile, |(i, _)| i),
        complexity: features.complexity,
        task_class: features.task_class,
        required_quality: required,
        risk: prompt_risk,
        second_opinion: rated.map(|rating| SecondOpinionUse {
            rating,
            model_risk: features.risk.unwrap_or_default(),
            changed: without_rating(set, req, load).is_ok_and(|d| d.profile != profile),
        }),
        risk_tolerance: req
            .overrides
            .risk_tolerance
            .unwrap_or(policy.risk_tolerance),
        latency_budget_ms: budget,
        expected_output_tokens: expected_out,
        candidates,
    })
}

/// The decision the outcome head's own risk would have made.
fn without_rating(
    set: &ProfileSet,
    req: &RouteRequest<'_>,
    load: &[ProfileLoad],
) -> Result<RoutingDecision, RouteError> {
    let mut plain = *req;
    plain.overrides.second_opinion = None;
    decide(set, &plain, load)
}

/// How far below the required quality the risk rule reaches, as a share of the range from
/// `required_quality.base` to `max`: under half, so a prompt the difficulty head calls heavy
/// steps down from the reference to the next tier but not to one kept for light prompts (the
/// outcome head ranks prompts within a kind; the kind still bounds the tiers). Half let too
/// many heavy prompts onto the cheapest tier (`docs/routing.md` §3).
const RISK_REACH: f64 = 0.4;

/// The risk rule of one request (`docs/routing.md` §3): a profile below the required quality
/// is still acceptable when its share of the prompt's risk is within the tolerance.
struct Risk {
    /// The outcome head's risk for the cheapest profile.
    risk: f64,
    tolerance: f64,
    /// The lowest quality the rule admits: the tenant's floor, and never more than
    /// [`RISK_REACH`] of the required-quality range below the required quality.
    floor: f64,
    /// The reference's (highest) and the cheapest's (lowest) quality for the task class.
    span: (f64, f64),
}

impl Risk {
    /// A profile's risk: the prompt's, scaled by how much of the reference-to-cheapest
    /// quality gap the profile gives up (the reference 0, the lowest-quality profile all).
    fn of(&self, quality: f64) -> f64 {
        let (top, bottom) = self.span;
        if top - bottom <= f64::EPSILON {
            return 0.0;
        }
        self.risk * ((top - quality) / (top - bottom)).clamp(0.0, 1.0)
    }

    /// Whether a profile of `quality` below the required quality may still serve.
    fn accepts(&self, quality: f64) -> bool {
        self.tolerance > 0.0
            && quality < self.span.0
            && quality >= self.floor
            && self.of(quality) <= self.tolerance
    }
}

/// Highest and lowest quality for `class` among enabled profiles the request may use.
fn quality_span(
    set: &ProfileSet,
    class: TaskClass,
    allowed: &impl Fn(&Profile) -> bool,
) -> (f64, f64) {
    set.profiles
        .iter()
        .filter(|p| p.enabled && allowed(p))
        .map(|p| p.quality_for(class))
        .fold((f64::NEG_INFINITY, f64::INFINITY), |(hi, lo), q| {
            (hi.max(q), lo.min(q))
        })
}

#[allow(clippy::too_many_arguments)]
fn score(
    p: &Profile,
    index: ProfileIndex,
    features: &Features,
    load: &ProfileLoad,
    expected_out: u32,
    context_out: u64,
    required: f64,
    budget: f64,
    risk: Option<&Risk>,
) -> Candidate {
    let chars_per_token = load
        .chars_per_token
        .filter(|c| c.is_finite() && *c > 0.0)
        .unwrap_or(p.chars_per_token);
    let input_tokens = features.estimated_input_tokens(chars_per_token);
    let predicted_latency_ms = load.queue_wait_ms.max(0.0)
        + p.latency.ttft_ms
        + p.latency.itl_ms * f64::from(expected_out);
    let quality = p.quality_for(features.task_class);
    let cost = input_tokens as f64 * p.cost_per_1m_input_tokens / 1e6
        + f64::from(expected_out) * p.cost_per_1m_output_tokens / 1e6;
    let rejected_because = if !load.available {
        Some(Rejection::Unavailable)
    } else if input_tokens + context_out > u64::from(p.max_context_tokens) {
        Some(Rejection::ContextTooSmall)
    } else if quality < required && !risk.is_some_and(|r| r.accepts(quality)) {
        Some(Rejection::QualityBelowRequired)
    } else if predicted_latency_ms > budget {
        Some(Rejection::LatencyOverBudget)
    } else {
        None
    };
    Candidate {
        profile: index,
        feasible: rejected_because.is_none(),
        rejected_because,
        predicted_latency_ms,
        quality,
        cost,
        utility: 0.0,
        estimated_input_tokens: input_tokens,
        risk: risk.map(|r| r.of(quality)),
    }
}

/// `U = w_q·Q − w_l·L/budget − w_c·C/C_max`, with C_max the costliest candidate and `w_c`
/// multiplied by `cost_factor` (1 unless downgraded).
fn apply_utility(candidates: &mut [Candidate], set: &ProfileSet, cost_factor: f64) {
    let w = &set.policy.weights;
    let w_cost = w.cost * cost_factor;
    let budget = set.policy.latency_budget_ms;
    let c_max = candidates
        .iter()
        .map(|c| c.cost)
        .fold(0.0_f64, f64::max)
        .max(f64::MIN_POSITIVE);
    for c in candidates {
        c.utility = w.quality * c.quality
            - w.latency * c.predicted_latency_ms / budget
            - w_cost * c.cost / c_max;
    }
}

/// Higher utility wins; ties go to the cheaper profile, then the smaller id.
fn best_feasible<'c>(candidates: &'c [Candidate], set: &ProfileSet) -> Option<&'c Candidate> {
    candidates.iter().filter(|c| c.feasible).min_by(|a, b| {
        b.utility
            .total_cmp(&a.utility)
            .then(a.cost.total_cmp(&b.cost))
            .then_with(|| set.profiles[a.profile].id.cmp(&set.profiles[b.profile].id))
    })
}

/// The highest-quality available profile (ties: cheaper, then id), among those whose
/// context holds the request when any does: a context too small fails for certain, where a
/// missed quality or latency target only makes the answer worse or later. A cold tier that
/// alone can hold a long prompt is thus waited for rather than passed over.
fn best_quality<'c>(candidates: &'c [Candidate], set: &ProfileSet) -> Option<&'c Candidate> {
    let by_quality = |a: &&Candidate, b: &&Candidate| {
        b.quality
            .total_cmp(&a.quality)
            .then(a.cost.total_cmp(&b.cost))
            .then_with(|| set.profiles[a.profile].id.cmp(&set.profiles[b.profile].id))
    };
    let available = candidates
        .iter()
        .filter(|c| c.rejected_because != Some(Rejection::Unavailable));
    available
        .clone()
        .filter(|c| c.rejected_because != Some(Rejection::ContextTooSmall))
        .min_by(by_quality)
        .or_else(|| available.min_by(by_quality))
}

fn apply_mode(
    set: &ProfileSet,
    candidates: &[Candidate],
    adaptive: (ProfileIndex, Reason),
    routing_key: &str,
) -> (ProfileIndex, Reason) {
    let default = set.default_index();
    let default_available = candidates
        .iter()
        .any(|c| c.profile == default && c.rejected_because != Some(Rejection::Unavailable));
    let control = match set.policy.mode {
        Mode::Enforce => None,
        Mode::Shadow => Some(Reason::Shadow),
        Mode::Canary => (stable_percent(routing_key) >= u64::from(set.policy.canary_percent))
            .then_some(Reason::CanaryControl),
    };
    match control {
        // The control group needs the default profile; if it is down, adaptive routing is
        // the only way to answer at all.
        Some(reason) if default_available => (default, reason),
        _ => adaptive,
    }
}

/// Expected wait before a new request starts on `profile`, from live load.
///
/// The router's own in-flight requests beyond `max_concurrency` and the upstream's reported
/// waiting requests (`vllm:num_requests_waiting`) form a queue that drains
/// `max_concurrency` requests per typical request duration.
pub fn queue_wait_ms(
    profile: &Profile,
    inflight: u64,
    upstream_waiting: u64,
    expected_out: u32,
) -> f64 {
    let capacity = u64::from(profile.max_concurrency.max(1));
    let queued = inflight.saturating_sub(capacity) + upstream_waiting;
    if queued == 0 {
        return 0.0;
    }
    let service_ms = profile.latency.ttft_ms + profile.latency.itl_ms * f64::from(expected_out);
    queued as f64 / capacity as f64 * service_ms
}

/// FNV-1a of the key mapped to 0..100: the same key always lands in the same group.
pub fn stable_percent(key: &str) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.bytes() {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash % 100
}

// === impl RoutingDecision ===

impl RoutingDecision {
    /// The candidate entry of the chosen profile.
    pub fn chosen(&self) -> Option<&Candidate> {
        self.candidate(self.profile)
    }

    /// The candidate entry for a profile index.
    pub fn candidate(&self, profile: ProfileIndex) -> Option<&Candidate> {
        self.candidates.iter().find(|c| c.profile == profile)
    }

    /// Where to go after `failed` was exhausted (cross-tier fallback): among untried,
    /// available profiles that fit the context, feasible ones by utility — those at least
    /// as good as the failed one first — then the rest by quality.
    pub fn next_after_error(&self, tried: &[ProfileIndex]) -> Option<ProfileIndex> {
        let floor = tried
            .last()
            .and_then(|&i| self.candidate(i))
            .map_or(0.0, |c| c.quality);
        let open = |c: &&Candidate| {
            !tried.contains(&c.profile)
                && !matches!(
                    c.rejected_because,
                    Some(Rejection::Unavailable | Rejection::ContextTooSmall)
                )
        };
        let by_utility = |a: &&Candidate, b: &&Candidate| b.utility.total_cmp(&a.utility);
        let feasible = self.candidates.iter().filter(open).filter(|c| c.feasible);
        feasible
            .clone()
            .filter(|c| c.quality >= floor)
            .min_by(by_utility)
            .or_else(|| feasible.min_by(by_utility))
            .or_else(|| {
                self.candidates
                    .iter()
                    .filter(open)
                    .max_by(|a, b| a.quality.total_cmp(&b.quality))
            })
            .map(|c| c.profile)
    }

    /// The profiles a quality fallback from `rejected` must not reach: those whose quality
    /// for this request is not above its own, `rejected` included. Their answer could be no
    /// better than the one that failed the check.
    pub fn no_better_than(&self, rejected: ProfileIndex) -> Vec<ProfileIndex> {
        let Some(q) = self.candidate(rejected).map(|c| c.quality) else {
            return vec![rejected];
        };
        self.candidates
            .iter()
            .filter(|c| c.quality <= q || c.profile == rejected)
            .map(|c| c.profile)
            .collect()
    }

    /// The next higher-quality available profile than `current` (quality fallback):
    /// the lowest quality strictly above the current one, ties by utility.
    pub fn next_higher_quality(&self, current: ProfileIndex) -> Option<ProfileIndex> {
        let q = self.candidate(current)?.quality;
        self.candidates
            .iter()
            .filter(|c| {
                c.quality > q
                    && !matches!(
                        c.rejected_because,
                        Some(Rejection::Unavailable | Rejection::ContextTooSmall)
                    )
            })
            .min_by(|a, b| {
                a.quality
                    .total_cmp(&b.quality)
                    .then(b.utility.total_cmp(&a.utility))
            })
            .map(|c| c.profile)
    }
}

// === impl Downgrade ===

impl Downgrade {
    /// A tenant past its soft limit: cost weighs four times as much, so among feasible
    /// profiles the cheaper one wins even against a sizeable quality lead, and the required
    /// quality drops by 0.1, about one tier's step in the default profile set, so the next
    /// cheaper tier becomes feasible for all but the hardest prompts.
    pub const NEAR_LIMIT: Downgrade = Downgrade {
        cost_weight_factor: 4.0,
        quality_drop: 0.1,
    };
}

// === impl Reason ===

impl Reason {
    /// Every reason, for tables indexed by reason (metric handles).
    pub const ALL: [Reason; 9] = [
        Reason::Utility,
        Reason::Pinned,
        Reason::ConstraintsUnmet,
        Reason::Shadow,
        Reason::CanaryControl,
        Reason::FallbackError,
        Reason::FallbackQuality,
        Reason::ColdStartAvoided,
        Reason::BudgetDowngrade,
    ];

    /// Position in [`Reason::ALL`], for tables indexed by reason.
    pub const fn index(self) -> usize {
        self as usize
    }

    /// The label used in headers and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Utility => "utility",
            Reason::Pinned => "pinned",
            Reason::ConstraintsUnmet => "constraints_unmet",
            Reason::Shadow => "shadow",
            Reason::CanaryControl => "canary_control",
            Reason::FallbackError => "fallback_error",
            Reason::FallbackQuality => "fallback_quality",
            Reason::ColdStartAvoided => "cold_start_avoided",
            Reason::BudgetDowngrade => "budget_downgrade",
        }
    }
}

// === impl Rejection ===

impl Rejection {
    /// The label used in explain output.
    pub fn as_str(self) -> &'static str {
        match self {
            Rejection::Unavailable => "unavailable",
            Rejection::ContextTooSmall => "context_too_small",
            Rejection::QualityBelowRequired => "quality_below_required",
            Rejection::LatencyOverBudget => "latency_over_budget",
        }
    }
}

// === impl ProfileLoad ===

impl Default for ProfileLoad {
    fn default() -> Self {
        AVAILABLE
    }
}

#[cfg(test)]
mod tests;
