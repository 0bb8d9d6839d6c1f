//! `tessera`: the launcher.
//!
//! - `tessera up --config FILE` starts n shards x r replica groups of
//!   ps-server processes on one host, waits until they are healthy, writes a
//!   matching `worker.toml`, and stops them all on Ctrl-C or SIGTERM.
//! - `tessera demo` starts the default cluster, runs a trainer and then a
//!   ranker against it, prints the results, and shuts everything down.
//!   With `--serving` (or a `[serving]` fleet in the config), trainers
//!   push into the training fleet while rankers read a serving fleet fed
//!   by its delta stream, and a probe measures the delay from a Push to
//!   its visibility there.
//! - `tessera admin ...` calls a running server's `Health` and `Admin`
//!   (stats, checkpoint) or a worker's `WorkerAdmin` (quarantine)
//!   (`admin.rs`).
//! - `tessera status TARGET...` prints every server's state, shards,
//!   primaries, epochs, transport and replication lag
//!   ([`tessera_deploy::status`]).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use tessera_coord::CoordinatorConfig;
use tessera_deploy::{Cluster, ClusterConfig};
use tessera_rpc::{RdmaProvider, TransportKind};
use tessera_worker::PsClient;
use tessera_worker::freshness::{self, DelayReport, ProbeConfig};
use tessera_worker::workload::{self, WorkloadKind, WorkloadReport, format_comparison};

mod admin;
use admin::{AdminAction, admin};

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
        /// Add a serving fleet (the built-in `[serving]` where the config
        /// has none): trainer and ranker run at once, on separate fleets.
        #[arg(long)]
        serving: bool,
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
    /// Which send windows (`rdma.window_bytes`) keep the fabric free of
    /// PFC pauses for an incast of `--servers` answers towards one worker,
    /// and at what Pull latency and goodput: the fabric simulator (the
    /// real RDMA engine on a simulated leaf-spine) run once per window.
    PlanWindow {
        /// Servers answering each Pull (the fan-in).
        #[arg(long)]
        servers: u32,
        /// Answer sizes in bytes: mean,p99 (a log-normal).
        #[arg(long, value_delimiter = ',', default_values_t = vec![20_000.0, 50_000.0])]
        message_sizes: Vec<f64>,
        /// Every link's rate, Gbit/s.
        #[arg(long, default_value_t = 25.0)]
        link_gbps: f64,
        /// Windows to try, bytes or `none`, comma-separated.
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "none,65536,32768,16384,8192,4096,2048"
        )]
        windows: Vec<String>,
        /// Pulls the worker keeps outstanding.
        #[arg(long, default_value_t = 4)]
        pulls_in_flight: u32,
        /// Pulls per run.
        #[arg(long, default_value_t = 8)]
        pulls: u32,
        /// The simulation's seed.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Print the plans as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Print the built-in cluster configuration as TOML.
    PrintConfig,
    /// Operate a running ps-server or worker (over Tessera RPC on TCP).
    Admin {
        #[command(flatten)]
        tls: TlsArgs,
        #[command(subcommand)]
        action: AdminAction,
    },
    /// Every server of a cluster in one table: state, replica group,
    /// shards, primaries, epochs, transport, replication lag. Exits 1 when
    /// a server does not answer or does not serve every hosted shard
    /// (with `--in-step`, also while a copy is not in step).
    Status {
        /// Run directories of `tessera up` (their worker.toml lists the
        /// servers) or server addresses (`host:port`).
        #[arg(required = true)]
        targets: Vec<String>,
        /// Print the statuses as JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Exit 0 only once every replica is in step with its primary
        /// (holds every Push the primary acknowledged) and every primary
        /// has all its replicas in step: what a rolling restart waits for
        /// before it stops the next server.
        #[arg(long)]
        in_step: bool,
        #[command(flatten)]
        tls: TlsArgs,
    },
    /// Change a running cluster's shard count (etcd mode): plan a resize
    /// to `--to M` shards (`--hold`: its cut-over waits for `--cut-over`),
    /// `--cancel` the one in progress (after its cut-over too, while no
    /// receiving shard claimed its opening: the way out of a resize one
    /// old shard cannot finish), or show where
    /// the shard map stands (the default). The servers carry the resize
    /// out; this tool only writes the plan.
    Reshard {
        /// Cluster description (TOML) whose `[coordinator]` names etcd
        /// and the cluster, or a run directory of `tessera up` (its
        /// `worker.toml` names the cluster's etcd, a local one included);
        /// built-in defaults without it.
        #[arg(long)]
        config: Option<PathBuf>,
        /// etcd's client endpoints, comma-separated (instead of the
        /// config's `coordinator.endpoints`).
        #[arg(long, value_delimiter = ',')]
        endpoints: Vec<String>,
        /// The cluster's name in etcd (instead of the config's
        /// `coordinator.cluster`).
        #[arg(long)]
        cluster: Option<String>,
        /// Plan a resize to this many shards.
        #[arg(long, conflicts_with_all = ["cancel", "cut_over"])]
        to: Option<u32>,
        /// With `--to`: the new shards copy and follow, but ownership
        /// moves only once released with `--cut-over`.
        #[arg(long, requires = "to")]
        hold: bool,
        /// Release a held resize: it cuts over once every receiving shard
        /// is in step.
        #[arg(long, conflicts_with = "cancel")]
        cut_over: bool,
        /// Cancel the resize in progress (after its cut-over only while no
        /// receiving shard claimed its opening).
        #[arg(long)]
        cancel: bool,
        /// Print the shard map as JSON instead of words.
        #[arg(long)]
        json: bool,
    },
}

