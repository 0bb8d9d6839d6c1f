//! A replica set: one logical service endpoint served by several replicas,
//! called with the recovery policies of [`crate::policy`] — replica
//! selection, probabilistic retries within the caller's deadline and a
//! retry budget, and quarantine of failing replicas.
//!
//! The policies are the sans-IO state machines; this is the thin driver:
//! it reads the clock, runs the attempts on [`Channel`]s (one per replica,
//! sharing one transport) and feeds the outcomes back.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rand::SeedableRng;
use rand::rngs::StdRng;
use tessera_transport::{Message, Transport};

use crate::policy::{
    AttemptFailure, Quarantine, QuarantineConfig, Replica, ReplicaSelector, RetryBudget,
    RetryBudgetConfig, RetryDecision, RetryPolicy, RetryPolicyConfig,
};
use crate::{Channel, ChannelConfig, RpcError};

/// One replica of the set.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ReplicaEndpoint {
    /// Its address.
    pub addr: String,
    /// Its failure domain (zone, mini-pod). Default: empty (one domain).
    #[serde(default)]
    pub domain: String,
}

/// Settings of a [`ReplicaSet`].
#[derive(Debug, Clone, Default)]
pub struct ReplicaSetConfig {
    /// The replicas.
    pub replicas: Vec<ReplicaEndpoint>,
    /// The caller's failure domain (its replicas are preferred).
    pub local_domain: String,
    /// Connection and request timeouts of each attempt.
    pub channel: ChannelConfig,
    /// When to retry.
    pub retry: RetryPolicyConfig,
    /// How much to retry.
    pub budget: RetryBudgetConfig,
    /// When to exclude a replica.
    pub quarantine: QuarantineConfig,
    /// Seed of the retry coin and the replica draws (`None`: from the OS).
    pub seed: Option<u64>,
}

struct State {
    selector: ReplicaSelector,
    quarantine: Quarantine,
    budget: RetryBudget,
    rng: StdRng,
}

/// Calls one logical endpoint over its replicas (see the module docs).
#[derive(Clone)]
pub struct ReplicaSet {
    channels: Arc<Vec<Channel>>,
    policy: RetryPolicy,
    /// Longest one attempt may take (Tr): a slow replica leaves time for
    /// another within the caller's deadline.
    attempt_timeout: Duration,
    state: Arc<Mutex<State>>,
}

impl std::fmt::Debug for ReplicaSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaSet")
            .field("replicas", &self.channels.len())
            .finish_non_exhaustive()
    }
}

