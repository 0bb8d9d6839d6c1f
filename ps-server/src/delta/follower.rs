//! A serving server's place in one training shard's delta stream: which
//! deltas to apply, which are repeats, and when a gap means copying the
//! shard's rows (sans-IO: headers in, verdicts out, time passed in).
//!
//! # The chain
//!
//! A stream is a training primary's term of one shard: a random id, and
//! deltas numbered 1, 2, ... in it, each in one or more parts. A delta
//! holds every row changed since the one before, so a receiver that
//! applied number n may apply n+1 (part 0, then 1, ...) and nothing else.
//! Anything else is:
//! - a **repeat** (a number or part already applied): ignored;
//! - **stale** (an epoch below the stream followed: a deposed primary
//!   draining its queue): ignored, and not taken as the source to copy
//!   from;
//! - a **gap** (another stream, a number beyond the next, a part beyond
//!   the next): the receiver cannot know what it missed, so it **copies**
//!   the training shard's rows ([`Verdict::Copy`]). The copy says which
//!   stream and number it is as new as ([`Follower::handle_copied`]):
//!   the deltas after that number hold every change since.
//!
//! While a copy is taken, arriving deltas are **held** (up to
//! [`MAX_HELD_BYTES`]; beyond, all are dropped, and the copy is followed
//! by another if the next delta does not follow it), and those after the
//! copy's number are applied when it is in ([`Resume`]). A held delta
//! that does not follow the copy asks for one more copy and is dropped:
//! each held delta causes at most one copy, so a late delta of an old
//! stream cannot keep a receiver copying.
//!
//! # Call order
//!
//! [`Follower::handle_delta`] for each delta as it arrives; the caller
//! applies a delta when told [`Verdict::Apply`], and starts a copy when
//! told [`Verdict::Copy`] (from [`Follower::source`]). When the copy is
//! installed, [`Follower::handle_copied`], then apply what [`Resume`]
//! lists, in order, and copy again if it says so; a copy that failed:
//! [`Follower::handle_copy_failed`] and try again later. Freshness
//! ([`Follower::fresh`]) is read at any time.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Bytes of deltas held while a copy is taken, per training shard: a
/// copy of a large shard takes seconds, during which a busy shard sends a
/// few deltas of a few MiB.
pub const MAX_HELD_BYTES: usize = 64 << 20;

/// Where a delta lies in its stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The stream (a primary term of the training shard).
    pub stream: u64,
    /// The epoch of the primary that sends it.
    pub epoch: u64,
    /// Its number in the stream.
    pub seq: u64,
    /// Its part, and whether it is the last.
    pub part: u32,
    /// Whether it is the delta's last part.
    pub last: bool,
}

/// What to do with a delta.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Apply it now, before handling the next.
    Apply,
    /// Applied before: ignore it.
    Repeat,
    /// From a primary older than the stream followed: ignore it.
    Stale,
    /// Held until the copy in progress is in.
    Held,
    /// Dropped: too much is held already (a copy is in progress).
    Dropped,
    /// A gap: held, and a copy of the training shard must be taken now.
    Copy,
}

/// What to do once a copy is in.
#[derive(Debug)]
pub struct Resume<T> {
    /// Held deltas that follow the copy: apply them, in order.
    pub apply: Vec<T>,
    /// A held delta did not follow: copy again (the rest stay held).
    pub copy_again: bool,
}

/// One training shard's stream as a serving server follows it.
#[derive(Debug)]
pub struct Follower<T> {
    /// The stream followed (0: none yet).
    stream: u64,
    /// The newest epoch heard of (deltas of older ones are stale).
    epoch: u64,
    /// The last delta applied whole.
    seq: u64,
    /// The next part of delta `seq + 1` (0: none of it applied).
    part: u32,
    /// A copy is being taken: the deltas held meanwhile.
    copying: Option<Held<T>>,
    /// When a delta (or a copy) was last applied.
    applied_at: Option<Instant>,
    /// The latest sender of the stream (where to copy from).
    source: String,
}

#[derive(Debug)]
struct Held<T> {
    items: VecDeque<(Header, T, usize)>,
    bytes: usize,
}

