//! Set-up the worker's end-to-end tests share.

use tessera_test_support::{Etcd, InProcess, InProcessCluster, etcd_coordination};
use tessera_worker::{PsClient, ServerEndpoint, WorkerConfig};

/// A worker's `[[servers]]` for every server of an in-process cluster.
#[allow(dead_code)] // not every test binary that shares this module uses it
pub fn endpoints(servers: &InProcessCluster) -> Vec<ServerEndpoint> {
    servers
        .layout
        .servers
        .iter()
        .map(|(group, shard, address)| ServerEndpoint {
            address: address.clone(),
            shards: vec![*shard],
            replica_group: *group,
        })
        .collect()
}

/// A worker of etcd cluster `cluster` that knows only `servers` (server
/// `i` hosting shard `i`, as `resize_servers` starts them; etcd tells it
/// the rest), with a Push timeout of `push_timeout_ms`.
#[allow(dead_code)] // not every test binary that shares this module uses it
pub fn resize_client(
    etcd: &Etcd,
    cluster: &str,
    servers: &[InProcess],
    push_timeout_ms: u64,
) -> PsClient {
    PsClient::new(&WorkerConfig {
        num_shards: u32::try_from(servers.len()).unwrap_or(u32::MAX),
        servers: servers
            .iter()
            .enumerate()
            .map(|(shard, s)| ServerEndpoint {
                address: s.addr.clone(),
                shards: vec![u32::try_from(shard).unwrap_or(u32::MAX)],
                replica_group: 0,
            })
            .collect(),
        coordinator: etcd_coordination(etcd, cluster, 2000),
        connect_timeout_ms: 2000,
        request_timeout_ms: 5000,
        call_timeout_ms: 10_000,
        push_timeout_ms,
        ..WorkerConfig::default()
    })
    .expect("a worker of the cluster")
}
