//! A thin client of etcd for the operations Tessera needs.
//!
//! Every unary call is bounded by `coordinator.request_timeout_ms`; the
//! streams (lease keep-alive, watch) are watched by HTTP/2 keep-alive
//! pings, so that a coordinator that stops answering shows up as an error
//! rather than as silence.

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, GetResponse, PutOptions,
    Txn, TxnOp, WatchOptions,
};

use crate::config::CoordinatorConfig;
use crate::endpoints::Members;
use crate::keys::{InStepRecord, Keys, MemberRecord, PrimaryRecord};
use crate::shard_map::{ResizeState, ShardMap};

/// Why a coordinator operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CoordError {
    /// etcd refused the call or could not be reached.
    #[error("etcd ({endpoints}): {source}")]
    Etcd {
        /// The configured endpoints.
        endpoints: String,
        /// The client's error.
        source: etcd_client::Error,
    },
    /// etcd did not answer within `coordinator.request_timeout_ms`.
    #[error("etcd ({endpoints}) did not answer within {timeout:?}")]
    Timeout {
        /// The configured endpoints.
        endpoints: String,
        /// The timeout.
        timeout: Duration,
    },
    /// A key holds something that is not the record it should.
    #[error("etcd key {key} holds no valid record: {source}")]
    BadRecord {
        /// The key.
        key: String,
        /// Why it does not parse.
        source: serde_json::Error,
    },
    /// The lease is gone (it expired, or was revoked).
    #[error("lease {0:#x} has expired")]
    LeaseExpired(i64),
    /// The watch stream ended.
    #[error("the etcd watch ended")]
    WatchEnded,
    /// This server is configured with another shard count than the
    /// cluster's shard map says (`shard_map.rs`).
    #[error(
        "the cluster's shard map (version {version}) routes keys to {map} shards; this server is configured with num_shards = {configured}"
    )]
    ShardCount {
        /// The map's count.
        map: u32,
        /// The map's version.
        version: u64,
        /// The configured count.
        configured: u32,
    },
    /// This server is configured with the count a shrink in progress goes
    /// to: it may start once the shrink is done (until then the remaining
    /// shards' servers keep the old count).
    #[error(
        "a shrink from {from} to {to} shards is in progress; a server configured with num_shards = {to} may start once it is done (`tessera reshard` shows it)"
    )]
    ShrinkInProgress {
        /// The count before the shrink.
        from: u32,
        /// The count it goes to (this server's).
        to: u32,
    },
    /// This server hosts a shard the growth in progress takes keys from,
    /// and is configured with the growth's target count: it may start
    /// with the old count now, or with the new one once the growth is
    /// done.
    #[error(
        "a growth from {from} to {to} shards is in progress and shard {shard} gives keys in it: its servers keep num_shards = {from} until it is done (`tessera reshard` shows it)"
    )]
    GrowthInProgress {
        /// The count before the growth.
        from: u32,
        /// The count it goes to (this server's).
        to: u32,
        /// The old shard this server hosts.
        shard: u32,
    },
    /// The cluster has no shard map yet: no server of it has started in
    /// etcd mode.
    #[error(
        "cluster {cluster} has no shard map in etcd ({endpoints}): start its servers (etcd mode) first"
    )]
    NoShardMap {
        /// The cluster's name (`coordinator.cluster`).
        cluster: String,
        /// The configured endpoints.
        endpoints: String,
    },
    /// A transition of the cluster's resize was refused in the state
    /// the map is in.
    #[error(transparent)]
    Resize(#[from] crate::shard_map::ResizeError),
}

/// A change of one shard's primary, as a watch reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrimaryChange {
    /// The shard.
    pub shard: u32,
    /// Its primary now, and the lease its key is on (`None`: the key was
    /// deleted; no primary).
    pub primary: Option<(PrimaryRecord, i64)>,
}

/// A client of the etcd that coordinates one cluster.
#[derive(Clone)]
pub struct EtcdCoordinator {
    members: Members,
    keys: Keys,
    endpoints: String,
    timeout: Duration,
}

impl std::fmt::Debug for EtcdCoordinator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdCoordinator")
            .field("endpoints", &self.endpoints)
            .field("keys", &self.keys)
            .finish_non_exhaustive()
    }
}

