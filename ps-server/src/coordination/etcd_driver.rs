//! The etcd coordination of one server: its lease and membership, the
//! watch of every shard's primary key, and the [`Election`] of each hosted
//! shard, whose actions it carries out.
//!
//! A *session* is one lease: granted, registered as a member, renewed
//! every tenth of its TTL on a thread of its own (each renewal that comes
//! back moves the fence; see [`super::fence`]). When the lease is lost (etcd says it expired, or
//! no renewal came back for a whole TTL, so it must be presumed expired)
//! every shard stands down and a new session starts; nothing else ends a
//! session (a read or watch that fails is tried again while the lease
//! holds). On shutdown the
//! shards it leads stop taking Pushes, their queues drain to the replicas,
//! and the keys and the lease are given up at once.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_coord::{
    CoordError, CoordinatorConfig, EtcdCoordinator, LeaseKeepAlive, MemberRecord, PrimaryRecord,
};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::election::{Action, Election, Phase};
use crate::config::PsServerConfig;
use crate::fence::Fence;
use crate::replication::{Patience, Replication};

/// Something a spawned task finished.
#[derive(Debug)]
enum Done {
    Campaign(u32, Result<Option<u64>, ()>),
    Recovered(u32, u64, bool),
}

/// The etcd coordination of one server (module docs).
#[derive(Debug)]
pub(super) struct Driver {
    /// The shard map as read when joining it (`None`: not read).
    joined: Option<tessera_coord::ShardMap>,
    coord: EtcdCoordinator,
    replication: Arc<Replication>,
    fence: Arc<Fence>,
    config: CoordinatorConfig,
    member: MemberRecord,
    elections: HashMap<u32, Election>,
    shutdown_grace: Duration,
}

impl Driver {
    pub async fn new(
        config: &PsServerConfig,
        replication: Arc<Replication>,
        fence: Arc<Fence>,
    ) -> Result<Self, CoordError> {
        let coord = EtcdCoordinator::connect(&config.coordinator).await?;
        // A server whose shard count disagrees with the cluster's map
        // does not start; one that cannot read the map now (etcd not up
        // yet) starts as before, unchecked, and says so: its sessions wait
        // for etcd anyway.
        let joined = match coord
            .join_shard_map(config.num_shards, &config.shards)
            .await
        {
            Ok(map) => {
                tracing::info!(
                    num_shards = map.num_shards,
                    version = map.version,
                    "joined the cluster's shard map"
                );
                Some(map)
            }
            Err(
                err @ (CoordError::ShardCount { .. }
                | CoordError::ShrinkInProgress { .. }
                | CoordError::GrowthInProgress { .. }),
            ) => return Err(err),
            Err(err) => {
                tracing::warn!(
                    %err,
                    "the cluster's shard map could not be read at start; this server's num_shards is not checked against it"
                );
                None
            }
        };
        let timeout = Duration::from_millis(config.coordinator.failover_timeout_ms);
        let me = config.advertised().to_owned();
        let elections = config
            .shards
            .iter()
            .map(|&shard| {
                (
                    shard,
                    Election::new(me.clone(), config.is_primary(shard), timeout),
                )
            })
            .collect();
        Ok(Self {
            joined,
            coord,
            replication,
            fence,
            config: config.coordinator.clone(),
            member: MemberRecord {
                address: me,
                replica_group: config.replica_group,
                shards: config.shards.clone(),
            },
            elections,
            shutdown_grace: Duration::from_millis(config.replication.replica_timeout_ms),
        })
    }

    /// The shard map as read when joining it.
    pub fn joined(&self) -> Option<&tessera_coord::ShardMap> {
        self.joined.as_ref()
    }

    /// Its client of the cluster's etcd.
    pub fn coordinator(&self) -> &EtcdCoordinator {
        &self.coord
    }

    fn failover_timeout(&self) -> Duration {
        Duration::from_millis(self.config.failover_timeout_ms)
    }

