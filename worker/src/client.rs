//! The worker's parameter-server client: Fetch and Push over every shard.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::future::{join_all, try_join_all};
use tessera_proto::rows::write_f32s;
use tessera_proto::sharding::primary_group;
use tessera_proto::v1::{
    FetchRequest, HealthRequest, HealthResponse, ParameterServerClient, PushRequest,
};
use tessera_rpc::{Channel, Endpoint, ReplicaEndpoint, ReplicaSet, RpcError, Transport, Validate};
use tokio_util::task::AbortOnDropHandle;

use crate::config::{ConfigError, WorkerConfig};
use crate::plan::{FetchPlan, MergeError, PushPlan};
use crate::primary::Primaries;
use crate::push::{PartFailure, PushFailure, PushId, SpecError};
use crate::routing::{self, LiftBackoff, Routing, Waited, replica_set_config};
use crate::spread::InFlight;

/// How many times a request that ran into a resize (`KeysMoved`) is split
/// anew and sent again.
const MOVED_TRIES: usize = 3;

/// Rows returned by a Fetch, in the caller's key order.
#[derive(Debug, Clone, PartialEq)]
pub struct Rows {
    dim: usize,
    values: Vec<f32>,
}

impl Rows {
    /// Values per row.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        self.values.len().checked_div(self.dim).unwrap_or(0)
    }

    /// Whether there are no rows.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// Row `i` (for the caller's `keys[i]`).
    pub fn row(&self, i: usize) -> &[f32] {
        &self.values[i * self.dim..(i + 1) * self.dim]
    }

    /// All values, row after row.
    pub fn values(&self) -> &[f32] {
        &self.values
    }

    /// All values, row after row, as the block the Fetch merged them into
    /// (no copy: for handing the rows to another owner, such as a NumPy
    /// array).
    pub fn into_values(self) -> Vec<f32> {
        self.values
    }
}

/// A Fetch split by shard that owns its keys ([`PsClient::plan_fetch`]):
/// sending it ([`PsClient::fetch_planned`]) borrows nothing of the
/// caller's, so a caller can let go of its keys before it waits (a Python
/// caller releases its interpreter lock only once its array was read).
#[derive(Debug, Clone)]
pub struct PlannedFetch {
    table: String,
    plan: FetchPlan,
}

impl PlannedFetch {
    /// The caller's keys, counted with repeats (the rows the Fetch returns).
    pub fn len(&self) -> usize {
        self.plan.len()
    }

    /// Whether the Fetch asks for no rows.
    pub fn is_empty(&self) -> bool {
        self.plan.is_empty()
    }
}

/// A Push whose gradients were summed per key and split by (table, shard),
/// owning them ([`PsClient::plan_push`], [`PsClient::plan_push_many`]); sent by
/// [`PsClient::push_planned`].
#[derive(Debug, Clone)]
pub struct PlannedPush {
    parts: Vec<(String, PushPlan)>,
}

/// One table's part of a batched Fetch ([`PsClient::fetch_many`]).
#[derive(Debug, Clone, Copy)]
pub struct FetchSpec<'a> {
    /// The table.
    pub table: &'a str,
    /// Its keys, in the order the rows are wanted.
    pub keys: &'a [u64],
}

/// One table's part of a batched Push ([`PsClient::push_many`]).
#[derive(Debug, Clone, Copy)]
pub struct PushSpec<'a> {
    /// The table.
    pub table: &'a str,
    /// Keys whose rows the gradients update (repeats are summed).
    pub keys: &'a [u64],
    /// `keys.len() * dim` values, row i for `keys[i]`.
    pub gradients: &'a [f32],
    /// The table's dimension.
    pub dim: usize,
}

