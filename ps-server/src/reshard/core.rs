//! The resize's decisions on one server, sans-IO: [`ReshardCore::look`]
//! takes what the server knows at one look (the shard map, the shards it
//! leads, its resize feed's health), sets the store's resize state as the
//! map calls for (fence, receiving and shrink states, catching up with a
//! finished resize), and returns the [`Action`]s that need the network:
//! shard-map writes, opening receiving shards, streaming to receivers or
//! taking their deltas. The driver ([`super::Resharding`]) gathers the
//! look and carries the actions out; the control-plane simulation runs
//! the same core for many servers in virtual time.
//!
//! Call order, per look: [`ReshardCore::look`], then the actions in the
//! order returned; for [`Action::Open`], after the claim is written and
//! the feed's fenced windows read and the feed closed, each shard under
//! its write lock with its replicas cut off: [`ReshardCore::open_shard`].
//! The core reads no clock: the in-step bound is compared with the ages
//! the feed's health reports, and the leads are judged by the caller.
//!
//! It locks shards with the store's blocking lock: the driver calls it off
//! the runtime's workers.

use std::collections::BTreeSet;
use std::time::Duration;

use tessera_coord::{Resize, ResizeState, ShardMap};

use super::state::{
    fence_of, fenced_for, gave, given_away, open_shrunk, receiving_now, set_shrink_state,
    shrink_now,
};
use tessera_store::store::{OriginSet, ShardGuard, Store, TableWindows};
use tessera_store::version::Version;

/// What a server knows at one look ([`ReshardCore::look`]).
#[derive(Debug, Clone, Default)]
pub struct Look {
    /// The shard map, as the watch last delivered it.
    pub map: Option<ShardMap>,
    /// The hosted shards this server leads now (its lease valid, not
    /// handing over), each with the epoch it leads it in.
    pub leads: Vec<(u32, u64)>,
    /// Its resize feed's health (`None`: no feed).
    pub feed: Option<tessera_proto::v1::ServingHealth>,
}

impl Look {
    /// Whether this server leads `shard` now.
    pub fn leads(&self, shard: u32) -> bool {
        self.leads.iter().any(|&(s, _)| s == shard)
    }

    /// The shards this server leads now.
    pub fn led(&self) -> Vec<u32> {
        self.leads.iter().map(|&(s, _)| s).collect()
    }
}

/// One shard-map transition a look asks for, written as a
/// compare-and-swap on the revision read (losing it is fine: the next
/// look acts on what is there).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transition {
    /// Planned to copying ([`ShardMap::start_copying`]).
    StartCopying,
    /// A receiving shard in step with the giving shards, or fallen behind
    /// ([`ShardMap::handle_ready`]).
    Ready {
        /// The receiving shard.
        shard: u32,
        /// In step.
        in_step: bool,
    },
    /// Every receiving shard ready ([`ShardMap::cut_over`]); the driver
    /// writes it only if every receiving shard has a primary in etcd (a
    /// `ready` outlives the restart of the server that wrote it).
    CutOver,
    /// A receiving shard opened at a stream position
    /// ([`ShardMap::handle_opened`]).
    Opened {
        /// The shard.
        shard: u32,
        /// The position its primary opened it at.
        position: u64,
    },
    /// Every receiving shard opened ([`ShardMap::finish`]).
    Finish,
}

impl Transition {
    /// The transition applied to `map`.
    pub fn apply(&self, map: &ShardMap) -> Result<ShardMap, tessera_coord::ResizeError> {
        match *self {
            Self::StartCopying => map.start_copying(),
            Self::Ready { shard, in_step } => map.handle_ready(shard, in_step),
            Self::CutOver => map.cut_over(),
            Self::Opened { shard, position } => map.handle_opened(shard, position),
            Self::Finish => map.finish(),
        }
    }

    /// For logs.
    pub fn name(&self) -> &'static str {
        match self {
            Self::StartCopying => "start copying",
            Self::Ready { .. } => "report ready",
            Self::CutOver => "cut over",
            Self::Opened { .. } => "report opened",
            Self::Finish => "finish",
        }
    }
}

