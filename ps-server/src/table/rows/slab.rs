//! The records of one stripe: fixed-size rows ([`super::layout`]) in
//! chunks of [`CHUNK_ROWS`], numbered by slot (chunk * 64 + record), freed
//! slots reused.
//!
//! A chunk is one allocation of `64 * words` `u32`s and a 64-bit mask of
//! the records that hold a row. Chunks sit behind an `Arc`: a snapshot
//! ([`Slab::snapshot`]) clones one pointer per chunk, not per row, and a
//! write to a chunk a snapshot still holds copies that chunk first
//! (`Arc::make_mut`), so a Push during a checkpoint pays at most one chunk
//! copy (64 records) per row it touches, once per snapshot, and the
//! snapshot stays a consistent cut. Growth adds a chunk; the chunk list
//! doubles now and then, which copies one pointer per 64 rows (the only
//! growth cost besides the key index's, which is bounded per insert).
//!
//! 64 rows a chunk: a record of a 64-float Adam row is 780 bytes, so a
//! chunk is 50 KB at most for such tables and 4.6 KB for SGD at dim 16;
//! copying one costs microseconds, and the per-chunk bookkeeping (an
//! `Arc`, a mask, an allocation header: about 64 bytes) is one byte per
//! row.

use std::sync::Arc;

use super::index::MAX_SLOTS;

/// Records per chunk (one bit each in the chunk's mask).
pub const CHUNK_ROWS: usize = 64;

#[derive(Debug, Clone)]
struct Chunk {
    /// Bit `i`: record `i` holds a row.
    live: u64,
    words: Box<[u32]>,
}

/// The records of one stripe (module docs).
#[derive(Debug)]
pub struct Slab {
    /// Words per record.
    words: usize,
    chunks: Vec<Arc<Chunk>>,
    /// Slots freed, reused first (last freed, first reused).
    free: Vec<u32>,
    len: usize,
    /// Chunks copied because a snapshot held them.
    copied: u64,
}

/// Bytes a slab holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlabBytes {
    /// Bytes of the records holding rows.
    pub rows: u64,
    /// Bytes of chunk records holding no row (freed, or not used yet).
    pub free: u64,
    /// Bytes of bookkeeping: chunk masks and pointers, the free list.
    pub overhead: u64,
}

impl Slab {
    /// An empty slab of `words`-word records.
    pub fn new(words: usize) -> Self {
        Self {
            words: words.max(1),
            chunks: Vec::new(),
            free: Vec::new(),
            len: 0,
            copied: 0,
        }
    }

    fn split(slot: u32) -> (usize, usize) {
        (slot as usize / CHUNK_ROWS, slot as usize % CHUNK_ROWS)
    }

    /// Rows held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no row is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The record at `slot` (which holds a row).
    pub fn record(&self, slot: u32) -> &[u32] {
        let (chunk, at) = Self::split(slot);
        &self.chunks[chunk].words[at * self.words..(at + 1) * self.words]
    }

    /// The record at `slot`, to change it: its chunk is copied first if a
    /// snapshot holds it.
    pub fn record_mut(&mut self, slot: u32) -> &mut [u32] {
        let (chunk, at) = Self::split(slot);
        let words = self.words;
        let chunk = self.chunk_mut(chunk);
        &mut chunk.words[at * words..(at + 1) * words]
    }

    fn chunk_mut(&mut self, chunk: usize) -> &mut Chunk {
        let shared = &mut self.chunks[chunk];
        if Arc::strong_count(shared) > 1 {
            self.copied += 1;
            metrics::counter!("tessera_ps_store_chunks_copied_total").increment(1);
        }
        Arc::make_mut(shared)
    }

