//! The `ParameterServer` RPC service over a [`Store`].

use std::sync::Arc;
use std::time::Instant;

use tessera_proto::v1::{
    self, FetchRequest, FetchResponse, HealthRequest, HealthResponse, PushRequest, PushResponse,
    TableInfo,
};
use tessera_rpc::{RequestContext, Status};

use crate::config::Mode;
use crate::replication::Replication;
use tessera_store::store::{ErrorKind, PushId, Store, StoreError};

/// The status a store's refusal is answered with.
pub(crate) fn store_status(err: StoreError) -> Status {
    let message = err.to_string();
    if let Some((shard, num_shards, map_version)) = err.moved_to() {
        return keys_moved(message, shard, num_shards, map_version);
    }
    match err.kind() {
        ErrorKind::NotFound => Status::not_found(message),
        ErrorKind::InvalidArgument => Status::invalid_argument(message),
        ErrorKind::Unavailable => Status::unavailable(message),
        ErrorKind::FailedPrecondition => Status::failed_precondition(message),
        ErrorKind::ResourceExhausted => Status::resource_exhausted(message),
        // `moved_to` names every moved refusal.
        ErrorKind::Moved | ErrorKind::Internal => Status::internal(message),
    }
}

/// `ABORTED` with a `KeysMoved`: the keys are routed by `num_shards` now
/// (the worker splits the request anew).
fn keys_moved(message: String, shard: u32, num_shards: u32, map_version: u64) -> Status {
    Status::with_details(
        tessera_rpc::Code::Aborted,
        message,
        prost::Message::encode_to_vec(&v1::KeysMoved {
            shard,
            num_shards,
            map_version,
        }),
    )
}

/// Serves Fetch, Push and Health from a shared [`Store`]; Pushes are
/// taken for the shards this server is primary of and forwarded to their
/// replicas.
#[derive(Debug, Clone)]
pub struct PsService {
    store: Arc<Store>,
    replica_group: u32,
    replication: Arc<Replication>,
    coordinator: &'static str,
    /// The configured transport, as Health reports it.
    transport: &'static str,
    /// The checkpoints, as Health reports them.
    checkpoints: Option<Arc<crate::admin::Checkpointer>>,
    /// A serving server's feed (freshness, Fetch refusals).
    feed: Option<Arc<crate::delta::Feed>>,
    /// A training server's delta stream, as Health reports it.
    sender: Option<Arc<crate::delta::Sender>>,
    /// The cluster's shard map as the coordination last read it.
    shard_map: Option<tokio::sync::watch::Receiver<Option<tessera_coord::ShardMap>>>,
}

impl PsService {
    /// A service over `store`, reporting `replica_group`, the
    /// `coordinator` kind, the transport and how the checkpoints go
    /// (`checkpoints`, when the server has a checkpoint directory) in
    /// Health.
    pub fn new(
        store: Arc<Store>,
        replica_group: u32,
        replication: Arc<Replication>,
        coordinator: &'static str,
        transport: &'static str,
        checkpoints: Option<Arc<crate::admin::Checkpointer>>,
    ) -> Self {
        Self {
            store,
            replica_group,
            replication,
            coordinator,
            transport,
            checkpoints,
            feed: None,
            sender: None,
            shard_map: None,
        }
    }

    /// With the cluster's shard map as the coordination follows it.
    pub fn with_shard_map(
        mut self,
        shard_map: tokio::sync::watch::Receiver<Option<tessera_coord::ShardMap>>,
    ) -> Self {
        self.shard_map = Some(shard_map);
        self
    }

    /// With the delta stream's ends: a serving server's `feed`, a
    /// training server's `sender`.
    pub fn with_delta(
        mut self,
        feed: Option<Arc<crate::delta::Feed>>,
        sender: Option<Arc<crate::delta::Sender>>,
    ) -> Self {
        self.feed = feed;
        self.sender = sender;
        self
    }
}

