//! A cluster of `num_shards` shards x `groups` replica groups: one server
//! per (group, shard), each listing the others as its peers.

use tessera_ps_server::PsServerConfig;
use tessera_ps_server::config::PeerConfig;

use crate::server::InProcess;

/// Where each server of a cluster listens, group-major: server
/// `group * num_shards + shard`.
#[derive(Debug, Clone)]
pub struct Layout {
    /// Shards of the model.
    pub num_shards: u32,
    /// Replica groups.
    pub groups: u32,
    /// (group, shard, address) of every server.
    pub servers: Vec<(u32, u32, String)>,
}

impl Layout {
    /// Free loopback addresses for every server.
    pub fn new(num_shards: u32, groups: u32) -> Self {
        let servers = (0..groups)
            .flat_map(|g| (0..num_shards).map(move |s| (g, s)))
            .map(|(g, s)| (g, s, crate::free_addr()))
            .collect();
        Self {
            num_shards,
            groups,
            servers,
        }
    }

    /// The index of the server of `group` and `shard`.
    pub fn index(&self, group: u32, shard: u32) -> usize {
        (group * self.num_shards + shard) as usize
    }

    /// The address of the server of `group` and `shard`.
    pub fn addr(&self, group: u32, shard: u32) -> &str {
        &self.servers[self.index(group, shard)].2
    }

    /// The configuration of server `index`: `base` with its address,
    /// shard, group, and every other server as a peer.
    pub fn config(&self, index: usize, base: &PsServerConfig) -> PsServerConfig {
        let (group, shard, address) = &self.servers[index];
        PsServerConfig {
            listen: address.clone(),
            num_shards: self.num_shards,
            shards: vec![*shard],
            replica_group: *group,
            replica_groups: self.groups,
            peers: self
                .servers
                .iter()
                .filter(|(_, _, other)| other != address)
                .map(|(g, s, a)| PeerConfig {
                    address: a.clone(),
                    replica_group: *g,
                    shards: vec![*s],
                })
                .collect(),
            ..base.clone()
        }
    }
}

/// Every server of a [`Layout`], in this process.
pub struct InProcessCluster {
    /// The layout.
    pub layout: Layout,
    /// The servers, in layout order.
    pub servers: Vec<InProcess>,
}

impl InProcessCluster {
    /// Starts `num_shards x groups` servers from `base` and waits until
    /// every one serves (primaries recovered, replicas in step).
    pub async fn start(num_shards: u32, groups: u32, base: &PsServerConfig) -> Self {
        let layout = Layout::new(num_shards, groups);
        let mut servers = Vec::new();
        for index in 0..layout.servers.len() {
            servers.push(InProcess::start(&layout.config(index, base)).await);
        }
        for (_, _, addr) in &layout.servers {
            crate::wait_serving(addr).await;
        }
        Self { layout, servers }
    }

    /// Stops every server.
    pub async fn stop(self) {
        for server in self.servers {
            server.stop().await;
        }
    }
}
