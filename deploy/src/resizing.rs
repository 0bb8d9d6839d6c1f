//! What `tessera up` does as its cluster is resized (issue 39), so that
//! `tessera reshard --to M` is all an operator types for a local cluster
//! in etcd mode. It follows the cluster's shard map (a read every half
//! second: the launcher acts on states that last seconds) and
//!
//! - once a growth is planned, starts the servers of each new shard that
//!   has none yet ([`crate::Cluster::add_shard`]: one per replica group,
//!   configured as the first servers were, with the new count); they take
//!   part in the resize by themselves;
//! - once a resize is done, writes its count into the remaining servers'
//!   configurations ([`crate::Cluster::set_num_shards`]), as an operator
//!   would before a restart, and after a shrink stops the servers of the
//!   shards given away (they hold no rows by then).
//!
//! Once no resize is in progress, the servers of shards the map has no
//! more are stopped (a shrink's given-away shards, a cancelled growth's
//! new ones), and the count is written whenever it differs from the
//! configurations' (the launcher acts on the map's count, not on seeing a
//! resize end). The decisions are a sans-IO [`Follower`]
//! ([`Follower::handle_map`] takes a map and the shards that have
//! servers, and returns [`Action`]s); [`follow`] reads the map and runs
//! them.

use std::collections::BTreeSet;
use std::time::Duration;

use tessera_coord::{CoordinatorConfig, EtcdCoordinator, ShardMap};

use crate::Cluster;

/// What the launcher does for a map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Start the servers of new shard `shard` of `num_shards`.
    Start {
        /// The new shard.
        shard: u32,
        /// The growth's target.
        num_shards: u32,
    },
    /// Write `0` into the remaining servers' configurations.
    WriteCount(u32),
    /// Stop the servers of a shard the map has no more (a finished
    /// shrink gave it away, or a cancelled growth added it).
    Stop(u32),
}

/// The launcher's decisions as the map changes (module docs).
#[derive(Debug)]
pub struct Follower {
    /// The count the servers' configurations say.
    written: u32,
}

impl Follower {
    /// A follower of a cluster whose servers are configured with
    /// `num_shards`.
    pub fn new(num_shards: u32) -> Self {
        Self {
            written: num_shards,
        }
    }

    /// What to do for `map`, with servers running for the shards in
    /// `running`. Acts on the map's count, not on seeing a resize end
    /// (the next one may be planned before a read sees it done).
    pub fn handle_map(&mut self, map: &ShardMap, running: &BTreeSet<u32>) -> Vec<Action> {
        if let Some(r) = map.active() {
            if r.to > r.from {
                return (r.from..r.to)
                    .filter(|s| !running.contains(s))
                    .map(|shard| Action::Start {
                        shard,
                        num_shards: r.to,
                    })
                    .collect();
            }
            return Vec::new();
        }
        let mut actions = Vec::new();
        if self.written != map.num_shards {
            self.written = map.num_shards;
            actions.push(Action::WriteCount(map.num_shards));
        }
        // Shards the map has no more: given away in a shrink, or a
        // cancelled growth's new ones.
        actions.extend(
            running
                .iter()
                .filter(|&&s| s >= map.num_shards)
                .map(|&s| Action::Stop(s)),
        );
        actions
    }
}

