//! A training server's side of the delta stream: every interval (or
//! sooner, when a shard's changes reach `delta.max_rows`), each shard it
//! leads is **cut** under the shard's write lock (the keys changed since
//! the last cut, the next delta number, the stream position), the rows of
//! those keys are read as they are now, routed to the serving shards of
//! their keys, and queued for every serving server of those shards.
//!
//! Each serving server has a queue of [`QUEUE_DELTAS`] deltas per shard
//! this server hosts and one call in flight. When a queue is full and its
//! server is keeping up (its last delta arrived within [`stall_bound`] and
//! none failed since), the cut **waits**: the changed keys keep
//! gathering, and the next cut, once the queue has room, sends them in one
//! larger delta. A slow serving server so gets fewer, bigger deltas and
//! never a gap (a gap costs it a copy of the whole shard, which made a
//! server a little too slow for the interval copy over and over). A
//! server that is down, failing or stalled loses deltas instead (counted
//! as failed or dropped) rather than holding the others back, and copies
//! the shard when it sees the gap (`follower.rs`). While one server of a
//! shard's stream holds a cut back, every server of it waits: the stream
//! is one sequence for all of them.
//!
//! The same cut goes to every route (`route.rs`): the serving fleet's,
//! and while this server gives keys to a resize, the receiving shards'
//! servers', with rows whole and routed by the resize's target count.
//!
//! A stream is a term of this server as the shard's primary: a new id
//! whenever it starts leading the shard (at start, after a failover, with
//! a new epoch), so that no receiver mistakes one term's deltas for
//! another's.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tessera_proto::v1::{DeltaClient, DeltaRequest, DeltaStreamHealth, DeltaTable};
use tessera_rpc::sync::LockExt;
use tessera_rpc::{Channel, ChannelConfig, Transport};
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;

use super::parts::{pack, route};
use super::route::{Destination, Outgoing, Reports, ResizePlan, Route};
use crate::config::DeltaConfig;
use crate::replication::Replication;
use tessera_store::store::Store;
use tessera_store::table::changes::{Taken, unix_ms};

/// Deltas of one shard queued for one serving server at most (a server
/// leading several shards queues as many per shard).
pub const QUEUE_DELTAS: usize = 4;

/// How long a serving server with a full queue may go without a delta
/// arriving and still hold cuts back: ten intervals, and at least 5 s (a
/// busy server's call of several megabytes; the call timeout is 10 s).
/// Beyond, it is stalled and loses deltas rather than holding every other
/// server of the stream back.
pub fn stall_bound(interval_ms: u64) -> Duration {
    Duration::from_millis(interval_ms.saturating_mul(10)).max(Duration::from_secs(5))
}

/// What became of one shard's turn to be cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Turn {
    /// Cut and queued (or nothing to do: not led, or not readable).
    Done,
    /// Not cut: a serving server that is keeping up has a full queue.
    Waiting,
}

/// Where a shard's stream stands (read under the shard's write lock).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Mark {
    /// The stream (0: none: this server does not lead the shard).
    pub stream: u64,
    /// The last delta cut.
    pub seq: u64,
    /// The epoch it leads the shard under.
    pub epoch: u64,
    /// The stream position the last delta reached.
    pub position: u64,
    /// The store's generation of change keeping the stream started under
    /// (`Store::changes_generation`): another one starts a new stream.
    pub changes: u64,
    /// The count a resize's cut-over had fenced the shard's moving keys
    /// for when the cut was made (`Store::set_moved`; 0: none): a cut to
    /// receivers of that count holds every change to the keys they get.
    pub fenced: u32,
    /// The shard-map version that fence was set at: receivers in a
    /// resize planned after it (an earlier resize to the same count was
    /// cancelled, and this copy kept its fence) do not take it for theirs.
    pub fenced_at: u64,
}

#[derive(Debug, Default)]
struct ShardCounters {
    rows: AtomicU64,
    failed: AtomicU64,
    dropped: AtomicU64,
    waited: AtomicU64,
    last_error: Mutex<String>,
}

