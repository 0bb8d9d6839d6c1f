//! The rows of one (table, shard): values, optimizer state, and what the
//! eviction policy needs, in lock stripes of slab records.
//!
//! Keys are spread over 64 stripes, each an `RwLock` over a [`Slab`] of
//! fixed-size records (key, steps, values, optimizer state: see
//! [`layout`]) in blocks of up to 4,096, and a [`KeyIndex`] from key to
//! slot.
//! Fetches of different stripes never contend and Fetches of one stripe
//! share its read lock; a row costs its payload, a 4-byte index bucket at
//! a load of 2/5 to 4/5, and about a byte of bookkeeping, where the
//! `IndexMap` of `Arc`ed boxed rows this replaces spent 2.65x the payload
//! (issue 34). The index grows by moving a few entries per insert
//! ([`index::MIGRATE_PER_INSERT`]), so no insert (and no Fetch behind it)
//! waits for a stripe's whole table to be rebuilt.
//!
//! A snapshot ([`ShardRows::snapshot`]) opens a cut on every stripe: it
//! costs nothing per row; a row changed while the snapshot is read is
//! copied once, as it was, before it changes (see [`slab`]).
//!
//! Eviction samples a few rows of a full stripe and evicts the worst by
//! the table's policy, as Redis does ("approximated LRU/LFU"): exact LRU
//! would need a list update under a write lock on every read. The last
//! use of each row is kept beside the records (an atomic per slot, only
//! for a table with a row limit), so a Fetch marks it under the read
//! lock.
//!
//! A limit of `max_rows` is enforced per stripe as `max_rows / stripes`,
//! with fewer stripes for small limits (at least 64 rows each), so the
//! total never exceeds it; a stripe that fills first starts evicting a
//! little before the whole shard is full.

pub mod index;
pub mod layout;
pub mod slab;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard, TryLockError};
use tessera_rpc::sync::{LockExt, RwLockExt};

use serde::{Deserialize, Serialize};
use tessera_proto::sharding::splitmix64;

use self::index::{KeyIndex, MAX_SLOTS};
pub use self::layout::{RowLayout, Storage};
use self::slab::{CHUNK_ROWS, Slab};

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

/// A row a Push evicted: `key` went just before the Push's key at index
/// `before` was inserted (replicas replay it at the same point).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Eviction {
    /// Index in the Push's keys of the row whose insertion evicted it.
    pub before: u32,
    /// The evicted row's key.
    pub key: u64,
}

/// A stripe holds [`MAX_SLOTS`] rows already: the row was not stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a stripe of this shard holds {MAX_SLOTS} rows, its most")]
pub struct StripeFull;

/// Rows sampled per eviction. 8: Redis's experience is that 5-10 samples
/// come close to exact LRU at a fraction of its cost.
const EVICTION_SAMPLES: usize = 8;

/// Stripes per (table, shard).
const STRIPES: usize = 64;

/// Rows a (table, shard) holds at most: [`MAX_SLOTS`] per stripe.
pub const MAX_SHARD_ROWS: u64 = STRIPES as u64 * MAX_SLOTS as u64;

/// Fewest rows per stripe of a limited table.
const MIN_STRIPE_ROWS: usize = 64;

/// One row, read in place.
#[derive(Debug, Clone, Copy)]
pub struct RowRef<'a> {
    layout: &'a RowLayout,
    record: &'a [u32],
}

impl RowRef<'_> {
    /// Its key.
    pub fn key(&self) -> u64 {
        self.layout.key(self.record)
    }

    /// Updates applied (0 where the layout does not keep them).
    pub fn steps(&self) -> u32 {
        self.layout.steps(self.record)
    }

    /// Its values as `f32`.
    pub fn values(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.layout.dim()];
        self.layout.read_values(self.record, &mut out);
        out
    }

    /// Its optimizer state as `f32`.
    pub fn state(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.layout.state_len()];
        self.layout.read_state(self.record, &mut out);
        out
    }

    /// Its values as little-endian `f32` into `out` (`4 * dim` bytes).
    pub fn write_values_le(&self, out: &mut [u8]) {
        self.layout.write_values_le(self.record, out);
    }

    /// Appends the row as a row file stores it ([`crate::rowfile`]): key,
    /// steps, values and state, little-endian `u64`, `u32` and `f32`s.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.key().to_le_bytes());
        out.extend_from_slice(&self.steps().to_le_bytes());
        let at = out.len();
        out.resize(at + self.layout.dim() * 4, 0);
        self.layout.write_values_le(self.record, &mut out[at..]);
        self.layout.write_state_le(self.record, out);
    }
}

