//! The `Admin` RPC service: checkpoints on demand, per-shard statistics,
//! and per-shard digests to compare copies across servers.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use tessera_proto::v1::{
    self, CheckpointRequest, CheckpointResponse, DigestRequest, DigestResponse, ShardDigest,
    ShardStats, StatsRequest, StatsResponse,
};
use tessera_rpc::{RequestContext, Status};

use crate::checkpoint::{self, CheckpointError};
use crate::store::Store;

/// Serves `Admin` over a shared [`Store`].
#[derive(Debug, Clone)]
pub struct AdminService {
    store: Arc<Store>,
    checkpoints: Option<Arc<Checkpointer>>,
}

/// Saves checkpoints of a store, one at a time.
#[derive(Debug)]
pub struct Checkpointer {
    store: Arc<Store>,
    dir: PathBuf,
    keep: usize,
    running: tokio::sync::Mutex<()>,
}

impl Checkpointer {
    /// Checkpoints of `store` under `dir`, keeping the newest `keep`.
    pub fn new(store: Arc<Store>, dir: PathBuf, keep: usize) -> Self {
        Self {
            store,
            dir,
            keep,
            running: tokio::sync::Mutex::new(()),
        }
    }

    /// Saves one now (waiting for a save in progress to finish first), off
    /// the async threads.
    pub async fn save(&self) -> Result<checkpoint::CheckpointInfo, CheckpointError> {
        let _one_at_a_time = self.running.lock().await;
        let (store, dir, keep) = (Arc::clone(&self.store), self.dir.clone(), self.keep);
        tokio::task::spawn_blocking(move || checkpoint::save(&store, &dir, keep))
            .await
            .unwrap_or_else(|join| {
                Err(CheckpointError::Io {
                    path: PathBuf::new(),
                    source: std::io::Error::other(join.to_string()),
                })
            })
    }
}

impl AdminService {
    /// Admin over `store`; checkpoints through `checkpoints` when the
    /// server has a checkpoint directory.
    pub fn new(store: Arc<Store>, checkpoints: Option<Arc<Checkpointer>>) -> Self {
        Self { store, checkpoints }
    }
}

impl v1::Admin for AdminService {
    async fn checkpoint(
        &self,
        _context: RequestContext,
        _request: CheckpointRequest,
    ) -> Result<CheckpointResponse, Status> {
        let Some(checkpoints) = &self.checkpoints else {
            return Err(Status::failed_precondition(
                "this server has no checkpoint.dir",
            ));
        };
        let info = checkpoints
            .save()
            .await
            .map_err(|err| Status::internal(err.to_string()))?;
        Ok(CheckpointResponse {
            path: info.path.display().to_string(),
            rows: info.rows,
            bytes: info.bytes,
        })
    }

    async fn stats(
        &self,
        _context: RequestContext,
        _request: StatsRequest,
    ) -> Result<StatsResponse, Status> {
        let mut shards = Vec::new();
        for table in self.store.tables() {
            let config = table.config();
            let row_bytes = u64::from(config.dim) * (1 + config.optimizer.slots() as u64) * 4;
            for (shard, state) in table.shards() {
                let rows = state.rows.len() as u64;
                shards.push(ShardStats {
                    table: config.name.clone(),
                    shard,
                    rows,
                    bytes: rows * row_bytes,
                    fetches: state.fetches.load(Ordering::Relaxed),
                    pushes: state.pushes.load(Ordering::Relaxed),
                    evictions: state.rows.evictions(),
                });
            }
        }
        shards.sort_by(|a, b| (&a.table, a.shard).cmp(&(&b.table, b.shard)));
        Ok(StatsResponse { shards })
    }

    async fn digest(
        &self,
        _context: RequestContext,
        _request: DigestRequest,
    ) -> Result<DigestResponse, Status> {
        let store = Arc::clone(&self.store);
        // Hashing every row is CPU work: off the async threads.
        let shards = tokio::task::spawn_blocking(move || {
            let mut out = Vec::new();
            for &shard in store.hosted() {
                let Some(cut) = store.lock_shard(shard) else {
                    continue;
                };
                for table in store.tables() {
                    let (rows, digest) = crate::rowfile::digest_shard(table, shard);
                    out.push(ShardDigest {
                        table: table.config().name.clone(),
                        shard,
                        version: Some(cut.version().into()),
                        rows,
                        digest,
                    });
                }
            }
            out.sort_by(|a, b| (&a.table, a.shard).cmp(&(&b.table, b.shard)));
            out
        })
        .await
        .map_err(|err| Status::internal(format!("digest task failed: {err}")))?;
        Ok(DigestResponse { shards })
    }
}
