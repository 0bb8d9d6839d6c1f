//! `tessera`: the launcher.
//!
//! - `tessera up --config FILE` starts n shards x r replica groups of
//!   ps-server processes on one host, waits until they are healthy, writes a
//!   matching `worker.toml`, and stops them all on Ctrl-C or SIGTERM.
//! - `tessera demo` starts the default cluster, runs a trainer and then a
//!   ranker against it, prints the results, and shuts everything down.
//! - `tessera admin ...` calls a running server's `Health` and `Admin`
//!   (stats, checkpoint) or a worker's `WorkerAdmin` (quarantine).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use tessera_deploy::{Cluster, ClusterConfig};
use tessera_rpc::{RdmaProvider, TransportKind};
use tessera_worker::PsClient;
use tessera_worker::workload::{self, WorkloadKind, WorkloadReport, format_comparison};

/// Tessera's launcher.
#[derive(Debug, Parser)]
#[command(name = "tessera", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// A transport the demo runs over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum DemoTransport {
    Tcp,
    RdmaSoft,
    Rdma,
    Auto,
}

impl DemoTransport {
    fn label(self) -> &'static str {
        match self {
            DemoTransport::Tcp => "tcp",
            DemoTransport::RdmaSoft => "rdma-soft",
            DemoTransport::Rdma => "rdma",
            DemoTransport::Auto => "auto",
        }
    }

    /// `config` switched to this transport.
    fn apply(self, mut config: ClusterConfig) -> ClusterConfig {
        config.transport = match self {
            DemoTransport::Tcp => TransportKind::Tcp,
            DemoTransport::RdmaSoft | DemoTransport::Rdma => TransportKind::Rdma,
            DemoTransport::Auto => TransportKind::Auto,
        };
        if self == DemoTransport::RdmaSoft {
            config.rdma.provider = RdmaProvider::Soft;
        }
        config
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start a local cluster and keep it running until Ctrl-C.
    Up {
        /// Cluster description (TOML); built-in defaults without it.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Where server configs, logs and worker.toml go (default: a fresh
        /// temporary directory, removed on exit).
        #[arg(long)]
        run_dir: Option<PathBuf>,
    },
    /// Start the default cluster, run a trainer and a ranker, print results;
    /// once per transport.
    Demo {
        /// Seconds each workload runs.
        #[arg(long, default_value_t = 10.0)]
        duration_secs: f64,
        /// Transports to run the demo over, one cluster each, in order:
        /// `tcp`, `rdma-soft` (the software RNIC, between the processes of
        /// this host), `rdma` (the config's provider), `auto`.
        #[arg(long, value_delimiter = ',', default_value = "tcp,rdma-soft")]
        transports: Vec<DemoTransport>,
        /// Cluster description (TOML); built-in defaults without it.
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Check this host for the transport: RDMA devices and ports (state,
    /// link layer, MTU, GIDs), locked memory against what the transport
    /// pins, fork safety, the soft NIC; each problem with what to change.
    /// Fails (exit code 1) when the configured transport cannot run here.
    Doctor {
        /// Cluster description (TOML) whose `transport` and `[rdma]` are
        /// checked; built-in defaults without it.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Check this transport instead of the config's: `tcp`, `rdma`,
        /// `auto`.
        #[arg(long)]
        transport: Option<String>,
        /// With `--transport rdma` or `auto`: the provider, `ibverbs` or
        /// `soft`.
        #[arg(long)]
        provider: Option<String>,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Print the built-in cluster configuration as TOML.
    PrintConfig,
    /// Operate a running ps-server or worker (over Tessera RPC on TCP).
    Admin {
        /// Mutual TLS with servers that run with `[tls]`: this tool's
        /// certificate (PEM; Admin calls need one with the admin role).
        #[arg(long, requires_all = ["tls_key", "tls_ca"], global = true)]
        tls_cert: Option<String>,
        /// The certificate's private key (PEM).
        #[arg(long, requires = "tls_cert", global = true)]
        tls_key: Option<String>,
        /// The CA whose certificates the servers carry (PEM).
        #[arg(long, requires = "tls_cert", global = true)]
        tls_ca: Option<String>,
        /// The name the server's certificate must carry, where it is not
        /// the host dialed.
        #[arg(long, requires = "tls_cert", global = true)]
        tls_server_name: Option<String>,
        #[command(subcommand)]
        action: AdminAction,
    },
}

#[derive(Debug, Subcommand)]
enum AdminAction {
    /// A server's health: state, shards, primaries, tables.
    Health {
        /// The ps-server (`host:port`).
        server: String,
    },
    /// Per-shard rows, bytes, fetches, pushes and evictions of a server.
    Stats {
        /// The ps-server (`host:port`).
        server: String,
    },
    /// Save a checkpoint on a server now.
    Checkpoint {
        /// The ps-server (`host:port`).
        server: String,
    },
    /// List (and with `--clear` readmit) the servers a worker quarantined.
    Quarantine {
        /// The worker's `admin_listen` address.
        worker: String,
        /// Readmit them all after listing.
        #[arg(long)]
        clear: bool,
    },
}

fn main() -> ExitCode {
    tessera_rpc::observe::init_logging("warn");
    let result = tokio::runtime::Runtime::new()
        .map_err(|err| err.into())
        .and_then(|runtime| runtime.block_on(run(Cli::parse())));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            #[allow(clippy::print_stderr)]
            {
                eprintln!("tessera: {err}");
            }
            ExitCode::FAILURE
        }
    }
}

type BoxError = Box<dyn std::error::Error>;

fn load(path: Option<&PathBuf>) -> Result<ClusterConfig, BoxError> {
    Ok(match path {
        Some(path) => ClusterConfig::load(path)?,
        None => ClusterConfig::default(),
    })
}

/// SIGINT and SIGTERM, caught from the launcher's first step: a signal
/// during a start or a demo stops what was started (and removes the
/// temporary run directory) instead of killing the launcher and leaving
/// its servers running.
struct Interrupt {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
}

impl Interrupt {
    fn install() -> Result<Self, BoxError> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            interrupt: signal(SignalKind::interrupt())?,
            terminate: signal(SignalKind::terminate())?,
        })
    }

    /// Until the next SIGINT or SIGTERM.
    async fn recv(&mut self) {
        tokio::select! {
            _ = self.interrupt.recv() => {}
            _ = self.terminate.recv() => {}
        }
    }
}

