//! The `Replication` RPC service of a server: forwarded Pushes, shard
//! copies, and what a server holds of a shard.

use std::sync::Arc;

use tessera_proto::v1::{
    self, ReplicateRequest, ReplicateResponse, ShardStatusRequest, ShardStatusResponse,
    SyncChunkRequest, SyncChunkResponse, SyncRequest, SyncResponse,
};
use tessera_rpc::{RequestContext, Status};

use super::Replication;
use super::shard::Role;
use super::sync;
use tessera_store::copy_stream::CopySource;

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
        Ok(self.replication.handle_replicate(&request))
    }

    async fn sync(
        &self,
        _context: RequestContext,
        request: SyncRequest,
    ) -> Result<SyncResponse, Status> {
        // A copy takes the shard's write lock (briefly, behind any Push in
        // flight): off the async threads.
        let replication = Arc::clone(&self.replication);
        tokio::task::spawn_blocking(move || replication.serve_sync(&request))
            .await
            .map_err(|err| Status::internal(format!("copying the shard failed: {err}")))?
    }

    async fn sync_chunk(
        &self,
        _context: RequestContext,
        request: SyncChunkRequest,
    ) -> Result<SyncChunkResponse, Status> {
        if request.release {
            self.replication.sessions.release(request.session);
            return Ok(SyncChunkResponse::default());
        }
        let source = self.replication.sessions.source(request.session)?;
        // A megabyte of rows to encode: off the async threads, which serve
        // Fetches meanwhile.
        let data = tokio::task::spawn_blocking(move || sync::encode_chunk(&source, request.offset))
            .await
            .map_err(|err| Status::internal(format!("encoding a copy chunk failed: {err}")))?;
        Ok(SyncChunkResponse { data })
    }

    async fn shard_status(
        &self,
        _context: RequestContext,
        request: ShardStatusRequest,
    ) -> Result<ShardStatusResponse, Status> {
        Ok(self.replication.shard_status(request.shard))
    }
}

impl Replication {
    /// Answers a `Sync`: with `attach`, as the shard's primary, attaching
    /// the caller from the copy (none when it is in step already);
    /// without, a copy for a new primary, from any server holding one.
    fn serve_sync(&self, request: &SyncRequest) -> Result<SyncResponse, Status> {
        let shard = request.shard;
        let (Some(cell), Some(writing)) = (self.cell(shard), self.store.lock_shard(shard)) else {
            return Err(Status::failed_precondition(format!(
                "shard {shard} is not hosted here"
            )));
        };
        let state = cell.lock();
        let caller = crate::wire::version_from_wire(request.version.unwrap_or_default());
        let version = writing.version();
        let mut attachment = 0;
        if caller > version {
            // A replica never copies from an older copy.
            metrics::counter!("tessera_ps_replication_newer_replicas_total").increment(1);
            tracing::error!(shard, replica = %request.replica, replica_version = %caller, version = %version, "a replica holds a newer copy than this server");
            return Err(Status::failed_precondition(format!(
                "the caller's copy of shard {shard} ({caller}) is newer than this server's ({version})"
            )));
        }
        let epoch = if request.attach {
            let Role::Primary { epoch, .. } = state.role else {
                return Err(super::Refusal::NotPrimary(state.redirect(shard)).into());
            };
            let forwarder = self
                .forwarders
                .iter()
                .find(|f| f.addr == request.replica && f.shards.contains(&shard))
                .ok_or_else(|| {
                    Status::failed_precondition(format!(
                        "{} is not a configured replica of shard {shard} here",
                        request.replica
                    ))
                })?;
            // Attached at the copy's version, under the write lock: every
            // later Push is queued for it.
            attachment = forwarder.attach(shard, version.position);
            epoch
        } else {
            // Whatever this server holds is what its ShardStatus reported:
            // a checkpoint, or a copy it follows or led with.
            state.known_epoch
        };
        drop(state);
        let origins = self
            .store
            .origin_windows(shard)
            .map(|set| crate::wire::origins_to_wire(&set));
        if caller == version && request.attach {
            tracing::info!(shard, replica = %request.replica, %version, "replica attached, in step");
            return Ok(SyncResponse {
                session: 0,
                epoch,
                version: Some(crate::wire::version_to_wire(version)),
                total_bytes: 0,
                attachment,
                origins,
            });
        }
        // A cut under the lock (a reference per row); every chunk is
        // encoded from it when asked.
        let source = CopySource::new(self.store.snapshot_shard(&writing));
        drop(writing);
        let total_bytes = source.total_bytes();
        let session = self.sessions.open(&request.replica, shard, source);
        tracing::info!(shard, replica = %request.replica, attach = request.attach, %version, total_bytes, "copy of the shard ready");
        Ok(SyncResponse {
            session,
            epoch,
            version: Some(crate::wire::version_to_wire(version)),
            total_bytes,
            attachment,
            origins,
        })
    }
}