impl EtcdCoordinator {
    /// A client of the etcd `config` names. Connections are made as calls
    /// need them.
    pub async fn connect(config: &CoordinatorConfig) -> Result<Self, CoordError> {
        let endpoints = config.endpoints.join(",");
        let timeout = Duration::from_millis(config.request_timeout_ms);
        let urls: Vec<String> = config
            .endpoints
            .iter()
            .map(|e| {
                if e.contains("://") {
                    e.clone()
                } else {
                    format!("http://{e}")
                }
            })
            .collect();
        let options = ConnectOptions::new()
            .with_connect_timeout(timeout)
            // A stream through a dead path errors within two seconds.
            .with_keep_alive(Duration::from_secs(1), Duration::from_secs(1))
            .with_keep_alive_while_idle(true);
        let members = Members::connect(&urls, endpoints.clone(), timeout, options).await?;
        Ok(Self {
            members,
            keys: Keys::new(&config.cluster),
            endpoints,
            timeout,
        })
    }

    /// The cluster's keys.
    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// Runs `call` on a member that answers ([`Members::call`]).
    async fn call<T, F, Fut>(&self, call: F) -> Result<T, CoordError>
    where
        F: Fn(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        self.members.call(call).await
    }

    /// Runs the transaction `txn`.
    async fn txn(&self, txn: Txn) -> Result<etcd_client::TxnResponse, CoordError> {
        self.call(|mut c| {
            let txn = txn.clone();
            async move { c.txn(txn).await }
        })
        .await
    }

    /// Reads `key` (every key under it with `prefix`).
    async fn get(&self, key: &str, prefix: bool) -> Result<GetResponse, CoordError> {
        self.call(|mut c| {
            let options = prefix.then(|| GetOptions::new().with_prefix());
            let key = key.to_owned();
            async move { c.get(key, options).await }
        })
        .await
    }

    /// A new lease of `ttl_secs`; returns its id and the TTL etcd granted
    /// (it raises TTLs below its minimum).
    pub async fn grant_lease(&self, ttl_secs: i64) -> Result<(i64, Duration), CoordError> {
        let granted = self
            .call(|mut c| async move { c.lease_grant(ttl_secs, None).await })
            .await?;
        Ok((
            granted.id(),
            Duration::from_secs(granted.ttl().max(0) as u64),
        ))
    }

    /// Revokes `lease`: every key on it is deleted at once, in one
    /// revision (a clean handover on shutdown, instead of waiting for it
    /// to expire). A lease etcd no longer knows counts as revoked (its
    /// keys are gone), so a revocation whose answer was lost can be tried
    /// again.
    pub async fn revoke_lease(&self, lease: i64) -> Result<(), CoordError> {
        match self
            .call(|mut c| async move { c.lease_revoke(lease).await })
            .await
        {
            Ok(_) => Ok(()),
            Err(CoordError::Etcd {
                source: etcd_client::Error::GRpcStatus(status),
                ..
            }) if status.code() == tonic::Code::NotFound => Ok(()),
            Err(err) => Err(err),
        }
    }

    /// Whether `lease` still exists.
    pub async fn lease_alive(&self, lease: i64) -> Result<bool, CoordError> {
        let answer = self
            .call(|mut c| async move { c.lease_time_to_live(lease, None).await })
            .await?;
        Ok(answer.ttl() > 0)
    }

    /// Opens a keep-alive stream for `lease`.
    pub async fn keep_alive(&self, lease: i64) -> Result<LeaseKeepAlive, CoordError> {
        let (keeper, stream) = self
            .call(|mut c| async move { c.lease_keep_alive(lease).await })
            .await?;
        Ok(LeaseKeepAlive {
            keeper,
            stream,
            lease,
            timeout: self.timeout,
            endpoints: self.endpoints.clone(),
        })
    }

    /// Registers (or refreshes) this server's member key on `lease`.
    pub async fn register(&self, member: &MemberRecord, lease: i64) -> Result<(), CoordError> {
        let value = serde_json::to_vec(member).map_err(|source| CoordError::BadRecord {
            key: self.keys.member(&member.address),
            source,
        })?;
        let key = self.keys.member(&member.address);
        self.call(|mut c| {
            let (key, value) = (key.clone(), value.clone());
            async move {
                c.put(key, value, Some(PutOptions::new().with_lease(lease)))
                    .await
            }
        })
        .await
        .map(|_| ())
    }