impl<T> Default for Follower<T> {
    fn default() -> Self {
        Self {
            stream: 0,
            epoch: 0,
            seq: 0,
            part: 0,
            copying: None,
            applied_at: None,
            source: String::new(),
        }
    }
}

impl<T> Follower<T> {
    /// A follower of nothing yet: its first delta is a gap.
    pub fn new() -> Self {
        Self::default()
    }

    /// Judges a delta (`bytes` long) from `source` arriving at `now`;
    /// keeps `item` when it is held ([`Verdict::Held`], [`Verdict::Copy`]),
    /// else hands it back.
    pub fn handle_delta(
        &mut self,
        header: Header,
        source: &str,
        item: T,
        bytes: usize,
        now: Instant,
    ) -> (Verdict, Option<T>) {
        if header.epoch < self.epoch {
            return (Verdict::Stale, Some(item));
        }
        self.epoch = header.epoch;
        if self.source != source {
            self.source = source.to_owned();
        }
        if let Some(held) = &mut self.copying {
            if held.bytes + bytes > MAX_HELD_BYTES {
                // The copy is followed by another unless the next delta
                // after it follows it.
                held.items.clear();
                held.bytes = 0;
                return (Verdict::Dropped, Some(item));
            }
            held.bytes += bytes;
            held.items.push_back((header, item, bytes));
            return (Verdict::Held, None);
        }
        match self.judge(header) {
            Judged::Next => {
                self.advance(header, now);
                (Verdict::Apply, Some(item))
            }
            Judged::Repeat => (Verdict::Repeat, Some(item)),
            Judged::Gap => {
                let mut items = VecDeque::new();
                items.push_back((header, item, bytes));
                self.copying = Some(Held { items, bytes });
                (Verdict::Copy, None)
            }
        }
    }

    /// A copy is in: it holds every change of `stream` (of `epoch`)
    /// through delta `seq` (a `stream` of 0: of no stream, so the next
    /// delta is a gap), as of `taken` (when it was asked for: its rows
    /// are at least that fresh). Returns the held deltas to apply now, in
    /// order.
    pub fn handle_copied(
        &mut self,
        stream: u64,
        seq: u64,
        epoch: u64,
        taken: Instant,
    ) -> Resume<T> {
        self.stream = stream;
        self.epoch = self.epoch.max(epoch);
        self.seq = seq;
        self.part = 0;
        self.applied_at = Some(taken);
        let mut held = self.copying.take().map(|h| h.items).unwrap_or_default();
        let mut apply = Vec::new();
        while let Some((header, item, _)) = held.pop_front() {
            if header.epoch < self.epoch {
                continue;
            }
            match self.judge(header) {
                Judged::Next => {
                    self.advance(header, taken);
                    apply.push(item);
                }
                Judged::Repeat => {}
                Judged::Gap => {
                    // One more copy for it (taken after it arrived, so as
                    // new as it), and it is done with.
                    let bytes = held.iter().map(|h| h.2).sum();
                    self.copying = Some(Held { items: held, bytes });
                    return Resume {
                        apply,
                        copy_again: true,
                    };
                }
            }
        }
        Resume {
            apply,
            copy_again: false,
        }
    }

    /// A copy failed: deltas stay held (within the bound) until one is
    /// in.
    pub fn handle_copy_failed(&mut self) {
        if self.copying.is_none() {
            self.copying = Some(Held {
                items: VecDeque::new(),
                bytes: 0,
            });
        }
    }

    /// Applying a delta failed (its rows do not fit this server's
    /// tables): the stream is lost here, and the next delta is a gap.
    pub fn handle_apply_failed(&mut self) {
        self.stream = 0;
    }

    /// Whether a copy is in progress.
    pub fn copying(&self) -> bool {
        self.copying.is_some()
    }

    /// The stream followed (0: none).
    pub fn stream(&self) -> u64 {
        self.stream
    }

    /// The last delta applied whole.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// The latest sender of the stream: where to copy from.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// When a delta or a copy was last applied (`None`: never).
    pub fn applied_at(&self) -> Option<Instant> {
        self.applied_at
    }

    /// How long ago a delta or a copy was last applied (`None`: never).
    pub fn applied_age(&self, now: Instant) -> Option<Duration> {
        self.applied_at.map(|at| now.saturating_duration_since(at))
    }

