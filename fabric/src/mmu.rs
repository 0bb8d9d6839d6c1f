//! A switch's memory management unit: where each arriving packet may be
//! held, when an ingress port pauses its peer (PFC), and whether a
//! leaving packet is ECN-marked.
//!
//! The buffer is shared. Each ingress port has a small reserve of its
//! own; beyond it, it draws on the shared pool up to a dynamic threshold,
//! a fraction 2^-shift of the pool still free (Choudhury and Hahne's
//! dynamic threshold, as Broadcom switches and the HPCC simulator use
//! it): the more the pool is used, the less each port may take, so one
//! hot port cannot starve the rest. With PFC on, a port that reaches its
//! threshold sends XOFF to its peer, and what arrives until the pause
//! lands goes to the port's headroom; once the headroom is empty and its
//! shared use is a resume offset below the threshold, it sends XON. With
//! PFC off, a packet over the threshold is dropped.
//!
//! # Call order
//!
//! For each packet: [`Mmu::handle_arrival`] when it is whole at the
//! switch (it says whether it is held), then [`Mmu::poll_pfc`] for its
//! ingress port (a pause to send). When it leaves its egress queue:
//! [`Mmu::ecn_mark`] (with the bytes it leaves behind counted), then
//! [`Mmu::handle_departure`], then [`Mmu::poll_pfc`] for its ingress port
//! (a resume to send). Nothing here reads a clock; the pause log
//! ([`crate::PauseLog`]) takes the times.

use rand::Rng;

use crate::params::{LinkParams, MAX_FRAME_BYTES, SwitchParams};

/// What the MMU does with an arriving packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Held until it leaves.
    Accepted,
    /// Dropped: over its ingress port's threshold with PFC off, or its
    /// headroom full with PFC on (too little headroom for the link).
    Dropped,
}

/// A PFC frame an ingress port sends to the peer on its link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pfc {
    /// XOFF: stop sending.
    Pause,
    /// XON: send again.
    Resume,
}

#[derive(Debug, Clone)]
struct Port {
    /// Bytes held for packets that came in here, reserve and shared.
    ingress: u64,
    /// Of those, in the headroom.
    headroom_used: u64,
    headroom: u64,
    alpha_shift: u32,
    paused: bool,
    /// Bytes queued to leave by this port.
    egress: u64,
}

/// One switch's buffer accounting (module docs).
#[derive(Debug, Clone)]
pub struct Mmu {
    params: SwitchParams,
    ports: Vec<Port>,
    /// Shared-pool bytes in use (ingress bytes past each reserve).
    shared_used: u64,
    /// The reserves and headrooms set aside from the buffer.
    set_aside: u64,
    drops: u64,
}

impl Mmu {
    /// A switch with one port per link in `links` (port `i` on
    /// `links[i]`), for hosts whose NICs run at `nic_rate_bps`.
    pub fn new(params: SwitchParams, links: &[LinkParams], nic_rate_bps: u64) -> Self {
        let ports: Vec<Port> = links
            .iter()
            .map(|link| {
                // A faster port may take a larger share (one step of the
                // shift per doubling above the NIC rate).
                let mut shift = params.alpha_shift;
                let mut rate = link.rate_bps;
                while rate > nic_rate_bps && shift > 0 {
                    shift -= 1;
                    rate /= 2;
                }
                Port {
                    ingress: 0,
                    headroom_used: 0,
                    headroom: link
                        .bdp_bytes()
                        .saturating_mul(params.headroom_bdps)
                        .saturating_add(params.headroom_frames.saturating_mul(MAX_FRAME_BYTES)),
                    alpha_shift: shift,
                    paused: false,
                    egress: 0,
                }
            })
            .collect();
        let set_aside = ports
            .iter()
            .map(|p| p.headroom.saturating_add(params.reserve_bytes))
            .fold(0u64, u64::saturating_add);
        Self {
            params,
            ports,
            shared_used: 0,
            set_aside,
            drops: 0,
        }
    }

