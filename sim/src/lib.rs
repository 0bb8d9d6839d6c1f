//! A deterministic discrete-event simulator: a virtual clock, one seeded
//! random stream (and independent forks of it), and a queue of events in
//! time order. Nothing here reads the wall clock or the operating
//! system's randomness, so a run is a function of its seed: the same seed
//! gives the same events in the same order at the same virtual times, and
//! [`Trace`] digests let a test say so byte for byte.
//!
//! It is the base of Tessera's simulations: the control plane's (issue 57:
//! the resize, failover and copy protocols' sans-IO cores, etcd as a
//! model, a nemesis, an exactly-once audit) and the fabric's (issue 58:
//! hosts, links and switches running the RDMA engine). Both drive
//! sans-IO state machines, which take events with the time passed in and
//! emit actions; the simulator turns actions into future events.
//!
//! # Call order
//!
//! [`Simulator::new`] with a seed; schedule the first events
//! ([`Simulator::schedule_in`], [`Simulator::schedule_at`]); then, in a
//! loop, [`Simulator::next_event`] advances the clock to the earliest
//! event and returns it, and the caller dispatches it, scheduling what it
//! causes (random choices from [`Simulator::rng`], or from a component's
//! own fork, [`Simulator::fork`]). [`Simulator::cancel`] drops an event
//! not yet returned (a timer reset). Events at the same time come out in
//! the order they were scheduled.
//!
//! # Why not a crate
//!
//! The Rust simulators on crates.io either run models as async actors on
//! an executor of their own (NeXosim: ports, mailboxes, a scheduler that
//! is the model's clock) or simulate a whole async runtime (madsim,
//! turmoil). Tessera's cores are already sans-IO; what they need is the
//! queue and the clock, about a page of code, with determinism that does
//! not depend on an executor's scheduling. The random stream is ChaCha8
//! (`rand_chacha`): its output for a seed is specified, so a seed's run
//! does not change when `rand`'s default generator does.
//!
//! ```
//! use tessera_sim::{SimTime, Simulator};
//!
//! let mut sim: Simulator<&str> = Simulator::new(7);
//! sim.schedule_at(SimTime::from_nanos(2_000), "second")?;
//! sim.schedule_at(SimTime::from_nanos(1_000), "first")?;
//! let first = sim.next_event().map(|due| (due.at, due.event));
//! assert_eq!(first, Some((SimTime::from_nanos(1_000), "first")));
//! assert_eq!(sim.now(), SimTime::from_nanos(1_000));
//! # Ok::<(), tessera_sim::SimError>(())
//! ```

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashSet};
use std::fmt;
use std::time::Duration;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// A point in virtual time: nanoseconds since the simulation started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct SimTime(u64);

impl SimTime {
    /// The start.
    pub const ZERO: Self = Self(0);

    /// `nanos` nanoseconds after the start.
    pub const fn from_nanos(nanos: u64) -> Self {
        Self(nanos)
    }

    /// Nanoseconds since the start.
    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// Time since the start.
    pub const fn since_start(self) -> Duration {
        Duration::from_nanos(self.0)
    }

    /// `self` plus `d`, or `None` past the end of virtual time (about 584
    /// years).
    pub fn checked_add(self, d: Duration) -> Option<Self> {
        u64::try_from(d.as_nanos())
            .ok()
            .and_then(|n| self.0.checked_add(n))
            .map(Self)
    }

    /// How long after `earlier` this is (zero if it is not after).
    pub fn saturating_since(self, earlier: Self) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }

    /// This time as an [`std::time::Instant`] on a line that starts at
    /// `base`: for cores whose API takes `Instant`s. Only differences
    /// between such instants mean anything, so the base (however it was
    /// obtained) does not change what a core decides.
    pub fn to_instant(self, base: std::time::Instant) -> std::time::Instant {
        base + self.since_start()
    }
}

impl fmt::Display for SimTime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (s, ns) = (self.0 / 1_000_000_000, self.0 % 1_000_000_000);
        write!(f, "{s}.{ns:09}s")
    }
}

