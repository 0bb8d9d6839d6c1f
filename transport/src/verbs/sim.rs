//! The memory side of a simulated RNIC: a host's table of registered
//! regions and memory windows, and the checked copies a NIC's DMA makes
//! into and out of them, for simulations that run real engines in
//! virtual time (`tessera-fabric`, issue 58).
//!
//! The soft provider ([`super::soft`]) executes a work request when it is
//! posted, in the posting thread, and paces its links by the monotonic
//! clock: right for processes, wrong for a simulation in which a WRITE
//! lands when its last packet crosses a modelled fabric. Here the
//! simulation owns the timing (its NIC model packetizes work requests and
//! places each when its last packet arrives); this module owns what must
//! be as strict as rxe and a real NIC whatever the timing:
//!
//! - a local scatter/gather entry must lie in a region registered under
//!   its `lkey` ([`SimMemory::gather`]: a local protection error else);
//! - a SEND lands in a posted receive's buffer, no longer than it (a
//!   local length error at the receiver else) and registered under its
//!   `lkey` ([`SimMemory::place_receive`]);
//! - a WRITE lands only in a region registered for remote writes under
//!   that `rkey`, or in the bytes of a memory window bound under it for
//!   the very queue pair the WRITE arrives on, and within bounds
//!   ([`SimMemory::place_write`]: a remote access error else);
//! - a window bound (`BindWindow`) covers registered bytes of a region
//!   registered for windows; an invalidated one admits nothing more.
//!
//! Regions are checked again at the moment of each copy, so memory
//! deregistered (its pool returned the block) while a request was in
//! flight fails the request instead of being written.
//!
//! # Why not the soft provider
//!
//! Its work requests complete synchronously and its completions go
//! through shared-memory rings read by threads; a simulation of thousands
//! of hosts in one thread needs neither, and needs every delivery to
//! happen at the virtual time the fabric says. The checks are the same.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::pool::{Access, RegisteredRegion, RegistrationError, RegistrationHook};
use crate::sync::LockExt;
use crate::verbs::{MemoryWindow, Sge, WcStatus};

/// A registered region.
#[derive(Debug, Clone, Copy)]
struct Region {
    addr: usize,
    len: usize,
    access: Access,
}

impl Region {
    fn contains(&self, addr: usize, len: usize) -> bool {
        addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.addr + self.len)
    }
}

/// A memory window's binding: bytes of a region the peer on `qpn` may
/// write under the binding's rkey.
#[derive(Debug, Clone, Copy)]
struct Binding {
    addr: usize,
    len: usize,
    qpn: u32,
    /// The key of the region the bytes lie in (checked at each write: the
    /// window does not outlive its region).
    lkey: u32,
}

#[derive(Debug, Default)]
struct Table {
    /// By key (a region's lkey and rkey are the same here).
    regions: HashMap<u32, Region>,
    /// By the rkey of the binding.
    bindings: HashMap<u32, Binding>,
}

#[derive(Debug)]
struct Inner {
    table: Mutex<Table>,
    next_key: AtomicU32,
    next_window: AtomicU64,
    registered_bytes: AtomicU64,
}

/// One simulated host's registered memory (module docs). Cloning shares
/// it.
#[derive(Debug, Clone)]
pub struct SimMemory {
    inner: Arc<Inner>,
}

impl Default for SimMemory {
    fn default() -> Self {
        Self::new()
    }
}

impl SimMemory {
    /// A host with nothing registered.
    pub fn new() -> Self {
        Self {
            inner: Arc::new(Inner {
                table: Mutex::new(Table::default()),
                next_key: AtomicU32::new(1),
                next_window: AtomicU64::new(1),
                registered_bytes: AtomicU64::new(0),
            }),
        }
    }

    /// The registration hook the host's pools register through.
    pub fn hook(&self) -> Arc<dyn RegistrationHook> {
        Arc::new(self.clone())
    }

    /// Bytes registered now.
    pub fn registered_bytes(&self) -> u64 {
        self.inner.registered_bytes.load(Ordering::Relaxed)
    }

