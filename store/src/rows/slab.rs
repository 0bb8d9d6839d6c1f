//! The records of one stripe: fixed-size rows ([`super::layout`])
//! numbered by slot, freed slots reused; and the rows a snapshot still
//! needs.
//!
//! **Blocks.** Records live in blocks of 64, 64, 128, 256, ... records,
//! doubling up to [`BLOCK_ROWS`] and that size from then on: a slot's
//! block and place follow from its number by arithmetic, and the list of
//! blocks is short (about 40 for 150,000 rows), so that finding a record
//! reads nothing that is not already in cache but the record itself (with
//! a block per 64 records, the first version, a Fetch of a large shard
//! missed the cache once for the block's pointer and again for the
//! record). A block is allocated zeroed and its records are handed out in
//! order, so the part not reached yet is address space the kernel has not
//! backed with memory. A large stripe's next block is made ahead, outside
//! its lock, on huge pages where it is 2 MiB or more ([`Slab::wants_block`],
//! `rows::block`). Growth adds a block and never moves a record (the
//! only other growth cost is the key index's, bounded per insert).
//!
//! **Chunks** are the bookkeeping unit of [`CHUNK_ROWS`] slots: a 64-bit
//! mask of the records that hold a row (one byte per 8 rows), and a cut's
//! slot table (below). Slots are opened a chunk at a time.
//!
//! **Cuts.** A snapshot opens a cut on every stripe ([`Slab::open_cut`]):
//! from then on the first change to a slot the cut covers saves what it
//! held (`rows::cut`); the snapshot reads each slot's record as it was
//! at the cut, live or saved, under the stripe's read lock
//! ([`Slab::read_cut`]). A stripe replaced or cleared under an open cut
//! first saves every row the cut still reads live (`Slab::save_all`).

use prefetch_index::prefetch_index;

use std::sync::Arc;

use super::block::Block;
pub use super::cut::CHUNK_ROWS;
use super::cut::Cut;
use super::index::MAX_SLOTS;
use super::spares::Spares;

/// Records of the largest block: 4,096 (295 KiB of SGD rows of dim 16,
/// 3 MiB of Adam rows of dim 64): few blocks per stripe, and a stripe
/// that stops growing leaves at most one block's tail unused.
pub const BLOCK_ROWS: usize = CHUNK_ROWS << BLOCK_DOUBLINGS;

/// Doublings from the first block's size to [`BLOCK_ROWS`].
const BLOCK_DOUBLINGS: u32 = 6;

/// Blocks a slab holds before it asks for the next one ahead
/// ([`Slab::wants_block`]): the first 4,096-record block and 16 more
/// (73,728 records, a shard of 4.7 million rows). A block made ahead is
/// resident before its rows come, and what a stripe leaves unused of its
/// last block stays resident when the growth stops: asked from the start,
/// a shard of 10^5-10^6 rows took 30-70% more memory (Adam rows of dim
/// 64: 803 -> 1,344 bytes a row at 10^5). From here that is at most one
/// block in 17, and the stripes whose growth faults most in under their
/// locks (the largest) are served.
const AHEAD_FROM_BLOCKS: usize = BLOCK_DOUBLINGS as usize + 1 + 16;

/// The block holding `slot`, and the slot's record in it (module docs).
#[inline]
fn locate(slot: u32) -> (usize, usize) {
    let slot = slot as usize;
    if slot < CHUNK_ROWS {
        return (0, slot);
    }
    if slot < 2 * BLOCK_ROWS {
        // Block b >= 1 holds slots 64 * 2^(b-1) up to twice that.
        let b = (slot / CHUNK_ROWS).ilog2() as usize + 1;
        return (b, slot - (CHUNK_ROWS << (b - 1)));
    }
    (
        slot / BLOCK_ROWS + BLOCK_DOUBLINGS as usize,
        slot % BLOCK_ROWS,
    )
}

