//! Starting, watching and stopping the ps-server processes of a local
//! cluster (and its local etcd, with failover on); killing and restarting
//! one of them, for drills.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tessera_coord::{LocalEtcd, LocalEtcdError};
use tessera_ps_server::PsServerConfig;
use tessera_ps_server::config::{CheckpointConfig, PeerConfig, ReplicationConfig};
use tessera_rpc::RdmaConfig;
use tessera_worker::{PsClient, ServerEndpoint, WorkerConfig};
use tokio::process::{Child, Command};

use crate::config::ClusterConfig;

/// Why the cluster could not be started or stopped cleanly.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LaunchError {
    /// The ps-server binary was not found.
    #[error(
        "ps-server binary not found (looked at {looked:?}); build it with `cargo build --bins` or set ps_server_bin"
    )]
    BinaryNotFound {
        /// Paths tried.
        looked: Vec<PathBuf>,
    },
    /// A file in the run directory could not be written.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A process could not be started.
    #[error("cannot start {what}: {source}")]
    Spawn {
        /// Which server.
        what: String,
        /// Why.
        source: std::io::Error,
    },
    /// A server exited during startup.
    #[error("{what} exited during startup ({status}); see {log}")]
    EarlyExit {
        /// Which server.
        what: String,
        /// Its exit status.
        status: String,
        /// Its log file.
        log: PathBuf,
    },
    /// Servers did not become healthy in time.
    #[error("servers not healthy after {timeout:?}: {unhealthy}")]
    Unhealthy {
        /// The startup timeout.
        timeout: Duration,
        /// Which servers, and the last error of each.
        unhealthy: String,
    },
    /// The worker client could not be built from the generated config.
    #[error(transparent)]
    Worker(#[from] tessera_worker::WorkerError),
    /// The local etcd could not be started.
    #[error(transparent)]
    Etcd(#[from] LocalEtcdError),
    /// Servers had to be killed because they did not stop in time.
    #[error("{0} server(s) did not stop within the stop timeout and were killed")]
    Killed(usize),
    /// The start was interrupted (a signal); what had started was stopped.
    #[error("interrupted while starting; every server started was stopped")]
    Interrupted,
    /// [`Cluster::start_placed`] was given a placement per server for a
    /// different number of servers.
    #[error("{given} placements for {servers} servers")]
    Placements {
        /// Placements given.
        given: usize,
        /// Servers of the cluster.
        servers: usize,
    },
}

/// Where one server of a cluster runs, for [`Cluster::start_placed`]: a
/// host of its own instead of the launcher's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Placement {
    /// The address it listens on (its host's).
    pub host: String,
    /// The command that runs a program on that host, followed by the
    /// program and its arguments (`ip netns exec NS` for a network
    /// namespace); empty: here.
    pub prefix: Vec<String>,
    /// Its soft RDMA NIC's port file (`[rdma] soft_port_file`: the port is
    /// down while the file exists), so that a drill can take its RDMA path
    /// down with its host's link.
    pub soft_port_file: Option<PathBuf>,
}

/// The port of every placed server where `base_port` is 0: each host has
/// an address of its own, so no port can be taken by another server.
const PLACED_PORT: u16 = 7000;

/// One running ps-server process.
#[derive(Debug)]
pub struct ServerProcess {
    /// Whether it belongs to the serving fleet (`[serving]`), fed by the
    /// training fleet's delta stream.
    pub serving: bool,
    /// Replica group.
    pub group: u32,
    /// Hosted shard.
    pub shard: u32,
    /// `host:port`.
    pub address: String,
    /// Its log file.
    pub log: PathBuf,
    /// Its configuration file.
    pub config_path: PathBuf,
    binary: PathBuf,
    /// [`Placement::prefix`].
    prefix: Vec<String>,
    child: Option<Child>,
}

impl ServerProcess {
    /// Its process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }

    fn name(&self) -> String {
        format!(
            "{}ps-server group {} shard {} ({})",
            if self.serving { "serving " } else { "" },
            self.group,
            self.shard,
            self.address
        )
    }
}

/// A running local cluster.
#[derive(Debug)]
pub struct Cluster {
    servers: Vec<ServerProcess>,
    worker_config: WorkerConfig,
    /// The serving fleet's, when there is one (`ranker.toml`).
    serving_config: Option<WorkerConfig>,
    run_dir: PathBuf,
    stop_timeout: Duration,
    /// Stopped (dropped) after the servers.
    etcd: Option<LocalEtcd>,
    /// The first training server's configuration, from which a grown
    /// cluster's new servers are made ([`Cluster::add_shard`]).
    template: Option<PsServerConfig>,
}

