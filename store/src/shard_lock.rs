//! One shard's write lock ([`ShardGuard`]) and the [`Version`] it guards:
//! taken by a thread ([`Writer::lock`]) or by a task without blocking its
//! thread ([`Writer::lock_async`]). The [`crate::Store`] keeps one
//! [`Writer`] per hosted shard and hands out its guards; a table's
//! methods that change rows take a guard as the witness that their
//! caller holds the lock. Below both, so that neither reaches up for it.

use std::sync::atomic::{AtomicUsize, Ordering as AtomicOrdering};
use std::sync::{Mutex, MutexGuard};
use tessera_sync::LockExt;

use crate::version::Version;

/// One shard's write lock, and the wake-up of the async tasks waiting for
/// it ([`Writer::lock_async`]).
#[derive(Debug, Default)]
pub struct Writer {
    version: Mutex<Version>,
    /// A copy of the version as of the last completed change, for readers
    /// that must not wait for the write lock (Health, stream heads).
    published: Mutex<Version>,
    /// Async waiters registered (a release notifies only if some are).
    waiting: AtomicUsize,
    released: event_listener::Event,
    /// The keys of the shard that moved away in a resize: those the
    /// jump hash routes elsewhere under this shard count (0: none moved).
    /// Set under the lock ([`ShardGuard::set_moved`]), so that a Push
    /// applied under it is either before the fence or refused.
    pub(crate) moved_to: std::sync::atomic::AtomicU32,
    /// The shard-map version that moved them.
    pub(crate) moved_version: std::sync::atomic::AtomicU64,
    /// When this copy fenced them: it serves their Fetches for at most
    /// the store's stale-read bound after (`store/resize.rs`).
    pub(crate) moved_since: Mutex<Option<std::time::Instant>>,
    /// Every receiving shard serves the moved keys now: Pushes split by
    /// the new count are taken ([`ShardGuard::new_count_open`]).
    pub(crate) moved_open: std::sync::atomic::AtomicBool,
    /// A shrink in which this shard receives keys, not opened on this
    /// copy yet: the count those keys are routed by (0: none). Its own
    /// keys are served; the incoming ones are refused until it opens
    /// (`store/resize.rs`).
    pub(crate) incoming_to: std::sync::atomic::AtomicU32,
    /// The count this shard routes keys by once a shrink opened on this
    /// copy (0: the store's). Set under the lock, with `incoming_to`
    /// cleared.
    pub(crate) routes_by: std::sync::atomic::AtomicU32,
}

/// The write lock of one shard (see [`crate::Store`]), with its version.
#[derive(Debug)]
pub struct ShardGuard<'a> {
    shard: u32,
    /// `Some` until dropped: released before the waiters are woken.
    version: Option<MutexGuard<'a, Version>>,
    pub(crate) writer: &'a Writer,
}

impl Drop for ShardGuard<'_> {
    fn drop(&mut self) {
        drop(self.version.take());
        // Pairs with the fence in `Writer::lock_async`: either this sees the
        // waiter's count, or the waiter's `try_lock` sees the release.
        std::sync::atomic::fence(AtomicOrdering::SeqCst);
        if self.writer.waiting.load(AtomicOrdering::SeqCst) > 0 {
            self.writer.released.notify(usize::MAX);
        }
    }
}

impl ShardGuard<'_> {
    /// The shard.
    pub fn shard(&self) -> u32 {
        self.shard
    }

    /// The version of the shard's rows.
    pub fn version(&self) -> Version {
        self.version.as_deref().copied().unwrap_or_default()
    }

    /// The shard count the shard's keys are routed by after a resize moved
    /// some of them away, and the map version that did (`None`: none
    /// moved).
    pub fn moved(&self) -> Option<(u32, u64)> {
        match self.writer.moved_to.load(AtomicOrdering::SeqCst) {
            0 => None,
            to => Some((to, self.writer.moved_version.load(AtomicOrdering::SeqCst))),
        }
    }

    /// Whether Pushes split by the count the keys moved to are taken: only
    /// once every receiving shard serves them, so that until then the
    /// shard's deduplication windows name only Pushes split by the old
    /// count (`store/resize.rs`).
    pub fn new_count_open(&self) -> bool {
        self.writer.moved_open.load(AtomicOrdering::SeqCst)
    }

    /// The count the shard receives keys of in a shrink not opened on
    /// this copy yet (`None`: none).
    pub fn incoming(&self) -> Option<u32> {
        match self.writer.incoming_to.load(AtomicOrdering::SeqCst) {
            0 => None,
            to => Some(to),
        }
    }

    /// The count the shard routes keys by after a shrink opened on this
    /// copy (`None`: the store's).
    pub fn routes_by(&self) -> Option<u32> {
        match self.writer.routes_by.load(AtomicOrdering::SeqCst) {
            0 => None,
            to => Some(to),
        }
    }

    /// Sets the version of the shard's rows (after changing them).
    pub fn set_version(&mut self, version: Version) {
        if let Some(held) = self.version.as_deref_mut() {
            *held = version;
            *self.writer.published.locked() = version;
        }
    }
}

impl Writer {
    /// The write lock of `shard`, blocking the thread until it is free.
    /// For blocking threads and sections that hold it briefly; async
    /// request handlers use [`Writer::lock_async`].
    pub fn lock(&self, shard: u32) -> ShardGuard<'_> {
        ShardGuard {
            shard,
            // A panic under the lock leaves at worst one Push half applied
            // to a row; serving beats failing every later request.
            version: Some(self.version.locked()),
            writer: self,
        }
    }

    /// The write lock of `shard` without blocking the thread: when it is
    /// held (a Push of the same shard, a snapshot, a copy being
    /// installed), the task waits to be woken by its release, and the
    /// runtime's threads go on serving Fetches, Health and other shards.
    /// A Push handler that blocked its thread instead would park every
    /// runtime thread once a few Pushes queue behind a long hold.
    pub async fn lock_async(&self, shard: u32) -> ShardGuard<'_> {
        // Counted as waiting until this returns or is dropped.
        struct Waiting<'a>(&'a AtomicUsize);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, AtomicOrdering::SeqCst);
            }
        }
        self.waiting.fetch_add(1, AtomicOrdering::SeqCst);
        let _waiting = Waiting(&self.waiting);
        loop {
            // Registered before trying: a release after this try wakes it.
            let released = self.released.listen();
            std::sync::atomic::fence(AtomicOrdering::SeqCst);
            if let Some(guard) = self.try_lock(shard) {
                return guard;
            }
            released.await;
        }
    }

    /// Async tasks waiting for the lock now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(AtomicOrdering::SeqCst)
    }

    /// The lock if it is free now.
    pub fn try_lock(&self, shard: u32) -> Option<ShardGuard<'_>> {
        let held = match self.version.try_lock() {
            Ok(held) => held,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        Some(ShardGuard {
            shard,
            version: Some(held),
            writer: self,
        })
    }

    /// The version as of the last completed change, without waiting for
    /// the lock.
    pub fn published(&self) -> Version {
        *self.published.locked()
    }
}
