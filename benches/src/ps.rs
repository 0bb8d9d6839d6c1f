//! `tessera-bench ps-inference` and `ps-training`: the paper's parameter
//! server tables (§8, Tables 5-7) on one host, tcp against rdma-soft at
//! matched offered load.
//!
//! Each run starts a local cluster (`tessera_deploy::Cluster`: 2 shards x
//! 2 replica groups of `ps-server` processes) over one transport and runs
//! the `worker` binary's `ranker` (inference) or `trainer` (training) in a
//! process of its own, so that the worker's CPU time and the servers' are
//! each their own processes':
//!
//! 1. **Saturation**, a closed loop per transport: the most iterations per
//!    second each sustains.
//! 2. **Matched load**, an open loop (`worker --rate`) at the same offered
//!    rates for both transports, fractions of the lower saturation, so
//!    that latency and CPU are compared doing the same work. Latency counts
//!    from when an iteration was due.
//!
//! Reported per run: Fetch latency (mean, p50, p99, p999: a ranker's whole
//! user request of several Fetches, a trainer step's Fetch), Push p99
//! (training), and CPU seconds per thousand iterations, user and system
//! apart, and context switches per iteration (every thread's, voluntary
//! and not: how often the work crossed threads or waited), of the worker
//! and of all servers together; each rdma-soft row
//! also as ratios to the tcp row of the same offered load. The paper's
//! production figures, for reference: -35.7% mean and -43.7% p99 Fetch
//! latency, -10.69% CPU, -74% p99 Push latency.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use tessera_deploy::{Cluster, ClusterConfig};
use tessera_rpc::TransportKind;

use crate::report::Meta;
use crate::transport::BoxError;

/// Which of the two.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Workload {
    /// Rankers: user requests of several concurrent Fetches.
    Inference,
    /// Trainers: Fetch, gradient, Push.
    Training,
}

impl Workload {
    /// The benchmark's name.
    pub fn bench(self) -> &'static str {
        match self {
            Workload::Inference => "ps-inference",
            Workload::Training => "ps-training",
        }
    }

    fn worker_command(self) -> &'static str {
        match self {
            Workload::Inference => "ranker",
            Workload::Training => "trainer",
        }
    }
}

/// What a run measures.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Seconds of each measurement.
    pub secs: f64,
    /// Offered loads, as fractions of the lower saturation rate.
    pub fractions: Vec<f64>,
    /// Offered loads in iterations per second; when not empty, used
    /// instead of `fractions`.
    pub rates: Vec<f64>,
    /// Iterations outstanding in the closed loop (saturation).
    pub closed_concurrency: usize,
    /// Most iterations outstanding in the open loop.
    pub open_concurrency: usize,
    /// What drives the rdma-soft rows' completion queues (servers and
    /// worker alike); `None`: the transport's default.
    pub polling: Option<tessera_transport::Polling>,
    /// `rdma.small_message_limit` of the rdma-soft rows (messages above it
    /// go by request-to-send and WRITE, a round trip more); `None`: the
    /// transport's default.
    pub small_message_limit: Option<usize>,
}

impl Plan {
    /// The full run, or a smoke run.
    pub fn new(quick: bool) -> Self {
        match quick {
            false => Self {
                secs: 8.0,
                fractions: vec![0.25, 0.5, 0.75],
                rates: Vec::new(),
                closed_concurrency: 8,
                open_concurrency: 64,
                polling: None,
                small_message_limit: None,
            },
            true => Self {
                secs: 1.0,
                fractions: vec![0.5],
                rates: Vec::new(),
                closed_concurrency: 8,
                open_concurrency: 32,
                polling: None,
                small_message_limit: None,
            },
        }
    }
}

const TRANSPORTS: [(&str, TransportKind); 2] = [
    ("tcp", TransportKind::Tcp),
    ("rdma-soft", TransportKind::Rdma),
];

/// A binary of the workspace next to this one (`TESSERA_<NAME>_BIN`
/// overrides).
fn sibling(name: &str) -> Result<PathBuf, BoxError> {
    let var = format!("TESSERA_{}_BIN", name.to_uppercase().replace('-', "_"));
    if let Some(path) = std::env::var_os(&var) {
        return Ok(PathBuf::from(path));
    }
    let path = std::env::current_exe()?.with_file_name(name);
    match path.exists() {
        true => Ok(path),
        false => Err(format!(
            "{} not found (build it: cargo build --release --bin {name}, or set {var})",
            path.display()
        )
        .into()),
    }
}

