//! The rows of a (table, shard) changed since the delta stream last took
//! them (ps-server's `delta`): a set of keys, kept on a training server with
//! `[delta]` always, and on one in etcd mode while it gives keys to a
//! resize (ps-server's `reshard`); switched by one flag for the whole store,
//! so that a server that streams nothing pays one atomic load per write.
//!
//! Keys, not rows: the delta reads each changed row's values when it is
//! sent, so a row pushed a thousand times in an interval is sent once, as
//! it is then. A key whose row is gone when it is read (expired, evicted)
//! is sent as removed. The set is bounded by the rows changed in one
//! interval, and [`Changes::record`] wakes the sender early once it holds
//! `delta.max_rows` keys.
//!
//! A `HashSet` behind a mutex: every writer of a shard's rows holds the
//! shard's write lock already (Pushes, the expiry sweep), except a Fetch
//! that creates a row, which is rare once a model is warm, so the mutex is
//! uncontended but for the sender's [`Changes::take`], once per interval.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tessera_sync::LockExt;

use crate::wake::Wake;

type Keys = HashSet<u64, foldhash::fast::RandomState>;

/// The keys of one (table, shard) changed since the last
/// [`Changes::take`].
#[derive(Debug)]
pub struct Changes {
    inner: Mutex<Inner>,
    /// Keys at which [`Changes::record`] wakes the sender.
    wake_at: usize,
    wake: Arc<Wake>,
    /// Whether changes are recorded now (the store's switch).
    on: Arc<AtomicBool>,
}

#[derive(Debug, Default)]
struct Inner {
    keys: Keys,
    /// When the oldest change in `keys` was recorded (Unix ms; 0: none).
    oldest_ms: u64,
}

/// What [`Changes::take`] took.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Taken {
    /// The keys changed, in no order.
    pub keys: Vec<u64>,
    /// When the oldest of those changes was recorded (Unix ms; 0: none).
    pub oldest_ms: u64,
}

impl Changes {
    /// An empty set that wakes `wake` once it holds `wake_at` keys,
    /// recording while `on` is set.
    pub fn new(wake_at: usize, wake: Arc<Wake>, on: Arc<AtomicBool>) -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            wake_at: wake_at.max(1),
            wake,
            on,
        }
    }

    /// Notes that the rows of `keys` changed (were written, created or
    /// removed) at `now_ms` (Unix ms).
    pub fn record(&self, keys: impl IntoIterator<Item = u64>, now_ms: u64) {
        if !self.on.load(Ordering::Relaxed) {
            return;
        }
        let len = {
            let mut inner = self.inner.locked();
            let before = inner.keys.len();
            inner.keys.extend(keys);
            if before == 0 && !inner.keys.is_empty() {
                inner.oldest_ms = now_ms;
            }
            inner.keys.len()
        };
        if len >= self.wake_at {
            self.wake.notify();
        }
    }

    /// The keys changed since the last take, and when the oldest change
    /// was made; the set starts again empty.
    pub fn take(&self) -> Taken {
        let mut inner = self.inner.locked();
        let oldest_ms = std::mem::take(&mut inner.oldest_ms);
        let keys = std::mem::take(&mut inner.keys);
        Taken {
            keys: keys.into_iter().collect(),
            oldest_ms,
        }
    }

    /// Keys held now.
    pub fn len(&self) -> usize {
        self.inner.locked().keys.len()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Wall-clock milliseconds since the Unix epoch (0 before it).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_changed_many_times_is_taken_once_with_the_oldest_time() {
        let changes = Changes::new(
            100,
            Arc::new(Wake::default()),
            Arc::new(AtomicBool::new(true)),
        );
        changes.record([1, 2, 3], 1_000);
        changes.record([2, 3, 4], 2_000);
        let mut taken = changes.take();
        taken.keys.sort_unstable();
        assert_eq!(taken.keys, vec![1, 2, 3, 4]);
        assert_eq!(taken.oldest_ms, 1_000);
        assert!(changes.is_empty());
        assert_eq!(changes.take(), Taken::default());
        changes.record([9], 3_000);
        assert_eq!(changes.take().oldest_ms, 3_000);
    }

    #[test]
    fn reaching_the_threshold_wakes_the_sender() {
        use futures::FutureExt;
        let wake = Arc::new(Wake::default());
        let changes = Changes::new(3, Arc::clone(&wake), Arc::new(AtomicBool::new(true)));
        changes.record([1, 2], 1);
        changes.record([2], 1);
        // Not yet: a pending wake would make this resolve at once.
        assert!(wake.notified().now_or_never().is_none());
        changes.record([3], 1);
        assert!(
            wake.notified().now_or_never().is_some(),
            "woken at three keys"
        );
    }
}