    /// A type-2 memory window of this host, bound by a `BindWindow` work
    /// request ([`SimMemory::bind`]).
    pub fn alloc_window(&self) -> Arc<dyn MemoryWindow> {
        let handle = self.inner.next_window.fetch_add(1, Ordering::Relaxed);
        Arc::new(SimWindow { handle })
    }

    /// The (address, length) ranges of `sges` if each lies in a region
    /// registered under its `lkey`, else a local protection error.
    pub fn gather(&self, sges: &[Sge]) -> Result<Vec<(usize, usize)>, WcStatus> {
        let table = self.inner.table.locked();
        sges.iter()
            .map(|sge| {
                let len = sge.len as usize;
                match table.regions.get(&sge.lkey) {
                    Some(region) if region.contains(sge.addr, len) => Ok((sge.addr, len)),
                    _ => Err(WcStatus::LocalProtectionError),
                }
            })
            .collect()
    }

    /// Binds window `rkey` over `len` bytes at `addr` of the region
    /// registered under `lkey` for queue pair `qpn` (a `BindWindow` work
    /// request executing); a local protection error if the bytes are not
    /// in a region registered for windows.
    pub fn bind(
        &self,
        rkey: u32,
        addr: usize,
        len: usize,
        lkey: u32,
        qpn: u32,
    ) -> Result<(), WcStatus> {
        let mut table = self.inner.table.locked();
        match table.regions.get(&lkey) {
            Some(region) if region.access == Access::Windows && region.contains(addr, len) => {
                table.bindings.insert(
                    rkey,
                    Binding {
                        addr,
                        len,
                        qpn,
                        lkey,
                    },
                );
                Ok(())
            }
            _ => Err(WcStatus::LocalProtectionError),
        }
    }

    /// Ends the binding under `rkey` (an `Invalidate` work request
    /// executing): no write through it lands from now on.
    pub fn invalidate(&self, rkey: u32) {
        self.inner.table.locked().bindings.remove(&rkey);
    }

    /// Copies `gather` (ranges of `source`'s memory, from
    /// [`SimMemory::gather`]) into this host's receive buffer `recv` (a
    /// SEND arriving): the bytes placed, or the receive's error (a local
    /// length error for a message longer than the buffer, a local
    /// protection error for a buffer not registered under its key).
    pub fn place_receive(
        &self,
        source: &SimMemory,
        gather: &[(usize, usize)],
        recv: Sge,
    ) -> Result<u32, WcStatus> {
        let total: usize = gather.iter().map(|&(_, len)| len).sum();
        if total > recv.len as usize {
            return Err(WcStatus::LocalLengthError);
        }
        let placed = u32::try_from(total).map_err(|_| WcStatus::LocalLengthError)?;
        let target = {
            let table = self.inner.table.locked();
            match table.regions.get(&recv.lkey) {
                Some(region) if region.contains(recv.addr, total) => recv.addr,
                _ => return Err(WcStatus::LocalProtectionError),
            }
        };
        source.copy_out(gather, self, target, total)?;
        Ok(placed)
    }

    /// Copies `gather` (ranges of `source`'s memory) to `remote_addr` of
    /// this host under `rkey`, for a WRITE arriving on queue pair `qpn`: a
    /// remote access error unless the bytes lie in a region registered for
    /// remote writes under `rkey`, or in a window bound under `rkey` for
    /// `qpn`.
    pub fn place_write(
        &self,
        source: &SimMemory,
        gather: &[(usize, usize)],
        remote_addr: usize,
        rkey: u32,
        qpn: u32,
    ) -> Result<(), WcStatus> {
        let total: usize = gather.iter().map(|&(_, len)| len).sum();
        {
            let table = self.inner.table.locked();
            let admitted = match table.regions.get(&rkey) {
                Some(region) => {
                    region.access.allows_remote_write() && region.contains(remote_addr, total)
                }
                None => table.bindings.get(&rkey).is_some_and(|b| {
                    b.qpn == qpn
                        && remote_addr >= b.addr
                        && remote_addr
                            .checked_add(total)
                            .is_some_and(|end| end <= b.addr + b.len)
                        && table
                            .regions
                            .get(&b.lkey)
                            .is_some_and(|r| r.contains(remote_addr, total))
                }),
            };
            if !admitted {
                return Err(WcStatus::RemoteAccessError);
            }
        }
        source.copy_out(gather, self, remote_addr, total)
    }

