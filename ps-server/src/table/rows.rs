//! The rows of one (table, shard): values, optimizer state, and what the
//! eviction policy needs, in lock stripes.
//!
//! Keys are spread over 64 stripes, each an `RwLock<IndexMap>`: Fetches of
//! different stripes never contend and Fetches of one stripe share its read
//! lock. This replaces a `DashMap` (itself a striped `RwLock<HashMap>`)
//! because eviction needs what `DashMap` does not offer: picking entries at
//! random in O(1). `IndexMap` (the well-kept insertion-ordered map) gives
//! index access and O(1) `swap_remove_index`, so eviction samples a few
//! rows of the full stripe and evicts the worst by the table's policy, as
//! Redis does ("approximated LRU/LFU"): exact LRU would need a list update
//! under a write lock on every read.
//!
//! A limit of `max_rows` is enforced per stripe as `max_rows / stripes`,
//! with fewer stripes for small limits (at least 64 rows each), so the
//! total never exceeds it; a stripe that fills first starts evicting a
//! little before the whole shard is full.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use indexmap::IndexMap;
use serde::{Deserialize, Serialize};
use tessera_proto::sharding::splitmix64;

/// Which row a full table gives up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EvictionPolicy {
    /// Least recently used (read or updated).
    #[default]
    Lru,
    /// Least frequently updated (fewest Pushes; ties: least recently used).
    Lfu,
}

/// What a row holds: shared with snapshots, copied on write.
#[derive(Debug, Clone, PartialEq)]
pub struct RowData {
    /// The embedding.
    pub values: Box<[f32]>,
    /// Optimizer state (`slots * dim`).
    pub state: Box<[f32]>,
    /// Optimizer steps applied (Adam's bias correction).
    pub steps: u32,
}

/// One row: its contents and its bookkeeping.
///
/// The contents sit behind an `Arc` so that a snapshot of a shard (for a
/// checkpoint or a copy to another server, [`ShardRows::snapshot`]) costs
/// one reference count per row instead of a copy of every value: the
/// shard's write lock is held only for that. A Push to a row a snapshot
/// still shares copies the row first ([`Row::data_mut`], `Arc::make_mut`);
/// one no snapshot shares is updated in place, as before.
#[derive(Debug)]
pub struct Row {
    data: Arc<RowData>,
    /// Last use on the table's logical clock (reads included).
    last_used: AtomicU64,
}

impl Row {
    /// A row with `values` and optimizer `state`, no updates yet.
    pub fn new(values: Box<[f32]>, state: Box<[f32]>) -> Self {
        Self {
            data: Arc::new(RowData {
                values,
                state,
                steps: 0,
            }),
            last_used: AtomicU64::new(0),
        }
    }

    /// The contents, for changing them (copied first if a snapshot shares
    /// them).
    pub fn data_mut(&mut self) -> &mut RowData {
        Arc::make_mut(&mut self.data)
    }
}

impl std::ops::Deref for Row {
    type Target = RowData;

    fn deref(&self) -> &RowData {
        &self.data
    }
}

/// A row a Push evicted: `key` went just before the Push's key at index
/// `before` was inserted (replicas replay it at the same point).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Eviction {
    /// Index in the Push's keys of the row whose insertion evicted it.
    pub before: u32,
    /// The evicted row's key.
    pub key: u64,
}

/// Rows sampled per eviction. 8: Redis's experience is that 5-10 samples
/// come close to exact LRU at a fraction of its cost.
const EVICTION_SAMPLES: usize = 8;

/// Stripes per (table, shard).
const STRIPES: usize = 64;

/// Fewest rows per stripe of a limited table.
const MIN_STRIPE_ROWS: usize = 64;

/// The rows of one (table, shard) (module docs).
#[derive(Debug)]
pub struct ShardRows {
    stripes: Box<[RwLock<IndexMap<u64, Row>>]>,
    /// Rows per stripe at most (`None`: unlimited).
    stripe_limit: Option<usize>,
    policy: EvictionPolicy,
    clock: AtomicU64,
    evictions: AtomicU64,
}

impl ShardRows {
    /// Empty rows, holding at most `max_rows` (`None`: unlimited).
    pub fn new(max_rows: Option<u64>, policy: EvictionPolicy) -> Self {
        // With a limit, every stripe holds at least MIN_STRIPE_ROWS so that
        // a small table is not cut to a handful of rows per stripe.
        let stripes = match max_rows {
            Some(max) => (max as usize / MIN_STRIPE_ROWS).clamp(1, STRIPES),
            None => STRIPES,
        };
        Self {
            stripes: (0..stripes).map(|_| RwLock::default()).collect(),
            stripe_limit: max_rows.map(|max| (max as usize / stripes).max(1)),
            policy,
            clock: AtomicU64::new(1),
            evictions: AtomicU64::new(0),
        }
    }

