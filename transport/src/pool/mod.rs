//! The registered-memory pool (the paper's bemalloc, §5.2).
//!
//! Network-bound buffers come from memory that is already registered with
//! the NIC. A [`Pool`] obtains large blocks (default 4 MiB) from the kernel,
//! registers each once through its [`RegistrationHook`], and carves it into
//! objects of one size class; allocations larger than the largest class get
//! a dedicated registered mapping, cached for reuse when freed. Once a pool
//! has grown to its working set, allocating and freeing register nothing.
//!
//! - **Thread caches**: allocation and free touch only the calling thread's
//!   cache; a free from another thread than the allocating one is the same
//!   cheap push (see `thread_cache`).
//! - **Lookup**: [`lookup`] finds the region (keys, access) of any address
//!   inside any pool allocation in O(1), without a lock (see `page_map`).
//! - **Isolation**: each pool has its own hook and [`Access`]; a send pool is
//!   local-only, a receive pool remotely writable, and no pool is global.
//! - **Accounting**: registered and in-use bytes and their peaks
//!   ([`PoolStats`], and `metrics` gauges `tessera_pool_registered_bytes`,
//!   `tessera_pool_peak_registered_bytes` and `tessera_pool_in_use_bytes`);
//!   a ceiling on registered bytes turns into an error, never an abort.
//! - **Buffers**: [`PoolBuf`] is an owned, writable buffer that returns to its
//!   pool when dropped on any thread; [`PoolBuf::freeze`] turns it into
//!   `bytes::Bytes` without a copy.
//!
//! Why written here rather than on rpmalloc: rpmalloc's map/unmap callbacks
//! would give registration, but its configuration is process-global (one
//! hook, one access right for the whole process) and `rpmalloc-sys` does not
//! bind them; the paper's requirement of several pools with different access
//! rights, and O(1) region lookup, are simpler to meet with size classes of
//! our own. `tessera-bench alloc` measures the result against the system
//! allocator, mimalloc and rpmalloc: on this project's 2-core machines the
//! pool does 1.0–1.3x rpmalloc's operations per second on both workloads
//! (7–16x the system allocator's) at 0.4–0.8x its peak memory, so there was
//! no speed to gain by binding rpmalloc.

mod buffer;
mod config;
mod core;
mod hook;
pub(crate) mod os;
mod page_map;
mod region;
mod size_class;
mod thread_cache;

use std::ptr::NonNull;
use std::sync::Arc;

pub use buffer::PoolBuf;
pub use config::PoolConfig;
pub use hook::{
    Access, CountingHook, RegisteredRegion, RegistrationCause, RegistrationError, RegistrationHook,
};
pub use page_map::GRANULE;
pub use region::RegionInfo;

/// Rails (devices) a pool registers its memory on at most.
pub const MAX_RAILS: usize = 8;
use tessera_config::{ConfigError, Validate};

/// Why an allocation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// Growing the pool would pass `max_registered_bytes`.
    #[error(
        "pool ceiling reached: {requested} more bytes would exceed {ceiling} registered bytes ({registered} registered)"
    )]
    CeilingExceeded {
        /// Bytes the pool needed to register.
        requested: u64,
        /// Bytes registered now.
        registered: u64,
        /// The ceiling.
        ceiling: u64,
    },
    /// The kernel refused memory.
    #[error("out of memory mapping {len} bytes")]
    OutOfMemory {
        /// Bytes asked for.
        len: usize,
    },
    /// The size cannot be represented.
    #[error("allocation of {len} bytes is too large")]
    TooLarge {
        /// Bytes asked for.
        len: usize,
    },
    /// The registration hook refused the memory.
    #[error(transparent)]
    Registration(#[from] RegistrationError),
}

/// A pool's memory accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolStats {
    /// Bytes registered now (blocks and dedicated mappings, cached or not).
    pub registered_bytes: u64,
    /// Most bytes ever registered at once.
    pub peak_registered_bytes: u64,
    /// Bytes of objects handed out and not yet freed (size-class rounded).
    /// Threads report their changes in batches, so this lags by at most a
    /// thread cache per thread; it is exact once threads have exited or
    /// called [`Pool::flush_thread_cache`].
    pub in_use_bytes: u64,
    /// Most bytes in use at once (as reported in batches).
    pub peak_in_use_bytes: u64,
    /// Registrations so far (blocks and dedicated mappings).
    pub registrations: u64,
}

/// A pool of registered memory. Cheap to clone; clones share the pool.
///
/// Buffers refer to their pool's shared state without reference counting
/// (a shared counter touched by every allocation and free on every thread
/// costs more than the rest of the allocation path): that state — a few
/// kilobytes of lists — lives for the rest of the process. The memory does
/// not: when the last handle is dropped the pool releases every block with
/// no object in use, and the rest as buffers come back.
#[derive(Debug, Clone)]
pub struct Pool {
    handle: Arc<PoolHandle>,
}

