//! A serving server's side of the delta stream: each training shard's
//! deltas judged by its [`Follower`] and applied in order; on a gap, a
//! copy of the rows this server hosts from the training shard's primary
//! (`source.rs`), then the deltas held meanwhile; and how fresh the rows
//! are, for Health, metrics and the `serving.max_delay_ms` bound.
//!
//! A training server in etcd mode has a feed too, closed but while one of
//! its shards receives keys in a resize (`crate::reshard`): the giving
//! shards' primaries stream it their moving rows, whole, and it follows
//! them exactly as a serving server follows its training fleet.
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
    SourceFeed, TableWindows,
};
use tessera_rpc::sync::LockExt;
use tessera_rpc::{Channel, ChannelConfig, RpcError, Status, Transport};
use tokio_util::sync::CancellationToken;

mod copy;
mod write;

pub use self::write::LeadCheck;
use self::write::{lock_for_feed, write_tables};
use super::follower::{Follower, Header, Verdict};
use tessera_store::store::{Store, StoreError};
use tessera_store::table::changes::unix_ms;

/// The keys a copy held, by table.
type Seen = Mutex<HashMap<String, HashSet<u64>>>;

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
    /// The feed was closed or opened again for another resize while the
    /// copy ran: its rows are of no use now.
    #[error("the feed was reset during the copy")]
    Reset,
    /// The blocking task applying rows died (panicked or was cancelled);
    /// the cause is kept as the runtime gave it.
    #[error("applying rows failed: {0}")]
    Task(#[source] tokio::task::JoinError),
}

/// One training shard as this server follows it.
#[derive(Debug, Default)]
struct Slot {
    /// The feed's generation it belongs to (`Feed::generation`).
    generation: u64,
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
    /// A resize's giving shard: a delta or copy cut after it fenced its
    /// moving keys was applied (every change to them is here).
    fenced: bool,
    /// The shard-map version of the newest such fence (0: a sender
    /// before it was sent): a resize planned after it is not opened by
    /// it (`reshard/core.rs`).
    fenced_at: u64,
    /// Its deduplication windows, as the last fenced delta or
    /// copy carried them.
    windows: Vec<TableWindows>,
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
    /// A training server's feed: `Some(the resize's shard count)` while
    /// one of its shards receives keys, `None` while closed. Absent on a
    /// serving server, which always takes deltas.
    resize_gate: Option<Mutex<Option<u32>>>,
    /// Moves on each time a resize feed opens or closes: slots (and the
    /// copies and applies of slots) of an older generation write nothing.
    generation: AtomicU64,
    /// Told when a giving shard's fenced delta or copy is applied (a
    /// receiving primary may open its shard now: `crate::reshard`).
    fenced: tokio::sync::Notify,
    /// Whether this server leads a shard (a resize feed writes only the
    /// shards it leads); every shard until set.
    leads: std::sync::OnceLock<LeadCheck>,
}

impl Feed {
    /// The feed of `store`, refusing Fetches while older than
    /// `max_delay_ms` (0: never), copying over `transport`.
    pub fn new(store: Arc<Store>, max_delay_ms: u64, transport: &Transport) -> Arc<Self> {
        Self::build(store, max_delay_ms, transport, None)
    }

    /// A training server's feed for resizes: closed until
    /// [`Feed::open_for_resize`].
    pub fn for_resizes(store: Arc<Store>, transport: &Transport) -> Arc<Self> {
        Self::build(store, 0, transport, Some(Mutex::new(None)))
    }

    /// Makes a resize feed write only the shards `leads` says this server
    /// leads (the replication's lease: `lib.rs`); set once.
    pub fn check_leads(&self, leads: LeadCheck) {
        let _ = self.leads.set(leads);
    }

    /// A resize feed's lead check (`None` on a serving server's feed).
    fn resize_check(&self) -> Option<LeadCheck> {
        self.resize_gate.as_ref()?;
        Some(
            self.leads
                .get()
                .cloned()
                .unwrap_or_else(|| LeadCheck::new(|_| true)),
        )
    }

