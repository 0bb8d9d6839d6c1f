//! Replication of shards across replica groups, and what a primary change
//! does to it.
//!
//! # Streams and versions
//!
//! Each shard has one **primary**, which takes its Pushes. It applies a
//! Push under the shard's write lock, gives it the next **position** of the
//! shard's stream and its own **epoch**, and queues it for every replica
//! attached to the shard ([`forward`]); a replica applies the positions
//! strictly in order. A copy of a shard is identified by its
//! [`Version`](crate::version::Version): the epoch and position of the last
//! Push it applied. Who the primary is and where epochs come from is the
//! coordination's business (`crate::coordination`): fixed in static mode,
//! leases in etcd otherwise; this module carries out its decisions
//! ([`Replication::lead`], [`Replication::follow`], ...).
//!
//! A replica that is not in step with its primary (it just started, the
//! primary changed, it saw a gap, or it was cut off) **attaches**: it sends
//! the primary its version; if it equals the primary's, it is in step
//! already; otherwise it copies the whole shard ([`sync`]). A replica never
//! takes a copy older than its own. A primary that takes over (a promoted
//! replica, a restarted primary, any primary in static mode at start)
//! first **recovers**: it asks the shard's other servers for their
//! versions and, when one holds a newer copy than its own, copies it
//! (`recovery`), so a restart never rolls a shard back to an older copy.
//! Until then it refuses the shard's Pushes and Fetches (`Unavailable`).
//!
//! # Consistency
//!
//! - **The primary's rows are the shard's truth.** A Fetch at the primary
//!   sees every Push it acknowledged (read-your-writes).
//! - **A replica's rows are the primary's as of an earlier position**: a
//!   prefix of the primary's stream, lagging by its forwarding queue (at
//!   most `max_lag_pushes`; `tessera_ps_replication_lag_pushes`), and bit
//!   for bit equal to them once the queue drains, whatever the optimizer.
//!   A Fetch at a replica may miss the latest Pushes. A replica that is
//!   replacing its copy refuses Fetches (workers read elsewhere); during a
//!   failover, replicas keep serving what they hold.
//! - **An acknowledged Push** was applied exactly once at the primary (the
//!   deduplication of worker ids, whose windows travel with every copy and
//!   every forwarded Push, so they survive a promotion). With `ack =
//!   "replicas"` it was also applied by every replica in step with the
//!   primary: it survives the primary's death as long as one of them does.
//!   With `ack = "primary"` it may be lost if the primary dies before
//!   forwarding it (the unreplicated tail: at most `max_lag_pushes` per
//!   shard while a replica is in step; counted and logged at the
//!   promotion as `tessera_ps_failover_lost_pushes_total`).
//! - **Fencing.** Every primary has its own epoch. A replica refuses
//!   Pushes from any epoch older than the newest it heard of, and tells the
//!   sender, which steps down; with etcd, a primary also stops
//!   acknowledging Pushes before its lease can expire. So no Push is ever
//!   acknowledged under two epochs.

mod forward;
mod recovery;
mod replica;
mod service;
mod shard;
mod sync;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use prost::Message as _;
use tessera_proto::v1::{
    self, NotPrimary, PushRequest, ReplicaStatus, ReplicationClient, ShardHealth, StreamHead,
};
use tessera_rpc::{Channel, ChannelConfig, Code, Status, Transport};
use tokio_util::sync::CancellationToken;

pub use self::recovery::{Patience, Recovered, RecoveryError};
pub use self::service::ReplicationService;
pub use self::sync::CopyError;

use self::forward::{Confirmation, ForwardSettings, Forwarder};
use self::shard::{Follow, Role, ShardCell, ShardState};
use crate::config::{AckMode, PeerConfig, PsServerConfig};
use crate::coordination::Fence;
use crate::store::Store;
use crate::version::Version;

