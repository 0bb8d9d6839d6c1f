//! What a resize of the cluster's shard count (`crate::reshard`) does to
//! a server's shards: a shard that **receives** keys serves no Fetch or
//! Push until its rows are complete, and a shard whose keys **moved**
//! away at the cut-over refuses them from then on, naming the count they
//! are routed by now (`StoreError::Moved`, answered `ABORTED` with a
//! `KeysMoved`).
//!
//! The fence of moved keys is set under the shard's write lock
//! ([`Store::set_moved`]) and a primary checks it under the lock before
//! it applies a Push (`CheckedPush::apply_at`): every Push to a moving
//! key is either applied before the fence, and so in the giving shard's
//! last delta cut after it, or refused. A replica applies what its
//! primary forwards without the check (the primary decided). Fetches
//! check it too ([`Store::check_fetch`]). Each check costs one atomic
//! load when no resize is under way.
//!
//! **Shrinking** keeps the receiving shards serving: a shard that
//! receives keys in a shrink serves its own keys throughout, and refuses
//! only the incoming ones ([`StoreError::NotOpened`], `UNAVAILABLE`)
//! until this copy of it opens ([`Store::set_incoming`]); a Push's
//! incoming keys are refused by the primary under the shard's lock, as
//! the fence is checked, while a replica applies what its primary
//! forwarded. From the opening the shard routes by the shrunk count
//! ([`Store::set_routes_by`]): its Pushes split by the old count are
//! answered [`StoreError::Resplit`] (`ABORTED` with a `KeysMoved`), so
//! that its deduplication window holds, from the opening on, only Pushes
//! split by the new count; what it held before is kept with the giving
//! shards' windows ([`Store::applied_at_origins`], origin: the shard
//! itself).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tessera_proto::sharding::shard_for_key;
use tessera_sync::LockExt;

use super::{PushId, ShardGuard, Store, StoreError};
use crate::dedup::WorkerWindow;

/// A shard's Push deduplication windows, per table.
pub type TableWindows = Vec<(String, Vec<WorkerWindow>)>;

/// What a receiving shard knows of the Pushes its giving shards applied
/// split by the old count: their windows, by giving shard and table, and
/// the count that names a key's giving shard.
#[derive(Debug)]
struct Origins {
    from: u32,
    /// The resize the shard opened in (0: not known, a copy from a
    /// release that did not say).
    resize: u64,
    windows: HashMap<(u32, String), HashMap<u64, WorkerWindow>>,
}

/// The windows a receiving shard keeps of its giving shards at its
/// opening ([`Store::set_origin_windows`]), as a copy of it carries them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct OriginSet {
    /// The shard count before the resize (it names each key's old shard).
    pub from: u32,
    /// The resize the shard opened in (`Resize::id`; 0: not known).
    pub resize: u64,
    /// By giving shard (a shrink's remaining shard among them: its own
    /// window before the opening), per table.
    pub giving: Vec<(u32, TableWindows)>,
}

/// A store's shards in a resize (module docs).
#[derive(Debug)]
pub(super) struct Resizing {
    /// Per hosted shard: whether it receives its keys in a resize now,
    /// and so serves no Fetch or Push.
    receiving: HashMap<u32, AtomicBool>,
    /// How many of them receive now: the Fetch and Push paths read this
    /// one word, and look a shard up only during a resize.
    receiving_count: AtomicUsize,
    /// How many hosted shards have moved keys fenced (as
    /// `receiving_count`).
    moved_count: AtomicUsize,
    /// Per receiving shard: its giving shards' windows, as their fenced
    /// deltas carried them.
    origins: Mutex<HashMap<u32, Arc<Origins>>>,
    /// How many shards hold origins (as `receiving_count`).
    origins_count: AtomicUsize,
    /// Fetches of keys fenced on a copy are answered there for at most
    /// this many milliseconds after its fence (`u64::MAX`: until every
    /// receiving shard serves, as the map says); [`Store::moved_reads_over`].
    stale_reads_ms: std::sync::atomic::AtomicU64,
    /// The shard-map version the store's resize state (receiving flags,
    /// shrink state, the fence of moved keys, a finished growth's count)
    /// was last set from; `None` while no resize follower runs (static
    /// coordination, a serving server): [`Store::resize_state_reaches`].
    state_version: Mutex<Option<u64>>,
    /// Notified each time `state_version` moves.
    state_moved: event_listener::Event,
    /// How many hosted shards receive keys in a shrink or route by a
    /// shrunk count (as `receiving_count`).
    shrinking_count: AtomicUsize,
    /// The count before the last shrink this store took
    /// ([`Store::adopt_shrunk_count`]; 0: none): a Push split by it or
    /// fewer, more than the store's count, is split anew.
    shrunk_from: std::sync::atomic::AtomicU32,
}

