//! The routing step of the pipeline: the policy's decision with the request's and the
//! tenant's bounds, the conversation's profile, KEDA's demand, the decision's log line, and
//! the wait for a tier scaling from zero.

use http::HeaderMap;
use opentelemetry::KeyValue;
use quantrouter_policy::{Rating, RoutingDecision};
use tokio::time::Instant;

use super::context::RequestCtx;
use crate::app::App;
use crate::openai::{ApiError, ParsedRequest};
use crate::profiles::Snapshot;
use crate::routing::{self, RouteInput, Routed};
use crate::tenants::Grant;
use crate::traces::RequestTrace;

/// What a request is decided with.
pub(super) struct Decide<'a> {
    pub snapshot: &'a Snapshot,
    pub parsed: &'a ParsedRequest<'a>,
    pub headers: &'a HeaderMap,
    pub request_id: &'a str,
    pub grant: Option<&'a Grant>,
}

impl Decide<'_> {
    /// The policy's decision (with a second opinion's `rating`, if one was asked) among the
    /// profiles the door can reach (`among`; `subset`: because of a Gateway's subset hint),
    /// settled by the conversation's earlier turns; KEDA hears of the tiers it wants.
    pub(super) fn route(
        self,
        app: &App,
        rating: Option<Rating>,
        among: Option<&[bool]>,
        subset: bool,
    ) -> Result<Routed, ApiError> {
        let snapshot = self.snapshot;
        let classifier = app.config.classifier.load();
        let input = RouteInput {
            classifier: classifier.model.as_ref(),
            headers: self.headers,
            aliases: &app.config.aliases,
            request_key: self.request_id,
            tenant: self.grant.map(|g| (&*g.tenant, g.downgraded)),
            among,
            rating,
        };
        let mut routed =
            routing::route(snapshot, self.parsed, input).map_err(|error| match error {
                // GIE: no eligible endpoint in the subset is a 503.
                ApiError::Unavailable(_) if subset => ApiError::Unavailable(
                    "no endpoint of the subset hint can take the request".to_owned(),
                ),
                error => error,
            })?;
        app.sessions.settle(snapshot, &mut routed, true);
        app.keda.on_route(snapshot, routed.decision.profile);
        if let Some(cold) = routed.cold_preferred {
            app.keda.on_route(snapshot, cold);
        }
        Ok(routed)
    }
}

/// Scale from zero: waits (counted in the tier's queue depth, which activates KEDA) for the
/// preferred tier's first endpoint, within the deadline.
pub(crate) async fn wait_for_cold_tier(ctx: &RequestCtx) -> Result<(), ApiError> {
    let Some((cold, timeout)) = ctx.routed.wait_for else {
        return Ok(());
    };
    let timeout = timeout.min(ctx.deadline.saturating_duration_since(Instant::now()));
    if ctx.snapshot.runtime[cold]
        .pool
        .wait_for_endpoints(timeout)
        .await
    {
        return Ok(());
    }
    let id = &ctx.snapshot.set.profiles[cold].id;
    Err(ApiError::Unavailable(format!(
        "profile {id} is scaled to zero and got no endpoint within {timeout:?}"
    )))
}

/// A routing decision, as the log and the trace record it.
pub(crate) struct DecisionLog<'a> {
    pub snapshot: &'a Snapshot,
    pub decision: &'a RoutingDecision,
    pub parsed: &'a ParsedRequest<'a>,
    pub request_id: &'a str,
}

impl DecisionLog<'_> {
    /// The decision in the log (with the prompt only under `--log-prompts`) and the trace.
    pub(crate) fn record(self, app: &App, trace: Option<&RequestTrace>) {
        let Self {
            snapshot,
            decision,
            parsed,
            request_id,
        } = self;
        let chosen = &snapshot.set.profiles[decision.profile];
        if app.config.log_prompts {
            let prompt: Vec<&str> = parsed.prompt().segments.iter().map(|s| s.text).collect();
            tracing::info!(request_id, profile = %chosen.id, reason = decision.reason.as_str(),
            complexity = decision.complexity, prompt = %prompt.join("\n"), "routed");
        } else {
            tracing::debug!(profile = %chosen.id, reason = decision.reason.as_str(),
            complexity = decision.complexity, "routed");
        }
        if let Some(trace) = trace {
            trace.record(
                "route",
                vec![
                    KeyValue::new("quantrouter.profile", chosen.id.clone()),
                    KeyValue::new("quantrouter.tier", chosen.tier.clone()),
                    KeyValue::new("quantrouter.reason", decision.reason.as_str()),
                    KeyValue::new("quantrouter.complexity", decision.complexity),
                    KeyValue::new(
                        "quantrouter.task_class",
                        format!("{:?}", decision.task_class),
                    ),
                ],
            );
        }
    }
}
