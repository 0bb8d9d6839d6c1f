//! A software RNIC: RC queue pair semantics in memory, for hosts without an
//! RDMA device (and for deterministic fault-injection tests).
//!
//! A [`SoftFabric`] is the network: devices opened on it can connect queue
//! pairs to each other. Work requests execute when posted, in the posting
//! thread, in order: a SEND copies its gather list into the receive buffer
//! that the peer posted first; a WRITE copies it into the peer's registered
//! memory after checking the rkey, the region's access rights and bounds —
//! the peer's CPU takes no part, as with a real NIC. Completions go to the
//! completion queues given at QP creation; an unsignalled request produces
//! none unless it fails.
//!
//! Memory named by a posted work request must stay registered until the
//! request completes (the same contract as real verbs, where violating it
//! gives an error completion; here the transport's buffer ownership makes
//! it hold).
//!
//! Faults, drawn from a seeded generator ([`SoftFaults`]): receiver not
//! ready, QP errors, delayed completions; and on demand a dead peer
//! ([`SoftDevice::kill`]) or a port that goes down and comes back
//! ([`SoftDevice::set_port_active`], or following a file from outside the
//! process: [`SoftDevice::follow_port_file`]).
//!
//! **Across processes.** Everything a peer's NIC touches lives in shared
//! memory (memfds): registered pool memory (the pool backs its blocks with
//! memfds for this provider), each QP's receive queue, state and DMA guard,
//! each CQ's ring of completions pushed by peers, and each device's table
//! of registered regions with the counters peers update. Node ids carry the
//! pid; each process runs an agent on the abstract unix socket
//! `tessera-soft-<pid>` that hands those memfds to peers (SCM_RIGHTS) when
//! they connect a QP or first touch a region. From then on a SEND or WRITE
//! from another process is a copy by the sender's thread straight into this
//! process's memory, and its completion a push into this process's CQ ring:
//! the receiving CPU takes no part until it polls, as with a NIC. Devices
//! of [`SoftFabric::process`] reach other processes; a [`SoftFabric::new`]
//! fabric is private to the process (tests). Processes in different
//! network namespaces of one machine (the hosts of a multi-host test
//! cluster) form one fabric too: a peer's agent not found in this
//! process's namespace is looked for in the peer's.

mod agent;
mod cq;
mod device;
mod peer;
mod port;
mod qp;
mod retry;
mod rings;
mod shm;
mod srq;

pub use cq::SoftCq;
pub use device::{SoftDevice, SoftFabric, SoftFaults, SoftProfile, SoftStats};
pub use port::SoftPort;
pub use qp::SoftQp;
pub use srq::SoftSrq;

/// Where the soft NIC's WRITEs land, for tests that check each one
/// against what the receiver holds out to its peer (`rdma/io/worker/
/// model.rs`): the WRITEs (and WRITE_WITH_IMMs) carried out on this thread
/// while it records, as (address, length) in the peer's memory.
#[cfg(test)]
pub(crate) mod tap {
    use std::cell::RefCell;

    thread_local! {
        static WRITES: RefCell<Option<Vec<(usize, usize)>>> = const { RefCell::new(None) };
    }

    /// Starts recording this thread's writes (dropping any recorded).
    pub(crate) fn record() {
        WRITES.with(|w| *w.borrow_mut() = Some(Vec::new()));
    }

    /// The writes recorded since the last call (recording goes on).
    pub(crate) fn take() -> Vec<(usize, usize)> {
        WRITES.with(|w| {
            w.borrow_mut()
                .as_mut()
                .map(std::mem::take)
                .unwrap_or_default()
        })
    }

    /// Stops recording.
    pub(crate) fn stop() {
        WRITES.with(|w| *w.borrow_mut() = None);
    }

    pub(super) fn wrote(addr: usize, len: usize) {
        WRITES.with(|w| {
            if let Some(writes) = w.borrow_mut().as_mut() {
                writes.push((addr, len));
            }
        });
    }
}

/// A send pool (local access) and a receive pool (remote write) registered
/// with `device`, named after `name` (tests of the soft NIC and the engine).
#[cfg(test)]
pub(crate) fn test_pools(
    device: &SoftDevice,
    name: &str,
) -> (crate::pool::Pool, crate::pool::Pool) {
    test_pools_with(device, name, crate::pool::Access::RemoteWrite)
}

/// A send pool and a receive pool of `device`, the receive pool
/// registered with `recv_access`.
#[cfg(test)]
pub(crate) fn test_pools_with(
    device: &SoftDevice,
    name: &str,
    recv_access: crate::pool::Access,
) -> (crate::pool::Pool, crate::pool::Pool) {
    use crate::pool::{Access, Pool, PoolConfig};
    use crate::verbs::Device;
    let hook = device.registration_hook();
    let pool = |suffix: &str, access| {
        Pool::new(
            PoolConfig::named(format!("{name}-{suffix}")),
            access,
            hook.clone(),
        )
        .expect("a test pool")
    };
    (pool("send", Access::LocalOnly), pool("recv", recv_access))
}

#[cfg(test)]
mod tests;