impl Resizing {
    pub(super) fn new(shards: &[u32]) -> Self {
        Self {
            receiving: shards
                .iter()
                .map(|&s| (s, AtomicBool::new(false)))
                .collect(),
            receiving_count: AtomicUsize::new(0),
            moved_count: AtomicUsize::new(0),
            origins: Mutex::new(HashMap::new()),
            origins_count: AtomicUsize::new(0),
            state_version: Mutex::new(None),
            state_moved: event_listener::Event::new(),
            stale_reads_ms: std::sync::atomic::AtomicU64::new(u64::MAX),
            shrinking_count: AtomicUsize::new(0),
            shrunk_from: std::sync::atomic::AtomicU32::new(0),
        }
    }
}

/// Whether a resize state set from map version `at` (`None`: no resize
/// follower) reached `version`: the lead gate's test
/// (`coordination/etcd_driver.rs`).
fn state_reached(at: Option<u64>, version: u64) -> bool {
    at.is_none_or(|at| at >= version)
}

impl Store {
    /// Marks `shard` as receiving its keys in a resize (or no longer):
    /// while it does, its rows are incomplete and it serves no Fetch or
    /// Push ([`Store::receiving`]). A no-op for a shard not hosted.
    pub fn set_receiving(&self, shard: u32, receiving: bool) {
        if let Some(flag) = self.resize.receiving.get(&shard) {
            let was = flag.swap(receiving, Ordering::SeqCst);
            if was != receiving {
                if receiving {
                    self.resize.receiving_count.fetch_add(1, Ordering::SeqCst);
                } else {
                    self.resize.receiving_count.fetch_sub(1, Ordering::SeqCst);
                }
                tracing::info!(shard, receiving, "shard receiving keys in a resize");
            }
        }
    }

    /// Whether `shard` receives its keys in a resize now.
    pub fn receiving(&self, shard: u32) -> bool {
        self.resize.receiving_count.load(Ordering::Relaxed) > 0
            && self
                .resize
                .receiving
                .get(&shard)
                .is_some_and(|f| f.load(Ordering::SeqCst))
    }

    /// Makes the locked shard receive the keys `to` routes to it in a
    /// shrink (`Some`), not opened on this copy yet, or no longer
    /// (`None`): until then its own keys are served and the incoming
    /// ones refused (module docs). A resize feed writes it meanwhile.
    pub fn set_incoming(&self, writing: &ShardGuard<'_>, to: Option<u32>) {
        let was = writing.incoming();
        if was == to {
            return;
        }
        writing
            .writer
            .incoming_to
            .store(to.unwrap_or(0), Ordering::SeqCst);
        self.count_shrinking(was.is_some() || writing.routes_by().is_some(), writing);
        tracing::info!(
            shard = writing.shard(),
            shrinks_to = to.unwrap_or(0),
            "shard receiving keys in a shrink"
        );
    }

    /// Makes the locked shard route keys by `to` (a shrink opened on this
    /// copy: it holds every moved row), or by the store's count again
    /// (`None`).
    pub fn set_routes_by(&self, writing: &ShardGuard<'_>, to: Option<u32>) {
        let was = writing.routes_by();
        if was == to {
            return;
        }
        writing
            .writer
            .routes_by
            .store(to.unwrap_or(0), Ordering::SeqCst);
        self.count_shrinking(was.is_some() || writing.incoming().is_some(), writing);
        tracing::info!(
            shard = writing.shard(),
            num_shards = to.unwrap_or_else(|| self.num_shards()),
            "shard routes keys by a shrunk count"
        );
    }

    /// Keeps `shrinking_count` after a change of the locked shard's shrink
    /// state (`was`: whether it had any before).
    fn count_shrinking(&self, was: bool, writing: &ShardGuard<'_>) {
        let is = writing.incoming().is_some() || writing.routes_by().is_some();
        match (was, is) {
            (false, true) => {
                self.resize.shrinking_count.fetch_add(1, Ordering::SeqCst);
            }
            (true, false) => {
                self.resize.shrinking_count.fetch_sub(1, Ordering::SeqCst);
            }
            _ => {}
        }
    }

    /// The count `shard` receives keys of in a shrink not opened on this
    /// copy yet.
    pub fn incoming(&self, shard: u32) -> Option<u32> {
        if self.resize.shrinking_count.load(Ordering::Relaxed) == 0 {
            return None;
        }
        match self.writers.get(&shard)?.incoming_to.load(Ordering::SeqCst) {
            0 => None,
            to => Some(to),
        }
    }

    /// The shrunk count `shard` routes by since a shrink opened on this
    /// copy, if one did (and the store has not taken it).
    pub fn routes_by(&self, shard: u32) -> Option<u32> {
        if self.resize.shrinking_count.load(Ordering::Relaxed) == 0 {
            return None;
        }
        match self.writers.get(&shard)?.routes_by.load(Ordering::SeqCst) {
            0 => None,
            to => Some(to),
        }
    }

    /// The count `shard`'s keys are routed by here: the store's, or a
    /// shrunk one from the shrink's opening on this copy.
    pub fn route_count(&self, shard: u32) -> u32 {
        if self.resize.shrinking_count.load(Ordering::Relaxed) > 0
            && let Some(writer) = self.writers.get(&shard)
        {
            match writer.routes_by.load(Ordering::SeqCst) {
                0 => {}
                to => return to,
            }
        }
        self.num_shards()
    }

