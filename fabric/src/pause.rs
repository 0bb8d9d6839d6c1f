//! The PFC pause log: every pause a switch port (or a NIC) sent, when,
//! for how long, and the first of them. Table 4 of the paper counts the
//! senders in an incast before the first pause; Table 7 the pause time
//! per 30 s.

use std::collections::BTreeMap;

use tessera_sim::SimTime;

/// A port that can pause its peer: (node, port).
pub type PortId = (u32, u32);

/// Pauses so far (module docs).
#[derive(Debug, Clone, Default)]
pub struct PauseLog {
    open: BTreeMap<PortId, SimTime>,
    count: u64,
    total_ns: u64,
    longest_ns: u64,
    first: Option<(SimTime, PortId)>,
    /// Per port: pauses and time paused (closed pauses).
    per_port: BTreeMap<PortId, (u64, u64)>,
}

impl PauseLog {
    /// `port` sent XOFF at `now` (a second XOFF while paused, as a
    /// refresh, is not another pause).
    pub fn handle_pause(&mut self, port: PortId, now: SimTime) {
        if self.open.contains_key(&port) {
            return;
        }
        self.open.insert(port, now);
        self.count += 1;
        self.per_port.entry(port).or_default().0 += 1;
        if self.first.is_none() {
            self.first = Some((now, port));
        }
    }

    /// `port` sent XON at `now`.
    pub fn handle_resume(&mut self, port: PortId, now: SimTime) {
        if let Some(since) = self.open.remove(&port) {
            self.close(since, now);
            let ns = now.as_nanos().saturating_sub(since.as_nanos());
            self.per_port.entry(port).or_default().1 += ns;
        }
    }

    fn close(&mut self, since: SimTime, now: SimTime) {
        let ns = now.as_nanos().saturating_sub(since.as_nanos());
        self.total_ns = self.total_ns.saturating_add(ns);
        self.longest_ns = self.longest_ns.max(ns);
    }

    /// Pauses sent.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// The first pause: when, and by which port.
    pub fn first(&self) -> Option<(SimTime, PortId)> {
        self.first
    }

    /// Time paused, summed over ports, counting the pauses still open as
    /// ending at `now`, and the longest single pause.
    pub fn paused_ns(&self, now: SimTime) -> (u64, u64) {
        let mut total = self.total_ns;
        let mut longest = self.longest_ns;
        for since in self.open.values() {
            let ns = now.as_nanos().saturating_sub(since.as_nanos());
            total = total.saturating_add(ns);
            longest = longest.max(ns);
        }
        (total, longest)
    }

    /// Each port that paused: (port, pauses, time paused in pauses that
    /// ended), in port order.
    pub fn per_port(&self) -> impl Iterator<Item = (PortId, u64, u64)> + '_ {
        self.per_port.iter().map(|(&p, &(n, ns))| (p, n, ns))
    }

    /// Ports paused now.
    pub fn open(&self) -> usize {
        self.open.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(us: u64) -> SimTime {
        SimTime::from_nanos(us * 1000)
    }

    #[test]
    fn pauses_are_counted_with_their_durations_and_the_first_kept() {
        let mut log = PauseLog::default();
        assert_eq!(log.first(), None);
        log.handle_pause((3, 1), at(10));
        log.handle_pause((3, 1), at(12)); // a refresh
        log.handle_pause((4, 2), at(11));
        log.handle_resume((3, 1), at(15));
        log.handle_resume((9, 9), at(16)); // never paused: nothing
        assert_eq!(log.count(), 2);
        assert_eq!(log.first(), Some((at(10), (3, 1))));
        assert_eq!(log.open(), 1);
        // 5 us closed, and (4, 2) open since 11 us, at 20 us: 9 us.
        assert_eq!(log.paused_ns(at(20)), (14_000, 9_000));
    }
}
