//! The verbs layer under the RDMA engine: a small provider trait over RC
//! queue pairs, and its providers.
//!
//! The engine (a later step of the RDMA transport) is written against
//! [`Device`], [`CompletionQueue`] and [`QueuePair`] only. Two providers
//! implement them:
//!
//! - `soft` ([`soft::SoftFabric`]): a software RNIC with the semantics the
//!   engine relies on — SEND consumes a posted receive (none posted is a
//!   receiver-not-ready error, counted), WRITE and WRITE_WITH_IMM land in the
//!   peer's registered memory after rkey, access and bounds checks,
//!   completions come per QP in posting order, unsignalled work requests
//!   complete silently, a QP in error flushes what is outstanding, each QP
//!   state allows only what real providers allow in it ([`QpState`]) — and
//!   seeded fault injection; between threads of one process and between
//!   processes of one host (shared memory).
//! - `ibverbs` ([`ibverbs::IbvDevice`], rdma-sys over libibverbs, cargo
//!   feature `ibverbs`, on by default): real RNICs and Soft-RoCE.
//!
//! The types here are plain data mirroring `ibv_send_wr`, `ibv_recv_wr`,
//! `ibv_wc` and the QP attributes exchanged at connection setup, so a real
//! provider maps them one to one.

pub mod events;
#[cfg(feature = "ibverbs")]
pub mod ibverbs;
pub mod limits;
pub mod memlock;
pub mod notify;
pub mod port;
pub mod sim;
pub mod soft;

pub use events::{AsyncEvent, EventHandler, EventWatch};
pub use limits::DeviceLimits;
pub use port::{GidType, LinkLayer};

use std::sync::Arc;

use crate::pool::RegistrationHook;

/// What a connection setup exchanges about a queue pair (out of band).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpEndpoint {
    /// Queue pair number.
    pub qpn: u32,
    /// Local identifier (InfiniBand) or 0 (RoCE).
    pub lid: u16,
    /// Global identifier (RoCE address).
    pub gid: [u8; 16],
    /// Initial packet sequence number.
    pub psn: u32,
    /// Which device (fabric node) the QP lives on; the soft provider's way
    /// of routing, 0 for real devices.
    pub node: u64,
    /// The active MTU of its port, in bytes (the path takes the smaller of
    /// both sides': [`port::agree`]).
    pub mtu: u32,
    /// The link its port runs on.
    pub link_layer: LinkLayer,
    /// The type of its GID (RoCE v1 or v2; InfiniBand ports say v1).
    pub gid_type: GidType,
}

/// A scatter/gather entry: `len` bytes at `addr` in memory registered with
/// `lkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    /// First byte.
    pub addr: usize,
    /// Bytes.
    pub len: u32,
    /// Local key of the region holding them.
    pub lkey: u32,
}

/// A send-queue operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// Two-sided: consumes a receive posted by the peer.
    Send,
    /// One-sided write into `remote_addr` (registered by the peer with `rkey`).
    Write {
        /// Destination address in the peer's memory.
        remote_addr: usize,
        /// The peer's remote key for it.
        rkey: u32,
    },
    /// A write that also consumes a peer receive and delivers `imm`.
    WriteWithImm {
        /// Destination address in the peer's memory.
        remote_addr: usize,
        /// The peer's remote key for it.
        rkey: u32,
        /// The immediate value the peer's completion carries.
        imm: u32,
    },
    /// Binds the type-2 memory window `window` to this QP over `len` bytes
    /// at `addr` of the region `region` (registered with
    /// [`crate::pool::Access::Windows`]), remotely writable under `rkey`
    /// (the window's [`MemoryWindow::next_rkey`]): from here on, and
    /// until it is invalidated, the peer of this QP — and nobody else —
    /// may write those bytes and no others (`IBV_WR_BIND_MW`). Gathers
    /// nothing; puts nothing on the wire.
    BindWindow {
        /// The window ([`MemoryWindow::handle`]).
        window: u64,
        /// Its key for this binding.
        rkey: u32,
        /// First byte the peer may write.
        addr: usize,
        /// Bytes it may write.
        len: usize,
        /// The region the bytes lie in: its local key...
        lkey: u32,
        /// ...and its provider handle ([`crate::pool::RegisteredRegion::handle`]).
        region: u64,
    },
    /// Invalidates the window bound under `rkey` (`IBV_WR_LOCAL_INV`): once
    /// this completes, no write through it can land any more.
    Invalidate {
        /// The key of the binding to end.
        rkey: u32,
    },
}

