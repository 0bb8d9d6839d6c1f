//! A server's part in a resize of the cluster's shard count (issue 39;
//! the state machine and the design: `tessera_coord::shard_map`).
//!
//! Every server in etcd mode runs [`Resharding::run`], which follows the
//! shard map (the coordination's watch) and, once a second besides, acts
//! on the resize in progress:
//!
//! - **A giving primary** (it leads a shard that gives keys away, and is
//!   configured with the resize's old count) keeps its changed keys and
//!   sends every cut of the shard to the primary of each receiving shard
//!   (etcd's primary keys), rows whole and routed by the new count: the
//!   delta stream's resize route (`delta/route.rs`).
//! - **A receiving primary** (it leads a receiving shard, configured
//!   with the new count) opens its feed to those deltas, so that it
//!   copies the moving rows from each giving primary and follows its
//!   stream, as a serving server follows a training fleet
//!   (`delta/feed.rs`). Only the primary follows: its replicas will copy
//!   the shard from it at the cut-over, as any replica out of step does
//!   (a replica fed on its own could apply a giving shard's last delta
//!   after Pushes its primary forwarded, and differ from it). It moves
//!   the resize from planned to copying, and reports its shard ready (in
//!   step with every giving shard: each followed, none being copied, each
//!   applied within three intervals and a second, or the giving side's
//!   stall bound if longer) or, fallen behind (twice that), not ready
//!   again. Losing the lead closes its feed; the new primary copies.
//!
//! - **The cut-over** (every receiving shard ready, none held): a
//!   receiving primary writes it (a compare-and-swap on the map). Every
//!   server of a giving shard then fences the moved keys under the
//!   shard's write lock (`store/resize.rs`): their Fetches and Pushes are
//!   refused with `KeysMoved`, and the giving primary's cuts from then on
//!   are marked fenced (a copy taken after the fence too). A receiving
//!   primary that applied every giving shard's fenced delta opens its
//!   shard: its feed closes, the shard takes a stream position as a gap,
//!   which cuts its replicas off so that they copy it, and it serves.
//!   Until a copy of a receiving shard holds a position past 0 it does
//!   not serve (a replica that has not copied from the opened primary, a
//!   primary promoted before opening, which follows the giving shards
//!   anew); the giving shards keep their moved rows and stream on.
//!
//! Why the delta stream and not the replication stream: see the design in
//! `tessera_coord::shard_map`. Built so far: growing (shrinking is
//! planned and cancelled, but nothing moves for it yet) through the
//! cut-over; exactly-once across it (the giving shards' dedup windows),
//! workers following the map and finishing the resize are the next steps.

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

