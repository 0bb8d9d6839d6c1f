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
    /// A memory window's binding: writes through it must arrive on this
    /// device's QP `qpn`, and land in the region `parent` (whose memory
    /// peers in other processes map). `None` for a registered region.
    pub(crate) bound: Option<Binding>,
}

/// What a bound memory window is bound to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Binding {
    /// The QP (of the window's device) whose peer may write through it.
    pub(crate) qpn: u32,
    /// The key of the registered region the window lies in.
    pub(crate) parent: u32,
}

/// How a slot's `access` word says what a key names (the low byte; a
/// window's QP number sits above it).
const ACCESS_LOCAL: u32 = 0;
const ACCESS_REMOTE_WRITE: u32 = 1;
const ACCESS_WINDOWS: u32 = 2;
const ACCESS_BOUND_WINDOW: u32 = 3;

impl MemoryRegion {
    /// A registration (no window).
    pub(crate) fn registered(addr: usize, len: usize, access: Access) -> Self {
        Self {
            addr,
            len,
            access,
            bound: None,
        }
    }

    pub(crate) fn contains(&self, addr: usize, len: usize) -> bool {
        addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.addr + self.len)
    }
}

/// Values of [`DeviceHeader::dead`]: peers read it before every operation
/// towards the device.
const REACHABLE: u64 = 0;
const DEAD: u64 = 1;
const PORT_DOWN: u64 = 2;

#[repr(C)]
pub(super) struct DeviceHeader {
    pub(super) magic: AtomicU64,
    pub(super) capacity: AtomicU64,
    pub(super) dead: AtomicU64,
    pub(super) rnr_events: AtomicU64,
    pub(super) remote_access_errors: AtomicU64,
    /// The port's link (`port.rs`): when what was booked on its ingress
    /// and on its egress has gone through (CLOCK_MONOTONIC nanoseconds),
    /// and its rate in picoseconds per byte (0: unlimited).
    pub(super) ingress_free_ns: AtomicU64,
    pub(super) egress_free_ns: AtomicU64,
    pub(super) ps_per_byte: AtomicU64,
}

#[repr(C)]
pub(super) struct RegionSlot {
    pub(super) key: AtomicU32,
    pub(super) access: AtomicU32,
    pub(super) base: AtomicU64,
    pub(super) len: AtomicU64,
    /// A bound window's QP number (high half) and parent region key (low
    /// half); else 0.
    pub(super) parent: AtomicU64,
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

    /// The slot a key names.
    pub(crate) fn slot_of(key: u32) -> usize {
        (key & ((1 << SLOT_BITS) - 1)) as usize
    }

    /// The key for `slot` in its `generation` (never 0).
    pub(crate) fn key(slot: usize, generation: u32) -> u32 {
        (generation << SLOT_BITS) | slot as u32
    }

    /// Makes `region` visible under `key`.
    pub(crate) fn publish(&self, key: u32, region: MemoryRegion) {
        let slot = self.slot(Self::slot_of(key));
        // A seqlock's writer: the slot's key is 0 (retired) or about to be
        // replaced; the fields below must not be seen before that by a
        // reader who then sees the old key again.
        std::sync::atomic::fence(Ordering::Release);
        slot.base.store(region.addr as u64, Ordering::Relaxed);
        slot.len.store(region.len as u64, Ordering::Relaxed);
        let access = match (region.bound, region.access) {
            (Some(_), _) => ACCESS_BOUND_WINDOW,
            (None, Access::LocalOnly) => ACCESS_LOCAL,
            (None, Access::RemoteWrite) => ACCESS_REMOTE_WRITE,
            (None, Access::Windows) => ACCESS_WINDOWS,
        };
        slot.access.store(access, Ordering::Relaxed);
        slot.parent.store(
            region
                .bound
                .map_or(0, |b| (u64::from(b.qpn) << 32) | u64::from(b.parent)),
            Ordering::Relaxed,
        );
        slot.key.store(key, Ordering::Release);
    }