/// Why this server does not take a Push for a shard now.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    /// Another server is (or none is known to be) the shard's primary.
    #[error("this server is not the primary of shard {}; {}", .0.shard, where_to(.0))]
    NotPrimary(NotPrimary),
    /// This server is becoming the primary: it copies the freshest copy
    /// from the replicas first.
    #[error("this server is recovering shard {0} before taking its Pushes")]
    Recovering(u32),
    /// This primary's lease is not confirmed: it may have been replaced.
    #[error("this server's lease is not confirmed; it takes no Pushes of shard {0} until it is")]
    Fenced(u32),
    /// This server stopped being the primary before the replicas confirmed
    /// the Push (it was not acknowledged; retry at the new primary).
    #[error("this server stopped being the primary of shard {} before its replicas confirmed the push; {}", .0.shard, where_to(.0))]
    Deposed(NotPrimary),
}

fn where_to(hint: &NotPrimary) -> String {
    if hint.primary.is_empty() {
        "no primary is known yet (a failover is in progress)".to_owned()
    } else {
        format!("it is {} at epoch {}", hint.primary, hint.epoch)
    }
}

impl Refusal {
    fn hint(&self) -> NotPrimary {
        match self {
            Refusal::NotPrimary(hint) | Refusal::Deposed(hint) => hint.clone(),
            Refusal::Recovering(shard) | Refusal::Fenced(shard) => NotPrimary {
                shard: *shard,
                ..NotPrimary::default()
            },
        }
    }
}

impl From<Refusal> for Status {
    /// `FAILED_PRECONDITION` when it names the primary to go to instead,
    /// `UNAVAILABLE` (retry shortly) otherwise; both with a [`NotPrimary`]
    /// in the details.
    fn from(refusal: Refusal) -> Self {
        let hint = refusal.hint();
        let code = match &refusal {
            Refusal::NotPrimary(h) if !h.primary.is_empty() => Code::FailedPrecondition,
            _ => Code::Unavailable,
        };
        Status::with_details(code, refusal.to_string(), hint.encode_to_vec())
    }
}

/// Pushes a primary waits on before acknowledging one (`ack =
/// "replicas"`): each confirmed replica's attachment and the position it
/// must reach.
#[derive(Debug)]
#[must_use = "a ticket must be awaited with Replication::confirmed"]
pub struct AckTicket {
    shard: u32,
    epoch: u64,
    position: u64,
    waits: Vec<(Arc<Forwarder>, u64)>,
}

/// The replication state of one server (module docs).
#[derive(Debug)]
pub struct Replication {
    store: Arc<Store>,
    me: String,
    ack: AckMode,
    replica_timeout: Duration,
    stale_after: Duration,
    cells: HashMap<u32, ShardCell>,
    forwarders: Vec<Arc<Forwarder>>,
    clients: HashMap<String, ReplicationClient>,
    peers: Vec<PeerConfig>,
    sessions: sync::Sessions,
    fence: Arc<Fence>,
    stop: CancellationToken,
    syncs: AtomicU64,
    cutoffs: Arc<AtomicU64>,
    weak: Weak<Replication>,
}

