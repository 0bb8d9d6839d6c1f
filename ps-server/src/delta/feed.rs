//! A serving server's side of the delta stream: each training shard's
//! deltas judged by its [`Follower`] and applied in order; on a gap, a
//! copy of the rows this server hosts from the training shard's primary
//! (`source.rs`), then the deltas held meanwhile; and how fresh the rows
//! are, for Health, metrics and the `serving.max_delay_ms` bound.
//!
//! Deltas of one training shard are applied one at a time (a lock per
//! training shard, held while one applies); different training shards
//! apply side by side. Rows are written under the serving shard's write
//! lock, a delta's table chunk at a time, on a blocking thread.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use tessera_proto::sharding::shard_for_key;
use tessera_proto::v1::{
    DeltaClient, DeltaCopyRequest, DeltaRequest, DeltaResponse, DeltaTable, ServingHealth,
    SourceFeed,
};
use tessera_rpc::sync::LockExt;
use tessera_rpc::{Channel, ChannelConfig, RpcError, Status, Transport};
use tokio_util::sync::CancellationToken;

use super::follower::{Follower, Header, Verdict};
use crate::store::{Store, StoreError};
use crate::table::changes::unix_ms;

/// The keys a copy held, by table.
type Seen = Mutex<HashMap<String, HashSet<u64>>>;

/// How long a failed copy waits before the next try, at first and at
/// most.
const COPY_BACKOFF: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(5));

/// How often a warning about one training shard is logged at most.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// Why a copy of a training shard failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FeedError {
    /// The call to the training server failed.
    #[error("copying from {addr}: {source}")]
    Rpc {
        /// The training server.
        addr: String,
        /// Why.
        source: RpcError,
    },
    /// Its rows do not fit this server's tables.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// No training server is known to copy from.
    #[error("no training server to copy from")]
    NoSource,
    /// The blocking task applying rows died.
    #[error("applying rows failed: {0}")]
    Task(String),
}

/// One training shard as this server follows it.
#[derive(Debug, Default)]
struct Slot {
    follower: Follower<DeltaRequest>,
    /// The training version its rows reached.
    epoch: u64,
    position: u64,
    /// The delay of the last delta's oldest change (ms).
    delay_ms: u64,
    rows_applied: u64,
    copies: u64,
    /// A copy task runs for it.
    copy_running: bool,
    /// The stream carries optimizer state.
    optimizer_state: bool,
    warned: Option<Instant>,
}

/// What Fetches and Health read without the slots' async locks.
#[derive(Debug, Default, Clone)]
struct Published {
    feeds: HashMap<u32, SourceFeed>,
    /// Per training shard: when it was last applied, and whether copying.
    applied_at: HashMap<u32, (Option<Instant>, bool)>,
}

/// The delta stream's receiving side of a serving server (module docs).
#[derive(Debug)]
pub struct Feed {
    store: Arc<Store>,
    max_delay: Option<Duration>,
    slots: Mutex<HashMap<u32, Arc<tokio::sync::Mutex<Slot>>>>,
    /// The training fleet's shard count (0: none heard yet).
    source_shards: AtomicU32,
    status: Mutex<Published>,
    /// Nanoseconds after `epoch` until which every training shard is
    /// within the bound (0: not fresh): what a Fetch reads.
    fresh_until: AtomicU64,
    epoch: Instant,
    /// The transport copies go over; `None` once shut down: the RPC
    /// server's connection tasks hold this feed, so a transport held here
    /// would keep the stopped server's endpoints (and their connections)
    /// alive.
    transport: Mutex<Option<Transport>>,
    clients: Mutex<HashMap<String, DeltaClient>>,
    stop: CancellationToken,
    weak: Weak<Feed>,
}