    /// Runs sessions until `stop`, then hands over.
    pub async fn run(mut self, stop: CancellationToken) {
        let mut backoff = Duration::from_millis(100);
        while !stop.is_cancelled() {
            match self.session(&stop).await {
                Ok(()) => return,
                Err(err) => {
                    tracing::warn!(%err, "coordinator session ended; starting a new one");
                    for election in self.elections.values_mut() {
                        election.handle_lease_lost();
                    }
                    self.fence.lost();
                    self.act(None, &mpsc::unbounded_channel().0);
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = stop.cancelled() => return,
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
            }
        }
    }

    /// One lease: returns `Ok` after a clean handover on `stop`, an error
    /// when the lease is lost.
    async fn session(&mut self, stop: &CancellationToken) -> Result<(), CoordError> {
        let sent_at = Instant::now();
        let wanted = self.config.lease_ttl_secs();
        let (lease, ttl) = self.coord.grant_lease(wanted).await?;
        if ttl > Duration::from_secs(wanted.max(0) as u64) {
            tracing::warn!(wanted_s = wanted, granted = ?ttl, "etcd granted a longer lease than asked for (its minimum TTL): failovers take longer than coordinator.failover_timeout_ms");
        }
        self.fence.renewed(sent_at, ttl);
        self.coord.register(&self.member, lease).await?;
        self.replication
            .set_in_step_writer(crate::replication::InStepWriter {
                coord: self.coord.clone(),
                lease,
            });
        tracing::info!(lease = format!("{lease:#x}"), ttl = ?ttl, "coordinator session started");
        let (lost_tx, mut lost_rx) = oneshot::channel();
        let keeper = Keeper::start(
            self.config.clone(),
            lease,
            ttl,
            sent_at,
            Arc::clone(&self.fence),
            lost_tx,
        );
        let (done_tx, mut done_rx) = mpsc::unbounded_channel();
        let mut backoff = Duration::from_millis(50);
        loop {
            // Where every shard's primary stands, then what changes. A
            // failure to read them is not a lost lease: while the keeper
            // renews it, this server still holds its shards, and reads
            // again (etcd electing a leader, or a member gone, fails a
            // read for a moment; standing down for it moved every shard).
            let attempt = async {
                let (primaries, revision) = self.coord.primaries().await?;
                let watch = self.coord.watch_primaries(revision + 1).await?;
                Ok::<_, CoordError>((primaries, watch))
            };
            let (primaries, mut watch) = match attempt.await {
                Ok(found) => found,
                Err(err) => {
                    tracing::info!(%err, "cannot read the primaries; reading again while the lease holds");
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = &mut lost_rx => return Err(CoordError::LeaseExpired(lease)),
                        _ = stop.cancelled() => {
                            self.hand_over(lease).await;
                            drop(keeper);
                            return Ok(());
                        }
                    }
                    backoff = (backoff * 2).min(Duration::from_millis(500));
                    continue;
                }
            };
            backoff = Duration::from_millis(50);
            let now = Instant::now();
            for (&shard, election) in &mut self.elections {
                let found = primaries.get(&shard);
                observe(election, &self.replication, shard, now, found, lease);
            }
            loop {
                self.act(Some(lease), &done_tx);
                let next = self
                    .elections
                    .values()
                    .filter_map(Election::poll_timeout)
                    .min();
                let sleep = async {
                    match next {
                        Some(at) => tokio::time::sleep_until(at.into()).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    changes = watch.next() => match changes {
                        Ok(changes) => {
                            let now = Instant::now();
                            for change in changes {
                                if let Some(election) = self.elections.get_mut(&change.shard) {
                                    observe(election, &self.replication, change.shard, now, change.primary.as_ref(), lease);
                                }
                            }
                        }
                        Err(err) => {
                            tracing::info!(%err, "primary watch broke; reading the primaries again");
                            break;
                        }
                    },
                    Some(done) = done_rx.recv() => {
                        let now = Instant::now();
                        match done {
                            Done::Campaign(shard, result) => {
                                if let Some(e) = self.elections.get_mut(&shard) {
                                    e.handle_campaign(now, result);
                                }
                            }
                            Done::Recovered(shard, epoch, ok) => {
                                if let Some(e) = self.elections.get_mut(&shard)
                                    && e.phase() == &(Phase::Recovering { epoch })
                                {
                                    e.handle_recovered(now, ok);
                                }
                            }
                        }
                    }
                    _ = sleep => {}
                    _ = &mut lost_rx => return Err(CoordError::LeaseExpired(lease)),
                    _ = stop.cancelled() => {
                        self.hand_over(lease).await;
                        drop(keeper);
                        return Ok(());
                    }
                }
            }
        }
    }

    /// Carries out every pending action; with no `lease`, only those that
    /// need none (standing down).
    fn act(&mut self, lease: Option<i64>, done: &mpsc::UnboundedSender<Done>) {
        let now = Instant::now();
        let shards: Vec<u32> = self.elections.keys().copied().collect();
        for shard in shards {
            while let Some(action) = self
                .elections
                .get_mut(&shard)
                .and_then(|e| e.poll_action(now))
            {
                self.perform(shard, action, lease, done);
            }
        }
    }

    fn perform(
        &mut self,
        shard: u32,
        action: Action,
        lease: Option<i64>,
        done: &mpsc::UnboundedSender<Done>,
    ) {
        let replication = &self.replication;
        match action {
            Action::Follow { primary, epoch } => replication.follow(shard, &primary, epoch),
            Action::StandDown => replication.stand_down(shard),
            Action::Lead { epoch } => {
                if let Err(err) = replication.lead(shard, epoch) {
                    // A newer primary exists; the watch will show it.
                    tracing::warn!(shard, epoch, %err, "not taking the shard over");
                }
            }
            Action::Campaign => {
                let Some(lease) = lease else {
                    let _ = done.send(Done::Campaign(shard, Err(())));
                    return;
                };
                let floor = replication
                    .known_epoch(shard)
                    .max(replication.store_version(shard).epoch);
                let (coord, done) = (self.coord.clone(), done.clone());
                let (me, group) = (self.member.address.clone(), self.member.replica_group);
                tokio::spawn(async move {
                    let result = coord.campaign(shard, &me, group, lease, floor).await;
                    if let Err(err) = &result {
                        tracing::info!(shard, %err, "campaign failed");
                    }
                    let _ = done.send(Done::Campaign(shard, result.map_err(|_| ())));
                });
            }
            Action::Recover { epoch } => {
                replication.begin_recovery(shard, epoch);
                let (coord, done, replication) =
                    (self.coord.clone(), done.clone(), Arc::clone(replication));
                let patience = self.failover_timeout();
                tokio::spawn(async move {
                    // The live servers of the shard: configured peers that
                    // hold a lease now.
                    let peers = replication.peers_of(shard);
                    let servers = match coord.members().await {
                        Ok(members) => peers
                            .into_iter()
                            .filter(|p| members.iter().any(|m| &m.address == p))
                            .collect(),
                        Err(_) => peers,
                    };
                    let deadline = Instant::now() + patience;
                    // Which copies hold every acknowledged Push: without
                    // knowing, no copy may lead.
                    let in_step = match coord.in_step(shard).await {
                        Ok(record) => record,
                        Err(err) => {
                            tracing::warn!(shard, epoch, %err, "cannot read the shard's in-step record; resigning");
                            let _ = done.send(Done::Recovered(shard, epoch, false));
                            return;
                        }
                    };
                    let recovered = replication
                        .recover(shard, &servers, Patience::Until(deadline), in_step.as_ref())
                        .await;
                    // The fence of a resize's cut-over that the last
                    // primary acted on (its fenced delta may have opened
                    // a receiving shard already) must stand here before
                    // a Push is taken: the map read now, after the lead
                    // was won, names every cut-over it saw.
                    let recovered = match recovered {
                        Ok(r) => match resize_state_caught_up(
                            &coord,
                            replication.store(),
                            Instant::now() + patience,
                        )
                        .await
                        {
                            Ok(()) => Ok(r),
                            Err(why) => {
                                tracing::warn!(
                                    shard,
                                    epoch,
                                    why,
                                    "the resize state is behind the shard map; resigning"
                                );
                                metrics::counter!("tessera_ps_promotions_waited_out_total")
                                    .increment(1);
                                let _ = done.send(Done::Recovered(shard, epoch, false));
                                return;
                            }
                        },
                        Err(err) => Err(err),
                    };
                    let ok = match recovered {
                        Ok(recovered) => {
                            if recovered.lost > 0 {
                                metrics::counter!("tessera_ps_failover_lost_pushes_total")
                                    .increment(recovered.lost);
                                tracing::warn!(
                                    shard,
                                    epoch,
                                    lost = recovered.lost,
                                    "the old primary had applied pushes that no live replica holds; they are lost"
                                );
                            }
                            tracing::info!(shard, epoch, version = %recovered.version, "promoted");
                            true
                        }
                        Err(err) => {
                            tracing::warn!(shard, epoch, %err, "recovery failed; resigning");
                            false
                        }
                    };
                    let _ = done.send(Done::Recovered(shard, epoch, ok));
                });
            }
            Action::Resign => {
                if let Some(lease) = lease {
                    let coord = self.coord.clone();
                    let patience = self.failover_timeout();
                    tokio::spawn(async move {
                        // Until etcd takes it: a key left on a live lease
                        // would keep the shard without a primary. (The next
                        // campaign of this server finds it its own, too.)
                        let started = Instant::now();
                        let mut backoff = Duration::from_millis(50);
                        while let Err(err) = coord.resign(shard, lease).await {
                            if started.elapsed() > patience * 3 {
                                tracing::warn!(shard, %err, "cannot give the shard up; campaigning finds the key this server's own");
                                return;
                            }
                            tokio::time::sleep(backoff).await;
                            backoff = (backoff * 2).min(Duration::from_secs(1));
                        }
                    });
                }
            }
        }
    }

    /// Stops leading, lets the queues reach the replicas, gives up the
    /// keys and the lease.
    ///
    /// The keys go by revoking the lease, not by resigning each shard and
    /// then revoking: a revocation deletes every key on the lease (the
    /// primary keys of the shards led here and this server's member record)
    /// in one etcd revision. Resigning first let a replica see the key go,
    /// win the shard and read the member list before the revocation landed:
    /// its recovery then counted this stopping server as live and waited
    /// its whole failover timeout for an answer (seen as a 2.2 s handover
    /// on a loaded machine, against about 1 s). A revocation that fails is
    /// tried again within the shutdown grace; after that the replicas take
    /// over when the lease expires.
    async fn hand_over(&mut self, lease: i64) {
        let led: Vec<u32> = self
            .elections
            .iter()
            .filter(|(_, e)| matches!(e.phase(), Phase::Leading { .. } | Phase::Recovering { .. }))
            .map(|(&s, _)| s)
            .collect();
        for &shard in &led {
            self.replication.stand_down_for_handover(shard);
        }
        self.replication.drain(self.shutdown_grace).await;
        let deadline = Instant::now() + self.shutdown_grace;
        let mut backoff = Duration::from_millis(20);
        loop {
            match self.coord.revoke_lease(lease).await {
                Ok(()) => {
                    tracing::info!(shards = ?led, "handed the shards over");
                    break;
                }
                Err(err) if Instant::now() + backoff < deadline => {
                    tracing::info!(%err, "revoking the lease failed; trying again");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_millis(500));
                }
                Err(err) => {
                    tracing::warn!(shards = ?led, %err, "cannot revoke the lease: the replicas take these shards over when it expires");
                    break;
                }
            }
        }
        self.fence.lost();
    }
}

