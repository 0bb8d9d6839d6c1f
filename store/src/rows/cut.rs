//! What a snapshot's cut keeps of one stripe ([`super::slab`]): which
//! slots changed since the cut, and a copy of each row as it was before
//! its first change.
//!
//! A cut records how many slots there are and, per chunk of
//! [`CHUNK_ROWS`] slots, a mask of the slots changed since and the last
//! copy saved of one of them (twelve bytes per 64 rows). From then on, the
//! first change to a slot below that mark (an update, an eviction, or a
//! free slot taken for a new row) marks it and, if it held a row, saves a
//! copy of its record, appended to the cut's blocks behind a link word
//! (the chunk's previous copy and the slot's place in the chunk). The
//! snapshot reads a slot's live record if it is unmarked (it is then as it
//! was at the cut), and the copy its chunk's chain names otherwise (no
//! copy: the slot held no row). A Push during a snapshot pays one record
//! copy and a mark per row it changes, once per open cut: bounded per row
//! (not per chunk or per shard), and nothing for rows already saved.
//!
//! The copies' blocks come, where it can, from the snapshot's
//! [`Spares`]: blocks whose pages its reader touched ahead, so that a
//! Push does not fault in the memory its copies land in.
//!
//! The first version kept a table of 64 entries per chunk, allocated at
//! the chunk's first change: a Push of 1,000 random rows just after a
//! cut allocated and zeroed 1,000 of them (256 KiB, 64 fresh pages to
//! fault in) besides its copies, and its on-CPU time nearly tripled. A
//! slot table for the whole stripe, allocated zeroed at the cut, cost a
//! page fault per row a Push changed (2-5 ms per Push). Copy-on-write
//! chunks behind `Arc`s (the version before that): a Push of 1,000 random
//! rows after a cut touched 1,000 chunks and copied 64 rows for each.

use std::sync::Arc;

use prefetch_index::prefetch_index;

use super::spares::Spares;

/// Records per chunk, the slab's bookkeeping unit and a cut's: one bit
/// each in the chunk's mask of live records (`rows::slab`) and in a cut's
/// mask of changed ones. Defined here, below the slab, because a cut is
/// laid out by it.
pub const CHUNK_ROWS: usize = 64;

/// Saved records per block of a cut.
pub const SAVE_BLOCK: usize = 256;

/// Words of a block of copies of `record_words`-word records (each copy
/// a link word and a record).
pub fn block_words(record_words: usize) -> usize {
    SAVE_BLOCK * (record_words + 1)
}

/// A copy's link word: the slot's place in its chunk in the low bits,
/// the chunk's previous copy (plus one; 0: none) above them.
const LINK_AT_BITS: u32 = CHUNK_ROWS.trailing_zeros();

/// What a cut still needs of the slots of one stripe (module docs).
#[derive(Debug)]
pub struct Cut {
    id: u64,
    /// Slots at the cut.
    slots: usize,
    /// Per chunk at the cut, bit `i`: slot `i` changed since (its record
    /// as it was is saved, or it held no row).
    changed: Vec<u64>,
    /// Per chunk, the last copy saved of one of its slots, plus one (0:
    /// none); each copy's link word names the one before.
    last: Vec<u32>,
    /// The copies, [`SAVE_BLOCK`] a block, each a link word and a record.
    copies: Vec<Vec<u32>>,
    /// Words per copy: the link word and a record.
    stride: usize,
    saved: usize,
    /// Blocks for copies, touched ahead by the snapshot's reader.
    spares: Arc<Spares>,
}

impl Cut {
    /// Cut `id` over `chunks` chunks of `words`-word records, its copies'
    /// blocks taken from `spares` where it has one.
    pub fn open(id: u64, chunks: usize, words: usize, spares: Arc<Spares>) -> Self {
        Self {
            id,
            slots: chunks * CHUNK_ROWS,
            stride: words + 1,
            changed: vec![0; chunks],
            last: vec![0; chunks],
            copies: Vec::new(),
            saved: 0,
            spares,
        }
    }

    /// The cut's id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Slots at the cut.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Whether `slot` changed since the cut.
    pub fn changed(&self, slot: usize) -> bool {
        self.changed
            .get(slot / CHUNK_ROWS)
            .is_some_and(|mask| mask & (1 << (slot % CHUNK_ROWS)) != 0)
    }

