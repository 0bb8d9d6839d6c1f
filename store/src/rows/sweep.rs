//! The expiry sweep over a shard's rows (`table/expiry.rs`): which rows
//! of a stretch of record slots are expired, and their removal, a stripe
//! at a time and in small batches under its write lock.

use std::sync::atomic::Ordering;

use super::{ShardRows, Stripe};

/// Rows the expiry sweep removes per hold of a stripe's write lock.
/// 256: a few microseconds of index removals, so a Fetch of the stripe
/// waits no longer than that behind a sweep.
const SWEEP_WRITE_BATCH: usize = 256;

impl ShardRows {
    /// One step of the expiry sweep (`table/expiry.rs`): visits up to
    /// `max_slots` record slots from `cursor` on (moving it; a step ends
    /// where a pass over every stripe does), removes the
    /// rows expired at `now` under `bound`, and returns their keys. Fetch
    /// marks (a table expiring on access) later than a row's stamp are
    /// folded into it first.
    ///
    /// Each stripe's slots are read under its read lock, which Fetches
    /// share; its write lock is taken only to remove what was found (and
    /// fold marks), 256 rows at a time, so a Fetch
    /// waits at most for that many removals. The caller holds the shard's
    /// write lock, so no Push changes a row between the two.
    pub fn sweep(
        &self,
        cursor: &mut super::stamp::SweepCursor,
        max_slots: usize,
        now: u32,
        bound: super::stamp::Bound,
    ) -> Vec<u64> {
        let mut removed = Vec::new();
        let mut left = max_slots;
        // Each stripe at most once per step, so that an empty shard's
        // step ends.
        let mut stripes_seen = 0;
        while left > 0 && stripes_seen <= self.stripes.len() {
            if cursor.stripe >= self.stripes.len() {
                cursor.stripe = 0;
                cursor.slot = 0;
                cursor.passes += 1;
            }
            let (end, slots, found) = {
                let stripe = self.read_stripe(cursor.stripe);
                let slots = stripe.slab.slots() as u32;
                let end = slots.min(cursor.slot.saturating_add(left as u32));
                (
                    end,
                    slots,
                    self.expired_in(&stripe, cursor.slot..end, now, bound),
                )
            };
            for batch in found.chunks(SWEEP_WRITE_BATCH) {
                let mut stripe = self.write_stripe(cursor.stripe);
                let held = std::time::Instant::now();
                for &(slot, key, expired) in batch {
                    // Marked again since the read (a Fetch, on access)?
                    let judged = self.effective_stamp(&mut stripe, slot, key);
                    if expired
                        && judged.is_some_and(|stamp| super::stamp::expired(stamp, now, bound))
                    {
                        stripe.remove(&self.layout, key);
                        removed.push(key);
                    }
                }
                let held = held.elapsed().as_nanos() as u64;
                self.longest_sweep_hold.fetch_max(held, Ordering::Relaxed);
            }
            left -= (end - cursor.slot.min(end)) as usize;
            if end >= slots {
                cursor.stripe += 1;
                cursor.slot = 0;
                stripes_seen += 1;
                if cursor.stripe >= self.stripes.len() {
                    // A pass ends a step: the caller paces passes.
                    cursor.stripe = 0;
                    cursor.passes += 1;
                    break;
                }
            } else {
                cursor.slot = end;
            }
        }
        self.count_expired(removed.len());
        removed
    }

    /// The rows in `slots` of `stripe` that are expired at `now`, or
    /// carry a Fetch mark to fold: (slot, key, expired).
    fn expired_in(
        &self,
        stripe: &Stripe,
        slots: std::ops::Range<u32>,
        now: u32,
        bound: super::stamp::Bound,
    ) -> Vec<(u32, u64, bool)> {
        use super::stamp::{expired, later};
        let mut found = Vec::new();
        for slot in slots {
            let Some(record) = stripe.slab.live_record(slot) else {
                continue;
            };
            let stamp = self.layout.stamp(record);
            let marked = stripe
                .touched(slot)
                .map(|t| t.load(Ordering::Relaxed))
                .filter(|&m| later(stamp, m) != stamp);
            let effective = marked.unwrap_or(stamp);
            let gone = expired(effective, now, bound);
            if gone || marked.is_some() {
                found.push((slot, self.layout.key(record), gone));
            }
        }
        found
    }

    /// The stamp of `key`'s row at `slot` with its Fetch mark folded in
    /// (written to the record when later); `None` if the slot no longer
    /// holds it.
    fn effective_stamp(&self, stripe: &mut Stripe, slot: u32, key: u64) -> Option<u32> {
        let record = stripe.slab.live_record(slot)?;
        if self.layout.key(record) != key {
            return None;
        }
        let stamp = self.layout.stamp(record);
        let marked = stripe.touched(slot).map(|t| t.load(Ordering::Relaxed));
        match marked {
            Some(m) if super::stamp::later(stamp, m) != stamp => {
                self.layout.set_stamp(stripe.slab.record_mut(slot), m);
                Some(m)
            }
            _ => Some(stamp),
        }
    }

    /// The longest the sweep held a stripe's write lock since the last
    /// call (what a Fetch of that stripe may have waited for it).
    pub fn take_longest_sweep_hold(&self) -> std::time::Duration {
        std::time::Duration::from_nanos(self.longest_sweep_hold.swap(0, Ordering::Relaxed))
    }

    /// Removes the row of `key` as the primary's sweep did; whether it
    /// was held.
    pub fn remove_expired(&self, key: u64) -> bool {
        let removed = self
            .write_stripe(self.stripe(key))
            .remove(&self.layout, key);
        self.count_expired(usize::from(removed));
        removed
    }

    fn count_expired(&self, rows: usize) {
        if rows > 0 {
            self.expired.fetch_add(rows as u64, Ordering::Relaxed);
        }
    }

    /// Rows expired so far.
    pub fn expired(&self) -> u64 {
        self.expired.load(Ordering::Relaxed)
    }
}