/// Mutual TLS with servers that run with `[tls]`.
#[derive(Debug, clap::Args)]
struct TlsArgs {
    /// This tool's certificate (PEM; Admin calls need one with the admin
    /// role).
    #[arg(long, requires_all = ["tls_key", "tls_ca"], global = true)]
    tls_cert: Option<String>,
    /// The certificate's private key (PEM).
    #[arg(long, requires = "tls_cert", global = true)]
    tls_key: Option<String>,
    /// The CA whose certificates the servers carry (PEM).
    #[arg(long, requires = "tls_cert", global = true)]
    tls_ca: Option<String>,
    /// The name the server's certificate must carry, where it is not the
    /// host dialed.
    #[arg(long, requires = "tls_cert", global = true)]
    tls_server_name: Option<String>,
}

impl TlsArgs {
    fn config(self) -> Option<tessera_rpc::TlsConfig> {
        match (self.tls_cert, self.tls_key, self.tls_ca) {
            (Some(cert), Some(key), Some(ca)) => Some(tessera_rpc::TlsConfig {
                cert,
                key,
                ca,
                server_name: self.tls_server_name,
            }),
            _ => None,
        }
    }
}

fn main() -> ExitCode {
    tessera_rpc::observe::init_logging("warn");
    let cli = Cli::parse();
    if tessera_config::parse_only() {
        return ExitCode::SUCCESS;
    }
    let result = tokio::runtime::Runtime::new()
        .map_err(|err| err.into())
        .and_then(|runtime| runtime.block_on(run(cli)));
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

/// The coordinator `tessera reshard` writes to: a run directory of
/// `tessera up` names its cluster's etcd in `worker.toml` (a local etcd
/// listens on a port picked at start, which the cluster description does
/// not know); a file is a cluster description.
fn reshard_coordinator(path: Option<&Path>) -> Result<CoordinatorConfig, BoxError> {
    match path {
        Some(dir) if dir.is_dir() => {
            Ok(tessera_worker::WorkerConfig::load(&dir.join("worker.toml"))?.coordinator)
        }
        Some(file) => Ok(ClusterConfig::load(file)?.coordinator),
        None => Ok(ClusterConfig::default().coordinator),
    }
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
            serving,
        } => {
            let mut interrupt = Interrupt::install()?;
            let mut config = load(config.as_ref())?;
            if serving && config.serving.is_none() {
                config.serving = Some(tessera_deploy::config::ServingFleetConfig::default());
            }
            demo(config, duration_secs, &transports, &mut interrupt).await
        }
        Command::Admin { action, tls } => admin(action, tls.config().as_ref()).await,
        Command::Status {
            targets,
            json,
            in_step,
            tls,
        } => status(&targets, json, in_step, tls.config()).await,
        Command::Doctor {
            config,
            transport,
            provider,
            json,
        } => doctor(load(config.as_ref())?, transport, provider, json).await,
        Command::Reshard {
            config,
            endpoints,
            cluster,
            to,
            hold,
            cut_over,
            cancel,
            json,
        } => {
            let mut coordinator = reshard_coordinator(config.as_deref())?;
            if !endpoints.is_empty() {
                coordinator.endpoints = endpoints;
            } else if !coordinator.is_etcd() {
                return Err(
                    "the cluster's coordinator is static: resharding needs etcd mode ([coordinator] kind = \"etcd\", or --endpoints)"
                        .into(),
                );
            }
            if let Some(cluster) = cluster {
                coordinator.cluster = cluster;
            }
            use tessera_deploy::reshard::Action;
            let action = match (to, cut_over, cancel) {
                (Some(to), _, _) if hold => Action::ToHeld(to),
                (Some(to), _, _) => Action::To(to),
                (None, true, _) => Action::CutOver,
                (None, false, true) => Action::Cancel,
                (None, false, false) => Action::Status,
            };
            let map = tessera_deploy::reshard::run(&coordinator, action).await?;
            #[allow(clippy::print_stdout)]
            {
                if json {
                    println!("{}", serde_json::to_string_pretty(&map)?);
                } else {
                    println!("{}", tessera_deploy::reshard::describe(&map));
                }
            }
            Ok(())
        }
        Command::PlanWindow {
            servers,
            message_sizes,
            link_gbps,
            windows,
            pulls_in_flight,
            pulls,
            seed,
            json,
        } => {
            let windows = windows
                .iter()
                .map(|w| match w.trim() {
                    "none" | "0" => Ok(0),
                    bytes => bytes.parse::<usize>().map_err(|_| {
                        format!("--windows: `{bytes}` is neither a byte count nor `none`")
                    }),
                })
                .collect::<Result<Vec<_>, _>>()?;
            let [mean_bytes, p99_bytes] = message_sizes[..] else {
                return Err(format!(
                    "--message-sizes takes two values, mean,p99 in bytes; got {message_sizes:?}"
                )
                .into());
            };
            let req = tessera_deploy::plan::PlanRequest {
                servers,
                mean_bytes,
                p99_bytes,
                link_gbps,
                windows,
                pulls_in_flight,
                pulls,
                seed,
            };
            let plans = tessera_deploy::plan::plan(&req)?;
            #[allow(clippy::print_stdout)]
            {
                if json {
                    println!("{}", serde_json::to_string_pretty(&plans)?);
                } else {
                    print!("{}", tessera_deploy::plan::table(&req, &plans));
                }
            }
            Ok(())
        }
        Command::PrintConfig => {
            #[allow(clippy::print_stdout)]
            {
                print!("{}", toml::to_string(&ClusterConfig::default())?);
            }
            Ok(())
        }
    }
}

