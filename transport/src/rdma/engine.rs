//! The RDMA engine (§5.4): one per RC queue pair, as a sans-IO state
//! machine.
//!
//! The engine takes messages to send ([`Engine::send`]) and work
//! completions ([`Engine::handle_completion`]), and emits batches of work
//! requests to post ([`Engine::poll_transmit`], [`Engine::poll_recv_post`])
//! and received messages or failures ([`Engine::poll_event`]). It never
//! calls the verbs itself, so tests drive it step by step.
//!
//! - **Small messages** (at most `small_message_limit` bytes) go by SEND:
//!   the control header and the message's own buffers as scatter/gather
//!   entries, into a receive buffer that then *becomes* the received message.
//! - **Large messages** (§5.3.2): a request to send (RTS) with the size; the
//!   receiver allocates the destination from its receive pool and answers
//!   clear to send (CTS) with address and rkey; the sender WRITEs fragments
//!   of at most `fragment_size` bytes to consecutive addresses, the last as
//!   WRITE_WITH_IMM carrying the message id. The receiver learns of the
//!   message from that completion alone and hands the buffer on as is.
//! - Every SEND and WRITE_WITH_IMM spends a receive credit
//!   ([`ReceiveCredits`]); work requests go through a [`WorkRequestRing`]
//!   as deep as the send queue.
//!
//! Small messages are delivered in order, large ones when their last
//! fragment lands, so a small message may overtake a large one sent before
//! it (the RPC layer matches responses by id and does not care).

use std::collections::{HashMap, VecDeque};

use bytes::Bytes;

use super::control::{ControlHeader, ControlKind, HEADER_LEN};
use super::credits::ReceiveCredits;
use super::ring::{RingEntry, WorkRequestRing};
use crate::Message;
use crate::pool::{Pool, PoolBuf, lookup};
use crate::verbs::{RecvWr, SendOp, SendWr, Sge, WcKind, WcStatus, WorkCompletion};

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
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            send_queue_depth: 32,
            recv_queue_depth: 64,
            small_message_limit: 8 << 10,
            fragment_size: 64 << 10,
            max_sge: 4,
            max_message_size: 64 << 20,
        }
    }
}

/// Why an engine stopped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// A work request failed; the queue pair is in error.
    #[error("work request failed: {0:?}")]
    Completion(WcStatus),
    /// The peer broke the protocol.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// No pool memory.
    #[error("no buffer memory: {0}")]
    Memory(String),
    /// A message to send is larger than the limit.
    #[error("message of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// Its size.
        len: u64,
        /// The limit.
        max: u64,
    },
}

/// What the engine has for its owner.
#[derive(Debug)]
pub enum EngineEvent {
    /// A whole message arrived (in receive-pool memory).
    Message(Bytes),
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
    /// Times sending waited for credits.
    pub credit_stalls: u64,
    /// Message parts copied into the send pool because they were not in
    /// memory registered with this engine's device.
    pub fallback_copies: u64,
    /// Explicit credit-return messages sent.
    pub credit_messages: u64,
}

#[derive(Debug)]
struct Outgoing {
    parts: Vec<Bytes>,
    len: usize,
}

#[derive(Debug)]
struct LargeSend {
    msg_id: u32,
    message: Outgoing,
    addr: u64,
    rkey: u32,
    offset: usize,
}

/// One engine (see the module docs).
#[derive(Debug)]
pub struct Engine {
    config: EngineConfig,
    send_pool: Pool,
    recv_pool: Pool,
    ring: WorkRequestRing,
    credits: ReceiveCredits,
    outbox: VecDeque<Outgoing>,
    control: VecDeque<(u32, ControlKind)>,
    awaiting_cts: HashMap<u32, Outgoing>,
    writing: VecDeque<LargeSend>,
    incoming: HashMap<u32, PoolBuf>,
    recv_slots: Vec<Option<PoolBuf>>,
    consumed_slots: Vec<usize>,
    spare: Vec<PoolBuf>,
    receives_posted: bool,
    events: VecDeque<EngineEvent>,
    next_msg_id: u32,
    failed: bool,
    stats: EngineStats,
}

