//! Tenants at work on the request path: who sent a request ([`Tenants::authenticate`]),
//! whether its limits let it through and routed how ([`Tenants::admit`], at most one Redis
//! round trip, before routing, reserving the request's worst case), and what its answer
//! used ([`Tenants::settle`], off the client's path once the answer ended). A request let
//! through but never answered gives its reservation back when its [`Grant`] is dropped.

use std::sync::Arc;

use http::{header, HeaderMap};
use quantrouter_policy::limits::{Outcome, RateHeaders, Reservation};
use tokio::task::JoinHandle;

use super::limiter::{Clock, Limiter, LimiterConfig, Ticket};
use super::{bearer, ActiveTenant, ImplicitKeys, KeyRejected, RejectReason, TenantStore};
use super::{TenantSnapshot, TenantsConfig};
pub use crate::openai::{insert_rate_headers, LimitReached};

/// The header Anthropic's clients send their key in.
const API_KEY: header::HeaderName = header::HeaderName::from_static("x-api-key");

/// A router's tenants: the active document, the limiter that counts against it, and the
/// clock its windows are read on.
#[derive(Debug)]
pub struct Tenants {
    pub store: Arc<TenantStore>,
    pub limiter: Arc<Limiter>,
    pub clock: Clock,
    /// The document's followers (Redis, the watched file), stopped with the router.
    tasks: Vec<JoinHandle<()>>,
}

/// A request let through: its tenant, the `x-ratelimit-*` values for its answer, and what
/// it reserved, settled when the answer ends.
#[derive(Debug)]
pub struct Grant {
    pub tenant: Arc<ActiveTenant>,
    pub rate: RateHeaders,
    /// Past a soft limit: routed with [`quantrouter_policy::Downgrade::NEAR_LIMIT`].
    pub downgraded: bool,
    /// The tokens it reserved for its prompt (the estimate a cut stream is charged).
    pub prompt_tokens: u64,
    reserved: Option<Reserved>,
}

/// A reservation still open: dropped unsettled, it is refunded (nothing was served).
#[derive(Debug)]
struct Reserved {
    ticket: Option<Ticket>,
    limiter: Arc<Limiter>,
    clock: Clock,
}

/// What an admitted request is charged when its answer ends.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Charge {
    /// What it used: input and output tokens and their cost.
    Used { input: u64, output: u64, cost: f64 },
    /// Unknown (a whole answer the client left before its usage): the reservation stands.
    Reserved,
    /// Nothing was served: the request, its tokens and spend are given back.
    Nothing,
}

// === impl Tenants ===

impl Tenants {
    /// Loads the tenant document (Redis, else the file) and starts following it, and starts
    /// the limiter.
    pub async fn start(
        config: TenantsConfig,
        limiter: LimiterConfig,
        clock: Clock,
    ) -> Result<Self, RejectReason> {
        let started = super::start(config).await?;
        let limiter = Limiter::start(LimiterConfig {
            clock: clock.clone(),
            ..limiter
        })
        .await;
        let store = Arc::clone(&started.store);
        limiter.follow(Box::new(move || {
            let snapshot = store.load();
            let limited = snapshot.tenants.iter().filter(|t| t.quota.is_limited());
            limited.map(|t| Arc::clone(&t.id)).collect()
        }));
        Ok(Self {
            store: started.store,
            limiter: Arc::new(limiter),
            clock,
            tasks: started.tasks,
        })
    }

    /// `--api-keys-file` alone: its keys form the implicit tenant, without limits.
    pub async fn implicit(keys: ImplicitKeys) -> Self {
        Self {
            store: Arc::new(TenantStore::new(Some(keys), super::labels::DEFAULT_TOP)),
            limiter: Arc::new(Limiter::start(LimiterConfig::new(None, "local".into())).await),
            clock: Clock::system(),
            tasks: Vec::new(),
        }
    }