/// `tessera status`: the table (or JSON) of every server of `targets`.
async fn status(
    targets: &[String],
    json: bool,
    in_step: bool,
    tls: Option<tessera_rpc::TlsConfig>,
) -> Result<(), BoxError> {
    let mut addresses = Vec::new();
    for target in targets {
        let path = std::path::Path::new(target);
        if path.is_dir() {
            addresses.extend(tessera_deploy::status::addresses_of_run_dir(path)?);
        } else {
            addresses.push(target.clone());
        }
    }
    let statuses = tessera_deploy::status::cluster_status(&addresses, tls.as_ref()).await;
    #[allow(clippy::print_stdout)]
    if json {
        println!("{}", serde_json::to_string_pretty(&statuses)?);
    } else {
        print!("{}", tessera_deploy::status::format_table(&statuses));
    }
    // A failing checkpoint does not stop serving (the exit status says
    // whether every server serves), but it is said.
    for s in &statuses {
        if let Some(error) = s.checkpoint.as_ref().and_then(|c| c.last_error.as_ref()) {
            #[allow(clippy::print_stderr)]
            {
                eprintln!("warning: {}: checkpoints failing: {error}", s.address);
            }
        }
    }
    let problems = tessera_deploy::status::problems(&statuses, in_step);
    if !problems.is_empty() {
        return Err(format!(
            "{} of {} servers {}: {}",
            problems.len(),
            statuses.len(),
            if in_step {
                "unreachable, not serving or not in step"
            } else {
                "unreachable or not serving"
            },
            problems.join("; ")
        )
        .into());
    }
    Ok(())
}