/// Records in block `b`.
fn block_rows(b: usize) -> usize {
    match b {
        0 => CHUNK_ROWS,
        _ => CHUNK_ROWS << (b - 1).min(BLOCK_DOUBLINGS as usize),
    }
}

/// Records in blocks `0..n`: they double up to [`BLOCK_ROWS`] (the first
/// `BLOCK_DOUBLINGS + 1` blocks hold `CHUNK_ROWS << (n - 1)`), then
/// `BLOCK_ROWS` a block.
fn slots_in_blocks(n: usize) -> usize {
    let doubling = BLOCK_DOUBLINGS as usize + 1;
    match n {
        0 => 0,
        _ if n <= doubling => CHUNK_ROWS << (n - 1),
        _ => BLOCK_ROWS * (n - doubling + 1),
    }
}

/// The records of one stripe (module docs).
#[derive(Debug)]
pub struct Slab {
    /// Words per record.
    words: usize,
    /// Per chunk opened, bit `i`: its record `i` holds a row.
    live: Vec<u64>,
    /// The records, in blocks (module docs).
    blocks: Vec<Block>,
    /// The next block, its pages written by a Push outside the stripe's
    /// lock ([`Slab::wants_block`]).
    next_block: Option<Block>,
    /// Blocks opened that were made ahead ([`Slab::give_block`]).
    blocks_ahead: u64,
    /// Slots freed, reused first (last freed, first reused).
    free: Vec<u32>,
    len: usize,
    /// Open cuts.
    cuts: Vec<Cut>,
    /// Records saved for cuts so far.
    saved: u64,
}

/// Bytes a slab holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlabBytes {
    /// Bytes of the records holding rows.
    pub rows: u64,
    /// Bytes of records holding no row in the chunks opened (freed, or
    /// not used yet); the rest of the last block is not counted: it was
    /// never written, so the kernel has not backed it with memory.
    pub free: u64,
    /// Bytes of bookkeeping: chunk masks, block pointers, the free list.
    pub overhead: u64,
    /// Bytes held for open cuts (slot tables and saved records).
    pub cuts: u64,
}

