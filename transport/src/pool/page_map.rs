//! A process-wide, lock-free map from any address to the registered region
//! that contains it.
//!
//! Regions (pool blocks and dedicated mappings) are aligned to, and a whole
//! number of, [`GRANULE`]s. The map has one slot per granule of the 48-bit
//! address space, in two levels of 2^14 entries: the top level is a fixed
//! array, leaves are allocated on first use and never freed. A lookup is
//! two atomic loads and no lock; inserting a region stores one pointer per
//! granule it covers.
//!
//! brpc's block pool scans its regions linearly and async-rdma takes a
//! global mutex over a BTreeMap; a page map is what every allocator that
//! must find metadata from a pointer uses instead (tcmalloc's pagemap,
//! mimalloc's segment map).

use std::sync::atomic::{AtomicPtr, Ordering};

use super::region::Region;

/// Granularity of the map: 1 MiB.
pub const GRANULE_SHIFT: u32 = 20;
/// Bytes per granule.
pub const GRANULE: usize = 1 << GRANULE_SHIFT;

const ADDRESS_BITS: u32 = 48;
const LEAF_BITS: u32 = 14;
const TOP_BITS: u32 = ADDRESS_BITS - GRANULE_SHIFT - LEAF_BITS;
const LEAF_LEN: usize = 1 << LEAF_BITS;
const TOP_LEN: usize = 1 << TOP_BITS;

type Leaf = [AtomicPtr<Region>; LEAF_LEN];

static TOP: [AtomicPtr<Leaf>; TOP_LEN] = [const { AtomicPtr::new(std::ptr::null_mut()) }; TOP_LEN];

fn split(addr: usize) -> Option<(usize, usize)> {
    if addr >> ADDRESS_BITS != 0 {
        return None;
    }
    let granule = addr >> GRANULE_SHIFT;
    Some((granule >> LEAF_BITS, granule & (LEAF_LEN - 1)))
}

fn leaf(top: usize, create: bool) -> Option<&'static Leaf> {
    let slot = &TOP[top];
    let mut ptr = slot.load(Ordering::Acquire);
    if ptr.is_null() {
        if !create {
            return None;
        }
        let fresh: Box<Leaf> = Box::new([const { AtomicPtr::new(std::ptr::null_mut()) }; LEAF_LEN]);
        let fresh = Box::into_raw(fresh);
        match slot.compare_exchange(
            std::ptr::null_mut(),
            fresh,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => ptr = fresh,
            Err(existing) => {
                // SAFETY: `fresh` came from Box::into_raw above and lost the
                // race, so no one else has seen it.
                drop(unsafe { Box::from_raw(fresh) });
                ptr = existing;
            }
        }
    }
    // SAFETY: leaves are installed once and never freed, so a non-null
    // pointer stays valid for the life of the process.
    Some(unsafe { &*ptr })
}

/// Maps every granule of `[base, base + len)` to `region`.
///
/// `base` and `len` must be granule-aligned and the range must not be
/// mapped already.
pub(crate) fn insert(base: usize, len: usize, region: *const Region) {
    debug_assert!(base.is_multiple_of(GRANULE) && len.is_multiple_of(GRANULE));
    let mut addr = base;
    while addr < base + len {
        if let Some((top, index)) = split(addr)
            && let Some(leaf) = leaf(top, true)
        {
            leaf[index].store(region.cast_mut(), Ordering::Release);
        }
        addr += GRANULE;
    }
}

/// Unmaps every granule of `[base, base + len)`.
pub(crate) fn remove(base: usize, len: usize) {
    let mut addr = base;
    while addr < base + len {
        if let Some((top, index)) = split(addr)
            && let Some(leaf) = leaf(top, false)
        {
            leaf[index].store(std::ptr::null_mut(), Ordering::Release);
        }
        addr += GRANULE;
    }
}

/// The region containing `addr`, if it is pool memory.
///
/// The pointer stays valid while the region's memory is in use: a caller
/// looking up an address inside a live buffer keeps that region alive.
pub(crate) fn get(addr: usize) -> Option<*const Region> {
    let (top, index) = split(addr)?;
    let ptr = leaf(top, false)?[index].load(Ordering::Acquire);
    (!ptr.is_null()).then_some(ptr.cast_const())
}