impl Replication {
    /// The replication of `store` as `config` lays it out; peers are
    /// reached over `transport`; a primary takes Pushes while `fence` is
    /// valid. Every hosted shard starts with no role: the coordination
    /// gives each one.
    pub fn new(
        store: Arc<Store>,
        config: &PsServerConfig,
        transport: &Transport,
        fence: Arc<Fence>,
    ) -> Arc<Self> {
        let channel_config = ChannelConfig {
            // Background traffic between servers: a slow peer must not
            // look dead.
            connect_timeout_ms: 1000,
            request_timeout_ms: 30_000,
            ..ChannelConfig::default()
        };
        let clients: HashMap<String, ReplicationClient> = config
            .peers
            .iter()
            .map(|peer| {
                (
                    peer.address.clone(),
                    ReplicationClient::new(Channel::with_transport(
                        &peer.address,
                        channel_config.clone(),
                        transport.clone(),
                    )),
                )
            })
            .collect();
        let settings = ForwardSettings {
            max_lag: config.replication.max_lag_pushes,
            batch: config.replication.batch_pushes,
            heartbeat: Duration::from_millis(config.replication.heartbeat_ms),
        };
        let cutoffs = Arc::new(AtomicU64::new(0));
        let forwarders = config
            .peers
            .iter()
            .filter_map(|peer| {
                let shards: Vec<u32> = peer
                    .shards
                    .iter()
                    .copied()
                    .filter(|s| config.shards.contains(s))
                    .collect();
                let client = clients.get(&peer.address)?.clone();
                (!shards.is_empty()).then(|| {
                    Arc::new(Forwarder::new(
                        peer.address.clone(),
                        shards,
                        client,
                        settings,
                        Arc::clone(&cutoffs),
                    ))
                })
            })
            .collect();
        Arc::new_cyclic(|weak| Self {
            store,
            me: config.advertised().to_owned(),
            ack: config.replication.ack,
            replica_timeout: Duration::from_millis(config.replication.replica_timeout_ms),
            stale_after: Duration::from_millis(config.replication.stale_after_ms),
            cells: config
                .shards
                .iter()
                .map(|&s| (s, ShardCell::new(s)))
                .collect(),
            forwarders,
            clients,
            peers: config.peers.clone(),
            sessions: sync::Sessions::new(),
            fence,
            stop: CancellationToken::new(),
            syncs: AtomicU64::new(0),
            cutoffs,
            weak: weak.clone(),
        })
    }

    /// This server's address as its peers know it.
    pub fn me(&self) -> &str {
        &self.me
    }

    /// The addresses of the other servers hosting `shard`.
    pub fn peers_of(&self, shard: u32) -> Vec<String> {
        self.peers
            .iter()
            .filter(|p| p.shards.contains(&shard))
            .map(|p| p.address.clone())
            .collect()
    }

    /// Starts forwarding and monitoring; everything stops with
    /// [`Replication::shutdown`].
    pub fn start(&self) {
        for forwarder in &self.forwarders {
            tokio::spawn(Arc::clone(forwarder).run(self.weak.clone(), self.stop.clone()));
        }
        let weak = self.weak.clone();
        let stop = self.stop.clone();
        tokio::spawn(async move {
            let mut silent: HashMap<u32, bool> = HashMap::new();
            loop {
                let Some(this) = weak.upgrade() else { return };
                let every = this.stale_after / 6;
                this.monitor(&mut silent);
                drop(this);
                tokio::select! {
                    _ = tokio::time::sleep(every) => {}
                    _ = stop.cancelled() => return,
                }
            }
        });
    }

    /// Stops every background task (forwarding, copies, monitoring).
    pub fn shutdown(&self) {
        self.stop.cancel();
    }

    fn cell(&self, shard: u32) -> Option<&ShardCell> {
        self.cells.get(&shard)
    }

    fn client(&self, addr: &str) -> Option<&ReplicationClient> {
        self.clients.get(addr)
    }

    /// Whether Fetches of `shard` may be served here now.
    pub fn readable(&self, shard: u32) -> bool {
        self.cell(shard).is_some_and(ShardCell::readable)
    }

    /// Whether every hosted shard is served.
    pub fn caught_up(&self) -> bool {
        self.cells.values().all(ShardCell::readable)
    }

    /// Whether this server takes Pushes for `shard` (as its primary).
    pub fn is_primary(&self, shard: u32) -> bool {
        self.cell(shard)
            .is_some_and(|c| c.lock().primary_epoch().is_some())
    }

    /// The shards this server is primary of.
    pub fn primary_shards(&self) -> Vec<u32> {
        let mut shards: Vec<u32> = self
            .cells
            .values()
            .filter(|c| c.lock().primary_epoch().is_some())
            .map(|c| c.shard)
            .collect();
        shards.sort_unstable();
        shards
    }

