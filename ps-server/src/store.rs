//! The rows a server holds: one concurrent map per (table, hosted shard).
//!
//! `dashmap` shards each map internally by key, so Fetches and Pushes on
//! one shard proceed in parallel and only contend when they touch the same
//! internal segment; this is the well-kept crate the project chose for
//! concurrent maps rather than a hand-written striped lock.

use std::collections::HashMap;

use dashmap::DashMap;
use tessera_proto::rows::{F32_BYTES, write_f32s};
use tessera_proto::sharding::{shard_for_key, splitmix64};

use crate::config::{Mode, PsServerConfig, TableConfig};

/// Why a Fetch or Push was refused. Nothing is applied when one is returned.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// No table of that name.
    #[error("no table named `{0}`")]
    UnknownTable(String),
    /// The request names a shard this server does not host.
    #[error("shard {shard} is not hosted here (hosted: {hosted:?})")]
    ShardNotHosted {
        /// The shard requested.
        shard: u32,
        /// The shards this server hosts.
        hosted: Vec<u32>,
    },
    /// A key does not belong to the shard named in the request.
    #[error("key {key} belongs to shard {actual}, not to shard {shard}")]
    WrongShard {
        /// The key.
        key: u64,
        /// The shard named in the request.
        shard: u32,
        /// The shard the key maps to.
        actual: u32,
    },
    /// The gradients do not hold `keys * dim` values.
    #[error("expected {expected} gradient bytes ({keys} keys x dim {dim} x 4), got {got}")]
    GradientLength {
        /// Number of keys.
        keys: usize,
        /// The table's dimension.
        dim: u32,
        /// Bytes expected.
        expected: usize,
        /// Bytes received.
        got: usize,
    },
    /// The output buffer of a fetch has the wrong size (a caller bug).
    #[error("fetch output holds {got} bytes, {expected} needed")]
    OutputLength {
        /// Bytes needed.
        expected: usize,
        /// Bytes given.
        got: usize,
    },
    /// Pushes are refused in inference mode.
    #[error("this server is in inference mode and does not accept pushes")]
    InferenceMode,
}

/// The rows of one (table, shard): key -> row of `dim` values.
type ShardRows = DashMap<u64, Box<[f32]>>;

/// One embedding table's rows on this server.
#[derive(Debug)]
pub struct Table {
    config: TableConfig,
    init_base: u64,
    shards: HashMap<u32, ShardRows>,
}

impl Table {
    fn new(config: TableConfig, seed: u64, hosted: &[u32]) -> Self {
        let name_hash = config.name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
        Self {
            init_base: splitmix64(seed ^ name_hash),
            shards: hosted.iter().map(|&s| (s, DashMap::new())).collect(),
            config,
        }
    }

    /// The table's configuration.
    pub fn config(&self) -> &TableConfig {
        &self.config
    }

    /// Rows stored, over all hosted shards.
    pub fn rows(&self) -> u64 {
        self.shards.values().map(|m| m.len() as u64).sum()
    }

    /// The initial value of `key`'s row: uniform in `[-scale, scale)`, a pure
    /// function of (seed, table name, key), so replicas agree.
    pub fn initial_row(&self, key: u64) -> Box<[f32]> {
        let scale = self.config.init_scale;
        let base = self.init_base.wrapping_add(splitmix64(key));
        (0..u64::from(self.config.dim))
            .map(|j| {
                let bits = splitmix64(base.wrapping_add(j)) >> 40; // 24 random bits
                let unit = bits as f32 / (1u32 << 24) as f32; // [0, 1)
                scale * (2.0 * unit - 1.0)
            })
            .collect()
    }
}

/// All tables of one server.
#[derive(Debug)]
pub struct Store {
    mode: Mode,
    num_shards: u32,
    hosted: Vec<u32>,
    tables: HashMap<String, Table>,
}

