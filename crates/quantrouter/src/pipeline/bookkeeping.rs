//! A generation request's bookkeeping, in one place: [`ledger`] counts the answer's head
//! and gathers what its end is booked with; when the answer ends, the answer's [`OnEnd`]
//! hook (or the endpoint picker, for an answer Envoy relays) hands the [`Outcome`] to
//! [`Ledger::book`] — the calibration sample, upstream failures, usage and cost, the learned
//! characters per token, the trace's end, the tenant's usage settled and the request's
//! duration. A resumed stream's parts are booked at the profiles that generated them
//! ([`split`]).

use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use opentelemetry::KeyValue;
use quantrouter_policy::ProfileIndex;

use super::context::RequestCtx;
use super::headers::{upstream_headers, Served};
use crate::apis::AgentApi;
use crate::app::App;
use crate::calibration::Sample;
use crate::openai::Endpoint;
use crate::openai::Usage;
use crate::profiles::{PerToken, Snapshot};
use crate::routing::PromptSize;
use crate::telemetry::{self, RequestLabels};
use crate::tenants::gate::Charge;
use crate::tenants::{ActiveTenant, Grant, Tenants};
use crate::traces::RequestTrace;
use crate::upstream::body::Handover;
use crate::upstream::{BodyEnd, OnEnd, Outcome, Pool};

/// An answer's head, as far as its books go.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AnswerHead {
    pub status: StatusCode,
    /// An SSE stream: its first output event is the first token, not the head.
    pub sse: bool,
}

/// Step 4: the answer's head counted (its status; the first token of a whole answer), and
/// the [`Ledger`] its end is booked with — usage and cost, the tenant's charge, the
/// calibration sample and the trace.
pub(crate) fn ledger(app: &App, ctx: &mut RequestCtx, served: &Served, head: AnswerHead) -> Ledger {
    let AnswerHead { status, sse } = head;
    let labels = served.labels(ctx);
    telemetry::response_headers(&labels, status.as_u16());
    if !sse {
        // Not a stream: the first token comes with the head (vLLM, and any server that
        // answers whole). A stream reports its first output event through the ledger.
        telemetry::first_token(&labels, ctx.received.started.elapsed());
    }
    let sample = sample_for_calibration(app, ctx, served.profile).filter(|_| status.is_success());
    let attributes = match ctx.trace() {
        Some(_) => span_attributes(ctx, served, status),
        None => Vec::new(),
    };
    Ledger::new(&ctx.snapshot, served.profile, labels, ctx.routed.prompt)
        .traced(ctx.trace(), attributes)
        .charging(
            app.tenants.as_ref(),
            ctx.grant.take(),
            status.is_success(),
            sse,
        )
        .sampled(sample)
}

/// Whether the books of a request from `tenant` to `endpoint` may need its answer's body:
/// the usage a tenant with limits or budgets is charged, the copy a calibration sample
/// compares (`policy.calibration`), or the id a stored Responses answer is placed by. Known
/// from the request's head, so a door can choose how to relay the answer before it has the
/// body. A door may leave any other answer's body unread: its tokens and cost then go
/// uncounted (the request, its status and its duration still are).
pub(crate) fn reads_answer(app: &App, tenant: Option<&ActiveTenant>, endpoint: Endpoint) -> bool {
    let limited = tenant.is_some_and(|t| t.quota.is_limited());
    let calibrated = app.store.load().set.policy.calibration.is_some();
    let may_sample = calibrated && AgentApi::of(endpoint).is_none();
    limited || may_sample || endpoint == Endpoint::Responses
}

/// What a request's end is booked with, gathered when its answer's head is known.
pub(crate) struct Ledger {
    labels: RequestLabels,
    pool: Arc<Pool>,
    prompt: PromptSize,
    prices: Prices,
    /// The request span and its attributes, with tracing on.
    trace: Option<(RequestTrace, Vec<KeyValue>)>,
    tenant: Option<TenantCharge>,
    sample: Option<Sample>,
    /// The later parts of a resumed stream that continuations generated, in order.
    parts: Vec<Part>,
}

/// A part of a resumed stream (`policy.stream_resume`) that a continuation generated.
struct Part {
    labels: RequestLabels,
    prices: Prices,
    /// Tokens delivered before it: the part starts at this output token.
    after: u64,
}

