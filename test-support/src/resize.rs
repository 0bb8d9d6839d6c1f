//! Servers of a cluster whose shard count changes (issue 39): etcd
//! coordination, deltas every 50 ms (a resize streams its moving rows
//! over them), one table.

use prost::Message as _;
use tessera_coord::{EtcdCoordinator, ShardMap};
use tessera_proto::v1::KeysMoved;
use tessera_ps_server::config::{DeltaConfig, PeerConfig};
use tessera_ps_server::{PsServerConfig, TableConfig};
use tessera_rpc::{Code, RpcError};

use crate::wait::eventually;
use crate::{Etcd, etcd_coordination, free_addr};

/// The server of shard `shard` of `num_shards` in etcd cluster `cluster`,
/// with `table`, on a free port.
pub fn resize_server(
    etcd: &Etcd,
    cluster: &str,
    num_shards: u32,
    shard: u32,
    table: &TableConfig,
) -> PsServerConfig {
    PsServerConfig {
        listen: free_addr(),
        num_shards,
        shards: vec![shard],
        coordinator: etcd_coordination(etcd, cluster, 2000),
        // No serving fleet: only a resize uses the deltas.
        delta: DeltaConfig {
            interval_ms: 50,
            ..DeltaConfig::default()
        },
        tables: vec![table.clone()],
        ..PsServerConfig::default()
    }
}

/// The two servers of shard `shard` of `num_shards` (replica groups 0 and
/// 1, each the other's peer), as [`resize_server`].
pub fn resize_pair(
    etcd: &Etcd,
    cluster: &str,
    num_shards: u32,
    shard: u32,
    table: &TableConfig,
) -> [PsServerConfig; 2] {
    let (a, b) = (free_addr(), free_addr());
    let one = |group: u32, me: &str, peer: &str| PsServerConfig {
        listen: me.to_owned(),
        replica_group: group,
        replica_groups: 2,
        peers: vec![PeerConfig {
            address: peer.to_owned(),
            replica_group: 1 - group,
            shards: vec![shard],
        }],
        ..resize_server(etcd, cluster, num_shards, shard, table)
    };
    [one(0, &a, &b), one(1, &b, &a)]
}

/// The `KeysMoved` of a server's refusal (`ABORTED`: the keys are routed
/// by another count now), if it is one.
pub fn keys_moved(err: &RpcError) -> Option<KeysMoved> {
    match err {
        RpcError::Status(status) if status.code() == Code::Aborted => {
            KeysMoved::decode(status.details().clone())
                .ok()
                .filter(|m| m.num_shards > 0)
        }
        _ => None,
    }
}

/// The cluster's shard map as etcd holds it now.
///
/// # Panics
///
/// If etcd cannot be read or holds no map (a test's set-up failed).
pub async fn shard_map_now(coord: &EtcdCoordinator) -> ShardMap {
    match coord.shard_map().await {
        Ok(Some((map, _))) => map,
        other => panic!("no shard map in etcd: {other:?}"),
    }
}

/// One server for each of shards `0..num_shards` of etcd cluster
/// `cluster` (as [`resize_server`]), each serving, and a coordinator
/// client of the cluster (the operator's, in a test).
///
/// # Panics
///
/// If etcd cannot be reached (a test's set-up failed).
pub async fn resize_servers(
    etcd: &Etcd,
    cluster: &str,
    num_shards: u32,
    table: &TableConfig,
) -> (Vec<crate::InProcess>, EtcdCoordinator) {
    let mut servers = Vec::new();
    for shard in 0..num_shards {
        servers.push(
            crate::InProcess::start(&resize_server(etcd, cluster, num_shards, shard, table)).await,
        );
    }
    for s in &servers {
        crate::wait_serving(&s.addr).await;
    }
    let coord = match EtcdCoordinator::connect(&etcd_coordination(etcd, cluster, 2000)).await {
        Ok(coord) => coord,
        Err(err) => panic!("etcd: {err}"),
    };
    (servers, coord)
}

/// Waits (up to 40 s) until the shard map etcd holds satisfies `done`.
///
/// # Panics
///
/// If it never does, naming `what` and the last map.
pub async fn wait_map(coord: &EtcdCoordinator, what: &str, done: impl Fn(&ShardMap) -> bool) {
    eventually(
        std::time::Duration::from_secs(40),
        &format!("shard map: {what}"),
        || async {
            let m = shard_map_now(coord).await;
            if done(&m) { Ok(()) } else { Err(m) }
        },
    )
    .await;
}

/// A Push of step `step` (worker 7, sequence `step`) to `keys` of
/// `shard` in table `emb` of dimension `dim`, split by `split_by` shards;
/// its gradients vary with the step.
pub fn split_push(
    dim: usize,
    step: u64,
    shard: u32,
    keys: &[u64],
    split_by: u32,
) -> tessera_proto::v1::PushRequest {
    let grads: Vec<f32> = (0..keys.len() * dim)
        .map(|i| ((i as u64 * 5 + step * 3) % 11) as f32 - 5.0)
        .collect();
    tessera_proto::v1::PushRequest {
        num_shards: split_by,
        table: "emb".into(),
        shard,
        keys: keys.to_vec(),
        gradients: bytes::Bytes::from(crate::wire(&grads)),
        worker_id: 7,
        sequence: step,
    }
}
