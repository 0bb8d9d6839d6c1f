//! Configuration of a worker: where the shards are, how to call them, and
//! the load the `worker` binary generates.

use std::collections::HashSet;
use std::path::Path;

use serde::{Deserialize, Serialize};
pub use tessera_config::ConfigError;
use tessera_config::{Validate, invalid};
use tessera_rpc::policy::{FallbackConfig, QuarantineConfig, RetryBudgetConfig, RetryPolicyConfig};
use tessera_rpc::{
    ChannelConfig, RdmaConfig, ReplicaSetConfig, TlsConfig, TransportConfig, TransportKind,
};

/// One ps-server as the worker sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerEndpoint {
    /// `host:port`.
    pub address: String,
    /// Shards it hosts.
    pub shards: Vec<u32>,
    /// Its replica group (failure domain). Default 0.
    #[serde(default)]
    pub replica_group: u32,
}

/// The load the `worker` binary generates.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkloadConfig {
    /// Table to fetch from and push to. Default `embeddings` (the
    /// ps-server's default table).
    pub table: String,
    /// How long to run, in seconds. Default 10.
    pub duration_secs: f64,
    /// User requests (ranker) or training steps (trainer) kept outstanding
    /// at once. Default 8: enough to keep every shard busy on a small
    /// cluster without measuring only queueing.
    pub concurrency: usize,
    /// Each model's keys are drawn uniformly from `0..key_space`. Default
    /// 1,000,000.
    pub key_space: u64,
    /// Seed of the key and size draws, for repeatable runs. Default 1.
    pub seed: u64,
    /// Ranker: models one user request needs (k); each is one Fetch of its
    /// own features, all k concurrent, each split over the shards. Default
    /// 4 (the paper's inference requests touch several models).
    pub models: usize,
    /// Ranker: smallest response of one model's Fetch, in bytes. Default
    /// 1 KiB.
    pub response_bytes_min: usize,
    /// Ranker: largest response of one model's Fetch, in bytes; sizes are
    /// log-uniform between the two, so KiB and MiB responses both occur.
    /// Default 1 MiB.
    pub response_bytes_max: usize,
    /// Trainer: mean size of a step's Fetch (and Push), in bytes. Default
    /// 20 KiB, with `message_bytes_p99` the paper's training message sizes.
    pub message_bytes_mean: usize,
    /// Trainer: 99th percentile of the message size; sizes are log-normal
    /// with this mean and p99. Default 50 KiB.
    pub message_bytes_p99: usize,
    /// Trainer: extra compute time per step, in microseconds, slept after
    /// computing the gradient (a real but small computation). Default 0.
    pub compute_us: u64,
    /// Open loop: iterations started per second over all tasks, each task
    /// at `rate_per_sec / concurrency`, evenly spaced. An iteration's Fetch
    /// latency counts from when it was due, so waiting behind a slow answer
    /// counts too (no coordinated omission); `concurrency` bounds how many
    /// are outstanding. Default 0: closed loop (each task starts its next
    /// iteration when the last one ends), which measures capacity, not
    /// latency at a given load.
    pub rate_per_sec: f64,
}

impl Default for WorkloadConfig {
    fn default() -> Self {
        Self {
            table: "embeddings".into(),
            duration_secs: 10.0,
            concurrency: 8,
            key_space: 1_000_000,
            seed: 1,
            models: 4,
            response_bytes_min: 1024,
            response_bytes_max: 1 << 20,
            message_bytes_mean: 20 * 1024,
            message_bytes_p99: 50 * 1024,
            compute_us: 0,
            rate_per_sec: 0.0,
        }
    }
}

