//! The fragment scheduler (§6.1): engine-level control messages first, then
//! the sockets with work in turn, round robin, one fragment (a SEND, an RTS
//! or one WRITE of at most `fragment_size` bytes) per turn, while the ring
//! has room for another doorbell batch, the credits and the send window
//! allow. Between two turns of one socket each other socket sends at most
//! one fragment: a small message waits behind at most (n−1)·S bytes, never
//! behind a whole large message.

use super::offers::{OFFER_BIT, PREFIX_LEN};
#[allow(clippy::wildcard_imports)]
use super::*;
use crate::rdma::control::{OFFER_LEN, encode_rail_keys};

/// An engine-level control message waiting for its turn.
#[derive(Debug)]
pub(super) enum Control {
    Cts {
        msg_id: u32,
        addr: u64,
        rkey: u32,
        /// The destination's key on each rail (`stripes.rs`; often none).
        keys: Vec<u32>,
    },
    /// Where the peer writes its keepalive (a window on our slot).
    Slot {
        addr: u64,
        rkey: u32,
    },
    /// A destination for `socket`'s next large message (`offers.rs`).
    Offer {
        id: u32,
        socket: SocketId,
        addr: u64,
        rkey: u32,
        size: u64,
        keys: Vec<u32>,
    },
    Open(SocketId),
    Accept(SocketId),
    Refuse(SocketId),
    Keepalive,
}

/// What one socket's turn produced.
pub(super) enum Turn {
    Fragment,
    Blocked,
    NoCredit,
    NoWindow,
    Done,
}

impl Engine {
    /// The first engine-level control message that its credit and the
    /// window allow (a keepalive needs no credit and may pass an `Open`
    /// waiting for one).
    pub(super) fn push_control(&mut self) -> Result<bool, EngineError> {
        let credits = &self.credits;
        let position = self.control.iter().position(|control| match control {
            Control::Keepalive => true,
            Control::Open(_) | Control::Accept(_) | Control::Refuse(_) | Control::Offer { .. } => {
                credits.can_send_data()
            }
            Control::Cts { .. } | Control::Slot { .. } => credits.can_send_control(),
        });
        let Some(position) = position else {
            return Ok(false);
        };
        let bytes = match &self.control[position] {
            Control::Keepalive => KEEPALIVE_SLOT_LEN,
            Control::Offer { keys, .. } => OFFER_LEN + 4 * keys.len(),
            Control::Cts { keys, .. } => HEADER_LEN + 4 * keys.len(),
            _ => HEADER_LEN,
        };
        if !self.window.admit(bytes) {
            return Ok(false);
        }
        let Some(control) = self.control.remove(position) else {
            return Ok(false);
        };
        match control {
            Control::Cts {
                msg_id,
                addr,
                rkey,
                keys,
            } => {
                let parts = match keys.is_empty() {
                    true => Vec::new(),
                    false => vec![
                        self.send_pool
                            .alloc_copy(&encode_rail_keys(&keys))
                            .map_err(EngineError::Memory)?
                            .freeze(),
                    ],
                };
                self.push_send(ControlKind::Cts { addr, rkey }, msg_id, 0, &parts)?;
            }
            Control::Slot { addr, rkey } => {
                self.push_send(ControlKind::Slot { addr, rkey }, 0, 0, &[])?;
            }
            Control::Offer {
                id,
                socket,
                addr,
                rkey,
                size,
                keys,
            } => {
                let mut raw = size.to_le_bytes().to_vec();
                raw.extend(encode_rail_keys(&keys));
                let size = self
                    .send_pool
                    .alloc_copy(&raw)
                    .map_err(EngineError::Memory)?
                    .freeze();
                self.push_send(ControlKind::Offer { addr, rkey }, id, socket, &[size])?;
            }
            Control::Open(socket) => self.push_send(ControlKind::Open, 0, socket, &[])?,
            Control::Accept(socket) => self.push_send(ControlKind::Accept, 0, socket, &[])?,
            Control::Refuse(socket) => self.push_send(ControlKind::Refuse, 0, socket, &[])?,
            Control::Keepalive => self.push_keepalive()?,
        }
        Ok(true)
    }

    /// One fragment of `socket`'s work (see the module docs).
    pub(super) fn socket_turn(&mut self, socket: SocketId) -> Result<Turn, EngineError> {
        let small_limit = self.small_limit;
        let rts_ahead = self.config.rts_ahead.max(1);
        let Some(tx) = self.sockets.get(&socket) else {
            return Ok(Turn::Done);
        };
        // A large message that fits the peer's offer goes there, unasked.
        let offered = match (tx.queue.front(), tx.offer.as_ref()) {
            (Some(Item::Message(m)), Some(offer))
                if m.len > small_limit && (m.len + PREFIX_LEN) as u64 <= offer.size =>
            {
                Some(m.len)
            }
            _ => None,
        };
        if let Some(len) = offered {
            let prefix = self
                .send_pool
                .alloc_copy(&(len as u64).to_le_bytes())
                .map_err(EngineError::Memory)?
                .freeze();
            let Some(tx) = self.sockets.get_mut(&socket) else {
                return Ok(Turn::Done);
            };
            let Some(offer) = tx.offer.take() else {
                return Ok(Turn::Done);
            };
            let Some(Item::Message(mut message)) = tx.queue.pop_front() else {
                return Ok(Turn::Done);
            };
            message.parts.insert(0, prefix);
            message.len += PREFIX_LEN;
            tx.large.push_back(LargeSend {
                msg_id: offer.id,
                message,
                dest: Some((offer.addr, offer.rkey)),
                offset: 0,
                rail_keys: offer.rail_keys,
                stripe: None,
            });
            self.stats.offered_sends += 1;
        }
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
            // Below the offers' ids (`offers.rs`).
            self.next_msg_id = (self.next_msg_id.wrapping_add(1) & !OFFER_BIT).max(1);
            let size = message.len as u64;
            tx.large.push_back(LargeSend {
                msg_id,
                message,
                dest: None,
                offset: 0,
                rail_keys: Vec::new(),
                stripe: None,
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

    pub(super) fn fill_ring(&mut self) -> Result<(), EngineError> {
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
            let turn = match socket {
                stripes::STRIPES => self.stripe_turn()?,
                socket => self.socket_turn(socket)?,
            };
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
                    if socket == stripes::STRIPES {
                        self.stripes_unscheduled();
                    } else if let Some(tx) = self.sockets.get_mut(&socket) {
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
}
