//! Per-thread caches of free objects, one set per pool a thread uses.
//!
//! An allocation pops from the calling thread's cache and a free pushes to
//! the freeing thread's cache, whichever thread allocated the object: free
//! lists hold plain addresses (nothing is written into free objects), so an
//! object can move between threads with no ownership hand-off. Only a cache
//! that runs empty or overflows takes its class's lock, once per batch.
//! A thread's caches go back to their pools when the thread exits.

use std::cell::RefCell;

use super::PoolError;
use super::core::PoolInner;
use super::size_class::class_size;

struct Entry {
    pool_id: u64,
    pool: &'static PoolInner,
    classes: Vec<Vec<usize>>,
    /// Bytes allocated minus freed by this thread since the last flush.
    in_use_delta: i64,
}

impl Entry {
    fn flush(&mut self, pool: &PoolInner) {
        for (class, objects) in self.classes.iter_mut().enumerate() {
            if !objects.is_empty() {
                pool.give_back(class, objects.drain(..));
            }
        }
        pool.account_in_use(std::mem::take(&mut self.in_use_delta));
        if pool.is_closed() {
            // The pool's handles are gone: let whole free blocks go.
            pool.trim();
        }
    }
}

#[derive(Default)]
struct ThreadCaches {
    entries: Vec<Entry>,
}

impl ThreadCaches {
    fn entry(&mut self, pool: &'static PoolInner) -> &mut Entry {
        let id = pool.id();
        if let Some(index) = self.entries.iter().position(|e| e.pool_id == id) {
            return &mut self.entries[index];
        }
        self.entries.push(Entry {
            pool_id: id,
            pool,
            classes: vec![Vec::new(); pool.class_count()],
            in_use_delta: 0,
        });
        let last = self.entries.len() - 1;
        &mut self.entries[last]
    }
}

impl Drop for ThreadCaches {
    fn drop(&mut self) {
        for entry in &mut self.entries {
            let pool = entry.pool;
            entry.flush(pool);
        }
    }
}

thread_local! {
    static CACHES: RefCell<ThreadCaches> = RefCell::default();
}

/// Takes an object of `class` for the calling thread.
#[inline]
pub(crate) fn alloc(pool: &'static PoolInner, class: usize) -> Result<usize, PoolError> {
    let size = class_size(class) as i64;
    let cached = CACHES.try_with(|caches| {
        let Ok(mut caches) = caches.try_borrow_mut() else {
            return None;
        };
        let entry = caches.entry(pool);
        let objects = &mut entry.classes[class];
        if objects.is_empty() {
            let batch = pool.thread_cache_limit(class).div_ceil(2);
            if let Err(err) = pool.take_batch(class, batch, objects) {
                return Some(Err(err));
            }
            pool.account_in_use(std::mem::take(&mut entry.in_use_delta));
        }
        let object = entry.classes[class].pop()?;
        entry.in_use_delta += size;
        Some(Ok(object))
    });
    match cached {
        Ok(Some(result)) => result,
        // No usable cache (thread exiting, or re-entered): go to the pool.
        _ => {
            let mut one = Vec::with_capacity(1);
            pool.take_batch(class, 1, &mut one)?;
            pool.account_in_use(size);
            one.pop()
                .ok_or(PoolError::OutOfMemory { len: size as usize })
        }
    }
}

/// Returns an object of `class` from the calling thread.
#[inline]
pub(crate) fn free(pool: &'static PoolInner, class: usize, object: usize) {
    let size = class_size(class) as i64;
    if pool.is_closed() {
        // The pool's handles are gone: give memory straight back so that
        // its blocks can be released.
        pool.give_back(class, std::iter::once(object));
        pool.account_in_use(-size);
        pool.trim_class(class);
        return;
    }
    let cached = CACHES.try_with(|caches| {
        let Ok(mut caches) = caches.try_borrow_mut() else {
            return false;
        };
        let limit = pool.thread_cache_limit(class);
        let entry = caches.entry(pool);
        entry.in_use_delta -= size;
        let objects = &mut entry.classes[class];
        objects.push(object);
        if objects.len() > limit {
            let keep = limit / 2;
            pool.give_back(class, objects.drain(keep..));
            pool.account_in_use(std::mem::take(&mut entry.in_use_delta));
        }
        true
    });
    if cached != Ok(true) {
        pool.give_back(class, std::iter::once(object));
        pool.account_in_use(-size);
    }
}

/// Returns the calling thread's cached objects of `pool` and its pending
/// accounting to the pool.
pub(crate) fn flush(pool: &'static PoolInner) {
    let _ = CACHES.try_with(|caches| {
        if let Ok(mut caches) = caches.try_borrow_mut() {
            let id = pool.id();
            if let Some(index) = caches.entries.iter().position(|e| e.pool_id == id) {
                caches.entries[index].flush(pool);
                // A closed pool's entry is not needed again.
                if pool.is_closed() {
                    caches.entries.swap_remove(index);
                }
            }
        }
    });
}
