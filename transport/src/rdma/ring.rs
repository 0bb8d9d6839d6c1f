//! The work-request ring of one engine (§5.4.1).
//!
//! As deep as the QP's send queue, and split into three parts: *in flight*
//! (posted, completion not yet seen), *pending* (queued, not yet posted) and
//! *free*. [`WorkRequestRing::take_batch`] moves as many pending requests as
//! there are free slots (at most [`MAX_BATCH`]) into flight for one
//! `post_send` (doorbell batching) and signals only the last of them; its completion retires every request
//! posted before it. The ring never has more requests in flight than the
//! send queue holds, so a post can never fail for lack of room.

use std::collections::VecDeque;
use std::time::Instant;

use bytes::Bytes;

use crate::verbs::SendWr;

/// Most requests posted with one doorbell. A NIC starts on the first ones
/// at once anyway, and a soft NIC (which copies in the posting thread)
/// returns to polling completions between batches: a batch of eight 64 KiB
/// fragments keeps an answer waiting for at most half a MiB of copying.
pub const MAX_BATCH: usize = 8;

/// A work request and the buffers it reads from, which must live until it
/// has completed.
#[derive(Debug)]
pub struct RingEntry {
    /// The request (its `wr_id` and `signaled` are set by the ring).
    pub wr: SendWr,
    /// Buffers the request's scatter/gather entries point into.
    pub keep: Vec<Bytes>,
    /// Bytes it puts on the wire (what the send window counts).
    pub bytes: usize,
}

/// A posted request awaiting retirement.
#[derive(Debug)]
struct InFlight {
    wr_id: u64,
    /// Held until retired: the NIC reads from these buffers.
    _keep: Vec<Bytes>,
    bytes: usize,
    posted_at: Instant,
}

/// What one completion retired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retired {
    /// Requests retired.
    pub count: usize,
    /// Their bytes.
    pub bytes: usize,
    /// When the completed (signalled) request was posted.
    pub posted_at: Option<Instant>,
}

/// The ring.
#[derive(Debug)]
pub struct WorkRequestRing {
    depth: usize,
    in_flight: VecDeque<InFlight>,
    pending: VecDeque<RingEntry>,
    next_wr_id: u64,
}

impl WorkRequestRing {
    /// A ring for a send queue of `depth` entries.
    pub fn new(depth: usize) -> Self {
        Self {
            depth: depth.max(1),
            in_flight: VecDeque::new(),
            pending: VecDeque::new(),
            next_wr_id: 1,
        }
    }

    /// Requests posted and not yet retired.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Requests waiting to be posted.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Free slots: room for more requests in flight.
    pub fn free(&self) -> usize {
        self.depth - self.in_flight.len()
    }

    /// Queues a request; returns the id it will be posted with (ids go to
    /// requests in the order they are queued), so a caller can tell when
    /// it has completed ([`WorkRequestRing::complete`] retires every id up
    /// to the one completed).
    pub fn push(&mut self, entry: RingEntry) -> u64 {
        let id = self.next_wr_id + self.pending.len() as u64;
        self.pending.push_back(entry);
        id
    }

    /// Bytes of the requests in flight.
    pub fn in_flight_bytes(&self) -> usize {
        self.in_flight.iter().map(|e| e.bytes).sum()
    }

    /// The next batch to post at `now`: as many pending requests as fit,
    /// with fresh ids, only the last one signalled. `None` if nothing can
    /// be posted.
    pub fn take_batch(&mut self, now: Instant) -> Option<Vec<SendWr>> {
        let count = self.pending.len().min(self.free()).min(MAX_BATCH);
        if count == 0 {
            return None;
        }
        let mut batch = Vec::with_capacity(count);
        for i in 0..count {
            let Some(mut entry) = self.pending.pop_front() else {
                break;
            };
            entry.wr.wr_id = self.next_wr_id;
            entry.wr.signaled = i + 1 == count;
            self.next_wr_id += 1;
            self.in_flight.push_back(InFlight {
                wr_id: entry.wr.wr_id,
                _keep: entry.keep,
                bytes: entry.bytes,
                posted_at: now,
            });
            batch.push(entry.wr);
        }
        Some(batch)
    }

    /// A signalled request completed: retires it and everything posted
    /// before it (their buffers are released).
    pub fn complete(&mut self, wr_id: u64) -> Retired {
        let mut retired = Retired {
            count: 0,
            bytes: 0,
            posted_at: None,
        };
        while let Some(front) = self.in_flight.front() {
            if front.wr_id > wr_id {
                break;
            }
            if front.wr_id == wr_id {
                retired.posted_at = Some(front.posted_at);
            }
            retired.bytes += front.bytes;
            retired.count += 1;
            self.in_flight.pop_front();
        }
        retired
    }

    /// Drops everything (the QP failed).
    pub fn clear(&mut self) {
        self.in_flight.clear();
        self.pending.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::SendOp;

    fn entry() -> RingEntry {
        RingEntry {
            wr: SendWr {
                wr_id: 0,
                op: SendOp::Send,
                sges: Vec::new(),
                signaled: false,
            },
            keep: vec![Bytes::from_static(b"x")],
            bytes: 100,
        }
    }

    #[test]
    fn batches_fill_free_slots_and_signal_only_the_last() {
        let mut ring = WorkRequestRing::new(4);
        for _ in 0..6 {
            ring.push(entry());
        }
        let now = Instant::now();
        let batch = ring.take_batch(now).unwrap();
        assert_eq!(batch.len(), 4);
        assert_eq!(
            batch.iter().map(|w| w.signaled).collect::<Vec<_>>(),
            [false, false, false, true]
        );
        assert_eq!((ring.in_flight(), ring.pending(), ring.free()), (4, 2, 0));
        assert_eq!(ring.in_flight_bytes(), 400);
        assert!(
            ring.take_batch(now).is_none(),
            "never more in flight than the queue holds"
        );
        // The signalled completion retires the whole batch.
        let retired = ring.complete(batch[3].wr_id);
        assert_eq!((retired.count, retired.bytes), (4, 400));
        assert_eq!(retired.posted_at, Some(now));
        let next = ring.take_batch(now).unwrap();
        assert_eq!(next.len(), 2);
        assert!(next[1].signaled && !next[0].signaled);
        assert!(next[0].wr_id > batch[3].wr_id);
        assert_eq!(ring.complete(next[1].wr_id).count, 2);
        assert_eq!((ring.in_flight(), ring.pending(), ring.free()), (0, 0, 4));
    }
}
