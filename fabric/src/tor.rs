//! One top-of-rack switch with N + 1 hosts: an incast of one message from
//! each of hosts 1..=N to host 0, in virtual time on the fabric model
//! (the NICs' egress ports, the switch's MMU and egress ports, PFC, ECN
//! and, optionally, DCQCN at the senders). The hosts are bare NICs
//! sending a message as fast as their rate allows, with no engine and no
//! RC protocol ([`crate::incast`] runs the real engines): the fabric
//! model's own answer to the paper's Table 4 question for raw flows, how
//! many senders before the first PFC pause.
//!
//! Gaps (besides the crate's): a CNP reaches its sender after two link
//! delays, queued nowhere; a PFC frame takes one link delay and no wire
//! time; a drop (PFC off, or a headroom too small) is counted, not
//! retransmitted.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use tessera_sim::{SimTime, Simulator};

use crate::dcqcn::{Dcqcn, DcqcnParams};
use crate::mmu::{Admission, Mmu, Pfc};
use crate::params::{LinkParams, SwitchParams};
use crate::pause::PauseLog;
use crate::port::Port;

/// What to run.
#[derive(Debug, Clone)]
pub struct IncastConfig {
    /// Hosts sending to host 0.
    pub senders: u32,
    /// Each sender's message, bytes.
    pub message_bytes: u64,
    /// Packet payload, bytes (headers are left out).
    pub mtu: u64,
    /// Every host's link to the switch.
    pub link: LinkParams,
    /// The switch.
    pub switch: SwitchParams,
    /// DCQCN at the senders (`None`: each sends at line rate).
    pub dcqcn: Option<DcqcnParams>,
    /// The seed of the ECN marking's random stream.
    pub seed: u64,
}

/// What happened.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct IncastReport {
    /// When the first PFC pause was sent, ns.
    pub first_pause_ns: Option<u64>,
    /// Pauses sent.
    pub pauses: u64,
    /// Time paused, summed over ports, ns.
    pub paused_ns: u64,
    /// Packets dropped.
    pub drops: u64,
    /// CNPs sent.
    pub cnps: u64,
    /// Bytes delivered to host 0.
    pub delivered_bytes: u64,
    /// When host 0 had every message, ns.
    pub done_ns: Option<u64>,
    /// Events handled.
    pub events: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Packet {
    src: u32,
    bytes: u64,
    ecn: bool,
}

#[derive(Debug)]
enum Event {
    /// A host's NIC may put its next packet on the wire.
    HostSend(u32),
    /// A packet whole at the switch.
    AtSwitch(Packet),
    /// The switch's port to host 0 may send its next packet.
    SwitchSend,
    /// A packet whole at host 0.
    AtReceiver(Packet),
    /// The switch's XOFF/XON reaches a sender.
    PfcAtHost(u32, bool),
    /// A CNP reaches a sender.
    Cnp(u32),
    /// A sender's DCQCN timer.
    RateTimer(u32),
}

struct Host {
    port: Port<Packet>,
    rate: Option<Dcqcn>,
    /// Pacing: the next packet may start then, ns.
    next_start: u64,
    last_cnp: Option<u64>,
}

/// Runs the incast to its end (or 1 s of virtual time).
pub fn run_incast(cfg: &IncastConfig) -> IncastReport {
    let mut incast = Incast::new(cfg);
    let end = SimTime::from_nanos(1_000_000_000);
    while let Some(due) = incast.sim.next_event_until(end) {
        incast.report.events += 1;
        let now = due.at.as_nanos();
        match due.event {
            Event::HostSend(h) => incast.host_send(h, now),
            Event::AtSwitch(packet) => incast.at_switch(packet, due.at),
            Event::SwitchSend => incast.switch_send(due.at),
            Event::AtReceiver(packet) => incast.at_receiver(packet, now),
            Event::PfcAtHost(h, pause) => {
                let host = &mut incast.hosts[h as usize];
                host.port.handle_pfc(pause);
                if !pause && host.port.poll_timeout().is_some() {
                    let _ = incast.sim.schedule_at(due.at, Event::HostSend(h));
                }
            }
            Event::Cnp(h) => incast.rate_event(h, now, true),
            Event::RateTimer(h) => incast.rate_event(h, now, false),
        }
        if incast.report.done_ns.is_some() {
            break;
        }
    }
    let mut report = incast.report;
    report.first_pause_ns = incast.pauses.first().map(|(t, _)| t.as_nanos());
    report.pauses = incast.pauses.count();
    report.paused_ns = incast.pauses.paused_ns(incast.sim.now()).0;
    report
}

fn at(ns: u64) -> SimTime {
    SimTime::from_nanos(ns)
}

