//! The RDMA engine (§5.4, §6.1, §6.3, §7.2): one per RC queue pair, as a
//! sans-IO state machine carrying many logical sockets.
//!
//! The engine takes messages to send ([`Engine::send`]), work completions
//! ([`Engine::handle_completion`]) and the passing of time
//! ([`Engine::handle_timeout`]); it emits batches of work requests to post
//! ([`Engine::poll_transmit`], [`Engine::poll_recv_post`]), events
//! ([`Engine::poll_event`]) and when it next needs the time
//! ([`Engine::poll_timeout`]). It never calls the verbs itself and never
//! reads a clock, so tests drive it step by step.
//!
//! - **Sockets** (§6.1, QP multiplexing): logical connections on one QP.
//!   The dialer opens them ([`Engine::open_socket`]); the peer learns of
//!   each from an `Open` control message ([`EngineEvent::Opened`]) and
//!   answers `Accept` or `Refuse` (nobody listens); the opener sends only
//!   after `Accept`. Closing one half sends `Close` after its last message
//!   and disturbs no other socket.
//! - **Small messages** (at most `small_message_limit` bytes, and what the
//!   peer's receive buffers and the window hold) go by SEND: the control
//!   header and the message's own buffers as scatter/gather entries, into a
//!   receive buffer that then *becomes* the received message.
//! - **Large messages** (§5.3.2): a request to send (RTS) with the size; the
//!   receiver allocates the destination from its receive pool and answers
//!   clear to send (CTS) with address and rkey; the sender WRITEs fragments
//!   of at most `fragment_size` bytes to consecutive addresses, the last as
//!   WRITE_WITH_IMM carrying the message id. The receiver learns of the
//!   message from that completion alone and hands the buffer on as is. A
//!   socket asks for up to `rts_ahead` destinations ahead, so round trips
//!   overlap with writing.
//! - **Fragment scheduler**: each socket queues its messages; whenever the
//!   ring has room, sockets with work take turns, round robin, one fragment
//!   (a SEND, an RTS or one WRITE of at most S bytes) per turn. Between two
//!   turns of one socket, each other socket sends at most one fragment: a
//!   small message waits behind at most (n−1)·S bytes of n−1 other
//!   sockets, never behind a whole large message. Engine-level control
//!   messages (CTS, credit returns, keepalives) go first; they are tiny.
//! - **Order**: per socket, messages are delivered in the order sent: a
//!   socket sends a small message or `Close` only once its large messages
//!   are fully written, and RC delivers in posting order.
//! - **Receive credits** ([`ReceiveCredits`]): every SEND and
//!   WRITE_WITH_IMM spends one; the last credit is kept for CTS and credit
//!   returns.
//! - **Send window** ([`SendWindow`], §6.3): bytes posted and not completed
//!   stay within the window, checked before each fragment; fragments and
//!   small messages are capped to the window's maximum so that one always
//!   fits.
//! - **Keepalive** (§7.2): every `interval` the engine WRITEs a growing
//!   sequence number into an 8-byte slot the peer registered (a one-sided
//!   write: it needs no receive credit, so a peer whose application has
//!   stopped reading still proves it is alive). If the engine's own slot
//!   does not change for `timeout`, the peer is dead: the engine fails with
//!   [`EngineError::PeerDead`].

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::control::{ControlHeader, ControlKind, HEADER_LEN};
use super::credits::ReceiveCredits;
use super::ring::{MAX_BATCH, RingEntry, WorkRequestRing};
use super::window::{SendWindow, WindowConfig};
use super::windows::Windows;
use super::wr_id::{self, WrKind};
use crate::Message;
use crate::inbound::{InboundBudget, InboundPermit};
use crate::pool::{Pool, PoolBuf, lookup};
use crate::verbs::{RecvWr, SendOp, SendWr, Sge, WcKind, WcStatus, WorkCompletion};

/// A logical socket on an engine.
pub type SocketId = u32;

/// Keepalive settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeepaliveConfig {
    /// How often the sequence number is written.
    pub interval: Duration,
    /// How long the peer's number may stand still before it is dead.
    pub timeout: Duration,
}

/// Settings of an engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineConfig {
    /// Send queue depth (the ring's size). Default 32 (the paper's).
    pub send_queue_depth: u32,
    /// Receive queue depth d; credits are returned in batches of d/2.
    /// Default 64.
    pub recv_queue_depth: u32,
    /// Largest message sent by SEND; larger ones use RTS/CTS and WRITEs.
    /// Default 8 KiB.
    pub small_message_limit: usize,
    /// Largest WRITE fragment S. Default 64 KiB.
    pub fragment_size: usize,
    /// Scatter/gather entries per work request. Default 4.
    pub max_sge: u32,
    /// Largest message accepted from the peer. Default 64 MiB.
    pub max_message_size: u64,
    /// The send window. Default off.
    pub window: WindowConfig,
    /// Keepalive; `None` turns it off. Default off (the transport turns it
    /// on from its config).
    pub keepalive: Option<KeepaliveConfig>,
    /// Large messages per socket whose destination is asked for ahead of
    /// writing. Default 4.
    pub rts_ahead: usize,
    /// Receives come from a shared receive queue the owner runs (handed in
    /// with [`Engine::handle_shared_receive`]); the engine posts none and
    /// returns no credits. Default false.
    pub shared_receives: bool,
    /// Bytes of large messages the peer may have been granted (CTS sent,
    /// last WRITE not yet completed) at once. An RTS beyond waits, ungranted
    /// and unallocated, until earlier ones complete (the peer's socket
    /// waits for its CTS: backpressure, as TCP's flow control is); the
    /// waiting RTS are bounded by [`MAX_WAITING_RTS`], past which the
    /// engine fails. Default 256 MiB (`inbound.max_connection_bytes`); at
    /// least `max_message_size`, so every message can be granted alone.
    pub max_granted_bytes: u64,
}

/// Requests to send an engine keeps waiting for budget before it fails:
/// more than any well-behaved peer has outstanding (each socket asks at
/// most `rts_ahead` ahead), few enough that a hostile one costs little
/// memory (16 bytes each).
pub const MAX_WAITING_RTS: usize = 16_384;

/// How soon a request to send waiting for the server's budget is tried
/// again when nothing else wakes the engine: 1 ms, a fraction of a large
/// message's transfer.
const INBOUND_RETRY: Duration = Duration::from_millis(1);

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            send_queue_depth: 32,
            recv_queue_depth: 64,
            small_message_limit: 8 << 10,
            fragment_size: 64 << 10,
            max_sge: 4,
            max_message_size: 64 << 20,
            window: WindowConfig::default(),
            keepalive: None,
            rts_ahead: 4,
            shared_receives: false,
            max_granted_bytes: 256 << 20,
        }
    }
}

/// Which end of the connection an engine is (socket ids of the acceptor
/// have the high bit set, so both ends may open sockets).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Dialed the connection.
    Dialer,
    /// Accepted it.
    Acceptor,
}

