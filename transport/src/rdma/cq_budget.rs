//! Room on an I/O thread's completion queue.
//!
//! Every QP an I/O thread serves completes into the thread's one CQ, and a
//! CQ that receives more completions than it holds overruns: the device
//! fails it, and every QP on it (`IBV_EVENT_CQ_ERR`). A QP can have at most
//! its send queue and its receive queue outstanding, so a thread takes a QP
//! only while the sum over its QPs (and its shared receive queue) fits the
//! CQ; a connection that fits no thread is refused with an error that says
//! what to raise, instead of overrunning under load. Before, QPs were
//! handed to threads round robin with no count.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// The completions one thread's CQ holds and how many its QPs may have
/// outstanding.
#[derive(Debug)]
pub(crate) struct CqBudget {
    capacity: u64,
    reserved: AtomicU64,
}

impl CqBudget {
    /// A budget of `capacity` entries, `fixed` of them taken for good (the
    /// thread's shared receive queue).
    pub(crate) fn new(capacity: u32, fixed: u32) -> Arc<Self> {
        Arc::new(Self {
            capacity: u64::from(capacity),
            reserved: AtomicU64::new(u64::from(fixed)),
        })
    }

    /// Takes room for `entries` completions, if there is.
    pub(crate) fn reserve(self: &Arc<Self>, entries: u32) -> Option<CqReservation> {
        let entries = u64::from(entries);
        self.reserved
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(entries).filter(|t| *t <= self.capacity)
            })
            .ok()?;
        Some(CqReservation {
            budget: Arc::clone(self),
            entries,
        })
    }

    /// Entries taken now.
    #[cfg(test)]
    pub(crate) fn reserved(&self) -> u64 {
        self.reserved.load(Ordering::Acquire)
    }
}

/// Room taken on a CQ; given back when dropped (with the QP's engine).
#[derive(Debug)]
pub(crate) struct CqReservation {
    budget: Arc<CqBudget>,
    entries: u64,
}

impl Drop for CqReservation {
    fn drop(&mut self) {
        self.budget
            .reserved
            .fetch_sub(self.entries, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qps_are_taken_while_they_fit_and_give_their_room_back() {
        let budget = CqBudget::new(256, 16);
        let a = budget.reserve(96).unwrap();
        let b = budget.reserve(96).unwrap();
        assert!(budget.reserve(96).is_none(), "16 + 3 x 96 > 256");
        assert_eq!(budget.reserved(), 208);
        drop(a);
        let c = budget.reserve(96).unwrap();
        drop((b, c));
        assert_eq!(budget.reserved(), 16);
    }
}