/// One stripe: records, index, and (with a row limit) each slot's last
/// use.
#[derive(Debug)]
struct Stripe {
    slab: Slab,
    index: KeyIndex,
    /// Last use per slot, a chunk of atomics per slab chunk (tables with
    /// a row limit only): marked by Fetches under the read lock.
    used: Vec<Box<[AtomicU64]>>,
    /// The widened values of a row being updated (narrow storage).
    scratch: Vec<f32>,
    /// Most entries an insert moved for an index growth, since the last
    /// [`ShardRows::take_most_moved`].
    most_moved: usize,
}

impl Stripe {
    fn new(layout: &RowLayout) -> Self {
        Self {
            slab: Slab::new(layout.words()),
            index: KeyIndex::new(),
            used: Vec::new(),
            scratch: Vec::new(),
            most_moved: 0,
        }
    }

    fn find(&self, layout: &RowLayout, key: u64) -> Option<u32> {
        let slab = &self.slab;
        self.index.get(key, |slot| layout.key(slab.record(slot)))
    }

    fn used(&self, slot: u32) -> Option<&AtomicU64> {
        let (chunk, at) = (slot as usize / CHUNK_ROWS, slot as usize % CHUNK_ROWS);
        self.used.get(chunk).map(|c| &c[at])
    }

    /// A new record for `key` (its contents unset but the key).
    fn add(&mut self, layout: &RowLayout, key: u64, limited: bool) -> Result<u32, StripeFull> {
        let slot = self.slab.alloc().ok_or(StripeFull)?;
        layout.set_key(self.slab.record_mut(slot), key);
        let slab = &self.slab;
        let moved = self.index.insert(key, slot, |s| layout.key(slab.record(s)));
        self.most_moved = self.most_moved.max(moved);
        if limited {
            while self.used.len() * CHUNK_ROWS <= slot as usize {
                self.used
                    .push((0..CHUNK_ROWS).map(|_| AtomicU64::new(0)).collect());
            }
        }
        Ok(slot)
    }

    fn remove(&mut self, layout: &RowLayout, key: u64) -> bool {
        let slab = &self.slab;
        match self.index.remove(key, |s| layout.key(slab.record(s))) {
            Some(slot) => {
                self.slab.release(slot);
                true
            }
            None => false,
        }
    }
}

/// What the rows of a (table, shard) take, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RowBytes {
    /// Rows held.
    pub rows: u64,
    /// Bytes of the records holding rows.
    pub row_bytes: u64,
    /// Bytes of the key index.
    pub index_bytes: u64,
    /// Bytes of records free in the chunks.
    pub free_bytes: u64,
    /// Bytes of bookkeeping (chunk masks and pointers, free lists, last
    /// use marks).
    pub overhead_bytes: u64,
    /// Bytes held for snapshots being read (rows changed since their cut).
    pub cut_bytes: u64,
}

impl std::ops::Add for RowBytes {
    type Output = RowBytes;

    fn add(self, other: RowBytes) -> RowBytes {
        RowBytes {
            rows: self.rows + other.rows,
            row_bytes: self.row_bytes + other.row_bytes,
            index_bytes: self.index_bytes + other.index_bytes,
            free_bytes: self.free_bytes + other.free_bytes,
            overhead_bytes: self.overhead_bytes + other.overhead_bytes,
            cut_bytes: self.cut_bytes + other.cut_bytes,
        }
    }
}