    /// Shard copies this server took from other servers.
    pub fn syncs(&self) -> u64 {
        self.syncs.load(Ordering::Relaxed)
    }

    /// Times this server cut a replica off from a shard.
    pub fn cutoffs(&self) -> u64 {
        self.cutoffs.load(Ordering::Relaxed)
    }

    // ----- The Push path, on a primary: under the shard's write lock. -----

    /// Whether a Push to `shard` may be applied now; returns the epoch to
    /// apply it under. Called under the shard's write lock.
    pub fn admit_push(&self, shard: u32, now: Instant) -> Result<u64, Refusal> {
        let Some(cell) = self.cell(shard) else {
            return Err(Refusal::NotPrimary(NotPrimary {
                shard,
                ..NotPrimary::default()
            }));
        };
        let state = cell.lock();
        match &state.role {
            Role::Primary { .. } if state.handing_over => Err(Refusal::NotPrimary(NotPrimary {
                shard,
                ..NotPrimary::default()
            })),
            Role::Primary { epoch, .. } => {
                if self.fence.is_valid(now) {
                    Ok(*epoch)
                } else {
                    metrics::counter!("tessera_ps_fenced_pushes_total").increment(1);
                    Err(Refusal::Fenced(shard))
                }
            }
            Role::Recovering { .. } => Err(Refusal::Recovering(shard)),
            Role::Replica(_) | Role::Idle => Err(Refusal::NotPrimary(state.redirect(shard))),
        }
    }

    /// Queues `push`, just applied to `shard` at `version`, for the
    /// replicas; returns what its acknowledgement waits for. Called under
    /// the shard's write lock, in stream order.
    pub fn record_push(&self, shard: u32, version: Version, push: &PushRequest) -> AckTicket {
        let mut ticket = AckTicket {
            shard,
            epoch: version.epoch,
            position: version.position,
            waits: Vec::new(),
        };
        let mut shared = None;
        for forwarder in &self.forwarders {
            if forwarder.shards.contains(&shard) {
                let push = shared.get_or_insert_with(|| Arc::new(push.clone()));
                if let Some(generation) =
                    forwarder.enqueue(shard, version.epoch, version.position, push)
                    && self.ack == AckMode::Replicas
                {
                    ticket.waits.push((Arc::clone(forwarder), generation));
                }
            }
        }
        ticket
    }

    /// What acknowledging a duplicate of a Push already applied to `shard`
    /// (now at `version`, under `epoch`) waits for: its original may still
    /// be on its way to the replicas, so every confirmed replica must
    /// reach `version`. Called under the shard's write lock.
    pub fn duplicate_ticket(&self, shard: u32, epoch: u64, version: Version) -> AckTicket {
        let waits = if self.ack == AckMode::Replicas {
            self.forwarders
                .iter()
                .filter(|f| f.shards.contains(&shard))
                .filter_map(|f| Some((Arc::clone(f), f.confirmed_generation(shard)?)))
                .collect()
        } else {
            Vec::new()
        };
        AckTicket {
            shard,
            epoch,
            position: version.position,
            waits,
        }
    }

