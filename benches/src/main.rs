//! `tessera-bench`: benchmarks, each reporting medians and percentiles and
//! the ratio to a baseline measured in the same run (timings on shared
//! machines are noisy; ratios travel better than absolute numbers).
//!
//! - `all`: every benchmark below into one report with figures; see
//!   `tessera_benches::all`.
//! - `alloc`: allocation and free rates and peak memory of Tessera's
//!   registered-memory pool against the system allocator, mimalloc and
//!   rpmalloc (the paper's Figure 4); see `tessera_benches::alloc`.
//! - `transport`: the transport alone between two processes, RDMA over
//!   the soft RNIC against TCP, with memcpy bandwidth as the ceiling (the
//!   paper's Figures 8 and 9); see `tessera_benches::transport`.
//! - `rpc`: the ParameterServer service end to end (Fetch of 1,000 keys x
//!   dim 64, an empty Health), Tessera RPC over tcp and rdma-soft against
//!   tonic gRPC and a bare TCP floor; see `tessera_benches::rpc`.
//! - `scale`: Fetch latency and server memory as keys per Fetch, rows
//!   per shard and client connections grow; see `tessera_benches::scale`.
//! - `recovery`: the RPC layer's policy overhead (a call with every policy
//!   on against a plain channel), RDMA-to-TCP fallback and return times,
//!   and failover around a SIGKILLed replica; see `recovery.rs`.
//! - `replication`: Push latency with `ack = "replicas"` against `ack =
//!   "primary"` (primary + replica in-process); see `replication.rs`.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};
use tessera_benches::transport;

