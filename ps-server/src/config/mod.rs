//! Configuration of a ps-server, read from TOML and overridable by flags.

mod checkpoint;
mod delta;
mod replication;

use std::path::Path;

use serde::{Deserialize, Serialize};
pub use tessera_config::ConfigError;
use tessera_config::{Validate, invalid};
pub use tessera_coord::{CoordinatorConfig, CoordinatorKind};
use tessera_rpc::{
    InboundConfig, RdmaConfig, ServerConfig, TlsConfig, TransportConfig, TransportKind,
};

pub use self::checkpoint::CheckpointConfig;
pub use self::delta::{DeltaConfig, ServingConfig, ServingServer};
pub use self::replication::{AckMode, PeerConfig, ReplicationConfig};
pub use tessera_store::config::{
    EvictionPolicy, Initializer, KeepChanges, MAX_DIM, Mode, NonFinite, OptimizerConfig, Storage,
    StoreConfig, TableConfig,
};

/// Configuration of one ps-server process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PsServerConfig {
    /// Address to listen on. Default `127.0.0.1:7070`: loopback, so a server
    /// started by hand is not exposed before its operator means it to be.
    pub listen: String,
    /// Transport: `tcp` (`rdma` and `auto` arrive with the RDMA transport).
    pub transport: TransportKind,
    /// Largest RPC message in bytes. Default 64 MiB (see the transport docs).
    pub max_message_size: u64,
    /// `training`, `inference` or `serving` (fed by a training fleet's
    /// `[delta]` stream). Default `training`.
    pub mode: Mode,
    /// Seed of the deterministic row initialiser. Every replica of a shard
    /// must use the same seed so that they initialise rows identically.
    /// Default 42.
    pub seed: u64,
    /// Total number of shards of the model. Default 1.
    pub num_shards: u32,
    /// Shards this server hosts. Default `[0]`.
    pub shards: Vec<u32>,
    /// RDMA settings (`[rdma]`: `provider = "ibverbs" | "soft"`, device,
    /// port, queue depths, small-message limit, fragment size), used when
    /// `transport = "rdma"`.
    pub rdma: RdmaConfig,
    /// Replica group (failure domain) of this server. Default 0.
    pub replica_group: u32,
    /// Replica groups of the model. Default 1. In static mode the primary
    /// of shard `s` — the server that takes its Pushes and forwards them to
    /// the other groups — is the one in group `s % replica_groups`, so
    /// primaries are spread over the groups; with a coordinator that
    /// server is the preferred one when the shard first needs a primary.
    pub replica_groups: u32,
    /// The other servers of the model (`[[peers]]`: `address`,
    /// `replica_group`, `shards`): the replicas a primary forwards to, and
    /// the primary a replica copies a shard from. Default none.
    pub peers: Vec<PeerConfig>,
    /// This server's address as its peers know it (their `peers` entry).
    /// Default: `listen`.
    pub advertise: Option<String>,
    /// Forwarding of Pushes to replicas (`[replication]`).
    pub replication: ReplicationConfig,
    /// Who decides the primaries (`[coordinator]`: `kind = "static" |
    /// "etcd"`, `endpoints`, `cluster`, `failover_timeout_ms`). Default
    /// static: fixed primaries, no failover.
    pub coordinator: CoordinatorConfig,
    /// How long in-flight requests may finish on shutdown, in milliseconds.
    /// Default 5000 ms.
    pub shutdown_grace_ms: u64,
    /// The tables every hosted shard holds. Default: one table `embeddings`
    /// of dimension 16.
    pub tables: Vec<TableConfig>,
    /// Address of an optional gRPC endpoint serving the same handlers to
    /// standard gRPC clients (grpcurl, grpcio, ...). Default: none, since
    /// workers use the Tessera endpoint; turn it on for tools and clients
    /// in other languages.
    pub grpc_listen: Option<String>,
    /// Address of an optional Prometheus endpoint (`GET /metrics`).
    /// Default: none.
    pub metrics_listen: Option<String>,
    /// Keys one Fetch or Push may carry. Default 1,000,000: a ranker
    /// request of a few thousand features fits with room to spare, while a
    /// runaway client cannot make one request hold the server for seconds.
    pub max_keys_per_request: u32,
    /// Workers whose Push sequences each shard remembers (exactly-once
    /// Push). Default 100,000: far more trainers than one job runs. A new
    /// worker beyond it is refused (`ResourceExhausted`) until some have
    /// been idle for `dedup_idle_secs`: forgetting a live one instead would
    /// apply its retried Pushes twice.
    pub dedup_max_workers: u32,
    /// A worker silent this long is forgotten by the Push deduplication, in
    /// seconds. Default 3600: longer than any retry of a Push could come.
    pub dedup_idle_secs: u64,
    /// Checkpoints (`[checkpoint]`).
    pub checkpoint: CheckpointConfig,
    /// What accepted connections may hold and for how long (`[inbound]`:
    /// `max_bytes`, `max_connection_bytes`, `frame_timeout_ms`,
    /// `handshake_timeout_ms`, `idle_timeout_ms`, `max_connections`; see
    /// docs/src/reference/configuration.md, "Limits").
    pub inbound: InboundConfig,
    /// Requests one connection may have in flight; more are answered
    /// `ResourceExhausted`. Default 1024.
    pub max_requests_per_connection: usize,
    /// Mutual TLS (`[tls]`: `cert`, `key`, `ca`, `server_name`) on the
    /// Tessera endpoint (TCP frames and the RDMA handshake), on this
    /// server's own calls to its peers (replication, which therefore
    /// presents this server's certificate), and on the gRPC endpoint.
    /// Default: off, for one host or a network only the fleet reaches;
    /// a fleet turns it on (see docs/src/concepts/security.md).
    pub tls: Option<TlsConfig>,
    /// The roles callers' certificates must give to use the Admin and
    /// Replication services (`[roles]`), checked when `[tls]` is on.
    pub roles: RolesConfig,
    /// A training server's stream of changed rows to a serving fleet
    /// (`[delta]`: `num_shards`, `[[delta.servers]]`, `interval_ms`,
    /// `max_rows`, `optimizer_state`). Default: none.
    pub delta: DeltaConfig,
    /// A serving server's freshness bound (`[serving]`: `max_delay_ms`).
    pub serving: ServingConfig,
}