impl v1::ParameterServer for PsService {
    async fn fetch(
        &self,
        context: RequestContext,
        request: FetchRequest,
    ) -> Result<FetchResponse, Status> {
        refuse_receiving(&self.store, request.shard)?;
        if self.store.hosted().contains(&request.shard) && !self.replication.readable(request.shard)
        {
            return Err(Status::unavailable(format!(
                "shard {} has no complete copy here yet (it is being copied, or recovered)",
                request.shard
            )));
        }
        if let Some(feed) = &self.feed
            && !feed.fresh()
        {
            metrics::counter!("tessera_ps_serving_stale_fetches_total").increment(1);
            let bound = feed.max_delay().unwrap_or_default();
            return Err(Status::unavailable(match feed.delay() {
                Some(delay) => format!(
                    "this serving copy is {delay:?} behind its training fleet (serving.max_delay_ms = {})",
                    bound.as_millis()
                ),
                None => format!(
                    "this serving copy is not in step with every training shard yet (copying, or not heard from; serving.max_delay_ms = {})",
                    bound.as_millis()
                ),
            }));
        }
        // The rows are written straight into a send-pool buffer, which then
        // goes out as its own part of the response: no copy after this one.
        // Every limit (keys, their shard, the answer's size) is checked
        // once, before the allocation: one request cannot make the server
        // reserve more than a message.
        let checked = self
            .store
            .check_fetch(&request.table, request.shard, &request.keys)
            .map_err(store_status)?;
        let len = checked.bytes();
        let mut values = context.send_pool.alloc(len).map_err(|err| {
            Status::resource_exhausted(format!("no memory for {len} bytes of rows: {err}"))
        })?;
        values.set_len(len);
        let dim = checked.fetch_into(&mut values).map_err(store_status)?;
        Ok(FetchResponse {
            dim,
            values: values.freeze(),
        })
    }

    async fn push(
        &self,
        _context: RequestContext,
        request: PushRequest,
    ) -> Result<PushResponse, Status> {
        let request = screen_push(&self.store, request)?;
        let checked = self
            .store
            .check_push(
                &request.table,
                request.shard,
                &request.keys,
                &request.gradients,
                PushId {
                    worker: request.worker_id,
                    sequence: request.sequence,
                },
            )
            .map_err(store_status)?
            .split_by(request.num_shards);
        // Admission, application and the stream position under the
        // shard's write lock: Pushes take their positions in the order they
        // change the rows, and no role change falls between.
        let (outcome, epoch, ticket) = {
            let mut writing = self
                .store
                .lock_shard_async(request.shard)
                .await
                .ok_or_else(|| StoreError::ShardNotHosted {
                    shard: request.shard,
                    hosted: self.store.hosted().to_vec(),
                })
                .map_err(store_status)?;
            // The time of admission is taken under the lock: waiting for it
            // (behind a copy of the shard) must not age the fence check.
            let now = Instant::now();
            let epoch = self.replication.admit_push(request.shard, now)?;
            let outcome = checked.apply(&writing, now).map_err(store_status)?;
            let ticket = if outcome.duplicate {
                self.replication
                    .duplicate_ticket(request.shard, epoch, writing.version())
            } else {
                let version = writing.version().next(epoch);
                writing.set_version(version);
                self.replication
                    .record_push(request.shard, version, &request, &outcome)
            };
            (outcome, epoch, ticket)
        };
        self.replication.confirmed(ticket).await?;
        Ok(PushResponse {
            applied: u32::try_from(outcome.applied).unwrap_or(u32::MAX),
            duplicate: outcome.duplicate,
            epoch,
            replica_wait_ms: u32::try_from(self.replication.replica_wait().as_millis())
                .unwrap_or(u32::MAX),
        })
    }

    async fn health(
        &self,
        _context: RequestContext,
        _request: HealthRequest,
    ) -> Result<HealthResponse, Status> {
        let mut tables: Vec<TableInfo> = self
            .store
            .tables()
            .map(|t| {
                // One walk over the stripes for both figures.
                let bytes = t.bytes();
                let (candidates, admitted, sketch) = t
                    .shards()
                    .map(|(_, s)| s.admission_counts())
                    .fold((0, 0, 0), |a, b| (a.0 + b.0, a.1 + b.1, a.2 + b.2));
                TableInfo {
                    name: t.config().name.clone(),
                    dim: t.config().dim,
                    rows: bytes.rows,
                    store_bytes: bytes.total(),
                    storage: t.config().storage.name().to_owned(),
                    rows_admitted: admitted,
                    admission_candidates: candidates,
                    admission_bytes: sketch,
                    rows_expired: t.expired(),
                }
            })
            .collect();
        tables.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(HealthResponse {
            serving: self.replication.caught_up(),
            state: self.replication.server_state() as i32,
            primary_shards: self.replication.primary_shards(),
            shard_health: self.replication.shard_health(),
            coordinator: self.coordinator.to_owned(),
            transport: self.transport.to_owned(),
            num_shards: self.store.num_shards(),
            shards: self.store.hosted().to_vec(),
            replica_group: self.replica_group,
            mode: match self.store.mode() {
                Mode::Training => v1::Mode::Training,
                Mode::Inference => v1::Mode::Inference,
                Mode::Serving => v1::Mode::Serving,
            } as i32,
            tables,
            checkpoint: self.checkpoints.as_ref().map(|c| c.health()),
            delta_streams: self.sender.as_ref().map(|s| s.health()).unwrap_or_default(),
            serving_feed: self
                .feed
                .as_ref()
                .filter(|f| f.is_open())
                .map(|f| f.health()),
            shard_map: self
                .shard_map
                .as_ref()
                .and_then(|m| m.borrow().as_ref().map(shard_map_health)),
        })
    }
}

