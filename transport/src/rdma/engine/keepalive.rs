//! Keepalive (§7.2): every `interval` the engine WRITEs a growing sequence
//! number into an 8-byte slot the peer registered (one-sided: it needs no
//! receive credit, so a peer whose application stopped reading still proves
//! it is alive). If the engine's own slot does not change for `timeout`,
//! the peer is dead ([`EngineError::PeerDead`]).

#[allow(clippy::wildcard_imports)]
use super::*;

/// Keepalive settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeepaliveConfig {
    /// How often the sequence number is written.
    pub interval: Duration,
    /// How long the peer's number may stand still before it is dead.
    pub timeout: Duration,
}

/// A running keepalive: our slot (the peer writes into it), the peer's
/// (we write into it), the sequence we write and what we last saw.
#[derive(Debug)]
pub(super) struct Keepalive {
    pub(super) config: KeepaliveConfig,
    pub(super) slot: PoolBuf,
    pub(super) peer_slot: Option<(u64, u32)>,
    pub(super) seq: u64,
    pub(super) next_send: Option<Instant>,
    pub(super) last_seen: u64,
    pub(super) last_advance: Instant,
}

/// Bytes of a keepalive slot: one little-endian u64.
pub(super) const KEEPALIVE_SLOT_LEN: usize = 8;

impl Engine {
    /// The slot the peer writes its keepalive into (address, rkey), for
    /// the handshake's hello. `None` with memory windows: the slot's key is
    /// sent once a window is bound to it (a `Slot` control message).
    pub fn keepalive_slot(&self) -> Option<(u64, u32)> {
        if self.windows.enabled() {
            return None;
        }
        let slot = &self.keepalive.as_ref()?.slot;
        Some((slot.as_ptr() as u64, slot.region_on(self.config.rail)?.rkey))
    }

    /// Queues the next keepalive WRITE into the peer's slot (once known).
    pub(super) fn push_keepalive(&mut self) -> Result<(), EngineError> {
        let Some(ka) = &mut self.keepalive else {
            return Ok(());
        };
        let Some((addr, rkey)) = ka.peer_slot else {
            return Ok(());
        };
        ka.seq += 1;
        let source = self
            .send_pool
            .alloc_copy(&ka.seq.to_le_bytes())
            .map_err(EngineError::Memory)?
            .freeze();
        let sge = Self::sge(&source, self.config.rail)
            .ok_or(EngineError::Unregistered("the keepalive slot"))?;
        self.window.add(KEEPALIVE_SLOT_LEN);
        self.stats.keepalives_sent += 1;
        self.ring.push(RingEntry {
            wr: SendWr {
                wr_id: 0,
                op: SendOp::Write {
                    remote_addr: addr as usize,
                    rkey,
                },
                sges: vec![sge],
                signaled: false,
            },
            keep: vec![source],
            bytes: KEEPALIVE_SLOT_LEN,
        });
        Ok(())
    }

    /// The keepalive slot: (address, the key of the region it lies in).
    #[cfg(test)]
    pub(crate) fn own_keepalive_slot(&self) -> Option<(u64, u32)> {
        let slot = &self.keepalive.as_ref()?.slot;
        Some((slot.as_ptr() as u64, slot.region()?.rkey))
    }

    /// Where this engine writes its keepalive (the peer's slot).
    #[cfg(test)]
    pub(crate) fn peer_keepalive_slot(&self) -> Option<(u64, u32)> {
        self.keepalive.as_ref()?.peer_slot
    }

    /// Time has passed: queues a keepalive when due, and fails the engine
    /// if the peer's stood still for the timeout.
    pub(super) fn keepalive_timeout(&mut self, now: Instant) {
        let Some(ka) = &mut self.keepalive else {
            return;
        };
        let seen = ka.slot.load_u64(0).unwrap_or(0);
        if seen != ka.last_seen {
            ka.last_seen = seen;
            ka.last_advance = now;
        }
        if let Some(next) = ka.next_send
            && now >= next
        {
            let after = next + ka.config.interval;
            ka.next_send = Some(if after <= now {
                now + ka.config.interval
            } else {
                after
            });
            if !self.control.iter().any(|c| matches!(c, Control::Keepalive)) {
                self.control.push_back(Control::Keepalive);
            }
        }
        let Some(ka) = &self.keepalive else {
            return;
        };
        let silent = now.saturating_duration_since(ka.last_advance);
        if silent > ka.config.timeout {
            self.fail(EngineError::PeerDead(silent));
        }
    }

    /// When the keepalive next needs the time: its next write, or the
    /// instant the peer would be dead.
    pub(super) fn keepalive_deadline(&self) -> Option<Instant> {
        self.keepalive.as_ref().map(|ka| {
            let deadline = ka.last_advance + ka.config.timeout;
            ka.next_send.map_or(deadline, |next| next.min(deadline))
        })
    }
}