/// Configuration of a worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkerConfig {
    /// Transport: `tcp` (`rdma` and `auto` arrive with the RDMA transport).
    pub transport: TransportKind,
    /// Connection timeout Tc in milliseconds (see `tessera_rpc::ChannelConfig`).
    pub connect_timeout_ms: u64,
    /// Request timeout Tr in milliseconds: the longest one attempt on one
    /// server may take (see `tessera_rpc::ChannelConfig`).
    pub request_timeout_ms: u64,
    /// Connections to each server, calls spread over them in turn
    /// (`tessera_rpc::ChannelConfig::connections`). Default 1; raise it
    /// for large Fetches under many concurrent calls over TCP.
    pub connections: usize,
    /// Threads of the `worker` binary's runtime (a program that embeds
    /// [`crate::PsClient`] runs it on a runtime of its own). Default 1, a
    /// single-threaded runtime: a call's own work in the worker (plan,
    /// encode, decode) is small next to its wake-ups, and with a second
    /// thread answers also woke the parked one (ps-training, trainers at
    /// 2,000 steps/s over TCP on 2 cores: 17% less worker CPU per step,
    /// 2.1 context switches per step instead of 4.0, and 10-30% more steps
    /// per second in a closed loop). Raise it for loads whose decoding
    /// keeps one core busy (rankers with Fetches of many thousand rows on
    /// a host with cores to spare); 0 is one per core. At most 1024.
    pub threads: usize,
    /// A call's whole deadline, retries on other replicas included, in
    /// milliseconds (see `tessera_rpc::ReplicaSetConfig`). Default 100.
    pub call_timeout_ms: u64,
    /// A Push's whole deadline, in milliseconds: how long it follows its
    /// shard's primary through redirects and failovers before it fails
    /// (each attempt bounded by `request_timeout_ms`). Default 10,000:
    /// longer than a failover (`coordinator.failover_timeout_ms`, 3 s, plus
    /// the new primary's recovery), since a trainer would rather wait for
    /// a new primary than drop an update.
    pub push_timeout_ms: u64,
    /// The cluster's coordinator (`[coordinator]`, as the servers'): with
    /// `kind = "etcd"` the worker watches each shard's primary there;
    /// otherwise it learns new primaries from the servers' redirects only.
    pub coordinator: tessera_coord::CoordinatorConfig,
    /// This worker's replica group (failure domain): Fetches prefer the
    /// servers of this group. Default: none preferred.
    pub replica_group: Option<u32>,
    /// Replica groups of the cluster: the servers' `replica_groups`
    /// (shard `s`'s primary is in group `s % replica_groups` until a
    /// failover moves it). Default: one more than the highest group listed
    /// in `servers`, which is right when the worker lists every group. A
    /// worker listing only some groups should set it; if it does not, or
    /// the primary's group is not listed, its first Push to a shard goes to
    /// a server it lists, which redirects it to the primary.
    pub replica_groups: Option<u32>,
    /// Probabilistic retries (`[retry]`: `probability`, `max_attempts`,
    /// `min_remaining_ms`).
    pub retry: RetryPolicyConfig,
    /// Retry budget (`[budget]`: `ratio`, `max_tokens`, `reserve_per_sec`).
    pub budget: RetryBudgetConfig,
    /// Quarantine of failing servers (`[quarantine]`).
    pub quarantine: QuarantineConfig,
    /// RDMA-to-TCP fallback (`[fallback]`: `enabled`, `reconnect_attempts`,
    /// `probe_interval_ms`).
    pub fallback: FallbackConfig,
    /// Largest RPC message in bytes. Default 64 MiB.
    pub max_message_size: u64,
    /// RDMA settings (`[rdma]`: `provider = "ibverbs" | "soft"`, device,
    /// port, queue depths, small-message limit, fragment size), used when
    /// `transport = "rdma"`.
    pub rdma: RdmaConfig,
    /// Total number of shards of the model. Default 1.
    pub num_shards: u32,
    /// The ps-servers. Every shard needs at least one.
    pub servers: Vec<ServerEndpoint>,
    /// The generated load.
    pub workload: WorkloadConfig,
    /// Address of an optional Prometheus endpoint (`GET /metrics`) of the
    /// `worker` binary. Default: none.
    pub metrics_listen: Option<String>,
    /// Address of the `worker` binary's `WorkerAdmin` service (Tessera RPC
    /// over TCP: list and clear the quarantine). Default: none.
    pub admin_listen: Option<String>,
    /// Mutual TLS with the ps-servers (`[tls]`: `cert`, `key`, `ca`,
    /// `server_name`): the worker presents its certificate and verifies
    /// the servers'. Needed where the servers run with `[tls]`. Default:
    /// off.
    pub tls: Option<TlsConfig>,
    /// With `[tls]`: the certificate role (`urn:tessera:role:<name>`) a
    /// caller of `WorkerAdmin` needs. Default `admin`, as the ps-servers'
    /// `[roles] admin`: the same operators' tools.
    pub admin_role: String,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        let channel = ChannelConfig::default();
        Self {
            transport: TransportKind::Tcp,
            connect_timeout_ms: channel.connect_timeout_ms,
            request_timeout_ms: channel.request_timeout_ms,
            connections: channel.connections,
            threads: 1,
            call_timeout_ms: ReplicaSetConfig::default().call_timeout_ms,
            push_timeout_ms: 10_000,
            coordinator: tessera_coord::CoordinatorConfig::default(),
            replica_group: None,
            replica_groups: None,
            retry: RetryPolicyConfig::default(),
            budget: RetryBudgetConfig::default(),
            quarantine: QuarantineConfig::default(),
            fallback: FallbackConfig::default(),
            max_message_size: channel.transport.max_message_size,
            rdma: RdmaConfig::default(),
            num_shards: 1,
            servers: vec![ServerEndpoint {
                address: "127.0.0.1:7070".into(),
                shards: vec![0],
                replica_group: 0,
            }],
            workload: WorkloadConfig::default(),
            metrics_listen: None,
            admin_listen: None,
            tls: None,
            admin_role: "admin".into(),
        }
    }
}