    /// Waits until the Push of `ticket` may be acknowledged: every replica
    /// it waits for applied it, or left the set of replicas in step with
    /// this primary (cut off for not confirming within
    /// `replica_timeout_ms`, or out of sync). Fails if this server stopped
    /// being the primary meanwhile, or its lease is not proven now (the
    /// Push must then be retried where the shard is led).
    pub async fn confirmed(&self, ticket: AckTicket) -> Result<(), Refusal> {
        if !ticket.waits.is_empty() {
            let deadline = Instant::now() + self.replica_timeout;
            let waits = ticket
                .waits
                .iter()
                .map(|(forwarder, generation)| async move {
                    let outcome = forwarder
                        .wait_applied(ticket.shard, *generation, ticket.position, deadline)
                        .await;
                    if outcome == Confirmation::TimedOut {
                        forwarder.cut_off(ticket.shard, *generation, ticket.epoch, ticket.position);
                    }
                });
            futures::future::join_all(waits).await;
        }
        let Some(cell) = self.cell(ticket.shard) else {
            return Ok(());
        };
        let state = cell.lock();
        if state.primary_epoch() != Some(ticket.epoch) {
            return Err(Refusal::Deposed(state.redirect(ticket.shard)));
        }
        // The acknowledgement is what the fence guards: a lease that may
        // have expired while the replicas were confirming acknowledges
        // nothing (the worker retries at whichever server leads).
        if !self.fence.is_valid(Instant::now()) {
            metrics::counter!("tessera_ps_fenced_pushes_total").increment(1);
            return Err(Refusal::Fenced(ticket.shard));
        }
        Ok(())
    }

    /// Where the streams of `shards` stand, for those this server is the
    /// primary of.
    fn heads(&self, shards: &[u32]) -> Vec<StreamHead> {
        shards
            .iter()
            .filter_map(|&shard| {
                let epoch = self.cell(shard)?.lock().primary_epoch()?;
                let position = self.store.version(shard)?.position;
                Some(StreamHead {
                    shard,
                    epoch,
                    position,
                })
            })
            .collect()
    }

    // ----- Role changes: what the coordination decided. -----

    /// Steps down from `state` (under the shard's write lock): the
    /// replicas are detached, and Pushes waiting for them fail.
    fn step_down_locked(&self, shard: u32, state: &mut ShardState, why: &str) {
        if let Role::Primary { epoch, .. } = state.role {
            tracing::warn!(shard, epoch, why, "stepping down as the shard's primary");
            metrics::counter!("tessera_ps_step_downs_total").increment(1);
        }
        state.role = Role::Idle;
        state.handing_over = false;
        for forwarder in &self.forwarders {
            if forwarder.shards.contains(&shard) {
                forwarder.detach(shard, None);
            }
        }
    }

    /// Makes this server a replica of `primary` at `epoch` for `shard`
    /// (stepping down if it was the primary of an older epoch), and starts
    /// attaching to it. Ignored if a newer epoch is known.
    pub fn follow(&self, shard: u32, primary: &str, epoch: u64) {
        if primary == self.me {
            return;
        }
        let (Some(cell), Some(writing)) = (self.cell(shard), self.store.lock_shard(shard)) else {
            return;
        };
        let mut state = cell.lock();
        if epoch < state.known_epoch {
            return;
        }
        state.learn(epoch, primary);
        if epoch == state.known_epoch {
            state.known_primary = Some(primary.to_owned());
        }
        match &mut state.role {
            Role::Replica(f) if f.primary == primary && f.epoch >= epoch => return,
            Role::Replica(f) if f.primary == primary => {
                f.epoch = epoch;
                f.in_step = false;
            }
            Role::Primary { .. } | Role::Recovering { .. } => {
                self.step_down_locked(shard, &mut state, "another server holds a newer epoch");
                state.role = Role::Replica(Follow::new(primary.to_owned(), epoch));
            }
            _ => {
                state.role =
                    Role::Replica(Follow::replacing(&state.role, primary.to_owned(), epoch))
            }
        }
        drop(state);
        drop(writing);
        self.spawn_attach(shard);
    }

    /// A replica told this server that `hint.primary` leads `hint.shard` at
    /// a newer epoch: it follows that primary (stepping down).
    fn deposed(&self, hint: &NotPrimary, from: &str) {
        tracing::warn!(shard = hint.shard, replica = from, primary = %hint.primary, epoch = hint.epoch, "a replica follows a newer primary");
        if hint.primary.is_empty() {
            self.stand_down(hint.shard);
        } else {
            self.follow(hint.shard, &hint.primary, hint.epoch);
        }
    }