    /// Whether a resize feed may write `shard` now: it receives keys,
    /// in a growth (not served) or a shrink (its own keys served).
    pub fn taking_rows(&self, shard: u32) -> bool {
        self.receiving(shard) || self.incoming(shard).is_some()
    }

    /// Makes the locked shard's deduplication windows start empty (a
    /// shrink's opening: what they held is kept as the shard's own
    /// origin windows first, [`Store::set_origin_windows`]).
    pub fn clear_dedup(&self, writing: &ShardGuard<'_>) {
        for table in self.tables.values() {
            if let Some(state) = table.shard(writing.shard()) {
                state.dedup.clear();
            }
        }
    }

    /// Fences the keys of the locked shard that a resize moved away: from
    /// now on those `shard_for_key(key, num_shards)` routes elsewhere are
    /// refused ([`StoreError::Moved`], naming `map_version`); `None`
    /// lifts the fence.
    pub fn set_moved(&self, writing: &ShardGuard<'_>, moved: Option<(u32, u64)>) {
        let was = writing.moved();
        if was == moved {
            return;
        }
        let (to, version) = moved.unwrap_or((0, 0));
        // A fence set anew (or widened) starts the stale-read bound again.
        *writing.writer.moved_since.locked() = moved.map(|_| std::time::Instant::now());
        writing
            .writer
            .moved_version
            .store(version, Ordering::SeqCst);
        writing.writer.moved_to.store(to, Ordering::SeqCst);
        match (was.is_some(), moved.is_some()) {
            (false, true) => {
                self.resize.moved_count.fetch_add(1, Ordering::SeqCst);
            }
            (true, false) => {
                self.resize.moved_count.fetch_sub(1, Ordering::SeqCst);
            }
            _ => {}
        }
        tracing::info!(
            shard = writing.shard(),
            num_shards = to,
            map_version = version,
            "keys moved away in a resize are fenced"
        );
    }

    /// The shard count `shard`'s keys are routed by after a resize moved
    /// some away, and the map version that did (`None`: none moved).
    pub fn moved(&self, shard: u32) -> Option<(u32, u64)> {
        if self.resize.moved_count.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let writer = self.writers.get(&shard)?;
        match writer.moved_to.load(Ordering::SeqCst) {
            0 => None,
            to => Some((to, writer.moved_version.load(Ordering::SeqCst))),
        }
    }

    /// Routes keys by `num_shards` from now on: the target of a finished
    /// growth whose moved rows this server's giving shards dropped (their
    /// shard ids and staying keys are those of the new count). The fence
    /// stays, so a moved key is still answered `KeysMoved`. Checkpoints
    /// record it from then on. Only a larger count is taken.
    pub fn adopt_num_shards(&self, num_shards: u32) -> bool {
        let was = self.num_shards.fetch_max(num_shards, Ordering::SeqCst);
        if was < num_shards {
            tracing::info!(
                was,
                num_shards,
                "routing keys by a finished growth's shard count"
            );
            true
        } else {
            false
        }
    }

    /// Routes keys by `num_shards`, fewer than now, from now on: the
    /// target of a finished shrink whose every hosted shard opened on
    /// this copy (each routes by it already, [`Store::set_routes_by`];
    /// the caller clears that once this is taken). Returns whether it was.
    pub fn adopt_shrunk_count(&self, num_shards: u32) -> bool {
        let was = self.num_shards.fetch_min(num_shards, Ordering::SeqCst);
        if was > num_shards {
            self.resize.shrunk_from.store(was, Ordering::SeqCst);
            tracing::info!(
                was,
                num_shards,
                "routing keys by a finished shrink's shard count"
            );
            true
        } else {
            false
        }
    }

    /// The count before the last shrink this store took (0: none).
    pub fn shrunk_from(&self) -> u32 {
        self.resize.shrunk_from.load(Ordering::Relaxed)
    }

    /// Whether `shard` takes Pushes split by the count its keys moved to.
    pub fn new_count_open(&self, shard: u32) -> bool {
        self.writers
            .get(&shard)
            .is_some_and(|w| w.moved_open.load(Ordering::SeqCst))
    }

    /// Lets the locked shard take Pushes split by the count its keys
    /// moved to (`open`: every receiving shard serves them now), or not.
    pub fn set_moved_open(&self, writing: &ShardGuard<'_>, open: bool) {
        if writing.writer.moved_open.swap(open, Ordering::SeqCst) != open {
            tracing::info!(
                shard = writing.shard(),
                open,
                "Pushes split by the new shard count are taken"
            );
        }
    }

    /// `shard`'s Push deduplication windows now, per table: what its
    /// fenced deltas and copies carry to the receiving shards. Until
    /// every receiving shard serves the moved keys they name only Pushes
    /// split by the old count ([`ShardGuard::new_count_open`]), whose
    /// parts held all their keys of the shard, moving ones included.
    pub fn dedup_windows(&self, shard: u32) -> TableWindows {
        self.tables
            .values()
            .filter_map(|t| {
                let state = t.shard(shard)?;
                Some((t.config().name.clone(), state.dedup.snapshot()))
            })
            .collect()
    }