impl WorkerConfig {
    /// Reads and validates a TOML file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        tessera_config::load(path)
    }

    /// Reads a TOML file without validating it (the caller applies its
    /// overrides, then calls [`Validate::validate`]).
    pub fn read(path: &Path) -> Result<Self, ConfigError> {
        tessera_config::read(path)
    }

    /// Replica groups of the model: `replica_groups` if set, else one
    /// more than the highest group listed (shard `s`'s primary is in group
    /// `s % replica_groups()`).
    pub fn replica_groups(&self) -> u32 {
        self.replica_groups.unwrap_or_else(|| {
            self.servers
                .iter()
                .map(|s| s.replica_group + 1)
                .max()
                .unwrap_or(1)
        })
    }

    /// The RPC channel settings this configuration implies.
    pub fn channel_config(&self) -> ChannelConfig {
        ChannelConfig {
            connect_timeout_ms: self.connect_timeout_ms,
            request_timeout_ms: self.request_timeout_ms,
            connections: self.connections,
            fallback: self.fallback,
            transport: TransportConfig {
                kind: self.transport,
                max_message_size: self.max_message_size,
                rdma: self.rdma.clone(),
                tls: self.tls.clone(),
                ..TransportConfig::default()
            },
        }
    }
}

/// Most threads `threads` may ask for.
pub const MAX_THREADS: usize = 1024;

impl WorkerConfig {
    /// The runtime `threads` asks for: a single-threaded one for 1, one
    /// worker thread per core for 0.
    pub fn runtime(&self) -> std::io::Result<tokio::runtime::Runtime> {
        match self.threads {
            1 => tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build(),
            0 => tokio::runtime::Runtime::new(),
            n => tokio::runtime::Builder::new_multi_thread()
                .worker_threads(n)
                .enable_all()
                .build(),
        }
    }
}