/// A send work request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendWr {
    /// Returned in the completion.
    pub wr_id: u64,
    /// What to do.
    pub op: SendOp,
    /// The local data, gathered in order.
    pub sges: Vec<Sge>,
    /// Whether a successful completion is reported (errors always are).
    pub signaled: bool,
}

/// A receive work request: one buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvWr {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Where an incoming SEND lands.
    pub sge: Sge,
}

/// How a work request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum WcStatus {
    /// Done.
    Success,
    /// A local gather/scatter entry is not registered memory (bad lkey or
    /// out of bounds).
    LocalProtectionError,
    /// An incoming message is longer than the posted receive buffer.
    LocalLengthError,
    /// The peer refused a one-sided access (rkey, access right or bounds).
    RemoteAccessError,
    /// The peer had no receive posted (receiver not ready).
    ReceiverNotReady,
    /// The peer stopped answering (transport retries exhausted).
    RetryExceeded,
    /// The peer could not complete the operation (for example its receive
    /// buffer was too small).
    RemoteOperationError,
    /// Flushed because the QP is in the error state.
    Flushed,
    /// Another provider status (the raw `ibv_wc_status`), kept as it came.
    Other(u32),
}

/// What kind of work a completion is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcKind {
    /// A send-queue work request.
    Send,
    /// A receive consumed by a SEND.
    Recv,
    /// A receive consumed by a WRITE_WITH_IMM (carries the immediate).
    RecvWithImm(u32),
    /// Not known: the completion is an error, whose opcode real providers
    /// leave undefined (as its length); the work request is told by its
    /// `wr_id` alone. Providers report every error completion so.
    Unknown,
}

/// A work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The work request's id.
    pub wr_id: u64,
    /// Outcome.
    pub status: WcStatus,
    /// Kind.
    pub kind: WcKind,
    /// Bytes received (successful receives only).
    pub byte_len: u32,
    /// The queue pair it belongs to.
    pub qpn: u32,
    /// The provider's own code for an error (`ibv_wc.vendor_err`; 0 on
    /// success and where the provider has none).
    pub vendor_err: u32,
}

/// Queue pair states (RESET -> INIT -> RTR -> RTS, or ERROR), with what
/// real providers allow in each (rxe and hns check it; mlx5 does not check
/// everything, which is no licence): receives may be posted from INIT on,
/// sends only in RTS, and only a QP in RTR or RTS accepts what its peer
/// sends (a QP behind that drops it, and the sender's retries run out).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpState {
    /// Created: nothing may be posted.
    Reset,
    /// Initialised ([`QueuePair::init`]): receives may be posted.
    Init,
    /// Ready to receive: accepts the peer's traffic, cannot send yet.
    ReadyToReceive,
    /// Ready to send (connected).
    ReadyToSend,
    /// Failed: outstanding and new work requests are flushed.
    Error,
}

/// Queue sizes of a QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Send queue depth: work requests posted and not yet completed.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// Scatter/gather entries per work request.
    pub max_sge: u32,
    /// Times a SEND that finds no receive posted is retried (after a short
    /// wait) before it fails with receiver-not-ready; 7 means without end
    /// (the InfiniBand convention). 0 with dedicated receive queues, where
    /// credits make an RNR impossible and one that happens is a bug to
    /// surface; 7 on a shared receive queue, which has no per-peer bound.
    pub rnr_retry: u8,
}

impl Default for QpCaps {
    fn default() -> Self {
        Self {
            max_send_wr: 32,
            max_recv_wr: 64,
            max_sge: 4,
            rnr_retry: 0,
        }
    }
}

