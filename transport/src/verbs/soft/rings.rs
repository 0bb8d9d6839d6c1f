//! The soft NIC's shared state, laid out in shared memory so that peers in
//! other processes can use it: the table of registered regions (with the
//! device's event counters), each QP's receive queue and state, and each
//! completion queue's ring of completions written by peers.
//!
//! Every field is an atomic of 4 or 8 bytes, so any bit pattern a peer
//! leaves behind is a valid value: a misbehaving peer can corrupt what it
//! shares, never this process's memory safety. Layouts are checked (magic,
//! capacity, size) when a peer's segment is opened.

use std::io;
use std::mem::size_of;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use super::shm::SharedMapping;
use crate::pool::Access;
use crate::verbs::{RecvWr, Sge, WcKind, WcStatus, WorkCompletion};

const TABLE_MAGIC: u64 = u64::from_le_bytes(*b"TSSOFTD1");
const QP_MAGIC: u64 = u64::from_le_bytes(*b"TSSOFTQ1");
const CQ_MAGIC: u64 = u64::from_le_bytes(*b"TSSOFTC1");

/// Region slots of a device: keys carry the slot in their low bits.
pub(crate) const REGION_SLOTS: usize = 4096;
const SLOT_BITS: u32 = 12;

/// A typed view of a shared segment.
#[derive(Debug)]
struct Segment {
    map: SharedMapping,
}

impl Segment {
    /// The `T` at byte `offset`.
    fn at<T: AtomicOnly>(&self, offset: usize) -> &T {
        assert!(
            offset + size_of::<T>() <= self.map.len()
                && offset.is_multiple_of(std::mem::align_of::<T>())
        );
        // SAFETY: in bounds and aligned (asserted; the mapping is page
        // aligned); `T` consists of atomics only, valid for any bytes and
        // meant for shared access; the reference lives no longer than the
        // mapping it borrows.
        unsafe { &*((self.map.addr() + offset) as *const T) }
    }

    fn open(fd: OwnedFd, magic: u64, header: usize, slot: usize) -> io::Result<(Self, usize)> {
        let segment = Self {
            map: SharedMapping::open(fd)?,
        };
        let invalid = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_string());
        if segment.map.len() < header {
            return Err(invalid("segment shorter than its header"));
        }
        let head: &[AtomicU64; 2] = segment.at(0);
        if head[0].load(Ordering::Acquire) != magic {
            return Err(invalid("segment of another kind or version"));
        }
        let capacity = usize::try_from(head[1].load(Ordering::Acquire))
            .map_err(|_| invalid("capacity out of range"))?;
        let fits = capacity
            .checked_mul(slot)
            .and_then(|n| n.checked_add(header))
            .is_some_and(|n| n <= segment.map.len());
        if capacity == 0 || !capacity.is_power_of_two() || !fits {
            return Err(invalid("capacity does not match the segment"));
        }
        Ok((segment, capacity))
    }

    fn create(
        name: &str,
        magic: u64,
        header: usize,
        slot: usize,
        capacity: usize,
    ) -> io::Result<Self> {
        let segment = Self {
            map: SharedMapping::create(name, header + slot * capacity)?,
        };
        let head: &[AtomicU64; 2] = segment.at(0);
        head[1].store(capacity as u64, Ordering::Relaxed);
        head[0].store(magic, Ordering::Release);
        Ok(segment)
    }
}

/// Types made of atomics only (valid for every bit pattern).
trait AtomicOnly {}
impl AtomicOnly for [AtomicU64; 2] {}
impl AtomicOnly for DeviceHeader {}
impl AtomicOnly for RegionSlot {}
impl AtomicOnly for QpHeader {}
impl AtomicOnly for RecvSlot {}
impl AtomicOnly for CqHeader {}
impl AtomicOnly for CqSlot {}

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
struct DeviceHeader {
    magic: AtomicU64,
    capacity: AtomicU64,
    dead: AtomicU64,
    rnr_events: AtomicU64,
    remote_access_errors: AtomicU64,
    _reserved: [AtomicU64; 3],
}

#[repr(C)]
struct RegionSlot {
    key: AtomicU32,
    access: AtomicU32,
    base: AtomicU64,
    len: AtomicU64,
    _reserved: AtomicU64,
}

