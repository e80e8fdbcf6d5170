//! The profile-set document: the table of model-quantization profiles and the routing policy
//! that operators push to Redis.
//!
//! Parsing and validation are separate steps so a caller can report every problem at once;
//! [`ProfileSet::from_json`] does both and is what every source should use.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::features::TaskClass;

/// A profile's position in its [`ProfileSet`]: what a decision names, and what everything
/// kept per profile beside the set (upstream pools, loads, metric handles) is indexed by, so
/// an index cannot be mistaken for a count or a position in another list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct ProfileIndex(usize);

impl ProfileIndex {
    /// The index of the `i`-th profile of a set.
    pub const fn new(i: usize) -> Self {
        Self(i)
    }

    /// The position in the set's `profiles`.
    pub const fn get(self) -> usize {
        self.0
    }
}

/// Lists kept in profile-set order are indexed by profile.
impl<T> std::ops::Index<ProfileIndex> for Vec<T> {
    type Output = T;

    fn index(&self, index: ProfileIndex) -> &T {
        &self[index.0]
    }
}

impl<T> std::ops::IndexMut<ProfileIndex> for Vec<T> {
    fn index_mut(&mut self, index: ProfileIndex) -> &mut T {
        &mut self[index.0]
    }
}

/// A complete, versioned routing configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileSet {
    /// Monotonic document version; a router never replaces a set with an older one. At most
    /// [`MAX_VERSION`].
    pub version: u64,
    /// When the document was written (RFC 3339), informational.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<String>,
    /// The profile that shadow mode, canary control traffic and savings are measured against.
    pub default_profile: String,
    #[serde(default)]
    pub policy: Policy,
    pub profiles: Vec<Profile>,
}

/// The largest document version: 2^53 − 1, the largest integer every JSON reader (and the
/// Lua numbers of the Redis push script) holds exactly. A larger one would be read back
/// rounded or negative and break every later compare-and-set push.
pub const MAX_VERSION: u64 = (1 << 53) - 1;

/// How profiles are scored and chosen.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Policy {
    pub weights: Weights,
    /// Hard upper bound on predicted latency unless a request overrides it.
    pub latency_budget_ms: f64,
    /// The output length latency and cost are predicted for when a request sets no
    /// `max_tokens`, and the cap when it sets a larger one: `max_tokens` is a ceiling,
    /// not a forecast, and chat answers are typically a few hundred tokens.
    pub expected_output_tokens: u32,
    pub required_quality: RequiredQuality,
    pub complexity: ComplexityWeights,
    pub quality_fallback: QualityFallback,
    pub mode: Mode,
    /// Share of requests routed adaptively in `canary` mode, 0..=100.
    pub canary_percent: u8,
    /// The highest net probability that a cheaper profile's answer is worse than the
    /// reference's (the classifier's outcome head) at which that profile may serve a prompt
    /// its quality falls short for; 0 turns the rule off.
    pub risk_tolerance: f64,
    /// Check the start of streamed answers from tiers with a better one above; absent: off.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stream_check: Option<StreamCheck>,
    /// Live agreement sampling against a reference tier; absent: off.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub calibration: Option<Calibration>,
    /// A rating by a cheap tier for prompts of uncertain risk; absent: off.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub second_opinion: Option<SecondOpinion>,
    /// How strongly requests stick to the endpoint and profile holding their KV cache.
    pub affinity: Affinity,
    /// For which APIs a request's output limit is only a ceiling.
    pub output_ceiling: OutputCeiling,
    /// Continuing a stream whose upstream failed after content reached the client.
    pub stream_resume: StreamResume,
}

/// `policy.output_ceiling`: the APIs whose output limit (`max_tokens`, `max_output_tokens`)
/// is an upper bound rather than room to reserve. Anthropic's and OpenAI's agent APIs treat
/// it so, and agents set it far above any answer (Claude Code asks for 32,000). For those
/// APIs a profile is excluded only when the prompt itself does not fit its context, latency
/// and cost are predicted for the expected output, and each upstream is sent the limit
/// lowered to what its context holds beside the prompt (`docs/routing.md`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OutputCeiling {
    /// The APIs it applies to; `[]` makes every limit room the context must hold.
    pub apis: Vec<UpstreamApi>,
    /// The share by which the prompt's estimate is raised before the limit is cut to the
    /// context left: the estimate counts characters, the upstream tokens. 0..=1.
    pub prompt_margin: f64,
}

/// `policy.stream_resume`: a streamed answer whose upstream fails after content reached the
/// client is continued from the delivered text by another endpoint, in the same stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StreamResume {
    /// Continuations one stream may get; 0 turns resumption off.
    pub max_resumes: u32,
}

/// `policy.affinity`: how strongly requests stick to where their cache is.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Affinity {
    /// A prompt's cached prefix may send it to an endpoint whose load is at most this many
    /// times the least loaded endpoint's (and always to one with a single request more).
    pub max_load_factor: f64,
    /// What a block of the prompt the endpoint must compute weighs against a block of
    /// prefill already queued there: above 1, because a recomputed prefix also delays
    /// whatever queues behind it and leaves the cached copy unused.
    pub recompute_weight: f64,
    /// Keep a conversation on the profile its earlier turns used while that profile meets
    /// the new turn's constraints.
    pub session: bool,
}

