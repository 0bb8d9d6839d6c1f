//! The shared state of a pool: per-class free lists and blocks, dedicated
//! mappings, accounting.

use crate::sync::lock;
use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::config::PoolConfig;
use super::hook::{
    Access, RegisteredRegion, RegistrationCause, RegistrationError, RegistrationHook,
};
use super::os;
use super::page_map::{self, GRANULE};
use super::region::Region;
use super::size_class::{class_count, class_size};
use super::{PoolError, PoolStats};

static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);

// Regions are boxed because the page map points at them: their address must
// not change when the vectors holding them grow.
#[allow(clippy::vec_box)]
#[derive(Debug, Default)]
struct ClassLists {
    free: Vec<usize>,
    blocks: Vec<Box<Region>>,
    /// Not yet handed-out part of the newest block: objects are carved from
    /// `next` up to `end` on demand, so a fresh block costs no list entries
    /// (a 4 MiB block of 16-byte objects would otherwise need 262,144).
    next: usize,
    end: usize,
}

#[allow(clippy::vec_box)]
#[derive(Debug, Default)]
struct DedicatedCache {
    by_len: HashMap<usize, Vec<Box<Region>>>,
    bytes: u64,
}

/// The state shared by a pool's handles and buffers.
pub(crate) struct PoolInner {
    id: u64,
    pub(crate) config: PoolConfig,
    access: Access,
    /// One hook per rail (device), the first the primary: every region is
    /// registered with each ([`Region::keys`]). Emptied once the pool is
    /// closed and its last region released: this state outlives the pool
    /// (it is leaked), and a hook holds its device (for the soft NIC its
    /// shared memory, for ibverbs its context and protection domain), so
    /// before, every pool ever made kept its devices open for the rest of
    /// the process (found by `rdma/io/worker/model.rs`, whose thousands of
    /// runs ran out of mappings). Locked only to register or deregister a
    /// region (a block's worth of allocations), never per allocation.
    hooks: Mutex<Vec<Arc<dyn RegistrationHook>>>,
    classes: Vec<Mutex<ClassLists>>,
    dedicated: Mutex<DedicatedCache>,
    registered: AtomicU64,
    peak_registered: AtomicU64,
    registrations: AtomicU64,
    in_use: AtomicI64,
    peak_in_use: AtomicI64,
    /// Objects a thread keeps per class before giving half back.
    cache_limits: Vec<usize>,
    closed: AtomicBool,
    registered_gauge: metrics::Gauge,
    peak_registered_gauge: metrics::Gauge,
    in_use_gauge: metrics::Gauge,
    registrations_counter: metrics::Counter,
}

impl std::fmt::Debug for PoolInner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolInner")
            .field("id", &self.id)
            .field("name", &self.config.name)
            .field("access", &self.access)
            .finish()
    }
}

