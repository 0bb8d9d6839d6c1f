//! The tables a server holds and the checks every Fetch and Push passes
//! before touching a row: the table exists, the shard is hosted, every key
//! belongs to it, the request is within the key limit, the gradients have
//! the right length and are finite (or clipped). Nothing of a refused
//! request is applied; an accepted Push is applied to every row it names.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering as AtomicOrdering};
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use tessera_proto::rows::{F32_BYTES, write_f32s};
use tessera_proto::sharding::shard_for_key;

use crate::config::{Mode, PsServerConfig};
use crate::dedup::Admission;
pub use crate::table::Table;
use crate::table::{GradientError, ShardState, dedup_limits};
use crate::version::Version;

/// Why a Fetch or Push was refused. Nothing is applied when one is returned.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// A forwarded Push's evictions do not point into its keys in order
    /// (a corrupt stream entry), or name a row this copy lacks (it is not
    /// the primary's).
    #[error("a forwarded push's evictions do not fit its {keys} keys or this copy")]
    BadEvictions {
        /// Keys of the Push.
        keys: usize,
    },
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
    /// More keys than `max_keys_per_request`.
    #[error("{got} keys in one request; at most {max} are accepted")]
    TooManyKeys {
        /// Keys sent.
        got: usize,
        /// The limit.
        max: u32,
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
    /// A gradient is NaN or infinite and the table rejects those.
    #[error("gradient value {index} of the push to `{table}` is not finite; nothing was applied")]
    NonFiniteGradient {
        /// The table.
        table: String,
        /// Index of the first bad value.
        index: usize,
    },
    /// The Push's sequence number is below the deduplication window: the
    /// server cannot tell whether it was applied, so it refuses it.
    #[error(
        "push {sequence} of worker {worker:#x} is older than the deduplication window (lowest {lowest}); it may already have been applied"
    )]
    SequenceTooOld {
        /// The worker.
        worker: u64,
        /// The sequence sent.
        sequence: u64,
        /// The lowest sequence still tracked.
        lowest: u64,
    },
    /// A Push's sequence is above the largest accepted or jumps too far
    /// above the worker's highest (see [`crate::dedup::MAX_JUMP`]).
    #[error(
        "push {sequence} of worker {worker:#x} is implausible (its highest is {highest}; at most {} above it, and at most {} in all)",
        crate::dedup::MAX_JUMP,
        crate::dedup::MAX_SEQUENCE
    )]
    SequenceImplausible {
        /// The worker.
        worker: u64,
        /// The sequence sent.
        sequence: u64,
        /// The worker's highest sequence so far.
        highest: u64,
    },
    /// A Fetch's answer would exceed the largest message.
    #[error(
        "the answer of {keys} keys x {row_bytes} bytes a row exceeds the largest message ({max} bytes); fetch fewer keys at a time"
    )]
    ResponseTooLarge {
        /// Keys asked for.
        keys: usize,
        /// Bytes of a row.
        row_bytes: usize,
        /// Most bytes a Fetch's rows may take.
        max: usize,
    },
    /// The Push comes from a worker the shard's deduplication has no room
    /// for: refused, so that no remembered worker has to be forgotten.
    #[error(
        "push deduplication of this shard remembers {max_workers} workers (dedup_max_workers), all seen within dedup_idle_secs; worker {worker:#x} is refused until some go idle"
    )]
    DedupFull {
        /// The refused worker.
        worker: u64,
        /// The limit.
        max_workers: usize,
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

/// What a Push did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushOutcome {
    /// Rows updated (0 for a duplicate).
    pub applied: usize,
    /// The Push had been applied before and was only acknowledged.
    pub duplicate: bool,
    /// Rows evicted to make room for its rows (a table with `max_rows`),
    /// in order: the replicas evict the same.
    pub evicted: Vec<crate::table::Eviction>,
}

/// The identity of a Push for exactly-once application: the worker and its
/// sequence number (0 and 0: not deduplicated).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PushId {
    /// The worker (random per worker process).
    pub worker: u64,
    /// The worker's sequence number of this Push.
    pub sequence: u64,
}