fn spawn_server(
    prefix: &[String],
    binary: &Path,
    config_path: &Path,
    log: &Path,
    what: &str,
) -> Result<Child, LaunchError> {
    // Appended to: a restarted server's log follows its predecessor's.
    let log_file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|source| LaunchError::Write {
            path: log.to_owned(),
            source,
        })?;
    // The server stops when this process exits, even by SIGKILL
    // (PR_SET_PDEATHSIG, set by the server itself). The kernel ties that
    // to the *thread* that spawned it: spawn servers from threads that live
    // as long as the launcher (the `block_on` thread, the runtime's
    // workers), never from `spawn_blocking` or a short-lived thread.
    let mut command = match prefix.split_first() {
        Some((program, args)) => {
            let mut command = Command::new(program);
            command.args(args).arg(binary);
            command
        }
        None => Command::new(binary),
    };
    command
        .arg("--config")
        .arg(config_path)
        .arg("--parent-pid")
        .arg(std::process::id().to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log_file)
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| LaunchError::Spawn {
            what: what.to_owned(),
            source,
        })
}

/// Finds the ps-server binary.
pub fn find_ps_server(config: &ClusterConfig) -> Result<PathBuf, LaunchError> {
    let mut looked = Vec::new();
    let explicit = std::env::var_os("TESSERA_PS_SERVER_BIN")
        .map(PathBuf::from)
        .or_else(|| config.ps_server_bin.clone());
    if let Some(path) = explicit {
        if path.is_file() {
            return Ok(path);
        }
        return Err(LaunchError::BinaryNotFound { looked: vec![path] });
    }
    if let Ok(exe) = std::env::current_exe()
        && let Some(dir) = exe.parent()
    {
        // Next to `tessera`, or one level up when run from cargo's deps/.
        for candidate in [dir.join("ps-server"), dir.join("../ps-server")] {
            if candidate.is_file() {
                return Ok(candidate);
            }
            looked.push(candidate);
        }
    }
    if let Some(paths) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&paths) {
            let candidate = dir.join("ps-server");
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
        looked.push(PathBuf::from("$PATH/ps-server"));
    }
    Err(LaunchError::BinaryNotFound { looked })
}

/// Starts of a cluster on ports the launcher picks, at most: a start
/// whose server lost its port to another process is tried again.
const PORT_ATTEMPTS: u32 = 3;

/// Whether the server whose log is `log` exited because its address was
/// taken.
fn lost_its_port(log: &Path) -> bool {
    std::fs::read_to_string(log)
        .is_ok_and(|text| text.contains("Address already in use") || text.contains("os error 98"))
}

/// `n` distinct free ports on `host`. Every probe socket stays bound until
/// all are chosen, so the kernel cannot hand one port out twice (probing
/// and releasing one at a time did, for large clusters); they are released
/// just before the servers start, and a server that still loses its port
/// to another process fails the start, naming it.
fn free_ports(host: &str, n: usize) -> Result<Vec<u16>, std::io::Error> {
    let probes = (0..n)
        .map(|_| std::net::TcpListener::bind((host, 0)))
        .collect::<Result<Vec<_>, _>>()?;
    probes
        .iter()
        .map(|probe| Ok(probe.local_addr()?.port()))
        .collect()
}

/// Where each training server runs: as given (one per server), or all on
/// the cluster's `host`.
fn placements_for(
    config: &ClusterConfig,
    placements: Option<Vec<Placement>>,
    servers: usize,
) -> Result<Vec<Placement>, LaunchError> {
    match placements {
        Some(placements) if placements.len() != servers => Err(LaunchError::Placements {
            given: placements.len(),
            servers,
        }),
        Some(placements) => Ok(placements),
        None => Ok(vec![
            Placement {
                host: config.host.clone(),
                ..Placement::default()
            };
            servers
        ]),
    }
}

