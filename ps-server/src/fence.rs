//! Fencing by lease: a primary takes Pushes only while its lease is
//! certainly alive.
//!
//! etcd restarts a lease's time-to-live when it *receives* a renewal; the
//! server cannot know when that was, only that it was after the renewal
//! was *sent*. So a renewal sent at `t` and answered with a TTL of `ttl`
//! proves the lease alive until at least `t + ttl` by etcd's clock; the
//! server stops acknowledging Pushes at `t + ttl - margin` by its own,
//! the margin covering clock rates and the time between the check and the
//! acknowledgement. A replica can take over only after the lease expired
//! in etcd, so no two primaries ever acknowledge at once. A renewal that
//! fails or is late renews nothing: the fence closes by itself when the
//! last proof runs out, whatever the network does.
//!
//! [`FenceCore`] is the sans-IO rule (time passed in); [`Fence`] shares it
//! between the lease keeper (`coordination`), which calls `handle_*`, and
//! the Push path (`replication`), which asks [`Fence::is_valid`]. It lives
//! beside both, not in either, so that neither imports the other for it.

use std::sync::Mutex;
use std::time::{Duration, Instant};
use tessera_sync::LockExt;

/// The fence's rule (module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FenceCore {
    /// `None`: no lease (static mode): always valid.
    margin: Option<Duration>,
    valid_until: Option<Instant>,
}

impl FenceCore {
    /// A fence that never closes (static mode: no leases).
    pub fn always_open() -> Self {
        Self {
            margin: None,
            valid_until: None,
        }
    }

    /// A fence closed until a renewal proves the lease alive; it closes
    /// `margin` before the proven expiry.
    pub fn leased(margin: Duration) -> Self {
        Self {
            margin: Some(margin),
            valid_until: None,
        }
    }

    /// A renewal (or the grant) sent at `sent_at` was answered with
    /// `ttl`.
    pub fn handle_renewed(&mut self, sent_at: Instant, ttl: Duration) {
        let Some(margin) = self.margin else { return };
        let until = sent_at + ttl.saturating_sub(margin);
        self.valid_until = Some(self.valid_until.map_or(until, |v| v.max(until)));
    }

    /// The lease is gone (expired, revoked, replaced by a new one).
    pub fn handle_lost(&mut self) {
        if self.margin.is_some() {
            self.valid_until = None;
        }
    }

    /// Whether Pushes may be acknowledged at `now`.
    pub fn is_valid(&self, now: Instant) -> bool {
        match self.margin {
            None => true,
            Some(_) => self.valid_until.is_some_and(|until| now < until),
        }
    }

    /// How long it stays valid from `now` (`None` for an always-open
    /// fence).
    pub fn remaining(&self, now: Instant) -> Option<Duration> {
        self.margin?;
        Some(
            self.valid_until
                .map_or(Duration::ZERO, |until| until.saturating_duration_since(now)),
        )
    }
}

/// A [`FenceCore`] shared between threads.
#[derive(Debug)]
pub struct Fence {
    core: Mutex<FenceCore>,
}

impl Fence {
    /// A shared `core`.
    pub fn new(core: FenceCore) -> Self {
        Self {
            core: Mutex::new(core),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FenceCore> {
        self.core.locked()
    }

    /// See [`FenceCore::handle_renewed`].
    pub fn renewed(&self, sent_at: Instant, ttl: Duration) {
        self.lock().handle_renewed(sent_at, ttl);
    }

    /// See [`FenceCore::handle_lost`].
    pub fn lost(&self) {
        self.lock().handle_lost();
    }

    /// See [`FenceCore::is_valid`].
    pub fn is_valid(&self, now: Instant) -> bool {
        self.lock().is_valid(now)
    }

    /// See [`FenceCore::remaining`].
    pub fn remaining(&self, now: Instant) -> Option<Duration> {
        self.lock().remaining(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_leased_fence_opens_on_proof_and_closes_before_the_lease_can_expire() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut fence = FenceCore::leased(ms(300));
        assert!(!fence.is_valid(t0), "closed until the lease is proven");
        // Renewal sent at t0, answered 50 ms later with a 3 s TTL: valid
        // until t0 + 2.7 s, however late the answer came.
        fence.handle_renewed(t0, ms(3000));
        assert!(fence.is_valid(t0 + ms(2699)));
        assert!(!fence.is_valid(t0 + ms(2700)));
        assert_eq!(fence.remaining(t0 + ms(700)), Some(ms(2000)));
        // A late answer to an older renewal never shortens it.
        fence.handle_renewed(t0 + ms(500), ms(3000));
        fence.handle_renewed(t0 + ms(100), ms(3000));
        assert!(fence.is_valid(t0 + ms(3199)));
        assert!(!fence.is_valid(t0 + ms(3200)));
        // Renewals stop (etcd unreachable): it closes by itself.
        assert!(!fence.is_valid(t0 + ms(10_000)));
        // The lease is lost: closed at once.
        fence.handle_renewed(t0 + ms(9000), ms(3000));
        assert!(fence.is_valid(t0 + ms(9100)));
        fence.handle_lost();
        assert!(!fence.is_valid(t0 + ms(9100)));
        assert_eq!(fence.remaining(t0), Some(Duration::ZERO));
    }

    #[test]
    fn a_static_fence_never_closes() {
        let mut fence = FenceCore::always_open();
        let now = Instant::now();
        assert!(fence.is_valid(now));
        fence.handle_lost();
        assert!(fence.is_valid(now + Duration::from_secs(3600)));
        assert_eq!(fence.remaining(now), None);
    }
}