/// What a look asks the driver to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Write a transition.
    Update(Transition),
    /// Open receiving shards `shards` of `resize` (this server leads
    /// them, and its feed holds every giving shard's fenced delta): claim
    /// each opening in the map (a compare-and-swap naming `resize`; none
    /// opens unless every claim holds), read the feed's fenced windows,
    /// close the feed, then [`ReshardCore::open_shard`] each.
    Open {
        /// The resize, as the map named it.
        resize: Resize,
        /// The shards.
        shards: Vec<u32>,
    },
    /// Stream deltas routed by the resize's new count to the primaries of
    /// its receiving shards that did not open yet (etcd's primary keys),
    /// or stop streaming (`None`).
    Give(Option<Resize>),
    /// Take a resize's deltas routed by this count, or refuse them.
    Receive(Option<u32>),
}

/// A server's part in resizes, without I/O (module docs).
#[derive(Debug)]
pub struct ReshardCore {
    /// How old a giving shard's last applied delta may be for its stream
    /// to count as in step (twice that, once reported ready, before it
    /// counts as behind: a slow receiver does not flip back and forth).
    in_step_within: Duration,
    /// The receiving shards this server opened as their primary, with
    /// the resize (its id) and the stream position they opened at, until
    /// the map says so (`Resize::opened`).
    opened: Vec<(u64, u32, u64)>,
    /// The shards this server gave away whole in a finished shrink and
    /// dropped the rows of.
    retired: BTreeSet<u32>,
    /// The resize and the receiving shards (with the epoch each was led
    /// in) the feed was opened for; `None` while closed.
    fed: Option<(u64, Vec<(u32, u64)>)>,
}

impl ReshardCore {
    /// A core whose receiving shards count as in step with a giving
    /// shard applied within `in_step_within`.
    pub fn new(in_step_within: Duration) -> Self {
        Self {
            in_step_within,
            opened: Vec::new(),
            retired: BTreeSet::new(),
            fed: None,
        }
    }

    /// The in-step bound.
    pub fn in_step_within(&self) -> Duration {
        self.in_step_within
    }