    /// A slot for a new row (its record holds garbage until written);
    /// `None` when the stripe holds [`MAX_SLOTS`] rows already.
    pub fn alloc(&mut self) -> Option<u32> {
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                let next = self.chunks.len() * CHUNK_ROWS;
                if next as u64 > u64::from(MAX_SLOTS) {
                    return None;
                }
                self.chunks.push(Arc::new(Chunk {
                    live: 0,
                    words: vec![0; CHUNK_ROWS * self.words].into_boxed_slice(),
                }));
                // The rest of the new chunk, handed out in slot order.
                self.free
                    .extend((next as u32 + 1..(next + CHUNK_ROWS) as u32).rev());
                next as u32
            }
        };
        let (chunk, at) = Self::split(slot);
        self.chunk_mut(chunk).live |= 1 << at;
        self.len += 1;
        Some(slot)
    }

    /// Frees `slot`'s record (which holds a row).
    pub fn release(&mut self, slot: u32) {
        let (chunk, at) = Self::split(slot);
        let chunk = self.chunk_mut(chunk);
        debug_assert!(chunk.live & (1 << at) != 0, "slot {slot} freed twice");
        chunk.live &= !(1 << at);
        self.len -= 1;
        self.free.push(slot);
    }

    /// A slot holding a row, drawn from `draw` (uniform over the rows of
    /// the chunk it lands in); `None` if the slab is empty.
    pub fn sample(&self, draw: u64) -> Option<u32> {
        if self.len == 0 {
            return None;
        }
        let start = (draw % self.chunks.len() as u64) as usize;
        // Few chunks are empty in a full stripe; walk on from an empty one.
        for i in 0..self.chunks.len() {
            let chunk = (start + i) % self.chunks.len();
            let live = self.chunks[chunk].live;
            if live != 0 {
                let nth = ((draw >> 32) % u64::from(live.count_ones())) as u32;
                let at = nth_set_bit(live, nth);
                return Some((chunk * CHUNK_ROWS + at) as u32);
            }
        }
        None
    }

    /// Drops every row.
    pub fn clear(&mut self) {
        self.chunks.clear();
        self.free.clear();
        self.len = 0;
    }

    /// Every chunk, shared: the cost is one pointer per chunk.
    pub fn snapshot(&self) -> SlabSnapshot {
        SlabSnapshot {
            words: self.words,
            chunks: self.chunks.clone(),
            len: self.len,
        }
    }

    /// Chunks copied so far because a snapshot held them.
    pub fn copied_chunks(&self) -> u64 {
        self.copied
    }

    /// What the slab holds, in bytes.
    pub fn bytes(&self) -> SlabBytes {
        let record = (self.words * 4) as u64;
        let records = (self.chunks.len() * CHUNK_ROWS) as u64;
        SlabBytes {
            rows: self.len as u64 * record,
            free: (records - self.len as u64) * record,
            overhead: (self.chunks.capacity() * std::mem::size_of::<Arc<Chunk>>()
                + self.chunks.len() * (std::mem::size_of::<Chunk>() + 16)
                + self.free.capacity() * 4) as u64,
        }
    }
}

/// The position of the `nth` set bit of `mask` (which has more than `nth`).
fn nth_set_bit(mut mask: u64, nth: u32) -> usize {
    for _ in 0..nth {
        mask &= mask - 1;
    }
    mask.trailing_zeros() as usize
}

/// A slab's chunks at one cut (shared with the live slab until it writes
/// them).
#[derive(Debug, Clone)]
pub struct SlabSnapshot {
    words: usize,
    chunks: Vec<Arc<Chunk>>,
    len: usize,
}

impl SlabSnapshot {
    /// Rows held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no row is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The records holding rows, from the `skip`-th on, in slot order.
    pub fn records_from(&self, skip: usize) -> impl Iterator<Item = &[u32]> + '_ {
        // Whole chunks skipped by their row counts; then record by record.
        let mut left = skip;
        let mut first = self.chunks.len();
        for (i, chunk) in self.chunks.iter().enumerate() {
            let rows = chunk.live.count_ones() as usize;
            if left < rows {
                first = i;
                break;
            }
            left -= rows;
        }
        let words = self.words;
        self.chunks[first.min(self.chunks.len())..]
            .iter()
            .flat_map(move |chunk| {
                (0..CHUNK_ROWS)
                    .filter(move |at| chunk.live & (1 << at) != 0)
                    .map(move |at| &chunk.words[at * words..(at + 1) * words])
            })
            .skip(left)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_slots_are_reused_and_a_snapshot_keeps_its_cut() {
        let mut slab = Slab::new(3);
        let slots: Vec<u32> = (0..200).map(|_| slab.alloc().unwrap()).collect();
        assert_eq!(slots, (0..200).collect::<Vec<_>>(), "slots in order");
        for &slot in &slots {
            slab.record_mut(slot).copy_from_slice(&[slot, slot, slot]);
        }
        let snapshot = slab.snapshot();
        slab.release(5);
        slab.record_mut(6)[0] = 999;
        assert_eq!(slab.alloc(), Some(5), "the freed slot comes back first");
        assert_eq!(slab.len(), 200);
        assert_eq!(slab.copied_chunks(), 1, "one chunk copied for the snapshot");
        let seen: Vec<u32> = snapshot.records_from(0).map(|r| r[0]).collect();
        assert_eq!(
            seen,
            (0..200).collect::<Vec<_>>(),
            "the snapshot is the cut"
        );
        let from: Vec<u32> = snapshot.records_from(130).map(|r| r[0]).collect();
        assert_eq!(from, (130..200).collect::<Vec<_>>());
        assert_eq!(snapshot.records_from(200).count(), 0);
        slab.release(100);
        let after = slab.snapshot();
        assert_eq!(after.len(), 199);
        let rows: Vec<u32> = after.records_from(99).map(|r| r[0]).collect();
        assert_eq!(rows[..2], [99, 101]);
    }

    #[test]
    fn samples_are_rows() {
        let mut slab = Slab::new(1);
        for _ in 0..300 {
            slab.alloc();
        }
        for slot in (0..300).filter(|s| s % 3 != 0) {
            slab.release(slot);
        }
        for draw in 0..1000u64 {
            let slot = slab
                .sample(tessera_proto::sharding::splitmix64(draw))
                .unwrap();
            assert_eq!(slot % 3, 0, "slot {slot} holds no row");
        }
    }
}
