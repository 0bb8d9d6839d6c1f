//! `tessera-bench fabric`: the paper's fabric-scale experiments in
//! virtual time (issue 58), on `tessera-fabric`'s model with Tessera's
//! real RDMA engines on every simulated host:
//!
//! - `table4`: servers in an incast towards one worker before the first
//!   PFC pause, by send window (none, 16, 8, 4 KB), up to `max_servers`
//!   (2,048 by default, quick too), beside the paper's counts.
//! - `fig15`: at `fig15_servers` servers, the worker's and a victim
//!   flow's bandwidth, p50/p99 Pull latency, PFC pauses and pause time,
//!   by window.
//! - `table7`: the paper's training fleet (124 servers x 346 trainers;
//!   quick: 16 x 48), DCQCN alone against DCQCN and the
//!   window: Fetch and Push p99, PFC pause time, retransmissions.
//! - `speed`: the simulator's own speed, a 1,000-server incast for 100 ms
//!   of virtual time (10 ms quick), in events per second and wall time.
//!
//! Each run is a function of its seed (`--seed`): the same seed writes
//! the same rows. Wall time and events per second are reported per row
//! (they are this machine's; nothing else is).

use std::time::Instant;

use serde_json::{Value, json};
use tessera_fabric::incast::{IncastRun, run, servers_before_pause};
use tessera_fabric::training::{self, TrainingRun};

use crate::transport::BoxError;

/// What to run.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The seed of every run.
    pub seed: u64,
    /// The largest incast Table 4 tries.
    pub max_servers: u32,
    /// Servers in Figure 15's runs.
    pub fig15_servers: u32,
    /// Pulls per run (4 outstanding).
    pub pulls: u32,
    /// Windows, bytes (0: none).
    pub windows: Vec<usize>,
    /// The speed run: servers, and virtual time in ns.
    pub speed: (u32, u64),
    /// Table 7's fleet: servers, trainers, virtual time in ns, the window
    /// of `hw+window`.
    pub table7: (u32, u32, u64, usize),
}

impl Plan {
    /// The full run, or the quick one (fewer Pulls per run and a smaller
    /// Figure 15; Table 4 still up to 2,048 servers).
    pub fn new(quick: bool, seed: u64) -> Self {
        Self {
            seed,
            max_servers: 2048,
            fig15_servers: if quick { 128 } else { 512 },
            pulls: if quick { 4 } else { 8 },
            windows: vec![0, 16 << 10, 8 << 10, 4 << 10],
            // The bound: a 1,000-host incast of 100 ms of virtual
            // time in at most 10 minutes here (quick: 10 ms).
            speed: (1000, if quick { 10_000_000 } else { 100_000_000 }),
            // The paper's 124 x 346 (quick: 16 x 48 for 10 ms, what a
            // debug build's smoke run affords).
            table7: if quick {
                (16, 48, 10_000_000, 4096)
            } else {
                (124, 346, 50_000_000, 4096)
            },
        }
    }
}

/// The paper's Table 4: servers before PFC by window.
fn paper_table4(window: usize) -> Option<u32> {
    match window {
        0 => Some(63),
        16384 => Some(273),
        8192 => Some(567),
        4096 => Some(1218),
        _ => None,
    }
}

fn window_name(window: usize) -> Value {
    if window == 0 {
        json!("none")
    } else {
        json!(window)
    }
}