    /// Copies this host's `gather` to `dest` in `target`'s memory, both
    /// checked again now (a region deregistered since the request was
    /// posted fails it).
    fn copy_out(
        &self,
        gather: &[(usize, usize)],
        target: &SimMemory,
        dest: usize,
        total: usize,
    ) -> Result<(), WcStatus> {
        let table = self.inner.table.locked();
        let registered = |table: &Table, addr: usize, len: usize| {
            len == 0 || table.regions.values().any(|r| r.contains(addr, len))
        };
        if !gather.iter().all(|&(a, l)| registered(&table, a, l)) {
            return Err(WcStatus::LocalProtectionError);
        }
        // The target's table (another lock unless it is this host: a QP
        // writing into its own host's memory).
        let same = Arc::ptr_eq(&self.inner, &target.inner);
        let dest_ok = if same {
            registered(&table, dest, total)
        } else {
            registered(&target.inner.table.locked(), dest, total)
        };
        if !dest_ok {
            return Err(WcStatus::RemoteAccessError);
        }
        let mut at = dest;
        for &(src, len) in gather {
            // SAFETY: the source range lies in a region of this host
            // registered now, and the destination range in one of the
            // target's (both checked just above, under the source's table
            // lock): a pool registers a block only while it is mapped and
            // deregisters it before unmapping it, so both ranges are
            // mapped memory of this process. `copy` tolerates overlap (a
            // host writing into its own memory). As with a NIC's DMA, the
            // owner of the destination gave it to the peer to write (a
            // posted receive, a grant), and the owner of the source keeps
            // it until the request completes (the verbs contract).
            unsafe { std::ptr::copy(src as *const u8, at as *mut u8, len) };
            at += len;
        }
        Ok(())
    }
}

impl RegistrationHook for SimMemory {
    fn register(
        &self,
        addr: usize,
        len: usize,
        access: Access,
    ) -> Result<RegisteredRegion, RegistrationError> {
        let key = self.inner.next_key.fetch_add(1, Ordering::Relaxed);
        self.inner
            .table
            .locked()
            .regions
            .insert(key, Region { addr, len, access });
        self.inner
            .registered_bytes
            .fetch_add(len as u64, Ordering::Relaxed);
        Ok(RegisteredRegion {
            lkey: key,
            rkey: key,
            handle: u64::from(key),
        })
    }

    fn deregister(&self, _addr: usize, len: usize, region: &RegisteredRegion) {
        let mut table = self.inner.table.locked();
        if table.regions.remove(&region.lkey).is_some() {
            self.inner
                .registered_bytes
                .fetch_sub(len as u64, Ordering::Relaxed);
        }
        // Windows bound into it admit nothing more.
        table.bindings.retain(|_, b| b.lkey != region.lkey);
    }
}

/// A simulated type-2 memory window: its keys are its handle in the high
/// bits (distinct from every region key, which count up from 1 in the
/// low ones) and a binding count in the low 8, as a NIC's do.
#[derive(Debug)]
struct SimWindow {
    handle: u64,
}

impl MemoryWindow for SimWindow {
    fn handle(&self) -> u64 {
        self.handle
    }

    fn rkey(&self) -> u32 {
        0x8000_0000 | ((self.handle as u32 & 0x7f_ffff) << 8)
    }