impl Feed {
    /// The feed of `store`, refusing Fetches while older than
    /// `max_delay_ms` (0: never), copying over `transport`.
    pub fn new(store: Arc<Store>, max_delay_ms: u64, transport: &Transport) -> Arc<Self> {
        Arc::new_cyclic(|weak| Self {
            store,
            max_delay: (max_delay_ms > 0).then(|| Duration::from_millis(max_delay_ms)),
            slots: Mutex::new(HashMap::new()),
            source_shards: AtomicU32::new(0),
            status: Mutex::new(Published::default()),
            fresh_until: AtomicU64::new(0),
            epoch: Instant::now(),
            transport: Mutex::new(Some(transport.clone())),
            clients: Mutex::new(HashMap::new()),
            stop: CancellationToken::new(),
            weak: weak.clone(),
        })
    }

    /// Stops the copy tasks and lets go of the transport.
    pub fn shutdown(&self) {
        self.stop.cancel();
        self.clients.locked().clear();
        *self.transport.locked() = None;
    }

    /// Whether Fetches may be answered now: always without a bound; with
    /// one, every training shard was applied within it and none is being
    /// copied.
    pub fn fresh(&self) -> bool {
        match self.max_delay {
            None => true,
            Some(_) => {
                let now = self.epoch.elapsed().as_nanos() as u64;
                now < self.fresh_until.load(Ordering::Relaxed)
            }
        }
    }

    /// How stale the rows are, for a refusal's message: the oldest
    /// training shard's time since it was last applied (`None`: one was
    /// never applied, or is being copied).
    pub fn delay(&self) -> Option<Duration> {
        let status = self.status.locked();
        let n = self.source_shards.load(Ordering::Relaxed);
        let now = Instant::now();
        let mut worst = Duration::ZERO;
        for s in 0..n {
            match status.applied_at.get(&s) {
                Some((Some(at), false)) => worst = worst.max(now.saturating_duration_since(*at)),
                _ => return None,
            }
        }
        (n > 0).then_some(worst)
    }

    /// The bound (`serving.max_delay_ms`).
    pub fn max_delay(&self) -> Option<Duration> {
        self.max_delay
    }

    /// Health's view.
    pub fn health(&self) -> ServingHealth {
        let status = self.status.locked();
        let now = Instant::now();
        let mut sources: Vec<SourceFeed> = status
            .feeds
            .values()
            .cloned()
            .map(|mut f| {
                if let Some((Some(at), _)) = status.applied_at.get(&f.source_shard) {
                    f.applied_age_ms = now.saturating_duration_since(*at).as_millis() as u64;
                }
                f
            })
            .collect();
        sources.sort_by_key(|f| f.source_shard);
        ServingHealth {
            source_shards: self.source_shards.load(Ordering::Relaxed),
            sources,
            fresh: self.fresh(),
            max_delay_ms: self.max_delay.map_or(0, |d| d.as_millis() as u64),
        }
    }

    /// Takes one delta (the `Apply` call). Judged and applied by a task
    /// of its own, which holds the training shard's lock until the delta
    /// is in: a call given up at its deadline must not let the next delta
    /// be written beside (or before) this one.
    pub async fn apply(&self, request: DeltaRequest) -> Result<DeltaResponse, Status> {
        let Some(feed) = self.weak.upgrade() else {
            return Err(Status::unavailable("the server is stopping"));
        };
        tokio::spawn(async move { feed.apply_in_order(request).await })
            .await
            .map_err(|err| Status::internal(format!("applying the delta failed: {err}")))?
    }