/// What the peer told at connection setup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerInfo {
    /// Receives it has posted (the initial credits).
    pub recv_depth: u32,
    /// Bytes of each of its receive buffers.
    pub recv_buffer: u32,
    /// Its keepalive slot (address, rkey), if it runs keepalive.
    pub keepalive_slot: Option<(u64, u32)>,
    /// Its receives come from a shared receive queue (no credits).
    pub shared_receives: bool,
}

/// Why an engine stopped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// A work request failed; the queue pair is in error.
    #[error("work request failed: {status:?} (vendor error {vendor_err:#x})")]
    Completion {
        /// How it ended.
        status: WcStatus,
        /// The provider's code for it.
        vendor_err: u32,
    },
    /// The peer broke the protocol.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// No pool memory.
    #[error("no buffer memory: {0}")]
    Memory(#[from] crate::pool::PoolError),
    /// A buffer the NIC must reach is not registered memory (`what`).
    #[error("{0} is not in registered memory")]
    Unregistered(&'static str),
    /// The engine has failed already (an operation after its failure).
    #[error("the engine has failed")]
    Failed,
    /// A message to send is larger than the limit.
    #[error("message of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// Its size.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The socket is not open (never opened, or closed by either end).
    #[error("socket {0:#x} is not open")]
    SocketClosed(SocketId),
    /// The peer's keepalive stopped.
    #[error("peer dead: no keepalive for {0:?}")]
    PeerDead(Duration),
    /// The peer closed its handshake connection (it went away).
    #[error("peer closed the connection")]
    PeerClosed,
    /// The device reported an event that ends this engine's QP
    /// ([`Engine::handle_device_event`]).
    #[error("the device reported {0:?}")]
    Device(crate::verbs::AsyncEvent),
    /// Closed by its owner: no socket is left on it, and it is not shared
    /// ([`Engine::handle_unused`]). Not a failure.
    #[error("closed: no socket left on it")]
    Unused,
    /// Posting work requests failed ([`Engine::handle_post_error`]).
    #[error("posting to the queue pair failed: {0}")]
    Post(crate::verbs::VerbsError),
    /// The engine's code panicked (a bug); the I/O thread failed it alone.
    #[error("the engine panicked (a bug); this connection is failed, the others are not")]
    Panicked,
}

/// What the engine has for its owner.
#[derive(Debug)]
pub enum EngineEvent {
    /// The peer opened a socket: answer with [`Engine::accept_socket`] or
    /// [`Engine::refuse_socket`].
    Opened(SocketId),
    /// The peer accepted a socket this end opened: it may carry messages.
    Accepted(SocketId),
    /// The peer refused a socket this end opened (nobody listens).
    Refused(SocketId),
    /// A whole message arrived on a socket (in receive-pool memory).
    Message {
        /// The socket.
        socket: SocketId,
        /// The message.
        bytes: Bytes,
    },
    /// The peer closed its half of a socket (after its last message).
    Closed(SocketId),
    /// A message of the socket is wholly on its way (its last fragment
    /// queued for posting): room for one more in the socket's send queue.
    Sent(SocketId),
    /// The engine failed; nothing more will happen on it.
    Failed(EngineError),
}

/// Counters of an engine.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Messages sent by SEND.
    pub small_sent: u64,
    /// Messages sent by WRITEs.
    pub large_sent: u64,
    /// Messages received.
    pub received: u64,
    /// Payload bytes sent.
    pub bytes_sent: u64,
    /// Payload bytes received.
    pub bytes_received: u64,
    /// Times sending waited for credits.
    pub credit_stalls: u64,
    /// Times sending waited for room in the send window.
    pub window_stalls: u64,
    /// Most bytes posted and not yet completed at once.
    pub peak_in_flight_bytes: u64,
    /// Message parts copied into the send pool because they were not in
    /// memory registered with this engine's device.
    pub fallback_copies: u64,
    /// Explicit credit-return messages sent.
    pub credit_messages: u64,
    /// Keepalive writes sent.
    pub keepalives_sent: u64,
    /// Messages dropped because their socket was closed.
    pub orphan_messages: u64,
}

#[derive(Debug)]
struct Outgoing {
    parts: Vec<Bytes>,
    len: usize,
}

#[derive(Debug)]
enum Item {
    Message(Outgoing),
    Close,
}

#[derive(Debug)]
struct LargeSend {
    msg_id: u32,
    message: Outgoing,
    dest: Option<(u64, u32)>,
    offset: usize,
}

/// The sending half of a socket.
#[derive(Debug, Default)]
struct SocketTx {
    queue: VecDeque<Item>,
    large: VecDeque<LargeSend>,
    scheduled: bool,
}

#[derive(Debug)]
enum Control {
    Cts {
        msg_id: u32,
        addr: u64,
        rkey: u32,
    },
    /// Where the peer writes its keepalive (a window on our slot).
    Slot {
        addr: u64,
        rkey: u32,
    },
    Open(SocketId),
    Accept(SocketId),
    Refuse(SocketId),
    Keepalive,
}

/// What one socket's turn produced.
enum Turn {
    Fragment,
    Blocked,
    NoCredit,
    NoWindow,
    Done,
}

#[derive(Debug)]
struct Keepalive {
    config: KeepaliveConfig,
    slot: PoolBuf,
    peer_slot: Option<(u64, u32)>,
    seq: u64,
    next_send: Option<Instant>,
    last_seen: u64,
    last_advance: Instant,
}

/// One engine (see the module docs).
#[derive(Debug)]
pub struct Engine {
    /// The memory windows grants go through (none: the pool's own keys).
    /// First, so dropped first: a window still bound to a buffer when it
    /// is freed would keep its registration from going (ibverbs refuses
    /// to deregister memory a window is bound to).
    windows: Windows,
    config: EngineConfig,
    role: Role,
    send_pool: Pool,
    recv_pool: Pool,
    ring: WorkRequestRing,
    credits: ReceiveCredits,
    window: SendWindow,
    /// Largest small message the peer can take (its buffers, the window).
    small_limit: usize,
    /// Largest WRITE fragment (capped to the window).
    fragment_size: usize,
    control: VecDeque<Control>,
    sockets: HashMap<SocketId, SocketTx>,
    /// Sockets messages may arrive on.
    open: HashSet<SocketId>,
    active: VecDeque<SocketId>,
    awaiting_cts: HashMap<u32, SocketId>,
    incoming: HashMap<u32, (SocketId, PoolBuf, Option<InboundPermit>)>,
    /// Bytes of the buffers in `incoming` (granted to the peer).
    granted_bytes: u64,
    /// The server's budget of large inbound messages, for an engine of an
    /// accepted connection (see [`Engine::set_inbound_budget`]).
    inbound: Option<InboundBudget>,
    /// When a request to send waiting for the server's budget is tried
    /// again (set while one waits for it).
    inbound_retry: Option<Instant>,
    /// Requests to send over the budget, in arrival order: (message id,
    /// socket, size).
    waiting_rts: VecDeque<(u32, SocketId, u64)>,
    recv_slots: Vec<Option<PoolBuf>>,
    consumed_slots: Vec<usize>,
    spare: Vec<PoolBuf>,
    receives_posted: bool,
    peer_ready: bool,
    keepalive: Option<Keepalive>,
    /// Events held back, in order, until the invalidation of a large
    /// message's window (the work request id) has completed; what came
    /// after it waits behind it, so per-socket order holds.
    held: VecDeque<(Option<u64>, EngineEvent)>,
    events: VecDeque<EngineEvent>,
    next_msg_id: u32,
    next_socket: SocketId,
    failed: bool,
    stats: EngineStats,
    /// Every socket-level fragment queued: (socket, bytes). Tests check the
    /// scheduler's fairness bound against it.
    #[cfg(test)]
    pub(crate) fragment_log: Vec<(SocketId, usize)>,
}