/// The port of each training server, then of each of `serving` serving
/// servers: from `base_port` up, or free ones probed on `host` (servers
/// placed on other hosts take [`PLACED_PORT`]).
fn ports_for(
    config: &ClusterConfig,
    placements: &[Placement],
    serving: usize,
) -> Result<Vec<u16>, LaunchError> {
    let servers = placements.len();
    let placed = placements.iter().any(|p| p.host != config.host);
    let probe_failed = |source| LaunchError::Spawn {
        what: "port probes".into(),
        source,
    };
    if config.base_port == 0 && placed {
        let mut ports = vec![PLACED_PORT; servers];
        ports.extend(free_ports(&config.host, serving).map_err(probe_failed)?);
        Ok(ports)
    } else if config.base_port == 0 {
        free_ports(&config.host, servers + serving).map_err(probe_failed)
    } else {
        // Validation guarantees base_port + index <= 65535.
        Ok((0..servers + serving)
            .map(|index| config.base_port + index as u16)
            .collect())
    }
}

/// The training servers' `[delta]`: a stream to every serving server.
fn serving_delta(
    serving: &crate::config::ServingFleetConfig,
    layout: &[(u32, u32, String)],
) -> tessera_ps_server::config::DeltaConfig {
    tessera_ps_server::config::DeltaConfig {
        num_shards: serving.num_shards,
        servers: layout
            .iter()
            .map(|(_, s, a)| tessera_ps_server::config::ServingServer {
                address: a.clone(),
                shards: vec![*s],
            })
            .collect(),
        interval_ms: serving.interval_ms,
        max_rows: serving.max_rows,
        ..tessera_ps_server::config::DeltaConfig::default()
    }
}

/// The configuration of the training server of `(group, shard)` at
/// `address`: every other server of `layout` is a peer.
fn training_server(
    config: &ClusterConfig,
    layout: &[(u32, u32, String)],
    (group, shard, address): (u32, u32, &str),
    placement: &Placement,
) -> PsServerConfig {
    let peers = layout
        .iter()
        .filter(|(_, _, other)| other != address)
        .map(|(g, s, a)| PeerConfig {
            address: a.clone(),
            replica_group: *g,
            shards: vec![*s],
        })
        .collect();
    PsServerConfig {
        listen: address.to_owned(),
        transport: config.transport,
        rdma: RdmaConfig {
            soft_port_file: placement
                .soft_port_file
                .clone()
                .or_else(|| config.rdma.soft_port_file.clone()),
            ..config.rdma.clone()
        },
        mode: config.mode,
        seed: config.seed,
        num_shards: config.num_shards,
        shards: vec![shard],
        replica_group: group,
        replica_groups: config.replica_groups,
        peers,
        tables: config.tables.clone(),
        replication: ReplicationConfig {
            ack: config.ack,
            ..ReplicationConfig::default()
        },
        ..PsServerConfig::default()
    }
}

/// Creates the run directory, and removes a previous run's `worker.toml`
/// and `ranker.toml` from it: they are written once every server of this
/// run answers, so a script that waits for them must not find an old
/// cluster's files instead.
fn prepare_run_dir(run_dir: &Path) -> Result<(), LaunchError> {
    std::fs::create_dir_all(run_dir).map_err(|source| LaunchError::Write {
        path: run_dir.to_owned(),
        source,
    })?;
    for name in ["worker.toml", "ranker.toml"] {
        let path = run_dir.join(name);
        match std::fs::remove_file(&path) {
            Err(source) if source.kind() != std::io::ErrorKind::NotFound => {
                return Err(LaunchError::Write { path, source });
            }
            _ => {}
        }
    }
    Ok(())
}

/// Writes `text` to `path` whole or not at all: into a temporary file
/// beside it, then renamed over it, so a reader that sees the file (a
/// script waiting for `worker.toml`) never reads it half written.
fn write_file(path: &Path, text: &str) -> Result<(), LaunchError> {
    let mut temporary = path.as_os_str().to_owned();
    temporary.push(".tmp");
    let temporary = std::path::PathBuf::from(temporary);
    std::fs::write(&temporary, text)
        .and_then(|()| std::fs::rename(&temporary, path))
        .map_err(|source| LaunchError::Write {
            path: path.to_owned(),
            source,
        })
}

impl Cluster {
    /// Starts every server of `config`, writing their configs and logs into
    /// `run_dir`, and waits until all are healthy. On failure, whatever was
    /// started is stopped again.
    pub async fn start(config: &ClusterConfig, run_dir: &Path) -> Result<Self, LaunchError> {
        Self::start_until(config, run_dir, std::future::pending()).await
    }

    /// [`Cluster::start`], given up when `interrupted` completes first (a
    /// signal): whatever was started is stopped (gracefully, as by
    /// [`Cluster::stop`]) before it returns [`LaunchError::Interrupted`].
    pub async fn start_until(
        config: &ClusterConfig,
        run_dir: &Path,
        interrupted: impl std::future::Future<Output = ()>,
    ) -> Result<Self, LaunchError> {
        Self::start_with(config, run_dir, None, interrupted).await
    }