    /// How many shared-pool bytes ingress port `port` may use now.
    pub fn threshold(&self, port: usize) -> u64 {
        let free = self
            .params
            .buffer_bytes
            .saturating_sub(self.set_aside)
            .saturating_sub(self.shared_used);
        let shift = self.ports.get(port).map_or(0, |p| p.alpha_shift);
        free >> shift
    }

    /// The shared-pool bytes ingress port `port` uses.
    pub fn shared_of(&self, port: usize) -> u64 {
        self.ports.get(port).map_or(0, |p| {
            p.ingress
                .saturating_sub(p.headroom_used)
                .saturating_sub(self.params.reserve_bytes)
        })
    }

    /// A packet of `bytes` whole at the switch, in from `ingress`, to
    /// leave by `egress`: held or dropped.
    pub fn handle_arrival(&mut self, ingress: usize, egress: usize, bytes: u64) -> Admission {
        if ingress >= self.ports.len() || egress >= self.ports.len() {
            self.drops += 1;
            return Admission::Dropped;
        }
        let threshold = self.threshold(ingress);
        let reserve = self.params.reserve_bytes;
        let pfc = self.params.pfc;
        let port = &mut self.ports[ingress];
        // Its bytes outside the headroom, and past the reserve with this
        // packet.
        let in_reserve = port.ingress.saturating_sub(port.headroom_used);
        let past = in_reserve.saturating_add(bytes).saturating_sub(reserve);
        if past > threshold {
            if !pfc || port.headroom_used.saturating_add(bytes) > port.headroom {
                self.drops += 1;
                return Admission::Dropped;
            }
            port.headroom_used += bytes;
        } else {
            // What of it lies past the reserve comes from the pool.
            self.shared_used += past.min(bytes);
        }
        port.ingress += bytes;
        self.ports[egress].egress += bytes;
        Admission::Accepted
    }

    /// A held packet of `bytes` (in from `ingress`) left by `egress`.
    pub fn handle_departure(&mut self, ingress: usize, egress: usize, bytes: u64) {
        let reserve = self.params.reserve_bytes;
        if let Some(port) = self.ports.get_mut(ingress) {
            // Headroom drains first: it is what made the port pause.
            let from_headroom = port.headroom_used.min(bytes);
            port.headroom_used -= from_headroom;
            let rest = bytes - from_headroom;
            let in_reserve = port
                .ingress
                .saturating_sub(port.headroom_used + from_headroom);
            let from_shared = rest.min(in_reserve.saturating_sub(reserve));
            self.shared_used = self.shared_used.saturating_sub(from_shared);
            port.ingress = port.ingress.saturating_sub(bytes);
        }
        if let Some(port) = self.ports.get_mut(egress) {
            port.egress = port.egress.saturating_sub(bytes);
        }
    }

    /// The PFC frame ingress port `port` sends now, if its state changed:
    /// XOFF once its headroom is in use or its shared use reached its
    /// threshold, XON once its headroom is empty and its shared use is
    /// the resume offset below the threshold (or nothing). `None` with
    /// PFC off.
    pub fn poll_pfc(&mut self, port: usize) -> Option<Pfc> {
        if !self.params.pfc || port >= self.ports.len() {
            return None;
        }
        let threshold = self.threshold(port);
        let shared = self.shared_of(port);
        let offset = self.params.resume_offset_bytes;
        let p = &mut self.ports[port];
        if !p.paused && (p.headroom_used > 0 || (shared > 0 && shared >= threshold)) {
            p.paused = true;
            return Some(Pfc::Pause);
        }
        if p.paused && p.headroom_used == 0 && (shared == 0 || shared + offset <= threshold) {
            p.paused = false;
            return Some(Pfc::Resume);
        }
        None
    }

    /// Whether a packet leaving by `egress` now is ECN-marked, from the
    /// bytes queued there (RED's profile between Kmin and Kmax; DCQCN
    /// marks as packets leave).
    pub fn ecn_mark(&self, egress: usize, rng: &mut impl Rng) -> bool {
        let queued = self.ports.get(egress).map_or(0, |p| p.egress);
        let ecn = &self.params.ecn;
        if queued > ecn.kmax_bytes {
            return true;
        }
        if queued <= ecn.kmin_bytes || ecn.kmax_bytes == ecn.kmin_bytes {
            return false;
        }
        let p =
            ecn.pmax * (queued - ecn.kmin_bytes) as f64 / (ecn.kmax_bytes - ecn.kmin_bytes) as f64;
        rng.random_bool(p.clamp(0.0, 1.0))
    }

