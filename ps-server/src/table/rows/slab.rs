//! The records of one stripe: fixed-size rows ([`super::layout`]) in
//! chunks of [`CHUNK_ROWS`], numbered by slot (chunk * 64 + record), freed
//! slots reused; and the rows a snapshot still needs.
//!
//! A chunk is one allocation of `64 * words` `u32`s and a 64-bit mask of
//! the records that hold a row: about half a byte of bookkeeping per row.
//! Growth adds a chunk; the chunk list doubles now and then, which copies
//! one pointer per 64 rows (the only growth cost besides the key index's,
//! which is bounded per insert).
//!
//! **Cuts.** A snapshot opens a cut on every stripe ([`Slab::open_cut`]):
//! it records how many slots there are and a null pointer per chunk, so
//! taking a snapshot costs eight bytes per 64 rows. From then on, the first change to a slot below
//! that mark (an update, an eviction, or a free slot taken for a new row)
//! saves what the slot held at the cut: a copy of its record, or "no row",
//! appended to the cut's blocks, and noted in the chunk's table of 64
//! entries (allocated at the chunk's first change: a slot table for the
//! whole stripe, zeroed pages allocated at the cut, cost a page fault per
//! row a Push changed, 2-5 ms per Push of 1,000 random rows). The
//! snapshot reads a slot's saved copy if
//! there is one and the live record otherwise (which is then as it was at
//! the cut), under the stripe's read lock. A Push during a snapshot pays
//! one record copy per row it changes, once per open cut: bounded per row
//! (not per chunk or per shard), and nothing for rows already saved. A cut
//! is closed when its snapshot is dropped; a stripe replaced or cleared
//! under an open cut first saves every row the cut still reads live
//! (`Slab::save_all`).
//!
//! Written here rather than with copy-on-write chunks behind `Arc`s (the
//! first version): a Push of 1,000 random rows after a cut touched 1,000
//! chunks and copied 64 rows for each, which a Push right after a
//! checkpoint started paid in full.

use super::index::MAX_SLOTS;

/// Records per chunk (one bit each in the chunk's mask).
pub const CHUNK_ROWS: usize = 64;

/// Saved records per block of a cut.
const SAVE_BLOCK: usize = 256;

/// A cut's slot entry: the live record is the slot's contents at the cut.
const NOT_SAVED: u32 = 0;
/// A cut's slot entry: the slot held no row at the cut.
const ABSENT: u32 = 1;
/// A cut's slot entry at or above this: saved copy number `entry - 2`.
const FIRST_COPY: u32 = 2;

#[derive(Debug)]
struct Chunk {
    /// Bit `i`: record `i` holds a row.
    live: u64,
    words: Box<[u32]>,
}

/// The entries of one chunk's slots in a cut.
type Entries = Box<[u32; CHUNK_ROWS]>;

/// What a cut still needs of the slots it covers (module docs).
#[derive(Debug)]
struct Cut {
    id: u64,
    /// Slots at the cut.
    slots: usize,
    /// Per chunk at the cut, once one of its slots changed: per slot
    /// [`NOT_SAVED`], [`ABSENT`], or a copy.
    entries: Vec<Option<Entries>>,
    /// The copies, [`SAVE_BLOCK`] records a block.
    copies: Vec<Box<[u32]>>,
    saved: usize,
}

/// The records of one stripe (module docs).
#[derive(Debug)]
pub struct Slab {
    /// Words per record.
    words: usize,
    chunks: Vec<Chunk>,
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
    /// Bytes of chunk records holding no row (freed, or not used yet).
    pub free: u64,
    /// Bytes of bookkeeping: chunk masks and pointers, the free list.
    pub overhead: u64,
    /// Bytes held for open cuts (slot tables and saved records).
    pub cuts: u64,
}