impl Engine {
    /// An engine whose peer has `peer_recv_depth` receives posted at start
    /// (exchanged at connection setup).
    pub fn new(
        config: EngineConfig,
        send_pool: Pool,
        recv_pool: Pool,
        peer_recv_depth: u32,
    ) -> Self {
        Self {
            ring: WorkRequestRing::new(config.send_queue_depth as usize),
            credits: ReceiveCredits::new(peer_recv_depth, config.recv_queue_depth),
            recv_slots: (0..config.recv_queue_depth).map(|_| None).collect(),
            config,
            send_pool,
            recv_pool,
            outbox: VecDeque::new(),
            control: VecDeque::new(),
            awaiting_cts: HashMap::new(),
            writing: VecDeque::new(),
            incoming: HashMap::new(),
            consumed_slots: Vec::new(),
            spare: Vec::new(),
            receives_posted: false,
            events: VecDeque::new(),
            next_msg_id: 1,
            failed: false,
            stats: EngineStats::default(),
        }
    }

    /// Adds credits granted by the peer outside the control header (its
    /// initial receive depth, learned at connection setup).
    pub fn grant_credits(&mut self, credits: u16) {
        self.credits.returned(credits);
    }

    /// Counters.
    pub fn stats(&self) -> EngineStats {
        self.stats
    }

    /// Work requests in flight on the send queue.
    pub fn in_flight(&self) -> usize {
        self.ring.in_flight()
    }

    /// Whether the engine has failed.
    pub fn is_failed(&self) -> bool {
        self.failed
    }

    /// Whether everything queued has been sent and completed.
    pub fn is_idle(&self) -> bool {
        self.outbox.is_empty()
            && self.control.is_empty()
            && self.awaiting_cts.is_empty()
            && self.writing.is_empty()
            && self.ring.in_flight() == 0
            && self.ring.pending() == 0
    }

    fn recv_buffer_size(&self) -> usize {
        HEADER_LEN + self.config.small_message_limit
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
        self.outbox.clear();
        self.control.clear();
        self.awaiting_cts.clear();
        self.writing.clear();
        self.events.push_back(EngineEvent::Failed(error));
    }

    fn alloc(pool: &Pool, len: usize) -> Result<PoolBuf, EngineError> {
        let mut buf = pool
            .alloc(len)
            .map_err(|e| EngineError::Memory(e.to_string()))?;
        buf.set_len(len);
        Ok(buf)
    }

    /// Queues a message. Parts outside registered memory are copied into the
    /// send pool (and counted); small messages with more parts than fit in
    /// one work request are gathered into one buffer.
    pub fn send(&mut self, message: Message) -> Result<(), EngineError> {
        if self.failed {
            return Err(EngineError::Protocol("engine has failed".into()));
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
            if lookup(part.as_ptr() as usize).is_some_and(|region| own.contains(&region.pool_id)) {
                parts.push(part.clone());
            } else {
                self.stats.fallback_copies += 1;
                parts.push(
                    self.send_pool
                        .alloc_copy(part)
                        .map_err(|e| EngineError::Memory(e.to_string()))?
                        .freeze(),
                );
            }
        }
        if len <= self.config.small_message_limit && parts.len() + 1 > self.config.max_sge as usize
        {
            let mut joined = Self::alloc(&self.send_pool, len)?;
            let mut at = 0;
            for part in &parts {
                joined[at..at + part.len()].copy_from_slice(part);
                at += part.len();
            }
            parts = vec![joined.freeze()];
        }
        self.outbox.push_back(Outgoing { parts, len });
        Ok(())
    }