    /// Takes deltas routed by `num_shards` (a resize's target, in which a
    /// shard of this server receives keys), or, with `None`, refuses
    /// deltas again and forgets the streams followed (a later resize
    /// starts with copies). A no-op on a serving server's feed.
    pub fn open_for_resize(&self, num_shards: Option<u32>) {
        drop(self.switch_resize(num_shards));
    }

    /// Resolves once a giving shard's fenced delta or copy was applied
    /// since the last time it resolved.
    pub async fn fenced_applied(&self) {
        self.fenced.notified().await;
    }

    /// The deduplication windows each giving shard had at its fence, by
    /// giving shard, as its fenced delta or copy carried them (a resize
    /// feed's; read before [`Feed::close_for_resize`]).
    pub async fn fenced_windows(&self) -> Vec<(u32, tessera_store::store::TableWindows)> {
        let slots: Vec<(u32, Arc<tokio::sync::Mutex<Slot>>)> = self
            .slots
            .locked()
            .iter()
            .map(|(&s, slot)| (s, Arc::clone(slot)))
            .collect();
        let mut out = Vec::new();
        for (shard, slot) in slots {
            let slot = slot.lock().await;
            if slot.fenced && self.current(&slot) {
                out.push((shard, crate::wire::windows_from_wire(&slot.windows)));
            }
        }
        out.sort_by_key(|(s, _)| *s);
        out
    }

    /// Closes a resize feed (as `open_for_resize(None)`) and waits until
    /// no delta of it is being applied any more: a receiving primary
    /// that serves from then on has rows no later delta changes.
    pub async fn close_for_resize(&self) {
        for slot in self.switch_resize(None) {
            drop(slot.lock().await);
        }
    }

    /// Switches the resize gate; returns the slots of the streams
    /// followed until then (empty when nothing changed).
    fn switch_resize(&self, num_shards: Option<u32>) -> Vec<Arc<tokio::sync::Mutex<Slot>>> {
        let Some(gate) = &self.resize_gate else {
            return Vec::new();
        };
        let mut gate = gate.locked();
        if *gate == num_shards {
            return Vec::new();
        }
        *gate = num_shards;
        // Whatever was followed belongs to another resize (or none): a
        // copy or an apply still running for it writes nothing more, and
        // the next resize's streams start with copies.
        self.generation.fetch_add(1, Ordering::SeqCst);
        let slots = self.slots.locked().drain().map(|(_, slot)| slot).collect();
        *self.status.locked() = Published::default();
        self.source_shards.store(0, Ordering::Relaxed);
        slots
    }

    /// The shard count rows are routed by here: a resize feed's target
    /// (a shrink's receiving server has more shards itself until it
    /// opens), else the store's.
    fn route_count(&self) -> u32 {
        self.resize_gate
            .as_ref()
            .and_then(|gate| *gate.locked())
            .unwrap_or_else(|| self.store.num_shards())
    }

    /// Whether deltas routed by `num_shards` are taken now.
    fn admits(&self, num_shards: u32) -> bool {
        self.resize_gate
            .as_ref()
            .is_none_or(|gate| *gate.locked() == Some(num_shards))
    }

    /// Whether `slot` belongs to the feed as it is now.
    fn current(&self, slot: &Slot) -> bool {
        slot.generation == self.generation.load(Ordering::SeqCst)
    }

    /// Whether it takes deltas now (a serving server's always; a
    /// training server's while one of its shards receives keys): Health
    /// reports it then.
    pub fn is_open(&self) -> bool {
        self.resize_gate
            .as_ref()
            .is_none_or(|gate| gate.locked().is_some())
    }

