//! One embedding table on this server: its configuration, and for every
//! hosted shard its rows (values and optimizer state) and its Push
//! deduplication.

mod init;
mod optimizer;
pub mod rows;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub use init::{Initializer, row_base};
pub use optimizer::OptimizerConfig;
pub use rows::{
    Eviction, EvictionPolicy, MAX_SHARD_ROWS, RowBytes, RowLayout, RowRef, RowsSnapshot, ShardRows,
    Storage, StripeFull,
};

use crate::config::{NonFinite, TableConfig};
use crate::image::{ShardImage, TableSnapshot};
use crate::store::ShardGuard;

/// Bytes of one f32 on the wire.
const F32: usize = tessera_proto::rows::F32_BYTES;
use crate::dedup::{Admission, DedupLimits, PushDedup};

/// The state of one (table, shard).
#[derive(Debug)]
pub struct ShardState {
    /// The rows.
    pub rows: ShardRows,
    /// Which Pushes were applied.
    pub dedup: PushDedup,
    /// Fetch requests served.
    pub fetches: AtomicU64,
    /// Pushes applied (duplicates not counted).
    pub pushes: AtomicU64,
}

impl ShardState {
    fn new(config: &TableConfig, dedup: DedupLimits) -> Self {
        Self {
            rows: ShardRows::new(row_layout(config), config.max_rows, config.eviction),
            dedup: PushDedup::new(dedup),
            fetches: AtomicU64::new(0),
            pushes: AtomicU64::new(0),
        }
    }
}

/// One table's rows on this server.
#[derive(Debug)]
pub struct Table {
    config: TableConfig,
    init_base: u64,
    shards: HashMap<u32, ShardState>,
}

/// Why a Push's gradients were refused (the store adds the table name).
#[derive(Debug, Clone, PartialEq)]
pub enum GradientError {
    /// A NaN or infinite value at this index, with `non_finite = "reject"`.
    NonFinite(usize),
}