    fn sge(bytes: &Bytes) -> Option<Sge> {
        let region = lookup(bytes.as_ptr() as usize)?;
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
        payload: &[Bytes],
    ) -> Result<(), EngineError> {
        let header = ControlHeader {
            kind,
            credits: self.credits.take_returnable(),
            msg_id,
        };
        let header = self
            .send_pool
            .alloc_copy(&header.encode())
            .map_err(|e| EngineError::Memory(e.to_string()))?
            .freeze();
        let mut keep = Vec::with_capacity(payload.len() + 1);
        let mut sges = Vec::with_capacity(payload.len() + 1);
        for part in std::iter::once(&header).chain(payload) {
            let sge = Self::sge(part)
                .ok_or_else(|| EngineError::Memory("unregistered send buffer".into()))?;
            sges.push(sge);
            keep.push(part.clone());
        }
        self.credits.spend();
        self.ring.push(RingEntry {
            wr: SendWr {
                wr_id: 0,
                op: SendOp::Send,
                sges,
                signaled: false,
            },
            keep,
        });
        Ok(())
    }

    /// Queues the next fragment of the large message at the front of
    /// `writing`. Returns `false` if it could not (no credit for the last).
    fn push_fragment(&mut self) -> Result<bool, EngineError> {
        let max_sge = self.config.max_sge as usize;
        let fragment_size = self.config.fragment_size;
        let Some(transfer) = self.writing.front() else {
            return Ok(false);
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
            sges.push(
                Self::sge(&slice)
                    .ok_or_else(|| EngineError::Memory("unregistered send buffer".into()))?,
            );
            keep.push(slice);
            room -= take;
            skip = 0;
        }
        let length: usize = sges.iter().map(|s| s.len as usize).sum();
        let last = length == remaining;
        if last && !self.credits.can_send_data() {
            self.stats.credit_stalls += 1;
            return Ok(false);
        }
        let remote_addr = transfer.addr as usize + transfer.offset;
        let op = if last {
            SendOp::WriteWithImm {
                remote_addr,
                rkey: transfer.rkey,
                imm: transfer.msg_id,
            }
        } else {
            SendOp::Write {
                remote_addr,
                rkey: transfer.rkey,
            }
        };
        if last {
            self.credits.spend();
            self.writing.pop_front();
            self.stats.large_sent += 1;
        } else if let Some(front) = self.writing.front_mut() {
            front.offset += length;
        }
        self.ring.push(RingEntry {
            wr: SendWr {
                wr_id: 0,
                op,
                sges,
                signaled: false,
            },
            keep,
        });
        Ok(true)
    }

    fn fill_ring(&mut self) -> Result<(), EngineError> {
        let mut pushed_send = false;
        while self.ring.pending() < self.ring.free() {
            if !self.control.is_empty() && self.credits.can_send_control() {
                if let Some((msg_id, kind)) = self.control.pop_front() {
                    self.push_send(kind, msg_id, &[])?;
                    pushed_send = true;
                }
                continue;
            }
            if !self.writing.is_empty() && self.push_fragment()? {
                continue;
            }
            let Some(next) = self.outbox.front() else {
                break;
            };
            if !self.credits.can_send_data() {
                self.stats.credit_stalls += 1;
                break;
            }
            let small = next.len <= self.config.small_message_limit;
            let Some(message) = self.outbox.pop_front() else {
                break;
            };
            if small {
                self.push_send(ControlKind::Data, 0, &message.parts)?;
                self.stats.small_sent += 1;
            } else {
                let msg_id = self.next_msg_id;
                self.next_msg_id = self.next_msg_id.wrapping_add(1).max(1);
                self.push_send(
                    ControlKind::Rts {
                        size: message.len as u64,
                    },
                    msg_id,
                    &[],
                )?;
                self.awaiting_cts.insert(msg_id, message);
            }
            pushed_send = true;
        }
        // Owed credits with no SEND to carry them: a message of their own.
        if !pushed_send
            && self.credits.owes_batch()
            && self.credits.can_send_control()
            && self.ring.pending() < self.ring.free()
        {
            self.push_send(ControlKind::Credit, 0, &[])?;
            self.stats.credit_messages += 1;
        }
        Ok(())
    }

