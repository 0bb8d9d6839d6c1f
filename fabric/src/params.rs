//! The fabric's parameters. Each default names its source; a model run
//! states the parameters it used. Rates are bits per second, sizes bytes,
//! delays nanoseconds.
//!
//! Sources:
//! - HPCC ns-3 simulator (Li et al., SIGCOMM 2019; the
//!   `alibaba-edu/High-Precision-Congestion-Control` repository): its
//!   switch MMU (`switch-mmu.cc`: 4 KB ingress reserve, 3 KB resume
//!   offset, dynamic threshold), its topology builder (`third.cc`:
//!   headroom of three times a link's bandwidth-delay product, threshold
//!   shift 3 for ports at the NIC rate, one less per doubling above it)
//!   and its runner's presets for DCQCN (`run.py`: 16 MB of buffer per
//!   50 Gbit/s of NIC rate; Kmin 100 KB, Kmax 400 KB, Pmax 0.2 at
//!   25 Gbit/s, scaled with the rate); its topologies use 1 µs links.
//! - DCQCN (Zhu et al., SIGCOMM 2015): the paper's own marking (Kmin
//!   5 KB, Kmax 200 KB, Pmax 1%) is [`EcnParams::dcqcn_paper`].

use thiserror::Error;

/// A parameter out of range, named by its field.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum ParamsError {
    /// The field must be above zero.
    #[error("{field} must be above 0")]
    Zero {
        /// The field.
        field: &'static str,
    },
    /// The field is outside its range.
    #[error("{field} = {value} is outside {range}")]
    Range {
        /// The field.
        field: &'static str,
        /// Its value, as written.
        value: String,
        /// The range it must be in.
        range: &'static str,
    },
}

/// The largest frame on the wire, bytes: a 4,096-byte payload with the
/// RoCE v2 headers (62 bytes, [`crate::rnic::RnicParams::header_bytes`]).
pub const MAX_FRAME_BYTES: u64 = 4096 + 62;

/// A link: its rate and propagation delay (one way).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkParams {
    /// Bits per second. Default 25 Gbit/s: the paper's ConnectX-5 fleet
    /// (Table 4, Table 7).
    pub rate_bps: u64,
    /// One-way propagation delay, ns. Default 1,000: the HPCC
    /// simulator's topologies.
    pub delay_ns: u64,
}

impl Default for LinkParams {
    fn default() -> Self {
        Self {
            rate_bps: 25_000_000_000,
            delay_ns: 1_000,
        }
    }
}

impl LinkParams {
    /// Nanoseconds to serialize `bytes` at the link's rate (rounded up).
    pub fn serialize_ns(&self, bytes: u64) -> u64 {
        let bits = u128::from(bytes) * 8 * 1_000_000_000;
        let rate = u128::from(self.rate_bps.max(1));
        u64::try_from(bits.div_ceil(rate)).unwrap_or(u64::MAX)
    }

    /// The bytes the link holds in flight one way: rate x delay.
    pub fn bdp_bytes(&self) -> u64 {
        let bytes = u128::from(self.rate_bps) * u128::from(self.delay_ns) / 8 / 1_000_000_000;
        u64::try_from(bytes).unwrap_or(u64::MAX)
    }

    /// Checks the fields.
    pub fn validate(&self) -> Result<(), ParamsError> {
        if self.rate_bps == 0 {
            return Err(ParamsError::Zero {
                field: "link.rate_bps",
            });
        }
        Ok(())
    }
}

/// ECN marking at a switch's egress queue: none below `kmin_bytes`,
/// every packet above `kmax_bytes`, and in between with a probability
/// rising linearly to `pmax` (RED's profile, as DCQCN uses it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EcnParams {
    /// Marking starts above this many bytes queued.
    pub kmin_bytes: u64,
    /// Every packet is marked above this many.
    pub kmax_bytes: u64,
    /// The marking probability just below `kmax_bytes`.
    pub pmax: f64,
}

impl EcnParams {
    /// The HPCC simulator's DCQCN preset for a port of `rate_bps`:
    /// 100 KB / 400 KB / 0.2 at 25 Gbit/s, thresholds scaled with the
    /// rate.
    pub fn hpcc_preset(rate_bps: u64) -> Self {
        let scale = |kb_at_25g: u64| {
            let bytes = u128::from(kb_at_25g) * 1000 * u128::from(rate_bps) / 25_000_000_000;
            u64::try_from(bytes).unwrap_or(u64::MAX)
        };
        Self {
            kmin_bytes: scale(100),
            kmax_bytes: scale(400),
            pmax: 0.2,
        }
    }

    /// The DCQCN paper's marking (Kmin 5 KB, Kmax 200 KB, Pmax 1%).
    pub fn dcqcn_paper() -> Self {
        Self {
            kmin_bytes: 5_000,
            kmax_bytes: 200_000,
            pmax: 0.01,
        }
    }

