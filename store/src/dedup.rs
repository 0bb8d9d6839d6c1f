//! Exactly-once Push: each shard remembers which (worker, sequence) pairs
//! it applied, so a Push that is retried (its first attempt timed out or
//! lost its connection after the server applied it) is acknowledged without
//! being applied again.
//!
//! A worker numbers its Pushes from one counter (one number per logical
//! Push, shared by its per-shard sub-requests) and may have several in
//! flight, so they can arrive out of order: per worker the shard keeps the
//! highest sequence seen and a window of the [`WINDOW`] below it as a
//! bitset (the anti-replay window of IPsec, RFC 4303 §3.4.3). A sequence
//! above the window's bottom is admitted once; one below it cannot be told
//! apart and is refused as [`Admission::TooOld`] (an error to the caller,
//! never a silent drop).
//!
//! Memory is bounded by `max_workers` windows (144 bytes each) per shard.
//! A worker silent for `idle_expiry` is forgotten: a retry of its Pushes
//! cannot come that late. A *new* worker that finds the table full of
//! workers seen within `idle_expiry` is refused ([`Admission::Full`]),
//! never admitted by forgetting another one: forgetting a live worker
//! would let its retried Pushes be applied twice, silently.
//!
//! Sequence 0 (or worker 0) means "not deduplicated": plain gRPC clients
//! and old workers send no ids, and their Pushes are applied as they come.
//!
//! Sequences are bounded ([`Admission::Implausible`]): at most
//! [`MAX_SEQUENCE`], and at most [`MAX_JUMP`] above the highest one seen
//! of the worker. Without the bound one Push carrying a worker's id and
//! sequence `u64::MAX` made every later Push of that worker "too old". The
//! bound stops that single step; a peer that can send Pushes under another
//! worker's id can still disturb its deduplication in steps, which is what
//! the method roles of mutual TLS are for.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tessera_sync::LockExt;

/// Sequences remembered below the highest one, per worker and shard.
/// 1024: far more Pushes than a worker keeps in flight to one shard (it
/// keeps them within half of it: `tessera_worker`'s `spread`).
pub const WINDOW: u64 = tessera_proto::DEDUP_WINDOW;
const WORDS: usize = (WINDOW / 64) as usize;

/// The largest sequence accepted: 2^48, a million Pushes a second for
/// nine years from one worker's counter (which starts at 1).
pub const MAX_SEQUENCE: u64 = 1 << 48;

/// How far above a worker's highest sequence a Push may be. 2^32: a
/// worker numbers all its Pushes from one counter, so a shard sees gaps
/// of the Pushes that went to other shards only, never billions.
pub const MAX_JUMP: u64 = 1 << 32;

/// What to do with a Push.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Not seen before: apply it (it is now marked as applied).
    Apply,
    /// Applied before: acknowledge it without applying.
    Duplicate,
    /// Below the window: whether it was applied is unknown.
    TooOld {
        /// The lowest sequence still tracked.
        lowest: u64,
    },
    /// A worker not seen before, and `max_workers` others are remembered:
    /// refused until some go idle.
    Full {
        /// The limit.
        max_workers: usize,
    },
    /// Above [`MAX_SEQUENCE`], or more than [`MAX_JUMP`] above the
    /// worker's highest: refused, and nothing is marked.
    Implausible {
        /// The worker's highest sequence so far (0: not seen).
        highest: u64,
    },
}

/// The deduplication window of one worker, as checkpoints and shard copies
/// carry it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerWindow {
    /// The worker.
    pub worker: u64,
    /// The highest sequence it pushed.
    pub highest: u64,
    /// Bit `i` of the window set: `highest - i` was applied.
    pub bits: Vec<u64>,
}

impl WorkerWindow {
    /// Whether this window says Push `sequence` was applied: `Ok(true)`
    /// or `Ok(false)`, or `Err(lowest)` when it lies below the window
    /// (unknown: `lowest` is the lowest sequence still tracked). A window
    /// from the network may have any number of words: bits past them
    /// read as not applied.
    pub fn applied(&self, sequence: u64) -> Result<bool, u64> {
        if sequence > self.highest {
            return Ok(false);
        }
        let offset = self.highest - sequence;
        if offset >= WINDOW {
            return Err(self.highest - WINDOW + 1);
        }
        let word = self.bits.get((offset / 64) as usize).copied().unwrap_or(0);
        Ok(word & (1 << (offset % 64)) != 0)
    }
}

#[derive(Debug)]
struct Window {
    highest: u64,
    /// Bit `i` set: `highest - i` was applied.
    seen: [u64; WORDS],
    last_seen: Instant,
}

impl Window {
    fn new(sequence: u64, now: Instant) -> Self {
        let mut seen = [0u64; WORDS];
        seen[0] = 1;
        Self {
            highest: sequence,
            seen,
            last_seen: now,
        }
    }