/// Which certificate role each guarded service requires (`[roles]`).
///
/// A role is a `urn:tessera:role:<name>` URI SAN in the caller's
/// certificate. Fetch, Push and Health need none: any peer of the CA
/// (every worker) may call them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RolesConfig {
    /// Role for `Admin` (checkpoints, statistics, digests). Default
    /// `admin`: operators' tools, not workers, take checkpoints.
    pub admin: String,
    /// Role for `Replication` (forwarded Pushes, shard copies). Default
    /// `replication`: only the fleet's servers may write to a replica, so
    /// every ps-server's certificate carries it.
    pub replication: String,
}

impl Default for RolesConfig {
    fn default() -> Self {
        Self {
            admin: "admin".into(),
            replication: "replication".into(),
        }
    }
}

impl Validate for RolesConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        for (key, role) in [
            ("roles.admin", &self.admin),
            ("roles.replication", &self.replication),
        ] {
            if role.is_empty()
                || !role
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
            {
                return Err(invalid(
                    key,
                    format!("`{role}` is not a role name (letters, digits, `-`, `_`, `.`)"),
                ));
            }
        }
        Ok(())
    }
}

impl Default for PsServerConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:7070".into(),
            transport: TransportKind::Tcp,
            max_message_size: TransportConfig::default().max_message_size,
            mode: Mode::Training,
            seed: 42,
            num_shards: 1,
            shards: vec![0],
            rdma: RdmaConfig::default(),
            replica_group: 0,
            replica_groups: 1,
            peers: Vec::new(),
            advertise: None,
            replication: ReplicationConfig::default(),
            coordinator: CoordinatorConfig::default(),
            shutdown_grace_ms: 5000,
            tables: vec![TableConfig::new("embeddings", 16)],
            grpc_listen: None,
            metrics_listen: None,
            max_keys_per_request: 1_000_000,
            dedup_max_workers: 100_000,
            dedup_idle_secs: 3600,
            checkpoint: CheckpointConfig::default(),
            inbound: InboundConfig::default(),
            max_requests_per_connection: ServerConfig::default().max_requests_per_connection,
            tls: None,
            roles: RolesConfig::default(),
            delta: DeltaConfig::default(),
            serving: ServingConfig::default(),
        }
    }
}