    /// One look at the resize in progress: sets `store`'s resize state as
    /// `look.map` calls for, and returns what needs the network, in order.
    pub fn look(&mut self, store: &Store, look: &Look) -> Vec<Action> {
        let map = look.map.as_ref();
        let resize = map.and_then(ShardMap::active);
        if let Some(map) = map {
            self.catch_up(store, map, &look.led());
            fence(store, map);
            unfence(store, map);
            lift_stale_fence(store, map);
        }
        let num_shards = store.num_shards();
        // Receiving: a server of the new count hosting a receiving shard
        // (growing), or of the old count hosting a remaining one
        // (shrinking).
        let receiving: Vec<u32> = match resize {
            Some(r)
                if (r.to > r.from && num_shards == r.to)
                    || (r.to < r.from && num_shards == r.from) =>
            {
                r.receiving()
                    .filter(|&s| store.hosted().contains(&s) && !given_away(store, s))
                    .collect()
            }
            _ => Vec::new(),
        };
        self.opened
            .retain(|(id, _, _)| resize.is_some_and(|r| r.id == *id));
        let opened_here: Vec<(u32, u64)> = self.opened.iter().map(|&(_, s, p)| (s, p)).collect();
        // Its rows are incomplete until it opens: no copy of it serves
        // (nor after a cancel: nothing is routed to it).
        for (shard, closed) in receiving_now(store, map, &opened_here) {
            store.set_receiving(shard, closed);
        }
        // A shrink's receiving shards keep serving their own keys;
        // cancelled, the rows taken for it are not this shard's.
        for shard in set_shrink_state(store, &shrink_now(store, map, &opened_here)) {
            let dropped = store.drop_moved_rows(shard, store.num_shards());
            tracing::info!(shard, rows = dropped, "a cancelled shrink's rows dropped");
        }
        // The fence, the receiving and shrink states and the count stand
        // as `map` says: a shard led from now on may take Pushes
        // (`Store::resize_state_reaches`).
        if let Some(map) = map {
            store.set_resize_state_version(map.version);
        }
        let Some(resize) = resize else {
            self.fed = None;
            return vec![Action::Give(None), Action::Receive(None)];
        };
        let mut actions = Vec::new();
        let leads: Vec<u32> = receiving
            .iter()
            .copied()
            .filter(|&s| store.taking_rows(s) && look.leads(s))
            .collect();
        // A copy of the primary that opened the shard in this resize (it
        // stopped before the map said so) holds every moved key and the
        // Pushes taken since: it opens again at once, and its rows are not
        // written by a feed (a giving shard's fenced rows would overwrite
        // those Pushes).
        let (again, leads): (Vec<u32>, Vec<u32>) = leads
            .into_iter()
            .partition(|&s| resize.state == ResizeState::CutOver && store.opened_in(s, resize.id));
        let terms: Vec<(u32, u64)> = look
            .leads
            .iter()
            .copied()
            .filter(|(s, _)| leads.contains(s))
            .collect();
        if !again.is_empty() {
            self.fed = None;
            actions.push(Action::Receive(None));
            actions.push(Action::Open {
                resize: resize.clone(),
                shards: again,
            });
        } else if leads.is_empty() {
            self.fed = None;
            actions.push(Action::Receive(None));
        } else if self.fed.as_ref() != Some(&(resize.id, terms.clone())) {
            // The lead was taken (or taken again) since the feed opened:
            // what it applied was written under another term, and a copy
            // of the last primary may have replaced those rows since (a
            // look stalled through the term between): it starts over, and
            // its health counts from the next look.
            self.fed = Some((resize.id, terms));
            actions.push(Action::Receive(None));
            actions.push(Action::Receive(Some(resize.to)));
        } else {
            actions.push(Action::Receive(Some(resize.to)));
            self.drive(resize, &leads, look.feed.as_ref(), &mut actions);
        }
        if resize.state == ResizeState::CutOver {
            // Opened on an earlier look: said in the map now (the giving
            // shards stop streaming to them; their copies serve once they
            // hold the position).
            for &(shard, position) in &opened_here {
                if !resize.opened.contains_key(&shard) {
                    actions.push(Action::Update(Transition::Opened { shard, position }));
                }
            }
            // Every receiving shard serves: the resize is done (any of
            // their primaries writes it).
            let all_opened = resize.receiving().all(|s| resize.opened.contains_key(&s));
            let leads_one = receiving.iter().any(|&s| look.leads(s));
            if all_opened && leads_one {
                actions.push(Action::Update(Transition::Finish));
            }
        }
        // Giving: the primary of a giving shard, of the old count.
        let gives = num_shards == resize.from
            && matches!(resize.state, ResizeState::Copying | ResizeState::CutOver)
            && resize.giving().any(|s| look.leads(s));
        actions.push(Action::Give(gives.then(|| resize.clone())));
        actions
    }