/// Feeds one observation of `shard`'s key into its election.
/// Waits until `store`'s resize state (the fence of moved keys, the
/// receiving and shrink states: `crate::reshard`) was set from the shard
/// map as etcd holds it now, or `deadline`. A server whose resize
/// follower is stalled (a watch that lags, a long drop of an earlier
/// growth's rows) does not lead until it caught up: as primary it could
/// otherwise take a Push to a key its old primary fenced, whose new
/// shard already opened without it (an acknowledged Push lost). Nothing
/// to wait for without a follower (serving) or a map.
async fn resize_state_caught_up(
    coord: &EtcdCoordinator,
    store: &tessera_store::store::Store,
    deadline: Instant,
) -> Result<(), &'static str> {
    if store.resize_state_version().is_none() {
        return Ok(());
    }
    let version = match coord.shard_map().await {
        Ok(Some((map, _))) => map.version,
        Ok(None) => return Ok(()),
        Err(_) => return Err("the shard map could not be read"),
    };
    let reached = store.resize_state_reaches(version);
    if tokio::time::timeout_at(deadline.into(), reached)
        .await
        .is_ok()
    {
        Ok(())
    } else {
        Err("not caught up with the shard map within the failover timeout")
    }
}

fn observe(
    election: &mut Election,
    replication: &Replication,
    shard: u32,
    now: Instant,
    found: Option<&(PrimaryRecord, i64)>,
    lease: i64,
) {
    let in_step = replication.in_step(shard);
    match found {
        Some((record, key_lease)) => {
            election.handle_observed(now, Some(record), *key_lease == lease, in_step)
        }
        None => election.handle_observed(now, None, false, in_step),
    }
}

