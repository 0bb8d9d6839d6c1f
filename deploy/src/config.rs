//! The launcher's cluster description.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
pub use tessera_config::ConfigError;
use tessera_config::{Validate, invalid};
use tessera_coord::CoordinatorConfig;
use tessera_ps_server::config::AckMode;
use tessera_ps_server::config::Storage;
use tessera_ps_server::{Mode, TableConfig};
use tessera_rpc::{RdmaConfig, TransportKind};

/// A local cluster: `num_shards` shards in each of `replica_groups` replica
/// groups, one ps-server process per (group, shard), on one host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterConfig {
    /// Address the servers listen on. Default `127.0.0.1`: a local cluster
    /// is not exposed to the network.
    pub host: String,
    /// First port; server `i` (group-major order) listens on
    /// `base_port + i`. Default 0: pick free ports, so that two clusters
    /// (or a cluster and a test run) never collide.
    pub base_port: u16,
    /// Shards of the model. Default 2.
    pub num_shards: u32,
    /// Replica groups; each holds every shard. Default 2: the smallest
    /// layout that exercises both sharding and replication.
    pub replica_groups: u32,
    /// Transport of servers and workers: `tcp` or `rdma`.
    pub transport: TransportKind,
    /// RDMA settings passed to servers and workers (`[rdma]`). The soft
    /// provider works between the processes of one host (no device);
    /// `ibverbs` needs an RDMA device.
    pub rdma: RdmaConfig,
    /// `training` or `inference`. Default `training`.
    pub mode: Mode,
    /// Row initialiser seed, the same for every replica. Default 42.
    pub seed: u64,
    /// How long servers may take to become healthy, in milliseconds.
    /// Default 20000 ms: a cold start of a debug build on a loaded 2-core
    /// host takes a few seconds.
    pub startup_timeout_ms: u64,
    /// How long servers may take to stop after SIGTERM before they are
    /// killed, in milliseconds. Default 10000 ms (longer than the servers'
    /// own 5 s shutdown grace).
    pub stop_timeout_ms: u64,
    /// The ps-server binary. Default: `ps-server` next to `tessera`, else
    /// on `PATH` (the environment variable `TESSERA_PS_SERVER_BIN` overrides).
    pub ps_server_bin: Option<PathBuf>,
    /// Tables. Default: one table `embeddings` of dimension 32.
    pub tables: Vec<TableConfig>,
    /// The workers' connection timeout Tc, in milliseconds. Default 1000.
    /// A local cluster shares one host's cores among all its servers and
    /// the worker (often debug builds): the paper's 10 ms, the worker's own
    /// default, would measure this host's scheduler rather than the RPC
    /// layer. A fleet's workers keep the worker defaults.
    pub worker_connect_timeout_ms: u64,
    /// The workers' per-attempt timeout Tr, in milliseconds. Default 1000
    /// (the paper's 40 ms is the worker default; see above).
    pub worker_request_timeout_ms: u64,
    /// The workers' whole-call deadline, in milliseconds. Default 2500:
    /// room for a second attempt on another replica.
    pub worker_call_timeout_ms: u64,
    /// Who decides the primaries, for servers and workers
    /// (`[coordinator]`): `static` (fixed primaries, no failover: a dead
    /// primary's shard takes no Pushes until it is back) or `etcd`
    /// (leases, automatic promotion with fencing). Default static.
    pub coordinator: CoordinatorConfig,
    /// With `coordinator.kind = "etcd"`: start a local etcd for the
    /// cluster (one member, on a free loopback port, its data in the run
    /// directory, stopped with the cluster) and use it instead of
    /// `coordinator.endpoints`. Default true: a one-host cluster has no
    /// etcd of its own; set false to use the one `endpoints` names.
    pub local_etcd: bool,
    /// Members of the local etcd: 1 (default: a one-host cluster loses its
    /// coordinator with its host anyway), or 3, 5, 7 to survive the loss of
    /// a member, its leader included (the fault soak runs three).
    pub local_etcd_members: usize,
    /// Seconds between each server's periodic checkpoints, into
    /// `checkpoints/ps-gG-sS` under the run directory (restored when a
    /// server starts again). Default 0: none (a local cluster is usually a
    /// test bed; set it to see saves and `tessera status`'s checkpoint
    /// column).
    pub checkpoint_interval_secs: u64,
    /// The etcd binary for `local_etcd`. Default: `etcd` on `PATH`, else
    /// `/usr/bin/etcd` (the environment variable `TESSERA_ETCD_BIN`
    /// overrides).
    pub etcd_bin: Option<PathBuf>,
    /// When a primary acknowledges a Push: `replicas` (once every replica
    /// in step applied it: none is lost in a failover) or `primary` (once
    /// it applied it: faster; a failover may lose the unforwarded tail).
    /// Default `replicas`.
    pub ack: AckMode,
    /// A serving fleet fed by this (training) fleet's delta stream
    /// (`[serving]`: `num_shards`, `replica_groups`, `interval_ms`,
    /// `max_rows`, `max_delay_ms`, `storage`): started first, its servers
    /// in `mode = "serving"`, every training server given `[delta]`
    /// naming all of them; rankers use `ranker.toml`. Default: none.
    pub serving: Option<ServingFleetConfig>,
}

