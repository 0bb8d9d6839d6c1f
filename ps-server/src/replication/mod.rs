//! Replication of shards across replica groups, and what a primary change
//! does to it.
//!
//! # Streams and versions
//!
//! Each shard has one **primary**, which takes its Pushes. It applies a
//! Push under the shard's write lock, gives it the next **position** of the
//! shard's stream and its own **epoch**, and queues it for every replica
//! attached to the shard (`forward`); a replica applies the positions
//! strictly in order. A copy of a shard is identified by its
//! [`Version`](tessera_store::version::Version): the epoch and position of the last
//! Push it applied. Who the primary is and where epochs come from is the
//! coordination's business (`crate::coordination`): fixed in static mode,
//! leases in etcd otherwise; this module carries out its decisions
//! ([`Replication::lead`], [`Replication::follow`], ...).
//!
//! A replica that is not in step with its primary (it just started, the
//! primary changed, it saw a gap, or it was cut off) **attaches**: it sends
//! the primary its version; if it equals the primary's, it is in step
//! already; otherwise it copies the whole shard (`sync`). A replica never
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

mod ack;
mod forward;
mod health;
mod in_step;
mod pending;
mod recovery;
mod replica;
mod roles;
mod service;
mod shard;
mod sync;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use tessera_proto::v1::{ReplicationClient, StreamHead};
use tessera_rpc::{Channel, ChannelConfig, Transport};
use tokio_util::sync::CancellationToken;

pub use self::ack::{AckTicket, Refusal};
pub use self::in_step::{InStepWriter, eligible};
pub use self::recovery::{Patience, Recovered, RecoveryError};
pub use self::service::ReplicationService;
pub use self::sync::CopyError;
#[cfg(test)]
pub(crate) use self::sync::Stager;
pub use tessera_store::copy_stream::{CopyDecoder, CopyItem, StreamError};

use self::forward::{ForwardSettings, Forwarder};
use self::shard::ShardCell;
use crate::config::{AckMode, PeerConfig, PsServerConfig};
use crate::fence::Fence;
use tessera_store::store::Store;

/// The replication state of one server (module docs).
#[derive(Debug)]
pub struct Replication {
    store: Arc<Store>,
    me: String,
    ack: AckMode,
    replica_timeout: Duration,
    stale_after: Duration,
    copy_buffer_bytes: usize,
    cells: HashMap<u32, ShardCell>,
    forwarders: Vec<Arc<Forwarder>>,
    clients: HashMap<String, ReplicationClient>,
    peers: Vec<PeerConfig>,
    sessions: sync::Sessions,
    fence: Arc<Fence>,
    stop: CancellationToken,
    syncs: AtomicU64,
    cutoffs: Arc<AtomicU64>,
    in_step: in_step::InStepBook,
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
            copy_buffer_bytes: usize::try_from(config.replication.copy_buffer_bytes)
                .unwrap_or(usize::MAX),
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
            in_step: in_step::InStepBook::new(&config.shards),
            weak: weak.clone(),
        })
    }

    /// The store whose shards it replicates.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
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
        // Copies whose callers went away.
        let weak = self.weak.clone();
        let stop = self.stop.clone();
        tokio::spawn(async move {
            let every = sync::SESSION_IDLE / 3;
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(every) => {}
                    _ = stop.cancelled() => return,
                }
                let Some(this) = weak.upgrade() else { return };
                let ended = this.sessions.sweep(std::time::Instant::now());
                if ended > 0 {
                    tracing::info!(ended, "copy sessions idle too long ended");
                }
            }
        });
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

    /// The longest a Push may wait for a replica that stopped confirming
    /// before it is acknowledged: `replica_timeout_ms` when Pushes wait
    /// for the replicas, zero when they do not (told to clients in every
    /// Push answer, `PushResponse.replica_wait_ms`).
    pub fn replica_wait(&self) -> std::time::Duration {
        match self.ack {
            AckMode::Replicas => self.replica_timeout,
            AckMode::Primary => std::time::Duration::ZERO,
        }
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
                    attachment: 0,
                    detached: false,
                    counted: false,
                    acked_alone_through: 0,
                })
            })
            .collect()
    }
}