/// `upstream.balance`: how a request picks one endpoint of a profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Balance {
    /// The endpoint most likely to hold the prompt's prefix, within the load bound.
    #[default]
    Prefix,
    /// The less loaded of two random endpoints (power of two choices).
    LeastLoad,
}

/// `policy.stream_check`: hold the first tokens of a streamed answer from a tier that has a
/// better one above it and run the answer checks on them before the client sees a byte.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StreamCheck {
    /// Content events (about one token each) of each choice held before the check runs.
    pub tokens: u32,
    /// The longest a stream is held. The hold is paced: after the first content event each
    /// next one is due within `max_hold_ms / tokens` on average, and a stream that falls
    /// behind is committed unchecked at once.
    pub max_hold_ms: u64,
}

/// `policy.calibration`: a sample of answers from lower tiers is also asked of a reference
/// tier, after the client has its answer, and the two compared.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Calibration {
    /// Share of eligible (non-streamed, answered by a lower tier) requests sampled, 0..=1.
    pub sample_rate: f64,
    /// The profile whose answers the others are compared with (usually the FP16 tier).
    pub reference_profile: String,
    /// Ceiling on the estimated cost of the reference requests per hour, in the profile
    /// prices' currency.
    pub max_extra_cost_per_hour: f64,
    /// Write an outcome record for every finished comparison; absent: none are written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcomes: Option<OutcomeSink>,
}

/// `policy.calibration.outcomes`: where the outcome records of sampled requests go
/// (`docs/routing.md`, "Learning from the router's own traffic").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OutcomeSink {
    /// The Redis stream `<prefix>:outcomes` of the router's Redis (`--redis-url`).
    pub redis: bool,
    /// A JSON-lines file on each replica; past `max_len` lines it is moved to `FILE.1`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file: Option<String>,
    /// Records kept: the stream is trimmed to about this many (`XADD … MAXLEN ~`).
    pub max_len: u64,
    /// The stream expires this long after its last record.
    pub ttl_s: u64,
}

/// `policy.second_opinion`: when the outcome head's risk for a request falls inside `band`,
/// `profile` rates the request's difficulty with one digit, and the rating replaces the risk.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecondOpinion {
    /// The risks, inclusive, for which a rating is asked.
    #[serde(default = "SecondOpinion::default_band")]
    pub band: [f64; 2],
    /// The profile asked (normally the cheapest tier).
    pub profile: String,
    /// How long the rating may take; past it the model's risk stands. 1..=5000.
    #[serde(default = "SecondOpinion::default_timeout_ms")]
    pub timeout_ms: u64,
    /// Whether streamed requests are rated too (their client waits for the first token).
    #[serde(default)]
    pub streams: bool,
}

/// Weights of the utility terms; only their ratios matter.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Weights {
    pub quality: f64,
    pub latency: f64,
    pub cost: f64,
}

/// Required quality grows linearly with prompt complexity from `base` to `max`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RequiredQuality {
    pub base: f64,
    pub max: f64,
}

/// Feature weights of the complexity score (see `docs/routing.md`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ComplexityWeights {
    pub entropy: f64,
    pub lexical: f64,
    pub code: f64,
    pub math: f64,
    pub json: f64,
    pub numeric: f64,
    pub length: f64,
    /// Features are computed over at most this many bytes of prompt text, which bounds the
    /// work per request whatever the prompt size.
    pub scoring_window_chars: usize,
}

/// Re-run degenerate non-streamed answers on a better profile.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QualityFallback {
    pub enabled: bool,
    /// An answer whose repeated-word share exceeds this is treated as degenerate.
    pub max_repetition_ratio: f64,
}

/// What the router does with a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Route adaptively.
    #[default]
    Enforce,
    /// Decide and record, but send everything to `default_profile`.
    Shadow,
    /// Adaptive for `canary_percent`% of request keys, default profile for the rest.
    Canary,
}

/// One model-quantization pair served by one vLLM deployment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    pub id: String,
    /// The model name the upstream serves; requests are rewritten to it.
    pub model: String,
    pub quantization: String,
    /// Scaling and metrics group (e.g. `fp16`, `fp8`, `int4`).
    pub tier: String,
    pub upstream: Upstream,
    pub cost_per_1m_input_tokens: f64,
    pub cost_per_1m_output_tokens: f64,
    pub latency: Latency,
    pub quality: Quality,
    pub max_context_tokens: u32,
    /// In-flight requests the router sends before queueing; vLLM's default `max_num_seqs`.
    #[serde(default = "default_max_concurrency")]
    pub max_concurrency: u32,
    /// Characters per token for estimates; ~4 for English with Llama-family tokenizers.
    #[serde(default = "default_chars_per_token")]
    pub chars_per_token: f64,
    /// Scale from zero: how long a request may wait for this profile's first endpoint when
    /// it has none (KEDA scaled it to zero) and no warm profile fits. 0 = never wait.
    #[serde(default)]
    pub cold_start_timeout_ms: u64,
    #[serde(default = "default_enabled")]
    pub enabled: bool,
}

