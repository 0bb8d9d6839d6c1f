//! One embedding table on this server: its configuration, and for every
//! hosted shard its rows (values and optimizer state) and its Push
//! deduplication.

mod admission;
pub mod changes;
pub mod config;
pub mod expiry;
mod init;
mod optimizer;

use std::collections::HashMap;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tessera_sync::LockExt;

pub use crate::rows::{
    Eviction, EvictionPolicy, MAX_SHARD_ROWS, RowBytes, RowLayout, RowRef, RowsSnapshot, ShardRows,
    Storage, StripeFull,
};
pub use admission::{AdmissionConfig, FeatureAdmission, SKETCH_DEPTH};
pub use expiry::{ExpiryConfig, Refresh};
pub use init::{Initializer, row_base};
pub use optimizer::OptimizerConfig;

use self::config::{NonFinite, TableConfig};
use crate::image::{ShardImage, TableSnapshot};
use crate::shard_lock::ShardGuard;

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
    /// Feature admission, if the table has it (used under the shard's
    /// write lock, with the Pushes).
    pub admission: Option<std::sync::Mutex<FeatureAdmission>>,
    /// Where the expiry sweep goes on (a table with expiry).
    pub sweep: std::sync::Mutex<expiry::SweepCursor>,
    /// The keys changed since the delta stream last took them (a
    /// training server with `[delta]`; `table/changes.rs`).
    pub changes: Option<changes::Changes>,
}

impl ShardState {
    fn new(config: &TableConfig, dedup: DedupLimits) -> Self {
        Self {
            rows: new_rows(config),
            dedup: PushDedup::new(dedup),
            fetches: AtomicU64::new(0),
            pushes: AtomicU64::new(0),
            admission: config
                .admission
                .map(|c| std::sync::Mutex::new(FeatureAdmission::new(c))),
            sweep: std::sync::Mutex::new(expiry::SweepCursor::default()),
            changes: None,
        }
    }

    /// Notes, for the delta stream, that the rows of `keys` changed (a
    /// no-op without one).
    pub fn note_changed(&self, keys: impl IntoIterator<Item = u64>) {
        if let Some(changes) = &self.changes {
            changes.record(keys, changes::unix_ms());
        }
    }

    /// Candidate Pushes counted by admission, rows it admitted, and the
    /// bytes its sketch takes (zeros without admission).
    pub fn admission_counts(&self) -> (u64, u64, u64) {
        match &self.admission {
            None => (0, 0, 0),
            Some(admission) => {
                let a = admission.locked();
                let (candidates, admitted) = a.counts();
                (candidates, admitted, a.bytes() as u64)
            }
        }
    }
}

/// What applying a Push decided, for its replicas: the rows evicted to
/// make room, and the keys admission left without a row.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Applied {
    /// Rows evicted (a table with `max_rows`), in order.
    pub evicted: Vec<Eviction>,
    /// Indices into the Push's keys of the rows not created (admission),
    /// ascending.
    pub not_admitted: Vec<u32>,
    /// The stamp its rows got (a table with expiry; 0 otherwise).
    pub stamp: u32,
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

