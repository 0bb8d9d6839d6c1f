//! Rate limits for warnings a peer can trigger (malformed input, failed
//! handshakes, refused connections): at most one line per peer address per
//! [`INTERVAL`], each saying how many were suppressed before it, so a flood
//! of bad connections cannot fill the disk; the events themselves are
//! always counted in metrics ([`MALFORMED`] and the callers' own).
//!
//! Hand-written rather than `governor`'s keyed limiter: that one needs a
//! sweeper for its keys and does not count what it suppressed, which is
//! the figure an operator needs; this is one small map behind a mutex,
//! bounded in size, on a path that is only taken when something is wrong.

use crate::sync::LockExt;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{LazyLock, Mutex};
use std::time::{Duration, Instant};

/// Metric: malformed or refused input from peers, by `listener` (`tcp`,
/// `rdma`, `rpc`, `grpc`).
pub const MALFORMED: &str = "tessera_malformed_input_total";

/// One warning per peer address this often.
pub const INTERVAL: Duration = Duration::from_secs(10);

/// Peers remembered at once; past it, entries older than [`INTERVAL`] are
/// dropped, and if all are recent, new peers share one entry (so a flood
/// from many addresses still logs one line per interval).
const MAX_PEERS: usize = 4096;

#[derive(Debug)]
struct Entry {
    last: Instant,
    suppressed: u64,
}

/// A per-peer limiter of warnings.
#[derive(Debug)]
pub struct WarnLimiter {
    interval: Duration,
    max_peers: usize,
    peers: Mutex<Peers>,
}

#[derive(Debug, Default)]
struct Peers {
    entries: HashMap<Option<IpAddr>, Entry>,
    /// When the map was last swept of stale entries: at most once an
    /// interval, so a flood from new addresses does not rescan it per line.
    swept: Option<Instant>,
}

impl WarnLimiter {
    /// One warning per peer per `interval`, remembering `max_peers`.
    pub fn new(interval: Duration, max_peers: usize) -> Self {
        Self {
            interval,
            max_peers: max_peers.max(1),
            peers: Mutex::new(Peers::default()),
        }
    }

    /// Whether a warning about `peer` may be written at `now`: `Some(n)`
    /// with the number suppressed since the last one, or `None`.
    pub fn check(&self, peer: IpAddr, now: Instant) -> Option<u64> {
        // A poisoned lock only means a panic elsewhere while holding it;
        // the map is still a valid map.
        let mut guard = self.peers.locked();
        let Peers {
            entries: peers,
            swept,
        } = &mut *guard;
        let mut key = Some(peer.to_canonical());
        if !peers.contains_key(&key) && peers.len() >= self.max_peers {
            let interval = self.interval;
            if swept.is_none_or(|at| now.saturating_duration_since(at) >= interval) {
                peers.retain(|_, entry| now.saturating_duration_since(entry.last) < interval);
                *swept = Some(now);
            }
            if peers.len() >= self.max_peers {
                // Every slot is a recent peer: newcomers share one.
                key = None;
            }
        }
        match peers.get_mut(&key) {
            Some(entry) if now.saturating_duration_since(entry.last) < self.interval => {
                entry.suppressed += 1;
                None
            }
            Some(entry) => {
                let suppressed = entry.suppressed;
                *entry = Entry {
                    last: now,
                    suppressed: 0,
                };
                Some(suppressed)
            }
            None => {
                peers.insert(
                    key,
                    Entry {
                        last: now,
                        suppressed: 0,
                    },
                );
                Some(0)
            }
        }
    }
}

static PROCESS: LazyLock<WarnLimiter> = LazyLock::new(|| WarnLimiter::new(INTERVAL, MAX_PEERS));

/// The process's limiter: whether to warn about `peer` now (`Some(n)`: yes,
/// `n` suppressed since the last line about it).
pub fn allow(peer: IpAddr) -> Option<u64> {
    PROCESS.check(peer, Instant::now())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_peer_per_interval_counting_the_rest() {
        let limiter = WarnLimiter::new(Duration::from_secs(10), 8);
        let t0 = Instant::now();
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        assert_eq!(limiter.check(a, t0), Some(0));
        for i in 1..=1000 {
            assert_eq!(limiter.check(a, t0 + Duration::from_millis(i)), None);
        }
        assert_eq!(limiter.check(b, t0), Some(0), "another peer has its own");
        assert_eq!(limiter.check(a, t0 + Duration::from_secs(10)), Some(1000));
    }

    #[test]
    fn a_flood_from_many_addresses_stays_bounded() {
        let limiter = WarnLimiter::new(Duration::from_secs(10), 4);
        let t0 = Instant::now();
        let mut written = 0;
        for i in 0..10_000u32 {
            let peer = IpAddr::from(i.to_be_bytes());
            if limiter.check(peer, t0).is_some() {
                written += 1;
            }
        }
        // Four remembered peers, and one line for all the others.
        assert_eq!(written, 5);
        assert!(limiter.peers.lock().unwrap().entries.len() <= 5);
    }
}