/// Where a profile's vLLM server lives.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Upstream {
    /// A Kubernetes service, reached by cluster DNS or through EndpointSlice discovery.
    Service(ServiceUpstream),
    /// Fixed base URLs, balanced by the router.
    Static(StaticUpstream),
}

/// A Kubernetes service upstream. The access fields (`api_key_env`, `api_key_file`,
/// `metrics`, `ca_file`, `http2`) are the same for both kinds of upstream; see
/// [`Upstream::api_key`], [`Upstream::queue_metrics`] and [`Upstream::transport`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceUpstream {
    pub service: String,
    #[serde(default = "default_namespace")]
    pub namespace: String,
    /// vLLM's OpenAI server listens on 8000 by default.
    #[serde(default = "default_port")]
    pub port: u16,
    /// Environment variable holding the bearer token for this upstream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_env: Option<String>,
    /// File holding the bearer token for this upstream (a mounted Secret).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_file: Option<String>,
    /// Names of the upstream's queue metrics; detected when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<QueueMetrics>,
    /// PEM file of the CA that signs the upstream's certificate (`https://` URLs only);
    /// absent: the system's roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<String>,
    /// Speak HTTP/2 to the upstream: h2c with prior knowledge on `http://`, ALPN on
    /// `https://`. Off by default: vLLM's server speaks HTTP/1.1 only.
    #[serde(default, skip_serializing_if = "is_false")]
    pub http2: bool,
    /// The APIs the upstream serves natively; the router translates the others to chat.
    #[serde(default = "default_apis", skip_serializing_if = "is_default_apis")]
    pub apis: Vec<UpstreamApi>,
    /// How a request picks an endpoint; absent: by cached prefix ([`Balance::Prefix`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub balance: Option<Balance>,
    /// The server continues a final assistant message (`continue_final_message`), so it
    /// may take over a broken stream ([`StreamResume`]); `false` for one that cannot.
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub resume: bool,
}

/// Fixed base URLs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StaticUpstream {
    pub urls: Vec<String>,
    /// Environment variable holding the bearer token for this upstream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_env: Option<String>,
    /// File holding the bearer token for this upstream (a mounted Secret).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_file: Option<String>,
    /// Names of the upstream's queue metrics; detected when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<QueueMetrics>,
    /// PEM file of the CA that signs the upstream's certificate (`https://` URLs only);
    /// absent: the system's roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<String>,
    /// Speak HTTP/2 to the upstream: h2c with prior knowledge on `http://`, ALPN on
    /// `https://`. Off by default: vLLM's server speaks HTTP/1.1 only.
    #[serde(default, skip_serializing_if = "is_false")]
    pub http2: bool,
    /// How a request picks an endpoint; absent: by cached prefix ([`Balance::Prefix`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub balance: Option<Balance>,
    /// The APIs the upstream serves natively; the router translates the others to chat.
    #[serde(default = "default_apis", skip_serializing_if = "is_default_apis")]
    pub apis: Vec<UpstreamApi>,
    /// The server continues a final assistant message; see [`ServiceUpstream::resume`].
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub resume: bool,
}

/// An API an upstream may serve (`upstream.apis`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UpstreamApi {
    /// OpenAI Chat Completions, `/v1/chat/completions`.
    Chat,
    /// OpenAI Completions, `/v1/completions`.
    Completions,
    /// Anthropic Messages, `/v1/messages`.
    Messages,
    /// OpenAI Responses, `/v1/responses`.
    Responses,
}

// === impl StaticUpstream ===

impl StaticUpstream {
    /// Fixed URLs with no API key and detected queue metrics.
    pub fn new(urls: Vec<String>) -> Self {
        Self {
            urls,
            ..Self::default()
        }
    }
}

impl Default for StaticUpstream {
    fn default() -> Self {
        Self {
            urls: Vec::new(),
            api_key_env: None,
            api_key_file: None,
            metrics: None,
            ca_file: None,
            http2: false,
            apis: default_apis(),
            balance: None,
            resume: true,
        }
    }
}

/// Prometheus metric names the router reads an upstream's queue from, overriding detection.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueueMetrics {
    /// Requests waiting to start (vLLM: `vllm:num_requests_waiting`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<String>,
    /// Requests being generated (vLLM: `vllm:num_requests_running`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running: Option<String>,
}

/// How the router connects to an upstream ([`Upstream::transport`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Transport<'a> {
    /// The CA file `https://` connections verify against; `None`: the system's roots.
    pub ca_file: Option<&'a str>,
    /// HTTP/2 (h2c or ALPN) instead of HTTP/1.1.
    pub http2: bool,
}

/// Where an upstream's bearer token is read from. The document names the place, never the
/// token itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiKeySource<'a> {
    /// An environment variable of the router process.
    Env(&'a str),
    /// A file (a mounted Kubernetes Secret); surrounding whitespace is trimmed.
    File(&'a str),
}

/// Unloaded latency of a profile.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Latency {
    pub ttft_ms: f64,
    pub itl_ms: f64,
}