    /// The next batch of send work requests to post with one `post_send`.
    pub fn poll_transmit(&mut self) -> Option<Vec<SendWr>> {
        if self.failed {
            return None;
        }
        if let Err(err) = self.fill_ring() {
            self.fail(err);
            return None;
        }
        self.ring.take_batch()
    }

    /// Receive work requests to post: the whole queue at start, then
    /// batches of d/2 as receives are consumed.
    pub fn poll_recv_post(&mut self) -> Option<Vec<RecvWr>> {
        if self.failed {
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
            let Some(region) = buf.region() else {
                self.fail(EngineError::Memory(
                    "receive buffer outside the pool".into(),
                ));
                return None;
            };
            wrs.push(RecvWr {
                wr_id: slot as u64,
                sge: Sge {
                    addr: buf.as_ptr() as usize,
                    len: u32::try_from(buf.len()).unwrap_or(u32::MAX),
                    lkey: region.lkey,
                },
            });
            self.recv_slots[slot] = Some(buf);
        }
        Some(wrs)
    }

    /// The next event for the owner.
    pub fn poll_event(&mut self) -> Option<EngineEvent> {
        self.events.pop_front()
    }

    /// Feeds a work completion of this engine's QP.
    pub fn handle_completion(&mut self, completion: &WorkCompletion) {
        if self.failed {
            return;
        }
        if completion.status != WcStatus::Success {
            self.fail(EngineError::Completion(completion.status));
            return;
        }
        match completion.kind {
            WcKind::Send => {
                self.ring.complete(completion.wr_id);
            }
            WcKind::Recv | WcKind::RecvWithImm(_) => {
                let slot = completion.wr_id as usize;
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

    fn received(&mut self, completion: &WorkCompletion, buf: PoolBuf) -> Result<(), EngineError> {
        if let WcKind::RecvWithImm(msg_id) = completion.kind {
            self.spare.push(buf);
            let message = self.incoming.remove(&msg_id).ok_or_else(|| {
                EngineError::Protocol(format!("write with immediate for unknown message {msg_id}"))
            })?;
            self.stats.received += 1;
            self.events
                .push_back(EngineEvent::Message(message.freeze()));
            return Ok(());
        }
        let len = completion.byte_len as usize;
        let header = ControlHeader::decode(&buf[..len.min(buf.len())])
            .map_err(|e| EngineError::Protocol(e.to_string()))?;
        self.credits.returned(header.credits);
        match header.kind {
            ControlKind::Data => {
                self.stats.received += 1;
                let message = buf.freeze().slice(HEADER_LEN..len);
                self.events.push_back(EngineEvent::Message(message));
            }
            ControlKind::Rts { size } => {
                self.spare.push(buf);
                if size > self.config.max_message_size {
                    return Err(EngineError::Protocol(format!(
                        "peer wants to send {size} bytes, above the limit of {}",
                        self.config.max_message_size
                    )));
                }
                let dest = Self::alloc(&self.recv_pool, size as usize)?;
                let region = dest
                    .region()
                    .ok_or_else(|| EngineError::Memory("destination outside the pool".into()))?;
                let addr = dest.as_ptr() as u64;
                self.incoming.insert(header.msg_id, dest);
                self.control.push_back((
                    header.msg_id,
                    ControlKind::Cts {
                        addr,
                        rkey: region.rkey,
                    },
                ));
            }
            ControlKind::Cts { addr, rkey } => {
                self.spare.push(buf);
                let message = self.awaiting_cts.remove(&header.msg_id).ok_or_else(|| {
                    EngineError::Protocol(format!(
                        "clear to send for unknown message {}",
                        header.msg_id
                    ))
                })?;
                self.writing.push_back(LargeSend {
                    msg_id: header.msg_id,
                    message,
                    addr,
                    rkey,
                    offset: 0,
                });
            }
            ControlKind::Credit => self.spare.push(buf),
        }
        Ok(())
    }
}
