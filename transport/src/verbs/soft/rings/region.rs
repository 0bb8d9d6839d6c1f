//! The device's table of registered regions, with the event counters peers
//! update.

#[allow(clippy::wildcard_imports)]
use super::*;

/// A registered memory region as the soft NIC sees it (addresses in the
/// owner's address space).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MemoryRegion {
    pub(crate) addr: usize,
    pub(crate) len: usize,
    pub(crate) access: Access,
}

impl MemoryRegion {
    pub(crate) fn contains(&self, addr: usize, len: usize) -> bool {
        addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.addr + self.len)
    }
}

#[repr(C)]
pub(super) struct DeviceHeader {
    pub(super) magic: AtomicU64,
    pub(super) capacity: AtomicU64,
    pub(super) dead: AtomicU64,
    pub(super) rnr_events: AtomicU64,
    pub(super) remote_access_errors: AtomicU64,
    pub(super) _reserved: [AtomicU64; 3],
}

#[repr(C)]
pub(super) struct RegionSlot {
    pub(super) key: AtomicU32,
    pub(super) access: AtomicU32,
    pub(super) base: AtomicU64,
    pub(super) len: AtomicU64,
    pub(super) _reserved: AtomicU64,
}

/// A device's registered regions and the counters its peers update.
#[derive(Debug)]
pub(crate) struct RegionTable {
    pub(super) segment: Segment,
    pub(super) capacity: usize,
}

impl RegionTable {
    const HEADER: usize = size_of::<DeviceHeader>();

    pub(crate) fn create() -> io::Result<Self> {
        let segment = Segment::create(
            "tessera-soft-device",
            TABLE_MAGIC,
            Self::HEADER,
            size_of::<RegionSlot>(),
            REGION_SLOTS,
        )?;
        Ok(Self {
            segment,
            capacity: REGION_SLOTS,
        })
    }

    pub(crate) fn open(fd: OwnedFd) -> io::Result<Self> {
        let (segment, capacity) =
            Segment::open(fd, TABLE_MAGIC, Self::HEADER, size_of::<RegionSlot>())?;
        Ok(Self { segment, capacity })
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.segment.map.fd()
    }

    fn header(&self) -> &DeviceHeader {
        self.segment.at(0)
    }

    fn slot(&self, index: usize) -> &RegionSlot {
        self.segment
            .at(Self::HEADER + index * size_of::<RegionSlot>())
    }

    /// The key for `slot` in its `generation` (never 0).
    pub(crate) fn key(slot: usize, generation: u32) -> u32 {
        (generation << SLOT_BITS) | slot as u32
    }

    /// Makes `region` visible under `key`.
    pub(crate) fn publish(&self, key: u32, region: MemoryRegion) {
        let slot = self.slot((key & ((1 << SLOT_BITS) - 1)) as usize);
        slot.base.store(region.addr as u64, Ordering::Relaxed);
        slot.len.store(region.len as u64, Ordering::Relaxed);
        slot.access.store(
            u32::from(region.access == Access::RemoteWrite),
            Ordering::Relaxed,
        );
        slot.key.store(key, Ordering::Release);
    }

    /// Withdraws `key`.
    pub(crate) fn retire(&self, key: u32) {
        let slot = self.slot((key & ((1 << SLOT_BITS) - 1)) as usize);
        let _ = slot
            .key
            .compare_exchange(key, 0, Ordering::AcqRel, Ordering::Relaxed);
    }

    /// The region `key` names, if it is registered.
    pub(crate) fn lookup(&self, key: u32) -> Option<MemoryRegion> {
        let index = (key & ((1 << SLOT_BITS) - 1)) as usize;
        if key == 0 || index >= self.capacity {
            return None;
        }
        let slot = self.slot(index);
        if slot.key.load(Ordering::Acquire) != key {
            return None;
        }
        let region = MemoryRegion {
            addr: usize::try_from(slot.base.load(Ordering::Relaxed)).ok()?,
            len: usize::try_from(slot.len.load(Ordering::Relaxed)).ok()?,
            access: if slot.access.load(Ordering::Relaxed) == 1 {
                Access::RemoteWrite
            } else {
                Access::LocalOnly
            },
        };
        // Fields are published before the key and never change under one
        // key: a key still in place means they were read whole.
        (slot.key.load(Ordering::Acquire) == key).then_some(region)
    }

    pub(crate) fn is_dead(&self) -> bool {
        self.header().dead.load(Ordering::Acquire) != 0
    }

    pub(crate) fn mark_dead(&self) {
        self.header().dead.store(1, Ordering::Release);
    }

    pub(crate) fn count_rnr(&self) {
        self.header().rnr_events.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn count_remote_access_error(&self) {
        self.header()
            .remote_access_errors
            .fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn rnr_events(&self) -> u64 {
        self.header().rnr_events.load(Ordering::Relaxed)
    }

    pub(crate) fn remote_access_errors(&self) -> u64 {
        self.header().remote_access_errors.load(Ordering::Relaxed)
    }
}