/// A device's registered regions and the counters its peers update.
#[derive(Debug)]
pub(crate) struct RegionTable {
    segment: Segment,
    capacity: usize,
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

/// QP states as stored in shared memory (see [`crate::verbs::QpState`]).
pub(crate) const STATE_RESET: u32 = 0;
/// Ready to send (RTS).
pub(crate) const STATE_READY: u32 = 1;
pub(crate) const STATE_ERROR: u32 = 2;
pub(crate) const STATE_INIT: u32 = 3;
/// Ready to receive (RTR): accepts the peer's traffic.
pub(crate) const STATE_RTR: u32 = 4;

#[repr(C)]
struct QpHeader {
    magic: AtomicU64,
    capacity: AtomicU64,
    state: AtomicU32,
    /// Peers copying into this QP's memory right now (the DMA guard).
    writers: AtomicU32,
    recv_cq: AtomicU32,
    /// The shared receive queue its receives come from (0: its own).
    srq: AtomicU32,
    /// Next receive a sender takes.
    head: AtomicU64,
    /// Next free slot the owner posts into.
    tail: AtomicU64,
}

#[repr(C)]
struct RecvSlot {
    wr_id: AtomicU64,
    addr: AtomicU64,
    len: AtomicU32,
    lkey: AtomicU32,
}

/// A QP's shared part: its state, the DMA guard and its receive queue.
#[derive(Debug)]
pub(crate) struct QpSegment {
    segment: Segment,
    capacity: usize,
}

impl QpSegment {
    const HEADER: usize = size_of::<QpHeader>();

    pub(crate) fn create(recv_depth: u32, recv_cq: u32, srq: u32) -> io::Result<Self> {
        let capacity = (recv_depth.max(1) as usize).next_power_of_two();
        let segment = Segment::create(
            "tessera-soft-qp",
            QP_MAGIC,
            Self::HEADER,
            size_of::<RecvSlot>(),
            capacity,
        )?;
        let this = Self { segment, capacity };
        this.header().recv_cq.store(recv_cq, Ordering::Release);
        this.header().srq.store(srq, Ordering::Release);
        Ok(this)
    }

    pub(crate) fn open(fd: OwnedFd) -> io::Result<Self> {
        let (segment, capacity) = Segment::open(fd, QP_MAGIC, Self::HEADER, size_of::<RecvSlot>())?;
        Ok(Self { segment, capacity })
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.segment.map.fd()
    }

    fn header(&self) -> &QpHeader {
        self.segment.at(0)
    }

    fn slot(&self, position: u64) -> &RecvSlot {
        let index = (position as usize) & (self.capacity - 1);
        self.segment
            .at(Self::HEADER + index * size_of::<RecvSlot>())
    }

    /// The completion queue (of the owner's device) its receives complete on.
    pub(crate) fn recv_cq(&self) -> u32 {
        self.header().recv_cq.load(Ordering::Acquire)
    }

    pub(crate) fn state(&self) -> u32 {
        self.header().state.load(Ordering::SeqCst)
    }

    /// The shared receive queue its receives come from (0: its own ring).
    pub(crate) fn srq(&self) -> u32 {
        self.header().srq.load(Ordering::Acquire)
    }

    /// Moves to `state`; returns the previous one.
    pub(crate) fn set_state(&self, state: u32) -> u32 {
        self.header().state.swap(state, Ordering::SeqCst)
    }

    /// Receives posted and not taken.
    pub(crate) fn posted(&self) -> usize {
        let header = self.header();
        let tail = header.tail.load(Ordering::Acquire);
        tail.saturating_sub(header.head.load(Ordering::Acquire)) as usize
    }

    /// Appends a receive (the owner, one poster at a time); false if full.
    pub(crate) fn push_recv(&self, wr: &RecvWr) -> bool {
        let header = self.header();
        let tail = header.tail.load(Ordering::Relaxed);
        if tail.wrapping_sub(header.head.load(Ordering::Acquire)) >= self.capacity as u64 {
            return false;
        }
        let slot = self.slot(tail);
        slot.wr_id.store(wr.wr_id, Ordering::Relaxed);
        slot.addr.store(wr.sge.addr as u64, Ordering::Relaxed);
        slot.len.store(wr.sge.len, Ordering::Relaxed);
        slot.lkey.store(wr.sge.lkey, Ordering::Relaxed);
        header.tail.store(tail.wrapping_add(1), Ordering::Release);
        true
    }