impl Store {
    /// An empty store for `config`'s tables and shards.
    pub fn new(config: &PsServerConfig) -> Self {
        let mut hosted = config.shards.clone();
        hosted.sort_unstable();
        Self {
            mode: config.mode,
            num_shards: config.num_shards,
            tables: config
                .tables
                .iter()
                .map(|t| (t.name.clone(), Table::new(t.clone(), config.seed, &hosted)))
                .collect(),
            hosted,
        }
    }

    /// Training or inference.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Total shards of the model.
    pub fn num_shards(&self) -> u32 {
        self.num_shards
    }

    /// Hosted shards, sorted.
    pub fn hosted(&self) -> &[u32] {
        &self.hosted
    }

    /// The tables, in no particular order.
    pub fn tables(&self) -> impl Iterator<Item = &Table> {
        self.tables.values()
    }

    fn shard_map(
        &self,
        table: &str,
        shard: u32,
        keys: &[u64],
    ) -> Result<(&Table, &ShardRows), StoreError> {
        let table_ref = self
            .tables
            .get(table)
            .ok_or_else(|| StoreError::UnknownTable(table.to_owned()))?;
        let map = table_ref
            .shards
            .get(&shard)
            .ok_or_else(|| StoreError::ShardNotHosted {
                shard,
                hosted: self.hosted.clone(),
            })?;
        // A misrouted key would be stored on the wrong shard and silently
        // diverge from its real row: refuse the whole request instead.
        for &key in keys {
            let actual = shard_for_key(key, self.num_shards);
            if actual != shard {
                return Err(StoreError::WrongShard { key, shard, actual });
            }
        }
        Ok((table_ref, map))
    }

    /// Bytes of one row of `table` on the wire.
    pub fn row_bytes(&self, table: &str) -> Result<usize, StoreError> {
        self.tables
            .get(table)
            .map(|t| t.config.dim as usize * F32_BYTES)
            .ok_or_else(|| StoreError::UnknownTable(table.to_owned()))
    }

    /// Writes the rows of `keys`, in order, as little-endian f32 into `out`
    /// (exactly `keys.len() * row_bytes(table)` bytes: the caller allocates
    /// it, in the send pool, so the response goes out from there without a
    /// copy). Returns the dimension.
    pub fn fetch_into(
        &self,
        table: &str,
        shard: u32,
        keys: &[u64],
        out: &mut [u8],
    ) -> Result<u32, StoreError> {
        let (table, map) = self.shard_map(table, shard, keys)?;
        let dim = table.config.dim;
        let row_bytes = dim as usize * F32_BYTES;
        if out.len() != keys.len() * row_bytes {
            return Err(StoreError::OutputLength {
                expected: keys.len() * row_bytes,
                got: out.len(),
            });
        }
        for (&key, slot) in keys.iter().zip(out.chunks_exact_mut(row_bytes)) {
            // The read guard is dropped before the entry below takes the
            // segment's write lock.
            let found = map.get(&key).map(|row| write_f32s(slot, &row)).is_some();
            if found {
                continue;
            }
            match self.mode {
                Mode::Training => {
                    let row = map.entry(key).or_insert_with(|| table.initial_row(key));
                    write_f32s(slot, &row);
                }
                Mode::Inference => slot.fill(0),
            }
        }
        metrics::counter!("tessera_ps_fetch_keys_total").increment(keys.len() as u64);
        Ok(dim)
    }

    /// The rows of `keys`, in order, as little-endian f32 in a new vector,
    /// and the dimension (for tests and tools; the server uses
    /// [`Store::fetch_into`]).
    pub fn fetch(
        &self,
        table: &str,
        shard: u32,
        keys: &[u64],
    ) -> Result<(u32, Vec<u8>), StoreError> {
        let mut out = vec![0u8; keys.len() * self.row_bytes(table)?];
        let dim = self.fetch_into(table, shard, keys, &mut out)?;
        Ok((dim, out))
    }