impl ReplicaSet {
    /// A set over `transport` (connections are made when first used).
    pub fn new(config: ReplicaSetConfig, transport: Transport) -> Self {
        let now = Instant::now();
        let channels = config
            .replicas
            .iter()
            .map(|r| {
                Channel::with_transport(r.addr.clone(), config.channel.clone(), transport.clone())
            })
            .collect();
        let replicas = config
            .replicas
            .iter()
            .map(|r| Replica::new(r.addr.clone(), r.domain.clone()))
            .collect();
        let rng = match config.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_os_rng(),
        };
        Self {
            channels: Arc::new(channels),
            policy: RetryPolicy::new(config.retry),
            attempt_timeout: config.channel.request_timeout(),
            state: Arc::new(Mutex::new(State {
                selector: ReplicaSelector::new(replicas, config.local_domain),
                quarantine: Quarantine::new(config.quarantine, config.replicas.len()),
                budget: RetryBudget::new(config.budget, now),
                rng,
            })),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The replicas excluded now, and until when.
    pub fn quarantined(&self) -> Vec<crate::policy::Ejection> {
        self.state().quarantine.list(Instant::now())
    }

    /// Readmits every replica (the admin call).
    pub fn clear_quarantine(&self) {
        self.state().quarantine.clear();
    }

    /// Calls `method_id` with `body` within `timeout`. `safe`: a second
    /// application is harmless (idempotent method, or a request id the
    /// server deduplicates), so an attempt whose outcome is unknown may be
    /// retried. Each attempt goes to a replica not tried yet for this call.
    pub async fn call_raw(
        &self,
        method_id: u32,
        body: Message,
        safe: bool,
        timeout: Duration,
    ) -> Result<Bytes, RpcError> {
        let started = Instant::now();
        let deadline = started + timeout;
        let mut tried: Vec<usize> = Vec::new();
        let mut attempt = 0u32;
        let mut last_error: Option<RpcError> = None;
        loop {
            attempt += 1;
            let picked = {
                let mut state = self.state();
                let now = Instant::now();
                let State {
                    selector,
                    quarantine,
                    rng,
                    ..
                } = &mut *state;
                let excluded: Vec<bool> = selector
                    .replicas()
                    .iter()
                    .map(|r| quarantine.is_excluded(&r.addr, now))
                    .collect();
                let pick = selector
                    .pick(
                        |i, _| !excluded.get(i).copied().unwrap_or(true) && !tried.contains(&i),
                        rng,
                    )
                    // Everything eligible excluded or tried: any replica
                    // not tried yet (quarantine never empties a set).
                    .or_else(|| selector.pick(|i, _| !tried.contains(&i), rng));
                if let Some(i) = pick {
                    selector.start(i);
                }
                pick
            };
            let Some(i) = picked else {
                // Every replica was tried: the last failure is the answer.
                return Err(last_error.unwrap_or_else(|| {
                    RpcError::NoReplica(format!("{} replicas", self.channels.len()))
                }));
            };
            tried.push(i);
            let attempt_started = Instant::now();
            let attempt_deadline = deadline.min(attempt_started + self.attempt_timeout);
            let result = self.channels[i]
                .call_raw(
                    method_id,
                    body.clone(),
                    attempt_deadline,
                    attempt_deadline.saturating_duration_since(attempt_started),
                )
                .await;
            let now = Instant::now();
            let mut state = self.state();
            state.selector.finish(i, now - attempt_started);
            let failure = match &result {
                Ok(_) => {
                    state.budget.on_success(now);
                    return result;
                }
                // Never sent: safe to retry whatever the method.
                Err(
                    RpcError::Connect { .. }
                    | RpcError::ConnectTimeout { .. }
                    | RpcError::Send { .. },
                ) => {
                    let addr = state.selector.replicas()[i].addr.clone();
                    if let Some(ejection) = state.quarantine.record_connect_failure(&addr, now) {
                        tracing::warn!(replica = %addr, until = ?ejection.until, "replica quarantined");
                        metrics::counter!("tessera_rpc_quarantine_ejections_total").increment(1);
                    }
                    AttemptFailure::Connect
                }
                Err(RpcError::DeadlineExceeded(_) | RpcError::ConnectionLost { .. }) => {
                    let addr = state.selector.replicas()[i].addr.clone();
                    if let Some(ejection) = state.quarantine.record_request_failure(&addr, now) {
                        tracing::warn!(replica = %addr, until = ?ejection.until, "replica quarantined");
                        metrics::counter!("tessera_rpc_quarantine_ejections_total").increment(1);
                    }
                    AttemptFailure::TimedOutOrLost
                }
                Err(_) => AttemptFailure::Status,
            };
            let State { budget, rng, .. } = &mut *state;
            match self
                .policy
                .decide(attempt, failure, safe, deadline, now, budget, rng)
            {
                RetryDecision::Retry => {
                    metrics::counter!("tessera_rpc_client_retries_total").increment(1);
                    tracing::debug!(attempt, "retrying on another replica");
                }
                RetryDecision::GiveUp(why) => {
                    if why == "retry budget exhausted" {
                        metrics::counter!("tessera_rpc_client_retry_budget_exhausted_total")
                            .increment(1);
                    }
                    return result;
                }
            }
            last_error = result.err();
        }
    }
}
