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

use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_coord::{CoordError, EtcdCoordinator, Resize, ResizeError, ResizeState, ShardMap};
use tessera_rpc::sync::LockExt;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::delta::{Feed, ResizePlan, Sender};
use crate::replication::Replication;
use crate::store::{OriginSet, Store};

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
/// `return` argument names the server; always false without the
/// `failpoints` feature).
fn stalled_here(name: &str, me: &str) -> bool {
    #[cfg(feature = "failpoints")]
    {
        fail::eval(name, |arg| arg.as_deref() == Some(me)).unwrap_or(false)
    }
    #[cfg(not(feature = "failpoints"))]
    {
        let _ = (name, me);
        false
    }
}

/// A server's part in resizes (module docs).
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
    /// How old a giving shard's last applied delta may be for its stream
    /// to count as in step (twice that, once reported ready, before it
    /// counts as behind: a slow receiver does not flip back and forth).
    in_step_within: Duration,
    /// The receiving shards this server opened as their primary, with
    /// the resize (its id) and the stream position they opened at, until
    /// the map says so (`Resize::opened`).
    opened: std::sync::Mutex<Vec<(u64, u32, u64)>>,
    /// The shards this server gave away whole in a finished shrink and
    /// dropped the rows of.
    retired: std::sync::Mutex<std::collections::BTreeSet<u32>>,
}

/// Whether each hosted shard of `store` receives keys now as `map` says
/// (no copy of it serves): a receiving shard of a growth in progress, of
/// a server of the new count, from the plan until its copy holds the
/// moved keys. After the cut-over that is once the map names the
/// position its primary opened it at and this copy holds it (a replica
/// copied the opened primary's rows; a primary promoted from such a
/// replica), or, on the primary that opened it, until the map says so
/// (`opened_here`: shard and position).
fn receiving_now(
    store: &Store,
    map: Option<&ShardMap>,
    opened_here: &[(u32, u64)],
) -> Vec<(u32, bool)> {
    // The last resize, done included: a replica that has not copied its
    // opened primary yet does not serve after the resize is done either.
    let resize = map.and_then(|m| m.resize.as_ref()).filter(|r| {
        r.to > r.from && store.num_shards() == r.to && r.state != ResizeState::Cancelled
    });
    store
        .hosted()
        .iter()
        .map(|&shard| {
            let closed = resize.is_some_and(|r| {
                if !r.receiving().any(|s| s == shard) || given_away(store, shard) {
                    return false;
                }
                if matches!(r.state, ResizeState::Planned | ResizeState::Copying) {
                    return true;
                }
                !holds_opened(store, r, shard, opened_here)
            });
            (shard, closed)
        })
        .collect()
}

/// Whether this copy of receiving shard `shard` holds the position its
/// primary opened it at in `r` (the map's `opened`, or `opened_here` on
/// the primary that opened it, until the map says so).
fn holds_opened(store: &Store, r: &Resize, shard: u32, opened_here: &[(u32, u64)]) -> bool {
    let held = store.version(shard).unwrap_or_default().position;
    let at = r.opened.get(&shard).copied().or_else(|| {
        opened_here
            .iter()
            .find(|(s, _)| *s == shard)
            .map(|&(_, p)| p)
    });
    at.is_some_and(|at| held >= at)
}

/// Whether `shard` of `store` was given away whole in a shrink (its keys
/// fenced, from the cut-over, for a count that has no such shard): it
/// takes no part in a later resize.
fn given_away(store: &Store, shard: u32) -> bool {
    store.moved(shard).is_some_and(|(to, _)| shard >= to)
}

/// What a shrink `map` names calls for on each hosted shard of `store`
/// that receives keys in it: the count it receives keys of, not opened
/// on this copy yet (`incoming`: its own keys served, the incoming ones
/// refused, a resize feed writes them), or the count it routes by since
/// it opened here (`routes_by`, with the resize's id: the shard's fence
/// is set to it too); both `None` for any other shard, a
/// cancelled shrink, or a server that took the shrunk count. Opened here
/// as in [`receiving_now`].
fn shrink_now(
    store: &Store,
    map: Option<&ShardMap>,
    opened_here: &[(u32, u64)],
) -> Vec<ShrinkState> {
    let resize = map.and_then(|m| m.resize.as_ref()).filter(|r| {
        r.to < r.from && store.num_shards() == r.from && r.state != ResizeState::Cancelled
    });
    store
        .hosted()
        .iter()
        .map(|&shard| {
            let Some(r) = resize.filter(|r| shard < r.to && !given_away(store, shard)) else {
                return (shard, None, None);
            };
            if matches!(r.state, ResizeState::Planned | ResizeState::Copying) {
                return (shard, Some(r.to), None);
            }
            if holds_opened(store, r, shard, opened_here) {
                (shard, None, Some((r.to, r.id)))
            } else {
                (shard, Some(r.to), None)
            }
        })
        .collect()
}

