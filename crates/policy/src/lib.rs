//! quantrouter's routing policy: profile sets, prompt features and utility selection.
//!
//! Pure and synchronous: no I/O, no clocks, no global state, so every decision is
//! reproducible from its inputs and property-testable.
//!
//! ```
//! use quantrouter_policy::{decide, Features, Overrides, ProfileSet, Prompt, Role, RouteRequest, Segment};
//!
//! let set = ProfileSet::from_json(quantrouter_policy::DEFAULT_PROFILE_SET).unwrap();
//! let prompt = Prompt {
//!     segments: vec![Segment { role: Role::User, text: "Say hello in French." }],
//!     wants_json: false,
//! };
//! let features = Features::extract(&prompt, &set.policy.complexity).unwrap();
//! let request = RouteRequest {
//!     features: &features,
//!     max_tokens: Some(32),
//!     overrides: Overrides::default(),
//!     routing_key: "req-1",
//! };
//! let decision = decide(&set, &request, &[]).unwrap();
//! assert_eq!(set.profiles[decision.profile].tier, "int4");
//! assert_eq!(decision.reason.as_str(), "utility");
//! ```

#![forbid(unsafe_code)]

mod affinity;
mod audit;
mod calibration;
pub mod classifier;
mod features;
pub mod limits;
mod profile;
mod quality;
pub mod second_opinion;
mod seed;
mod select;
mod tenant;
pub mod wait_queue;

pub use affinity::{
    choose_endpoint, conversation_key, prefer_session, prefix_blocks, prompt_blocks, remembers,
    AffinityUse, Conversation, EndpointChoice, EndpointLoad, KeyScope, PrefixTable,
    DEFAULT_TABLE_BLOCKS, MAX_PREFIX_BYTES, PREFIX_BLOCK_BYTES,
};
pub use audit::{audit, AuditError, AuditReport, LabelStats, LabelledText};
pub use calibration::{sampled, AgreementTally, CostWindow, QualityEstimate};
pub use classifier::{
    score, Classification, Classifier, ClassifierDocument, ClassifierError, DEFAULT_CLASSIFIER,
};
pub use features::{FeatureError, Features, Prompt, Role, Segment, TaskClass};
pub use profile::{
    Affinity, ApiKeySource, Balance, Calibration, ComplexityWeights, FieldError, Latency, Mode,
    OutcomeSink, OutputCeiling, Policy, Profile, ProfileIndex, ProfileSet, ProfileSetError,
    Quality, QualityFallback, QueueMetrics, RequiredQuality, SecondOpinion, ServiceUpstream,
    StaticUpstream, StreamCheck, StreamResume, Transport, Upstream, UpstreamApi, ValidationErrors,
    Weights, MAX_VERSION,
};
pub use quality::{
    check_answer, check_choices, check_stream_choices, check_stream_start, repetition_ratio,
    AnswerChoice, AnswerProblem, StartChoice,
};
pub use second_opinion::{Rating, SecondOpinionUse};
pub use seed::{from_seed_list, looks_like_seed_list, SeedProfile};
pub use select::{
    decide, queue_wait_ms, stable_percent, Candidate, Downgrade, Overrides, ProfileLoad, Reason,
    Rejection, RouteError, RouteRequest, RoutingDecision,
};
pub use tenant::{
    hash_key, is_valid_api_key, parse_key_hash, PrefixCache, Tenant, TenantDocument, TenantError,
    TenantKeys, TenantLimits, MAX_BUDGET, MAX_COUNT_LIMIT, MAX_KEYS, MAX_KEY_BYTES,
};

/// The built-in profile set (`profiles/default.json`), used when no other source is set.
pub const DEFAULT_PROFILE_SET: &str = include_str!("../../../profiles/default.json");
