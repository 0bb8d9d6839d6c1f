//! `worker`: runs a ranker or trainer load against a parameter server.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use tessera_rpc::{TransportKind, Validate};
use tessera_worker::workload::{self, WorkloadKind};
use tessera_worker::{PsClient, WorkerConfig};

/// Fetch and push embeddings against a Tessera parameter server.
#[derive(Debug, Parser)]
#[command(name = "worker", version)]
struct Cli {
    /// TOML configuration file (servers, timeouts, workload).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Override `transport`.
    #[arg(long)]
    transport: Option<TransportKind>,
    /// Override `workload.duration_secs`.
    #[arg(long)]
    duration_secs: Option<f64>,
    /// Override `workload.batch_keys`.
    #[arg(long)]
    batch_keys: Option<usize>,
    /// Override `workload.concurrency`.
    #[arg(long)]
    concurrency: Option<usize>,
    /// Override `workload.table`.
    #[arg(long)]
    table: Option<String>,
    /// Override `metrics_listen`: a Prometheus endpoint on this address.
    #[arg(long)]
    metrics_listen: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Inference: Fetch only.
    Ranker,
    /// Training: Fetch, compute a gradient, Push.
    Trainer,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(err) => {
            #[allow(clippy::print_stderr)]
            {
                eprintln!("worker: {err}");
            }
            ExitCode::FAILURE
        }
    }
}

#[allow(clippy::print_stdout)]
fn run(cli: Cli) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let mut config = match &cli.config {
        Some(path) => WorkerConfig::load(path)?,
        None => WorkerConfig::default(),
    };
    if let Some(transport) = cli.transport {
        config.transport = transport;
    }
    if let Some(duration) = cli.duration_secs {
        config.workload.duration_secs = duration;
    }
    if let Some(batch) = cli.batch_keys {
        config.workload.batch_keys = batch;
    }
    if let Some(concurrency) = cli.concurrency {
        config.workload.concurrency = concurrency;
    }
    if let Some(table) = cli.table {
        config.workload.table = table;
    }
    if let Some(addr) = cli.metrics_listen {
        config.metrics_listen = Some(addr);
    }
    config.validate()?;
    let kind = match cli.command {
        Command::Ranker => WorkloadKind::Ranker,
        Command::Trainer => WorkloadKind::Trainer,
    };
    let runtime = tokio::runtime::Runtime::new()?;
    let report = runtime.block_on(async {
        if let Some(addr) = &config.metrics_listen {
            tessera_rpc::observe::install_prometheus(addr)?;
        }
        let client = Arc::new(PsClient::new(&config)?);
        Ok::<_, Box<dyn std::error::Error>>(workload::run(kind, client, &config.workload).await)
    })?;
    println!("{report}");
    println!(
        "{} iterations in {:.1} s ({:.0}/s), {} rows fetched, {} errors",
        report.iterations,
        report.elapsed.as_secs_f64(),
        report.throughput(),
        report.rows_fetched,
        report.errors
    );
    if let Some(err) = &report.first_error {
        println!("first error: {err}");
    }
    Ok(if report.iterations > 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
