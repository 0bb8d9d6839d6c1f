//! A switch: egress ports over one shared buffer ([`crate::mmu`]), each
//! serializing its queue at its link's rate and holding it while the
//! peer pauses it; PFC frames for the ingress ports the MMU pauses and
//! resumes; ECN marks on data packets as they leave.
//!
//! # Call order
//!
//! [`Switch::handle_arrival`] for a packet whole at an ingress port and
//! routed to an egress port (it may say to pause or resume the ingress's
//! peer);
//! [`Switch::handle_pfc`] when a peer pauses or resumes an egress port;
//! then [`Switch::poll_transmit`] for the egress port at the time passed
//! in, which sends its next packet if the wire is free (it may say to
//! resume an ingress's peer), and [`Switch::poll_timeout`] for when to
//! call it again. Every PFC frame either returns must reach the peer:
//! the MMU's state and the peer's must not part.

use rand::Rng;

use crate::mmu::{Admission, Mmu, Pfc};
use crate::params::{LinkParams, SwitchParams};
use crate::port::{Port, Transmit};
use crate::rnic::Packet;

/// A PFC frame the switch sends out of `port` to its peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PfcFrame {
    /// The port (its ingress) whose peer is paused or resumed.
    pub port: usize,
    /// XOFF (`true`) or XON.
    pub pause: bool,
}

/// What became of an arriving packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrival {
    /// Queued at its egress port; a PFC frame for its ingress's peer if
    /// the MMU's state for that port changed.
    Queued(Option<PfcFrame>),
    /// Dropped (no room: PFC off, or headroom overrun).
    Dropped,
}

/// One switch (module docs).
#[derive(Debug)]
pub struct Switch {
    mmu: Mmu,
    ports: Vec<Port<(Packet, usize)>>,
    links: Vec<LinkParams>,
    marked: u64,
}

impl Switch {
    /// A switch with one port per link in `links` (its link to the peer
    /// on that port), hosts' NICs at `nic_rate_bps`.
    pub fn new(params: SwitchParams, links: Vec<LinkParams>, nic_rate_bps: u64) -> Self {
        Self {
            mmu: Mmu::new(params, &links, nic_rate_bps),
            ports: links.iter().map(|&l| Port::new(l)).collect(),
            links,
            marked: 0,
        }
    }

    /// Ports.
    pub fn ports(&self) -> usize {
        self.ports.len()
    }

    /// The link on `port`.
    pub fn link(&self, port: usize) -> LinkParams {
        self.links[port]
    }

    /// `packet` whole at `ingress`, to leave by `egress`.
    pub fn handle_arrival(&mut self, ingress: usize, egress: usize, packet: Packet) -> Arrival {
        let bytes = packet.wire_bytes;
        if self.mmu.handle_arrival(ingress, egress, bytes) == Admission::Dropped {
            return Arrival::Dropped;
        }
        self.ports[egress].handle_enqueue((packet, ingress), bytes);
        Arrival::Queued(self.pfc_of(ingress))
    }

    /// The PFC frame `ingress` sends now, if its state changed: either
    /// way, whatever changed it (an arrival can end a pause when the pool
    /// has grown since; a departure can start one when the pool has
    /// shrunk), so that the peer always knows the state the MMU holds.
    fn pfc_of(&mut self, ingress: usize) -> Option<PfcFrame> {
        self.mmu.poll_pfc(ingress).map(|pfc| PfcFrame {
            port: ingress,
            pause: pfc == Pfc::Pause,
        })
    }

    /// The peer on `port` paused (`true`) or resumed it.
    pub fn handle_pfc(&mut self, port: usize, pause: bool) {
        self.ports[port].handle_pfc(pause);
    }

