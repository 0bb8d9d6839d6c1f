//! Feature admission (issue 37): a row only for an id that has been pushed
//! often enough, so that the ids seen once or twice, most of a
//! recommendation model's, take no row.
//!
//! **Count.** An id without a row is a *candidate*; each Push of it counts
//! in a count-min sketch (`depth` rows of `width` saturating 8-bit
//! counters, conservative update: only the counters at the minimum go up),
//! and the Push that brings its estimate to `min_pushes` creates its row;
//! earlier Pushes of it are dropped (counted). A Fetch of a candidate
//! answers the initializer's values, as for any id without a row. The
//! sketch ages as TinyLFU's does: once `width / 2` candidate Pushes have
//! counted, every counter is halved, so that an id must reach
//! `min_pushes` within about that window, and the sketch never fills: at
//! most half as many increments as counters per row, which bounds the
//! chance that an id seen once already reads `min_pushes - 1` through
//! collisions (a false admission) by `(1 - e^(-1/2))^depth`, 2.4% with 4
//! rows, far less just after a halving. Memory: `depth * width` bytes
//! per shard.
//!
//! **Probability.** Each candidate Push admits the id with probability
//! `p`, drawn from the id and the Push's identity (so the same Push
//! draws the same on every replica).
//!
//! **Replicas.** The primary decides; a forwarded Push names the keys it
//! did not admit, and replicas create rows for the others only, so every
//! copy holds the same rows. A replica counts the same candidates in its
//! own sketch, in the same order (Pushes of a shard apply in order), so
//! that a promoted replica goes on counting where the primary was.
//!
//! Written here rather than taken from a crate: the decision must be a
//! pure function of the Push stream on every replica (seeded hashing of
//! the id, a fixed halving point), counters of one byte with conservative
//! update, and a sketch that can be imaged byte for byte; the count-min
//! crates on crates.io hash through `std`'s randomly seeded hasher or
//! keep counters of 32 or 64 bits.

use serde::{Deserialize, Serialize};
use tessera_proto::sharding::splitmix64;

/// How a table admits new ids (`admission = { kind = ..., ... }`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum AdmissionConfig {
    /// After `min_pushes` Pushes of the id (counted in a sketch).
    Count {
        /// Pushes that create the row (the last of them is applied).
        /// 2 to 255.
        min_pushes: u32,
        /// Counters per sketch row, a power of two; the sketch takes
        /// `4 * sketch_width` bytes per shard and halves its counts
        /// every `sketch_width / 2` candidate Pushes. Default 2^20
        /// (4 MiB per shard, a window of 524,288 candidate Pushes).
        #[serde(default = "default_sketch_width")]
        sketch_width: u32,
    },
    /// Each Push of an id without a row creates it with probability `p`
    /// (0 < p <= 1).
    Probability {
        /// The chance per Push.
        p: f64,
    },
}

fn default_sketch_width() -> u32 {
    1 << 20
}

/// Rows of the sketch: 4, for a false-admission bound of 2.4% at its
/// fullest (module docs) with four byte reads per candidate.
pub const SKETCH_DEPTH: usize = 4;

impl AdmissionConfig {
    /// Checks the settings; the error names the key under `table`.
    pub fn validate(&self, table: &str) -> Result<(), tessera_config::ConfigError> {
        use tessera_config::invalid;
        match *self {
            AdmissionConfig::Count {
                min_pushes,
                sketch_width,
            } => {
                if !(2..=255).contains(&min_pushes) {
                    return Err(invalid(
                        format!("{table}.admission.min_pushes"),
                        "must be between 2 and 255 (1 admits every id: leave admission out)",
                    ));
                }
                if !sketch_width.is_power_of_two() || !(1 << 10..=1 << 28).contains(&sketch_width) {
                    return Err(invalid(
                        format!("{table}.admission.sketch_width"),
                        "must be a power of two between 1024 and 2^28",
                    ));
                }
            }
            AdmissionConfig::Probability { p } => {
                if !(p > 0.0 && p <= 1.0) {
                    return Err(invalid(
                        format!("{table}.admission.p"),
                        "must be above 0 and at most 1",
                    ));
                }
            }
        }
        Ok(())
    }
}

/// The admission state of one shard.
#[derive(Debug)]
pub struct FeatureAdmission {
    config: AdmissionConfig,
    /// Count: `SKETCH_DEPTH` rows of `width` counters, row after row.
    counters: Box<[u8]>,
    /// Count: candidate Pushes counted since the last halving.
    since_halving: u64,
    /// Candidate Pushes seen (counted or drawn).
    candidates: u64,
    /// Rows created by admission.
    admitted: u64,
}

impl FeatureAdmission {
    /// Empty state for `config`.
    pub fn new(config: AdmissionConfig) -> Self {
        let counters = match config {
            AdmissionConfig::Count { sketch_width, .. } => {
                vec![0u8; SKETCH_DEPTH * sketch_width as usize].into_boxed_slice()
            }
            AdmissionConfig::Probability { .. } => Box::default(),
        };
        Self {
            config,
            counters,
            since_halving: 0,
            candidates: 0,
            admitted: 0,
        }
    }

    /// A Push of `key`, which has no row: whether it creates the row now.
    /// `draw` is the Push's seed (the probability kind draws from it).
    /// Counts the candidate either way.
    pub fn candidate(&mut self, key: u64, draw: u64) -> bool {
        self.candidates += 1;
        let admit = match self.config {
            AdmissionConfig::Count { min_pushes, .. } => self.count(key) >= min_pushes,
            AdmissionConfig::Probability { p } => {
                // 53 bits of a draw seeded by the key and the Push.
                let x = splitmix64(key ^ splitmix64(draw)) >> 11;
                (x as f64) < p * (1u64 << 53) as f64
            }
        };
        if admit {
            self.admitted += 1;
        }
        admit
    }

