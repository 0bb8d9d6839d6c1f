//! A switch: egress ports over one shared buffer ([`crate::mmu`]), each
//! serializing its queue at its link's rate and holding it while the
//! peer pauses it; PFC frames for the ingress ports the MMU pauses and
//! resumes; ECN marks on data packets as they leave.
//!
//! # Call order
//!
//! [`Switch::handle_arrival`] for a packet whole at an ingress port and
//! routed to an egress port (it may say to pause the ingress's peer);
//! [`Switch::handle_pfc`] when a peer pauses or resumes an egress port;
//! then [`Switch::poll_transmit`] for the egress port at the time passed
//! in, which sends its next packet if the wire is free (it may say to
//! resume an ingress's peer), and [`Switch::poll_timeout`] for when to
//! call it again.

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
    /// Queued at its egress port; a pause for its ingress's peer if the
    /// MMU calls for one.
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
        let pfc = (self.mmu.poll_pfc(ingress) == Some(Pfc::Pause)).then_some(PfcFrame {
            port: ingress,
            pause: true,
        });
        Arrival::Queued(pfc)
    }

    /// The peer on `port` paused (`true`) or resumed it.
    pub fn handle_pfc(&mut self, port: usize, pause: bool) {
        self.ports[port].handle_pfc(pause);
    }

    /// The next packet out of `egress` at `now`, ECN-marked by the queue
    /// it leaves (data packets only), with a resume for its ingress's
    /// peer if its leaving calls for one.
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
        let pfc = (self.mmu.poll_pfc(ingress) == Some(Pfc::Resume)).then_some(PfcFrame {
            port: ingress,
            pause: false,
        });
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