    fn next_rkey(&self, rkey: u32) -> u32 {
        (rkey & !0xff) | (rkey.wrapping_add(1) & 0xff)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::{Pool, PoolConfig};

    fn pools(memory: &SimMemory, access: Access) -> Pool {
        Pool::new(PoolConfig::named("sim-test"), access, memory.hook()).unwrap()
    }

    fn key(buf: &crate::pool::PoolBuf) -> u32 {
        buf.region().unwrap().lkey
    }

    #[test]
    fn a_send_lands_in_the_posted_receive_and_a_longer_one_is_refused() {
        let (a, b) = (SimMemory::new(), SimMemory::new());
        let send = pools(&a, Access::LocalOnly);
        let recv = pools(&b, Access::RemoteWrite);
        let mut out = send.alloc(100).unwrap();
        out.fill(7);
        let (out_addr, out_key) = (out.as_ptr() as usize, key(&out));
        let buf = recv.alloc(64).unwrap();
        let sge = Sge {
            addr: out_addr,
            len: 64,
            lkey: out_key,
        };
        let gather = a.gather(&[sge]).unwrap();
        let into = Sge {
            addr: buf.as_ptr() as usize,
            len: 64,
            lkey: key(&buf),
        };
        assert_eq!(b.place_receive(&a, &gather, into), Ok(64));
        assert!(buf.iter().all(|&x| x == 7));
        let long = a.gather(&[Sge { len: 100, ..sge }]).unwrap();
        assert_eq!(
            b.place_receive(&a, &long, into),
            Err(WcStatus::LocalLengthError)
        );
        // A key of another host's table is no key here.
        assert_eq!(
            b.gather(&[sge]),
            Err(WcStatus::LocalProtectionError),
            "b never registered a's send buffer"
        );
    }

    #[test]
    fn a_write_needs_a_remote_writable_region_or_a_window_bound_for_its_queue_pair() {
        let (a, b) = (SimMemory::new(), SimMemory::new());
        let send = pools(&a, Access::LocalOnly);
        let mut out = send.alloc(32).unwrap();
        out.fill(3);
        let gather = a
            .gather(&[Sge {
                addr: out.as_ptr() as usize,
                len: 32,
                lkey: key(&out),
            }])
            .unwrap();
        let open = pools(&b, Access::RemoteWrite);
        let dest = open.alloc(32).unwrap();
        let addr = dest.as_ptr() as usize;
        assert_eq!(b.place_write(&a, &gather, addr, key(&dest), 9), Ok(()));
        assert!(dest.iter().all(|&x| x == 3));
        // Past the end of its region, or under a key it is not
        // registered with.
        let region = dest.region().unwrap();
        assert_eq!(
            b.place_write(&a, &gather, region.base + region.len - 16, key(&dest), 9),
            Err(WcStatus::RemoteAccessError)
        );
        assert_eq!(
            b.place_write(&a, &gather, addr, 0xdead, 9),
            Err(WcStatus::RemoteAccessError)
        );
        // A confined region admits writes only through a bound window, for
        // the queue pair it was bound on, until invalidated.
        let confined = pools(&b, Access::Windows);
        let grant = confined.alloc(32).unwrap();
        let gaddr = grant.as_ptr() as usize;
        assert_eq!(
            b.place_write(&a, &gather, gaddr, key(&grant), 9),
            Err(WcStatus::RemoteAccessError)
        );
        let window = b.alloc_window();
        let rkey = window.next_rkey(window.rkey());
        b.bind(rkey, gaddr, 32, key(&grant), 9).unwrap();
        assert_eq!(
            b.place_write(&a, &gather, gaddr, rkey, 8),
            Err(WcStatus::RemoteAccessError),
            "bound for another queue pair"
        );
        assert_eq!(b.place_write(&a, &gather, gaddr, rkey, 9), Ok(()));
        b.invalidate(rkey);
        assert_eq!(
            b.place_write(&a, &gather, gaddr, rkey, 9),
            Err(WcStatus::RemoteAccessError)
        );
    }

    #[test]
    fn memory_deregistered_while_a_request_was_in_flight_fails_it() {
        let (a, b) = (SimMemory::new(), SimMemory::new());
        let recv = pools(&b, Access::RemoteWrite);
        let dest = recv.alloc(16).unwrap();
        let gather = {
            let send = pools(&a, Access::LocalOnly);
            let out = send.alloc(16).unwrap();
            let gather = a
                .gather(&[Sge {
                    addr: out.as_ptr() as usize,
                    len: 16,
                    lkey: key(&out),
                }])
                .unwrap();
            drop(out);
            drop(send);
            gather
        };
        assert_eq!(a.registered_bytes(), 0, "the pool returned its block");
        assert_eq!(
            b.place_write(&a, &gather, dest.as_ptr() as usize, key(&dest), 1),
            Err(WcStatus::LocalProtectionError)
        );
    }
}
