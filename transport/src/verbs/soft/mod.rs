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
//! ([`SoftDevice::kill`]).
//!
//! This step works between threads of one process. Cross-process operation
//! (memory shared through memfd) is still to come.

mod cq;
mod device;
mod qp;

pub use cq::SoftCq;
pub use device::{SoftDevice, SoftFabric, SoftFaults, SoftStats};
pub use qp::SoftQp;

#[cfg(test)]
mod tests;
