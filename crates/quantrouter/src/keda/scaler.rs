//! KEDA's external scaler (gRPC, `proto/externalscaler.proto`), served on its own port.
//!
//! A ScaledObject trigger of type `external` (or `external-push`) names the router service
//! and a tier in its metadata:
//! - `tier` (required): the tier whose vLLM Deployment is scaled;
//! - `targetQueueDepth` (default 4): requests, queued or in flight, per vLLM replica.
//!
//! The metric (`quantrouter-<tier>-requests`) is the tier's cluster-wide queue depth plus
//! requests in flight: everything that needs a vLLM replica's capacity now. The HPA aims
//! for `ceil(metric / targetQueueDepth)` replicas. The tier is active while that sum is
//! above zero or a request for it found no ready endpoint within the demand hold; an open
//! `StreamIsActive` hears of such a request at once.

use std::pin::Pin;
use std::sync::Arc;

use futures_util::Stream;
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::{broadcast, watch};
use tokio::time::{Instant, Interval};
use tonic::{Request, Response, Status};

use super::proto::external_scaler_server::{ExternalScaler, ExternalScalerServer};
use super::proto::{
    GetMetricSpecResponse, GetMetricsRequest, GetMetricsResponse, IsActiveResponse, MetricSpec,
    MetricValue, ScaledObjectRef,
};
use super::{Keda, TierReport};
use crate::profiles::ProfileStore;

/// A target of 4 requests per replica scales out early: with vLLM's continuous batching a
/// replica takes far more, but each extra request slows every other one's tokens, and a
/// cold start takes minutes. Raise it toward the concurrency at which one replica still
/// meets the latency budget.
pub const DEFAULT_TARGET: f64 = 4.0;

/// The external scaler over the router's live numbers.
#[derive(Debug, Clone)]
pub struct Scaler {
    store: Arc<ProfileStore>,
    keda: Arc<Keda>,
    /// Turns true when the router shuts down; open streams end then.
    stopped: watch::Receiver<bool>,
}

/// What a trigger asks for.
#[derive(Debug, Clone, PartialEq)]
struct Trigger {
    tier: String,
    target: f64,
}

/// A `StreamIsActive` stream's state between messages.
struct Follow {
    scaler: Scaler,
    tier: String,
    signals: broadcast::Receiver<Arc<str>>,
    checks: Interval,
    /// The last value sent; `None` before the first.
    sent: Option<bool>,
}

/// Why a `StreamIsActive` stream wakes up.
enum Wake {
    Demand,
    Check,
    Stop,
}

type ActiveStream = Pin<Box<dyn Stream<Item = Result<IsActiveResponse, Status>> + Send>>;

// === impl Scaler ===

impl Scaler {
    pub fn new(store: Arc<ProfileStore>, keda: Arc<Keda>, stopped: watch::Receiver<bool>) -> Self {
        Self {
            store,
            keda,
            stopped,
        }
    }

    /// The tonic service, ready to serve over HTTP/2.
    pub fn into_service(self) -> ExternalScalerServer<Self> {
        ExternalScalerServer::new(self)
    }

    async fn report(&self, tier: &str) -> Result<TierReport, Status> {
        let snapshot = self.store.load();
        self.keda.tier(&snapshot, tier).await.ok_or_else(|| {
            let tier = super::quoted(tier);
            Status::not_found(format!("no tier `{tier}` in the active profile set"))
        })
    }

    async fn active(&self, tier: &str) -> Result<bool, Status> {
        let report = self.report(tier).await?;
        let hold = self.keda.config.demand_hold;
        Ok(load(&report) > 0 || self.keda.demand.recent(tier, hold, Instant::now()))
    }
}

#[tonic::async_trait]
impl ExternalScaler for Scaler {
    async fn is_active(
        &self,
        request: Request<ScaledObjectRef>,
    ) -> Result<Response<IsActiveResponse>, Status> {
        let trigger = Trigger::parse(request.get_ref())?;
        let result = self.active(&trigger.tier).await?;
        Ok(Response::new(IsActiveResponse { result }))
    }

    type StreamIsActiveStream = ActiveStream;