/// The tenant's reservation, settled to what the answer used.
struct TenantCharge {
    tenants: Arc<Tenants>,
    grant: Grant,
    /// The upstream answered with a success: only then is the tenant charged.
    served: bool,
    stream: bool,
}

/// Per-token prices of the serving profile and of `default_profile`, for cost and savings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Prices {
    actual: PerToken,
    counterfactual: PerToken,
}

// === impl Ledger ===

impl Ledger {
    /// The books of an answer from `profile`, labelled `labels`, to a prompt of `prompt`.
    pub(crate) fn new(
        snapshot: &Snapshot,
        profile: ProfileIndex,
        labels: RequestLabels,
        prompt: PromptSize,
    ) -> Self {
        Self {
            labels,
            pool: Arc::clone(&snapshot.runtime[profile].pool),
            prompt,
            prices: Prices::new(snapshot, profile),
            trace: None,
            tenant: None,
            sample: None,
            parts: Vec::new(),
        }
    }

    /// Ends `trace` with `attributes` (and the usage) when the answer ends.
    pub(crate) fn traced(
        mut self,
        trace: Option<&RequestTrace>,
        attributes: Vec<KeyValue>,
    ) -> Self {
        self.trace = trace.map(|trace| (trace.clone(), attributes));
        self
    }

    /// Settles `grant` when the answer ends; `served`: the upstream answered with a success,
    /// `stream`: as an SSE stream.
    pub(crate) fn charging(
        mut self,
        tenants: Option<&Arc<Tenants>>,
        grant: Option<Grant>,
        served: bool,
        stream: bool,
    ) -> Self {
        self.tenant = tenants.zip(grant).map(|(tenants, grant)| TenantCharge {
            tenants: Arc::clone(tenants),
            grant,
            served,
            stream,
        });
        self
    }

    /// Asks the reference for `sample` once the whole answer is in.
    pub(crate) fn sampled(mut self, sample: Option<Sample>) -> Self {
        self.sample = sample;
        self
    }

    /// Whether a copy of the whole answer is wanted ([`Outcome::answer`]).
    pub(crate) fn wants_answer(&self) -> bool {
        self.sample.is_some()
    }

    /// The first output of a stream, this long after the request started.
    pub(crate) fn first_output(&self, elapsed: Duration) {
        telemetry::first_token(&self.labels, elapsed);
    }

    /// The one bookkeeping function of a generation request.
    pub(crate) fn book(self, outcome: Outcome) {
        let Outcome { end, answer } = outcome;
        let Self {
            labels,
            pool,
            prompt,
            prices,
            trace,
            tenant,
            sample,
            parts,
        } = self;
        // Calibration: after the client has its answer, a sample is asked of the reference.
        if let (Some(sample), Some(answer)) = (sample, answer) {
            sample.run(answer, end.usage);
        }
        if let Some(failure) = end.failure {
            telemetry::upstream_error(labels.profile.id(), failure.kind());
        }
        let first = (&labels, prices);
        if let Some(usage) = end.usage {
            for (labels, prices, usage) in split(first, &parts, usage) {
                prices.record(labels, usage);
            }
            prompt.observe(&pool, usage);
        }
        if let Some((trace, mut attributes)) = trace {
            if let Some(usage) = end.usage {
                attributes.extend(usage_attributes(usage));
            }
            trace.finish(attributes);
        }
        if let Some(mut tenant) = tenant {
            let cost = |usage| split(first, &parts, usage).map(|(_, p, u)| p.cost(u)).sum();
            let charge = tenant.charge(&end, cost);
            let settle = tenant.tenants.settle(&mut tenant.grant);
            settle(charge);
        }
        telemetry::finished(&labels, end.elapsed);
    }
}

impl OnEnd for Ledger {
    fn first_output(&mut self, elapsed: Duration) {
        Ledger::first_output(self, elapsed);
    }

    fn resumed(&mut self, handovers: &[Handover]) {
        let reason = self.labels.reason;
        self.parts = handovers
            .iter()
            .map(|handover| Part {
                labels: RequestLabels {
                    profile: Arc::clone(&handover.served.telemetry),
                    reason,
                },
                prices: Prices {
                    actual: handover.served.prices,
                    counterfactual: self.prices.counterfactual,
                },
                after: handover.after,
            })
            .collect();
    }

    fn on_end(self: Box<Self>, outcome: Outcome) {
        self.book(outcome);
    }
}