#[allow(clippy::print_stdout)]
fn print_cluster(cluster: &Cluster) {
    println!("| server | fleet | replica group | shard | address |");
    println!("|--------|-------|---------------|-------|---------|");
    for (i, server) in cluster.servers().iter().enumerate() {
        println!(
            "| {i} | {} | {} | {} | {} |",
            if server.serving {
                "serving"
            } else {
                "training"
            },
            server.group,
            server.shard,
            server.address
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
    let mut cluster = Cluster::start_until(&config, &dir, interrupt.recv()).await?;
    print_cluster(&cluster);
    println!(
        "{} ps-server(s) healthy; worker config: {}",
        cluster.servers().len(),
        dir.join("worker.toml").display()
    );
    if cluster.serving_config().is_some() {
        println!(
            "serving fleet (fed by the training fleet's delta stream); ranker config: {}",
            dir.join("ranker.toml").display()
        );
    }
    println!("Press Ctrl-C to stop.");
    if config.coordinator.is_etcd() {
        // `tessera reshard --to M` resizes it: new shards' servers are
        // started here, given-away ones stopped.
        let coordinator = cluster.worker_config().coordinator.clone();
        tessera_deploy::resizing::follow(&mut cluster, &coordinator, interrupt.recv()).await;
    } else {
        interrupt.recv().await;
    }
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
    let mut delays = Vec::new();
    for &transport in transports {
        let (reports, delay) =
            demo_once(transport.apply(config.clone()), duration_secs, interrupt).await?;
        runs.push((transport.label().to_string(), reports));
        if let Some(delay) = delay {
            delays.push((transport.label(), delay));
        }
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
    if let Some(serving) = &config.serving {
        let interval = serving.interval_ms as f64;
        println!(
            "training to serving ({} shards x {} groups, delta every {} ms), delay from a Push's send to a ranker's first Fetch that sees it:",
            serving.num_shards, serving.replica_groups, serving.interval_ms
        );
        for (label, delay) in &delays {
            let ms = |d: Option<std::time::Duration>| d.map_or(f64::NAN, |d| d.as_secs_f64() * 1e3);
            let (p50, p99) = (ms(delay.percentile(50.0)), ms(delay.percentile(99.0)));
            println!(
                "{label}: {}; target p50 <= {:.0} ms {}, p99 <= {:.0} ms {}",
                delay.summary(),
                interval + 100.0,
                if p50 <= interval + 100.0 {
                    "met"
                } else {
                    "MISSED"
                },
                2.0 * interval,
                if p99 <= 2.0 * interval {
                    "met"
                } else {
                    "MISSED"
                },
            );
            failed |= delay.delays.is_empty() || delay.unseen > 0;
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
) -> Result<(Vec<WorkloadReport>, Option<DelayReport>), BoxError> {
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
    let serving_config = cluster.serving_config().cloned().map(|mut c| {
        c.workload.duration_secs = duration_secs;
        c
    });
    let dim = config.tables.first().map_or(32, |t| t.dim as usize);
    let outcome = async {
        let client = Arc::new(PsClient::new(&worker_config)?);
        let Some(serving_config) = &serving_config else {
            let mut reports = Vec::new();
            for kind in [WorkloadKind::Trainer, WorkloadKind::Ranker] {
                println!("running {kind:?} for {duration_secs} s...");
                reports
                    .push(workload::run(kind, Arc::clone(&client), &worker_config.workload).await);
            }
            return Ok::<_, BoxError>((reports, None));
        };
        // Trainers and rankers at once, on their own fleets, and the probe
        // of the delay between them.
        let serving = Arc::new(PsClient::new(serving_config)?);
        println!(
            "running the trainer (training fleet), the ranker (serving fleet) and the delay probe for {duration_secs} s..."
        );
        let probe_config = ProbeConfig {
            table: worker_config.workload.table.clone(),
            dim,
            ..ProbeConfig::default()
        };
        let duration = std::time::Duration::from_secs_f64(duration_secs);
        let (trainer, ranker, delay) = tokio::join!(
            workload::run(
                WorkloadKind::Trainer,
                Arc::clone(&client),
                &worker_config.workload
            ),
            workload::run(
                WorkloadKind::Ranker,
                Arc::clone(&serving),
                &serving_config.workload
            ),
            freshness::probe(
                Arc::clone(&client),
                Arc::clone(&serving),
                &probe_config,
                tokio::time::sleep(duration)
            ),
        );
        Ok((vec![trainer, ranker], Some(delay)))
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