    /// Takes the oldest receive (a sender, or the owner flushing).
    pub(crate) fn take_recv(&self) -> Option<RecvWr> {
        let header = self.header();
        loop {
            let head = header.head.load(Ordering::Acquire);
            if head == header.tail.load(Ordering::Acquire) {
                return None;
            }
            // The slot is not reused before `head` moves past it, so it can
            // be read before claiming it.
            let slot = self.slot(head);
            let wr = RecvWr {
                wr_id: slot.wr_id.load(Ordering::Relaxed),
                sge: Sge {
                    addr: usize::try_from(slot.addr.load(Ordering::Relaxed)).unwrap_or(0),
                    len: slot.len.load(Ordering::Relaxed),
                    lkey: slot.lkey.load(Ordering::Relaxed),
                },
            };
            if header
                .head
                .compare_exchange(
                    head,
                    head.wrapping_add(1),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
            {
                return Some(wr);
            }
        }
    }

    /// Enters the DMA guard: false (and not entered) unless the QP accepts
    /// its peer's traffic (RTR or RTS; a real responder in RESET or INIT
    /// drops the packets).
    pub(crate) fn begin_dma(&self) -> bool {
        let header = self.header();
        header.writers.fetch_add(1, Ordering::SeqCst);
        if matches!(header.state.load(Ordering::SeqCst), STATE_READY | STATE_RTR) {
            return true;
        }
        header.writers.fetch_sub(1, Ordering::SeqCst);
        false
    }

    pub(crate) fn end_dma(&self) {
        self.header().writers.fetch_sub(1, Ordering::SeqCst);
    }

    /// Waits until no peer is inside the DMA guard (after the state left
    /// READY, none can enter). A peer that died inside it is given up on
    /// after `limit`.
    pub(crate) fn wait_dma_idle(&self, limit: std::time::Duration) -> bool {
        let started = std::time::Instant::now();
        while self.header().writers.load(Ordering::SeqCst) != 0 {
            if started.elapsed() > limit {
                return false;
            }
            std::thread::yield_now();
        }
        true
    }
}

#[repr(C)]
struct CqHeader {
    magic: AtomicU64,
    capacity: AtomicU64,
    enqueue: AtomicU64,
    dequeue: AtomicU64,
    /// Non-zero while the owner sleeps (or is about to) in `wait`.
    armed: AtomicU32,
    /// Futex word bumped by wakers.
    wake_seq: AtomicU32,
    /// Set by a pusher that found the ring full (an overrun), taken by the
    /// owner, whose device then reports the CQ failed.
    overrun: AtomicU32,
}

#[repr(C)]
struct CqSlot {
    /// Vyukov sequence: `position` when free for that position's producer,
    /// `position + 1` once filled.
    seq: AtomicU64,
    wr_id: AtomicU64,
    status: AtomicU32,
    kind: AtomicU32,
    imm: AtomicU32,
    byte_len: AtomicU32,
    qpn: AtomicU32,
    delay: AtomicU32,
}

/// A completion as it travels through a ring, with its fault-injected
/// delay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RingCompletion {
    pub(crate) completion: WorkCompletion,
    pub(crate) delay_polls: u32,
}

/// A completion queue's ring of completions pushed by peers (many
/// producers, in any process; one consumer, the owner).
#[derive(Debug)]
pub(crate) struct CqRing {
    segment: Segment,
    capacity: usize,
}

impl CqRing {
    const HEADER: usize = size_of::<CqHeader>();

    pub(crate) fn create(depth: u32) -> io::Result<Self> {
        let capacity = (depth.max(16) as usize).next_power_of_two();
        let segment = Segment::create(
            "tessera-soft-cq",
            CQ_MAGIC,
            Self::HEADER,
            size_of::<CqSlot>(),
            capacity,
        )?;
        let this = Self { segment, capacity };
        for position in 0..capacity as u64 {
            this.slot(position).seq.store(position, Ordering::Relaxed);
        }
        Ok(this)
    }

    pub(crate) fn open(fd: OwnedFd) -> io::Result<Self> {
        let (segment, capacity) = Segment::open(fd, CQ_MAGIC, Self::HEADER, size_of::<CqSlot>())?;
        Ok(Self { segment, capacity })
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.segment.map.fd()
    }

    fn header(&self) -> &CqHeader {
        self.segment.at(0)
    }

    fn slot(&self, position: u64) -> &CqSlot {
        let index = (position as usize) & (self.capacity - 1);
        self.segment.at(Self::HEADER + index * size_of::<CqSlot>())
    }

