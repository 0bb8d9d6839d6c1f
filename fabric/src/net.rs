//! The network: hosts' NICs and the switches between them, wired as a
//! topology, with the packets, PFC frames and wake-ups that move between
//! them as events.
//!
//! # Call order
//!
//! [`Network::new`] with a [`Topology`]; the hosts' queue pairs through
//! [`Network::nic_mut`]. Then, in a loop driven by the caller's
//! simulator: [`Network::kick`] after anything was posted at a host's NIC;
//! [`Network::handle`] for each [`NetEvent`] that comes due; after either,
//! schedule what [`Network::poll_scheduled`] gives and let the hosts named
//! by [`Network::poll_touched`] drain their NICs' completions.
//!
//! # Topologies
//!
//! - [`Topology::Tor`]: one top-of-rack switch, host `h` on its port `h`.
//! - [`Topology::LeafSpine`]: `leaves` leaf switches with `per_leaf` hosts
//!   each (host `h` on leaf `h / per_leaf`, port `h % per_leaf`) and an
//!   uplink from every leaf to each of `spines` spine switches (leaf port
//!   `per_leaf + s`, spine port `l`). A packet for another leaf takes the
//!   uplink chosen by hashing its flow (source and destination host and
//!   queue pair): ECMP, so one queue pair's packets keep one path and stay
//!   in order.

use std::collections::VecDeque;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::dcqcn::DcqcnParams;
use crate::params::{LinkParams, ParamsError, SwitchParams};
use crate::pause::PauseLog;
use crate::rnic::{HostId, Packet, Rnic, RnicParams};
use crate::switch::{Arrival, Switch};
use tessera_transport::verbs::sim::SimMemory;

/// How the hosts and switches are wired (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Topology {
    /// One switch and its hosts.
    Tor {
        /// Hosts.
        hosts: u32,
    },
    /// A two-tier Clos.
    LeafSpine {
        /// Leaf switches.
        leaves: u32,
        /// Spine switches.
        spines: u32,
        /// Hosts per leaf.
        per_leaf: u32,
    },
}

impl Topology {
    /// Hosts in it.
    pub fn hosts(&self) -> u32 {
        match *self {
            Topology::Tor { hosts } => hosts,
            Topology::LeafSpine {
                leaves, per_leaf, ..
            } => leaves * per_leaf,
        }
    }

    /// Checks the counts.
    pub fn validate(&self) -> Result<(), ParamsError> {
        let zero = |field| Err(ParamsError::Zero { field });
        match *self {
            Topology::Tor { hosts: 0 } => zero("topology.hosts"),
            Topology::LeafSpine { leaves: 0, .. } => zero("topology.leaves"),
            Topology::LeafSpine { spines: 0, .. } => zero("topology.spines"),
            Topology::LeafSpine { per_leaf: 0, .. } => zero("topology.per_leaf"),
            _ => Ok(()),
        }
    }
}

/// The whole fabric's parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NetParams {
    /// The wiring.
    pub topology: Topology,
    /// Every link (hosts' and switches').
    pub link: LinkParams,
    /// Every switch.
    pub switch: SwitchParams,
    /// Every NIC.
    pub rnic: RnicParams,
    /// DCQCN at every NIC's queue pairs (`None`: off).
    pub dcqcn: Option<DcqcnParams>,
}

impl NetParams {
    /// A fabric of `topology` with every other parameter defaulted for
    /// 25 Gbit/s.
    pub fn new(topology: Topology) -> Self {
        let link = LinkParams::default();
        Self {
            topology,
            link,
            switch: SwitchParams::for_nic_rate(link.rate_bps),
            rnic: RnicParams::default(),
            dcqcn: None,
        }
    }

    /// Checks every part.
    pub fn validate(&self) -> Result<(), ParamsError> {
        self.topology.validate()?;
        self.link.validate()?;
        self.switch.validate()?;
        self.rnic.validate()?;
        if let Some(d) = &self.dcqcn {
            d.validate()?;
        }
        Ok(())
    }
}

/// Where a port's link leads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Peer {
    Host(HostId),
    Switch { switch: usize, port: usize },
}

/// An event of the network.
#[derive(Debug)]
pub enum NetEvent {
    /// A host's NIC may send or has a timer due.
    NicWake(HostId),
    /// A packet whole at a host.
    AtHost(Packet),
    /// A packet whole at a switch's port.
    AtSwitch {
        /// The switch.
        switch: usize,
        /// Its ingress port.
        port: usize,
        /// The packet.
        packet: Packet,
    },
    /// A switch's egress port may send.
    PortWake {
        /// The switch.
        switch: usize,
        /// The port.
        port: usize,
    },
    /// A PFC frame reaches a host's NIC.
    PfcAtHost(HostId, bool),
    /// A PFC frame reaches a switch's port (from the peer on it).
    PfcAtSwitch {
        /// The switch.
        switch: usize,
        /// The port.
        port: usize,
        /// XOFF or XON.
        pause: bool,
    },
}