impl Slab {
    /// An empty slab of `words`-word records.
    pub fn new(words: usize) -> Self {
        Self {
            words: words.max(1),
            chunks: Vec::new(),
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
        self.chunks.len() * CHUNK_ROWS
    }

    /// The record at `slot`.
    pub fn record(&self, slot: u32) -> &[u32] {
        let (chunk, at) = Self::split(slot);
        &self.chunks[chunk].words[at * self.words..(at + 1) * self.words]
    }

    fn holds(&self, slot: u32) -> bool {
        let (chunk, at) = Self::split(slot);
        self.chunks
            .get(chunk)
            .is_some_and(|c| c.live & (1 << at) != 0)
    }

    /// The record at `slot`, to change it: what it holds is saved first
    /// for every open cut that still reads it live.
    pub fn record_mut(&mut self, slot: u32) -> &mut [u32] {
        self.save(slot);
        let (chunk, at) = Self::split(slot);
        let words = self.words;
        &mut self.chunks[chunk].words[at * words..(at + 1) * words]
    }

    /// Saves what `slot` holds for every open cut that has not yet.
    fn save(&mut self, slot: u32) {
        if self.cuts.is_empty() {
            return;
        }
        let (chunk, at) = Self::split(slot);
        let holds = self.holds(slot);
        let words = self.words;
        for cut in &mut self.cuts {
            if slot as usize >= cut.slots {
                continue;
            }
            let entry = &mut cut.entries[chunk]
                .get_or_insert_with(|| Box::new([NOT_SAVED; CHUNK_ROWS]))[at];
            if *entry != NOT_SAVED {
                continue;
            }
            if !holds {
                *entry = ABSENT;
                continue;
            }
            let (block, within) = (cut.saved / SAVE_BLOCK, cut.saved % SAVE_BLOCK);
            if block == cut.copies.len() {
                cut.copies
                    .push(vec![0; SAVE_BLOCK * words].into_boxed_slice());
            }
            cut.copies[block][within * words..(within + 1) * words]
                .copy_from_slice(&self.chunks[chunk].words[at * words..(at + 1) * words]);
            *entry = FIRST_COPY + cut.saved as u32;
            cut.saved += 1;
            self.saved += 1;
        }
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
                self.chunks.push(Chunk {
                    live: 0,
                    words: vec![0; CHUNK_ROWS * self.words].into_boxed_slice(),
                });
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
        self.chunks[chunk].live |= 1 << at;
        self.len += 1;
        Some(slot)
    }

    /// Frees `slot`'s record (which holds a row).
    pub fn release(&mut self, slot: u32) {
        self.save(slot);
        let (chunk, at) = Self::split(slot);
        let chunk = &mut self.chunks[chunk];
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

    /// Drops every row (the open cuts keep what they read).
    pub fn clear(&mut self) {
        self.save_all();
        self.chunks = Vec::new();
        self.free = Vec::new();
        self.len = 0;
    }

    /// Exchanges the rows with `other`'s; the open cuts stay (each saves
    /// every row it still reads live first).
    pub fn swap_rows(&mut self, other: &mut Slab) {
        self.save_all();
        other.save_all();
        std::mem::swap(&mut self.chunks, &mut other.chunks);
        std::mem::swap(&mut self.free, &mut other.free);
        std::mem::swap(&mut self.len, &mut other.len);
    }

    /// Saves, for every open cut, every slot it still reads live.
    fn save_all(&mut self) {
        let slots: Vec<u32> = self
            .cuts
            .iter()
            .flat_map(|cut| {
                (0..cut.slots)
                    .filter(|&slot| cut.entry(slot) == NOT_SAVED)
                    .map(|slot| slot as u32)
            })
            .collect();
        for slot in slots {
            self.save(slot);
        }
    }

    /// Opens cut `id` over the slots there are now.
    pub fn open_cut(&mut self, id: u64) {
        self.cuts.push(Cut {
            id,
            slots: self.slots(),
            entries: (0..self.chunks.len()).map(|_| None).collect(),
            copies: Vec::new(),
            saved: 0,
        });
    }

    /// Closes cut `id`, dropping what it saved.
    pub fn close_cut(&mut self, id: u64) {
        self.cuts.retain(|cut| cut.id != id);
    }

    /// Calls `f` with the slot and record of each row of cut `id` at
    /// slots `from..to` in order, while it returns true; returns the slot
    /// after the last one passed to `f` (or the end of the range or the
    /// cut).
    pub fn read_cut(
        &self,
        id: u64,
        from: u32,
        to: u32,
        mut f: impl FnMut(u32, &[u32]) -> bool,
    ) -> u32 {
        let Some(cut) = self.cuts.iter().find(|c| c.id == id) else {
            return from;
        };
        let words = self.words;
        let end = (to as usize).min(cut.slots);
        for slot in from as usize..end {
            let record = match cut.entry(slot) {
                NOT_SAVED if self.holds(slot as u32) => self.record(slot as u32),
                NOT_SAVED | ABSENT => continue,
                copy => {
                    let n = (copy - FIRST_COPY) as usize;
                    &cut.copies[n / SAVE_BLOCK]
                        [(n % SAVE_BLOCK) * words..(n % SAVE_BLOCK + 1) * words]
                }
            };
            if !f(slot as u32, record) {
                return slot as u32 + 1;
            }
        }
        end.max(from as usize) as u32
    }

    /// Slots cut `id` covers.
    pub fn cut_slots(&self, id: u64) -> u32 {
        self.cuts
            .iter()
            .find(|c| c.id == id)
            .map_or(0, |c| c.slots as u32)
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
            free: (records - self.len as u64) * record,
            overhead: (self.chunks.capacity() * std::mem::size_of::<Chunk>()
                + self.chunks.len() * 16
                + self.free.capacity() * 4) as u64,
            cuts: self
                .cuts
                .iter()
                .map(|c| {
                    (c.entries.len() * 8
                        + c.entries.iter().flatten().count() * CHUNK_ROWS * 4
                        + c.copies.len() * SAVE_BLOCK * self.words * 4) as u64
                })
                .sum(),
        }
    }
}

impl Cut {
    fn entry(&self, slot: usize) -> u32 {
        self.entries[slot / CHUNK_ROWS]
            .as_ref()
            .map_or(NOT_SAVED, |e| e[slot % CHUNK_ROWS])
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
    use super::*;

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
        slab.open_cut(1);
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
        slab.open_cut(2);
        let now = rows_of_cut(&slab, 2);
        assert!(now.contains(&998) && now.contains(&(5000 + 7)) && !now.contains(&6));
        // Reading from a slot on, and stopping early.
        let mut first = Vec::new();
        let next = slab.read_cut(1, 10, u32::MAX, |_, r| {
            first.push(r[0]);
            first.len() < 2
        });
        assert_eq!((first, next), (vec![10, 11], 12));
        slab.close_cut(1);
        slab.record_mut(8)[0] = 1;
        assert_eq!(slab.saved_records(), 4, "one more, for cut 2 alone");
        slab.close_cut(2);
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
        slab.open_cut(9);
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