    /// Withdraws `key`.
    pub(crate) fn retire(&self, key: u32) {
        let slot = self.slot(Self::slot_of(key));
        let _ = slot
            .key
            .compare_exchange(key, 0, Ordering::AcqRel, Ordering::Relaxed);
    }

    /// The key published under `slot` now (0: none).
    pub(crate) fn key_in(&self, slot: usize) -> u32 {
        if slot >= self.capacity {
            return 0;
        }
        self.slot(slot).key.load(Ordering::Acquire)
    }

    /// Withdraws whatever key is published under `slot`.
    pub(crate) fn retire_slot(&self, slot: usize) {
        if slot < self.capacity {
            self.slot(slot).key.store(0, Ordering::Release);
        }
    }

    /// The region `key` names, if it is registered.
    pub(crate) fn lookup(&self, key: u32) -> Option<MemoryRegion> {
        let index = Self::slot_of(key);
        if key == 0 || index >= self.capacity {
            return None;
        }
        let slot = self.slot(index);
        if slot.key.load(Ordering::Acquire) != key {
            return None;
        }
        let access = slot.access.load(Ordering::Relaxed);
        let parent = slot.parent.load(Ordering::Relaxed);
        let (access, bound) = match access & 0xff {
            ACCESS_REMOTE_WRITE => (Access::RemoteWrite, None),
            ACCESS_WINDOWS => (Access::Windows, None),
            ACCESS_BOUND_WINDOW => (
                Access::RemoteWrite,
                Some(Binding {
                    qpn: (parent >> 32) as u32,
                    parent: parent as u32,
                }),
            ),
            _ => (Access::LocalOnly, None),
        };
        let region = MemoryRegion {
            addr: usize::try_from(slot.base.load(Ordering::Relaxed)).ok()?,
            len: usize::try_from(slot.len.load(Ordering::Relaxed)).ok()?,
            access,
            bound,
        };
        // Fields are published before the key and never change under one
        // key: a key still in place means they were read whole (the
        // seqlock's reader fence: the loads above before the check below).
        std::sync::atomic::fence(Ordering::Acquire);
        (slot.key.load(Ordering::Acquire) == key).then_some(region)
    }

    /// Whether nothing reaches the device: its host died, or its port
    /// is down.
    pub(crate) fn is_dead(&self) -> bool {
        self.header().dead.load(Ordering::Acquire) != REACHABLE
    }

    /// Its host died: for good.
    pub(crate) fn mark_dead(&self) {
        self.header().dead.store(DEAD, Ordering::Release);
    }

    /// Its port went down (`true`) or came back (`false`); whether that
    /// changed anything (a dead device's port stays dead).
    pub(crate) fn set_port_down(&self, down: bool) -> bool {
        let (from, to) = if down {
            (REACHABLE, PORT_DOWN)
        } else {
            (PORT_DOWN, REACHABLE)
        };
        self.header()
            .dead
            .compare_exchange(from, to, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// The port's link rate, in picoseconds per byte (0: unlimited).
    pub(crate) fn ps_per_byte(&self) -> u64 {
        self.header().ps_per_byte.load(Ordering::Relaxed)
    }

    pub(crate) fn set_ps_per_byte(&self, ps: u64) {
        self.header().ps_per_byte.store(ps, Ordering::Relaxed);
    }

    /// When the link's ingress (`true`) or egress is free.
    pub(crate) fn link_free_ns(&self, ingress: bool) -> u64 {
        let header = self.header();
        let free = if ingress {
            &header.ingress_free_ns
        } else {
            &header.egress_free_ns
        };
        free.load(Ordering::Acquire)
    }

    /// Books `cost_ns` of the link's ingress (`true`) or egress from
    /// `now_ns` or from when it frees, whichever is later.
    pub(crate) fn book_link(&self, ingress: bool, now_ns: u64, cost_ns: u64) {
        let header = self.header();
        let free = if ingress {
            &header.ingress_free_ns
        } else {
            &header.egress_free_ns
        };
        let _ = free.fetch_update(Ordering::AcqRel, Ordering::Acquire, |at| {
            Some(at.max(now_ns).saturating_add(cost_ns))
        });
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
