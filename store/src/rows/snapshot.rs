//! A consistent image of a (table, shard)'s rows for a checkpoint or a
//! copy to another server, read while Fetches and Pushes go on: a cut on
//! every stripe ([`super::slab`]), read a few KiB of records per hold of
//! a stripe's read lock.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, RwLock};

use tessera_sync::LockExt;

use super::cut;
use super::spares::Spares;
use super::{RowLayout, RowRef, ShardRows, Stripe, read, write};

impl ShardRows {
    /// Every row at this cut (see [`super::slab`]): each stripe write-locked for
    /// as long as it takes to open a cut on it, which costs nothing per
    /// row. The caller holds the shard's write lock, so no Push changes a
    /// row meanwhile and the snapshot is a cut at the shard's version.
    /// Fetches go on: a Fetch that inserts a missing row (its initial
    /// values, which any copy re-creates alike) waits at most for one
    /// stripe, and is not part of the cut.
    pub fn snapshot(&self) -> RowsSnapshot {
        let id = self.next_cut.fetch_add(1, Ordering::Relaxed);
        let spares = Arc::new(Spares::new(cut::block_words(self.layout.words())));
        let lens = (0..self.stripes.len())
            .map(|i| {
                let mut stripe = self.write_stripe(i);
                stripe.slab.open_cut(id, Arc::clone(&spares));
                stripe.slab.len()
            })
            .collect::<Vec<_>>();
        // At most one copy per row of the cut; each stripe may leave a
        // block part-filled.
        let len = lens.iter().sum::<usize>();
        spares.bound(len / cut::SAVE_BLOCK + self.stripes.len());
        RowsSnapshot {
            cut: Arc::new(Cut {
                stripes: Some(Arc::clone(&self.stripes)),
                id,
                layout: self.layout,
                len,
                lens,
                cursor: Mutex::new(Cursor::default()),
                spares: Some(spares),
            }),
        }
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
    /// Blocks for the Pushes' copies, touched ahead by the reader
    /// ([`super::spares`]).
    spares: Option<Arc<Spares>>,
}

impl Drop for Cut {
    fn drop(&mut self) {
        for stripe in self.stripes.iter().flat_map(|s| s.iter()) {
            let closed = write(stripe).slab.close_cut(self.id);
            // Freed here, the stripe's lock released.
            drop(closed);
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
                spares: None,
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
            // Between holds, the blocks the stripes' next saves will
            // fill get their pages here rather than in a Push.
            if let Some(spares) = &cut.spares {
                spares.top_up();
            }
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
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_reads_about_4_kib_of_records_per_hold_of_a_stripe() {
        // SGD dim 16 in f32: 18 words, 72 bytes.
        assert_eq!(read_slots(18), 56);
        // Small records: at most 256 a hold; large ones: at least 4.
        assert_eq!(read_slots(1), READ_MAX_SLOTS);
        assert_eq!(read_slots(2000), READ_MIN_SLOTS);
        assert_eq!(read_slots(0), READ_MAX_SLOTS);
    }
}
