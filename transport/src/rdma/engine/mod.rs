//! The RDMA engine (§5.4, §6.1, §6.3, §7.2): one per RC queue pair, as a
//! sans-IO state machine carrying many logical sockets. It never calls the
//! verbs itself and never reads a clock, so tests drive it step by step.
//!
//! # Surface and call order
//!
//! Like quinn's `Connection`, the owner (an I/O driver, `rdma/io/`) feeds
//! it events with `handle_*` and takes what it has to do with `poll_*`:
//!
//! 1. [`Engine::new`], then (confinement) [`Engine::set_windows`], then the
//!    handshake: the hello carries [`Engine::keepalive_slot`] and
//!    [`Engine::recv_buffer_size`]; post [`Engine::poll_recv_post`]'s
//!    receives before the peer can learn of them, then
//!    [`Engine::peer_ready`] once the peer's queue pair is connected.
//! 2. Inputs, in any order: [`Engine::open_socket`],
//!    [`Engine::accept_socket`], [`Engine::refuse_socket`],
//!    [`Engine::send`], [`Engine::close_socket`] from the application;
//!    [`Engine::handle_completion`] and [`Engine::handle_shared_receive`]
//!    for each work completion of its queue pair;
//!    [`Engine::handle_timeout`] once [`Engine::poll_timeout`]'s instant
//!    has come; [`Engine::handle_device_event`],
//!    [`Engine::handle_post_error`], [`Engine::handle_peer_closed`] and
//!    [`Engine::handle_unused`] for what ends it.
//! 3. After any input, drain the outputs: [`Engine::poll_recv_post`]
//!    (receives to repost), [`Engine::poll_transmit`] (one doorbell batch
//!    of send work requests per call), [`Engine::poll_event`] (messages,
//!    socket changes, its failure), and [`Engine::poll_timeout`] (when to
//!    call `handle_timeout` next). An engine that failed emits
//!    [`EngineEvent::Failed`], and after it only
//!    [`EngineEvent::StripeDone`] answers for other engines' chunks, as
//!    the completions of its queue pair (flushed, now) come back: keep
//!    feeding them. [`Engine::take_held`] then gives the events held for
//!    invalidations once its queue pair is in error.
//! 4. Before its queue pair is destroyed, [`Engine::release_windows`]
//!    (rxe waits 50 s for windows still bound on a QP being destroyed);
//!    the engine itself, owning every buffer the NIC may touch, goes
//!    after the queue pair.
//!
//! # Where each mechanism lives
//!
//! - `types.rs`: configuration, the peer's settings, errors, events,
//!   counters.
//! - `sockets.rs` (§6.1, QP multiplexing): logical connections on one QP.
//!   The dialer opens them; the peer learns of each from an `Open` control
//!   message ([`EngineEvent::Opened`]) and answers `Accept` or `Refuse`;
//!   the opener sends only after `Accept`. Closing one half sends `Close`
//!   after its last message and disturbs no other socket.
//! - `small.rs`: small messages (at most `small_message_limit` bytes, and
//!   what the peer's receive buffers and the window hold) go by SEND: the
//!   control header and the message's own buffers as scatter/gather
//!   entries, into a receive buffer that then *becomes* the received
//!   message.
//! - `large.rs` (§5.3.2): large messages by request to send (RTS), clear
//!   to send (CTS) with address and rkey, and WRITEs of at most
//!   `fragment_size` bytes, the last as WRITE_WITH_IMM carrying the
//!   message id; the receiver learns of the message from that completion
//!   alone. A socket asks for up to `rts_ahead` destinations ahead.
//! - `offers.rs`: after a large message of a socket, the receiver offers a
//!   destination for the next one unasked; a message that fits goes there
//!   behind an 8-byte length prefix, with no RTS/CTS round trip.
//! - `scheduler.rs`: the fragment scheduler. Engine-level control messages
//!   (CTS, credit returns, keepalives) first; then sockets with work take
//!   turns, round robin, one fragment per turn, so a small message waits
//!   behind at most (n−1)·S bytes of n−1 other sockets.
//! - `receive.rs` and [`ReceiveCredits`] (§5.4.2): every SEND and
//!   WRITE_WITH_IMM spends a credit; receives are reposted in batches of
//!   d/2 and the credits returned; the last credit is kept for CTS and
//!   credit returns.
//! - `grants.rs`: destinations granted to the peer, within
//!   `max_granted_bytes` and the server's inbound budget, through memory
//!   windows when confined.
//! - [`SendWindow`] (§6.3, `rdma/window.rs`): bytes posted and not
//!   completed stay within the window.
//! - `keepalive.rs` (§7.2): a growing sequence number WRITten into the
//!   peer's slot every `interval`; a slot of ours that stands still for
//!   `timeout` fails the engine with [`EngineError::PeerDead`].
//! - `stripes.rs`: a large message's bytes written through the queue
//!   pairs of other rails to the same peer as well (chunks handed out with
//!   [`Engine::poll_delegation`], answered by [`Engine::handle_stripe_done`];
//!   the last fragment, the WRITE_WITH_IMM, once every chunk is placed),
//!   and chunks of other engines written here
//!   ([`Engine::handle_stripe_writes`], [`EngineEvent::StripeDone`]).
//! - `delivery.rs`: per socket, messages are delivered in the order sent
//!   (a socket sends a small message or `Close` only once its large
//!   messages are fully written, RC delivers in posting order, and a
//!   message whose window is being invalidated holds those behind it).

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

