//! A server's part in a resize of the cluster's shard count (issue 39;
//! the state machine and the design: `tessera_coord::shard_map`).
//!
//! Every server in etcd mode runs [`Resharding::run`], which follows the
//! shard map (the coordination's watch) and, once a second besides, acts
//! on the resize in progress:
//!
//! - **A giving primary** (it leads a shard that gives keys away, and is
//!   configured with the resize's old count) keeps its changed keys and
//!   sends every cut of the shard to each server hosting a receiving
//!   shard (read from etcd's members), rows whole and routed by the new
//!   count: the delta stream's resize route (`delta/route.rs`).
//! - **A receiving server** (it hosts a receiving shard, configured with
//!   the new count) opens its feed to those deltas, so that it copies the
//!   moving rows from each giving primary and follows its stream, as a
//!   serving server follows a training fleet (`delta/feed.rs`). Every copy
//!   of a receiving shard is fed on its own, so the shard's replicas fill
//!   the same way as its primary. The one that leads a receiving shard
//!   moves the resize from planned to copying, and reports its shard
//!   ready (in step with every giving shard: each followed, none being
//!   copied, each applied within a few intervals) or, fallen behind, not
//!   ready again.
//!
//! Why the delta stream and not the replication stream: see the design in
//! `tessera_coord::shard_map`. Built so far: growing (shrinking is
//! planned and cancelled, but nothing moves for it yet) up to the copying
//! state; the cut-over (fencing the moving keys at the giving primaries,
//! the last delta, redirects) is the next step.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_coord::{CoordError, EtcdCoordinator, Resize, ResizeError, ResizeState, ShardMap};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::delta::{Feed, ResizePlan, Sender};
use crate::replication::Replication;
use crate::store::Store;

/// How often the resize is looked at besides the map's changes (the
/// receiving shards' servers may come and go; a shard's feed falls in
/// and out of step).
const EVERY: Duration = Duration::from_secs(1);

/// A server's part in resizes (module docs).
#[derive(Debug)]
pub struct Resharding {
    coord: EtcdCoordinator,
    map: watch::Receiver<Option<ShardMap>>,
    store: Arc<Store>,
    replication: Arc<Replication>,
    sender: Option<Arc<Sender>>,
    feed: Option<Arc<Feed>>,
    /// How old a giving shard's last applied delta may be for its stream
    /// to count as in step.
    in_step_within: Duration,
}

impl Resharding {
    /// The part of the server whose `store`, `replication`, delta
    /// `sender` and resize `feed` these are, following `map` and writing
    /// through `coord`; deltas are cut every `interval`.
    pub fn new(
        coord: EtcdCoordinator,
        map: watch::Receiver<Option<ShardMap>>,
        store: Arc<Store>,
        replication: Arc<Replication>,
        sender: Option<Arc<Sender>>,
        feed: Option<Arc<Feed>>,
        interval: Duration,
    ) -> Self {
        Self {
            coord,
            map,
            store,
            replication,
            sender,
            feed,
            in_step_within: interval * 3 + Duration::from_secs(1),
        }
    }

