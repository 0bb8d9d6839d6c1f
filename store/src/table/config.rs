//! One table's configuration ([`TableConfig`]): its dimension, how new
//! rows start, the optimizer, the row limit, storage type, admission and
//! expiry. The table reads it; the store's configuration
//! ([`crate::config::StoreConfig`]) lists the tables.

use serde::{Deserialize, Serialize};
use tessera_config::{ConfigError, invalid};

use super::{AdmissionConfig, EvictionPolicy, ExpiryConfig, Initializer, OptimizerConfig, Storage};

/// One embedding table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TableConfig {
    /// Table name, as used in Fetch and Push.
    pub name: String,
    /// Values per row.
    pub dim: u32,
    /// How new rows start (`{ kind = "zeros" | "uniform" | "normal", ... }`).
    /// Default uniform in ±0.01.
    #[serde(default)]
    pub initializer: Initializer,
    /// Seed of the initializer. Default: the server's `seed`. Every
    /// replica of a shard must use the same.
    #[serde(default)]
    pub seed: Option<u64>,
    /// The optimizer Pushes apply (`{ kind = "sgd" | "adagrad" | "adam",
    /// learning_rate = ..., ... }`). Default SGD with learning rate 0.01.
    #[serde(default)]
    pub optimizer: OptimizerConfig,
    /// Rows per hosted shard at most; beyond it rows are evicted by
    /// `eviction`. Default: no limit (a table that fits in memory should
    /// never lose rows).
    #[serde(default)]
    pub max_rows: Option<u64>,
    /// `lru` (least recently used) or `lfu` (least frequently updated).
    /// Default `lru`: a row nobody reads any more is the cheapest to lose.
    #[serde(default)]
    pub eviction: EvictionPolicy,
    /// How values are stored: `f32`, `f16` or `bf16` (half the bytes;
    /// optimizer math runs in `f32` and rounds once per update, the
    /// optimizer state stays `f32`, Fetches answer `f32`). Default `f32`:
    /// exactly what was computed; choose a narrow one for a table whose
    /// model tolerates 2^-11 (`f16`) or 2^-8 (`bf16`) relative rounding
    /// per update.
    #[serde(default)]
    pub storage: Storage,
    /// What a Push with NaN or infinite gradients gets: `reject` (the whole
    /// Push is refused) or `clip` (NaN becomes 0, every value is clamped to
    /// ±`gradient_clip`). Default `reject`: a NaN gradient is a bug
    /// upstream, and one applied NaN poisons a row for good.
    #[serde(default)]
    pub non_finite: NonFinite,
    /// Largest gradient magnitude with `non_finite = "clip"`. Default 1000.
    #[serde(default = "default_gradient_clip")]
    pub gradient_clip: f32,
    /// Feature admission (`table/admission.rs`): a row is created for an
    /// id only once it has been pushed `min_pushes` times (`{ kind =
    /// "count", min_pushes = 2 }`, counted in a sketch of
    /// `4 * sketch_width` bytes per shard) or with probability `p` per
    /// Push (`{ kind = "probability", p = 0.1 }`); earlier Pushes of it
    /// are dropped, Fetches of it answer the initializer's values. Default
    /// none: every pushed id gets a row (a table whose ids all matter).
    #[serde(default)]
    pub admission: Option<AdmissionConfig>,
    /// Expiry (`table/expiry.rs`): rows not pushed for `after_secs`
    /// seconds (`{ after_secs = 604800 }`) or while
    /// `after_pushes_to_shard` Pushes reached their shard are removed by
    /// a background sweep on the shard's primary (`refresh = "access"`:
    /// Fetches keep rows too; `sweep_rows_per_sec`, default 1,000,000,
    /// paces it). Costs 4 bytes per row. Default none: rows stay until a
    /// row limit evicts them.
    #[serde(default)]
    pub expiry: Option<ExpiryConfig>,
}

fn default_gradient_clip() -> f32 {
    1000.0
}

/// What happens to non-finite gradients (see [`TableConfig::non_finite`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NonFinite {
    /// The Push is refused.
    #[default]
    Reject,
    /// NaN -> 0, values clamped to ±`gradient_clip`.
    Clip,
}

impl TableConfig {
    /// A table with every setting at its default.
    pub fn new(name: impl Into<String>, dim: u32) -> Self {
        Self {
            name: name.into(),
            dim,
            initializer: Initializer::default(),
            seed: None,
            optimizer: OptimizerConfig::default(),
            max_rows: None,
            eviction: EvictionPolicy::default(),
            storage: Storage::default(),
            non_finite: NonFinite::default(),
            gradient_clip: default_gradient_clip(),
            admission: None,
            expiry: None,
        }
    }

    /// Checks the table as `tables[i]` of its file, naming the key that
    /// is wrong.
    pub fn validate(&self, i: usize) -> Result<(), ConfigError> {
        if self.name.is_empty() {
            return Err(invalid(format!("tables[{i}].name"), "must not be empty"));
        }
        if self.dim == 0 || self.dim > MAX_DIM {
            return Err(invalid(
                format!("tables[{i}].dim"),
                format!("{} is outside 1..={MAX_DIM}", self.dim),
            ));
        }
        self.initializer
            .validate(&format!("tables[{i}].initializer"))?;
        self.optimizer.validate(&format!("tables[{i}].optimizer"))?;
        if self.max_rows == Some(0) {
            return Err(invalid(
                format!("tables[{i}].max_rows"),
                "must be at least 1 (leave it out for no limit)",
            ));
        }
        if let Some(max) = self.max_rows
            && max > super::MAX_SHARD_ROWS
        {
            return Err(invalid(
                format!("tables[{i}].max_rows"),
                format!(
                    "{max} exceeds the {} rows a shard of a table holds",
                    super::MAX_SHARD_ROWS
                ),
            ));
        }
        if !(self.gradient_clip.is_finite() && self.gradient_clip > 0.0) {
            return Err(invalid(
                format!("tables[{i}].gradient_clip"),
                format!("{} must be a positive number", self.gradient_clip),
            ));
        }
        if let Some(admission) = &self.admission {
            admission.validate(&format!("tables[{i}]"))?;
        }
        if let Some(expiry) = &self.expiry {
            expiry.validate(&format!("tables[{i}]"))?;
        }
        Ok(())
    }
}

/// Most values per row: beyond this a single row would be larger than any
/// sane embedding and a Fetch of a few keys could exceed message limits.
pub const MAX_DIM: u32 = 65_536;
