//! `worker`: runs a ranker or trainer load against a parameter server.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use clap::{Parser, Subcommand};
use tessera_rpc::{TransportKind, Validate};
use tessera_worker::workload::{self, WorkloadKind};
use tessera_worker::{PsClient, WorkerConfig};

/// mimalloc rather than glibc's allocator: a Fetch's answer is merged
/// into a fresh buffer of up to megabytes, and glibc hands such buffers
/// back to the kernel as they are freed (per-thread heaps trimmed with
/// `madvise`), so the next one faults its pages in again: a ranker took
/// about 20,000 page faults a second, 97% of them in that merge. mimalloc
/// keeps freed memory for reuse (the well-kept allocator we also measure
/// in `tessera-bench alloc`).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
    /// Override `workload.models` (ranker: models per user request).
    #[arg(long)]
    models: Option<usize>,
    /// Override `admin_listen`: serve `WorkerAdmin` (quarantine list) here.
    #[arg(long)]
    admin_listen: Option<String>,
    /// Write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Override `workload.concurrency`.
    #[arg(long)]
    concurrency: Option<usize>,
    /// Override `threads` (the runtime's threads; 0: one per core).
    #[arg(long)]
    threads: Option<usize>,
    /// Override `workload.rate_per_sec`: an open loop at this many
    /// iterations per second (0: closed loop).
    #[arg(long)]
    rate: Option<f64>,
    /// Override `workload.table`.
    #[arg(long)]
    table: Option<String>,
    /// Override `metrics_listen`: a Prometheus endpoint on this address.
    #[arg(long)]
    metrics_listen: Option<String>,
    /// Load and validate the configuration (file and overrides), say what
    /// is wrong naming the key, and exit without running the workload.
    #[arg(long)]
    check_config: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Inference: Fetch only.
    Ranker,
    /// Training: Fetch, compute a gradient, Push.
    Trainer,
    /// Print the rows of KEYS in the table (`--table`, else
    /// `workload.table`) as JSON: `{"table", "dim", "rows": [[...], ...]}`,
    /// each value printed so that it reads back as the same f32.
    Fetch {
        /// Comma-separated keys.
        #[arg(long, value_delimiter = ',', required = true)]
        keys: Vec<u64>,
    },
    /// Push gradients to the rows of KEYS in the table (`--table`, else
    /// `workload.table`), read from stdin as JSON (`[[f32; dim]; keys]`);
    /// prints the Push's id.
    Push {
        /// Comma-separated keys.
        #[arg(long, value_delimiter = ',', required = true)]
        keys: Vec<u64>,
    },
}