    /// Whether the rows are within `bound` of the stream: following it
    /// (not copying) and a delta applied within `bound`.
    pub fn fresh(&self, now: Instant, bound: Duration) -> bool {
        self.copying.is_none() && self.applied_age(now).is_some_and(|age| age <= bound)
    }

    fn judge(&self, header: Header) -> Judged {
        if header.stream != self.stream || self.stream == 0 {
            return Judged::Gap;
        }
        if header.seq <= self.seq || (header.seq == self.seq + 1 && header.part < self.part) {
            Judged::Repeat
        } else if header.seq == self.seq + 1 && header.part == self.part {
            Judged::Next
        } else {
            Judged::Gap
        }
    }

    fn advance(&mut self, header: Header, now: Instant) {
        if header.last {
            self.seq = header.seq;
            self.part = 0;
            self.applied_at = Some(now);
        } else {
            self.part = header.part + 1;
        }
    }
}

enum Judged {
    Next,
    Repeat,
    Gap,
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn h(stream: u64, seq: u64) -> Header {
        Header {
            stream,
            epoch: stream,
            seq,
            part: 0,
            last: true,
        }
    }

    fn part(stream: u64, seq: u64, part: u32, last: bool) -> Header {
        Header {
            stream,
            epoch: stream,
            seq,
            part,
            last,
        }
    }

    #[test]
    fn the_first_delta_is_a_gap_and_the_copy_resumes_the_chain() {
        let now = Instant::now();
        let mut f = Follower::new();
        assert!(!f.fresh(now, Duration::from_secs(1)));
        assert_eq!(f.handle_delta(h(7, 3), "a", 3, 10, now).0, Verdict::Copy);
        assert_eq!(f.handle_delta(h(7, 4), "a", 4, 10, now).0, Verdict::Held);
        assert_eq!(f.handle_delta(h(7, 5), "a", 5, 10, now).0, Verdict::Held);
        assert!(f.copying());
        // The copy was taken after delta 4 was cut.
        let resume = f.handle_copied(7, 4, 7, now);
        assert_eq!(resume.apply, vec![5]);
        assert!(!resume.copy_again);
        assert_eq!(f.seq(), 5);
        assert!(f.fresh(now, Duration::from_secs(1)));
        assert_eq!(f.handle_delta(h(7, 6), "a", 6, 10, now).0, Verdict::Apply);
        assert_eq!(f.handle_delta(h(7, 6), "a", 6, 10, now).0, Verdict::Repeat);
        assert_eq!(f.handle_delta(h(7, 2), "a", 2, 10, now).0, Verdict::Repeat);
    }

    #[test]
    fn a_missed_delta_or_a_new_stream_means_a_copy() {
        let now = Instant::now();
        let mut f = Follower::new();
        f.handle_delta(h(7, 1), "a", (), 1, now);
        f.handle_copied(7, 1, 7, now);
        assert_eq!(f.handle_delta(h(7, 3), "a", (), 1, now).0, Verdict::Copy);
        f.handle_copied(7, 3, 7, now);
        // A new primary (or a restarted one): another stream.
        assert_eq!(f.handle_delta(h(9, 1), "b", (), 1, now).0, Verdict::Copy);
        assert_eq!(f.source(), "b");
    }

    #[test]
    fn parts_apply_in_order_and_a_missed_part_is_a_gap() {
        let now = Instant::now();
        let mut f = Follower::new();
        f.handle_delta(h(1, 1), "a", (), 1, now);
        f.handle_copied(1, 1, 1, now);
        assert_eq!(
            f.handle_delta(part(1, 2, 0, false), "a", (), 1, now).0,
            Verdict::Apply
        );
        assert_eq!(
            f.handle_delta(part(1, 2, 0, false), "a", (), 1, now).0,
            Verdict::Repeat
        );
        assert_eq!(
            f.handle_delta(part(1, 2, 1, true), "a", (), 1, now).0,
            Verdict::Apply
        );
        assert_eq!(f.seq(), 2);
        assert_eq!(
            f.handle_delta(part(1, 3, 1, true), "a", (), 1, now).0,
            Verdict::Copy
        );
    }