async fn run(cli: Cli) -> Result<(), BoxError> {
    match cli.command {
        Command::Up { config, run_dir } => {
            let mut interrupt = Interrupt::install()?;
            up(load(config.as_ref())?, run_dir, &mut interrupt).await
        }
        Command::Demo {
            duration_secs,
            transports,
            config,
        } => {
            let mut interrupt = Interrupt::install()?;
            demo(
                load(config.as_ref())?,
                duration_secs,
                &transports,
                &mut interrupt,
            )
            .await
        }
        Command::Admin {
            action,
            tls_cert,
            tls_key,
            tls_ca,
            tls_server_name,
        } => {
            let tls = match (tls_cert, tls_key, tls_ca) {
                (Some(cert), Some(key), Some(ca)) => Some(tessera_rpc::TlsConfig {
                    cert,
                    key,
                    ca,
                    server_name: tls_server_name,
                }),
                _ => None,
            };
            admin(action, tls.as_ref()).await
        }
        Command::Doctor {
            config,
            transport,
            provider,
            json,
        } => doctor(load(config.as_ref())?, transport, provider, json).await,
        Command::PrintConfig => {
            #[allow(clippy::print_stdout)]
            {
                print!("{}", toml::to_string(&ClusterConfig::default())?);
            }
            Ok(())
        }
    }
}

/// A channel for an admin call: generous timeouts (a checkpoint of a big
/// server takes a while), TCP, mutual TLS with `tls` where given.
async fn admin_channel(
    addr: &str,
    tls: Option<&tessera_rpc::TlsConfig>,
) -> Result<tessera_rpc::Channel, BoxError> {
    let mut config = tessera_rpc::ChannelConfig {
        connect_timeout_ms: 2000,
        request_timeout_ms: 600_000,
        ..tessera_rpc::ChannelConfig::default()
    };
    config.transport.tls = tls.cloned();
    Ok(tessera_rpc::Channel::connect(addr, config).await?)
}

