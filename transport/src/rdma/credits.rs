//! Receive credits (§5.4.2).
//!
//! A sender may only SEND (or WRITE_WITH_IMM) when the peer has a receive
//! posted for it; it learns how many from credits. Each side starts with the
//! peer's receive depth as credits; every SEND and WRITE_WITH_IMM spends
//! one. The receiver reposts consumed receives in batches of `k = depth/2`
//! and returns the credits, piggy-backed on its next SEND or in an explicit
//! credit message. The last credit is kept for control messages (which
//! always return credits), so two peers that have both run out of data
//! credits can still tell each other about reposted receives: with credits
//! enforced this way, a receiver-not-ready event cannot happen.

/// Both halves of the credit accounting of one engine.
#[derive(Debug, Clone)]
pub struct ReceiveCredits {
    /// The peer takes receives from a shared receive queue: there is no
    /// per-peer bound to respect (it retries on receiver-not-ready).
    peer_shared: bool,
    /// Our receives come from a shared receive queue: nothing to count or
    /// return.
    own_shared: bool,
    /// SENDs the peer can take now.
    peer_credits: u32,
    /// Our receives consumed and not yet reposted.
    consumed: u32,
    /// Our receives reposted whose credits the peer has not been told of.
    unreturned: u32,
    batch: u32,
}

impl ReceiveCredits {
    /// Credits for a peer with `peer_depth` receives posted, and our own
    /// receive queue of `local_depth`.
    pub fn new(peer_depth: u32, local_depth: u32) -> Self {
        Self {
            peer_shared: false,
            own_shared: false,
            peer_credits: peer_depth,
            consumed: 0,
            unreturned: 0,
            batch: (local_depth / 2).max(1),
        }
    }

    /// Our receives come from a shared receive queue (see the module docs
    /// of the SRQ option): nothing is counted or returned.
    pub fn set_own_shared(&mut self) {
        self.own_shared = true;
        self.consumed = 0;
        self.unreturned = 0;
    }

    /// The peer's receives come from a shared receive queue: sending is not
    /// bounded by credits.
    pub fn set_peer_shared(&mut self) {
        self.peer_shared = true;
    }

    /// Credits available for sending.
    pub fn peer_credits(&self) -> u32 {
        self.peer_credits
    }

    /// Whether a data message (small SEND, request to send, or the final
    /// WRITE_WITH_IMM) may be sent: one credit always stays in reserve.
    pub fn can_send_data(&self) -> bool {
        self.peer_shared || self.peer_credits >= 2
    }

    /// Whether a control message (clear to send, credit return) may be sent.
    pub fn can_send_control(&self) -> bool {
        self.peer_shared || self.peer_credits >= 1
    }

    /// Spends one credit.
    pub fn spend(&mut self) {
        self.peer_credits = self.peer_credits.saturating_sub(1);
    }

    /// The peer returned `credits`.
    pub fn returned(&mut self, credits: u16) {
        self.peer_credits += u32::from(credits);
    }

    /// One of our receives was consumed.
    pub fn consumed(&mut self) {
        if !self.own_shared {
            self.consumed += 1;
        }
    }

    /// How many receives to repost now (a whole batch, or none).
    pub fn take_repost(&mut self) -> u32 {
        if self.consumed < self.batch {
            return 0;
        }
        let n = self.consumed;
        self.consumed = 0;
        self.unreturned += n;
        n
    }

    /// Credits to piggy-back on the next SEND (all that are owed).
    pub fn take_returnable(&mut self) -> u16 {
        let n = self.unreturned.min(u32::from(u16::MAX));
        self.unreturned -= n;
        n as u16
    }

    /// Whether enough credits are owed to justify a message of their own.
    pub fn owes_batch(&self) -> bool {
        self.unreturned >= self.batch
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credits_are_spent_reposted_in_batches_and_returned() {
        let mut mine = ReceiveCredits::new(4, 4);
        assert!(mine.can_send_data());
        for _ in 0..3 {
            mine.spend();
        }
        assert!(
            !mine.can_send_data() && mine.can_send_control(),
            "the last credit is reserved"
        );
        mine.consumed();
        assert_eq!(mine.take_repost(), 0, "wait for a batch of depth/2");
        mine.consumed();
        assert_eq!(mine.take_repost(), 2);
        assert!(mine.owes_batch());
        assert_eq!(mine.take_returnable(), 2);
        assert_eq!(mine.take_returnable(), 0);
        mine.returned(3);
        assert_eq!(mine.peer_credits(), 4);
    }
}