    /// Every live member.
    pub async fn members(&self) -> Result<Vec<MemberRecord>, CoordError> {
        let prefix = self.keys.members_prefix();
        let found = self.get(&prefix, true).await?;
        found
            .kvs()
            .iter()
            .map(|kv| decode(kv.key(), kv.value()))
            .collect()
    }

    /// Every shard's primary now with the lease its key is on, and the
    /// revision they were read at (to watch from).
    pub async fn primaries(&self) -> Result<(HashMap<u32, (PrimaryRecord, i64)>, i64), CoordError> {
        let prefix = self.keys.shards_prefix();
        let found = self.get(&prefix, true).await?;
        let revision = found.header().map_or(0, |h| h.revision());
        let mut out = HashMap::new();
        for kv in found.kvs() {
            let key = String::from_utf8_lossy(kv.key());
            if let Some(shard) = self.keys.shard_of_primary_key(&key) {
                out.insert(shard, (decode(kv.key(), kv.value())?, kv.lease()));
            }
        }
        Ok((out, revision))
    }

    /// Tries to become the primary of `shard` on `lease`: succeeds only if
    /// the shard has no primary and nobody else issued an epoch meanwhile.
    /// The epoch is one above both the last issued and `floor` (the newest
    /// epoch the caller has seen on any copy). Returns the epoch won —
    /// also when the key is on `lease` already (an earlier campaign of the
    /// caller's committed but its answer was lost) — or `None` when
    /// another server holds the shard or won the race.
    pub async fn campaign(
        &self,
        shard: u32,
        address: &str,
        replica_group: u32,
        lease: i64,
        floor: u64,
    ) -> Result<Option<u64>, CoordError> {
        let (primary_key, epoch_key) = (self.keys.primary(shard), self.keys.epoch(shard));
        let current = self.get(&epoch_key, false).await?;
        let (last, epoch_revision) = match current.kvs().first() {
            Some(kv) => (
                String::from_utf8_lossy(kv.value())
                    .trim()
                    .parse::<u64>()
                    .map_err(|err| CoordError::BadRecord {
                        key: epoch_key.clone(),
                        source: serde::de::Error::custom(err),
                    })?,
                kv.mod_revision(),
            ),
            None => (0, 0),
        };
        let epoch = last.max(floor) + 1;
        let record = PrimaryRecord {
            address: address.to_owned(),
            epoch,
            replica_group,
        };
        let value = serde_json::to_vec(&record).map_err(|source| CoordError::BadRecord {
            key: primary_key.clone(),
            source,
        })?;
        let txn = Txn::new()
            .when([
                // No primary now...
                Compare::create_revision(primary_key.clone(), CompareOp::Equal, 0),
                // ...and no epoch issued since we read the last one.
                Compare::mod_revision(epoch_key.clone(), CompareOp::Equal, epoch_revision),
            ])
            .and_then([
                TxnOp::put(epoch_key, epoch.to_string(), None),
                TxnOp::put(
                    primary_key.clone(),
                    value,
                    Some(PutOptions::new().with_lease(lease)),
                ),
            ])
            // Who holds it instead.
            .or_else([TxnOp::get(primary_key, None)]);
        let answer = self.txn(txn).await?;
        if answer.succeeded() {
            return Ok(Some(epoch));
        }
        for op in answer.op_responses() {
            if let etcd_client::TxnOpResponse::Get(found) = op
                && let Some(kv) = found.kvs().first()
                && kv.lease() == lease
            {
                let held: PrimaryRecord = decode(kv.key(), kv.value())?;
                return Ok(Some(held.epoch));
            }
        }
        Ok(None)
    }

    /// The cluster's shard map and the revision it was written at, if
    /// one was written.
    pub async fn shard_map(&self) -> Result<Option<(ShardMap, i64)>, CoordError> {
        Ok(self.shard_map_read().await?.0)
    }

    /// The shard map with the revision it was written at (if one was),
    /// and the store's revision at the read: a watch from one past that
    /// misses nothing, and starts above any compaction (a map written
    /// long ago has a revision etcd may have compacted away).
    async fn shard_map_read(&self) -> Result<(Option<(ShardMap, i64)>, i64), CoordError> {
        let key = self.keys.shard_map();
        let found = self.get(&key, false).await?;
        let revision = found.header().map_or(0, |h| h.revision());
        let map = found
            .kvs()
            .first()
            .map(|kv| -> Result<(ShardMap, i64), CoordError> {
                Ok((decode(kv.key(), kv.value())?, kv.mod_revision()))
            })
            .transpose()?;
        Ok((map, revision))
    }

