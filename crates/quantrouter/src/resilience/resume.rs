//! Resuming a broken stream (`policy.stream_resume`): the request kept for as long as its
//! stream runs ([`ResumeRequest`]), and the [`Resume`] hook that asks for a continuation the
//! request's own way ([`Forwarder::resume`]) and books every break: the endpoint's breaker
//! sees the failure, `quantrouter_stream_resumes_total` its outcome, the trace a span; a
//! failure that a continuation hid counts in `quantrouter_upstream_errors_total` here (one
//! that ends the stream is counted by the answer's bookkeeping, as without resumption).
//!
//! What the continuation asks for, and how its events join the stream, is
//! [`crate::upstream::continuation`]'s; relaying it is [`crate::upstream::body::Resuming`]'s.

use std::sync::Arc;
use std::time::SystemTime;

use bytes::Bytes;
use http::HeaderMap;
use opentelemetry::KeyValue;
use quantrouter_policy::{ProfileIndex, RoutingDecision};
use serde_json::Value;
use tokio::time::Instant;

use super::retry::{Answer, Forwarder, Outgoing, Plan};
use super::ResilienceConfig;
use crate::apis::{AgentApi, Translation};
use crate::openai::{BodyEdits, Endpoint as Api};
use crate::profiles::{PerToken, Snapshot};
use crate::telemetry;
use crate::traces::RequestTrace;
use crate::upstream::body::{Asked, Broken, Continuation, Resumable, Resume, Served};
use crate::upstream::continuation::{self, Unresumable};
use crate::upstream::{
    is_event_stream, BodyError, Endpoint, Placement, TimeLimits, UpstreamClient,
};

/// A streamed request as a continuation needs it, kept while its stream runs.
#[derive(Debug)]
pub struct ResumeRequest {
    pub client: UpstreamClient,
    pub config: ResilienceConfig,
    pub snapshot: Arc<Snapshot>,
    pub decision: RoutingDecision,
    /// The client named the profile: the stream is continued there or not at all.
    pub pinned: bool,
    /// Headers for the upstream, as every attempt of the request sends them.
    pub headers: HeaderMap,
    pub started: Instant,
    pub deadline: Instant,
    pub trace: Option<RequestTrace>,
    pub request_id: String,
    /// The tenant's place in admission queues.
    pub priority: i32,
    /// The prompt's blocks: a continuation prefers the endpoint holding its cached prefix.
    pub blocks: Vec<u64>,
    /// The request as the client sent it, and the API it came through.
    pub body: Bytes,
    pub api: Api,
    /// The router asks for the usage event (and cuts it out): continuations ask too.
    pub adds_usage: bool,
    /// Per profile, the output limit its context holds when the request's is only a ceiling
    /// (`policy.output_ceiling`), as the first attempt was sent it.
    pub ceilings: Vec<Option<u32>>,
    /// The tenant's KV-cache salt, which every attempt of the request carries.
    pub cache_salt: Option<String>,
}

/// The [`Resume`] hook of one stream.
#[derive(Debug)]
struct StreamResumer(Arc<ResumeRequest>);

/// Whether a stream may be resumed at all: resumption is on, the stream has one choice, and
/// its answer is a chat or completion stream (a native agent-API stream is not).
pub fn eligible(
    set: &quantrouter_policy::ProfileSet,
    api: Api,
    choices: u32,
    answer: &Answer,
) -> bool {
    let native = AgentApi::of(api).is_some_and(|agent| {
        set.profiles[answer.profile]
            .upstream
            .serves(agent.upstream())
    });
    let response = &answer.response;
    set.policy.stream_resume.max_resumes > 0
        && choices == 1
        && !native
        && response.status().is_success()
        && is_event_stream(response.headers())
}

// === impl ResumeRequest ===

impl ResumeRequest {
    /// What the stream of `answer` carries to be resumed.
    pub fn into_resumable(self, answer: &Answer) -> Resumable {
        let served = self.served(
            answer.profile,
            Arc::clone(&answer.endpoint),
            answer.attempts,
        );
        let max_resumes = self.snapshot.set.policy.stream_resume.max_resumes;
        let idle = self.config.idle_timeout;
        let hook = Box::new(StreamResumer(Arc::new(self)));
        Resumable::new(hook, served, max_resumes, idle)
    }

