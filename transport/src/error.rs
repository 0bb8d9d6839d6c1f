//! The transport's errors: what sending, receiving, listening and
//! connecting return ([`TransportError`]) and what the RDMA path adds
//! ([`RdmaError`]).

use std::io;

/// Errors of the transport layer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// Establishing a connection to `addr` failed.
    #[error("connect to {addr}: {source}")]
    Connect {
        /// The address that was dialled.
        addr: String,
        /// The underlying I/O error.
        source: io::Error,
    },
    /// Binding a listener on `addr` failed.
    #[error("listen on {addr}: {source}")]
    Listen {
        /// The address that was bound.
        addr: String,
        /// The underlying I/O error.
        source: io::Error,
    },
    /// An I/O error on an established connection.
    #[error("transport I/O error: {0}")]
    Io(#[from] io::Error),
    /// A peer announced (or a caller tried to send) a message larger than the
    /// configured limit. The connection is closed: the frame boundary is lost.
    #[error("message of {len} bytes exceeds the maximum message size of {max} bytes")]
    MessageTooLarge {
        /// The announced or attempted size.
        len: u64,
        /// The configured limit (`max_message_size`).
        max: u64,
    },
    /// An accepted connection broke one of its inbound limits (a message
    /// not finished in time, nothing sent after connecting, idle too long)
    /// and is closed.
    #[error("connection closed by an inbound limit: {0}")]
    Stalled(crate::inbound::Stall),
    /// The peer closed the connection in the middle of a message.
    #[error(
        "peer closed the connection in the middle of a {expected}-byte message ({received} bytes received)"
    )]
    Truncated {
        /// Size of the frame being received.
        expected: u64,
        /// Bytes of it that arrived before the close.
        received: u64,
    },
    /// No pool memory could be had for a message.
    #[error("no buffer memory: {0}")]
    Memory(#[from] crate::pool::PoolError),
    /// The configuration is invalid (boxed: rare, and it keeps every
    /// transport result small).
    #[error(transparent)]
    Config(Box<tessera_config::ConfigError>),
    /// No I/O thread's completion queue has room for another QP's
    /// completions (see `rdma/cq_budget.rs`).
    #[error(
        "no room for another RDMA connection: each of the {io_threads} I/O threads' completion \
         queues ({cq_depth} entries) is taken, and a connection needs {need}; raise rdma.cq_depth \
         (up to the device's max_cqe) or rdma.io_threads, or lower the queue depths"
    )]
    CompletionQueuesFull {
        /// I/O threads (one CQ each).
        io_threads: usize,
        /// Entries of each CQ.
        cq_depth: u32,
        /// Entries one more connection needs.
        need: u32,
    },
    /// The locked-memory limit is below what the RDMA transport pins.
    #[error(transparent)]
    LockedMemory(#[from] crate::verbs::memlock::LockedMemoryError),
    /// The RDMA device, queue pair, handshake or engine failed: which,
    /// and why, as a type ([`RdmaError`]; boxed, as it is large and rare,
    /// to keep every transport result small).
    #[error("rdma: {0}")]
    Rdma(Box<RdmaError>),
    /// TLS could not be set up (certificates, key, CA) or a handshake
    /// failed (boxed: rare).
    #[error(transparent)]
    Tls(Box<crate::tls::TlsError>),
    /// The connection is closed (locally or by a previous error).
    #[error("connection closed")]
    Closed,
}

impl From<crate::tls::TlsError> for TransportError {
    fn from(err: crate::tls::TlsError) -> Self {
        TransportError::Tls(Box::new(err))
    }
}

impl From<RdmaError> for TransportError {
    fn from(err: RdmaError) -> Self {
        TransportError::Rdma(Box::new(err))
    }
}

impl TransportError {
    /// The error for an RDMA failure.
    pub(crate) fn rdma_error(err: impl Into<RdmaError>) -> Self {
        TransportError::Rdma(Box::new(err.into()))
    }

    /// The RDMA failure, if this is one.
    pub fn rdma(&self) -> Option<&RdmaError> {
        match self {
            TransportError::Rdma(err) => Some(err),
            _ => None,
        }
    }
}

impl From<tessera_config::ConfigError> for TransportError {
    fn from(err: tessera_config::ConfigError) -> Self {
        TransportError::Config(Box::new(err))
    }
}

/// Why the RDMA side of the transport failed. Callers tell a dead peer
/// ([`crate::rdma::engine::EngineError::PeerDead`]) from a flushed or
/// failed work request (`Completion { status, .. }`) from a device event
/// or a refused handshake by matching on it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RdmaError {
    /// A verbs call failed (device, queue, post).
    #[error(transparent)]
    Verbs(#[from] crate::verbs::VerbsError),
    /// The connection's engine failed (the peer, a work completion, the
    /// protocol, the device).
    #[error(transparent)]
    Engine(#[from] crate::rdma::engine::EngineError),
    /// The connection handshake was refused.
    #[error(transparent)]
    Handshake(#[from] HandshakeError),
    /// The I/O thread serving the connection has stopped.
    #[error("the RDMA I/O thread stopped")]
    ThreadStopped,
    /// The queue pair to the peer has failed and is gone.
    #[error("the queue pair to this peer failed")]
    EngineGone,
    /// No engine to the address could be set up (it kept going away).
    #[error("could not set up an RDMA connection to {addr}")]
    NoConnection {
        /// The address.
        addr: String,
    },
    /// Every rail's port is down: no RDMA connection can be made (the RPC
    /// layer then falls back to TCP).
    #[error("the port of every RDMA rail ({rails}) is down")]
    RailsDown {
        /// Rails the transport has.
        rails: usize,
    },
    /// The transport runs without an RDMA device (TCP, or `auto` without
    /// one).
    #[error("this transport has no RDMA device")]
    NoDevice,
    /// The build has no ibverbs provider (cargo feature `ibverbs`).
    #[error("this build has no ibverbs provider")]
    NoProvider,
    /// A receive buffer lies outside registered memory.
    #[error("a receive buffer lies outside the registered pool")]
    BufferOutsidePool,
    /// `rdma.polling = "runtime"` drives completion queues from the tokio
    /// runtime, and the transport was started outside one.
    #[error(
        "rdma.polling = \"runtime\" needs a tokio runtime with I/O enabled: start the transport inside one, or use \"event\""
    )]
    NoRuntime,
    /// `rdma.polling = "runtime"` and the device's completion queues cannot
    /// notify through a file descriptor.
    #[error(
        "rdma.polling = \"runtime\": this device's completion queues cannot notify through a file descriptor; use \"event\""
    )]
    NoNotification,
}

/// Why an RDMA connection handshake was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// The peer does not speak the Tessera RDMA handshake.
    #[error("peer does not speak the Tessera RDMA handshake")]
    NotTessera,
    /// The peer speaks another version of the protocol.
    #[error("peer speaks RDMA protocol version {peer}, this build {ours}")]
    Version {
        /// The peer's.
        peer: u16,
        /// This build's.
        ours: u16,
    },
    /// The hello names a link layer this build does not know.
    #[error("peer's hello names link layer {0}")]
    LinkLayer(u8),
    /// The accepting side never heard the dialer confirm.
    #[error("peer did not confirm the RDMA connection")]
    NotConfirmed,
    /// The hello names a GID type this build does not know.
    #[error("peer's hello names GID type {0}")]
    GidType(u8),
    /// The rail the dialer chose has its port down here: it tries its
    /// next rail.
    #[error("rail {rail} of the accepting side has its port down")]
    RailDown {
        /// The rail the hello named.
        rail: u8,
    },
}