/// Names a scheduled event, for [`Simulator::cancel`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EventId(u64);

/// Why an event could not be scheduled.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SimError {
    /// Its time is before the clock: virtual time never goes back.
    #[error("an event at {at} is before the clock ({now})")]
    InThePast {
        /// The time asked.
        at: SimTime,
        /// The clock.
        now: SimTime,
    },
    /// Its time is past the end of virtual time.
    #[error("an event {after:?} after {now} is past the end of virtual time")]
    TooLate {
        /// The clock.
        now: SimTime,
        /// The delay asked.
        after: Duration,
    },
}

/// An event due, as [`Simulator::next_event`] returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Due<E> {
    /// Its time (the clock now).
    pub at: SimTime,
    /// Its name.
    pub id: EventId,
    /// What happens.
    pub event: E,
}

/// One queued event: ordered by time, then by the order of scheduling.
#[derive(Debug)]
struct Queued<E> {
    at: SimTime,
    seq: u64,
    event: E,
}

impl<E> PartialEq for Queued<E> {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}

impl<E> Eq for Queued<E> {}

impl<E> PartialOrd for Queued<E> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl<E> Ord for Queued<E> {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

/// The simulator (module docs).
pub struct Simulator<E> {
    now: SimTime,
    queue: BinaryHeap<Reverse<Queued<E>>>,
    cancelled: HashSet<u64>,
    next_seq: u64,
    seed: u64,
    rng: ChaCha8Rng,
    delivered: u64,
}

impl<E> fmt::Debug for Simulator<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Simulator")
            .field("now", &self.now)
            .field("pending", &self.pending())
            .field("seed", &self.seed)
            .field("delivered", &self.delivered)
            .finish_non_exhaustive()
    }
}

impl<E> Simulator<E> {
    /// A simulation at time zero with no events, its random stream seeded
    /// with `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            now: SimTime::ZERO,
            queue: BinaryHeap::new(),
            cancelled: HashSet::new(),
            next_seq: 0,
            seed,
            rng: ChaCha8Rng::seed_from_u64(seed),
            delivered: 0,
        }
    }

    /// The seed it was made with.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The clock: the time of the last event returned.
    pub fn now(&self) -> SimTime {
        self.now
    }

    /// The random stream. Every random choice of a run comes from it, or
    /// from a fork of it.
    pub fn rng(&mut self) -> &mut ChaCha8Rng {
        &mut self.rng
    }

    /// An independent random stream for one component, named by `stream`:
    /// the same seed and name give the same stream, whatever else the run
    /// draws (a component added to a simulation leaves the others' choices
    /// as they were).
    pub fn fork(&self, stream: u64) -> ChaCha8Rng {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        rng.set_stream(stream.wrapping_add(1));
        rng
    }

    /// Schedules `event` at `at`, not before the clock.
    pub fn schedule_at(&mut self, at: SimTime, event: E) -> Result<EventId, SimError> {
        if at < self.now {
            return Err(SimError::InThePast { at, now: self.now });
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.queue.push(Reverse(Queued { at, seq, event }));
        Ok(EventId(seq))
    }

    /// Schedules `event` `after` from now.
    pub fn schedule_in(&mut self, after: Duration, event: E) -> Result<EventId, SimError> {
        let at = self.now.checked_add(after).ok_or(SimError::TooLate {
            now: self.now,
            after,
        })?;
        self.schedule_at(at, event)
    }

    /// Drops event `id` if it was not returned yet; whether it was
    /// pending.
    pub fn cancel(&mut self, id: EventId) -> bool {
        if id.0 >= self.next_seq || self.cancelled.contains(&id.0) {
            return false;
        }
        let pending = self.queue.iter().any(|Reverse(q)| q.seq == id.0);
        if pending {
            self.cancelled.insert(id.0);
        }
        pending
    }

    /// Events scheduled and neither returned nor cancelled.
    pub fn pending(&self) -> usize {
        self.queue.len() - self.cancelled.len()
    }

    /// Events returned so far.
    pub fn delivered(&self) -> u64 {
        self.delivered
    }

    /// The time of the next event, if any.
    pub fn peek_time(&mut self) -> Option<SimTime> {
        self.skip_cancelled();
        self.queue.peek().map(|Reverse(q)| q.at)
    }

    /// Advances the clock to the earliest event and returns it; `None`
    /// when none is left (the clock stays).
    pub fn next_event(&mut self) -> Option<Due<E>> {
        self.skip_cancelled();
        let Reverse(q) = self.queue.pop()?;
        self.now = q.at;
        self.delivered += 1;
        Some(Due {
            at: q.at,
            id: EventId(q.seq),
            event: q.event,
        })
    }

    /// As [`Simulator::next_event`], for an event at or before `until`
    /// only; otherwise the clock moves to `until` (if it is later) and
    /// `None` comes back.
    pub fn next_event_until(&mut self, until: SimTime) -> Option<Due<E>> {
        match self.peek_time() {
            Some(at) if at <= until => self.next_event(),
            _ => {
                self.now = self.now.max(until);
                None
            }
        }
    }

    fn skip_cancelled(&mut self) {
        while let Some(Reverse(q)) = self.queue.peek() {
            if !self.cancelled.remove(&q.seq) {
                break;
            }
            self.queue.pop();
        }
    }
}