    /// A continuation of `broken`, through the request's own way; `None` when there is none.
    async fn continuation(&self, broken: Broken) -> Option<Continuation> {
        let broke_at = SystemTime::now();
        let id = self.profile_id(broken.served.profile);
        broken.served.endpoint.failed_mid_answer();
        let (bodies, why) = self.bodies(&broken);
        let ruled_out = (0..bodies.len())
            .map(ProfileIndex::new)
            .filter(|p| bodies[p.get()].is_none())
            .collect::<Vec<_>>();
        let candidates = &self.decision.candidates;
        if candidates.iter().all(|c| ruled_out.contains(&c.profile)) {
            self.refused(
                &broken,
                why.map_or("no profile can continue it", Unresumable::as_str),
            );
            return None;
        }
        let placement = Placement::new(self.blocks.clone());
        let plan = Plan {
            snapshot: &self.snapshot,
            decision: &self.decision,
            pinned: self.pinned,
            stream: true,
            wants_json: false,
            headers: &self.headers,
            started: self.started,
            deadline: self.deadline,
            trace: self.trace.as_ref(),
            request_id: &self.request_id,
            priority: self.priority,
            placement: &placement,
        };
        let body_for = |profile: ProfileIndex| {
            // Ruled-out profiles are never asked.
            bodies[profile.get()].clone().unwrap_or(Outgoing {
                path: Api::Chat.path(),
                body: Bytes::new(),
            })
        };
        let forwarder = Forwarder::new(&self.client, &self.config, plan, &body_for);
        let from = (broken.served.profile, Arc::clone(&broken.served.endpoint));
        let answered = forwarder
            .resume(from, broken.served.attempts, ruled_out)
            .await;
        let continuation = match answered {
            Ok(answer) if eligible(&self.snapshot.set, Api::Chat, 1, &answer) => {
                Ok(self.continue_with(answer))
            }
            Ok(answer) => Err(format!(
                "the continuation answered {}",
                answer.response.status()
            )),
            Err(error) => Err(error.to_string()),
        };
        let result = match &continuation {
            Ok(continuation) => {
                telemetry::upstream_error(id, broken.failure.kind());
                tracing::info!(request_id = self.request_id, profile = id,
                    failure = %broken.failure, tokens = broken.tokens,
                    to = self.profile_id(continuation.served.profile), "stream resumed");
                "resumed"
            }
            Err(error) => {
                tracing::warn!(request_id = self.request_id, profile = id,
                    failure = %broken.failure, error, "the stream could not be resumed");
                "failed"
            }
        };
        telemetry::stream_resume(id, result);
        self.trace_break(&broken, result, broke_at);
        continuation.ok()
    }

    /// A continuation's answer, relayed under the request's limits.
    fn continue_with(&self, answer: Answer) -> Continuation {
        let Answer {
            response,
            profile,
            endpoint,
            held,
            attempts,
            sent_at,
            ..
        } = answer;
        Continuation {
            incoming: response.into_body(),
            held,
            limits: TimeLimits {
                idle: self.config.idle_timeout,
                deadline: self.deadline,
                first_output_by: sent_at + self.client.header_timeout,
            },
            served: self.served(profile, endpoint, attempts),
        }
    }

    /// `endpoint` of `profile` serves a part of the stream, after `attempts` in all.
    fn served(&self, profile: ProfileIndex, endpoint: Arc<Endpoint>, attempts: u32) -> Served {
        Served {
            profile,
            endpoint,
            attempts,
            telemetry: Arc::clone(&self.snapshot.runtime[profile].telemetry),
            prices: PerToken::of(&self.snapshot.set.profiles[profile]),
        }
    }