/// Why a worker call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A sub-request to a shard failed.
    #[error("shard {shard} at {addr}: {source}")]
    Rpc {
        /// The shard.
        shard: u32,
        /// The server called.
        addr: String,
        /// The RPC error.
        source: RpcError,
    },
    /// No configured server is the shard's primary (validation rules this
    /// out for a configuration that loaded).
    #[error("no server of shard {0}'s primary replica group is configured")]
    NoPrimary(u32),
    /// Some parts of a Push failed (the others were applied): retry under
    /// the failure's id to complete it exactly once.
    #[error(transparent)]
    Push(Box<PushFailure>),
    /// The specs of a batched Push do not fit together.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// The shards' answers do not fit together.
    #[error(transparent)]
    Merge(#[from] MergeError),
    /// The transport could not be set up (for example no RDMA device).
    #[error("transport: {0}")]
    Transport(#[source] tessera_rpc::TransportError),
    /// No send-pool memory for the gradients.
    #[error("no buffer memory for gradients: {0}")]
    Memory(#[source] tessera_rpc::PoolError),
    /// `gradients.len()` is not `keys.len() * dim`.
    #[error("{gradients} gradient values do not match {keys} keys of dim {dim}")]
    GradientLength {
        /// Keys passed.
        keys: usize,
        /// Dimension passed.
        dim: usize,
        /// Gradient values passed.
        gradients: usize,
    },
}

/// A client of a sharded, replicated parameter server.
///
/// Fetch: keys are deduplicated, split by shard (see
/// `tessera_proto::sharding`), sent as one sub-request per shard
/// concurrently and merged in the caller's order. Each shard's Fetches go
/// through a [`ReplicaSet`] of the servers hosting it: replica selection
/// (own replica group first, then power-of-two-choices), retries within
/// the call's deadline, quarantine, and the RDMA-to-TCP fallback. Push:
/// gradients of repeated keys are summed, split by shard, and sent to each
/// shard's *primary* — at first the server of replica group `shard %
/// replica_groups` (see [`WorkerConfig::replica_groups`]), then
/// whichever server the coordinator or a server's redirect names (see
/// [`crate::primary`]) — which forwards them to the shard's other
/// replicas. Every Push carries this client's random worker id and a
/// sequence number, the same in all its sub-requests; servers apply each
/// (worker, sequence) once, so a sub-request whose answer was lost is
/// retried (on the same primary, or on a new one after a failover) and
/// still applied exactly once.
#[derive(Debug)]
pub struct PsClient {
    /// The shard count and each shard's Fetch path (`routing.rs`).
    routing: Arc<Routing>,
    /// Every shard's primary as known now, and the Push path to it.
    primaries: Arc<Primaries>,
    /// The coordinator's watches of the primaries and of the shard map,
    /// when there is one.
    _watch: Vec<AbortOnDropHandle<()>>,
    /// How long a request waits for a resize it ran into (`KeysMoved`)
    /// to reach this worker's routing.
    moved_wait: Duration,
    push_timeout: Duration,
    attempt_timeout: Duration,
    /// This client's id in Push deduplication (random, never 0).
    worker_id: u64,
    /// The last Push sequence number used.
    sequence: AtomicU64,
    /// The Push ids in flight, kept within the servers' window.
    in_flight: InFlight,
    servers: Vec<(String, ParameterServerClient)>,
    transport: Transport,
}

impl PsClient {
    /// A client for the servers in `config`. Connections are made lazily, on
    /// first use.
    pub fn new(config: &WorkerConfig) -> Result<Self, WorkerError> {
        config.validate()?;
        let channel_config = config.channel_config();
        // One transport (and so one pair of pools) for all the worker's
        // channels.
        let transport =
            Transport::new(channel_config.transport.clone()).map_err(WorkerError::Transport)?;
        let mut channels: HashMap<String, Channel> = HashMap::new();
        let mut servers = Vec::new();
        let groups = config.replica_groups();
        let mut primaries = vec![String::new(); config.num_shards as usize];
        let mut hosts = vec![Vec::new(); config.num_shards as usize];
        let mut endpoints = vec![Vec::new(); config.num_shards as usize];
        for server in &config.servers {
            let channel = channels
                .entry(server.address.clone())
                .or_insert_with(|| {
                    let channel = Channel::with_transport(
                        &server.address,
                        channel_config.clone(),
                        transport.clone(),
                    );
                    servers.push((
                        server.address.clone(),
                        ParameterServerClient::new(channel.clone()),
                    ));
                    channel
                })
                .clone();
            let endpoint = ReplicaEndpoint {
                addr: server.address.clone(),
                domain: server.replica_group.to_string(),
            };
            for &shard in &server.shards {
                if primary_group(shard, groups) == server.replica_group {
                    primaries[shard as usize] = server.address.clone();
                }
                hosts[shard as usize].push(server.address.clone());
                endpoints[shard as usize].push((endpoint.clone(), channel.clone()));
            }
        }
        // A shard whose primary's group this worker does not list starts
        // at any server of the shard, which redirects it.
        for (primary, hosts) in primaries.iter_mut().zip(&hosts) {
            if primary.is_empty()
                && let Some(first) = hosts.first()
            {
                primary.clone_from(first);
            }
        }
        let fetchers = endpoints
            .into_iter()
            .map(|endpoints| {
                let (replicas, channels): (Vec<_>, Vec<_>) = endpoints.into_iter().unzip();
                ParameterServerClient::new(ReplicaSet::over_channels(
                    replica_set_config(config, &channel_config, replicas),
                    channels,
                    transport.clone(),
                ))
            })
            .collect();
        let connect: crate::primary::Connect = {
            let (channel_config, transport) = (channel_config.clone(), transport.clone());
            Box::new(move |addr: &str| {
                ParameterServerClient::new(Channel::with_transport(
                    addr,
                    channel_config.clone(),
                    transport.clone(),
                ))
            })
        };
        let primaries = Arc::new(Primaries::new(
            primaries,
            hosts,
            servers.iter().cloned().collect(),
            connect,
        ));
        // The coordinator's watch needs a runtime; without one (a client
        // built outside tokio) the servers' redirects still lead the way.
        let routing = Arc::new(Routing::new(
            config,
            fetchers,
            Arc::clone(&primaries),
            channel_config.clone(),
            transport.clone(),
            channels,
        ));
        let mut watch = Vec::new();
        if config.coordinator.is_etcd() && tokio::runtime::Handle::try_current().is_ok() {
            watch.push(AbortOnDropHandle::new(crate::primary::watch(
                Arc::clone(&primaries),
                config.coordinator.clone(),
            )));
            watch.push(AbortOnDropHandle::new(crate::routing::follow(
                Arc::clone(&routing),
                config.coordinator.clone(),
            )));
        }
        Ok(Self {
            routing,
            primaries,
            _watch: watch,
            moved_wait: Duration::from_millis(
                config.push_timeout_ms.max(config.request_timeout_ms),
            ),
            push_timeout: Duration::from_millis(config.push_timeout_ms),
            attempt_timeout: Duration::from_millis(config.request_timeout_ms),
            worker_id: rand::random::<u64>().max(1),
            sequence: AtomicU64::new(0),
            in_flight: InFlight::default(),
            servers,
            transport,
        })
    }

    /// This client's worker id in Push deduplication.
    pub fn worker_id(&self) -> u64 {
        self.worker_id
    }

    /// Calls held at a resize's fence now, waiting for the shard map to
    /// move on (a new count, or the fence lifted): what a resize stuck at
    /// its cut-over holds up.
    pub fn calls_held_at_fences(&self) -> usize {
        self.routing.waiting_for_change()
    }

    /// Total shards (the count keys are routed by now: a resize of the
    /// cluster changes it, see `routing.rs`).
    pub fn num_shards(&self) -> u32 {
        self.routing.layout().num_shards
    }

    /// The replica set each shard's Fetches go through (for its
    /// quarantine list and which transport each replica is reached over).
    pub fn replica_set(&self, shard: u32) -> Option<ReplicaSet> {
        match self
            .routing
            .layout()
            .fetchers
            .get(shard as usize)?
            .endpoint()
        {
            Endpoint::Replicas(set) => Some(set.clone()),
            Endpoint::Channel(_) => None,
        }
    }

    /// The rows of `keys` in `table`, in the order of `keys`.
    pub async fn fetch(&self, table: &str, keys: &[u64]) -> Result<Rows, WorkerError> {
        self.fetch_planned(&self.plan_fetch(table, keys)).await
    }

    /// Splits a Fetch of `keys` in `table` by shard (deduplicated), copying
    /// the keys into its sub-requests; [`PsClient::fetch_planned`] sends it.
    pub fn plan_fetch(&self, table: &str, keys: &[u64]) -> PlannedFetch {
        PlannedFetch {
            table: table.to_owned(),
            plan: FetchPlan::new(keys, self.num_shards()),
        }
    }

    /// Sends a planned Fetch (as [`PsClient::fetch`]). Planned before the
    /// cluster grew, or answered that keys moved, it is split anew by the
    /// count routed by now (waiting, within the call's time, for the
    /// resize to reach this worker).
    pub async fn fetch_planned(&self, planned: &PlannedFetch) -> Result<Rows, WorkerError> {
        let mut plan = std::borrow::Cow::Borrowed(&planned.plan);
        let deadline = Instant::now() + self.moved_wait;
        let mut lifted = LiftBackoff::new();
        let mut tries = 0;
        loop {
            let routed = self.num_shards();
            if plan.num_shards() != routed {
                plan = std::borrow::Cow::Owned(plan.resplit(routed));
            }
            if tries == MOVED_TRIES {
                return self.fetch_split(&planned.table, &plan).await;
            }
            let source = match self.fetch_split(&planned.table, &plan).await {
                Err(WorkerError::Rpc { source, .. })
                    if routing::moved(&source)
                        .is_some_and(|m| m.num_shards != plan.num_shards()) =>
                {
                    source
                }
                other => return other,
            };
            let fenced_at = routing::moved(&source).map_or(0, |m| m.map_version);
            let left = deadline.saturating_duration_since(Instant::now());
            let lost = |source| WorkerError::Rpc {
                shard: 0,
                addr: String::new(),
                source,
            };
            match self
                .routing
                .wait_for_change(plan.num_shards(), fenced_at, left)
                .await
            {
                Waited::Resplit => tries += 1,
                Waited::Lifted => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(lost(source));
                    }
                    tokio::time::sleep(lifted.next(left)).await;
                }
                Waited::TimedOut => return Err(lost(source)),
            }
        }
    }

    /// Sends the sub-requests of `plan` (split by the count routed by).
    async fn fetch_split(&self, table: &str, plan: &FetchPlan) -> Result<Rows, WorkerError> {
        let layout = self.routing.layout();
        let calls = plan.groups().iter().map(|group| {
            let client = layout.fetchers.get(group.shard as usize);
            let request = FetchRequest {
                table: table.to_owned(),
                shard: group.shard,
                keys: group.keys.clone(),
            };
            async move {
                let Some(client) = client else {
                    return Err(WorkerError::NoPrimary(group.shard));
                };
                client
                    .fetch(request)
                    .await
                    .map(|response| (response.dim, response.values))
                    .map_err(|source| WorkerError::Rpc {
                        shard: group.shard,
                        addr: client.endpoint().describe(),
                        source,
                    })
            }
        });
        let answers: Vec<(u32, Bytes)> = try_join_all(calls).await?;
        let (dim, values) = plan.merge(&answers)?;
        Ok(Rows { dim, values })
    }

    /// The rows of several tables at once: every table's per-shard
    /// sub-requests run concurrently; answers in the order of `specs`.
    pub async fn fetch_many(&self, specs: &[FetchSpec<'_>]) -> Result<Vec<Rows>, WorkerError> {
        try_join_all(specs.iter().map(|spec| self.fetch(spec.table, spec.keys))).await
    }

    /// A fresh Push id, for a Push the caller may want to retry exactly
    /// once ([`PsClient::push_as`], [`PsClient::push_many_as`]).
    pub fn next_push_id(&self) -> PushId {
        PushId(self.sequence.fetch_add(1, Ordering::Relaxed) + 1)
    }

    /// Gradients for several tables as one Push (one id, every
    /// (table, shard) part concurrently). Specs naming the same table are
    /// merged: their keys' gradients are summed as within one spec. On
    /// failure, [`WorkerError::Push`] says which parts failed; retry them
    /// with [`PsClient::push_many_as`] under its id.
    pub async fn push_many(&self, specs: &[PushSpec<'_>]) -> Result<(), WorkerError> {
        self.push_many_as(self.next_push_id(), specs).await
    }

    /// [`PsClient::push_many`] under a given id: a first attempt (with an
    /// id from [`PsClient::next_push_id`]) or a retry of a failed Push
    /// with the same specs, which applies each part at most once in all.
    pub async fn push_many_as(
        &self,
        id: PushId,
        specs: &[PushSpec<'_>],
    ) -> Result<(), WorkerError> {
        self.push_planned(id, &self.plan_push_many(specs)?).await
    }

    /// Sums and splits the gradients of several tables' specs as
    /// [`PsClient::push_many`] does, copying them into the Push's
    /// sub-requests; [`PsClient::push_planned`] sends it.
    pub fn plan_push_many(&self, specs: &[PushSpec<'_>]) -> Result<PlannedPush, WorkerError> {
        let tables = crate::push::merge_specs(specs)?;
        let mut parts = Vec::with_capacity(tables.len());
        for table in &tables {
            let plan = PushPlan::new(&table.keys, &table.gradients, table.dim, self.num_shards())
                .ok_or(WorkerError::GradientLength {
                keys: table.keys.len(),
                dim: table.dim,
                gradients: table.gradients.len(),
            })?;
            parts.push((table.table.to_owned(), plan));
        }
        Ok(PlannedPush { parts })
    }

    /// Plans the Push of a training step: the gradients of the rows
    /// `fetch` returned (`fetch.len() * dim` values, in the order of its
    /// keys), to the same table, summed and split as [`PsClient::push`]
    /// does but reusing the Fetch's split (no key hashed again).
    pub fn plan_push_for(
        &self,
        fetch: &PlannedFetch,
        gradients: &[f32],
        dim: usize,
    ) -> Result<PlannedPush, WorkerError> {
        let plan = PushPlan::for_fetch(&fetch.plan, gradients, dim).ok_or(
            WorkerError::GradientLength {
                keys: fetch.plan.len(),
                dim,
                gradients: gradients.len(),
            },
        )?;
        Ok(PlannedPush {
            parts: vec![(fetch.table.clone(), plan)],
        })
    }

    /// Sums and splits the gradients of one table as [`PsClient::push`]
    /// does, copying them into the Push's sub-requests.
    pub fn plan_push(
        &self,
        table: &str,
        keys: &[u64],
        gradients: &[f32],
        dim: usize,
    ) -> Result<PlannedPush, WorkerError> {
        let plan = PushPlan::new(keys, gradients, dim, self.num_shards()).ok_or(
            WorkerError::GradientLength {
                keys: keys.len(),
                dim,
                gradients: gradients.len(),
            },
        )?;
        Ok(PlannedPush {
            parts: vec![(table.to_owned(), plan)],
        })
    }

    /// Sends a planned Push under `id` (a fresh one from
    /// [`PsClient::next_push_id`], or a failed Push's id to retry it with
    /// the same plan: see [`PsClient::push_many_as`]).
    pub async fn push_planned(&self, id: PushId, planned: &PlannedPush) -> Result<(), WorkerError> {
        self.send_parts(id, &planned.parts).await
    }

    /// Applies `gradients` (`keys.len() * dim` values, row i for `keys[i]`)
    /// to `table`. Gradients of repeated keys are summed first. On
    /// failure, [`WorkerError::Push`] says which shards failed; retry with
    /// [`PsClient::push_as`] under its id.
    pub async fn push(
        &self,
        table: &str,
        keys: &[u64],
        gradients: &[f32],
        dim: usize,
    ) -> Result<(), WorkerError> {
        self.push_as(self.next_push_id(), table, keys, gradients, dim)
            .await
    }

    /// [`PsClient::push`] under a given id (see
    /// [`PsClient::push_many_as`]).
    pub async fn push_as(
        &self,
        id: PushId,
        table: &str,
        keys: &[u64],
        gradients: &[f32],
        dim: usize,
    ) -> Result<(), WorkerError> {
        self.push_planned(id, &self.plan_push(table, keys, gradients, dim)?)
            .await
    }

    /// Sends every (table, shard) part of a Push and waits for all of
    /// them: none is cancelled because another failed.
    async fn send_parts(
        &self,
        id: PushId,
        plans: &[(String, PushPlan)],
    ) -> Result<(), WorkerError> {
        // Before the deadline starts: a Push held back here has sent
        // nothing yet.
        let _in_flight = self.in_flight.enter(id.0).await;
        let deadline = Instant::now() + self.push_timeout;
        let mut plans = std::borrow::Cow::Borrowed(plans);
        let mut tries = 0;
        // Its resize cancelled, a fence the server has yet to lift.
        let mut lifted = LiftBackoff::new();
        loop {
            // Planned before the cluster grew: split anew by the count
            // routed by now.
            let routed = self.num_shards();
            if plans.iter().any(|(_, p)| p.num_shards != routed) {
                plans = std::borrow::Cow::Owned(
                    plans
                        .iter()
                        .map(|(t, p)| (t.clone(), p.resplit(routed).unwrap_or_else(|| p.clone())))
                        .collect(),
                );
            }
            let failure = match self.send_split(id, &plans, deadline).await {
                Err(WorkerError::Push(failure)) => failure,
                other => return other,
            };
            // Keys moved to a new shard (a resize cut over): once routed by
            // the new count, every part goes again under the same id; those
            // applied already are duplicates, at their shard or, for moved
            // keys, at the new one (it holds the old shards' windows).
            let fenced_at = failure
                .failed
                .iter()
                .filter_map(|f| routing::moved(&f.source))
                .filter(|m| m.num_shards != routed)
                .map(|m| m.map_version)
                .max();
            // Not deduplicated (id 0): the parts applied would be applied
            // again; the caller decides.
            let Some(fenced_at) = fenced_at.filter(|_| id.0 != 0 && tries < MOVED_TRIES) else {
                return Err(WorkerError::Push(failure));
            };
            let left = deadline.saturating_duration_since(Instant::now());
            match self.routing.wait_for_change(routed, fenced_at, left).await {
                Waited::Resplit => tries += 1,
                Waited::Lifted => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(WorkerError::Push(failure));
                    }
                    tokio::time::sleep(lifted.next(left)).await;
                }
                Waited::TimedOut => return Err(WorkerError::Push(failure)),
            }
        }
    }

    /// Sends every part of `plans` once (each following its shard's
    /// primary until `deadline`) and waits for all of them.
    async fn send_split(
        &self,
        id: PushId,
        plans: &[(String, PushPlan)],
        deadline: Instant,
    ) -> Result<(), WorkerError> {
        let mut calls = Vec::new();
        for (table, plan) in plans {
            for (group, sums) in &plan.groups {
                // Built once in the send pool and shared by every attempt's
                // request: each sends it from there as a part of its own.
                let len = sums.len() * tessera_proto::rows::F32_BYTES;
                let mut buf = self
                    .transport
                    .send_pool()
                    .alloc(len)
                    .map_err(WorkerError::Memory)?;
                buf.set_len(len);
                write_f32s(&mut buf, sums);
                let request = PushRequest {
                    num_shards: plan.num_shards,
                    table: table.clone(),
                    shard: group.shard,
                    keys: group.keys.clone(),
                    gradients: buf.freeze(),
                    worker_id: self.worker_id,
                    sequence: id.0,
                };
                let primaries = &self.primaries;
                let attempt_timeout = self.attempt_timeout;
                calls.push(async move {
                    let outcome = primaries.push(&request, attempt_timeout, deadline).await;
                    (request.table, request.shard, outcome)
                });
            }
        }
        let mut acknowledged = Vec::new();
        let mut failed = Vec::new();
        for (table, shard, outcome) in join_all(calls).await {
            match outcome {
                Ok(_) => acknowledged.push((table, shard)),
                Err((addr, source)) => failed.push(PartFailure {
                    table,
                    shard,
                    addr,
                    source,
                }),
            }
        }
        if failed.is_empty() {
            return Ok(());
        }
        Err(WorkerError::Push(Box::new(PushFailure {
            id,
            acknowledged,
            failed,
        })))
    }

    /// The server this client sends `shard`'s Pushes to now, and its epoch.
    pub fn primary(&self, shard: u32) -> Option<(String, u64)> {
        self.primaries.current(shard)
    }

    /// Health of every server, in configuration order.
    pub async fn health(&self) -> Vec<(String, Result<HealthResponse, RpcError>)> {
        let calls = self.servers.iter().map(|(addr, client)| async move {
            (addr.clone(), client.health(HealthRequest {}).await)
        });
        futures::future::join_all(calls).await
    }
}
