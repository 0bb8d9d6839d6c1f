//! `tessera-bench all`: every benchmark in one run, with one report.
//!
//! Each benchmark runs as a child process of its own (`tessera-bench
//! <name> [--quick] --out DIR`, its output kept in `DIR/<name>.log`) so
//! that none inherits another's threads, pools or memory. Each writes
//! `<name>.json` and `<name>.md`; then this draws the figures of each
//! result as PNGs and writes `REPORT.md`, which embeds them under the
//! benchmark's table. A benchmark that fails is reported as failed and the
//! others still run; the command then exits with an error.
//!
//! Every `<name>.json` follows `benches/result.schema.json` (checked by the
//! test suite on a `--quick` run).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use serde_json::Value;

use crate::plot::{Figure, draw};
use crate::report::Meta;
use crate::transport::BoxError;

/// One benchmark of the report.
#[derive(Debug)]
pub struct Bench {
    /// Its subcommand (and result name).
    pub name: &'static str,
    /// What it measures, one line.
    pub about: &'static str,
    /// Its figures.
    pub figures: &'static [Figure],
}

const fn figure(file: &'static str, title: &'static str) -> Figure {
    Figure {
        file,
        title,
        filter: &[],
        x: "",
        y: "",
        series: &[],
        x_label: "",
        y_label: "",
        x_log: false,
        y_log: false,
    }
}