    /// The continuation's request for each profile of the set (`None` where a profile
    /// cannot continue the stream), and why the request itself cannot be continued, if so.
    fn bodies(&self, broken: &Broken) -> (Vec<Option<Outgoing>>, Option<Unresumable>) {
        let set = &self.snapshot.set;
        let translation = match AgentApi::of(self.api) {
            Some(_) => Translation::prepare(self.api, &self.body, set, self.decision.profile)
                .ok()
                .flatten(),
            None => None,
        };
        let mut why = None;
        let bodies = (0..set.profiles.len())
            .map(ProfileIndex::new)
            .map(|profile| {
                let (api, base) = self.base(profile, translation.as_ref())?;
                let request = continuation::request(base, api, &broken.delivered, broken.tokens);
                request
                    .map_err(|refused| why = Some(refused))
                    .ok()
                    .map(|body| Outgoing {
                        path: api.path(),
                        body,
                    })
            })
            .collect();
        (bodies, why)
    }

    /// What an attempt on `profile` would send, and to which API; `None` for a profile that
    /// cannot continue a stream (`upstream.resume: false`, or one serving the agent API
    /// natively, whose events are not chat).
    fn base(
        &self,
        profile: ProfileIndex,
        translation: Option<&Translation>,
    ) -> Option<(Api, Value)> {
        let set = &self.snapshot.set;
        let chosen = &set.profiles[profile];
        if !chosen.enabled || !chosen.upstream.resumes() {
            return None;
        }
        let model_json = &self.snapshot.runtime[profile].model_json;
        let ceiling = self.ceilings.get(profile.get()).copied().flatten();
        if AgentApi::of(self.api).is_some() {
            let edits = BodyEdits {
                ceiling,
                cache_salt: self.cache_salt.as_deref(),
            };
            let chat = translation?.chat_body(set, profile, model_json, edits)?;
            return Some((Api::Chat, serde_json::from_slice(&chat).ok()?));
        }
        let mut body: Value = serde_json::from_slice(&self.body).ok()?;
        body["model"] = serde_json::from_str(model_json).ok()?;
        if let Some(salt) = &self.cache_salt {
            body["cache_salt"] = salt.as_str().into();
        }
        if let Some(ceiling) = ceiling {
            for key in ["max_tokens", "max_completion_tokens"] {
                if body[key]
                    .as_u64()
                    .is_some_and(|limit| limit > u64::from(ceiling))
                {
                    body[key] = ceiling.into();
                }
            }
        }
        if self.adds_usage {
            body["stream_options"] = serde_json::json!({"include_usage": true});
        }
        Some((self.api, body))
    }

    /// `broken` is not continued: booked as such.
    fn refused(&self, broken: &Broken, why: &'static str) {
        let id = self.profile_id(broken.served.profile);
        tracing::info!(request_id = self.request_id, profile = id,
            failure = %broken.failure, why, "the stream is not resumed");
        telemetry::stream_resume(id, "not_resumable");
        self.trace_break(broken, "not_resumable", SystemTime::now());
    }

    /// The break in the request's trace, beside the attempts' spans: from `broke_at` to
    /// the continuation (or its failure).
    fn trace_break(&self, broken: &Broken, result: &'static str, broke_at: SystemTime) {
        let Some(trace) = &self.trace else {
            return;
        };
        let tokens = i64::try_from(broken.tokens).unwrap_or(i64::MAX);
        trace.record_since(
            "stream resume",
            broke_at,
            vec![
                KeyValue::new(
                    "quantrouter.profile",
                    self.profile_id(broken.served.profile).to_owned(),
                ),
                KeyValue::new("server.address", broken.served.endpoint.base().to_owned()),
                KeyValue::new("quantrouter.failure", broken.failure.kind()),
                KeyValue::new("quantrouter.delivered_tokens", tokens),
                KeyValue::new("quantrouter.result", result),
            ],
        );
    }

    fn profile_id(&self, profile: ProfileIndex) -> &str {
        &self.snapshot.set.profiles[profile].id
    }
}

// === impl StreamResumer ===

impl Resume for StreamResumer {
    fn resume(&self, broken: Broken) -> Asked {
        let request = Arc::clone(&self.0);
        Box::pin(async move { request.continuation(broken).await })
    }

    fn refuse(&self, broken: &Broken, why: &'static str) {
        if broken.failure != BodyError::Deadline {
            broken.served.endpoint.failed_mid_answer();
        }
        self.0.refused(broken, why);
    }
}