/// A serving fleet beside the training fleet (`[serving]` of a cluster
/// file).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServingFleetConfig {
    /// Its shard count (rows are routed by key; it may differ from the
    /// training fleet's). Default 3.
    pub num_shards: u32,
    /// Copies of each serving shard. Default 2: rankers have another copy
    /// to read while one restarts or copies.
    pub replica_groups: u32,
    /// `delta.interval_ms` of the training servers. Default 1000.
    pub interval_ms: u64,
    /// `delta.max_rows` of the training servers. Default 100,000.
    pub max_rows: u64,
    /// `serving.max_delay_ms` of the serving servers. Default 0 (always
    /// answer).
    pub max_delay_ms: u64,
    /// How the serving fleet stores values (`f32`, `f16`, `bf16`), for
    /// every table. Default: as the training table says.
    pub storage: Option<Storage>,
}

impl Default for ServingFleetConfig {
    fn default() -> Self {
        let delta = tessera_ps_server::config::DeltaConfig::default();
        Self {
            num_shards: 3,
            replica_groups: 2,
            interval_ms: delta.interval_ms,
            max_rows: delta.max_rows,
            max_delay_ms: 0,
            storage: None,
        }
    }
}

impl ServingFleetConfig {
    /// Number of serving server processes.
    pub fn servers(&self) -> u32 {
        self.num_shards.saturating_mul(self.replica_groups)
    }
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            base_port: 0,
            num_shards: 2,
            replica_groups: 2,
            transport: TransportKind::Tcp,
            rdma: RdmaConfig::default(),
            mode: Mode::Training,
            seed: 42,
            startup_timeout_ms: 20_000,
            stop_timeout_ms: 10_000,
            ps_server_bin: None,
            tables: vec![TableConfig::new("embeddings", 32)],
            worker_connect_timeout_ms: 1000,
            worker_request_timeout_ms: 1000,
            worker_call_timeout_ms: 2500,
            coordinator: CoordinatorConfig::default(),
            local_etcd: true,
            local_etcd_members: 1,
            checkpoint_interval_secs: 0,
            etcd_bin: None,
            ack: AckMode::Replicas,
            serving: None,
        }
    }
}

/// Most servers one launcher starts on one host.
pub const MAX_SERVERS: u32 = 256;

impl ClusterConfig {
    /// Reads and validates a TOML file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        tessera_config::load(path)
    }

    /// Number of training server processes.
    pub fn servers(&self) -> u32 {
        self.num_shards.saturating_mul(self.replica_groups)
    }

    /// Number of server processes, serving fleet included.
    pub fn all_servers(&self) -> u32 {
        self.servers()
            .saturating_add(self.serving.as_ref().map_or(0, ServingFleetConfig::servers))
    }
}

