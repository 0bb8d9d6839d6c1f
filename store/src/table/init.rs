//! How a row that has never been pushed starts: zeros, uniform or normal
//! values, each a pure function of (seed, table name, key, position) so
//! that every replica of a shard initialises a row identically without
//! talking to the others.

use serde::{Deserialize, Serialize};
use tessera_config::{ConfigError, invalid};
use tessera_proto::sharding::splitmix64;

/// A table's initializer.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum Initializer {
    /// All zeros.
    Zeros,
    /// Uniform in `[-scale, scale)`.
    Uniform {
        /// Half-width. Default 0.01: small random rows break symmetry
        /// without saturating anything.
        #[serde(default = "default_scale")]
        scale: f32,
    },
    /// Normal with mean 0 and standard deviation `std`.
    Normal {
        /// Standard deviation. Default 0.01.
        #[serde(default = "default_scale")]
        std: f32,
    },
}

fn default_scale() -> f32 {
    0.01
}

impl Default for Initializer {
    fn default() -> Self {
        Initializer::Uniform {
            scale: default_scale(),
        }
    }
}

impl Initializer {
    /// Checks the parameters; `key` names the table's initializer.
    pub fn validate(&self, key: &str) -> Result<(), ConfigError> {
        let (name, value) = match *self {
            Initializer::Zeros => return Ok(()),
            Initializer::Uniform { scale } => ("scale", scale),
            Initializer::Normal { std } => ("std", std),
        };
        if value.is_finite() && value >= 0.0 {
            Ok(())
        } else {
            Err(invalid(
                format!("{key}.{name}"),
                format!("{value} must be a finite number, at least 0"),
            ))
        }
    }

    /// The row of `key` (`dim` values); `base` mixes the seed and the
    /// table name ([`row_base`]).
    pub fn row(&self, base: u64, key: u64, dim: usize) -> Box<[f32]> {
        let mut out = vec![0.0; dim].into_boxed_slice();
        self.fill(base, key, &mut out);
        out
    }

    /// Writes the row of `key` into `out` (its length is the dimension).
    pub fn fill(&self, base: u64, key: u64, out: &mut [f32]) {
        let base = base.wrapping_add(splitmix64(key));
        // 24 random bits -> [0, 1), exactly representable in f32.
        let unit = |i: u64| (splitmix64(base.wrapping_add(i)) >> 40) as f32 / (1u32 << 24) as f32;
        match *self {
            Initializer::Zeros => out.fill(0.0),
            Initializer::Uniform { scale } => {
                for (j, v) in out.iter_mut().enumerate() {
                    *v = scale * (2.0 * unit(j as u64) - 1.0);
                }
            }
            Initializer::Normal { std } => {
                for (j, v) in out.iter_mut().enumerate() {
                    let j = j as u64;
                    // Box-Muller on two independent draws per value; u1 in
                    // (0, 1] so the logarithm is finite.
                    let u1 = 1.0 - unit(2 * j + 1_000_003);
                    let u2 = unit(2 * j + 1_000_004);
                    *v = std * (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos();
                }
            }
        }
    }
}

/// The per-table part of every row's seed: the server's (or table's) seed
/// mixed with an FNV-1a hash of the table name, so tables differ.
pub fn row_base(seed: u64, table: &str) -> u64 {
    let name_hash = table.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    splitmix64(seed ^ name_hash)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_deterministic_and_differ_by_key_seed_and_table() {
        let init = Initializer::Uniform { scale: 0.5 };
        let base = row_base(42, "emb");
        assert_eq!(init.row(base, 7, 8), init.row(base, 7, 8));
        assert_ne!(init.row(base, 7, 8), init.row(base, 8, 8));
        assert_ne!(init.row(base, 7, 8), init.row(row_base(43, "emb"), 7, 8));
        assert_ne!(init.row(base, 7, 8), init.row(row_base(42, "other"), 7, 8));
        assert!(
            init.row(base, 7, 64)
                .iter()
                .all(|v| (-0.5..0.5).contains(v))
        );
        assert!(Initializer::Zeros.row(base, 7, 4).iter().all(|&v| v == 0.0));
    }

    #[test]
    fn normal_rows_have_the_configured_spread() {
        let init = Initializer::Normal { std: 0.2 };
        let base = row_base(1, "t");
        let values: Vec<f32> = (0..2000u64)
            .flat_map(|k| init.row(base, k, 16).into_vec())
            .collect();
        let n = values.len() as f32;
        let mean = values.iter().sum::<f32>() / n;
        let var = values.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
        assert!(mean.abs() < 0.005, "mean {mean}");
        assert!((var.sqrt() - 0.2).abs() < 0.005, "std {}", var.sqrt());
        assert!(values.iter().all(|v| v.is_finite()));
    }

    #[test]
    fn negative_or_nan_spreads_are_refused_with_their_key() {
        let err = Initializer::Normal { std: -1.0 }
            .validate("tables[1].initializer")
            .unwrap_err()
            .to_string();
        assert!(err.contains("tables[1].initializer.std"), "{err}");
        assert!(
            Initializer::Uniform { scale: f32::NAN }
                .validate("x")
                .is_err()
        );
    }
}
