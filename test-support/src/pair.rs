//! Two servers that replicate one shard (shard 0 of table `emb`, rows of
//! 4 floats): the configuration and the Pushes of the replication,
//! failover and in-step tests.

use bytes::Bytes;
use tessera_proto::v1::PushRequest;
use tessera_ps_server::config::{CoordinatorConfig, CoordinatorKind, OptimizerConfig, PeerConfig};
use tessera_ps_server::{PsServerConfig, TableConfig};

use crate::{Etcd, wire};

/// The table every pair serves.
pub const PAIR_TABLE: &str = "emb";
/// Its row width.
pub const PAIR_DIM: u32 = 4;

/// A server of replica group `group` (0 or 1) listening on `listen`, its
/// peer of the other group at `peer`, static coordination, Adam.
pub fn pair_config(listen: &str, group: u32, peer: &str) -> PsServerConfig {
    PsServerConfig {
        listen: listen.to_owned(),
        replica_group: group,
        replica_groups: 2,
        peers: vec![PeerConfig {
            address: peer.to_owned(),
            replica_group: 1 - group,
            shards: vec![0],
        }],
        tables: vec![TableConfig {
            optimizer: OptimizerConfig::adam(0.01),
            ..TableConfig::new(PAIR_TABLE, PAIR_DIM)
        }],
        ..PsServerConfig::default()
    }
}

/// Failover through `etcd` under `cluster`, a primary's lease lost after
/// `failover_timeout_ms`.
pub fn etcd_coordination(
    etcd: &Etcd,
    cluster: &str,
    failover_timeout_ms: u64,
) -> CoordinatorConfig {
    CoordinatorConfig {
        kind: CoordinatorKind::Etcd,
        endpoints: vec![etcd.endpoint.clone()],
        cluster: cluster.to_owned(),
        failover_timeout_ms,
        ..CoordinatorConfig::default()
    }
}

/// Worker `worker_id`'s Push of `step`: keys `0..keys`, every row's
/// gradient different from the last step's.
pub fn pair_push(step: u64, keys: u64, worker_id: u64) -> PushRequest {
    let keys: Vec<u64> = (0..keys).collect();
    let grads: Vec<f32> = (0..keys.len() * PAIR_DIM as usize)
        .map(|i| ((i as u64 * 13 + step * 7) % 17) as f32 - 8.0)
        .collect();
    PushRequest {
        num_shards: 0,
        table: PAIR_TABLE.into(),
        shard: 0,
        keys,
        gradients: Bytes::from(wire(&grads)),
        worker_id,
        sequence: step,
    }
}