impl Validate for WorkerConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.num_shards == 0 {
            return Err(invalid("num_shards", "must be at least 1"));
        }
        if self.threads > MAX_THREADS {
            return Err(invalid(
                "threads",
                format!("{} is more than {MAX_THREADS}", self.threads),
            ));
        }
        let mut covered = HashSet::new();
        for (i, server) in self.servers.iter().enumerate() {
            if server.address.is_empty() {
                return Err(invalid(
                    format!("servers[{i}].address"),
                    "must not be empty",
                ));
            }
            for (j, &shard) in server.shards.iter().enumerate() {
                if shard >= self.num_shards {
                    return Err(invalid(
                        format!("servers[{i}].shards[{j}]"),
                        format!(
                            "shard {shard} does not exist (num_shards = {})",
                            self.num_shards
                        ),
                    ));
                }
                covered.insert(shard);
            }
        }
        if let Some(missing) = (0..self.num_shards).find(|s| !covered.contains(s)) {
            return Err(invalid(
                "servers",
                format!("no server hosts shard {missing}"),
            ));
        }
        if let Some(groups) = self.replica_groups {
            if groups == 0 {
                return Err(invalid("replica_groups", "must be at least 1"));
            }
            if let Some((i, server)) = self
                .servers
                .iter()
                .enumerate()
                .find(|(_, s)| s.replica_group >= groups)
            {
                return Err(invalid(
                    format!("servers[{i}].replica_group"),
                    format!(
                        "group {} does not exist (replica_groups = {groups})",
                        server.replica_group
                    ),
                ));
            }
        }
        let w = &self.workload;
        if !(w.duration_secs.is_finite() && w.duration_secs > 0.0) {
            return Err(invalid(
                "workload.duration_secs",
                "must be a positive number",
            ));
        }
        if w.models == 0 {
            return Err(invalid("workload.models", "must be at least 1"));
        }
        if w.response_bytes_min == 0 || w.response_bytes_max < w.response_bytes_min {
            return Err(invalid(
                "workload.response_bytes_max",
                "need 0 < response_bytes_min <= response_bytes_max",
            ));
        }
        if w.message_bytes_mean == 0 || w.message_bytes_p99 < w.message_bytes_mean {
            return Err(invalid(
                "workload.message_bytes_p99",
                "need 0 < message_bytes_mean <= message_bytes_p99",
            ));
        }
        if w.concurrency == 0 {
            return Err(invalid("workload.concurrency", "must be at least 1"));
        }
        if !w.rate_per_sec.is_finite() || w.rate_per_sec < 0.0 {
            return Err(invalid(
                "workload.rate_per_sec",
                format!("{} is not a rate (0: closed loop)", w.rate_per_sec),
            ));
        }
        if w.key_space == 0 {
            return Err(invalid("workload.key_space", "must be at least 1"));
        }
        if self.call_timeout_ms == 0 {
            return Err(invalid("call_timeout_ms", "must be at least 1"));
        }
        if self.push_timeout_ms == 0 {
            return Err(invalid("push_timeout_ms", "must be at least 1"));
        }
        self.coordinator.validate()?;
        self.retry.validate()?;
        self.budget.validate()?;
        self.quarantine.validate()?;
        if self.admin_role.is_empty() {
            return Err(invalid("admin_role", "must name a role"));
        }
        self.channel_config().validate()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_uncovered_shards_are_not() {
        WorkerConfig::default().validate().unwrap();
        let config = WorkerConfig {
            num_shards: 2,
            ..WorkerConfig::default()
        };
        let err = config.validate().unwrap_err().to_string();
        assert!(
            err.contains("`servers`") && err.contains("shard 1"),
            "{err}"
        );
    }

    #[test]
    fn bad_values_name_their_key() {
        for (text, key) in [
            ("transport = \"smoke-signals\"", "transport"),
            ("[workload]\nconcurrency = 0", "workload.concurrency"),
            ("[workload]\nrate_per_sec = -1.0", "workload.rate_per_sec"),
            (
                "[[servers]]\naddress = \"a:1\"\nshards = [3]",
                "servers[0].shards[0]",
            ),
            (
                "replica_groups = 2\n[[servers]]\naddress = \"a:1\"\nshards = [0]\nreplica_group = 2",
                "servers[0].replica_group",
            ),
            ("replica_groups = 0", "replica_groups"),
            ("threads = 1025", "threads"),
        ] {
            let err = match toml::from_str::<WorkerConfig>(text) {
                Ok(config) => config.validate().unwrap_err().to_string(),
                Err(err) => err.to_string(),
            };
            assert!(err.contains(key), "{text:?}: {err}");
        }
    }

    #[test]
    fn threads_pick_the_runtime() {
        use tokio::runtime::RuntimeFlavor;
        let flavor = |threads| {
            let runtime = WorkerConfig {
                threads,
                ..WorkerConfig::default()
            }
            .runtime()
            .unwrap();
            let flavor = runtime.handle().runtime_flavor();
            let workers = runtime.metrics().num_workers();
            (flavor, workers)
        };
        assert_eq!(flavor(1), (RuntimeFlavor::CurrentThread, 1));
        assert_eq!(flavor(3), (RuntimeFlavor::MultiThread, 3));
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(flavor(0), (RuntimeFlavor::MultiThread, cores));
    }
}