/// One incast's state: the senders, the switch and its port to the
/// receiver, as [`run_incast`] moves them event by event.
struct Incast<'a> {
    cfg: &'a IncastConfig,
    sim: Simulator<Event>,
    marks: ChaCha8Rng,
    mmu: Mmu,
    to_receiver: Port<(Packet, usize)>,
    pauses: PauseLog,
    hosts: Vec<Host>,
    total: u64,
    report: IncastReport,
}

impl<'a> Incast<'a> {
    /// Every sender with its whole message queued, each starting at 0.
    fn new(cfg: &'a IncastConfig) -> Self {
        let n = cfg.senders as usize;
        let mtu = cfg.mtu.max(1);
        let mut sim: Simulator<Event> = Simulator::new(cfg.seed);
        // Switch port i faces host i.
        let mut hosts: Vec<Host> = (0..=n)
            .map(|_| Host {
                port: Port::new(cfg.link),
                rate: cfg.dcqcn.map(|p| Dcqcn::new(p, 0)),
                next_start: 0,
                last_cnp: None,
            })
            .collect();
        for (h, host) in hosts.iter_mut().enumerate().skip(1) {
            let mut left = cfg.message_bytes;
            while left > 0 {
                let bytes = left.min(mtu);
                left -= bytes;
                host.port.handle_enqueue(
                    Packet {
                        src: h as u32,
                        bytes,
                        ecn: false,
                    },
                    bytes,
                );
            }
            let _ = sim.schedule_at(SimTime::ZERO, Event::HostSend(h as u32));
        }
        Self {
            cfg,
            sim,
            marks: ChaCha8Rng::seed_from_u64(cfg.seed),
            mmu: Mmu::new(cfg.switch, &vec![cfg.link; n + 1], cfg.link.rate_bps),
            to_receiver: Port::new(cfg.link),
            pauses: PauseLog::default(),
            hosts,
            total: cfg.message_bytes * u64::from(cfg.senders),
            report: IncastReport::default(),
        }
    }

    /// Host `h` sends its next packet, paced at its flow's rate.
    fn host_send(&mut self, h: u32, now: u64) {
        let host = &mut self.hosts[h as usize];
        if now < host.next_start {
            let _ = self
                .sim
                .schedule_at(at(host.next_start), Event::HostSend(h));
            return;
        }
        let Some(t) = host.port.poll_transmit(now) else {
            return;
        };
        // Paced at the flow's rate: the next start is one
        // packet's time at that rate after this one's.
        let rate = host
            .rate
            .as_ref()
            .map_or(self.cfg.link.rate_bps, Dcqcn::rate_bps)
            .max(1);
        let gap = LinkParams {
            rate_bps: rate,
            ..self.cfg.link
        }
        .serialize_ns(t.bytes);
        host.next_start = now + gap;
        if let Some(rate) = host.rate.as_mut() {
            rate.handle_sent(t.bytes, now);
        }
        let _ = self
            .sim
            .schedule_at(at(t.arrives_at), Event::AtSwitch(t.packet));
        if host.port.poll_timeout().is_some() {
            let next = t.leaves_at.max(host.next_start);
            let _ = self.sim.schedule_at(at(next), Event::HostSend(h));
        }
    }

    /// A packet reaches the switch: admitted or dropped, pausing its
    /// ingress once over its threshold, queued to the receiver.
    fn at_switch(&mut self, packet: Packet, due: SimTime) {
        let now = due.as_nanos();
        let ingress = packet.src as usize;
        if self.mmu.handle_arrival(ingress, 0, packet.bytes) == Admission::Dropped {
            self.report.drops += 1;
            return;
        }
        if self.mmu.poll_pfc(ingress) == Some(Pfc::Pause) {
            self.pauses.handle_pause((0, packet.src), due);
            let _ = self.sim.schedule_at(
                at(now + self.cfg.link.delay_ns),
                Event::PfcAtHost(packet.src, true),
            );
        }
        let idle = self.to_receiver.poll_timeout().is_none();
        self.to_receiver
            .handle_enqueue((packet, ingress), packet.bytes);
        if idle {
            let _ = self.sim.schedule_at(due, Event::SwitchSend);
        }
    }