    /// Whether ingress port `port` has its peer paused.
    pub fn paused(&self, port: usize) -> bool {
        self.ports.get(port).is_some_and(|p| p.paused)
    }

    /// Bytes queued to leave by `port`.
    pub fn egress_bytes(&self, port: usize) -> u64 {
        self.ports.get(port).map_or(0, |p| p.egress)
    }

    /// Bytes held for packets in from `port`, and of those in headroom.
    pub fn ingress_bytes(&self, port: usize) -> (u64, u64) {
        self.ports
            .get(port)
            .map_or((0, 0), |p| (p.ingress, p.headroom_used))
    }

    /// Shared-pool bytes in use.
    pub fn shared_used(&self) -> u64 {
        self.shared_used
    }

    /// Packets dropped so far.
    pub fn drops(&self) -> u64 {
        self.drops
    }

    /// Ingress port `port`'s headroom, bytes.
    pub fn headroom(&self, port: usize) -> u64 {
        self.ports.get(port).map_or(0, |p| p.headroom)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use proptest::prelude::*;
    use rand::SeedableRng;

    use super::*;
    use crate::params::EcnParams;

    const MTU: u64 = 1024;

    fn switch(ports: usize, pfc: bool) -> Mmu {
        let params = SwitchParams {
            buffer_bytes: 1_000_000,
            pfc,
            ..SwitchParams::default()
        };
        Mmu::new(params, &vec![LinkParams::default(); ports], 25_000_000_000)
    }

    #[test]
    fn an_incast_pauses_its_senders_once_the_pool_is_shared_out() {
        // Eight senders into port 0: each ingress port takes its share
        // of the free pool, which shrinks as they fill it.
        let mut mmu = switch(9, true);
        let first = mmu.threshold(1);
        let mut paused_at = None;
        'fill: for n in 0..2_000u64 {
            for port in 1..9 {
                assert_eq!(mmu.handle_arrival(port, 0, MTU), Admission::Accepted);
                if mmu.poll_pfc(port) == Some(Pfc::Pause) {
                    paused_at = Some(n);
                    break 'fill;
                }
            }
        }
        assert!(paused_at.is_some(), "a sender was paused");
        assert!(
            mmu.threshold(1) < first,
            "the threshold shrinks as the pool fills"
        );
        // Eight ports sharing, each may hold T = (F - 8 T) / 8 of the
        // pool F left after reserves and headroom: T = F / 16, where the
        // first of them pauses.
        let pool = 1_000_000 - 9 * (3 * 3_125 + 2 * MAX_FRAME_BYTES + 4 * 1024);
        let share = pool / 16;
        for port in 1..9 {
            let held = mmu.shared_of(port);
            assert!(
                held + 2 * MTU >= share && held <= share + MTU,
                "{held} against {share}"
            );
        }
    }

    #[test]
    fn headroom_takes_what_arrives_after_the_pause_and_resume_waits_for_it() {
        let mut mmu = switch(2, true);
        let mut n = 0;
        while mmu.poll_pfc(1) != Some(Pfc::Pause) {
            assert_eq!(mmu.handle_arrival(1, 0, MTU), Admission::Accepted);
            n += 1;
        }
        // The packet that crossed the threshold went to headroom (and
        // made the port pause); what is in flight when the XOFF went
        // follows it there, not dropped.
        let headroom = mmu.headroom(1);
        assert_eq!(headroom, 3 * 3_125 + 2 * MAX_FRAME_BYTES);
        assert_eq!(mmu.ingress_bytes(1).1, MTU);
        let fits = headroom / MTU;
        for _ in 1..fits {
            assert_eq!(mmu.handle_arrival(1, 0, MTU), Admission::Accepted);
        }
        assert_eq!(mmu.ingress_bytes(1).1, fits * MTU);
        // Past the headroom: dropped (the link's headroom was too small).
        assert_eq!(mmu.handle_arrival(1, 0, MTU), Admission::Dropped);
        assert_eq!(mmu.drops(), 1);
        // Draining: no XON while headroom is in use.
        for _ in 0..fits {
            assert_eq!(mmu.poll_pfc(1), None);
            mmu.handle_departure(1, 0, MTU);
        }
        let mut resumed = false;
        for _ in 0..n - 1 {
            mmu.handle_departure(1, 0, MTU);
            if mmu.poll_pfc(1) == Some(Pfc::Resume) {
                resumed = true;
                break;
            }
        }
        assert!(resumed);
        assert!(!mmu.paused(1));
    }