fn main() -> ExitCode {
    tessera_rpc::observe::init_logging("warn");
    let cli = Cli::parse();
    if tessera_config::parse_only() {
        return ExitCode::SUCCESS;
    }
    match run(cli) {
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
        // Validated below, once the flags are applied.
        Some(path) => WorkerConfig::read(path)?,
        None => WorkerConfig::default(),
    };
    if let Some(transport) = cli.transport {
        config.transport = transport;
    }
    if let Some(duration) = cli.duration_secs {
        config.workload.duration_secs = duration;
    }
    if let Some(models) = cli.models {
        config.workload.models = models;
    }
    if let Some(concurrency) = cli.concurrency {
        config.workload.concurrency = concurrency;
    }
    if let Some(threads) = cli.threads {
        config.threads = threads;
    }
    if let Some(rate) = cli.rate {
        config.workload.rate_per_sec = rate;
    }
    if let Some(table) = cli.table {
        config.workload.table = table;
    }
    if let Some(addr) = cli.metrics_listen {
        config.metrics_listen = Some(addr);
    }
    if let Some(addr) = cli.admin_listen {
        config.admin_listen = Some(addr);
    }
    config.validate()?;
    if cli.check_config {
        #[allow(clippy::print_stdout)]
        {
            println!(
                "worker: configuration ok ({})",
                cli.config
                    .as_deref()
                    .map_or("built-in defaults".into(), |p| p.display().to_string())
            );
        }
        return Ok(ExitCode::SUCCESS);
    }
    let kind = match cli.command {
        Command::Ranker => WorkloadKind::Ranker,
        Command::Trainer => WorkloadKind::Trainer,
        Command::Fetch { keys } => return rows(&config, Rows::Fetch(keys)),
        Command::Push { keys } => return rows(&config, Rows::Push(keys)),
    };
    let runtime = config.runtime()?;
    let report = runtime.block_on(async {
        if let Some(addr) = &config.metrics_listen {
            tessera_rpc::observe::install_prometheus(addr)?;
        }
        let client = Arc::new(PsClient::new(&config)?);
        let _admin = match &config.admin_listen {
            Some(addr) => Some(serve_admin(addr, Arc::clone(&client), &config).await?),
            None => None,
        };
        let progress = Arc::new(AtomicU64::new(0));
        let bar = progress_bar(kind, config.workload.duration_secs, Arc::clone(&progress));
        let report = workload::run_with_progress(kind, client, &config.workload, progress).await;
        bar.abort();
        Ok::<_, Box<dyn std::error::Error>>(report)
    })?;
    println!("{report}");
    println!(
        "{} iterations in {:.1} s ({:.0}/s), {} rows ({:.1} MiB) fetched, {:.0} µs CPU and {:.1} context switches per iteration, {} errors",
        report.iterations,
        report.elapsed.as_secs_f64(),
        report.throughput(),
        report.rows_fetched,
        report.bytes_fetched as f64 / (1 << 20) as f64,
        report.cpu_us_per_iteration,
        report.context_switches_per_iteration,
        report.errors
    );
    if let Some(path) = &cli.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
    }
    if let Some(err) = &report.first_error {
        println!("first error: {err}");
    }
    Ok(if report.iterations > 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// What `worker fetch` / `worker push` do.
enum Rows {
    Fetch(Vec<u64>),
    Push(Vec<u64>),
}

/// One Fetch or Push of `config.workload.table`'s rows, printed as JSON
/// (for scripts and for checking another client's numbers).
#[allow(clippy::print_stdout)]
fn rows(config: &WorkerConfig, op: Rows) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let table = &config.workload.table;
    let runtime = config.runtime()?;
    runtime.block_on(async {
        let client = PsClient::new(config)?;
        match op {
            Rows::Fetch(keys) => {
                let rows = client.fetch(table, &keys).await?;
                let rows: Vec<&[f32]> = (0..rows.len()).map(|i| rows.row(i)).collect();
                let dim = rows.first().map_or(0, |row| row.len());
                let out = serde_json::json!({ "table": table, "dim": dim, "rows": rows });
                println!("{out}");
            }
            Rows::Push(keys) => {
                let gradients: Vec<Vec<f32>> = serde_json::from_reader(std::io::stdin().lock())?;
                if gradients.len() != keys.len() {
                    return Err(format!(
                        "{} gradient rows for {} keys",
                        gradients.len(),
                        keys.len()
                    )
                    .into());
                }
                let dim = gradients.first().map_or(0, Vec::len);
                if gradients.iter().any(|row| row.len() != dim) {
                    return Err("gradient rows differ in length".into());
                }
                let flat: Vec<f32> = gradients.concat();
                let id = client.next_push_id();
                client.push_as(id, table, &keys, &flat, dim).await?;
                println!("{}", serde_json::json!({ "push_id": id.sequence() }));
            }
        }
        Ok::<_, Box<dyn std::error::Error>>(())
    })?;
    Ok(ExitCode::SUCCESS)
}

/// A progress line on stderr (indicatif hides it when stderr is not a
/// terminal): elapsed time against the run's length, iterations and rate.
fn progress_bar(
    kind: WorkloadKind,
    duration_secs: f64,
    done: Arc<AtomicU64>,
) -> tokio::task::JoinHandle<()> {
    let total_ms = (duration_secs * 1000.0) as u64;
    let bar = indicatif::ProgressBar::new(total_ms);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{prefix} [{bar:30}] {elapsed_precise} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_prefix(format!("{kind:?}"));
    let started = std::time::Instant::now();
    tokio::spawn(async move {
        loop {
            let elapsed = started.elapsed();
            let n = done.load(Ordering::Relaxed);
            bar.set_position((elapsed.as_millis() as u64).min(total_ms));
            bar.set_message(format!(
                "{n} iterations, {:.0}/s",
                n as f64 / elapsed.as_secs_f64().max(1e-3)
            ));
            if elapsed.as_millis() as u64 >= total_ms {
                bar.finish_and_clear();
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
}

/// Serves `WorkerAdmin` on `addr` until the returned sender is dropped.
/// Serves `WorkerAdmin` at `addr`; with the worker's `[tls]`, over
/// mutual TLS and only to certificates with its `admin_role`, since
/// clearing a quarantine is an operator's act.
async fn serve_admin(
    addr: &str,
    client: Arc<PsClient>,
    config: &tessera_worker::WorkerConfig,
) -> Result<tokio::sync::oneshot::Sender<()>, Box<dyn std::error::Error>> {
    let mut server_config = tessera_rpc::ServerConfig::default();
    server_config.transport.tls = config.tls.clone();
    let mut builder = tessera_rpc::Server::builder(server_config).add_service(
        tessera_proto::v1::WorkerAdminServer::new(tessera_worker::WorkerAdminService::new(client)),
    )?;
    if config.tls.is_some() {
        builder = builder.require_role(
            tessera_proto::v1::WORKER_ADMIN_DESCRIPTOR.name,
            &config.admin_role,
        )?;
    }
    let server = builder.bind(addr).await?;
    tracing::info!(addr = %server.local_addr(), "WorkerAdmin listening");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(server.serve_with_shutdown(async {
        let _ = stopped.await;
    }));
    Ok(stop)
}