    /// As the primary of receiving shards `leads`: moves a planned resize
    /// to copying, reports each shard ready or not, cuts over once every
    /// receiving shard is ready, and after the cut-over opens its shards
    /// once its feed holds every giving shard's fenced delta.
    fn drive(
        &self,
        resize: &Resize,
        leads: &[u32],
        feed: Option<&tessera_proto::v1::ServingHealth>,
        actions: &mut Vec<Action>,
    ) {
        match resize.state {
            ResizeState::Planned => actions.push(Action::Update(Transition::StartCopying)),
            ResizeState::Copying => {
                let mut all_ready = true;
                for &shard in leads {
                    let ready = resize.ready.binary_search(&shard).is_ok();
                    let within = if ready {
                        self.in_step_within * 2
                    } else {
                        self.in_step_within
                    };
                    let in_step = in_step(feed, resize, within);
                    all_ready &= in_step;
                    if ready != in_step {
                        tracing::info!(
                            shard,
                            in_step,
                            "a receiving shard's rows are {} the giving shards'",
                            if in_step { "in step with" } else { "behind" }
                        );
                        actions.push(Action::Update(Transition::Ready { shard, in_step }));
                    }
                }
                let others_ready = resize
                    .receiving()
                    .filter(|s| !leads.contains(s))
                    .all(|s| resize.ready.binary_search(&s).is_ok());
                if all_ready && others_ready && !resize.hold {
                    // Compared on the revision read: a shard that fell
                    // out of step meanwhile wrote `ready` again, and the
                    // cut-over is refused.
                    actions.push(Action::Update(Transition::CutOver));
                }
            }
            ResizeState::CutOver if fenced(feed, resize) => actions.push(Action::Open {
                resize: resize.clone(),
                shards: leads.to_vec(),
            }),
            _ => {}
        }
    }

    /// Opens receiving shard `writing` locks in `resize` (its primary,
    /// every giving shard's fenced delta applied, the feed closed): its
    /// replicas were cut off at `version` (they copy it from here; the
    /// rows came outside its stream), it keeps the giving shards'
    /// deduplication windows `windows` and serves. A copy of the primary
    /// that opened the shard in this resize (it stopped before the map
    /// said so) keeps the windows of that opening as they are, the
    /// shard's own window of a shrink among them: its present window
    /// holds only Pushes split by the new count.
    pub fn open_shard(
        &mut self,
        store: &Store,
        writing: &ShardGuard<'_>,
        resize: &Resize,
        version: Version,
        windows: &[(u32, TableWindows)],
    ) {
        let shard = writing.shard();
        // Before its first Push: a part retried across the cut-over
        // leaves out the keys a giving shard applied it to
        // (`store/resize.rs`). A shrink's receiving shard keeps its own
        // window as one of them, and starts a new one for Pushes split by
        // the new count.
        let shrink = resize.to < resize.from;
        if store.opened_in(shard, resize.id) {
            tracing::info!(
                shard,
                "a receiving shard copied from the primary that opened it opens again with that opening's windows"
            );
        } else {
            let mut giving = windows.to_vec();
            if shrink {
                giving.push((shard, store.dedup_windows(shard)));
                giving.sort_by_key(|(s, _)| *s);
                store.clear_dedup(writing);
            }
            store.set_origin_windows(
                shard,
                OriginSet {
                    from: resize.from,
                    resize: resize.id,
                    giving,
                },
            );
        }
        self.opened.push((resize.id, shard, version.position));
        if shrink {
            open_shrunk(store, writing, resize.to, resize.id);
            store.set_incoming(writing, None);
        } else {
            store.set_receiving(shard, false);
        }
        // Its serving fleet copies it as it opened.
        store.restart_streams();
        tracing::info!(shard, %version, "a receiving shard holds every moved key and serves them; its replicas copy it");
        metrics::counter!("tessera_ps_resize_opened_total").increment(1);
    }

