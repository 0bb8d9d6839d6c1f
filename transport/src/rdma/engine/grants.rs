//! Grants of large messages the peer asks to send: a destination from the
//! receive pool and a CTS, in arrival order, while they fit in
//! `max_granted_bytes` and (for an accepted connection) the server's
//! inbound budget; with confinement each one through a memory window of its
//! own (`rdma/windows.rs`). A request that does not fit waits, unallocated.

#[allow(clippy::wildcard_imports)]
use super::*;

/// How soon a request to send waiting for the server's budget is tried
/// again when nothing else wakes the engine: 1 ms, a fraction of a large
/// message's transfer.
pub(super) const INBOUND_RETRY: Duration = Duration::from_millis(1);

impl Engine {
    /// Grants waiting requests to send, in order, while they fit in
    /// `max_granted_bytes` (and the server's budget, for an accepted
    /// connection): allocates each destination and queues its CTS. `now`
    /// schedules a retry while the server's budget is short, and starts
    /// the grant timeout's clock if no grant was out.
    pub(super) fn grant_waiting(&mut self, now: Instant) -> Result<(), EngineError> {
        self.inbound_retry = None;
        while let Some(&(msg_id, socket, size)) = self.waiting_rts.front() {
            let fits = self.granted_bytes + size <= self.config.max_granted_bytes
                // One message alone is always granted (validation keeps
                // the budget above the largest message anyway); offers
                // waiting for a socket's next message do not count
                // (`offers.rs`: an idle one would hold it back for ever).
                || self.incoming.len() == self.offered.len();
            // With confinement, a grant needs a window too.
            if !fits || (self.windows.enabled() && self.windows.available() == 0) {
                break;
            }
            let permit = match &self.inbound {
                None => None,
                Some(budget) => match budget.try_acquire(size as usize) {
                    Some(permit) => Some(permit),
                    None => {
                        // Tried again at each I/O round (an engine
                        // waiting for the budget stays on its driver's
                        // ready list: `waits_for_budget`), or within
                        // `INBOUND_RETRY` of `now` when the driver sleeps.
                        self.inbound_retry = Some(now + INBOUND_RETRY);
                        break;
                    }
                },
            };
            self.waiting_rts.pop_front();
            let dest = Self::alloc(&self.recv_pool, size as usize)?;
            let addr = dest.as_ptr() as u64;
            let rkey = self
                .expose(msg_id, &dest)
                .ok_or(EngineError::Unregistered("a write destination"))?;
            let keys = self.rail_keys(&dest);
            self.granted_bytes += size;
            self.incoming.insert(msg_id, (socket, dest, permit));
            self.grant_idle_since.get_or_insert(now);
            self.control.push_back(Control::Cts {
                msg_id,
                addr,
                rkey,
                keys,
            });
        }
        Ok(())
    }

    /// The key the peer writes `dest` with, for grant or offer `id`: where
    /// confined, a window over exactly these bytes on this QP, its bind
    /// queued here, before the CTS or `Offer` that tells the key (same
    /// send queue, in order); else the key of the region `dest` lies in.
    /// `None` when `dest` is outside registered memory or no window binds.
    pub(super) fn expose(&mut self, id: u32, dest: &PoolBuf) -> Option<u32> {
        let region = dest.region_on(self.config.rail)?;
        match self.windows.bind_grant(id, dest) {
            None => Some(region.rkey),
            Some(Ok((bind, rkey))) => {
                self.push_local(bind);
                Some(rkey)
            }
            Some(Err(_)) => None,
        }
    }

    /// The keys of `dest` on each of the transport's rails, for the peer to
    /// stripe its message over them (`stripes.rs`): none with one rail,
    /// with striping off, or where confined (windows are bound on this
    /// queue pair alone). Once any are told, the engine keeps its grants'
    /// buffers from the pool for a while after it fails
    /// ([`Engine::take_exposed`]): the peer's other queue pairs may still
    /// be writing into them.
    pub(super) fn rail_keys(&mut self, dest: &PoolBuf) -> Vec<u32> {
        if self.config.rails < 2 || self.config.stripe.is_none() || self.windows.enabled() {
            return Vec::new();
        }
        let keys: Option<Vec<u32>> =
            (0..self.config.rails.min(crate::rdma::control::MAX_RAIL_KEYS))
                .map(|rail| dest.region_on(rail).map(|region| region.rkey))
                .collect();
        let keys = keys.unwrap_or_default();
        self.exposed_rail_keys |= !keys.is_empty();
        keys
    }

    /// Once its owner is done with the engine (it failed, or it panicked:
    /// then whatever state the panic left, and the engine is never called
    /// again) and its queue pair is in error: the buffers of its grants
    /// and offers, if their keys on other rails were told (empty
    /// otherwise). The peer's queue pairs on those rails live on and may
    /// still write a chunk into them through this side's queue pairs on
    /// those rails, so the owner keeps them from the pool until those
    /// queue pairs are in error too (`io/late.rs`), instead of freeing
    /// them with the engine. Their permits of the inbound budget go now.
    /// Before, a panicked engine (never marked failed) kept nothing.
    pub fn take_exposed(&mut self) -> Vec<PoolBuf> {
        if !self.exposed_rail_keys {
            return Vec::new();
        }
        self.offered.clear();
        self.offered_bytes = 0;
        self.granted_bytes = 0;
        self.incoming.drain().map(|(_, (_, buf, _))| buf).collect()
    }