impl Slab {
    /// An empty slab of `words`-word records.
    pub fn new(words: usize) -> Self {
        Self {
            words: words.max(1),
            live: Vec::new(),
            blocks: Vec::new(),
            next_block: None,
            blocks_ahead: 0,
            free: Vec::new(),
            len: 0,
            cuts: Vec::new(),
            saved: 0,
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

    /// Slots there are (held or free).
    pub fn slots(&self) -> usize {
        self.live.len() * CHUNK_ROWS
    }

    /// The record at `slot`.
    #[inline]
    pub fn record(&self, slot: u32) -> &[u32] {
        let (block, at) = locate(slot);
        &self.blocks[block][at * self.words..(at + 1) * self.words]
    }

    /// The record of `slot` if it holds a row (`None` for a free slot or
    /// one beyond the slab).
    #[inline]
    pub fn live_record(&self, slot: u32) -> Option<&[u32]> {
        self.holds(slot).then(|| self.record(slot))
    }

    /// Asks the processor to load the first `words` words of `slot`'s
    /// record (every cache line they touch), without waiting; nothing
    /// for a slot beyond the blocks.
    #[inline]
    pub fn prefetch(&self, slot: u32, words: usize) {
        let (block, at) = locate(slot);
        let Some(block) = self.blocks.get(block).map(|b| &b[..]) else {
            return;
        };
        let start = at * self.words;
        let words = words.min(self.words);
        // A line holds 16 words: one prefetch per 16 from the start, and
        // the last word's line (where the record's start is not aligned).
        for word in (0..words).step_by(16) {
            prefetch_index(block, start + word);
        }
        if words > 0 {
            prefetch_index(block, start + words - 1);
        }
        // What a change to the slot reads of each open cut (a Push's
        // update saves the row first): its chunk's mark and chain.
        let chunk = slot as usize / CHUNK_ROWS;
        for cut in &self.cuts {
            cut.prefetch(chunk);
        }
    }

    fn holds(&self, slot: u32) -> bool {
        let (chunk, at) = Self::split(slot);
        self.live
            .get(chunk)
            .is_some_and(|live| live & (1 << at) != 0)
    }

    /// The record at `slot`, to change it: what it holds is saved first
    /// for every open cut that still reads it live.
    pub fn record_mut(&mut self, slot: u32) -> &mut [u32] {
        self.save(slot);
        let (block, at) = locate(slot);
        let words = self.words;
        &mut self.blocks[block][at * words..(at + 1) * words]
    }

    /// Saves what `slot` holds for every open cut that has not yet.
    fn save(&mut self, slot: u32) {
        if self.cuts.is_empty() {
            return;
        }
        let (blocks, words) = (&self.blocks, self.words);
        let record = self.holds(slot).then(|| {
            let (block, at) = locate(slot);
            &blocks[block][at * words..(at + 1) * words]
        });
        for cut in &mut self.cuts {
            if cut.save(slot, record) {
                self.saved += 1;
            }
        }
    }

    /// A slot for a new row (its record holds garbage until written);
    /// `None` when the stripe holds [`MAX_SLOTS`] rows already.
    pub fn alloc(&mut self) -> Option<u32> {
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                let next = self.live.len() * CHUNK_ROWS;
                if next as u64 > u64::from(MAX_SLOTS) {
                    return None;
                }
                let (block, _) = locate(next as u32);
                if block == self.blocks.len() {
                    let words = block_rows(block) * self.words;
                    let ready = self.next_block.take().filter(|b| b.len() == words);
                    self.blocks_ahead += u64::from(ready.is_some());
                    // Else zeroed: fresh pages from the kernel for a large
                    // block, backed as its records are first written,
                    // under the stripe's lock (small pages: `rows::block`).
                    self.blocks
                        .push(ready.unwrap_or_else(|| Block::zeroed(words)));
                }
                self.live.push(0);
                // The rest of the new chunk, handed out in slot order.
                self.free
                    .extend((next as u32 + 1..(next + CHUNK_ROWS) as u32).rev());
                next as u32
            }
        };
        // A free slot an open cut covers held no row at its cut (a row
        // freed since was saved as it went).
        self.save(slot);
        let (chunk, at) = Self::split(slot);
        self.live[chunk] |= 1 << at;
        self.len += 1;
        Some(slot)
    }

    /// The words of the block this slab will open next, when it is near
    /// (fewer free and unopened slots left than half the last block), none
    /// is ready, and the slab holds `AHEAD_FROM_BLOCKS` blocks already:
    /// a caller that is about to add rows makes one with
    /// [`Block::touched`] outside the stripe's lock and hands it over
    /// ([`Slab::give_block`]), so that no page of it is faulted in while
    /// the lock is held (the stripe's Fetches wait for that).
    pub fn wants_block(&self) -> Option<usize> {
        if self.next_block.is_some() || self.blocks.len() < AHEAD_FROM_BLOCKS {
            return None;
        }
        let opened = self.live.len() * CHUNK_ROWS;
        let left = slots_in_blocks(self.blocks.len()) - opened + self.free.len();
        let last = self.blocks.len().checked_sub(1).map_or(0, block_rows);
        (left < last / 2 + CHUNK_ROWS)
            .then(|| block_rows(self.blocks.len()) * self.words)
            .filter(|_| opened < MAX_SLOTS as usize)
    }

    /// Keeps `block` for the next block the slab opens, if it is the size
    /// [`Slab::wants_block`] asked for and none is kept yet; else hands it
    /// back, for the caller to drop once it has released the stripe's
    /// lock (unmapping a block is not free).
    #[must_use = "a block not kept is dropped: drop it outside the stripe's lock"]
    pub fn give_block(&mut self, block: Block) -> Option<Block> {
        if self.next_block.is_none() && Some(block.len()) == self.wants_block() {
            self.next_block = Some(block);
            return None;
        }
        Some(block)
    }

