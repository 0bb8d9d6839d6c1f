//! A row's expiry stamp: a 32-bit clock that wraps (the wall clock's
//! seconds, or the positions of the shard's stream), what a table's bound
//! on its age means ([`Bound`]), and where a sweep goes on
//! ([`SweepCursor`]). The rows keep one stamp each and sweep by it; the
//! table's expiry (`table/expiry.rs`) chooses the bound and drives the
//! sweep.

/// A table's expiry bound, in its clock's units.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// Seconds of the primary's wall clock.
    Secs(u32),
    /// Positions of the shard's stream.
    Pushes(u32),
}

impl Bound {
    /// The stamp of a Push applied at `secs` (the primary's wall clock)
    /// to a table whose latest stamp is `latest` (32 bits, wrapping:
    /// module docs).
    pub fn push_stamp(self, secs: u64, latest: u32) -> u32 {
        match self {
            Bound::Secs(_) => secs as u32,
            Bound::Pushes(_) => latest.wrapping_add(1),
        }
    }

    /// The time a sweep judges ages at, in this clock: the wall clock
    /// `secs`, or the table's latest Push `latest` (sweep steps and idle
    /// time do not age rows counted in Pushes).
    pub fn now(self, secs: u64, latest: u32) -> u32 {
        match self {
            Bound::Secs(_) => secs as u32,
            Bound::Pushes(_) => latest,
        }
    }
}

/// Whether a row stamped `stamp` is expired at `now` under `bound`.
pub fn expired(stamp: u32, now: u32, bound: Bound) -> bool {
    let limit = match bound {
        Bound::Secs(b) | Bound::Pushes(b) => b,
    };
    let age = now.wrapping_sub(stamp);
    // A stamp "after" now (a wrapped difference of 2^31 or more) is
    // younger.
    (age as i32) >= 0 && age > limit
}

/// The later of two stamps (wrapping: the one the other is within 2^31
/// before).
pub fn later(a: u32, b: u32) -> u32 {
    if (b.wrapping_sub(a) as i32) > 0 { b } else { a }
}

/// Where a shard's sweep goes on: a stripe and a record slot in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SweepCursor {
    /// The stripe.
    pub stripe: usize,
    /// The next slot in it.
    pub slot: u32,
    /// Passes over every stripe completed.
    pub passes: u64,
}