impl Validate for ClusterConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.num_shards == 0 {
            return Err(invalid("num_shards", "must be at least 1"));
        }
        if self.replica_groups == 0 {
            return Err(invalid("replica_groups", "must be at least 1"));
        }
        if !(1..=7).contains(&self.local_etcd_members) || self.local_etcd_members.is_multiple_of(2)
        {
            return Err(invalid(
                "local_etcd_members",
                "must be 1, 3, 5 or 7 (a Raft majority)",
            ));
        }
        if let Some(serving) = &self.serving {
            if serving.num_shards == 0 {
                return Err(invalid("serving.num_shards", "must be at least 1"));
            }
            if serving.replica_groups == 0 {
                return Err(invalid("serving.replica_groups", "must be at least 1"));
            }
            if self.mode != Mode::Training {
                return Err(invalid(
                    "serving",
                    "a serving fleet is fed by a training fleet: mode must be `training`",
                ));
            }
            let delta = tessera_ps_server::config::DeltaConfig {
                num_shards: serving.num_shards,
                interval_ms: serving.interval_ms,
                max_rows: serving.max_rows,
                servers: vec![tessera_ps_server::config::ServingServer {
                    address: "probe:1".into(),
                    shards: (0..serving.num_shards).collect(),
                }],
                ..Default::default()
            };
            let probe = tessera_ps_server::PsServerConfig {
                delta,
                ..tessera_ps_server::PsServerConfig::default()
            };
            probe.validate().map_err(|err| match err {
                tessera_ps_server::ConfigError::Invalid { key, reason } => ConfigError::Invalid {
                    key: key.replacen("delta.", "serving.", 1),
                    reason,
                },
                other => invalid("serving", other.to_string()),
            })?;
            let serving_probe = tessera_ps_server::PsServerConfig {
                mode: Mode::Serving,
                serving: tessera_ps_server::config::ServingConfig {
                    max_delay_ms: serving.max_delay_ms,
                },
                ..tessera_ps_server::PsServerConfig::default()
            };
            serving_probe.validate().map_err(|err| match err {
                tessera_ps_server::ConfigError::Invalid { key, reason } => {
                    ConfigError::Invalid { key, reason }
                }
                other => invalid("serving", other.to_string()),
            })?;
        }
        if self.all_servers() > MAX_SERVERS {
            return Err(invalid(
                "num_shards",
                format!(
                    "{} processes (both fleets) exceed {MAX_SERVERS}",
                    self.all_servers()
                ),
            ));
        }
        if self.base_port != 0 && u32::from(self.base_port) + self.all_servers() > 65_536 {
            return Err(invalid(
                "base_port",
                format!(
                    "{} leaves no room for {} servers",
                    self.base_port,
                    self.all_servers()
                ),
            ));
        }
        for (key, value) in [
            ("worker_connect_timeout_ms", self.worker_connect_timeout_ms),
            ("worker_request_timeout_ms", self.worker_request_timeout_ms),
            ("worker_call_timeout_ms", self.worker_call_timeout_ms),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be at least 1"));
            }
        }
        if self.host.is_empty() {
            return Err(invalid("host", "must not be empty"));
        }
        if self.startup_timeout_ms == 0 {
            return Err(invalid("startup_timeout_ms", "must be at least 1"));
        }
        self.coordinator.validate()?;
        // The tables are checked by the ps-server's own validation, with
        // the same keys.
        let probe = tessera_ps_server::PsServerConfig {
            tables: self.tables.clone(),
            ..tessera_ps_server::PsServerConfig::default()
        };
        probe.validate().map_err(|err| match err {
            tessera_ps_server::ConfigError::Invalid { key, reason } => {
                ConfigError::Invalid { key, reason }
            }
            other => invalid("tables", other.to_string()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_example_is_valid_and_equals_the_defaults() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("local/cluster.toml");
        let config = ClusterConfig::load(&path).unwrap();
        assert_eq!(config, ClusterConfig::default());
    }

    #[test]
    fn the_failover_example_is_valid() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("local/failover.toml");
        let config = ClusterConfig::load(&path).unwrap();
        assert!(config.coordinator.is_etcd() && config.local_etcd);
    }

    #[test]
    fn the_serving_example_is_valid() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("local/serving.toml");
        let config = ClusterConfig::load(&path).unwrap();
        let serving = config.serving.as_ref().expect("a serving fleet");
        assert_eq!((serving.num_shards, serving.replica_groups), (3, 2));
        assert_eq!(config.all_servers(), 10);
    }

    #[test]
    fn bad_values_name_their_key() {
        for (text, key) in [
            ("replica_groups = 0", "replica_groups"),
            ("local_etcd_members = 2", "local_etcd_members"),
            ("transport = \"tin-cans\"", "transport"),
            ("[[tables]]\nname = \"t\"\ndim = 0", "tables[0].dim"),
            ("base_port = 65535", "base_port"),
            ("[serving]\nnum_shards = 0", "serving.num_shards"),
            ("[serving]\ninterval_ms = 1", "serving.interval_ms"),
            ("[serving]\nmax_rows = 0", "serving.max_rows"),
            (
                "[coordinator]\nkind = \"etcd\"\nfailover_timeout_ms = 10",
                "coordinator.failover_timeout_ms",
            ),
        ] {
            let err = match toml::from_str::<ClusterConfig>(text) {
                Ok(config) => config.validate().unwrap_err().to_string(),
                Err(err) => err.to_string(),
            };
            assert!(err.contains(key), "{text:?}: {err}");
        }
    }
}
