//! Live agreement sampling (`policy.calibration`, docs/routing.md §7): what a replica
//! reports on `GET /admin/calibration`, and how `quantrouter profiles suggest` turns the
//! reports of several replicas into proposed quality numbers.
//!
//! A sampled answer ([`Sample`]) is compared with the reference's in a task of its own,
//! after the client has it whole, and with `policy.calibration.outcomes` the comparison is
//! written as an outcome record ([`outcomes`]). A suggestion is only ever printed: an
//! operator reads it and pushes a profile set.

pub mod outcomes;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::HeaderMap;
use quantrouter_policy::{
    sampled, AgreementTally, AnswerChoice, Calibration, CostWindow, ProfileIndex, ProfileSet,
    QualityEstimate, Reason, RoutingDecision, TaskClass,
};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::openai::{answer_choices, find_usage, Endpoint, ParsedRequest, Usage};
use crate::profiles::{PerToken, Snapshot};
use crate::resilience::retry::{self, Forwarder, Plan};
use crate::resilience::{BudgetConfig, ResilienceConfig, RetryBudget};
use crate::telemetry;
use crate::tier_profile::matchers::{agree, json_payload, last_number, MatchKind};
use crate::upstream::UpstreamClient;
use quantrouter_policy::classifier::{OutcomeInputs, TrafficOutcome, OUTCOME_INPUTS};

/// The reference requests of one router: what was sampled, what it cost, what agreed.
#[derive(Debug)]
pub struct Calibrator {
    started: Instant,
    state: Mutex<State>,
    /// Where outcome records go when the policy asks for them.
    outcomes: outcomes::OutcomeLog,
}

#[derive(Debug)]
struct State {
    cost: CostWindow,
    /// Extra upstream load: reference requests per eligible request, like retries.
    load: RetryBudget,
    tallies: BTreeMap<(String, TaskClass), AgreementTally>,
    eligible: u64,
    sampled: u64,
    skipped: u64,
    not_comparable: u64,
}

/// What one admitted reference request was charged, so that its actual cost can replace it.
#[derive(Debug, Clone, Copy)]
pub struct Charge {
    at_ms: u64,
    estimate: f64,
}

/// One sampled answer on its way to the reference tier: everything the comparison needs,
/// owned, since it runs after the client's request is over.
#[derive(Debug)]
pub struct Sample {
    pub calibrator: Arc<Calibrator>,
    pub client: UpstreamClient,
    pub config: ResilienceConfig,
    pub snapshot: Arc<Snapshot>,
    pub policy: Calibration,
    /// The decision the served answer came from, and the profiles compared.
    pub decision: RoutingDecision,
    pub served: ProfileIndex,
    pub reference: ProfileIndex,
    pub wants_json: bool,
    /// The client's `max_tokens`: the reference's answer is at most this long.
    pub max_tokens: Option<u32>,
    /// The client's `n`: the reference answers that many choices too.
    pub choices: u32,
    pub path: &'static str,
    pub headers: HeaderMap,
    /// The client's body with the reference's model name.
    pub body: Bytes,
    pub request_id: String,
}

/// Largest served answer compared: far above any completion; a bigger one is not sampled.
pub const MAX_ANSWER: usize = 1024 * 1024;

/// `GET /admin/calibration`: this replica's agreement counts since it started.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CalibrationReport {
    /// `None` while the active profile set has no `policy.calibration`.
    pub reference_profile: Option<String>,
    pub sample_rate: f64,
    /// Estimated cost of the reference requests of the last hour, and its ceiling.
    pub spent_last_hour: f64,
    pub limit_per_hour: f64,
    /// Requests that could have been sampled (non-streamed, answered by another profile),
    /// and those the draw put in the sample.
    #[serde(default)]
    pub eligible: u64,
    #[serde(default)]
    pub sampled: u64,
    /// Sampled requests that were not sent because the hour's budget or the extra-load
    /// limit was used up.
    pub skipped: u64,
    /// Sampled requests that were not sent because the reference could not answer them
    /// alike: ones offering tools (a call asked again may act again) and prompts longer
    /// than the reference's context.
    #[serde(default)]
    pub not_comparable: u64,
    pub tallies: Vec<TallyRow>,
}

/// Agreement of one profile with the reference for one task class.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TallyRow {
    pub profile: String,
    pub task_class: TaskClass,
    #[serde(flatten)]
    pub tally: AgreementTally,
}