/// All tables of one server.
///
/// Each hosted shard has one write lock for all its tables, held by
/// everything that changes its rows (a Push, a copy replacing the shard)
/// or must see whole Pushes only (a checkpoint, a copy for another
/// server). It guards the shard's [`Version`]: whoever changes the rows
/// sets the version under the same lock, so a copy and its version always
/// agree. Fetches do not take it.
#[derive(Debug)]
pub struct Store {
    mode: Mode,
    num_shards: u32,
    hosted: Vec<u32>,
    max_keys: u32,
    /// Most bytes the rows of one Fetch may take: `max_message_size` less
    /// room for the response's header and framing.
    max_response_bytes: usize,
    tables: HashMap<String, Table>,
    writers: HashMap<u32, Writer>,
}

/// One shard's write lock, and the wake-up of the async tasks waiting for
/// it ([`Store::lock_shard_async`]).
#[derive(Debug, Default)]
struct Writer {
    version: Mutex<Version>,
    /// A copy of the version as of the last completed change, for readers
    /// that must not wait for the write lock (Health, stream heads).
    published: Mutex<Version>,
    /// Async waiters registered (a release notifies only if some are).
    waiting: AtomicUsize,
    released: tokio::sync::Notify,
}

/// The write lock of one shard (see [`Store`]), with its version.
#[derive(Debug)]
pub struct ShardGuard<'a> {
    shard: u32,
    /// `Some` until dropped: released before the waiters are woken.
    version: Option<MutexGuard<'a, Version>>,
    writer: &'a Writer,
}

impl Drop for ShardGuard<'_> {
    fn drop(&mut self) {
        drop(self.version.take());
        // Pairs with the fence in `lock_shard_async`: either this sees the
        // waiter's count, or the waiter's `try_lock` sees the release.
        std::sync::atomic::fence(AtomicOrdering::SeqCst);
        if self.writer.waiting.load(AtomicOrdering::SeqCst) > 0 {
            self.writer.released.notify_waiters();
        }
    }
}

impl ShardGuard<'_> {
    /// The shard.
    pub fn shard(&self) -> u32 {
        self.shard
    }

    /// The version of the shard's rows.
    pub fn version(&self) -> Version {
        self.version.as_deref().copied().unwrap_or_default()
    }

    /// Sets the version of the shard's rows (after changing them).
    pub fn set_version(&mut self, version: Version) {
        if let Some(held) = self.version.as_deref_mut() {
            *held = version;
            *self
                .writer
                .published
                .lock()
                .unwrap_or_else(|p| p.into_inner()) = version;
        }
    }
}

/// Every table of one shard at one cut ([`Store::snapshot_shard`]): owns
/// what it holds (rows are shared with the store, see
/// [`crate::table::Row`]), so it can outlive the lock and travel to other
/// threads.
#[derive(Debug, Clone)]
pub struct ShardSnapshot {
    /// The shard.
    pub shard: u32,
    /// The version the rows are at.
    pub version: Version,
    /// Each table hosting the shard, by name, and its rows.
    pub tables: Vec<(TableShape, crate::table::TableSnapshot)>,
}

/// A table's name and row shape, as a snapshot carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableShape {
    /// The table.
    pub name: String,
    /// Values per row.
    pub dim: u32,
    /// Optimizer state slots per value.
    pub slots: u32,
}

impl ShardSnapshot {
    /// Each table's row file (name, bytes, rows), in name order.
    pub fn encode(&self) -> Vec<(&str, Vec<u8>, u64)> {
        self.tables
            .iter()
            .map(|(shape, snapshot)| {
                let (bytes, rows) =
                    crate::rowfile::encode_snapshot(snapshot, shape.dim, shape.slots);
                (shape.name.as_str(), bytes, rows)
            })
            .collect()
    }
}

/// A Push that passed every check ([`Store::check_push`]), ready to apply
/// under its shard's write lock.
#[derive(Debug)]
pub struct CheckedPush<'a> {
    table: &'a Table,
    state: &'a ShardState,
    shard: u32,
    keys: &'a [u64],
    gradients: &'a [u8],
    id: PushId,
}

/// A Fetch that passed every check of [`Store::check_fetch`].
#[derive(Debug)]
pub struct CheckedFetch<'a> {
    store: &'a Store,
    table: &'a Table,
    state: &'a ShardState,
    keys: &'a [u64],
    bytes: usize,
}

