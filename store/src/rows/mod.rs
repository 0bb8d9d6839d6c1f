//! The rows of one (table, shard): values, optimizer state, and what the
//! eviction policy needs, in lock stripes of slab records.
//!
//! Keys are spread over 64 stripes, each an `RwLock` over a [`Slab`](slab::Slab) of
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
//! A table with expiry keeps a stamp in each record (`table/expiry.rs`),
//! set to the shard's current stamp ([`ShardRows::set_stamp_now`]) by
//! every update; with `refresh = "access"`, Fetches mark the rows they
//! find beside the records (an atomic per slot, like the last use), and
//! [`ShardRows::sweep`] folds the marks into the stamps as it passes.
//!
//! A limit of `max_rows` is enforced per stripe as `max_rows / stripes`,
//! with fewer stripes for small limits (at least 64 rows each), so the
//! total never exceeds it; a stripe that fills first starts evicting a
//! little before the whole shard is full.

mod batch;
pub mod block;
mod cut;
pub mod index;
pub mod layout;
pub mod slab;
mod snapshot;
mod spares;
pub mod stamp;
mod stripe;
mod sweep;

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard, TryLockError};
use tessera_sync::RwLockExt;

use serde::{Deserialize, Serialize};
use tessera_proto::sharding::splitmix64;