/// A proposed quality for one profile and task class.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Suggestion {
    pub profile: String,
    pub task_class: TaskClass,
    /// What the active profile set says now.
    pub current: f64,
    #[serde(flatten)]
    pub suggested: QualityEstimate,
}

/// Merges the replicas' counts and proposes, for every profile and task class with at least
/// `min_samples` samples, the reference's quality for that class times the agreement rate.
/// The reference is the one of `set`'s calibration policy; reports of another reference
/// are left out.
pub fn suggest(
    set: &ProfileSet,
    reports: &[CalibrationReport],
    min_samples: u64,
) -> Result<Vec<Suggestion>, String> {
    let calibration = set
        .policy
        .calibration
        .as_ref()
        .ok_or("the active profile set has no policy.calibration")?;
    let reference = set
        .profiles
        .iter()
        .find(|p| p.id == calibration.reference_profile)
        .ok_or("the calibration's reference profile is not in the set")?;
    let mut merged: BTreeMap<(String, TaskClass), AgreementTally> = BTreeMap::new();
    for report in reports
        .iter()
        .filter(|r| r.reference_profile.as_deref() == Some(reference.id.as_str()))
    {
        for row in &report.tallies {
            merged
                .entry((row.profile.clone(), row.task_class))
                .or_default()
                .merge(row.tally);
        }
    }
    Ok(merged
        .into_iter()
        .filter(|(_, tally)| tally.samples() >= min_samples.max(1))
        .filter_map(|((profile, task_class), tally)| {
            let current = set.profiles.iter().find(|p| p.id == profile)?;
            Some(Suggestion {
                current: current.quality_for(task_class),
                suggested: tally.quality(reference.quality_for(task_class))?,
                profile,
                task_class,
            })
        })
        .collect())
}

// === impl Calibrator ===

impl Default for Calibrator {
    fn default() -> Self {
        Self::new(ResilienceConfig::default().calibration)
    }
}

impl Calibrator {
    /// A calibrator whose reference requests are limited by `load` (see
    /// [`ResilienceConfig::calibration`]).
    pub fn new(load: BudgetConfig) -> Self {
        let now = Instant::now();
        Self {
            started: now,
            state: Mutex::new(State {
                cost: CostWindow::default(),
                load: RetryBudget::new(load, now),
                tallies: BTreeMap::new(),
                eligible: 0,
                sampled: 0,
                skipped: 0,
                not_comparable: 0,
            }),
            outcomes: outcomes::OutcomeLog::default(),
        }
    }

    /// Outcome records go to `log` (the router's Redis, and whether they may carry prompts).
    pub fn with_outcomes(mut self, log: outcomes::OutcomeLog) -> Self {
        self.outcomes = log;
        self
    }

    /// Whether a request that could be sampled (a non-streamed answer from another profile
    /// than the reference) is: a draw of the router's own against `rate`. Every such
    /// request counts towards the extra-load limit, sampled or not.
    pub fn sample(&self, rate: f64) -> bool {
        let mut state = self.lock();
        state.load.on_request(Instant::now());
        state.eligible += 1;
        let sampled = sampled(fastrand::f64(), rate);
        state.sampled += u64::from(sampled);
        sampled
    }

    /// Whether a sampled request may be asked of the reference: the hour's cost budget and
    /// the extra-load limit both have room for `reference_cost`, which is then charged.
    pub fn admit(&self, policy: &Calibration, reference_cost: f64) -> Option<Charge> {
        let now = Instant::now();
        let mut state = self.lock();
        let now_ms = now.duration_since(self.started).as_millis() as u64;
        // The cost is only spent once the load limit has said yes.
        let fits = state.cost.spent(now_ms) + reference_cost <= policy.max_extra_cost_per_hour;
        let spent = fits
            && state.load.try_retry(now)
            && state
                .cost
                .try_spend(now_ms, reference_cost, policy.max_extra_cost_per_hour);
        if !spent {
            state.skipped += 1;
            return None;
        }
        Some(Charge {
            at_ms: now_ms,
            estimate: reference_cost,
        })
    }

    /// The reference answered with its usage: its actual cost replaces the estimate charged.
    pub fn settle(&self, charge: Charge, actual: f64) {
        self.lock()
            .cost
            .correct(charge.at_ms, charge.estimate, actual);
    }

    /// Counts a sampled request the reference cannot be asked alike.
    pub fn not_comparable(&self) {
        self.lock().not_comparable += 1;
    }