impl CheckedFetch<'_> {
    /// Bytes its rows take.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Writes the rows, in order, as little-endian f32 into `out` (exactly
    /// [`CheckedFetch::bytes`] long). Returns the dimension.
    pub fn fetch_into(self, out: &mut [u8]) -> Result<u32, StoreError> {
        let (table, state, keys) = (self.table, self.state, self.keys);
        let dim = table.config().dim;
        let row_bytes = dim as usize * F32_BYTES;
        if out.len() != self.bytes {
            return Err(StoreError::OutputLength {
                expected: self.bytes,
                got: out.len(),
            });
        }
        state
            .fetches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        for (&key, slot) in keys.iter().zip(out.chunks_exact_mut(row_bytes.max(1))) {
            if state
                .rows
                .read(key, |row| write_f32s(slot, &row.values))
                .is_some()
            {
                continue;
            }
            match self.store.mode {
                // A table with a row limit stores rows only from Pushes
                // (under the shard's lock, where the primary's evictions
                // go into the stream): a Fetch storing one would evict a
                // trained row that no replica hears of. The initial values
                // are a pure function of the key, so the answer is the
                // same either way.
                Mode::Training if state.rows.limited() => {
                    write_f32s(slot, &table.initial_row(key));
                }
                Mode::Training => {
                    state.rows.upsert(
                        key,
                        || table.new_row(key),
                        |row| write_f32s(slot, &row.values),
                    );
                }
                Mode::Inference => slot.fill(0),
            }
        }
        metrics::counter!("tessera_ps_fetch_keys_total").increment(keys.len() as u64);
        Ok(dim)
    }
}

/// Bytes of a Fetch response besides its rows (RPC header, protobuf tags
/// and lengths); generous, so that an answer within the check always fits
/// in a message.
const RESPONSE_OVERHEAD: u64 = 4096;

impl Store {
    /// An empty store for `config`'s tables and shards.
    pub fn new(config: &PsServerConfig) -> Self {
        let mut hosted = config.shards.clone();
        hosted.sort_unstable();
        let limits = dedup_limits(config.dedup_max_workers, config.dedup_idle_secs);
        Self {
            mode: config.mode,
            num_shards: config.num_shards,
            max_keys: config.max_keys_per_request,
            max_response_bytes: usize::try_from(
                config.max_message_size.saturating_sub(RESPONSE_OVERHEAD),
            )
            .unwrap_or(usize::MAX),
            tables: config
                .tables
                .iter()
                .map(|t| {
                    (
                        t.name.clone(),
                        Table::new(t.clone(), config.seed, &hosted, limits),
                    )
                })
                .collect(),
            writers: hosted.iter().map(|&s| (s, Writer::default())).collect(),
            hosted,
        }
    }