    async fn apply_in_order(&self, request: DeltaRequest) -> Result<DeltaResponse, Status> {
        if request.source_shards == 0 || request.source_shard >= request.source_shards {
            return Err(Status::invalid_argument(format!(
                "source shard {} of {} does not exist",
                request.source_shard, request.source_shards
            )));
        }
        if request.num_shards != self.store.num_shards() {
            return Err(Status::failed_precondition(format!(
                "the training fleet routes rows to {} serving shards; this serving fleet has {} (delta.num_shards must equal the serving fleet's num_shards)",
                request.num_shards,
                self.store.num_shards()
            )));
        }
        let mut shards = request.shards.clone();
        shards.sort_unstable();
        shards.dedup();
        if shards != self.store.hosted() {
            return Err(Status::failed_precondition(format!(
                "the training fleet sends this server the rows of serving shards {shards:?}; it hosts {:?} (fix its delta.servers entry)",
                self.store.hosted()
            )));
        }
        let known = self
            .source_shards
            .swap(request.source_shards, Ordering::Relaxed);
        if known != 0 && known != request.source_shards {
            tracing::warn!(
                was = known,
                now = request.source_shards,
                "the training fleet's shard count changed"
            );
        }
        let shard = request.source_shard;
        let slot = self.slot(shard);
        let mut slot = slot.lock().await;
        let header = Header {
            stream: request.stream,
            epoch: request.epoch,
            seq: request.seq,
            part: request.part,
            last: request.last,
        };
        let bytes: usize = request.tables.iter().map(super::parts::table_bytes).sum();
        let source = request.source.clone();
        slot.optimizer_state = request.optimizer_state;
        let now = Instant::now();
        let (verdict, item) = slot
            .follower
            .handle_delta(header, &source, request, bytes, now);
        let response = match (verdict, item) {
            (Verdict::Apply, Some(request)) => {
                self.apply_delta(&mut slot, request).await;
                DeltaResponse {
                    applied: true,
                    copying: slot.follower.copying(),
                }
            }
            (Verdict::Copy, _) => {
                metrics::counter!("tessera_ps_serving_gaps_total").increment(1);
                if !slot.copy_running {
                    slot.copy_running = true;
                    if let Some(feed) = self.weak.upgrade() {
                        tokio::spawn(feed.copy_loop(shard));
                    }
                }
                DeltaResponse {
                    applied: false,
                    copying: true,
                }
            }
            _ => DeltaResponse {
                applied: false,
                copying: slot.follower.copying(),
            },
        };
        self.publish(shard, &slot);
        Ok(response)
    }

    fn slot(&self, shard: u32) -> Arc<tokio::sync::Mutex<Slot>> {
        Arc::clone(self.slots.locked().entry(shard).or_default())
    }

    /// Applies a delta the follower said to, and notes what it did; a
    /// delta that does not fit loses the stream (the next one copies).
    async fn apply_delta(&self, slot: &mut Slot, request: DeltaRequest) {
        let rows = request
            .tables
            .iter()
            .map(|t| t.keys.len() + t.removed.len())
            .sum::<usize>();
        match self.write(request.tables, None).await {
            Ok(()) => {
                slot.rows_applied += rows as u64;
                metrics::counter!("tessera_ps_serving_rows_total").increment(rows as u64);
                if request.last {
                    slot.epoch = request.epoch;
                    slot.position = request.position;
                    if request.oldest_change_unix_ms > 0 {
                        let delay = unix_ms().saturating_sub(request.oldest_change_unix_ms);
                        slot.delay_ms = delay;
                        metrics::histogram!("tessera_ps_serving_delay_seconds")
                            .record(delay as f64 / 1000.0);
                    }
                }
            }
            Err(err) => {
                slot.follower.handle_apply_failed();
                self.warn(slot, request.source_shard, &err);
            }
        }
    }

    /// Writes `tables` into the store on a blocking thread: each row
    /// under its serving shard's write lock; keys seen go into `seen`.
    async fn write(
        &self,
        tables: Vec<DeltaTable>,
        seen: Option<Arc<Seen>>,
    ) -> Result<(), FeedError> {
        if tables.is_empty() {
            return Ok(());
        }
        let store = Arc::clone(&self.store);
        tokio::task::spawn_blocking(move || write_tables(&store, &tables, seen.as_deref()))
            .await
            .map_err(|err| FeedError::Task(err.to_string()))?
    }

