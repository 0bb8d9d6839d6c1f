//! The row store this benchmark measures against: Tessera's store before
//! issue 34 (`ps-server/src/table/rows.rs` at ff41562), kept here as it
//! was, less what the benchmark does not call (evictions, staging).
//!
//! Keys spread over 64 stripes, each an `RwLock<IndexMap<u64, Row>>`; a
//! row is an `Arc<RowData>` of two boxed slices, so that a snapshot costs
//! one reference count per row under the shard's lock and a write to a
//! row a snapshot shares copies it (`Arc::make_mut`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};
use tessera_transport::sync::RwLockExt;

use indexmap::IndexMap;
use tessera_proto::sharding::splitmix64;

/// What a row holds: shared with snapshots, copied on write.
#[derive(Debug, Clone, PartialEq)]
pub struct RowData {
    /// The embedding.
    pub values: Box<[f32]>,
    /// Optimizer state (`slots * dim`).
    pub state: Box<[f32]>,
    /// Optimizer steps applied.
    pub steps: u32,
}

/// One row: its contents and its last use.
#[derive(Debug)]
pub struct Row {
    data: Arc<RowData>,
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

    /// The contents.
    pub fn data(&self) -> &RowData {
        &self.data
    }

    /// Its last use (kept by the old store for eviction; part of its
    /// size).
    pub fn last_used(&self) -> u64 {
        self.last_used.load(Ordering::Relaxed)
    }
}

const STRIPES: usize = 64;

/// The rows of one (table, shard), unlimited.
#[derive(Debug)]
pub struct ShardRows {
    stripes: Box<[RwLock<IndexMap<u64, Row>>]>,
}

impl Default for ShardRows {
    fn default() -> Self {
        Self {
            stripes: (0..STRIPES).map(|_| RwLock::default()).collect(),
        }
    }
}

impl ShardRows {
    fn stripe(&self, key: u64) -> usize {
        ((splitmix64(key) >> 32) as usize) % self.stripes.len()
    }

    fn read_stripe(&self, i: usize) -> RwLockReadGuard<'_, IndexMap<u64, Row>> {
        self.stripes[i].read_locked()
    }

    fn write_stripe(&self, i: usize) -> RwLockWriteGuard<'_, IndexMap<u64, Row>> {
        self.stripes[i].write_locked()
    }

    /// Calls `read` with the row of `key`, if present.
    pub fn read<R>(&self, key: u64, read: impl FnOnce(&Row) -> R) -> Option<R> {
        let stripe = self.read_stripe(self.stripe(key));
        stripe.get(&key).map(read)
    }

    /// Calls `update` with the row of `key`, inserting `init()` first when
    /// it is missing; returns whether the insert outgrew the stripe's map
    /// (every row of the stripe moved) and how many rows it held then.
    pub fn upsert(
        &self,
        key: u64,
        init: impl FnOnce() -> Row,
        update: impl FnOnce(&mut Row),
    ) -> Option<usize> {
        let mut stripe = self.write_stripe(self.stripe(key));
        let capacity = stripe.capacity();
        update(stripe.entry(key).or_insert_with(init));
        (stripe.capacity() != capacity).then(|| stripe.len() - 1)
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

    /// Every row's contents, shared: a reference count per row.
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

    /// The bound `ps-server`'s `no_insert_moves_more_than_a_bounded_number_
    /// of_rows_for_a_growth` holds the slab store to (at most
    /// `MIGRATE_PER_INSERT` rows moved by one insert), applied to this
    /// store: it fails, by a whole stripe.
    #[test]
    fn the_store_before_moved_a_whole_stripe_when_one_insert_outgrew_it() {
        let rows = ShardRows::default();
        let mut most = 0;
        for key in 0..600_000u64 {
            let moved = rows.upsert(
                key.wrapping_mul(0x2545_f491_4f6c_dd1d),
                || Row::new(vec![0.5; 4].into_boxed_slice(), Box::new([])),
                |_| (),
            );
            most = most.max(moved.unwrap_or(0));
        }
        let bound = tessera_store::rows::index::MIGRATE_PER_INSERT;
        assert!(
            most > 100 * bound,
            "one insert moved {most} rows (the slab store's bound: {bound})"
        );
    }
}