/// User and system CPU seconds of `pid` so far (`/proc/<pid>/stat`).
fn cpu_secs(pid: u32) -> (f64, f64) {
    let tick = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .filter(|&t| t > 0)
        .unwrap_or(100) as f64;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces) in parens:
    // state is the 3rd field, utime the 14th, stime the 15th.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let at = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (at(11) / tick, at(12) / tick)
}

/// Context switches of every thread of `pid` so far (voluntary and not,
/// `/proc/<pid>/task/*/status`).
fn context_switches(pid: u32) -> f64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0.0;
    };
    tasks
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("status")).ok())
        .flat_map(|status| {
            status
                .lines()
                .filter_map(|l| {
                    l.strip_prefix("voluntary_ctxt_switches:")
                        .or_else(|| l.strip_prefix("nonvoluntary_ctxt_switches:"))
                })
                .filter_map(|v| v.trim().parse::<f64>().ok())
                .collect::<Vec<_>>()
        })
        .sum()
}

/// User and system CPU seconds, and context switches, of every server.
fn servers_usage(cluster: &Cluster) -> (f64, f64, f64) {
    cluster
        .servers()
        .iter()
        .filter_map(|s| s.pid())
        .map(|pid| {
            let (user, system) = cpu_secs(pid);
            (user, system, context_switches(pid))
        })
        .fold((0.0, 0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1, a.2 + b.2))
}

/// One measurement: the worker's report, and the servers' CPU and
/// context switches over it.
struct Measured {
    report: Value,
    servers_user: f64,
    servers_system: f64,
    servers_switches: f64,
}

/// Runs the worker once against `cluster`.
async fn measure(
    cluster: &Cluster,
    workload: Workload,
    secs: f64,
    concurrency: usize,
    rate: Option<f64>,
    scratch: &Path,
) -> Result<Measured, BoxError> {
    let json = scratch.join("report.json");
    let _ = std::fs::remove_file(&json);
    let before = servers_usage(cluster);
    let mut command = tokio::process::Command::new(sibling("worker")?);
    command
        .arg("--config")
        .arg(cluster.run_dir().join("worker.toml"))
        .arg("--json")
        .arg(&json)
        .args(["--duration-secs", &secs.to_string()])
        .args(["--concurrency", &concurrency.to_string()])
        .args(["--rate", &rate.unwrap_or(0.0).to_string()])
        .arg(workload.worker_command())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let output = command.output().await?;
    let after = servers_usage(cluster);
    if !output.status.success() {
        return Err(format!(
            "worker {} failed: {}",
            workload.worker_command(),
            String::from_utf8_lossy(&output.stderr)
        )
        .into());
    }
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&json)?)?;
    if report["errors"].as_u64().unwrap_or(1) > 0 {
        return Err(format!("the worker saw errors: {}", report["first_error"]).into());
    }
    Ok(Measured {
        report,
        servers_user: after.0 - before.0,
        servers_system: after.1 - before.1,
        servers_switches: after.2 - before.2,
    })
}

