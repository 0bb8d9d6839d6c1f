//! What the worker routes keys by: the cluster's shard count and each
//! shard's Fetch path, and how both follow a resize of the shard count
//! (issue 39; the servers' side is `tessera_coord::shard_map`).
//!
//! A worker starts from its configuration. In etcd mode it also follows
//! the cluster's shard map (the coordinator's watch of one key): when a
//! resize cuts over to more shards, it reads the servers of the new
//! shards from the members etcd lists (every server registers its
//! address, replica group and shards) and their primaries, adds a Fetch
//! path for each new shard ([`Routing::resize`]) and the new shards to its
//! Push path ([`crate::primary::Primaries::grow`]), and routes by the new
//! count from then on. A server that moved keys away answers a request
//! for them `ABORTED` with a `KeysMoved`; the client then waits (within
//! the call's time) until it routes by that count and sends the request
//! again, split anew ([`moved`], `client.rs`). Requests split by the old
//! count and retried across the cut-over are applied exactly once: the
//! servers keep the old shards' deduplication windows at the cut-over
//! (`store/src/store/resize.rs`).
//!
//! A shrink is followed the same way: once every remaining shard serves
//! the keys it received, the worker drops the Fetch and Push paths of the
//! shards given away and routes by the smaller count; a remaining shard
//! answers a Push part split by the old count after it opened with a
//! `KeysMoved` too, and the Push goes again, split anew.
//!
//! A resize cancelled after its cut-over lifts its fences with the same
//! count: a worker that sees the cancel before the refusing server does
//! sends the request again after short, doubling pauses
//! ([`LiftBackoff`]) until the server follows, within the call's time.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use prost::Message as _;
use tessera_coord::{CoordinatorConfig, EtcdCoordinator, MemberRecord, ResizeState, ShardMap};
use tessera_proto::v1::{KeysMoved, ParameterServerClient};
use tessera_rpc::sync::LockExt;
use tessera_rpc::{
    Channel, ChannelConfig, Code, ReplicaEndpoint, ReplicaSet, ReplicaSetConfig, RpcError,
    Transport,
};

use crate::config::WorkerConfig;
use crate::primary::Primaries;

/// The shard count and each shard's Fetch path, as routed by now.
#[derive(Debug)]
pub struct Layout {
    /// The shard count keys are split by.
    pub num_shards: u32,
    /// `fetchers[shard]`: the shard's replica set.
    pub fetchers: Vec<ParameterServerClient>,
}

/// What a request refused at a fence saw while it waited
/// ([`Routing::wait_for_change`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waited {
    /// Keys are routed by another count now: split the request anew.
    Resplit,
    /// The map lifted the fence (its resize was cancelled) and the count
    /// is the same: the server that refused may not have seen the cancel
    /// yet, so the request goes again after a pause ([`LiftBackoff`]).
    Lifted,
    /// Neither within the time given.
    TimedOut,
}

/// The pauses of a request that goes again to a server still holding a
/// fence its map lifted: the server follows the same map a moment later
/// (its resize loop lifts the fence when it sees the cancel), so the
/// pauses start short and double to a cap, and the caller's deadline
/// bounds them, not a count.
#[derive(Debug)]
pub struct LiftBackoff {
    next: Duration,
}

impl LiftBackoff {
    const FIRST: Duration = Duration::from_millis(10);
    const CAP: Duration = Duration::from_millis(500);

    /// The first pause is the shortest.
    pub fn new() -> Self {
        Self { next: Self::FIRST }
    }

    /// The next pause, at most `left`.
    pub fn next(&mut self, left: Duration) -> Duration {
        let pause = self.next.min(left);
        self.next = (self.next * 2).min(Self::CAP);
        pause
    }
}

impl Default for LiftBackoff {
    fn default() -> Self {
        Self::new()
    }
}

/// The worker's routing (module docs).
pub struct Routing {
    layout: RwLock<Arc<Layout>>,
    /// The shard count routed by, for waiters ([`Routing::wait_for_change`]).
    count: tokio::sync::watch::Sender<u32>,
    /// The version of the last shard map seen with no resize past its
    /// cut-over and unfinished (none, done, or cancelled): a request
    /// refused at a fence set at an earlier version waits no more once
    /// this passes it (a resize cancelled after its cut-over lifts its
    /// fence, and the count does not change).
    settled: tokio::sync::watch::Sender<u64>,
    primaries: Arc<Primaries>,
    config: WorkerConfig,
    channel_config: ChannelConfig,
    transport: Transport,
    /// One channel per server, shared by every shard it hosts.
    channels: Mutex<HashMap<String, Channel>>,
}

impl std::fmt::Debug for Routing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Routing")
            .field("layout", &self.layout)
            .finish_non_exhaustive()
    }
}