/// The renewal of one lease, on a thread of its own with its own runtime
/// and etcd client: whatever the data path does to the server's runtime (a
/// long copy of a shard holding a lock that Pushes wait for), renewals go
/// out on time, and the fence stays open. Stopped when dropped.
struct Keeper {
    stop: CancellationToken,
}

impl Keeper {
    fn start(
        config: CoordinatorConfig,
        lease: i64,
        ttl: Duration,
        granted_at: Instant,
        fence: Arc<Fence>,
        lost: oneshot::Sender<()>,
    ) -> Self {
        let stop = CancellationToken::new();
        let token = stop.clone();
        let spawned = std::thread::Builder::new()
            .name("tessera-lease".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => runtime,
                    Err(err) => {
                        tracing::error!(%err, "cannot start the lease keeper's runtime");
                        fence.lost();
                        let _ = lost.send(());
                        return;
                    }
                };
                runtime.block_on(async move {
                    tokio::select! {
                        _ = keep_alive(config, lease, ttl, granted_at, fence, lost) => {}
                        _ = token.cancelled() => {}
                    }
                });
            });
        if let Err(err) = spawned {
            tracing::error!(%err, "cannot start the lease keeper's thread");
        }
        Self { stop }
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Renews `lease` every tenth of `ttl` until it is lost, moving the fence
/// with every renewal that comes back; reports the loss on `lost`.
async fn keep_alive(
    config: CoordinatorConfig,
    lease: i64,
    ttl: Duration,
    granted_at: Instant,
    fence: Arc<Fence>,
    lost: oneshot::Sender<()>,
) {
    let every = (ttl / 10).max(Duration::from_millis(100));
    let mut coord: Option<EtcdCoordinator> = None;
    let mut stream: Option<LeaseKeepAlive> = None;
    let mut last_proof = granted_at;
    loop {
        tokio::time::sleep(every).await;
        let sent_at = Instant::now();
        if coord.is_none() {
            coord = EtcdCoordinator::connect(&config).await.ok();
        }
        if let Some(client) = &coord
            && stream.is_none()
        {
            match client.keep_alive(lease).await {
                Ok(opened) => stream = Some(opened),
                Err(err) => {
                    tracing::debug!(%err, "cannot open the lease keep-alive");
                    if let Ok(false) = client.lease_alive(lease).await {
                        break;
                    }
                }
            }
        }
        if let Some(open) = &mut stream {
            match open.renew().await {
                Ok(granted) => {
                    fence.renewed(sent_at, granted);
                    last_proof = sent_at;
                }
                Err(CoordError::LeaseExpired(_)) => break,
                Err(err) => {
                    tracing::debug!(%err, "lease renewal failed");
                    stream = None;
                }
            }
        }
        if last_proof.elapsed() >= ttl {
            // No renewal came back for a whole TTL: etcd must be presumed
            // to have expired it.
            break;
        }
    }
    fence.lost();
    tracing::warn!(lease = format!("{lease:#x}"), "lease lost");
    let _ = lost.send(());
}