    /// Checks the fields.
    pub fn validate(&self) -> Result<(), ParamsError> {
        if self.kmax_bytes < self.kmin_bytes {
            return Err(ParamsError::Range {
                field: "ecn.kmax_bytes",
                value: self.kmax_bytes.to_string(),
                range: "at least ecn.kmin_bytes",
            });
        }
        if !(0.0..=1.0).contains(&self.pmax) {
            return Err(ParamsError::Range {
                field: "ecn.pmax",
                value: self.pmax.to_string(),
                range: "0 to 1",
            });
        }
        Ok(())
    }
}

/// A switch's buffer, PFC and ECN.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SwitchParams {
    /// The shared packet buffer. Default for a NIC rate of `r`: 16 MB per
    /// 50 Gbit/s (HPCC runner), 8 MB at 25 Gbit/s.
    pub buffer_bytes: u64,
    /// What each ingress port may hold before it draws on the shared
    /// pool. Default 4 KB (HPCC MMU).
    pub reserve_bytes: u64,
    /// How far below its threshold an ingress port's shared use must
    /// fall before it sends XON (hysteresis). Default 3 KB (HPCC MMU).
    pub resume_offset_bytes: u64,
    /// Each ingress port's headroom, in one-way bandwidth-delay products
    /// of its link: what arrives after the XOFF is sent (the pause's
    /// flight, the peer finishing its packet, the bytes already on the
    /// wire). Default 3 (HPCC topology builder).
    pub headroom_bdps: u64,
    /// Whole frames of headroom on top: the frame the peer is sending when
    /// the XOFF arrives and the one the switch was receiving when it sent
    /// it (IEEE 802.1Qbb's sizing counts two maximum frames beside twice
    /// the link's delay). Default 2 frames of [`MAX_FRAME_BYTES`]: 3 BDPs
    /// of a 25 Gbit/s, 1 us link are 9.4 KB, and with a 4 KB MTU what can
    /// arrive after an XOFF (2 us of the line rate and a frame being
    /// finished) comes to about 10.4 KB.
    pub headroom_frames: u64,
    /// The dynamic threshold: an ingress port may use 2^-shift of the
    /// free shared buffer. Default 3 (1/8) for ports at the NIC rate, one
    /// less per doubling of a port's rate above it (HPCC topology
    /// builder).
    pub alpha_shift: u32,
    /// PFC on: a port over its threshold pauses its peer and packets go
    /// to headroom (lossless). Off: a packet over the threshold is
    /// dropped. Default on (the paper's fabric).
    pub pfc: bool,
    /// ECN marking at the egress queues.
    pub ecn: EcnParams,
}

impl SwitchParams {
    /// The defaults for hosts whose NICs run at `nic_rate_bps`.
    pub fn for_nic_rate(nic_rate_bps: u64) -> Self {
        let buffer = u128::from(nic_rate_bps) * 16_000_000 / 50_000_000_000;
        Self {
            buffer_bytes: u64::try_from(buffer).unwrap_or(u64::MAX),
            reserve_bytes: 4 * 1024,
            resume_offset_bytes: 3 * 1024,
            headroom_bdps: 3,
            headroom_frames: 2,
            alpha_shift: 3,
            pfc: true,
            ecn: EcnParams::hpcc_preset(nic_rate_bps),
        }
    }

    /// Checks the fields.
    pub fn validate(&self) -> Result<(), ParamsError> {
        if self.buffer_bytes == 0 {
            return Err(ParamsError::Zero {
                field: "switch.buffer_bytes",
            });
        }
        if self.alpha_shift > 16 {
            return Err(ParamsError::Range {
                field: "switch.alpha_shift",
                value: self.alpha_shift.to_string(),
                range: "0 to 16",
            });
        }
        self.ecn.validate()
    }
}

impl Default for SwitchParams {
    fn default() -> Self {
        Self::for_nic_rate(LinkParams::default().rate_bps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_the_sources_figures() {
        let s = SwitchParams::default();
        assert_eq!(s.buffer_bytes, 8_000_000);
        assert_eq!((s.ecn.kmin_bytes, s.ecn.kmax_bytes), (100_000, 400_000));
        let fast = EcnParams::hpcc_preset(100_000_000_000);
        assert_eq!((fast.kmin_bytes, fast.kmax_bytes), (400_000, 1_600_000));
        let link = LinkParams::default();
        assert_eq!(link.bdp_bytes(), 3_125);
        // A 1 KB MTU packet at 25 Gbit/s.
        assert_eq!(link.serialize_ns(1024), 328);
        assert_eq!(s.validate(), Ok(()));
    }

    #[test]
    fn a_bad_field_is_named() {
        let mut s = SwitchParams::default();
        s.ecn.pmax = 1.5;
        let err = s.validate().unwrap_err();
        assert!(err.to_string().contains("ecn.pmax"), "{err}");
        s.ecn.pmax = 0.2;
        s.ecn.kmax_bytes = 1;
        assert!(
            s.validate()
                .unwrap_err()
                .to_string()
                .contains("ecn.kmax_bytes")
        );
    }
}
