//! Many rows at once: a Fetch's reads ([`ShardRows::read_many`]) and a
//! Push's updates ([`ShardRows::upsert_many`]), each stripe locked once
//! for its keys, their cache misses overlapped by prefetching.

use super::block::Block;
use super::index::{self, NO_SLOT};
use super::{RowRef, ShardRows, Stripe, try_read, try_write};

// `upsert_many` keeps a bit per stripe.
const _: () = assert!(super::STRIPES <= u64::BITS as usize);

/// Blocks a Push makes ahead at most ([`ShardRows::ready_blocks`]). The
/// stripes of a shard fill at the same pace, so they all come near a new
/// block within a few Pushes of one another: unbounded, one Push would
/// make all 64 (19 MiB of SGD records, some 4,600 page faults) and carry
/// them in its own latency. A stripe asks half a block ahead (over 100
/// Pushes of 1,000 rows for the largest blocks), so two a Push serve them
/// all in time; a stripe not served opens a block as before.
const READY_BLOCKS: usize = 2;

/// Keys [`ShardRows::read_many`] prefetches together: their buckets and
/// records (192 KiB of SGD rows of dim 16, 400 KiB of dim 64) stay in a
/// core's L2 cache until they are read.
const READ_BATCH: usize = 1024;

/// One batch of [`ShardRows::read_many`] (or `upsert_many`): its keys'
/// indices grouped by stripe (stripe `s`'s are `order[starts[s]..
/// starts[s + 1]]`), the keys in that order, and each one's candidate
/// slot ([`KeyIndex::candidates`]). Kept across batches for its buffers.
#[derive(Debug, Default)]
struct Batch {
    order: Vec<u32>,
    starts: Vec<usize>,
    /// The keys' index hashes ([`super::index::hash`]), in `order`.
    hashes: Vec<u64>,
    candidates: Vec<u32>,
    /// Each key's stripe, and the counting sort's cursors (buffers of
    /// `by_stripe`).
    stripe_of: Vec<u16>,
    next: Vec<usize>,
}

