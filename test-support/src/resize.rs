//! Servers of a cluster whose shard count changes (issue 39): etcd
//! coordination, deltas every 50 ms (a resize streams its moving rows
//! over them), one table.

use tessera_ps_server::config::{DeltaConfig, PeerConfig};
use tessera_ps_server::{PsServerConfig, TableConfig};

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