    fn bit(&self, offset: u64) -> bool {
        self.seen[(offset / 64) as usize] & (1 << (offset % 64)) != 0
    }

    fn set(&mut self, offset: u64) {
        self.seen[(offset / 64) as usize] |= 1 << (offset % 64);
    }

    /// Moves the window up by `by` sequences (bit i becomes bit i + by).
    fn shift(&mut self, by: u64) {
        if by >= WINDOW {
            self.seen = [0; WORDS];
            return;
        }
        let (words, bits) = ((by / 64) as usize, by % 64);
        for i in (0..WORDS).rev() {
            let low = i.checked_sub(words).map_or(0, |j| self.seen[j] << bits);
            let carry = match (bits, i.checked_sub(words + 1)) {
                (0, _) | (_, None) => 0,
                (_, Some(j)) => self.seen[j] >> (64 - bits),
            };
            self.seen[i] = low | carry;
        }
    }

    fn admit(&mut self, sequence: u64, now: Instant) -> Admission {
        self.last_seen = now;
        if sequence > self.highest && sequence - self.highest > MAX_JUMP {
            return Admission::Implausible {
                highest: self.highest,
            };
        }
        self.mark(sequence)
    }

    /// Marks `sequence` applied unless it was (the primary's decision, or
    /// a plausible new one).
    fn mark(&mut self, sequence: u64) -> Admission {
        if sequence > self.highest {
            self.shift(sequence - self.highest);
            self.highest = sequence;
            self.set(0);
            return Admission::Apply;
        }
        let offset = self.highest - sequence;
        if offset >= WINDOW {
            // `highest - sequence >= WINDOW`, so this cannot overflow.
            return Admission::TooOld {
                lowest: self.highest - WINDOW + 1,
            };
        }
        if self.bit(offset) {
            Admission::Duplicate
        } else {
            self.set(offset);
            Admission::Apply
        }
    }
}

/// Settings of the Push deduplication of a shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DedupLimits {
    /// Workers remembered at most.
    pub max_workers: usize,
    /// A worker silent this long is forgotten.
    pub idle_expiry: Duration,
}

/// The applied (worker, sequence) pairs of one shard (module docs).
#[derive(Debug)]
pub struct PushDedup {
    limits: DedupLimits,
    workers: Mutex<HashMap<u64, Window>>,
}

impl PushDedup {
    /// Nothing applied yet.
    pub fn new(limits: DedupLimits) -> Self {
        Self {
            limits,
            workers: Mutex::new(HashMap::new()),
        }
    }

    /// Decides about Push `sequence` of `worker` at `now`, marking it
    /// applied when the answer is [`Admission::Apply`]. Call it only once
    /// the Push is known to be valid: an admitted Push must be applied.
    pub fn admit(&self, worker: u64, sequence: u64, now: Instant) -> Admission {
        if worker == 0 || sequence == 0 {
            return Admission::Apply;
        }
        let mut workers = self.workers.locked();
        if sequence > MAX_SEQUENCE {
            return Admission::Implausible {
                highest: workers.get(&worker).map_or(0, |w| w.highest),
            };
        }
        if let Some(window) = workers.get_mut(&worker) {
            return window.admit(sequence, now);
        }
        if workers.len() >= self.limits.max_workers {
            let expiry = self.limits.idle_expiry;
            workers.retain(|_, w| now.saturating_duration_since(w.last_seen) < expiry);
            if workers.len() >= self.limits.max_workers {
                metrics::counter!("tessera_ps_dedup_full_total").increment(1);
                return Admission::Full {
                    max_workers: self.limits.max_workers,
                };
            }
        }
        workers.insert(worker, Window::new(sequence, now));
        Admission::Apply
    }

    /// Records that Push `sequence` of `worker` was applied, as its shard's
    /// primary decided (a replica applying the primary's stream): no
    /// decision of its own, so that a replica's rows never depend on its
    /// own clock or table. Idle workers are still forgotten; the table may
    /// hold more than `max_workers` for a while when this server's idle
    /// clocks run behind the primary's.
    pub fn record(&self, worker: u64, sequence: u64, now: Instant) {
        if worker == 0 || sequence == 0 {
            return;
        }
        let mut workers = self.workers.locked();
        if let Some(window) = workers.get_mut(&worker) {
            window.last_seen = now;
            window.mark(sequence);
            return;
        }
        if workers.len() >= self.limits.max_workers {
            let expiry = self.limits.idle_expiry;
            workers.retain(|_, w| now.saturating_duration_since(w.last_seen) < expiry);
        }
        workers.insert(worker, Window::new(sequence, now));
    }

    /// Forgets every worker.
    pub fn clear(&self) {
        self.workers.locked().clear();
    }

    /// Workers remembered now.
    pub fn workers(&self) -> usize {
        self.workers.locked().len()
    }