    /// [`Cluster::start`] with each server on a host of its own:
    /// `placements` gives, per server in the launcher's order (group-major),
    /// where it runs. Its port is `base_port + index`, or 7000 where
    /// `base_port` is 0. The local etcd, if any, listens on `config.host`
    /// in the caller's network namespace, which every placed host must
    /// reach. Multi-host drills place servers in network namespaces.
    pub async fn start_placed(
        config: &ClusterConfig,
        run_dir: &Path,
        placements: Vec<Placement>,
    ) -> Result<Self, LaunchError> {
        Self::start_with(config, run_dir, Some(placements), std::future::pending()).await
    }

    async fn start_with(
        config: &ClusterConfig,
        run_dir: &Path,
        placements: Option<Vec<Placement>>,
        interrupted: impl std::future::Future<Output = ()>,
    ) -> Result<Self, LaunchError> {
        tokio::pin!(interrupted);
        let mut attempt = 1;
        loop {
            match Self::start_once(config, run_dir, placements.clone(), &mut interrupted).await {
                // A probed port is released just before its server binds
                // it; another process may take it in between (a test suite
                // binding ports by the hundred did, one 64-server start in
                // a few dozen). Only ports the launcher picked can be
                // picked again: the whole start is tried once more.
                Err(LaunchError::EarlyExit { what, log, .. })
                    if config.base_port == 0 && attempt < PORT_ATTEMPTS && lost_its_port(&log) =>
                {
                    tracing::warn!(server = %what, attempt, "a server lost its port to another process; starting again on new ports");
                    attempt += 1;
                }
                outcome => return outcome,
            }
        }
    }

    async fn start_once(
        config: &ClusterConfig,
        run_dir: &Path,
        placements: Option<Vec<Placement>>,
        interrupted: &mut std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
    ) -> Result<Self, LaunchError> {
        let binary = find_ps_server(config)?;
        prepare_run_dir(run_dir)?;
        let mut cluster = Cluster {
            servers: Vec::new(),
            worker_config: WorkerConfig::default(),
            serving_config: None,
            run_dir: run_dir.to_owned(),
            stop_timeout: Duration::from_millis(config.stop_timeout_ms),
            etcd: None,
            template: None,
        };
        let outcome = tokio::select! {
            outcome = cluster.spawn_all(config, &binary, placements) => outcome,
            () = interrupted.as_mut() => Err(LaunchError::Interrupted),
        };
        match outcome {
            Ok(()) => Ok(cluster),
            Err(err) => {
                let _ = cluster.stop().await;
                Err(err)
            }
        }
    }