/// Tessera benchmarks.
#[derive(Debug, Parser)]
#[command(name = "tessera-bench")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Every benchmark, each in a process of its own, into one report:
    /// `<name>.json`, `<name>.md`, PNG figures and `REPORT.md` in `--out`.
    All {
        /// Smoke settings for every benchmark (minutes, not an hour).
        #[arg(long)]
        quick: bool,
        /// The report's directory.
        #[arg(long)]
        out: PathBuf,
        /// Only these benchmarks (comma-separated).
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
    },
    /// Allocator rates and peak memory: pool vs system, mimalloc, rpmalloc.
    Alloc {
        /// A short smoke run (fewer operations, one repetition).
        #[arg(long)]
        quick: bool,
        /// Write `alloc.json` and `alloc.md` into this directory.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Thread counts to run.
        #[arg(long, value_delimiter = ',', default_values_t = vec![1usize, 2])]
        threads: Vec<usize>,
        /// Repetitions per cell; the median is reported.
        #[arg(long)]
        repeat: Option<usize>,
    },
    /// One allocator measurement in this process (used by `alloc`).
    #[command(hide = true)]
    AllocChild {
        /// `tessera-pool` or `system`.
        system: String,
        /// Workload, threads and operations per thread.
        args: Vec<String>,
    },
    /// Transport latency and throughput: rdma-soft vs tcp, two processes.
    Transport {
        /// A short smoke run.
        #[arg(long)]
        quick: bool,
        /// Write `transport.json` and `transport.md` into this directory.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Measured round trips per latency size.
        #[arg(long)]
        iterations: Option<u32>,
        /// Latency message sizes in bytes.
        #[arg(long, value_delimiter = ',', default_values_t = vec![32usize, 256, 1024, 4096, 16384, 65536])]
        sizes: Vec<usize>,
        /// Seconds per throughput run.
        #[arg(long)]
        throughput_secs: Option<f64>,
        /// Messages outstanding in the throughput runs.
        #[arg(long, default_value_t = 8)]
        concurrency: usize,
        /// RDMA fragment sizes to measure throughput with (the first one is
        /// used for latency).
        #[arg(long, value_delimiter = ',', default_values_t = vec![65536u32, 8192, 16384, 32768, 131072])]
        fragment_sizes: Vec<u32>,
        #[command(flatten)]
        tuning: TuningArgs,
    },
    /// RDMA throughput vs fragment size, 1 KiB to 64 KiB (Figure 10).
    Fragment {
        #[command(flatten)]
        common: EngineBenchArgs,
        /// Fragment sizes in bytes.
        #[arg(long, value_delimiter = ',', default_values_t = vec![1024u32, 2048, 4096, 8192, 16384, 32768, 65536])]
        sizes: Vec<u32>,
    },
    /// Small-flow latency next to 0..8 large flows on one QP, with and
    /// without fragmentation (Figure 13).
    Hol {
        #[command(flatten)]
        common: EngineBenchArgs,
        /// Numbers of concurrent large flows.
        #[arg(long, value_delimiter = ',', default_values_t = vec![0usize, 1, 2, 4, 8])]
        large: Vec<usize>,
    },
    /// 1 MiB throughput over 1, 2 and 4 soft rails whose links run at a
    /// set rate each (issue 36).
    Rails {
        #[command(flatten)]
        common: EngineBenchArgs,
        /// Rail counts.
        #[arg(long, value_delimiter = ',', default_values_t = vec![1usize, 2, 4])]
        counts: Vec<usize>,
        /// Connections sending at once.
        #[arg(long, default_value_t = 8)]
        sockets: usize,
        /// Interleaved rounds (median reported).
        #[arg(long, default_value_t = 3)]
        rounds: usize,
    },
    /// Many senders towards one receiver, send window off and on
    /// (Figure 15, Table 4).
    Incast {
        #[command(flatten)]
        common: EngineBenchArgs,
        /// Senders, each with its own engine.
        #[arg(long, default_value_t = 8)]
        senders: usize,
        /// Window sizes in bytes (0 = off).
        #[arg(long, value_delimiter = ',', default_values_t = vec![0usize, 4096, 8192, 16384])]
        windows: Vec<usize>,
    },
    /// The paper's fabric-scale experiments (Table 4, Figure 15, Table 7)
    /// in virtual time: Tessera's real engines on a simulated leaf-spine
    /// (issue 58), and the simulator's calibration against a real run.
    Fabric {
        /// Fewer Pulls per run and a smaller Figure 15 (Table 4 still
        /// goes up to 2,048 servers).
        #[arg(long)]
        quick: bool,
        /// Write `fabric.json` and `fabric.md` here.
        #[arg(long)]
        out: Option<PathBuf>,
        /// The seed of every run.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// The largest incast Table 4 tries.
        #[arg(long)]
        max_servers: Option<u32>,
        /// Only these scenarios (`table4`, `fig15`, `table7`,
        /// `calibration`, `speed`; default: all).
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
    },
    /// 512-byte message rate vs number of QPs (Figure 11).
    Qps {
        #[command(flatten)]
        common: EngineBenchArgs,
        /// QP counts.
        #[arg(long, value_delimiter = ',', default_values_t = vec![1usize, 2, 4, 8, 16, 32, 64, 128, 256])]
        qps: Vec<usize>,
    },
    /// The server process of `transport`.
    #[command(hide = true)]
    TransportServer {
        /// `tcp` or `rdma-soft:<fragment size>`.
        kind: String,
        #[command(flatten)]
        tuning: TuningArgs,
    },
    /// Policy overhead, fallback/return and failover times of the RPC layer.
    Recovery {
        /// Calls per side of the overhead comparison.
        #[arg(long, default_value_t = 20_000)]
        calls: u32,
        /// Break/repair cycles (and failover rounds, at most 3).
        #[arg(long, default_value_t = 5)]
        rounds: u32,
        /// RDMA probe interval of the fallback measurement, milliseconds.
        #[arg(long, default_value_t = 1000)]
        probe_ms: u64,
        /// A short smoke run (at most 2,000 calls, one round).
        #[arg(long)]
        quick: bool,
        /// Write `recovery.json` and `recovery.md` into this directory.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Push latency by acknowledgement mode: ack = replicas vs primary.
    Replication {
        /// Pushes per mode and concurrency.
        #[arg(long, default_value_t = 4000)]
        pushes: u64,
        /// Interleaved blocks.
        #[arg(long, default_value_t = 20)]
        blocks: u64,
        /// A short smoke run (at most 400 pushes in 4 blocks).
        #[arg(long)]
        quick: bool,
        /// Write `replication.json` and `replication.md` into this directory.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// The server process of `recovery`'s failover measurement.
    #[command(hide = true)]
    RpcServer {
        /// `tcp` or `rdma` (soft provider).
        kind: tessera_rpc::TransportKind,
        /// Address to listen on.
        listen: String,
    },
    /// The ParameterServer service end to end: Tessera RPC over tcp and
    /// rdma-soft against tonic gRPC and a bare TCP floor, client and
    /// servers in separate processes.
    Rpc {
        /// A short smoke run.
        #[arg(long)]
        quick: bool,
        /// Write `rpc.json` and `rpc.md` into this directory.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Measured calls per way and call (latency, one outstanding).
        #[arg(long)]
        iterations: Option<usize>,
        /// Seconds of throughput per way and call, over all rounds.
        #[arg(long)]
        throughput_secs: Option<f64>,
        /// Callers outstanding in the throughput runs.
        #[arg(long)]
        concurrency: Option<usize>,
        /// Connections of the channel Tessera's callers share (default 16).
        #[arg(long)]
        connections: Option<usize>,
        /// Only these calls (`fetch`, `health`; comma-separated).
        #[arg(long, value_delimiter = ',')]
        calls: Vec<tessera_benches::rpc::Call>,
        /// Only these ways (`floor`, `tessera-tcp`, `tessera-rdma-soft`,
        /// `grpc`; comma-separated), for example to profile one.
        #[arg(long, value_delimiter = ',')]
        ways: Vec<tessera_benches::rpc::Way>,
    },
    /// Rankers over a local cluster, tcp vs rdma-soft at matched load (the
    /// paper's Tables 5 and 6).
    PsInference {
        #[command(flatten)]
        args: PsArgs,
    },
    /// Trainers over a local cluster, tcp vs rdma-soft at matched load
    /// (the paper's Table 7).
    PsTraining {
        #[command(flatten)]
        args: PsArgs,
    },
    /// One (table, shard)'s row store as it grows: bytes per row, Fetch
    /// and Push, growth stalls, snapshots under Pushes; the slab store
    /// beside the one before it.
    Store {
        /// A short smoke run.
        #[arg(long)]
        quick: bool,
        /// Write `store.json` and `store.md` into this directory.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Rows per level.
        #[arg(long, value_delimiter = ',')]
        rows: Vec<u64>,
        /// Only these tables (`sgd`, `adagrad`, `adam`).
        #[arg(long, value_delimiter = ',')]
        optimizers: Vec<String>,
    },
    /// One (store, table) of `store`, in this process.
    #[command(hide = true)]
    StoreChild {
        /// `sgd`, `adagrad` or `adam`.
        #[arg(long)]
        optimizer: String,
        /// Values per row.
        #[arg(long)]
        dim: usize,
        /// `f32`, `f16` or `bf16`.
        #[arg(long)]
        storage: String,
        /// Rows per level.
        #[arg(long, value_delimiter = ',')]
        rows: Vec<u64>,
        /// Seconds per measurement.
        #[arg(long)]
        level_secs: f64,
        /// Seconds of quiet Pushes before the snapshots.
        #[arg(long)]
        quiet_secs: f64,
        /// The store before the slab store.
        #[arg(long)]
        old: bool,
        /// Measure snapshots under Pushes at the largest level.
        #[arg(long)]
        snapshots: bool,
    },
    /// Feature admission and expiry over a drifting Zipf id stream: rows,
    /// memory and hit share against an unlimited table and a row limit,
    /// and Fetch latency beside the expiry sweep (issue 37).
    Admission {
        /// A short smoke run.
        #[arg(long)]
        quick: bool,
        /// Write `admission.json` and `admission.md` into this directory.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Pushes (default 4000, quick 200).
        #[arg(long)]
        pushes: Option<u64>,
    },
    /// How a ps-server's latency and memory grow with keys per Fetch, rows
    /// per shard and client connections (log axes).
    Scale {
        /// A short smoke run.
        #[arg(long)]
        quick: bool,
        /// Write `scale.json` and `scale.md` into this directory.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Keys per Fetch to sweep.
        #[arg(long, value_delimiter = ',')]
        keys: Vec<usize>,
        /// Rows per shard to sweep.
        #[arg(long, value_delimiter = ',')]
        rows: Vec<u64>,
        /// Client connections to sweep.
        #[arg(long, value_delimiter = ',')]
        connections: Vec<usize>,
    },
    /// The ps-server child of `rpc` and `scale`.
    #[command(hide = true)]
    RpcPsServer {
        /// `tcp` or `rdma` (soft provider).
        kind: tessera_rpc::TransportKind,
        /// Values per row of table `emb`.
        #[arg(long, default_value_t = tessera_benches::rpc::DIM)]
        dim: u32,
    },
    /// The bare TCP echo child of `rpc` (the floor).
    #[command(hide = true)]
    RpcFloorServer,
}

/// `given` on the command line, or `default` when none was.
fn given_or<T: Clone>(given: Vec<T>, default: &[T]) -> Vec<T> {
    match given.is_empty() {
        true => default.to_vec(),
        false => given,
    }
}

/// What the parameter-server benchmarks share.
#[derive(Debug, Clone, clap::Args)]
struct PsArgs {
    /// A short smoke run.
    #[arg(long)]
    quick: bool,
    /// Write `<bench>.json` and `<bench>.md` here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Seconds per measurement (default 8, quick 1).
    #[arg(long)]
    secs: Option<f64>,
    /// Offered loads as fractions of the lower saturation rate.
    #[arg(long, value_delimiter = ',')]
    fractions: Vec<f64>,
    /// Offered loads in iterations per second, instead of fractions: to
    /// compare two builds at the same rate (worker CPU per iteration).
    #[arg(long, value_delimiter = ',', conflicts_with = "fractions")]
    rates: Vec<f64>,
    /// What drives rdma-soft's completion queues: event, busy or runtime
    /// (default: the transport's).
    #[arg(long)]
    polling: Option<String>,
    /// rdma-soft's `small_message_limit` in bytes (default: the
    /// transport's).
    #[arg(long)]
    small_message_limit: Option<usize>,
}

impl PsArgs {
    fn run(&self, workload: tessera_benches::ps::Workload) -> Result<(), BoxError> {
        let defaults = tessera_benches::ps::Plan::new(self.quick);
        let plan = tessera_benches::ps::Plan {
            secs: self.secs.unwrap_or(defaults.secs),
            fractions: match self.fractions.is_empty() {
                true => defaults.fractions.clone(),
                false => self.fractions.clone(),
            },
            rates: self.rates.clone(),
            polling: self.polling.as_deref().map(parse_polling).transpose()?,
            small_message_limit: self.small_message_limit,
            ..defaults
        };
        let meta = tessera_benches::report::Meta::collect(workload.bench());
        let runtime = tokio::runtime::Runtime::new()?;
        let (rows, table) = runtime
            .block_on(tessera_benches::ps::run(workload, &plan, &meta))
            .map_err(|e| e.to_string())?;
        report(&meta, self.out.as_deref(), &rows, &table)
    }
}

/// What the engine benchmarks share.
#[derive(Debug, Clone, clap::Args)]
struct EngineBenchArgs {
    /// A short smoke run.
    #[arg(long)]
    quick: bool,
    /// Write `<bench>.json` (a result object) and `<bench>.md` here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Seconds per measurement (default 2, quick 0.3).
    #[arg(long)]
    secs: Option<f64>,
    /// Round trips per latency measurement (hol; default 3000, quick 100).
    #[arg(long)]
    iterations: Option<u32>,
    #[command(flatten)]
    tuning: TuningArgs,
}

impl EngineBenchArgs {
    fn secs(&self) -> f64 {
        self.secs.unwrap_or(if self.quick { 0.3 } else { 2.0 })
    }

    fn iterations(&self) -> u32 {
        self.iterations
            .unwrap_or(if self.quick { 100 } else { 3000 })
    }
}

fn run_engine_bench(
    common: &EngineBenchArgs,
    bench: &str,
    future: impl std::future::Future<
        Output = Result<Vec<serde_json::Value>, tessera_benches::transport::BoxError>,
    >,
    title: String,
    columns: &[&str],
) -> Result<(), BoxError> {
    let meta = tessera_benches::report::Meta::collect(bench);
    let runtime = tokio::runtime::Runtime::new()?;
    let rows = runtime.block_on(future).map_err(|e| e.to_string())?;
    let table = tessera_benches::engine::markdown(&title, &rows, columns);
    report(&meta, common.out.as_deref(), &rows, &table)
}

/// I/O thread settings of the RDMA side of a benchmark.
#[derive(Debug, Clone, clap::Args)]
struct TuningArgs {
    /// What drives the RDMA completion queues: `event` or `busy` I/O
    /// threads, or the `runtime`.
    #[arg(long, default_value = "busy")]
    polling: String,
    /// Spin budget of event polling, microseconds.
    #[arg(long, default_value_t = 50)]
    spin_us: u64,
    /// RDMA I/O threads per process.
    #[arg(long, default_value_t = 1)]
    io_threads: usize,
    /// The soft devices' link rate, Mbit/s each way (0: unlimited;
    /// `rails` takes 1,000 then).
    #[arg(long, default_value_t = 0)]
    link_mbps: u64,
}

impl TuningArgs {
    fn tuning(&self) -> Result<transport::Tuning, BoxError> {
        let polling = parse_polling(&self.polling)?;
        Ok(transport::Tuning {
            polling,
            spin_us: self.spin_us,
            io_threads: self.io_threads.max(1),
            link_mbps: self.link_mbps,
        })
    }
}

type BoxError = tessera_benches::transport::BoxError;

/// `--polling`'s value.
fn parse_polling(value: &str) -> Result<tessera_transport::Polling, BoxError> {
    match value {
        "busy" => Ok(tessera_transport::Polling::Busy),
        "event" => Ok(tessera_transport::Polling::Event),
        "runtime" => Ok(tessera_transport::Polling::Runtime),
        other => Err(format!("--polling {other}: allowed: event, busy, runtime").into()),
    }
}

/// Prints `table` and, with `out`, writes the result there.
fn report(
    meta: &tessera_benches::report::Meta,
    out: Option<&std::path::Path>,
    rows: &[serde_json::Value],
    table: &str,
) -> Result<(), BoxError> {
    tessera_benches::report::emit(meta, out, rows, table).map_err(|e| e.to_string().into())
}

fn main() -> Result<(), BoxError> {
    tessera_rpc::observe::init_logging("warn");
    let cli = Cli::parse();
    if tessera_config::parse_only() {
        return Ok(());
    }
    match cli.command {
        Command::All { quick, out, only } => {
            tessera_benches::all::run(quick, &out, &only).map_err(|e| e.to_string().into())
        }
        Command::Alloc {
            quick,
            out,
            threads,
            repeat,
        } => tessera_benches::alloc::compare(
            quick,
            out,
            &threads,
            repeat.unwrap_or(if quick { 1 } else { 3 }),
        )
        .map_err(|e| e.to_string().into()),
        Command::AllocChild { system, args } => {
            tessera_benches::alloc::child(&system, &args).map_err(|e| e.to_string().into())
        }
        Command::Transport {
            quick,
            out,
            iterations,
            sizes,
            throughput_secs,
            concurrency,
            fragment_sizes,
            tuning,
        } => {
            let plan = transport::Plan {
                tuning: tuning.tuning()?,
                iterations: iterations.unwrap_or(if quick { 200 } else { 5000 }),
                sizes,
                throughput_secs: throughput_secs.unwrap_or(if quick { 0.5 } else { 3.0 }),
                throughput_size: 1 << 20,
                concurrency,
                fragment_sizes,
            };
            let meta = tessera_benches::report::Meta::collect("transport");
            let runtime = tokio::runtime::Runtime::new()?;
            let rows = runtime
                .block_on(transport::run(&plan))
                .map_err(|e| e.to_string())?;
            let table = transport::markdown(&rows, &plan);
            let rows = rows
                .iter()
                .map(serde_json::to_value)
                .collect::<Result<Vec<_>, _>>()?;
            report(&meta, out.as_deref(), &rows, &table)
        }
        Command::Fragment { common, sizes } => {
            let tuning = common.tuning.tuning()?;
            let secs = common.secs();
            run_engine_bench(
                &common,
                "fragment",
                tessera_benches::engine::fragment(&sizes, secs, &tuning),
                format!(
                    "fragment: 1 MiB messages, 8 outstanding, {secs} s per size, rdma-soft between two processes"
                ),
                &["fragment_bytes", "gbytes_per_sec", "p50_us", "p99_us"],
            )
        }
        Command::Hol { common, large } => {
            let tuning = common.tuning.tuning()?;
            let iterations = common.iterations();
            run_engine_bench(
                &common,
                "hol",
                tessera_benches::engine::hol(&large, iterations, &tuning),
                format!(
                    "hol: 512 B round trips ({iterations}) on a QP shared with N flows of 1 MiB messages (4 outstanding each); fragmentation = 64 KiB fragments, none = one WRITE per message"
                ),
                &[
                    "fragmentation",
                    "large_flows",
                    "qps_open",
                    "p50_us",
                    "p99_us",
                    "mean_us",
                ],
            )
        }
        Command::Rails {
            common,
            counts,
            sockets,
            rounds,
        } => {
            let tuning = common.tuning.tuning()?;
            // Each soft device's link rate (`--link-mbps`): 1,000 Mbit/s
            // unless given, so that the rails, not the CPU, set the rate.
            let link_mbps = match tuning.link_mbps {
                0 => 1000,
                given => given,
            };
            let secs = common.secs();
            let rounds = if common.quick { 1 } else { rounds };
            run_engine_bench(
                &common,
                "rails",
                tessera_benches::rails::rails(&counts, link_mbps, sockets, secs, rounds, &tuning),
                format!(
                    "rails: 1 MiB messages into a sink, soft devices at {link_mbps} Mbit/s each on both sides; spread = {sockets} connections (each on the least-used rail, confinement on: no striping), striped = 1 connection, confinement off, its messages striped over the rails; {secs} s per measurement, median of {rounds} interleaved rounds, client and server in one process"
                ),
                &[
                    "layout",
                    "rails",
                    "mbytes_per_sec",
                    "runs_mbytes_per_sec",
                    "of_the_links",
                    "x_one_rail",
                    "rail_shares",
                    "target",
                ],
            )
        }
        Command::Incast {
            common,
            senders,
            windows,
        } => {
            let tuning = common.tuning.tuning()?;
            let secs = common.secs();
            run_engine_bench(
                &common,
                "incast",
                tessera_benches::engine::incast(senders, &windows, secs, &tuning),
                format!(
                    "incast: {senders} senders (own engine each) -> 1 receiver, 20-50 KiB messages, 4 outstanding per sender, {secs} s; peak in flight = sum of the senders' peaks"
                ),
                &[
                    "senders",
                    "window_bytes",
                    "goodput_gbytes_per_sec",
                    "p50_us",
                    "p99_us",
                    "peak_inflight_bytes",
                    "bound_bytes",
                    "peak_inflight_per_sender_max",
                ],
            )
        }
        Command::Fabric {
            quick,
            out,
            seed,
            max_servers,
            only,
        } => {
            let meta = tessera_benches::report::Meta::collect("fabric");
            let mut plan = tessera_benches::fabric::Plan::new(quick, seed);
            if let Some(max) = max_servers {
                plan.max_servers = max.max(1);
            }
            plan.only(&only)?;
            let rows = tessera_benches::fabric::run_plan(&plan)?;
            let table = tessera_benches::fabric::markdown(&plan, &rows);
            report(&meta, out.as_deref(), &rows, &table)
        }
        Command::Qps { common, qps } => {
            let tuning = common.tuning.tuning()?;
            let secs = common.secs();
            run_engine_bench(
                &common,
                "qps",
                tessera_benches::engine::qps(&qps, secs, &tuning),
                format!(
                    "qps: 512 B messages, 4 outstanding per QP, {secs} s per point, {} I/O threads per process",
                    tuning.io_threads
                ),
                &["qps", "qps_open", "msgs_per_sec"],
            )
        }
        Command::TransportServer { kind, tuning } => {
            let kind = transport::Kind::parse(&kind).map_err(|e| e.to_string())?;
            let tuning = tuning.tuning()?;
            let runtime = tokio::runtime::Runtime::new()?;
            runtime
                .block_on(transport::serve(kind, &tuning))
                .map_err(|e| e.to_string().into())
        }
        Command::Replication {
            pushes,
            blocks,
            quick,
            out,
        } => {
            let meta = tessera_benches::report::Meta::collect("replication");
            let (pushes, blocks) = match quick {
                true => (pushes.min(400), blocks.min(4)),
                false => (pushes, blocks),
            };
            let runtime = tokio::runtime::Runtime::new()?;
            let (rows, table) = runtime.block_on(tessera_benches::replication::run(
                pushes.max(1),
                blocks.max(1),
            ))?;
            report(&meta, out.as_deref(), &rows, &table)
        }
        Command::Recovery {
            calls,
            rounds,
            probe_ms,
            quick,
            out,
        } => {
            let meta = tessera_benches::report::Meta::collect("recovery");
            let (calls, rounds) = match quick {
                true => (calls.min(2000), rounds.min(1)),
                false => (calls, rounds),
            };
            let runtime = tokio::runtime::Runtime::new()?;
            let (rows, table) = runtime.block_on(tessera_benches::recovery::run(
                calls,
                rounds.max(1),
                Duration::from_millis(probe_ms.max(1)),
            ))?;
            report(&meta, out.as_deref(), &rows, &table)
        }
        Command::RpcServer { kind, listen } => {
            let runtime = tokio::runtime::Runtime::new()?;
            runtime.block_on(tessera_benches::recovery::child_server(kind, &listen))
        }
        Command::Rpc {
            quick,
            out,
            iterations,
            throughput_secs,
            concurrency,
            connections,
            calls,
            ways,
        } => {
            let defaults = tessera_benches::rpc::Plan::new(quick);
            let plan = tessera_benches::rpc::Plan {
                iterations: iterations.unwrap_or(defaults.iterations),
                throughput_secs: throughput_secs.unwrap_or(defaults.throughput_secs),
                concurrency: concurrency.unwrap_or(defaults.concurrency),
                connections: connections.unwrap_or(defaults.connections),
                calls: given_or(calls, &defaults.calls),
                ways: given_or(ways, &defaults.ways),
                ..defaults
            };
            let meta = tessera_benches::report::Meta::collect("rpc");
            let runtime = tokio::runtime::Runtime::new()?;
            let (rows, table) = runtime
                .block_on(tessera_benches::rpc::run(&plan, &meta))
                .map_err(|e| e.to_string())?;
            #[allow(clippy::print_stdout)]
            {
                print!("{table}");
            }
            if let Some(dir) = out {
                tessera_benches::report::write(&dir, &meta, &rows, &table)?;
            }
            Ok(())
        }
        Command::PsInference { args } => args.run(tessera_benches::ps::Workload::Inference),
        Command::PsTraining { args } => args.run(tessera_benches::ps::Workload::Training),
        Command::Store {
            quick,
            out,
            rows,
            optimizers,
        } => {
            let defaults = tessera_benches::store::Plan::new(quick);
            let plan = tessera_benches::store::Plan {
                rows: given_or(rows, &defaults.rows),
                ..defaults
            };
            // A smoke run measures SGD alone (both storages, both stores).
            let chosen = |t: &tessera_benches::store::TableKind| match optimizers.is_empty() {
                true => !quick || t.optimizer == "sgd",
                false => optimizers.iter().any(|o| o == t.optimizer),
            };
            let tables: Vec<_> = tessera_benches::store::TABLES
                .iter()
                .filter(|t| chosen(t))
                .copied()
                .collect();
            let meta = tessera_benches::report::Meta::collect("store");
            let (rows, table) = tessera_benches::store::run(&plan, &tables)?;
            report(&meta, out.as_deref(), &rows, &table)
        }
        Command::StoreChild {
            optimizer,
            dim,
            storage,
            rows,
            level_secs,
            quiet_secs,
            old,
            snapshots,
        } => {
            let storage = match storage.as_str() {
                "f16" => tessera_ps_server::table::Storage::F16,
                "bf16" => tessera_ps_server::table::Storage::Bf16,
                _ => tessera_ps_server::table::Storage::F32,
            };
            let kind = tessera_benches::store::TABLES
                .iter()
                .find(|t| t.optimizer == optimizer && t.dim == dim)
                .map(|t| tessera_benches::store::TableKind { storage, ..*t })
                .ok_or_else(|| format!("no table {optimizer} dim {dim}"))?;
            let plan = tessera_benches::store::Plan {
                rows,
                level_secs,
                quiet_secs,
            };
            // One JSON object per line, for the parent (`store`).
            #[allow(clippy::print_stdout)]
            for row in tessera_benches::store::child(kind, old, &plan, snapshots)? {
                println!("{row}");
            }
            Ok(())
        }
        Command::Admission { quick, out, pushes } => {
            let defaults = tessera_benches::admission::Plan::new(quick);
            let plan = tessera_benches::admission::Plan {
                pushes: pushes.unwrap_or(defaults.pushes),
                ..defaults
            };
            let meta = tessera_benches::report::Meta::collect("admission");
            let (rows, table) = tessera_benches::admission::run(&plan)?;
            report(&meta, out.as_deref(), &rows, &table)
        }
        Command::Scale {
            quick,
            out,
            keys,
            rows,
            connections,
        } => {
            let defaults = tessera_benches::scale::Plan::new(quick);
            let plan = tessera_benches::scale::Plan {
                keys: given_or(keys, &defaults.keys),
                rows: given_or(rows, &defaults.rows),
                connections: given_or(connections, &defaults.connections),
                ..defaults
            };
            let meta = tessera_benches::report::Meta::collect("scale");
            let runtime = tokio::runtime::Runtime::new()?;
            let (rows, table) = runtime
                .block_on(tessera_benches::scale::run(&plan, &meta))
                .map_err(|e| e.to_string())?;
            report(&meta, out.as_deref(), &rows, &table)
        }
        Command::RpcPsServer { kind, dim } => tokio::runtime::Runtime::new()?
            .block_on(tessera_benches::rpc::ps_server_child(kind, dim))
            .map_err(|e| e.to_string().into()),
        Command::RpcFloorServer => tokio::runtime::Runtime::new()?
            .block_on(tessera_benches::rpc::floor_server_child())
            .map_err(|e| e.to_string().into()),
    }
}
