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
//!   quick: 16 x 48; servers spread over the racks, 20 ms of compute per
//!   step), DCQCN alone against DCQCN and the window: Fetch and Push p99,
//!   PFC pause time, drops and retransmissions; once with the switches'
//!   headroom sized by IEEE 802.1Qbb's rule (lossless) and once a
//!   headroom of one bandwidth-delay product (`short`: a pause can lose
//!   packets, as the paper's fabric did without the window); and once
//!   more with synchronous steps (every trainer Pushes at once).
//! - `calibration`: `tessera-bench incast` run for real (8 senders over
//!   soft NICs whose links run at `calibration.0` Mbit/s) and the same
//!   incast in the simulator (same sizes in the same order, same engine
//!   configuration, same link rate), by window: goodput and p50/p99, and
//!   their ratios `*_sim_vs_measured`.
//! - `speed`: the simulator's own speed, a 1,000-server incast for 100 ms
//!   of virtual time (10 ms quick), in events per second and wall time.
//!
//! Each run is a function of its seed (`--seed`): the same seed writes
//! the same rows. Wall time and events per second are reported per row
//! (they are this machine's; nothing else is).

use std::time::Instant;

use serde_json::{Value, json};
use tessera_fabric::calibration::{self, CalibrationRun};
use tessera_fabric::incast::{IncastRun, run, servers_before_pause};
use tessera_fabric::training::{self, Placement, TrainingRun};

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
    /// Table 7's fleet.
    pub table7: Table7,
    /// The calibration: link rate in Mbit/s, seconds per window, senders
    /// (`None`: not run).
    pub calibration: Option<(u64, f64, usize)>,
    /// The scenarios to run (all by default).
    pub scenarios: Vec<&'static str>,
}

/// Table 7's fleet and its settings.
#[derive(Debug, Clone, Copy)]
pub struct Table7 {
    /// Parameter servers.
    pub servers: u32,
    /// Trainers.
    pub trainers: u32,
    /// Virtual time of each run, ns.
    pub virtual_ns: u64,
    /// The window of `hw+window`, bytes.
    pub window: usize,
    /// A trainer's compute per step, ns.
    pub compute_ns: u64,
}

