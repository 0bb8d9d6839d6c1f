//! Each shard's write lock ([`ShardGuard`]) and the version it guards:
//! taken by a thread ([`Store::lock_shard`]) or by a task without blocking
//! its thread ([`Store::lock_shard_async`]).

use std::sync::atomic::{AtomicUsize, Ordering as AtomicOrdering};
use std::sync::{Mutex, MutexGuard};
use tessera_rpc::sync::LockExt;

use super::Store;
use crate::version::Version;

/// One shard's write lock, and the wake-up of the async tasks waiting for
/// it ([`Store::lock_shard_async`]).
#[derive(Debug, Default)]
pub(super) struct Writer {
    version: Mutex<Version>,
    /// A copy of the version as of the last completed change, for readers
    /// that must not wait for the write lock (Health, stream heads).
    published: Mutex<Version>,
    /// Async waiters registered (a release notifies only if some are).
    waiting: AtomicUsize,
    released: tokio::sync::Notify,
    /// The keys of the shard that moved away in a resize: those the
    /// jump hash routes elsewhere under this shard count (0: none moved).
    /// Set under the lock ([`ShardGuard::set_moved`]), so that a Push
    /// applied under it is either before the fence or refused.
    pub(super) moved_to: std::sync::atomic::AtomicU32,
    /// The shard-map version that moved them.
    pub(super) moved_version: std::sync::atomic::AtomicU64,
    /// When this copy fenced them: it serves their Fetches for at most
    /// the store's stale-read bound after (`store/resize.rs`).
    pub(super) moved_since: Mutex<Option<std::time::Instant>>,
    /// Every receiving shard serves the moved keys now: Pushes split by
    /// the new count are taken ([`ShardGuard::new_count_open`]).
    pub(super) moved_open: std::sync::atomic::AtomicBool,
    /// A shrink in which this shard receives keys, not opened on this
    /// copy yet: the count those keys are routed by (0: none). Its own
    /// keys are served; the incoming ones are refused until it opens
    /// (`store/resize.rs`).
    pub(super) incoming_to: std::sync::atomic::AtomicU32,
    /// The count this shard routes keys by once a shrink opened on this
    /// copy (0: the store's). Set under the lock, with `incoming_to`
    /// cleared.
    pub(super) routes_by: std::sync::atomic::AtomicU32,
}

/// The write lock of one shard (see [`Store`]), with its version.
#[derive(Debug)]
pub struct ShardGuard<'a> {
    shard: u32,
    /// `Some` until dropped: released before the waiters are woken.
    version: Option<MutexGuard<'a, Version>>,
    pub(super) writer: &'a Writer,
}

impl Drop for ShardGuard<'_> {
    fn drop(&mut self) {
        drop(self.version.take());
        // Pairs with the fence in `lock_shard_async`: either this sees the
        // waiter's count, or the waiter's `try_lock` sees the release.
        std::sync::atomic::fence(AtomicOrdering::SeqCst);
        if self.writer.waiting.load(AtomicOrdering::SeqCst) > 0 {
            self.writer.released.notify_waiters();
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

impl Store {
    /// The write lock of `shard` (see [`Store`]), blocking the thread
    /// until it is free; `None` if the shard is not hosted here. For
    /// blocking threads and sections that hold it briefly; async request
    /// handlers use [`Store::lock_shard_async`].
    pub fn lock_shard(&self, shard: u32) -> Option<ShardGuard<'_>> {
        let writer = self.writers.get(&shard)?;
        Some(ShardGuard {
            shard,
            // A panic under the lock leaves at worst one Push half applied
            // to a row; serving beats failing every later request.
            version: Some(writer.version.locked()),
            writer,
        })
    }

    /// The write lock of `shard` without blocking the thread: when it is
    /// held (a Push of the same shard, a snapshot, a copy being installed),
    /// the task waits to be woken by its release, and the runtime's
    /// threads go on serving Fetches, Health and other shards. A Push
    /// handler that blocked its thread instead would park every runtime
    /// thread once a few Pushes queue behind a long hold. `None` if the
    /// shard is not hosted here.
    pub async fn lock_shard_async(&self, shard: u32) -> Option<ShardGuard<'_>> {
        let writer = self.writers.get(&shard)?;
        // Counted as waiting until this returns or is dropped.
        struct Waiting<'a>(&'a AtomicUsize);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, AtomicOrdering::SeqCst);
            }
        }
        writer.waiting.fetch_add(1, AtomicOrdering::SeqCst);
        let _waiting = Waiting(&writer.waiting);
        loop {
            let released = writer.released.notified();
            tokio::pin!(released);
            // Registered before trying: a release after this try wakes it.
            released.as_mut().enable();
            std::sync::atomic::fence(AtomicOrdering::SeqCst);
            if let Some(guard) = Self::try_lock_writer(shard, writer) {
                return Some(guard);
            }
            released.await;
        }
    }

    /// Async tasks waiting for `shard`'s write lock now (0 if it is not
    /// hosted).
    pub fn waiting_for_lock(&self, shard: u32) -> usize {
        self.writers
            .get(&shard)
            .map_or(0, |w| w.waiting.load(AtomicOrdering::SeqCst))
    }

    fn try_lock_writer(shard: u32, writer: &Writer) -> Option<ShardGuard<'_>> {
        let held = match writer.version.try_lock() {
            Ok(held) => held,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        Some(ShardGuard {
            shard,
            version: Some(held),
            writer,
        })
    }

    /// The version of `shard`'s rows as of the last completed change
    /// (`None`: not hosted). Does not wait for the shard's write lock: a
    /// Push being applied now is not counted yet; who needs the version
    /// to agree with the rows holds the lock ([`ShardGuard::version`]).
    pub fn version(&self, shard: u32) -> Option<Version> {
        let writer = self.writers.get(&shard)?;
        Some(*writer.published.locked())
    }
}