/// Resolves when `feed` applied a giving shard's fenced delta or copy
/// (never without a feed).
async fn fenced_applied(feed: Option<&Feed>) {
    match feed {
        Some(feed) => feed.fenced_applied().await,
        None => std::future::pending().await,
    }
}

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
    /// to count as in step (twice that, once reported ready, before it
    /// counts as behind: a slow receiver does not flip back and forth).
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
            // A giving primary may hold a cut back for a receiver that
            // keeps up for as long as its stall bound.
            in_step_within: (interval * 3 + Duration::from_secs(1)).max(crate::delta::stall_bound(
                u64::try_from(interval.as_millis()).unwrap_or(u64::MAX),
            )),
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
                // A giving shard's last delta is in: open without waiting
                // for the tick.
                () = fenced_applied(self.feed.as_deref()) => {}
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
        if let Some(map) = map {
            self.fence(map).await;
        }
        let num_shards = self.store.num_shards();
        // Receiving: a server of the new count hosting a receiving shard.
        let receiving: Vec<u32> = match resize {
            Some(r) if num_shards == r.to => r
                .receiving()
                .filter(|s| self.store.hosted().contains(s))
                .collect(),
            _ => Vec::new(),
        };
        // Its rows are incomplete until the cut-over: no copy of it serves
        // until it opens (a cancel opens it too). After the cut-over a
        // copy at position 0 has not opened yet: its primary still
        // follows the giving shards' fenced deltas, or its replica has
        // not copied from the opened primary yet (`Resharding::open`).
        let cut_over = resize.is_some_and(|r| r.state == ResizeState::CutOver);
        for &shard in self.store.hosted() {
            let closed = receiving.contains(&shard)
                && (!cut_over || self.store.version(shard).unwrap_or_default().position == 0);
            self.store.set_receiving(shard, closed);
        }
        let Some(resize) = resize else {
            self.give(None);
            self.receive(None);
            return;
        };
        let now = Instant::now();
        let leads: Vec<u32> = receiving
            .iter()
            .copied()
            .filter(|&s| self.store.receiving(s))
            .filter(|&s| self.replication.leading_epoch(s, now).is_some())
            .collect();
        if leads.is_empty() {
            self.receive(None);
        } else {
            self.receive(Some(resize.to));
            self.drive(resize, &leads).await;
        }
        if cut_over {
            let opened: Vec<u32> = receiving
                .iter()
                .copied()
                .filter(|&s| !self.store.receiving(s))
                .filter(|&s| self.replication.leading_epoch(s, now).is_some())
                .collect();
            self.report_opened(resize, &opened).await;
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

    /// As a server of a giving shard (any copy of it) in a growth that
    /// cut over: fences the keys that moved, under the shard's write lock
    /// (`store/resize.rs`). The fence stays once the resize is done: the
    /// keys belong elsewhere. Set on every copy, so that a replica
    /// promoted later refuses them from its first Push (it sees the map
    /// long before a failover can make it primary: the watch delivers in
    /// milliseconds, a lease runs for seconds).
    async fn fence(&self, map: &ShardMap) {
        let Some(r) = map.resize.as_ref().filter(|r| {
            r.to > r.from
                && matches!(r.state, ResizeState::CutOver | ResizeState::Done)
                && self.store.num_shards() == r.from
        }) else {
            return;
        };
        for shard in r.giving() {
            if self.store.moved(shard).is_some() {
                continue;
            }
            if let Some(writing) = self.store.lock_shard_async(shard).await {
                self.store.set_moved(&writing, Some((r.to, map.version)));
            }
        }
    }

    /// As the primary of receiving shards `leads`: moves a planned resize
    /// to copying, reports each shard ready or not, cuts over once every
    /// receiving shard is ready, and after the cut-over opens its shards
    /// once it holds every giving shard's fenced delta.
    async fn drive(&self, resize: &Resize, leads: &[u32]) {
        match resize.state {
            ResizeState::Planned => {
                self.update("start copying", |m| m.start_copying()).await;
            }
            ResizeState::Copying => {
                let mut all_ready = true;
                for &shard in leads {
                    let ready = resize.ready.binary_search(&shard).is_ok();
                    let within = if ready {
                        self.in_step_within * 2
                    } else {
                        self.in_step_within
                    };
                    let in_step = self.in_step(resize, within);
                    all_ready &= in_step;
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
                let others_ready = resize
                    .receiving()
                    .filter(|s| !leads.contains(s))
                    .all(|s| resize.ready.binary_search(&s).is_ok());
                if all_ready && others_ready && !resize.hold && self.led(resize).await {
                    // Compared on the revision read: a shard that fell
                    // out of step meanwhile wrote `ready` again, and the
                    // cut-over is refused.
                    self.update("cut over", ShardMap::cut_over).await;
                }
            }
            ResizeState::CutOver if self.fenced(resize) => self.open(resize, leads).await,
            _ => {}
        }
    }

    /// Whether every receiving shard has a primary in etcd (a `ready`
    /// outlives the restart of the server that wrote it; a shard being
    /// led again copies anew, and opens only once it holds every giving
    /// shard's fenced delta, whenever the cut-over came).
    async fn led(&self, resize: &Resize) -> bool {
        match self.coord.primaries().await {
            Ok((primaries, _)) => resize.receiving().all(|s| primaries.contains_key(&s)),
            Err(err) => {
                tracing::debug!(%err, "reading the receiving shards' primaries failed; the cut-over waits");
                false
            }
        }
    }

    /// Whether this server's feed holds every giving shard's fenced delta
    /// (or a copy taken after its fence), none being copied.
    fn fenced(&self, resize: &Resize) -> bool {
        let Some(feed) = &self.feed else {
            return false;
        };
        let health = feed.health();
        health.source_shards == resize.from
            && resize.giving().all(|g| {
                health
                    .sources
                    .iter()
                    .any(|s| s.source_shard == g && s.fenced && !s.copying)
            })
    }

    /// Opens the receiving shards `leads` after the cut-over: the giving
    /// shards' deduplication windows at their fences are read from the
    /// feed, the feed closes (no delta still being applied), then, under
    /// each shard's write lock, its replicas are cut off to copy it from
    /// here (the rows came outside its stream), it takes the windows and
    /// it serves. A resize feed writes a
    /// shard only while it receives (`delta/feed/write.rs`), so no row
    /// still on its way lands after its first Push.
    async fn open(&self, resize: &Resize, leads: &[u32]) {
        let Some(feed) = &self.feed else {
            return;
        };
        let windows = feed.fenced_windows().await;
        feed.close_for_resize().await;
        for &shard in leads {
            let Some(mut writing) = self.store.lock_shard_async(shard).await else {
                continue;
            };
            match self.replication.restart_replicas(&mut writing) {
                Some(version) => {
                    // Before its first Push: a part retried across the
                    // cut-over leaves out the keys a giving shard applied
                    // it to (`store/resize.rs`).
                    self.store
                        .set_origin_windows(shard, resize.from, windows.clone());
                    self.store.set_receiving(shard, false);
                    drop(writing);
                    tracing::info!(shard, %version, "a receiving shard holds every moved key and serves them; its replicas copy it");
                    metrics::counter!("tessera_ps_resize_opened_total").increment(1);
                }
                None => {
                    tracing::info!(
                        shard,
                        "lost the lead of a receiving shard before opening it; the new primary follows the giving shards"
                    );
                }
            }
        }
    }

    /// As the primary of opened receiving shards `opened`: says so in the
    /// map (the giving shards stop streaming to them).
    async fn report_opened(&self, resize: &Resize, opened: &[u32]) {
        for &shard in opened {
            if resize.opened.binary_search(&shard).is_err() {
                self.update("report opened", |m| m.handle_opened(shard))
                    .await;
            }
        }
    }

    /// Whether this server's feed follows every giving shard, none being
    /// copied, each applied lately.
    fn in_step(&self, resize: &Resize, within: Duration) -> bool {
        let Some(feed) = &self.feed else {
            return false;
        };
        let health = feed.health();
        let within = u64::try_from(within.as_millis()).unwrap_or(u64::MAX);
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

    /// The primaries of the receiving shards (etcd's primary keys), each
    /// with the receiving shards it leads.
    async fn receivers(&self, resize: &Resize) -> Result<Vec<(String, Vec<u32>)>, CoordError> {
        let (primaries, _) = self.coord.primaries().await?;
        let mut servers: std::collections::BTreeMap<String, Vec<u32>> = Default::default();
        for shard in resize
            .receiving()
            .filter(|s| resize.opened.binary_search(s).is_err())
        {
            if let Some((record, _)) = primaries.get(&shard) {
                servers
                    .entry(record.address.clone())
                    .or_default()
                    .push(shard);
            }
        }
        Ok(servers.into_iter().collect())
    }

    /// Streams to a resize's receiving servers, or stops.
    fn give(&self, plan: Option<ResizePlan>) {
        let Some(sender) = &self.sender else {
            return;
        };
        // Changes are kept from before the first cut that goes to a
        // receiving server, and the route goes before they stop being
        // kept; each switch starts new streams at the next cuts (the
        // store's generation of change keeping), so a receiver copies as
        // of a cut made while they were kept and misses none.
        let streaming = plan.as_ref().is_some_and(|p| !p.servers.is_empty());
        if streaming {
            self.store.track_changes_for_resize(true);
            sender.set_resize(plan);
        } else {
            sender.set_resize(None);
            self.store.track_changes_for_resize(false);
        }
    }

    /// Takes a resize's deltas, routed by `num_shards`, or refuses them.
    fn receive(&self, num_shards: Option<u32>) {
        if let Some(feed) = &self.feed {
            feed.open_for_resize(num_shards);
        }
    }
}