    /// As a server whose shards gave keys in a growth that is over (done,
    /// whether this server saw it or the map moved on to another resize):
    /// fences the keys that moved for the count they are routed by now,
    /// drops their rows (nothing reads or changes them), and routes by
    /// that count, so that another resize can follow. The count is the
    /// one before the resize in progress, or the map's.
    fn catch_up(&mut self, store: &Store, map: &ShardMap, leads: &[u32]) {
        let target = map.active().map_or(map.num_shards, |r| r.from);
        // A shrink that opened on this copy and is over, though the map
        // routes by this store's count again: its looks stalled through
        // the shrink's end and a whole growth back (the watch delivers the
        // newest map, not each one). It takes the shrunk count first, as
        // it would have at the shrink's end, then catches up the growth;
        // routing by the shrunk count it refused every Push split by the
        // map's for good (control-plane simulation, seed 13296).
        if let Some(shrunk) = shrunk_here(store)
            && shrunk < target
            && !map
                .active()
                .is_some_and(|r| r.from == store.num_shards() && r.to == shrunk)
        {
            self.catch_up_shrunk(store, map, shrunk, leads);
        }
        let own = store.num_shards();
        // Fewer shards: a shrink from this server's count is over (or a
        // growth's new server is ahead of the map: nothing to do there).
        if target < own {
            self.catch_up_shrunk(store, map, target, leads);
        }
        if target <= own {
            return;
        }
        // A shrink from the count taken is the map's last resize: a
        // remaining shard's copy may hold the keys it brings (a copy of the
        // primary that opened it, installed before this look): they stay.
        let shrink_to = map
            .resize
            .as_ref()
            .filter(|r| r.from == target && r.to < target && r.state != ResizeState::Cancelled)
            .map(|r| r.to);
        let mut dropped = 0;
        for &shard in store.hosted() {
            if let Some(writing) = store.lock_shard(shard) {
                if store.moved(shard).is_none_or(|(n, _)| n < target) {
                    store.set_moved(&writing, Some((target, map.version)));
                }
                if store.moved(shard).is_some_and(|(n, _)| n == target) {
                    store.set_moved_open(&writing, true);
                }
            }
            let mut counts = vec![target];
            counts.extend(shrink_to.filter(|&to| shard < to));
            dropped += store.drop_rows_routed_elsewhere(shard, &counts);
        }
        tracing::info!(
            num_shards = target,
            rows = dropped,
            "dropped the rows finished growths moved away"
        );
        // What remains of each shard is that shard of the new count.
        store.adopt_num_shards(target);
    }

    /// As a server of a shrink to `target` that is over (the map routes
    /// by `target`, whatever resize it moved on to): a shard given away
    /// whole (fenced at the cut-over) drops its rows once every remaining
    /// shard serves them (its servers are to be stopped), and a server
    /// whose other shards all opened on this copy routes by `target` from
    /// now on, as one started with it would. Nothing for a server that
    /// took no part (a growth's new server, ahead of the map).
    fn catch_up_shrunk(&mut self, store: &Store, map: &ShardMap, target: u32, leads: &[u32]) {
        let retire: Vec<u32> = store
            .hosted()
            .iter()
            .copied()
            .filter(|&s| given_away(store, s) && store.new_count_open(s) && self.retired.insert(s))
            .collect();
        let hosted = store.hosted();
        let own = store.num_shards();
        let shrink_in_map = map
            .resize
            .as_ref()
            .is_some_and(|r| r.from == own && r.to == target && r.state != ResizeState::Cancelled);
        if !shrink_in_map {
            // The map moved on past the shrink before this copy's look
            // placed it, but the copy holds the opening (it copied the
            // primary that opened the shard: the opening's origin windows
            // came with it): it routes by the shrunk count, as one that
            // saw the shrink would.
            for &shard in hosted {
                let opened = store
                    .origin_windows(shard)
                    .filter(|o| o.from == own)
                    .map(|o| o.resize);
                if shard >= target
                    || given_away(store, shard)
                    || store.routes_by(shard) == Some(target)
                {
                    continue;
                }
                if let Some(id) = opened
                    && let Some(writing) = store.lock_shard(shard)
                {
                    open_shrunk(store, &writing, target, id);
                    store.set_incoming(&writing, None);
                }
            }
        }
        let adopt = hosted.iter().any(|&s| store.routes_by(s) == Some(target))
            && hosted
                .iter()
                .all(|&s| given_away(store, s) || store.routes_by(s) == Some(target));
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
            return;
        }
        // The shrink is no longer the map's last resize, and a remaining
        // shard (a growth's new server, ahead of the map, hosts none)
        // never opened on this copy: it missed the whole shrink (its
        // watch delivers the newest map, not each one), so `shrink_now`
        // cannot place it any more, and nothing in the map says which
        // position holds the keys the shrink brought to it.
        if adopt || shrink_in_map {
            return;
        }
        let missed: Vec<u32> = hosted
            .iter()
            .copied()
            .filter(|&s| s < target && !given_away(store, s) && store.routes_by(s) != Some(target))
            .collect();
        if missed.is_empty() {
            return;
        }
        if let Some(&led) = missed.iter().find(|s| leads.contains(s)) {
            // A primary cannot copy from itself: it waits for another copy
            // to lead (it could not have opened the shrink it missed).
            tracing::error!(
                shard = led,
                num_shards = target,
                "this primary missed a whole shrink and cannot tell whether it holds the keys it brought; it waits for the lead to move"
            );
            return;
        }
        // A replica forgets its version, so that its stream breaks and it
        // copies the shard whole from its primary (which opened it), and
        // takes the count.
        for &shard in &missed {
            if let Some(mut writing) = store.lock_shard(shard) {
                writing.set_version(tessera_store::version::Version::default());
                store.set_routes_by(&writing, None);
                store.set_incoming(&writing, None);
            }
        }
        if store.adopt_shrunk_count(target) {
            for &shard in &missed {
                if let Some(writing) = store.lock_shard(shard) {
                    let fence =
                        (target != store.configured_shards()).then_some((target, map.version));
                    store.set_moved(&writing, fence);
                    store.set_moved_open(&writing, fence.is_some());
                }
            }
            tracing::warn!(
                num_shards = target,
                shards = ?missed,
                "this copy missed a whole shrink: it takes the count and copies its shards anew"
            );
        }
    }
}