    /// Blocks opened so far that a caller made ahead.
    pub fn blocks_ahead(&self) -> u64 {
        self.blocks_ahead
    }

    /// Frees `slot`'s record (which holds a row).
    pub fn release(&mut self, slot: u32) {
        self.save(slot);
        let (chunk, at) = Self::split(slot);
        let live = &mut self.live[chunk];
        debug_assert!(*live & (1 << at) != 0, "slot {slot} freed twice");
        *live &= !(1 << at);
        self.len -= 1;
        self.free.push(slot);
    }

    /// A slot holding a row, drawn from `draw` (uniform over the rows of
    /// the chunk it lands in); `None` if the slab is empty.
    pub fn sample(&self, draw: u64) -> Option<u32> {
        if self.len == 0 {
            return None;
        }
        let start = (draw % self.live.len() as u64) as usize;
        // Few chunks are empty in a full stripe; walk on from an empty one.
        for i in 0..self.live.len() {
            let chunk = (start + i) % self.live.len();
            let live = self.live[chunk];
            if live != 0 {
                let nth = ((draw >> 32) % u64::from(live.count_ones())) as u32;
                let at = nth_set_bit(live, nth);
                return Some((chunk * CHUNK_ROWS + at) as u32);
            }
        }
        None
    }

    /// Drops every row (the open cuts keep what they read).
    pub fn clear(&mut self) {
        self.save_all();
        self.live = Vec::new();
        self.blocks = Vec::new();
        self.next_block = None;
        self.free = Vec::new();
        self.len = 0;
    }

    /// Exchanges the rows with `other`'s; the open cuts stay (each saves
    /// every row it still reads live first).
    pub fn swap_rows(&mut self, other: &mut Slab) {
        self.save_all();
        other.save_all();
        std::mem::swap(&mut self.live, &mut other.live);
        std::mem::swap(&mut self.blocks, &mut other.blocks);
        std::mem::swap(&mut self.next_block, &mut other.next_block);
        std::mem::swap(&mut self.free, &mut other.free);
        std::mem::swap(&mut self.len, &mut other.len);
    }

    /// Saves, for every open cut, every slot it still reads live.
    fn save_all(&mut self) {
        let slots: Vec<u32> = self
            .cuts
            .iter()
            .flat_map(|cut| {
                (0..cut.slots())
                    .filter(|&slot| !cut.changed(slot))
                    .map(|slot| slot as u32)
            })
            .collect();
        for slot in slots {
            self.save(slot);
        }
    }

    /// Opens cut `id` over the slots there are now, its copies' blocks
    /// taken from `spares` where it has one (`rows::spares`).
    pub fn open_cut(&mut self, id: u64, spares: Arc<Spares>) {
        self.cuts
            .push(Cut::open(id, self.live.len(), self.words, spares));
    }

    /// Closes cut `id`, handing back what it saved, for the caller to
    /// drop once it has released the stripe's lock: freeing a cut's copies
    /// (hundreds of MiB after a long snapshot of a large shard under
    /// Pushes) returns memory to the kernel, which held a Push waiting for
    /// the stripe up to 40 ms.
    #[must_use = "dropping the cut frees its copies: drop it outside the stripe's lock"]
    pub fn close_cut(&mut self, id: u64) -> Option<Cut> {
        let at = self.cuts.iter().position(|cut| cut.id() == id)?;
        Some(self.cuts.swap_remove(at))
    }

    /// Calls `f` with the slot and record of each row of cut `id` at
    /// slots `from..to` in order, while it returns true; returns the slot
    /// after the last one passed to `f` (or the end of the range or the
    /// cut).
    pub fn read_cut(&self, id: u64, from: u32, to: u32, f: impl FnMut(u32, &[u32]) -> bool) -> u32 {
        match self.cuts.iter().find(|c| c.id() == id) {
            Some(cut) => cut.read(from, to, |slot| self.live_record(slot), f),
            None => from,
        }
    }