#[allow(clippy::print_stdout)]
async fn admin(action: AdminAction, tls: Option<&tessera_rpc::TlsConfig>) -> Result<(), BoxError> {
    use tessera_proto::v1::{
        AdminClient, CheckpointRequest, HealthRequest, ParameterServerClient, QuarantineRequest,
        ServerState, StatsRequest, WorkerAdminClient,
    };
    match action {
        AdminAction::Health { server } => {
            let health = ParameterServerClient::new(admin_channel(&server, tls).await?)
                .health(HealthRequest {})
                .await?;
            let state = ServerState::try_from(health.state).map_or("unknown", |s| s.as_str_name());
            println!(
                "{server}: {state}, replica group {}, shards {:?} of {}, primary of {:?}, coordinator {}",
                health.replica_group,
                health.shards,
                health.num_shards,
                health.primary_shards,
                if health.coordinator.is_empty() {
                    "static"
                } else {
                    &health.coordinator
                }
            );
            print!("{}", format_shard_health(&health.shard_health));
            for table in &health.tables {
                println!(
                    "  table {}: dim {}, {} rows",
                    table.name, table.dim, table.rows
                );
            }
        }
        AdminAction::Stats { server } => {
            let stats = AdminClient::new(admin_channel(&server, tls).await?)
                .stats(StatsRequest {})
                .await?;
            println!("| table | shard | rows | bytes | fetches | pushes | evictions |");
            println!("|---|---:|---:|---:|---:|---:|---:|");
            for s in &stats.shards {
                println!(
                    "| {} | {} | {} | {} | {} | {} | {} |",
                    s.table, s.shard, s.rows, s.bytes, s.fetches, s.pushes, s.evictions
                );
            }
        }
        AdminAction::Checkpoint { server } => {
            let saved = AdminClient::new(admin_channel(&server, tls).await?)
                .checkpoint(CheckpointRequest {})
                .await?;
            println!(
                "{server}: checkpoint {} ({} rows, {} bytes)",
                saved.path, saved.rows, saved.bytes
            );
        }
        AdminAction::Quarantine { worker, clear } => {
            let listed = WorkerAdminClient::new(admin_channel(&worker, tls).await?)
                .quarantine(QuarantineRequest { clear })
                .await?;
            if listed.servers.is_empty() {
                println!("{worker}: no server quarantined");
            }
            for s in &listed.servers {
                println!(
                    "shard {} server {}: excluded for {:.0} s more ({} ejections in a row){}",
                    s.shard,
                    s.address,
                    s.seconds_left,
                    s.ejections,
                    if clear { ", readmitted" } else { "" }
                );
            }
        }
    }
    Ok(())
}

/// Each shard's replication as a table: role, epoch, version, primary,
/// and a replica's stream or a primary's replicas.
fn format_shard_health(shards: &[tessera_proto::v1::ShardHealth]) -> String {
    use std::fmt::Write as _;
    use tessera_proto::v1::ShardRole;
    let mut out = String::from(
        "| shard | role | epoch | version | primary | stream | replicas (lag in pushes) |\n|---:|---|---:|---|---|---|---|\n",
    );
    for s in shards {
        let role = ShardRole::try_from(s.role).map_or("unknown", |r| {
            r.as_str_name().trim_start_matches("SHARD_ROLE_")
        });
        let version = s
            .version
            .map_or_else(|| "-".to_owned(), |v| format!("{}:{}", v.epoch, v.position));
        let stream = if s.role == ShardRole::Replica as i32 {
            format!(
                "{}{}, heard {} ms ago{}",
                if s.in_step { "in step" } else { "out of step" },
                if s.syncing { ", copying" } else { "" },
                s.stream_age_ms,
                if s.receiving { "" } else { ", NOT RECEIVING" }
            )
        } else if s.fenced {
            "FENCED (lease not confirmed)".to_owned()
        } else {
            "-".to_owned()
        };
        let replicas = s
            .replicas
            .iter()
            .map(|r| {
                format!(
                    "{} {} {}",
                    r.address,
                    if r.in_step {
                        "in step"
                    } else if r.attached {
                        "attaching"
                    } else {
                        "detached"
                    },
                    r.lag_pushes
                )
            })
            .collect::<Vec<_>>()
            .join("; ");
        let _ = writeln!(
            out,
            "| {} | {role} | {} | {version} | {} | {stream} | {} |",
            s.shard,
            s.epoch,
            if s.primary.is_empty() {
                "none"
            } else {
                &s.primary
            },
            if replicas.is_empty() { "-" } else { &replicas }
        );
    }
    out
}

#[allow(clippy::print_stdout)]
fn print_cluster(cluster: &Cluster) {
    println!("| server | replica group | shard | address |");
    println!("|--------|---------------|-------|---------|");
    for (i, server) in cluster.servers().iter().enumerate() {
        println!(
            "| {i} | {} | {} | {} |",
            server.group, server.shard, server.address
        );
    }
}

#[allow(clippy::print_stdout)]
async fn up(
    config: ClusterConfig,
    run_dir: Option<PathBuf>,
    interrupt: &mut Interrupt,
) -> Result<(), BoxError> {
    let temp;
    let dir = match run_dir {
        Some(dir) => dir,
        None => {
            temp = tempfile::Builder::new().prefix("tessera-run-").tempdir()?;
            temp.path().to_owned()
        }
    };
    let cluster = Cluster::start_until(&config, &dir, interrupt.recv()).await?;
    print_cluster(&cluster);
    println!(
        "{} ps-server(s) healthy; worker config: {}",
        cluster.servers().len(),
        dir.join("worker.toml").display()
    );
    println!("Press Ctrl-C to stop.");
    interrupt.recv().await;
    println!("stopping...");
    cluster.stop().await?;
    println!("all servers stopped");
    Ok(())
}

