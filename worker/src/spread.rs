//! The Push ids a client has in flight stay within half the servers'
//! deduplication window ([`tessera_proto::DEDUP_WINDOW`]).
//!
//! A server remembers which of a worker's last 1,024 sequences it applied
//! and refuses one below that ("may already have been applied"), since
//! it cannot tell. A Push that waits out a failover in retries while the
//! client's other tasks push on to the new primary can fall that far
//! behind: the kill-primary drill saw Push 8,945 retried after 1,267 newer
//! ones had landed, and its step failed. So a Push whose id is
//! [`MAX_SPREAD`] or more above the oldest one in flight waits (before it
//! sends anything) until that one is answered or given up; the oldest
//! never waits, so they all move. A caller's own retry of an old id (under
//! `push_as`) is not held back.

use std::collections::BTreeMap;
use std::sync::Mutex;

use tessera_rpc::sync::LockExt;
use tokio::sync::Notify;

/// Newest id in flight minus the oldest, at most (exclusive): half the
/// servers' window, the other half left for retries by callers.
pub const MAX_SPREAD: u64 = tessera_proto::DEDUP_WINDOW / 2;

/// The ids in flight (how many sends of each), and a wake-up for the
/// Pushes waiting for the oldest to leave.
#[derive(Debug, Default)]
pub struct InFlight {
    ids: Mutex<BTreeMap<u64, usize>>,
    left: Notify,
}

/// An id in flight until dropped.
#[derive(Debug)]
pub struct Entered<'a> {
    in_flight: &'a InFlight,
    id: u64,
}

impl InFlight {
    /// Waits until `id` is within [`MAX_SPREAD`] of the oldest id in
    /// flight (at once if it is, or is older), and marks it in flight.
    pub async fn enter(&self, id: u64) -> Entered<'_> {
        loop {
            let left = self.left.notified();
            tokio::pin!(left);
            // Registered before the check: a Push leaving between the
            // check and the wait still wakes this one.
            left.as_mut().enable();
            {
                let mut ids = self.ids.locked();
                let oldest = ids.keys().next().copied().unwrap_or(id);
                if id.saturating_sub(oldest) < MAX_SPREAD {
                    *ids.entry(id).or_default() += 1;
                    return Entered {
                        in_flight: self,
                        id,
                    };
                }
            }
            left.await;
        }
    }

    /// Ids in flight now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.ids.locked().values().sum()
    }
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        let mut ids = self.in_flight.ids.locked();
        if let Some(count) = ids.get_mut(&self.id) {
            *count -= 1;
            if *count == 0 {
                ids.remove(&self.id);
            }
        }
        drop(ids);
        self.in_flight.left.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;

    #[tokio::test(flavor = "current_thread")]
    async fn an_id_too_far_ahead_of_the_oldest_waits_for_it() {
        let in_flight = InFlight::default();
        let oldest = in_flight.enter(10).await;
        let near = in_flight.enter(10 + MAX_SPREAD - 1).await;
        // A retry of an older id goes at once.
        let retry = in_flight.enter(3).await;
        drop(retry);
        assert_eq!(in_flight.len(), 2);
        let far = in_flight.enter(10 + MAX_SPREAD);
        tokio::pin!(far);
        assert!(
            far.as_mut().now_or_never().is_none(),
            "the id MAX_SPREAD above the oldest waits"
        );
        drop(oldest);
        let far = far.await;
        assert_eq!(in_flight.len(), 2);
        drop((near, far));
        assert_eq!(in_flight.len(), 0);
        // The same id twice (parts of one Push, or a retry beside the
        // first try) counts until both leave.
        let a = in_flight.enter(7).await;
        let b = in_flight.enter(7).await;
        drop(a);
        assert_eq!(in_flight.len(), 1);
        drop(b);
        assert_eq!(in_flight.len(), 0);
    }
}
