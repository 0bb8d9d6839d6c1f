//! Offers: a destination for a socket's next large message, given before
//! the peer asks, so that request/response traffic of large messages pays
//! no RTS/CTS round trip after the first one.
//!
//! **Receiver.** Once a large message of a socket has been delivered, the
//! engine allocates a buffer for the next one ([`offer_size`] of the last
//! message's length: room for its 8-byte length prefix and some growth),
//! binds a window over it where the peer is confined, and sends `Offer`
//! with its address and key (the offer id, [`OFFER_BIT`] set, in the
//! header's message id; the size in 8 bytes after the header). The buffer
//! waits in `incoming` like a grant. At most one offer per socket is out,
//! and offers hold at most half of `max_granted_bytes` and half of the
//! memory windows, so that requests to send are always granted in the end:
//! a socket whose next message is larger than its offer asks by RTS, and a
//! grant never waits for an offer to be used (a request alone but for
//! offers is granted whatever its size, as one alone always was: the
//! granted bytes may then exceed `max_granted_bytes` by the offers'
//! bytes, at most half of it). An engine of an accepted
//! connection that draws on the server's inbound budget makes none (an
//! idle offer would hold budget other connections need).
//!
//! **Sender.** A socket keeps the offer it was given. When its next large
//! message fits (8 + length within the size), the message goes to the
//! offered address without an RTS: an 8-byte little-endian length prefix
//! and the message, as WRITEs of at most `fragment_size` bytes, the last
//! one WRITE_WITH_IMM carrying the offer id (`large.rs` writes them).
//!
//! **Arrival.** The receiver reads the prefix (a length past the offered
//! buffer fails the engine: [`Violation::OfferOverrun`]), invalidates the
//! window, delivers the message (the buffer's bytes after the prefix) in
//! order, and offers again.
//!
//! **End.** An offer not used is freed when the peer closes or refuses the
//! socket (its `Close` comes after its last message, in order on the
//! queue pair), or this side refuses it, or with the engine; an `Offer`
//! not yet sent is dropped; where a window was bound over it, the buffer
//! goes back to the pool only once the window's invalidation has
//! completed. After an overrun the engine fails and the buffer stays
//! with it (the peer may write into it until the queue pair is in error).

#[allow(clippy::wildcard_imports)]
use super::*;

/// Set in the id of every offer; message ids (the peer's) stay below it.
pub const OFFER_BIT: u32 = 1 << 31;

/// Bytes of the length prefix an offered message is written behind.
pub const PREFIX_LEN: usize = 8;

/// The size of the offer made after a message of `len` bytes: the prefix,
/// the message and a quarter more (the next answer of a request/response
/// socket is often a little larger), in whole cache lines.
pub fn offer_size(len: usize) -> usize {
    (PREFIX_LEN + len + len / 4).div_ceil(64) * 64
}

/// An offer the peer made for one of this engine's sockets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct PeerOffer {
    pub(super) id: u32,
    pub(super) addr: u64,
    pub(super) rkey: u32,
    pub(super) size: u64,
    /// The buffer's key on each of the peer's rails (`stripes.rs`).
    pub(super) rail_keys: Vec<u32>,
}

impl Engine {
    /// After a large message of `len` bytes was delivered on `socket`:
    /// an offer for the next one, where the limits allow (module docs).
    pub(super) fn offer_after(&mut self, socket: SocketId, len: usize) {
        if !self.config.offers
            || self.inbound.is_some()
            || !self.open.contains(&socket)
            || self.offered.contains_key(&socket)
        {
            return;
        }
        // Never room for more than the largest message taken (an offer
        // has a quarter to spare; that room must not invite a message the
        // limit refuses).
        let most = PREFIX_LEN
            .saturating_add(usize::try_from(self.config.max_message_size).unwrap_or(usize::MAX));
        let size = offer_size(len).min(most);
        let bytes = size as u64;
        if self.offered_bytes + bytes > self.config.max_granted_bytes / 2
            || self.granted_bytes + bytes > self.config.max_granted_bytes
        {
            return;
        }
        // Half the windows at most, so that grants always find one.
        if self.windows.enabled() && (self.offered.len() + 1) * 2 > self.windows.count() {
            return;
        }
        let Ok(dest) = Self::alloc(&self.recv_pool, size) else {
            return;
        };
        let id = loop {
            let id = self.next_offer_id | OFFER_BIT;
            self.next_offer_id = self.next_offer_id.wrapping_add(1) & !OFFER_BIT;
            if !self.incoming.contains_key(&id) {
                break id;
            }
        };
        let addr = dest.as_ptr() as u64;
        // No window to spare (or no key): no offer.
        let Some(rkey) = self.expose(id, &dest) else {
            return;
        };
        let keys = self.rail_keys(&dest);
        self.granted_bytes += bytes;
        self.offered_bytes += bytes;
        self.offered.insert(socket, id);
        self.incoming.insert(id, (socket, dest, None));
        self.stats.offers_made += 1;
        self.control.push_back(Control::Offer {
            id,
            socket,
            addr,
            rkey,
            size: bytes,
            keys,
        });
    }