#[allow(clippy::print_stdout)]
async fn demo(
    config: ClusterConfig,
    duration_secs: f64,
    transports: &[DemoTransport],
    interrupt: &mut Interrupt,
) -> Result<(), BoxError> {
    if !(duration_secs.is_finite() && duration_secs > 0.0) {
        return Err("--duration-secs must be a positive number".into());
    }
    if transports.is_empty() {
        return Err("--transports names no transport".into());
    }
    let mut runs = Vec::new();
    for &transport in transports {
        let reports = demo_once(transport.apply(config.clone()), duration_secs, interrupt).await?;
        runs.push((transport.label().to_string(), reports));
    }
    let w = tessera_worker::WorkloadConfig::default();
    println!();
    println!(
        "Tessera demo: {} shards x {} replica groups; ranker: {} models per request, responses {}-{} KiB; trainer: messages mean {} KiB, p99 {} KiB; {} outstanding, {} s per workload",
        config.num_shards,
        config.replica_groups,
        w.models,
        w.response_bytes_min / 1024,
        w.response_bytes_max / 1024,
        w.message_bytes_mean / 1024,
        w.message_bytes_p99 / 1024,
        w.concurrency,
        duration_secs
    );
    print!("{}", format_comparison(&runs));
    let mut failed = false;
    for (label, reports) in &runs {
        for report in reports {
            println!(
                "{label} {:?}: {} iterations in {:.1} s ({:.0}/s), {} rows fetched, {} errors",
                report.kind,
                report.iterations,
                report.elapsed.as_secs_f64(),
                report.throughput(),
                report.rows_fetched,
                report.errors
            );
            if let Some(err) = &report.first_error {
                println!("  first error: {err}");
            }
            failed |= report.iterations == 0 || report.errors > 0;
        }
    }
    if failed {
        return Err("the demo saw errors (see above)".into());
    }
    println!("all servers stopped; demo finished");
    Ok(())
}

/// Starts the cluster `config` describes, runs both workloads, stops it.
#[allow(clippy::print_stdout)]
async fn demo_once(
    config: ClusterConfig,
    duration_secs: f64,
    interrupt: &mut Interrupt,
) -> Result<Vec<WorkloadReport>, BoxError> {
    let temp = tempfile::Builder::new().prefix("tessera-demo-").tempdir()?;
    let provider = match config.transport {
        TransportKind::Tcp => String::new(),
        _ => format!(" (provider {:?})", config.rdma.provider),
    };
    println!(
        "starting {} shards x {} replica groups on {} over {}{provider}...",
        config.num_shards, config.replica_groups, config.host, config.transport
    );
    let cluster = Cluster::start_until(&config, temp.path(), interrupt.recv()).await?;
    print_cluster(&cluster);
    let mut worker_config = cluster.worker_config().clone();
    worker_config.workload.duration_secs = duration_secs;
    let outcome = async {
        let client = Arc::new(PsClient::new(&worker_config)?);
        let mut reports = Vec::new();
        for kind in [WorkloadKind::Trainer, WorkloadKind::Ranker] {
            println!("running {kind:?} for {duration_secs} s...");
            reports.push(workload::run(kind, Arc::clone(&client), &worker_config.workload).await);
        }
        Ok::<_, BoxError>(reports)
    };
    let outcome = tokio::select! {
        outcome = outcome => outcome,
        () = interrupt.recv() => {
            println!("interrupted; stopping the cluster...");
            Err("interrupted".into())
        }
    };
    let stopped = cluster.stop().await;
    let reports = outcome?;
    stopped?;
    Ok(reports)
}

/// `tessera doctor`: the transport's host checks for `config` (with the
/// overrides), printed; an error when the configured transport cannot run.
async fn doctor(
    config: ClusterConfig,
    transport: Option<String>,
    provider: Option<String>,
    json: bool,
) -> Result<(), BoxError> {
    let mut checked = tessera_rpc::TransportConfig {
        kind: config.transport,
        rdma: config.rdma.clone(),
        ..tessera_rpc::TransportConfig::default()
    };
    if let Some(kind) = transport {
        checked.kind = kind.parse()?;
    }
    if let Some(provider) = provider {
        checked.rdma.provider = match provider.as_str() {
            "ibverbs" => RdmaProvider::Ibverbs,
            "soft" => RdmaProvider::Soft,
            other => return Err(format!("unknown provider {other:?}: ibverbs or soft").into()),
        };
    }
    let report = tessera_rpc::doctor::diagnose(&checked).await;
    #[allow(clippy::print_stdout)]
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{report}");
    }
    if report.can_run {
        Ok(())
    } else {
        Err("the configured transport cannot run on this host (see the problems above)".into())
    }
}