/// Counters of the whole network.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NetStats {
    /// Packets dropped at switches.
    pub drops: u64,
    /// Data packets ECN-marked.
    pub marked: u64,
    /// Events handled.
    pub events: u64,
}

/// The network (module docs).
#[derive(Debug)]
pub struct Network {
    params: NetParams,
    nics: Vec<Rnic>,
    /// When each NIC's live wake-up is scheduled.
    nic_wake: Vec<Option<u64>>,
    switches: Vec<Switch>,
    /// `peers[switch][port]`.
    peers: Vec<Vec<Peer>>,
    port_wake: Vec<Vec<Option<u64>>>,
    /// Host `h`'s switch and port.
    host_port: Vec<(usize, usize)>,
    marks: ChaCha8Rng,
    pauses: PauseLog,
    scheduled: Vec<(u64, NetEvent)>,
    touched: VecDeque<HostId>,
    touched_mark: Vec<bool>,
    events: u64,
}

impl Network {
    /// The network of `params`, each host's NIC over `memory(host)`, ECN
    /// marks drawn from `seed`.
    pub fn new(
        params: NetParams,
        seed: u64,
        mut memory: impl FnMut(HostId) -> SimMemory,
    ) -> Result<Self, ParamsError> {
        params.validate()?;
        let link = params.link;
        let n = params.topology.hosts();
        let nics = (0..n)
            .map(|h| Rnic::new(h, params.rnic, link, params.dcqcn, memory(h)))
            .collect();
        let (peers, host_port): (Vec<Vec<Peer>>, Vec<(usize, usize)>) = match params.topology {
            Topology::Tor { hosts } => (
                vec![(0..hosts).map(Peer::Host).collect()],
                (0..hosts as usize).map(|h| (0, h)).collect(),
            ),
            Topology::LeafSpine {
                leaves,
                spines,
                per_leaf,
            } => {
                let (l, s, p) = (leaves as usize, spines as usize, per_leaf as usize);
                let mut peers = Vec::new();
                for leaf in 0..l {
                    let mut ports: Vec<Peer> = (0..p)
                        .map(|i| Peer::Host((leaf * p + i) as HostId))
                        .collect();
                    ports.extend((0..s).map(|spine| Peer::Switch {
                        switch: l + spine,
                        port: leaf,
                    }));
                    peers.push(ports);
                }
                for spine in 0..s {
                    peers.push(
                        (0..l)
                            .map(|leaf| Peer::Switch {
                                switch: leaf,
                                port: p + spine,
                            })
                            .collect(),
                    );
                }
                (peers, (0..l * p).map(|h| (h / p, h % p)).collect())
            }
        };
        let switches = peers
            .iter()
            .map(|ports| Switch::new(params.switch, vec![link; ports.len()], link.rate_bps))
            .collect();
        let port_wake = peers.iter().map(|p| vec![None; p.len()]).collect();
        Ok(Self {
            params,
            nics,
            nic_wake: vec![None; n as usize],
            switches,
            peers,
            port_wake,
            host_port,
            marks: ChaCha8Rng::seed_from_u64(seed),
            pauses: PauseLog::default(),
            scheduled: Vec::new(),
            touched: VecDeque::new(),
            touched_mark: vec![false; n as usize],
            events: 0,
        })
    }

    /// The parameters.
    pub fn params(&self) -> &NetParams {
        &self.params
    }

    /// Hosts.
    pub fn hosts(&self) -> u32 {
        self.nics.len() as u32
    }

    /// Host `h`'s NIC.
    pub fn nic(&self, h: HostId) -> &Rnic {
        &self.nics[h as usize]
    }

    /// Host `h`'s NIC, to create queue pairs and post work requests on
    /// (then [`Network::kick`] it).
    pub fn nic_mut(&mut self, h: HostId) -> &mut Rnic {
        &mut self.nics[h as usize]
    }

    /// The PFC pauses so far.
    pub fn pauses(&self) -> &PauseLog {
        &self.pauses
    }

    /// Counters.
    pub fn stats(&self) -> NetStats {
        NetStats {
            drops: self.switches.iter().map(Switch::drops).sum(),
            marked: self.switches.iter().map(Switch::marked).sum(),
            events: self.events,
        }
    }