    /// Asks the processor to load what a change to a slot of `chunk`
    /// reads of the cut: the chunk's mark and chain.
    #[inline]
    pub fn prefetch(&self, chunk: usize) {
        if chunk < self.changed.len() {
            prefetch_index(&self.changed, chunk);
            prefetch_index(&self.last, chunk);
        }
    }

    /// `slot` is about to change: marks it if the cut covers it and it
    /// has not changed since, and saves `record` (what it holds; `None`:
    /// no row). Returns whether a copy was saved.
    pub fn save(&mut self, slot: u32, record: Option<&[u32]>) -> bool {
        if slot as usize >= self.slots {
            return false;
        }
        let (chunk, at) = (slot as usize / CHUNK_ROWS, slot as usize % CHUNK_ROWS);
        let changed = &mut self.changed[chunk];
        if *changed & (1 << at) != 0 {
            return false;
        }
        *changed |= 1 << at;
        let Some(record) = record else {
            return false;
        };
        let block = self.saved / SAVE_BLOCK;
        if block == self.copies.len() {
            // Touched ahead by the reader where it could; else allocated,
            // not zeroed: the copies are appended, so each page is written
            // (and faulted in) once, by the save that reaches it. Zeroed,
            // a block of Adam rows (200 KiB) was cleared whole by the save
            // that opened it, and on this VM, where fresh memory is slow
            // to touch, Pushes during a snapshot of 10^7 such rows took
            // 2 ms at the median.
            let block = self
                .spares
                .take()
                .unwrap_or_else(|| Vec::with_capacity(SAVE_BLOCK * self.stride));
            self.copies.push(block);
        }
        let link = self.last[chunk] << LINK_AT_BITS | at as u32;
        let copies = &mut self.copies[block];
        copies.push(link);
        copies.extend_from_slice(record);
        self.saved += 1;
        // At most one copy per slot: the link fits its 26 bits.
        debug_assert!(self.saved <= self.slots);
        self.last[chunk] = self.saved as u32;
        true
    }

    /// Calls `f` with the slot and record of each row of the cut at slots
    /// `from..to` in order, while it returns true; `live` gives a slot's
    /// record now, if it holds a row. Returns the slot after the last one
    /// passed to `f` (or the end of the range or the cut).
    pub fn read<'a>(
        &'a self,
        from: u32,
        to: u32,
        live: impl Fn(u32) -> Option<&'a [u32]>,
        mut f: impl FnMut(u32, &[u32]) -> bool,
    ) -> u32 {
        let end = (to as usize).min(self.slots);
        let mut slot = from as usize;
        while slot < end {
            let chunk = slot / CHUNK_ROWS;
            let chunk_end = ((chunk + 1) * CHUNK_ROWS).min(end);
            let changed = self.changed[chunk];
            // The copies of the chunk's changed slots, by place.
            let mut copy_at = [None; CHUNK_ROWS];
            if changed != 0 {
                self.copies_of(chunk, |at, copy| copy_at[at] = Some(copy));
            }
            for slot in slot..chunk_end {
                let at = slot % CHUNK_ROWS;
                let record = if changed & (1 << at) == 0 {
                    match live(slot as u32) {
                        Some(record) => record,
                        None => continue,
                    }
                } else {
                    match copy_at[at] {
                        Some(copy) => copy,
                        None => continue,
                    }
                };
                if !f(slot as u32, record) {
                    return slot as u32 + 1;
                }
            }
            slot = chunk_end;
        }
        end.max(from as usize) as u32
    }

    /// Calls `each` with the place in `chunk` and the saved record of
    /// every copy of one of its slots.
    fn copies_of<'a>(&'a self, chunk: usize, mut each: impl FnMut(usize, &'a [u32])) {
        let stride = self.stride;
        let mut link = self.last[chunk];
        while link != 0 {
            let n = (link - 1) as usize;
            let copy = &self.copies[n / SAVE_BLOCK]
                [(n % SAVE_BLOCK) * stride..(n % SAVE_BLOCK + 1) * stride];
            each((copy[0] & (CHUNK_ROWS as u32 - 1)) as usize, &copy[1..]);
            link = copy[0] >> LINK_AT_BITS;
        }
    }

    /// Bytes the cut holds: its marks, chains and copies' blocks.
    pub fn bytes(&self) -> u64 {
        (self.changed.len() * 8
            + self.last.len() * 4
            + self.copies.iter().map(Vec::capacity).sum::<usize>() * 4) as u64
    }
}