/// A shard that receives its keys in a resize is not served until the
/// resize's cut-over: `UNAVAILABLE`, which callers try elsewhere.
/// A Push part retried across a resize's cut-over, first sent split by
/// the old count: the keys whose old shard applied it before the fence
/// are left out (`store/resize.rs`); the rest is applied, and the part is
/// recorded here as applied. Gradients that do not fit the keys are left
/// for the Push's own checks to refuse.
/// What a Push meets before its checks, as the resize has it: refused on a
/// shard still receiving its keys, or split by the count a shrink goes to
/// before this copy opened (refused before the windows are read, which
/// the opening sets before it lets such Pushes in, `store/resize.rs`);
/// otherwise its keys a giving shard applied it to before the cut-over
/// are left out. The control-plane simulation screens its Pushes here too.
pub(crate) fn screen_push(store: &Store, request: PushRequest) -> Result<PushRequest, Status> {
    refuse_receiving(store, request.shard)?;
    if let Some(to) = store.incoming(request.shard)
        && request.num_shards == to
    {
        return Err(store_status(StoreError::NotCutOver {
            shard: request.shard,
            split_by: to,
            num_shards: store.route_count(request.shard),
        }));
    }
    without_applied_at_origins(store, request)
}

fn without_applied_at_origins(store: &Store, request: PushRequest) -> Result<PushRequest, Status> {
    let id = PushId {
        worker: request.worker_id,
        sequence: request.sequence,
    };
    let Some(mask) = store
        .applied_at_origins(&request.table, request.shard, &request.keys, id)
        .map_err(store_status)?
    else {
        return Ok(request);
    };
    let n = request.keys.len();
    let row = request.gradients.len().checked_div(n).unwrap_or(0);
    if n == 0 || row * n != request.gradients.len() {
        return Ok(request);
    }
    let mut keys = Vec::with_capacity(n);
    let mut gradients = Vec::with_capacity(request.gradients.len());
    for (i, (&key, &applied)) in request.keys.iter().zip(&mask).enumerate() {
        if !applied {
            keys.push(key);
            gradients.extend_from_slice(&request.gradients[i * row..(i + 1) * row]);
        }
    }
    metrics::counter!("tessera_ps_resize_retried_keys_left_out_total")
        .increment((n - keys.len()) as u64);
    Ok(PushRequest {
        keys,
        gradients: gradients.into(),
        ..request
    })
}

fn refuse_receiving(store: &Store, shard: u32) -> Result<(), Status> {
    if store.receiving(shard) {
        return Err(Status::unavailable(format!(
            "shard {shard} receives its keys in a resize of the cluster (copying them from the old shards); it is served from the cut-over on"
        )));
    }
    Ok(())
}

/// The shard map as Health reports it.
fn shard_map_health(map: &tessera_coord::ShardMap) -> v1::ShardMapHealth {
    use tessera_coord::ResizeState as S;
    let mut health = v1::ShardMapHealth {
        version: map.version,
        num_shards: map.num_shards,
        ..v1::ShardMapHealth::default()
    };
    if let Some(r) = &map.resize {
        health.resize_state = match r.state {
            S::Planned => v1::ResizeState::Planned,
            S::Copying => v1::ResizeState::Copying,
            S::CutOver => v1::ResizeState::CutOver,
            S::Done => v1::ResizeState::Done,
            S::Cancelled => v1::ResizeState::Cancelled,
        } as i32;
        health.resize_from = r.from;
        health.resize_to = r.to;
        health.ready.clone_from(&r.ready);
        health.resize_id = r.id;
        health.hold = r.hold;
        health.opened = r.opened.keys().copied().collect();
    }
    health
}