    /// Slots cut `id` covers.
    pub fn cut_slots(&self, id: u64) -> u32 {
        self.cuts
            .iter()
            .find(|c| c.id() == id)
            .map_or(0, |c| c.slots() as u32)
    }

    /// Records saved for cuts so far.
    pub fn saved_records(&self) -> u64 {
        self.saved
    }

    /// What the slab holds, in bytes.
    pub fn bytes(&self) -> SlabBytes {
        let record = (self.words * 4) as u64;
        let records = self.slots() as u64;
        SlabBytes {
            rows: self.len as u64 * record,
            free: (records - self.len as u64) * record
                + self.next_block.as_ref().map_or(0, |b| b.len() as u64 * 4),
            overhead: (self.live.capacity() * 8
                + self.blocks.capacity() * std::mem::size_of::<Block>()
                + self.free.capacity() * 4) as u64,
            cuts: self.cuts.iter().map(Cut::bytes).sum(),
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

#[cfg(test)]
mod tests {
    use super::super::block::HUGE_PAGE;
    use super::*;

    /// No spare blocks: saves allocate their own.
    fn spares(slab: &Slab) -> Arc<Spares> {
        let spares = Spares::new(super::super::cut::block_words(slab.words));
        spares.bound(0);
        Arc::new(spares)
    }

    fn rows_of_cut(slab: &Slab, id: u64) -> Vec<u32> {
        let mut out = Vec::new();
        slab.read_cut(id, 0, u32::MAX, |_, r| {
            out.push(r[0]);
            true
        });
        out
    }

    #[test]
    fn a_cut_reads_its_rows_as_they_were_whatever_changes_after() {
        let mut slab = Slab::new(3);
        let slots: Vec<u32> = (0..200).map(|_| slab.alloc().unwrap()).collect();
        assert_eq!(slots, (0..200).collect::<Vec<_>>(), "slots in order");
        for &slot in &slots {
            slab.record_mut(slot).copy_from_slice(&[slot, slot, slot]);
        }
        slab.release(7);
        slab.open_cut(1, spares(&slab));
        assert_eq!(slab.saved_records(), 0, "opening a cut copies nothing");
        // Changed, freed, freed and reused, a free slot reused, new slots.
        slab.record_mut(6)[0] = 999;
        slab.record_mut(6)[0] = 998;
        slab.release(5);
        slab.release(100);
        for _ in 0..3 {
            let slot = slab.alloc().unwrap();
            slab.record_mut(slot)[0] = 5000 + slot;
        }
        assert_eq!(slab.saved_records(), 3, "rows 6, 5 and 100, once each");
        let expected: Vec<u32> = (0..200).filter(|s| *s != 7).collect();
        assert_eq!(rows_of_cut(&slab, 1), expected, "the cut as it was");
        // A second cut sees the rows as they are now.
        slab.open_cut(2, spares(&slab));
        let now = rows_of_cut(&slab, 2);
        assert!(now.contains(&998) && now.contains(&(5000 + 7)) && !now.contains(&6));
        // Reading from a slot on, and stopping early.
        let mut first = Vec::new();
        let next = slab.read_cut(1, 10, u32::MAX, |_, r| {
            first.push(r[0]);
            first.len() < 2
        });
        assert_eq!((first, next), (vec![10, 11], 12));
        drop(slab.close_cut(1));
        slab.record_mut(8)[0] = 1;
        assert_eq!(slab.saved_records(), 4, "one more, for cut 2 alone");
        drop(slab.close_cut(2));
        slab.record_mut(9)[0] = 1;
        assert_eq!(slab.saved_records(), 4, "none with no cut open");
    }

    #[test]
    fn a_cleared_or_swapped_slab_keeps_its_open_cuts_whole() {
        let mut slab = Slab::new(1);
        for v in 0..100 {
            let slot = slab.alloc().unwrap();
            slab.record_mut(slot)[0] = v;
        }
        slab.open_cut(9, spares(&slab));
        let mut other = Slab::new(1);
        let slot = other.alloc().unwrap();
        other.record_mut(slot)[0] = 4242;
        slab.swap_rows(&mut other);
        assert_eq!(slab.len(), 1);
        assert_eq!(rows_of_cut(&slab, 9), (0..100).collect::<Vec<_>>());
        slab.clear();
        assert_eq!(rows_of_cut(&slab, 9), (0..100).collect::<Vec<_>>());
    }

    #[test]
    fn blocks_double_to_their_cap_and_every_slot_has_its_own_record() {
        let sizes: Vec<usize> = (0..9).map(block_rows).collect();
        assert_eq!(sizes, [64, 64, 128, 256, 512, 1024, 2048, 4096, 4096]);
        for n in 0..40 {
            assert_eq!(
                slots_in_blocks(n),
                (0..n).map(block_rows).sum::<usize>(),
                "{n} blocks"
            );
        }
        // Slots in order fill each block in order, then the next.
        let mut expected = (0, 0);
        for slot in 0..(3 * BLOCK_ROWS as u32 + 100) {
            assert_eq!(locate(slot), expected, "slot {slot}");
            expected.1 += 1;
            if expected.1 == block_rows(expected.0) {
                expected = (expected.0 + 1, 0);
            }
        }
        assert_eq!(locate(MAX_SLOTS).0, MAX_SLOTS as usize / BLOCK_ROWS + 6);
        // Through a slab: 20,000 rows, each reads back what it was given.
        let mut slab = Slab::new(2);
        for v in 0..20_000u32 {
            let slot = slab.alloc().unwrap();
            slab.record_mut(slot).copy_from_slice(&[v, !v]);
        }
        assert_eq!(
            slab.blocks.len(),
            11,
            "64 + 64 + ... + 2048 = 4,096, then 4 of 4,096"
        );
        for v in 0..20_000u32 {
            assert_eq!(slab.record(v), [v, !v]);
        }
    }

    #[test]
    fn a_growing_slab_asks_for_its_next_block_ahead_and_opens_the_one_given() {
        // Small records, and records whose blocks are 2 MiB (mapped).
        for words in [3, HUGE_PAGE / 4 / BLOCK_ROWS] {
            let mut slab = Slab::new(words);
            let mut given = Vec::new();
            let first_ahead =
                2 * BLOCK_ROWS + (AHEAD_FROM_BLOCKS - BLOCK_DOUBLINGS as usize - 2) * BLOCK_ROWS;
            for n in 0..first_ahead + 3 * BLOCK_ROWS {
                // Small slabs are never served ahead.
                if n < first_ahead - BLOCK_ROWS {
                    assert_eq!(slab.wants_block(), None, "at {n}");
                }
                if let Some(wanted) = slab.wants_block() {
                    // A block of the wrong size is not kept.
                    assert!(slab.give_block(Block::touched(wanted + 1)).is_some());
                    assert!(slab.next_block.is_none());
                    let block = Block::touched(wanted);
                    assert_eq!(block.is_mapped(), wanted * 4 >= HUGE_PAGE);
                    given.push(block.as_ptr());
                    assert!(slab.give_block(block).is_none());
                    // One at a time, and only the size asked for.
                    assert_eq!(slab.wants_block(), None);
                }
                let slot = slab.alloc().unwrap();
                slab.record_mut(slot).fill(slot);
            }
            // The three blocks past the mark came from a caller, ahead of
            // need; none before it.
            assert_eq!(slab.blocks.len(), AHEAD_FROM_BLOCKS + 3);
            assert_eq!(slab.blocks_ahead(), 3);
            for block in &slab.blocks[AHEAD_FROM_BLOCKS..] {
                assert!(given.contains(&block.as_ptr()));
            }
            for slot in (0..slab.slots() as u32).step_by(997) {
                assert!(slab.record(slot).iter().all(|&w| w == slot), "{words}");
            }
        }
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

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(u32),
        Release(u16),
        Write(u16, u32),
        Open,
        Close(u8),
        Read(u8, u16, u16, u8),
        Swap,
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            6 => any::<u32>().prop_map(Op::Alloc),
            2 => any::<u16>().prop_map(Op::Release),
            6 => (any::<u16>(), any::<u32>()).prop_map(|(s, v)| Op::Write(s, v)),
            1 => Just(Op::Open),
            1 => any::<u8>().prop_map(Op::Close),
            2 => (any::<u8>(), any::<u16>(), any::<u16>(), any::<u8>())
                .prop_map(|(c, f, n, stop)| Op::Read(c, f, n, stop)),
            1 => Just(Op::Swap),
        ]
    }

    proptest::proptest! {
        /// Against a model that copies every row at each cut: whatever
        /// is changed, freed, reused or swapped out after a cut, reading
        /// it (whole, from a slot on, or stopped early) gives the rows as
        /// they were, and each row is saved at most once per cut.
        #[test]
        fn cuts_read_what_a_full_copy_would(ops in proptest::collection::vec(op(), 1..600)) {
            use std::collections::BTreeMap;
            let mut slab = Slab::new(2);
            let mut live: BTreeMap<u32, u32> = BTreeMap::new();
            let mut cuts: Vec<(u64, BTreeMap<u32, u32>)> = Vec::new();
            let mut next_id = 0;
            let mut possible = 0u64;
            for op in ops {
                match op {
                    Op::Alloc(v) => {
                        let slot = slab.alloc().expect("a slot");
                        proptest::prop_assert!(!live.contains_key(&slot));
                        slab.record_mut(slot).copy_from_slice(&[v, slot]);
                        live.insert(slot, v);
                    }
                    Op::Release(n) | Op::Write(n, _) if live.is_empty() => {
                        let _ = n;
                    }
                    Op::Release(n) => {
                        let slot = *live.keys().nth(n as usize % live.len()).expect("a row");
                        slab.release(slot);
                        live.remove(&slot);
                    }
                    Op::Write(n, v) => {
                        let slot = *live.keys().nth(n as usize % live.len()).expect("a row");
                        slab.record_mut(slot)[0] = v;
                        live.insert(slot, v);
                    }
                    Op::Open => {
                        next_id += 1;
                        slab.open_cut(next_id, spares(&slab));
                        cuts.push((next_id, live.clone()));
                        possible += live.len() as u64;
                    }
                    Op::Close(c) if !cuts.is_empty() => {
                        let (id, _) = cuts.remove(c as usize % cuts.len());
                        drop(slab.close_cut(id));
                    }
                    Op::Close(_) => {}
                    Op::Read(c, from, n, stop) if !cuts.is_empty() => {
                        let (id, rows) = &cuts[c as usize % cuts.len()];
                        let (from, to) = (u32::from(from % 300), u32::from(from % 300) + u32::from(n % 300));
                        let stop = usize::from(stop % 8);
                        let mut got = Vec::new();
                        let next = slab.read_cut(*id, from, to, |slot, r| {
                            got.push((slot, r[0], r[1]));
                            stop == 0 || got.len() < stop
                        });
                        let mut want: Vec<(u32, u32, u32)> = rows
                            .range(from..to)
                            .map(|(&slot, &v)| (slot, v, slot))
                            .collect();
                        let stopped = stop != 0 && want.len() >= stop;
                        if stopped {
                            want.truncate(stop);
                        }
                        let end = if stopped {
                            want[stop - 1].0 + 1
                        } else {
                            to.min(slab.cut_slots(*id)).max(from)
                        };
                        proptest::prop_assert_eq!(&got, &want);
                        proptest::prop_assert_eq!(next, end);
                    }
                    Op::Read(..) => {}
                    Op::Swap => {
                        // Swapped out and back: the cuts are kept whole.
                        let mut other = Slab::new(2);
                        slab.swap_rows(&mut other);
                        slab.swap_rows(&mut other);
                    }
                }
            }
            proptest::prop_assert!(slab.saved_records() <= possible);
        }
    }
}
