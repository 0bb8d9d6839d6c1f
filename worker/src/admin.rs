//! The worker's `WorkerAdmin` service: lists, and on request clears, the
//! quarantine list of every shard's replica set (the RPC layer's exclusion
//! of failing servers), so an operator can see why a worker avoids a
//! server and readmit it after fixing it.

use std::sync::Arc;
use std::time::Instant;

use tessera_proto::v1::{self, QuarantineRequest, QuarantineResponse, QuarantinedServer};
use tessera_rpc::{RequestContext, Status};

use crate::client::PsClient;

/// Serves `WorkerAdmin` for a [`PsClient`].
#[derive(Debug, Clone)]
pub struct WorkerAdminService {
    client: Arc<PsClient>,
}

impl WorkerAdminService {
    /// The admin service of `client`.
    pub fn new(client: Arc<PsClient>) -> Self {
        Self { client }
    }
}

impl v1::WorkerAdmin for WorkerAdminService {
    async fn quarantine(
        &self,
        _context: RequestContext,
        request: QuarantineRequest,
    ) -> Result<QuarantineResponse, Status> {
        let now = Instant::now();
        let mut servers = Vec::new();
        for shard in 0..self.client.num_shards() {
            let Some(set) = self.client.replica_set(shard) else {
                continue;
            };
            for ejection in set.quarantined() {
                servers.push(QuarantinedServer {
                    shard,
                    address: ejection.node,
                    seconds_left: ejection.until.saturating_duration_since(now).as_secs_f64(),
                    ejections: ejection.count,
                });
            }
            if request.clear {
                set.clear_quarantine();
            }
        }
        if request.clear && !servers.is_empty() {
            tracing::info!(
                readmitted = servers.len(),
                "quarantine cleared by the admin call"
            );
        }
        Ok(QuarantineResponse { servers })
    }
}