/// How a Push makes room in a table with a row limit.
enum Evicting<'a> {
    /// As the primary: choose victims, and record them.
    Choose(&'a mut Vec<Eviction>),
    /// As a replica: the primary's victims, in order, never one's own.
    Follow(&'a [Eviction]),
}

/// Where the parts of a row of a `config` table lie: `steps` kept for
/// Adam's bias correction and for LFU eviction, where they are used.
pub fn row_layout(config: &TableConfig) -> RowLayout {
    let dim = config.dim as usize;
    RowLayout::new(
        dim,
        config.optimizer.slots() * dim,
        config.storage,
        config.optimizer.uses_steps()
            || (config.max_rows.is_some() && config.eviction == EvictionPolicy::Lfu),
    )
}

/// Deduplication settings from the server's configuration.
pub fn dedup_limits(max_workers: u32, idle_secs: u64) -> DedupLimits {
    DedupLimits {
        max_workers: max_workers.max(1) as usize,
        idle_expiry: Duration::from_secs(idle_secs),
    }
}

impl Table {
    /// An empty table for the `hosted` shards; `seed` is the server's.
    pub fn new(config: TableConfig, seed: u64, hosted: &[u32], dedup: DedupLimits) -> Self {
        let init_base = row_base(config.seed.unwrap_or(seed), &config.name);
        let shards = hosted
            .iter()
            .map(|&shard| (shard, ShardState::new(&config, dedup)))
            .collect();
        Self {
            config,
            init_base,
            shards,
        }
    }

    /// The table's configuration.
    pub fn config(&self) -> &TableConfig {
        &self.config
    }

    /// The state of a hosted shard.
    pub fn shard(&self, shard: u32) -> Option<&ShardState> {
        self.shards.get(&shard)
    }

    /// The hosted shards' states.
    pub fn shards(&self) -> impl Iterator<Item = (u32, &ShardState)> {
        self.shards.iter().map(|(&id, state)| (id, state))
    }

    /// Rows stored, over all hosted shards.
    pub fn rows(&self) -> u64 {
        self.shards.values().map(|s| s.rows.len() as u64).sum()
    }

    /// What the rows take in memory, over all hosted shards.
    pub fn bytes(&self) -> RowBytes {
        self.shards
            .values()
            .map(|s| s.rows.bytes())
            .fold(RowBytes::default(), |a, b| a + b)
    }

    /// Publishes every hosted shard's row count and memory as gauges:
    /// `tessera_ps_store_rows` and `tessera_ps_store_bytes` by `part`
    /// (`records`, `index`, `free`, `overhead`, `snapshots`), labelled
    /// with the table and the shard.
    pub fn publish_gauges(&self) {
        for (&shard, state) in &self.shards {
            let b = state.rows.bytes();
            let (table, shard) = (self.config.name.clone(), shard.to_string());
            metrics::gauge!("tessera_ps_store_rows", "table" => table.clone(), "shard" => shard.clone())
                .set(b.rows as f64);
            for (part, bytes) in [
                ("records", b.row_bytes),
                ("index", b.index_bytes),
                ("free", b.free_bytes),
                ("overhead", b.overhead_bytes),
                ("snapshots", b.cut_bytes),
            ] {
                metrics::gauge!("tessera_ps_store_bytes", "table" => table.clone(), "shard" => shard.clone(), "part" => part)
                    .set(bytes as f64);
            }
        }
    }

    /// Rows evicted, over all hosted shards.
    pub fn evictions(&self) -> u64 {
        self.shards.values().map(|s| s.rows.evictions()).sum()
    }

    /// The initial values of `key`'s row as stored: a pure function of
    /// (seed, table name, key), so replicas agree.
    pub fn initial_row(&self, key: u64) -> Box<[f32]> {
        let mut values = self
            .config
            .initializer
            .row(self.init_base, key, self.config.dim as usize);
        for (i, v) in values.iter_mut().enumerate() {
            *v = self.config.storage.round(key, i, *v);
        }
        values
    }

    /// Writes a new row of `key`: initial values and fresh optimizer
    /// state.
    pub fn init_row(&self, key: u64, values: &mut [f32], state: &mut [f32]) {
        self.config.initializer.fill(self.init_base, key, values);
        self.config.optimizer.fill_initial_state(state);
    }

    /// Checks little-endian f32 gradients against the table's non-finite
    /// policy without copying them: with `reject`, the index of the first
    /// NaN or infinity is an error (counted). With `clip`, anything goes;
    /// [`Table::apply`] clips as it reads.
    pub fn check_gradients(&self, raw: &[u8]) -> Result<(), GradientError> {
        if self.config.non_finite == NonFinite::Reject
            && let Some(i) = raw
                .chunks_exact(F32)
                .position(|c| !f32::from_le_bytes([c[0], c[1], c[2], c[3]]).is_finite())
        {
            metrics::counter!("tessera_ps_non_finite_gradients_total", "table" => self.config.name.clone(), "action" => "rejected").increment(1);
            return Err(GradientError::NonFinite(i));
        }
        Ok(())
    }

    /// Decodes one row's gradients into `out`, clipping with `clip`;
    /// returns how many values were changed.
    fn decode_row(&self, raw: &[u8], out: &mut [f32]) -> u64 {
        let mut clipped = 0;
        for (g, c) in out.iter_mut().zip(raw.chunks_exact(F32)) {
            *g = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            if self.config.non_finite == NonFinite::Clip {
                let limit = self.config.gradient_clip;
                let fixed = if g.is_nan() {
                    0.0
                } else {
                    g.clamp(-limit, limit)
                };
                if fixed.to_bits() != g.to_bits() {
                    clipped += 1;
                    *g = fixed;
                }
            }
        }
        clipped
    }

    /// Applies `gradients` (little-endian f32, `keys.len() * dim`, already
    /// checked with [`Table::check_gradients`]) to the rows of `keys` in
    /// `state`, unless (`worker`, `sequence`) was applied before. The caller
    /// holds the shard's write lock (`_writing`). Rows are decoded one at a
    /// time into a row-sized scratch buffer: the payload itself is never
    /// copied. Returns the admission decision and the rows evicted to make
    /// room (which the replicas replay).
    #[allow(clippy::too_many_arguments)]
    pub fn apply(
        &self,
        _writing: &ShardGuard<'_>,
        state: &ShardState,
        keys: &[u64],
        gradients: &[u8],
        worker: u64,
        sequence: u64,
        now: Instant,
    ) -> (Admission, Vec<Eviction>) {
        let admission = state.dedup.admit(worker, sequence, now);
        if admission != Admission::Apply {
            return (admission, Vec::new());
        }
        let mut evicted = Vec::new();
        self.apply_rows(
            state,
            keys,
            gradients,
            (worker, sequence),
            Evicting::Choose(&mut evicted),
        );
        (admission, evicted)
    }

    /// Applies a Push the shard's primary applied (a replica following its
    /// stream): records its id without deciding anything (see
    /// [`PushDedup::record`]), always applies it, and evicts exactly the
    /// rows the primary evicted, at the same points (`evictions`, in
    /// order, each `before` an index into `keys`). False when a row to
    /// evict was missing: this copy is not the primary's. The caller holds
    /// the shard's write lock.
    #[allow(clippy::too_many_arguments)]
    pub fn apply_replicated(
        &self,
        _writing: &ShardGuard<'_>,
        state: &ShardState,
        keys: &[u64],
        gradients: &[u8],
        worker: u64,
        sequence: u64,
        evictions: &[Eviction],
        now: Instant,
    ) -> bool {
        state.dedup.record(worker, sequence, now);
        self.apply_rows(
            state,
            keys,
            gradients,
            (worker, sequence),
            Evicting::Follow(evictions),
        )
    }

    /// Applies the rows; false when a victim to evict (following) was not
    /// there.
    fn apply_rows(
        &self,
        state: &ShardState,
        keys: &[u64],
        gradients: &[u8],
        (worker, sequence): (u64, u64),
        mut evicting: Evicting<'_>,
    ) -> bool {
        let mut followed = true;
        state.pushes.fetch_add(1, Ordering::Relaxed);
        let dim = self.config.dim as usize;
        let optimizer = self.config.optimizer;
        let mut grad = vec![0f32; dim];
        let mut clipped = 0;
        let mut refused = 0u64;
        // Narrow values round with draws seeded by the Push (see
        // `rows::layout`): the replicas apply it with the same identity.
        let seed = tessera_proto::sharding::splitmix64(worker ^ sequence.rotate_left(32));
        let evictions_to_follow = matches!(&evicting, Evicting::Follow(e) if !e.is_empty());
        if !state.rows.limited() && !evictions_to_follow {
            // Nothing to evict: every stripe locked once for its rows. As
            // the row-by-row path (a zip), rows past the gradients' whole
            // rows are not applied; row `i` is then in range.
            let row = dim * F32;
            let keys = &keys[..keys.len().min(gradients.len() / row.max(1))];
            refused = state.rows.upsert_many(
                keys,
                seed,
                |i, values, st| self.init_row(keys[i], values, st),
                |i, values, st, steps| {
                    clipped += self.decode_row(&gradients[i * row..(i + 1) * row], &mut grad);
                    optimizer.apply(values, st, steps, &grad)
                },
            ) as u64;
        } else {
            for (index, (&key, raw)) in keys
                .iter()
                .zip(gradients.chunks_exact(dim * F32))
                .enumerate()
            {
                clipped += self.decode_row(raw, &mut grad);
                match &mut evicting {
                    Evicting::Choose(evicted) => {
                        let Ok(((), victim)) = state.rows.upsert_evicting(
                            key,
                            seed,
                            |values, st| self.init_row(key, values, st),
                            |values, st, steps| optimizer.apply(values, st, steps, &grad),
                        ) else {
                            refused += 1;
                            continue;
                        };
                        if let Some(victim) = victim {
                            evicted.push(Eviction {
                                before: u32::try_from(index).unwrap_or(u32::MAX),
                                key: victim,
                            });
                        }
                    }
                    Evicting::Follow(evictions) => {
                        while let Some((first, rest)) = evictions.split_first()
                            && first.before as usize <= index
                        {
                            followed &= state.rows.evict(first.key);
                            *evictions = rest;
                        }
                        if state
                            .rows
                            .upsert_following(
                                key,
                                seed,
                                |values, st| self.init_row(key, values, st),
                                |values, st, steps| optimizer.apply(values, st, steps, &grad),
                            )
                            .is_err()
                        {
                            refused += 1;
                        }
                    }
                }
            }
        }
        if clipped > 0 {
            metrics::counter!("tessera_ps_non_finite_gradients_total", "table" => self.config.name.clone(), "action" => "clipped").increment(clipped);
        }
        if refused > 0 {
            // Checked before the Push ([`ShardRows::has_room`]); only Fetches
            // inserting rows meanwhile can fill a stripe this far.
            metrics::counter!("tessera_ps_rows_refused_total", "table" => self.config.name.clone())
                .increment(refused);
            tracing::warn!(table = %self.config.name, refused, "rows of a Push not stored: a stripe of the shard is full");
        }
        followed
    }

    /// `shard`'s rows and deduplication windows as they are now, shared
    /// with the live rows (see [`rows::slab`]); the caller holds the shard's
    /// write lock (`_writing`), so the snapshot holds whole Pushes only.
    /// Empty if the shard is not hosted.
    pub fn snapshot(&self, _writing: &ShardGuard<'_>, shard: u32) -> TableSnapshot {
        match self.shards.get(&shard) {
            Some(state) => TableSnapshot {
                rows: state.rows.snapshot(),
                dedup: state.dedup.snapshot(),
            },
            None => TableSnapshot {
                rows: RowsSnapshot::empty(row_layout(&self.config)),
                dedup: Vec::new(),
            },
        }
    }

    /// Adds a checkpoint's image to `shard`'s rows and deduplication
    /// windows (rows beyond `max_rows` are evicted as usual). Existing rows
    /// stay unless the image has them; see [`Table::replace`] to drop them
    /// first. The caller holds the shard's write lock.
    pub fn install(&self, _writing: &ShardGuard<'_>, shard: u32, image: ShardImage, now: Instant) {
        let Some(state) = self.shards.get(&shard) else {
            return;
        };
        for saved in image.rows {
            if state
                .rows
                .insert(saved.key, saved.steps, &saved.values, &saved.state)
                .is_err()
            {
                tracing::warn!(table = %self.config.name, shard, "a stripe of the shard is full: rows of the image are left out");
                break;
            }
        }
        state.dedup.restore(&image.dedup, now);
    }

    /// A new, empty set of rows laid out as this table's (to stage a copy
    /// in before [`Table::swap_in`]).
    pub fn staging_rows(&self) -> ShardRows {
        ShardRows::new(
            row_layout(&self.config),
            self.config.max_rows,
            self.config.eviction,
        )
    }

    /// Makes `shard` hold exactly `rows` (staged from a copy) and `dedup`;
    /// `rows` gets the old rows, for the caller to drop after releasing the
    /// shard's write lock (`_writing`). Returns the rows installed.
    pub fn swap_in(
        &self,
        _writing: &ShardGuard<'_>,
        shard: u32,
        rows: &ShardRows,
        dedup: &[crate::dedup::WorkerWindow],
        now: Instant,
    ) -> usize {
        let Some(state) = self.shards.get(&shard) else {
            return 0;
        };
        state.rows.swap_rows(rows);
        state.dedup.clear();
        state.dedup.restore(dedup, now);
        state.rows.len()
    }

    /// Makes `shard` hold exactly `image` (a copy from another server).
    pub fn replace(&self, writing: &ShardGuard<'_>, shard: u32, image: ShardImage, now: Instant) {
        if let Some(state) = self.shards.get(&shard) {
            state.rows.clear();
            state.dedup.clear();
        }
        self.install(writing, shard, image, now);
    }
}