/// Measured answer quality in [0,1], per task class where known.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Quality {
    pub default: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub math: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub structured: Option<f64>,
    /// Multi-step reasoning in prose; older documents without it use `default`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<f64>,
}

/// Why a document was refused.
#[derive(Debug, thiserror::Error)]
pub enum ProfileSetError {
    /// Not JSON, wrong types or unknown fields.
    #[error("{path}: {message}")]
    Parse { path: String, message: String },
    /// Well-formed but breaks a rule.
    #[error("{0}")]
    Invalid(ValidationErrors),
}

/// Every rule a document breaks, each with its JSON path.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ValidationErrors(pub Vec<FieldError>);

/// One broken rule.
#[derive(Debug, Clone, PartialEq)]
pub struct FieldError {
    /// JSON path such as `profiles[2].latency.itl_ms`.
    pub path: String,
    pub message: String,
}

// === impl ProfileSet ===

impl ProfileSet {
    /// Parses and validates a document; errors carry the JSON path.
    pub fn from_json(text: &str) -> Result<Self, ProfileSetError> {
        let set: ProfileSet = parse_with_path(text)?;
        set.validate().map_err(ProfileSetError::Invalid)?;
        Ok(set)
    }

    /// Checks every rule of the profile-set document and reports all violations.
    pub fn validate(&self) -> Result<(), ValidationErrors> {
        let mut errors = Vec::new();
        let mut err = |path: String, message: &str| {
            errors.push(FieldError {
                path,
                message: message.to_owned(),
            })
        };
        if self.version > MAX_VERSION {
            err(
                "version".into(),
                "must be at most 9007199254740991 (2^53 - 1), the largest integer JSON numbers hold exactly",
            );
        }
        self.policy.check(&mut err);
        if self.profiles.is_empty() {
            err("profiles".into(), "must contain at least one profile");
        } else if !self.profiles.iter().any(|p| p.enabled) {
            err("profiles".into(), "at least one profile must be enabled");
        }
        for (i, profile) in self.profiles.iter().enumerate() {
            let path = format!("profiles[{i}]");
            if self.profiles[..i].iter().any(|p| p.id == profile.id) {
                err(format!("{path}.id"), "duplicate profile id");
            }
            profile.check(&path, &mut err);
        }
        if let Some(c) = &self.policy.calibration {
            if !self
                .profiles
                .iter()
                .any(|p| p.id == c.reference_profile && p.enabled)
            {
                err(
                    "policy.calibration.reference_profile".into(),
                    "must name an enabled profile in `profiles`",
                );
            }
        }
        if let Some(o) = &self.policy.second_opinion {
            if !self.profiles.iter().any(|p| p.id == o.profile && p.enabled) {
                err(
                    "policy.second_opinion.profile".into(),
                    "must name an enabled profile in `profiles`",
                );
            }
        }
        if !self.profiles.iter().any(|p| p.id == self.default_profile) {
            err(
                "default_profile".into(),
                "must name a profile in `profiles`",
            );
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(ValidationErrors(errors))
        }
    }

    /// The profile with this id.
    pub fn profile(&self, id: &str) -> Option<&Profile> {
        self.profiles.iter().find(|p| p.id == id)
    }

    /// Index of the profile with this id.
    pub fn index_of(&self, id: &str) -> Option<ProfileIndex> {
        self.profiles
            .iter()
            .position(|p| p.id == id)
            .map(ProfileIndex)
    }

    /// Index of `default_profile` (validated to exist; falls back to the first profile).
    pub fn default_index(&self) -> ProfileIndex {
        self.index_of(&self.default_profile)
            .unwrap_or(ProfileIndex(0))
    }

    /// Every profile with its index.
    pub fn indexed(&self) -> impl Iterator<Item = (ProfileIndex, &Profile)> {
        self.profiles
            .iter()
            .enumerate()
            .map(|(i, p)| (ProfileIndex(i), p))
    }

    /// The enabled profile with the lowest output price (ties: input price, then id): the
    /// tier that routing quality is measured against.
    pub fn cheapest(&self) -> &Profile {
        self.profiles
            .iter()
            .filter(|p| p.enabled)
            .min_by(|a, b| {
                a.cost_per_1m_output_tokens
                    .total_cmp(&b.cost_per_1m_output_tokens)
                    .then(
                        a.cost_per_1m_input_tokens
                            .total_cmp(&b.cost_per_1m_input_tokens),
                    )
                    .then_with(|| a.id.cmp(&b.id))
            })
            .unwrap_or(&self.profiles[0])
    }
}

/// Deserializes with `serde_path_to_error` so a type error names its JSON path.
pub(crate) fn parse_with_path<T: serde::de::DeserializeOwned>(
    text: &str,
) -> Result<T, ProfileSetError> {
    let de = &mut serde_json::Deserializer::from_str(text);
    let value = serde_path_to_error::deserialize(&mut *de).map_err(|e| {
        let path = e.path().to_string();
        ProfileSetError::Parse {
            path: if path == "." { "$".into() } else { path },
            message: e.into_inner().to_string(),
        }
    })?;
    // One document: bytes after it mean the text is not what the operator thinks it is.
    de.end().map_err(|e| ProfileSetError::Parse {
        path: "$".into(),
        message: e.to_string(),
    })?;
    Ok(value)
}

