//! A completion queue's ring of completions pushed by peers, its wake-up
//! (a futex word, or an eventfd for an owner inside an async runtime) and
//! the overrun flag.

#[allow(clippy::wildcard_imports)]
use super::*;

#[repr(C)]
pub(super) struct CqHeader {
    pub(super) magic: AtomicU64,
    pub(super) capacity: AtomicU64,
    pub(super) enqueue: AtomicU64,
    pub(super) dequeue: AtomicU64,
    /// Non-zero while the owner sleeps (or is about to): [`ARMED_FUTEX`]
    /// in `wait`, [`ARMED_FD`] on the eventfd. The first waker takes it
    /// back to zero, so a burst of completions costs one wake-up.
    pub(super) armed: AtomicU32,
    /// Futex word bumped by wakers.
    pub(super) wake_seq: AtomicU32,
    /// Set by a pusher that found the ring full (an overrun), taken by the
    /// owner, whose device then reports the CQ failed.
    pub(super) overrun: AtomicU32,
}

#[repr(C)]
pub(super) struct CqSlot {
    /// Vyukov sequence: `position` when free for that position's producer,
    /// `position + 1` once filled.
    pub(super) seq: AtomicU64,
    pub(super) wr_id: AtomicU64,
    pub(super) status: AtomicU32,
    pub(super) kind: AtomicU32,
    pub(super) imm: AtomicU32,
    pub(super) byte_len: AtomicU32,
    pub(super) qpn: AtomicU32,
    pub(super) delay: AtomicU32,
}

/// A completion as it travels through a ring, with its fault-injected
/// delay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RingCompletion {
    pub(crate) completion: WorkCompletion,
    pub(crate) delay_polls: u32,
}

/// The owner sleeps on the futex word (`wait`).
const ARMED_FUTEX: u32 = 1;
/// The owner sleeps on the eventfd (a reactor).
const ARMED_FD: u32 = 2;

/// A completion queue's ring of completions pushed by peers (many
/// producers, in any process; one consumer, the owner).
#[derive(Debug)]
pub(crate) struct CqRing {
    pub(super) segment: Segment,
    pub(super) capacity: usize,
    /// The owner's eventfd (created with the ring; a peer's copy comes
    /// from the owner's agent). Without one, a peer cannot wake an owner
    /// that sleeps on it.
    event: Option<OwnedFd>,
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
        let event = OwnedFd::from(
            nix::sys::eventfd::EventFd::from_value_and_flags(
                0,
                nix::sys::eventfd::EfdFlags::EFD_NONBLOCK
                    | nix::sys::eventfd::EfdFlags::EFD_CLOEXEC,
            )
            .map_err(io::Error::from)?,
        );
        let this = Self {
            segment,
            capacity,
            event: Some(event),
        };
        for position in 0..capacity as u64 {
            this.slot(position).seq.store(position, Ordering::Relaxed);
        }
        Ok(this)
    }

    /// A peer's view of an owner's ring: its memory `fd` and, to wake an
    /// owner sleeping on it, its eventfd `event`.
    pub(crate) fn open(fd: OwnedFd, event: Option<OwnedFd>) -> io::Result<Self> {
        let (segment, capacity) = Segment::open(fd, CQ_MAGIC, Self::HEADER, size_of::<CqSlot>())?;
        Ok(Self {
            segment,
            capacity,
            event,
        })
    }

    /// The ring's eventfd, if this side has one.
    pub(crate) fn event_fd(&self) -> Option<BorrowedFd<'_>> {
        self.event.as_ref().map(AsFd::as_fd)
    }

    /// Disarms: the owner is awake. The eventfd's counter is left as it
    /// is: the reactor watches it edge-triggered (each write is a new
    /// event, whatever the counter holds), so reading it back would be a
    /// system call per wake-up for nothing; at one write per arming it
    /// cannot reach its limit (2^64 - 2).
    pub(crate) fn clear_event(&self) {
        self.header().armed.store(0, Ordering::Relaxed);
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

    /// The owner is about to sleep, in `wait` or (`by_fd`) on the
    /// eventfd: returns the wake sequence to wait on. The owner must poll
    /// once more after arming and sleep only if that found nothing.
    pub(crate) fn arm(&self, by_fd: bool) -> u32 {
        let header = self.header();
        let how = if by_fd { ARMED_FD } else { ARMED_FUTEX };
        header.armed.store(how, Ordering::Relaxed);
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
        if header.armed.load(Ordering::Relaxed) == 0 {
            return;
        }
        match header.armed.swap(0, Ordering::AcqRel) {
            ARMED_FUTEX => {
                header.wake_seq.fetch_add(1, Ordering::AcqRel);
                futex_wake(&header.wake_seq);
            }
            ARMED_FD => {
                if let Some(event) = &self.event {
                    // A full counter (EAGAIN) is already a wake-up.
                    let _ = nix::unistd::write(event, &1u64.to_ne_bytes());
                }
            }
            _ => {}
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
pub(super) fn futex_wait(word: &AtomicU32, expected: u32, timeout: std::time::Duration) {
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
pub(super) fn futex_wake(word: &AtomicU32) {
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

pub(super) fn status_code(status: WcStatus) -> u32 {
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

pub(super) fn status_from_code(code: u32) -> WcStatus {
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
