//! Set-up the worker's end-to-end tests share.

use tessera_test_support::InProcessCluster;
use tessera_worker::ServerEndpoint;

/// A worker's `[[servers]]` for every server of an in-process cluster.
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