    /// Appends a completion; false if the ring is full (a CQ overrun).
    pub(crate) fn push(&self, entry: RingCompletion) -> bool {
        let header = self.header();
        let mut position = header.enqueue.load(Ordering::Relaxed);
        let slot = loop {
            let slot = self.slot(position);
            let seq = slot.seq.load(Ordering::Acquire);
            match seq.cmp(&position) {
                std::cmp::Ordering::Equal => {
                    match header.enqueue.compare_exchange_weak(
                        position,
                        position.wrapping_add(1),
                        Ordering::Relaxed,
                        Ordering::Relaxed,
                    ) {
                        Ok(_) => break slot,
                        Err(now) => position = now,
                    }
                }
                std::cmp::Ordering::Less => {
                    header.overrun.store(1, Ordering::Release);
                    self.wake();
                    return false;
                }
                std::cmp::Ordering::Greater => position = header.enqueue.load(Ordering::Relaxed),
            }
        };
        let c = entry.completion;
        let (kind, imm) = match c.kind {
            WcKind::Send => (0, 0),
            WcKind::Recv => (1, 0),
            WcKind::RecvWithImm(imm) => (2, imm),
            WcKind::Unknown => (3, 0),
        };
        slot.wr_id.store(c.wr_id, Ordering::Relaxed);
        slot.status.store(status_code(c.status), Ordering::Relaxed);
        slot.kind.store(kind, Ordering::Relaxed);
        slot.imm.store(imm, Ordering::Relaxed);
        slot.byte_len.store(c.byte_len, Ordering::Relaxed);
        slot.qpn.store(c.qpn, Ordering::Relaxed);
        slot.delay.store(entry.delay_polls, Ordering::Relaxed);
        slot.seq.store(position.wrapping_add(1), Ordering::Release);
        self.wake();
        true
    }

    /// The owner is about to sleep: returns the wake sequence to wait on.
    /// The owner must poll once more after arming and sleep only if that
    /// found nothing.
    pub(crate) fn arm(&self) -> u32 {
        let header = self.header();
        header.armed.store(1, Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::SeqCst);
        header.wake_seq.load(Ordering::Acquire)
    }

    /// Sleeps until woken after `armed_at` (from [`CqRing::arm`]) or
    /// `timeout`, then disarms.
    pub(crate) fn wait(&self, armed_at: u32, timeout: std::time::Duration) {
        let header = self.header();
        futex_wait(&header.wake_seq, armed_at, timeout);
        header.armed.store(0, Ordering::Relaxed);
    }

    /// Wakes the owner if it sleeps (from any thread or process).
    pub(crate) fn wake(&self) {
        let header = self.header();
        // Pairs with the fence in `arm`: whatever the caller published
        // before (a completion, a command) is seen by the owner's last
        // look, or the owner is seen armed here.
        std::sync::atomic::fence(Ordering::SeqCst);
        if header.armed.load(Ordering::Relaxed) != 0 {
            header.wake_seq.fetch_add(1, Ordering::AcqRel);
            futex_wake(&header.wake_seq);
        }
    }

    /// Whether a pusher overran the ring since the last call.
    pub(crate) fn take_overrun(&self) -> bool {
        self.header().overrun.swap(0, Ordering::AcqRel) != 0
    }