const ACCEPTOR_BIT: SocketId = 1 << 31;
const KEEPALIVE_SLOT_LEN: usize = 8;

impl Engine {
    /// An engine; it posts its receives at once but sends nothing before
    /// [`Engine::peer_ready`].
    pub fn new(
        config: EngineConfig,
        send_pool: Pool,
        recv_pool: Pool,
        role: Role,
        now: Instant,
    ) -> Result<Self, EngineError> {
        let keepalive = match config.keepalive {
            Some(ka) => {
                let mut slot = Self::alloc(&recv_pool, KEEPALIVE_SLOT_LEN)?;
                slot.fill(0);
                Some(Keepalive {
                    config: ka,
                    slot,
                    peer_slot: None,
                    seq: 0,
                    next_send: None,
                    last_seen: 0,
                    last_advance: now,
                })
            }
            None => None,
        };
        let fragment_size = match config.window.max_bytes {
            0 => config.fragment_size,
            max => config.fragment_size.min(max).max(1),
        };
        let small_limit = match config.window.max_bytes {
            0 => config.small_message_limit,
            max => config
                .small_message_limit
                .min(max.saturating_sub(HEADER_LEN)),
        };
        let largest_request = fragment_size.max(small_limit + HEADER_LEN);
        let mut credits = ReceiveCredits::new(0, config.recv_queue_depth);
        if config.shared_receives {
            credits.set_own_shared();
        }
        Ok(Self {
            ring: WorkRequestRing::new(config.send_queue_depth as usize),
            credits,
            window: SendWindow::new(config.window, largest_request),
            small_limit,
            fragment_size,
            recv_slots: (0..config.recv_queue_depth).map(|_| None).collect(),
            role,
            send_pool,
            recv_pool,
            control: VecDeque::new(),
            sockets: HashMap::new(),
            open: HashSet::new(),
            active: VecDeque::new(),
            awaiting_cts: HashMap::new(),
            incoming: HashMap::new(),
            granted_bytes: 0,
            inbound: None,
            inbound_retry: None,
            waiting_rts: VecDeque::new(),
            consumed_slots: Vec::new(),
            spare: Vec::new(),
            receives_posted: false,
            peer_ready: false,
            keepalive,
            windows: Windows::default(),
            held: VecDeque::new(),
            events: VecDeque::new(),
            next_msg_id: 1,
            next_socket: 1,
            failed: false,
            stats: EngineStats::default(),
            #[cfg(test)]
            fragment_log: Vec::new(),
            config,
        })
    }

    /// Bytes of each receive buffer (the peer's small-message bound).
    pub fn recv_buffer_size(&self) -> usize {
        HEADER_LEN + self.config.small_message_limit
    }

    /// The slot the peer writes its keepalive into (address, rkey), for
    /// the handshake's hello. `None` with memory windows: the slot's key is
    /// sent once a window is bound to it (a `Slot` control message).
    pub fn keepalive_slot(&self) -> Option<(u64, u32)> {
        if self.windows.enabled() {
            return None;
        }
        let slot = &self.keepalive.as_ref()?.slot;
        Some((slot.as_ptr() as u64, slot.region()?.rkey))
    }

    /// Confines the peer's writes (see `rdma/windows.rs`): every grant and
    /// the keepalive slot go through one of `windows` (type-2 memory
    /// windows of the device, bindable on this engine's QP; the receive
    /// pool registered for windows). Call before the handshake's hello
    /// ([`Engine::keepalive_slot`]); at least two (a grant and the slot).
    pub fn set_windows(&mut self, windows: Vec<std::sync::Arc<dyn crate::verbs::MemoryWindow>>) {
        self.windows = Windows::new(windows);
    }

    /// Deallocates the engine's memory windows, which ends their bindings:
    /// call it before the queue pair they were bound on is destroyed. A
    /// type-2 window bound on a QP holds a reference to it, and rxe's
    /// `ibv_destroy_qp` waits for every reference to go, 50 s before it
    /// gives up (with a kernel warning): every connection's close stalled
    /// its thread that long. The engine sends nothing more through
    /// windows afterwards (a grant then finds none free).
    pub fn release_windows(&mut self) {
        self.windows = Windows::default();
    }

    /// The connection is set up: the peer's receives are posted (its
    /// initial credits) and what it told is known.
    pub fn peer_ready(&mut self, peer: PeerInfo, now: Instant) {
        self.credits
            .returned(u16::try_from(peer.recv_depth).unwrap_or(u16::MAX));
        if peer.shared_receives {
            self.credits.set_peer_shared();
        }
        let peer_small = (peer.recv_buffer as usize).saturating_sub(HEADER_LEN);
        self.small_limit = self.small_limit.min(peer_small);
        if let Some(ka) = &mut self.keepalive {
            // A confined peer tells its slot in a `Slot` message, not in
            // its hello; that message may have been handled already (the
            // dialer's I/O thread can post it before the acceptor's task
            // hands over the peer's readiness), and is never sent twice.
            ka.peer_slot = peer.keepalive_slot.or(ka.peer_slot);
            ka.next_send = ka.peer_slot.map(|_| now);
            ka.last_advance = now;
            // Our slot through a window of its own: bound first, its key
            // told behind the bind on the same queue.
            if let Some(bound) = self.windows.bind_keepalive(&ka.slot) {
                match bound {
                    Ok((bind, rkey)) => {
                        let addr = ka.slot.as_ptr() as u64;
                        self.push_local(bind);
                        self.control.push_back(Control::Slot { addr, rkey });
                    }
                    Err(_) => self.fail(EngineError::Unregistered("the keepalive slot")),
                }
            }
        }
        self.peer_ready = true;
    }

    /// Queues a work request that moves no data (a window's bind or
    /// invalidation); returns the id it will be posted with.
    fn push_local(&mut self, op: SendOp) -> u64 {
        self.ring.push(RingEntry {
            wr: SendWr {
                wr_id: 0,
                op,
                sges: Vec::new(),
                signaled: false,
            },
            keep: Vec::new(),
            bytes: 0,
        })
    }

