//! Blocks for a snapshot's saved copies, their pages touched ahead by the
//! snapshot's reader rather than by the Pushes that fill them.
//!
//! A Push during a snapshot saves each row it changes first
//! ([`super::cut`]), appending the copy to a block of the cut. A fresh
//! block's pages are backed by the kernel when first written, so the
//! Push whose copy first reached a page paid the page fault: a Push of
//! 1,000 random rows during a read cut of 10^7 SGD rows took 92-108 µs at
//! the median, and 66-74 µs with the blocks touched ahead (45-48 quiet;
//! this VM, release). The snapshot's reader runs beside the Pushes on
//! another thread: between its short holds of the stripes' read locks it
//! allocates a block or two and writes them once ([`Spares::top_up`]),
//! and a save takes one ready ([`Spares::take`]) without ever waiting: if
//! the pool is empty, or the reader holds its lock that instant, the save
//! allocates as before.
//!
//! The pool holds at most [`SPARE_BYTES`] and never more blocks than the
//! cut could fill; it is dropped with the snapshot. A cut nobody reads
//! (none is, for long) gets no spares and costs what it did.
//!
//! Hand-written rather than through an allocator's pre-faulting knobs
//! (`MAP_POPULATE`, jemalloc's `opt.retain`): those fault memory in on
//! the thread that allocates, which is the Push's here.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use tessera_sync::LockExt;

use super::block::touched_vec;

/// The most bytes of blocks a pool keeps ready: some 100 Pushes of
/// 1,000 SGD rows of dim 16 changed for the first time since the cut.
/// The reader adds up to [`TOP_UP_BLOCKS`] between two holds of a
/// stripe's lock (microseconds apart), so the pool refills faster than
/// Pushes empty it, without long pauses in the reading.
pub const SPARE_BYTES: usize = 8 << 20;

/// Blocks a reader adds per [`Spares::top_up`].
const TOP_UP_BLOCKS: usize = 2;

/// Blocks of a cut's copies, ready to be written (module docs).
#[derive(Debug)]
pub struct Spares {
    /// Words per block.
    block_words: usize,
    /// Blocks kept ready at most ([`Spares::bound`] lowers it).
    target: AtomicUsize,
    /// The blocks: empty, with room for `block_words` words, every page
    /// written once.
    ready: Mutex<Vec<Vec<u32>>>,
    /// How many `ready` holds (read without its lock).
    count: AtomicUsize,
}

impl Spares {
    /// A pool of blocks of `block_words` words, at most [`SPARE_BYTES`].
    pub fn new(block_words: usize) -> Self {
        let block_words = block_words.max(1);
        Self {
            block_words,
            target: AtomicUsize::new((SPARE_BYTES / (block_words * 4)).max(1)),
            ready: Mutex::new(Vec::new()),
            count: AtomicUsize::new(0),
        }
    }

    /// The cut this pool serves can fill at most `most_blocks` blocks:
    /// no more are kept ready.
    pub fn bound(&self, most_blocks: usize) {
        self.target.fetch_min(most_blocks.max(1), Ordering::Relaxed);
    }

    /// A ready block, if one is there and taking it means no wait.
    pub fn take(&self) -> Option<Vec<u32>> {
        if self.count.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let mut ready = self.ready.try_lock().ok()?;
        let block = ready.pop()?;
        self.count.store(ready.len(), Ordering::Relaxed);
        Some(block)
    }

    /// Adds up to [`TOP_UP_BLOCKS`] blocks while the pool is below its
    /// bound (the reader's side): each is allocated and written whole
    /// outside the lock, then added.
    pub fn top_up(&self) {
        for _ in 0..TOP_UP_BLOCKS {
            if self.count.load(Ordering::Relaxed) >= self.target.load(Ordering::Relaxed) {
                return;
            }
            // Every page written once (`touched_vec`), then emptied:
            // the capacity stays.
            let mut block = touched_vec(self.block_words);
            block.clear();
            let mut ready = self.ready.locked();
            ready.push(block);
            self.count.store(ready.len(), Ordering::Relaxed);
        }
    }

    /// Blocks ready now.
    #[cfg(test)]
    fn ready(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }

    /// Bytes of the blocks ready now.
    #[cfg(test)]
    fn bytes(&self) -> u64 {
        (self.ready() * self.block_words * 4) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_fills_to_its_bound_and_hands_out_empty_blocks_of_its_size() {
        // Few blocks for a small cut, at most SPARE_BYTES for a large one.
        let small = Spares::new(1000);
        small.bound(3);
        small.top_up();
        assert_eq!(small.ready(), TOP_UP_BLOCKS);
        small.top_up();
        assert_eq!(small.ready(), 3);
        let large = Spares::new(1 << 16);
        large.bound(1 << 20);
        for _ in 0..SPARE_BYTES {
            large.top_up();
        }
        assert_eq!(large.bytes(), SPARE_BYTES as u64);
        let block = small.take().unwrap();
        assert!(block.is_empty());
        assert!(block.capacity() >= 1000);
        assert_eq!(small.ready(), 2);
        small.take();
        small.take();
        assert_eq!(small.take(), None);
        small.top_up();
        small.top_up();
        assert_eq!(small.ready(), 3);
    }
}