    /// Acts on every change of the map, and every second, until `stop`.
    pub async fn run(mut self, stop: CancellationToken) {
        let mut ticks = tokio::time::interval(EVERY);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                changed = self.map.changed() => {
                    if changed.is_err() {
                        break;
                    }
                }
                _ = ticks.tick() => {}
                () = stop.cancelled() => break,
            }
            let map = self.map.borrow_and_update().clone();
            self.step(map.as_ref()).await;
        }
        self.give(None);
        self.receive(None);
    }

    /// One look at the resize in progress.
    async fn step(&self, map: Option<&ShardMap>) {
        let resize = map.and_then(ShardMap::active).filter(|r| r.to > r.from);
        let Some(resize) = resize else {
            self.give(None);
            self.receive(None);
            return;
        };
        let now = Instant::now();
        let num_shards = self.store.num_shards();
        // Receiving: a server of the new count hosting a receiving shard.
        let receiving: Vec<u32> = if num_shards == resize.to {
            resize
                .receiving()
                .filter(|s| self.store.hosted().contains(s))
                .collect()
        } else {
            Vec::new()
        };
        if receiving.is_empty() {
            self.receive(None);
        } else {
            self.receive(Some(resize.to));
            let leads: Vec<u32> = receiving
                .iter()
                .copied()
                .filter(|&s| self.replication.leading_epoch(s, now).is_some())
                .collect();
            if !leads.is_empty() {
                self.drive(resize, &leads).await;
            }
        }
        // Giving: the primary of a giving shard, of the old count.
        let gives = num_shards == resize.from
            && matches!(resize.state, ResizeState::Copying | ResizeState::CutOver)
            && resize
                .giving()
                .any(|s| self.replication.leading_epoch(s, now).is_some());
        if gives {
            match self.receivers(resize).await {
                Ok(servers) => self.give(Some(ResizePlan {
                    num_shards: resize.to,
                    servers,
                })),
                Err(err) => {
                    tracing::debug!(%err, "reading the receiving shards' servers failed; trying again");
                }
            }
        } else {
            self.give(None);
        }
    }

    /// As the primary of receiving shards `leads`: moves a planned resize
    /// to copying, and reports each shard ready or not.
    async fn drive(&self, resize: &Resize, leads: &[u32]) {
        match resize.state {
            ResizeState::Planned => {
                self.update("start copying", |m| m.start_copying()).await;
            }
            ResizeState::Copying => {
                let in_step = self.in_step(resize);
                for &shard in leads {
                    let ready = resize.ready.binary_search(&shard).is_ok();
                    if ready != in_step {
                        tracing::info!(
                            shard,
                            in_step,
                            "a receiving shard's rows are {} the giving shards'",
                            if in_step { "in step with" } else { "behind" }
                        );
                        self.update("report ready", |m| m.handle_ready(shard, in_step))
                            .await;
                    }
                }
            }
            _ => {}
        }
    }

    /// Whether this server's feed follows every giving shard, none being
    /// copied, each applied lately.
    fn in_step(&self, resize: &Resize) -> bool {
        let Some(feed) = &self.feed else {
            return false;
        };
        let health = feed.health();
        let within = u64::try_from(self.in_step_within.as_millis()).unwrap_or(u64::MAX);
        health.source_shards == resize.from
            && resize.giving().all(|g| {
                health.sources.iter().any(|s| {
                    s.source_shard == g && s.seq > 0 && !s.copying && s.applied_age_ms <= within
                })
            })
    }

    /// Writes one transition; losing to another writer, or a state that
    /// moved on, is fine (the next look acts on what is there).
    async fn update(
        &self,
        what: &'static str,
        step: impl Fn(&ShardMap) -> Result<ShardMap, ResizeError>,
    ) {
        match self.coord.update_shard_map(step).await {
            Ok(map) => tracing::info!(version = map.version, what, "resize moved on"),
            Err(CoordError::Resize(err)) => tracing::debug!(%err, what, "resize step not taken"),
            Err(err) => tracing::warn!(%err, what, "resize step could not be written"),
        }
    }

    /// The servers hosting receiving shards (etcd's members), each with
    /// the receiving shards it hosts.
    async fn receivers(&self, resize: &Resize) -> Result<Vec<(String, Vec<u32>)>, CoordError> {
        let receiving: Vec<u32> = resize.receiving().collect();
        let mut servers: Vec<(String, Vec<u32>)> = self
            .coord
            .members()
            .await?
            .into_iter()
            .filter_map(|m| {
                let mut shards: Vec<u32> = m
                    .shards
                    .iter()
                    .copied()
                    .filter(|s| receiving.contains(s))
                    .collect();
                shards.sort_unstable();
                (!shards.is_empty()).then_some((m.address, shards))
            })
            .collect();
        servers.sort();
        Ok(servers)
    }

    /// Streams to a resize's receiving servers, or stops.
    fn give(&self, plan: Option<ResizePlan>) {
        let Some(sender) = &self.sender else {
            return;
        };
        // Changes are kept from before the first cut that goes to a
        // receiving server, and whenever they were not kept for a while
        // the streams start anew: every receiver copies as of a cut made
        // while they were kept, so none misses a change.
        let streaming = plan.as_ref().is_some_and(|p| !p.servers.is_empty());
        if self.store.track_changes_for_resize(streaming) {
            sender.new_streams();
        }
        sender.set_resize(plan);
    }

    /// Takes a resize's deltas, routed by `num_shards`, or refuses them.
    fn receive(&self, num_shards: Option<u32>) {
        if let Some(feed) = &self.feed {
            feed.open_for_resize(num_shards);
        }
    }
}