impl Routing {
    /// Routing by `config`'s shard count over `fetchers` (one per shard)
    /// and `primaries`; a grown cluster's new shards are reached over
    /// `transport` with `channel_config`, through `channels` (the
    /// configured servers').
    pub fn new(
        config: &WorkerConfig,
        fetchers: Vec<ParameterServerClient>,
        primaries: Arc<Primaries>,
        channel_config: ChannelConfig,
        transport: Transport,
        channels: HashMap<String, Channel>,
    ) -> Self {
        Self {
            layout: RwLock::new(Arc::new(Layout {
                num_shards: config.num_shards,
                fetchers,
            })),
            count: tokio::sync::watch::Sender::new(config.num_shards),
            settled: tokio::sync::watch::Sender::new(0),
            primaries,
            config: config.clone(),
            channel_config,
            transport,
            channels: Mutex::new(channels),
        }
    }

    /// The layout routed by now.
    pub fn layout(&self) -> Arc<Layout> {
        Arc::clone(
            &self
                .layout
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    /// Routes by `num_shards` from now on: a grown cluster's new shards
    /// are reached through the servers `members` lists for them; a shrunk
    /// cluster's shards beyond it are forgotten. Returns whether it
    /// changed: not for the count it routes by already, nor while a new
    /// shard has no server listed (the next look tries again).
    pub fn resize(&self, num_shards: u32, members: &[MemberRecord]) -> bool {
        let now = self.layout();
        if num_shards == now.num_shards || num_shards == 0 {
            return false;
        }
        if num_shards < now.num_shards {
            let mut fetchers = now.fetchers.clone();
            fetchers.truncate(num_shards as usize);
            self.primaries.truncate(num_shards as usize);
            self.route_by(num_shards, fetchers);
            tracing::info!(
                num_shards,
                "the cluster shrank: keys are routed by the new shard count"
            );
            return true;
        }
        // The servers of each new shard, own replica group first, then by
        // group and address (as a configuration lists them).
        let mut hosts: BTreeMap<u32, Vec<&MemberRecord>> = BTreeMap::new();
        for member in members {
            for &shard in &member.shards {
                if (now.num_shards..num_shards).contains(&shard) {
                    hosts.entry(shard).or_default().push(member);
                }
            }
        }
        if (now.num_shards..num_shards).any(|s| !hosts.contains_key(&s)) {
            tracing::info!(
                num_shards,
                "a new shard has no server registered yet; routing stays as it is for now"
            );
            return false;
        }
        let mut fetchers = now.fetchers.clone();
        let mut all_hosts: Vec<Vec<String>> = vec![Vec::new(); now.num_shards as usize];
        for (_, mut servers) in hosts {
            servers.sort_by_key(|m| (m.replica_group, m.address.clone()));
            all_hosts.push(servers.iter().map(|m| m.address.clone()).collect());
            fetchers.push(self.fetcher(&servers));
        }
        self.primaries.grow(all_hosts);
        self.route_by(num_shards, fetchers);
        tracing::info!(
            num_shards,
            "the cluster grew: keys are routed by the new shard count"
        );
        true
    }

    /// Routes by `num_shards` over `fetchers` from now on, and wakes the
    /// requests waiting for a change.
    fn route_by(&self, num_shards: u32, fetchers: Vec<ParameterServerClient>) {
        *self
            .layout
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(Layout {
            num_shards,
            fetchers,
        });
        self.count.send_replace(num_shards);
    }

    /// The Fetch path of a new shard over `servers`.
    fn fetcher(&self, servers: &[&MemberRecord]) -> ParameterServerClient {
        let mut channels = self.channels.locked();
        let (replicas, channels): (Vec<_>, Vec<_>) = servers
            .iter()
            .map(|m| {
                let channel = channels
                    .entry(m.address.clone())
                    .or_insert_with(|| {
                        Channel::with_transport(
                            &m.address,
                            self.channel_config.clone(),
                            self.transport.clone(),
                        )
                    })
                    .clone();
                (
                    ReplicaEndpoint {
                        addr: m.address.clone(),
                        domain: m.replica_group.to_string(),
                    },
                    channel,
                )
            })
            .unzip();
        ParameterServerClient::new(ReplicaSet::over_channels(
            replica_set_config(&self.config, &self.channel_config, replicas),
            channels,
            self.transport.clone(),
        ))
    }

    /// Waits until keys are routed by another count than `num_shards`
    /// (a resize reached this worker), or a map later than `fenced_at`
    /// (the version of the fence a request ran into) has no resize under
    /// way past its cut-over (it was cancelled: the fence is lifted), for
    /// at most `within`, and says which.
    pub async fn wait_for_change(
        &self,
        num_shards: u32,
        fenced_at: u64,
        within: Duration,
    ) -> Waited {
        let mut count = self.count.subscribe();
        let mut settled = self.settled.subscribe();
        let changed = async {
            tokio::select! {
                r = count.wait_for(|&n| n != num_shards) => r.is_ok(),
                r = settled.wait_for(|&v| fenced_at > 0 && v > fenced_at) => r.is_ok(),
            }
        };
        match tokio::time::timeout(within, changed).await {
            Ok(true) if *self.count.borrow() != num_shards => Waited::Resplit,
            Ok(true) => Waited::Lifted,
            Ok(false) | Err(_) => Waited::TimedOut,
        }
    }

    /// Calls waiting in [`Routing::wait_for_change`] now.
    pub fn waiting_for_change(&self) -> usize {
        self.settled.receiver_count()
    }

    /// Notes shard map `map` as followed ([`Routing::wait_for_change`]).
    fn note_map(&self, map: &ShardMap) {
        let under_way = map
            .resize
            .as_ref()
            .is_some_and(|r| r.state == ResizeState::CutOver);
        if !under_way {
            self.settled.send_if_modified(|v| {
                let newer = map.version > *v;
                if newer {
                    *v = map.version;
                }
                newer
            });
        }
    }
}

/// The replica-set settings of the worker's configuration for `replicas`.
pub fn replica_set_config(
    config: &WorkerConfig,
    channel: &ChannelConfig,
    replicas: Vec<ReplicaEndpoint>,
) -> ReplicaSetConfig {
    ReplicaSetConfig {
        replicas,
        local_domain: config
            .replica_group
            .map(|g| g.to_string())
            .unwrap_or_default(),
        call_timeout_ms: config.call_timeout_ms,
        channel: channel.clone(),
        retry: config.retry,
        budget: config.budget,
        quarantine: config.quarantine,
        seed: None,
    }
}

/// The `KeysMoved` of a server's refusal: the keys asked for moved to
/// another shard in a resize (`None`: another error).
pub fn moved(error: &RpcError) -> Option<KeysMoved> {
    match error {
        // A count of 0 is no `KeysMoved` (an ABORTED without details
        // decodes as one).
        RpcError::Status(status) if status.code() == Code::Aborted => {
            KeysMoved::decode(status.details().clone())
                .ok()
                .filter(|m| m.num_shards > 0)
        }
        _ => None,
    }
}

/// Follows the cluster's shard map in etcd until the returned task is
/// dropped (aborted): each map that routes by another count resizes
/// `routing`, a grown cluster's new shards' servers and primaries read
/// from etcd.
pub fn follow(routing: Arc<Routing>, config: CoordinatorConfig) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut backoff = Duration::from_millis(100);
        loop {
            if let Err(err) = follow_once(&routing, &config).await {
                tracing::info!(%err, "following the shard map failed; trying again");
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    })
}

/// The count to route by as `map` says: its count once every receiving
/// shard of a resize serves (a growth's new shards open about one delta
/// interval after the cut-over; until then the old shards still serve the
/// moved keys' Fetches, and their Pushes wait for the opening), the
/// count before it meanwhile.
fn routed_count(map: &ShardMap) -> u32 {
    match map.resize.as_ref() {
        Some(r)
            if r.state == ResizeState::CutOver
                && r.receiving().any(|s| !r.opened.contains_key(&s)) =>
        {
            r.from
        }
        _ => map.num_shards,
    }
}

async fn follow_once(
    routing: &Routing,
    config: &CoordinatorConfig,
) -> Result<(), tessera_coord::CoordError> {
    let coord = EtcdCoordinator::connect(config).await?;
    let (tx, mut maps) = tokio::sync::watch::channel::<Option<ShardMap>>(None);
    let follow = coord.follow_shard_map(tx, Duration::from_millis(500));
    tokio::pin!(follow);
    // A map whose count is not routed by yet (a new shard's servers not
    // registered), looked at again each second.
    let mut pending: Option<u32> = None;
    loop {
        tokio::select! {
            () = &mut follow => return Ok(()),
            changed = maps.changed() => {
                if changed.is_err() {
                    return Ok(());
                }
                let map = maps.borrow_and_update().clone();
                if let Some(map) = &map {
                    routing.note_map(map);
                }
                pending = map.as_ref().map(routed_count);
            }
            () = tokio::time::sleep(Duration::from_secs(1)), if pending.is_some() => {}
        }
        let Some(num_shards) = pending else {
            continue;
        };
        if num_shards <= routing.layout().num_shards {
            pending = None;
            let _ = routing.resize(num_shards, &[]);
            continue;
        }
        let members = coord.members().await?;
        if routing.resize(num_shards, &members) {
            pending = None;
            let (primaries, _) = coord.primaries().await?;
            for (shard, (record, _)) in primaries {
                routing
                    .primaries
                    .learn(shard, &record.address, record.epoch);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lifted_fences_pauses_double_to_a_cap_and_never_pass_the_time_left() {
        let mut backoff = LiftBackoff::new();
        let long = Duration::from_secs(60);
        let pauses: Vec<u64> = (0..8)
            .map(|_| backoff.next(long).as_millis() as u64)
            .collect();
        assert_eq!(pauses, [10, 20, 40, 80, 160, 320, 500, 500]);
        assert_eq!(
            backoff.next(Duration::from_millis(3)),
            Duration::from_millis(3)
        );
    }
}