impl RowBytes {
    /// Every byte counted.
    pub fn total(&self) -> u64 {
        self.row_bytes + self.index_bytes + self.free_bytes + self.overhead_bytes + self.cut_bytes
    }
}

/// The rows of one (table, shard) (module docs).
#[derive(Debug)]
pub struct ShardRows {
    layout: RowLayout,
    /// Shared with the snapshots being read.
    stripes: Arc<[RwLock<Stripe>]>,
    /// The next snapshot's cut id.
    next_cut: AtomicU64,
    /// The most rows any stripe has held ([`ShardRows::has_room`]).
    largest: AtomicUsize,
    /// Rows per stripe at most (`None`: unlimited).
    stripe_limit: Option<usize>,
    policy: EvictionPolicy,
    clock: AtomicU64,
    evictions: AtomicU64,
}

impl ShardRows {
    /// Empty rows of `layout`, holding at most `max_rows` (`None`:
    /// unlimited).
    pub fn new(layout: RowLayout, max_rows: Option<u64>, policy: EvictionPolicy) -> Self {
        // With a limit, every stripe holds at least MIN_STRIPE_ROWS so that
        // a small table is not cut to a handful of rows per stripe.
        let stripes = match max_rows {
            Some(max) => (max as usize / MIN_STRIPE_ROWS).clamp(1, STRIPES),
            None => STRIPES,
        };
        Self {
            stripes: (0..stripes)
                .map(|_| RwLock::new(Stripe::new(&layout)))
                .collect(),
            layout,
            next_cut: AtomicU64::new(1),
            largest: AtomicUsize::new(0),
            stripe_limit: max_rows.map(|max| (max as usize / stripes).max(1)),
            policy,
            clock: AtomicU64::new(1),
            evictions: AtomicU64::new(0),
        }
    }

    /// Where the parts of a row lie.
    pub fn layout(&self) -> &RowLayout {
        &self.layout
    }

    fn stripe(&self, key: u64) -> usize {
        // High bits: the low ones of the same hash already chose the shard.
        ((splitmix64(key) >> 32) as usize) % self.stripes.len()
    }