/// The delta stream of a training server (module docs).
#[derive(Debug)]
pub struct Sender {
    store: Arc<Store>,
    replication: Arc<Replication>,
    config: DeltaConfig,
    /// This server as serving servers reach it (to copy from).
    me: String,
    marks: HashMap<u32, Mutex<Mark>>,
    counters: HashMap<u32, ShardCounters>,
    /// The serving fleet's route (`[delta]`; empty without).
    serving: Route,
    /// A resize's route, while this server gives keys to one.
    resize: Mutex<Option<Arc<Route>>>,
    /// Queues whose delivery has not started yet (before
    /// [`Sender::run`], or beside it when a resize's route changes).
    pending: Mutex<Vec<(Arc<Destination>, mpsc::Receiver<Outgoing>)>>,
    /// Told when `pending` has queues to start.
    pending_wake: Notify,
    /// Told whenever a delivery finishes a delta (a queue has room).
    room: Arc<Notify>,
    started: Instant,
    stall: Duration,
    /// What receivers' clients are made over; let go when `run` ends (a
    /// transport held by a stopped server's tasks keeps its endpoints).
    transport: Mutex<Option<Transport>>,
    channel_config: ChannelConfig,
}

impl Sender {
    /// The stream of `store`'s shards to the serving fleet `config`
    /// names, over `transport`; `me` is this server's address as the
    /// serving servers reach it.
    pub fn new(
        store: Arc<Store>,
        replication: Arc<Replication>,
        config: &DeltaConfig,
        me: String,
        transport: &Transport,
    ) -> Arc<Self> {
        let channel_config = ChannelConfig {
            // Background traffic: a busy serving server must not look dead.
            connect_timeout_ms: 1000,
            request_timeout_ms: 10_000,
            ..ChannelConfig::default()
        };
        let mut destinations = Vec::new();
        let mut pending = Vec::new();
        let depth = QUEUE_DELTAS * store.hosted().len().max(1);
        for server in &config.servers {
            let (dest, rx) =
                Destination::new(&server.address, &server.shards, config.num_shards, depth, 0);
            destinations.push(Arc::clone(&dest));
            pending.push((dest, rx));
        }
        let hosted = store.hosted().to_vec();
        Arc::new(Self {
            store,
            replication,
            config: config.clone(),
            me,
            marks: hosted.iter().map(|&s| (s, Mutex::default())).collect(),
            counters: hosted
                .iter()
                .map(|&s| (s, ShardCounters::default()))
                .collect(),
            serving: Route {
                num_shards: config.num_shards,
                whole_rows: config.optimizer_state,
                destinations,
                plan: None,
            },
            resize: Mutex::new(None),
            pending: Mutex::new(pending),
            pending_wake: Notify::new(),
            room: Arc::new(Notify::new()),
            started: Instant::now(),
            stall: stall_bound(config.interval_ms),
            transport: Mutex::new(Some(transport.clone())),
            channel_config,
        })
    }

    /// Lets go of the transport and the queues not yet delivered (the
    /// server stopped: `run` may have been aborted before its end).
    pub fn shutdown(&self) {
        self.pending.locked().clear();
        *self.transport.locked() = None;
        *self.resize.locked() = None;
    }

    /// Sends every cut also to the servers of `plan` (a resize this
    /// server gives keys to), rows whole and routed by its count; `None`
    /// stops. Servers kept from the last plan keep their queues.
    pub fn set_resize(&self, plan: Option<ResizePlan>) {
        let mut resize = self.resize.locked();
        if resize.as_ref().and_then(|r| r.plan.as_ref()) == plan.as_ref() {
            return;
        }
        let Some(plan) = plan else {
            if resize.take().is_some() {
                tracing::info!("resize stream ends");
            }
            return;
        };
        let depth = QUEUE_DELTAS * self.store.hosted().len().max(1);
        let mut destinations = Vec::new();
        let mut started = Vec::new();
        for (address, shards) in &plan.servers {
            let kept = resize.as_ref().and_then(|r| {
                (r.num_shards == plan.num_shards)
                    .then(|| {
                        r.destinations
                            .iter()
                            .find(|d| &d.address == address && &d.shards == shards)
                    })
                    .flatten()
                    .cloned()
            });
            match kept {
                Some(dest) => destinations.push(dest),
                None => {
                    let (dest, rx) =
                        Destination::new(address, shards, plan.num_shards, depth, self.now_ms());
                    destinations.push(Arc::clone(&dest));
                    started.push((dest, rx));
                }
            }
        }
        tracing::info!(num_shards = plan.num_shards, servers = ?plan.servers, "resize stream to the receiving shards' servers");
        *resize = Some(Arc::new(Route {
            num_shards: plan.num_shards,
            whole_rows: true,
            destinations,
            plan: Some(plan),
        }));
        drop(resize);
        if !started.is_empty() {
            self.pending.locked().extend(started);
            self.pending_wake.notify_one();
        }
    }