// === impl Policy ===

impl Default for Policy {
    fn default() -> Self {
        Self {
            weights: Weights::default(),
            // Interactive chat tolerates a few seconds for a few hundred tokens.
            latency_budget_ms: 8000.0,
            expected_output_tokens: 256,
            required_quality: RequiredQuality::default(),
            complexity: ComplexityWeights::default(),
            quality_fallback: QualityFallback::default(),
            mode: Mode::Enforce,
            canary_percent: 100,
            risk_tolerance: 0.0,
            stream_check: None,
            calibration: None,
            second_opinion: None,
            affinity: Affinity::default(),
            output_ceiling: OutputCeiling::default(),
            stream_resume: StreamResume::default(),
        }
    }
}

impl Default for OutputCeiling {
    /// The agent APIs, whose clients send a ceiling; chat and completions keep OpenAI's
    /// reading, under which a limit the model cannot reach is refused. A tenth over the
    /// estimate covers the usual gap between characters per token and the tokenizer's count.
    fn default() -> Self {
        Self {
            apis: vec![UpstreamApi::Messages, UpstreamApi::Responses],
            prompt_margin: 0.1,
        }
    }
}

// === impl Affinity ===

impl Default for Affinity {
    /// 1.5: a cached prefix is worth queueing behind half as many requests again as the
    /// least loaded endpoint has (prefill saved against queue wait), not more — the bound
    /// under which a hot prefix's max/mean replica load stays at 1.5. Recompute weight 4:
    /// a conversation leaves its cache only for a queue several times its own prefill, so
    /// moves stay rare and the hit rate stays; at 1 every move that helps one turn costs
    /// the turns behind it more (docs/routing.md). Sessions on: a turn that moves tier
    /// recomputes the whole conversation.
    fn default() -> Self {
        Self {
            max_load_factor: 1.5,
            recompute_weight: 4.0,
            session: true,
        }
    }
}

impl Affinity {
    pub(crate) fn check(&self, err: &mut impl FnMut(String, &str)) {
        if !(self.max_load_factor >= 1.0 && self.max_load_factor.is_finite()) {
            err(
                "policy.affinity.max_load_factor".into(),
                "must be a number >= 1",
            );
        }
        if !(self.recompute_weight >= 1.0 && self.recompute_weight.is_finite()) {
            err(
                "policy.affinity.recompute_weight".into(),
                "must be a number >= 1",
            );
        }
    }
}

// === impl OutputCeiling ===

impl OutputCeiling {
    /// Whether a request's output limit is only a ceiling on `api`.
    pub fn applies_to(&self, api: UpstreamApi) -> bool {
        self.apis.contains(&api)
    }

    /// The output limit to send an upstream whose context holds `max_context_tokens`, for a
    /// request asking at most `max_tokens` with a prompt estimated at `prompt_tokens`: the
    /// request's own, or the context left beside the prompt (with the margin), at least 1.
    pub fn clamp(&self, max_tokens: u32, max_context_tokens: u32, prompt_tokens: u64) -> u32 {
        let prompt = (prompt_tokens as f64 * (1.0 + self.prompt_margin.max(0.0))).ceil();
        let left = (f64::from(max_context_tokens) - prompt).max(1.0);
        // `left` is in 1..=u32::MAX here; `as` saturates anyway.
        max_tokens.min(left as u32)
    }
}

/// The most continuations `policy.stream_resume.max_resumes` may allow one stream.
const MAX_RESUMES: u32 = 3;

impl Default for StreamResume {
    /// One continuation hides the usual single failure (a pod scaled down, evicted or out of
    /// memory); a stream that breaks again is meeting a tier in trouble, not bad luck.
    fn default() -> Self {
        Self { max_resumes: 1 }
    }
}

/// The most records `policy.calibration.outcomes.max_len` may keep.
const MAX_OUTCOME_RECORDS: u64 = 10_000_000;

impl Default for OutcomeSink {
    /// A hundred thousand records (tens of MB in Redis) retrain the head many times over; a
    /// week keeps a stream no router writes to any more from lingering.
    fn default() -> Self {
        Self {
            redis: true,
            file: None,
            max_len: 100_000,
            ttl_s: 7 * 24 * 3600,
        }
    }
}

impl SecondOpinion {
    fn default_band() -> [f64; 2] {
        [0.35, 0.65]
    }

    /// A rating call against a tier answering its first token in tens of milliseconds.
    fn default_timeout_ms() -> u64 {
        150
    }
}

impl Default for StreamCheck {
    /// 24 tokens are enough to see an empty answer, a loop or prose where JSON was asked for,
    /// and arrive within a few hundred milliseconds on every tier; 800 ms bounds what a
    /// passing stream's first token can be delayed by, and paces the hold at a token per
    /// 33 ms, slower than any tier's decoding when it is not overloaded.
    fn default() -> Self {
        Self {
            tokens: 24,
            max_hold_ms: 800,
        }
    }
}