/// A shared receive queue (§6.2.2): receives that any QP created on it
/// consumes.
pub trait SharedReceiveQueue: Send + Sync {
    /// Posts a list of receive work requests with one doorbell.
    fn post_recv(&self, wrs: &[RecvWr]) -> Result<(), VerbsError>;
    /// The queue as `Any` (see [`CompletionQueue::into_any`]).
    fn into_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync>;
}

/// Errors of the verbs layer (returned by calls, as opposed to the
/// statuses of work completions).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum VerbsError {
    /// No device can be opened (no RNIC, or no kernel support).
    #[error("no RDMA device: {0}")]
    NoDevice(String),
    /// More work requests than the queue has room for.
    #[error("{queue} queue full: {posted} posted of {depth}")]
    QueueFull {
        /// `send` or `recv`.
        queue: &'static str,
        /// Outstanding requests, including this post.
        posted: u32,
        /// The queue's depth.
        depth: u32,
    },
    /// A work request is malformed (too many SGEs, empty SEND gather list...).
    #[error("invalid work request: {0}")]
    InvalidRequest(String),
    /// The peer QP does not exist (or is not reachable).
    #[error("no queue pair {qpn} on node {node}")]
    UnknownPeer {
        /// The node asked for.
        node: u64,
        /// The QP number asked for.
        qpn: u32,
    },
    /// A post stopped at a work request (`ibv_post_send`'s and
    /// `ibv_post_recv`'s `bad_wr`): the first `posted` of the list were
    /// posted and will complete, the rest were not. The caller owns the
    /// difference; the engine puts the QP in error ([`QueuePair::fail`]).
    #[error("posting {queue} work requests failed after {posted}: {}", std::io::Error::from_raw_os_error(*errno))]
    PostFailed {
        /// `send` or `recv`.
        queue: &'static str,
        /// Work requests of the list that were posted.
        posted: u32,
        /// The errno the provider returned.
        errno: i32,
    },
    /// Two ports that cannot talk to each other ([`port::agree`]).
    #[error("the peer's port does not match: {what} here {local}, there {remote}")]
    PathMismatch {
        /// What differs.
        what: &'static str,
        /// This side's.
        local: String,
        /// The peer's.
        remote: String,
    },
    /// A RoCE port without a usable GID table entry (`index`: the one
    /// configured, empty).
    #[error("no usable GID{}: set rdma.gid_index to a filled entry (`show_gids`, or /sys/class/infiniband/<device>/ports/<port>/gids)", .index.map(|i| format!(" at index {i}")).unwrap_or_default())]
    NoGid {
        /// The configured index, if one was.
        index: Option<u8>,
    },
    /// More than the device can hold ([`DeviceLimits`]).
    #[error("{asked} {what} asked for, the device has at most {max}")]
    OverLimit {
        /// What was asked for, with the limit's name.
        what: &'static str,
        /// How many.
        asked: u32,
        /// The device's limit.
        max: u32,
    },
    /// The operation needs another QP state.
    #[error("queue pair {qpn} is in state {state:?}")]
    WrongState {
        /// The QP.
        qpn: u32,
        /// Its state.
        state: QpState,
    },
}

