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
//!   are marked fenced (a copy taken after the fence too) and carry its
//!   deduplication windows. A receiving primary that applied every giving
//!   shard's fenced delta opens its shard: its feed closes, it keeps the
//!   windows (`Store::applied_at_origins`), the shard takes a stream
//!   position as a gap, which cuts its replicas off so that they copy it,
//!   and it serves; it writes the position to the map (`opened`), and
//!   the giving shards stop streaming to it. A copy of a receiving shard
//!   serves only once it holds that position. Giving shards take Pushes
//!   split by the new count only once every receiving shard opened.
//! - **At start** ([`prepare`]), before a server serves, the receiving
//!   flags and the fence are set from the map it joined, so a server
//!   (re)started during a resize serves nothing against them.
//!
//! Why the delta stream and not the replication stream, and the known
//! limits: see the design in `tessera_coord::shard_map`.
//! - **Done**: once every receiving shard opened, a receiving primary
//!   writes it, and every copy of a giving shard drops the moved rows
//!   (`Store::drop_moved_rows`) and routes by the new count from then on
//!   (`Store::adopt_num_shards`; the fence stays, widened by a later
//!   growth), so that another resize can follow. A server catches up
//!   from the map's count, not from seeing `done` (the map may have moved
//!   on to the next resize), and a copy installed from a source that had
//!   not dropped the rows yet drops them on arrival.
//!
//! - **Shrinking** (`n` to `m` < `n`): the receiving shards are the
//!   remaining ones, on servers of the old count, and keep serving their
//!   own keys: each copy refuses only the keys it receives until it
//!   opens (`shrink_now`, `store/resize.rs`); its primary's feed
//!   copies and follows the given-away shards as a growth's new primary
//!   does. At the opening the shard also keeps its own deduplication
//!   window with the giving shards' and starts a new one, and routes by
//!   `m` (a Push split by `n` is split anew). The giving shards are
//!   fenced whole at the cut-over and drop their rows once done; a
//!   server whose every shard remains takes `m` then
//!   (`Resharding::catch_up`); a cancel drops the rows taken.
//!
//! Built: growing and shrinking, to done, one resize after another.
//!
//! The decisions are a sans-IO core ([`ReshardCore`]: the map, the
//! leads and the feed's health in, the store's resize state set and the
//! network's part out as actions), with what the map calls for on a store
//! as pure functions (`state.rs`); [`Resharding`] is its driver, and the
//! control-plane simulation (`crate::dst`, test-only) another.

mod core;
mod state;

pub use self::core::{Action, Look, ReshardCore, Transition};
pub use self::state::{prepare, reconciles};

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tessera_coord::{CoordError, EtcdCoordinator, Resize, ResizeError, ShardMap};
use tessera_rpc::sync::LockExt;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::delta::{Feed, ResizePlan, Sender};
use crate::replication::Replication;
use tessera_store::store::Store;

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

/// Whether fail point `name` stalls the server at address `me` (its
/// `return` argument names the server, or several separated by commas;
/// always false without the `failpoints` feature).
fn stalled_here(name: &str, me: &str) -> bool {
    #[cfg(feature = "failpoints")]
    {
        fail::eval(name, |arg| {
            arg.is_some_and(|a| a.split(',').any(|a| a == me))
        })
        .unwrap_or(false)
    }
    #[cfg(not(feature = "failpoints"))]
    {
        let _ = (name, me);
        false
    }
}

/// A server's part in resizes: the driver of its [`ReshardCore`] (module
/// docs).
#[derive(Debug)]
pub struct Resharding {
    /// This server's advertised address.
    me: String,
    coord: EtcdCoordinator,
    map: watch::Receiver<Option<ShardMap>>,
    store: Arc<Store>,
    replication: Arc<Replication>,
    sender: Option<Arc<Sender>>,
    feed: Option<Arc<Feed>>,
    /// Locked only for a look or an opening, never across an await.
    core: Arc<Mutex<ReshardCore>>,
}