    /// The next packet out of `egress` at `now`, ECN-marked by the queue
    /// it leaves (data packets only), with a PFC frame for its ingress's
    /// peer if its leaving changed that port's state.
    pub fn poll_transmit(
        &mut self,
        egress: usize,
        now: u64,
        rng: &mut impl Rng,
    ) -> Option<(Transmit<Packet>, Option<PfcFrame>)> {
        let t = self.ports[egress].poll_transmit(now)?;
        let (mut packet, ingress) = t.packet;
        if packet.is_data() && self.mmu.ecn_mark(egress, rng) {
            packet.ecn = true;
            self.marked += 1;
        }
        self.mmu.handle_departure(ingress, egress, t.bytes);
        let pfc = self.pfc_of(ingress);
        Some((
            Transmit {
                packet,
                bytes: t.bytes,
                leaves_at: t.leaves_at,
                arrives_at: t.arrives_at,
            },
            pfc,
        ))
    }

    /// When `egress` may send its next packet (`None`: empty or paused).
    pub fn poll_timeout(&self, egress: usize) -> Option<u64> {
        self.ports[egress].poll_timeout()
    }

    /// Packets dropped.
    pub fn drops(&self) -> u64 {
        self.mmu.drops()
    }

    /// Packets ECN-marked.
    pub fn marked(&self) -> u64 {
        self.marked
    }

    /// Bytes queued at `egress`.
    pub fn queued_bytes(&self, egress: usize) -> u64 {
        self.mmu.egress_bytes(egress)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rnic::PacketKind;
    use rand::SeedableRng;

    fn packet(bytes: u64) -> Packet {
        Packet {
            src: 1,
            dst: 0,
            src_qp: 0,
            dst_qp: 0,
            wire_bytes: bytes,
            ecn: false,
            kind: PacketKind::Cnp,
        }
    }

    fn drain_one(sw: &mut Switch, egress: usize, now: &mut u64) -> Option<PfcFrame> {
        let rng = &mut rand_chacha::ChaCha8Rng::seed_from_u64(1);
        *now = (*now).max(sw.poll_timeout(egress).unwrap_or(*now));
        let (t, pfc) = sw.poll_transmit(egress, *now, rng).unwrap();
        *now = t.leaves_at;
        pfc
    }

    #[test]
    fn an_arrival_that_ends_a_pause_says_so() {
        // Ports 2..=9 fill part of a small buffer, then port 1 (towards
        // port 0) until it is paused. Port 1 drains to its last headroom
        // byte and stays paused; then the others' bytes leave, the
        // free pool grows, and the next arrival at port 1 finds itself
        // well under its threshold: that arrival must resume port 1's
        // peer (it once went unsaid, and the peer stayed paused while
        // the switch thought it free, or the other way round).
        let params = SwitchParams {
            buffer_bytes: 600_000,
            ..SwitchParams::default()
        };
        let mut sw = Switch::new(params, vec![LinkParams::default(); 12], 25_000_000_000);
        // Ports 2..=9 fill part of the pool (each under its threshold),
        // towards port 10.
        for port in 2..10 {
            for _ in 0..10 {
                assert_eq!(
                    sw.handle_arrival(port, 10, packet(1086)),
                    Arrival::Queued(None)
                );
            }
        }
        let mut sent = 0;
        loop {
            sent += 1;
            assert!(sent < 1_000, "never paused");
            if sw.handle_arrival(1, 0, packet(1086))
                == Arrival::Queued(Some(PfcFrame {
                    port: 1,
                    pause: true,
                }))
            {
                break;
            }
        }
        let mut now = 0;
        while sw.mmu.ingress_bytes(1).1 > 0 {
            assert_eq!(drain_one(&mut sw, 0, &mut now), None, "still paused");
        }
        assert!(sw.mmu.paused(1));
        while sw.mmu.egress_bytes(10) > 0 {
            drain_one(&mut sw, 10, &mut now);
        }
        assert_eq!(
            sw.handle_arrival(1, 0, packet(64)),
            Arrival::Queued(Some(PfcFrame {
                port: 1,
                pause: false
            }))
        );
        assert!(!sw.mmu.paused(1));
    }
}
