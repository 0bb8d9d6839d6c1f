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
use tessera_transport::sync::LockExt;

use bytes::Bytes;
use rand::SeedableRng;
use rand::rngs::StdRng;
use tessera_transport::{Message, Transport};

use crate::NoReplica;
use crate::channel::Target;
use crate::policy::{
    AttemptFailure, GiveUp, Quarantine, QuarantineConfig, Replica, ReplicaSelector, RetryBudget,
    RetryBudgetConfig, RetryDecision, RetryPolicy, RetryPolicyConfig,
};
use crate::{CallOptions, Channel, ChannelConfig, Code, LinkClosed, MethodDescriptor, RpcError};
use tessera_config::{ConfigError, Validate, invalid};

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
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReplicaSetConfig {
    /// The replicas.
    pub replicas: Vec<ReplicaEndpoint>,
    /// The caller's failure domain (its replicas are preferred).
    pub local_domain: String,
    /// A call's whole deadline, retries included, in milliseconds, when the
    /// caller gives none. Default 100 ms: two and a half attempts of the
    /// paper's Tr = 40 ms, so a call that lost its first attempt to a
    /// timeout still has a whole attempt on another replica.
    pub call_timeout_ms: u64,
    /// Connection timeout Tc and per-attempt timeout Tr (each attempt gets
    /// at most Tr of the call's deadline), and the RDMA-to-TCP fallback.
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

impl Default for ReplicaSetConfig {
    fn default() -> Self {
        Self {
            replicas: Vec::new(),
            local_domain: String::new(),
            call_timeout_ms: 100,
            channel: ChannelConfig::default(),
            retry: RetryPolicyConfig::default(),
            budget: RetryBudgetConfig::default(),
            quarantine: QuarantineConfig::default(),
            seed: None,
        }
    }
}

impl ReplicaSetConfig {
    /// The default deadline of a call.
    pub fn call_timeout(&self) -> Duration {
        Duration::from_millis(self.call_timeout_ms)
    }
}

impl Validate for ReplicaSetConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.replicas.is_empty() {
            return Err(invalid("replicas", "at least one replica is required"));
        }
        for (i, replica) in self.replicas.iter().enumerate() {
            if replica.addr.is_empty() {
                return Err(invalid(format!("replicas[{i}].addr"), "must not be empty"));
            }
        }
        if self.call_timeout_ms == 0 {
            return Err(invalid("call_timeout_ms", "must be at least 1"));
        }
        self.channel.validate()?;
        self.retry.validate()?;
        self.budget.validate()?;
        self.quarantine.validate()
    }
}

struct State {
    selector: ReplicaSelector,
    quarantine: Quarantine,
    budget: RetryBudget,
    rng: StdRng,
    /// Quarantine readmissions already counted in the metrics.
    seen_readmissions: u64,
    /// Whether each replica was excluded at the last pick.
    was_excluded: Vec<bool>,
    /// The last connection event (a failed dial, a broken link) counted
    /// against each replica: the other calls failing with the same one
    /// are not counted again.
    last_event: Vec<Option<u64>>,
}

