//! The `Admin` RPC service: checkpoints on demand, per-shard statistics,
//! and per-shard digests to compare copies across servers.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use tessera_rpc::sync::LockExt;

use tessera_proto::v1::{
    self, CheckpointRequest, CheckpointResponse, DigestRequest, DigestResponse, ShardDigest,
    ShardStats, StatsRequest, StatsResponse,
};
use tessera_rpc::{RequestContext, Status};

use tessera_store::checkpoint::{self, CheckpointError};
use tessera_store::store::Store;

/// Serves `Admin` over a shared [`Store`].
#[derive(Debug, Clone)]
pub struct AdminService {
    store: Arc<Store>,
    checkpoints: Option<Arc<Checkpointer>>,
}

/// Saves checkpoints of a store, one at a time, and remembers how the
/// last ones went (for Health: a full or read-only disk shows there until
/// a save succeeds again).
#[derive(Debug)]
pub struct Checkpointer {
    store: Arc<Store>,
    dir: PathBuf,
    keep: usize,
    /// Held for the whole of a save, by the blocking task doing it.
    running: Arc<tokio::sync::Mutex<()>>,
    outcomes: std::sync::Mutex<v1::CheckpointHealth>,
}

fn unix_ms(at: std::time::SystemTime) -> u64 {
    at.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Checkpointer {
    /// Checkpoints of `store` under `dir`, keeping the newest `keep`.
    pub fn new(store: Arc<Store>, dir: PathBuf, keep: usize) -> Self {
        let outcomes = std::sync::Mutex::new(v1::CheckpointHealth {
            dir: dir.display().to_string(),
            ..v1::CheckpointHealth::default()
        });
        Self {
            store,
            dir,
            keep,
            running: Arc::new(tokio::sync::Mutex::new(())),
            outcomes,
        }
    }

    /// How the checkpoints are going (Health's `checkpoint`).
    pub fn health(&self) -> v1::CheckpointHealth {
        let mut health = self.outcomes.locked().clone();
        health.saving = self.saving();
        health
    }

    /// Records the outcome of a save; a failure is logged with its path
    /// and cause (saves are rare: at most one a period, or on demand).
    fn record(&self, outcome: &Result<checkpoint::CheckpointInfo, CheckpointError>) {
        let now = unix_ms(std::time::SystemTime::now());
        let mut health = self.outcomes.locked();
        match outcome {
            Ok(info) => {
                health.last_success_unix_ms = now;
                health.last_success_path = info.path.display().to_string();
                health.last_error.clear();
                health.consecutive_failures = 0;
            }
            Err(err) => {
                metrics::counter!("tessera_ps_checkpoint_failures_total").increment(1);
                health.last_failure_unix_ms = now;
                health.last_error = err.to_string();
                health.consecutive_failures = health.consecutive_failures.saturating_add(1);
                tracing::warn!(
                    dir = %self.dir.display(),
                    %err,
                    failures_in_a_row = health.consecutive_failures,
                    "checkpoint failed; serving and replication go on, the next save retries"
                );
            }
        }
    }

    /// Saves one now (waiting for a save in progress to finish first), off
    /// the async threads. The save runs to its end even if the caller stops
    /// waiting (an RPC handler abandoned at its deadline), and the next
    /// save waits for it: the guard travels with the blocking task.
    pub async fn save(&self) -> Result<checkpoint::CheckpointInfo, CheckpointError> {
        let one_at_a_time = Arc::clone(&self.running).lock_owned().await;
        let (store, dir, keep) = (Arc::clone(&self.store), self.dir.clone(), self.keep);
        let outcome = tokio::task::spawn_blocking(move || {
            let _one_at_a_time = one_at_a_time;
            checkpoint::save(&store, &dir, keep)
        })
        .await
        .unwrap_or_else(|join| {
            Err(CheckpointError::Io {
                path: self.dir.clone(),
                source: std::io::Error::other(join.to_string()),
            })
        });
        self.record(&outcome);
        outcome
    }
}

impl Checkpointer {
    /// Whether a save is running now.
    pub fn saving(&self) -> bool {
        self.running.try_lock().is_err()
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
                let memory = state.rows.bytes();
                let (admission_candidates, rows_admitted, admission_bytes) =
                    state.admission_counts();
                shards.push(ShardStats {
                    table: config.name.clone(),
                    shard,
                    rows: memory.rows,
                    bytes: memory.rows * row_bytes,
                    fetches: state.fetches.load(Ordering::Relaxed),
                    pushes: state.pushes.load(Ordering::Relaxed),
                    evictions: state.rows.evictions(),
                    record_bytes: memory.row_bytes,
                    index_bytes: memory.index_bytes,
                    free_bytes: memory.free_bytes,
                    overhead_bytes: memory.overhead_bytes,
                    snapshot_bytes: memory.cut_bytes,
                    storage: config.storage.name().to_owned(),
                    admission_candidates,
                    rows_admitted,
                    admission_bytes,
                    rows_expired: state.rows.expired(),
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
                // A brief cut under the shard's lock; hashing after it.
                let snapshot = {
                    let Some(cut) = store.lock_shard(shard) else {
                        continue;
                    };
                    store.snapshot_shard(&cut)
                };
                for (table, rows) in &snapshot.tables {
                    let (count, digest) = tessera_store::rowfile::digest_snapshot(rows);
                    out.push(ShardDigest {
                        table: table.name.clone(),
                        shard,
                        version: Some(crate::wire::version_to_wire(snapshot.version)),
                        rows: count,
                        digest,
                        values_digest: tessera_store::rowfile::values_digest(rows),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// An RPC handler abandoned at its deadline must not release the
    /// one-at-a-time guard while its blocking save keeps running.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_save_whose_caller_gave_up_still_holds_off_the_next() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(Store::new(&crate::config::StoreConfig::default()));
        store.fetch("embeddings", 0, &[1, 2, 3]).unwrap();
        let checkpoints = Checkpointer::new(Arc::clone(&store), dir.path().to_owned(), 5);
        fail::cfg("checkpoint::after_shard_file", "pause").unwrap();
        let abandoned =
            tokio::time::timeout(std::time::Duration::from_millis(20), checkpoints.save()).await;
        assert!(abandoned.is_err(), "the save is paused");
        assert!(
            checkpoints.saving(),
            "the abandoned save still holds the guard"
        );
        let next = tokio::spawn({
            let checkpoints = Arc::new(checkpoints);
            let waiting = Arc::clone(&checkpoints);
            async move {
                let info = waiting.save().await;
                (checkpoints, info)
            }
        });
        fail::remove("checkpoint::after_shard_file");
        let (checkpoints, info) = next.await.unwrap();
        info.unwrap();
        assert!(!checkpoints.saving());
        let mut names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(
            names,
            [
                "LATEST",
                "ckpt-00000000000000000001",
                "ckpt-00000000000000000002"
            ]
        );
    }
}