    fn stripe(&self, key: u64) -> usize {
        // High bits: the low ones of the same hash already chose the shard.
        ((splitmix64(key) >> 32) as usize) % self.stripes.len()
    }

    fn read_stripe(&self, i: usize) -> RwLockReadGuard<'_, IndexMap<u64, Row>> {
        // A panic while a stripe is locked leaves at worst one row half
        // updated; serving it beats failing every later request.
        self.stripes[i].read().unwrap_or_else(|p| p.into_inner())
    }

    fn write_stripe(&self, i: usize) -> RwLockWriteGuard<'_, IndexMap<u64, Row>> {
        self.stripes[i].write().unwrap_or_else(|p| p.into_inner())
    }

    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::Relaxed)
    }

    /// Marks `row` used now. Only a table with a row limit keeps the
    /// clock: it is one shared atomic per row touched, which an unlimited
    /// table (nothing to evict) should not pay on every Fetch.
    fn touch(&self, row: &Row) {
        if self.stripe_limit.is_some() {
            row.last_used.store(self.tick(), Ordering::Relaxed);
        }
    }

    /// Calls `read` with the row of `key`, if present (counts as a use).
    pub fn read<R>(&self, key: u64, read: impl FnOnce(&Row) -> R) -> Option<R> {
        let stripe = self.read_stripe(self.stripe(key));
        let row = stripe.get(&key)?;
        self.touch(row);
        Some(read(row))
    }

    /// Calls `update` with the row of `key`, inserting `init()` first when
    /// it is missing (evicting another row if the stripe is full).
    pub fn upsert<R>(
        &self,
        key: u64,
        init: impl FnOnce() -> Row,
        update: impl FnOnce(&mut Row) -> R,
    ) -> R {
        self.upsert_evicting(key, init, update).0
    }

    /// [`ShardRows::upsert`], also returning the key of the row evicted to
    /// make room, if one was.
    pub fn upsert_evicting<R>(
        &self,
        key: u64,
        init: impl FnOnce() -> Row,
        update: impl FnOnce(&mut Row) -> R,
    ) -> (R, Option<u64>) {
        let mut stripe = self.write_stripe(self.stripe(key));
        let evicted = self.make_room(&mut stripe, key);
        let row = stripe.entry(key).or_insert_with(init);
        self.touch(row);
        (update(row), evicted)
    }

    /// [`ShardRows::upsert`] without choosing a victim (a replica replays
    /// its primary's evictions with [`ShardRows::evict`] instead).
    pub fn upsert_following<R>(
        &self,
        key: u64,
        init: impl FnOnce() -> Row,
        update: impl FnOnce(&mut Row) -> R,
    ) -> R {
        let mut stripe = self.write_stripe(self.stripe(key));
        let row = stripe.entry(key).or_insert_with(init);
        self.touch(row);
        update(row)
    }

    /// Evicts the row of `key` (as the primary did); whether it was held.
    pub fn evict(&self, key: u64) -> bool {
        let removed = self
            .write_stripe(self.stripe(key))
            .swap_remove(&key)
            .is_some();
        if removed {
            self.evictions.fetch_add(1, Ordering::Relaxed);
            metrics::counter!("tessera_ps_evictions_total").increment(1);
        }
        removed
    }

    /// Whether the table has a row limit (rows are then stored only by
    /// Pushes and copies, and evicted by the primary alone).
    pub fn limited(&self) -> bool {
        self.stripe_limit.is_some()
    }

    /// Puts `row` in place of whatever `key` had (evicting another row if
    /// the stripe is full).
    pub fn insert(&self, key: u64, row: Row) {
        self.touch(&row);
        let mut stripe = self.write_stripe(self.stripe(key));
        self.make_room(&mut stripe, key);
        stripe.insert(key, row);
    }

    /// Evicts a row if `key` is new and its stripe is full; returns the
    /// victim's key.
    fn make_room(&self, stripe: &mut IndexMap<u64, Row>, key: u64) -> Option<u64> {
        if !stripe.contains_key(&key)
            && let Some(limit) = self.stripe_limit
            && stripe.len() >= limit
        {
            return self.evict_one(stripe, key);
        }
        None
    }

    /// Evicts the worst of a few rows sampled from a full stripe; returns
    /// its key.
    fn evict_one(&self, stripe: &mut IndexMap<u64, Row>, salt: u64) -> Option<u64> {
        let len = stripe.len();
        if len == 0 {
            return None;
        }
        let mut draw = splitmix64(salt ^ self.tick());
        let mut victim = None;
        let mut worst = (u64::MAX, u64::MAX);
        for _ in 0..EVICTION_SAMPLES.min(len) {
            draw = splitmix64(draw);
            let i = (draw % len as u64) as usize;
            let Some((_, row)) = stripe.get_index(i) else {
                continue;
            };
            let used = row.last_used.load(Ordering::Relaxed);
            let score = match self.policy {
                EvictionPolicy::Lru => (used, 0),
                EvictionPolicy::Lfu => (u64::from(row.steps), used),
            };
            if score < worst {
                worst = score;
                victim = Some(i);
            }
        }
        let (key, _) = stripe.swap_remove_index(victim?)?;
        self.evictions.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("tessera_ps_evictions_total").increment(1);
        Some(key)
    }

    /// Exchanges every row with `other`'s (a copy staged aside, installed
    /// in one step): afterwards this holds what `other` held and `other`
    /// the old rows, to be dropped outside any lock.
    pub fn swap_rows(&self, other: &ShardRows) {
        if self.stripes.len() == other.stripes.len() {
            for i in 0..self.stripes.len() {
                std::mem::swap(&mut *self.write_stripe(i), &mut *other.write_stripe(i));
            }
            return;
        }
        // Laid out differently (another row limit): row by row.
        let mut moved: Vec<(u64, Row)> = Vec::with_capacity(other.len());
        for i in 0..other.stripes.len() {
            moved.extend(other.write_stripe(i).drain(..));
        }
        for i in 0..self.stripes.len() {
            let old: Vec<(u64, Row)> = self.write_stripe(i).drain(..).collect();
            for (key, row) in old {
                other.insert(key, row);
            }
        }
        for (key, row) in moved {
            self.insert(key, row);
        }
    }

    /// Drops every row.
    pub fn clear(&self) {
        for i in 0..self.stripes.len() {
            self.write_stripe(i).clear();
        }
    }

    /// Rows held.
    pub fn len(&self) -> usize {
        (0..self.stripes.len())
            .map(|i| self.read_stripe(i).len())
            .sum()
    }

    /// Whether no row is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Rows evicted so far.
    pub fn evictions(&self) -> u64 {
        self.evictions.load(Ordering::Relaxed)
    }

    /// Every row's contents, shared (see [`Row`]): one stripe read-locked
    /// at a time, each for as long as it takes to count its references.
    /// The caller holds the shard's write lock, so no Push changes a row
    /// meanwhile and the snapshot is a cut at the shard's version. Fetches
    /// go on: of present rows at once, and a Fetch that inserts a missing
    /// row (its initial values, which any copy re-creates alike) waits at
    /// most for one stripe.
    pub fn snapshot(&self) -> Vec<(u64, Arc<RowData>)> {
        let mut out = Vec::with_capacity(self.len());
        for i in 0..self.stripes.len() {
            let stripe = self.read_stripe(i);
            out.extend(
                stripe
                    .iter()
                    .map(|(&key, row)| (key, Arc::clone(&row.data))),
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(v: f32) -> Row {
        Row::new(vec![v].into_boxed_slice(), Box::new([]))
    }

    #[test]
    fn the_row_limit_holds_and_evictions_are_counted() {
        for (max, policy) in [(10u64, EvictionPolicy::Lru), (1000, EvictionPolicy::Lfu)] {
            let rows = ShardRows::new(Some(max), policy);
            for key in 0..5 * max {
                rows.upsert(key, || row(1.0), |_| ());
                assert!(rows.len() as u64 <= max, "{} rows, limit {max}", rows.len());
            }
            assert_eq!(rows.evictions(), 5 * max - rows.len() as u64);
        }
        let unlimited = ShardRows::new(None, EvictionPolicy::Lru);
        for key in 0..10_000 {
            unlimited.upsert(key, || row(0.0), |_| ());
        }
        assert_eq!(unlimited.len(), 10_000);
        assert_eq!(unlimited.evictions(), 0);
    }

    #[test]
    fn lru_keeps_rows_that_are_read_often() {
        let rows = ShardRows::new(Some(6400), EvictionPolicy::Lru);
        let hot: Vec<u64> = (0..640).collect();
        for key in &hot {
            rows.upsert(*key, || row(1.0), |_| ());
        }
        for cold in 1_000_000..1_040_000u64 {
            rows.upsert(cold, || row(0.0), |_| ());
            // The hot set is read between every few inserts.
            if cold.is_multiple_of(8) {
                for key in &hot {
                    rows.read(*key, |_| ());
                }
            }
        }
        let kept = hot
            .iter()
            .filter(|k| rows.read(**k, |_| ()).is_some())
            .count();
        assert!(kept >= 600, "only {kept} of 640 hot rows survived");
    }

    #[test]
    fn lfu_keeps_rows_that_are_updated_often() {
        let rows = ShardRows::new(Some(640), EvictionPolicy::Lfu);
        for key in 0..64u64 {
            rows.upsert(key, || row(1.0), |r| r.data_mut().steps = 100);
        }
        for cold in 1_000..20_000u64 {
            rows.upsert(cold, || row(0.0), |r| r.data_mut().steps = 1);
        }
        let kept = (0..64u64)
            .filter(|k| rows.read(*k, |_| ()).is_some())
            .count();
        assert!(
            kept >= 60,
            "only {kept} of 64 frequently updated rows survived"
        );
    }
}