    /// Where `shard`'s stream stands. The caller holds the shard's write
    /// lock, so that the mark and what it reads of the rows agree (a copy
    /// for a serving server: `source.rs`).
    pub fn mark(&self, shard: u32) -> Mark {
        self.marks
            .get(&shard)
            .map(|m| *m.locked())
            .unwrap_or_default()
    }

    /// Each led shard's stream, for Health.
    pub fn health(&self) -> Vec<DeltaStreamHealth> {
        let mut out: Vec<DeltaStreamHealth> = self
            .marks
            .iter()
            .filter_map(|(&shard, mark)| {
                let mark = *mark.locked();
                let c = self.counters.get(&shard)?;
                (mark.stream != 0).then(|| DeltaStreamHealth {
                    shard,
                    stream: mark.stream,
                    seq: mark.seq,
                    position: mark.position,
                    rows_sent: c.rows.load(Ordering::Relaxed),
                    failed: c.failed.load(Ordering::Relaxed),
                    dropped: c.dropped.load(Ordering::Relaxed),
                    waited: c.waited.load(Ordering::Relaxed),
                    last_error: c.last_error.locked().clone(),
                })
            })
            .collect();
        out.sort_by_key(|h| h.shard);
        out
    }

    /// Cuts and sends every interval (or when a shard's changes reach
    /// `max_rows`) until `stop`.
    pub async fn run(self: Arc<Self>, stop: CancellationToken) {
        let mut deliveries = tokio::task::JoinSet::new();
        self.start_deliveries(&mut deliveries, &stop);
        let every = Duration::from_millis(self.config.interval_ms);
        let mut ticks = tokio::time::interval(every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let wake = Arc::clone(self.store.changes_wake());
        let max_rows = usize::try_from(self.config.max_rows).unwrap_or(usize::MAX);
        // Shards whose cut waits for a queue's room.
        let mut waiting: Vec<u32> = Vec::new();
        loop {
            // Every shard at the interval; woken early, those whose
            // changes reached `max_rows`, and (once a queue has room) those
            // that waited. While some wait, `max_rows` wakes are not
            // listened to: they would only find the queue still full.
            let all = tokio::select! {
                _ = ticks.tick() => true,
                () = wake.notified(), if waiting.is_empty() => false,
                () = self.room.notified(), if !waiting.is_empty() => false,
                () = self.pending_wake.notified() => {
                    self.start_deliveries(&mut deliveries, &stop);
                    continue;
                }
                () = stop.cancelled() => break,
            };
            // Deliveries whose queue is gone (a resize's server dropped)
            // have ended.
            while deliveries.try_join_next().is_some() {}
            let waited = std::mem::take(&mut waiting);
            for &shard in self.store.hosted() {
                if (all || waited.contains(&shard) || self.store.changed_rows(shard) >= max_rows)
                    && self.cut_and_send(shard).await == Turn::Waiting
                {
                    waiting.push(shard);
                }
            }
        }
        deliveries.shutdown().await;
        self.pending.locked().clear();
        *self.transport.locked() = None;
    }

    /// Starts delivering every pending queue.
    fn start_deliveries(
        self: &Arc<Self>,
        deliveries: &mut tokio::task::JoinSet<()>,
        stop: &CancellationToken,
    ) {
        let pending = std::mem::take(&mut *self.pending.locked());
        let Some(transport) = self.transport.locked().clone() else {
            return;
        };
        for (dest, rx) in pending {
            let client = DeltaClient::new(Channel::with_transport(
                &dest.address,
                self.channel_config.clone(),
                transport.clone(),
            ));
            let reports: Arc<dyn Reports> = Arc::clone(self) as Arc<Sender>;
            deliveries.spawn(super::route::deliver(
                reports,
                dest.address.clone(),
                client,
                rx,
                Arc::clone(&dest.delivery),
                stop.clone(),
            ));
        }
    }

    /// Milliseconds since the sender was made.
    pub(super) fn now_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Whether a cut should wait: some receiving server's queue is full
    /// while it keeps up (module docs).
    fn must_wait(&self, routes: &[&Route]) -> bool {
        let now_ms = self.now_ms();
        routes
            .iter()
            .flat_map(|r| &r.destinations)
            .any(|dest| dest.holds_back(now_ms, self.stall))
    }

    /// One delta of `shard`, if this server leads it: cut under the write
    /// lock, read, routed and queued; or not cut yet, when a serving
    /// server that keeps up has no room for it.
    async fn cut_and_send(&self, shard: u32) -> Turn {
        let resize = self.resize.locked().clone();
        let routes: Vec<&Route> = std::iter::once(&self.serving)
            .chain(resize.as_deref())
            .filter(|r| !r.is_empty())
            .collect();
        if routes.is_empty() {
            // Nobody to send to: no cut (the changes keep gathering where
            // they are kept at all).
            return Turn::Done;
        }
        // Only this task queues deltas, so a queue with room now still
        // has it below.
        if self.must_wait(&routes) {
            if let Some(c) = self.counters.get(&shard) {
                c.waited.fetch_add(1, Ordering::Relaxed);
            }
            metrics::counter!("tessera_ps_delta_waits_total").increment(1);
            return Turn::Waiting;
        }
        let Some((mark, mut changes)) = self.cut(shard).await else {
            return Turn::Done;
        };
        let taken_ms = unix_ms();
        for (i, route) in routes.iter().enumerate() {
            let store = Arc::clone(&self.store);
            let changes = if i + 1 == routes.len() {
                std::mem::take(&mut changes)
            } else {
                changes.clone()
            };
            let (num_shards, whole) = (route.num_shards, route.whole_rows);
            let serving = std::ptr::eq(*route, &self.serving);
            // The serving fleet gets nothing of a growth's new shard until
            // it opens (then a new stream, which it copies), and nothing of
            // the keys a resize moved away after their fence (their
            // removal here, an eviction or an expiry, is not theirs to
            // follow: their new shard's stream carries them).
            if serving && self.store.receiving(shard) {
                continue;
            }
            let owned_by = (serving && mark.fenced != 0).then_some(mark.fenced);
            let rows_of = tokio::task::spawn_blocking(move || {
                read_and_route(&store, shard, changes, num_shards, whole, owned_by)
            })
            .await;
            let (per_shard, rows, oldest_ms) = match rows_of {
                Ok(Ok(routed)) => routed,
                // Not sent: its changes would be lost. The next delta's
                // number is a gap, so every receiver copies the shard.
                Ok(Err(err)) => {
                    tracing::warn!(shard, seq = mark.seq, %err, "a delta could not be read; receivers will copy the shard");
                    continue;
                }
                Err(err) => {
                    tracing::warn!(shard, seq = mark.seq, %err, "a delta could not be read; receivers will copy the shard");
                    continue;
                }
            };
            if i == 0 {
                if let Some(c) = self.counters.get(&shard) {
                    c.rows.fetch_add(rows, Ordering::Relaxed);
                }
                metrics::counter!("tessera_ps_delta_rows_total").increment(rows);
            }
            self.queue(shard, mark, route, &per_shard, oldest_ms, taken_ms);
        }
        Turn::Done
    }

    /// Queues one cut's rows (`per_shard`: by receiving shard of the
    /// route's count) for every server of `route`.
    fn queue(
        &self,
        shard: u32,
        mark: Mark,
        route: &Route,
        per_shard: &[Vec<DeltaTable>],
        oldest_ms: u64,
        taken_ms: u64,
    ) {
        // A resize's fenced cuts carry the giving shard's deduplication
        // windows (on each delta's last part: `store/resize.rs`).
        // Fenced for this route's count (an earlier resize's fence, which
        // stays, says nothing about this one's).
        let fenced = mark.fenced != 0 && mark.fenced == route.num_shards;
        let windows = if fenced && route.whole_rows {
            crate::wire::windows_to_wire(&self.store.dedup_windows(shard))
        } else {
            Vec::new()
        };
        for dest in &route.destinations {
            let tables: Vec<DeltaTable> = per_shard
                .iter()
                .enumerate()
                .filter(|(t, _)| dest.hosts.get(*t).copied().unwrap_or(false))
                .flat_map(|(_, tables)| tables.iter().cloned())
                .collect();
            let packed = pack(tables);
            let n = packed.len();
            let parts = packed
                .into_iter()
                .enumerate()
                .map(|(i, tables)| DeltaRequest {
                    source_shard: shard,
                    source_shards: self.store.num_shards(),
                    stream: mark.stream,
                    seq: mark.seq,
                    part: i as u32,
                    last: i + 1 == n,
                    epoch: mark.epoch,
                    position: mark.position,
                    source: self.me.clone(),
                    oldest_change_unix_ms: oldest_ms,
                    taken_unix_ms: taken_ms,
                    tables,
                    optimizer_state: route.whole_rows,
                    num_shards: route.num_shards,
                    shards: dest.shards.clone(),
                    fenced,
                    fenced_at: if fenced { mark.fenced_at } else { 0 },
                    windows: if i + 1 == n {
                        windows.clone()
                    } else {
                        Vec::new()
                    },
                })
                .collect();
            if let Err(mpsc::error::TrySendError::Full(_)) =
                dest.queue.try_send(Outgoing { shard, parts })
            {
                // It is down, failing or stalled: it will see the gap and
                // copy the shard.
                if let Some(c) = self.counters.get(&shard) {
                    c.dropped.fetch_add(1, Ordering::Relaxed);
                }
                metrics::counter!("tessera_ps_delta_dropped_total").increment(1);
            }
        }
    }

    /// Cuts `shard` under its write lock: the next delta's mark and the
    /// keys changed since the last, or `None` when this server does not
    /// lead it (its stream ends).
    async fn cut(&self, shard: u32) -> Option<(Mark, Vec<(String, Taken)>)> {
        let writing = self.store.lock_shard_async(shard).await?;
        let leading = self.replication.leading_epoch(shard, Instant::now());
        let mut mark = self.marks.get(&shard)?.locked();
        let Some(epoch) = leading else {
            if mark.stream != 0 {
                tracing::info!(shard, stream = %format_args!("{:#x}", mark.stream), "delta stream ends: no longer the shard's primary");
            }
            *mark = Mark::default();
            // Changes are kept only while leading; a new term starts over.
            drop(self.store.take_changes(&writing));
            return None;
        };
        let position = writing.version().position;
        let changes = self.store.changes_generation();
        if mark.stream == 0 || mark.epoch != epoch || mark.changes != changes {
            // A new term: receivers copy the shard once, as of a cut of
            // this stream, so what changed before it need not be sent.
            *mark = Mark {
                stream: rand::random::<u64>() | 1,
                seq: 0,
                epoch,
                position,
                changes,
                fenced: 0,
                fenced_at: 0,
            };
            drop(self.store.take_changes(&writing));
            tracing::info!(shard, epoch, stream = %format_args!("{:#x}", mark.stream), "delta stream starts");
        }
        mark.seq += 1;
        mark.position = position;
        (mark.fenced, mark.fenced_at) = writing.moved().unwrap_or_default();
        Some((*mark, self.store.take_changes(&writing)))
    }
}

/// The rows of `changes` on `shard` as they are now, routed to the
/// serving shards (element `t`: the tables for serving shard `t`); the
/// rows read, and the oldest change's time.
fn read_and_route(
    store: &Store,
    shard: u32,
    changes: Vec<(String, Taken)>,
    num_shards: u32,
    with_state: bool,
    owned_by: Option<u32>,
) -> Result<(Vec<Vec<DeltaTable>>, u64, u64), tessera_store::store::StoreError> {
    let mut per_shard: Vec<Vec<DeltaTable>> = vec![Vec::new(); num_shards as usize];
    let mut rows = 0u64;
    let mut oldest = 0u64;
    for (name, mut taken) in changes {
        // Only the keys `owned_by` routes to this shard (a fence's count).
        if let Some(count) = owned_by {
            taken
                .keys
                .retain(|&k| tessera_proto::sharding::shard_for_key(k, count) == shard);
        }
        if taken.keys.is_empty() {
            continue;
        }
        if oldest == 0 || taken.oldest_ms < oldest {
            oldest = taken.oldest_ms;
        }
        let table = store
            .table(&name)
            .ok_or_else(|| tessera_store::store::StoreError::UnknownTable(name.clone()))?;
        let dim = table.config().dim as usize;
        let state_len = dim * table.config().optimizer.slots();
        let read = store.read_rows(&name, shard, &taken.keys, with_state)?;
        rows += taken.keys.len() as u64;
        for (t, tables) in route(&name, &read, dim, state_len, num_shards)
            .into_iter()
            .enumerate()
        {
            per_shard[t].extend(tables);
        }
    }
    Ok((per_shard, rows, oldest))
}

impl Reports for Sender {
    fn delivery_failed(&self, shard: u32, address: &str, err: &dyn std::fmt::Display) {
        if let Some(c) = self.counters.get(&shard) {
            c.failed.fetch_add(1, Ordering::Relaxed);
            *c.last_error.locked() = format!("{address}: {err}");
        }
        metrics::counter!("tessera_ps_delta_failed_total").increment(1);
    }

    fn now_ms(&self) -> u64 {
        Sender::now_ms(self)
    }

    fn room_made(&self) {
        self.room.notify_one();
    }
}