/// How a Push admits new ids (a table with admission).
enum Admitting<'a> {
    /// As the primary: decide, and list the keys left out.
    Choose(&'a mut Vec<u32>),
    /// As a replica: the primary's list, never a decision of one's own.
    Follow(&'a [u32]),
}

/// How a Push makes room in a table with a row limit.
enum Evicting<'a> {
    /// As the primary: choose victims, and record them.
    Choose(&'a mut Vec<Eviction>),
    /// As a replica: the primary's victims, in order, never one's own.
    Follow(&'a [Eviction]),
}

/// Where the parts of a row of a `config` table lie: `steps` kept for
/// Adam's bias correction and for LFU eviction, where they are used; a
/// stamp for expiry.
pub fn row_layout(config: &TableConfig) -> RowLayout {
    let dim = config.dim as usize;
    let layout = RowLayout::new(
        dim,
        config.optimizer.slots() * dim,
        config.storage,
        config.optimizer.uses_steps()
            || (config.max_rows.is_some() && config.eviction == EvictionPolicy::Lfu),
    );
    match config.expiry {
        Some(_) => layout.with_stamp(),
        None => layout,
    }
}

/// Empty rows for a `config` table.
fn new_rows(config: &TableConfig) -> ShardRows {
    let rows = ShardRows::new(row_layout(config), config.max_rows, config.eviction);
    match config.expiry {
        Some(e) if e.refresh == Refresh::Access => rows.marking_access(),
        _ => rows,
    }
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

    /// Keeps the keys each hosted shard changes for the delta stream
    /// (`table/changes.rs`), waking `wake` when a shard's set reaches
    /// `wake_at` keys.
    pub fn track_changes(
        &mut self,
        wake_at: usize,
        wake: &std::sync::Arc<crate::wake::Wake>,
        on: &std::sync::Arc<std::sync::atomic::AtomicBool>,
    ) {
        for state in self.shards.values_mut() {
            state.changes = Some(changes::Changes::new(
                wake_at,
                std::sync::Arc::clone(wake),
                std::sync::Arc::clone(on),
            ));
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
    /// with the table and the shard; with admission, its candidates, rows
    /// admitted and sketch bytes (`tessera_ps_admission_candidates`,
    /// `_admitted`, `_bytes`).
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
            if state.admission.is_some() {
                let (candidates, admitted, bytes) = state.admission_counts();
                metrics::gauge!("tessera_ps_admission_candidates", "table" => table.clone(), "shard" => shard.clone())
                    .set(candidates as f64);
                metrics::gauge!("tessera_ps_admission_admitted", "table" => table.clone(), "shard" => shard.clone())
                    .set(admitted as f64);
                metrics::gauge!("tessera_ps_admission_bytes", "table" => table.clone(), "shard" => shard.clone())
                    .set(bytes as f64);
            }
        }
    }

    /// Rows expired, over all hosted shards.
    pub fn expired(&self) -> u64 {
        self.shards.values().map(|s| s.rows.expired()).sum()
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
    /// copied. Returns the deduplication decision and what the replicas
    /// replay: the rows evicted to make room, the keys admission left
    /// without a row.
    /// With expiry, the rows are stamped at `secs` (the primary's wall
    /// clock) or with the table's next Push count (`table/expiry.rs`).
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
        secs: u64,
    ) -> (Admission, Applied) {
        let admission = state.dedup.admit(worker, sequence, now);
        if admission != Admission::Apply {
            return (admission, Applied::default());
        }
        let mut applied = Applied::default();
        if let Some(expiry) = &self.config.expiry {
            applied.stamp = expiry.bound().push_stamp(secs, state.rows.stamp_now());
            state.rows.set_stamp_now(applied.stamp);
        }
        self.apply_rows(
            state,
            keys,
            gradients,
            (worker, sequence),
            Evicting::Choose(&mut applied.evicted),
            Admitting::Choose(&mut applied.not_admitted),
        );
        (admission, applied)
    }

    /// Applies a Push the shard's primary applied (a replica following its
    /// stream): records its id without deciding anything (see
    /// [`PushDedup::record`]), always applies it, evicts exactly the rows
    /// the primary evicted, at the same points (`evictions`, in order, each
    /// `before` an index into `keys`), and creates no row for the keys
    /// admission left out there (`not_admitted`, ascending indices). False
    /// when this copy is not the primary's: a row to evict was missing, or
    /// a key left out has a row here. The caller holds the shard's write
    /// lock. Rows are stamped `stamp`, as the primary stamped them.
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
        not_admitted: &[u32],
        now: Instant,
        stamp: u32,
    ) -> bool {
        state.dedup.record(worker, sequence, now);
        if self.config.expiry.is_some() {
            state.rows.set_stamp_now(stamp);
        }
        self.apply_rows(
            state,
            keys,
            gradients,
            (worker, sequence),
            Evicting::Follow(evictions),
            Admitting::Follow(not_admitted),
        )
    }

    /// One step of `state`'s expiry sweep at `secs` (the primary's wall
    /// clock; a table expiring after Pushes judges at its latest Push),
    /// visiting at most `max_slots` record
    /// slots: the keys of the rows it removed (none without expiry);
    /// `pass_done` says whether it finished a pass over the rows. The
    /// caller holds the shard's write lock, and sends the keys to the
    /// replicas ([`Table::remove_expired`]).
    pub fn expire_step(
        &self,
        _writing: &ShardGuard<'_>,
        state: &ShardState,
        secs: u64,
        max_slots: usize,
        pass_done: &mut bool,
    ) -> Vec<u64> {
        let Some(expiry) = &self.config.expiry else {
            return Vec::new();
        };
        let bound = expiry.bound();
        let now = bound.now(secs, state.rows.stamp_now());
        // Fetch marks from now on carry this time (seconds move between
        // Pushes; positions only with them).
        state.rows.note_stamp(now);
        let mut cursor = state.sweep.locked();
        let passes = cursor.passes;
        let removed = state.rows.sweep(&mut cursor, max_slots, now, bound);
        *pass_done = cursor.passes != passes;
        state.note_changed(removed.iter().copied());
        if !removed.is_empty() {
            metrics::counter!("tessera_ps_expired_rows_total", "table" => self.config.name.clone())
                .increment(removed.len() as u64);
        }
        removed
    }

    /// Removes the rows of `keys` as the primary's sweep did; false when
    /// one was not here (this copy is not the primary's). The caller
    /// holds the shard's write lock.
    pub fn remove_expired(
        &self,
        _writing: &ShardGuard<'_>,
        state: &ShardState,
        keys: &[u64],
    ) -> bool {
        let mut all = true;
        for &key in keys {
            all &= state.rows.remove_expired(key);
        }
        if !keys.is_empty() {
            metrics::counter!("tessera_ps_expired_rows_total", "table" => self.config.name.clone())
                .increment(keys.len() as u64);
        }
        all
    }

    /// Which of the first `n` keys of a Push get their rows applied, with
    /// admission (`table/admission.rs`): those with a row, and those
    /// admitted now (choosing, the rest listed in `not_admitted`; or
    /// following the primary's list). Keys already admitted by this Push
    /// count as having a row. Sets `followed` to false when a key the
    /// primary left out has a row here.
    fn admit(
        admission: &mut FeatureAdmission,
        state: &ShardState,
        keys: &[u64],
        n: usize,
        seed: u64,
        admitting: Admitting<'_>,
        followed: &mut bool,
    ) -> Vec<usize> {
        let mut kept = Vec::with_capacity(n);
        let mut admitted_now = std::collections::HashSet::new();
        match admitting {
            Admitting::Choose(left_out) => {
                for (i, &key) in keys.iter().enumerate().take(n) {
                    if admitted_now.contains(&key) || state.rows.contains(key) {
                        kept.push(i);
                    } else if admission.candidate(key, seed) {
                        admitted_now.insert(key);
                        kept.push(i);
                    } else {
                        left_out.push(u32::try_from(i).unwrap_or(u32::MAX));
                    }
                }
            }
            Admitting::Follow(left_out) => {
                let mut listed = left_out.iter().copied().peekable();
                for (i, &key) in keys.iter().enumerate().take(n) {
                    let out = listed.next_if(|&l| l as usize == i).is_some();
                    let known = admitted_now.contains(&key) || state.rows.contains(key);
                    if out {
                        *followed &= !known;
                        admission.follow(key, false);
                        continue;
                    }
                    if !known {
                        admission.follow(key, true);
                        admitted_now.insert(key);
                    }
                    kept.push(i);
                }
            }
        }
        kept
    }

    /// Applies the rows; false when a victim to evict (following) was not
    /// there, or a key admission left out (following) has a row here.
    fn apply_rows(
        &self,
        state: &ShardState,
        keys: &[u64],
        gradients: &[u8],
        (worker, sequence): (u64, u64),
        mut evicting: Evicting<'_>,
        admitting: Admitting<'_>,
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
        let row = dim * F32;
        // Rows past the gradients' whole rows are not applied.
        let n = keys.len().min(gradients.len() / row.max(1));
        // The keys applied, by their index in the Push: all of them, or
        // those admission lets through.
        let kept: Option<Vec<usize>> = state.admission.as_ref().map(|admission| {
            Self::admit(
                &mut admission.locked(),
                state,
                keys,
                n,
                seed,
                admitting,
                &mut followed,
            )
        });
        let index_of = |j: usize| kept.as_ref().map_or(j, |kept| kept[j]);
        let applied_keys: std::borrow::Cow<'_, [u64]> = match &kept {
            None => std::borrow::Cow::Borrowed(&keys[..n]),
            Some(kept) => kept.iter().map(|&i| keys[i]).collect(),
        };
        let evictions_to_follow = matches!(&evicting, Evicting::Follow(e) if !e.is_empty());
        if !state.rows.limited() && !evictions_to_follow {
            // Nothing to evict: every stripe locked once for its rows.
            let keys = &applied_keys[..];
            refused = state.rows.upsert_many(
                keys,
                seed,
                |j, values, st| self.init_row(keys[j], values, st),
                |j, values, st, steps| {
                    let i = index_of(j);
                    clipped += self.decode_row(&gradients[i * row..(i + 1) * row], &mut grad);
                    optimizer.apply(values, st, steps, &grad)
                },
            ) as u64;
        } else {
            for (j, &key) in applied_keys.iter().enumerate() {
                let index = index_of(j);
                let raw = &gradients[index * row..(index + 1) * row];
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
    /// with the live rows (see [`crate::rows::slab`]); the caller holds the shard's
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
    /// first. With expiry and a `cut` (the checkpoint's wall clock when
    /// saved), rows without a stamp (an older file) are stamped with it
    /// (counted in Pushes: the image's latest stamp), so every server
    /// loading the file stamps alike. Expired rows are installed too: a
    /// server leaving them out at load would hold other rows than a
    /// replica at the same version that did not restart; the primary's
    /// sweep removes them through the stream. The caller holds the
    /// shard's write lock.
    pub fn install(
        &self,
        _writing: &ShardGuard<'_>,
        shard: u32,
        image: ShardImage,
        now: Instant,
        cut: Option<u64>,
    ) {
        let Some(state) = self.shards.get(&shard) else {
            return;
        };
        let unstamped = self.config.expiry.zip(cut).map(|(e, secs)| {
            let latest = image
                .rows
                .iter()
                .map(|r| r.stamp)
                .filter(|&s| s != 0)
                .reduce(expiry::later);
            e.bound().now(secs, latest.unwrap_or(0))
        });
        for mut saved in image.rows {
            if let Some(at) = unstamped
                && saved.stamp == 0
            {
                saved.stamp = at;
            }
            if state
                .rows
                .insert(
                    saved.key,
                    saved.steps,
                    saved.stamp,
                    &saved.values,
                    &saved.state,
                )
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
        new_rows(&self.config)
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
        self.install(writing, shard, image, now, None);
    }
}
