//! `[[peers]]` and `[replication]`: the other servers of the model, and how
//! a primary forwards Pushes to its replicas.

use serde::{Deserialize, Serialize};
use tessera_config::{ConfigError, invalid};

/// Another server of the model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerConfig {
    /// Its address (`host:port`).
    pub address: String,
    /// Its replica group.
    pub replica_group: u32,
    /// The shards it hosts.
    pub shards: Vec<u32>,
}

/// When a primary acknowledges a Push.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AckMode {
    /// Once the primary applied it. The fastest; a failover loses the
    /// Pushes the primary had not forwarded yet (at most `max_lag_pushes`
    /// per shard while a replica is in step), counted and logged at the
    /// promotion.
    Primary,
    /// Once every replica in step with the primary applied it too: no
    /// acknowledged Push is lost while one replica that was in step
    /// survives. A replica that does not confirm within
    /// `replica_timeout_ms` is cut off (it copies the shard again) rather
    /// than stalling every Push. The default: a parameter server exists to
    /// keep what was trained.
    #[default]
    Replicas,
}

/// How a primary forwards Pushes to its replicas.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReplicationConfig {
    /// `primary` or `replicas` (see [`AckMode`]). Default `replicas`. Every
    /// server of a cluster should say the same.
    pub ack: AckMode,
    /// Pushes of one shard queued for one replica at most (the bound on
    /// its lag). A replica that falls further behind on a shard is cut off
    /// from it and copies it again. Default 10,000: seconds of a busy
    /// trainer fleet's Pushes, a few tens of MiB of queue.
    pub max_lag_pushes: usize,
    /// Pushes per forwarding call. Default 64: amortises the round trip
    /// without making one call large.
    pub batch_pushes: usize,
    /// How long a primary waits for a replica to confirm a forwarded Push
    /// before it cuts the replica off, in milliseconds (with `ack =
    /// "replicas"`, the longest one dead replica stalls Pushes). Default
    /// 2000: several times a loaded host's scheduling hiccup, well below a
    /// worker's Push deadline.
    pub replica_timeout_ms: u64,
    /// How often a primary tells an idle replica where its stream stands,
    /// in milliseconds, so that a replica can tell a silent primary from an
    /// idle one. Default 500.
    pub heartbeat_ms: u64,
    /// A replica that has not heard its primary's stream for this long
    /// says so (Health `receiving = false`, the
    /// `tessera_ps_replica_receiving` metric, a warning), in milliseconds.
    /// Default 3000: six heartbeats.
    pub stale_after_ms: u64,
    /// Bytes of forwarded Pushes (gradients and keys) a replica holds per
    /// shard while it copies the shard, to apply after the copy; beyond,
    /// it drops them and copies again. Default 1 GiB: at the trainer's
    /// 20 KiB Pushes, 50,000 Pushes — seconds of a busy shard, the length
    /// of a large copy — and far below the pool ceiling.
    pub copy_buffer_bytes: u64,
}

impl Default for ReplicationConfig {
    fn default() -> Self {
        Self {
            ack: AckMode::Replicas,
            max_lag_pushes: 10_000,
            batch_pushes: 64,
            replica_timeout_ms: 2000,
            heartbeat_ms: 500,
            stale_after_ms: 3000,
            copy_buffer_bytes: 1 << 30,
        }
    }
}

impl ReplicationConfig {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        for (key, value) in [
            ("replication.max_lag_pushes", self.max_lag_pushes as u64),
            ("replication.batch_pushes", self.batch_pushes as u64),
            ("replication.replica_timeout_ms", self.replica_timeout_ms),
            ("replication.heartbeat_ms", self.heartbeat_ms),
            ("replication.copy_buffer_bytes", self.copy_buffer_bytes),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be at least 1"));
            }
        }
        if self.stale_after_ms <= self.heartbeat_ms {
            return Err(invalid(
                "replication.stale_after_ms",
                format!(
                    "{} must exceed replication.heartbeat_ms ({}): an idle stream is heard every heartbeat",
                    self.stale_after_ms, self.heartbeat_ms
                ),
            ));
        }
        Ok(())
    }
}
