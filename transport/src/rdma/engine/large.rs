//! Large messages (§5.3.2): a request to send (RTS), the receiver's clear to
//! send (CTS) with the destination, then WRITEs of at most `fragment_size`
//! bytes to consecutive addresses, the last one WRITE_WITH_IMM carrying the
//! message id. The RTS is queued by the scheduler (`scheduler.rs`), the CTS
//! handled on receipt (`receive.rs`), grants made by the receiver in
//! `grants.rs`; this file writes the fragments.

use super::offers::{OFFER_BIT, PREFIX_LEN};
use super::stripes::{Range, Striping, slices};
#[allow(clippy::wildcard_imports)]
use super::*;

/// A large message on its way: its id, its parts, the destination once
/// the CTS came, and how much of it is written.
#[derive(Debug)]
pub(super) struct LargeSend {
    pub(super) msg_id: u32,
    pub(super) message: Outgoing,
    pub(super) dest: Option<(u64, u32)>,
    /// Bytes written in order from the start (not striped), or of the
    /// last fragment's range (striped).
    pub(super) offset: usize,
    /// The destination's key on each of the receiver's rails (none: it
    /// cannot be striped).
    pub(super) rail_keys: Vec<u32>,
    /// Its striping over other rails, once planned (`stripes.rs`).
    pub(super) stripe: Option<Striping>,
}

impl Engine {
    /// The next WRITE fragment of `socket`'s first large message (a
    /// striped one's: a range the partners did not take, `stripes.rs`).
    pub(super) fn push_fragment(&mut self, socket: SocketId) -> Result<Turn, EngineError> {
        self.plan_stripes(socket);
        let max_sge = self.config.max_sge as usize;
        let fragment_size = self.fragment_size;
        let can_finish = self.credits.can_send_data();
        let rail = self.config.rail;
        let Some(tx) = self.sockets.get_mut(&socket) else {
            return Ok(Turn::Done);
        };
        let Some(transfer) = tx.large.front_mut() else {
            return Ok(Turn::Done);
        };
        let Some((addr, rkey)) = transfer.dest else {
            return Ok(Turn::Blocked);
        };
        let len = transfer.message.len;
        // Striped, the home takes bytes of the shared range as a partner
        // does: no more in flight than a partner's chunks, or it would
        // queue most of the message at once and leave the other rails
        // little. It goes on when its writes complete.
        let share = self
            .config
            .stripe
            .map_or(0, |c| c.depth.max(1) * c.chunk_bytes);
        if transfer
            .stripe
            .as_ref()
            .is_some_and(Striping::has_body_left)
            && self.window.in_flight() >= share
        {
            self.stripes_throttled(socket);
            return Ok(Turn::Blocked);
        }
        let Some(tx) = self.sockets.get_mut(&socket) else {
            return Ok(Turn::Done);
        };
        let Some(transfer) = tx.large.front_mut() else {
            return Ok(Turn::Done);
        };
        let range = match transfer.stripe.as_mut() {
            None => Range {
                start: transfer.offset,
                len: fragment_size.min(len - transfer.offset),
            },
            // Waiting for chunks on other rails before the last fragment.
            Some(stripe) => match stripe.take_own(transfer.offset, len, fragment_size) {
                Some(range) => range,
                None => return Ok(Turn::Blocked),
            },
        };
        // The range the home writes in order up to the end (the whole
        // message unstriped, the last fragment striped): `offset` follows
        // it; a range below is the striping's to take back if not written.
        let tail = transfer
            .stripe
            .as_ref()
            .is_none_or(|stripe| range.start >= stripe.end());
        let keep = slices(&transfer.message.parts, range.start, range.len, max_sge);
        let mut sges = Vec::with_capacity(keep.len());
        for slice in &keep {
            sges.push(Self::sge(slice, rail).ok_or(EngineError::Unregistered("a send buffer"))?);
        }
        let length: usize = sges.iter().map(|s| s.len as usize).sum();
        let last = tail && range.start + length == len;
        let blocked = if last && !can_finish {
            self.stats.credit_stalls += 1;
            Some(Turn::NoCredit)
        } else if !self.window.admit(length) {
            Some(Turn::NoWindow)
        } else {
            None
        };
        if let Some(turn) = blocked {
            if !tail && let Some(stripe) = transfer.stripe.as_mut() {
                stripe.give_back(range.start, range.len);
            }
            return Ok(turn);
        }
        if tail {
            transfer.offset = range.start + length;
        } else if length < range.len
            && let Some(stripe) = transfer.stripe.as_mut()
        {
            // Fewer scatter/gather entries than the range needed: the rest
            // is taken again.
            stripe.give_back(range.start + length, range.len - length);
        }
        // Cannot overflow: `addr + len` was checked when the destination
        // came (`receive::check_destination`), and `range` lies within `len`.
        let remote_addr = addr as usize + range.start;
        let op = if last {
            SendOp::WriteWithImm {
                remote_addr,
                rkey,
                imm: transfer.msg_id,
            }
        } else {
            SendOp::Write { remote_addr, rkey }
        };
        if last {
            let done = tx.large.pop_front();
            self.events.push_back(EngineEvent::Sent(socket));
            self.credits.spend();
            self.stats.large_sent += 1;
            // Less the length prefix of a message sent to an offer.
            self.stats.bytes_sent += done.map_or(0, |d| {
                let prefix = if d.msg_id & OFFER_BIT != 0 {
                    PREFIX_LEN
                } else {
                    0
                };
                (d.message.len - prefix) as u64
            });
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
}