/// As a server of a giving shard (any copy of it) in a resize that cut
/// over: fences the keys that moved, under the shard's write lock
/// (`store/resize.rs`). The fence stays once the resize is done: the keys
/// belong elsewhere. Set on every copy, so that a replica promoted later
/// refuses them from its first Push (it sees the map long before a
/// failover can make it primary: the watch delivers in milliseconds, a
/// lease runs for seconds; and it takes the lead only once its resize
/// state reached the map it read after winning).
fn fence(store: &Store, map: &ShardMap) {
    let Some((giving, to, version, open, id)) = fence_of(store, map) else {
        return;
    };
    for shard in giving {
        // Fenced for this resize (an earlier growth's fence is widened:
        // its moved keys route elsewhere under the new count too; a
        // cancelled one's to the same count is set anew).
        let fenced = fenced_for(store, shard, to, id);
        if fenced && store.new_count_open(shard) == open {
            continue;
        }
        if let Some(writing) = store.lock_shard(shard) {
            if !fenced {
                store.set_moved(&writing, Some((to, version)));
            }
            store.set_moved_open(&writing, open);
        }
    }
}

/// As a server of a giving shard of a resize cancelled after its
/// cut-over (no receiving shard opened, `tessera_coord::shard_map`): lifts
/// the fence it set for it, so the moved keys are served here again,
/// from the rows their Pushes left before the fence. A store that took a
/// finished growth's count keeps the fence of that count.
fn unfence(store: &Store, map: &ShardMap) {
    let Some(r) = map
        .resize
        .as_ref()
        .filter(|r| r.state == ResizeState::Cancelled && gave(store, r))
    else {
        return;
    };
    for &shard in store.hosted() {
        let set_in_it = store
            .moved(shard)
            .is_some_and(|(to, version)| to == r.to && version > r.id);
        if !set_in_it {
            continue;
        }
        if let Some(writing) = store.lock_shard(shard) {
            let own = store.num_shards();
            let before = (own != store.configured_shards()).then_some((own, map.version));
            store.set_moved(&writing, before);
            store.set_moved_open(&writing, before.is_some());
            tracing::info!(
                shard,
                "a resize cancelled after its cut-over: the moved keys are served here again"
            );
        }
    }
}

