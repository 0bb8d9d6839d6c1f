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
    Memory(String),
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
    /// The RDMA device, queue pair or engine failed.
    #[error("rdma: {0}")]
    Rdma(String),
    /// The connection is closed (locally or by a previous error).
    #[error("connection closed")]
    Closed,
}

impl From<tessera_config::ConfigError> for TransportError {
    fn from(err: tessera_config::ConfigError) -> Self {
        TransportError::Config(Box::new(err))
    }
}