    /// Writes `map` if the shard-map key is still at `revision` (0: not
    /// written yet), as [`EtcdCoordinator::shard_map`] read it: a
    /// transition of a resize (`shard_map.rs`) computed from one state
    /// wins only if nobody else's did first. Returns whether it was
    /// written.
    pub async fn write_shard_map(&self, map: &ShardMap, revision: i64) -> Result<bool, CoordError> {
        let key = self.keys.shard_map();
        let value = serde_json::to_vec(map).map_err(|source| CoordError::BadRecord {
            key: key.clone(),
            source,
        })?;
        let txn = Txn::new()
            .when([Compare::mod_revision(
                key.clone(),
                CompareOp::Equal,
                revision,
            )])
            .and_then([TxnOp::put(key, value, None)]);
        let answer = self.txn(txn).await?;
        Ok(answer.succeeded())
    }

    /// Reads the shard map, computes the next with `step` and writes it
    /// over the revision read; when another writer got in between, again
    /// from what it wrote. Returns the map written, or why `step` refused
    /// the state it found ([`CoordError::Resize`]).
    pub async fn update_shard_map(
        &self,
        step: impl Fn(&ShardMap) -> Result<ShardMap, crate::shard_map::ResizeError>,
    ) -> Result<ShardMap, CoordError> {
        loop {
            let (map, revision) =
                self.shard_map()
                    .await?
                    .ok_or_else(|| CoordError::NoShardMap {
                        cluster: self.keys.cluster().to_owned(),
                        endpoints: self.endpoints.clone(),
                    })?;
            let next = step(&map)?;
            if self.write_shard_map(&next, revision).await? {
                return Ok(next);
            }
        }
    }

    /// The cluster's shard map, written as `ShardMap::new(num_shards)` by
    /// the first server to start; a server configured with another count
    /// than the map routes by (or, during a resize, than its target; or,
    /// after a growth cut over, than its old count: a giving shard's
    /// server) is refused ([`CoordError::ShardCount`]): it would look for
    /// its keys on the wrong shards.
    ///
    /// A server hosting `shards` with a growth's target count may join
    /// during the growth only if it hosts none of the old shards (those
    /// keep the old count, and their fence, until the growth is done:
    /// [`CoordError::GrowthInProgress`]).
    pub async fn join_shard_map(
        &self,
        num_shards: u32,
        shards: &[u32],
    ) -> Result<ShardMap, CoordError> {
        loop {
            let map = match self.shard_map().await? {
                Some((map, _)) => map,
                None => {
                    let map = ShardMap::new(num_shards);
                    if self.write_shard_map(&map, 0).await? {
                        return Ok(map);
                    }
                    // Another server wrote it first: read theirs.
                    continue;
                }
            };
            // A growth's target may join from the plan on (its new
            // servers). A shrink's may not until it is done: a copy of a
            // remaining shard must refuse the keys it receives until it
            // holds them, which only a server of the old count does.
            let target = map.active().filter(|r| r.to > r.from).map(|r| r.to);
            if let Some(r) = map.active().filter(|r| r.to < r.from && r.to == num_shards) {
                return Err(CoordError::ShrinkInProgress {
                    from: r.from,
                    to: r.to,
                });
            }
            if let Some(r) = map.active().filter(|r| r.to > r.from && r.to == num_shards)
                && let Some(&shard) = shards.iter().find(|&&s| s < r.from)
            {
                return Err(CoordError::GrowthInProgress {
                    from: r.from,
                    to: r.to,
                    shard,
                });
            }
            // The old count of a resize that cut over (or is done): a
            // giving shard's server keeps its shard id and serves the keys
            // that stayed (a growth's) or none (a shrink's), the moved ones
            // fenced; a shrink's receiving server serves its own keys and
            // those it received (`crate::shard_map`).
            let resized_from = map
                .resize
                .as_ref()
                .filter(|r| {
                    r.to == map.num_shards
                        && matches!(r.state, ResizeState::CutOver | ResizeState::Done)
                })
                .map(|r| r.from);
            if map.num_shards != num_shards
                && target != Some(num_shards)
                && resized_from != Some(num_shards)
            {
                return Err(CoordError::ShardCount {
                    map: map.num_shards,
                    version: map.version,
                    configured: num_shards,
                });
            }
            return Ok(map);
        }
    }