/// Every scenario, in the order they run.
pub const SCENARIOS: [&str; 5] = ["table4", "fig15", "table7", "calibration", "speed"];

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
            // The paper's 124 x 346 (quick: 16 x 48, what a debug build's
            // smoke run affords). 20 ms of compute per step: a trainer
            // spends most of its time computing, and Fetch and Push
            // bursts come and go (with 1 ms the fabric is saturated and
            // no window keeps it from pausing: the book has those runs).
            table7: Table7 {
                servers: if quick { 16 } else { 124 },
                trainers: if quick { 48 } else { 346 },
                virtual_ns: 40_000_000,
                window: 4096,
                compute_ns: 20_000_000,
            },
            // 250 Mbit/s: a 35 KB message is 1.1 ms on the link, so the
            // host's own time per message on two shared cores (tens to a
            // few hundred microseconds) is small beside it.
            calibration: Some((250, if quick { 0.5 } else { 2.0 }, 8)),
            scenarios: SCENARIOS.to_vec(),
        }
    }

    /// Runs only `names` (all when empty); an unknown name is refused.
    pub fn only(&mut self, names: &[String]) -> Result<(), BoxError> {
        if names.is_empty() {
            return Ok(());
        }
        let mut scenarios = Vec::new();
        for name in names {
            match SCENARIOS.iter().find(|s| **s == name.as_str()) {
                Some(s) => scenarios.push(*s),
                None => {
                    return Err(format!("--only {name}: allowed: {}", SCENARIOS.join(", ")).into());
                }
            }
        }
        self.scenarios = scenarios;
        Ok(())
    }

    fn runs(&self, scenario: &str) -> bool {
        self.scenarios.contains(&scenario)
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
    for &window in plan.windows.iter().filter(|_| plan.runs("table4")) {
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
    for &window in plan.windows.iter().filter(|_| plan.runs("fig15")) {
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
    if plan.runs("table7") {
        rows.extend(table7(plan)?);
    }
    if let Some((link_mbps, secs, senders)) = plan.calibration.filter(|_| plan.runs("calibration"))
    {
        rows.extend(calibration(plan, link_mbps, secs, senders)?);
    }
    if !plan.runs("speed") {
        return Ok(rows);
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

/// Table 7's fleet, by headroom and control.
fn table7(plan: &Plan) -> Result<Vec<Value>, BoxError> {
    let t7 = plan.table7;
    let mut rows = Vec::new();
    // Trainers on their own steps, in a lossless fabric and a lossy one;
    // then in synchronous steps (every trainer's Push at once), lossless,
    // for half as long again so that two whole steps fit.
    let configs = [
        ("staggered", "ieee", t7.virtual_ns),
        ("staggered", "short", t7.virtual_ns),
        ("synchronous", "ieee", t7.virtual_ns * 3 / 2),
    ];
    for (steps, headroom, virtual_ns) in configs {
        for (control, window) in [("hw", 0), ("hw+window", t7.window)] {
            let started = Instant::now();
            let mut r = TrainingRun::new(t7.servers, t7.trainers, window, virtual_ns, plan.seed);
            r.compute_ns = t7.compute_ns;
            r.synchronous = steps == "synchronous";
            // Every rack holds servers and trainers: with servers grouped
            // 16 to a leaf, 346 trainers' 4 KB each towards one leaf are
            // 22 MB, far over its 8 MB buffer, and pauses are certain
            // whatever the window.
            r.placement = Placement::Interleaved;
            if headroom == "short" {
                // One bandwidth-delay product: less than what arrives
                // after an XOFF (its flight, the bytes on the wire, the
                // frame being sent), so a pause can overflow it.
                r.net.switch.headroom_bdps = 1;
                r.net.switch.headroom_frames = 0;
            }
            let o = training::run(&r)?;
            let wall = started.elapsed().as_secs_f64();
            let per_30s = 30e9 / virtual_ns as f64;
            let (paper_fetch, paper_push, paper_pause, paper_naks) = match control {
                "hw" => (1_040_000.0, 1_120_000.0, 1_000_000.0, 3000.0),
                _ => (338_000.0, 268_000.0, 0.0, 0.0),
            };
            rows.push(json!({
                "bench": "fabric",
                "scenario": "table7",
                "control": control,
                "headroom": headroom,
                "steps": steps,
                "window": window_name(window),
                "servers": t7.servers,
                "trainers": t7.trainers,
                "compute_ms": t7.compute_ns as f64 / 1e6,
                "placement": "interleaved",
                "fetches": o.fetch_ns.len(),
                "fetch_p50_us": o.fetch_quantile(0.5) as f64 / 1e3,
                "fetch_p99_us": o.fetch_quantile(0.99) as f64 / 1e3,
                "push_p50_us": o.push_quantile(0.5) as f64 / 1e3,
                "push_p99_us": o.push_quantile(0.99) as f64 / 1e3,
                "pfc_pause_us": o.paused_ns as f64 / 1e3,
                "pfc_pause_us_per_30s": o.paused_ns as f64 / 1e3 * per_30s,
                "pfc_pauses": o.pauses,
                "drops": o.drops,
                "retransmitted": o.retransmitted,
                "retransmitted_per_30s": o.retransmitted as f64 * per_30s,
                "cnps": o.cnps,
                "paper_fetch_p99_us": paper_fetch,
                "paper_push_p99_us": paper_push,
                "paper_pfc_pause_us_per_30s": paper_pause,
                "paper_naks_per_30s": paper_naks,
                "virtual_ms": virtual_ns as f64 / 1e6,
                "events_per_s": o.events as f64 / wall.max(1e-9),
                "wall_s": wall,
            }));
        }
    }
    Ok(rows)
}

/// `tessera-bench incast` for real at `link_mbps`, then the same in the
/// simulator, for each window of the plan.
fn calibration(
    plan: &Plan,
    link_mbps: u64,
    secs: f64,
    senders: usize,
) -> Result<Vec<Value>, BoxError> {
    let tuning = crate::transport::Tuning {
        polling: tessera_transport::Polling::Busy,
        spin_us: 50,
        io_threads: 1,
        link_mbps,
    };
    let runtime = tokio::runtime::Runtime::new()?;
    let measured =
        runtime.block_on(crate::engine::incast(senders, &plan.windows, secs, &tuning))?;
    let sizes: Vec<Vec<usize>> = (0..senders)
        .map(|s| crate::engine::incast_sizes(s as u64 + 1))
        .collect();
    let mut rows = Vec::new();
    for (&window, real) in plan.windows.iter().zip(&measured) {
        let started = Instant::now();
        let mut run = CalibrationRun::new(
            sizes.clone(),
            link_mbps,
            crate::engine::incast_config(window, &tuning),
            (secs * 1e9) as u64,
            plan.seed,
        );
        run.depth = crate::engine::INCAST_DEPTH;
        let o = calibration::run(&run)?;
        let wall = started.elapsed().as_secs_f64();
        let real_mbps = real["goodput_gbytes_per_sec"].as_f64().unwrap_or(0.0) * 8e3;
        let real_p50 = real["p50_us"].as_f64().unwrap_or(0.0);
        let real_p99 = real["p99_us"].as_f64().unwrap_or(0.0);
        let sim_mbps = o.goodput_bytes_per_sec() * 8.0 / 1e6;
        let sim_p50 = o.latency_quantile(0.5) as f64 / 1e3;
        let sim_p99 = o.latency_quantile(0.99) as f64 / 1e3;
        let real_share = real["sender_bytes_min_over_max"].as_f64().unwrap_or(0.0);
        // Little's law: what the mean latency must be with `depth`
        // messages of the mean size outstanding per sender at the
        // measured goodput.
        let outstanding: f64 = sizes
            .iter()
            .map(|s| run.depth as f64 * s.iter().sum::<usize>() as f64 / s.len().max(1) as f64)
            .sum();
        let real_little_us = outstanding * 8.0 / real_mbps.max(1e-9);
        let ratio = |sim: f64, real: f64| if real > 0.0 { sim / real } else { f64::NAN };
        rows.push(json!({
            "bench": "fabric",
            "scenario": "calibration",
            "window": window_name(window),
            "link_mbps": link_mbps,
            "senders": senders,
            "measured_goodput_mbps": real_mbps,
            "sim_goodput_mbps": sim_mbps,
            "goodput_sim_vs_measured": ratio(sim_mbps, real_mbps),
            "measured_p50_us": real_p50,
            "sim_p50_us": sim_p50,
            "p50_sim_vs_measured": ratio(sim_p50, real_p50),
            "measured_p99_us": real_p99,
            "sim_p99_us": sim_p99,
            "p99_sim_vs_measured": ratio(sim_p99, real_p99),
            "measured_little_us": real_little_us,
            "measured_sender_min_over_max": real_share,
            "sim_sender_min_over_max": o.sender_bytes_min_over_max(),
            "sim_pfc_pauses": o.pauses,
            "secs": secs,
            "wall_s": wall,
        }));
    }
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
    let t7 = plan.table7;
    out.push('\n');
    out.push_str(&crate::engine::markdown(
        &format!(
            "fabric, Table 7: {} servers x {} trainers on the same leaf-spine, servers spread over the racks, DCQCN on at every NIC (hw) and with Tessera's {}-byte send window too (hw+window); each trainer Fetches from every server, computes {} ms, Pushes to every server, in steps of its own from a random start (staggered) or all together after a barrier (synchronous), for {} ms of virtual time (synchronous: half as long again); p99s of the trainers' calls (calls under way at the end at their age), PFC pause time summed over ports and retransmitted packets, both scaled to 30 s, beside the paper's production figures (its NAKs per 30 s beside the retransmissions); headroom `ieee`: 3 BDPs and 2 frames (lossless), `short`: 1 BDP (a pause can lose packets)",
            t7.servers,
            t7.trainers,
            t7.window,
            t7.compute_ns / 1_000_000,
            t7.virtual_ns / 1_000_000
        ),
        &table7,
        &[
            "steps",
            "headroom",
            "control",
            "fetches",
            "fetch_p99_us",
            "push_p99_us",
            "pfc_pause_us_per_30s",
            "drops",
            "retransmitted_per_30s",
            "paper_fetch_p99_us",
            "paper_push_p99_us",
            "paper_pfc_pause_us_per_30s",
            "paper_naks_per_30s",
            "wall_s",
        ],
    ));
    let calibration: Vec<Value> = rows
        .iter()
        .filter(|r| r["scenario"] == "calibration")
        .cloned()
        .collect();
    if let Some((link_mbps, secs, senders)) = plan.calibration {
        let depth = crate::engine::INCAST_DEPTH;
        out.push('\n');
        out.push_str(&crate::engine::markdown(
            &format!(
                "fabric, calibration: `tessera-bench incast` measured ({senders} senders over soft NICs at {link_mbps} Mbit/s, {depth} outstanding each, 20-50 KiB, {secs} s per window) beside the same incast simulated (same sizes in the same order, same engine configuration, one ToR at {link_mbps} Mbit/s); ratios are simulated over measured"
            ),
            &calibration,
            &[
                "window",
                "measured_goodput_mbps",
                "sim_goodput_mbps",
                "goodput_sim_vs_measured",
                "measured_p50_us",
                "sim_p50_us",
                "p50_sim_vs_measured",
                "measured_p99_us",
                "sim_p99_us",
                "p99_sim_vs_measured",
                "measured_little_us",
                "measured_sender_min_over_max",
                "sim_sender_min_over_max",
            ],
        ));
    }
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