/// Sets each shard's shrink state as `states` ([`shrink_now`]) says,
/// under its write lock where it changes; returns the shards that
/// stopped receiving without opening (a cancel: the caller drops the
/// rows they took). A shrunk count a shard routes by stays until the
/// store takes it (`Resharding::catch_up`), even once the map has moved
/// on to another resize.
fn set_shrink_state(store: &Store, states: &[ShrinkState]) -> Vec<u32> {
    let mut cancelled = Vec::new();
    for &(shard, incoming, routes_by) in states {
        let count = routes_by.map(|(to, _)| to);
        let opens = count.is_some() && store.routes_by(shard) != count;
        if store.incoming(shard) == incoming && !opens {
            continue;
        }
        if let Some(writing) = store.lock_shard(shard) {
            if writing.incoming().is_some() && incoming.is_none() && routes_by.is_none() {
                cancelled.push(shard);
            }
            if let Some((to, id)) = routes_by {
                open_shrunk(store, &writing, to, id);
            }
            store.set_incoming(&writing, incoming);
        }
    }
    cancelled
}

/// Makes the locked shard, receiving keys in a shrink to `to` (resize
/// `id`), route by `to` on this copy: a key `to` routes elsewhere is
/// answered `KeysMoved` (the fence of an earlier growth, which named
/// keys that come back now, is replaced). The caller clears the shard's
/// incoming count after this (a Push checked against neither count is
/// refused).
fn open_shrunk(store: &Store, writing: &crate::store::ShardGuard<'_>, to: u32, id: u64) {
    store.set_routes_by(writing, Some(to));
    store.set_moved(writing, Some((to, id)));
    store.set_moved_open(writing, true);
}

/// A hosted shard, the count it receives keys of in a shrink, and the
/// count (and resize id) it routes by since the shrink opened here.
type ShrinkState = (u32, Option<u32>, Option<(u32, u64)>);

/// The fence `map` calls for on `store`'s giving shards: the count the
/// moved keys are routed by, the map's version, and whether Pushes split
/// by that count are taken (every receiving shard opened); `None` unless
/// a resize from this server's count cut over (or is done). A shrink's
/// giving shards are fenced whole: no key routes to them any more.
fn fence_of(store: &Store, map: &ShardMap) -> Option<(Vec<u32>, u32, u64, bool)> {
    let r = map.resize.as_ref().filter(|r| {
        matches!(r.state, ResizeState::CutOver | ResizeState::Done) && gave(store, r)
    })?;
    // Pushes split by the new count wait until every receiving shard
    // serves: until then a giving shard's windows name only Pushes split
    // by the old count, whatever copy of it sends them
    // (`store/resize.rs`).
    let open = r.state == ResizeState::Done || r.receiving().all(|s| r.opened.contains_key(&s));
    let giving = r.giving().filter(|s| store.hosted().contains(s)).collect();
    Some((giving, r.to, map.version, open))
}

/// Whether `store`'s shards are of `r`'s old count: routed by it, or
/// configured with it (a server that took the count `r` grew to keeps
/// its fence).
fn gave(store: &Store, r: &Resize) -> bool {
    store.num_shards() == r.from || store.configured_shards() == r.from
}

/// Whether `map` reconciles a store that routes by `saved` shards (a
/// checkpoint saved under another count than the configured one): the
/// map's count, or either count of its last resize that was not
/// cancelled (a growth's old count: the moved rows are dropped at the
/// first look, `Resharding::catch_up`; a shrink's old count: its
/// remaining shards route by the new one once they hold their opening
/// position, `shrink_now`). Anything else (a map of another cluster's
/// history, a checkpoint two resizes back) is not.
pub fn reconciles(map: Option<&ShardMap>, saved: u32) -> bool {
    map.is_some_and(|m| {
        m.num_shards == saved
            || m.resize.as_ref().is_some_and(|r| {
                r.state != ResizeState::Cancelled && (r.from == saved || r.to == saved)
            })
    })
}