    #[test]
    fn a_copy_of_no_stream_leaves_the_next_delta_a_gap() {
        let now = Instant::now();
        let mut f = Follower::new();
        f.handle_delta(h(4, 1), "a", (), 1, now);
        let resume = f.handle_copied(0, 0, 0, now);
        // The held delta does not follow a copy of no stream: copy again.
        assert!(resume.copy_again);
        assert!(f.copying());
    }

    #[test]
    fn too_much_held_is_dropped_and_the_copy_is_followed_by_another() {
        let now = Instant::now();
        let mut f = Follower::new();
        assert_eq!(f.handle_delta(h(1, 1), "a", 1, 10, now).0, Verdict::Copy);
        assert_eq!(
            f.handle_delta(h(1, 2), "a", 2, MAX_HELD_BYTES, now).0,
            Verdict::Dropped
        );
        assert_eq!(f.handle_delta(h(1, 3), "a", 3, 10, now).0, Verdict::Held);
        // Copied as of delta 1: delta 3 does not follow.
        let resume = f.handle_copied(1, 1, 1, now);
        assert!(resume.apply.is_empty());
        assert!(resume.copy_again);
        // The second copy, as of delta 3, resumes.
        let resume = f.handle_copied(1, 3, 1, now);
        assert!(resume.apply.is_empty() && !resume.copy_again);
        assert_eq!(f.handle_delta(h(1, 4), "a", 4, 10, now).0, Verdict::Apply);
    }

    /// A deposed primary's late deltas (an older epoch) are ignored, and
    /// do not become the source to copy from.
    #[test]
    fn a_deposed_primarys_late_deltas_are_stale() {
        let now = Instant::now();
        let mut f = Follower::new();
        f.handle_delta(h(2, 5), "new", (), 1, now);
        f.handle_copied(2, 5, 2, now);
        assert_eq!(f.handle_delta(h(1, 9), "old", (), 1, now).0, Verdict::Stale);
        assert_eq!(f.source(), "new");
        assert!(!f.copying());
        assert_eq!(f.handle_delta(h(2, 6), "new", (), 1, now).0, Verdict::Apply);
    }

    /// A held delta of another stream at the same epoch (a lone server
    /// restarted without its checkpoint) asks for one more copy, once:
    /// it cannot keep the follower copying.
    #[test]
    fn a_held_delta_that_does_not_follow_causes_one_copy_at_most() {
        let now = Instant::now();
        let mut f = Follower::new();
        let other = Header {
            stream: 8,
            epoch: 1,
            ..h(1, 3)
        };
        assert_eq!(f.handle_delta(h(1, 1), "a", 1, 1, now).0, Verdict::Copy);
        assert_eq!(f.handle_delta(other, "a", 2, 1, now).0, Verdict::Held);
        assert_eq!(f.handle_delta(h(1, 2), "a", 3, 1, now).0, Verdict::Held);
        let resume = f.handle_copied(1, 1, 1, now);
        assert!(resume.copy_again && resume.apply.is_empty());
        // The next copy is of stream 1 again; delta 2 of it follows.
        let resume = f.handle_copied(1, 1, 1, now);
        assert_eq!(resume.apply, vec![3]);
        assert!(!resume.copy_again && !f.copying());
    }

    #[test]
    fn freshness_follows_the_last_applied_delta() {
        let start = Instant::now();
        let bound = Duration::from_millis(500);
        let mut f = Follower::new();
        f.handle_delta(h(1, 1), "a", (), 1, start);
        f.handle_copied(1, 1, 1, start);
        assert!(f.fresh(start + Duration::from_millis(400), bound));
        assert!(!f.fresh(start + Duration::from_millis(600), bound));
        f.handle_delta(h(1, 2), "a", (), 1, start + Duration::from_millis(600));
        assert!(f.fresh(start + Duration::from_millis(700), bound));
        // Copying is never fresh.
        f.handle_delta(h(1, 9), "a", (), 1, start + Duration::from_millis(700));
        assert!(!f.fresh(start + Duration::from_millis(700), bound));
    }