    #[test]
    fn without_pfc_a_packet_over_the_threshold_is_dropped() {
        let mut mmu = switch(2, false);
        let mut accepted = 0u64;
        while mmu.handle_arrival(1, 0, MTU) == Admission::Accepted {
            accepted += 1;
            assert_eq!(mmu.poll_pfc(1), None);
        }
        assert!(accepted > 4, "past the reserve");
        assert_eq!(mmu.drops(), 1);
    }

    #[test]
    fn ecn_marks_nothing_below_kmin_everything_above_kmax_and_pmax_between() {
        let params = SwitchParams {
            buffer_bytes: 100_000_000,
            ecn: EcnParams {
                kmin_bytes: 10 * MTU,
                kmax_bytes: 110 * MTU,
                pmax: 0.2,
            },
            ..SwitchParams::default()
        };
        let mut mmu = Mmu::new(params, &[LinkParams::default(); 2], 25_000_000_000);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let queue = |mmu: &mut Mmu, packets: u64| {
            while mmu.egress_bytes(0) < packets * MTU {
                let _ = mmu.handle_arrival(1, 0, MTU);
            }
            while mmu.egress_bytes(0) > packets * MTU {
                mmu.handle_departure(1, 0, MTU);
            }
        };
        queue(&mut mmu, 10);
        assert!((0..1000).all(|_| !mmu.ecn_mark(0, &mut rng)));
        queue(&mut mmu, 111);
        assert!((0..1000).all(|_| mmu.ecn_mark(0, &mut rng)));
        // Halfway: pmax / 2 = 10%.
        queue(&mut mmu, 60);
        let marked = (0..10_000).filter(|_| mmu.ecn_mark(0, &mut rng)).count();
        assert!((800..1200).contains(&marked), "{marked}");
    }

    proptest! {
        /// Whatever arrives and leaves (each port's packets in order),
        /// the pool is never over the buffer, and once all is drained
        /// every counter is back to zero and no port stays paused.
        #[test]
        fn the_accounting_returns_to_zero(
            steps in proptest::collection::vec((0usize..4, 0usize..4, 64u64..4200, any::<bool>()), 1..400),
            pfc in any::<bool>(),
        ) {
            let mut mmu = switch(4, pfc);
            let mut held: Vec<VecDeque<(usize, u64)>> = vec![VecDeque::new(); 4];
            for (ingress, egress, bytes, leave) in steps {
                if leave {
                    if let Some((e, b)) = held[ingress].pop_front() {
                        mmu.handle_departure(ingress, e, b);
                    }
                } else if mmu.handle_arrival(ingress, egress, bytes) == Admission::Accepted {
                    held[ingress].push_back((egress, bytes));
                }
                let _ = mmu.poll_pfc(ingress);
                prop_assert!(mmu.shared_used() <= 1_000_000);
            }
            for (ingress, queue) in held.iter_mut().enumerate() {
                while let Some((e, b)) = queue.pop_front() {
                    mmu.handle_departure(ingress, e, b);
                }
                let _ = mmu.poll_pfc(ingress);
            }
            prop_assert_eq!(mmu.shared_used(), 0);
            for port in 0..4 {
                prop_assert_eq!(mmu.ingress_bytes(port), (0, 0));
                prop_assert_eq!(mmu.egress_bytes(port), 0);
                prop_assert!(!mmu.paused(port));
            }
        }
    }
}