/// Every benchmark, in the order they run.
pub const BENCHES: &[Bench] = &[
    Bench {
        name: "rpc",
        about: "the ParameterServer service end to end: Tessera over tcp and rdma-soft against tonic gRPC and a bare TCP floor",
        figures: &[
            Figure {
                x: "way",
                y: "p50_us",
                series: &["call"],
                x_label: "way",
                y_label: "p50 latency, µs (log)",
                y_log: true,
                ..figure("rpc-latency.png", "rpc: p50 latency, one call outstanding")
            },
            Figure {
                x: "way",
                y: "calls_per_s",
                series: &["call"],
                x_label: "way",
                y_label: "calls per second (log)",
                y_log: true,
                ..figure("rpc-throughput.png", "rpc: throughput, many callers")
            },
        ],
    },
    Bench {
        name: "ps-inference",
        about: "rankers on a local cluster, tcp against rdma-soft at matched offered load (paper Tables 5, 6)",
        figures: &[
            Figure {
                filter: &[("load", "matched (open loop)")],
                x: "offered_per_s",
                y: "fetch_p99_us",
                series: &["transport"],
                x_label: "offered user requests per second",
                y_label: "request p99, µs",
                ..figure("ps-inference-p99.png", "ps-inference: p99 at matched load")
            },
            Figure {
                filter: &[("load", "matched (open loop)")],
                x: "offered_per_s",
                y: "worker_cpu_user_s_per_1k",
                series: &["transport"],
                x_label: "offered user requests per second",
                y_label: "worker user CPU s per 1,000 requests",
                ..figure(
                    "ps-inference-cpu.png",
                    "ps-inference: worker CPU at matched load",
                )
            },
        ],
    },
    Bench {
        name: "ps-training",
        about: "trainers on a local cluster, tcp against rdma-soft at matched offered load (paper Table 7)",
        figures: &[
            Figure {
                filter: &[("load", "matched (open loop)")],
                x: "offered_per_s",
                y: "worker_switches_per_iteration",
                series: &["transport"],
                x_label: "offered steps per second",
                y_label: "worker context switches per step",
                ..figure(
                    "ps-training-switches.png",
                    "ps-training: the worker's context switches per step",
                )
            },
            Figure {
                filter: &[("load", "matched (open loop)")],
                x: "offered_per_s",
                y: "push_p99_us",
                series: &["transport"],
                x_label: "offered steps per second",
                y_label: "Push p99, µs",
                ..figure(
                    "ps-training-push.png",
                    "ps-training: Push p99 at matched load",
                )
            },
            Figure {
                filter: &[("load", "matched (open loop)")],
                x: "offered_per_s",
                y: "fetch_p99_us",
                series: &["transport"],
                x_label: "offered steps per second",
                y_label: "Fetch p99, µs",
                ..figure(
                    "ps-training-fetch.png",
                    "ps-training: Fetch p99 at matched load",
                )
            },
        ],
    },
    Bench {
        name: "store",
        about: "one (table, shard)'s row store as it grows: bytes per row, Fetch, Push, growth stalls and snapshots under Pushes, the slab store beside the one before it",
        figures: &[
            Figure {
                filter: &[("section", "rows")],
                x: "rows",
                y: "x_payload",
                series: &["store", "table"],
                x_label: "rows (log)",
                y_label: "resident bytes per row / payload",
                x_log: true,
                ..figure(
                    "store-memory.png",
                    "store: bytes per row against the payload",
                )
            },
            Figure {
                filter: &[("section", "rows")],
                x: "rows",
                y: "fetch_p50_us",
                series: &["store", "table"],
                x_label: "rows (log)",
                y_label: "Fetch of 1,000 rows, p50 µs (log)",
                x_log: true,
                y_log: true,
                ..figure("store-fetch.png", "store: Fetch latency by rows")
            },
        ],
    },
    Bench {
        name: "scale",
        about: "a ps-server's Fetch latency and memory as keys per Fetch, rows per shard and client connections grow",
        figures: &[
            Figure {
                filter: &[("section", "keys")],
                x: "keys",
                y: "p50_us",
                series: &["transport"],
                x_label: "keys per Fetch (log)",
                y_label: "Fetch p50, µs (log)",
                x_log: true,
                y_log: true,
                ..figure("scale-keys.png", "scale: Fetch latency by keys per Fetch")
            },
            Figure {
                filter: &[("section", "rows")],
                x: "rows",
                y: "bytes_per_added_row",
                x_label: "rows per shard (log)",
                y_label: "server resident bytes per row added (log)",
                x_log: true,
                y_log: true,
                ..figure("scale-rows-memory.png", "scale: server memory per row")
            },
            Figure {
                filter: &[("section", "rows")],
                x: "rows",
                y: "p50_us",
                x_label: "rows per shard (log)",
                y_label: "Fetch of 1,000 keys, p50 µs (log)",
                x_log: true,
                y_log: true,
                ..figure(
                    "scale-rows-latency.png",
                    "scale: Fetch latency by rows per shard",
                )
            },
            Figure {
                filter: &[("section", "connections")],
                x: "connections",
                y: "active_p99_us",
                series: &["transport"],
                x_label: "client connections, all busy (log)",
                y_label: "Fetch p99, µs (log)",
                x_log: true,
                y_log: true,
                ..figure(
                    "scale-connections.png",
                    "scale: Fetch p99 by client connections",
                )
            },
            Figure {
                filter: &[("section", "connections")],
                x: "connections",
                y: "server_rss_mib",
                series: &["transport"],
                x_label: "client connections (log)",
                y_label: "server resident MiB (log)",
                x_log: true,
                y_log: true,
                ..figure(
                    "scale-connections-memory.png",
                    "scale: server memory by client connections",
                )
            },
        ],
    },
    Bench {
        name: "transport",
        about: "the transport alone between two processes: rdma-soft against tcp, memcpy as the ceiling",
        figures: &[
            Figure {
                filter: &[("test", "latency")],
                x: "size",
                y: "p50_us",
                series: &["transport"],
                x_label: "message bytes (log)",
                y_label: "p50 round trip, µs (log)",
                x_log: true,
                y_log: true,
                ..figure("transport-latency.png", "transport: round trip by size")
            },
            Figure {
                filter: &[("test", "throughput")],
                x: "transport",
                y: "gbytes_per_sec",
                series: &["fragment_size"],
                x_label: "transport",
                y_label: "GB/s of 1 MiB messages",
                ..figure("transport-throughput.png", "transport: throughput")
            },
        ],
    },
    Bench {
        name: "alloc",
        about: "the registered-memory pool against the system allocator, mimalloc and rpmalloc (paper Fig. 4)",
        figures: &[Figure {
            x: "system",
            y: "ops_per_sec",
            series: &["workload", "threads"],
            x_label: "allocator",
            y_label: "allocations + frees per second (log)",
            y_log: true,
            ..figure("alloc.png", "alloc: operations per second")
        }],
    },
    Bench {
        name: "fragment",
        about: "RDMA throughput of 1 MiB messages by fragment size (paper Fig. 10)",
        figures: &[Figure {
            x: "fragment_bytes",
            y: "gbytes_per_sec",
            x_label: "fragment bytes (log)",
            y_label: "GB/s",
            x_log: true,
            ..figure("fragment.png", "fragment: throughput by fragment size")
        }],
    },
    Bench {
        name: "hol",
        about: "a small flow's round trip next to large flows on one QP, with and without fragmentation (paper Fig. 13)",
        figures: &[Figure {
            x: "large_flows",
            y: "p99_us",
            series: &["fragmentation"],
            x_label: "large flows on the QP",
            y_label: "small-flow p99, µs (log)",
            y_log: true,
            ..figure("hol.png", "hol: head-of-line blocking")
        }],
    },
    Bench {
        name: "incast",
        about: "many senders towards one receiver, send window off and on (paper Fig. 15, Table 4)",
        figures: &[Figure {
            x: "window_bytes",
            y: "p99_us",
            x_label: "send window bytes (0: off)",
            y_label: "p99, µs",
            ..figure("incast.png", "incast: p99 by send window")
        }],
    },
    Bench {
        name: "fabric",
        about: "the paper's incast and training fleet at fabric scale in virtual time: Tessera's real engines on a simulated leaf-spine with PFC (paper Table 4, Fig. 15, Table 7), and the simulator calibrated against a real soft-NIC incast",
        figures: &[
            Figure {
                filter: &[("scenario", "table4")],
                x: "window",
                y: "servers_before_pfc",
                x_label: "send window, bytes",
                y_label: "servers before the first PFC pause (log)",
                y_log: true,
                ..figure(
                    "fabric-table4.png",
                    "fabric: servers before PFC by window (Table 4)",
                )
            },
            Figure {
                filter: &[("scenario", "fig15")],
                x: "window",
                y: "pull_p99_us",
                x_label: "send window, bytes",
                y_label: "Pull p99, µs",
                ..figure(
                    "fabric-fig15-latency.png",
                    "fabric: Pull p99 by window (Fig. 15b)",
                )
            },
            Figure {
                filter: &[("scenario", "fig15")],
                x: "window",
                y: "pfc_pause_us",
                x_label: "send window, bytes",
                y_label: "PFC pause time summed over ports, µs",
                ..figure(
                    "fabric-fig15-pauses.png",
                    "fabric: PFC pause time by window",
                )
            },
        ],
    },
    Bench {
        name: "qps",
        about: "512-byte message rate by number of QPs (paper Fig. 11)",
        figures: &[Figure {
            x: "qps",
            y: "msgs_per_sec",
            x_label: "QPs (log)",
            y_label: "messages per second",
            x_log: true,
            ..figure("qps.png", "qps: message rate by QPs")
        }],
    },
    Bench {
        name: "replication",
        about: "Push latency with ack = replicas against ack = primary",
        figures: &[Figure {
            x: "ack",
            y: "p50_us",
            series: &["transport", "outstanding"],
            x_label: "acknowledged by",
            y_label: "Push p50, µs",
            ..figure("replication.png", "replication: Push p50 by ack mode")
        }],
    },
    Bench {
        name: "recovery",
        about: "policy overhead, RDMA-to-TCP fallback and return, failover around a killed replica, rolling restart",
        figures: &[Figure {
            filter: &[("test", "rolling_restart")],
            x: "transport",
            y: "slowest_ms",
            series: &["round"],
            x_label: "transport",
            y_label: "slowest call, ms",
            ..figure(
                "recovery.png",
                "recovery: slowest call in a rolling restart",
            )
        }],
    },
];

