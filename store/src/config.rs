//! The store's configuration: its tables ([`TableConfig`]), what it does
//! with rows it has never seen ([`Mode`]), and the shards it holds
//! ([`StoreConfig`]). A ps-server's file carries these keys at its top
//! level (`tables`, `mode`, `seed`, `num_shards`, `shards`, ...) and
//! derives a [`StoreConfig`] from them, so the key a validation error
//! names is the key of that file.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};
use tessera_config::{ConfigError, Validate, invalid};

pub use crate::table::config::{MAX_DIM, NonFinite, TableConfig};
pub use crate::table::{
    AdmissionConfig, EvictionPolicy, ExpiryConfig, Initializer, OptimizerConfig, Storage,
};

/// How a server fills rows it has never seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Missing rows are initialised deterministically from `seed` and
    /// stored; Push is accepted.
    #[default]
    Training,
    /// Missing rows read as zeros and are not stored; Push is refused.
    Inference,
    /// As `inference`, and the rows come from a training fleet's delta
    /// stream (ps-server's `delta`): every server stands alone (no peers, no
    /// coordinator), fed by the training primaries directly.
    Serving,
}

impl Mode {
    /// Whether Pushes are refused and missing rows read as zeros.
    pub fn read_only(self) -> bool {
        matches!(self, Mode::Inference | Mode::Serving)
    }
}

/// Whether the store keeps the keys each shard's writes changed, for a
/// stream that sends them (`table/changes.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeepChanges {
    /// Never: nothing streams this store's changes. The default: a store
    /// that streams nothing pays nothing per write.
    #[default]
    Never,
    /// Only while [`crate::Store::track_changes_for_resize`] is on (a
    /// training server in etcd mode, which may give keys to a resize).
    ForResizes,
    /// Always (a training server with a delta stream to a serving fleet).
    Always,
}

/// Configuration of one [`crate::Store`]: the tables, the shards held and
/// the bounds on one request. A ps-server builds it from its own file
/// (`StoreConfig::store`); a program that embeds the store builds it
/// directly.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StoreConfig {
    /// `training`, `inference` or `serving`. Default `training`: the
    /// mode in which rows are created and Pushes applied.
    pub mode: Mode,
    /// Seed of the deterministic row initialiser. Every copy of a shard
    /// must use the same seed so that they initialise rows identically.
    /// Default 42.
    pub seed: u64,
    /// Total number of shards of the model; keys are routed among them by
    /// `tessera_proto::sharding::shard_for_key`. Default 1.
    pub num_shards: u32,
    /// Shards this store holds. Default `[0]`.
    pub shards: Vec<u32>,
    /// The tables. Default one table `embeddings` of dimension 16.
    pub tables: Vec<TableConfig>,
    /// Keys one Fetch or Push may carry. Default 1,000,000: a ranker
    /// request of a few thousand features fits with room to spare, while
    /// a runaway client cannot make one request hold the store for
    /// seconds.
    pub max_keys_per_request: u32,
    /// Largest message an answer must fit in, in bytes: a Fetch whose rows
    /// would not fit is refused. Default 64 MiB, the transport's.
    pub max_message_size: u64,
    /// Workers whose Push sequences each shard remembers (exactly-once
    /// Push). Default 100,000: far more trainers than one job runs.
    pub dedup_max_workers: u32,
    /// A worker silent this long is forgotten by the Push deduplication,
    /// in seconds. Default 3600: longer than any retry of a Push could
    /// come.
    pub dedup_idle_secs: u64,
    /// Whether the keys changed by writes are kept for a stream (a
    /// training store's only: the others write nothing of their own).
    /// Default `never`.
    pub keep_changes: KeepChanges,
    /// Changed keys of one shard at which the stream is woken early
    /// ([`crate::Store::changes_wake`]; 0 is taken as 1). Default 100,000,
    /// a delta stream's `max_rows`.
    pub changes_wake_rows: u64,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            mode: Mode::Training,
            seed: 42,
            num_shards: 1,
            shards: vec![0],
            tables: vec![TableConfig::new("embeddings", 16)],
            max_keys_per_request: 1_000_000,
            max_message_size: 64 << 20,
            dedup_max_workers: 100_000,
            dedup_idle_secs: 3600,
            keep_changes: KeepChanges::Never,
            changes_wake_rows: 100_000,
        }
    }
}

impl Validate for StoreConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.num_shards == 0 {
            return Err(invalid("num_shards", "must be at least 1"));
        }
        if self.shards.is_empty() {
            return Err(invalid("shards", "a server must host at least one shard"));
        }
        let mut seen = HashSet::new();
        for (i, &shard) in self.shards.iter().enumerate() {
            if shard >= self.num_shards {
                return Err(invalid(
                    format!("shards[{i}]"),
                    format!(
                        "shard {shard} does not exist (num_shards = {})",
                        self.num_shards
                    ),
                ));
            }
            if !seen.insert(shard) {
                return Err(invalid(
                    format!("shards[{i}]"),
                    format!("shard {shard} is listed twice"),
                ));
            }
        }
        if self.tables.is_empty() {
            return Err(invalid("tables", "at least one table is required"));
        }
        let mut names = HashSet::new();
        for (i, table) in self.tables.iter().enumerate() {
            table.validate(i)?;
            if !names.insert(table.name.as_str()) {
                return Err(invalid(
                    format!("tables[{i}].name"),
                    format!("table `{}` is declared twice", table.name),
                ));
            }
        }
        if self.max_keys_per_request == 0 {
            return Err(invalid("max_keys_per_request", "must be at least 1"));
        }
        if self.dedup_max_workers == 0 {
            return Err(invalid("dedup_max_workers", "must be at least 1"));
        }
        Ok(())
    }
}