    /// A Push of `key` that the primary decided about (a replica): counted
    /// as [`FeatureAdmission::candidate`] counts it, the decision taken as given.
    pub fn follow(&mut self, key: u64, admitted: bool) {
        self.candidates += 1;
        if let AdmissionConfig::Count { .. } = self.config {
            self.count(key);
        }
        if admitted {
            self.admitted += 1;
        }
    }

    /// Counts one Push of `key` (conservative update); its estimate after.
    fn count(&mut self, key: u64) -> u32 {
        let width = self.counters.len() / SKETCH_DEPTH;
        if width == 0 {
            return 0;
        }
        let mask = width - 1;
        let mut slots = [0usize; SKETCH_DEPTH];
        let mut h = splitmix64(key ^ 0x5ad1_55e0_c0de_0001);
        for (row, slot) in slots.iter_mut().enumerate() {
            *slot = row * width + (h as usize & mask);
            h = splitmix64(h);
        }
        let least = slots.iter().map(|&s| self.counters[s]).min().unwrap_or(0);
        let next = least.saturating_add(1);
        for &s in &slots {
            if self.counters[s] < next {
                self.counters[s] = next;
            }
        }
        self.since_halving += 1;
        if self.since_halving >= (width / 2) as u64 {
            self.halve();
        }
        u32::from(next)
    }

    /// Halves every counter (the sketch's aging).
    fn halve(&mut self) {
        for c in self.counters.iter_mut() {
            *c >>= 1;
        }
        self.since_halving = 0;
    }

    /// Candidate Pushes seen, and rows admitted.
    pub fn counts(&self) -> (u64, u64) {
        (self.candidates, self.admitted)
    }

    /// Bytes the sketch takes.
    pub fn bytes(&self) -> usize {
        self.counters.len()
    }

    /// The state as bytes (identical on replicas that saw the same
    /// Pushes).
    #[cfg(test)]
    pub(crate) fn image(&self) -> (&[u8], u64) {
        (&self.counters, self.since_halving)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(min_pushes: u32, width: u32) -> FeatureAdmission {
        FeatureAdmission::new(AdmissionConfig::Count {
            min_pushes,
            sketch_width: width,
        })
    }

    #[test]
    fn an_id_is_admitted_at_its_nth_push_and_not_before() {
        let mut a = count(3, 1 << 16);
        assert!(!a.candidate(42, 0));
        assert!(!a.candidate(42, 1));
        assert!(a.candidate(42, 2));
        // Another id starts from nothing.
        assert!(!a.candidate(43, 0));
        assert_eq!(a.counts(), (4, 1));
    }

    #[test]
    fn false_admissions_stay_within_the_documented_bound() {
        // Ids seen once each, as many as the sketch counts before it
        // halves (its fullest): how many read as seen before?
        let width = 1u32 << 16;
        let mut a = count(2, width);
        let mut false_admissions = 0;
        let n = u64::from(width / 2) - 1;
        for key in 0..n {
            if a.candidate(splitmix64(key), 0) {
                false_admissions += 1;
            }
        }
        let rate = false_admissions as f64 / n as f64;
        let bound = (1.0 - (-0.5f64).exp()).powi(SKETCH_DEPTH as i32);
        assert!(rate < bound, "{rate} false admissions, bound {bound}");
    }

    #[test]
    fn the_sketch_halves_and_ids_must_come_back_within_the_window() {
        let width = 1u32 << 10;
        let mut a = count(2, width);
        assert!(!a.candidate(7, 0));
        // A window of other candidates: the count of 7 halves to 0.
        for key in 1000..1000 + u64::from(width / 2) {
            a.candidate(key, 0);
        }
        assert!(!a.candidate(7, 0), "counted again from nothing");
        assert!(a.candidate(7, 0));
    }

    #[test]
    fn a_follower_counting_the_same_pushes_holds_the_same_sketch() {
        let mut primary = count(2, 1 << 10);
        let mut replica = count(2, 1 << 10);
        for i in 0..5000u64 {
            let key = splitmix64(i % 700);
            let admitted = primary.candidate(key, i);
            replica.follow(key, admitted);
        }
        assert_eq!(primary.image(), replica.image());
        assert_eq!(primary.counts(), replica.counts());
    }

    #[test]
    fn probability_admits_about_p_and_the_same_draw_the_same_way() {
        let mut a = FeatureAdmission::new(AdmissionConfig::Probability { p: 0.25 });
        let admitted = (0..20_000u64).filter(|&i| a.candidate(i, i * 7)).count();
        assert!((4_500..5_500).contains(&admitted), "{admitted}");
        let mut b = FeatureAdmission::new(AdmissionConfig::Probability { p: 0.25 });
        let mut c = FeatureAdmission::new(AdmissionConfig::Probability { p: 0.25 });
        for i in 0..1000u64 {
            assert_eq!(b.candidate(i, 99), c.candidate(i, 99));
        }
    }

    #[test]
    fn settings_out_of_range_are_refused_by_key() {
        let bad = [
            AdmissionConfig::Count {
                min_pushes: 1,
                sketch_width: 1 << 20,
            },
            AdmissionConfig::Count {
                min_pushes: 2,
                sketch_width: 1000,
            },
            AdmissionConfig::Probability { p: 0.0 },
            AdmissionConfig::Probability { p: 1.5 },
        ];
        for config in bad {
            let err = config.validate("tables[0]").unwrap_err().to_string();
            assert!(err.contains("tables[0].admission."), "{err}");
        }
    }
}