    /// Counters.
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            window_stalls: self.window.stalls(),
            peak_in_flight_bytes: self.window.peak() as u64,
            ..self.stats
        }
    }

    /// Work requests in flight on the send queue.
    pub fn in_flight(&self) -> usize {
        self.ring.in_flight()
    }

    /// Bytes of posted work requests not yet completed (what the send
    /// window bounds), and the window's current bound.
    pub fn window_usage(&self) -> (usize, usize) {
        (self.window.in_flight(), self.window.limit())
    }

    /// Whether the engine has failed.
    pub fn is_failed(&self) -> bool {
        self.failed
    }

    /// Whether everything queued has been sent and completed.
    pub fn is_idle(&self) -> bool {
        self.control.is_empty()
            && self
                .sockets
                .values()
                .all(|s| s.queue.is_empty() && s.large.is_empty())
            && self.ring.in_flight() == 0
            && self.ring.pending() == 0
            && self.held.is_empty()
    }

    fn fail(&mut self, error: EngineError) {
        if self.failed {
            return;
        }
        self.failed = true;
        // Buffers the NIC may still touch (posted receives, destinations
        // handed to the peer, data of requests in flight) stay owned until
        // the engine is dropped, which its owner does only after the queue
        // pair is destroyed: freeing them now could let a late WRITE land
        // in memory the pool has handed to someone else.
        self.control.clear();
        self.sockets.clear();
        self.active.clear();
        self.awaiting_cts.clear();
        self.events.push_back(EngineEvent::Failed(error));
    }

    fn alloc(pool: &Pool, len: usize) -> Result<PoolBuf, EngineError> {
        let mut buf = pool.alloc(len).map_err(EngineError::Memory)?;
        buf.set_len(len);
        Ok(buf)
    }

    /// Opens a socket (its `Open` goes to the peer before its first
    /// message).
    pub fn open_socket(&mut self) -> Result<SocketId, EngineError> {
        if self.failed {
            return Err(EngineError::Failed);
        }
        let id = loop {
            let candidate = match self.role {
                Role::Dialer => self.next_socket & !ACCEPTOR_BIT,
                Role::Acceptor => self.next_socket | ACCEPTOR_BIT,
            };
            self.next_socket = self.next_socket.wrapping_add(1).max(1);
            if candidate & !ACCEPTOR_BIT != 0
                && !self.open.contains(&candidate)
                && !self.sockets.contains_key(&candidate)
            {
                break candidate;
            }
        };
        self.sockets.insert(id, SocketTx::default());
        self.open.insert(id);
        self.control.push_back(Control::Open(id));
        Ok(id)
    }

    /// Takes a socket the peer opened (it may carry messages now).
    pub fn accept_socket(&mut self, socket: SocketId) {
        if self.open.contains(&socket) {
            self.control.push_back(Control::Accept(socket));
        }
    }

    /// Turns away a socket the peer opened.
    pub fn refuse_socket(&mut self, socket: SocketId) {
        if self.open.remove(&socket) {
            self.sockets.remove(&socket);
            self.control.push_back(Control::Refuse(socket));
        }
    }

    /// Closes the sending half of a socket: its queued messages still go,
    /// then `Close` (the peer's end of file). Messages from the peer are
    /// still delivered until it closes its half.
    pub fn close_socket(&mut self, socket: SocketId) {
        if let Some(tx) = self.sockets.get_mut(&socket) {
            tx.queue.push_back(Item::Close);
            self.schedule(socket);
        }
    }

    fn schedule(&mut self, socket: SocketId) {
        if let Some(tx) = self.sockets.get_mut(&socket)
            && !tx.scheduled
        {
            tx.scheduled = true;
            self.active.push_back(socket);
        }
    }

    /// Queues a message on a socket. Parts outside registered memory are
    /// copied into the send pool (and counted); small messages with more
    /// parts than fit in one work request are gathered into one buffer.
    pub fn send(&mut self, socket: SocketId, message: Message) -> Result<(), EngineError> {
        if self.failed {
            return Err(EngineError::Failed);
        }
        if !self.sockets.contains_key(&socket) {
            return Err(EngineError::SocketClosed(socket));
        }
        let len = message.len();
        if len as u64 > self.config.max_message_size {
            return Err(EngineError::TooLarge {
                len: len as u64,
                max: self.config.max_message_size,
            });
        }
        let mut parts = Vec::with_capacity(message.parts().len());
        // Only this engine's pools are registered with its device: memory of
        // any other pool (another transport's, keys from another device) is
        // as foreign to the NIC as unregistered memory.
        let own = [self.send_pool.id(), self.recv_pool.id()];
        for part in message.parts() {
            if part.is_empty() {
                continue;
            }
            if lookup(&part[..]).is_some_and(|region| own.contains(&region.pool_id)) {
                parts.push(part.clone());
            } else {
                self.stats.fallback_copies += 1;
                parts.push(
                    self.send_pool
                        .alloc_copy(part)
                        .map_err(EngineError::Memory)?
                        .freeze(),
                );
            }
        }
        if len <= self.small_limit && parts.len() + 1 > self.config.max_sge as usize {
            let mut joined = Self::alloc(&self.send_pool, len)?;
            let mut at = 0;
            for part in &parts {
                joined[at..at + part.len()].copy_from_slice(part);
                at += part.len();
            }
            parts = vec![joined.freeze()];
        }
        if let Some(tx) = self.sockets.get_mut(&socket) {
            tx.queue.push_back(Item::Message(Outgoing { parts, len }));
        }
        self.schedule(socket);
        Ok(())
    }

    fn sge(bytes: &Bytes) -> Option<Sge> {
        let region = lookup(&bytes[..])?;
        Some(Sge {
            addr: bytes.as_ptr() as usize,
            len: u32::try_from(bytes.len()).ok()?,
            lkey: region.lkey,
        })
    }

    /// Queues a SEND of a control header followed by `payload`.
    fn push_send(
        &mut self,
        kind: ControlKind,
        msg_id: u32,
        socket: SocketId,
        payload: &[Bytes],
    ) -> Result<(), EngineError> {
        let header = ControlHeader {
            kind,
            credits: self.credits.take_returnable(),
            msg_id,
            socket,
        };
        let header = self
            .send_pool
            .alloc_copy(&header.encode())
            .map_err(EngineError::Memory)?
            .freeze();
        let mut keep = Vec::with_capacity(payload.len() + 1);
        let mut sges = Vec::with_capacity(payload.len() + 1);
        let mut bytes = 0;
        for part in std::iter::once(&header).chain(payload) {
            let sge = Self::sge(part).ok_or(EngineError::Unregistered("a send buffer"))?;
            bytes += part.len();
            sges.push(sge);
            keep.push(part.clone());
        }
        self.credits.spend();
        self.window.add(bytes);
        self.ring.push(RingEntry {
            wr: SendWr {
                wr_id: 0,
                op: SendOp::Send,
                sges,
                signaled: false,
            },
            keep,
            bytes,
        });
        Ok(())
    }

    /// The first engine-level control message that its credit and the
    /// window allow (a keepalive needs no credit and may pass an `Open`
    /// waiting for one).
    fn push_control(&mut self) -> Result<bool, EngineError> {
        let credits = &self.credits;
        let position = self.control.iter().position(|control| match control {
            Control::Keepalive => true,
            Control::Open(_) | Control::Accept(_) | Control::Refuse(_) => credits.can_send_data(),
            Control::Cts { .. } | Control::Slot { .. } => credits.can_send_control(),
        });
        let Some(position) = position else {
            return Ok(false);
        };
        let bytes = match self.control[position] {
            Control::Keepalive => KEEPALIVE_SLOT_LEN,
            _ => HEADER_LEN,
        };
        if !self.window.admit(bytes) {
            return Ok(false);
        }
        let Some(control) = self.control.remove(position) else {
            return Ok(false);
        };
        match control {
            Control::Cts { msg_id, addr, rkey } => {
                self.push_send(ControlKind::Cts { addr, rkey }, msg_id, 0, &[])?;
            }
            Control::Slot { addr, rkey } => {
                self.push_send(ControlKind::Slot { addr, rkey }, 0, 0, &[])?;
            }
            Control::Open(socket) => self.push_send(ControlKind::Open, 0, socket, &[])?,
            Control::Accept(socket) => self.push_send(ControlKind::Accept, 0, socket, &[])?,
            Control::Refuse(socket) => self.push_send(ControlKind::Refuse, 0, socket, &[])?,
            Control::Keepalive => self.push_keepalive()?,
        }
        Ok(true)
    }

    fn push_keepalive(&mut self) -> Result<(), EngineError> {
        let Some(ka) = &mut self.keepalive else {
            return Ok(());
        };
        let Some((addr, rkey)) = ka.peer_slot else {
            return Ok(());
        };
        ka.seq += 1;
        let source = self
            .send_pool
            .alloc_copy(&ka.seq.to_le_bytes())
            .map_err(EngineError::Memory)?
            .freeze();
        let sge = Self::sge(&source).ok_or(EngineError::Unregistered("the keepalive slot"))?;
        self.window.add(KEEPALIVE_SLOT_LEN);
        self.stats.keepalives_sent += 1;
        self.ring.push(RingEntry {
            wr: SendWr {
                wr_id: 0,
                op: SendOp::Write {
                    remote_addr: addr as usize,
                    rkey,
                },
                sges: vec![sge],
                signaled: false,
            },
            keep: vec![source],
            bytes: KEEPALIVE_SLOT_LEN,
        });
        Ok(())
    }

    /// One fragment of `socket`'s work (see the module docs).
    fn socket_turn(&mut self, socket: SocketId) -> Result<Turn, EngineError> {
        let small_limit = self.small_limit;
        let rts_ahead = self.config.rts_ahead.max(1);
        let Some(tx) = self.sockets.get(&socket) else {
            return Ok(Turn::Done);
        };
        let front_large_waits = tx.large.front().is_some_and(|l| l.dest.is_none());
        // Ask for the next destination ahead, so its round trip overlaps.
        let next_is_large =
            matches!(tx.queue.front(), Some(Item::Message(m)) if m.len > small_limit);
        if next_is_large && tx.large.len() < rts_ahead {
            if !self.credits.can_send_data() {
                self.stats.credit_stalls += 1;
                return Ok(Turn::NoCredit);
            }
            if !self.window.admit(HEADER_LEN) {
                return Ok(Turn::NoWindow);
            }
            let Some(tx) = self.sockets.get_mut(&socket) else {
                return Ok(Turn::Done);
            };
            let Some(Item::Message(message)) = tx.queue.pop_front() else {
                return Ok(Turn::Done);
            };
            let msg_id = self.next_msg_id;
            self.next_msg_id = self.next_msg_id.wrapping_add(1).max(1);
            let size = message.len as u64;
            tx.large.push_back(LargeSend {
                msg_id,
                message,
                dest: None,
                offset: 0,
            });
            self.awaiting_cts.insert(msg_id, socket);
            self.push_send(ControlKind::Rts { size }, msg_id, socket, &[])?;
            return Ok(Turn::Fragment);
        }
        if tx.large.front().is_some_and(|l| l.dest.is_some()) {
            return self.push_fragment(socket);
        }
        if front_large_waits {
            return Ok(Turn::Blocked);
        }
        match tx.queue.front() {
            None => Ok(Turn::Done),
            Some(Item::Message(m)) if m.len <= small_limit => {
                if !self.credits.can_send_data() {
                    self.stats.credit_stalls += 1;
                    return Ok(Turn::NoCredit);
                }
                if !self.window.admit(HEADER_LEN + m.len) {
                    return Ok(Turn::NoWindow);
                }
                let Some(tx) = self.sockets.get_mut(&socket) else {
                    return Ok(Turn::Done);
                };
                let Some(Item::Message(message)) = tx.queue.pop_front() else {
                    return Ok(Turn::Done);
                };
                self.push_send(ControlKind::Data, 0, socket, &message.parts)?;
                self.events.push_back(EngineEvent::Sent(socket));
                self.stats.small_sent += 1;
                self.stats.bytes_sent += message.len as u64;
                Ok(Turn::Fragment)
            }
            // A large message behind `rts_ahead` others: wait for writing.
            Some(Item::Message(_)) => Ok(Turn::Blocked),
            Some(Item::Close) => {
                if !self.credits.can_send_data() {
                    self.stats.credit_stalls += 1;
                    return Ok(Turn::NoCredit);
                }
                if !self.window.admit(HEADER_LEN) {
                    return Ok(Turn::NoWindow);
                }
                self.sockets.remove(&socket);
                self.push_send(ControlKind::Close, 0, socket, &[])?;
                Ok(Turn::Done)
            }
        }
    }

    /// The next WRITE fragment of `socket`'s first large message.
    fn push_fragment(&mut self, socket: SocketId) -> Result<Turn, EngineError> {
        let max_sge = self.config.max_sge as usize;
        let fragment_size = self.fragment_size;
        let can_finish = self.credits.can_send_data();
        let Some(tx) = self.sockets.get_mut(&socket) else {
            return Ok(Turn::Done);
        };
        let Some(transfer) = tx.large.front_mut() else {
            return Ok(Turn::Done);
        };
        let Some((addr, rkey)) = transfer.dest else {
            return Ok(Turn::Blocked);
        };
        let remaining = transfer.message.len - transfer.offset;
        let mut sges = Vec::new();
        let mut keep = Vec::new();
        let mut skip = transfer.offset;
        let mut room = fragment_size.min(remaining);
        for part in &transfer.message.parts {
            if room == 0 || sges.len() == max_sge {
                break;
            }
            if skip >= part.len() {
                skip -= part.len();
                continue;
            }
            let take = (part.len() - skip).min(room);
            let slice = part.slice(skip..skip + take);
            sges.push(Self::sge(&slice).ok_or(EngineError::Unregistered("a send buffer"))?);
            keep.push(slice);
            room -= take;
            skip = 0;
        }
        let length: usize = sges.iter().map(|s| s.len as usize).sum();
        let last = length == remaining;
        if last && !can_finish {
            self.stats.credit_stalls += 1;
            return Ok(Turn::NoCredit);
        }
        if !self.window.admit(length) {
            return Ok(Turn::NoWindow);
        }
        let remote_addr = addr as usize + transfer.offset;
        let op = if last {
            SendOp::WriteWithImm {
                remote_addr,
                rkey,
                imm: transfer.msg_id,
            }
        } else {
            SendOp::Write { remote_addr, rkey }
        };
        transfer.offset += length;
        if last {
            let done = tx.large.pop_front();
            self.events.push_back(EngineEvent::Sent(socket));
            self.credits.spend();
            self.stats.large_sent += 1;
            self.stats.bytes_sent += done.map_or(0, |d| d.message.len as u64);
        }
        self.window.add(length);
        self.ring.push(RingEntry {
            wr: SendWr {
                wr_id: 0,
                op,
                sges,
                signaled: false,
            },
            keep,
            bytes: length,
        });
        Ok(Turn::Fragment)
    }

    fn fill_ring(&mut self) -> Result<(), EngineError> {
        if !self.peer_ready {
            return Ok(());
        }
        let mut pushed_send = false;
        // Schedule no more than one doorbell batch ahead: a fragment queued
        // in the ring is out of the scheduler's hands, so a small message of
        // another socket would wait behind all of them.
        while self.ring.pending() < self.ring.free().min(MAX_BATCH) {
            if !self.control.is_empty() && self.push_control()? {
                pushed_send = true;
                continue;
            }
            let Some(socket) = self.active.pop_front() else {
                break;
            };
            #[cfg(test)]
            let before = self.window.in_flight();
            let turn = self.socket_turn(socket)?;
            #[cfg(test)]
            if matches!(turn, Turn::Fragment) {
                let bytes = self.window.in_flight() - before;
                self.fragment_log.push((socket, bytes));
            }
            match turn {
                Turn::Fragment => {
                    pushed_send = true;
                    self.active.push_back(socket);
                }
                Turn::Blocked | Turn::Done => {
                    if let Some(tx) = self.sockets.get_mut(&socket) {
                        tx.scheduled = false;
                    }
                }
                Turn::NoCredit | Turn::NoWindow => {
                    // Its turn is kept: it goes first once room returns.
                    self.active.push_front(socket);
                    break;
                }
            }
        }
        // Owed credits with no SEND to carry them: a message of their own.
        if !pushed_send
            && self.credits.owes_batch()
            && self.credits.can_send_control()
            && self.ring.pending() < self.ring.free()
            && self.window.admit(HEADER_LEN)
        {
            self.push_send(ControlKind::Credit, 0, 0, &[])?;
            self.stats.credit_messages += 1;
        }
        Ok(())
    }

    /// Whether a request to send waits for the inbound budget, which other
    /// connections free: the driver calls [`Engine::poll_transmit`] again
    /// at each round while it does, not only at its retry timer.
    pub fn waits_for_budget(&self) -> bool {
        self.inbound_retry.is_some()
    }

    /// The next batch of send work requests to post with one `post_send`.
    pub fn poll_transmit(&mut self, now: Instant) -> Option<Vec<SendWr>> {
        if self.failed {
            return None;
        }
        if self.inbound_retry.is_some()
            && let Err(err) = self.grant_waiting(Some(now))
        {
            self.fail(err);
            return None;
        }
        if let Err(err) = self.fill_ring() {
            self.fail(err);
            return None;
        }
        self.ring.take_batch(now)
    }

    /// Receive work requests to post: the whole queue at start, then
    /// batches of d/2 as receives are consumed.
    pub fn poll_recv_post(&mut self) -> Option<Vec<RecvWr>> {
        if self.failed || self.config.shared_receives {
            return None;
        }
        let slots: Vec<usize> = if self.receives_posted {
            let n = self.credits.take_repost() as usize;
            if n == 0 {
                return None;
            }
            self.consumed_slots
                .drain(..n.min(self.consumed_slots.len()))
                .collect()
        } else {
            self.receives_posted = true;
            (0..self.recv_slots.len()).collect()
        };
        let size = self.recv_buffer_size();
        let mut wrs = Vec::with_capacity(slots.len());
        for slot in slots {
            let buf = match self.spare.pop() {
                Some(buf) => buf,
                None => match Self::alloc(&self.recv_pool, size) {
                    Ok(buf) => buf,
                    Err(err) => {
                        self.fail(err);
                        return None;
                    }
                },
            };
            let Some(wr) = recv_wr(wr_id::recv(slot), &buf) else {
                self.fail(EngineError::Unregistered("a receive buffer"));
                return None;
            };
            wrs.push(wr);
            self.recv_slots[slot] = Some(buf);
        }
        Some(wrs)
    }

    /// The next event for the owner.
    pub fn poll_event(&mut self) -> Option<EngineEvent> {
        self.events.pop_front()
    }

    /// The peer's handshake connection closed: it is gone.
    pub fn handle_peer_closed(&mut self) {
        self.fail(EngineError::PeerClosed);
    }

    /// The owner closes the engine: its last socket is gone and nobody
    /// shares it (a connection of its own, `multiplex = false`). Without
    /// this such an engine lived, holding its QP and its room on the CQ,
    /// until its peer went away.
    pub fn handle_unused(&mut self) {
        self.fail(EngineError::Unused);
    }

    /// The device reported that this engine's QP failed, or something
    /// that takes every QP with it (a CQ overrun, a port down, a dead
    /// device): the engine fails now, instead of when every retry ran out.
    pub fn handle_device_event(&mut self, event: crate::verbs::AsyncEvent) {
        self.fail(EngineError::Device(event));
    }

    /// A batch from [`Engine::poll_transmit`] or [`Engine::poll_recv_post`]
    /// could not be posted (wholly or from some work request on). The ring
    /// and the credits already count all of it, and what was not posted
    /// will never complete, so the engine cannot go on: it fails, and its
    /// owner puts the queue pair in error ([`crate::verbs::QueuePair::fail`])
    /// so that what was posted is flushed back.
    pub fn handle_post_error(&mut self, error: crate::verbs::VerbsError) {
        self.fail(EngineError::Post(error));
    }

    /// When [`Engine::handle_timeout`] should next be called.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.failed || !self.peer_ready {
            return None;
        }
        let keepalive = self.keepalive.as_ref().map(|ka| {
            let deadline = ka.last_advance + ka.config.timeout;
            ka.next_send.map_or(deadline, |next| next.min(deadline))
        });
        match (keepalive, self.inbound_retry) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Time has passed: sends a keepalive when due, and fails the engine if
    /// the peer's stood still for the timeout.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.failed || !self.peer_ready {
            return;
        }
        if self.inbound_retry.is_some_and(|at| now >= at)
            && let Err(err) = self.grant_waiting(Some(now))
        {
            self.fail(err);
            return;
        }
        let Some(ka) = &mut self.keepalive else {
            return;
        };
        let seen = ka.slot.load_u64(0).unwrap_or(0);
        if seen != ka.last_seen {
            ka.last_seen = seen;
            ka.last_advance = now;
        }
        if let Some(next) = ka.next_send
            && now >= next
        {
            let after = next + ka.config.interval;
            ka.next_send = Some(if after <= now {
                now + ka.config.interval
            } else {
                after
            });
            if !self.control.iter().any(|c| matches!(c, Control::Keepalive)) {
                self.control.push_back(Control::Keepalive);
            }
        }
        let Some(ka) = &self.keepalive else {
            return;
        };
        let silent = now.saturating_duration_since(ka.last_advance);
        if silent > ka.config.timeout {
            self.fail(EngineError::PeerDead(silent));
        }
    }

    /// Feeds a work completion of this engine's QP.
    pub fn handle_completion(&mut self, completion: &WorkCompletion, now: Instant) {
        if self.failed {
            return;
        }
        if completion.status != WcStatus::Success {
            self.fail(completion_error(completion));
            return;
        }
        // By the id, not the opcode (see `wr_id`).
        match wr_id::classify(completion.wr_id) {
            WrKind::Send(wr_id) => {
                let retired = self.ring.complete(wr_id);
                let delay = retired
                    .posted_at
                    .map(|at| now.saturating_duration_since(at));
                self.window.retire(retired.bytes, delay, now);
                self.release_held(wr_id);
            }
            WrKind::SharedRecv(_) => {
                self.fail(EngineError::Protocol(
                    "a shared receive came without its buffer".into(),
                ));
            }
            WrKind::Recv(_) if self.config.shared_receives => {
                self.fail(EngineError::Protocol(
                    "a receive of its own on an engine with shared receives".into(),
                ));
            }
            WrKind::Recv(slot) => {
                let Some(buf) = self.recv_slots.get_mut(slot).and_then(Option::take) else {
                    self.fail(EngineError::Protocol(format!(
                        "completion for unknown receive {slot}"
                    )));
                    return;
                };
                self.consumed_slots.push(slot);
                self.credits.consumed();
                if let Err(err) = self.received(completion, buf) {
                    self.fail(err);
                }
            }
        }
    }

    /// Feeds a receive completion of the shared receive queue for this
    /// engine's QP, with the buffer it landed in (the owner of the queue
    /// maps `wr_id` to it).
    pub fn handle_shared_receive(&mut self, completion: &WorkCompletion, buf: PoolBuf) {
        if self.failed {
            return;
        }
        if completion.status != WcStatus::Success {
            // The buffer goes back to the pool (the queue's owner reposts
            // its slot).
            drop(buf);
            self.fail(completion_error(completion));
            return;
        }
        if let Err(err) = self.received(completion, buf) {
            self.fail(err);
        }
    }

    fn deliver(&mut self, socket: SocketId, bytes: Bytes) {
        self.deliver_after(socket, bytes, None);
    }

    /// Hands a message on, after the work request `after` (a window's
    /// invalidation) has completed where given, and in any case after
    /// everything held before it.
    fn deliver_after(&mut self, socket: SocketId, bytes: Bytes, after: Option<u64>) {
        if !self.open.contains(&socket) {
            self.stats.orphan_messages += 1;
            return;
        }
        self.stats.received += 1;
        self.stats.bytes_received += bytes.len() as u64;
        self.emit_ordered(EngineEvent::Message { socket, bytes }, after);
    }

    /// An event of a socket's stream (a message, its close), behind any
    /// held one.
    fn emit_ordered(&mut self, event: EngineEvent, after: Option<u64>) {
        if after.is_none() && self.held.is_empty() {
            self.events.push_back(event);
        } else {
            self.held.push_back((after, event));
        }
    }

    /// After the engine failed, once its QP is in error (no write can land
    /// any more): the messages and closes held for invalidations that will
    /// never complete, in order, to hand on before the failure.
    pub fn take_held(&mut self) -> Vec<EngineEvent> {
        if !self.failed {
            return Vec::new();
        }
        self.held.drain(..).map(|(_, event)| event).collect()
    }

    /// Send work requests up to `wr_id` have completed: held events whose
    /// invalidation was among them go out, in order.
    fn release_held(&mut self, wr_id: u64) {
        while let Some((after, _)) = self.held.front() {
            if after.is_some_and(|id| id > wr_id) {
                break;
            }
            if let Some((_, event)) = self.held.pop_front() {
                self.events.push_back(event);
            }
        }
    }

    /// A receive buffer done with: kept for the next repost of this
    /// engine's own receives, at most one per receive slot. With shared
    /// receives the engine posts none (the I/O thread's queue allocates
    /// its own), so the buffer goes back to the pool; keeping it, as
    /// before, grew the pool by every control message for the life of the
    /// connection.
    fn recycle(&mut self, buf: PoolBuf) {
        if !self.config.shared_receives && self.spare.len() < self.recv_slots.len() {
            self.spare.push(buf);
        }
    }

    /// Grants waiting requests to send, in order, while they fit in
    /// `max_granted_bytes` (and the server's budget, for an accepted
    /// connection): allocates each destination and queues its CTS. `now`
    /// (when known) schedules a retry while the server's budget is short.
    fn grant_waiting(&mut self, now: Option<Instant>) -> Result<(), EngineError> {
        self.inbound_retry = None;
        while let Some(&(msg_id, socket, size)) = self.waiting_rts.front() {
            let fits = self.granted_bytes + size <= self.config.max_granted_bytes
                // One message alone is always granted (validation keeps
                // the budget above the largest message anyway).
                || self.incoming.is_empty();
            // With confinement, a grant needs a window too.
            if !fits || (self.windows.enabled() && self.windows.available() == 0) {
                break;
            }
            let permit = match &self.inbound {
                None => None,
                Some(budget) => match budget.try_acquire(size as usize) {
                    Some(permit) => Some(permit),
                    None => {
                        // Tried again at each I/O round (an engine
                        // waiting for the budget stays on its driver's
                        // ready list: `waits_for_budget`), or within
                        // `INBOUND_RETRY` of `now` when the driver sleeps.
                        self.inbound_retry = Some(now.unwrap_or_else(Instant::now) + INBOUND_RETRY);
                        break;
                    }
                },
            };
            self.waiting_rts.pop_front();
            let dest = Self::alloc(&self.recv_pool, size as usize)?;
            let region = dest
                .region()
                .ok_or(EngineError::Unregistered("a write destination"))?;
            let addr = dest.as_ptr() as u64;
            // Confined: a window over exactly these bytes, on this QP,
            // bound before the CTS (same send queue, in order) tells the
            // peer its key.
            let rkey = match self.windows.bind_grant(msg_id, &dest) {
                None => region.rkey,
                Some(Ok((bind, rkey))) => {
                    self.push_local(bind);
                    rkey
                }
                Some(Err(_)) => return Err(EngineError::Unregistered("a write destination")),
            };
            self.granted_bytes += size;
            self.incoming.insert(msg_id, (socket, dest, permit));
            self.control.push_back(Control::Cts { msg_id, addr, rkey });
        }
        Ok(())
    }

    /// Grants of this engine (an accepted connection's) also draw on the
    /// server's budget of large inbound messages, `inbound.max_bytes`
    /// shared with TCP peers; a request to send that does not fit waits.
    pub fn set_inbound_budget(&mut self, budget: InboundBudget) {
        self.inbound = Some(budget);
    }

    /// The grants the peer holds: (message id, address, bytes, the key
    /// its CTS carried, the key of the registered region it lies in).
    #[cfg(test)]
    pub(crate) fn grants(&self) -> Vec<(u32, u64, usize, u32, u32)> {
        self.incoming
            .iter()
            .map(|(&msg_id, (_, buf, _))| {
                let region = buf.region().map_or(0, |r| r.rkey);
                let rkey = self.windows.rkey_of(msg_id).unwrap_or(region);
                (msg_id, buf.as_ptr() as u64, buf.len(), rkey, region)
            })
            .collect()
    }

    /// The keepalive slot: (address, the key of the region it lies in).
    #[cfg(test)]
    pub(crate) fn own_keepalive_slot(&self) -> Option<(u64, u32)> {
        let slot = &self.keepalive.as_ref()?.slot;
        Some((slot.as_ptr() as u64, slot.region()?.rkey))
    }

    /// Where this engine writes its keepalive (the peer's slot).
    #[cfg(test)]
    pub(crate) fn peer_keepalive_slot(&self) -> Option<(u64, u32)> {
        self.keepalive.as_ref()?.peer_slot
    }

    /// Events held for invalidations.
    #[cfg(test)]
    pub(crate) fn held_len(&self) -> usize {
        self.held.len()
    }

    /// Bytes granted to the peer for large messages now, and requests to
    /// send waiting for budget.
    pub fn granted(&self) -> (u64, usize) {
        (self.granted_bytes, self.waiting_rts.len())
    }

    fn received(&mut self, completion: &WorkCompletion, buf: PoolBuf) -> Result<(), EngineError> {
        if let WcKind::RecvWithImm(msg_id) = completion.kind {
            self.recycle(buf);
            let (socket, message, permit) = self.incoming.remove(&msg_id).ok_or_else(|| {
                EngineError::Protocol(format!("write with immediate for unknown message {msg_id}"))
            })?;
            self.granted_bytes = self.granted_bytes.saturating_sub(message.len() as u64);
            // Confined: the window dies before the message is handed on,
            // so the peer cannot change it once the application has it.
            let after = self
                .windows
                .release_grant(msg_id)
                .map(|invalidate| self.push_local(invalidate));
            // The server's budget stays held while the message's bytes live,
            // as on TCP.
            self.deliver_after(
                socket,
                crate::inbound::budgeted(message, [permit, None]),
                after,
            );
            self.grant_waiting(None)?;
            return Ok(());
        }
        // The completion's length is the peer's word: checked before any
        // use (before, a length past the buffer was clamped for decoding
        // but not for slicing, and the slice panicked the I/O thread).
        let len = completion.byte_len as usize;
        if len > buf.len() {
            return Err(EngineError::Protocol(format!(
                "a receive of {len} bytes into a buffer of {}",
                buf.len()
            )));
        }
        let header =
            ControlHeader::decode(&buf[..len]).map_err(|e| EngineError::Protocol(e.to_string()))?;
        self.credits.returned(header.credits);
        match header.kind {
            ControlKind::Data => {
                let message = buf.freeze().slice(HEADER_LEN..len);
                self.deliver(header.socket, message);
            }
            ControlKind::Rts { size } => {
                self.recycle(buf);
                if size > self.config.max_message_size {
                    return Err(EngineError::Protocol(format!(
                        "peer wants to send {size} bytes, above the limit of {}",
                        self.config.max_message_size
                    )));
                }
                // A message id already granted (or waiting): its buffer's
                // address and key are the peer's, which may still write
                // into it, so it is never replaced (and so freed); the
                // engine fails.
                if self.incoming.contains_key(&header.msg_id)
                    || self.waiting_rts.iter().any(|w| w.0 == header.msg_id)
                {
                    return Err(EngineError::Protocol(format!(
                        "request to send message {} again while it is granted",
                        header.msg_id
                    )));
                }
                if self.waiting_rts.len() >= MAX_WAITING_RTS {
                    return Err(EngineError::Protocol(format!(
                        "{MAX_WAITING_RTS} requests to send wait for budget; the peer sends more"
                    )));
                }
                self.waiting_rts
                    .push_back((header.msg_id, header.socket, size));
                self.grant_waiting(None)?;
            }
            ControlKind::Cts { addr, rkey } => {
                self.recycle(buf);
                let socket = self.awaiting_cts.remove(&header.msg_id).ok_or_else(|| {
                    EngineError::Protocol(format!(
                        "clear to send for unknown message {}",
                        header.msg_id
                    ))
                })?;
                if let Some(tx) = self.sockets.get_mut(&socket)
                    && let Some(transfer) = tx.large.iter_mut().find(|l| l.msg_id == header.msg_id)
                {
                    transfer.dest = Some((addr, rkey));
                    self.schedule(socket);
                }
            }
            ControlKind::Credit => self.recycle(buf),
            ControlKind::Open => {
                self.recycle(buf);
                let socket = header.socket;
                let theirs = match self.role {
                    Role::Dialer => socket & ACCEPTOR_BIT != 0,
                    Role::Acceptor => socket & ACCEPTOR_BIT == 0,
                };
                if !theirs || socket & !ACCEPTOR_BIT == 0 || self.open.contains(&socket) {
                    return Err(EngineError::Protocol(format!(
                        "peer opened socket {socket:#x}, which is not its to open"
                    )));
                }
                self.open.insert(socket);
                self.sockets.insert(socket, SocketTx::default());
                self.events.push_back(EngineEvent::Opened(socket));
            }
            ControlKind::Accept => {
                self.recycle(buf);
                self.events.push_back(EngineEvent::Accepted(header.socket));
            }
            ControlKind::Refuse => {
                self.recycle(buf);
                self.open.remove(&header.socket);
                self.sockets.remove(&header.socket);
                self.events.push_back(EngineEvent::Refused(header.socket));
            }
            ControlKind::Close => {
                self.recycle(buf);
                let socket = header.socket;
                if self.open.remove(&socket) {
                    self.emit_ordered(EngineEvent::Closed(socket), None);
                }
            }
            ControlKind::Slot { addr, rkey } => {
                self.recycle(buf);
                if let Some(ka) = &mut self.keepalive
                    && ka.peer_slot.is_none()
                {
                    ka.peer_slot = Some((addr, rkey));
                    ka.next_send = Some(ka.last_advance);
                }
            }
        }
        Ok(())
    }
}

/// The engine's error for a failed work completion.
fn completion_error(completion: &WorkCompletion) -> EngineError {
    EngineError::Completion {
        status: completion.status,
        vendor_err: completion.vendor_err,
    }
}

/// A receive of all of `buf` (pool memory), returned as `wr_id`; `None` if
/// the buffer lies outside registered memory.
pub(crate) fn recv_wr(wr_id: u64, buf: &PoolBuf) -> Option<RecvWr> {
    let region = buf.region()?;
    Some(RecvWr {
        wr_id,
        sge: Sge {
            addr: buf.as_ptr() as usize,
            len: u32::try_from(buf.len()).ok()?,
            lkey: region.lkey,
        },
    })
}