    /// The window of every worker remembered, for a checkpoint or a copy.
    pub fn snapshot(&self) -> Vec<WorkerWindow> {
        let workers = self.workers.locked();
        workers
            .iter()
            .map(|(&worker, w)| WorkerWindow {
                worker,
                highest: w.highest,
                bits: w.seen.to_vec(),
            })
            .collect()
    }

    /// Restores what [`PushDedup::snapshot`] saved (workers count as just
    /// seen).
    pub fn restore(&self, saved: &[WorkerWindow], now: Instant) {
        let mut workers = self.workers.locked();
        for window in saved {
            // Saved before sequences were bounded: such a window would
            // refuse every later Push of its worker as too old. Every copy
            // of the shard restores the same image, so all drop it alike.
            if window.highest > MAX_SEQUENCE {
                tracing::warn!(
                    worker = window.worker,
                    highest = window.highest,
                    "dropping a deduplication window above the largest sequence"
                );
                continue;
            }
            let mut seen = [0u64; WORDS];
            for (slot, word) in seen.iter_mut().zip(&window.bits) {
                *slot = *word;
            }
            workers.insert(
                window.worker,
                Window {
                    highest: window.highest,
                    seen,
                    last_seen: now,
                },
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_saved_window_answers_what_its_shard_applied() {
        let d = PushDedup::new(DedupLimits {
            max_workers: 4,
            idle_expiry: Duration::from_secs(60),
        });
        let now = Instant::now();
        for seq in [5, 7, 1030, 1100] {
            assert_eq!(d.admit(9, seq, now), Admission::Apply);
        }
        let saved = d.snapshot();
        let w = saved.iter().find(|w| w.worker == 9).unwrap();
        assert_eq!(w.applied(1100), Ok(true));
        assert_eq!(w.applied(1030), Ok(true));
        assert_eq!(w.applied(1031), Ok(false));
        assert_eq!(w.applied(2000), Ok(false), "above the highest: not applied");
        assert_eq!(
            w.applied(7),
            Err(1100 - WINDOW + 1),
            "below the window: unknown"
        );
        // A short or empty window from the network reads as not applied.
        let short = WorkerWindow {
            worker: 9,
            highest: 1100,
            bits: Vec::new(),
        };
        assert_eq!(short.applied(1100), Ok(false));
    }

    fn dedup(max_workers: usize) -> PushDedup {
        PushDedup::new(DedupLimits {
            max_workers,
            idle_expiry: Duration::from_secs(60),
        })
    }

    #[test]
    fn each_sequence_is_admitted_once_in_any_order() {
        let d = dedup(10);
        let now = Instant::now();
        // Out of order, with gaps, and every one repeated.
        let order = [5u64, 3, 9, 4, 1, 7, 2000, 1990, 1500, 1999];
        for &seq in &order {
            assert_eq!(d.admit(1, seq, now), Admission::Apply, "{seq}");
        }
        for &seq in &order {
            let again = d.admit(1, seq, now);
            assert!(
                again == Admission::Duplicate || matches!(again, Admission::TooOld { .. }),
                "{seq}: {again:?}"
            );
        }
        // Within the window below 2000: exact answers.
        assert_eq!(d.admit(1, 1990, now), Admission::Duplicate);
        assert_eq!(d.admit(1, 1991, now), Admission::Apply);
        // Below the window: refused, never applied twice.
        assert_eq!(d.admit(1, 5, now), Admission::TooOld { lowest: 977 });
        // Another worker has its own window.
        assert_eq!(d.admit(2, 5, now), Admission::Apply);
        // No ids: always applied.
        assert_eq!(d.admit(0, 5, now), Admission::Apply);
        assert_eq!(d.admit(3, 0, now), Admission::Apply);
        assert_eq!(d.admit(3, 0, now), Admission::Apply);
    }

    #[test]
    fn the_window_shifts_exactly() {
        // Against a plain set, for every shift distance pattern.
        let d = dedup(10);
        let now = Instant::now();
        let mut applied = std::collections::HashSet::new();
        let mut seq = 1u64;
        let mut draw = 12345u64;
        for _ in 0..20_000 {
            draw = tessera_proto::sharding::splitmix64(draw);
            // Mostly forward steps of 0..130, sometimes far back.
            let candidate = if draw.is_multiple_of(5) {
                seq.saturating_sub(draw % 1100).max(1)
            } else {
                seq += (draw >> 8) % 130;
                seq
            };
            let highest = *applied.iter().max().unwrap_or(&0u64);
            let expected = if candidate + WINDOW <= highest {
                "old"
            } else if applied.contains(&candidate) {
                "dup"
            } else {
                "apply"
            };
            let got = match d.admit(9, candidate, now) {
                Admission::Apply => "apply",
                Admission::Duplicate => "dup",
                Admission::TooOld { .. } => "old",
                Admission::Full { .. } => "full",
                Admission::Implausible { .. } => "implausible",
            };
            assert_eq!(got, expected, "sequence {candidate}, highest {highest}");
            if got == "apply" {
                applied.insert(candidate);
            }
        }
    }

    #[test]
    fn implausible_sequences_mark_nothing_and_recorded_ones_never_overflow() {
        let d = dedup(10);
        let now = Instant::now();
        assert_eq!(
            d.admit(1, u64::MAX, now),
            Admission::Implausible { highest: 0 },
            "a first sequence above the largest"
        );
        assert_eq!(d.admit(1, 5, now), Admission::Apply);
        assert_eq!(
            d.admit(1, 6 + MAX_JUMP, now),
            Admission::Implausible { highest: 5 }
        );
        assert_eq!(d.admit(1, 5 + MAX_JUMP, now), Admission::Apply);
        // What a primary decided (or a checkpoint carried) is recorded as
        // it is, and the window's arithmetic holds at the top of u64.
        d.record(2, u64::MAX, now);
        assert_eq!(
            d.admit(2, 1, now),
            Admission::TooOld {
                lowest: u64::MAX - WINDOW + 1
            }
        );
    }

    #[test]
    fn a_restored_window_above_the_largest_sequence_is_dropped() {
        let d = dedup(10);
        let now = Instant::now();
        d.restore(
            &[
                WorkerWindow {
                    worker: 1,
                    highest: u64::MAX,
                    bits: vec![1],
                },
                WorkerWindow {
                    worker: 2,
                    highest: 10,
                    bits: vec![1],
                },
            ],
            now,
        );
        // Before: worker 1's Pushes were all "too old" for ever.
        assert_eq!(d.admit(1, 5, now), Admission::Apply);
        assert_eq!(d.admit(2, 10, now), Admission::Duplicate);
    }

    #[test]
    fn memory_is_bounded_by_expiring_idle_workers() {
        let d = dedup(100);
        let t0 = Instant::now();
        for worker in 1..=100 {
            d.admit(worker, 1, t0);
        }
        assert_eq!(d.workers(), 100);
        // A new worker after the others went idle: they expire.
        let later = t0 + Duration::from_secs(61);
        assert_eq!(d.admit(1000, 1, later), Admission::Apply);
        assert_eq!(d.workers(), 1);
    }

    /// Forgetting a live worker to admit a new one would apply that
    /// worker's retried Pushes twice: a full table refuses the newcomer
    /// instead, and every remembered worker keeps its exact answers.
    #[test]
    fn a_full_table_refuses_new_workers_and_forgets_none() {
        let d = dedup(100);
        let t0 = Instant::now();
        for worker in 1..=100 {
            assert_eq!(d.admit(worker, 7, t0), Admission::Apply);
        }
        for newcomer in 2000..2200 {
            let now = t0 + Duration::from_millis(newcomer);
            assert_eq!(
                d.admit(newcomer, 1, now),
                Admission::Full { max_workers: 100 }
            );
            assert_eq!(d.workers(), 100);
        }
        // Every remembered worker's retry is still recognised (before the
        // fix, the least recently seen ones were dropped and re-applied).
        let now = t0 + Duration::from_secs(1);
        for worker in 1..=100 {
            assert_eq!(d.admit(worker, 7, now), Admission::Duplicate, "{worker}");
        }
        // Once they go idle, newcomers get in.
        let idle = now + Duration::from_secs(61);
        assert_eq!(d.admit(5000, 1, idle), Admission::Apply);
    }

    /// A replica records what its primary applied whatever its own table
    /// says: a full table, a remembered sequence, an old one.
    #[test]
    fn recorded_pushes_are_never_refused() {
        let d = dedup(2);
        let now = Instant::now();
        d.admit(1, 5, now);
        d.admit(2, 5, now);
        assert_eq!(d.admit(3, 1, now), Admission::Full { max_workers: 2 });
        d.record(3, 1, now);
        assert_eq!(d.workers(), 3, "over the limit rather than diverging");
        assert_eq!(d.admit(3, 1, now), Admission::Duplicate);
        d.record(1, 5, now);
        assert_eq!(d.admit(1, 6, now), Admission::Apply);
    }

    #[test]
    fn a_snapshot_restores_the_same_answers() {
        let d = dedup(10);
        let now = Instant::now();
        for seq in [3u64, 8, 1030] {
            d.admit(4, seq, now);
        }
        let restored = dedup(10);
        restored.restore(&d.snapshot(), now);
        assert_eq!(restored.admit(4, 8, now), Admission::Duplicate);
        assert_eq!(restored.admit(4, 9, now), Admission::Apply);
        assert!(matches!(
            restored.admit(4, 3, now),
            Admission::TooOld { .. }
        ));
    }
}