/// A cluster over `transport`, in a directory of `scratch`.
async fn start(
    transport: TransportKind,
    scratch: &Path,
    polling: Option<tessera_transport::Polling>,
    small_message_limit: Option<usize>,
) -> Result<Cluster, BoxError> {
    let mut rdma = tessera_transport::TransportConfig::soft_rdma().rdma;
    if let Some(polling) = polling {
        rdma.polling = polling;
    }
    if let Some(limit) = small_message_limit {
        rdma.small_message_limit = limit;
    }
    let config = ClusterConfig {
        transport,
        rdma,
        ps_server_bin: Some(sibling("ps-server")?),
        ..ClusterConfig::default()
    };
    let dir = scratch.join(format!("cluster-{transport}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    Ok(Cluster::start(&config, &dir).await?)
}

fn row(
    workload: Workload,
    transport: &str,
    load: &str,
    offered: Option<f64>,
    m: &Measured,
) -> Value {
    let r = &m.report;
    let iterations = r["iterations"].as_f64().unwrap_or(0.0).max(1.0);
    let per_1k = |secs: f64| secs * 1000.0 / iterations;
    let us = |v: &Value| v.as_f64().unwrap_or(0.0);
    json!({
        "bench": workload.bench(),
        "transport": transport,
        "load": load,
        "offered_per_s": offered,
        "achieved_per_s": iterations / us(&r["elapsed"]).max(1e-9),
        "iterations": r["iterations"],
        "fetch_mean_us": us(&r["fetch"]["mean_us"]),
        "fetch_p50_us": us(&r["fetch"]["p50_us"]),
        "fetch_p99_us": us(&r["fetch"]["p99_us"]),
        "fetch_p999_us": us(&r["fetch"]["p999_us"]),
        "push_p99_us": r["push"]["p99_us"].as_f64(),
        "worker_cpu_user_s_per_1k": us(&r["cpu_user_us_per_iteration"]) / 1000.0,
        "worker_cpu_system_s_per_1k": us(&r["cpu_system_us_per_iteration"]) / 1000.0,
        "servers_cpu_user_s_per_1k": per_1k(m.servers_user),
        "servers_cpu_system_s_per_1k": per_1k(m.servers_system),
        "worker_switches_per_iteration": us(&r["context_switches_per_iteration"]),
        "servers_switches_per_iteration": m.servers_switches / iterations,
    })
}

/// Runs `workload` with `plan`: its rows and table.
pub async fn run(
    workload: Workload,
    plan: &Plan,
    meta: &Meta,
) -> Result<(Vec<Value>, String), BoxError> {
    let scratch = tempfile::Builder::new()
        .prefix("tessera-bench-ps-")
        .tempdir()?;
    let mut rows = Vec::new();
    // Saturation, each transport on a cluster of its own.
    let mut saturation = Vec::new();
    for (label, kind) in TRANSPORTS {
        let cluster = start(kind, scratch.path(), plan.polling, plan.small_message_limit).await?;
        let m = measure(
            &cluster,
            workload,
            plan.secs,
            plan.closed_concurrency,
            None,
            scratch.path(),
        )
        .await;
        cluster.stop().await?;
        let m = m?;
        let r = row(workload, label, "saturation (closed loop)", None, &m);
        saturation.push(r["achieved_per_s"].as_f64().unwrap_or(0.0));
        rows.push(r);
    }
    let lowest = saturation.iter().copied().fold(f64::INFINITY, f64::min);
    let rates: Vec<f64> = match plan.rates.is_empty() {
        true => plan
            .fractions
            .iter()
            .map(|f| (f * lowest).max(1.0).round())
            .collect(),
        false => plan.rates.iter().map(|r| r.max(1.0).round()).collect(),
    };
    for (label, kind) in TRANSPORTS {
        let cluster = start(kind, scratch.path(), plan.polling, plan.small_message_limit).await?;
        let mut outcome = Ok(());
        for &rate in &rates {
            match measure(
                &cluster,
                workload,
                plan.secs,
                plan.open_concurrency,
                Some(rate),
                scratch.path(),
            )
            .await
            {
                Ok(m) => rows.push(row(workload, label, "matched (open loop)", Some(rate), &m)),
                Err(err) => {
                    outcome = Err(err);
                    break;
                }
            }
        }
        cluster.stop().await?;
        outcome?;
    }
    add_ratios(&mut rows);
    let table = markdown(workload, plan, meta, &rows);
    Ok((rows, table))
}

/// Each rdma-soft row's figures as ratios to the tcp row of the same load.
fn add_ratios(rows: &mut [Value]) {
    let tcp: Vec<Value> = rows
        .iter()
        .filter(|r| r["transport"] == "tcp")
        .cloned()
        .collect();
    for row in rows.iter_mut().filter(|r| r["transport"] != "tcp") {
        let Some(base) = tcp
            .iter()
            .find(|t| t["load"] == row["load"] && t["offered_per_s"] == row["offered_per_s"])
        else {
            continue;
        };
        let ratio = |key: &str| {
            let (a, b) = (row[key].as_f64(), base[key].as_f64());
            match (a, b) {
                (Some(a), Some(b)) if b > 0.0 => json!(a / b),
                _ => Value::Null,
            }
        };
        let cpu = |r: &Value, who: &str| {
            r[format!("{who}_cpu_user_s_per_1k")]
                .as_f64()
                .unwrap_or(0.0)
                + r[format!("{who}_cpu_system_s_per_1k")]
                    .as_f64()
                    .unwrap_or(0.0)
        };
        let ratios = json!({
            "fetch_mean_vs_tcp": ratio("fetch_mean_us"),
            "fetch_p99_vs_tcp": ratio("fetch_p99_us"),
            "push_p99_vs_tcp": ratio("push_p99_us"),
            "achieved_vs_tcp": ratio("achieved_per_s"),
            "worker_cpu_vs_tcp": cpu(row, "worker") / cpu(base, "worker").max(1e-12),
            "servers_cpu_vs_tcp": cpu(row, "servers") / cpu(base, "servers").max(1e-12),
            "worker_switches_vs_tcp": ratio("worker_switches_per_iteration"),
            "servers_switches_vs_tcp": ratio("servers_switches_per_iteration"),
        });
        if let (Some(row), Some(ratios)) = (row.as_object_mut(), ratios.as_object()) {
            row.extend(ratios.clone());
        }
    }
}

fn markdown(workload: Workload, plan: &Plan, meta: &Meta, rows: &[Value]) -> String {
    let what = match workload {
        Workload::Inference => {
            "rankers: a user request is 4 concurrent Fetches (one per model, each split over the shards), responses 1 KiB-1 MiB log-uniform; latency is the whole request's"
        }
        Workload::Training => {
            "trainers: a step is Fetch, gradient, Push, messages log-normal (mean 20 KiB, p99 50 KiB); latency is the step's Fetch, and its Push"
        }
    };
    let offered = match plan.rates.is_empty() {
        true => format!("{:?} of the lower saturation", plan.fractions),
        false => format!("{:?} per second", plan.rates),
    };
    let mut out = format!(
        "## {}: 2 shards x 2 replica groups, {what}\n\n{}\n\n{} s per measurement; saturation with {} outstanding (closed loop), then the same offered rates for both transports ({offered}, at most {} outstanding, latency from when each was due). CPU: seconds per 1,000 iterations.\n\n",
        workload.bench(),
        meta.machine_line(),
        plan.secs,
        plan.closed_concurrency,
        plan.open_concurrency,
    );
    out.push_str("| transport | load | offered/s | achieved/s | Fetch mean ms | p50 ms | p99 ms | p999 ms | Push p99 ms | worker CPU user / sys s | servers CPU user / sys s | switches per iteration, worker / servers | mean vs tcp | p99 vs tcp | Push p99 vs tcp | worker CPU vs tcp | switches vs tcp, worker / servers |\n");
    out.push_str(
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let f = |r: &Value, k: &str| r[k].as_f64();
    let ms = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{:.2}", v / 1000.0));
    let x = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.2}"));
    for r in rows {
        out.push_str(&format!(
            "| {} | {} | {} | {:.0} | {} | {} | {} | {} | {} | {:.3} / {:.3} | {:.3} / {:.3} | {:.1} / {:.1} | {} | {} | {} | {} | {} / {} |\n",
            r["transport"].as_str().unwrap_or(""),
            r["load"].as_str().unwrap_or(""),
            f(r, "offered_per_s").map_or("-".to_owned(), |v| format!("{v:.0}")),
            f(r, "achieved_per_s").unwrap_or(0.0),
            ms(f(r, "fetch_mean_us")),
            ms(f(r, "fetch_p50_us")),
            ms(f(r, "fetch_p99_us")),
            ms(f(r, "fetch_p999_us")),
            ms(f(r, "push_p99_us")),
            f(r, "worker_cpu_user_s_per_1k").unwrap_or(0.0),
            f(r, "worker_cpu_system_s_per_1k").unwrap_or(0.0),
            f(r, "servers_cpu_user_s_per_1k").unwrap_or(0.0),
            f(r, "servers_cpu_system_s_per_1k").unwrap_or(0.0),
            f(r, "worker_switches_per_iteration").unwrap_or(0.0),
            f(r, "servers_switches_per_iteration").unwrap_or(0.0),
            x(f(r, "fetch_mean_vs_tcp")),
            x(f(r, "fetch_p99_vs_tcp")),
            x(f(r, "push_p99_vs_tcp")),
            x(f(r, "worker_cpu_vs_tcp")),
            x(f(r, "worker_switches_vs_tcp")),
            x(f(r, "servers_switches_vs_tcp")),
        ));
    }
    out
}