impl PsServerConfig {
    /// The replica group holding the primary of `shard`.
    pub fn primary_group(&self, shard: u32) -> u32 {
        tessera_proto::sharding::primary_group(shard, self.replica_groups)
    }

    /// Whether this server is the primary of `shard` (a serving server
    /// leads all its shards: each copy stands alone).
    pub fn is_primary(&self, shard: u32) -> bool {
        self.mode == Mode::Serving || self.primary_group(shard) == self.replica_group
    }

    /// Drops this server's own entry from `peers`, where the list is a
    /// fleet-wide shard map that names every server (one ConfigMap for
    /// every pod of a StatefulSet): an entry at the advertised address
    /// with this server's replica group and shards. An entry at that
    /// address that disagrees with them stays, and validation refuses it.
    /// Returns whether one was dropped.
    pub fn drop_own_peer_entry(&mut self) -> bool {
        let me = self.advertised().to_owned();
        let mut shards = self.shards.clone();
        shards.sort_unstable();
        let group = self.replica_group;
        let before = self.peers.len();
        self.peers.retain(|p| {
            let mut theirs = p.shards.clone();
            theirs.sort_unstable();
            !(p.address == me && p.replica_group == group && theirs == shards)
        });
        self.peers.len() != before
    }

    /// This server's address as its peers know it.
    pub fn advertised(&self) -> &str {
        self.advertise.as_deref().unwrap_or(&self.listen)
    }

    /// Reads and validates a TOML file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        tessera_config::load(path)
    }

    /// Reads `path` without validating it (the caller applies overrides,
    /// then calls [`Validate::validate`]).
    pub fn read(path: &Path) -> Result<Self, ConfigError> {
        tessera_config::read(path)
    }

    /// Whether this server may give keys to a resize of the cluster's
    /// shard count, and take them in one: a training server in etcd mode
    /// (the shard map lives in etcd).
    pub fn takes_part_in_resizes(&self) -> bool {
        self.mode == Mode::Training && self.coordinator.is_etcd()
    }

    /// The store this configuration describes: its tables and shards, and
    /// whether it keeps changed keys for a stream (always with `[delta]`
    /// on a training server; for resizes on one in etcd mode).
    pub fn store(&self) -> StoreConfig {
        let keep_changes = match self.mode {
            Mode::Training if self.delta.enabled() => KeepChanges::Always,
            Mode::Training if self.takes_part_in_resizes() => KeepChanges::ForResizes,
            _ => KeepChanges::Never,
        };
        StoreConfig {
            mode: self.mode,
            seed: self.seed,
            num_shards: self.num_shards,
            shards: self.shards.clone(),
            tables: self.tables.clone(),
            max_keys_per_request: self.max_keys_per_request,
            max_message_size: self.max_message_size,
            dedup_max_workers: self.dedup_max_workers,
            dedup_idle_secs: self.dedup_idle_secs,
            keep_changes,
            changes_wake_rows: self.delta.max_rows,
        }
    }

    /// The RPC server settings this configuration implies.
    pub fn server_config(&self) -> ServerConfig {
        ServerConfig {
            shutdown_grace_ms: self.shutdown_grace_ms,
            max_requests_per_connection: self.max_requests_per_connection,
            transport: self.transport_config(),
        }
    }

    fn transport_config(&self) -> TransportConfig {
        TransportConfig {
            kind: self.transport,
            max_message_size: self.max_message_size,
            rdma: self.rdma.clone(),
            inbound: self.inbound.clone(),
            tls: self.tls.clone(),
            ..TransportConfig::default()
        }
    }
}