    /// The in-step record of `shard`, if a primary wrote one.
    pub async fn in_step(&self, shard: u32) -> Result<Option<InStepRecord>, CoordError> {
        let key = self.keys.in_step(shard);
        let found = self.get(&key, false).await?;
        found
            .kvs()
            .first()
            .map(|kv| decode(kv.key(), kv.value()))
            .transpose()
    }

    /// Writes `record` as the in-step record of `shard` if `lease` holds
    /// the shard's primary key (only the primary writes it); whether it
    /// did.
    pub async fn publish_in_step(
        &self,
        shard: u32,
        lease: i64,
        record: &InStepRecord,
    ) -> Result<bool, CoordError> {
        let (primary_key, key) = (self.keys.primary(shard), self.keys.in_step(shard));
        let value = serde_json::to_vec(record).map_err(|source| CoordError::BadRecord {
            key: key.clone(),
            source,
        })?;
        let txn = Txn::new()
            .when([Compare::lease(primary_key, CompareOp::Equal, lease)])
            .and_then([TxnOp::put(key, value, None)]);
        let answer = self.txn(txn).await?;
        Ok(answer.succeeded())
    }

    /// Gives up the primary key of `shard` if `lease` holds it.
    pub async fn resign(&self, shard: u32, lease: i64) -> Result<(), CoordError> {
        let key = self.keys.primary(shard);
        let txn = Txn::new()
            .when([Compare::lease(key.clone(), CompareOp::Equal, lease)])
            .and_then([TxnOp::delete(key, None)]);
        self.call(|mut c| {
            let txn = txn.clone();
            async move { c.txn(txn).await }
        })
        .await
        .map(|_| ())
    }

    /// Watches the cluster's shard-map key from `revision` (0: from now).
    pub async fn watch_shard_map(&self, revision: i64) -> Result<ShardMapWatch, CoordError> {
        let key = self.keys.shard_map();
        let stream = self
            .call(|mut c| {
                let key = key.clone();
                let options = WatchOptions::new().with_start_revision(revision);
                async move { c.watch(key, Some(options)).await }
            })
            .await?;
        Ok(ShardMapWatch {
            stream,
            endpoints: self.endpoints.clone(),
        })
    }

    /// Keeps `out` holding the cluster's shard map as etcd has it (`None`
    /// until one is written) until every receiver of `out` is gone: reads
    /// the map, then follows a watch of its key from the revision read; a
    /// read or watch that fails is tried again after `retry`, from a fresh
    /// read, so no change is missed for long. Only a newer version
    /// replaces the one held (a read racing a watch cannot step back).
    pub async fn follow_shard_map(
        &self,
        out: tokio::sync::watch::Sender<Option<ShardMap>>,
        retry: Duration,
    ) {
        let offer = |map: ShardMap| {
            out.send_if_modified(|held| {
                let newer = held.as_ref().is_none_or(|h| map.version > h.version);
                if newer {
                    *held = Some(map);
                }
                newer
            });
        };
        let follow = async {
            loop {
                let watched = async {
                    let (map, revision) = self.shard_map_read().await?;
                    if let Some((map, _)) = map {
                        offer(map);
                    }
                    let mut watch = self.watch_shard_map(revision + 1).await?;
                    loop {
                        offer(watch.next().await?);
                    }
                };
                let err: CoordError = match watched.await {
                    Err(err) => err,
                    Ok(()) => CoordError::WatchEnded,
                };
                tracing::debug!(%err, "following the shard map: reading it again");
                tokio::time::sleep(retry).await;
            }
        };
        tokio::select! {
            () = follow => {}
            () = out.closed() => {}
        }
    }

    /// Watches every shard's primary key from `revision` on (the one
    /// [`EtcdCoordinator::primaries`] returned, plus one).
    pub async fn watch_primaries(&self, revision: i64) -> Result<PrimaryWatch, CoordError> {
        let prefix = self.keys.shards_prefix();
        let stream = self
            .call(|mut c| {
                let prefix = prefix.clone();
                let options = WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(revision);
                async move { c.watch(prefix, Some(options)).await }
            })
            .await?;
        Ok(PrimaryWatch {
            stream,
            keys: self.keys.clone(),
            endpoints: self.endpoints.clone(),
        })
    }
}