/// Sets what `map` calls for on `store` before the server serves (the
/// driver keeps it up to date from then on): which shards receive keys,
/// and the fence of moved keys, so that a server started or restarted
/// during a resize serves nothing and applies no Push against them.
pub fn prepare(store: &Store, map: Option<&ShardMap>) {
    for (shard, closed) in receiving_now(store, map, &[]) {
        store.set_receiving(shard, closed);
    }
    set_shrink_state(store, &shrink_now(store, map, &[]));
    // A checkpoint taken while a shrink that was cancelled since copied
    // rows here holds rows of keys this server does not route to it.
    let cancelled = map.and_then(|m| m.resize.as_ref()).filter(|r| {
        r.to < r.from && r.state == ResizeState::Cancelled && store.num_shards() == r.from
    });
    if let Some(r) = cancelled {
        for &shard in store.hosted().iter().filter(|&&s| s < r.to) {
            let dropped = store.drop_moved_rows(shard, store.num_shards());
            if dropped > 0 {
                tracing::info!(shard, rows = dropped, "a cancelled shrink's rows dropped");
            }
        }
    }
    if let Some((giving, to, version, open)) = map.and_then(|m| fence_of(store, m)) {
        for shard in giving {
            if let Some(writing) = store.lock_shard(shard) {
                if store.moved(shard).map(|(n, _)| n) != Some(to) {
                    store.set_moved(&writing, Some((to, version)));
                }
                store.set_moved_open(&writing, open);
            }
        }
    }
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
        // A receiving shard opens about a delta interval after the
        // cut-over, once the fenced deltas are in: a copy that has not
        // heard of it within the in-step bound stops serving the keys it
        // fenced (`Store::moved_reads_over`).
        let in_step_within = (interval * 3 + Duration::from_secs(1)).max(
            crate::delta::stall_bound(u64::try_from(interval.as_millis()).unwrap_or(u64::MAX)),
        );
        store.bound_moved_reads(in_step_within);
        Self {
            me,
            coord,
            map,
            store,
            replication,
            sender,
            feed,
            // A giving primary may hold a cut back for a receiver that
            // keeps up for as long as its stall bound.
            in_step_within,
            opened: std::sync::Mutex::new(Vec::new()),
            retired: std::sync::Mutex::new(Default::default()),
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
        // Tests stall one server's look (the fail point's argument names
        // it) to hold its resize state behind the map.
        if stalled_here("reshard::step", &self.me) {
            return;
        }
        let resize = map.and_then(ShardMap::active);
        if let Some(map) = map {
            self.catch_up(map).await;
            self.fence(map).await;
            self.unfence(map).await;
        }
        let num_shards = self.store.num_shards();
        // Receiving: a server of the new count hosting a receiving shard
        // (growing), or of the old count hosting a remaining one
        // (shrinking).
        let receiving: Vec<u32> = match resize {
            Some(r)
                if (r.to > r.from && num_shards == r.to)
                    || (r.to < r.from && num_shards == r.from) =>
            {
                r.receiving()
                    .filter(|&s| self.store.hosted().contains(&s) && !given_away(&self.store, s))
                    .collect()
            }
            _ => Vec::new(),
        };
        let opened_here: Vec<(u32, u64)> = {
            let mut opened = self.opened.locked();
            opened.retain(|(id, _, _)| resize.is_some_and(|r| r.id == *id));
            opened.iter().map(|&(_, s, p)| (s, p)).collect()
        };
        // Its rows are incomplete until it opens: no copy of it serves
        // (a cancel opens it too).
        for (shard, closed) in receiving_now(&self.store, map, &opened_here) {
            self.store.set_receiving(shard, closed);
        }
        // A shrink's receiving shards keep serving their own keys.
        let states = shrink_now(&self.store, map, &opened_here);
        let store = Arc::clone(&self.store);
        let shrinking = tokio::task::spawn_blocking(move || {
            // Cancelled: the rows taken for it are not this shard's.
            for shard in set_shrink_state(&store, &states) {
                let dropped = store.drop_moved_rows(shard, store.num_shards());
                tracing::info!(shard, rows = dropped, "a cancelled shrink's rows dropped");
            }
        });
        if let Err(err) = shrinking.await {
            tracing::warn!(%err, "setting the shards' shrink state failed");
            return;
        }
        // The fence, the receiving and shrink states and the count stand
        // as `map` says: a shard led from now on may take Pushes
        // (`Store::resize_state_reaches`).
        if let Some(map) = map {
            self.store.set_resize_state_version(map.version);
        }
        let cut_over = resize.is_some_and(|r| r.state == ResizeState::CutOver);
        let Some(resize) = resize else {
            self.give(None);
            self.receive(None);
            return;
        };
        let now = Instant::now();
        let leads: Vec<u32> = receiving
            .iter()
            .copied()
            .filter(|&s| self.store.taking_rows(s))
            .filter(|&s| self.replication.leading_epoch(s, now).is_some())
            .collect();
        if leads.is_empty() {
            self.receive(None);
        } else {
            self.receive(Some(resize.to));
            self.drive(resize, &leads).await;
        }
        if cut_over {
            self.report_opened(resize, &opened_here).await;
            // Every receiving shard serves: the resize is done (any of
            // their primaries writes it).
            let all_opened = resize.receiving().all(|s| resize.opened.contains_key(&s));
            let leads_one = receiving
                .iter()
                .any(|&s| self.replication.leading_epoch(s, now).is_some());
            if all_opened && leads_one {
                self.update("finish", ShardMap::finish).await;
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

    /// As a server of a giving shard (any copy of it) in a growth that
    /// cut over: fences the keys that moved, under the shard's write lock
    /// (`store/resize.rs`). The fence stays once the resize is done: the
    /// keys belong elsewhere. Set on every copy, so that a replica
    /// promoted later refuses them from its first Push (it sees the map
    /// long before a failover can make it primary: the watch delivers in
    /// milliseconds, a lease runs for seconds).
    async fn fence(&self, map: &ShardMap) {
        let Some((giving, to, version, open)) = fence_of(&self.store, map) else {
            return;
        };
        for shard in giving {
            // Fenced for this resize's count (an earlier growth's fence is
            // widened: its moved keys route elsewhere under the new count
            // too).
            let fenced = self.store.moved(shard).is_some_and(|(n, _)| n == to);
            if fenced && self.store.new_count_open(shard) == open {
                continue;
            }
            if let Some(writing) = self.store.lock_shard_async(shard).await {
                if !fenced {
                    self.store.set_moved(&writing, Some((to, version)));
                }
                self.store.set_moved_open(&writing, open);
            }
        }
    }

    /// As a server whose shards gave keys in a growth that is over (done,
    /// whether this server saw it or the map moved on to another resize):
    /// fences the keys that moved for the count they are routed by now,
    /// drops their rows (nothing reads or changes them), and routes by
    /// that count, so that another resize can follow. The count is the
    /// one before the resize in progress, or the map's.
    async fn catch_up(&self, map: &ShardMap) {
        let target = map.active().map_or(map.num_shards, |r| r.from);
        let own = self.store.num_shards();
        // Fewer shards: a shrink from this server's count is over (or a
        // growth's new server is ahead of the map: nothing to do there).
        if target < own {
            self.catch_up_shrunk(target).await;
        }
        if target <= own {
            return;
        }
        let (store, version) = (Arc::clone(&self.store), map.version);
        let dropped = tokio::task::spawn_blocking(move || {
            let mut dropped = 0;
            for &shard in store.hosted() {
                if let Some(writing) = store.lock_shard(shard) {
                    if store.moved(shard).is_none_or(|(n, _)| n < target) {
                        store.set_moved(&writing, Some((target, version)));
                    }
                    if store.moved(shard).is_some_and(|(n, _)| n == target) {
                        store.set_moved_open(&writing, true);
                    }
                }
                dropped += store.drop_moved_rows(shard, target);
            }
            dropped
        })
        .await
        .unwrap_or(0);
        tracing::info!(
            num_shards = target,
            rows = dropped,
            "dropped the rows finished growths moved away"
        );
        // What remains of each shard is that shard of the new count.
        self.store.adopt_num_shards(target);
    }

    /// As a server of a shrink to `target` that is over (the map routes
    /// by `target`, whatever resize it moved on to): a shard given away
    /// whole (fenced at the cut-over) drops its rows once every remaining
    /// shard serves them (its servers are to be stopped), and a server
    /// whose other shards all opened on this copy routes by `target` from
    /// now on, as one started with it would. Nothing for a server that
    /// took no part (a growth's new server, ahead of the map).
    async fn catch_up_shrunk(&self, target: u32) {
        let store = Arc::clone(&self.store);
        let retire: Vec<u32> = {
            let mut retired = self.retired.locked();
            store
                .hosted()
                .iter()
                .copied()
                .filter(|&s| given_away(&store, s) && store.new_count_open(s) && retired.insert(s))
                .collect()
        };
        let hosted = store.hosted();
        let adopt = hosted.iter().any(|&s| store.routes_by(s) == Some(target))
            && hosted
                .iter()
                .all(|&s| given_away(&store, s) || store.routes_by(s) == Some(target));
        if retire.is_empty() && !adopt {
            return;
        }
        tokio::task::spawn_blocking(move || {
            for shard in retire {
                let dropped = store.drop_moved_rows(shard, target);
                tracing::info!(
                    shard,
                    rows = dropped,
                    "a shard given away in a finished shrink dropped its rows; stop its servers"
                );
            }
            if adopt && store.adopt_shrunk_count(target) {
                for &shard in store.hosted() {
                    if let Some(writing) = store.lock_shard(shard) {
                        store.set_routes_by(&writing, None);
                    }
                }
            }
        })
        .await
        .unwrap_or(());
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
    /// shards' deduplication windows (fenced deltas carry them) are read from the
    /// feed, the feed closes (no delta still being applied), then, under
    /// each shard's write lock, its replicas are cut off to copy it from
    /// here (the rows came outside its stream), it takes the windows and
    /// it serves. A resize feed writes a
    /// shard only while it receives (`delta/feed/write.rs`), so no row
    /// still on its way lands after its first Push.
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
            // A copy of the primary that opened the shard in this resize
            // (it stopped before the map said so): the windows of that
            // opening stand as they are, the shard's own window of a
            // shrink among them; its present window holds only Pushes
            // split by the new count.
            let again = self.store.opened_in(shard, resize.id);
            match self.replication.restart_replicas(&mut writing) {
                Some(version) => {
                    // Before its first Push: a part retried across the
                    // cut-over leaves out the keys a giving shard applied
                    // it to (`store/resize.rs`). A shrink's receiving
                    // shard keeps its own window as one of them, and
                    // starts a new one for Pushes split by the new count.
                    let shrink = resize.to < resize.from;
                    if again {
                        tracing::info!(
                            shard,
                            "a receiving shard copied from the primary that opened it opens again with that opening's windows"
                        );
                    } else {
                        let mut giving = windows.clone();
                        if shrink {
                            giving.push((shard, self.store.dedup_windows(shard)));
                            giving.sort_by_key(|(s, _)| *s);
                            self.store.clear_dedup(&writing);
                        }
                        self.store.set_origin_windows(
                            shard,
                            OriginSet {
                                from: resize.from,
                                resize: resize.id,
                                giving,
                            },
                        );
                    }
                    self.opened
                        .locked()
                        .push((resize.id, shard, version.position));
                    if shrink {
                        open_shrunk(&self.store, &writing, resize.to, resize.id);
                        self.store.set_incoming(&writing, None);
                    } else {
                        self.store.set_receiving(shard, false);
                    }
                    // Its serving fleet copies it as it opened.
                    self.store.restart_streams();
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

    /// As a server of a giving shard of a resize cancelled after its
    /// cut-over (no receiving shard opened, `tessera_coord::shard_map`):
    /// lifts the fence it set for it, so the moved keys are served here
    /// again, from the rows their Pushes left before the fence. A store
    /// that took a finished growth's count keeps the fence of that count.
    async fn unfence(&self, map: &ShardMap) {
        let Some(r) = map
            .resize
            .as_ref()
            .filter(|r| r.state == ResizeState::Cancelled && gave(&self.store, r))
        else {
            return;
        };
        for &shard in self.store.hosted() {
            let set_in_it = self
                .store
                .moved(shard)
                .is_some_and(|(to, version)| to == r.to && version > r.id);
            if !set_in_it {
                continue;
            }
            if let Some(writing) = self.store.lock_shard_async(shard).await {
                let own = self.store.num_shards();
                let before = (own != self.store.configured_shards()).then_some((own, map.version));
                self.store.set_moved(&writing, before);
                self.store.set_moved_open(&writing, before.is_some());
                tracing::info!(
                    shard,
                    "a resize cancelled after its cut-over: the moved keys are served here again"
                );
            }
        }
    }

    /// As the primary that opened receiving shards `opened` (shard and
    /// position): says so in the map (the giving shards stop streaming to
    /// them; their copies serve once they hold the position).
    async fn report_opened(&self, resize: &Resize, opened: &[(u32, u64)]) {
        // Tests stop a primary between its opening and this report
        // (`tests/reshard_failover.rs`).
        fail::fail_point!("reshard::report_opened", |_| ());
        for &(shard, position) in opened {
            if !resize.opened.contains_key(&shard) {
                self.update("report opened", |m| m.handle_opened(shard, position))
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