    /// Copies `shard` until a copy is in and the stream resumes after it.
    async fn copy_loop(self: Arc<Self>, shard: u32) {
        let slot = self.slot(shard);
        let mut backoff = COPY_BACKOFF.0;
        loop {
            let (from, with_state) = {
                let slot = slot.lock().await;
                (slot.follower.source().to_owned(), slot.optimizer_state)
            };
            let copied = tokio::select! {
                copied = self.copy_once(shard, &from, with_state) => copied,
                () = self.stop.cancelled() => return,
            };
            let mut guard = slot.lock().await;
            match copied {
                Ok(mark) => {
                    backoff = COPY_BACKOFF.0;
                    guard.copies += 1;
                    guard.rows_applied += mark.rows;
                    guard.epoch = mark.epoch;
                    guard.position = mark.position;
                    metrics::counter!("tessera_ps_serving_copies_total").increment(1);
                    tracing::info!(source_shard = shard, from = %from, rows = mark.rows, took = ?mark.took, "copied a training shard's rows");
                    let resume =
                        guard
                            .follower
                            .handle_copied(mark.stream, mark.seq, mark.epoch, mark.asked);
                    for request in resume.apply {
                        self.apply_delta(&mut guard, request).await;
                    }
                    if !resume.copy_again && !guard.follower.copying() {
                        guard.copy_running = false;
                        self.publish(shard, &guard);
                        return;
                    }
                    self.publish(shard, &guard);
                }
                Err(err) => {
                    guard.follower.handle_copy_failed();
                    self.warn(&mut guard, shard, &err);
                    drop(guard);
                    tokio::select! {
                        () = tokio::time::sleep(backoff) => {}
                        () = self.stop.cancelled() => return,
                    }
                    backoff = (backoff * 2).min(COPY_BACKOFF.1);
                }
            }
        }
    }

    /// One copy of the rows this server hosts from training shard `shard`
    /// at `from`; then drops the rows of that training shard the copy did
    /// not hold.
    async fn copy_once(
        &self,
        shard: u32,
        from: &str,
        with_state: bool,
    ) -> Result<Copied, FeedError> {
        if from.is_empty() {
            return Err(FeedError::NoSource);
        }
        let started = Instant::now();
        let client = self.client(from).ok_or(FeedError::NoSource)?;
        let mut session = 0;
        let copied = self
            .copy_pages(shard, from, with_state, &client, &mut session)
            .await;
        if copied.is_err() && session != 0 {
            // Best effort: the source lets the snapshot go now rather than
            // when it has been idle long enough.
            let _ = client
                .copy(DeltaCopyRequest {
                    session,
                    release: true,
                    ..DeltaCopyRequest::default()
                })
                .await;
        }
        let (mark, rows) = copied?;
        let (stream, seq, epoch, position) = mark;
        Ok(Copied {
            stream,
            seq,
            epoch,
            position,
            rows,
            asked: started,
            took: started.elapsed(),
        })
    }

    /// The pages of one copy, written as they come; then the rows of that
    /// training shard the copy did not hold are removed. Returns the
    /// copy's mark (stream, seq, epoch, position) and rows.
    async fn copy_pages(
        &self,
        shard: u32,
        from: &str,
        with_state: bool,
        client: &DeltaClient,
        session: &mut u64,
    ) -> Result<((u64, u64, u64, u64), u64), FeedError> {
        let mut request = DeltaCopyRequest {
            source_shard: shard,
            num_shards: self.store.num_shards(),
            shards: self.store.hosted().to_vec(),
            optimizer_state: with_state,
            ..DeltaCopyRequest::default()
        };
        let seen: Arc<Seen> = Arc::new(Mutex::new(HashMap::new()));
        let mut mark = None;
        let mut rows = 0u64;
        loop {
            let page = client
                .copy(request.clone())
                .await
                .map_err(|source| FeedError::Rpc {
                    addr: from.to_owned(),
                    source,
                })?;
            if mark.is_none() {
                mark = Some((page.stream, page.seq, page.epoch, page.position));
            }
            *session = page.session;
            rows += page.tables.iter().map(|t| t.keys.len() as u64).sum::<u64>();
            self.write(page.tables, Some(Arc::clone(&seen))).await?;
            if page.done {
                break;
            }
            request.session = page.session;
            request.table = page.next_table;
            request.row = page.next_row;
        }
        // Rows of this training shard that it no longer has (removed
        // while this server was out of the stream).
        let store = Arc::clone(&self.store);
        let source_shards = self.source_shards.load(Ordering::Relaxed).max(1);
        let removed = tokio::task::spawn_blocking(move || {
            let seen = seen.locked();
            let mut removed = 0usize;
            for &serving in store.hosted() {
                let Some(writing) = store.lock_shard(serving) else {
                    continue;
                };
                let names: Vec<String> = store.tables().map(|t| t.config().name.clone()).collect();
                for name in names {
                    let kept = seen.get(&name);
                    let gone = store.keys_where(&writing, &name, |k| {
                        shard_for_key(k, source_shards) == shard
                            && !kept.is_some_and(|kept| kept.contains(&k))
                    });
                    removed += store.remove_rows(&writing, &name, &gone).unwrap_or(0);
                }
            }
            removed
        })
        .await
        .map_err(|err| FeedError::Task(err.to_string()))?;
        if removed > 0 {
            tracing::info!(
                source_shard = shard,
                removed,
                "removed rows the training shard no longer has"
            );
        }
        *session = 0;
        Ok((mark.unwrap_or_default(), rows))
    }