    /// The switch sends its next packet to the receiver, marking it by
    /// its queue, and resumes an ingress back under its threshold.
    fn switch_send(&mut self, due: SimTime) {
        let now = due.as_nanos();
        let Some(t) = self.to_receiver.poll_transmit(now) else {
            if let Some(next) = self.to_receiver.poll_timeout() {
                let _ = self.sim.schedule_at(at(next.max(now)), Event::SwitchSend);
            }
            return;
        };
        let (mut packet, ingress) = t.packet;
        packet.ecn = self.mmu.ecn_mark(0, &mut self.marks);
        self.mmu.handle_departure(ingress, 0, packet.bytes);
        if self.mmu.poll_pfc(ingress) == Some(Pfc::Resume) {
            self.pauses.handle_resume((0, packet.src), due);
            let _ = self.sim.schedule_at(
                at(now + self.cfg.link.delay_ns),
                Event::PfcAtHost(packet.src, false),
            );
        }
        let _ = self
            .sim
            .schedule_at(at(t.arrives_at), Event::AtReceiver(packet));
        if let Some(next) = self.to_receiver.poll_timeout() {
            let _ = self.sim.schedule_at(at(next), Event::SwitchSend);
        }
    }

    /// A packet reaches the receiver: counted, and a CNP for a marked one
    /// (one per flow per decrease interval).
    fn at_receiver(&mut self, packet: Packet, now: u64) {
        self.report.delivered_bytes += packet.bytes;
        if self.report.delivered_bytes >= self.total && self.report.done_ns.is_none() {
            self.report.done_ns = Some(now);
        }
        let host = &mut self.hosts[packet.src as usize];
        if packet.ecn
            && let Some(params) = self.cfg.dcqcn.as_ref()
            && host.rate.is_some()
        {
            // The notification point: one CNP per flow per
            // decrease interval.
            let interval = params.decrease_interval_ns;
            if host
                .last_cnp
                .is_none_or(|last| now.saturating_sub(last) >= interval)
            {
                host.last_cnp = Some(now);
                self.report.cnps += 1;
                let _ = self
                    .sim
                    .schedule_at(at(now + 2 * self.cfg.link.delay_ns), Event::Cnp(packet.src));
            }
        }
    }

    /// Host `h`'s rate control gets a CNP (`cnp`) or its timer fires.
    fn rate_event(&mut self, h: u32, now: u64, cnp: bool) {
        let Some(rate) = self.hosts[h as usize].rate.as_mut() else {
            return;
        };
        if cnp {
            rate.handle_cnp(now);
        } else if rate.poll_timeout().is_some_and(|next| next <= now) {
            rate.handle_timeout(now);
        } else {
            return;
        }
        if let Some(next) = rate.poll_timeout() {
            let _ = self.sim.schedule_at(at(next.max(now)), Event::RateTimer(h));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn incast(senders: u32, message_bytes: u64) -> IncastConfig {
        IncastConfig {
            senders,
            message_bytes,
            mtu: 1024,
            link: LinkParams::default(),
            switch: SwitchParams::default(),
            dcqcn: None,
            seed: 1,
        }
    }

    #[test]
    fn one_sender_at_line_rate_never_pauses_and_takes_its_serialization_time() {
        let r = run_incast(&incast(1, 1_024_000));
        assert_eq!(r.pauses, 0);
        assert_eq!(r.delivered_bytes, 1_024_000);
        // 1000 packets of 328 ns back to back, plus two hops.
        let done = r.done_ns.unwrap();
        assert!((328_000..340_000).contains(&done), "{done}");
    }

    #[test]
    fn a_small_incast_fits_the_buffer_and_a_large_one_pauses() {
        let small = run_incast(&incast(4, 20_000));
        assert_eq!((small.pauses, small.drops), (0, 0));
        assert_eq!(small.delivered_bytes, 80_000);
        let large = run_incast(&incast(64, 1_000_000));
        assert!(large.pauses > 0);
        assert_eq!(large.drops, 0, "PFC keeps it lossless");
        assert_eq!(large.delivered_bytes, 64_000_000);
        assert!(large.first_pause_ns.is_some());
    }

    #[test]
    fn the_first_pause_comes_once_the_messages_outgrow_the_buffer() {
        // 20 KB messages (the paper's mean) at line rate: they arrive
        // within microseconds, far faster than one port drains them, so
        // the switch's 8 MB buffer is what holds them, less each port's
        // reserve and headroom (about 22 KB a port). 128 of them (2.6 MB)
        // fit under the dynamic thresholds; 512 (10.2 MB) cannot.
        let fits = run_incast(&incast(128, 20_000));
        assert_eq!(fits.pauses, 0, "{fits:?}");
        let over = run_incast(&incast(512, 20_000));
        assert!(over.pauses > 0, "{over:?}");
        assert_eq!(over.drops, 0);
        assert_eq!(over.delivered_bytes, 512 * 20_000);
    }

    #[test]
    fn the_same_seed_gives_the_same_run() {
        let mut cfg = incast(32, 500_000);
        cfg.dcqcn = Some(DcqcnParams::for_line_rate(cfg.link.rate_bps));
        let a = run_incast(&cfg);
        assert_eq!(a, run_incast(&cfg));
        assert!(a.cnps > 0, "{a:?}");
    }
}