    /// `shard` has no primary now (its lease expired): this server stops
    /// being its primary, or a replica of the old one. Its copy is still
    /// served.
    pub fn stand_down(&self, shard: u32) {
        let (Some(cell), Some(_writing)) = (self.cell(shard), self.store.lock_shard(shard)) else {
            return;
        };
        let mut state = cell.lock();
        self.step_down_locked(shard, &mut state, "the shard has no primary any more");
    }

    /// Stops taking Pushes of `shard` (a primary shutting down) while what
    /// is queued still reaches the replicas ([`Replication::drain`]).
    pub fn stand_down_for_handover(&self, shard: u32) {
        let (Some(cell), Some(_writing)) = (self.cell(shard), self.store.lock_shard(shard)) else {
            return;
        };
        let mut state = cell.lock();
        if state.primary_epoch().is_some() {
            state.handing_over = true;
        }
    }

    /// Waits until every queued forward reached its replica, or `within`
    /// passed.
    pub async fn drain(&self, within: Duration) {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline && !self.forwarders.iter().all(|f| f.is_drained()) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The version of this server's copy of `shard` (default when not
    /// hosted).
    pub fn store_version(&self, shard: u32) -> Version {
        self.store.version(shard).unwrap_or_default()
    }

    /// Marks `shard` as recovering under `epoch` (0: not known yet): its
    /// Pushes and Fetches are refused until [`Replication::lead`].
    pub fn begin_recovery(&self, shard: u32, epoch: u64) {
        let (Some(cell), Some(_writing)) = (self.cell(shard), self.store.lock_shard(shard)) else {
            return;
        };
        let mut state = cell.lock();
        if state.primary_epoch().is_some() {
            self.step_down_locked(shard, &mut state, "recovering again");
        }
        // The epoch won is the newest there is: the old primary's stream is
        // refused (and told so) from now on, so it cannot get a Push
        // confirmed here while this server takes over.
        state.learn(epoch, &self.me);
        state.role = Role::Recovering { epoch };
    }

    /// Makes this server the primary of `shard` under `epoch`, from the
    /// copy it holds now (after [`Replication::recover`]). Refused when a
    /// newer epoch is known.
    pub fn lead(&self, shard: u32, epoch: u64) -> Result<(), RecoveryError> {
        let (Some(cell), Some(writing)) = (self.cell(shard), self.store.lock_shard(shard)) else {
            return Err(RecoveryError::NotHosted(shard));
        };
        let mut state = cell.lock();
        if state.known_epoch > epoch {
            return Err(RecoveryError::Superseded {
                shard,
                known: state.known_epoch,
            });
        }
        let base = writing.version();
        state.role = Role::Primary { epoch, base };
        state.handing_over = false;
        state.known_epoch = epoch;
        state.known_primary = Some(self.me.clone());
        state.has_copy = true;
        drop(state);
        drop(writing);
        for forwarder in &self.forwarders {
            if forwarder.shards.contains(&shard) {
                // Replicas attach to the new stream afresh.
                forwarder.detach(shard, None);
                forwarder.nudge();
            }
        }
        metrics::counter!("tessera_ps_primary_takeovers_total").increment(1);
        metrics::gauge!("tessera_ps_shard_epoch", "shard" => shard.to_string()).set(epoch as f64);
        tracing::info!(shard, epoch, from = %base, "primary of the shard");
        Ok(())
    }

    /// The newest epoch this server has heard of for `shard`.
    pub fn known_epoch(&self, shard: u32) -> u64 {
        self.cell(shard).map_or(0, |c| c.lock().known_epoch)
    }

    /// Whether this server's copy of `shard` follows its primary's stream
    /// in order (a replica that may take over without losing Pushes).
    pub fn in_step(&self, shard: u32) -> bool {
        self.cell(shard)
            .is_some_and(|c| matches!(&c.lock().role, Role::Replica(f) if f.in_step && !f.syncing))
    }

    // ----- Visibility. -----

    /// Every hosted shard's replication, for Health.
    pub fn shard_health(&self) -> Vec<ShardHealth> {
        let now = Instant::now();
        let mut shards: Vec<u32> = self.cells.keys().copied().collect();
        shards.sort_unstable();
        shards
            .into_iter()
            .filter_map(|shard| {
                let version = self.store.version(shard)?;
                let state = self.cell(shard)?.lock();
                let mut health = ShardHealth {
                    shard,
                    role: state.health_role() as i32,
                    epoch: state.known_epoch,
                    version: Some(version.into()),
                    primary: state.known_primary.clone().unwrap_or_default(),
                    ..ShardHealth::default()
                };
                match &state.role {
                    Role::Primary { epoch, .. } => {
                        health.epoch = *epoch;
                        health.primary = self.me.clone();
                        health.fenced = !self.fence.is_valid(now);
                        health.replicas = self
                            .forwarders
                            .iter()
                            .filter(|f| f.shards.contains(&shard))
                            .map(|f| {
                                let (attached, confirmed, queued, applied) = f.status(shard);
                                ReplicaStatus {
                                    address: f.addr.clone(),
                                    attached,
                                    lag_pushes: queued as u64,
                                    applied_position: applied,
                                    in_step: attached && confirmed,
                                }
                            })
                            .collect();
                    }
                    Role::Replica(f) => {
                        health.epoch = f.epoch;
                        health.primary = f.primary.clone();
                        health.in_step = f.in_step;
                        health.syncing = f.syncing;
                        health.stream_age_ms = f
                            .last_heard
                            .map_or(0, |t| now.saturating_duration_since(t).as_millis() as u64);
                        health.receiving = state.receiving(now, self.stale_after).unwrap_or(false);
                    }
                    Role::Recovering { epoch } => health.epoch = (*epoch).max(state.known_epoch),
                    Role::Idle => {}
                }
                Some(health)
            })
            .collect()
    }

    /// The server's state as Health reports it.
    pub fn server_state(&self) -> v1::ServerState {
        let mut state = v1::ServerState::Serving;
        for cell in self.cells.values() {
            let s = cell.lock();
            match &s.role {
                Role::Recovering { .. } => return v1::ServerState::Recovering,
                Role::Replica(f) if f.syncing || !s.has_copy => {
                    state = v1::ServerState::CatchingUp;
                }
                Role::Idle if !s.has_copy => state = v1::ServerState::CatchingUp,
                _ => {}
            }
        }
        state
    }

    /// Publishes each replica's stream age, and warns (once) when one stops
    /// hearing its primary.
    fn monitor(&self, silent: &mut HashMap<u32, bool>) {
        let now = Instant::now();
        for cell in self.cells.values() {
            let state = cell.lock();
            let shard = cell.shard.to_string();
            let Some(receiving) = state.receiving(now, self.stale_after) else {
                metrics::gauge!("tessera_ps_replica_receiving", "shard" => shard).set(1.0);
                silent.remove(&cell.shard);
                continue;
            };
            if let Role::Replica(f) = &state.role {
                let age = f
                    .last_heard
                    .map_or(0.0, |t| now.saturating_duration_since(t).as_secs_f64());
                metrics::gauge!("tessera_ps_replica_stream_age_seconds", "shard" => shard.clone())
                    .set(age);
                let was_silent = silent.insert(cell.shard, !receiving).unwrap_or(false);
                if !receiving && !was_silent && !f.syncing {
                    tracing::warn!(shard = cell.shard, primary = %f.primary, age_s = age, "replica is not receiving its primary's stream");
                } else if receiving && was_silent {
                    tracing::info!(shard = cell.shard, primary = %f.primary, "replica receives its primary's stream again");
                }
            }
            metrics::gauge!("tessera_ps_replica_receiving", "shard" => shard).set(if receiving {
                1.0
            } else {
                0.0
            });
        }
    }
}