    /// The tenant of a request's key — `Authorization: Bearer`, else `x-api-key` — `None`
    /// when no tenant has a key (no authentication). Nothing here logs or keeps the key.
    pub fn authenticate(
        &self,
        headers: &HeaderMap,
    ) -> Result<Option<Arc<ActiveTenant>>, KeyRejected> {
        let snapshot: Arc<TenantSnapshot> = self.store.load();
        if !snapshot.requires_key() {
            return Ok(None);
        }
        let key = match (headers.get(header::AUTHORIZATION), headers.get(API_KEY)) {
            (Some(value), _) => bearer(value.as_bytes()).ok_or(KeyRejected::Malformed)?,
            // Anthropic's clients send the key as it is, in `x-api-key`.
            (None, Some(value)) => value.to_str().map_err(|_| KeyRejected::Malformed)?,
            (None, None) => return Err(KeyRejected::Missing),
        };
        snapshot
            .authenticate(Some(key))
            .map(|tenant| tenant.map(Arc::clone))
    }

    /// Decides a request of `tenant` whose prompt is estimated at `prompt_tokens` and that
    /// may use up to `reserved` (prompt included) against its limits: one admission call to
    /// Redis for a tenant with limits, none for one without.
    pub async fn admit(
        &self,
        tenant: Arc<ActiveTenant>,
        prompt_tokens: u64,
        reserved: Reservation,
    ) -> Result<Grant, LimitReached> {
        tenant.metrics.request();
        if !tenant.quota.is_limited() {
            return Ok(Grant {
                tenant,
                rate: RateHeaders::default(),
                downgraded: false,
                prompt_tokens,
                reserved: None,
            });
        }
        let admission = self
            .limiter
            .reserve(&tenant, reserved, self.clock.now_ms())
            .await;
        let decision = admission.decision;
        match decision.outcome {
            Outcome::Refuse {
                limit,
                retry_after_s,
            } => {
                tenant.metrics.refusal(limit.as_str());
                Err(LimitReached {
                    limit,
                    retry_after_s,
                    rate: decision.headers,
                })
            }
            outcome => {
                let downgraded = outcome == Outcome::Downgrade;
                if downgraded {
                    tenant.metrics.downgrade();
                }
                Ok(Grant {
                    tenant,
                    rate: decision.headers,
                    downgraded,
                    prompt_tokens,
                    reserved: admission.ticket.map(|ticket| Reserved {
                        ticket: Some(ticket),
                        limiter: Arc::clone(&self.limiter),
                        clock: self.clock.clone(),
                    }),
                })
            }
        }
    }

    /// What to run when the answer of `grant` ends, with what it is charged: the tenant's
    /// metrics, and the limiter's settlement in a task of its own, so neither the client
    /// nor the body waits on Redis.
    pub fn settle(&self, grant: &mut Grant) -> impl FnOnce(Charge) + Send + 'static {
        let tenant = Arc::clone(&grant.tenant);
        let reserved = grant.reserved.take();
        move |charge| {
            if let Charge::Used {
                input,
                output,
                cost,
            } = charge
            {
                tenant.metrics.usage(input, output, cost);
            }
            if let Some(reserved) = reserved {
                reserved.close(charge);
            }
        }
    }
}

impl Drop for Tenants {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

// === impl Reserved ===

impl Reserved {
    fn close(mut self, charge: Charge) {
        let Some(ticket) = self.ticket.take() else {
            return;
        };
        let limiter = Arc::clone(&self.limiter);
        let now_ms = self.clock.now_ms();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(async move {
            match charge {
                Charge::Used {
                    input,
                    output,
                    cost,
                } => {
                    let tokens = input.saturating_add(output);
                    limiter.settle(ticket, tokens, cost, now_ms).await;
                }
                Charge::Reserved => {}
                Charge::Nothing => limiter.refund(ticket, now_ms).await,
            }
        });
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        if self.ticket.is_some() {
            let rest = Reserved {
                ticket: self.ticket.take(),
                limiter: Arc::clone(&self.limiter),
                clock: self.clock.clone(),
            };
            rest.close(Charge::Nothing);
        }
    }
}
