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
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use super::shm::SharedMapping;
use crate::pool::Access;
use crate::verbs::{RecvWr, Sge, WcKind, WcStatus, WorkCompletion};

mod cq_ring;
mod qp_segment;
mod region;

use cq_ring::{CqHeader, CqSlot};
pub(crate) use cq_ring::{CqRing, RingCompletion};
use qp_segment::{QpHeader, RecvSlot};
pub(crate) use qp_segment::{
    QpSegment, STATE_ERROR, STATE_INIT, STATE_READY, STATE_RESET, STATE_RTR,
};
pub(crate) use region::{Binding, MemoryRegion, RegionTable};
use region::{DeviceHeader, RegionSlot};

const TABLE_MAGIC: u64 = u64::from_le_bytes(*b"TSSOFTD1");
const QP_MAGIC: u64 = u64::from_le_bytes(*b"TSSOFTQ1");
/// Version 2: the owner may sleep on an eventfd (`armed` = 2), which a
/// version-1 peer would disarm without signalling.
const CQ_MAGIC: u64 = u64::from_le_bytes(*b"TSSOFTC2");

/// Region slots of a device: keys carry the slot in their low bits.
/// 16,384: every pool block and dedicated mapping of a device, and the
/// memory windows of its connections (`rdma.windows_per_connection` each).
pub(crate) const REGION_SLOTS: usize = 1 << SLOT_BITS;
pub(crate) const SLOT_BITS: u32 = 14;
/// Generations of a slot's key: the bits above the slot.
pub(crate) const GENERATION_MASK: u32 = (1 << (32 - SLOT_BITS)) - 1;

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

    /// The counter of the ring's eventfd (0 when nothing was signalled).
    fn signalled(ring: &CqRing) -> u64 {
        let mut counter = [0u8; 8];
        match nix::unistd::read(ring.event_fd().unwrap(), &mut counter) {
            Ok(8) => u64::from_ne_bytes(counter),
            _ => 0,
        }
    }

    #[test]
    fn an_owner_armed_by_fd_is_woken_once_per_arm_through_the_eventfd() {
        let ring = CqRing::create(16).unwrap();
        // A peer's view, holding a duplicate of the eventfd as the agent
        // hands it out.
        let event = ring.event_fd().unwrap().try_clone_to_owned().unwrap();
        let peer = CqRing::open(ring.fd().try_clone_to_owned().unwrap(), Some(event)).unwrap();
        // Not armed: pushes signal nothing (no system call per completion).
        assert!(peer.push(completion(1)));
        assert_eq!(signalled(&ring), 0);
        // Armed by fd: the first push signals, the rest of the burst not.
        ring.arm(true);
        for i in 2..6 {
            assert!(peer.push(completion(i)));
        }
        assert_eq!(signalled(&ring), 1, "one wake-up per arm");
        // Armed again, then woken by the owner's own `wake` (a command).
        ring.arm(true);
        ring.wake();
        assert_eq!(signalled(&ring), 1);
        // Cleared: disarmed, so a later push signals nothing.
        ring.arm(true);
        ring.clear_event();
        assert!(peer.push(completion(7)));
        assert_eq!(signalled(&ring), 0);
        // Armed for the futex: the eventfd stays quiet.
        let at = ring.arm(false);
        assert!(peer.push(completion(8)));
        assert_eq!(signalled(&ring), 0);
        ring.wait(at, std::time::Duration::from_secs(5));
        for i in [1, 2, 3, 4, 5, 7, 8] {
            assert_eq!(ring.pop().map(|e| e.completion.wr_id), Some(i));
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
        assert!(CqRing::open(fd, None).is_err(), "a QP segment is not a CQ");
    }

    #[test]
    fn region_keys_name_one_registration_only() {
        let table = RegionTable::create().unwrap();
        let region = MemoryRegion {
            addr: 4096,
            len: 100,
            access: Access::RemoteWrite,
            bound: None,
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
