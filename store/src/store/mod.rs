//! The tables a server holds and the checks every Fetch and Push passes
//! before touching a row: the table exists, the shard is hosted, every key
//! belongs to it, the request is within the key limit, the gradients have
//! the right length and are finite (or clipped). Nothing of a refused
//! request is applied; an accepted Push is applied to every row it names.

mod delta;
mod error;
mod expire;
mod fetch;
mod lock;
mod push;
mod resize;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::time::Instant;

use tessera_proto::sharding::shard_for_key;

pub use self::delta::DeltaRows;
pub use self::error::{ErrorKind, StoreError};
pub use self::expire::Expired;
pub use self::fetch::CheckedFetch;
use self::fetch::RESPONSE_OVERHEAD;
pub use self::push::{CheckedPush, PushId, PushOutcome};
pub use self::resize::{OriginSet, TableWindows};
use crate::config::{KeepChanges, Mode, StoreConfig};
use crate::image::{ShardSnapshot, TableShape};
pub use crate::shard_lock::ShardGuard;
use crate::shard_lock::Writer;
pub use crate::table::Table;
use crate::table::{ShardState, dedup_limits};
use crate::wake::Wake;

/// All tables of one server.
///
/// Each hosted shard has one write lock for all its tables, held by
/// everything that changes its rows (a Push, a copy replacing the shard)
/// or must see whole Pushes only (a checkpoint, a copy for another
/// server). It guards the shard's [`crate::version::Version`]: whoever changes the rows
/// sets the version under the same lock, so a copy and its version always
/// agree. Fetches do not take it.
#[derive(Debug)]
pub struct Store {
    mode: Mode,
    /// The shard count keys are routed by: the configured one, or the
    /// target of a growth this server's shards gave keys to, once it is
    /// done ([`Store::adopt_num_shards`]).
    num_shards: std::sync::atomic::AtomicU32,
    /// The configured count (a giving shard's server of a growth is
    /// recognised by it after it took the new count; checkpoints record
    /// `num_shards`, the count the rows are routed by).
    configured_shards: u32,
    hosted: Vec<u32>,
    max_keys: u32,
    /// Most bytes the rows of one Fetch may take: `max_message_size` less
    /// room for the response's header and framing.
    max_response_bytes: usize,
    tables: HashMap<String, Table>,
    writers: HashMap<u32, Writer>,
    /// Woken when a shard's set of changed keys reaches `delta.max_rows`
    /// (a store that keeps changes for a stream: `table/changes.rs`).
    changes_wake: std::sync::Arc<Wake>,
    /// Whether changed keys are kept for a delta stream now: always with
    /// `[delta]`; while giving keys to a resize in etcd mode
    /// ([`Store::track_changes_for_resize`]).
    changes_on: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// `[delta]` on a training server: changes are always kept.
    delta_configured: bool,
    /// Moves on each time keeping changes is switched on or off: a
    /// stream cut under another generation starts anew (`delta/sender.rs`).
    changes_generation: std::sync::atomic::AtomicU64,
    /// What a resize of the cluster's shard count does to the shards
    /// (`resize.rs`).
    resize: resize::Resizing,
}

