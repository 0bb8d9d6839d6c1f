//! Replication of shards across replica groups.
//!
//! Each shard has one **primary**: the server of replica group
//! `shard % replica_groups` that hosts it. Workers push to the primary
//! only. The primary applies a Push and, still holding the (table, shard)
//! write lock, gives it the next position of the shard's **stream** and
//! queues it for every attached replica; a forwarder task per replica sends
//! the queue in order, in batches, and retries until the replica has it
//! (a replica skips positions it already applied, so retries are safe).
//!
//! A replica applies stream positions strictly in order. When it does not
//! know the primary's stream (it just started, or the primary restarted),
//! sees a gap, or gets a gap marker (the primary cut it off because its
//! queue passed `max_lag_pushes`), it **syncs** the shard: the primary
//! takes every table's rows of the shard between two Pushes (all the
//! shard's write locks held), notes the stream position after them,
//! re-attaches the replica from there, and the replica downloads the copy
//! in chunks and replaces its rows with it. While a shard syncs, the
//! replica refuses Fetches of it (`Unavailable`: the worker's replica set
//! reads elsewhere) and asks the primary to hold its forwards back.
//!
//! Consistency this gives: the primary's rows are the truth; a replica's
//! rows are the primary's as of some earlier stream position, lagging by
//! the forwarding queue (bounded by `max_lag_pushes`, reported as
//! `tessera_ps_replication_lag_pushes`), and equal to them once the queue
//! drains. A Fetch served by a replica may therefore miss the latest
//! Pushes (read-your-writes holds only at the primary). Pushes are applied
//! exactly once on the primary (worker ids) and in the primary's order on
//! every replica (stream positions), so replicas converge bit for bit,
//! whatever the optimizer.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tessera_proto::v1::{
    self, PushRequest, ReplicateRequest, ReplicateResponse, ReplicatedPush, ReplicationClient,
    SyncChunkRequest, SyncChunkResponse, SyncRequest, SyncResponse,
};
use tessera_rpc::{Channel, ChannelConfig, RequestContext, Status, Transport};

use crate::checkpoint::{self, ShardImage};
use crate::config::PsServerConfig;
use crate::store::{PushId, Store};

/// Bytes per `SyncChunk` answer: well under any message limit, large
/// enough that a big shard takes few round trips.
const CHUNK_BYTES: usize = 1 << 20;
/// A sync whose copy is not fetched within this long is dropped.
const SESSION_EXPIRY: Duration = Duration::from_secs(120);

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// One queued forward, with a local id to acknowledge it by. The Push is
/// shared by every replica's queue (one copy per Push, not per replica);
/// `None` is a gap marker.
#[derive(Debug, Clone)]
struct Queued {
    id: u64,
    shard: u32,
    sequence: u64,
    push: Option<Arc<PushRequest>>,
}

impl Queued {
    /// The entry as sent (prost encodes owned messages).
    fn to_wire(&self) -> ReplicatedPush {
        ReplicatedPush {
            shard: self.shard,
            sequence: self.sequence,
            push: self.push.as_deref().cloned(),
            gap: self.push.is_none(),
        }
    }
}

#[derive(Debug, Default)]
struct PeerQueue {
    entries: VecDeque<Queued>,
    /// Shards forwarded to this peer (attached by its sync).
    attached: HashSet<u32>,
    /// Attachments so far per shard: an out-of-sync answer to a batch sent
    /// before the latest attachment must not undo it.
    generation: HashMap<u32, u64>,
    next_id: u64,
}

/// The forwarding of a primary's streams to one replica.
#[derive(Debug)]
struct Forwarder {
    addr: String,
    /// Shards of this primary that the peer replicates.
    shards: Vec<u32>,
    queue: Mutex<PeerQueue>,
    wake: tokio::sync::Notify,
    client: ReplicationClient,
    cutoffs: Arc<AtomicU64>,
}