use self::index::{KeyIndex, MAX_SLOTS};
pub use self::layout::{RowLayout, Storage};
use self::slab::CHUNK_ROWS;
pub use self::snapshot::RowsSnapshot;
use self::stripe::Stripe;

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

    /// Its expiry stamp (0 where the layout does not keep it).
    pub fn stamp(&self) -> u32 {
        self.layout.stamp(self.record)
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

    /// Appends its optimizer state as little-endian `f32`s to `out`.
    pub fn write_state_le(&self, out: &mut Vec<u8>) {
        self.layout.write_state_le(self.record, out);
    }

    /// Appends the row as a row file stores it ([`crate::rowfile`]): key,
    /// steps, stamp, values and state, little-endian `u64`, `u32`s and
    /// `f32`s.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.key().to_le_bytes());
        out.extend_from_slice(&self.steps().to_le_bytes());
        out.extend_from_slice(&self.stamp().to_le_bytes());
        let at = out.len();
        out.resize(at + self.layout.dim() * 4, 0);
        self.layout.write_values_le(self.record, &mut out[at..]);
        self.layout.write_state_le(self.record, out);
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
    /// The stamp updates and (expiring on access) Fetches mark rows with
    /// (`table/expiry.rs`).
    stamp_now: AtomicU32,
    /// `stamp_now` was set (by an update, a row installed, or a clock):
    /// before, it is no stamp to compare others with.
    stamp_known: AtomicBool,
    /// Fetches mark the rows they find (a table expiring on access).
    access: bool,
    /// Rows expired so far (swept here, or as the primary swept them).
    expired: AtomicU64,
    /// The longest the sweep held a stripe's write lock, nanoseconds
    /// ([`ShardRows::take_longest_sweep_hold`]).
    longest_sweep_hold: AtomicU64,
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
            stamp_now: AtomicU32::new(0),
            stamp_known: AtomicBool::new(false),
            access: false,
            expired: AtomicU64::new(0),
            longest_sweep_hold: AtomicU64::new(0),
        }
    }

    /// The same rows with Fetches marking the rows they find (a table
    /// expiring on access; its layout keeps stamps).
    pub fn marking_access(self) -> Self {
        Self {
            access: self.layout.keeps_stamp(),
            ..self
        }
    }

    /// Sets the stamp later updates (and Fetch marks) give rows. The
    /// caller of an update sets it first, under the shard's write lock.
    pub fn set_stamp_now(&self, stamp: u32) {
        self.stamp_now.store(stamp, Ordering::Relaxed);
        self.stamp_known.store(true, Ordering::Relaxed);
    }

    /// Moves the current stamp on to `stamp` if that is later (or none
    /// was set yet: a wrapping comparison with an unset 0 would call
    /// stamps past 2^31 earlier).
    pub fn note_stamp(&self, stamp: u32) {
        let latest = match self.stamp_known.load(Ordering::Relaxed) {
            true => self::stamp::later(self.stamp_now(), stamp),
            false => stamp,
        };
        self.set_stamp_now(latest);
    }

    /// Whether a current stamp was set.
    pub fn stamp_known(&self) -> bool {
        self.stamp_known.load(Ordering::Relaxed)
    }

    /// The stamp updates give rows now.
    pub fn stamp_now(&self) -> u32 {
        self.stamp_now.load(Ordering::Relaxed)
    }

    /// Where the parts of a row lie.
    pub fn layout(&self) -> &RowLayout {
        &self.layout
    }

    fn stripe(&self, key: u64) -> usize {
        // High bits: the low ones of the same hash already chose the shard.
        // Scaled to the stripe count by a multiply and a shift, not a
        // remainder: the count need not be a power of two, and a division
        // per key was a tenth of a cached Fetch's time.
        (((splitmix64(key) >> 32) * self.stripes.len() as u64) >> 32) as usize
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
        if self.access
            && let Some(touched) = stripe.touched(slot)
        {
            touched.store(self.stamp_now(), Ordering::Relaxed);
        }
    }

    /// Whether `key` has a row (not a use: an LRU clock stays as it is).
    pub fn contains(&self, key: u64) -> bool {
        self.read_stripe(self.stripe(key))
            .find(&self.layout, key)
            .is_some()
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
            None => (
                stripe.add(layout, key, self.limited(), self.access, self.stamp_now())?,
                true,
            ),
        };
        if fresh {
            self.largest.fetch_max(stripe.slab.len(), Ordering::Relaxed);
        }
        self.touch(stripe, slot);
        let Stripe { slab, scratch, .. } = stripe;
        let record = slab.record_mut(slot);
        layout.set_stamp(record, self.stamp_now());
        Ok(
            layout.update(record, scratch, seed, |values, state, steps| {
                if fresh {
                    *steps = 0;
                    init(values, state);
                }
                update(values, state, steps)
            }),
        )
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

    /// Removes the row of `key` (the delta stream says it is gone at the
    /// training fleet); whether it was held.
    pub fn remove(&self, key: u64) -> bool {
        self.write_stripe(self.stripe(key))
            .remove(&self.layout, key)
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

    /// Puts a row (as saved or copied, stamped `stamp`) in place of
    /// whatever `key` had (evicting another row if the stripe is full).
    pub fn insert(
        &self,
        key: u64,
        steps: u32,
        stamp: u32,
        values: &[f32],
        state: &[f32],
    ) -> Result<(), StripeFull> {
        let mut stripe = self.write_stripe(self.stripe(key));
        let layout = &self.layout;
        let slot = match stripe.find(layout, key) {
            Some(slot) => slot,
            None => {
                self.make_room(&mut stripe, key);
                let slot = stripe.add(layout, key, self.limited(), self.access, stamp)?;
                self.largest.fetch_max(stripe.slab.len(), Ordering::Relaxed);
                slot
            }
        };
        if self.stripe_limit.is_some()
            && let Some(used) = stripe.used(slot)
        {
            used.store(self.tick(), Ordering::Relaxed);
        }
        if let Some(touched) = stripe.touched(slot) {
            touched.store(stamp, Ordering::Relaxed);
        }
        let record = stripe.slab.record_mut(slot);
        layout.write(record, key, steps, values, state);
        layout.set_stamp(record, stamp);
        if layout.keeps_stamp() {
            // The table's clock starts from its latest row (a count of
            // Pushes goes on from there: `table/expiry.rs`).
            self.note_stamp(stamp);
        }
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
                std::mem::swap(&mut mine.touched, &mut theirs.touched);
            }
            // The largest stripe goes with the rows (`has_room`).
            let theirs = other.largest.load(Ordering::Relaxed);
            let mine = self.largest.swap(theirs, Ordering::Relaxed);
            other.largest.store(mine, Ordering::Relaxed);
            let theirs = other.stamp_now();
            let mine = self.stamp_now.swap(theirs, Ordering::Relaxed);
            other.stamp_now.store(mine, Ordering::Relaxed);
            let theirs = other.stamp_known();
            let mine = self.stamp_known.swap(theirs, Ordering::Relaxed);
            other.stamp_known.store(mine, Ordering::Relaxed);
            return;
        }
        // Laid out differently (another row limit): row by row.
        let (mine, theirs) = (self.snapshot(), other.snapshot());
        self.clear();
        other.clear();
        for (to, from) in [(self, &theirs), (other, &mine)] {
            from.for_each_from(0, |row| {
                // Rows that do not fit a smaller limit are evicted as usual.
                let _ = to.insert(
                    row.key(),
                    row.steps(),
                    row.stamp(),
                    &row.values(),
                    &row.state(),
                );
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
            stripe.touched = Vec::new();
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
                + (stripe.touched.len() * (CHUNK_ROWS * 4 + 16)) as u64
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

#[cfg(test)]
mod tests;