    async fn spawn_all(
        &mut self,
        config: &ClusterConfig,
        binary: &Path,
        placements: Option<Vec<Placement>>,
    ) -> Result<(), LaunchError> {
        let coordinator = self.start_local_etcd(config)?;
        // Every server's address first: each one's configuration lists the
        // others as its replication peers.
        let servers = (config.replica_groups * config.num_shards) as usize;
        let placements = placements_for(config, placements, servers)?;
        // The serving fleet's servers (on `host`) after the training ones.
        let serving_servers = config.serving.as_ref().map_or(0, |s| s.servers() as usize);
        let mut ports = ports_for(config, &placements, serving_servers)?;
        let serving_ports = ports.split_off(servers);
        let serving_layout: Vec<(u32, u32, String)> = match &config.serving {
            None => Vec::new(),
            Some(serving) => (0..serving.replica_groups)
                .flat_map(|g| (0..serving.num_shards).map(move |s| (g, s)))
                .zip(&serving_ports)
                .map(|((g, s), port)| (g, s, format!("{}:{port}", config.host)))
                .collect(),
        };
        if let Some(serving) = &config.serving {
            self.spawn_serving(config, serving, &serving_layout, binary)?;
        }
        let delta = match &config.serving {
            None => tessera_ps_server::config::DeltaConfig::default(),
            Some(serving) => serving_delta(serving, &serving_layout),
        };
        let mut layout = Vec::new();
        for group in 0..config.replica_groups {
            for shard in 0..config.num_shards {
                let index = (group * config.num_shards + shard) as usize;
                let host = &placements[index].host;
                layout.push((group, shard, format!("{host}:{}", ports[index])));
            }
        }
        let mut endpoints = Vec::new();
        for (index, (group, shard, address)) in layout.clone().into_iter().enumerate() {
            let placement = &placements[index];
            let stem = format!("ps-g{group}-s{shard}");
            let server_config = PsServerConfig {
                coordinator: coordinator.clone(),
                delta: delta.clone(),
                checkpoint: if config.checkpoint_interval_secs > 0 {
                    CheckpointConfig {
                        dir: Some(self.run_dir.join("checkpoints").join(&stem)),
                        interval_secs: config.checkpoint_interval_secs,
                        ..CheckpointConfig::default()
                    }
                } else {
                    CheckpointConfig::default()
                },
                ..training_server(config, &layout, (group, shard, &address), placement)
            };
            if self.template.is_none() {
                self.template = Some(server_config.clone());
            }
            let what = format!("ps-server group {group} shard {shard} ({address})");
            let (config_path, log, child) =
                self.write_and_spawn(&stem, &server_config, &placement.prefix, binary, &what)?;
            endpoints.push(ServerEndpoint {
                address: address.clone(),
                shards: vec![shard],
                replica_group: group,
            });
            self.servers.push(ServerProcess {
                serving: false,
                group,
                shard,
                address,
                log,
                config_path,
                binary: binary.to_owned(),
                prefix: placement.prefix.clone(),
                child: Some(child),
            });
        }
        self.worker_config = WorkerConfig {
            transport: config.transport,
            rdma: config.rdma.clone(),
            num_shards: config.num_shards,
            replica_groups: Some(config.replica_groups),
            servers: endpoints,
            connect_timeout_ms: config.worker_connect_timeout_ms,
            request_timeout_ms: config.worker_request_timeout_ms,
            call_timeout_ms: config.worker_call_timeout_ms,
            coordinator,
            ..WorkerConfig::default()
        };
        if let Some(table) = config.tables.first() {
            self.worker_config.workload.table = table.name.clone();
        }
        self.wait_healthy(Duration::from_millis(config.startup_timeout_ms))
            .await?;
        self.write_worker_files()
    }

    /// The coordinator the servers use: the configured one, or, with
    /// `local_etcd`, the members of an etcd this launcher starts.
    fn start_local_etcd(
        &mut self,
        config: &ClusterConfig,
    ) -> Result<tessera_coord::CoordinatorConfig, LaunchError> {
        let mut coordinator = config.coordinator.clone();
        if coordinator.is_etcd() && config.local_etcd {
            let bin = tessera_coord::etcd_bin(config.etcd_bin.as_deref());
            let etcd = LocalEtcd::start_members_on(
                &bin,
                &self.run_dir.join("etcd"),
                config.local_etcd_members,
                &config.host,
                Duration::from_secs(20),
            )?;
            coordinator.endpoints = etcd.endpoints().to_vec();
            self.etcd = Some(etcd);
        }
        Ok(coordinator)
    }

    /// Writes `ranker.toml` (with a serving fleet) and then `worker.toml`:
    /// last, since its presence tells scripts the cluster is up.
    fn write_worker_files(&self) -> Result<(), LaunchError> {
        if let Some(serving) = &self.serving_config {
            let path = self.run_dir.join("ranker.toml");
            let text = toml::to_string(serving).map_err(|err| LaunchError::Write {
                path: path.clone(),
                source: std::io::Error::other(err),
            })?;
            write_file(&path, &text)?;
        }
        let worker_path = self.run_dir.join("worker.toml");
        let text = toml::to_string(&self.worker_config).map_err(|err| LaunchError::Write {
            path: worker_path.clone(),
            source: std::io::Error::other(err),
        })?;
        write_file(&worker_path, &text)
    }

    /// Writes `server_config` to `<stem>.toml` in the run directory and
    /// starts a server from it, logging to a fresh `<stem>.log`; returns
    /// both paths and the process.
    fn write_and_spawn(
        &self,
        stem: &str,
        server_config: &PsServerConfig,
        prefix: &[String],
        binary: &Path,
        what: &str,
    ) -> Result<(PathBuf, PathBuf, Child), LaunchError> {
        let config_path = self.run_dir.join(format!("{stem}.toml"));
        let text = toml::to_string(server_config).map_err(|err| LaunchError::Write {
            path: config_path.clone(),
            source: std::io::Error::other(err),
        })?;
        write_file(&config_path, &text)?;
        let log = self.run_dir.join(format!("{stem}.log"));
        let _ = std::fs::remove_file(&log);
        let child = spawn_server(prefix, binary, &config_path, &log, what)?;
        Ok((config_path, log, child))
    }