impl Policy {
    fn check(&self, err: &mut impl FnMut(String, &str)) {
        let w = &self.weights;
        for (name, value) in [
            ("quality", w.quality),
            ("latency", w.latency),
            ("cost", w.cost),
        ] {
            check_unit(&format!("policy.weights.{name}"), value, err);
        }
        positive("policy.latency_budget_ms", self.latency_budget_ms, err);
        if self.expected_output_tokens == 0 {
            err("policy.expected_output_tokens".into(), "must be > 0");
        }
        let rq = &self.required_quality;
        check_unit("policy.required_quality.base", rq.base, err);
        check_unit("policy.required_quality.max", rq.max, err);
        if rq.max < rq.base {
            err("policy.required_quality.max".into(), "must be >= base");
        }
        let c = &self.complexity;
        for (name, value) in [
            ("entropy", c.entropy),
            ("lexical", c.lexical),
            ("code", c.code),
            ("math", c.math),
            ("json", c.json),
            ("numeric", c.numeric),
            ("length", c.length),
        ] {
            check_unit(&format!("policy.complexity.{name}"), value, err);
        }
        if c.scoring_window_chars == 0 {
            err(
                "policy.complexity.scoring_window_chars".into(),
                "must be > 0",
            );
        }
        check_unit(
            "policy.quality_fallback.max_repetition_ratio",
            self.quality_fallback.max_repetition_ratio,
            err,
        );
        if self.canary_percent > 100 {
            err("policy.canary_percent".into(), "must be in [0, 100]");
        }
        check_unit("policy.risk_tolerance", self.risk_tolerance, err);
        if let Some(check) = &self.stream_check {
            if check.tokens == 0 {
                err("policy.stream_check.tokens".into(), "must be > 0");
            }
            if check.max_hold_ms == 0 {
                err("policy.stream_check.max_hold_ms".into(), "must be > 0");
            }
        }
        self.affinity.check(err);
        check_unit(
            "policy.output_ceiling.prompt_margin",
            self.output_ceiling.prompt_margin,
            err,
        );
        if self.stream_resume.max_resumes > MAX_RESUMES {
            err(
                "policy.stream_resume.max_resumes".into(),
                "must be in [0, 3]",
            );
        }
        if let Some(c) = &self.calibration {
            check_unit("policy.calibration.sample_rate", c.sample_rate, err);
            positive(
                "policy.calibration.max_extra_cost_per_hour",
                c.max_extra_cost_per_hour,
                err,
            );
            if let Some(o) = &c.outcomes {
                if !(1..=MAX_OUTCOME_RECORDS).contains(&o.max_len) {
                    err(
                        "policy.calibration.outcomes.max_len".into(),
                        "must be in 1..=10000000",
                    );
                }
                if o.ttl_s == 0 {
                    err("policy.calibration.outcomes.ttl_s".into(), "must be > 0");
                }
                if !o.redis && o.file.as_deref().is_none_or(|f| f.trim().is_empty()) {
                    err(
                        "policy.calibration.outcomes".into(),
                        "needs a destination: \"redis\": true or a \"file\"",
                    );
                }
            }
        }
        if let Some(o) = &self.second_opinion {
            let [low, high] = o.band;
            if !(0.0..=1.0).contains(&low) || !(0.0..=1.0).contains(&high) {
                err(
                    "policy.second_opinion.band".into(),
                    "both bounds must be in [0, 1]",
                );
            } else if low >= high {
                err(
                    "policy.second_opinion.band".into(),
                    "the lower bound must be below the upper one",
                );
            }
            if !(1..=5000).contains(&o.timeout_ms) {
                err(
                    "policy.second_opinion.timeout_ms".into(),
                    "must be in 1..=5000",
                );
            }
        }
    }
}

impl Default for Weights {
    /// Quality dominates; cost outweighs latency because every profile must already meet
    /// the latency budget to be feasible.
    fn default() -> Self {
        Self {
            quality: 1.0,
            latency: 0.3,
            cost: 0.5,
        }
    }
}

impl Default for RequiredQuality {
    /// 0.80 is where 4-bit quantizations of 8B models still answer simple prompts well;
    /// 0.97 asks for near-FP16 quality on the hardest prompts.
    fn default() -> Self {
        Self {
            base: 0.80,
            max: 0.97,
        }
    }
}

impl Default for ComplexityWeights {
    /// Tuned on `eval/prompt-mix.jsonl`; see `docs/routing.md` for each weight.
    fn default() -> Self {
        Self {
            entropy: 0.20,
            lexical: 0.15,
            code: 0.30,
            math: 0.30,
            json: 0.20,
            numeric: 0.10,
            length: 0.25,
            scoring_window_chars: 4096,
        }
    }
}

impl Default for QualityFallback {
    /// Half the words being repeats is far beyond natural prose (~0.2-0.3 for long answers).
    fn default() -> Self {
        Self {
            enabled: true,
            max_repetition_ratio: 0.5,
        }
    }
}

