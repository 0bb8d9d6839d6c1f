//! The [`Store`]'s access to each hosted shard's write lock
//! ([`crate::shard_lock`]): by a thread ([`Store::lock_shard`]) or by a
//! task without blocking its thread ([`Store::lock_shard_async`]).

use super::Store;
use crate::shard_lock::ShardGuard;
use crate::version::Version;

impl Store {
    /// The write lock of `shard` (see [`Store`]), blocking the thread
    /// until it is free; `None` if the shard is not hosted here. For
    /// blocking threads and sections that hold it briefly; async request
    /// handlers use [`Store::lock_shard_async`].
    pub fn lock_shard(&self, shard: u32) -> Option<ShardGuard<'_>> {
        Some(self.writers.get(&shard)?.lock(shard))
    }

    /// The write lock of `shard` without blocking the thread
    /// ([`crate::shard_lock::Writer::lock_async`]); `None` if the shard is
    /// not hosted here.
    pub async fn lock_shard_async(&self, shard: u32) -> Option<ShardGuard<'_>> {
        Some(self.writers.get(&shard)?.lock_async(shard).await)
    }

    /// Async tasks waiting for `shard`'s write lock now (0 if it is not
    /// hosted).
    pub fn waiting_for_lock(&self, shard: u32) -> usize {
        self.writers.get(&shard).map_or(0, |w| w.waiting())
    }

    /// The version of `shard`'s rows as of the last completed change
    /// (`None`: not hosted). Does not wait for the shard's write lock: a
    /// Push being applied now is not counted yet; who needs the version
    /// to agree with the rows holds the lock ([`ShardGuard::version`]).
    pub fn version(&self, shard: u32) -> Option<Version> {
        Some(self.writers.get(&shard)?.published())
    }
}
