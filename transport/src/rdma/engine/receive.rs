//! Receives and credits (§5.4.2): the engine's own receive queue, posted
//! whole at start and reposted in batches of d/2 as receives are consumed
//! (credits returned to the peer), and what a receive completion brings: a
//! small message, a control message, or a large message's WRITE_WITH_IMM.

use super::offers::{OFFER_BIT, PeerOffer};
#[allow(clippy::wildcard_imports)]
use super::*;
use crate::rdma::control::{OFFER_LEN, decode_offer_size, decode_rail_keys};

impl Engine {
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
            let Some(wr) = recv_wr(wr_id::recv(slot), &buf, self.config.rail) else {
                self.fail(EngineError::Unregistered("a receive buffer"));
                return None;
            };
            wrs.push(wr);
            self.recv_slots[slot] = Some(buf);
        }
        Some(wrs)
    }

    pub(super) fn received(
        &mut self,
        completion: &WorkCompletion,
        buf: PoolBuf,
        now: Instant,
    ) -> Result<(), EngineError> {
        if let WcKind::RecvWithImm(msg_id) = completion.kind {
            self.recycle(buf);
            return self.received_large(msg_id, now);
        }
        // The completion's length is the peer's word: checked before any
        // use (before, a length past the buffer was clamped for decoding
        // but not for slicing, and the slice panicked the I/O thread).
        let len = completion.byte_len as usize;
        if len > buf.len() {
            return Err(EngineError::Protocol(Violation::ReceiveTooLong {
                len,
                buffer: buf.len(),
            }));
        }
        let header =
            ControlHeader::decode(&buf[..len]).map_err(|e| EngineError::Protocol(e.into()))?;
        self.credits.returned(header.credits);
        match header.kind {
            ControlKind::Data => {
                let message = buf.freeze().slice(HEADER_LEN..len);
                self.deliver(header.socket, message);
            }
            ControlKind::Rts { size } => {
                self.recycle(buf);
                self.received_rts(header.msg_id, header.socket, size, now)?;
            }
            ControlKind::Cts { addr, rkey } => {
                let keys = decode_rail_keys(&buf[..len], HEADER_LEN);
                self.recycle(buf);
                self.received_cts(header.msg_id, addr, rkey, keys)?;
            }
            ControlKind::Credit => self.recycle(buf),
            ControlKind::Open => {
                self.recycle(buf);
                self.received_open(header.socket)?;
            }
            ControlKind::Accept => {
                self.recycle(buf);
                self.events.push_back(EngineEvent::Accepted(header.socket));
            }
            ControlKind::Refuse => {
                self.recycle(buf);
                self.withdraw_offer(header.socket);
                self.open.remove(&header.socket);
                self.sockets.remove(&header.socket);
                self.events.push_back(EngineEvent::Refused(header.socket));
            }
            ControlKind::Close => {
                self.recycle(buf);
                let socket = header.socket;
                self.withdraw_offer(socket);
                if self.open.remove(&socket) {
                    self.emit_ordered(EngineEvent::Closed(socket), None);
                }
            }
            ControlKind::Offer { addr, rkey } => {
                let size = decode_offer_size(&buf[..len])
                    .ok_or(EngineError::Protocol(Violation::ShortOffer(len)))?;
                let rail_keys = decode_rail_keys(&buf[..len], OFFER_LEN);
                self.recycle(buf);
                self.take_offer(
                    header.socket,
                    PeerOffer {
                        id: header.msg_id,
                        addr,
                        rkey,
                        size,
                        rail_keys,
                    },
                )?;
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

    /// The end of a large message (a WRITE_WITH_IMM naming it), or of a
    /// message written into an offer: handed on once its window is
    /// invalidated, and its grant's room given to the next.
    fn received_large(&mut self, msg_id: u32, now: Instant) -> Result<(), EngineError> {
        if msg_id & OFFER_BIT != 0 {
            self.received_offered(msg_id)?;
            self.grant_progress(now);
            return self.grant_waiting(now);
        }
        let (socket, message, permit) = self
            .incoming
            .remove(&msg_id)
            .ok_or(EngineError::Protocol(Violation::UnknownMessage(msg_id)))?;
        self.granted_bytes = self.granted_bytes.saturating_sub(message.len() as u64);
        // Confined: the window dies before the message is handed on,
        // so the peer cannot change it once the application has it.
        let after = self
            .windows
            .release_grant(msg_id)
            .map(|invalidate| self.push_local(invalidate));
        // The server's budget stays held while the message's bytes live,
        // as on TCP.
        let len = message.len();
        self.deliver_after(
            socket,
            crate::inbound::budgeted(message, [permit, None]),
            after,
        );
        self.offer_after(socket, len);
        self.grant_progress(now);
        self.grant_waiting(now)?;
        Ok(())
    }

    /// A request to send a large message of `size` bytes on `socket`:
    /// queued for a grant, within the bounds a peer may ask for.
    fn received_rts(
        &mut self,
        msg_id: u32,
        socket: SocketId,
        size: u64,
        now: Instant,
    ) -> Result<(), EngineError> {
        if msg_id & OFFER_BIT != 0 {
            return Err(EngineError::Protocol(Violation::MessageIdInOfferRange(
                msg_id,
            )));
        }
        if size > self.config.max_message_size {
            return Err(EngineError::Protocol(Violation::TooLarge {
                size,
                max: self.config.max_message_size,
            }));
        }
        // A message id already granted (or waiting): its buffer's
        // address and key are the peer's, which may still write
        // into it, so it is never replaced (and so freed); the
        // engine fails.
        if self.incoming.contains_key(&msg_id) || self.waiting_rts.iter().any(|w| w.0 == msg_id) {
            return Err(EngineError::Protocol(Violation::RequestAgain(msg_id)));
        }
        if self.waiting_rts.len() >= MAX_WAITING_RTS {
            return Err(EngineError::Protocol(Violation::TooManyRequests(
                MAX_WAITING_RTS,
            )));
        }
        self.waiting_rts.push_back((msg_id, socket, size));
        self.grant_waiting(now)?;
        Ok(())
    }

    /// The peer's clear-to-send for large message `msg_id`: where to write
    /// it (`addr`, `rkey`; `keys` on the other rails).
    fn received_cts(
        &mut self,
        msg_id: u32,
        addr: u64,
        rkey: u32,
        keys: Vec<u32>,
    ) -> Result<(), EngineError> {
        let socket = self
            .awaiting_cts
            .remove(&msg_id)
            .ok_or(EngineError::Protocol(Violation::UnknownClearToSend(msg_id)))?;
        if let Some(tx) = self.sockets.get_mut(&socket)
            && let Some(transfer) = tx.large.iter_mut().find(|l| l.msg_id == msg_id)
        {
            // The address is the peer's word: every WRITE goes to
            // `addr + offset` within the message, so a destination
            // that wraps is refused here, once, and the sums in
            // `large.rs` and `stripes.rs` cannot overflow.
            check_destination(addr, transfer.message.len as u64)?;
            transfer.dest = Some((addr, rkey));
            transfer.rail_keys = keys;
            self.schedule(socket);
        }
        Ok(())
    }

    /// The peer opens `socket`: one of the peer's numbers, not open yet.
    fn received_open(&mut self, socket: SocketId) -> Result<(), EngineError> {
        let theirs = match self.role {
            Role::Dialer => socket & ACCEPTOR_BIT != 0,
            Role::Acceptor => socket & ACCEPTOR_BIT == 0,
        };
        if !theirs
            || socket & !ACCEPTOR_BIT == 0
            || socket == super::stripes::STRIPES
            || self.open.contains(&socket)
        {
            return Err(EngineError::Protocol(Violation::NotItsSocket(socket)));
        }
        self.open.insert(socket);
        self.sockets.insert(socket, SocketTx::default());
        self.events.push_back(EngineEvent::Opened(socket));
        Ok(())
    }

    /// A receive buffer done with: kept for the next repost of this
    /// engine's own receives, at most one per receive slot. With shared
    /// receives the engine posts none (the I/O thread's queue allocates
    /// its own), so the buffer goes back to the pool; keeping it, as
    /// before, grew the pool by every control message for the life of the
    /// connection.
    pub(super) fn recycle(&mut self, buf: PoolBuf) {
        if !self.config.shared_receives && self.spare.len() < self.recv_slots.len() {
            self.spare.push(buf);
        }
    }
}

/// A destination of `len` bytes at `addr` (the peer's word) whose last byte
/// lies within the address space: every write to it goes to `addr + offset`
/// with `offset < len`, which then cannot overflow.
pub(super) fn check_destination(addr: u64, len: u64) -> Result<(), EngineError> {
    match addr.checked_add(len) {
        Some(_) => Ok(()),
        None => Err(EngineError::Protocol(Violation::AddressOverflow {
            addr,
            len,
        })),
    }
}

/// A receive of all of `buf` (pool memory), returned as `wr_id`; `None` if
/// the buffer lies outside registered memory.
pub(crate) fn recv_wr(wr_id: u64, buf: &PoolBuf, rail: usize) -> Option<RecvWr> {
    let region = buf.region_on(rail)?;
    Some(RecvWr {
        wr_id,
        sge: Sge {
            addr: buf.as_ptr() as usize,
            len: u32::try_from(buf.len()).ok()?,
            lkey: region.lkey,
        },
    })
}