/// Follows the shard map of `cluster` (etcd at `coordinator`) until
/// `stop` resolves, acting as [`Follower`] decides; each action is
/// printed.
#[allow(clippy::print_stdout)]
pub async fn follow(
    cluster: &mut Cluster,
    coordinator: &CoordinatorConfig,
    stop: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(stop);
    let mut follower = Follower::new(cluster.worker_config().num_shards);
    let mut coord = None;
    loop {
        tokio::select! {
            () = &mut stop => return,
            () = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
        if coord.is_none() {
            coord = EtcdCoordinator::connect(coordinator).await.ok();
        }
        let Some(c) = &coord else {
            continue;
        };
        let map = match c.shard_map().await {
            Ok(Some((map, _))) => map,
            Ok(None) => continue,
            Err(err) => {
                tracing::debug!(%err, "reading the shard map failed; trying again");
                coord = None;
                continue;
            }
        };
        let shards: BTreeSet<u32> = cluster
            .servers()
            .iter()
            .filter(|s| !s.serving && s.pid().is_some())
            .map(|s| s.shard)
            .collect();
        for action in follower.handle_map(&map, &shards) {
            match action {
                Action::Start { shard, num_shards } => match cluster.add_shard(shard, num_shards) {
                    Ok(added) => {
                        for &index in &added {
                            let s = &cluster.servers()[index];
                            println!(
                                "resize to {num_shards} shards: started ps-server group {} shard {shard} at {}",
                                s.group, s.address
                            );
                        }
                    }
                    Err(err) => println!(
                        "resize to {num_shards} shards: shard {shard}'s servers did not start: {err}"
                    ),
                },
                Action::WriteCount(num_shards) => match cluster.set_num_shards(num_shards) {
                    Ok(()) => println!(
                        "resize to {num_shards} shards done: the servers' configurations say num_shards = {num_shards}"
                    ),
                    Err(err) => println!(
                        "resize to {num_shards} shards done; the configurations were not updated: {err}"
                    ),
                },
                Action::Stop(shard) => {
                    let indices: Vec<usize> = cluster
                        .servers()
                        .iter()
                        .enumerate()
                        .filter(|(_, s)| !s.serving && s.shard == shard)
                        .map(|(i, _)| i)
                        .collect();
                    for index in indices {
                        cluster.signal(index, nix::sys::signal::Signal::SIGTERM);
                        cluster.wait_exit(index).await;
                    }
                    println!(
                        "shard {shard} is not in the cluster's {} shards (given away in a shrink, or a cancelled growth's): its servers stopped",
                        map.num_shards
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shards(list: &[u32]) -> BTreeSet<u32> {
        list.iter().copied().collect()
    }

    #[test]
    fn a_growth_starts_its_new_shards_and_a_shrink_stops_the_given_away_ones() {
        let mut f = Follower::new(2);
        let map = ShardMap::new(2);
        assert!(f.handle_map(&map, &shards(&[0, 1])).is_empty());
        let planned = map.plan(4).unwrap();
        assert_eq!(
            f.handle_map(&planned, &shards(&[0, 1])),
            [
                Action::Start {
                    shard: 2,
                    num_shards: 4
                },
                Action::Start {
                    shard: 3,
                    num_shards: 4
                }
            ]
        );
        // Started: nothing more while it copies.
        let copying = planned.start_copying().unwrap();
        assert!(f.handle_map(&copying, &shards(&[0, 1, 2, 3])).is_empty());
        let done = copying
            .handle_ready(2, true)
            .and_then(|m| m.handle_ready(3, true))
            .and_then(|m| m.cut_over())
            .and_then(|m| m.handle_opened(2, 1))
            .and_then(|m| m.handle_opened(3, 1))
            .and_then(|m| m.finish())
            .unwrap();
        assert_eq!(
            f.handle_map(&done, &shards(&[0, 1, 2, 3])),
            [Action::WriteCount(4)]
        );
        assert!(
            f.handle_map(&done, &shards(&[0, 1, 2, 3])).is_empty(),
            "once"
        );
        // A shrink planned before the done map was read: the count is
        // written once no resize is in progress, the given-away stopped.
        let shrunk = done
            .plan(2)
            .and_then(|m| m.start_copying())
            .and_then(|m| m.handle_ready(0, true))
            .and_then(|m| m.handle_ready(1, true))
            .and_then(|m| m.cut_over())
            .and_then(|m| m.handle_opened(0, 9))
            .and_then(|m| m.handle_opened(1, 9))
            .and_then(|m| m.finish())
            .unwrap();
        let mut late = Follower::new(4);
        assert!(
            late.handle_map(&done.plan(2).unwrap(), &shards(&[0, 1, 2, 3]))
                .is_empty()
        );
        assert_eq!(
            late.handle_map(&shrunk, &shards(&[0, 1, 2, 3])),
            [Action::WriteCount(2), Action::Stop(2), Action::Stop(3)]
        );
        // Stopped: a later growth back to 3 starts shard 2 anew.
        assert_eq!(
            late.handle_map(&shrunk.plan(3).unwrap(), &shards(&[0, 1])),
            [Action::Start {
                shard: 2,
                num_shards: 3
            }]
        );
        // A cancelled growth's new servers are stopped.
        let cancelled = shrunk.plan(3).unwrap().cancel().unwrap();
        assert_eq!(
            late.handle_map(&cancelled, &shards(&[0, 1, 2])),
            [Action::Stop(2)]
        );
    }
}