/// The keep-alive stream of one lease.
#[derive(Debug)]
pub struct LeaseKeepAlive {
    keeper: etcd_client::LeaseKeeper,
    stream: etcd_client::LeaseKeepAliveStream,
    lease: i64,
    timeout: Duration,
    endpoints: String,
}

impl LeaseKeepAlive {
    /// Renews the lease once; returns the TTL etcd restarted it with.
    /// Measure the time *before* calling: the lease runs from when etcd
    /// received the renewal, which is no earlier than that.
    pub async fn renew(&mut self) -> Result<Duration, CoordError> {
        let endpoints = self.endpoints.clone();
        let lease = self.lease;
        let exchange = async {
            self.keeper.keep_alive().await?;
            self.stream.message().await
        };
        match within(self.timeout, &endpoints, exchange).await? {
            Some(answer) if answer.ttl() > 0 => Ok(Duration::from_secs(answer.ttl() as u64)),
            Some(_) => Err(CoordError::LeaseExpired(lease)),
            None => Err(CoordError::WatchEnded),
        }
    }
}

/// A stream of primary changes.
pub struct PrimaryWatch {
    stream: etcd_client::WatchStream,
    keys: Keys,
    endpoints: String,
}

impl std::fmt::Debug for PrimaryWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrimaryWatch").finish_non_exhaustive()
    }
}

/// A watch of the cluster's shard-map key
/// ([`EtcdCoordinator::watch_shard_map`]).
pub struct ShardMapWatch {
    stream: etcd_client::WatchStream,
    endpoints: String,
}

impl std::fmt::Debug for ShardMapWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardMapWatch").finish_non_exhaustive()
    }
}

/// A watch's next answer; an error when the watch broke or was
/// cancelled.
async fn next_answer(
    stream: &mut etcd_client::WatchStream,
    endpoints: &str,
) -> Result<etcd_client::WatchResponse, CoordError> {
    let answer = stream
        .message()
        .await
        .map_err(|source| CoordError::Etcd {
            endpoints: endpoints.to_owned(),
            source,
        })?
        .ok_or(CoordError::WatchEnded)?;
    if answer.canceled() {
        return Err(CoordError::WatchEnded);
    }
    Ok(answer)
}

impl ShardMapWatch {
    /// The next map written; an error when the watch broke or the key
    /// was deleted (the caller reads the map again and watches anew).
    pub async fn next(&mut self) -> Result<ShardMap, CoordError> {
        loop {
            let answer = next_answer(&mut self.stream, &self.endpoints).await?;
            let mut latest = None;
            for event in answer.events() {
                let Some(kv) = event.kv() else { continue };
                match event.event_type() {
                    EventType::Put => latest = Some(decode(kv.key(), kv.value())?),
                    EventType::Delete => return Err(CoordError::WatchEnded),
                }
            }
            if let Some(map) = latest {
                return Ok(map);
            }
        }
    }
}

impl PrimaryWatch {
    /// The next changes (at least one); an error when the watch broke (the
    /// caller reads the primaries again and watches anew).
    pub async fn next(&mut self) -> Result<Vec<PrimaryChange>, CoordError> {
        loop {
            let answer = next_answer(&mut self.stream, &self.endpoints).await?;
            let mut changes = Vec::new();
            for event in answer.events() {
                let Some(kv) = event.kv() else { continue };
                let key = String::from_utf8_lossy(kv.key());
                let Some(shard) = self.keys.shard_of_primary_key(&key) else {
                    continue;
                };
                let primary = match event.event_type() {
                    EventType::Put => Some((decode(kv.key(), kv.value())?, kv.lease())),
                    EventType::Delete => None,
                };
                changes.push(PrimaryChange { shard, primary });
            }
            if !changes.is_empty() {
                return Ok(changes);
            }
        }
    }
}

fn decode<T: serde::de::DeserializeOwned>(key: &[u8], value: &[u8]) -> Result<T, CoordError> {
    serde_json::from_slice(value).map_err(|source| CoordError::BadRecord {
        key: String::from_utf8_lossy(key).into_owned(),
        source,
    })
}

pub(crate) async fn within<T>(
    timeout: Duration,
    endpoints: &str,
    call: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, CoordError> {
    match tokio::time::timeout(timeout, call).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(source)) => Err(CoordError::Etcd {
            endpoints: endpoints.to_owned(),
            source,
        }),
        Err(_) => Err(CoordError::Timeout {
            endpoints: endpoints.to_owned(),
            timeout,
        }),
    }
}
