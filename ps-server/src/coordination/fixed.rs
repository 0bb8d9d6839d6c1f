//! Static mode: fixed primaries (see the module docs of
//! [`crate::coordination`]).

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::config::PsServerConfig;
use crate::replication::{Patience, Replication};

/// Gives every hosted shard its fixed role, at once: a replica follows the
/// configured primary; a primary with no replicas leads; a primary with
/// replicas starts recovering. Returns the shards to recover with
/// [`run`].
pub(super) fn assign(config: &PsServerConfig, replication: &Replication) -> Vec<u32> {
    let mut recover = Vec::new();
    for &shard in &config.shards {
        if config.is_primary(shard) {
            if replication.peers_of(shard).is_empty() {
                let epoch = replication.store_version(shard).epoch + 1;
                if let Err(err) = replication.lead(shard, epoch) {
                    tracing::error!(shard, %err, "cannot take the shard over");
                }
            } else {
                replication.begin_recovery(shard, 0);
                recover.push(shard);
            }
        } else {
            let group = config.primary_group(shard);
            match config
                .peers
                .iter()
                .find(|p| p.replica_group == group && p.shards.contains(&shard))
            {
                Some(primary) => replication.follow(shard, &primary.address, 0),
                None => tracing::error!(shard, group, "no configured peer is the shard's primary"),
            }
        }
    }
    recover
}

/// Recovers each of `shards` from all its replicas, then leads it one
/// epoch above any found.
pub(super) async fn run(shards: Vec<u32>, replication: Arc<Replication>, stop: CancellationToken) {
    let recoveries = shards.into_iter().map(|shard| {
        let replication = Arc::clone(&replication);
        async move {
            let servers = replication.peers_of(shard);
            match replication
                .recover(shard, &servers, Patience::All, None)
                .await {
                Ok(recovered) => {
                    if recovered.lost > 0 {
                        metrics::counter!("tessera_ps_failover_lost_pushes_total")
                            .increment(recovered.lost);
                        tracing::warn!(shard, lost = recovered.lost, "the previous primary had applied pushes that no replica holds; they are lost");
                    }
                    let epoch = recovered.newest_epoch + 1;
                    if let Err(err) = replication.lead(shard, epoch) {
                        tracing::error!(shard, %err, "cannot take the shard over");
                    }
                }
                Err(err) => tracing::error!(shard, %err, "recovering the shard failed"),
            }
        }
    });
    tokio::select! {
        _ = futures::future::join_all(recoveries) => {}
        _ = stop.cancelled() => {}
    }
}