    /// Applies SGD (`w -= learning_rate * g`) to the rows of `keys` with the
    /// gradients in `gradients` (little-endian f32, `keys.len() * dim`).
    /// Validates everything before changing any row. Returns the number of
    /// rows updated (duplicate keys are applied once per occurrence).
    pub fn push(
        &self,
        table: &str,
        shard: u32,
        keys: &[u64],
        gradients: &[u8],
    ) -> Result<usize, StoreError> {
        if self.mode == Mode::Inference {
            return Err(StoreError::InferenceMode);
        }
        let (table, map) = self.shard_map(table, shard, keys)?;
        let dim = table.config.dim;
        let row_bytes = dim as usize * F32_BYTES;
        let expected = keys.len() * row_bytes;
        if gradients.len() != expected {
            return Err(StoreError::GradientLength {
                keys: keys.len(),
                dim,
                expected,
                got: gradients.len(),
            });
        }
        let lr = table.config.learning_rate;
        for (&key, grad) in keys.iter().zip(gradients.chunks_exact(row_bytes)) {
            let mut row = map.entry(key).or_insert_with(|| table.initial_row(key));
            for (w, g) in row.iter_mut().zip(grad.chunks_exact(F32_BYTES)) {
                *w -= lr * f32::from_le_bytes([g[0], g[1], g[2], g[3]]);
            }
        }
        metrics::counter!("tessera_ps_push_keys_total").increment(keys.len() as u64);
        Ok(keys.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_proto::rows::{get_f32s, put_f32s};

    fn config(mode: Mode) -> PsServerConfig {
        PsServerConfig {
            mode,
            num_shards: 2,
            shards: vec![0, 1],
            tables: vec![TableConfig {
                name: "t".into(),
                dim: 3,
                learning_rate: 0.5,
                init_scale: 0.1,
            }],
            ..PsServerConfig::default()
        }
    }

    fn keys_of_shard(shard: u32, n: usize) -> Vec<u64> {
        (0..)
            .filter(|&k| shard_for_key(k, 2) == shard)
            .take(n)
            .collect()
    }

    fn decode(bytes: &[u8]) -> Vec<f32> {
        let mut out = vec![0f32; bytes.len() / 4];
        assert!(get_f32s(bytes, &mut out));
        out
    }

    #[test]
    fn training_fetch_initialises_deterministically_and_stores() {
        let a = Store::new(&config(Mode::Training));
        let b = Store::new(&config(Mode::Training));
        let keys = keys_of_shard(1, 4);
        let (dim, rows_a) = a.fetch("t", 1, &keys).unwrap();
        let (_, rows_b) = b.fetch("t", 1, &keys).unwrap();
        assert_eq!(dim, 3);
        assert_eq!(rows_a, rows_b, "two replicas initialise identically");
        let values = decode(&rows_a);
        assert!(values.iter().all(|v| (-0.1..0.1).contains(v)), "{values:?}");
        assert!(values.iter().any(|v| *v != 0.0));
        assert_ne!(values[0..3], values[3..6], "rows differ by key");
        assert_eq!(a.tables().map(Table::rows).sum::<u64>(), 4);
        // A second fetch reads the stored rows.
        assert_eq!(a.fetch("t", 1, &keys).unwrap().1, rows_a);
    }

    #[test]
    fn other_seed_or_table_gives_other_rows() {
        let mut other = config(Mode::Training);
        other.seed = 7;
        let keys = keys_of_shard(0, 1);
        let a = Store::new(&config(Mode::Training))
            .fetch("t", 0, &keys)
            .unwrap()
            .1;
        let b = Store::new(&other).fetch("t", 0, &keys).unwrap().1;
        assert_ne!(a, b);
    }

    #[test]
    fn inference_fetch_returns_zeros_without_storing_and_refuses_push() {
        let store = Store::new(&config(Mode::Inference));
        let keys = keys_of_shard(0, 2);
        let (_, rows) = store.fetch("t", 0, &keys).unwrap();
        assert_eq!(decode(&rows), vec![0.0; 6]);
        assert_eq!(store.tables().map(Table::rows).sum::<u64>(), 0);
        assert_eq!(
            store.push("t", 0, &keys, &[0u8; 24]),
            Err(StoreError::InferenceMode)
        );
    }

    #[test]
    fn fetch_returns_rows_in_request_order_with_duplicates() {
        let store = Store::new(&config(Mode::Training));
        let keys = keys_of_shard(0, 2);
        let (_, single) = store.fetch("t", 0, &keys).unwrap();
        let (_, mixed) = store.fetch("t", 0, &[keys[1], keys[0], keys[1]]).unwrap();
        assert_eq!(mixed[0..12], single[12..24]);
        assert_eq!(mixed[12..24], single[0..12]);
        assert_eq!(mixed[24..36], single[12..24]);
    }

    #[test]
    fn sgd_numerics_match_hand_computation() {
        let store = Store::new(&config(Mode::Training));
        let key = keys_of_shard(0, 1)[0];
        let before = decode(&store.fetch("t", 0, &[key]).unwrap().1);
        let grads = [1.0f32, -2.0, 0.25];
        let mut wire = Vec::new();
        put_f32s(&mut wire, &grads);
        assert_eq!(store.push("t", 0, &[key], &wire).unwrap(), 1);
        let after = decode(&store.fetch("t", 0, &[key]).unwrap().1);
        // lr = 0.5: w' = w - 0.5 * g
        let expected = [before[0] - 0.5, before[1] + 1.0, before[2] - 0.125];
        assert_eq!(after, expected);
        // Pushing the same key twice in one request applies both.
        let mut twice = Vec::new();
        put_f32s(&mut twice, &[1.0, 1.0, 1.0, 1.0, 1.0, 1.0]);
        store.push("t", 0, &[key, key], &twice).unwrap();
        let again = decode(&store.fetch("t", 0, &[key]).unwrap().1);
        assert_eq!(
            again,
            [expected[0] - 1.0, expected[1] - 1.0, expected[2] - 1.0]
        );
    }

    #[test]
    fn push_to_a_missing_row_starts_from_its_initial_value() {
        let store = Store::new(&config(Mode::Training));
        let key = keys_of_shard(1, 1)[0];
        let init = store.tables().next().unwrap().initial_row(key);
        let mut wire = Vec::new();
        put_f32s(&mut wire, &[2.0, 2.0, 2.0]);
        store.push("t", 1, &[key], &wire).unwrap();
        let after = decode(&store.fetch("t", 1, &[key]).unwrap().1);
        assert_eq!(after, init.iter().map(|w| w - 1.0).collect::<Vec<_>>());
    }

    #[test]
    fn bad_requests_are_refused_and_change_nothing() {
        let store = Store::new(&config(Mode::Training));
        let good = keys_of_shard(0, 1)[0];
        let wrong = keys_of_shard(1, 1)[0];
        assert!(matches!(
            store.fetch("nope", 0, &[good]),
            Err(StoreError::UnknownTable(_))
        ));
        assert!(matches!(
            store.fetch("t", 5, &[good]),
            Err(StoreError::ShardNotHosted { shard: 5, .. })
        ));
        assert!(matches!(
            store.fetch("t", 0, &[good, wrong]),
            Err(StoreError::WrongShard { .. })
        ));
        assert!(matches!(
            store.push("t", 0, &[good], &[0u8; 8]),
            Err(StoreError::GradientLength {
                expected: 12,
                got: 8,
                ..
            })
        ));
        assert!(matches!(
            store.push("t", 0, &[good, wrong], &[0u8; 24]),
            Err(StoreError::WrongShard { .. })
        ));
        assert_eq!(
            store.tables().map(Table::rows).sum::<u64>(),
            0,
            "nothing stored"
        );
    }
}