    fn client(&self, addr: &str) -> Option<DeltaClient> {
        let transport = self.transport.locked().clone()?;
        Some(
            self.clients
                .locked()
                .entry(addr.to_owned())
                .or_insert_with(|| {
                    DeltaClient::new(Channel::with_transport(
                        addr,
                        ChannelConfig {
                            connect_timeout_ms: 1000,
                            request_timeout_ms: 30_000,
                            ..ChannelConfig::default()
                        },
                        transport,
                    ))
                })
                .clone(),
        )
    }

    fn warn(&self, slot: &mut Slot, shard: u32, err: &dyn std::fmt::Display) {
        if slot.warned.is_none_or(|at| at.elapsed() >= WARN_EVERY) {
            tracing::warn!(source_shard = shard, %err, "the delta stream of a training shard is interrupted here");
            slot.warned = Some(Instant::now());
        }
    }

    /// Publishes `slot`'s state for Health and Fetches.
    fn publish(&self, shard: u32, slot: &Slot) {
        let mut status = self.status.locked();
        let applied_at = slot.follower.applied_at();
        status
            .applied_at
            .insert(shard, (applied_at, slot.follower.copying()));
        status.feeds.insert(
            shard,
            SourceFeed {
                source_shard: shard,
                source: slot.follower.source().to_owned(),
                stream: slot.follower.stream(),
                seq: slot.follower.seq(),
                position: slot.position,
                applied_age_ms: 0,
                delay_ms: slot.delay_ms,
                copying: slot.follower.copying(),
                rows_applied: slot.rows_applied,
                copies: slot.copies,
            },
        );
        metrics::gauge!("tessera_ps_serving_position", "source_shard" => shard.to_string())
            .set(slot.position as f64);
        // Fresh until the earliest training shard's applied time plus the
        // bound, if every one is known, applied and not being copied.
        let until = self.max_delay.and_then(|bound| {
            let n = self.source_shards.load(Ordering::Relaxed);
            let mut earliest: Option<Instant> = None;
            for s in 0..n {
                match status.applied_at.get(&s) {
                    Some((Some(at), false)) => {
                        earliest = Some(earliest.map_or(*at, |e| e.min(*at)));
                    }
                    _ => return None,
                }
            }
            earliest.map(|e| (e + bound).saturating_duration_since(self.epoch).as_nanos() as u64)
        });
        self.fresh_until
            .store(until.unwrap_or(0), Ordering::Relaxed);
    }
}

/// A copy's mark and size.
#[derive(Debug)]
struct Copied {
    stream: u64,
    seq: u64,
    epoch: u64,
    position: u64,
    rows: u64,
    /// When it was asked for (its rows are at least that fresh).
    asked: Instant,
    took: Duration,
}