/// A running digest of what a run did (FNV-1a, 64 bits): two runs that
/// recorded the same bytes in the same order have the same digest, which
/// is how a test says a seed replays byte for byte. Not for security.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Trace(u64);

impl Default for Trace {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Trace {
    /// Mixes `bytes` in.
    pub fn record(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    /// Mixes a number in.
    pub fn record_u64(&mut self, n: u64) {
        self.record(&n.to_le_bytes());
    }

    /// The digest so far.
    pub fn digest(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use rand::Rng;

    use super::*;

    #[test]
    fn events_come_out_in_time_order_and_ties_in_scheduling_order() {
        let mut sim = Simulator::new(1);
        sim.schedule_in(Duration::from_millis(5), "c").unwrap();
        sim.schedule_in(Duration::from_millis(1), "a").unwrap();
        sim.schedule_in(Duration::from_millis(5), "d").unwrap();
        sim.schedule_in(Duration::from_millis(1), "b").unwrap();
        let mut seen = Vec::new();
        while let Some(due) = sim.next_event() {
            assert_eq!(sim.now(), due.at);
            seen.push((due.at.since_start().as_millis(), due.event));
        }
        assert_eq!(seen, [(1, "a"), (1, "b"), (5, "c"), (5, "d")]);
        assert_eq!(sim.delivered(), 4);
        assert_eq!(sim.now(), SimTime::from_nanos(5_000_000));
    }

    #[test]
    fn the_clock_never_goes_back() {
        let mut sim = Simulator::new(1);
        sim.schedule_in(Duration::from_secs(2), ()).unwrap();
        sim.next_event().unwrap();
        assert_eq!(
            sim.schedule_at(SimTime::from_nanos(1), ()),
            Err(SimError::InThePast {
                at: SimTime::from_nanos(1),
                now: SimTime::from_nanos(2_000_000_000),
            })
        );
        assert!(matches!(
            sim.schedule_in(Duration::MAX, ()),
            Err(SimError::TooLate { .. })
        ));
        // Now itself is fine: it comes out next.
        sim.schedule_at(sim.now(), ()).unwrap();
        assert_eq!(
            sim.next_event().unwrap().at,
            SimTime::from_nanos(2_000_000_000)
        );
        // Nothing left: the clock stays, or moves to a bound asked for.
        assert!(sim.next_event().is_none());
        assert!(
            sim.next_event_until(SimTime::from_nanos(3_000_000_000))
                .is_none()
        );
        assert_eq!(sim.now(), SimTime::from_nanos(3_000_000_000));
    }

    #[test]
    fn a_cancelled_event_never_comes() {
        let mut sim = Simulator::new(1);
        let a = sim.schedule_in(Duration::from_millis(1), 'a').unwrap();
        let b = sim.schedule_in(Duration::from_millis(2), 'b').unwrap();
        assert_eq!(sim.pending(), 2);
        assert!(sim.cancel(a));
        assert!(!sim.cancel(a), "cancelled twice");
        assert_eq!(sim.pending(), 1);
        assert_eq!(sim.peek_time(), Some(SimTime::from_nanos(2_000_000)));
        assert_eq!(sim.next_event().map(|d| d.event), Some('b'));
        assert!(!sim.cancel(b), "already returned");
        assert!(!sim.cancel(EventId(99)), "never scheduled");
        assert_eq!(sim.pending(), 0);
    }

    #[test]
    fn next_event_until_stops_at_the_bound() {
        let mut sim = Simulator::new(1);
        sim.schedule_in(Duration::from_secs(1), 1).unwrap();
        sim.schedule_in(Duration::from_secs(3), 3).unwrap();
        let bound = SimTime::from_nanos(2_000_000_000);
        assert_eq!(sim.next_event_until(bound).map(|d| d.event), Some(1));
        assert_eq!(sim.next_event_until(bound), None);
        assert_eq!(sim.now(), bound);
        assert_eq!(sim.next_event().map(|d| d.event), Some(3));
    }

    /// A workload whose every choice is random: each event schedules up
    /// to two more at random delays, one in five cancels a pending one.
    fn run(seed: u64, events: u64) -> (u64, SimTime) {
        let mut sim: Simulator<u64> = Simulator::new(seed);
        let mut trace = Trace::default();
        let mut timers = Vec::new();
        for i in 0..4 {
            timers.push(sim.schedule_in(Duration::from_micros(i), i).unwrap());
        }
        let mut label = 4;
        while let Some(due) = sim.next_event() {
            trace.record_u64(due.at.as_nanos());
            trace.record_u64(due.event);
            if sim.delivered() >= events {
                break;
            }
            for _ in 0..sim.rng().random_range(0..3) {
                let after = Duration::from_nanos(sim.rng().random_range(0..1_000_000));
                timers.push(sim.schedule_in(after, label).unwrap());
                label += 1;
            }
            if sim.rng().random_ratio(1, 5) && !timers.is_empty() {
                let i = sim.rng().random_range(0..timers.len());
                let id = timers.swap_remove(i);
                trace.record_u64(u64::from(sim.cancel(id)));
            }
        }
        (trace.digest(), sim.now())
    }

    #[test]
    fn the_same_seed_replays_byte_for_byte_and_another_does_not() {
        let first = run(42, 20_000);
        assert_eq!(run(42, 20_000), first);
        assert_ne!(run(43, 20_000).0, first.0);
    }

    #[test]
    fn forks_are_fixed_by_the_seed_and_their_name_and_differ_from_each_other() {
        let sim: Simulator<()> = Simulator::new(7);
        let draw = |mut rng: ChaCha8Rng| (0..8).map(|_| rng.random::<u64>()).collect::<Vec<_>>();
        assert_eq!(draw(sim.fork(1)), draw(sim.fork(1)));
        assert_ne!(draw(sim.fork(1)), draw(sim.fork(2)));
        assert_eq!(draw(sim.fork(1)), draw(Simulator::<()>::new(7).fork(1)));
        assert_ne!(draw(sim.fork(1)), draw(Simulator::<()>::new(8).fork(1)));
        // Drawing from the main stream leaves a fork as it was.
        let mut busy: Simulator<()> = Simulator::new(7);
        for _ in 0..100 {
            busy.rng().random::<u64>();
        }
        assert_eq!(draw(busy.fork(1)), draw(sim.fork(1)));
    }

    #[test]
    fn times_print_and_convert() {
        let t = SimTime::from_nanos(1_500_000_123);
        assert_eq!(t.to_string(), "1.500000123s");
        assert_eq!(
            t.saturating_since(SimTime::from_nanos(500_000_123)),
            Duration::from_secs(1)
        );
        assert_eq!(SimTime::ZERO.saturating_since(t), Duration::ZERO);
        let base = std::time::Instant::now();
        assert_eq!(
            t.to_instant(base) - base,
            Duration::from_nanos(1_500_000_123)
        );
    }
}
