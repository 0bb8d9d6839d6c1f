//! The owned, writable pool buffer.

use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use bytes::Bytes;

use super::core::PoolInner;
use super::region::{Region, RegionInfo};

/// A writable buffer of pool memory. Returns to its pool when dropped, on
/// whatever thread drops it.
///
/// Its bytes are always initialised (blocks are zeroed when obtained from
/// the OS and never de-initialised), so a fresh buffer may hold data of a
/// previous user: write before you read.
pub struct PoolBuf {
    ptr: NonNull<u8>,
    len: usize,
    capacity: usize,
    class: usize,
    dedicated: Option<Box<Region>>,
    pool: &'static PoolInner,
}

// SAFETY: a PoolBuf exclusively owns its memory (no other PoolBuf or cache
// refers to it while it lives), so moving it to, or sharing `&PoolBuf`
// with, another thread is as safe as for a Box<[u8]>.
unsafe impl Send for PoolBuf {}
// SAFETY: see above; `&PoolBuf` only gives shared read access.
unsafe impl Sync for PoolBuf {}

impl PoolBuf {
    pub(crate) fn new(
        ptr: NonNull<u8>,
        len: usize,
        capacity: usize,
        class: usize,
        dedicated: Option<Box<Region>>,
        pool: &'static PoolInner,
    ) -> Self {
        Self {
            ptr,
            len,
            capacity,
            class,
            dedicated,
            pool,
        }
    }

    /// Bytes the buffer can hold (its size class, at least the requested length).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Sets the length, up to the capacity. The bytes between the old and the
    /// new length keep whatever they held.
    pub fn set_len(&mut self, len: usize) {
        self.len = len.min(self.capacity);
    }

    /// The 8 bytes at `offset` (8-aligned within the buffer) read as one
    /// atomic word: for memory a NIC writes into while the buffer is held
    /// (a keepalive slot). `None` if out of bounds or misaligned.
    pub fn load_u64(&self, offset: usize) -> Option<u64> {
        let end = offset.checked_add(8)?;
        let addr = self.ptr.as_ptr() as usize + offset;
        if end > self.len || !addr.is_multiple_of(8) {
            return None;
        }
        // SAFETY: in bounds and 8-aligned (checked); the buffer is live
        // pool memory. A peer's NIC may store to it concurrently, which an
        // atomic load tolerates (it sees the old or the new word).
        let word = unsafe { std::sync::atomic::AtomicU64::from_ptr(addr as *mut u64) };
        Some(word.load(std::sync::atomic::Ordering::Acquire))
    }

    /// The registered region the buffer lies in (keys, access rights), with
    /// the primary rail's keys ([`PoolBuf::region_on`] for another rail's).
    /// Always `Some` for a live buffer; an `Option` only because the lookup
    /// goes through the process-wide map.
    pub fn region(&self) -> Option<RegionInfo> {
        self.region_on(0)
    }

    /// The buffer's region as rail `rail` registered it (`None` past the
    /// pool's rails).
    pub fn region_on(&self, rail: usize) -> Option<RegionInfo> {
        match &self.dedicated {
            Some(region) => region.info_on(rail),
            None => super::lookup_address(self.ptr.as_ptr() as usize, rail),
        }
    }

    /// The id of the pool the buffer came from.
    pub fn pool_id(&self) -> u64 {
        self.pool.id()
    }

    /// Turns the buffer into `Bytes` without copying; the memory returns to
    /// the pool when the last clone or slice of the `Bytes` is dropped.
    pub fn freeze(self) -> Bytes {
        Bytes::from_owner(self)
    }
}

impl Deref for PoolBuf {
    type Target = [u8];

    #[inline]
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` points to `capacity >= len` bytes of pool memory that
        // this buffer owns exclusively and that are initialised (see the
        // type's docs); a block with a live object is never released, so the
        // memory outlives `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for PoolBuf {
    #[inline]
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl AsRef<[u8]> for PoolBuf {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl AsMut<[u8]> for PoolBuf {
    fn as_mut(&mut self) -> &mut [u8] {
        self
    }
}

impl std::fmt::Debug for PoolBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolBuf")
            .field("len", &self.len)
            .field("capacity", &self.capacity)
            .field("pool", &self.pool.id())
            .finish()
    }
}

impl Drop for PoolBuf {
    #[inline]
    fn drop(&mut self) {
        match self.dedicated.take() {
            Some(region) => self.pool.free_dedicated(region),
            None => super::thread_cache::free(self.pool, self.class, self.ptr.as_ptr() as usize),
        }
    }
}
