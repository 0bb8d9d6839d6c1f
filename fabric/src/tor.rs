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
    let n = cfg.senders as usize;
    let mtu = cfg.mtu.max(1);
    let mut sim: Simulator<Event> = Simulator::new(cfg.seed);
    let mut marks = ChaCha8Rng::seed_from_u64(cfg.seed);
    // Switch port i faces host i.
    let mut mmu = Mmu::new(cfg.switch, &vec![cfg.link; n + 1], cfg.link.rate_bps);
    let mut to_receiver: Port<(Packet, usize)> = Port::new(cfg.link);
    let mut pauses = PauseLog::default();
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
    let total = cfg.message_bytes * u64::from(cfg.senders);
    let mut report = IncastReport::default();
    let end = SimTime::from_nanos(1_000_000_000);
    let at = |ns: u64| SimTime::from_nanos(ns);
    while let Some(due) = sim.next_event_until(end) {
        report.events += 1;
        let now = due.at.as_nanos();
        match due.event {
            Event::HostSend(h) => {
                let host = &mut hosts[h as usize];
                if now < host.next_start {
                    let _ = sim.schedule_at(at(host.next_start), Event::HostSend(h));
                    continue;
                }
                let Some(t) = host.port.poll_transmit(now) else {
                    continue;
                };
                // Paced at the flow's rate: the next start is one
                // packet's time at that rate after this one's.
                let rate = host
                    .rate
                    .as_ref()
                    .map_or(cfg.link.rate_bps, Dcqcn::rate_bps)
                    .max(1);
                let gap = LinkParams {
                    rate_bps: rate,
                    ..cfg.link
                }
                .serialize_ns(t.bytes);
                host.next_start = now + gap;
                if let Some(rate) = host.rate.as_mut() {
                    rate.handle_sent(t.bytes, now);
                }
                let _ = sim.schedule_at(at(t.arrives_at), Event::AtSwitch(t.packet));
                if host.port.poll_timeout().is_some() {
                    let next = t.leaves_at.max(host.next_start);
                    let _ = sim.schedule_at(at(next), Event::HostSend(h));
                }
            }
            Event::AtSwitch(packet) => {
                let ingress = packet.src as usize;
                if mmu.handle_arrival(ingress, 0, packet.bytes) == Admission::Dropped {
                    report.drops += 1;
                    continue;
                }
                if mmu.poll_pfc(ingress) == Some(Pfc::Pause) {
                    pauses.handle_pause((0, packet.src), due.at);
                    let _ = sim.schedule_at(
                        at(now + cfg.link.delay_ns),
                        Event::PfcAtHost(packet.src, true),
                    );
                }
                let idle = to_receiver.poll_timeout().is_none();
                to_receiver.handle_enqueue((packet, ingress), packet.bytes);
                if idle {
                    let _ = sim.schedule_at(due.at, Event::SwitchSend);
                }
            }
            Event::SwitchSend => {
                let Some(t) = to_receiver.poll_transmit(now) else {
                    if let Some(next) = to_receiver.poll_timeout() {
                        let _ = sim.schedule_at(at(next.max(now)), Event::SwitchSend);
                    }
                    continue;
                };
                let (mut packet, ingress) = t.packet;
                packet.ecn = mmu.ecn_mark(0, &mut marks);
                mmu.handle_departure(ingress, 0, packet.bytes);
                if mmu.poll_pfc(ingress) == Some(Pfc::Resume) {
                    pauses.handle_resume((0, packet.src), due.at);
                    let _ = sim.schedule_at(
                        at(now + cfg.link.delay_ns),
                        Event::PfcAtHost(packet.src, false),
                    );
                }
                let _ = sim.schedule_at(at(t.arrives_at), Event::AtReceiver(packet));
                if let Some(next) = to_receiver.poll_timeout() {
                    let _ = sim.schedule_at(at(next), Event::SwitchSend);
                }
            }
            Event::AtReceiver(packet) => {
                report.delivered_bytes += packet.bytes;
                if report.delivered_bytes >= total && report.done_ns.is_none() {
                    report.done_ns = Some(now);
                }
                let host = &mut hosts[packet.src as usize];
                if packet.ecn
                    && let Some(params) = cfg.dcqcn.as_ref()
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
                        report.cnps += 1;
                        let _ = sim
                            .schedule_at(at(now + 2 * cfg.link.delay_ns), Event::Cnp(packet.src));
                    }
                }
            }
            Event::PfcAtHost(h, pause) => {
                let host = &mut hosts[h as usize];
                host.port.handle_pfc(pause);
                if !pause && host.port.poll_timeout().is_some() {
                    let _ = sim.schedule_at(due.at, Event::HostSend(h));
                }
            }
            Event::Cnp(h) => {
                if let Some(rate) = hosts[h as usize].rate.as_mut() {
                    rate.handle_cnp(now);
                    if let Some(next) = rate.poll_timeout() {
                        let _ = sim.schedule_at(at(next.max(now)), Event::RateTimer(h));
                    }
                }
            }
            Event::RateTimer(h) => {
                if let Some(rate) = hosts[h as usize].rate.as_mut()
                    && rate.poll_timeout().is_some_and(|next| next <= now)
                {
                    rate.handle_timeout(now);
                    if let Some(next) = rate.poll_timeout() {
                        let _ = sim.schedule_at(at(next.max(now)), Event::RateTimer(h));
                    }
                }
            }
        }
        if report.done_ns.is_some() {
            break;
        }
    }
    report.first_pause_ns = pauses.first().map(|(t, _)| t.as_nanos());
    report.pauses = pauses.count();
    report.paused_ns = pauses.paused_ns(sim.now()).0;
    report
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