    /// Counts whether the served answer agreed with the reference's.
    pub fn record(&self, profile: &str, task_class: TaskClass, agreed: bool) {
        self.lock()
            .tallies
            .entry((profile.to_owned(), task_class))
            .or_default()
            .record(agreed);
    }

    /// What `GET /admin/calibration` answers.
    pub fn report(&self, policy: Option<&Calibration>) -> CalibrationReport {
        let now_ms = Instant::now().duration_since(self.started).as_millis() as u64;
        let mut state = self.lock();
        CalibrationReport {
            reference_profile: policy.map(|p| p.reference_profile.clone()),
            sample_rate: policy.map_or(0.0, |p| p.sample_rate),
            spent_last_hour: state.cost.spent(now_ms),
            limit_per_hour: policy.map_or(0.0, |p| p.max_extra_cost_per_hour),
            eligible: state.eligible,
            sampled: state.sampled,
            skipped: state.skipped,
            not_comparable: state.not_comparable,
            tallies: state
                .tallies
                .iter()
                .map(|((profile, task_class), tally)| TallyRow {
                    profile: profile.clone(),
                    task_class: *task_class,
                    tally: *tally,
                })
                .collect(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Whether two answers to one prompt agree, compared the way the prompt's task asks: the
/// JSON keys for structured output (or any request for JSON), the last number for math,
/// normalised prose similarity for the rest. The reference's answer can say more than the
/// classifier: one that is JSON, or ends in a number, is compared as such, since prose
/// similarity finds "The answer is 41." and "The answer is 42." alike.
pub fn answers_agree(
    task_class: TaskClass,
    wants_json: bool,
    served: &str,
    reference: &str,
) -> bool {
    let ends_in_number = || {
        let tail = reference
            .trim_end()
            .trim_end_matches(['.', '!', '?', '*', '`']);
        tail.ends_with(|c: char| c.is_ascii_digit()) && last_number(tail).is_some()
    };
    let kind = match task_class {
        _ if wants_json => MatchKind::Json,
        TaskClass::Structured => MatchKind::Json,
        TaskClass::Math => MatchKind::Number,
        _ if json_payload(reference).is_some_and(|v| v.is_object() || v.is_array()) => {
            MatchKind::Json
        }
        _ if ends_in_number() => MatchKind::Number,
        TaskClass::Code | TaskClass::Reasoning | TaskClass::General => MatchKind::Contains,
    };
    agree(kind, served, reference)
}

// === impl Sample ===

impl Sample {
    /// The served answer arrived whole (with its usage): ask the reference too, in a task of
    /// its own, if it can answer alike and the hour's budget and the load limit allow.
    pub fn run(self, served: Bytes, usage: Option<Usage>) {
        // Without usage the cost of asking is unknown, and the budget could not bound it.
        let Some(usage) = usage else {
            return;
        };
        // The reference would refuse a prompt it cannot hold, and may still charge for it.
        let reference = &self.snapshot.set.profiles[self.reference];
        let needs = usage.prompt_tokens + u64::from(self.max_tokens.unwrap_or(0));
        if needs > u64::from(reference.max_context_tokens) {
            self.calibrator.not_comparable();
            return;
        }
        let estimate = self.reference_cost(usage);
        let Some(charge) = self.calibrator.admit(&self.policy, estimate) else {
            return;
        };
        tokio::spawn(self.compare(served, charge));
    }

    /// The most the reference's answer can cost: the same prompt, and at most `max_tokens`
    /// for each of the `n` choices (or, without one, as many tokens as the served answer,
    /// whose usage counts every choice).
    fn reference_cost(&self, usage: Usage) -> f64 {
        let output = self.max_tokens.map_or(usage.completion_tokens, |max| {
            u64::from(max) * u64::from(self.choices)
        });
        self.reference_price(Usage {
            prompt_tokens: usage.prompt_tokens,
            completion_tokens: output,
        })
    }

    /// What `usage` costs at the reference's prices.
    fn reference_price(&self, usage: Usage) -> f64 {
        PerToken::of(&self.snapshot.set.profiles[self.reference]).cost(usage)
    }

    async fn compare(self, served: Bytes, charge: Charge) {
        let profile = self.snapshot.set.profiles[self.served].id.as_str();
        let task_class = self.decision.task_class;
        let answered = self.ask_reference().await;
        if let Some(usage) = answered.as_ref().ok().and_then(|a| find_usage(a)) {
            self.calibrator.settle(charge, self.reference_price(usage));
        }
        let result = match answered {
            Ok(reference) => match (first_text(&served), first_text(&reference)) {
                (Some(served), Some(reference)) => {
                    match answers_agree(task_class, self.wants_json, &served, &reference) {
                        true => "agree",
                        false => "disagree",
                    }
                }
                // A tool call or a refusal: no text to compare.
                _ => return,
            },
            Err(error) => {
                tracing::debug!(request_id = self.request_id, %error,
                    "calibration: the reference did not answer");
                "error"
            }
        };
        if result != "error" {
            self.calibrator
                .record(profile, task_class, result == "agree");
        }
        telemetry::tier_agreement(profile, task_class.as_str(), result);
        if let (Some(sink), "agree" | "disagree") = (&self.policy.outcomes, result) {
            if let Some(record) = self.outcome_record(result == "agree") {
                self.calibrator.outcomes.write(sink, &record).await;
            }
        }
    }

    /// The comparison as an outcome record: the prompt as the outcome head reads it (the
    /// same parse and window as routing), never its text unless `--log-prompts`, and then
    /// only the window's text.
    fn outcome_record(&self, agreed: bool) -> Option<TrafficOutcome> {
        let endpoint = match self.path {
            "/v1/completions" => Endpoint::Completions,
            _ => Endpoint::Chat,
        };
        let parsed = ParsedRequest::parse(&self.body, endpoint).ok()?;
        let prompt = parsed.prompt();
        let window = self
            .snapshot
            .set
            .policy
            .complexity
            .scoring_window_chars
            .max(1);
        let profiles = &self.snapshot.set.profiles;
        Some(TrafficOutcome {
            features: OutcomeInputs::of(&prompt, window).named(),
            inputs: OUTCOME_INPUTS,
            task_class: self.decision.task_class,
            cheap_profile: profiles[self.served].id.clone(),
            reference_profile: profiles[self.reference].id.clone(),
            agreed,
            prompt: self
                .calibrator
                .outcomes
                .log_prompts()
                .then(|| OutcomeInputs::scored_text(&prompt, window)),
        })
    }

    /// The reference profile's whole answer, sent as a pinned request (admission, breaker
    /// and retries as for any request to it; no fallback to another profile).
    async fn ask_reference(&self) -> Result<Bytes, String> {
        let mut decision = self.decision.clone();
        decision.profile = self.reference;
        decision.reason = Reason::Pinned;
        let started = Instant::now();
        let deadline = started + self.config.default_deadline;
        let plan = Plan {
            snapshot: &self.snapshot,
            decision: &decision,
            pinned: true,
            stream: false,
            wants_json: self.wants_json,
            headers: &self.headers,
            started,
            deadline,
            trace: None,
            request_id: &self.request_id,
            // Extra load the router chose to add: every client request goes first.
            priority: i32::MIN,
            placement: &crate::upstream::Placement::default(),
        };
        let body_for = |_: ProfileIndex| retry::Outgoing {
            path: self.path,
            body: self.body.clone(),
        };
        Forwarder::new(&self.client, &self.config, plan, &body_for)
            .ask()
            .await
    }
}

/// The text of an answer's first choice.
fn first_text(body: &[u8]) -> Option<String> {
    match answer_choices(body)?.into_iter().next()? {
        AnswerChoice::Text(text) => Some(text.into_owned()),
        AnswerChoice::NotText => None,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use quantrouter_policy::{Calibration, DEFAULT_PROFILE_SET};

    fn set() -> ProfileSet {
        let mut set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
        set.policy.calibration = Some(Calibration {
            sample_rate: 0.1,
            reference_profile: "llama8b-fp16".into(),
            max_extra_cost_per_hour: 1.0,
            outcomes: None,
        });
        set
    }

    fn report(reference: &str, rows: &[(&str, TaskClass, u64, u64)]) -> CalibrationReport {
        CalibrationReport {
            reference_profile: Some(reference.into()),
            tallies: rows
                .iter()
                .map(|&(profile, task_class, agree, disagree)| TallyRow {
                    profile: profile.into(),
                    task_class,
                    tally: AgreementTally { agree, disagree },
                })
                .collect(),
            ..CalibrationReport::default()
        }
    }

    #[test]
    fn replicas_are_merged_and_scaled_by_the_references_quality() {
        let reports = [
            report(
                "llama8b-fp16",
                &[
                    ("llama8b-awq", TaskClass::Math, 70, 30),
                    ("llama8b-fp8", TaskClass::Code, 5, 0),
                ],
            ),
            report("llama8b-fp16", &[("llama8b-awq", TaskClass::Math, 90, 10)]),
            report("other", &[("llama8b-awq", TaskClass::Math, 0, 500)]),
        ];
        let suggestions = suggest(&set(), &reports, 30).unwrap();
        assert_eq!(suggestions.len(), 1, "{suggestions:?}");
        let s = &suggestions[0];
        assert_eq!(
            (s.profile.as_str(), s.task_class),
            ("llama8b-awq", TaskClass::Math)
        );
        assert_eq!(s.suggested.samples, 200);
        assert!((s.suggested.estimate - 0.93 * 0.8).abs() < 1e-9, "{s:?}");
        assert!(s.suggested.low < s.suggested.estimate && s.suggested.estimate < s.suggested.high);
        assert_eq!(s.current, 0.78);
    }

    fn policy(rate: f64, limit: f64) -> Calibration {
        Calibration {
            sample_rate: rate,
            reference_profile: "llama8b-fp16".into(),
            max_extra_cost_per_hour: limit,
            outcomes: None,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_hours_budget_bounds_the_extra_cost() {
        let calibrator = Calibrator::default();
        // Powers of two, so that ten costs add up to the limit exactly.
        let cost = 1.0 / 1024.0;
        let p = policy(1.0, 10.0 * cost);
        let admitted = (0..10_000)
            .filter(|_| calibrator.sample(p.sample_rate) && calibrator.admit(&p, cost).is_some())
            .count();
        assert_eq!(admitted, 10, "ten requests fill the hour's budget");
        let report = calibrator.report(Some(&p));
        assert!(
            report.spent_last_hour <= p.max_extra_cost_per_hour,
            "{report:?}"
        );
        assert!(report.skipped > 0);
        tokio::time::advance(Duration::from_secs(3601)).await;
        assert!(
            calibrator.admit(&p, cost).is_some(),
            "an hour later there is room again"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_load_limit_caps_reference_requests_whatever_the_rate() {
        let calibrator = Calibrator::default();
        let p = policy(1.0, 1e9);
        let admitted = (0..1000)
            .filter(|_| calibrator.sample(p.sample_rate) && calibrator.admit(&p, 0.0).is_some())
            .count();
        assert!(admitted <= 1000 / 20 + 2, "{admitted}");
        assert!(admitted >= 40, "{admitted}");
    }

    #[test]
    fn agreement_is_judged_by_what_the_task_asks() {
        assert!(answers_agree(
            TaskClass::Math,
            false,
            "so the total is 42.",
            "The answer: 42"
        ));
        assert!(!answers_agree(
            TaskClass::Math,
            false,
            "It is 41",
            "The answer: 42"
        ));
        assert!(answers_agree(
            TaskClass::General,
            true,
            "{\"a\": 1, \"b\": 2}",
            "```json\n{\"a\": 3, \"b\": 4}\n```"
        ));
        assert!(!answers_agree(
            TaskClass::Structured,
            false,
            "{\"a\": 1}",
            "{\"a\": 1, \"b\": 2}"
        ));
        assert!(answers_agree(
            TaskClass::General,
            false,
            "Paris is the capital of France.",
            "The capital of France is Paris."
        ));
        assert!(!answers_agree(
            TaskClass::General,
            false,
            "Lyon",
            "The capital of France is Paris."
        ));
    }

    #[test]
    fn numbers_and_json_in_the_references_answer_are_compared_as_such_whatever_the_class() {
        // Prose similarity would call these alike.
        assert!(!answers_agree(
            TaskClass::General,
            false,
            "The answer is 43.",
            "The answer is 42."
        ));
        assert!(answers_agree(
            TaskClass::Reasoning,
            false,
            "So it is 42.",
            "The answer is 42."
        ));
        // A subset of the reference's words, but a key short.
        assert!(!answers_agree(
            TaskClass::General,
            false,
            "{\"age\": 55}",
            "{\"age\": 55, \"city\": \"Bergen\"}"
        ));
    }

    #[test]
    fn without_a_calibration_policy_there_is_nothing_to_suggest() {
        let plain = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
        assert!(suggest(&plain, &[], 1).is_err());
    }
}