/// What became of one benchmark.
#[derive(Debug)]
struct Outcome {
    name: &'static str,
    secs: f64,
    error: Option<String>,
    /// Not run now: an earlier run's result in the directory.
    earlier: bool,
}

/// Runs `benches` (all by default) into `out` and writes `REPORT.md`.
pub fn run(quick: bool, out: &Path, only: &[String]) -> Result<(), BoxError> {
    std::fs::create_dir_all(out)?;
    let meta = Meta::collect("all");
    let exe = std::env::current_exe()?;
    let chosen: Vec<&Bench> = BENCHES
        .iter()
        .filter(|b| only.is_empty() || only.iter().any(|o| o == b.name))
        .collect();
    if chosen.is_empty() {
        return Err(format!("--only {only:?}: none of {:?}", names()).into());
    }
    let bar = indicatif::ProgressBar::new(chosen.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}")?
            .progress_chars("=> "),
    );
    let mut outcomes = Vec::new();
    for bench in &chosen {
        bar.set_message(format!("{} ({})", bench.name, bench.about));
        let started = Instant::now();
        let log = std::fs::File::create(out.join(format!("{}.log", bench.name)))?;
        let mut command = Command::new(&exe);
        command.arg(bench.name);
        if quick {
            command.arg("--quick");
        }
        let status = command
            .arg("--out")
            .arg(out)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .status();
        let error = match status {
            Ok(s) if s.success() => None,
            Ok(s) => Some(format!("exited with {s}; see {}.log", bench.name)),
            Err(err) => Some(err.to_string()),
        };
        outcomes.push(Outcome {
            name: bench.name,
            secs: started.elapsed().as_secs_f64(),
            error,
            earlier: false,
        });
        bar.inc(1);
    }
    bar.finish_with_message("done");
    // With --only, the other benchmarks' results already in `out` stay in
    // the report (each says in its table when and how it was made).
    let mut shown: Vec<&Bench> = Vec::new();
    let mut shown_outcomes = Vec::new();
    for bench in BENCHES {
        if chosen.iter().any(|c| c.name == bench.name) {
            // `outcomes` are in `chosen`'s order, which is this one's.
            shown.push(bench);
            shown_outcomes.push(outcomes.remove(0));
        } else if let Ok(text) = std::fs::read_to_string(out.join(format!("{}.json", bench.name))) {
            let earlier: Value = serde_json::from_str(&text).unwrap_or_default();
            shown.push(bench);
            shown_outcomes.push(Outcome {
                name: bench.name,
                secs: earlier["meta"]["duration_s"].as_f64().unwrap_or(0.0),
                error: None,
                earlier: true,
            });
        }
    }
    let outcomes = shown_outcomes;
    let report = report(&meta, quick, out, &shown, &outcomes)?;
    std::fs::write(out.join("REPORT.md"), report)?;
    let failed: Vec<&str> = outcomes
        .iter()
        .filter(|o| o.error.is_some())
        .map(|o| o.name)
        .collect();
    match failed.is_empty() {
        true => Ok(()),
        false => Err(format!("benchmarks failed: {failed:?} (see REPORT.md)").into()),
    }
}