#[derive(Debug)]
struct PoolHandle {
    inner: &'static core::PoolInner,
}

impl Drop for PoolHandle {
    fn drop(&mut self) {
        thread_cache::flush(self.inner);
        self.inner.close();
    }
}

impl Pool {
    /// A pool whose memory `hook` registers with `access`.
    pub fn new(
        config: PoolConfig,
        access: Access,
        hook: Arc<dyn RegistrationHook>,
    ) -> Result<Self, ConfigError> {
        Self::on_rails(config, access, vec![hook])
    }

    /// A pool whose memory each of `hooks` registers with `access`: one per
    /// rail (device) a buffer may cross, the first the primary. A buffer's
    /// keys for rail `r` are [`lookup_on`]'s and [`PoolBuf::region_on`]'s.
    /// At least one hook, at most [`MAX_RAILS`].
    pub fn on_rails(
        config: PoolConfig,
        access: Access,
        hooks: Vec<Arc<dyn RegistrationHook>>,
    ) -> Result<Self, ConfigError> {
        config.validate()?;
        if hooks.is_empty() || hooks.len() > MAX_RAILS {
            return Err(ConfigError::Invalid {
                key: "rdma.devices".into(),
                reason: format!(
                    "{} devices: a pool registers on 1 to {MAX_RAILS}",
                    hooks.len()
                ),
            });
        }
        let inner: &'static core::PoolInner =
            Box::leak(Box::new(core::PoolInner::new(config, access, hooks)));
        Ok(Self {
            handle: Arc::new(PoolHandle { inner }),
        })
    }

    fn inner(&self) -> &'static core::PoolInner {
        self.handle.inner
    }

    /// The pool's id (unique in the process).
    pub fn id(&self) -> u64 {
        self.inner().id()
    }

    /// The pool's configuration.
    pub fn config(&self) -> &PoolConfig {
        &self.inner().config
    }

    /// A buffer of `len` bytes (its contents are whatever the memory held).
    #[inline]
    pub fn alloc(&self, len: usize) -> Result<PoolBuf, PoolError> {
        let inner = self.inner();
        if len > inner.config.max_class_size {
            return inner.alloc_dedicated(len);
        }
        let class = size_class::class_of(len);
        let address = thread_cache::alloc(inner, class)?;
        let ptr = NonNull::new(address as *mut u8).ok_or(PoolError::OutOfMemory { len })?;
        Ok(PoolBuf::new(
            ptr,
            len,
            size_class::class_size(class),
            class,
            None,
            inner,
        ))
    }

    /// A buffer holding a copy of `data`.
    pub fn alloc_copy(&self, data: &[u8]) -> Result<PoolBuf, PoolError> {
        let mut buf = self.alloc(data.len())?;
        buf.copy_from_slice(data);
        Ok(buf)
    }

    /// The pool's accounting.
    pub fn stats(&self) -> PoolStats {
        self.inner().stats()
    }

    /// Returns the calling thread's cached objects and pending accounting to
    /// the pool (threads do this on exit by themselves).
    pub fn flush_thread_cache(&self) {
        thread_cache::flush(self.inner());
    }

    /// Releases (deregisters and unmaps) every block with no object in use
    /// and every cached dedicated mapping; returns the bytes released.
    /// Objects held in threads' caches keep their blocks.
    pub fn trim(&self) -> u64 {
        self.inner().trim()
    }
}

/// The registered region holding `bytes`, if they lie in a pool's memory,
/// with the primary rail's keys ([`lookup_on`] for another rail's).
/// O(1) and lock-free. It takes the bytes, not an address: a borrowed
/// slice of pool memory proves an allocation is alive there, which keeps
/// its region alive while it is read (an arbitrary address, as before,
/// could name a region being freed at that moment).
pub fn lookup(bytes: &[u8]) -> Option<RegionInfo> {
    lookup_address(bytes.as_ptr() as usize, 0)
}

/// [`lookup`] for rail `rail`: the keys the region was registered with on
/// that rail's device; `None` outside every pool, or past its rails.
pub fn lookup_on(bytes: &[u8], rail: usize) -> Option<RegionInfo> {
    lookup_address(bytes.as_ptr() as usize, rail)
}

/// [`lookup`] by address, for the crate's buffers, whose address is inside
/// an allocation they own (the condition the read below relies on).
pub(crate) fn lookup_address(address: usize, rail: usize) -> Option<RegionInfo> {
    let region = page_map::get(address)?;
    // SAFETY: the page map holds pointers to regions that are mapped; a
    // region is unmapped from it before it is freed, and the callers pass
    // an address inside an allocation they hold, which keeps its region
    // alive.
    unsafe { &*region }.info_on(rail)
}

#[cfg(test)]
mod tests;