    /// Starts the serving fleet's servers (`mode = "serving"`, each on
    /// its own: no peers, static) at `layout`, and its workers' config.
    fn spawn_serving(
        &mut self,
        config: &ClusterConfig,
        serving: &crate::config::ServingFleetConfig,
        layout: &[(u32, u32, String)],
        binary: &Path,
    ) -> Result<(), LaunchError> {
        let tables: Vec<_> = config
            .tables
            .iter()
            .cloned()
            .map(|mut t| {
                if let Some(storage) = serving.storage {
                    t.storage = storage;
                }
                t
            })
            .collect();
        let mut endpoints = Vec::new();
        for (group, shard, address) in layout {
            let server_config = PsServerConfig {
                listen: address.clone(),
                transport: config.transport,
                rdma: config.rdma.clone(),
                mode: tessera_ps_server::Mode::Serving,
                seed: config.seed,
                num_shards: serving.num_shards,
                shards: vec![*shard],
                replica_group: *group,
                replica_groups: serving.replica_groups,
                tables: tables.clone(),
                serving: tessera_ps_server::config::ServingConfig {
                    max_delay_ms: serving.max_delay_ms,
                },
                ..PsServerConfig::default()
            };
            let stem = format!("serving-g{group}-s{shard}");
            let what = format!("serving ps-server group {group} shard {shard} ({address})");
            let (config_path, log, child) =
                self.write_and_spawn(&stem, &server_config, &[], binary, &what)?;
            endpoints.push(ServerEndpoint {
                address: address.clone(),
                shards: vec![*shard],
                replica_group: *group,
            });
            self.servers.push(ServerProcess {
                serving: true,
                group: *group,
                shard: *shard,
                address: address.clone(),
                log,
                config_path,
                binary: binary.to_owned(),
                prefix: Vec::new(),
                child: Some(child),
            });
        }
        let mut ranker = WorkerConfig {
            transport: config.transport,
            rdma: config.rdma.clone(),
            num_shards: serving.num_shards,
            replica_groups: Some(serving.replica_groups),
            servers: endpoints,
            connect_timeout_ms: config.worker_connect_timeout_ms,
            request_timeout_ms: config.worker_request_timeout_ms,
            call_timeout_ms: config.worker_call_timeout_ms,
            ..WorkerConfig::default()
        };
        if let Some(table) = config.tables.first() {
            ranker.workload.table = table.name.clone();
        }
        self.serving_config = Some(ranker);
        Ok(())
    }

