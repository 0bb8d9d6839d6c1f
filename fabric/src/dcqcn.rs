//! DCQCN rate control at a sending NIC (Zhu et al., "Congestion Control
//! for Large-Scale RDMA Deployments", SIGCOMM 2015): the paper's
//! "hardware congestion control". A switch marks packets (ECN) as they
//! leave a long queue, the receiving NIC answers marked packets with a
//! congestion notification (CNP, at most one per flow per interval), and
//! the sending NIC's reaction point cuts the flow's rate on each CNP and
//! raises it again, in stages, while none comes.
//!
//! On a CNP (at most one cut per decrease interval): the target rate
//! takes the current one, the current rate falls by `alpha / 2`, and
//! `alpha` (the estimate of how congested the path is) moves towards 1
//! by `g`. With no CNP, `alpha` decays by `1 - g` per alpha interval,
//! and the rate rises on two clocks, a timer and a byte counter: for the
//! first `F` steps of either (fast recovery) the current rate moves half
//! way to the target; past `F` on one of them (additive increase) the
//! target grows by `R_AI` first; past `F` on both (hyper increase), by
//! `i x R_HAI` at the `i`-th step beyond. Rates stay between the minimum
//! and the line rate.
//!
//! # Call order
//!
//! [`Dcqcn::new`] at the flow's start; [`Dcqcn::handle_sent`] for each
//! packet sent, [`Dcqcn::handle_cnp`] for each CNP received; schedule a
//! timer at [`Dcqcn::poll_timeout`] (`None`: at line rate, nothing to
//! wake for) and call [`Dcqcn::handle_timeout`] when it fires (early or
//! late is fine: it does what is due). [`Dcqcn::rate_bps`] paces the
//! next packet. Time is nanoseconds of virtual time, passed in.

/// DCQCN's parameters (the defaults: the HPCC simulator's `dcqcn_paper`
/// preset, the DCQCN paper's timers, and HPCC's increase steps and
/// minimum rate for a 25 Gbit/s NIC, scaled with the line rate).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DcqcnParams {
    /// The NIC's line rate: the start and the ceiling.
    pub line_rate_bps: u64,
    /// The floor. Default 1 Gbit/s (HPCC runner's `MIN_RATE`).
    pub min_rate_bps: u64,
    /// `alpha`'s gain. Default 1/256 (DCQCN paper, HPCC).
    pub g: f64,
    /// `alpha` decays once per this with no CNP. Default 55 µs (DCQCN
    /// paper).
    pub alpha_interval_ns: u64,
    /// At most one rate cut per this. Default 50 µs (DCQCN paper: the
    /// notification point's CNP interval; HPCC `dcqcn_paper`).
    pub decrease_interval_ns: u64,
    /// The rate-increase timer. Default 55 µs (DCQCN paper, HPCC
    /// `dcqcn_paper`).
    pub increase_interval_ns: u64,
    /// The rate-increase byte counter. Default 10 MB (DCQCN paper).
    pub byte_counter: u64,
    /// Fast-recovery steps before additive increase. Default 5 (DCQCN
    /// paper).
    pub fast_recovery_steps: u32,
    /// Additive increase. Default 5 Mbit/s per 25 Gbit/s of line rate
    /// (HPCC runner).
    pub rate_ai_bps: u64,
    /// Hyper increase. Default 50 Mbit/s per 25 Gbit/s (HPCC runner).
    pub rate_hai_bps: u64,
}

impl DcqcnParams {
    /// The defaults for a NIC of `line_rate_bps`.
    pub fn for_line_rate(line_rate_bps: u64) -> Self {
        let per_25g = |bps: u64| {
            let scaled = u128::from(bps) * u128::from(line_rate_bps) / 25_000_000_000;
            u64::try_from(scaled).unwrap_or(u64::MAX)
        };
        Self {
            line_rate_bps,
            min_rate_bps: 1_000_000_000.min(line_rate_bps),
            g: 1.0 / 256.0,
            alpha_interval_ns: 55_000,
            decrease_interval_ns: 50_000,
            increase_interval_ns: 55_000,
            byte_counter: 10_000_000,
            fast_recovery_steps: 5,
            rate_ai_bps: per_25g(5_000_000),
            rate_hai_bps: per_25g(50_000_000),
        }
    }
}