    /// The write lock of `shard` (see [`Store`]), blocking the thread
    /// until it is free; `None` if the shard is not hosted here. For
    /// blocking threads and sections that hold it briefly; async request
    /// handlers use [`Store::lock_shard_async`].
    pub fn lock_shard(&self, shard: u32) -> Option<ShardGuard<'_>> {
        let writer = self.writers.get(&shard)?;
        Some(ShardGuard {
            shard,
            // A panic under the lock leaves at worst one Push half applied
            // to a row; serving beats failing every later request.
            version: Some(writer.version.lock().unwrap_or_else(|p| p.into_inner())),
            writer,
        })
    }

    /// The write lock of `shard` without blocking the thread: when it is
    /// held (a Push of the same shard, a snapshot, a copy being installed),
    /// the task waits to be woken by its release, and the runtime's
    /// threads go on serving Fetches, Health and other shards. A Push
    /// handler that blocked its thread instead would park every runtime
    /// thread once a few Pushes queue behind a long hold. `None` if the
    /// shard is not hosted here.
    pub async fn lock_shard_async(&self, shard: u32) -> Option<ShardGuard<'_>> {
        let writer = self.writers.get(&shard)?;
        // Counted as waiting until this returns or is dropped.
        struct Waiting<'a>(&'a AtomicUsize);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, AtomicOrdering::SeqCst);
            }
        }
        writer.waiting.fetch_add(1, AtomicOrdering::SeqCst);
        let _waiting = Waiting(&writer.waiting);
        loop {
            let released = writer.released.notified();
            tokio::pin!(released);
            // Registered before trying: a release after this try wakes it.
            released.as_mut().enable();
            std::sync::atomic::fence(AtomicOrdering::SeqCst);
            if let Some(guard) = Self::try_lock_writer(shard, writer) {
                return Some(guard);
            }
            released.await;
        }
    }

    /// Every table's rows of the shard `writing` locks, at one cut, with
    /// the shard's version, in table-name order. Costs one reference count
    /// per row (rows are shared, copied only when a Push changes them
    /// later: see [`crate::table::Row`]), so the lock is held briefly; the
    /// caller encodes the snapshot after releasing it.
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

    /// Async tasks waiting for `shard`'s write lock now (0 if it is not
    /// hosted).
    pub fn waiting_for_lock(&self, shard: u32) -> usize {
        self.writers
            .get(&shard)
            .map_or(0, |w| w.waiting.load(AtomicOrdering::SeqCst))
    }

    fn try_lock_writer(shard: u32, writer: &Writer) -> Option<ShardGuard<'_>> {
        let held = match writer.version.try_lock() {
            Ok(held) => held,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        Some(ShardGuard {
            shard,
            version: Some(held),
            writer,
        })
    }

    /// The version of `shard`'s rows as of the last completed change
    /// (`None`: not hosted). Does not wait for the shard's write lock: a
    /// Push being applied now is not counted yet; who needs the version
    /// to agree with the rows holds the lock ([`ShardGuard::version`]).
    pub fn version(&self, shard: u32) -> Option<Version> {
        let writer = self.writers.get(&shard)?;
        Some(*writer.published.lock().unwrap_or_else(|p| p.into_inner()))
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

    /// The table called `name`.
    pub fn table(&self, name: &str) -> Option<&Table> {
        self.tables.get(name)
    }

    /// Installs a verified checkpoint (see [`crate::checkpoint::load`]):
    /// its rows, and each shard's version as saved.
    pub fn install(&self, checkpoint: crate::checkpoint::LoadedCheckpoint) {
        let now = Instant::now();
        for (shard, version) in checkpoint.versions {
            if let Some(mut guard) = self.lock_shard(shard) {
                guard.set_version(version);
            }
        }
        for (table, shard, image) in checkpoint.shards {
            if let (Some(table), Some(guard)) = (self.tables.get(&table), self.lock_shard(shard)) {
                table.install(&guard, shard, image, now);
            }
        }
    }

    fn shard_state(
        &self,
        table: &str,
        shard: u32,
        keys: &[u64],
    ) -> Result<(&Table, &ShardState), StoreError> {
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
        if keys.len() > self.max_keys as usize {
            return Err(StoreError::TooManyKeys {
                got: keys.len(),
                max: self.max_keys,
            });
        }
        // A misrouted key would be stored on the wrong shard and silently
        // diverge from its real row: refuse the whole request instead.
        for &key in keys {
            let actual = shard_for_key(key, self.num_shards);
            if actual != shard {
                return Err(StoreError::WrongShard { key, shard, actual });
            }
        }
        Ok((table_ref, state))
    }

    /// Checks a Fetch of `keys` from `table`'s `shard` once, before anything
    /// is allocated for its rows: table and shard hosted, no more than
    /// `max_keys_per_request` keys, every key of that shard, and the answer
    /// within the largest message. The checked Fetch says how many bytes
    /// its rows take and then writes them ([`CheckedFetch::fetch_into`]).
    pub fn check_fetch<'a>(
        &'a self,
        table: &str,
        shard: u32,
        keys: &'a [u64],
    ) -> Result<CheckedFetch<'a>, StoreError> {
        let (table_ref, state) = self.shard_state(table, shard, keys)?;
        let row_bytes = table_ref.config().dim as usize * F32_BYTES;
        match keys.len().checked_mul(row_bytes) {
            Some(bytes) if bytes <= self.max_response_bytes => Ok(CheckedFetch {
                store: self,
                table: table_ref,
                state,
                keys,
                bytes,
            }),
            _ => Err(StoreError::ResponseTooLarge {
                keys: keys.len(),
                row_bytes,
                max: self.max_response_bytes,
            }),
        }
    }

    /// Bytes the rows of an allowed Fetch take (see [`Store::check_fetch`]).
    pub fn fetch_bytes(&self, table: &str, shard: u32, keys: &[u64]) -> Result<usize, StoreError> {
        self.check_fetch(table, shard, keys).map(|c| c.bytes())
    }

    /// Bytes of one row of `table` on the wire.
    pub fn row_bytes(&self, table: &str) -> Result<usize, StoreError> {
        self.tables
            .get(table)
            .map(|t| t.config().dim as usize * F32_BYTES)
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
        self.check_fetch(table, shard, keys)?.fetch_into(out)
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
        let checked = self.check_fetch(table, shard, keys)?;
        let mut out = vec![0u8; checked.bytes()];
        let dim = checked.fetch_into(&mut out)?;
        Ok((dim, out))
    }

    /// Applies `gradients` (little-endian f32, `keys.len() * dim`) to the
    /// rows of `keys` with the table's optimizer, once per `id` (a retried
    /// Push with the same id is acknowledged as a duplicate). Validates
    /// everything before changing any row; duplicate keys in one request
    /// are applied once per occurrence. Leaves the shard's version as it
    /// is: servers apply Pushes through [`Store::check_push`] and
    /// [`CheckedPush::apply`] and move the version themselves.
    pub fn push(
        &self,
        table: &str,
        shard: u32,
        keys: &[u64],
        gradients: &[u8],
        id: PushId,
    ) -> Result<PushOutcome, StoreError> {
        let push = self.check_push(table, shard, keys, gradients, id)?;
        let guard = self
            .lock_shard(shard)
            .ok_or_else(|| StoreError::ShardNotHosted {
                shard,
                hosted: self.hosted.clone(),
            })?;
        push.apply(&guard, Instant::now())
    }

    /// Runs every check of a Push (table, shard, keys, key limit, mode,
    /// gradient length and values) without taking any lock.
    pub fn check_push<'a>(
        &'a self,
        table: &str,
        shard: u32,
        keys: &'a [u64],
        gradients: &'a [u8],
        id: PushId,
    ) -> Result<CheckedPush<'a>, StoreError> {
        if self.mode == Mode::Inference {
            return Err(StoreError::InferenceMode);
        }
        let (table, state) = self.shard_state(table, shard, keys)?;
        let dim = table.config().dim;
        let expected = keys.len() * dim as usize * F32_BYTES;
        if gradients.len() != expected {
            return Err(StoreError::GradientLength {
                keys: keys.len(),
                dim,
                expected,
                got: gradients.len(),
            });
        }
        table.check_gradients(gradients).map_err(|err| match err {
            GradientError::NonFinite(index) => StoreError::NonFiniteGradient {
                table: table.config().name.clone(),
                index,
            },
        })?;
        Ok(CheckedPush {
            table,
            state,
            shard,
            keys,
            gradients,
            id,
        })
    }
}

