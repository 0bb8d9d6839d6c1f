//! What Health and the metrics say about a server's replication.

use std::collections::HashMap;
use std::time::Instant;

use tessera_proto::v1::{self, ReplicaStatus, ShardHealth};

use super::Replication;
use super::shard::Role;

impl Replication {
    /// Every hosted shard's replication, for Health.
    pub fn shard_health(&self) -> Vec<ShardHealth> {
        let now = Instant::now();
        let mut shards: Vec<u32> = self.cells.keys().copied().collect();
        shards.sort_unstable();
        shards
            .into_iter()
            .filter_map(|shard| {
                let version = self.store.version(shard)?;
                let state = self.cell(shard)?.lock();
                let mut health = ShardHealth {
                    shard,
                    role: state.health_role() as i32,
                    epoch: state.known_epoch,
                    version: Some(crate::wire::version_to_wire(version)),
                    primary: state.known_primary.clone().unwrap_or_default(),
                    ..ShardHealth::default()
                };
                match &state.role {
                    Role::Primary { epoch, .. } => {
                        health.epoch = *epoch;
                        health.primary = self.me.clone();
                        health.fenced = !self.fence.is_valid(now);
                        health.replicas = self
                            .forwarders
                            .iter()
                            .filter(|f| f.shards.contains(&shard))
                            .map(|f| {
                                let (attached, in_step, queued, applied) = f.status(shard);
                                ReplicaStatus {
                                    address: f.addr.clone(),
                                    attached,
                                    lag_pushes: queued as u64,
                                    applied_position: applied,
                                    in_step: attached && in_step,
                                }
                            })
                            .collect();
                    }
                    Role::Replica(f) => {
                        health.epoch = f.epoch;
                        health.primary = f.primary.clone();
                        // In step: attached to the stream, and holding
                        // every Push the primary acknowledged.
                        health.in_step = f.holds_every_ack(version.position);
                        health.syncing = f.syncing;
                        health.stream_age_ms = f
                            .last_heard
                            .map_or(0, |t| now.saturating_duration_since(t).as_millis() as u64);
                        health.receiving = state.receiving(now, self.stale_after).unwrap_or(false);
                    }
                    Role::Recovering { epoch } => health.epoch = (*epoch).max(state.known_epoch),
                    Role::Idle => {}
                }
                Some(health)
            })
            .collect()
    }

    /// The server's state as Health reports it.
    pub fn server_state(&self) -> v1::ServerState {
        let mut state = v1::ServerState::Serving;
        for cell in self.cells.values() {
            let s = cell.lock();
            match &s.role {
                Role::Recovering { .. } => return v1::ServerState::Recovering,
                Role::Replica(f) if f.syncing || !s.has_copy => {
                    state = v1::ServerState::CatchingUp;
                }
                Role::Idle if !s.has_copy => state = v1::ServerState::CatchingUp,
                _ => {}
            }
        }
        state
    }

    /// Publishes each replica's stream age, and warns (once) when one stops
    /// hearing its primary.
    pub(super) fn monitor(&self, silent: &mut HashMap<u32, bool>) {
        let now = Instant::now();
        for cell in self.cells.values() {
            let state = cell.lock();
            let shard = cell.shard.to_string();
            let Some(receiving) = state.receiving(now, self.stale_after) else {
                metrics::gauge!("tessera_ps_replica_receiving", "shard" => shard).set(1.0);
                silent.remove(&cell.shard);
                continue;
            };
            if let Role::Replica(f) = &state.role {
                let age = f
                    .last_heard
                    .map_or(0.0, |t| now.saturating_duration_since(t).as_secs_f64());
                metrics::gauge!("tessera_ps_replica_stream_age_seconds", "shard" => shard.clone())
                    .set(age);
                let was_silent = silent.insert(cell.shard, !receiving).unwrap_or(false);
                if !receiving && !was_silent && !f.syncing {
                    tracing::warn!(shard = cell.shard, primary = %f.primary, age_s = age, "replica is not receiving its primary's stream");
                } else if receiving && was_silent {
                    tracing::info!(shard = cell.shard, primary = %f.primary, "replica receives its primary's stream again");
                }
            }
            metrics::gauge!("tessera_ps_replica_receiving", "shard" => shard).set(if receiving {
                1.0
            } else {
                0.0
            });
        }
    }
}
