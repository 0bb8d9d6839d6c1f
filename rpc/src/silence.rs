//! Dead TCP links: a link that goes silent (a cable pulled, a host off the
//! network, a switch port down) answers nothing and reports nothing. The
//! kernel keeps retransmitting with a backoff that doubles each time, so
//! after a 30 s outage its next retransmission can be 20 s after the link
//! has returned, and every call on the old connection waits for it (the
//! multi-host drill 2 found a readmitted server getting no Fetch for 20 s).
//!
//! The rule: calls' attempts on a TCP link keep timing out, and nothing at
//! all has been heard from the peer since the first of them was sent,
//! [`SILENT_AFTER`] ago: the link is presumed dead. The channel closes it
//! (its other calls fail at once and are retried elsewhere, its socket is
//! shut down) and the next call dials again, which fails fast while the
//! link is down and succeeds as soon as it is back. A call that is merely
//! long (a checkpoint) times out no attempt; one slow answer resets the
//! count by arriving, even late.
//!
//! The price: a peer that is alive but sends nothing for 2 s while calls
//! to it time out (a server dropping every expired call under overload,
//! or holding a large message back for its inbound budget while the
//! calls queued behind it expire) is also cut off, and the connection,
//! with the upload it carried, starts over, as after gRPC's keepalive
//! timeout. Telling the two apart needs `TCP_INFO` (whether the peer
//! still acknowledges), which only an `unsafe` call reads.
//!
//! Why not `TCP_USER_TIMEOUT`: Linux also aborts a connection whose peer
//! keeps a zero window that long, which is exactly how a server's inbound
//! budget holds back a large message (up to `frame_timeout_ms`, 30 s),
//! and that with no call timing out at all. RDMA links need none of this:
//! the transport's keepalive covers them.
//!
//! A sans-IO state: the channel reports attempts that timed out
//! ([`Silence::handle_timed_out`]) and anything received
//! ([`Silence::handle_heard`]), and asks, with the time passed in, whether
//! the link is silent ([`Silence::is_silent`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long attempts may keep timing out with nothing heard before the
/// link is closed. 2 s: far above what a live server under load takes to
/// send *something* back (answers to other calls, late answers), well
/// below the outages worth reconnecting for, and a reconnect costs one
/// handshake.
pub(crate) const SILENT_AFTER: Duration = Duration::from_secs(2);

/// Since when a link's attempts have timed out with nothing heard.
#[derive(Debug)]
pub(crate) struct Silence {
    origin: Instant,
    /// Microseconds after `origin`, plus one, when the first attempt that
    /// timed out since the peer was last heard went out; 0: none.
    since: AtomicU64,
}

impl Silence {
    /// A link opened at `origin`.
    pub(crate) fn new(origin: Instant) -> Self {
        Self {
            origin,
            since: AtomicU64::new(0),
        }
    }

    /// An attempt sent at `sent` timed out unanswered.
    pub(crate) fn handle_timed_out(&self, sent: Instant) {
        let at = sent.saturating_duration_since(self.origin).as_micros() as u64 + 1;
        let _ = self
            .since
            .compare_exchange(0, at, Ordering::AcqRel, Ordering::Acquire);
    }

    /// Something arrived from the peer.
    pub(crate) fn handle_heard(&self) {
        self.since.store(0, Ordering::Release);
    }

    /// Whether, at `now`, attempts have timed out for [`SILENT_AFTER`]
    /// with nothing heard.
    pub(crate) fn is_silent(&self, now: Instant) -> bool {
        match self.since.load(Ordering::Acquire) {
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
    fn attempts_timing_out_with_nothing_heard_for_two_seconds_are_silence() {
        let t0 = Instant::now();
        let link = Silence::new(t0);
        // Nothing timed out: however long since anything was heard (an
        // idle link, or one long call).
        assert!(!link.is_silent(t0 + 60_000 * MS));
        link.handle_timed_out(t0 + 10 * MS);
        // Later timeouts do not move the first one.
        link.handle_timed_out(t0 + 500 * MS);
        assert!(!link.is_silent(t0 + 2009 * MS));
        assert!(link.is_silent(t0 + 2010 * MS));
    }

    #[test]
    fn anything_heard_starts_the_count_again() {
        let t0 = Instant::now();
        let link = Silence::new(t0);
        link.handle_timed_out(t0);
        link.handle_heard();
        assert!(!link.is_silent(t0 + 5000 * MS));
        // One slow call on a link idle for long: its own send counts.
        link.handle_timed_out(t0 + 10_000 * MS);
        assert!(!link.is_silent(t0 + 10_040 * MS));
        assert!(link.is_silent(t0 + 12_000 * MS));
    }
}