/// The benchmarks' names.
pub fn names() -> Vec<&'static str> {
    BENCHES.iter().map(|b| b.name).collect()
}

fn report(
    meta: &Meta,
    quick: bool,
    out: &Path,
    chosen: &[&Bench],
    outcomes: &[Outcome],
) -> Result<String, BoxError> {
    let mut md = format!(
        "# Tessera benchmark report\n\n{}\n\n{} run; every figure below is also given as a ratio to a baseline measured in the same run (the baseline is named in each table).\n\n| benchmark | what | seconds | result |\n|---|---|---:|---|\n",
        meta.machine_line(),
        if quick {
            "A `--quick` (smoke)"
        } else {
            "A full"
        },
    );
    for (bench, outcome) in chosen.iter().zip(outcomes) {
        md.push_str(&format!(
            "| [{}](#{}) | {} | {:.0} | {} |\n",
            bench.name,
            bench.name,
            bench.about,
            outcome.secs,
            match (&outcome.error, outcome.earlier) {
                (Some(error), _) => error.as_str(),
                (None, true) => "ok (an earlier run's)",
                (None, false) => "ok",
            },
        ));
    }
    for (bench, outcome) in chosen.iter().zip(outcomes) {
        md.push_str(&format!("\n## {}\n\n", bench.name));
        if let Some(error) = &outcome.error {
            md.push_str(&format!("**Failed**: {error}\n"));
            continue;
        }
        let table =
            std::fs::read_to_string(out.join(format!("{}.md", bench.name))).unwrap_or_default();
        md.push_str(table.trim_end());
        md.push_str("\n\n");
        let rows = read_rows(&out.join(format!("{}.json", bench.name)))?;
        for figure in bench.figures {
            if draw(out, &rows, figure)? {
                md.push_str(&format!("![{}]({})\n\n", figure.title, figure.file));
            }
        }
    }
    Ok(md)
}

/// The rows of a result file.
pub fn read_rows(path: &PathBuf) -> Result<Vec<Value>, BoxError> {
    let result: Value = serde_json::from_str(&std::fs::read_to_string(path)?)?;
    Ok(result["rows"].as_array().cloned().unwrap_or_default())
}