    fn read_stripe(&self, i: usize) -> RwLockReadGuard<'_, Stripe> {
        read(&self.stripes[i])
    }

    fn write_stripe(&self, i: usize) -> RwLockWriteGuard<'_, Stripe> {
        write(&self.stripes[i])
    }

    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::Relaxed)
    }

    /// Marks `slot` used now. Only a table with a row limit keeps the
    /// clock: it is one shared atomic per row touched, which an unlimited
    /// table (nothing to evict) should not pay on every Fetch.
    fn touch(&self, stripe: &Stripe, slot: u32) {
        if self.stripe_limit.is_some()
            && let Some(used) = stripe.used(slot)
        {
            used.store(self.tick(), Ordering::Relaxed);
        }
    }

    /// Calls `read` with the row of `key`, if present (counts as a use).
    pub fn read<R>(&self, key: u64, read: impl FnOnce(RowRef<'_>) -> R) -> Option<R> {
        let stripe = self.read_stripe(self.stripe(key));
        let slot = stripe.find(&self.layout, key)?;
        self.touch(&stripe, slot);
        Some(read(RowRef {
            layout: &self.layout,
            record: stripe.slab.record(slot),
        }))
    }

    /// Calls `found` with the index in `keys` and the row of every key
    /// present (each counts as a use), and adds the index of every key
    /// missing to `missing`. Each stripe is read-locked once for all its
    /// keys, and their lookups overlap ([`KeyIndex::get_many`]): a Fetch's
    /// path.
    pub fn read_many(
        &self,
        keys: &[u64],
        mut found: impl FnMut(usize, RowRef<'_>),
        missing: &mut Vec<usize>,
    ) {
        let (order, starts) = self.by_stripe(keys);
        let mut stripe_keys = Vec::new();
        let mut slots = Vec::new();
        each_stripe(
            &starts,
            |s| try_read(&self.stripes[s]),
            |s| self.read_stripe(s),
            |s, stripe| {
                let group = &order[starts[s]..starts[s + 1]];
                stripe_keys.clear();
                stripe_keys.extend(group.iter().map(|&i| keys[i as usize]));
                slots.clear();
                slots.resize(group.len(), None);
                let slab = &stripe.slab;
                stripe.index.get_many(&stripe_keys, &mut slots, |slot| {
                    let record = slab.record(slot);
                    // The record's end may lie in the next cache line: loaded
                    // now, with the key, rather than when `found` reads it.
                    std::hint::black_box(record.last().copied());
                    self.layout.key(record)
                });
                for (&i, slot) in group.iter().zip(&slots) {
                    match *slot {
                        Some(slot) => {
                            self.touch(&stripe, slot);
                            found(
                                i as usize,
                                RowRef {
                                    layout: &self.layout,
                                    record: slab.record(slot),
                                },
                            );
                        }
                        None => missing.push(i as usize),
                    }
                }
            },
        );
        missing.sort_unstable();
    }

    /// The indices of `keys` grouped by stripe, in their order within a
    /// stripe (a counting sort): stripe `s`'s are `order[starts[s]..
    /// starts[s + 1]]`.
    fn by_stripe(&self, keys: &[u64]) -> (Vec<u32>, Vec<usize>) {
        let stripes = self.stripes.len();
        let of: Vec<u16> = keys.iter().map(|&k| self.stripe(k) as u16).collect();
        let mut starts = vec![0usize; stripes + 1];
        for &s in &of {
            starts[s as usize + 1] += 1;
        }
        for s in 0..stripes {
            starts[s + 1] += starts[s];
        }
        let mut order = vec![0u32; keys.len()];
        let mut next = starts.clone();
        for (i, &s) in of.iter().enumerate() {
            order[next[s as usize]] = i as u32;
            next[s as usize] += 1;
        }
        (order, starts)
    }

    /// [`ShardRows::upsert_following`] for every key of `keys` (a Push's
    /// rows, seeded `seed`), with `init` and `update` given the key's
    /// index; for a table without a row limit (nothing to evict). Each
    /// stripe is write-locked once for all its keys, where one lock per
    /// row made a Push of 1,000 rows take 1,000 locks, and sleep behind
    /// every reader it met (a snapshot being read, Fetches). The rows of
    /// one key are updated in the order of `keys`; rows of different keys
    /// do not depend on one another (rounding draws from the key, not
    /// the position), so the outcome is that of updating them in order.
    /// Returns how many rows were not stored (their stripe was full).
    pub fn upsert_many(
        &self,
        keys: &[u64],
        seed: u64,
        mut init: impl FnMut(usize, &mut [f32], &mut [f32]),
        mut update: impl FnMut(usize, &mut [f32], &mut [f32], &mut u32),
    ) -> usize {
        debug_assert!(!self.limited(), "upsert_many on a table with a row limit");
        let (order, starts) = self.by_stripe(keys);
        let mut refused = 0;
        each_stripe(
            &starts,
            |s| try_write(&self.stripes[s]),
            |s| self.write_stripe(s),
            |s, mut stripe| {
                for &i in &order[starts[s]..starts[s + 1]] {
                    let (i, key) = (i as usize, keys[i as usize]);
                    let found = stripe.find(&self.layout, key);
                    let stored = self.upsert_in(
                        &mut stripe,
                        key,
                        found,
                        seed,
                        |values, state| init(i, values, state),
                        |values, state, steps| update(i, values, state, steps),
                    );
                    refused += usize::from(stored.is_err());
                }
            },
        );
        refused
    }

    /// Calls `update` with the row of `key` as `f32` (values, optimizer
    /// state, steps), creating it first with `init` (values, state) when
    /// it is missing (evicting another row if the stripe is full).
    pub fn upsert<R>(
        &self,
        key: u64,
        init: impl FnOnce(&mut [f32], &mut [f32]),
        update: impl FnOnce(&mut [f32], &mut [f32], &mut u32) -> R,
    ) -> Result<R, StripeFull> {
        self.upsert_evicting(key, 0, init, update).map(|(r, _)| r)
    }

    /// [`ShardRows::upsert`] for a Push seeded `seed` (its identity: the
    /// rounding of narrow values draws from it, see [`layout`]), also
    /// returning the key of the row evicted to make room, if one was.
    pub fn upsert_evicting<R>(
        &self,
        key: u64,
        seed: u64,
        init: impl FnOnce(&mut [f32], &mut [f32]),
        update: impl FnOnce(&mut [f32], &mut [f32], &mut u32) -> R,
    ) -> Result<(R, Option<u64>), StripeFull> {
        let mut stripe = self.write_stripe(self.stripe(key));
        let found = stripe.find(&self.layout, key);
        let evicted = match found {
            Some(_) => None,
            None => self.make_room(&mut stripe, key),
        };
        let r = self.upsert_in(&mut stripe, key, found, seed, init, update)?;
        Ok((r, evicted))
    }

    /// [`ShardRows::upsert`] without choosing a victim (a replica replays
    /// its primary's evictions with [`ShardRows::evict`] instead).
    pub fn upsert_following<R>(
        &self,
        key: u64,
        seed: u64,
        init: impl FnOnce(&mut [f32], &mut [f32]),
        update: impl FnOnce(&mut [f32], &mut [f32], &mut u32) -> R,
    ) -> Result<R, StripeFull> {
        let mut stripe = self.write_stripe(self.stripe(key));
        let found = stripe.find(&self.layout, key);
        self.upsert_in(&mut stripe, key, found, seed, init, update)
    }

    /// Updates the row of `key` at `found` (its slot, looked up by the
    /// caller under the same lock), or adds it.
    fn upsert_in<R>(
        &self,
        stripe: &mut Stripe,
        key: u64,
        found: Option<u32>,
        seed: u64,
        init: impl FnOnce(&mut [f32], &mut [f32]),
        update: impl FnOnce(&mut [f32], &mut [f32], &mut u32) -> R,
    ) -> Result<R, StripeFull> {
        let layout = &self.layout;
        let (slot, fresh) = match found {
            Some(slot) => (slot, false),
            None => (stripe.add(layout, key, self.limited())?, true),
        };
        if fresh {
            self.largest.fetch_max(stripe.slab.len(), Ordering::Relaxed);
        }
        self.touch(stripe, slot);
        let Stripe { slab, scratch, .. } = stripe;
        Ok(layout.update(
            slab.record_mut(slot),
            scratch,
            seed,
            |values, state, steps| {
                if fresh {
                    *steps = 0;
                    init(values, state);
                }
                update(values, state, steps)
            },
        ))
    }

    /// Evicts the row of `key` (as the primary did); whether it was held.
    pub fn evict(&self, key: u64) -> bool {
        let removed = self
            .write_stripe(self.stripe(key))
            .remove(&self.layout, key);
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

    /// Whether every stripe can take `rows` more rows (a Push of that many
    /// keys is then applied whole).
    pub fn has_room(&self, rows: usize) -> bool {
        // The largest any stripe has been (it never shrinks: near the
        // limit a stripe that lost rows counts as full, which errs safe),
        // rather than 64 read locks on every Push.
        self.limited() || self.largest.load(Ordering::Relaxed) + rows <= MAX_SLOTS as usize
    }

    /// Puts a row (as saved or copied) in place of whatever `key` had
    /// (evicting another row if the stripe is full).
    pub fn insert(
        &self,
        key: u64,
        steps: u32,
        values: &[f32],
        state: &[f32],
    ) -> Result<(), StripeFull> {
        let mut stripe = self.write_stripe(self.stripe(key));
        let layout = &self.layout;
        let slot = match stripe.find(layout, key) {
            Some(slot) => slot,
            None => {
                self.make_room(&mut stripe, key);
                let slot = stripe.add(layout, key, self.limited())?;
                self.largest.fetch_max(stripe.slab.len(), Ordering::Relaxed);
                slot
            }
        };
        self.touch(&stripe, slot);
        layout.write(stripe.slab.record_mut(slot), key, steps, values, state);
        Ok(())
    }

    /// Evicts a row if `key` (not present) would overfill its stripe;
    /// returns the victim's key.
    fn make_room(&self, stripe: &mut Stripe, key: u64) -> Option<u64> {
        let limit = self.stripe_limit?;
        if stripe.slab.len() < limit {
            return None;
        }
        let mut draw = splitmix64(key ^ self.tick());
        let mut victim = None;
        let mut worst = (u64::MAX, u64::MAX);
        for _ in 0..EVICTION_SAMPLES.min(stripe.slab.len()) {
            draw = splitmix64(draw);
            let Some(slot) = stripe.slab.sample(draw) else {
                continue;
            };
            let used = stripe.used(slot).map_or(0, |u| u.load(Ordering::Relaxed));
            let score = match self.policy {
                EvictionPolicy::Lru => (used, 0),
                EvictionPolicy::Lfu => {
                    (u64::from(self.layout.steps(stripe.slab.record(slot))), used)
                }
            };
            if score < worst {
                worst = score;
                victim = Some(slot);
            }
        }
        let victim = self.layout.key(stripe.slab.record(victim?));
        stripe.remove(&self.layout, victim);
        self.evictions.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("tessera_ps_evictions_total").increment(1);
        Some(victim)
    }

    /// Exchanges every row with `other`'s (a copy staged aside, installed
    /// in one step): afterwards this holds what `other` held and `other`
    /// the old rows, to be dropped outside any lock. Snapshots being read
    /// keep their rows (see [`slab`]).
    pub fn swap_rows(&self, other: &ShardRows) {
        if self.stripes.len() == other.stripes.len() && self.layout == other.layout {
            for i in 0..self.stripes.len() {
                let (mut mine, mut theirs) = (self.write_stripe(i), other.write_stripe(i));
                mine.slab.swap_rows(&mut theirs.slab);
                std::mem::swap(&mut mine.index, &mut theirs.index);
                std::mem::swap(&mut mine.used, &mut theirs.used);
            }
            return;
        }
        // Laid out differently (another row limit): row by row.
        let (mine, theirs) = (self.snapshot(), other.snapshot());
        self.clear();
        other.clear();
        for (to, from) in [(self, &theirs), (other, &mine)] {
            from.for_each_from(0, |row| {
                // Rows that do not fit a smaller limit are evicted as usual.
                let _ = to.insert(row.key(), row.steps(), &row.values(), &row.state());
                true
            });
        }
    }

    /// Drops every row (snapshots being read keep theirs).
    pub fn clear(&self) {
        for i in 0..self.stripes.len() {
            let mut stripe = self.write_stripe(i);
            stripe.slab.clear();
            stripe.index = KeyIndex::new();
            stripe.used = Vec::new();
        }
    }

    /// Rows held.
    pub fn len(&self) -> usize {
        (0..self.stripes.len())
            .map(|i| self.read_stripe(i).slab.len())
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

    /// What the rows take, in bytes.
    pub fn bytes(&self) -> RowBytes {
        let mut out = RowBytes::default();
        for i in 0..self.stripes.len() {
            let stripe = self.read_stripe(i);
            let slab = stripe.slab.bytes();
            out.rows += stripe.slab.len() as u64;
            out.row_bytes += slab.rows;
            out.free_bytes += slab.free;
            out.index_bytes += stripe.index.bytes() as u64;
            out.cut_bytes += slab.cuts;
            out.overhead_bytes += slab.overhead
                + (stripe.used.len() * (CHUNK_ROWS * 8 + 16)) as u64
                + std::mem::size_of::<RwLock<Stripe>>() as u64;
        }
        out
    }

    /// The most index entries one insert moved for a growth since the
    /// last call, over all stripes (a test's bound on growth work).
    pub fn take_most_moved(&self) -> usize {
        (0..self.stripes.len())
            .map(|i| std::mem::take(&mut self.write_stripe(i).most_moved))
            .max()
            .unwrap_or(0)
    }

    /// Every row at this cut (see [`slab`]): each stripe write-locked for
    /// as long as it takes to open a cut on it, which costs nothing per
    /// row. The caller holds the shard's write lock, so no Push changes a
    /// row meanwhile and the snapshot is a cut at the shard's version.
    /// Fetches go on: a Fetch that inserts a missing row (its initial
    /// values, which any copy re-creates alike) waits at most for one
    /// stripe, and is not part of the cut.
    pub fn snapshot(&self) -> RowsSnapshot {
        let id = self.next_cut.fetch_add(1, Ordering::Relaxed);
        let lens = (0..self.stripes.len())
            .map(|i| {
                let mut stripe = self.write_stripe(i);
                stripe.slab.open_cut(id);
                stripe.slab.len()
            })
            .collect::<Vec<_>>();
        RowsSnapshot {
            cut: Arc::new(Cut {
                stripes: Some(Arc::clone(&self.stripes)),
                id,
                layout: self.layout,
                len: lens.iter().sum(),
                lens,
                cursor: Mutex::new(Cursor::default()),
            }),
        }
    }
}

fn read(stripe: &RwLock<Stripe>) -> RwLockReadGuard<'_, Stripe> {
    // A panic while a stripe is locked leaves at worst one row half
    // updated; serving it beats failing every later request.
    stripe.read_locked()
}

fn write(stripe: &RwLock<Stripe>) -> RwLockWriteGuard<'_, Stripe> {
    stripe.write_locked()
}

/// [`read`] if the lock is free now.
fn try_read(stripe: &RwLock<Stripe>) -> Option<RwLockReadGuard<'_, Stripe>> {
    match stripe.try_read() {
        Ok(guard) => Some(guard),
        Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

/// [`write`] if the lock is free now.
fn try_write(stripe: &RwLock<Stripe>) -> Option<RwLockWriteGuard<'_, Stripe>> {
    match stripe.try_write() {
        Ok(guard) => Some(guard),
        Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

/// Calls `visit` once with each stripe `s` that has keys (`starts[s] <
/// starts[s + 1]`, as [`ShardRows::by_stripe`] gives) and its lock: the
/// stripes whose lock `try_lock` takes at once first, in order, then the
/// ones that were busy, waiting for each (`lock`). A Fetch and a Push that
/// both walked the stripes in order and waited at each busy one fell into
/// step: each waited for the other at nearly every stripe, a sleep and a
/// wake-up each time (Fetches of 1,000 rows at p99 1 ms beside a growing
/// Push, 0.3 ms beside one that only updates). Going round a busy stripe
/// and coming back breaks the step.
fn each_stripe<G>(
    starts: &[usize],
    try_lock: impl Fn(usize) -> Option<G>,
    lock: impl Fn(usize) -> G,
    mut visit: impl FnMut(usize, G),
) {
    let mut busy = Vec::new();
    for (s, range) in starts.windows(2).enumerate() {
        if range[0] == range[1] {
            continue;
        }
        match try_lock(s) {
            Some(guard) => visit(s, guard),
            None => busy.push(s),
        }
    }
    for s in busy {
        visit(s, lock(s));
    }
}

/// Bytes of records a snapshot copies out per hold of a stripe's read
/// lock (at least [`READ_MIN_SLOTS`] records, at most [`READ_MAX_SLOTS`]):
/// a writer that finds the lock held waits about a microsecond, within
/// the spinning a lock does before it puts a thread to sleep. With 256
/// records a hold (18 KiB of SGD rows, 200 KiB of Adam rows), a Push of
/// 1,000 random rows during a copy (which takes a stripe's lock per row)
/// found the reader's hold some 20 times and slept each time; the p99 of
/// those Pushes was 5-6x that of quiet ones.
const READ_BYTES: usize = 4096;
const READ_MIN_SLOTS: u32 = 4;
const READ_MAX_SLOTS: u32 = 256;

/// Slots a snapshot reads per hold of a stripe's read lock, for records
/// of `words` words ([`READ_BYTES`]).
fn read_slots(words: usize) -> u32 {
    u32::try_from(READ_BYTES / (words * 4).max(1))
        .unwrap_or(READ_MAX_SLOTS)
        .clamp(READ_MIN_SLOTS, READ_MAX_SLOTS)
}

/// Where the last read of a snapshot stopped: rows before that position,
/// stripe and slot (sequential reads go on from there).
#[derive(Debug, Default, Clone, Copy)]
struct Cursor {
    before: usize,
    stripe: usize,
    slot: u32,
}

/// A cut open on every stripe, closed when the last handle is dropped.
#[derive(Debug)]
struct Cut {
    stripes: Option<Arc<[RwLock<Stripe>]>>,
    id: u64,
    layout: RowLayout,
    lens: Vec<usize>,
    len: usize,
    cursor: Mutex<Cursor>,
}

impl Drop for Cut {
    fn drop(&mut self) {
        for stripe in self.stripes.iter().flat_map(|s| s.iter()) {
            write(stripe).slab.close_cut(self.id);
        }
    }
}

/// Every row of a (table, shard) at one cut ([`ShardRows::snapshot`]):
/// what a checkpoint or a copy to another server encodes. Clones share
/// the cut.
#[derive(Debug, Clone)]
pub struct RowsSnapshot {
    cut: Arc<Cut>,
}

impl RowsSnapshot {
    /// No rows, of `layout`.
    pub fn empty(layout: RowLayout) -> Self {
        Self {
            cut: Arc::new(Cut {
                stripes: None,
                id: 0,
                layout,
                lens: Vec::new(),
                len: 0,
                cursor: Mutex::new(Cursor::default()),
            }),
        }
    }

    /// Rows held.
    pub fn len(&self) -> usize {
        self.cut.len
    }

    /// Whether no row is held.
    pub fn is_empty(&self) -> bool {
        self.cut.len == 0
    }

    /// Calls `f` with the rows from the `skip`-th on, in a fixed order
    /// (stripe, slot), while it returns true. The records of a few slots
    /// at a time (about 4 KiB) are copied out under the
    /// stripe's read lock and handed to
    /// `f` after it is released: a reader that is slow (encoding, or
    /// preempted on a busy host) never holds up the stripe's Pushes, nor
    /// the Fetches queued behind them. A read that starts where the last
    /// one stopped does not count the rows before again.
    pub fn for_each_from(&self, skip: usize, mut f: impl FnMut(RowRef<'_>) -> bool) {
        let cut = &*self.cut;
        let Some(stripes) = &cut.stripes else {
            return;
        };
        let mut cursor = cut.cursor.locked();
        let mut at = if cursor.before <= skip {
            *cursor
        } else {
            Cursor::default()
        };
        let layout = &cut.layout;
        let words = layout.words();
        let mut copied: Vec<u32> = Vec::new();
        let mut slots: Vec<u32> = Vec::new();
        'stripes: while at.stripe < stripes.len() {
            if at.slot == 0 && at.before + cut.lens[at.stripe] <= skip {
                // The whole stripe is before `skip`.
                at.before += cut.lens[at.stripe];
                at.stripe += 1;
                continue;
            }
            copied.clear();
            slots.clear();
            let next = {
                let stripe = read(&stripes[at.stripe]);
                let end = stripe.slab.cut_slots(cut.id);
                if at.slot >= end {
                    None
                } else {
                    Some(stripe.slab.read_cut(
                        cut.id,
                        at.slot,
                        at.slot.saturating_add(read_slots(words)),
                        |slot, record| {
                            slots.push(slot);
                            copied.extend_from_slice(record);
                            true
                        },
                    ))
                }
            };
            let Some(next) = next else {
                at = Cursor {
                    before: at.before,
                    stripe: at.stripe + 1,
                    slot: 0,
                };
                continue;
            };
            for (&slot, record) in slots.iter().zip(copied.chunks_exact(words)) {
                at.before += 1;
                if at.before <= skip {
                    continue;
                }
                if !f(RowRef { layout, record }) {
                    at.slot = slot + 1;
                    break 'stripes;
                }
            }
            at.slot = next;
        }
        *cursor = at;
    }
}

#[cfg(test)]
mod tests;