impl Validate for PsServerConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        // The store's keys (shards, tables, request bounds) sit at the
        // top level of this file, so its errors name them as written.
        self.store().validate()?;
        if self.replica_groups == 0 {
            return Err(invalid("replica_groups", "must be at least 1"));
        }
        if self.replica_group >= self.replica_groups {
            return Err(invalid(
                "replica_group",
                format!(
                    "{} is not below replica_groups = {}",
                    self.replica_group, self.replica_groups
                ),
            ));
        }
        for (i, peer) in self.peers.iter().enumerate() {
            if peer.replica_group >= self.replica_groups {
                return Err(invalid(
                    format!("peers[{i}].replica_group"),
                    format!(
                        "{} is not below replica_groups = {}",
                        peer.replica_group, self.replica_groups
                    ),
                ));
            }
            if let Some(j) = peer.shards.iter().position(|&s| s >= self.num_shards) {
                return Err(invalid(
                    format!("peers[{i}].shards[{j}]"),
                    format!("shard {} does not exist", peer.shards[j]),
                ));
            }
        }
        if self.mode == Mode::Serving {
            // Each serving server is fed by the training primaries on its
            // own: nothing to replicate, no primary to elect.
            if !self.peers.is_empty() {
                return Err(invalid(
                    "peers",
                    "a serving server has no peers: the training fleet feeds every copy",
                ));
            }
            if self.coordinator.kind != CoordinatorKind::Static {
                return Err(invalid(
                    "coordinator.kind",
                    "a serving server takes no Pushes and needs no primary: use `static`",
                ));
            }
        }
        if self.delta.enabled() && self.mode != Mode::Training {
            return Err(invalid(
                "delta.servers",
                "only a training server sends a delta stream",
            ));
        }
        for (i, &shard) in self.shards.iter().enumerate() {
            let primary = self.primary_group(shard);
            if self.mode != Mode::Serving
                && primary != self.replica_group
                && !self
                    .peers
                    .iter()
                    .any(|p| p.replica_group == primary && p.shards.contains(&shard))
            {
                return Err(invalid(
                    format!("shards[{i}]"),
                    format!(
                        "shard {shard}'s primary is in replica group {primary}, and no peer of that group hosts it"
                    ),
                ));
            }
        }
        self.replication.validate()?;
        self.coordinator.validate()?;
        self.delta.validate()?;
        self.serving.validate()?;
        if self.peers.iter().any(|p| p.address == self.advertised()) {
            return Err(invalid(
                "peers",
                format!("lists this server itself ({})", self.advertised()),
            ));
        }
        if self.checkpoint.keep == 0 {
            return Err(invalid("checkpoint.keep", "must be at least 1"));
        }
        if self.checkpoint.interval_secs > 0 && self.checkpoint.dir.is_none() {
            return Err(invalid(
                "checkpoint.interval_secs",
                "periodic checkpoints need checkpoint.dir",
            ));
        }
        self.roles.validate()?;
        if let Some(tls) = &self.tls {
            tls.validate().map_err(|err| match err {
                ConfigError::Invalid { key, reason } => invalid(format!("tls.{key}"), reason),
                other => other,
            })?;
        }
        self.server_config().validate()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<PsServerConfig, String> {
        let config: PsServerConfig = toml::from_str(text).map_err(|e| e.to_string())?;
        config.validate().map_err(|e| e.to_string())?;
        Ok(config)
    }

    #[test]
    fn a_fleet_wide_shard_map_drops_this_servers_own_entry_only_when_it_agrees() {
        let map = r#"
            num_shards = 2
            replica_groups = 2
            [[peers]]
            address = "ps-g0-0.ps-g0:7000"
            replica_group = 0
            shards = [0]
            [[peers]]
            address = "ps-g0-1.ps-g0:7000"
            replica_group = 0
            shards = [1]
            [[peers]]
            address = "ps-g1-0.ps-g1:7000"
            replica_group = 1
            shards = [0]
            [[peers]]
            address = "ps-g1-1.ps-g1:7000"
            replica_group = 1
            shards = [1]
        "#;
        let mut config: PsServerConfig = toml::from_str(map).unwrap();
        config.advertise = Some("ps-g1-0.ps-g1:7000".into());
        config.replica_group = 1;
        config.shards = vec![0];
        // As written, it lists itself: refused.
        let err = config.validate().unwrap_err();
        assert!(err.key().is_some_and(|k| k.starts_with("peers")), "{err}");
        assert!(config.drop_own_peer_entry());
        assert_eq!(config.peers.len(), 3);
        config.validate().unwrap();
        // An entry at its address that says another shard is not itself:
        // it stays, and validation says so.
        let mut wrong: PsServerConfig = toml::from_str(map).unwrap();
        wrong.advertise = Some("ps-g1-0.ps-g1:7000".into());
        wrong.replica_group = 1;
        wrong.shards = vec![1];
        assert!(!wrong.drop_own_peer_entry());
        assert!(wrong.validate().is_err());
    }

    #[test]
    fn defaults_are_valid() {
        PsServerConfig::default().validate().unwrap();
        assert_eq!(parse("").unwrap(), PsServerConfig::default());
    }

    #[test]
    fn full_example_parses() {
        let config = parse(
            r#"
            listen = "127.0.0.1:9000"
            transport = "tcp"
            mode = "inference"
            num_shards = 4
            shards = [1, 3]
            replica_group = 1
            replica_groups = 2
            [[peers]]
            address = "10.0.0.2:7070"
            replica_group = 0
            shards = [0, 2]
            [[tables]]
            name = "user"
            dim = 8
            optimizer = { kind = "adagrad", learning_rate = 0.5 }
            initializer = { kind = "normal", std = 0.05 }
            max_rows = 100000
            eviction = "lfu"
            non_finite = "clip"
            [[tables]]
            name = "item"
            dim = 4
            "#,
        )
        .unwrap();
        assert_eq!(config.mode, Mode::Inference);
        assert_eq!(config.shards, vec![1, 3]);
        assert_eq!(config.tables[0].optimizer, OptimizerConfig::adagrad(0.5));
        assert_eq!(
            config.tables[0].initializer,
            Initializer::Normal { std: 0.05 }
        );
        assert_eq!(config.tables[0].eviction, EvictionPolicy::Lfu);
        assert_eq!(config.tables[1], TableConfig::new("item", 4));
    }

    #[test]
    fn bad_values_name_their_key() {
        let cases = [
            ("transport = \"carrier-pigeon\"", "transport"),
            ("num_shards = 2\nshards = [2]", "shards[0]"),
            ("shards = [0, 0]", "shards[1]"),
            ("[[tables]]\nname = \"t\"\ndim = 0", "tables[0].dim"),
            (
                "[[tables]]\nname = \"t\"\ndim = 4\noptimizer = { kind = \"sgd\", learning_rate = -1.0 }",
                "tables[0].optimizer.learning_rate",
            ),
            (
                "[[tables]]\nname = \"t\"\ndim = 4\nmax_rows = 0",
                "tables[0].max_rows",
            ),
            ("max_keys_per_request = 0", "max_keys_per_request"),
            (
                "[[tables]]\nname = \"t\"\ndim = 4\n[[tables]]\nname = \"t\"\ndim = 4",
                "tables[1].name",
            ),
            ("mode = \"sideways\"", "mode"),
            ("colour = \"blue\"", "colour"),
        ];
        for (text, key) in cases {
            let err = parse(text).unwrap_err();
            assert!(
                err.contains(key),
                "error for {text:?} should name {key}: {err}"
            );
        }
        let err = parse("transport = \"udp\"").unwrap_err();
        assert!(err.contains("allowed: tcp"), "{err}");
    }
}