    /// The WRITE_WITH_IMM of offer `id` completed: the message behind the
    /// prefix is delivered, and the socket offered a destination again.
    pub(super) fn received_offered(&mut self, id: u32) -> Result<(), EngineError> {
        let unknown = EngineError::Protocol(Violation::UnknownMessage(id));
        let (len, room) = {
            let (_, dest, _) = self.incoming.get(&id).ok_or(unknown.clone())?;
            let prefix: [u8; PREFIX_LEN] = dest
                .get(..PREFIX_LEN)
                .and_then(|p| p.try_into().ok())
                .ok_or(unknown.clone())?;
            (
                u64::from_le_bytes(prefix),
                dest.len().saturating_sub(PREFIX_LEN) as u64,
            )
        };
        if len > room {
            // The buffer stays in `incoming`, its window bound: the peer
            // may write into it until the queue pair is in error, so it
            // goes with the engine (`Engine::fail`'s rule).
            return Err(EngineError::Protocol(Violation::OfferOverrun { len, room }));
        }
        // The limit holds for offered messages as for requests to send
        // (`receive.rs`); the buffer stays, as above.
        if len > self.config.max_message_size {
            return Err(EngineError::Protocol(Violation::TooLarge {
                size: len,
                max: self.config.max_message_size,
            }));
        }
        let (socket, dest, permit) = self.incoming.remove(&id).ok_or(unknown)?;
        let size = dest.len() as u64;
        self.granted_bytes = self.granted_bytes.saturating_sub(size);
        self.offered_bytes = self.offered_bytes.saturating_sub(size);
        if self.offered.get(&socket) == Some(&id) {
            self.offered.remove(&socket);
        }
        let len = len as usize;
        let after = self
            .windows
            .release_grant(id)
            .map(|invalidate| self.push_local(invalidate));
        let message =
            crate::inbound::budgeted(dest, [permit, None]).slice(PREFIX_LEN..PREFIX_LEN + len);
        self.stats.offers_used += 1;
        self.deliver_after(socket, message, after);
        self.offer_after(socket, len);
        Ok(())
    }

    /// The peer closed or refused `socket` (or this side refused it): the
    /// offer it did not use is freed (once its window's invalidation has
    /// completed, where one was bound), its `Offer` dropped if not sent.
    pub(super) fn withdraw_offer(&mut self, socket: SocketId) {
        let Some(id) = self.offered.remove(&socket) else {
            return;
        };
        self.control.retain(
            |control| !matches!(control, Control::Offer { id: queued, .. } if *queued == id),
        );
        let Some((_, dest, _permit)) = self.incoming.remove(&id) else {
            return;
        };
        let size = dest.len() as u64;
        self.granted_bytes = self.granted_bytes.saturating_sub(size);
        self.offered_bytes = self.offered_bytes.saturating_sub(size);
        match self.windows.release_grant(id) {
            Some(invalidate) => {
                let after = self.push_local(invalidate);
                self.retiring.push_back((after, dest));
            }
            None => drop(dest),
        }
    }

    /// The peer's offer `offer` for `socket` (control message `Offer`).
    pub(super) fn take_offer(
        &mut self,
        socket: SocketId,
        offer: PeerOffer,
    ) -> Result<(), EngineError> {
        if offer.id & OFFER_BIT == 0 {
            return Err(EngineError::Protocol(Violation::NotAnOffer(offer.id)));
        }
        // Messages go to `addr + offset` within the offer's size.
        super::receive::check_destination(offer.addr, offer.size)?;
        if !self.config.offers {
            return Ok(());
        }
        // A socket closed here meanwhile: the peer frees it at our Close.
        let Some(tx) = self.sockets.get_mut(&socket) else {
            return Ok(());
        };
        if tx.offer.is_some() {
            return Err(EngineError::Protocol(Violation::OfferAgain(socket)));
        }
        tx.offer = Some(offer);
        self.schedule(socket);
        Ok(())
    }

    /// Offers out (made, not yet used or withdrawn), and their bytes.
    #[cfg(test)]
    pub(crate) fn offers_out(&self) -> (usize, u64) {
        (self.offered.len(), self.offered_bytes)
    }

    /// Buffers of withdrawn offers waiting for their window's
    /// invalidation.
    #[cfg(test)]
    pub(crate) fn retiring_len(&self) -> usize {
        self.retiring.len()
    }

    /// Buffers withdrawn from offers whose window invalidation has
    /// completed (send work requests up to `wr_id`) go back to the pool.
    pub(super) fn release_retiring(&mut self, wr_id: u64) {
        while self
            .retiring
            .front()
            .is_some_and(|(after, _)| *after <= wr_id)
        {
            self.retiring.pop_front();
        }
    }
}