impl Store {
    /// An empty store for `config`'s tables and shards. The caller
    /// validates `config` first ([`tessera_config::Validate`]).
    pub fn new(config: &StoreConfig) -> Self {
        let mut hosted = config.shards.clone();
        hosted.sort_unstable();
        let limits = dedup_limits(config.dedup_max_workers, config.dedup_idle_secs);
        let changes_wake = std::sync::Arc::new(Wake::default());
        // Only a training store's own writes are changes to stream.
        let keep_changes = match config.mode {
            Mode::Training => config.keep_changes,
            Mode::Inference | Mode::Serving => KeepChanges::Never,
        };
        let delta_configured = keep_changes == KeepChanges::Always;
        // Sets exist where a stream may need them.
        let keeps_sets = keep_changes != KeepChanges::Never;
        let changes_on = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(delta_configured));
        let wake_at = usize::try_from(config.changes_wake_rows).unwrap_or(usize::MAX);
        Self {
            mode: config.mode,
            num_shards: std::sync::atomic::AtomicU32::new(config.num_shards),
            configured_shards: config.num_shards,
            max_keys: config.max_keys_per_request,
            max_response_bytes: usize::try_from(
                config.max_message_size.saturating_sub(RESPONSE_OVERHEAD),
            )
            .unwrap_or(usize::MAX),
            tables: config
                .tables
                .iter()
                .map(|t| {
                    let mut t = t.clone();
                    if config.mode == Mode::Serving {
                        // The training fleet decides which rows exist (its
                        // evictions, admission and expiry come through the
                        // stream): a serving shard, laid out by another
                        // shard count, must not choose victims of its own.
                        t.max_rows = None;
                        t.admission = None;
                        t.expiry = None;
                    }
                    let mut table = Table::new(t.clone(), config.seed, &hosted, limits);
                    if keeps_sets {
                        table.track_changes(wake_at, &changes_wake, &changes_on);
                    }
                    (t.name.clone(), table)
                })
                .collect(),
            writers: hosted.iter().map(|&s| (s, Writer::default())).collect(),
            hosted,
            changes_wake,
            changes_on,
            delta_configured,
            changes_generation: std::sync::atomic::AtomicU64::new(0),
            resize: resize::Resizing::new(&config.shards),
        }
    }

    /// How many times keeping changes was switched
    /// ([`Store::track_changes_for_resize`]): a delta stream holds every
    /// change only within one generation.
    pub fn changes_generation(&self) -> u64 {
        self.changes_generation
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Moves the generation of change keeping on: the next cut of every
    /// shard starts a new stream, which its receivers copy. A receiving
    /// shard calls it when it opens in a resize: the rows its resize feed
    /// wrote were never changes of its stream (`store/delta.rs`), so the
    /// serving fleet gets them only by copying.
    pub fn restart_streams(&self) {
        self.changes_generation
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether the keys every Push, expiry and row-creating Fetch changes
    /// are kept for a delta stream now (`table/changes.rs`).
    pub fn tracks_changes(&self) -> bool {
        self.changes_on.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Keeps changed keys while this server gives keys to a resize
    /// (`crate::reshard`), or stops (unless `[delta]` keeps them anyway;
    /// the sets are emptied then). Each switch moves the generation on,
    /// so that the next cut of every shard starts a new stream (whose
    /// receivers copy as of it) rather than send a delta that lacks the
    /// changes made while none were kept.
    pub fn track_changes_for_resize(&self, on: bool) {
        let on = on || self.delta_configured;
        let was = self
            .changes_on
            .swap(on, std::sync::atomic::Ordering::SeqCst);
        if was != on {
            self.changes_generation
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        if was && !on {
            for table in self.tables.values() {
                for (_, state) in table.shards() {
                    if let Some(changes) = &state.changes {
                        drop(changes.take());
                    }
                }
            }
        }
    }

    /// Woken when a shard's set of changed keys reaches `delta.max_rows`.
    pub fn changes_wake(&self) -> &std::sync::Arc<Wake> {
        &self.changes_wake
    }

    /// Every table's rows of the shard `writing` locks, at one cut, with
    /// the shard's version, in table-name order. Costs nothing per row (a
    /// row is copied only when a Push changes it while the snapshot is
    /// read: see [`crate::rows::slab`]), so the lock is held
    /// briefly; the caller encodes the snapshot after releasing it.
    pub fn snapshot_shard(&self, writing: &ShardGuard<'_>) -> ShardSnapshot {
        let mut tables: Vec<&Table> = self.tables.values().collect();
        tables.sort_by(|a, b| a.config().name.cmp(&b.config().name));
        ShardSnapshot {
            shard: writing.shard(),
            version: writing.version(),
            tables: tables
                .into_iter()
                .filter(|t| t.shard(writing.shard()).is_some())
                .map(|t| {
                    let config = t.config();
                    let shape = TableShape {
                        name: config.name.clone(),
                        dim: config.dim,
                        slots: config.optimizer.slots() as u32,
                    };
                    (shape, t.snapshot(writing, writing.shard()))
                })
                .collect(),
        }
    }

    /// Training or inference.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Total shards of the model.
    pub fn num_shards(&self) -> u32 {
        self.num_shards.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The configured shard count (checkpoints record it).
    pub fn configured_shards(&self) -> u32 {
        self.configured_shards
    }

    /// Hosted shards, sorted.
    pub fn hosted(&self) -> &[u32] {
        &self.hosted
    }

    /// The tables, in no particular order.
    pub fn tables(&self) -> impl Iterator<Item = &Table> {
        self.tables.values()
    }

    /// The table called `name`.
    pub fn table(&self, name: &str) -> Option<&Table> {
        self.tables.get(name)
    }

    /// Installs a verified checkpoint (see [`crate::checkpoint::load`]):
    /// its rows, and each shard's version as saved.
    pub fn install(&self, checkpoint: crate::image::LoadedCheckpoint) {
        let now = Instant::now();
        // Saved under another count (a finished resize's, or the one before
        // it): its rows are routed by that count, and so is the store until
        // the shard map says otherwise (`crate::reshard`).
        if checkpoint.num_shards != 0 && checkpoint.num_shards != self.num_shards() {
            tracing::info!(
                saved = checkpoint.num_shards,
                configured = self.configured_shards(),
                "the checkpoint was saved under another shard count; routing by it until the shard map reconciles them"
            );
            self.num_shards
                .store(checkpoint.num_shards, std::sync::atomic::Ordering::SeqCst);
        }
        for (shard, version) in checkpoint.versions {
            if let Some(mut guard) = self.lock_shard(shard) {
                guard.set_version(version);
            }
        }
        for (table, shard, image) in checkpoint.shards {
            if let (Some(table), Some(guard)) = (self.tables.get(&table), self.lock_shard(shard)) {
                // Rows without a stamp get the checkpoint's own time, so
                // every server loading it stamps alike (`table/expiry.rs`).
                table.install(&guard, shard, image, now, Some(checkpoint.saved_at_secs));
            }
        }
    }

    /// `table` and its state of `shard`, or why not.
    fn table_shard(&self, table: &str, shard: u32) -> Result<(&Table, &ShardState), StoreError> {
        let table_ref = self
            .tables
            .get(table)
            .ok_or_else(|| StoreError::UnknownTable(table.to_owned()))?;
        let state = table_ref
            .shard(shard)
            .ok_or_else(|| StoreError::ShardNotHosted {
                shard,
                hosted: self.hosted.clone(),
            })?;
        Ok((table_ref, state))
    }

    fn shard_state(
        &self,
        table: &str,
        shard: u32,
        keys: &[u64],
    ) -> Result<(&Table, &ShardState), StoreError> {
        let (table_ref, state) = self.table_shard(table, shard)?;
        if keys.len() > self.max_keys as usize {
            return Err(StoreError::TooManyKeys {
                got: keys.len(),
                max: self.max_keys,
            });
        }
        // A misrouted key would be stored on the wrong shard and silently
        // diverge from its real row: refuse the whole request instead.
        let num_shards = self.route_count(shard);
        for &key in keys {
            let actual = shard_for_key(key, num_shards);
            if actual != shard {
                // A key this shard receives in a shrink: a replica applies
                // it as forwarded; a primary refuses it under the lock, a
                // Fetch at once, until this copy opens. (An earlier
                // growth's fence names it moved away: it comes back.)
                if self
                    .incoming(shard)
                    .is_some_and(|to| shard_for_key(key, to) == shard)
                {
                    continue;
                }
                // A key a resize moved away (this shard took the new
                // count): the caller follows a `KeysMoved`.
                if let Some(moved) = self.moved(shard) {
                    resize::refuse_moved(shard, &[key], moved)?;
                }
                return Err(StoreError::WrongShard { key, shard, actual });
            }
        }
        Ok((table_ref, state))
    }
}
