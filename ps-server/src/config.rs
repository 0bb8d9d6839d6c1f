//! Configuration of a ps-server, read from TOML and overridable by flags.

use std::collections::HashSet;
use std::path::Path;

use serde::{Deserialize, Serialize};
pub use tessera_config::ConfigError;
use tessera_config::{Validate, invalid};
use tessera_rpc::{RdmaConfig, ServerConfig, TransportConfig, TransportKind};

/// How a server fills rows it has never seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Missing rows are initialised deterministically from `seed` and
    /// stored; Push is accepted.
    #[default]
    Training,
    /// Missing rows read as zeros and are not stored; Push is refused.
    Inference,
}

/// One embedding table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TableConfig {
    /// Table name, as used in Fetch and Push.
    pub name: String,
    /// Values per row.
    pub dim: u32,
    /// SGD learning rate. Default 0.01, a common starting point for
    /// embedding tables trained with plain SGD.
    #[serde(default = "default_learning_rate")]
    pub learning_rate: f32,
    /// Initial values are uniform in `[-init_scale, init_scale)`. Default
    /// 0.01: small random rows break symmetry without saturating anything.
    #[serde(default = "default_init_scale")]
    pub init_scale: f32,
}

fn default_learning_rate() -> f32 {
    0.01
}

fn default_init_scale() -> f32 {
    0.01
}

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
    /// `training` or `inference`. Default `training`.
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
            shutdown_grace_ms: 5000,
            tables: vec![TableConfig {
                name: "embeddings".into(),
                dim: 16,
                learning_rate: default_learning_rate(),
                init_scale: default_init_scale(),
            }],
            grpc_listen: None,
            metrics_listen: None,
        }
    }
}

/// Most values per row: beyond this a single row would be larger than any
/// sane embedding and a Fetch of a few keys could exceed message limits.
pub const MAX_DIM: u32 = 65_536;

impl PsServerConfig {
    /// Reads and validates a TOML file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        tessera_config::load(path)
    }

    /// The RPC server settings this configuration implies.
    pub fn server_config(&self) -> ServerConfig {
        ServerConfig {
            shutdown_grace_ms: self.shutdown_grace_ms,
            transport: self.transport_config(),
        }
    }

    fn transport_config(&self) -> TransportConfig {
        TransportConfig {
            kind: self.transport,
            max_message_size: self.max_message_size,
            rdma: self.rdma.clone(),
            ..TransportConfig::default()
        }
    }
}

impl Validate for PsServerConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.num_shards == 0 {
            return Err(invalid("num_shards", "must be at least 1"));
        }
        if self.shards.is_empty() {
            return Err(invalid("shards", "a server must host at least one shard"));
        }
        let mut seen = HashSet::new();
        for (i, &shard) in self.shards.iter().enumerate() {
            if shard >= self.num_shards {
                return Err(invalid(
                    format!("shards[{i}]"),
                    format!(
                        "shard {shard} does not exist (num_shards = {})",
                        self.num_shards
                    ),
                ));
            }
            if !seen.insert(shard) {
                return Err(invalid(
                    format!("shards[{i}]"),
                    format!("shard {shard} is listed twice"),
                ));
            }
        }
        if self.tables.is_empty() {
            return Err(invalid("tables", "at least one table is required"));
        }
        let mut names = HashSet::new();
        for (i, table) in self.tables.iter().enumerate() {
            if table.name.is_empty() {
                return Err(invalid(format!("tables[{i}].name"), "must not be empty"));
            }
            if !names.insert(table.name.as_str()) {
                return Err(invalid(
                    format!("tables[{i}].name"),
                    format!("table `{}` is declared twice", table.name),
                ));
            }
            if table.dim == 0 || table.dim > MAX_DIM {
                return Err(invalid(
                    format!("tables[{i}].dim"),
                    format!("{} is outside 1..={MAX_DIM}", table.dim),
                ));
            }
            if !table.learning_rate.is_finite() || table.learning_rate <= 0.0 {
                return Err(invalid(
                    format!("tables[{i}].learning_rate"),
                    format!("{} is not a positive finite number", table.learning_rate),
                ));
            }
            if !table.init_scale.is_finite() || table.init_scale < 0.0 {
                return Err(invalid(
                    format!("tables[{i}].init_scale"),
                    format!("{} is not a non-negative finite number", table.init_scale),
                ));
            }
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
            [[tables]]
            name = "user"
            dim = 8
            learning_rate = 0.5
            "#,
        )
        .unwrap();
        assert_eq!(config.mode, Mode::Inference);
        assert_eq!(config.shards, vec![1, 3]);
        assert_eq!(config.tables[0].init_scale, 0.01);
    }

    #[test]
    fn bad_values_name_their_key() {
        let cases = [
            ("transport = \"carrier-pigeon\"", "transport"),
            ("num_shards = 2\nshards = [2]", "shards[0]"),
            ("shards = [0, 0]", "shards[1]"),
            ("[[tables]]\nname = \"t\"\ndim = 0", "tables[0].dim"),
            (
                "[[tables]]\nname = \"t\"\ndim = 4\nlearning_rate = -1.0",
                "tables[0].learning_rate",
            ),
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
