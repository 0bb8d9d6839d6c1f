//! Who is the primary of each hosted shard, decided by the configured
//! coordinator and carried out by the replication layer
//! ([`crate::replication`]).
//!
//! - **static** (`coordinator.kind = "static"`, `fixed`): shard `s`'s
//!   primary is the server of replica group `s % replica_groups`, always.
//!   At start it recovers the freshest copy from the shard's replicas,
//!   waiting for every one of them, and takes the next epoch; the others
//!   follow it. Nothing fails over: when the primary is down, its shard
//!   takes no Pushes (Fetches go on at the replicas) until it is back. For
//!   one host's development.
//! - **etcd** (`coordinator.kind = "etcd"`, `etcd_driver`): every server
//!   holds a lease (TTL `failover_timeout_ms` less one second) and
//!   registers as a member;
//!   each shard's primary holds the shard's primary key on its lease, and
//!   its epoch comes from etcd. When the key disappears, one replica wins
//!   the campaign for it, recovers and leads; the old primary is fenced
//!   ([`crate::fence`]) and, when it comes back, follows the new one. See
//!   [`election`] for one server's part in it and `tessera_coord` for why
//!   etcd. The server also follows the cluster's shard map
//!   (`tessera_coord::shard_map`, a watch of its key) and reports it in
//!   Health: the count keys are routed by and the resize in progress.

pub mod election;
mod etcd_driver;
mod fixed;

use std::sync::Arc;
use std::time::Duration;

pub use crate::fence::{Fence, FenceCore};
use tessera_coord::{CoordError, CoordinatorKind, ShardMap};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use crate::config::PsServerConfig;
use crate::replication::Replication;

/// The fence a server's primaries take Pushes behind: always open in
/// static mode; with etcd, open while the lease is proven, closing a
/// tenth of the TTL (at most 500 ms) before it could expire.
pub fn fence_for(config: &PsServerConfig) -> Arc<Fence> {
    Arc::new(Fence::new(match config.coordinator.kind {
        CoordinatorKind::Static => FenceCore::always_open(),
        CoordinatorKind::Etcd => {
            let ttl = Duration::from_secs(config.coordinator.lease_ttl_secs() as u64);
            FenceCore::leased((ttl / 10).min(Duration::from_millis(500)))
        }
    }))
}

/// A server's coordination, prepared ([`Coordination::prepare`]) and then
/// running ([`Coordination::start`]).
#[derive(Debug)]
pub struct Coordination {
    plan: Plan,
    stop: CancellationToken,
    /// Aborted when dropped: a server dropped without a shutdown (a crash,
    /// in tests) stops renewing its lease.
    task: Option<AbortOnDropHandle<()>>,
    /// The cluster's shard map as last read (always `None` in static
    /// mode), and its follower (etcd mode, once started).
    shard_map: watch::Receiver<Option<ShardMap>>,
    map_task: Option<AbortOnDropHandle<()>>,
    /// A client of the cluster's etcd (etcd mode).
    etcd: Option<tessera_coord::EtcdCoordinator>,
}

/// How soon a failed read or watch of the shard map is tried again.
const MAP_RETRY: Duration = Duration::from_millis(500);

#[derive(Debug)]
enum Plan {
    /// Static mode: the shards left to recover.
    Fixed(Vec<u32>),
    Etcd(
        Option<Box<etcd_driver::Driver>>,
        Option<watch::Sender<Option<ShardMap>>>,
    ),
}

impl Coordination {
    /// Prepares the coordination of `replication`'s shards as `config`
    /// says. In static mode the fixed roles are given at once (so a server
    /// without replicas takes Pushes as soon as it listens).
    pub async fn prepare(
        config: &PsServerConfig,
        replication: &Arc<Replication>,
        fence: Arc<Fence>,
    ) -> Result<Self, CoordError> {
        let (map_tx, shard_map) = watch::channel(None);
        let mut etcd = None;
        let plan = match config.coordinator.kind {
            CoordinatorKind::Static => Plan::Fixed(fixed::assign(config, replication)),
            CoordinatorKind::Etcd => {
                let driver =
                    etcd_driver::Driver::new(config, Arc::clone(replication), fence).await?;
                etcd = Some(driver.coordinator().clone());
                // Known from the start (the watch follows from `start`).
                map_tx.send_replace(driver.joined().cloned());
                Plan::Etcd(Some(Box::new(driver)), Some(map_tx))
            }
        };
        Ok(Self {
            plan,
            stop: CancellationToken::new(),
            task: None,
            shard_map,
            map_task: None,
            etcd,
        })
    }

    /// A client of the cluster's etcd (etcd mode only).
    pub fn etcd(&self) -> Option<tessera_coord::EtcdCoordinator> {
        self.etcd.clone()
    }

    /// The cluster's shard map as this server last read it (`None` in
    /// static mode, and until the first read).
    pub fn shard_map(&self) -> watch::Receiver<Option<ShardMap>> {
        self.shard_map.clone()
    }

    /// Starts it (once the server serves: recoveries ask its peers, who
    /// ask it back).
    pub fn start(&mut self, replication: &Arc<Replication>) {
        if self.task.is_some() {
            return;
        }
        let stop = self.stop.clone();
        self.task = Some(AbortOnDropHandle::new(match &mut self.plan {
            Plan::Fixed(shards) => tokio::spawn(fixed::run(
                std::mem::take(shards),
                Arc::clone(replication),
                stop,
            )),
            Plan::Etcd(driver, map_tx) => match driver.take() {
                Some(driver) => {
                    if let Some(map_tx) = map_tx.take() {
                        let coord = driver.coordinator().clone();
                        self.map_task = Some(AbortOnDropHandle::new(tokio::spawn(async move {
                            coord.follow_shard_map(map_tx, MAP_RETRY).await;
                        })));
                    }
                    tokio::spawn(driver.run(stop))
                }
                None => return,
            },
        }));
    }

    /// Hands over cleanly: with etcd, the shards this server leads stop
    /// taking Pushes, their queued Pushes reach the replicas, and the
    /// primary keys and the lease are given up at once (a replica takes
    /// over in milliseconds instead of a lease time). Bounded by `within`.
    pub async fn shutdown(self, within: Duration) {
        self.stop.cancel();
        let Some(mut task) = self.task else { return };
        // Dropping the handle aborts the task if it is not done by then.
        let _ = tokio::time::timeout(within, &mut task).await;
    }
}