    fn build(
        store: Arc<Store>,
        max_delay_ms: u64,
        transport: &Transport,
        resize_gate: Option<Mutex<Option<u32>>>,
    ) -> Arc<Self> {
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
            resize_gate,
            leads: std::sync::OnceLock::new(),
            generation: AtomicU64::new(0),
            fenced: tokio::sync::Notify::new(),
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
        if let Some(gate) = &self.resize_gate {
            let open = *gate.locked();
            if open != Some(request.num_shards) {
                return Err(Status::failed_precondition(format!(
                    "this training server takes no rows routed by {} shards now (no shard of it receives keys in the cluster's resize{})",
                    request.num_shards,
                    open.map_or(String::new(), |n| format!(" to {n} shards"))
                )));
            }
        }
        if request.source_shards == 0 || request.source_shard >= request.source_shards {
            return Err(Status::invalid_argument(format!(
                "source shard {} of {} does not exist",
                request.source_shard, request.source_shards
            )));
        }
        if request.num_shards != self.route_count() {
            return Err(Status::failed_precondition(format!(
                "the training fleet routes rows to {} serving shards; this serving fleet has {} (delta.num_shards must equal the serving fleet's num_shards)",
                request.num_shards,
                self.route_count()
            )));
        }
        let mut shards = request.shards.clone();
        shards.sort_unstable();
        shards.dedup();
        let fits = if self.resize_gate.is_some() {
            // A resize's deltas name the receiving shards of this server,
            // which may host others too.
            !shards.is_empty() && shards.iter().all(|s| self.store.hosted().contains(s))
        } else {
            shards == self.store.hosted()
        };
        if !fits {
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
        let slot_ref = self.slot(shard);
        let mut slot = slot_ref.lock().await;
        // Closed, or opened for another resize, since the check above.
        if !self.admits(request.num_shards) || !self.current(&slot) {
            return Err(Status::unavailable(
                "this server's resize feed changed while the delta waited; send it again",
            ));
        }
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
                        tokio::spawn(feed.copy_loop(shard, Arc::clone(&slot_ref)));
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
        let generation = self.generation.load(Ordering::SeqCst);
        Arc::clone(self.slots.locked().entry(shard).or_insert_with(|| {
            Arc::new(tokio::sync::Mutex::new(Slot {
                generation,
                ..Slot::default()
            }))
        }))
    }

    /// Applies a delta the follower said to, and notes what it did; a
    /// delta that does not fit loses the stream (the next one copies).
    async fn apply_delta(&self, slot: &mut Slot, request: DeltaRequest) {
        if !self.current(slot) {
            return;
        }
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
                    if request.fenced {
                        slot.fenced_at = slot.fenced_at.max(request.fenced_at);
                        if !slot.fenced {
                            slot.fenced = true;
                            self.fenced.notify_one();
                        }
                    }
                    if request.fenced && !request.windows.is_empty() {
                        slot.windows = request.windows;
                    }
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
        let resize = self.resize_check();
        let n = self.route_count();
        tokio::task::spawn_blocking(move || {
            write_tables(&store, &tables, seen.as_deref(), n, resize.as_ref())
        })
        .await
        .map_err(FeedError::Task)?
    }

    fn warn(&self, slot: &mut Slot, shard: u32, err: &dyn std::fmt::Display) {
        if slot.warned.is_none_or(|at| at.elapsed() >= WARN_EVERY) {
            tracing::warn!(source_shard = shard, %err, "the delta stream of a training shard is interrupted here");
            slot.warned = Some(Instant::now());
        }
    }

    /// Publishes `slot`'s state for Health and Fetches.
    fn publish(&self, shard: u32, slot: &Slot) {
        if !self.current(slot) {
            return;
        }
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
                fenced: slot.fenced,
                fenced_at: slot.fenced_at,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_dead_apply_task_keeps_its_cause_as_the_source() {
        let join = tokio::task::spawn_blocking(|| -> () { panic!("row apply died") })
            .await
            .unwrap_err();
        let err = FeedError::Task(join);
        let source = std::error::Error::source(&err).expect("a source");
        let join = source
            .downcast_ref::<tokio::task::JoinError>()
            .expect("the runtime's JoinError");
        assert!(join.is_panic(), "{err}");
        assert!(err.to_string().starts_with("applying rows failed"), "{err}");
    }
}