    /// A model of a stream's changes: the follower applies a delta only
    /// right after the one before (or after a copy as of the one before),
    /// so the rows it holds equal the source's at every point where it is
    /// not copying, whatever is lost, repeated or reordered on the way.
    #[derive(Debug, Clone)]
    enum Event {
        /// The source cuts a delta changing key k to a new value.
        Cut(u8),
        /// The network delivers the queued delta at this index (mod len),
        /// or drops it, or delivers it twice.
        Deliver(usize),
        Drop(usize),
        Twice(usize),
        /// A new primary term: a new stream.
        NewStream,
        /// The copy in progress completes now.
        CopyDone,
    }

    fn event() -> impl Strategy<Value = Event> {
        prop_oneof![
            4 => any::<u8>().prop_map(|k| Event::Cut(k % 16)),
            6 => any::<usize>().prop_map(Event::Deliver),
            1 => any::<usize>().prop_map(Event::Drop),
            1 => any::<usize>().prop_map(Event::Twice),
            1 => Just(Event::NewStream),
            2 => Just(Event::CopyDone),
        ]
    }

    proptest! {
        #[test]
        fn rows_equal_the_sources_once_the_stream_drains(events in proptest::collection::vec(event(), 1..200)) {
            let now = Instant::now();
            // The source: values by key, its stream, delta number, and
            // each delta as (header, changes).
            let mut source = [0u64; 16];
            let mut stream = 1u64;
            let mut seq = 0u64;
            let mut next_value = 1u64;
            let mut wire: Vec<(Header, Vec<(usize, u64)>)> = Vec::new();
            let mut mine = [0u64; 16];
            let mut f: Follower<Vec<(usize, u64)>> = Follower::new();
            let apply = |mine: &mut [u64; 16], changes: &[(usize, u64)]| {
                for &(k, v) in changes {
                    mine[k] = v;
                }
            };
            let deliver = |f: &mut Follower<Vec<(usize, u64)>>, mine: &mut [u64; 16], header: Header, changes: Vec<(usize, u64)>| {
                if f.handle_delta(header, "src", changes.clone(), 1, now).0 == Verdict::Apply {
                    apply(mine, &changes);
                }
            };
            for e in events {
                match e {
                    Event::Cut(k) => {
                        source[k as usize] = next_value;
                        next_value += 1;
                        seq += 1;
                        // A delta holds the row as it is when cut.
                        wire.push((h(stream, seq), vec![(k as usize, source[k as usize])]));
                    }
                    Event::Deliver(i) if !wire.is_empty() => {
                        let (header, changes) = wire.remove(i % wire.len());
                        deliver(&mut f, &mut mine, header, changes);
                    }
                    Event::Drop(i) if !wire.is_empty() => {
                        wire.remove(i % wire.len());
                    }
                    Event::Twice(i) if !wire.is_empty() => {
                        let (header, changes) = wire[i % wire.len()].clone();
                        deliver(&mut f, &mut mine, header, changes);
                    }
                    Event::NewStream => {
                        stream += 1;
                        seq = 0;
                    }
                    Event::CopyDone if f.copying() => {
                        mine = source;
                        let resume = f.handle_copied(stream, seq, stream, now);
                        for changes in resume.apply {
                            apply(&mut mine, &changes);
                        }
                    }
                    _ => {}
                }
                if !f.copying() && f.stream() == stream && f.seq() == seq {
                    prop_assert_eq!(mine, source);
                }
            }
            // Drain: every delta still on the wire arrives (old streams'
            // too), then a heartbeat; copies are taken until the follower
            // is in step, which one copy does (stale deltas are dropped).
            for (header, changes) in std::mem::take(&mut wire) {
                deliver(&mut f, &mut mine, header, changes);
            }
            seq += 1;
            deliver(&mut f, &mut mine, h(stream, seq), Vec::new());
            let mut copies = 0;
            while f.copying() {
                copies += 1;
                prop_assert!(copies <= 1, "copied again and again");
                mine = source;
                let resume = f.handle_copied(stream, seq, stream, now);
                for changes in resume.apply {
                    apply(&mut mine, &changes);
                }
            }
            prop_assert!(!f.copying());
            prop_assert_eq!(mine, source);
        }
    }
}