// === impl TenantCharge ===

impl TenantCharge {
    /// What the answer is charged when it ends: its `usage`, at `cost`; a stream without
    /// one (its client left, or the upstream sends none) the prompt's estimate and a token
    /// per event it delivered; an error answer nothing; a whole answer left before its
    /// usage, what it reserved.
    fn charge(&self, end: &BodyEnd, cost: impl Fn(Usage) -> f64) -> Charge {
        let used = |usage: Usage| Charge::Used {
            input: usage.prompt_tokens,
            output: usage.completion_tokens,
            cost: cost(usage),
        };
        match (self.served, end.usage) {
            (false, _) => Charge::Nothing,
            (true, Some(usage)) => used(usage),
            (true, None) if self.stream => used(Usage {
                prompt_tokens: self.grant.prompt_tokens,
                completion_tokens: end.data_events,
            }),
            (true, None) => Charge::Reserved,
        }
    }
}

// === impl Prices ===

impl Prices {
    pub(crate) fn new(snapshot: &Snapshot, profile: ProfileIndex) -> Self {
        let actual = PerToken::of(&snapshot.set.profiles[profile]);
        let counterfactual = snapshot
            .set
            .profile(&snapshot.set.default_profile)
            .map_or(actual, PerToken::of);
        Self {
            actual,
            counterfactual,
        }
    }

    /// What `usage` cost on the serving profile.
    pub(crate) fn cost(&self, usage: Usage) -> f64 {
        self.actual.cost(usage)
    }

    fn record(&self, labels: &RequestLabels, usage: Usage) {
        telemetry::usage(
            labels,
            (usage.prompt_tokens, usage.completion_tokens),
            self.actual.cost(usage),
            self.counterfactual.cost(usage),
        );
    }
}

/// `policy.calibration`: a non-streamed request answered by another profile than the
/// reference, in the sample (the router's own draw), is asked of the reference too. Every
/// such request counts towards the limit on that extra load, sampled or not.
fn sample_for_calibration(app: &App, ctx: &RequestCtx, served: ProfileIndex) -> Option<Sample> {
    let (snapshot, shape, received) = (&ctx.snapshot, &ctx.shape, &ctx.received);
    let policy = snapshot.set.policy.calibration.as_ref()?;
    let reference = snapshot.set.index_of(&policy.reference_profile)?;
    // An agent API's answer is not a chat answer to compare.
    if shape.stream || served == reference || AgentApi::of(received.endpoint).is_some() {
        return None;
    }
    if !app.calibrator.sample(policy.sample_rate) {
        return None;
    }
    // A call asked again may act again; such a request is not sent twice.
    if shape.offers_tools {
        app.calibrator.not_comparable();
        return None;
    }
    let id = ctx.request_id();
    let key = id.to_str().unwrap_or_default().to_owned();
    Some(Sample {
        calibrator: Arc::clone(&app.calibrator),
        client: app.client.clone(),
        config: app.config.resilience,
        snapshot: Arc::clone(snapshot),
        policy: policy.clone(),
        decision: ctx.routed.decision.clone(),
        served,
        reference,
        wants_json: shape.wants_json,
        max_tokens: shape.max_tokens,
        choices: shape.choices,
        path: received.endpoint.path(),
        headers: upstream_headers(&received.parts.headers, &id),
        body: ctx.upstream_body(reference),
        request_id: key,
    })
}

/// Attributes of a finished request span (HTTP and `gen_ai.*` conventions).
fn span_attributes(ctx: &RequestCtx, served: &Served, status: StatusCode) -> Vec<KeyValue> {
    let profile = &ctx.snapshot.set.profiles[served.profile];
    let model = ctx.shape.rewrite.model(&ctx.received.body);
    vec![
        KeyValue::new("http.response.status_code", i64::from(status.as_u16())),
        KeyValue::new("gen_ai.request.model", model),
        KeyValue::new("gen_ai.response.model", profile.model.clone()),
        KeyValue::new("quantrouter.profile", profile.id.clone()),
        KeyValue::new("quantrouter.tier", profile.tier.clone()),
        KeyValue::new("quantrouter.attempts", i64::from(served.attempts)),
    ]
}

