//! One lock stripe of a shard's rows: its slab of records, its key
//! index, and the per-slot marks kept beside the records (last use for
//! eviction, last Fetch for expiry on access).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use super::StripeFull;
use super::index::KeyIndex;
use super::layout::RowLayout;
use super::slab::{CHUNK_ROWS, Slab};

/// One stripe: records, index, and (with a row limit) each slot's last
/// use.
#[derive(Debug)]
pub(super) struct Stripe {
    pub(super) slab: Slab,
    pub(super) index: KeyIndex,
    /// Last use per slot, a chunk of atomics per slab chunk (tables with
    /// a row limit only): marked by Fetches under the read lock.
    pub(super) used: Vec<Box<[AtomicU64]>>,
    /// Stamp of the last Fetch per slot, a chunk of atomics per slab
    /// chunk (tables expiring on access only): marked under the read
    /// lock, folded into the records by [`ShardRows::sweep`].
    pub(super) touched: Vec<Box<[AtomicU32]>>,
    /// The widened values of a row being updated (narrow storage).
    pub(super) scratch: Vec<f32>,
    /// Most entries an insert moved for an index growth, since the last
    /// [`ShardRows::take_most_moved`].
    pub(super) most_moved: usize,
}

impl Stripe {
    pub(super) fn new(layout: &RowLayout) -> Self {
        Self {
            slab: Slab::new(layout.words()),
            index: KeyIndex::new(),
            used: Vec::new(),
            touched: Vec::new(),
            scratch: Vec::new(),
            most_moved: 0,
        }
    }

    pub(super) fn find(&self, layout: &RowLayout, key: u64) -> Option<u32> {
        let slab = &self.slab;
        self.index.get(key, |slot| layout.key(slab.record(slot)))
    }

    /// [`Stripe::find`] trying `candidate` first ([`KeyIndex::candidates`]):
    /// it is `key`'s slot if its record holds a row with that key.
    pub(super) fn find_from(&self, layout: &RowLayout, key: u64, candidate: u32) -> Option<u32> {
        match self.slab.live_record(candidate) {
            Some(record) if layout.key(record) == key => Some(candidate),
            _ => self.find(layout, key),
        }
    }

    pub(super) fn used(&self, slot: u32) -> Option<&AtomicU64> {
        let (chunk, at) = (slot as usize / CHUNK_ROWS, slot as usize % CHUNK_ROWS);
        self.used.get(chunk).map(|c| &c[at])
    }

    pub(super) fn touched(&self, slot: u32) -> Option<&AtomicU32> {
        let (chunk, at) = (slot as usize / CHUNK_ROWS, slot as usize % CHUNK_ROWS);
        self.touched.get(chunk).map(|c| &c[at])
    }

    /// A new record for `key` (its contents unset but the key), stamped
    /// `stamp` (and marked so, expiring on access).
    pub(super) fn add(
        &mut self,
        layout: &RowLayout,
        key: u64,
        limited: bool,
        access: bool,
        stamp: u32,
    ) -> Result<u32, StripeFull> {
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
        layout.set_stamp(self.slab.record_mut(slot), stamp);
        if access {
            while self.touched.len() * CHUNK_ROWS <= slot as usize {
                self.touched
                    .push((0..CHUNK_ROWS).map(|_| AtomicU32::new(0)).collect());
            }
            if let Some(t) = self.touched(slot) {
                t.store(stamp, Ordering::Relaxed);
            }
        }
        Ok(slot)
    }

    pub(super) fn remove(&mut self, layout: &RowLayout, key: u64) -> bool {
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