impl DcqcnParams {
    /// Checks the fields.
    pub fn validate(&self) -> Result<(), crate::ParamsError> {
        if self.line_rate_bps == 0 {
            return Err(crate::ParamsError::Zero {
                field: "dcqcn.line_rate_bps",
            });
        }
        if self.min_rate_bps > self.line_rate_bps {
            return Err(crate::ParamsError::Range {
                field: "dcqcn.min_rate_bps",
                value: self.min_rate_bps.to_string(),
                range: "at most dcqcn.line_rate_bps",
            });
        }
        if !(self.g > 0.0 && self.g <= 1.0) {
            return Err(crate::ParamsError::Range {
                field: "dcqcn.g",
                value: self.g.to_string(),
                range: "above 0, at most 1",
            });
        }
        Ok(())
    }
}

/// One flow's reaction point (module docs).
#[derive(Debug, Clone)]
pub struct Dcqcn {
    p: DcqcnParams,
    /// Current and target rates, bits per second.
    rc: f64,
    rt: f64,
    alpha: f64,
    /// When `alpha` was last brought up to date.
    alpha_at: u64,
    last_cut: Option<u64>,
    /// Increase steps since the last cut, by timer and by bytes.
    timer_steps: u32,
    byte_steps: u32,
    bytes: u64,
    next_increase: u64,
}

impl Dcqcn {
    /// A flow starting at line rate at `now`.
    pub fn new(p: DcqcnParams, now: u64) -> Self {
        let line = p.line_rate_bps as f64;
        Self {
            p,
            rc: line,
            rt: line,
            alpha: 1.0,
            alpha_at: now,
            last_cut: None,
            timer_steps: 0,
            byte_steps: 0,
            bytes: 0,
            next_increase: now,
        }
    }

    /// The rate to send at now, bits per second.
    pub fn rate_bps(&self) -> u64 {
        self.rc as u64
    }

    /// `alpha` as of `now` (decayed for each alpha interval passed).
    fn decay_alpha(&mut self, now: u64) {
        let interval = self.p.alpha_interval_ns.max(1);
        let steps = now.saturating_sub(self.alpha_at) / interval;
        if steps > 0 {
            let steps = i32::try_from(steps).unwrap_or(i32::MAX);
            self.alpha *= (1.0 - self.p.g).powi(steps);
            self.alpha_at += u64::try_from(steps).unwrap_or(0) * interval;
        }
    }

    /// A CNP for this flow arrived at `now`.
    pub fn handle_cnp(&mut self, now: u64) {
        self.decay_alpha(now);
        if self
            .last_cut
            .is_some_and(|at| now.saturating_sub(at) < self.p.decrease_interval_ns)
        {
            return;
        }
        self.last_cut = Some(now);
        self.rt = self.rc;
        self.rc = (self.rc * (1.0 - self.alpha / 2.0)).max(self.p.min_rate_bps as f64);
        self.alpha = (1.0 - self.p.g) * self.alpha + self.p.g;
        self.alpha_at = now;
        self.timer_steps = 0;
        self.byte_steps = 0;
        self.bytes = 0;
        self.next_increase = now.saturating_add(self.p.increase_interval_ns);
    }

    /// `bytes` more were sent at `now`.
    pub fn handle_sent(&mut self, bytes: u64, _now: u64) {
        if self.at_line_rate() {
            return;
        }
        self.bytes += bytes;
        while self.bytes >= self.p.byte_counter.max(1) {
            self.bytes -= self.p.byte_counter.max(1);
            self.byte_steps = self.byte_steps.saturating_add(1);
            self.increase();
        }
    }

    /// When the rate next rises with no CNP (`None`: at line rate).
    pub fn poll_timeout(&self) -> Option<u64> {
        (!self.at_line_rate()).then_some(self.next_increase)
    }

    /// The timer fired at `now`: each increase step due is taken.
    pub fn handle_timeout(&mut self, now: u64) {
        let interval = self.p.increase_interval_ns.max(1);
        while !self.at_line_rate() && self.next_increase <= now {
            self.timer_steps = self.timer_steps.saturating_add(1);
            self.next_increase = self.next_increase.saturating_add(interval);
            self.increase();
        }
    }