    /// Grants by CTS out now (offers, which wait for a socket's next
    /// message by design, are not counted: they never draw on the inbound
    /// budget, hold at most half of `max_granted_bytes`, never keep a
    /// request from being granted, and go when their socket closes).
    fn grants_out(&self) -> usize {
        self.incoming.len().saturating_sub(self.offered.len())
    }

    /// A large message arrived at `now`: the peer is writing its grants,
    /// so the grant timeout's clock starts again (or stops, none left).
    pub(super) fn grant_progress(&mut self, now: Instant) {
        self.grant_idle_since = (self.grants_out() > 0).then_some(now);
    }

    /// When the grant timeout runs out, if a grant is out.
    pub(super) fn grant_deadline(&self) -> Option<Instant> {
        let timeout = self.config.grant_timeout?;
        if self.grants_out() == 0 {
            return None;
        }
        Some(self.grant_idle_since? + timeout)
    }

    /// Whether the grant timeout ran out at `now` (issue 57, hole 9): a
    /// peer that took destinations and wrote none of them for
    /// `grant_timeout` holds their bytes (`max_granted_bytes`) and, on a
    /// server, the inbound budget other peers need; the engine then fails
    /// with [`EngineError::GrantTimeout`]. The clock runs from the first
    /// grant out, and starts again at each large message that arrives (a
    /// grant waits, legitimately, for its socket's earlier messages).
    ///
    /// Revoking a grant is failing the engine, on purpose: the one sound
    /// way to take a destination back from a peer that may still write
    /// into it. Its owner moves the queue pair to error, after which no
    /// write of the peer's lands through it; the grants' buffers stay with
    /// the engine (`Engine::fail`'s rule) until the owner destroys the
    /// queue pair, so no late write lands in memory handed to someone
    /// else; their inbound permits and bytes go with the engine then.
    /// Invalidating only the grant's window was the other option, but an
    /// unconfined grant has no key of its own to invalidate (its key is
    /// the pool's), and a confined peer's write into an invalidated window
    /// fails its queue pair anyway. Grants whose keys on other rails were
    /// told are held past that until the partners' queue pairs are in
    /// error too (`io/late.rs`). Before, such a grant was held for the
    /// engine's life.
    pub(super) fn grant_timed_out(&mut self, now: Instant) -> bool {
        let Some(deadline) = self.grant_deadline() else {
            return false;
        };
        if now < deadline {
            return false;
        }
        let waited = self
            .grant_idle_since
            .map_or(Duration::ZERO, |since| now.saturating_duration_since(since));
        self.fail(EngineError::GrantTimeout {
            waited,
            grants: self.grants_out(),
        });
        true
    }

    /// Grants of this engine (an accepted connection's) also draw on the
    /// server's budget of large inbound messages, `inbound.max_bytes`
    /// shared with TCP peers; a request to send that does not fit waits.
    pub fn set_inbound_budget(&mut self, budget: InboundBudget) {
        self.inbound = Some(budget);
    }

    /// Whether a request to send waits for the inbound budget, which other
    /// connections free: the driver calls [`Engine::poll_transmit`] again
    /// at each round while it does, not only at its retry timer.
    pub fn waits_for_budget(&self) -> bool {
        self.inbound_retry.is_some()
    }

    /// The grants the peer holds: (message id, address, bytes, the key
    /// its CTS carried, the key of the registered region it lies in).
    #[cfg(test)]
    pub(crate) fn grants(&self) -> Vec<(u32, u64, usize, u32, u32)> {
        self.incoming
            .iter()
            .map(|(&msg_id, (_, buf, _))| {
                let region = buf.region().map_or(0, |r| r.rkey);
                let rkey = self.windows.rkey_of(msg_id).unwrap_or(region);
                (msg_id, buf.as_ptr() as u64, buf.len(), rkey, region)
            })
            .collect()
    }

    /// Every range the peer may write into now, as (address, length): its
    /// grants and offers (a failed engine's too: they stay with it until
    /// it is dropped), and withdrawn offers waiting for their window's
    /// invalidation.
    #[cfg(test)]
    pub(crate) fn destinations(&self) -> Vec<(usize, usize)> {
        self.incoming
            .values()
            .map(|(_, buf, _)| buf)
            .chain(self.retiring.iter().map(|(_, buf)| buf))
            .map(|buf| (buf.as_ptr() as usize, buf.len()))
            .collect()
    }

    /// Bytes granted to the peer for large messages now, and requests to
    /// send waiting for budget.
    pub fn granted(&self) -> (u64, usize) {
        (self.granted_bytes, self.waiting_rts.len())
    }
}