    /// Events to schedule, (time in ns, event), in the order caused.
    pub fn poll_scheduled(&mut self) -> std::vec::Drain<'_, (u64, NetEvent)> {
        self.scheduled.drain(..)
    }

    /// The next host whose NIC may have completions for its engines.
    pub fn poll_touched(&mut self) -> Option<HostId> {
        let h = self.touched.pop_front()?;
        self.touched_mark[h as usize] = false;
        Some(h)
    }

    fn touch(&mut self, h: HostId) {
        if !std::mem::replace(&mut self.touched_mark[h as usize], true) {
            self.touched.push_back(h);
        }
    }

    /// Host `h`'s NIC may have work at `now` (something was posted):
    /// schedules its wake-up.
    pub fn kick(&mut self, h: HostId, now: u64) {
        let Some(at) = self.nics[h as usize].poll_timeout() else {
            return;
        };
        let at = at.max(now);
        let wake = &mut self.nic_wake[h as usize];
        if wake.is_none_or(|w| at < w) {
            *wake = Some(at);
            self.scheduled.push((at, NetEvent::NicWake(h)));
        }
        // Completions a post made at once (a flush, a local request).
        self.touch(h);
    }

    fn kick_port(&mut self, switch: usize, port: usize, now: u64) {
        let Some(at) = self.switches[switch].poll_timeout(port) else {
            return;
        };
        let at = at.max(now);
        let wake = &mut self.port_wake[switch][port];
        if wake.is_none_or(|w| at < w) {
            *wake = Some(at);
            self.scheduled
                .push((at, NetEvent::PortWake { switch, port }));
        }
    }

    /// The egress port of `switch` towards `packet`'s destination.
    fn route(&self, switch: usize, packet: &Packet) -> usize {
        let (dst_switch, dst_port) = self.host_port[packet.dst as usize];
        match self.params.topology {
            Topology::Tor { .. } => dst_port,
            Topology::LeafSpine {
                leaves,
                spines,
                per_leaf,
            } => {
                if switch >= leaves as usize {
                    // A spine: down to the destination's leaf.
                    dst_switch
                } else if switch == dst_switch {
                    dst_port
                } else {
                    per_leaf as usize + (flow_hash(packet) % u64::from(spines)) as usize
                }
            }
        }
    }

    /// Sends a PFC frame out of `switch`'s `port` to its peer.
    fn send_pfc(&mut self, switch: usize, port: usize, pause: bool, now: u64) {
        let at = now + self.switches[switch].link(port).delay_ns;
        let key = (switch as u32, port as u32);
        if pause {
            self.pauses
                .handle_pause(key, tessera_sim::SimTime::from_nanos(now));
        } else {
            self.pauses
                .handle_resume(key, tessera_sim::SimTime::from_nanos(now));
        }
        let event = match self.peers[switch][port] {
            Peer::Host(h) => NetEvent::PfcAtHost(h, pause),
            Peer::Switch { switch, port } => NetEvent::PfcAtSwitch {
                switch,
                port,
                pause,
            },
        };
        self.scheduled.push((at, event));
    }

    /// An event due at `now`.
    pub fn handle(&mut self, event: NetEvent, now: u64) {
        self.events += 1;
        match event {
            NetEvent::NicWake(h) => {
                if self.nic_wake[h as usize] != Some(now) {
                    return;
                }
                self.nic_wake[h as usize] = None;
                let nic = &mut self.nics[h as usize];
                nic.handle_timeout(now);
                if let Some(sent) = nic.poll_transmit(now) {
                    let (switch, port) = self.host_port[h as usize];
                    self.scheduled.push((
                        sent.arrives_at,
                        NetEvent::AtSwitch {
                            switch,
                            port,
                            packet: sent.packet,
                        },
                    ));
                }
                self.touch(h);
                self.kick(h, now);
            }
            NetEvent::AtHost(packet) => {
                let h = packet.dst;
                self.nics[h as usize].handle_packet(packet, now);
                self.touch(h);
                self.kick(h, now);
            }
            NetEvent::AtSwitch {
                switch,
                port,
                packet,
            } => {
                let egress = self.route(switch, &packet);
                match self.switches[switch].handle_arrival(port, egress, packet) {
                    Arrival::Dropped => {}
                    Arrival::Queued(pfc) => {
                        if let Some(pfc) = pfc {
                            self.send_pfc(switch, pfc.port, pfc.pause, now);
                        }
                        self.kick_port(switch, egress, now);
                    }
                }
            }
            NetEvent::PortWake { switch, port } => {
                if self.port_wake[switch][port] != Some(now) {
                    return;
                }
                self.port_wake[switch][port] = None;
                if let Some((t, pfc)) =
                    self.switches[switch].poll_transmit(port, now, &mut self.marks)
                {
                    let event = match self.peers[switch][port] {
                        Peer::Host(_) => NetEvent::AtHost(t.packet),
                        Peer::Switch { switch, port } => NetEvent::AtSwitch {
                            switch,
                            port,
                            packet: t.packet,
                        },
                    };
                    self.scheduled.push((t.arrives_at, event));
                    if let Some(pfc) = pfc {
                        self.send_pfc(switch, pfc.port, pfc.pause, now);
                    }
                }
                self.kick_port(switch, port, now);
            }
            NetEvent::PfcAtHost(h, pause) => {
                self.nics[h as usize].handle_pfc(pause);
                self.kick(h, now);
            }
            NetEvent::PfcAtSwitch {
                switch,
                port,
                pause,
            } => {
                self.switches[switch].handle_pfc(port, pause);
                self.kick_port(switch, port, now);
            }
        }
    }
}

/// The ECMP hash of a packet's flow: both ends' hosts and queue pairs,
/// the same for every packet of a queue pair's direction (FNV-1a).
fn flow_hash(p: &Packet) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for word in [p.src, p.dst, p.src_qp, p.dst_qp] {
        for byte in word.to_le_bytes() {
            h ^= u64::from(byte);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}