    /// Gives receiving shard `shard` its giving shards' windows as their
    /// fenced deltas carried them (`set.giving`: by giving shard, of
    /// `set.from` shards), for [`Store::applied_at_origins`], replacing
    /// any it held; an empty list forgets them.
    pub fn set_origin_windows(&self, shard: u32, set: OriginSet) {
        let mut origins = self.resize.origins.locked();
        let had = if set.giving.is_empty() {
            origins.remove(&shard).is_some()
        } else {
            let mut by: HashMap<(u32, String), HashMap<u64, WorkerWindow>> = HashMap::new();
            for (origin, tables) in set.giving {
                for (table, list) in tables {
                    by.entry((origin, table))
                        .or_default()
                        .extend(list.into_iter().map(|w| (w.worker, w)));
                }
            }
            origins
                .insert(
                    shard,
                    Arc::new(Origins {
                        from: set.from,
                        resize: set.resize,
                        windows: by,
                    }),
                )
                .is_some()
        };
        let has = origins.contains_key(&shard);
        match (had, has) {
            (false, true) => {
                self.resize.origins_count.fetch_add(1, Ordering::SeqCst);
            }
            (true, false) => {
                self.resize.origins_count.fetch_sub(1, Ordering::SeqCst);
            }
            _ => {}
        }
    }

    /// The windows receiving shard `shard` keeps of its giving shards, as
    /// [`Store::set_origin_windows`] takes them: a copy of the shard
    /// carries them.
    pub fn origin_windows(&self, shard: u32) -> Option<OriginSet> {
        let origins = self.resize.origins.locked().get(&shard).cloned()?;
        let mut by: std::collections::BTreeMap<u32, TableWindows> = Default::default();
        for ((origin, table), workers) in &origins.windows {
            let mut list: Vec<WorkerWindow> = workers.values().cloned().collect();
            list.sort_by_key(|w| w.worker);
            by.entry(*origin).or_default().push((table.clone(), list));
        }
        for tables in by.values_mut() {
            tables.sort_by(|a, b| a.0.cmp(&b.0));
        }
        Some(OriginSet {
            from: origins.from,
            resize: origins.resize,
            giving: by.into_iter().collect(),
        })
    }

    /// Whether this copy of `shard` opened in resize `resize` (a nonzero
    /// id): it keeps the windows of that resize's opening, set here or
    /// copied from the primary that opened it. A shrink's remaining
    /// shard moved its own window among them then and started a new one:
    /// opening it again must keep both as they are.
    pub fn opened_in(&self, shard: u32, resize: u64) -> bool {
        resize != 0
            && self
                .resize
                .origins
                .locked()
                .get(&shard)
                .is_some_and(|o| o.resize == resize)
    }