impl CheckedPush<'_> {
    /// The shard it goes to.
    pub fn shard(&self) -> u32 {
        self.shard
    }

    /// Applies it as the shard's primary did (a replica following its
    /// stream): its id is recorded, never judged, and exactly the rows the
    /// primary evicted are evicted (`evictions`, in order). Refused, with
    /// nothing applied, if an eviction does not point into the Push's
    /// keys in order. The caller holds the shard's write lock.
    pub fn apply_replicated(
        &self,
        writing: &ShardGuard<'_>,
        evictions: &[crate::table::Eviction],
        now: Instant,
    ) -> Result<(), StoreError> {
        debug_assert_eq!(writing.shard(), self.shard, "another shard's lock");
        let in_order = evictions.windows(2).all(|w| w[0].before <= w[1].before);
        if !in_order
            || evictions
                .iter()
                .any(|e| e.before as usize >= self.keys.len())
        {
            return Err(StoreError::BadEvictions {
                keys: self.keys.len(),
            });
        }
        let followed = self.table.apply_replicated(
            writing,
            self.state,
            self.keys,
            self.gradients,
            self.id.worker,
            self.id.sequence,
            evictions,
            now,
        );
        if !followed {
            // A row the primary evicted is not here: this copy is not the
            // primary's (applied anyway; the caller copies the shard again).
            return Err(StoreError::BadEvictions {
                keys: self.keys.len(),
            });
        }
        Ok(())
    }

    /// Applies it, unless its id was applied before (then it is
    /// acknowledged as a duplicate). The caller holds the shard's write
    /// lock.
    pub fn apply(&self, writing: &ShardGuard<'_>, now: Instant) -> Result<PushOutcome, StoreError> {
        debug_assert_eq!(writing.shard(), self.shard, "another shard's lock");
        let id = self.id;
        let (admission, evicted) = self.table.apply(
            writing,
            self.state,
            self.keys,
            self.gradients,
            id.worker,
            id.sequence,
            now,
        );
        match admission {
            Admission::Apply => {
                metrics::counter!("tessera_ps_push_keys_total").increment(self.keys.len() as u64);
                Ok(PushOutcome {
                    applied: self.keys.len(),
                    duplicate: false,
                    evicted,
                })
            }
            Admission::Duplicate => {
                metrics::counter!("tessera_ps_push_duplicates_total").increment(1);
                Ok(PushOutcome {
                    applied: 0,
                    duplicate: true,
                    evicted,
                })
            }
            Admission::TooOld { lowest } => Err(StoreError::SequenceTooOld {
                worker: id.worker,
                sequence: id.sequence,
                lowest,
            }),
            Admission::Full { max_workers } => Err(StoreError::DedupFull {
                worker: id.worker,
                max_workers,
            }),
            Admission::Implausible { highest } => Err(StoreError::SequenceImplausible {
                worker: id.worker,
                sequence: id.sequence,
                highest,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Initializer, OptimizerConfig, TableConfig};
    use tessera_proto::rows::{get_f32s, put_f32s};

    const NO_ID: PushId = PushId {
        worker: 0,
        sequence: 0,
    };

    fn config(mode: Mode) -> PsServerConfig {
        PsServerConfig {
            mode,
            num_shards: 2,
            shards: vec![0, 1],
            tables: vec![TableConfig {
                optimizer: OptimizerConfig::sgd(0.5),
                initializer: Initializer::Uniform { scale: 0.1 },
                ..TableConfig::new("t", 3)
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
            store.push("t", 0, &keys, &[0u8; 24], NO_ID),
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
        assert_eq!(store.push("t", 0, &[key], &wire, NO_ID).unwrap().applied, 1);
        let after = decode(&store.fetch("t", 0, &[key]).unwrap().1);
        // lr = 0.5: w' = w - 0.5 * g
        let expected = [before[0] - 0.5, before[1] + 1.0, before[2] - 0.125];
        assert_eq!(after, expected);
        // Pushing the same key twice in one request applies both.
        let mut twice = Vec::new();
        put_f32s(&mut twice, &[1.0, 1.0, 1.0, 1.0, 1.0, 1.0]);
        store.push("t", 0, &[key, key], &twice, NO_ID).unwrap();
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
        store.push("t", 1, &[key], &wire, NO_ID).unwrap();
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
            store.push("t", 0, &[good], &[0u8; 8], NO_ID),
            Err(StoreError::GradientLength {
                expected: 12,
                got: 8,
                ..
            })
        ));
        assert!(matches!(
            store.push("t", 0, &[good, wrong], &[0u8; 24], NO_ID),
            Err(StoreError::WrongShard { .. })
        ));
        assert_eq!(
            store.tables().map(Table::rows).sum::<u64>(),
            0,
            "nothing stored"
        );
    }

    fn wire(values: &[f32]) -> Vec<u8> {
        let mut out = Vec::new();
        put_f32s(&mut out, values);
        out
    }

    #[test]
    fn non_finite_gradients_are_rejected_or_clipped_per_table() {
        let mut config = config(Mode::Training);
        config.tables.push(TableConfig {
            non_finite: crate::config::NonFinite::Clip,
            gradient_clip: 2.0,
            initializer: Initializer::Zeros,
            optimizer: OptimizerConfig::sgd(1.0),
            ..TableConfig::new("clipped", 3)
        });
        let store = Store::new(&config);
        let key = keys_of_shard(0, 1)[0];
        let bad = wire(&[1.0, f32::NAN, 0.5]);
        assert_eq!(
            store.push("t", 0, &[key], &bad, NO_ID),
            Err(StoreError::NonFiniteGradient {
                table: "t".into(),
                index: 1
            })
        );
        assert_eq!(store.table("t").unwrap().rows(), 0, "nothing applied");
        let wild = wire(&[f32::INFINITY, f32::NAN, -5.0]);
        store.push("clipped", 0, &[key], &wild, NO_ID).unwrap();
        let row = decode(&store.fetch("clipped", 0, &[key]).unwrap().1);
        assert_eq!(
            row,
            [-2.0, 0.0, 2.0],
            "clamped to ±2, NaN as 0, then w -= g"
        );
    }

    #[test]
    fn requests_over_the_key_limit_are_refused() {
        let mut config = config(Mode::Training);
        config.max_keys_per_request = 3;
        let store = Store::new(&config);
        let keys = keys_of_shard(0, 4);
        assert_eq!(
            store.fetch("t", 0, &keys).unwrap_err(),
            StoreError::TooManyKeys { got: 4, max: 3 }
        );
        assert!(matches!(
            store.push("t", 0, &keys, &wire(&[0.0; 12]), NO_ID),
            Err(StoreError::TooManyKeys { got: 4, max: 3 })
        ));
        assert!(store.fetch("t", 0, &keys[..3]).is_ok());
    }

    #[test]
    fn a_fetch_whose_answer_exceeds_a_message_is_refused_before_allocating() {
        // 1 MiB messages, dim 3: 87,040 rows fit, the request's keys are
        // checked against it before any row is stored or allocated.
        let mut config = config(Mode::Training);
        config.max_message_size = 1 << 20;
        let store = Store::new(&config);
        let fit = ((1usize << 20) - 4096) / 12;
        let keys = keys_of_shard(0, fit + 1);
        assert_eq!(
            store.fetch_bytes("t", 0, &keys).unwrap_err(),
            StoreError::ResponseTooLarge {
                keys: fit + 1,
                row_bytes: 12,
                max: (1 << 20) - 4096
            }
        );
        assert!(store.fetch("t", 0, &keys).is_err());
        assert_eq!(store.table("t").unwrap().rows(), 0, "nothing was inserted");
        assert_eq!(store.fetch_bytes("t", 0, &keys[..fit]).unwrap(), fit * 12);
    }

    #[test]
    fn a_spoofed_huge_sequence_is_refused_and_the_worker_keeps_pushing() {
        let store = Store::new(&config(Mode::Training));
        let key = keys_of_shard(0, 1)[0];
        let grads = wire(&[1.0, 1.0, 1.0]);
        let id = |sequence| PushId {
            worker: 9,
            sequence,
        };
        store.push("t", 0, &[key], &grads, id(1)).unwrap();
        // Before: accepted, and every later Push of worker 9 was "too old"
        // (and `highest + 1` overflowed in debug builds).
        for sequence in [
            u64::MAX,
            crate::dedup::MAX_SEQUENCE + 1,
            2 + crate::dedup::MAX_JUMP,
        ] {
            assert!(
                matches!(
                    store.push("t", 0, &[key], &grads, id(sequence)),
                    Err(StoreError::SequenceImplausible { highest: 1, .. })
                ),
                "{sequence}"
            );
        }
        let applied = store.push("t", 0, &[key], &grads, id(2)).unwrap();
        assert_eq!((applied.applied, applied.duplicate), (1, false));
        let far = store
            .push("t", 0, &[key], &grads, id(2 + crate::dedup::MAX_JUMP))
            .unwrap();
        assert_eq!(far.applied, 1, "a jump within the bound is fine");
    }

    #[test]
    fn a_duplicate_push_is_acknowledged_and_not_applied() {
        let store = Store::new(&config(Mode::Training));
        let key = keys_of_shard(0, 1)[0];
        let id = PushId {
            worker: 77,
            sequence: 1,
        };
        let grads = wire(&[1.0, 1.0, 1.0]);
        let first = store.push("t", 0, &[key], &grads, id).unwrap();
        assert_eq!(
            first,
            PushOutcome {
                applied: 1,
                duplicate: false,
                evicted: Vec::new(),
            }
        );
        let row = store.fetch("t", 0, &[key]).unwrap().1;
        let again = store.push("t", 0, &[key], &grads, id).unwrap();
        assert_eq!(
            again,
            PushOutcome {
                applied: 0,
                duplicate: true,
                evicted: Vec::new(),
            }
        );
        assert_eq!(store.fetch("t", 0, &[key]).unwrap().1, row, "unchanged");
        // A refused Push does not use up its id: fixed, it applies.
        let next = PushId {
            worker: 77,
            sequence: 2,
        };
        assert!(store.push("t", 0, &[key], &wire(&[1.0]), next).is_err());
        assert_eq!(store.push("t", 0, &[key], &grads, next).unwrap().applied, 1);
    }

    #[test]
    fn table_row_limits_hold_through_fetches_and_pushes() {
        let mut config = config(Mode::Training);
        config.tables[0].max_rows = Some(100);
        let store = Store::new(&config);
        let keys = keys_of_shard(0, 1000);
        for chunk in keys.chunks(50) {
            store.fetch("t", 0, chunk).unwrap();
            store
                .push("t", 0, chunk, &wire(&vec![0.1; chunk.len() * 3]), NO_ID)
                .unwrap();
            let table = store.table("t").unwrap();
            assert!(table.shard(0).unwrap().rows.len() <= 100);
        }
        let table = store.table("t").unwrap();
        assert_eq!(table.rows(), 100, "full, not more");
        assert!(table.evictions() >= 900, "{} evictions", table.evictions());
    }

    fn digest(store: &Store, shard: u32) -> Vec<(u64, u64)> {
        let cut = store.lock_shard(shard).unwrap();
        store
            .snapshot_shard(&cut)
            .tables
            .iter()
            .map(|(_, rows)| crate::rowfile::digest_snapshot(rows))
            .collect()
    }

    proptest::proptest! {
        /// A replica replaying the primary's evictions holds exactly the
        /// primary's rows, whatever the keys (repeats, keys evicted by a
        /// later key of the same Push) and whatever each side fetched.
        #[test]
        fn replayed_evictions_keep_a_replica_identical(
            pushes in proptest::collection::vec(proptest::collection::vec(0usize..300, 1..40), 1..60),
            fetches in proptest::collection::vec(0usize..300, 0..200),
        ) {
            let mut config = config(Mode::Training);
            config.tables[0].max_rows = Some(100);
            let (primary, replica) = (Store::new(&config), Store::new(&config));
            let keys = keys_of_shard(0, 300);
            for (i, push) in pushes.iter().enumerate() {
                // Keys deduplicated as the worker sends them.
                let mut picked: Vec<u64> = Vec::new();
                for &k in push {
                    if !picked.contains(&keys[k]) {
                        picked.push(keys[k]);
                    }
                }
                let grads = wire(&vec![0.25; picked.len() * 3]);
                let id = PushId { worker: 1, sequence: i as u64 + 1 };
                let outcome = primary.push("t", 0, &picked, &grads, id).unwrap();
                let checked = replica.check_push("t", 0, &picked, &grads, id).unwrap();
                let guard = replica.lock_shard(0).unwrap();
                checked.apply_replicated(&guard, &outcome.evicted, Instant::now()).unwrap();
                drop(guard);
                // Each side serves Fetches of its own.
                let (a, b) = fetches.split_at(fetches.len() / 2);
                let a: Vec<u64> = a.iter().map(|&k| keys[k]).collect();
                let b: Vec<u64> = b.iter().map(|&k| keys[k]).collect();
                primary.fetch("t", 0, &a).unwrap();
                replica.fetch("t", 0, &b).unwrap();
                proptest::prop_assert!(primary.table("t").unwrap().shard(0).unwrap().rows.len() <= 100);
            }
            proptest::prop_assert_eq!(digest(&primary, 0), digest(&replica, 0));
        }
    }
}