/// Lifts a fence no resize calls for any more on a copy that missed the
/// resize that undid it: its watch delivers the newest map, not each one
/// (a copy cut off from etcd through a growth to `n` and the shrink back
/// holds the growth's fence for `n` shards while the map routes by its
/// own count again, and would refuse its own keys for good). A fence
/// stands where its count is the store's (a finished growth taken, a
/// shrink's count taken), the count a shrink opened here routes by, or a
/// resize from this store's count that cut over names it; a shard given
/// away whole keeps its fence while the map routes by the shrunk count.
fn lift_stale_fence(store: &Store, map: &ShardMap) {
    let cut_over_to = fence_of(store, map).map(|(_, to, _, _, _)| to);
    let own = store.num_shards();
    for &shard in store.hosted() {
        let Some((n, _)) = store.moved(shard) else {
            continue;
        };
        // Given away whole: stands while the map routes by the shrunk
        // count (until the servers are stopped); a shrink cancelled after
        // its cut-over that this copy missed leaves it stale.
        if n == own
            || store.routes_by(shard) == Some(n)
            || cut_over_to == Some(n)
            || (given_away(store, shard) && map.num_shards == n)
        {
            continue;
        }
        if let Some(writing) = store.lock_shard(shard) {
            let before = (own != store.configured_shards()).then_some((own, map.version));
            store.set_moved(&writing, before);
            store.set_moved_open(&writing, before.is_some());
            tracing::info!(
                shard,
                stale = n,
                "a fence no resize calls for any more lifted (this copy missed the resize that undid it)"
            );
        }
    }
}

/// The count every hosted shard this copy keeps routes by since a shrink
/// opened here (`None`: none, or some shard does not).
fn shrunk_here(store: &Store) -> Option<u32> {
    let mut kept = store
        .hosted()
        .iter()
        .copied()
        .filter(|&s| !given_away(store, s))
        .map(|s| store.routes_by(s));
    let first = kept.next()??;
    kept.all(|n| n == Some(first))
        .then_some(first)
        .filter(|&n| n < store.num_shards())
}

/// Whether the feed whose health is `feed` follows every giving shard of
/// `resize`, none being copied, each applied within `within`.
fn in_step(
    feed: Option<&tessera_proto::v1::ServingHealth>,
    resize: &Resize,
    within: Duration,
) -> bool {
    let Some(health) = feed else {
        return false;
    };
    let within = u64::try_from(within.as_millis()).unwrap_or(u64::MAX);
    health.source_shards == resize.from
        && resize.giving().all(|g| {
            health.sources.iter().any(|s| {
                s.source_shard == g && s.seq > 0 && !s.copying && s.applied_age_ms <= within
            })
        })
}