impl Resharding {
    /// The part of the server whose `store`, `replication`, delta
    /// `sender` and resize `feed` these are, following `map` and writing
    /// through `coord`; deltas are cut every `interval`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        me: String,
        coord: EtcdCoordinator,
        map: watch::Receiver<Option<ShardMap>>,
        store: Arc<Store>,
        replication: Arc<Replication>,
        sender: Option<Arc<Sender>>,
        feed: Option<Arc<Feed>>,
        interval: Duration,
    ) -> Self {
        // Its resize state was set from the map it joined (`prepare`);
        // from now on a shard it leads waits for its looks.
        let version = map.borrow().as_ref().map_or(0, |m| m.version);
        store.follow_resizes(version);
        let in_step_within = in_step_within(interval);
        // A receiving shard opens about a delta interval after the
        // cut-over, once the fenced deltas are in: a copy that has not
        // heard of it within the in-step bound stops serving the keys it
        // fenced (`Store::moved_reads_over`).
        store.bound_moved_reads(in_step_within);
        Self {
            me,
            coord,
            map,
            store,
            replication,
            sender,
            feed,
            core: Arc::new(Mutex::new(ReshardCore::new(in_step_within))),
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
            self.step(map).await;
        }
        self.give(None);
        self.receive(None);
    }

    /// One look at the resize in progress: the core's, off the runtime's
    /// workers (it takes shard locks and may drop rows), then its actions.
    async fn step(&self, map: Option<ShardMap>) {
        // Tests stall one server's look (the fail point's argument names
        // it) to hold its resize state behind the map.
        if stalled_here("reshard::step", &self.me) {
            return;
        }
        let now = Instant::now();
        let resize = map.as_ref().and_then(ShardMap::active).cloned();
        let look = Look {
            map,
            leads: self
                .store
                .hosted()
                .iter()
                .copied()
                .filter_map(|s| Some((s, self.replication.leading_epoch(s, now)?)))
                .collect(),
            feed: self.feed.as_ref().map(|f| f.health()),
        };
        let (core, store) = (Arc::clone(&self.core), Arc::clone(&self.store));
        let actions =
            match tokio::task::spawn_blocking(move || core.locked().look(&store, &look)).await {
                Ok(actions) => actions,
                Err(err) => {
                    tracing::warn!(%err, "a look at the resize failed");
                    return;
                }
            };
        for action in actions {
            match action {
                Action::Update(Transition::CutOver) => {
                    if let Some(resize) = &resize
                        && !self.led(resize).await
                    {
                        continue;
                    }
                    self.update(&Transition::CutOver).await;
                }
                Action::Update(t @ Transition::Opened { .. }) => {
                    // Tests stop a primary between its opening and this
                    // report (`tests/reshard_failover.rs`).
                    fail::fail_point!("reshard::report_opened", |_| ());
                    self.update(&t).await;
                }
                Action::Update(t) => self.update(&t).await,
                Action::Open { resize, shards } => self.open(&resize, &shards).await,
                Action::Give(Some(resize)) => match self.receivers(&resize).await {
                    Ok(servers) => self.give(Some(ResizePlan {
                        num_shards: resize.to,
                        servers,
                    })),
                    Err(err) => {
                        tracing::debug!(%err, "reading the receiving shards' servers failed; trying again");
                    }
                },
                Action::Give(None) => self.give(None),
                Action::Receive(count) => self.receive(count),
            }
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

    /// Opens the receiving shards `leads` after the cut-over: each
    /// opening is claimed in the map, the giving shards' deduplication
    /// windows (fenced deltas carry them) are read from the feed, the
    /// feed closes (no delta still being applied), then, under each
    /// shard's write lock, its replicas are cut off to copy it from here
    /// (the rows came outside its stream) and the core opens it
    /// ([`ReshardCore::open_shard`]). A resize feed writes a shard only
    /// while it receives (`delta/feed/write.rs`), so no row still on its
    /// way lands after its first Push.
    async fn open(&self, resize: &Resize, leads: &[u32]) {
        // Tests hold every opening here to stop a resize between its
        // cut-over and its opening (`tests/reshard_states.rs`).
        fail::fail_point!("reshard::open", |_| ());
        let Some(feed) = &self.feed else {
            return;
        };
        // Claimed in the map first, compared on its revision: a cancel
        // after the cut-over and this opening cannot both win
        // (`tessera_coord::shard_map`).
        if !self.claim_opening(resize, leads).await {
            return;
        }
        let windows = feed.fenced_windows().await;
        feed.close_for_resize().await;
        for &shard in leads {
            let Some(mut writing) = self.store.lock_shard_async(shard).await else {
                continue;
            };
            match self.replication.restart_replicas(&mut writing) {
                Some(version) => {
                    self.core
                        .locked()
                        .open_shard(&self.store, &writing, resize, version, &windows);
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

    /// Writes the claim of opening receiving shards `leads` in `resize`
    /// (those the map does not name yet); whether the map names them all
    /// now, in that resize, still cut over.
    async fn claim_opening(&self, resize: &Resize, leads: &[u32]) -> bool {
        for &shard in leads {
            if resize.opening.contains(&shard) || resize.opened.contains_key(&shard) {
                continue;
            }
            let id = resize.id;
            let claimed = self
                .coord
                .update_shard_map(|m| {
                    if m.active().map(|r| r.id) != Some(id) {
                        return Err(ResizeError::NoResize);
                    }
                    m.handle_opening(shard)
                })
                .await;
            match claimed {
                Ok(map) => {
                    tracing::info!(
                        shard,
                        version = map.version,
                        "claimed a receiving shard's opening"
                    );
                }
                Err(err) => {
                    tracing::info!(shard, %err, "a receiving shard's opening not claimed; it does not open");
                    return false;
                }
            }
        }
        true
    }

    /// Writes one transition; losing to another writer, or a state that
    /// moved on, is fine (the next look acts on what is there).
    async fn update(&self, transition: &Transition) {
        let what = transition.name();
        match self.coord.update_shard_map(|m| transition.apply(m)).await {
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
            .filter(|s| !resize.opened.contains_key(s))
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

/// How old a giving shard's last applied delta may be for a receiving
/// shard's stream to count as in step, with deltas cut every `interval`:
/// three intervals and a second, or the giving side's stall bound (a
/// giving primary may hold a cut back that long for a receiver that
/// keeps up) if longer.
pub fn in_step_within(interval: Duration) -> Duration {
    (interval * 3 + Duration::from_secs(1)).max(crate::delta::stall_bound(
        u64::try_from(interval.as_millis()).unwrap_or(u64::MAX),
    ))
}