// === impl Profile ===

impl Profile {
    fn check(&self, path: &str, err: &mut impl FnMut(String, &str)) {
        if self.id.trim().is_empty() {
            err(format!("{path}.id"), "must not be empty");
        }
        if self.model.trim().is_empty() {
            err(format!("{path}.model"), "must not be empty");
        }
        if self.tier.trim().is_empty() {
            err(format!("{path}.tier"), "must not be empty");
        }
        let cost_in = format!("{path}.cost_per_1m_input_tokens");
        positive(&cost_in, self.cost_per_1m_input_tokens, err);
        let cost_out = format!("{path}.cost_per_1m_output_tokens");
        positive(&cost_out, self.cost_per_1m_output_tokens, err);
        positive(
            &format!("{path}.latency.ttft_ms"),
            self.latency.ttft_ms,
            err,
        );
        positive(&format!("{path}.latency.itl_ms"), self.latency.itl_ms, err);
        check_unit(
            &format!("{path}.quality.default"),
            self.quality.default,
            err,
        );
        for (name, value) in [
            ("code", self.quality.code),
            ("math", self.quality.math),
            ("structured", self.quality.structured),
            ("reasoning", self.quality.reasoning),
        ] {
            if let Some(value) = value {
                check_unit(&format!("{path}.quality.{name}"), value, err);
            }
        }
        if self.max_context_tokens == 0 {
            err(format!("{path}.max_context_tokens"), "must be > 0");
        }
        if self.max_concurrency == 0 {
            err(format!("{path}.max_concurrency"), "must be > 0");
        }
        positive(
            &format!("{path}.chars_per_token"),
            self.chars_per_token,
            err,
        );
        self.upstream.check(&format!("{path}.upstream"), err);
    }

    /// Quality for a task class, falling back to `quality.default`.
    pub fn quality_for(&self, class: TaskClass) -> f64 {
        let q = &self.quality;
        match class {
            TaskClass::Code => q.code,
            TaskClass::Math => q.math,
            TaskClass::Structured => q.structured,
            TaskClass::Reasoning => q.reasoning,
            TaskClass::General => None,
        }
        .unwrap_or(q.default)
    }
}

fn default_max_concurrency() -> u32 {
    256
}

fn default_chars_per_token() -> f64 {
    4.0
}

fn default_enabled() -> bool {
    true
}

fn default_namespace() -> String {
    "default".into()
}

fn default_port() -> u16 {
    8000
}

// === impl Upstream ===

impl Upstream {
    fn check(&self, path: &str, err: &mut impl FnMut(String, &str)) {
        match self {
            Upstream::Service(s) => {
                if !is_dns_label(&s.service) {
                    err(format!("{path}.service"), "must be a DNS-1123 label");
                }
                if !is_dns_label(&s.namespace) {
                    err(format!("{path}.namespace"), "must be a DNS-1123 label");
                }
                if s.port == 0 {
                    err(format!("{path}.port"), "must be in 1..=65535");
                }
            }
            Upstream::Static(s) => {
                if s.urls.is_empty() {
                    err(format!("{path}.urls"), "must contain at least one URL");
                }
                for (i, url) in s.urls.iter().enumerate() {
                    if let Err(why) = check_base_url(url) {
                        err(format!("{path}.urls[{i}]"), why);
                    }
                }
            }
        }
        if !self.serves(UpstreamApi::Chat) {
            err(
                format!("{path}.apis"),
                "must include \"chat\": chat requests, and agent requests translated to chat, go to every profile",
            );
        }
        let (key_env, key_file, metrics) = self.access();
        if let Some(var) = key_env {
            if !is_env_name(var) {
                err(
                    format!("{path}.api_key_env"),
                    "must be an environment variable name ([A-Za-z_][A-Za-z0-9_]*)",
                );
            }
        }
        match key_file {
            Some(_) if key_env.is_some() => err(
                format!("{path}.api_key_file"),
                "set api_key_env or api_key_file, not both",
            ),
            Some(file) if file.trim().is_empty() => {
                err(format!("{path}.api_key_file"), "must not be empty")
            }
            _ => {}
        }
        if let Some(ca_file) = self.transport().ca_file {
            if ca_file.trim().is_empty() {
                err(format!("{path}.ca_file"), "must not be empty");
            } else if !self.base_urls().iter().any(|u| u.starts_with("https://")) {
                err(
                    format!("{path}.ca_file"),
                    "only https:// URLs use a CA file, and this upstream has none",
                );
            }
        }
        if let Some(metrics) = metrics {
            for (name, value) in [("waiting", &metrics.waiting), ("running", &metrics.running)] {
                if value.as_deref().is_some_and(|v| !is_metric_name(v)) {
                    err(
                        format!("{path}.metrics.{name}"),
                        "must be a Prometheus metric name ([a-zA-Z_:][a-zA-Z0-9_:]*)",
                    );
                }
            }
        }
    }