/// Whether the feed whose health is `feed` holds every giving shard's
/// fenced delta (or a copy taken after its fence), none being copied.
/// The fence must be this resize's: one set before it was planned is an
/// earlier, cancelled resize's to the same count that a copy of the
/// giving shard kept (its looks stalled through the cancel), and its cuts
/// miss the Pushes the other copies took after the cancel. A sender
/// before the fence's version was sent says 0: its count is trusted.
fn fenced(feed: Option<&tessera_proto::v1::ServingHealth>, resize: &Resize) -> bool {
    let Some(health) = feed else {
        return false;
    };
    health.source_shards == resize.from
        && resize.giving().all(|g| {
            health.sources.iter().any(|s| {
                s.source_shard == g
                    && s.fenced
                    && (s.fenced_at == 0 || s.fenced_at > resize.id)
                    && !s.copying
            })
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{StoreConfig, TableConfig};
    use tessera_proto::v1::{ServingHealth, SourceFeed};

    /// A growth 2 -> 3 cancelled after its cut-over, planned again and
    /// cut over again.
    fn again() -> (ShardMap, ShardMap) {
        let cut_over = |map: ShardMap| {
            map.start_copying()
                .and_then(|m| m.handle_ready(2, true))
                .and_then(|m| m.cut_over())
                .unwrap()
        };
        let first = cut_over(ShardMap::new(2).plan(3).unwrap());
        let second = cut_over(first.cancel().unwrap().plan(3).unwrap());
        (first, second)
    }

    /// A server of `num_shards` hosting `shard`.
    fn server(num_shards: u32, shard: u32) -> Store {
        Store::new(&StoreConfig {
            num_shards,
            shards: vec![shard],
            tables: vec![TableConfig::new("t", 1)],
            ..StoreConfig::default()
        })
    }

    fn feed(fenced_at: u64) -> ServingHealth {
        ServingHealth {
            source_shards: 2,
            sources: (0..2)
                .map(|g| SourceFeed {
                    source_shard: g,
                    seq: 1,
                    fenced: true,
                    fenced_at,
                    ..SourceFeed::default()
                })
                .collect(),
            ..ServingHealth::default()
        }
    }

    #[test]
    fn a_fence_a_cancelled_resize_left_does_not_open_the_next_one() {
        let (first, second) = again();
        let resize = second.resize.as_ref().unwrap();
        // Cut under the first growth's fence, which a copy of the giving
        // shard kept through the cancel: its rows miss the Pushes the
        // other copies took after it (control-plane simulation, seed
        // 8571: the new shard opened on them and lost six Pushes).
        assert!(!fenced(Some(&feed(first.version)), resize));
        assert!(fenced(Some(&feed(second.version)), resize));
        // A sender before the fence's version was sent: the count alone.
        assert!(fenced(Some(&feed(0)), resize));
    }

    #[test]
    fn a_copy_that_missed_a_shrinks_end_and_the_growth_back_routes_by_the_map() {
        let store = server(3, 1);
        let shrink = ShardMap::new(3)
            .plan(2)
            .and_then(|m| m.start_copying())
            .and_then(|m| m.handle_ready(0, true))
            .and_then(|m| m.handle_ready(1, true))
            .and_then(|m| m.cut_over())
            .and_then(|m| m.handle_opening(1))
            .unwrap();
        let opened = shrink.handle_opened(1, 7).unwrap();
        // Shard 1 opened on this copy (it copied the primary that opened
        // it), which routes by 2 from then on.
        let mut core = ReshardCore::new(Duration::from_secs(1));
        {
            let writing = store.lock_shard(1).unwrap();
            open_shrunk(&store, &writing, 2, shrink.resize.as_ref().unwrap().id);
        }
        core.look(
            &store,
            &Look {
                map: Some(opened.clone()),
                ..Look::default()
            },
        );
        assert_eq!(store.routes_by(1), Some(2));
        // Its looks stall through the shrink's end and a whole growth
        // back to 3 (shard 1 gives keys to the new shard 2).
        let grown = opened
            .handle_opened(0, 9)
            .and_then(|m| m.finish())
            .and_then(|m| m.plan(3))
            .and_then(|m| m.start_copying())
            .and_then(|m| m.handle_ready(2, true))
            .and_then(|m| m.cut_over())
            .and_then(|m| m.handle_opening(2))
            .and_then(|m| m.handle_opened(2, 1))
            .and_then(|m| m.finish())
            .unwrap();
        core.look(
            &store,
            &Look {
                map: Some(grown.clone()),
                ..Look::default()
            },
        );
        // Before the fix it kept routing by 2 and refused every Push
        // split by 3 for good (control-plane simulation, seed 13296).
        assert_eq!(store.routes_by(1), None);
        assert_eq!(store.num_shards(), 3);
        assert_eq!(store.moved(1).map(|(n, _)| n), Some(3));
    }

    #[test]
    fn a_giving_copy_sets_a_cancelled_resizes_fence_anew() {
        let store = server(2, 0);
        let (first, second) = again();
        fence(&store, &first);
        assert_eq!(store.moved(0), Some((3, first.version)));
        // Its looks stalled through the cancel: the next look is at the
        // second cut-over, to the same count.
        fence(&store, &second);
        assert_eq!(store.moved(0), Some((3, second.version)));
    }
}