    /// Bounds how long after its fence a copy answers Fetches of the
    /// keys a resize moved away ([`Store::moved_reads_over`]).
    pub fn bound_moved_reads(&self, bound: std::time::Duration) {
        self.resize.stale_reads_ms.store(
            u64::try_from(bound.as_millis()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// Whether the Fetches of `shard`'s fenced keys are refused at `now`
    /// although the map has not said every receiving shard serves them
    /// (`new_count_open`) on this copy: its fence is older than the
    /// stale-read bound. Until then nobody writes them (their Pushes are
    /// refused here, and a receiving shard takes none before every one
    /// opened), so what this copy holds is their value, and after the
    /// opening their value at most the bound old. A copy that does not
    /// hear of the opening (cut off from etcd, a watch that lags) would
    /// otherwise serve it for as long as that lasts; refused, a worker
    /// still on the old count waits for its routing to move on.
    pub fn moved_reads_over(&self, shard: u32, now: std::time::Instant) -> bool {
        if self.resize.moved_count.load(Ordering::Relaxed) == 0 {
            return false;
        }
        let bound = match self.resize.stale_reads_ms.load(Ordering::Relaxed) {
            u64::MAX => return false,
            ms => std::time::Duration::from_millis(ms),
        };
        self.writers.get(&shard).is_some_and(|w| {
            w.moved_since
                .locked()
                .is_some_and(|since| now.saturating_duration_since(since) >= bound)
        })
    }

    /// A resize follower runs for this store from shard-map `version`
    /// on (`crate::reshard`): [`Store::resize_state_reaches`] waits for
    /// it from now on.
    pub fn follow_resizes(&self, version: u64) {
        *self.resize.state_version.locked() = Some(version);
        self.resize.state_moved.notify(usize::MAX);
    }

    /// The store's resize state was set from shard-map `version` (the
    /// resize follower's look at it); never moves back.
    pub fn set_resize_state_version(&self, version: u64) {
        let moved = {
            let mut at = self.resize.state_version.locked();
            match *at {
                Some(was) if was < version => {
                    *at = Some(version);
                    true
                }
                _ => false,
            }
        };
        if moved {
            self.resize.state_moved.notify(usize::MAX);
        }
    }

    /// The shard-map version the store's resize state was last set from
    /// (`None`: no resize follower).
    pub fn resize_state_version(&self) -> Option<u64> {
        *self.resize.state_version.locked()
    }

    /// Waits until the store's resize state was set from shard-map
    /// `version` or a later one (at once without a resize follower). A
    /// server taking the lead of a shard waits for the version it read
    /// from etcd after winning the lead, under a deadline of its own: the
    /// fence of a cut-over its last primary acted on is then in place
    /// before it applies a Push (ps-server's `coordination/etcd_driver.rs`).
    pub async fn resize_state_reaches(&self, version: u64) {
        loop {
            // Registered before the look: a move after it wakes this.
            let moved = self.resize.state_moved.listen();
            if self.resize_state_reached(version) {
                return;
            }
            moved.await;
        }
    }

    /// Whether the store's resize state was set from shard-map `version`
    /// or a later one now (always without a resize follower): what
    /// [`Store::resize_state_reaches`] waits for.
    pub fn resize_state_reached(&self, version: u64) -> bool {
        state_reached(self.resize_state_version(), version)
    }

    /// Which of `keys` (of `table` on receiving shard `shard`) the Push
    /// `id` was applied to already, at the giving shard that held them
    /// before a resize's cut-over: a part retried across the cut-over,
    /// first sent split by the old count. `None` when none was (nothing
    /// to leave out), else a mask over `keys`. A sequence below a giving
    /// shard's window cannot be told apart and is refused, as it would
    /// be there.
    pub fn applied_at_origins(
        &self,
        table: &str,
        shard: u32,
        keys: &[u64],
        id: PushId,
    ) -> Result<Option<Vec<bool>>, StoreError> {
        if self.resize.origins_count.load(Ordering::Relaxed) == 0
            || id.worker == 0
            || id.sequence == 0
        {
            return Ok(None);
        }
        let Some(origins) = self.resize.origins.locked().get(&shard).cloned() else {
            return Ok(None);
        };
        // Per giving shard: whether it applied the Push (asked once).
        let mut verdicts: HashMap<u32, bool> = HashMap::new();
        let mut mask = Vec::with_capacity(keys.len());
        let mut any = false;
        for &key in keys {
            let origin = shard_for_key(key, origins.from);
            let applied = match verdicts.get(&origin) {
                Some(&v) => v,
                None => {
                    let window = origins
                        .windows
                        .get(&(origin, table.to_owned()))
                        .and_then(|w| w.get(&id.worker));
                    let v = match window.map(|w| w.applied(id.sequence)) {
                        None | Some(Ok(false)) => false,
                        Some(Ok(true)) => true,
                        Some(Err(lowest)) => {
                            return Err(StoreError::SequenceTooOld {
                                worker: id.worker,
                                sequence: id.sequence,
                                lowest,
                            });
                        }
                    };
                    verdicts.insert(origin, v);
                    v
                }
            };
            any |= applied;
            mask.push(applied);
        }
        Ok(any.then_some(mask))
    }

    /// Drops the rows of `shard` whose keys `num_shards` routes elsewhere
    /// (a finished growth's moved rows, fenced): per table, the keys are
    /// found under one hold of the shard's lock, then removed 4,096 per
    /// hold, so Pushes of the keys that stay wait little. Returns the rows
    /// dropped. Blocking.
    pub fn drop_moved_rows(&self, shard: u32, num_shards: u32) -> usize {
        self.drop_rows_routed_elsewhere(shard, &[num_shards])
    }

    /// [`Store::drop_moved_rows`] keeping the rows of keys any of `counts`
    /// routes to `shard` (a growth's moved rows dropped on a copy that
    /// also holds a shrink's incoming ones). Blocking.
    pub fn drop_rows_routed_elsewhere(&self, shard: u32, counts: &[u32]) -> usize {
        let names: Vec<String> = self.tables.keys().cloned().collect();
        let mut dropped = 0;
        for name in names {
            let keys = match self.lock_shard(shard) {
                Some(writing) => self.keys_where(&writing, &name, |k| {
                    counts.iter().all(|&n| shard_for_key(k, n) != shard)
                }),
                None => return dropped,
            };
            for chunk in keys.chunks(4096) {
                if let Some(writing) = self.lock_shard(shard) {
                    dropped += self.remove_rows(&writing, &name, chunk).unwrap_or(0);
                }
            }
        }
        dropped
    }

    /// Drops the rows of the shard `writing` locks that its count does not
    /// route to it, if a resize moved keys away from it (a copy just
    /// installed that still held a finished growth's moved rows); one
    /// scan under the lock the caller holds anyway. The keys it receives
    /// in a shrink stay. Returns the rows. Nothing is dropped where the
    /// copy holds an opening newer than this store's fence (its origin
    /// windows name a resize planned after the fence was set): the store's
    /// resize state lags the map (its looks stalled through a shrink), so
    /// what routes here is not known yet, and the rows the shrink brought
    /// would go with the rest.
    pub fn drop_unrouted(&self, writing: &ShardGuard<'_>) -> usize {
        let shard = writing.shard();
        let Some((_, fenced_at)) = self.moved(shard) else {
            return 0;
        };
        if self
            .origin_windows(shard)
            .is_some_and(|o| o.resize > fenced_at)
        {
            return 0;
        }
        let num_shards = self.route_count(shard);
        let incoming = writing.incoming();
        let names: Vec<String> = self.tables.keys().cloned().collect();
        let mut dropped = 0;
        for name in names {
            let keys = self.keys_where(writing, &name, |k| {
                shard_for_key(k, num_shards) != shard
                    && incoming.is_none_or(|to| shard_for_key(k, to) != shard)
            });
            dropped += self.remove_rows(writing, &name, &keys).unwrap_or(0);
        }
        dropped
    }

    /// Refuses `keys` of `shard` if one of them moved away.
    pub(super) fn check_moved(&self, shard: u32, keys: &[u64]) -> Result<(), StoreError> {
        match self.moved(shard) {
            Some(moved) => refuse_moved(shard, keys, moved),
            None => Ok(()),
        }
    }
}

/// [`StoreError::NotOpened`] for the first of `keys` that `num_shards`
/// (the shard's count before a shrink) routes away from `shard`: one it
/// receives in a shrink to `to` not opened here.
pub(super) fn refuse_incoming(
    shard: u32,
    keys: &[u64],
    num_shards: u32,
    to: u32,
) -> Result<(), StoreError> {
    match keys
        .iter()
        .find(|&&k| shard_for_key(k, num_shards) != shard)
    {
        Some(&key) => Err(StoreError::NotOpened {
            key,
            shard,
            num_shards: to,
        }),
        None => Ok(()),
    }
}

/// [`StoreError::Moved`] for the first of `keys` that `moved` (a shard
/// count and a map version) routes away from `shard`.
pub(super) fn refuse_moved(shard: u32, keys: &[u64], moved: (u32, u64)) -> Result<(), StoreError> {
    let (num_shards, map_version) = moved;
    match keys
        .iter()
        .find(|&&k| shard_for_key(k, num_shards) != shard)
    {
        Some(&key) => Err(StoreError::Moved {
            key,
            shard,
            num_shards,
            to: shard_for_key(key, num_shards),
            map_version,
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Mode;
    use crate::store::PushId;
    use crate::store::tests::config;

    #[test]
    fn moved_keys_are_refused_and_the_others_served() {
        let store = Store::new(&config(Mode::Training));
        let (moving, staying): (Vec<u64>, Vec<u64>) = (0u64..400)
            .filter(|&k| shard_for_key(k, 2) == 0)
            .partition(|&k| shard_for_key(k, 3) == 2);
        assert!(!moving.is_empty() && !staying.is_empty());
        let grads = vec![0u8; moving.len() * 3 * 4];
        store
            .push("t", 0, &moving, &grads, PushId::default())
            .unwrap();
        {
            let writing = store.lock_shard(0).unwrap();
            store.set_moved(&writing, Some((3, 7)));
        }
        assert_eq!(store.moved(0), Some((3, 7)));
        assert_eq!(store.moved(1), None);
        // Until the receiving shards serve, a Fetch of a moved key is
        // served here (nobody writes it); its Push is refused at once.
        assert!(store.fetch("t", 0, &moving).is_ok());
        {
            let writing = store.lock_shard(0).unwrap();
            store.set_moved_open(&writing, true);
        }
        for err in [
            store.fetch("t", 0, &moving).map(|_| ()).unwrap_err(),
            store
                .push("t", 0, &moving, &grads, PushId::default())
                .map(|_| ())
                .unwrap_err(),
        ] {
            assert!(
                matches!(
                    err,
                    StoreError::Moved {
                        shard: 0,
                        num_shards: 3,
                        to: 2,
                        map_version: 7,
                        ..
                    }
                ),
                "{err:?}"
            );
        }
        // The keys that stay are served as before.
        assert!(store.fetch("t", 0, &staying).is_ok());
        let grads = vec![0u8; staying.len() * 3 * 4];
        assert!(
            store
                .push("t", 0, &staying, &grads, PushId::default())
                .is_ok()
        );
        // A Push checked before the fence is refused under the lock; a
        // replica applies what its primary forwarded, fence or not.
        let grads = vec![0u8; moving.len() * 3 * 4];
        {
            let writing = store.lock_shard(0).unwrap();
            store.set_moved(&writing, None);
        }
        let checked = store
            .check_push("t", 0, &moving, &grads, PushId::default())
            .unwrap();
        let writing = store.lock_shard(0).unwrap();
        store.set_moved(&writing, Some((3, 8)));
        assert!(matches!(
            checked.apply(&writing, std::time::Instant::now()),
            Err(StoreError::Moved { map_version: 8, .. })
        ));
        let id = PushId {
            worker: 1,
            sequence: 1,
        };
        store
            .check_push("t", 0, &moving, &grads, id)
            .unwrap()
            .apply_replicated(&writing, &[], &[], std::time::Instant::now(), 0)
            .unwrap();
    }

    /// Found by the control-plane simulation (seed 248): a replica whose
    /// looks stalled through a shrink still held an older growth's fence
    /// when it installed a copy of its opened primary, and dropped the
    /// rows the shrink brought as not routed here (its primary then
    /// died: the keys' Pushes were lost). A copy holding an opening newer
    /// than the fence keeps them.
    #[test]
    fn a_copy_of_a_newer_opening_keeps_its_rows_on_a_lagging_store() {
        // A server of 3 shards that has not seen the shrink to 2.
        let store = Store::new(&crate::StoreConfig {
            num_shards: 3,
            ..config(Mode::Training)
        });
        // Routed to shard 0 by 2 shards, to shard 2 by 3: a shrink from 3
        // brought them to shard 0 (the copy installed holds them).
        let came: Vec<u64> = (0u64..400)
            .filter(|&k| shard_for_key(k, 2) == 0 && shard_for_key(k, 3) == 2)
            .collect();
        let writing = store.lock_shard(0).unwrap();
        store.set_incoming(&writing, Some(2));
        store
            .put_rows(&writing, "t", &came, &vec![0u8; came.len() * 3 * 4], &[])
            .unwrap();
        store.set_incoming(&writing, None);
        // An older growth's fence (a growth to 3 at map version 5).
        store.set_moved(&writing, Some((3, 5)));
        // The copy's origins: a shrink planned at version 9 opened it.
        store.set_origin_windows(
            0,
            OriginSet {
                from: 3,
                resize: 9,
                giving: vec![(2, vec![("t".to_owned(), Vec::new())])],
            },
        );
        assert_eq!(store.drop_unrouted(&writing), 0);
        assert_eq!(store.read_rows("t", 0, &came, false).unwrap().keys, came);
        // Once the store's state caught up (a fence of that resize or
        // later), rows it does not route here go.
        store.set_moved(&writing, Some((3, 12)));
        assert_eq!(store.drop_unrouted(&writing), came.len());
    }

    /// Hole 5 of issue 57: a copy that fenced keys and never hears that
    /// their new shard serves them (cut off from etcd) answers their
    /// Fetches for the stale-read bound after its fence, then refuses
    /// them; the keys that stay are served throughout, and a fence lifted
    /// or set anew starts over.
    #[test]
    fn fenced_keys_are_read_here_for_the_stale_read_bound_only() {
        use std::time::{Duration, Instant};
        let store = Store::new(&config(Mode::Training));
        let (moving, staying): (Vec<u64>, Vec<u64>) = (0u64..400)
            .filter(|&k| shard_for_key(k, 2) == 0)
            .partition(|&k| shard_for_key(k, 3) == 2);
        let grads = vec![0u8; moving.len() * 3 * 4];
        store
            .push("t", 0, &moving, &grads, PushId::default())
            .unwrap();
        let bound = Duration::from_secs(10);
        store.bound_moved_reads(bound);
        let before = Instant::now();
        {
            let writing = store.lock_shard(0).unwrap();
            store.set_moved(&writing, Some((3, 7)));
        }
        let after = Instant::now();
        assert!(!store.moved_reads_over(0, after));
        assert!(!store.moved_reads_over(0, before + bound - Duration::from_millis(1)));
        assert!(store.moved_reads_over(0, after + bound));
        assert!(
            !store.moved_reads_over(1, after + bound),
            "shard 1 fenced nothing"
        );
        assert!(store.fetch("t", 0, &moving).is_ok());
        // A bound already over: refused now, without the map's word.
        store.bound_moved_reads(Duration::ZERO);
        assert!(matches!(
            store.fetch("t", 0, &moving).map(|_| ()),
            Err(StoreError::Moved { to: 2, .. })
        ));
        assert!(store.fetch("t", 0, &staying).is_ok());
        // Lifted (a cancel after the cut-over): served again.
        {
            let writing = store.lock_shard(0).unwrap();
            store.set_moved(&writing, None);
        }
        assert!(!store.moved_reads_over(0, after + bound));
        assert!(store.fetch("t", 0, &moving).is_ok());
    }

    /// A shrink from 3 to 2 shards at remaining shard 0: its own keys
    /// are served throughout; the keys it receives (from shard 2) only
    /// once it opens, and a Push split by 2 waits for that; a replica
    /// applies forwarded Pushes of them. From the opening it routes by 2:
    /// a Push split by 3 is answered `Resplit`, and a Push retried split
    /// by 2 leaves out the keys the shard applied it to before, by the
    /// window it kept of itself, not those shard 2 had not applied.
    #[test]
    fn a_shrink_receiving_shard_serves_its_own_keys_and_the_others_once_open() {
        let store = Store::new(&crate::StoreConfig {
            num_shards: 3,
            shards: vec![0, 2],
            ..config(Mode::Training)
        });
        let own: Vec<u64> = (0u64..400).filter(|&k| shard_for_key(k, 3) == 0).collect();
        let incoming: Vec<u64> = (0u64..400)
            .filter(|&k| shard_for_key(k, 3) == 2 && shard_for_key(k, 2) == 0)
            .collect();
        assert!(!own.is_empty() && !incoming.is_empty());
        let grads = |keys: &[u64]| vec![0u8; keys.len() * 3 * 4];
        let id = |sequence| PushId {
            worker: 5,
            sequence,
        };
        let push = |keys: &[u64], split_by, sequence| {
            let g = grads(keys);
            let writing = store.lock_shard(0).unwrap();
            store
                .check_push("t", 0, keys, &g, id(sequence))
                .map(|c| c.split_by(split_by))
                .and_then(|c| c.apply(&writing, std::time::Instant::now()))
        };
        {
            let writing = store.lock_shard(0).unwrap();
            store.set_incoming(&writing, Some(2));
        }
        assert!(store.taking_rows(0) && !store.taking_rows(2));
        // Its own keys: served, and Pushed (split by the old count).
        assert!(store.fetch("t", 0, &own).is_ok());
        push(&own, 3, 1).unwrap();
        // The incoming ones: not yet.
        assert!(matches!(
            store.fetch("t", 0, &incoming),
            Err(StoreError::NotOpened {
                shard: 0,
                num_shards: 2,
                ..
            })
        ));
        assert!(matches!(
            push(&incoming, 2, 2),
            Err(StoreError::NotOpened { .. })
        ));
        assert!(matches!(
            push(&own, 2, 3),
            Err(StoreError::NotCutOver { split_by: 2, .. })
        ));
        // A key of neither count's shard 0 is misrouted as ever.
        let other: Vec<u64> = (0u64..400)
            .filter(|&k| shard_for_key(k, 2) == 1)
            .take(1)
            .collect();
        assert!(matches!(
            store.fetch("t", 0, &other),
            Err(StoreError::WrongShard { .. })
        ));
        // A replica applies what its primary forwarded.
        {
            let g = grads(&incoming);
            let writing = store.lock_shard(0).unwrap();
            store
                .check_push("t", 0, &incoming, &g, PushId::default())
                .unwrap()
                .apply_replicated(&writing, &[], &[], std::time::Instant::now(), 0)
                .unwrap();
        }
        // Opened: its own window kept as an origin, a new one started.
        {
            let writing = store.lock_shard(0).unwrap();
            store.set_origin_windows(
                0,
                OriginSet {
                    from: 3,
                    resize: 9,
                    giving: vec![(0, store.dedup_windows(0))],
                },
            );
            store.clear_dedup(&writing);
            store.set_routes_by(&writing, Some(2));
            store.set_incoming(&writing, None);
        }
        assert_eq!(store.route_count(0), 2);
        assert_eq!(store.route_count(2), 3);
        assert!(!store.taking_rows(0));
        assert!(store.fetch("t", 0, &incoming).is_ok());
        assert!(matches!(
            push(&own, 3, 4),
            Err(StoreError::Resplit {
                shard: 0,
                split_by: 3,
                num_shards: 2
            })
        ));
        // Push 1 retried split by 2, with a key that came from shard 2:
        // the own keys are left out (applied here before), that one not.
        let mut both = own.clone();
        both.push(incoming[0]);
        let mask = store
            .applied_at_origins("t", 0, &both, id(1))
            .unwrap()
            .unwrap();
        assert!(mask[..own.len()].iter().all(|&m| m));
        assert!(!mask[own.len()]);
        // The new window does not hold it: the rest is applied.
        assert!(!push(&incoming[..1], 2, 1).unwrap().duplicate);
        assert!(push(&incoming[..1], 2, 1).unwrap().duplicate);
        // The store takes the count once the shrink is done.
        assert!(store.adopt_shrunk_count(2));
        {
            let writing = store.lock_shard(0).unwrap();
            store.set_routes_by(&writing, None);
        }
        assert_eq!(store.route_count(0), 2);
        assert!(store.fetch("t", 0, &incoming).is_ok());
    }

    #[test]
    fn a_push_split_by_a_new_count_waits_for_the_fence() {
        let store = Store::new(&config(Mode::Training));
        let staying: Vec<u64> = (0u64..400)
            .filter(|&k| shard_for_key(k, 2) == 0 && shard_for_key(k, 3) == 0)
            .collect();
        let grads = vec![0u8; staying.len() * 3 * 4];
        let push = |split_by| {
            let writing = store.lock_shard(0).unwrap();
            store
                .check_push("t", 0, &staying, &grads, PushId::default())
                .unwrap()
                .split_by(split_by)
                .apply(&writing, std::time::Instant::now())
                .map(|_| ())
        };
        // The shard's own count, or none said: taken.
        push(2).unwrap();
        push(0).unwrap();
        assert!(matches!(
            push(3),
            Err(StoreError::NotCutOver {
                shard: 0,
                split_by: 3,
                num_shards: 2
            })
        ));
        {
            let writing = store.lock_shard(0).unwrap();
            store.set_moved(&writing, Some((3, 5)));
        }
        // Fenced, but the receiving shards do not serve yet: its windows
        // must name only Pushes split by the old count.
        assert!(matches!(push(3), Err(StoreError::NotCutOver { .. })));
        push(2).unwrap();
        {
            let writing = store.lock_shard(0).unwrap();
            store.set_moved_open(&writing, true);
        }
        assert!(store.new_count_open(0));
        push(3).unwrap();
        push(2).unwrap();
        assert!(matches!(push(4), Err(StoreError::NotCutOver { .. })));
    }
}
