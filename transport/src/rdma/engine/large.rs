//! Large messages (§5.3.2): a request to send (RTS), the receiver's clear to
//! send (CTS) with the destination, then WRITEs of at most `fragment_size`
//! bytes to consecutive addresses, the last one WRITE_WITH_IMM carrying the
//! message id. The RTS is queued by the scheduler (`scheduler.rs`), the CTS
//! handled on receipt (`receive.rs`), grants made by the receiver in
//! `grants.rs`; this file writes the fragments.

use super::offers::{OFFER_BIT, PREFIX_LEN};
#[allow(clippy::wildcard_imports)]
use super::*;

/// A large message on its way: its id, its parts, the destination once
/// the CTS came, and how much of it is written.
#[derive(Debug)]
pub(super) struct LargeSend {
    pub(super) msg_id: u32,
    pub(super) message: Outgoing,
    pub(super) dest: Option<(u64, u32)>,
    pub(super) offset: usize,
}

impl Engine {
    /// The next WRITE fragment of `socket`'s first large message.
    pub(super) fn push_fragment(&mut self, socket: SocketId) -> Result<Turn, EngineError> {
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
            sges.push(Self::sge(&slice, rail).ok_or(EngineError::Unregistered("a send buffer"))?);
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
