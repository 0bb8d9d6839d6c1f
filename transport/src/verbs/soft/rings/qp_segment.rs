//! A QP's shared part: its state, the DMA guard and its receive queue.

#[allow(clippy::wildcard_imports)]
use super::*;

/// QP states as stored in shared memory (see [`crate::verbs::QpState`]).
pub(crate) const STATE_RESET: u32 = 0;
/// Ready to send (RTS).
pub(crate) const STATE_READY: u32 = 1;
pub(crate) const STATE_ERROR: u32 = 2;
pub(crate) const STATE_INIT: u32 = 3;
/// Ready to receive (RTR): accepts the peer's traffic.
pub(crate) const STATE_RTR: u32 = 4;

#[repr(C)]
pub(super) struct QpHeader {
    pub(super) magic: AtomicU64,
    pub(super) capacity: AtomicU64,
    pub(super) state: AtomicU32,
    /// Peers copying into this QP's memory right now (the DMA guard).
    pub(super) writers: AtomicU32,
    pub(super) recv_cq: AtomicU32,
    /// The shared receive queue its receives come from (0: its own).
    pub(super) srq: AtomicU32,
    /// Next receive a sender takes.
    pub(super) head: AtomicU64,
    /// Next free slot the owner posts into.
    pub(super) tail: AtomicU64,
}

#[repr(C)]
pub(super) struct RecvSlot {
    pub(super) wr_id: AtomicU64,
    pub(super) addr: AtomicU64,
    pub(super) len: AtomicU32,
    pub(super) lkey: AtomicU32,
}

/// A QP's shared part: its state, the DMA guard and its receive queue.
#[derive(Debug)]
pub(crate) struct QpSegment {
    pub(super) segment: Segment,
    pub(super) capacity: usize,
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
            // What the writer reads next (the key it writes through) is
            // read after it counted itself in: an invalidation that
            // retired the key and then found no writer cannot miss it.
            std::sync::atomic::fence(Ordering::SeqCst);
            return true;
        }
        header.writers.fetch_sub(1, Ordering::SeqCst);
        false
    }

    /// Whether the QP takes its peer's traffic now (RTR or RTS).
    pub(crate) fn receiving(&self) -> bool {
        matches!(
            self.header().state.load(Ordering::SeqCst),
            STATE_READY | STATE_RTR
        )
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