/// Runs the plan: Table 4's rows, then Figure 15's.
pub fn run_plan(plan: &Plan) -> Result<Vec<Value>, BoxError> {
    let mut rows = Vec::new();
    for &window in &plan.windows {
        let started = Instant::now();
        let mut base = IncastRun::new(1, window, plan.seed);
        base.pulls = plan.pulls;
        let (before, first) = servers_before_pause(&base, plan.max_servers)?;
        rows.push(json!({
            "bench": "fabric",
            "scenario": "table4",
            "window": window_name(window),
            "servers_before_pfc": before,
            "first_pause_at_servers": first,
            "capped": first.is_none(),
            "paper_servers_before_pfc": paper_table4(window),
            "wall_s": started.elapsed().as_secs_f64(),
        }));
    }
    for &window in &plan.windows {
        let started = Instant::now();
        let mut r = IncastRun::new(plan.fig15_servers, window, plan.seed);
        r.pulls = plan.pulls;
        let o = run(&r)?;
        let wall = started.elapsed().as_secs_f64();
        rows.push(json!({
            "bench": "fabric",
            "scenario": "fig15",
            "window": window_name(window),
            "servers": plan.fig15_servers,
            "worker_gbps": o.goodput_bps() / 1e9,
            "victim_gbps": o.victim_bps() / 1e9,
            "pull_p50_us": o.latency_quantile(0.5) as f64 / 1e3,
            "pull_p99_us": o.latency_quantile(0.99) as f64 / 1e3,
            "pfc_pauses": o.pauses,
            "pfc_pause_us": o.paused_ns as f64 / 1e3,
            "retransmitted": o.retransmitted,
            "pulls_lost": o.lost,
            "virtual_ms": o.done_ns as f64 / 1e6,
            "events": o.events,
            "events_per_s": o.events as f64 / wall.max(1e-9),
            "wall_s": wall,
        }));
    }
    let (servers, trainers, virtual_ns, window) = plan.table7;
    for (control, window) in [("hw", 0), ("hw+window", window)] {
        let started = Instant::now();
        let r = TrainingRun::new(servers, trainers, window, virtual_ns, plan.seed);
        let o = training::run(&r)?;
        let wall = started.elapsed().as_secs_f64();
        let per_30s = 30e9 / virtual_ns as f64;
        let (paper_fetch, paper_push, paper_pause) = match control {
            "hw" => (1_040_000.0, 1_120_000.0, 1_000_000.0),
            _ => (338_000.0, 268_000.0, 0.0),
        };
        rows.push(json!({
            "bench": "fabric",
            "scenario": "table7",
            "control": control,
            "window": window_name(window),
            "servers": servers,
            "trainers": trainers,
            "fetches": o.fetch_ns.len(),
            "fetch_p50_us": o.fetch_quantile(0.5) as f64 / 1e3,
            "fetch_p99_us": o.fetch_quantile(0.99) as f64 / 1e3,
            "push_p50_us": o.push_quantile(0.5) as f64 / 1e3,
            "push_p99_us": o.push_quantile(0.99) as f64 / 1e3,
            "pfc_pause_us": o.paused_ns as f64 / 1e3,
            "pfc_pause_us_per_30s": o.paused_ns as f64 / 1e3 * per_30s,
            "pfc_pauses": o.pauses,
            "retransmitted": o.retransmitted,
            "cnps": o.cnps,
            "paper_fetch_p99_us": paper_fetch,
            "paper_push_p99_us": paper_push,
            "paper_pfc_pause_us_per_30s": paper_pause,
            "virtual_ms": virtual_ns as f64 / 1e6,
            "events_per_s": o.events as f64 / wall.max(1e-9),
            "wall_s": wall,
        }));
    }
    let (servers, virtual_ns) = plan.speed;
    let started = Instant::now();
    let mut r = IncastRun::new(servers, 0, plan.seed);
    r.pulls = u32::MAX;
    r.until_ns = virtual_ns;
    let o = run(&r)?;
    let wall = started.elapsed().as_secs_f64();
    rows.push(json!({
        "bench": "fabric",
        "scenario": "speed",
        "window": "none",
        "hosts": r.hosts(),
        "servers": servers,
        "virtual_ms": virtual_ns as f64 / 1e6,
        "pulls_done": o.pull_latencies_ns.len(),
        "events": o.events,
        "events_per_s": o.events as f64 / wall.max(1e-9),
        "wall_s": wall,
        "bound_s": 600,
    }));
    Ok(rows)
}

/// The Markdown tables of the rows.
pub fn markdown(plan: &Plan, rows: &[Value]) -> String {
    let table4: Vec<Value> = rows
        .iter()
        .filter(|r| r["scenario"] == "table4")
        .cloned()
        .collect();
    let fig15: Vec<Value> = rows
        .iter()
        .filter(|r| r["scenario"] == "fig15")
        .cloned()
        .collect();
    let mut out = crate::engine::markdown(
        &format!(
            "fabric, Table 4: servers in an incast towards one worker before the first PFC pause, by send window; one worker pulls with 4 Pulls outstanding ({} in all) from N servers (one connection each), answers log-normal 20 KB mean / 50 KB p99, a victim bandwidth test beside it; leaf-spine of 16 hosts per leaf and 16 spines at 25 Gbit/s, 8 MB switch buffers, PFC on, DCQCN off; up to {} servers; seed {}",
            plan.pulls, plan.max_servers, plan.seed
        ),
        &table4,
        &[
            "window",
            "servers_before_pfc",
            "first_pause_at_servers",
            "capped",
            "paper_servers_before_pfc",
            "wall_s",
        ],
    );
    out.push('\n');
    out.push_str(&crate::engine::markdown(
        &format!(
            "fabric, Figure 15: {} servers, the same workload, by send window",
            plan.fig15_servers
        ),
        &fig15,
        &[
            "window",
            "worker_gbps",
            "victim_gbps",
            "pull_p50_us",
            "pull_p99_us",
            "pfc_pauses",
            "pfc_pause_us",
            "retransmitted",
            "virtual_ms",
            "events_per_s",
            "wall_s",
        ],
    ));
    let table7: Vec<Value> = rows
        .iter()
        .filter(|r| r["scenario"] == "table7")
        .cloned()
        .collect();
    let (servers, trainers, virtual_ns, _) = plan.table7;
    out.push('\n');
    out.push_str(&crate::engine::markdown(
        &format!(
            "fabric, Table 7: {servers} servers x {trainers} trainers on the same leaf-spine, DCQCN on at every NIC (hw) and with Tessera's send window too (hw+window); each trainer Fetches from every server, computes 1 ms, Pushes to every server, for {} ms of virtual time; p99s of the trainers' calls (calls under way at the end at their age), PFC pause time summed over ports and scaled to 30 s, beside the paper's production figures",
            virtual_ns / 1_000_000
        ),
        &table7,
        &[
            "control",
            "window",
            "fetches",
            "fetch_p99_us",
            "push_p99_us",
            "pfc_pause_us_per_30s",
            "retransmitted",
            "cnps",
            "paper_fetch_p99_us",
            "paper_push_p99_us",
            "paper_pfc_pause_us_per_30s",
            "wall_s",
        ],
    ));
    let speed: Vec<Value> = rows
        .iter()
        .filter(|r| r["scenario"] == "speed")
        .cloned()
        .collect();
    out.push('\n');
    out.push_str(&crate::engine::markdown(
        "fabric, speed: the same incast with no window (its heaviest), setup included, against the issue's bound of 10 minutes for 1,000 hosts and 100 ms",
        &speed,
        &[
            "hosts",
            "virtual_ms",
            "pulls_done",
            "events",
            "events_per_s",
            "wall_s",
            "bound_s",
        ],
    ));
    out
}