mod delivery;
mod grants;
mod keepalive;
mod large;
mod offers;
mod receive;
mod scheduler;
mod small;
mod sockets;
mod stripes;
mod types;

pub use keepalive::KeepaliveConfig;
pub use stripes::{Delegation, StripeChunk};
pub use types::{
    EngineConfig, EngineError, EngineEvent, EngineStats, MAX_WAITING_RTS, PeerInfo, Role,
    StripeConfig, Violation,
};

use keepalive::{KEEPALIVE_SLOT_LEN, Keepalive};
use large::LargeSend;
#[cfg(test)]
pub(crate) use offers::{OFFER_BIT, PREFIX_LEN};
pub(crate) use receive::recv_wr;
use scheduler::{Control, Turn};
use sockets::{Item, Outgoing, SocketTx};

/// A logical socket on an engine.
pub type SocketId = u32;

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
    /// Bytes of the buffers in `incoming` (granted or offered to the peer).
    granted_bytes: u64,
    /// Per socket, the offer out for its next large message (its id in
    /// `incoming`).
    offered: HashMap<SocketId, u32>,
    /// Bytes of those offers (also in `granted_bytes`).
    offered_bytes: u64,
    /// The next offer's id, less [`offers::OFFER_BIT`].
    next_offer_id: u32,
    /// Buffers of offers withdrawn, kept until their window's
    /// invalidation (the send work request id) has completed.
    retiring: VecDeque<(u64, PoolBuf)>,
    /// The server's budget of large inbound messages, for an engine of an
    /// accepted connection (see [`Engine::set_inbound_budget`]).
    inbound: Option<InboundBudget>,
    /// When a request to send waiting for the server's budget is tried
    /// again (set while one waits for it).
    inbound_retry: Option<Instant>,
    /// Since when no grant has been written while one is out (CTS sent,
    /// its message not arrived): the grant timeout's clock (`grants.rs`).
    grant_idle_since: Option<Instant>,
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
    /// Striping over other rails, both roles (`stripes.rs`).
    stripes: stripes::Stripes,
    /// Grants or offers told their keys on other rails (`grants.rs`).
    exposed_rail_keys: bool,
    /// Every socket-level fragment queued: (socket, bytes). Tests check the
    /// scheduler's fairness bound against it.
    #[cfg(test)]
    pub(crate) fragment_log: Vec<(SocketId, usize)>,
}