/// Calls one logical endpoint over its replicas (see the module docs).
#[derive(Clone)]
pub struct ReplicaSet {
    channels: Arc<Vec<Channel>>,
    transport: Transport,
    call_timeout: Duration,
    policy: RetryPolicy,
    /// Longest one attempt may take (Tr): a slow replica leaves time for
    /// another within the caller's deadline.
    attempt_timeout: Duration,
    state: Arc<Mutex<State>>,
    /// Handles of the per-method call metrics.
    call_metrics: Arc<crate::observe::CallMetrics>,
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
        let channels = config
            .replicas
            .iter()
            .map(|r| {
                Channel::with_transport(r.addr.clone(), config.channel.clone(), transport.clone())
            })
            .collect();
        Self::over_channels(config, channels, transport)
    }

    /// A set over existing channels, one per entry of `config.replicas` in
    /// the same order (a process that reaches one server through several
    /// sets shares one channel, and so one connection, among them).
    /// `config.channel` is then not used.
    ///
    /// # Panics
    /// If `channels` and `config.replicas` differ in length (a programming
    /// error, not a runtime condition).
    pub fn over_channels(
        config: ReplicaSetConfig,
        channels: Vec<Channel>,
        transport: Transport,
    ) -> Self {
        assert_eq!(
            channels.len(),
            config.replicas.len(),
            "one channel per replica"
        );
        let now = Instant::now();
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
            transport,
            call_timeout: config.call_timeout(),
            policy: RetryPolicy::new(config.retry),
            attempt_timeout: config.channel.request_timeout(),
            state: Arc::new(Mutex::new(State {
                selector: ReplicaSelector::new(replicas, config.local_domain),
                quarantine: Quarantine::new(config.quarantine, config.replicas.len()),
                budget: RetryBudget::new(config.budget, now),
                rng,
                seen_readmissions: 0,
                was_excluded: vec![false; config.replicas.len()],
                last_event: vec![None; config.replicas.len()],
            })),
            call_metrics: Arc::default(),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.locked()
    }

    /// The replicas excluded now, and until when.
    pub fn quarantined(&self) -> Vec<crate::policy::Ejection> {
        self.state().quarantine.list(Instant::now())
    }

    /// Readmits every replica (the admin call).
    pub fn clear_quarantine(&self) {
        let readmitted = self.state().quarantine.list(Instant::now()).len();
        self.state().quarantine.clear();
        metrics::counter!(crate::observe::QUARANTINE_READMISSIONS).increment(readmitted as u64);
    }

    /// The send pool requests are encoded into.
    pub fn send_pool(&self) -> &tessera_transport::pool::Pool {
        self.transport.send_pool()
    }

    /// Attempts outstanding on each replica now, in configuration order.
    pub fn outstanding(&self) -> Vec<u32> {
        self.state().selector.outstanding()
    }

    /// Each replica's address and the transport its channel is connected
    /// over now (`None` before the first connection or after a broken
    /// one), in configuration order.
    pub fn transports(&self) -> Vec<(String, Option<crate::TransportKind>)> {
        self.channels
            .iter()
            .map(|c| (c.addr().to_owned(), c.current_transport()))
            .collect()
    }

    /// The replicas' addresses, in configuration order.
    pub fn addrs(&self) -> Vec<String> {
        self.channels.iter().map(|c| c.addr().to_owned()).collect()
    }

    /// Calls `method` (what a generated client does): retried when the
    /// method is idempotent or `options.deduplicated` says the server
    /// deduplicates the request; the deadline is `options.timeout` or the
    /// set's call timeout.
    pub async fn unary_message<Resp>(
        &self,
        method: &'static MethodDescriptor,
        body: Message,
        options: &CallOptions,
    ) -> Result<Resp, RpcError>
    where
        Resp: prost::Message + Default,
    {
        let timeout = options.timeout.unwrap_or(self.call_timeout);
        let safe = method.idempotent || options.deduplicated;
        let span = tracing::debug_span!(
            "rpc.call",
            method = method.path,
            replicas = self.channels.len()
        );
        crate::observe::measured_call(
            &self.call_metrics,
            method,
            span,
            self.call(method.path, Target::of(method), body, safe, timeout),
        )
        .await
    }

    /// Calls `method_id` with `body` within `timeout`. `safe`: a second
    /// application is harmless (idempotent method, or a request id the
    /// server deduplicates), so an attempt whose outcome is unknown may be
    /// retried. Each attempt goes to a replica not tried yet for this call
    /// while there is one, then to any but the one that failed last.
    pub async fn call_raw(
        &self,
        method_id: u32,
        body: Message,
        safe: bool,
        timeout: Duration,
    ) -> Result<Bytes, RpcError> {
        self.call("raw", Target::raw(method_id), body, safe, timeout)
            .await
    }

    /// The replica for the next attempt of a call that tried `tried`:
    /// quarantined ones excluded, one readmitted from quarantine starting
    /// afresh (what got it excluded says nothing of it now). `None`: an
    /// empty set.
    fn pick(&self, tried: &[usize]) -> Option<usize> {
        let mut state = self.state();
        let now = Instant::now();
        let State {
            selector,
            quarantine,
            rng,
            seen_readmissions,
            was_excluded,
            ..
        } = &mut *state;
        let excluded: Vec<bool> = selector
            .replicas()
            .iter()
            .map(|r| quarantine.is_excluded(&r.addr, now))
            .collect();
        for (i, (&now_excluded, was)) in excluded.iter().zip(was_excluded.iter_mut()).enumerate() {
            if *was && !now_excluded {
                selector.reset(i);
            }
            *was = now_excluded;
        }
        let pick = selector.pick_for_attempt(tried, &excluded, now, rng);
        if let Some(i) = pick {
            selector.start(i);
        }
        let readmissions = quarantine.readmissions();
        if readmissions > *seen_readmissions {
            metrics::counter!(crate::observe::QUARANTINE_READMISSIONS)
                .increment(readmissions - *seen_readmissions);
            *seen_readmissions = readmissions;
        }
        pick
    }

    /// What replica `i`'s failed attempt (started at `attempt_started`)
    /// teaches its selector and quarantine: the failure's class and the
    /// replica's address, or `None` for a failure that is final for the
    /// call (a request too large for any replica).
    fn learn(
        &self,
        state: &mut State,
        i: usize,
        err: &RpcError,
        attempt_started: Instant,
        now: Instant,
    ) -> Option<(AttemptFailure, String)> {
        let failure = classify(err);
        let fault = is_server_fault(err);
        // One reset with fifty calls in flight, or one failed dial with
        // thirty callers waiting, is one failure of the replica.
        let event = err.event();
        let repeated = event.is_some() && state.last_event[i] == event;
        if event.is_some() {
            state.last_event[i] = event;
        }
        if matches!(err, RpcError::MessageTooLarge { .. }) {
            state.selector.abandon(i);
            return None;
        }
        match failure {
            // No latency sample from a failed or refused connection; the
            // replica backs off instead.
            AttemptFailure::Connect | AttemptFailure::Refused | AttemptFailure::Lost
                if repeated =>
            {
                state.selector.abandon(i)
            }
            AttemptFailure::Connect | AttemptFailure::Refused | AttemptFailure::Lost => {
                state.selector.connection_failed(i, now)
            }
            // Fast and useless: a sample of at least an attempt's time.
            _ if fault => state
                .selector
                .fault(i, now - attempt_started, self.attempt_timeout, now),
            _ => state.selector.finish(i, now - attempt_started, now),
        }
        let addr = state.selector.replicas()[i].addr.clone();
        let ejection = match failure {
            _ if repeated => None,
            AttemptFailure::Connect => state.quarantine.record_connect_failure(&addr, now),
            AttemptFailure::Lost | AttemptFailure::TimedOut => {
                state.quarantine.record_request_failure(&addr, now)
            }
            _ if fault => state.quarantine.record_request_failure(&addr, now),
            _ => None,
        };
        if let Some(ejection) = ejection {
            tracing::warn!(replica = %addr, until = ?ejection.until, "replica quarantined");
            metrics::counter!(crate::observe::QUARANTINE_EJECTIONS).increment(1);
        }
        Some((failure, addr))
    }

    async fn call(
        &self,
        method: &'static str,
        target: Target,
        body: Message,
        safe: bool,
        timeout: Duration,
    ) -> Result<Bytes, RpcError> {
        let started = Instant::now();
        let deadline = started + timeout;
        let mut tried: Vec<usize> = Vec::new();
        // Every attempt (numbered for the channel's spans and metrics), and
        // those the retry policy counts (not the ones that did no work and
        // moved on to another replica, see `policy::retry`).
        let mut attempt = 0u32;
        let mut counted = 0u32;
        let mut last_error: Option<RpcError> = None;
        // Each failed attempt's replica and failure, for the log of a call
        // that gives up (allocated only once an attempt failed).
        let mut failures: Vec<(usize, AttemptFailure)> = Vec::new();
        // Replicas that turned this call away (an attempt that did no work:
        // a refused dial, `Unavailable`).
        let mut turned_away: Vec<usize> = Vec::new();
        loop {
            attempt += 1;
            counted += 1;
            let picked = self.pick(&tried);
            let Some(i) = picked else {
                // An empty set.
                return Err(last_error.unwrap_or(RpcError::NoReplica(NoReplica::EmptySet)));
            };
            tried.push(i);
            // Until the outcome is fed back, a dropped call (its caller
            // gave up) only ends the attempt's count as outstanding.
            let mut pending = Abandoned {
                state: &self.state,
                replica: Some(i),
            };
            let attempt_started = Instant::now();
            let attempt_deadline = deadline.min(attempt_started + self.attempt_timeout);
            let result = self.channels[i]
                .attempt(
                    method,
                    target,
                    body.clone(),
                    attempt_deadline,
                    attempt_deadline.saturating_duration_since(attempt_started),
                    attempt,
                )
                .await;
            pending.replica = None;
            let now = Instant::now();
            let mut state = self.state();
            let (failure, addr) = match &result {
                Ok(_) => {
                    state.selector.finish(i, now - attempt_started, now);
                    state.budget.on_success(now);
                    return result;
                }
                Err(err) => match self.learn(&mut state, i, err, attempt_started, now) {
                    Some(learned) => learned,
                    // The request's fault, and final: no replica would take it.
                    None => return result,
                },
            };
            failures.push((i, failure));
            if failure.did_no_work() && !turned_away.contains(&i) {
                turned_away.push(i);
            }
            // Somewhere else to go: a replica not tried yet, or one tried
            // that did not turn the call away (it may answer now).
            let elsewhere = (0..self.channels.len()).any(|j| j != i && !turned_away.contains(&j));
            let State { budget, rng, .. } = &mut *state;
            match self.policy.decide(
                counted, failure, safe, elsewhere, deadline, now, budget, rng,
            ) {
                RetryDecision::Redirect => {
                    counted -= 1;
                    metrics::counter!(crate::observe::CLIENT_REDIRECTS, "method" => method)
                        .increment(1);
                    tracing::debug!(attempt, replica = %addr, "did no work there; trying another replica");
                }
                RetryDecision::Retry => {
                    metrics::counter!(crate::observe::CLIENT_RETRIES, "method" => method)
                        .increment(1);
                    tracing::debug!(attempt, replica = %addr, error = ?result.as_ref().err(), "retrying on another replica");
                }
                RetryDecision::GiveUp(why) => {
                    tracing::debug!(attempt, replica = %addr, %why, ?failures, error = ?result.as_ref().err(), "giving up");
                    if why == GiveUp::BudgetExhausted {
                        metrics::counter!(crate::observe::CLIENT_BUDGET_EXHAUSTED).increment(1);
                    }
                    return result;
                }
            }
            last_error = result.err();
        }
    }
}

