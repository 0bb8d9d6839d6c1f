//! The RDMA transport's engine layer (the paper's ByteExpress engine,
//! §5.3–§5.4), over the verbs provider trait in [`crate::verbs`].
//!
//! The sans-IO engine ([`engine`]) and its parts: the control header
//! ([`control`]), the work-request ring ([`ring`]), receive credits
//! ([`credits`]), the send window ([`window`]) and remote-write
//! confinement by memory windows ([`windows`]); the I/O threads that
//! drive engines and the handshake and connection table
//! ([`connection`]).

pub mod connection;
pub mod control;
pub(crate) mod cq_budget;
pub mod credits;
pub mod engine;
pub(crate) mod io;
pub(crate) mod partners;
pub(crate) mod rails;
pub mod ring;
pub(crate) mod topology;
pub mod window;
pub mod windows;
pub(crate) mod wr_id;

pub use credits::ReceiveCredits;
pub use engine::{
    Engine, EngineConfig, EngineError, EngineEvent, EngineStats, KeepaliveConfig, PeerInfo, Role,
    SocketId, Violation,
};
pub use ring::WorkRequestRing;
pub use window::{SendWindow, WindowConfig};

#[cfg(test)]
mod tests;

/// Counters of a transport's RDMA side, summed over its I/O threads
/// ([`crate::Transport::rdma_stats`]). The same figures go to the `metrics`
/// registry per peer (`tessera_rdma_*`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RdmaStats {
    /// Queue pairs (engines) running.
    pub qps_open: u64,
    /// Logical sockets on them.
    pub sockets_open: u64,
    /// Payload bytes sent.
    pub bytes_sent: u64,
    /// Payload bytes received.
    pub bytes_received: u64,
    /// Messages sent.
    pub messages_sent: u64,
    /// Messages received.
    pub messages_received: u64,
    /// Times a sender waited for receive credits.
    pub credit_stalls: u64,
    /// Times a sender waited for room in the send window.
    pub window_stalls: u64,
    /// Keepalive writes sent.
    pub keepalives_sent: u64,
    /// Large messages sent to a destination the peer offered, with no
    /// request to send (`rdma/engine/offers.rs`).
    pub offered_sends: u64,
    /// Peers declared dead by keepalive.
    pub keepalive_failures: u64,
    /// Engines that failed (any reason).
    pub engines_failed: u64,
    /// Most bytes one engine had posted and not completed at once.
    pub peak_in_flight_bytes: u64,
    /// Receiver-not-ready events on this transport's devices (SENDs that
    /// found no receive posted; 0 with dedicated receive queues, where
    /// credits prevent them), where the provider counts them.
    pub rnr_events: u64,
    /// Receives posted on the I/O threads' shared receive queues now (0
    /// without them; at most `io_threads * srq_depth` per rail, below it while
    /// applications are slow to read).
    pub shared_receives_posted: u64,
    /// Rounds the I/O drivers ran (each takes commands and completions,
    /// then visits the engines with work).
    pub io_rounds: u64,
    /// Engines those rounds visited: per round, about the engines with
    /// work, however many are open.
    pub engine_visits: u64,
    /// Asynchronous events the devices reported (QP or CQ failed, port
    /// down, device failed; see `verbs/events.rs`).
    pub async_events: u64,
    /// Rails whose port is down now (they take no new connection).
    pub rails_down: u64,
    /// Chunks of large messages handed to another rail's queue pair
    /// (striping, `rdma/engine/stripes.rs`).
    pub stripe_chunks: u64,
    /// Of those, chunks the other rail did not write (it failed), written
    /// again by the message's own queue pair.
    pub stripe_redone: u64,
    /// Bytes written for messages of another rail's queue pair (the
    /// chunks this rail took).
    pub striped_bytes: u64,
}