    /// Takes the oldest completion (the owner only, one at a time).
    pub(crate) fn pop(&self) -> Option<RingCompletion> {
        let header = self.header();
        let position = header.dequeue.load(Ordering::Relaxed);
        let slot = self.slot(position);
        if slot.seq.load(Ordering::Acquire) != position.wrapping_add(1) {
            return None;
        }
        let kind = match slot.kind.load(Ordering::Relaxed) {
            0 => WcKind::Send,
            1 => WcKind::Recv,
            2 => WcKind::RecvWithImm(slot.imm.load(Ordering::Relaxed)),
            _ => WcKind::Unknown,
        };
        let entry = RingCompletion {
            completion: WorkCompletion {
                wr_id: slot.wr_id.load(Ordering::Relaxed),
                status: status_from_code(slot.status.load(Ordering::Relaxed)),
                kind,
                byte_len: slot.byte_len.load(Ordering::Relaxed),
                qpn: slot.qpn.load(Ordering::Relaxed),
                vendor_err: 0,
            },
            delay_polls: slot.delay.load(Ordering::Relaxed),
        };
        slot.seq.store(
            position.wrapping_add(self.capacity as u64),
            Ordering::Release,
        );
        header
            .dequeue
            .store(position.wrapping_add(1), Ordering::Relaxed);
        Some(entry)
    }
}

/// Sleeps while `word` holds `expected`, at most `timeout` (a shared
/// futex: the word may live in memory another process maps).
fn futex_wait(word: &AtomicU32, expected: u32, timeout: std::time::Duration) {
    let spec = libc::timespec {
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_nsec: libc::c_long::from(timeout.subsec_nanos() as i32),
    };
    // SAFETY: `word` is a live, aligned 32-bit atomic; FUTEX_WAIT only
    // reads it and sleeps; `spec` outlives the call. Spurious returns
    // (EAGAIN, EINTR, timeout) are fine: callers re-check their queues.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &spec as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Wakes every sleeper on `word`.
fn futex_wake(word: &AtomicU32) {
    // SAFETY: `word` is a live, aligned 32-bit atomic; FUTEX_WAKE does not
    // touch memory.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

fn status_code(status: WcStatus) -> u32 {
    match status {
        WcStatus::Success => 0,
        WcStatus::LocalProtectionError => 1,
        WcStatus::LocalLengthError => 2,
        WcStatus::RemoteAccessError => 3,
        WcStatus::ReceiverNotReady => 4,
        WcStatus::RetryExceeded => 5,
        WcStatus::RemoteOperationError => 6,
        WcStatus::Flushed => 7,
        // Raw statuses travel above the named ones.
        WcStatus::Other(raw) => 8u32.saturating_add(raw),
    }
}

fn status_from_code(code: u32) -> WcStatus {
    match code {
        0 => WcStatus::Success,
        1 => WcStatus::LocalProtectionError,
        2 => WcStatus::LocalLengthError,
        3 => WcStatus::RemoteAccessError,
        4 => WcStatus::ReceiverNotReady,
        5 => WcStatus::RetryExceeded,
        6 => WcStatus::RemoteOperationError,
        7 => WcStatus::Flushed,
        raw => WcStatus::Other(raw - 8),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn completion(wr_id: u64) -> RingCompletion {
        RingCompletion {
            completion: WorkCompletion {
                wr_id,
                status: WcStatus::Success,
                kind: WcKind::RecvWithImm(wr_id as u32 * 3),
                byte_len: 7,
                qpn: 9,
                vendor_err: 0,
            },
            delay_polls: 0,
        }
    }

    #[test]
    fn completion_ring_is_fifo_bounded_and_survives_wrapping() {
        let ring = CqRing::create(16).unwrap();
        for round in 0..5u64 {
            for i in 0..16 {
                assert!(ring.push(completion(round * 100 + i)));
            }
            assert!(!ring.push(completion(999)), "full at its capacity");
            for i in 0..16 {
                assert_eq!(ring.pop(), Some(completion(round * 100 + i)));
            }
            assert_eq!(ring.pop(), None);
        }
    }

    #[test]
    fn completion_ring_takes_concurrent_producers() {
        let ring = std::sync::Arc::new(CqRing::create(1024).unwrap());
        let producers: Vec<_> = (0..4u64)
            .map(|p| {
                let ring = std::sync::Arc::clone(&ring);
                std::thread::spawn(move || {
                    for i in 0..200 {
                        while !ring.push(completion(p * 1000 + i)) {
                            std::thread::yield_now();
                        }
                    }
                })
            })
            .collect();
        let mut last = [None::<u64>; 4];
        let mut seen = 0;
        while seen < 800 {
            if let Some(entry) = ring.pop() {
                let id = entry.completion.wr_id;
                let p = (id / 1000) as usize;
                assert!(last[p].is_none_or(|l| l < id), "per-producer order");
                last[p] = Some(id);
                seen += 1;
            }
        }
        for p in producers {
            p.join().unwrap();
        }
    }

    #[test]
    fn a_segment_opened_from_its_fd_shares_memory_and_refuses_strangers() {
        let qp = QpSegment::create(8, 3, 0).unwrap();
        let peer = QpSegment::open(qp.fd().try_clone_to_owned().unwrap()).unwrap();
        let wr = RecvWr {
            wr_id: 5,
            sge: Sge {
                addr: 0x1000,
                len: 64,
                lkey: 7,
            },
        };
        assert!(qp.push_recv(&wr));
        assert_eq!(peer.recv_cq(), 3);
        assert_eq!(peer.take_recv(), Some(wr));
        assert_eq!(qp.posted(), 0);
        let fd = qp.fd().try_clone_to_owned().unwrap();
        assert!(CqRing::open(fd).is_err(), "a QP segment is not a CQ");
    }

    #[test]
    fn region_keys_name_one_registration_only() {
        let table = RegionTable::create().unwrap();
        let region = MemoryRegion {
            addr: 4096,
            len: 100,
            access: Access::RemoteWrite,
        };
        let old = RegionTable::key(5, 1);
        table.publish(old, region);
        assert_eq!(table.lookup(old), Some(region));
        table.retire(old);
        let new = RegionTable::key(5, 2);
        table.publish(new, region);
        assert_eq!(
            table.lookup(old),
            None,
            "a reused slot does not revive a key"
        );
        assert_eq!(table.lookup(new), Some(region));
        assert_eq!(table.lookup(0), None);
    }
}