/// A completion queue.
pub trait CompletionQueue: Send + Sync {
    /// Moves up to `max` completions into `out`; returns how many.
    fn poll(&self, out: &mut Vec<WorkCompletion>, max: usize) -> usize;
    /// The queue as `Any`, so that a provider can recover its own type from
    /// the trait object it is handed back in [`Device::create_qp`].
    fn into_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync>;
    /// Event mode, step one: asks to be woken by the next completion or
    /// [`CompletionQueue::wake`]. The caller then polls once more and calls
    /// [`CompletionQueue::wait`] only if that found nothing, so no
    /// completion slips between the last poll and the sleep.
    fn arm(&self) {}
    /// Event mode, step two: sleeps until a completion arrives, `wake` is
    /// called, or `timeout` passes (spurious returns allowed).
    fn wait(&self, timeout: std::time::Duration) {
        std::thread::sleep(timeout.min(std::time::Duration::from_micros(50)));
    }
    /// Wakes a thread sleeping in `wait` (from any thread).
    fn wake(&self) {}
    /// Switches the queue to notification through file descriptors, for a
    /// driver inside an async runtime: from then on, after [`arm`], the
    /// next completion or [`wake`] makes one of the returned descriptors
    /// readable, instead of ending a [`wait`]. The descriptors are
    /// non-blocking duplicates, for the caller to keep (see
    /// [`notify::register`]). `None`: the provider cannot (the queue stays
    /// as it was).
    ///
    /// [`arm`]: CompletionQueue::arm
    /// [`wake`]: CompletionQueue::wake
    /// [`wait`]: CompletionQueue::wait
    fn notify_by_fd(&self) -> Option<Vec<std::os::fd::OwnedFd>> {
        None
    }
    /// After a descriptor of [`notify_by_fd`](CompletionQueue::notify_by_fd)
    /// turned readable: consumes what must be consumed (the ibverbs
    /// channel's events), never blocking, and disarms. The caller watches
    /// the descriptors edge-triggered (tokio's reactor does), so a
    /// descriptor that stays readable signals again on its next event.
    fn clear_notification(&self) {}
}

/// An RC queue pair.
///
/// Call order, as verbs demand it: [`Device::create_qp`] (RESET), then
/// [`QueuePair::init`] (INIT), then the first receives
/// ([`QueuePair::post_recv`]) so that they are up before the peer learns of
/// the QP, then [`QueuePair::connect`] (RTR, RTS), then sends. A call out of
/// that order fails with [`VerbsError::WrongState`].
pub trait QueuePair: Send + Sync {
    /// Its number.
    fn qpn(&self) -> u32;
    /// What the peer needs to connect to it.
    fn endpoint(&self) -> QpEndpoint;
    /// RESET -> INIT: from here receives may be posted.
    fn init(&self) -> Result<(), VerbsError>;
    /// Connects to `remote` (INIT -> RTR -> RTS).
    fn connect(&self, remote: &QpEndpoint) -> Result<(), VerbsError>;
    /// Posts a list of send work requests with one doorbell.
    fn post_send(&self, wrs: &[SendWr]) -> Result<(), VerbsError>;
    /// Posts a list of receive work requests with one doorbell.
    fn post_recv(&self, wrs: &[RecvWr]) -> Result<(), VerbsError>;
    /// The current state.
    fn state(&self) -> QpState;
    /// Moves the QP to ERROR (`ibv_modify_qp` to `IBV_QPS_ERR`): everything
    /// outstanding completes as flushed, and so does anything posted later.
    /// Returns at once: a peer's write already under way may still land
    /// (see [`quiesce`](QueuePair::quiesce)).
    fn fail(&self) -> Result<(), VerbsError>;
    /// After [`fail`](QueuePair::fail): returns once no remote write can
    /// land in memory this QP exposes (a caller about to hand such memory
    /// on waits here). The soft NIC waits, up to a bound, for peers still
    /// copying in; a device's QP in ERROR takes no more packets, so the
    /// default returns at once.
    fn quiesce(&self) {}
}

/// A type-2 memory window (`ibv_alloc_mw(IBV_MW_TYPE_2)`): bound with
/// [`SendOp::BindWindow`] on one QP to one byte range of a registered
/// region, it lets that QP's peer write exactly there, until
/// [`SendOp::Invalidate`]. Each binding has a fresh key (a new tag: 8 bits
/// on RNICs, so tags come round again after 256 bindings), and a key works
/// only on the QP the window is bound to, for its current range.
///
/// Dropping it deallocates the window, which ends any binding.
pub trait MemoryWindow: Send + Sync + std::fmt::Debug {
    /// What [`SendOp::BindWindow`] names it by.
    fn handle(&self) -> u64;
    /// Its key as allocated (bound to nothing).
    fn rkey(&self) -> u32;
    /// The key for its next binding after one under `rkey`: same window,
    /// another tag (`ibv_inc_rkey`). Pure: it does not bind anything.
    fn next_rkey(&self, rkey: u32) -> u32;
}