impl ShardRows {
    /// Calls `found` with the index in `keys` and the row of every key
    /// present (each counts as a use), and adds the index of every key
    /// missing to `missing`: a Fetch's path.
    ///
    /// At 10^7 rows nearly every row is three cache misses (its index
    /// bucket and the two lines its key and values span), and lookups one
    /// after another, or 16 at a time with loads, stop the processor once
    /// its window of outstanding loads is full: a Fetch of 1,000 random
    /// SGD rows took 85-110 µs where the same rows in cache took 30. So
    /// the keys are read in batches of 1,024, each in three passes over
    /// its stripes:
    /// 1. every key's home bucket is prefetched;
    /// 2. every key's candidate slot is read from its bucket (now in
    ///    cache) and its record prefetched through its values;
    /// 3. each stripe is read-locked once for its keys, and a key's row
    ///    is its candidate's record if that holds the key (nearly always;
    ///    it is then in cache), or found by a lookup.
    ///
    /// A prefetch retires at once, so a batch's misses all overlap. The
    /// first two passes hold a stripe's read lock only for their own
    /// loads and skip a stripe a writer holds; what they leave (the
    /// candidates) is checked in pass 3, so a row that moved between the
    /// passes is still found.
    pub fn read_many(
        &self,
        keys: &[u64],
        found: impl FnMut(usize, RowRef<'_>),
        missing: &mut Vec<usize>,
    ) {
        self.read_many_with(keys, true, found, missing);
    }

    /// [`ShardRows::read_many`] that does not count as a use (no LRU
    /// clock or access mark moves): the delta stream reading the rows it
    /// sends must not keep them alive.
    pub fn peek_many(
        &self,
        keys: &[u64],
        found: impl FnMut(usize, RowRef<'_>),
        missing: &mut Vec<usize>,
    ) {
        self.read_many_with(keys, false, found, missing);
    }

    fn read_many_with(
        &self,
        keys: &[u64],
        touch: bool,
        mut found: impl FnMut(usize, RowRef<'_>),
        missing: &mut Vec<usize>,
    ) {
        self.each_key(
            keys,
            self.layout.fetch_words(),
            |s| try_read(&self.stripes[s]),
            |s| self.read_stripe(s),
            |stripe, i, _, slot| match slot {
                Some(slot) => {
                    if touch {
                        self.touch(stripe, slot);
                    }
                    found(
                        i,
                        RowRef {
                            layout: &self.layout,
                            record: stripe.slab.record(slot),
                        },
                    );
                }
                None => missing.push(i),
            },
        );
        missing.sort_unstable();
    }

    /// [`ShardRows::read_many`]'s passes over `keys`, in batches of
    /// [`READ_BATCH`]: the first two ([`ShardRows::prefetch`], `words` words
    /// of each record), then each stripe with keys locked once
    /// ([`each_stripe`] with `try_lock` and `lock`) and `visit` called
    /// for each of its keys with the guard, the key's index in `keys`, the
    /// key, and its slot (the candidate if its record holds the key, else
    /// a lookup's answer).
    fn each_key<G: std::ops::Deref<Target = Stripe>>(
        &self,
        keys: &[u64],
        words: usize,
        try_lock: impl Fn(usize) -> Option<G>,
        lock: impl Fn(usize) -> G,
        mut visit: impl FnMut(&mut G, usize, u64, Option<u32>),
    ) {
        let mut batch = Batch::default();
        for (n, keys) in keys.chunks(READ_BATCH).enumerate() {
            let base = n * READ_BATCH;
            self.prefetch(keys, &mut batch, words);
            let Batch {
                order,
                starts,
                candidates,
                ..
            } = &batch;
            each_stripe(starts, &try_lock, &lock, |s, mut stripe| {
                for at in starts[s]..starts[s + 1] {
                    let i = order[at] as usize;
                    let slot = stripe.find_from(&self.layout, keys[i], candidates[at]);
                    visit(&mut stripe, base + i, keys[i], slot);
                }
            });
        }
    }

    /// Passes 1 and 2 of [`ShardRows::read_many`] for `keys` (at most
    /// [`READ_BATCH`]), into `batch`: the keys grouped by stripe, their
    /// home buckets prefetched, then their candidate slots found and the
    /// first `words` words of those records prefetched. A stripe a writer
    /// holds is skipped (its keys keep no candidate).
    fn prefetch(&self, keys: &[u64], batch: &mut Batch, words: usize) {
        self.by_stripe(keys, batch);
        let Batch {
            order,
            starts,
            hashes,
            candidates,
            ..
        } = batch;
        hashes.clear();
        hashes.extend(order.iter().map(|&i| index::hash(keys[i as usize])));
        candidates.clear();
        candidates.resize(keys.len(), NO_SLOT);
        for s in 0..self.stripes.len() {
            if starts[s] < starts[s + 1]
                && let Some(stripe) = try_read(&self.stripes[s])
            {
                stripe
                    .index
                    .prefetch_homes(&hashes[starts[s]..starts[s + 1]]);
            }
        }
        for s in 0..self.stripes.len() {
            let range = starts[s]..starts[s + 1];
            if !range.is_empty()
                && let Some(stripe) = try_read(&self.stripes[s])
            {
                let candidates = &mut candidates[range.clone()];
                stripe.index.candidates(&hashes[range], candidates);
                for &slot in candidates.iter() {
                    stripe.slab.prefetch(slot, words);
                }
            }
        }
    }

    /// The indices of `keys` grouped by stripe, in their order within a
    /// stripe (a counting sort), into `batch`: stripe `s`'s are
    /// `order[starts[s]..starts[s + 1]]`. The batch's buffers are reused.
    fn by_stripe(&self, keys: &[u64], batch: &mut Batch) {
        let stripes = self.stripes.len();
        let Batch {
            order,
            starts,
            stripe_of,
            next,
            ..
        } = batch;
        stripe_of.clear();
        stripe_of.extend(keys.iter().map(|&k| self.stripe(k) as u16));
        starts.clear();
        starts.resize(stripes + 1, 0);
        for &s in stripe_of.iter() {
            starts[s as usize + 1] += 1;
        }
        for s in 0..stripes {
            starts[s + 1] += starts[s];
        }
        order.clear();
        order.resize(keys.len(), 0);
        next.clear();
        next.extend_from_slice(starts);
        for (i, &s) in stripe_of.iter().enumerate() {
            order[next[s as usize]] = i as u32;
            next[s as usize] += 1;
        }
    }

    /// [`ShardRows::upsert_following`] for every key of `keys` (a Push's
    /// rows, seeded `seed`), with `init` and `update` given the key's
    /// index; for a table without a row limit (nothing to evict). Each
    /// stripe is write-locked once for all its keys, where one lock per
    /// row made a Push of 1,000 rows take 1,000 locks, and sleep behind
    /// every reader it met (a snapshot being read, Fetches). The rows of
    /// one key are updated in the order of `keys`; rows of different keys
    /// do not depend on one another (rounding draws from the key, not
    /// the position), so the outcome is that of updating them in order.
    /// Returns how many rows were not stored (their stripe was full).
    pub fn upsert_many(
        &self,
        keys: &[u64],
        seed: u64,
        mut init: impl FnMut(usize, &mut [f32], &mut [f32]),
        mut update: impl FnMut(usize, &mut [f32], &mut [f32], &mut u32),
    ) -> usize {
        debug_assert!(!self.limited(), "upsert_many on a table with a row limit");
        let mut refused = 0;
        // Stripes that got new rows (bit per stripe, 64 of them).
        let mut grew = 0u64;
        // Whole records prefetched: an update reads and writes them all.
        self.each_key(
            keys,
            self.layout.words(),
            |s| try_write(&self.stripes[s]),
            |s| self.write_stripe(s),
            |stripe, i, key, slot| {
                if slot.is_none() {
                    grew |= 1 << self.stripe(key);
                }
                let stored = self.upsert_in(
                    stripe,
                    key,
                    slot,
                    seed,
                    |values, state| init(i, values, state),
                    |values, state, steps| update(i, values, state, steps),
                );
                refused += usize::from(stored.is_err());
            },
        );
        self.ready_blocks(grew);
        refused
    }

    /// For each stripe in `grew` (bit `s`: stripe `s` got new rows) whose
    /// slab will soon open a block ([`Slab::wants_block`]): the block,
    /// its pages written here, with no lock held, then handed over. A
    /// growing shard's first writes to a fresh block faulted its pages in
    /// under the stripe's write lock, one per 4 KiB, while the stripe's
    /// Fetches waited.
    fn ready_blocks(&self, grew: u64) {
        let mut grew = grew;
        let mut made = 0;
        while grew != 0 && made < READY_BLOCKS {
            let s = grew.trailing_zeros() as usize;
            grew &= grew - 1;
            let Some(stripe) = self.stripes.get(s) else {
                continue;
            };
            let wanted = try_read(stripe).and_then(|stripe| stripe.slab.wants_block());
            if let Some(words) = wanted {
                let block = Block::touched(words);
                let refused = self.write_stripe(s).slab.give_block(block);
                // Unmapped here, with the stripe's lock released.
                drop(refused);
                made += 1;
            }
        }
    }
}

/// Calls `visit` once with each stripe `s` that has keys (`starts[s] <
/// starts[s + 1]`, as [`ShardRows::by_stripe`] gives) and its lock: the
/// stripes whose lock `try_lock` takes at once first, in order, then the
/// ones that were busy, waiting for each (`lock`). A Fetch and a Push that
/// both walked the stripes in order and waited at each busy one fell into
/// step: each waited for the other at nearly every stripe, a sleep and a
/// wake-up each time (Fetches of 1,000 rows at p99 1 ms beside a growing
/// Push, 0.3 ms beside one that only updates). Going round a busy stripe
/// and coming back breaks the step.
fn each_stripe<G>(
    starts: &[usize],
    try_lock: impl Fn(usize) -> Option<G>,
    lock: impl Fn(usize) -> G,
    mut visit: impl FnMut(usize, G),
) {
    let mut busy = Vec::new();
    for (s, range) in starts.windows(2).enumerate() {
        if range[0] == range[1] {
            continue;
        }
        match try_lock(s) {
            Some(guard) => visit(s, guard),
            None => busy.push(s),
        }
    }
    for s in busy {
        visit(s, lock(s));
    }
}