/// `usage` of a whole answer by the profile that generated each part: the first part (the
/// profile that started the answer, `first`) is charged the prompt and the tokens delivered
/// before the first continuation, each continuation in `parts` the tokens from its own start
/// to the next one's (the last, the rest). A continuation's `usage` counts the delivered text
/// as prompt again; the stream's usage already moved it back to the completion, so that
/// second prefill is charged to no one: it is the cost of the failure.
fn split<'a>(
    first: (&'a RequestLabels, Prices),
    parts: &'a [Part],
    usage: Usage,
) -> impl Iterator<Item = (&'a RequestLabels, Prices, Usage)> + 'a {
    let all = usage.completion_tokens;
    // Where each part starts in the answer's output, and where the next one starts.
    let starts = std::iter::once(0).chain(parts.iter().map(move |part| part.after.min(all)));
    let ends = parts.iter().map(move |part| part.after.min(all));
    let profiles =
        std::iter::once(first).chain(parts.iter().map(|part| (&part.labels, part.prices)));
    profiles
        .zip(starts.zip(ends.chain(std::iter::once(all))))
        .enumerate()
        .map(move |(i, ((labels, prices), (start, end)))| {
            let part = Usage {
                prompt_tokens: if i == 0 { usage.prompt_tokens } else { 0 },
                completion_tokens: end.saturating_sub(start),
            };
            (labels, prices, part)
        })
}

fn usage_attributes(usage: Usage) -> [KeyValue; 2] {
    let tokens = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    [
        KeyValue::new("gen_ai.usage.input_tokens", tokens(usage.prompt_tokens)),
        KeyValue::new(
            "gen_ai.usage.output_tokens",
            tokens(usage.completion_tokens),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use quantrouter_policy::{ProfileSet, Reason, DEFAULT_PROFILE_SET};

    use super::*;
    use crate::telemetry::ProfileTelemetry;

    /// The labels and prices of profile `i` of the default set, `counterfactual` its default's.
    fn profile(set: &ProfileSet, i: usize) -> (RequestLabels, Prices) {
        let labels = RequestLabels {
            profile: Arc::new(ProfileTelemetry::new(&set.profiles[i])),
            reason: Reason::Utility,
        };
        let default = set.profile(&set.default_profile).unwrap();
        let prices = Prices {
            actual: PerToken::of(&set.profiles[i]),
            counterfactual: PerToken::of(default),
        };
        (labels, prices)
    }

    fn part(set: &ProfileSet, i: usize, after: u64) -> Part {
        let (labels, prices) = profile(set, i);
        Part {
            labels,
            prices,
            after,
        }
    }

    fn usage(prompt_tokens: u64, completion_tokens: u64) -> Usage {
        Usage {
            prompt_tokens,
            completion_tokens,
        }
    }

    #[test]
    fn each_part_of_a_resumed_answer_is_booked_at_the_profile_that_generated_it() {
        let set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
        let (labels, prices) = profile(&set, 2);
        let parts = [part(&set, 1, 9), part(&set, 0, 30)];
        let booked: Vec<_> = split((&labels, prices), &parts, usage(20, 40))
            .map(|(labels, prices, usage)| (labels.profile.id().to_owned(), prices, usage))
            .collect();
        let ids: Vec<_> = booked.iter().map(|(id, ..)| id.as_str()).collect();
        assert_eq!(ids, ["llama8b-awq", "llama8b-fp8", "llama8b-fp16"]);
        let usages: Vec<_> = booked.iter().map(|(.., usage)| *usage).collect();
        assert_eq!(usages, [usage(20, 9), usage(0, 21), usage(0, 10)]);
        assert_eq!(booked[1].1, parts[0].prices);

        // Without a continuation the answer is the first profile's, whole.
        let whole: Vec<_> = split((&labels, prices), &[], usage(20, 40)).collect();
        assert_eq!(whole.len(), 1);
        assert_eq!((whole[0].1, whole[0].2), (prices, usage(20, 40)));
    }

    #[test]
    fn a_continuation_of_nothing_delivered_leaves_the_prompt_to_the_first_part() {
        let set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
        let (labels, prices) = profile(&set, 2);
        // And a usage short of what was delivered (a stream charged by its events) never
        // books a part below zero.
        let parts = [part(&set, 1, 0), part(&set, 0, 50)];
        let usages: Vec<_> = split((&labels, prices), &parts, usage(20, 40))
            .map(|(.., usage)| usage)
            .collect();
        assert_eq!(usages, [usage(20, 0), usage(0, 40), usage(0, 0)]);
    }
}