    async fn stream_is_active(
        &self,
        request: Request<ScaledObjectRef>,
    ) -> Result<Response<Self::StreamIsActiveStream>, Status> {
        let trigger = Trigger::parse(request.get_ref())?;
        // Subscribe before the first check so no demand falls between the two.
        let signals = self.keda.demand.subscribe();
        self.report(&trigger.tier).await?;
        let period = self.keda.config.stream_check;
        let follow = Follow {
            scaler: self.clone(),
            tier: trigger.tier,
            signals,
            checks: tokio::time::interval_at(Instant::now() + period, period),
            sent: None,
        };
        let stream = futures_util::stream::unfold(Some(follow), |follow| async move {
            let mut follow = follow?;
            match follow.next().await {
                Ok(Some(result)) => Some((Ok(IsActiveResponse { result }), Some(follow))),
                Ok(None) => None,
                Err(status) => Some((Err(status), None)),
            }
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_metric_spec(
        &self,
        request: Request<ScaledObjectRef>,
    ) -> Result<Response<GetMetricSpecResponse>, Status> {
        let trigger = Trigger::parse(request.get_ref())?;
        self.report(&trigger.tier).await?;
        let spec = MetricSpec {
            metric_name: metric_name(&trigger.tier),
            target_size: trigger.target.ceil() as i64,
            target_size_float: trigger.target,
        };
        Ok(Response::new(GetMetricSpecResponse {
            metric_specs: vec![spec],
        }))
    }

    async fn get_metrics(
        &self,
        request: Request<GetMetricsRequest>,
    ) -> Result<Response<GetMetricsResponse>, Status> {
        let request = request.get_ref();
        let object = request
            .scaled_object_ref
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("scaledObjectRef is missing"))?;
        let trigger = Trigger::parse(object)?;
        let report = self.report(&trigger.tier).await?;
        let value = load(&report);
        Ok(Response::new(GetMetricsResponse {
            metric_values: vec![MetricValue {
                metric_name: metric_name(&trigger.tier),
                metric_value: i64::try_from(value).unwrap_or(i64::MAX),
                metric_value_float: value as f64,
            }],
        }))
    }
}

/// What needs capacity: queued plus in flight.
fn load(report: &TierReport) -> u64 {
    report.queue_depth.saturating_add(report.inflight)
}

/// The metric's name in the HPA (KEDA prefixes it with the trigger index).
pub fn metric_name(tier: &str) -> String {
    format!("quantrouter-{tier}-requests")
}

// === impl Trigger ===

impl Trigger {
    fn parse(object: &ScaledObjectRef) -> Result<Self, Status> {
        let metadata = &object.scaler_metadata;
        let tier = metadata
            .get("tier")
            .map(|t| t.trim())
            .filter(|t| !t.is_empty())
            .ok_or_else(|| Status::invalid_argument("trigger metadata needs `tier`"))?;
        let target = match metadata.get("targetQueueDepth") {
            None => DEFAULT_TARGET,
            Some(text) => text
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|t| t.is_finite() && *t > 0.0)
                .ok_or_else(|| {
                    let text = super::quoted(text);
                    Status::invalid_argument(format!(
                        "targetQueueDepth must be a number above 0, got `{text}`"
                    ))
                })?,
        };
        Ok(Self {
            tier: tier.to_owned(),
            target,
        })
    }
}

// === impl Follow ===

impl Follow {
    /// The next value to send: the current state at once on opening, then `true` the moment
    /// demand for the tier is signalled, and any change seen by the periodic check. `None`
    /// when the router shuts down.
    async fn next(&mut self) -> Result<Option<bool>, Status> {
        loop {
            let wake = match self.sent {
                None => Wake::Check,
                Some(_) => self.wait().await,
            };
            let active = match wake {
                Wake::Stop => return Ok(None),
                Wake::Demand => true,
                Wake::Check => self.scaler.active(&self.tier).await?,
            };
            // Demand is always sent (KEDA may have missed nothing, but it costs nothing).
            if matches!(wake, Wake::Demand) || self.sent != Some(active) {
                self.sent = Some(active);
                return Ok(Some(active));
            }
        }
    }

    async fn wait(&mut self) -> Wake {
        if *self.scaler.stopped.borrow() {
            return Wake::Stop;
        }
        loop {
            tokio::select! {
                signal = self.signals.recv() => match signal {
                    Ok(tier) if *tier == *self.tier => return Wake::Demand,
                    Ok(_) => continue,
                    // Missed signals may have been for this tier: look.
                    Err(RecvError::Lagged(_)) => return Wake::Check,
                    Err(RecvError::Closed) => return Wake::Stop,
                },
                _ = self.checks.tick() => return Wake::Check,
                // Shutting down, or the server is gone.
                _ = self.scaler.stopped.changed() => return Wake::Stop,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(pairs: &[(&str, &str)]) -> ScaledObjectRef {
        ScaledObjectRef {
            name: "vllm-int4".into(),
            namespace: "llm".into(),
            scaler_metadata: pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        }
    }

    #[test]
    fn a_trigger_needs_a_tier_and_a_positive_target() {
        assert_eq!(
            Trigger::parse(&object(&[("tier", "int4")])).unwrap(),
            Trigger {
                tier: "int4".into(),
                target: DEFAULT_TARGET
            }
        );
        assert_eq!(
            Trigger::parse(&object(&[("tier", "fp8"), ("targetQueueDepth", "2.5")]))
                .unwrap()
                .target,
            2.5
        );
        for bad in [
            object(&[]),
            object(&[("tier", " ")]),
            object(&[("tier", "int4"), ("targetQueueDepth", "0")]),
            object(&[("tier", "int4"), ("targetQueueDepth", "lots")]),
        ] {
            let status = Trigger::parse(&bad).unwrap_err();
            assert_eq!(status.code(), tonic::Code::InvalidArgument, "{bad:?}");
        }
    }
}
