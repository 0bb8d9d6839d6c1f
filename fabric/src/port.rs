//! An egress port: the packets leaving by one link, in order, each sent
//! whole at the link's rate once the one before it is on the wire, and
//! none started while the peer has the port paused (PFC: a packet being
//! serialized when the pause arrives is finished).
//!
//! # Call order
//!
//! [`Port::handle_enqueue`] for each packet queued to leave;
//! [`Port::handle_pfc`] when the peer's XOFF or XON arrives; then
//! [`Port::poll_transmit`] at the time passed in, which starts the next
//! packet if the wire is free and says when its last bit leaves and when
//! it arrives at the far end; call it again at [`Port::poll_timeout`].

use std::collections::VecDeque;

use crate::params::LinkParams;

/// A packet put on the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transmit<P> {
    /// The packet.
    pub packet: P,
    /// Its size, bytes.
    pub bytes: u64,
    /// When its last bit leaves (the wire is free again), ns.
    pub leaves_at: u64,
    /// When its last bit reaches the far end, ns.
    pub arrives_at: u64,
}

/// One egress port (module docs).
#[derive(Debug, Clone)]
pub struct Port<P> {
    link: LinkParams,
    queue: VecDeque<(P, u64)>,
    queued_bytes: u64,
    /// The wire is busy until then, ns.
    busy_until: u64,
    paused: bool,
    sent_bytes: u64,
}

impl<P> Port<P> {
    /// An idle port on `link`.
    pub fn new(link: LinkParams) -> Self {
        Self {
            link,
            queue: VecDeque::new(),
            queued_bytes: 0,
            busy_until: 0,
            paused: false,
            sent_bytes: 0,
        }
    }

    /// `packet` of `bytes` queued to leave.
    pub fn handle_enqueue(&mut self, packet: P, bytes: u64) {
        self.queued_bytes += bytes;
        self.queue.push_back((packet, bytes));
    }

    /// The peer paused the port (`true`, XOFF) or let it go (`false`).
    pub fn handle_pfc(&mut self, pause: bool) {
        self.paused = pause;
    }

    /// The next packet put on the wire at `now`, if one is queued, the
    /// wire is free and the port is not paused.
    pub fn poll_transmit(&mut self, now: u64) -> Option<Transmit<P>> {
        if self.paused || now < self.busy_until {
            return None;
        }
        let (packet, bytes) = self.queue.pop_front()?;
        self.queued_bytes -= bytes;
        self.sent_bytes += bytes;
        let leaves_at = now.saturating_add(self.link.serialize_ns(bytes));
        self.busy_until = leaves_at;
        Some(Transmit {
            packet,
            bytes,
            leaves_at,
            arrives_at: leaves_at.saturating_add(self.link.delay_ns),
        })
    }

    /// When [`Port::poll_transmit`] may put the next packet on the wire
    /// (`None`: nothing queued, or paused: an enqueue or a resume says
    /// when).
    pub fn poll_timeout(&self) -> Option<u64> {
        (!self.paused && !self.queue.is_empty()).then_some(self.busy_until)
    }

    /// Bytes queued, not yet on the wire.
    pub fn queued_bytes(&self) -> u64 {
        self.queued_bytes
    }

    /// Bytes put on the wire so far.
    pub fn sent_bytes(&self) -> u64 {
        self.sent_bytes
    }

    /// Whether the peer has it paused.
    pub fn paused(&self) -> bool {
        self.paused
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packets_leave_back_to_back_at_the_line_rate_and_arrive_a_delay_later() {
        let mut port = Port::new(LinkParams::default());
        assert_eq!(port.poll_timeout(), None);
        port.handle_enqueue("a", 1024);
        port.handle_enqueue("b", 1024);
        assert_eq!(port.queued_bytes(), 2048);
        let a = port.poll_transmit(0).unwrap();
        assert_eq!((a.packet, a.leaves_at, a.arrives_at), ("a", 328, 1_328));
        // The wire is busy until a's last bit left.
        assert_eq!(port.poll_transmit(100), None);
        assert_eq!(port.poll_timeout(), Some(328));
        let b = port.poll_transmit(328).unwrap();
        assert_eq!((b.packet, b.leaves_at), ("b", 656));
        assert_eq!(port.poll_timeout(), None);
        assert_eq!(port.sent_bytes(), 2048);
    }

    #[test]
    fn a_pause_holds_the_next_packet_and_a_resume_lets_it_go() {
        let mut port = Port::new(LinkParams::default());
        port.handle_enqueue(1, 4096);
        port.handle_enqueue(2, 4096);
        let first = port.poll_transmit(0).unwrap();
        // XOFF while the first is on the wire: it finishes, the second
        // waits.
        port.handle_pfc(true);
        assert!(port.paused());
        assert_eq!(port.poll_timeout(), None);
        assert_eq!(port.poll_transmit(first.leaves_at + 10_000), None);
        port.handle_pfc(false);
        let second = port.poll_transmit(50_000).unwrap();
        assert_eq!(second.packet, 2);
        assert_eq!(
            second.leaves_at,
            50_000 + LinkParams::default().serialize_ns(4096)
        );
    }
}