    /// The fields both kinds of upstream share: `api_key_env`, `api_key_file`, `metrics`.
    fn access(&self) -> (Option<&str>, Option<&str>, Option<&QueueMetrics>) {
        match self {
            Upstream::Service(s) => (
                s.api_key_env.as_deref(),
                s.api_key_file.as_deref(),
                s.metrics.as_ref(),
            ),
            Upstream::Static(s) => (
                s.api_key_env.as_deref(),
                s.api_key_file.as_deref(),
                s.metrics.as_ref(),
            ),
        }
    }

    /// Where this upstream's bearer token comes from, if it needs one.
    pub fn api_key(&self) -> Option<ApiKeySource<'_>> {
        match self.access() {
            (Some(var), _, _) => Some(ApiKeySource::Env(var)),
            (None, Some(file), _) => Some(ApiKeySource::File(file)),
            (None, None, _) => None,
        }
    }

    /// The queue metric names the document sets, if any.
    pub fn queue_metrics(&self) -> Option<&QueueMetrics> {
        self.access().2
    }

    /// How a request picks one of this upstream's endpoints.
    pub fn balance(&self) -> Balance {
        match self {
            Upstream::Service(s) => s.balance,
            Upstream::Static(s) => s.balance,
        }
        .unwrap_or_default()
    }

    /// How connections to this upstream are made: its CA file and HTTP version.
    pub fn transport(&self) -> Transport<'_> {
        let (ca_file, http2) = match self {
            Upstream::Service(s) => (s.ca_file.as_deref(), s.http2),
            Upstream::Static(s) => (s.ca_file.as_deref(), s.http2),
        };
        Transport { ca_file, http2 }
    }

    /// Whether the upstream can continue a broken stream (`upstream.resume`).
    pub fn resumes(&self) -> bool {
        match self {
            Upstream::Service(s) => s.resume,
            Upstream::Static(s) => s.resume,
        }
    }

    /// Whether the upstream serves `api` natively (`upstream.apis`).
    pub fn serves(&self, api: UpstreamApi) -> bool {
        let apis = match self {
            Upstream::Service(s) => &s.apis,
            Upstream::Static(s) => &s.apis,
        };
        apis.contains(&api)
    }

    /// Base URLs to reach this upstream without discovery: the static list, or the
    /// service's cluster DNS name.
    pub fn base_urls(&self) -> Vec<String> {
        match self {
            Upstream::Service(s) => vec![format!(
                "http://{}.{}.svc:{}",
                s.service, s.namespace, s.port
            )],
            Upstream::Static(s) => s.urls.clone(),
        }
    }
}

/// What every OpenAI-compatible server serves (vLLM, SGLang, llama.cpp, TGI); the agent
/// APIs are declared where a server has them, so nothing is sent where it would 404.
fn default_apis() -> Vec<UpstreamApi> {
    vec![UpstreamApi::Chat, UpstreamApi::Completions]
}

fn is_default_apis(apis: &Vec<UpstreamApi>) -> bool {
    *apis == default_apis()
}

fn is_false(value: &bool) -> bool {
    !*value
}

fn is_true(value: &bool) -> bool {
    *value
}

fn yes() -> bool {
    true
}

fn is_env_name(s: &str) -> bool {
    let mut bytes = s.bytes();
    bytes
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

fn is_metric_name(s: &str) -> bool {
    let mut bytes = s.bytes();
    bytes
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_' || b == b':')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b':')
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// Accepts `http(s)://host[:port][/path]` with a non-empty host and a numeric port.
fn check_base_url(url: &str) -> Result<(), &'static str> {
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
        .ok_or("must start with http:// or https://")?;
    if url.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err("must not contain whitespace");
    }
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let (host, port) = match authority.strip_prefix('[') {
        // An IPv6 literal: `[addr]` or `[addr]:port`.
        Some(bracketed) => {
            let (host, after) = bracketed
                .split_once(']')
                .ok_or("must close the IPv6 address with ]")?;
            let port = match after {
                "" => None,
                after => Some(after.strip_prefix(':').ok_or("must have a host")?),
            };
            (host, port)
        }
        None => match authority.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        },
    };
    let bracketed = authority.starts_with('[');
    if host.is_empty() || host.contains(['@', '[', ']']) || (!bracketed && host.contains(':')) {
        return Err("must have a host");
    }
    if let Some(port) = port {
        match port.parse::<u16>() {
            Ok(p) if p > 0 => {}
            _ => return Err("port must be a number in 1..=65535"),
        }
    }
    Ok(())
}

fn check_unit(path: &str, value: f64, err: &mut impl FnMut(String, &str)) {
    if !(0.0..=1.0).contains(&value) {
        err(path.to_owned(), "must be in [0, 1]");
    }
}

fn positive(path: &str, value: f64, err: &mut impl FnMut(String, &str)) {
    if !(value > 0.0 && value.is_finite()) {
        err(path.to_owned(), "must be > 0");
    }
}

// === impl ValidationErrors ===

impl fmt::Display for ValidationErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{}: {}", e.path, e.message)?;
        }
        Ok(())
    }
}

impl std::error::Error for ValidationErrors {}

#[cfg(test)]
mod tests;
