//! The memory of a slab's blocks ([`super::slab`]): the heap, or, for a
//! large block made ahead of its rows, an anonymous mapping whose whole
//! 2 MiB pages the kernel is asked to back with transparent huge pages.
//!
//! **Why huge pages.** A Fetch of 1,000 random keys from a shard of 10^7
//! dim-64 rows (5-8 GB of records) reaches a new page for nearly every
//! record; with 4 KiB pages their table entries alone are some 15 MB, far
//! beyond the caches, so most records cost a page walk that misses too.
//! On this 2-core VM a bare loop of the same reads (an index bucket, then
//! 264 bytes of a 528-byte record, prefetched as the store does) took
//! 16 µs over 10^5 rows and 51 µs over 10^7 on small pages, 29 µs on huge
//! ones. In the store benchmark (release, two runs each way, same build
//! otherwise), the blocks made ahead on huge pages (55% of an Adagrad
//! shard's memory at 10^7 rows, 37% of an Adam one's) took Fetch p50 at
//! 10^7 rows from 124 µs to 106-117 (Adagrad) and from 120-132 µs to
//! 114-121 (Adam), bytes per row unchanged.
//!
//! **Why only blocks made ahead.** The kernel zeroes a huge page whole at
//! its first write. Blocks opened under a stripe's write lock (the first
//! ones of every stripe, and any a Push did not make ahead) stay on the
//! heap with small pages: with huge pages there, a growing shard's
//! Fetches waited for those faults (growth p99 270 µs -> 4.5 ms). A block
//! made ahead is written whole by a Push with no lock held
//! (`ShardRows::ready_blocks`).
//!
//! **Why only whole pages.** The mapping is one huge page larger than the
//! block, so that the block can start on a 2 MiB boundary; only the
//! block's whole 2 MiB pages are advised. A huge page over the block's
//! tail would be backed whole when the tail is written: up to 2 MiB of
//! memory for a few records.
//!
//! **Why memmap2.** The workspace keeps `unsafe` to the transport's
//! providers and its allocator; `memmap2` is the well-kept crate that maps
//! anonymous memory and passes `madvise` behind a safe API, and `bytemuck`
//! views its bytes as words with the alignment checked.
//!
//! Huge pages are a hint: where the kernel has none to give (THP set to
//! `never`, memory too fragmented), the mapping is backed by small pages
//! and works the same; where the mapping fails, the block is on the heap.

use std::ops::{Deref, DerefMut};

use memmap2::{Advice, MmapMut, MmapOptions};

/// Bytes of a huge page (x86-64 and aarch64 with 4 KiB base pages).
pub const HUGE_PAGE: usize = 2 << 20;

/// A block of `u32` words (module docs).
#[derive(Debug)]
pub struct Block {
    memory: Memory,
}

#[derive(Debug)]
enum Memory {
    Heap(Box<[u32]>),
    /// `words` words from byte `start` of `map` (a multiple of
    /// [`HUGE_PAGE`] from the map's start address).
    Mapped {
        map: MmapMut,
        start: usize,
        words: usize,
    },
}

impl Block {
    /// A block of `words` zeros from the heap, its pages backed by the
    /// kernel as they are first written.
    pub fn zeroed(words: usize) -> Self {
        Self {
            memory: Memory::Heap(vec![0; words].into_boxed_slice()),
        }
    }

    /// A block of `words` zeros, every page of it written already, its
    /// whole 2 MiB pages huge where the kernel gives them: to be made
    /// with no lock held (module docs).
    pub fn touched(words: usize) -> Self {
        let bytes = words * 4;
        if bytes >= HUGE_PAGE
            && let Ok(mut block) = Self::mapped(words)
        {
            // Zero already; a word of each 4 KiB page written so that
            // every page is backed now (a huge one at its first word).
            for word in block.iter_mut().step_by(1024) {
                *word = 0;
            }
            return block;
        }
        Self {
            memory: Memory::Heap(touched_vec(words).into_boxed_slice()),
        }
    }

    /// An anonymous mapping with room for `words` words on a 2 MiB
    /// boundary, its whole huge pages advised.
    fn mapped(words: usize) -> std::io::Result<Self> {
        let bytes = words * 4;
        let map = MmapOptions::new().len(bytes + HUGE_PAGE).map_anon()?;
        let address = map.as_ptr() as usize;
        let start = (HUGE_PAGE - address % HUGE_PAGE) % HUGE_PAGE;
        let whole = bytes / HUGE_PAGE * HUGE_PAGE;
        if whole > 0 {
            // A hint: without it (THP off), small pages serve the same.
            let _ = map.advise_range(Advice::HugePage, start, whole);
        }
        // The words' view is checked here once; `deref` relies on it.
        if bytemuck::try_cast_slice::<u8, u32>(&map[start..start + bytes]).is_err() {
            return Err(std::io::Error::other("mapping not aligned for words"));
        }
        Ok(Self {
            memory: Memory::Mapped { map, start, words },
        })
    }

    /// Whether the block is on a mapping advised for huge pages.
    pub fn is_mapped(&self) -> bool {
        matches!(self.memory, Memory::Mapped { .. })
    }
}

impl Deref for Block {
    type Target = [u32];

    #[inline]
    fn deref(&self) -> &[u32] {
        match &self.memory {
            Memory::Heap(words) => words,
            Memory::Mapped { map, start, words } => {
                bytemuck::cast_slice(&map[*start..*start + *words * 4])
            }
        }
    }
}

impl DerefMut for Block {
    #[inline]
    fn deref_mut(&mut self) -> &mut [u32] {
        match &mut self.memory {
            Memory::Heap(words) => words,
            Memory::Mapped { map, start, words } => {
                bytemuck::cast_slice_mut(&mut map[*start..*start + *words * 4])
            }
        }
    }
}

/// `words` zeros on the heap, every page written. Not `vec![0; n]`:
/// calloc hands out fresh pages unwritten, to be faulted in later.
#[allow(
    clippy::slow_vector_initialization,
    reason = "calloc would not write the pages"
)]
pub fn touched_vec(words: usize) -> Vec<u32> {
    let mut block = Vec::with_capacity(words);
    block.resize(words, 0u32);
    block
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_large_touched_block_is_mapped_on_a_huge_page_boundary() {
        let words = (HUGE_PAGE + 4096) / 4 + 3;
        let mut block = Block::touched(words);
        assert!(block.is_mapped());
        assert_eq!(block.len(), words);
        assert_eq!(block.as_ptr() as usize % HUGE_PAGE, 0);
        assert!(block.iter().all(|&w| w == 0));
        block[words - 1] = 7;
        block[0] = 9;
        assert_eq!((block[0], block[words - 1]), (9, 7));
    }

    #[test]
    fn small_and_zeroed_blocks_are_on_the_heap() {
        for block in [Block::touched(1000), Block::zeroed(HUGE_PAGE)] {
            assert!(!block.is_mapped());
            assert!(block.iter().all(|&w| w == 0));
        }
        assert_eq!(Block::touched(0).len(), 0);
    }
}