    async fn wait_healthy(&mut self, timeout: Duration) -> Result<(), LaunchError> {
        let mut clients = vec![PsClient::new(&self.worker_config)?];
        if let Some(serving) = &self.serving_config {
            clients.push(PsClient::new(serving)?);
        }
        let deadline = Instant::now() + timeout;
        loop {
            for server in &mut self.servers {
                if let Some(Ok(Some(status))) = server.child.as_mut().map(Child::try_wait) {
                    return Err(LaunchError::EarlyExit {
                        what: server.name(),
                        status: status.to_string(),
                        log: server.log.clone(),
                    });
                }
            }
            let mut health = Vec::new();
            for client in &clients {
                health.extend(client.health().await);
            }
            let unhealthy: Vec<String> = health
                .iter()
                .filter_map(|(addr, result)| match result {
                    Ok(h) if h.serving => None,
                    Ok(_) => Some(format!("{addr}: not serving yet")),
                    Err(err) => Some(format!("{addr}: {err}")),
                })
                .collect();
            if unhealthy.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(LaunchError::Unhealthy {
                    timeout,
                    unhealthy: unhealthy.join("; "),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The servers.
    pub fn servers(&self) -> &[ServerProcess] {
        &self.servers
    }

    /// A worker configuration that reaches every (training) server.
    pub fn worker_config(&self) -> &WorkerConfig {
        &self.worker_config
    }

    /// A worker configuration for rankers of the serving fleet, when the
    /// cluster has one (`ranker.toml`).
    pub fn serving_config(&self) -> Option<&WorkerConfig> {
        self.serving_config.as_ref()
    }

    /// The run directory (server configs, logs, `worker.toml`).
    pub fn run_dir(&self) -> &Path {
        &self.run_dir
    }

    /// The local etcd's endpoint, when the cluster started one.
    pub fn etcd_endpoint(&self) -> Option<&str> {
        self.etcd.as_ref().map(LocalEtcd::endpoint)
    }

    /// The local etcd, when the cluster started one (its members can be
    /// killed and restarted, for drills).
    pub fn etcd_mut(&mut self) -> Option<&mut LocalEtcd> {
        self.etcd.as_mut()
    }

    /// The index of the training server of `group` and `shard`.
    pub fn index_of(&self, group: u32, shard: u32) -> Option<usize> {
        self.servers
            .iter()
            .position(|s| !s.serving && s.group == group && s.shard == shard)
    }

    /// The index of the serving server of `group` and `shard`.
    pub fn serving_index_of(&self, group: u32, shard: u32) -> Option<usize> {
        self.servers
            .iter()
            .position(|s| s.serving && s.group == group && s.shard == shard)
    }

    /// Starts the servers of new shard `shard` of a cluster growing to
    /// `num_shards` shards (etcd mode, after `tessera reshard --to`
    /// planned it), one per replica group, each the others' replication
    /// peer, configured as the cluster's first servers were, on free
    /// ports of its host; returns their indices in [`Cluster::servers`].
    /// They take part in the resize by themselves (`ps-server`'s
    /// `reshard`); workers learn of them from etcd.
    pub fn add_shard(&mut self, shard: u32, num_shards: u32) -> Result<Vec<usize>, LaunchError> {
        let Some(template) = self.template.clone() else {
            return Err(LaunchError::Spawn {
                what: format!("shard {shard}'s servers"),
                source: std::io::Error::other("the cluster has no training server to copy"),
            });
        };
        let host = template
            .listen
            .rsplit_once(':')
            .map_or("127.0.0.1", |(host, _)| host)
            .to_owned();
        let groups = template.replica_groups.max(1);
        let ports = free_ports(&host, groups as usize).map_err(|source| LaunchError::Spawn {
            what: "port probes".into(),
            source,
        })?;
        let addresses: Vec<String> = ports.iter().map(|p| format!("{host}:{p}")).collect();
        let binary = self
            .servers
            .iter()
            .find(|s| !s.serving)
            .map(|s| s.binary.clone())
            .unwrap_or_default();
        let mut added = Vec::new();
        for group in 0..groups {
            let address = addresses[group as usize].clone();
            let peers = (0..groups)
                .filter(|&g| g != group)
                .map(|g| PeerConfig {
                    address: addresses[g as usize].clone(),
                    replica_group: g,
                    shards: vec![shard],
                })
                .collect();
            // A shard added again (given away earlier) gets files of its own:
            // the old checkpoints are another count's rows.
            let before = self
                .servers
                .iter()
                .filter(|s| !s.serving && s.group == group && s.shard == shard)
                .count();
            let stem = match before {
                0 => format!("ps-g{group}-s{shard}"),
                n => format!("ps-g{group}-s{shard}-{n}"),
            };
            let mut config = PsServerConfig {
                listen: address.clone(),
                num_shards,
                shards: vec![shard],
                replica_group: group,
                peers,
                ..template.clone()
            };
            if config.checkpoint.dir.is_some() {
                config.checkpoint.dir = Some(self.run_dir.join("checkpoints").join(&stem));
            }
            let what = format!("ps-server group {group} shard {shard} ({address})");
            let (config_path, log, child) =
                self.write_and_spawn(&stem, &config, &[], &binary, &what)?;
            added.push(self.servers.len());
            self.servers.push(ServerProcess {
                serving: false,
                group,
                shard,
                address,
                log,
                config_path,
                binary: binary.clone(),
                prefix: Vec::new(),
                child: Some(child),
            });
        }
        Ok(added)
    }

    /// Writes `num_shards` into the configuration of every training server
    /// whose shard it keeps (after a resize is done, as an operator
    /// would: a server restarted from then on joins with the count it
    /// routes by; one configured with a count two resizes back is
    /// refused). Servers of shards a shrink gave away keep theirs.
    pub fn set_num_shards(&mut self, num_shards: u32) -> Result<(), LaunchError> {
        for server in self
            .servers
            .iter()
            .filter(|s| !s.serving && s.shard < num_shards)
        {
            let path = &server.config_path;
            let unreadable = |err: String| LaunchError::Write {
                path: path.clone(),
                source: std::io::Error::other(err),
            };
            let text = std::fs::read_to_string(path).map_err(|err| unreadable(err.to_string()))?;
            let mut config: PsServerConfig =
                toml::from_str(&text).map_err(|err| unreadable(err.to_string()))?;
            config.num_shards = num_shards;
            let text = toml::to_string(&config).map_err(|err| unreadable(err.to_string()))?;
            write_file(path, &text)?;
        }
        self.worker_config.num_shards = num_shards;
        Ok(())
    }

    /// SIGKILLs server `index` and reaps it (a crash; nothing is handed
    /// over).
    pub async fn kill(&mut self, index: usize) {
        if let Some(mut child) = self.servers.get_mut(index).and_then(|s| s.child.take()) {
            let _ = child.kill().await;
        }
    }

    /// Sends server `index` a signal (SIGTERM for a graceful stop, SIGSTOP
    /// and SIGCONT to freeze and thaw it).
    pub fn signal(&self, index: usize, signal: Signal) {
        if let Some(pid) = self
            .servers
            .get(index)
            .and_then(|s| s.child.as_ref())
            .and_then(Child::id)
            .and_then(|id| i32::try_from(id).ok())
        {
            let _ = kill(Pid::from_raw(pid), signal);
        }
    }

    /// Waits until server `index` has exited (after a SIGTERM), at most
    /// the stop timeout; false if it had not.
    pub async fn wait_exit(&mut self, index: usize) -> bool {
        let timeout = self.stop_timeout;
        let Some(server) = self.servers.get_mut(index) else {
            return true;
        };
        let Some(child) = server.child.as_mut() else {
            return true;
        };
        let exited = tokio::time::timeout(timeout, child.wait()).await.is_ok();
        if exited {
            server.child = None;
        }
        exited
    }

    /// Starts server `index` again from its configuration (after a kill
    /// or a stop); its log is appended to.
    pub fn restart(&mut self, index: usize) -> Result<(), LaunchError> {
        let Some(server) = self.servers.get_mut(index) else {
            return Ok(());
        };
        if server.child.is_some() {
            return Ok(());
        }
        let what = server.name();
        server.child = Some(spawn_server(
            &server.prefix,
            &server.binary,
            &server.config_path,
            &server.log,
            &what,
        )?);
        Ok(())
    }

    /// Stops every server: SIGTERM (graceful shutdown), then SIGKILL for
    /// those still running after the stop timeout; then the local etcd.
    pub async fn stop(mut self) -> Result<(), LaunchError> {
        for index in 0..self.servers.len() {
            self.signal(index, Signal::SIGTERM);
        }
        let deadline = Instant::now() + self.stop_timeout;
        let mut killed = 0;
        for server in &mut self.servers {
            let name = server.name();
            let Some(child) = server.child.as_mut() else {
                continue;
            };
            let remaining = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(remaining, child.wait()).await {
                Ok(_) => {}
                Err(_) => {
                    tracing::warn!(server = %name, "did not stop in time; killing");
                    let _ = child.kill().await;
                    killed += 1;
                }
            }
        }
        drop(self.etcd.take());
        if killed > 0 {
            return Err(LaunchError::Killed(killed));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A script waiting for `worker.toml` in a run directory used before
    /// does not find the last run's file.
    #[test]
    fn a_previous_runs_worker_files_are_removed_and_the_rest_kept() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        prepare_run_dir(&run).unwrap();
        for name in ["worker.toml", "ranker.toml", "ps-g0-s0.log"] {
            std::fs::write(run.join(name), "old").unwrap();
        }
        prepare_run_dir(&run).unwrap();
        assert!(!run.join("worker.toml").exists());
        assert!(!run.join("ranker.toml").exists());
        assert!(run.join("ps-g0-s0.log").exists());
    }

    /// A server that lost its port says so in its log, in the words the
    /// ps-server binary uses; any other early exit is not retried.
    #[test]
    fn a_lost_port_is_told_from_other_early_exits() {
        let dir = tempfile::tempdir().unwrap();
        let lost = dir.path().join("lost.log");
        std::fs::write(
            &lost,
            "2026-12-06T10:42:06Z ERROR ps_server: listen on 127.0.0.1:47111: Address already in use (os error 98)\n",
        )
        .unwrap();
        assert!(lost_its_port(&lost));
        let other = dir.path().join("other.log");
        std::fs::write(
            &other,
            "ps-server: config: tables[0].dim must be at least 1\n",
        )
        .unwrap();
        assert!(!lost_its_port(&other));
        assert!(!lost_its_port(&dir.path().join("missing.log")));
    }
}