impl Forwarder {
    fn enqueue(&self, shard: u32, sequence: u64, push: &Arc<PushRequest>, max_lag: usize) {
        let mut queue = lock(&self.queue);
        if !queue.attached.contains(&shard) {
            return;
        }
        let id = queue.next_id;
        queue.next_id += 1;
        if queue.entries.len() >= max_lag {
            // Cut off: drop this shard's queue, tell the replica with a gap
            // marker, and forward nothing more until it syncs again.
            queue.entries.retain(|q| q.shard != shard);
            queue.attached.remove(&shard);
            queue.entries.push_back(Queued {
                id,
                shard,
                sequence,
                push: None,
            });
            metrics::counter!("tessera_ps_replication_cutoffs_total").increment(1);
            self.cutoffs.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(peer = %self.addr, shard, max_lag, "replica lags too far; cut off until it syncs");
        } else {
            queue.entries.push_back(Queued {
                id,
                shard,
                sequence,
                push: Some(Arc::clone(push)),
            });
        }
        drop(queue);
        self.wake.notify_one();
    }

    /// Re-attaches `shard` after a sync: its old entries are in the copy.
    fn attach(&self, shard: u32) {
        let mut queue = lock(&self.queue);
        queue.entries.retain(|q| q.shard != shard);
        queue.attached.insert(shard);
        *queue.generation.entry(shard).or_default() += 1;
    }

    /// Stops forwarding `shards`, unless one was re-attached since `seen`
    /// (the generations when the answered batch was taken): the replica
    /// may have synced before its out-of-sync answer arrived here.
    fn detach(&self, shards: &[u32], seen: &HashMap<u32, u64>) {
        let mut queue = lock(&self.queue);
        let stale: Vec<u32> = shards
            .iter()
            .copied()
            .filter(|s| queue.generation.get(s) == seen.get(s))
            .collect();
        queue.entries.retain(|q| !stale.contains(&q.shard));
        for shard in &stale {
            queue.attached.remove(shard);
        }
    }

    fn lag(&self) -> usize {
        lock(&self.queue).entries.len()
    }