impl PoolInner {
    /// `hooks` must not be empty ([`super::Pool::on_rails`] checks).
    pub(crate) fn new(
        config: PoolConfig,
        access: Access,
        hooks: Vec<Arc<dyn RegistrationHook>>,
    ) -> Self {
        let count = class_count(config.max_class_size);
        let classes = (0..count)
            .map(|_| Mutex::new(ClassLists::default()))
            .collect();
        let cache_limits = (0..count)
            .map(|class| (config.thread_cache_bytes / class_size(class)).clamp(4, 1024))
            .collect();
        let name = config.name.clone();
        Self {
            id: NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed),
            config,
            access,
            hooks: Mutex::new(hooks),
            classes,
            dedicated: Mutex::new(DedicatedCache::default()),
            registered: AtomicU64::new(0),
            peak_registered: AtomicU64::new(0),
            registrations: AtomicU64::new(0),
            in_use: AtomicI64::new(0),
            peak_in_use: AtomicI64::new(0),
            cache_limits,
            closed: AtomicBool::new(false),
            registered_gauge: metrics::gauge!("tessera_pool_registered_bytes", "pool" => name.clone()),
            peak_registered_gauge: metrics::gauge!("tessera_pool_peak_registered_bytes", "pool" => name.clone()),
            in_use_gauge: metrics::gauge!("tessera_pool_in_use_bytes", "pool" => name.clone()),
            registrations_counter: metrics::counter!("tessera_pool_registrations_total", "pool" => name),
        }
    }

    /// Whether every handle of the pool is gone.
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Relaxed)
    }

    /// Called when the last handle goes: from now on freed memory goes
    /// straight back to the OS as soon as whole blocks are free.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
        self.trim();
        self.drop_hooks_if_done();
    }

    /// The hooks, cloned (not held locked while a provider registers).
    fn hooks(&self) -> Vec<Arc<dyn RegistrationHook>> {
        lock(&self.hooks).clone()
    }

    /// A closed pool with nothing registered any more lets go of its hooks
    /// (and their devices): no handle is left to allocate with, so none
    /// registers again.
    fn drop_hooks_if_done(&self) {
        if self.is_closed() && self.registered.load(Ordering::Acquire) == 0 {
            lock(&self.hooks).clear();
        }
    }

    /// Hooks held now (0 once a closed pool let go of them).
    #[cfg(test)]
    pub(crate) fn hook_count(&self) -> usize {
        lock(&self.hooks).len()
    }

    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    pub(crate) fn class_count(&self) -> usize {
        self.classes.len()
    }

    /// Objects of `class` a thread keeps before giving some back.
    pub(crate) fn thread_cache_limit(&self, class: usize) -> usize {
        self.cache_limits[class]
    }

    /// Adds a thread's accumulated change of bytes in use.
    pub(crate) fn account_in_use(&self, delta: i64) {
        if delta == 0 {
            return;
        }
        let now = self.in_use.fetch_add(delta, Ordering::Relaxed) + delta;
        self.peak_in_use.fetch_max(now, Ordering::Relaxed);
        self.in_use_gauge.set(now as f64);
    }

    /// Reserves `len` registered bytes under the ceiling, evicting cached
    /// dedicated mappings if that makes room.
    fn reserve(&self, len: usize) -> Result<(), PoolError> {
        let len = len as u64;
        let ceiling = self.config.max_registered_bytes;
        for attempt in 0..2 {
            let before = self.registered.fetch_add(len, Ordering::AcqRel);
            if before + len <= ceiling {
                let now = before + len;
                let peak = self
                    .peak_registered
                    .fetch_max(now, Ordering::Relaxed)
                    .max(now);
                self.peak_registered_gauge.set(peak as f64);
                self.registered_gauge.set(now as f64);
                return Ok(());
            }
            self.registered.fetch_sub(len, Ordering::AcqRel);
            if attempt == 0 {
                self.drain_dedicated_cache();
            }
        }
        Err(PoolError::CeilingExceeded {
            requested: len,
            registered: self.registered.load(Ordering::Relaxed),
            ceiling,
        })
    }

    /// Obtains `len` zeroed bytes aligned to `align` from the OS, registers
    /// them and maps them in the page map.
    fn acquire(&self, len: usize, align: usize) -> Result<Box<Region>, PoolError> {
        self.reserve(len)?;
        let shares = self.hooks().iter().any(|hook| hook.shares_memory());
        let (memory, shared) = if shares {
            match os::map_shared_aligned(len, align) {
                Some((memory, fd)) => (Some(memory), Some(fd)),
                None => (None, None),
            }
        } else {
            (os::map_aligned(len, align), None)
        };
        let Some(memory) = memory else {
            self.registered.fetch_sub(len as u64, Ordering::AcqRel);
            return Err(PoolError::OutOfMemory { len });
        };
        let base = memory.as_ptr() as usize;
        let keys = match self.register_on_rails(base, len, shared) {
            Ok(keys) => keys,
            Err(err) => {
                os::unmap(base, len);
                self.registered.fetch_sub(len as u64, Ordering::AcqRel);
                return Err(err);
            }
        };
        self.registrations.fetch_add(1, Ordering::Relaxed);
        self.registrations_counter.increment(1);
        let region = Box::new(Region {
            base,
            len,
            keys,
            access: self.access,
            pool_id: self.id,
        });
        page_map::insert(base, len, &*region);
        Ok(region)
    }

    /// Registers `len` bytes at `base` with every rail's hook, in rail
    /// order; `shared` (the memfd behind a shared mapping) goes to each hook
    /// as a descriptor of its own. If one refuses, those before it are
    /// deregistered again and its error returned.
    fn register_on_rails(
        &self,
        base: usize,
        len: usize,
        shared: Option<std::os::fd::OwnedFd>,
    ) -> Result<Vec<RegisteredRegion>, PoolError> {
        let hooks = self.hooks();
        let mut keys = Vec::with_capacity(hooks.len());
        let mut shared = shared;
        for (rail, hook) in hooks.iter().enumerate() {
            let last = rail + 1 == hooks.len();
            let registered = match shared.take() {
                Some(fd) if last => hook.register_shared(base, len, self.access, fd),
                Some(fd) => match fd.try_clone() {
                    Ok(copy) => {
                        shared = Some(fd);
                        hook.register_shared(base, len, self.access, copy)
                    }
                    Err(err) => Err(RegistrationError {
                        len,
                        cause: RegistrationCause::Descriptor {
                            errno: err.raw_os_error().unwrap_or(0),
                        },
                    }),
                },
                None => hook.register(base, len, self.access),
            };
            match registered {
                Ok(region) => keys.push(region),
                Err(err) => {
                    for (hook, keys) in hooks.iter().zip(&keys) {
                        hook.deregister(base, len, keys);
                    }
                    return Err(PoolError::Registration(err));
                }
            }
        }
        Ok(keys)
    }

    /// Unmaps, deregisters and frees a region.
    #[allow(clippy::boxed_local)] // the box is what the page map pointed at
    fn release(&self, region: Box<Region>) {
        page_map::remove(region.base, region.len);
        for (hook, keys) in self.hooks().iter().zip(&region.keys) {
            hook.deregister(region.base, region.len, keys);
        }
        // No buffer refers to the region any more: blocks are released only
        // when all their objects are free, dedicated regions only when their
        // buffer is gone.
        os::unmap(region.base, region.len);
        let now = self
            .registered
            .fetch_sub(region.len as u64, Ordering::AcqRel)
            - region.len as u64;
        self.registered_gauge.set(now as f64);
        self.drop_hooks_if_done();
    }

    /// Moves up to `count` free objects of `class` into `out`, growing the
    /// pool by one block if none is free.
    pub(crate) fn take_batch(
        &self,
        class: usize,
        count: usize,
        out: &mut Vec<usize>,
    ) -> Result<(), PoolError> {
        let size = class_size(class);
        let mut lists = lock(&self.classes[class]);
        let keep = lists.free.len().saturating_sub(count);
        out.extend(lists.free.drain(keep..));
        let mut missing = count.saturating_sub(out.len());
        while missing > 0 {
            if lists.next + size > lists.end {
                if !out.is_empty() {
                    break;
                }
                let block_size = self.config.block_size;
                let region = self.acquire(block_size, block_size)?;
                lists.next = region.base;
                lists.end = region.base + block_size - block_size % size;
                lists.blocks.push(region);
            }
            let available = (lists.end - lists.next) / size;
            let take = missing.min(available);
            let start = lists.next;
            out.extend((0..take).map(|i| start + i * size));
            lists.next += take * size;
            missing -= take;
        }
        Ok(())
    }

    /// Returns objects of `class` to the shared list.
    pub(crate) fn give_back(&self, class: usize, objects: impl Iterator<Item = usize>) {
        lock(&self.classes[class]).free.extend(objects);
    }

    /// Allocates a dedicated mapping of at least `len` bytes (rounded up to
    /// the granule), reusing a cached one of the same size if there is one.
    pub(crate) fn alloc_dedicated(&'static self, len: usize) -> Result<super::PoolBuf, PoolError> {
        let rounded = len
            .checked_next_multiple_of(GRANULE)
            .ok_or(PoolError::TooLarge { len })?;
        let cached = {
            let mut cache = lock(&self.dedicated);
            let region = cache.by_len.get_mut(&rounded).and_then(Vec::pop);
            if region.is_some() {
                cache.bytes -= rounded as u64;
            }
            region
        };
        let region = match cached {
            Some(region) => region,
            None => self.acquire(rounded, GRANULE)?,
        };
        self.account_in_use(rounded as i64);
        let ptr = NonNull::new(region.base as *mut u8).ok_or(PoolError::OutOfMemory { len })?;
        Ok(super::PoolBuf::new(
            ptr,
            len,
            rounded,
            usize::MAX,
            Some(region),
            self,
        ))
    }

    /// Takes back a dedicated mapping: cached for reuse, or released when the
    /// cache is full.
    pub(crate) fn free_dedicated(&self, region: Box<Region>) {
        let len = region.len;
        self.account_in_use(-(len as i64));
        let mut cache = lock(&self.dedicated);
        if !self.is_closed() && cache.bytes + len as u64 <= self.config.dedicated_cache_bytes {
            cache.bytes += len as u64;
            cache.by_len.entry(len).or_default().push(region);
        } else {
            drop(cache);
            self.release(region);
        }
    }

    fn drain_dedicated_cache(&self) {
        let regions: Vec<Box<Region>> = {
            let mut cache = lock(&self.dedicated);
            cache.bytes = 0;
            cache.by_len.drain().flat_map(|(_, v)| v).collect()
        };
        for region in regions {
            self.release(region);
        }
    }

    /// Releases every block whose objects are all free in the shared lists,
    /// and every cached dedicated mapping. Returns the bytes released.
    pub(crate) fn trim(&self) -> u64 {
        let before = self.registered.load(Ordering::Acquire);
        self.drain_dedicated_cache();
        for class in 0..self.classes.len() {
            self.trim_class(class);
        }
        before.saturating_sub(self.registered.load(Ordering::Acquire))
    }

    /// Releases the blocks of `class` whose objects are all free in the
    /// shared list.
    pub(crate) fn trim_class(&self, class: usize) {
        let block_size = self.config.block_size;
        {
            let mut lists = lock(&self.classes[class]);
            if lists.blocks.is_empty() {
                return;
            }
            let size = class_size(class);
            let per_block = block_size / size;
            let mut free_per_block: HashMap<usize, usize> = HashMap::new();
            // The uncarved rest of the newest block is free too.
            if lists.next < lists.end {
                let bump_block = lists.next & !(block_size - 1);
                *free_per_block.entry(bump_block).or_default() += (lists.end - lists.next) / size;
            }
            for &object in &lists.free {
                *free_per_block
                    .entry(object & !(block_size - 1))
                    .or_default() += 1;
            }
            let empty: Vec<usize> = free_per_block
                .into_iter()
                .filter(|&(_, free)| free == per_block)
                .map(|(base, _)| base)
                .collect();
            if empty.is_empty() {
                return;
            }
            lists
                .free
                .retain(|object| !empty.contains(&(object & !(block_size - 1))));
            let (released, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut lists.blocks)
                .into_iter()
                .partition(|r| empty.contains(&r.base));
            lists.blocks = kept;
            if lists.end > 0 && empty.contains(&((lists.end - 1) & !(block_size - 1))) {
                lists.next = 0;
                lists.end = 0;
            }
            drop(lists);
            for region in released {
                self.release(region);
            }
        }
    }

    pub(crate) fn stats(&self) -> PoolStats {
        PoolStats {
            registered_bytes: self.registered.load(Ordering::Relaxed),
            peak_registered_bytes: self.peak_registered.load(Ordering::Relaxed),
            in_use_bytes: self.in_use.load(Ordering::Relaxed).max(0) as u64,
            peak_in_use_bytes: self.peak_in_use.load(Ordering::Relaxed).max(0) as u64,
            registrations: self.registrations.load(Ordering::Relaxed),
        }
    }
}