/// Writes rows and removals of `tables` into `store`, each chunk's rows
/// under their serving shard's write lock.
fn write_tables(
    store: &Store,
    tables: &[DeltaTable],
    seen: Option<&Seen>,
) -> Result<(), FeedError> {
    let n = store.num_shards();
    for table in tables {
        let row_bytes = store.row_bytes(&table.name)?;
        let state_bytes = if table.keys.is_empty() {
            0
        } else {
            table.state.len() / table.keys.len()
        };
        if table.state.len() != state_bytes * table.keys.len() {
            return Err(StoreError::DeltaLength {
                table: table.name.clone(),
                part: "state",
                keys: table.keys.len(),
                expected: state_bytes * table.keys.len(),
                got: table.state.len(),
            }
            .into());
        }
        for (part, got) in [("steps", table.steps.len()), ("stamps", table.stamps.len())] {
            if got != 0 && got != table.keys.len() {
                return Err(StoreError::DeltaLength {
                    table: table.name.clone(),
                    part,
                    keys: table.keys.len(),
                    expected: table.keys.len(),
                    got,
                }
                .into());
            }
        }
        if table.values.len() != table.keys.len() * row_bytes {
            return Err(StoreError::DeltaLength {
                table: table.name.clone(),
                part: "values",
                keys: table.keys.len(),
                expected: table.keys.len() * row_bytes,
                got: table.values.len(),
            }
            .into());
        }
        // Rows by serving shard, in order.
        let mut by_shard: HashMap<u32, Vec<usize>> = HashMap::new();
        for (i, &k) in table.keys.iter().enumerate() {
            by_shard.entry(shard_for_key(k, n)).or_default().push(i);
        }
        if by_shard.len() == 1
            && let Some(&shard) = by_shard.keys().next()
        {
            // One serving shard (the sender routes per shard, so nearly
            // always): the rows as they came, no copy.
            let writing = store.lock_shard(shard).ok_or(StoreError::ShardNotHosted {
                shard,
                hosted: store.hosted().to_vec(),
            })?;
            store.put_whole_rows(
                &writing,
                &table.name,
                &table.keys,
                &table.values,
                &table.state,
                &table.steps,
                &table.stamps,
            )?;
            by_shard.clear();
        }
        for (shard, rows) in by_shard {
            let writing = store.lock_shard(shard).ok_or(StoreError::ShardNotHosted {
                shard,
                hosted: store.hosted().to_vec(),
            })?;
            let keys: Vec<u64> = rows.iter().map(|&i| table.keys[i]).collect();
            let mut values = Vec::with_capacity(rows.len() * row_bytes);
            let mut state = Vec::with_capacity(rows.len() * state_bytes);
            for &i in &rows {
                values.extend_from_slice(&table.values[i * row_bytes..(i + 1) * row_bytes]);
                if state_bytes > 0 {
                    state.extend_from_slice(&table.state[i * state_bytes..(i + 1) * state_bytes]);
                }
            }
            // (Each empty or one per key: checked above.)
            let pick = |all: &[u32]| -> Vec<u32> {
                if all.is_empty() {
                    Vec::new()
                } else {
                    rows.iter().map(|&i| all[i]).collect()
                }
            };
            store.put_whole_rows(
                &writing,
                &table.name,
                &keys,
                &values,
                &state,
                &pick(&table.steps),
                &pick(&table.stamps),
            )?;
        }
        let mut removed: HashMap<u32, Vec<u64>> = HashMap::new();
        for &k in &table.removed {
            removed.entry(shard_for_key(k, n)).or_default().push(k);
        }
        for (shard, keys) in removed {
            if let Some(writing) = store.lock_shard(shard) {
                store.remove_rows(&writing, &table.name, &keys)?;
            }
        }
        if let Some(seen) = seen {
            seen.locked()
                .entry(table.name.clone())
                .or_default()
                .extend(table.keys.iter().copied());
        }
    }
    Ok(())
}
