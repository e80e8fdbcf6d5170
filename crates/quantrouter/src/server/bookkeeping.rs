//! A generation request's bookkeeping, in one place: when its answer ends, the answer's
//! [`OnEnd`] hook (or the endpoint picker, for an answer Envoy relays) hands the
//! [`Outcome`] to [`Ledger::book`] — the calibration sample, upstream failures, usage and
//! cost, the learned characters per token, the trace's end, the tenant's usage settled and
//! the request's duration.

use std::sync::Arc;
use std::time::Duration;

use opentelemetry::KeyValue;
use quantrouter_policy::ProfileIndex;

use crate::calibration::Sample;
use crate::openai::Usage;
use crate::profiles::{PerToken, Snapshot};
use crate::routing::PromptSize;
use crate::telemetry::{self, RequestLabels};
use crate::tenants::gate::Charge;
use crate::tenants::{Grant, Tenants};
use crate::traces::RequestTrace;
use crate::upstream::{BodyEnd, OnEnd, Outcome, Pool};

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
#[derive(Debug, Clone, Copy)]
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
        // Calibration: after the client has its answer, a sample is asked of the reference.
        if let (Some(sample), Some(answer)) = (self.sample, answer) {
            sample.run(answer, end.usage);
        }
        if let Some(failure) = end.failure {
            telemetry::upstream_error(self.labels.profile.id(), failure.kind());
        }
        if let Some(usage) = end.usage {
            self.prices.record(&self.labels, usage);
            self.prompt.observe(&self.pool, usage);
        }
        if let Some((trace, mut attributes)) = self.trace {
            if let Some(usage) = end.usage {
                attributes.extend(usage_attributes(usage));
            }
            trace.finish(attributes);
        }
        if let Some(mut tenant) = self.tenant {
            let charge = tenant.charge(&end, self.prices);
            let settle = tenant.tenants.settle(&mut tenant.grant);
            settle(charge);
        }
        telemetry::finished(&self.labels, end.elapsed);
    }
}

impl OnEnd for Ledger {
    fn first_output(&mut self, elapsed: Duration) {
        Ledger::first_output(self, elapsed);
    }

    fn on_end(self: Box<Self>, outcome: Outcome) {
        self.book(outcome);
    }
}

// === impl TenantCharge ===

impl TenantCharge {
    /// What the answer is charged when it ends: its `usage`; a stream without one (its
    /// client left, or the upstream sends none) the prompt's estimate and a token per event
    /// it delivered; an error answer nothing; a whole answer left before its usage, what it
    /// reserved.
    fn charge(&self, end: &BodyEnd, prices: Prices) -> Charge {
        let used = |usage: Usage| Charge::Used {
            input: usage.prompt_tokens,
            output: usage.completion_tokens,
            cost: prices.cost(usage),
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
