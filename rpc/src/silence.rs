//! Dead TCP links: a link that goes silent (a cable pulled, a host off the
//! network, a switch port down) answers nothing and reports nothing. The
//! kernel keeps retransmitting with a backoff that doubles each time, so
//! after a 30 s outage its next retransmission can be 20 s after the link
//! has returned, and every call on the old connection waits for it (the
//! multi-host drill 2 found a readmitted server getting no Fetch for 20 s).
//!
//! The rule: when an attempt on a TCP link times out, and the link's oldest
//! unanswered request has waited [`SILENT_AFTER`] with nothing at all heard
//! from the peer since, the link is presumed dead. The channel closes it
//! (its other calls fail at once and are retried elsewhere) and the next
//! call dials again, which fails fast while the link is down and succeeds
//! as soon as it is back. A link that is merely slow keeps answering
//! something, and an idle one has nothing unanswered.
//!
//! Why not `TCP_USER_TIMEOUT`: Linux also aborts a connection whose peer
//! keeps a zero window for that long, which is exactly how a server's
//! inbound budget holds back a large message (up to `frame_timeout_ms`,
//! 30 s). RDMA links need none of this: the transport's keepalive covers
//! them.
//!
//! A sans-IO state: the channel reports sends ([`Silence::handle_sent`])
//! and anything received ([`Silence::handle_heard`]), and asks, with the
//! time passed in, whether the link is silent ([`Silence::is_silent`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long the oldest unanswered request may wait with nothing heard
/// before a timed-out attempt closes its link. 1 s: far above what a live
/// server under load takes to send *something* back (its answers to other
/// calls), and a reconnect costs one handshake.
pub(crate) const SILENT_AFTER: Duration = Duration::from_secs(1);

/// What a link has heard since its oldest unanswered request.
#[derive(Debug)]
pub(crate) struct Silence {
    origin: Instant,
    /// Microseconds after `origin` plus one when the oldest request sent
    /// since the peer was last heard went out; 0: none.
    waiting_since: AtomicU64,
}

impl Silence {
    /// A link opened at `origin`.
    pub(crate) fn new(origin: Instant) -> Self {
        Self {
            origin,
            waiting_since: AtomicU64::new(0),
        }
    }

    /// A request went out at `now`.
    pub(crate) fn handle_sent(&self, now: Instant) {
        let at = now.saturating_duration_since(self.origin).as_micros() as u64 + 1;
        let _ = self
            .waiting_since
            .compare_exchange(0, at, Ordering::AcqRel, Ordering::Acquire);
    }

    /// Something arrived from the peer.
    pub(crate) fn handle_heard(&self) {
        self.waiting_since.store(0, Ordering::Release);
    }

    /// Whether, at `now`, a request has waited [`SILENT_AFTER`] with
    /// nothing heard since.
    pub(crate) fn is_silent(&self, now: Instant) -> bool {
        match self.waiting_since.load(Ordering::Acquire) {
            0 => false,
            at => {
                let sent = self.origin + Duration::from_micros(at - 1);
                now.saturating_duration_since(sent) >= SILENT_AFTER
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_request_unanswered_with_nothing_heard_for_a_second_is_silence() {
        let t0 = Instant::now();
        let link = Silence::new(t0);
        // Idle: nothing unanswered, however long.
        assert!(!link.is_silent(t0 + 60_000 * MS));
        link.handle_sent(t0 + 10 * MS);
        // Later sends do not move the oldest one.
        link.handle_sent(t0 + 500 * MS);
        assert!(!link.is_silent(t0 + 1009 * MS));
        assert!(link.is_silent(t0 + 1010 * MS));
    }

    #[test]
    fn anything_heard_ends_the_wait() {
        let t0 = Instant::now();
        let link = Silence::new(t0);
        link.handle_sent(t0);
        link.handle_heard();
        assert!(!link.is_silent(t0 + 5000 * MS));
        // A slow call on an idle link: its own wait counts from its send.
        link.handle_sent(t0 + 10_000 * MS);
        assert!(!link.is_silent(t0 + 10_040 * MS));
        assert!(link.is_silent(t0 + 11_000 * MS));
    }
}