    fn at_line_rate(&self) -> bool {
        self.rc >= self.p.line_rate_bps as f64
    }

    fn increase(&mut self) {
        let f = self.p.fast_recovery_steps;
        let (most, least) = (
            self.timer_steps.max(self.byte_steps),
            self.timer_steps.min(self.byte_steps),
        );
        if least > f {
            // Hyper increase: i x R_HAI at the i-th step past F on both.
            let i = f64::from(least - f);
            self.rt += i * self.p.rate_hai_bps as f64;
        } else if most > f {
            self.rt += self.p.rate_ai_bps as f64;
        }
        let line = self.p.line_rate_bps as f64;
        self.rt = self.rt.min(line);
        self.rc = ((self.rt + self.rc) / 2.0).min(line);
        // Within one additive step of the line rate: there (halving the
        // gap would take dozens more timer events to close it).
        if line - self.rc < self.p.rate_ai_bps.max(1) as f64 {
            self.rc = line;
            self.rt = line;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: u64 = 1_000;

    fn flow() -> Dcqcn {
        Dcqcn::new(DcqcnParams::for_line_rate(25_000_000_000), 0)
    }

    #[test]
    fn a_cnp_halves_the_first_rate_and_more_within_the_interval_do_nothing() {
        let mut d = flow();
        assert_eq!(d.rate_bps(), 25_000_000_000);
        assert_eq!(d.poll_timeout(), None);
        d.handle_cnp(10 * US);
        // alpha starts at 1: the first cut halves the rate.
        assert_eq!(d.rate_bps(), 12_500_000_000);
        d.handle_cnp(20 * US);
        assert_eq!(d.rate_bps(), 12_500_000_000);
        d.handle_cnp(70 * US);
        assert!(d.rate_bps() < 12_500_000_000);
        assert_eq!(d.poll_timeout(), Some(70 * US + 55 * US));
    }

    #[test]
    fn without_cnps_the_rate_recovers_to_line_rate_and_the_timer_stops() {
        let mut d = flow();
        d.handle_cnp(0);
        let mut now = 0;
        let mut steps = 0;
        while let Some(at) = d.poll_timeout() {
            now = at;
            d.handle_timeout(now);
            steps += 1;
            assert!(steps < 10_000, "never recovered");
        }
        assert_eq!(d.rate_bps(), 25_000_000_000);
        // Fast recovery alone halves the gap each step: it closes within
        // a few dozen steps of 55 µs.
        assert!(now < 5_000 * US, "{now}");
    }

    #[test]
    fn alpha_decays_between_cnps_so_a_late_cut_is_gentler() {
        let mut soon = flow();
        soon.handle_cnp(0);
        soon.handle_cnp(60 * US);
        let mut late = flow();
        late.handle_cnp(0);
        // 10 ms later: alpha decayed over ~180 intervals.
        late.handle_timeout(10_000 * US);
        let before = late.rate_bps();
        late.handle_cnp(10_000 * US);
        let cut_late = 1.0 - late.rate_bps() as f64 / before as f64;
        let cut_soon = 1.0 - soon.rate_bps() as f64 / 12_500_000_000.0;
        assert!(cut_late < cut_soon, "{cut_late} against {cut_soon}");
    }

    #[test]
    fn the_rate_never_falls_below_the_floor() {
        let mut d = flow();
        for i in 0..10_000 {
            d.handle_cnp(i * 60 * US);
        }
        assert_eq!(d.rate_bps(), 1_000_000_000);
    }

    #[test]
    fn the_defaults_validate_and_a_bad_gain_is_named() {
        let mut p = DcqcnParams::for_line_rate(25_000_000_000);
        assert_eq!(p.validate(), Ok(()));
        assert_eq!((p.rate_ai_bps, p.rate_hai_bps), (5_000_000, 50_000_000));
        p.g = 0.0;
        assert!(p.validate().unwrap_err().to_string().contains("dcqcn.g"));
    }

    #[test]
    fn the_byte_counter_raises_the_rate_too() {
        let mut d = flow();
        d.handle_cnp(0);
        let cut = d.rate_bps();
        d.handle_sent(10_000_000, 1);
        assert!(d.rate_bps() > cut);
    }
}