pub(super) const ACCEPTOR_BIT: SocketId = 1 << 31;

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
            offered: HashMap::new(),
            offered_bytes: 0,
            next_offer_id: 1,
            retiring: VecDeque::new(),
            inbound: None,
            inbound_retry: None,
            grant_idle_since: None,
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
            stripes: stripes::Stripes::default(),
            exposed_rail_keys: false,
            #[cfg(test)]
            fragment_log: Vec::new(),
            config,
        })
    }

    /// Bytes of each receive buffer (the peer's small-message bound).
    pub fn recv_buffer_size(&self) -> usize {
        HEADER_LEN + self.config.small_message_limit
    }

    /// Confines the peer's writes (see `rdma/windows.rs`): every grant and
    /// the keepalive slot go through one of `windows` (type-2 memory
    /// windows of the device, bindable on this engine's QP; the receive
    /// pool registered for windows). Call before the handshake's hello
    /// ([`Engine::keepalive_slot`]); at least two (a grant and the slot).
    pub fn set_windows(&mut self, windows: Vec<std::sync::Arc<dyn crate::verbs::MemoryWindow>>) {
        self.windows = Windows::new(windows, self.config.rail);
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
    pub(super) fn push_local(&mut self, op: SendOp) -> u64 {
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
            && self.stripes_idle()
    }

    pub(super) fn fail(&mut self, error: EngineError) {
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
        // Other engines' chunks: those with nothing posted are answered
        // now, the rest as their writes' completions come (`stripes.rs`).
        self.settle_stripes(None);
    }

    pub(super) fn alloc(pool: &Pool, len: usize) -> Result<PoolBuf, EngineError> {
        let mut buf = pool.alloc(len).map_err(EngineError::Memory)?;
        buf.set_len(len);
        Ok(buf)
    }

    /// The next batch of send work requests to post with one `post_send`.
    pub fn poll_transmit(&mut self, now: Instant) -> Option<Vec<SendWr>> {
        if self.failed {
            return None;
        }
        if self.inbound_retry.is_some()
            && let Err(err) = self.grant_waiting(now)
        {
            self.fail(err);
            return None;
        }
        if let Err(err) = self.fill_ring() {
            self.fail(err);
            return None;
        }
        self.fill_delegations();
        self.ring.take_batch(now)
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
        [
            self.keepalive_deadline(),
            self.inbound_retry,
            self.grant_deadline(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Time has passed: sends a keepalive when due, and fails the engine if
    /// the peer's stood still for the timeout, or left its grants unwritten
    /// for the grant timeout.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.failed || !self.peer_ready {
            return;
        }
        if self.inbound_retry.is_some_and(|at| now >= at)
            && let Err(err) = self.grant_waiting(now)
        {
            self.fail(err);
            return;
        }
        if self.grant_timed_out(now) {
            return;
        }
        self.keepalive_timeout(now);
    }

    /// Feeds a work completion of this engine's QP.
    pub fn handle_completion(&mut self, completion: &WorkCompletion, now: Instant) {
        if self.failed {
            self.completed_after_failure(completion);
            return;
        }
        if completion.status != WcStatus::Success {
            self.fail(completion_error(completion));
            self.completed_after_failure(completion);
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
                self.release_retiring(wr_id);
                self.ack_stripes(wr_id);
            }
            WrKind::SharedRecv(_) => {
                self.fail(EngineError::Protocol(Violation::SharedReceiveWithoutBuffer));
            }
            WrKind::Recv(_) if self.config.shared_receives => {
                self.fail(EngineError::Protocol(
                    Violation::OwnReceiveWithSharedReceives,
                ));
            }
            WrKind::Recv(slot) => {
                let Some(buf) = self.recv_slots.get_mut(slot).and_then(Option::take) else {
                    self.fail(EngineError::Protocol(Violation::UnknownReceive(slot)));
                    return;
                };
                self.consumed_slots.push(slot);
                self.credits.consumed();
                if let Err(err) = self.received(completion, buf, now) {
                    self.fail(err);
                }
            }
        }
    }

    /// Feeds a receive completion of the shared receive queue for this
    /// engine's QP, with the buffer it landed in (the owner of the queue
    /// maps `wr_id` to it), at `now`.
    pub fn handle_shared_receive(
        &mut self,
        completion: &WorkCompletion,
        buf: PoolBuf,
        now: Instant,
    ) {
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
        if let Err(err) = self.received(completion, buf, now) {
            self.fail(err);
        }
    }
}

impl Engine {
    /// A completion of a failed engine's queue pair (in error: the rest of
    /// what was posted comes back flushed). Only the send queue's matter:
    /// they retire the ring, and with it the writes of other engines'
    /// chunks, which are answered once none of their writes can still be
    /// carried out (`stripes.rs`).
    fn completed_after_failure(&mut self, completion: &WorkCompletion) {
        if let WrKind::Send(wr_id) = wr_id::classify(completion.wr_id) {
            self.ring.complete(wr_id);
            let placed = completion.status == WcStatus::Success;
            self.settle_stripes(Some((wr_id, placed)));
        }
    }
}

/// The engine's error for a failed work completion.
fn completion_error(completion: &WorkCompletion) -> EngineError {
    EngineError::Completion {
        status: completion.status,
        vendor_err: completion.vendor_err,
    }
}