/// Ends an attempt's count as outstanding if the call is dropped before
/// its outcome is fed back (`replica` is cleared once it is).
struct Abandoned<'a> {
    state: &'a Mutex<State>,
    replica: Option<usize>,
}

impl Drop for Abandoned<'_> {
    fn drop(&mut self) {
        if let Some(i) = self.replica {
            self.state.locked().selector.abandon(i);
        }
    }
}

/// A status that says the replica, not the request, is at fault: counted
/// against it in selection and quarantine.
fn is_server_fault(err: &RpcError) -> bool {
    matches!(
        err,
        RpcError::Status(status) if matches!(
            status.code(),
            Code::Internal | Code::Unknown | Code::DataLoss | Code::Unimplemented | Code::FailedPrecondition
        )
    )
}

/// How a failed attempt counts for retrying, selection and quarantine.
fn classify(err: &RpcError) -> AttemptFailure {
    match err {
        // Never sent: safe to retry whatever the method.
        RpcError::Connect { .. } | RpcError::ConnectTimeout { .. } | RpcError::Send { .. } => {
            AttemptFailure::Connect
        }
        RpcError::Status(status) if status.code() == Code::Unavailable => AttemptFailure::Refused,
        // A stopping server closed the link without reading the request.
        RpcError::ConnectionLost { reason, .. } if matches!(**reason, LinkClosed::Drained) => {
            AttemptFailure::Refused
        }
        RpcError::ConnectionLost { .. } => AttemptFailure::Lost,
        RpcError::DeadlineExceeded(_) => AttemptFailure::TimedOut,
        _ => AttemptFailure::Status,
    }
}