/// An opened RNIC (context and protection domain).
pub trait Device: Send + Sync {
    /// A name for logs.
    fn name(&self) -> &str;
    /// What the device can hold; every create call stays within it.
    fn limits(&self) -> DeviceLimits;
    /// The hook that registers pool memory with this device's protection
    /// domain (give it to the transport's pools).
    fn registration_hook(&self) -> Arc<dyn RegistrationHook>;
    /// A completion queue of `depth` entries.
    fn create_cq(&self, depth: u32) -> Result<Arc<dyn CompletionQueue>, VerbsError>;
    /// An RC queue pair whose completions go to `send_cq` and `recv_cq`.
    fn create_qp(
        &self,
        send_cq: Arc<dyn CompletionQueue>,
        recv_cq: Arc<dyn CompletionQueue>,
        caps: QpCaps,
    ) -> Result<Arc<dyn QueuePair>, VerbsError>;
    /// A shared receive queue of `depth` receives.
    fn create_srq(&self, depth: u32) -> Result<Arc<dyn SharedReceiveQueue>, VerbsError> {
        let _ = depth;
        Err(VerbsError::InvalidRequest(format!(
            "{} has no shared receive queues",
            self.name()
        )))
    }
    /// An RC queue pair that takes its receives from `srq`.
    fn create_qp_on_srq(
        &self,
        send_cq: Arc<dyn CompletionQueue>,
        recv_cq: Arc<dyn CompletionQueue>,
        srq: Arc<dyn SharedReceiveQueue>,
        caps: QpCaps,
    ) -> Result<Arc<dyn QueuePair>, VerbsError> {
        let _ = (send_cq, recv_cq, srq, caps);
        Err(VerbsError::InvalidRequest(format!(
            "{} has no shared receive queues",
            self.name()
        )))
    }
    /// Hands the device's asynchronous events to `handler` until the
    /// returned watch is dropped.
    fn watch_events(&self, handler: EventHandler) -> Result<EventWatch, VerbsError>;
    /// Receiver-not-ready events seen by this device (SENDs that found no
    /// receive posted), where the provider counts them.
    fn rnr_events(&self) -> Option<u64> {
        None
    }
    /// Whether the device's port is up now, as far as the provider can
    /// tell (default: yes). A transport reads it once its event watch is in
    /// place, so that a port that went down before is not missed.
    fn port_active(&self) -> bool {
        true
    }
    /// The NUMA node the device hangs off, where the host says (default:
    /// none; `rdma/topology.rs` pins the rail's I/O threads there).
    fn numa_node(&self) -> Option<u32> {
        None
    }
    /// A type-2 memory window in the device's protection domain (see
    /// [`DeviceLimits::memory_windows`]).
    fn alloc_window(&self) -> Result<Arc<dyn MemoryWindow>, VerbsError> {
        Err(VerbsError::InvalidRequest(format!(
            "{} has no type-2 memory windows",
            self.name()
        )))
    }
}

/// Recovers a provider's own completion queue type from a trait object
/// handed back to it (in [`Device::create_qp`]).
pub(crate) fn downcast_srq<T: std::any::Any + Send + Sync>(
    srq: Arc<dyn SharedReceiveQueue>,
) -> Result<Arc<T>, VerbsError> {
    srq.into_any()
        .downcast::<T>()
        .map_err(|_| VerbsError::InvalidRequest("shared receive queue of another provider".into()))
}

/// Recovers a provider's own completion queue type from a trait object
/// handed back to it (in [`Device::create_qp`]).
pub(crate) fn downcast_cq<T: std::any::Any + Send + Sync>(
    cq: Arc<dyn CompletionQueue>,
) -> Result<Arc<T>, VerbsError> {
    cq.into_any()
        .downcast::<T>()
        .map_err(|_| VerbsError::InvalidRequest("completion queue of another provider".into()))
}
