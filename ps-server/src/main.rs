//! `ps-server`: runs one parameter-server process.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use tessera_ps_server::{Mode, PsServer, PsServerConfig};
use tessera_rpc::{TransportKind, Validate};

/// Serve shards of embedding tables over Tessera RPC.
#[derive(Debug, Parser)]
#[command(name = "ps-server", version)]
struct Cli {
    /// TOML configuration file; without it, built-in defaults are used.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Override `listen`.
    #[arg(long)]
    listen: Option<String>,
    /// Override `transport`.
    #[arg(long)]
    transport: Option<TransportKind>,
    /// Override `mode`.
    #[arg(long, value_enum)]
    mode: Option<Mode>,
    /// Override `num_shards`.
    #[arg(long)]
    num_shards: Option<u32>,
    /// Override `shards` (comma-separated).
    #[arg(long, value_delimiter = ',')]
    shards: Option<Vec<u32>>,
    /// Override `replica_group`.
    #[arg(long)]
    replica_group: Option<u32>,
    /// Override `seed`.
    #[arg(long)]
    seed: Option<u64>,
    /// Override `grpc_listen`: serve gRPC clients on this address too.
    #[arg(long)]
    grpc_listen: Option<String>,
    /// Override `metrics_listen`: a Prometheus endpoint on this address.
    #[arg(long)]
    metrics_listen: Option<String>,
    /// Override `advertise`: this server's address as its peers know it
    /// (a pod's stable DNS name). A `[[peers]]` entry at this address with
    /// this server's group and shards is this server itself, and is
    /// dropped: one fleet-wide shard map serves every server.
    #[arg(long)]
    advertise: Option<String>,
    /// Override `checkpoint.dir`.
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Stop (gracefully, as on SIGTERM) when the process PID, this
    /// server's parent, exits: a launcher's children must not outlive it,
    /// even when it is killed with SIGKILL.
    #[arg(long, value_name = "PID")]
    parent_pid: Option<i32>,
    /// Load and validate the configuration (file and overrides), say
    /// what is wrong naming the key, and exit without serving: for
    /// deployment checks (`ExecStartPre=` in the systemd unit, the test
    /// suite on the Kubernetes manifests' configs).
    #[arg(long)]
    check_config: bool,
}

fn main() -> ExitCode {
    tessera_rpc::observe::init_logging("info");
    // Fault injection for the drills: FAILPOINTS="name=action;..." (only
    // in builds with the `failpoints` feature).
    #[cfg(feature = "failpoints")]
    let _failpoints = fail::FailScenario::setup();
    let cli = Cli::parse();
    if tessera_config::parse_only() {
        return ExitCode::SUCCESS;
    }
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!("{err}");
            #[allow(clippy::print_stderr)]
            {
                eprintln!("ps-server: {err}");
            }
            ExitCode::FAILURE
        }
    }
}

/// Asks the kernel for SIGTERM when the parent exits, then checks that the
/// parent is still `parent` (it may have exited before the request).
fn die_with_parent(parent: i32) -> Result<(), Box<dyn std::error::Error>> {
    nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM)?;
    let now = nix::unistd::getppid().as_raw();
    if now != parent {
        return Err(format!("the parent process {parent} is gone (parent now {now})").into());
    }
    Ok(())
}

fn run(cli: Cli) -> Result<(), Box<dyn std::error::Error>> {
    if let Some(parent) = cli.parent_pid {
        die_with_parent(parent)?;
    }
    let mut config = match &cli.config {
        // Validated below, once the flags are applied.
        Some(path) => PsServerConfig::read(path)?,
        None => PsServerConfig::default(),
    };
    if let Some(listen) = cli.listen {
        config.listen = listen;
    }
    if let Some(transport) = cli.transport {
        config.transport = transport;
    }
    if let Some(mode) = cli.mode {
        config.mode = mode;
    }
    if let Some(num_shards) = cli.num_shards {
        config.num_shards = num_shards;
    }
    if let Some(shards) = cli.shards {
        config.shards = shards;
    }
    if let Some(group) = cli.replica_group {
        config.replica_group = group;
    }
    if let Some(seed) = cli.seed {
        config.seed = seed;
    }
    if let Some(addr) = cli.grpc_listen {
        config.grpc_listen = Some(addr);
    }
    if let Some(addr) = cli.metrics_listen {
        config.metrics_listen = Some(addr);
    }
    if let Some(dir) = cli.checkpoint_dir {
        config.checkpoint.dir = Some(dir);
    }
    if let Some(addr) = cli.advertise {
        config.advertise = Some(addr);
    }
    if config.drop_own_peer_entry() {
        tracing::debug!(advertise = %config.advertised(), "this server's own entry of the shard map dropped from peers");
    }
    config.validate()?;
    if cli.check_config {
        #[allow(clippy::print_stdout)]
        {
            println!(
                "ps-server: configuration ok ({})",
                cli.config
                    .as_deref()
                    .map_or("built-in defaults".into(), |p| p.display().to_string())
            );
        }
        return Ok(());
    }
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        if let Some(addr) = &config.metrics_listen {
            let bound = tessera_rpc::observe::install_prometheus(addr)?;
            tracing::info!(addr = %bound, "Prometheus endpoint listening");
        }
        let server = PsServer::bind(&config).await?;
        // The process ends right after: its rows go with it, not one by one.
        server.serve(tessera_rpc::shutdown_signal()).await.leak();
        tracing::info!("ps-server stopped");
        Ok(())
    })
}