    async fn run(self: Arc<Self>, stream_id: u64, batch: usize) {
        let mut backoff = Duration::from_millis(50);
        loop {
            let wake = self.wake.notified();
            let (pending, generations): (Vec<Queued>, HashMap<u32, u64>) = {
                let queue = lock(&self.queue);
                (
                    queue.entries.iter().take(batch).cloned().collect(),
                    queue.generation.clone(),
                )
            };
            metrics::gauge!("tessera_ps_replication_lag_pushes", "peer" => self.addr.clone())
                .set(self.lag() as f64);
            if pending.is_empty() {
                wake.await;
                continue;
            }
            let request = ReplicateRequest {
                stream_id,
                pushes: pending.iter().map(Queued::to_wire).collect(),
            };
            match self.client.replicate(request).await {
                Ok(answer) => {
                    backoff = Duration::from_millis(50);
                    self.acknowledge(&pending, &answer, &generations);
                    if answer.syncing && answer.processed == 0 {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
                Err(err) => {
                    tracing::debug!(peer = %self.addr, %err, "forwarding failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
            }
        }
    }

    fn acknowledge(
        &self,
        sent: &[Queued],
        answer: &ReplicateResponse,
        generations: &HashMap<u32, u64>,
    ) {
        let done = (answer.processed as usize).min(sent.len());
        let mut queue = lock(&self.queue);
        if let Some(last) = done.checked_sub(1).map(|i| sent[i].id) {
            while queue.entries.front().is_some_and(|q| q.id <= last) {
                queue.entries.pop_front();
            }
        }
        drop(queue);
        if !answer.out_of_sync.is_empty() {
            tracing::info!(peer = %self.addr, shards = ?answer.out_of_sync, "replica out of sync; it will copy the shards again");
            self.detach(&answer.out_of_sync, generations);
        }
    }
}

/// A replica's view of one shard's stream.
#[derive(Debug, Default)]
struct ReplicaShard {
    /// The primary stream it follows (0: none yet).
    stream_id: u64,
    /// The next stream position to apply.
    expected: u64,
    /// A copy from the primary is in progress.
    syncing: bool,
}

/// One shard this server replicates.
#[derive(Debug)]
struct ReplicaEntry {
    state: Mutex<ReplicaShard>,
    /// Rows match the primary's as of `state.expected`: read by every Fetch
    /// of the shard without the lock, written under it.
    synced: AtomicBool,
    /// A client of the shard's primary.
    primary: ReplicationClient,
}

/// A copy of a shard waiting to be fetched.
#[derive(Debug)]
struct Session {
    data: Bytes,
    created: Instant,
}

/// The replication state of one server (module docs).
#[derive(Debug)]
pub struct Replication {
    store: Arc<Store>,
    advertised: String,
    stream_id: u64,
    max_lag: usize,
    batch: usize,
    /// Stream positions of the shards this server is primary of.
    streams: HashMap<u32, Mutex<u64>>,
    forwarders: Vec<Arc<Forwarder>>,
    /// The shards this server replicates, and a client of each one's primary.
    replicas: HashMap<u32, ReplicaEntry>,
    sessions: Mutex<HashMap<u64, Session>>,
    next_session: AtomicU64,
    /// Copies of a shard this server made from a primary.
    syncs: AtomicU64,
    /// Replicas this server cut off for lagging.
    cutoffs: Arc<AtomicU64>,
}

impl Replication {
    /// The replication of `store` as `config` lays it out; peers are
    /// reached over `transport`.
    pub fn new(store: Arc<Store>, config: &PsServerConfig, transport: &Transport) -> Self {
        let channel_config = ChannelConfig {
            // Background traffic between servers: a slow peer must not
            // look dead.
            connect_timeout_ms: 1000,
            request_timeout_ms: 30_000,
            ..ChannelConfig::default()
        };
        let client = |addr: &str| {
            ReplicationClient::new(Channel::with_transport(
                addr,
                channel_config.clone(),
                transport.clone(),
            ))
        };
        let primary_shards: Vec<u32> = config
            .shards
            .iter()
            .copied()
            .filter(|&s| config.is_primary(s))
            .collect();
        let cutoffs = Arc::new(AtomicU64::new(0));
        let forwarders = config
            .peers
            .iter()
            .filter_map(|peer| {
                let shards: Vec<u32> = peer
                    .shards
                    .iter()
                    .copied()
                    .filter(|s| primary_shards.contains(s))
                    .collect();
                (!shards.is_empty()).then(|| {
                    Arc::new(Forwarder {
                        addr: peer.address.clone(),
                        shards,
                        queue: Mutex::new(PeerQueue::default()),
                        wake: tokio::sync::Notify::new(),
                        client: client(&peer.address),
                        cutoffs: Arc::clone(&cutoffs),
                    })
                })
            })
            .collect();
        let replicas = config
            .shards
            .iter()
            .filter(|&&s| !config.is_primary(s))
            .filter_map(|&shard| {
                let primary = config.primary_group(shard);
                let peer = config
                    .peers
                    .iter()
                    .find(|p| p.replica_group == primary && p.shards.contains(&shard))?;
                Some((
                    shard,
                    ReplicaEntry {
                        state: Mutex::new(ReplicaShard::default()),
                        synced: AtomicBool::new(false),
                        primary: client(&peer.address),
                    },
                ))
            })
            .collect();
        Self {
            store,
            advertised: config.advertised().to_owned(),
            stream_id: rand::random::<u64>().max(1),
            max_lag: config.replication.max_lag_pushes,
            batch: config.replication.batch_pushes,
            streams: primary_shards.iter().map(|&s| (s, Mutex::new(1))).collect(),
            forwarders,
            replicas,
            sessions: Mutex::new(HashMap::new()),
            next_session: AtomicU64::new(rand::random::<u64>() | 1),
            syncs: AtomicU64::new(0),
            cutoffs,
        }
    }

    /// Whether this server takes Pushes for `shard`.
    pub fn is_primary(&self, shard: u32) -> bool {
        self.streams.contains_key(&shard)
    }

    /// The shards this server is primary of.
    pub fn primary_shards(&self) -> Vec<u32> {
        let mut shards: Vec<u32> = self.streams.keys().copied().collect();
        shards.sort_unstable();
        shards
    }

    /// Whether Fetches of `shard` may be served (a replica shard that is
    /// being copied is not).
    pub fn readable(&self, shard: u32) -> bool {
        self.replicas
            .get(&shard)
            .is_none_or(|entry| entry.synced.load(Ordering::Acquire))
    }

    /// Whether every replica shard is in step with its primary's stream.
    pub fn caught_up(&self) -> bool {
        self.replicas
            .values()
            .all(|entry| entry.synced.load(Ordering::Acquire))
    }

    /// Shard copies this server made from its primaries.
    pub fn syncs(&self) -> u64 {
        self.syncs.load(Ordering::Relaxed)
    }

    /// Times this server cut a lagging replica off.
    pub fn cutoffs(&self) -> u64 {
        self.cutoffs.load(Ordering::Relaxed)
    }

    /// Gives `push` (just applied to `shard`, under its write lock) its
    /// stream position and queues it for the replicas.
    pub fn forward(&self, shard: u32, push: &PushRequest) {
        let Some(stream) = self.streams.get(&shard) else {
            return;
        };
        let mut next = lock(stream);
        let sequence = *next;
        *next += 1;
        let mut shared = None;
        for forwarder in &self.forwarders {
            if forwarder.shards.contains(&shard) {
                let push = shared.get_or_insert_with(|| Arc::new(push.clone()));
                forwarder.enqueue(shard, sequence, push, self.max_lag);
            }
        }
    }

    /// Starts the forwarders and the first sync of every replica shard.
    pub fn start(self: &Arc<Self>) -> Vec<tokio::task::JoinHandle<()>> {
        let mut tasks: Vec<_> = self
            .forwarders
            .iter()
            .map(|f| tokio::spawn(Arc::clone(f).run(self.stream_id, self.batch)))
            .collect();
        for &shard in self.replicas.keys() {
            if let Some(task) = self.spawn_sync(shard) {
                tasks.push(task);
            }
        }
        tasks
    }

    /// Copies `shard` from its primary in the background, unless a copy
    /// is already running.
    fn spawn_sync(self: &Arc<Self>, shard: u32) -> Option<tokio::task::JoinHandle<()>> {
        let entry = self.replicas.get(&shard)?;
        {
            let mut state = lock(&entry.state);
            if state.syncing {
                return None;
            }
            state.syncing = true;
            entry.synced.store(false, Ordering::Release);
        }
        let this = Arc::clone(self);
        Some(tokio::spawn(async move {
            let mut backoff = Duration::from_millis(100);
            loop {
                match this.sync_once(shard).await {
                    Ok(()) => return,
                    Err(err) => {
                        tracing::info!(shard, %err, "copying the shard from its primary failed; retrying");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(2));
                    }
                }
            }
        }))
    }

    async fn sync_once(&self, shard: u32) -> Result<(), String> {
        let Some(entry) = self.replicas.get(&shard) else {
            return Ok(());
        };
        let primary = &entry.primary;
        let started = Instant::now();
        let session = primary
            .sync(SyncRequest {
                shard,
                replica: self.advertised.clone(),
            })
            .await
            .map_err(|e| e.to_string())?;
        let mut data = Vec::with_capacity(session.total_bytes.min(1 << 30) as usize);
        while (data.len() as u64) < session.total_bytes {
            let chunk = primary
                .sync_chunk(SyncChunkRequest {
                    session: session.session,
                    offset: data.len() as u64,
                })
                .await
                .map_err(|e| e.to_string())?;
            if chunk.data.is_empty() {
                return Err("the primary sent an empty chunk".into());
            }
            data.extend_from_slice(&chunk.data);
        }
        let images = self.decode_copy(&data)?;
        let now = Instant::now();
        let rows: usize = images.iter().map(|(_, image)| image.rows.len()).sum();
        for (table, image) in images {
            if let Some(table) = self.store.table(&table) {
                table.replace(shard, image, now);
            }
        }
        let mut state = lock(&entry.state);
        state.stream_id = session.stream_id;
        state.expected = session.next_sequence;
        state.syncing = false;
        entry.synced.store(true, Ordering::Release);
        metrics::counter!("tessera_ps_replication_syncs_total").increment(1);
        self.syncs.fetch_add(1, Ordering::Relaxed);
        tracing::info!(shard, rows, bytes = data.len(), took = ?started.elapsed(), "shard copied from its primary");
        Ok(())
    }

    /// Every table's rows of `shard` as one blob — per table (by name):
    /// the name's length and bytes, the image's length and bytes
    /// ([`checkpoint::encode`]) — taken between two Pushes, and the stream
    /// position of the next Push; `forwarder` is re-attached at exactly
    /// that point.
    fn copy_and_attach(&self, shard: u32, forwarder: &Forwarder) -> (Vec<u8>, u64) {
        let mut tables: Vec<_> = self.store.tables().collect();
        tables.sort_by(|a, b| a.config().name.cmp(&b.config().name));
        // Every table's write lock of the shard, in name order (Pushes take
        // one at a time, so this cannot deadlock): no Push is half applied,
        // and none takes a stream position until they are released.
        let guards: Vec<_> = tables
            .iter()
            .filter_map(|t| t.shard(shard).map(|s| s.lock_writes()))
            .collect();
        let files: Vec<_> = tables
            .iter()
            .map(|t| (t, checkpoint::encode_locked(t, shard).0))
            .collect();
        let next_sequence = self.streams.get(&shard).map_or(0, |stream| *lock(stream));
        forwarder.attach(shard);
        drop(guards);
        let mut blob = Vec::with_capacity(files.iter().map(|(_, f)| f.len() + 64).sum());
        for (table, bytes) in files {
            let name = &table.config().name;
            blob.extend_from_slice(&(name.len() as u32).to_le_bytes());
            blob.extend_from_slice(name.as_bytes());
            blob.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
            blob.extend_from_slice(&bytes);
        }
        (blob, next_sequence)
    }

    fn decode_copy(&self, mut data: &[u8]) -> Result<Vec<(String, ShardImage)>, String> {
        let mut out = Vec::new();
        let take = |n: usize, data: &mut &[u8]| -> Result<Vec<u8>, String> {
            if data.len() < n {
                return Err("the copy is truncated".into());
            }
            let (head, rest) = data.split_at(n);
            *data = rest;
            Ok(head.to_vec())
        };
        while !data.is_empty() {
            let len = u32::from_le_bytes(take(4, &mut data)?.try_into().map_err(|_| "bad length")?)
                as usize;
            let name = String::from_utf8(take(len, &mut data)?).map_err(|e| e.to_string())?;
            let len = u64::from_le_bytes(take(8, &mut data)?.try_into().map_err(|_| "bad length")?)
                as usize;
            let bytes = take(len, &mut data)?;
            let table = self
                .store
                .table(&name)
                .ok_or_else(|| format!("the primary has a table `{name}` this server lacks"))?;
            let config = table.config();
            let image = checkpoint::decode(&bytes, config.dim, config.optimizer.slots() as u32)?;
            out.push((name, image));
        }
        Ok(out)
    }

    fn expire_sessions(&self) {
        let now = Instant::now();
        lock(&self.sessions)
            .retain(|_, s| now.saturating_duration_since(s.created) < SESSION_EXPIRY);
    }
}

/// The `Replication` RPC service of a server.
#[derive(Debug, Clone)]
pub struct ReplicationService {
    replication: Arc<Replication>,
}

impl ReplicationService {
    /// The service of `replication`.
    pub fn new(replication: Arc<Replication>) -> Self {
        Self { replication }
    }
}

impl v1::Replication for ReplicationService {
    async fn replicate(
        &self,
        _context: RequestContext,
        request: ReplicateRequest,
    ) -> Result<ReplicateResponse, Status> {
        let r = &self.replication;
        let mut answer = ReplicateResponse::default();
        let mut resync = Vec::new();
        for entry in &request.pushes {
            let Some(replica) = r.replicas.get(&entry.shard) else {
                // Not a replica of it (configuration changed): stop the
                // primary forwarding it here.
                if !answer.out_of_sync.contains(&entry.shard) {
                    answer.out_of_sync.push(entry.shard);
                }
                answer.processed += 1;
                continue;
            };
            let mut state = lock(&replica.state);
            if answer.out_of_sync.contains(&entry.shard) {
                answer.processed += 1;
                continue;
            }
            if state.syncing {
                answer.syncing = true;
                break;
            }
            let in_step = replica.synced.load(Ordering::Acquire)
                && state.stream_id == request.stream_id
                && !entry.gap;
            if in_step && entry.sequence < state.expected {
                // Already applied (a retried batch).
                answer.processed += 1;
                continue;
            }
            if !in_step || entry.sequence != state.expected {
                replica.synced.store(false, Ordering::Release);
                answer.out_of_sync.push(entry.shard);
                resync.push(entry.shard);
                metrics::counter!("tessera_ps_replication_out_of_sync_total").increment(1);
                answer.processed += 1;
                continue;
            }
            if let Some(push) = &entry.push
                && let Err(err) = r.store.push(
                    &push.table,
                    push.shard,
                    &push.keys,
                    &push.gradients,
                    PushId {
                        worker: push.worker_id,
                        sequence: push.sequence,
                    },
                )
            {
                // The primary applied it, so this replica's configuration
                // differs from the primary's; counted and logged, the
                // stream goes on.
                metrics::counter!("tessera_ps_replication_apply_failures_total").increment(1);
                tracing::error!(shard = entry.shard, %err, "a forwarded push was refused here");
            }
            state.expected += 1;
            answer.processed += 1;
        }
        for shard in resync {
            r.spawn_sync(shard);
        }
        Ok(answer)
    }

    async fn sync(
        &self,
        _context: RequestContext,
        request: SyncRequest,
    ) -> Result<SyncResponse, Status> {
        let r = &self.replication;
        if !r.is_primary(request.shard) {
            return Err(Status::failed_precondition(format!(
                "this server is not the primary of shard {}",
                request.shard
            )));
        }
        let forwarder = r
            .forwarders
            .iter()
            .find(|f| f.addr == request.replica && f.shards.contains(&request.shard))
            .ok_or_else(|| {
                Status::failed_precondition(format!(
                    "{} is not a configured replica of shard {} here",
                    request.replica, request.shard
                ))
            })?;
        r.expire_sessions();
        let (blob, next_sequence) = r.copy_and_attach(request.shard, forwarder);
        let session = r.next_session.fetch_add(2, Ordering::Relaxed);
        let total_bytes = blob.len() as u64;
        lock(&r.sessions).insert(
            session,
            Session {
                data: Bytes::from(blob),
                created: Instant::now(),
            },
        );
        tracing::info!(shard = request.shard, replica = %request.replica, total_bytes, next_sequence, "replica attached; copy ready");
        Ok(SyncResponse {
            session,
            stream_id: r.stream_id,
            next_sequence,
            total_bytes,
        })
    }

    async fn sync_chunk(
        &self,
        _context: RequestContext,
        request: SyncChunkRequest,
    ) -> Result<SyncChunkResponse, Status> {
        let mut sessions = lock(&self.replication.sessions);
        let session = sessions
            .get(&request.session)
            .ok_or_else(|| Status::not_found(format!("no sync session {:#x}", request.session)))?;
        let start = (request.offset as usize).min(session.data.len());
        let end = (start + CHUNK_BYTES).min(session.data.len());
        let data = session.data.slice(start..end);
        if end == session.data.len() {
            sessions.remove(&request.session);
        }
        Ok(SyncChunkResponse { data })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn forwarder() -> Forwarder {
        Forwarder {
            addr: "127.0.0.1:1".into(),
            shards: vec![0, 1],
            queue: Mutex::new(PeerQueue::default()),
            wake: tokio::sync::Notify::new(),
            client: ReplicationClient::new(
                Channel::lazy("127.0.0.1:1", ChannelConfig::default()).unwrap(),
            ),
            cutoffs: Arc::new(AtomicU64::new(0)),
        }
    }

    fn push() -> Arc<PushRequest> {
        Arc::new(PushRequest::default())
    }

    #[test]
    fn an_old_out_of_sync_answer_does_not_undo_a_newer_attachment() {
        let f = forwarder();
        f.attach(0);
        let before = lock(&f.queue).generation.clone();
        // The replica synced again (attach) before its earlier out-of-sync
        // answer was processed: forwarding must go on.
        f.attach(0);
        f.detach(&[0], &before);
        f.enqueue(0, 7, &push(), 100);
        assert_eq!(f.lag(), 1, "still attached");
        // An answer about the current attachment does detach.
        let now = lock(&f.queue).generation.clone();
        f.detach(&[0], &now);
        assert_eq!(f.lag(), 0, "queue of the shard dropped");
        f.enqueue(0, 8, &push(), 100);
        assert_eq!(f.lag(), 0, "detached: nothing queued");
    }

    #[test]
    fn a_lagging_replica_is_cut_off_with_a_gap_marker() {
        let f = forwarder();
        f.attach(0);
        f.attach(1);
        for seq in 1..=3 {
            f.enqueue(0, seq, &push(), 3);
        }
        f.enqueue(1, 1, &push(), 10);
        // The queue is at 4 >= 3: the next Push of shard 0 cuts it off.
        f.enqueue(0, 4, &push(), 3);
        let queue = lock(&f.queue);
        let shard0: Vec<_> = queue.entries.iter().filter(|q| q.shard == 0).collect();
        assert_eq!(shard0.len(), 1);
        assert!(shard0[0].push.is_none() && shard0[0].sequence == 4);
        assert!(shard0[0].to_wire().gap);
        assert!(!queue.attached.contains(&0) && queue.attached.contains(&1));
        assert_eq!(f.cutoffs.load(Ordering::Relaxed), 1);
    }
}
