//! `tessera plan-window`: which send windows keep a fabric free of PFC
//! pauses for a given fan-in and message sizes, and at what Pull latency
//! and goodput. It runs the fabric simulator (`tessera-fabric`: Tessera's
//! real RDMA engines on a simulated leaf-spine with a shared-buffer
//! switch, PFC and ECN; see the book's chapter on it) once per candidate
//! window, the same incast each time: one worker keeping
//! `pulls_in_flight` Pulls outstanding from N servers whose answers are
//! log-normal with the given mean and 99th percentile.
//!
//! A simulation rather than a rule of thumb because the answer depends
//! on what a formula leaves out: the switch's dynamic thresholds, the
//! ports' headroom, how many senders share each uplink, the RTS/CTS
//! round trips of the engine's large-message path.

use serde::Serialize;
use tessera_fabric::incast::{IncastRun, MessageSizes, run};
use tessera_fabric::params::{LinkParams, SwitchParams};

/// What to plan for.
#[derive(Debug, Clone)]
pub struct PlanRequest {
    /// Servers answering each Pull (the fan-in).
    pub servers: u32,
    /// Answer sizes: mean and 99th percentile, bytes.
    pub mean_bytes: f64,
    /// (See `mean_bytes`.)
    pub p99_bytes: f64,
    /// Every link's rate, Gbit/s.
    pub link_gbps: f64,
    /// Candidate windows, bytes (0: none).
    pub windows: Vec<usize>,
    /// Pulls the worker keeps outstanding.
    pub pulls_in_flight: u32,
    /// Pulls per run.
    pub pulls: u32,
    /// The simulation's seed.
    pub seed: u64,
}

/// One window's outcome.
#[derive(Debug, Clone, Serialize)]
pub struct WindowPlan {
    /// The window, bytes (0: none).
    pub window: usize,
    /// PFC pauses the incast caused.
    pub pfc_pauses: u64,
    /// Pull latency, µs.
    pub pull_p50_us: f64,
    /// (See `pull_p50_us`.)
    pub pull_p99_us: f64,
    /// The worker's goodput, Gbit/s.
    pub goodput_gbps: f64,
    /// Pulls that did not complete.
    pub pulls_lost: u32,
}

/// Why a plan could not be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// A request value out of range, named.
    #[error("{0}")]
    Invalid(String),
    /// The simulation failed.
    #[error("simulation: {0}")]
    Simulation(#[from] tessera_fabric::cluster::ClusterError),
}

/// Runs the simulation for each window of `req`.
pub fn plan(req: &PlanRequest) -> Result<Vec<WindowPlan>, PlanError> {
    if req.servers == 0 {
        return Err(PlanError::Invalid("--servers must be at least 1".into()));
    }
    if !(req.mean_bytes >= 1.0 && req.p99_bytes >= req.mean_bytes) {
        return Err(PlanError::Invalid(format!(
            "--message-sizes {},{}: the mean must be at least 1 byte and the p99 at least the mean",
            req.mean_bytes, req.p99_bytes
        )));
    }
    if !(req.link_gbps > 0.0 && req.link_gbps <= 800.0) {
        return Err(PlanError::Invalid(format!(
            "--link-gbps {} is outside (0, 800]",
            req.link_gbps
        )));
    }
    let rate_bps = (req.link_gbps * 1e9) as u64;
    let mut plans = Vec::new();
    for &window in &req.windows {
        let mut r = IncastRun::new(req.servers, window, req.seed);
        r.sizes = MessageSizes {
            mean: req.mean_bytes,
            p99: req.p99_bytes,
        };
        r.pulls_in_flight = req.pulls_in_flight.max(1);
        r.pulls = req.pulls.max(1);
        r.victim = false;
        r.net.link = LinkParams {
            rate_bps,
            ..LinkParams::default()
        };
        r.net.switch = SwitchParams::for_nic_rate(rate_bps);
        let o = run(&r)?;
        plans.push(WindowPlan {
            window,
            pfc_pauses: o.pauses,
            pull_p50_us: o.latency_quantile(0.5) as f64 / 1e3,
            pull_p99_us: o.latency_quantile(0.99) as f64 / 1e3,
            goodput_gbps: o.goodput_bps() / 1e9,
            pulls_lost: o.lost,
        });
    }
    Ok(plans)
}

/// The plans as a table, with the advice: the largest window that caused
/// no pause (the least per-message overhead among the safe ones).
pub fn table(req: &PlanRequest, plans: &[WindowPlan]) -> String {
    let mut out = format!(
        "{} servers -> 1 worker, {} Pulls outstanding ({} in all), answers {:.0} B mean / {:.0} B p99, {} Gbit/s links, leaf-spine (16 hosts a leaf, 16 spines), PFC on, seed {}\n\n",
        req.servers,
        req.pulls_in_flight,
        req.pulls,
        req.mean_bytes,
        req.p99_bytes,
        req.link_gbps,
        req.seed
    );
    out.push_str(&format!(
        "{:>8}  {:>10}  {:>12}  {:>12}  {:>12}\n",
        "window", "PFC pauses", "Pull p50 us", "Pull p99 us", "goodput Gb/s"
    ));
    for p in plans {
        let window = if p.window == 0 {
            "none".to_owned()
        } else {
            p.window.to_string()
        };
        out.push_str(&format!(
            "{window:>8}  {:>10}  {:>12.0}  {:>12.0}  {:>12.1}{}\n",
            p.pfc_pauses,
            p.pull_p50_us,
            p.pull_p99_us,
            p.goodput_gbps,
            if p.pulls_lost > 0 {
                "  (pulls lost)"
            } else {
                ""
            }
        ));
    }
    let safe = plans
        .iter()
        .filter(|p| p.pfc_pauses == 0 && p.pulls_lost == 0)
        .max_by_key(|p| if p.window == 0 { usize::MAX } else { p.window });
    out.push('\n');
    out.push_str(&match safe {
        Some(p) if p.window == 0 => {
            "advice: no window is needed: this incast causes no PFC pause without one\n".into()
        }
        Some(p) => format!(
            "advice: rdma.window_bytes = {} (the largest window tried that caused no PFC pause)\n",
            p.window
        ),
        None => "advice: every window tried caused PFC pauses: try smaller windows, fewer Pulls outstanding, or spread the servers\n".into(),
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_fan_in_needs_no_window_and_the_advice_says_so() {
        let req = PlanRequest {
            servers: 8,
            mean_bytes: 20_000.0,
            p99_bytes: 50_000.0,
            link_gbps: 25.0,
            windows: vec![0, 4096],
            pulls_in_flight: 2,
            pulls: 2,
            seed: 1,
        };
        let plans = plan(&req).unwrap();
        assert_eq!(plans.len(), 2);
        assert!(plans.iter().all(|p| p.pfc_pauses == 0 && p.pulls_lost == 0));
        assert!(table(&req, &plans).contains("advice: no window is needed"));
    }

    #[test]
    fn a_request_out_of_range_is_refused_by_name() {
        let mut req = PlanRequest {
            servers: 8,
            mean_bytes: 20_000.0,
            p99_bytes: 10_000.0,
            link_gbps: 25.0,
            windows: vec![0],
            pulls_in_flight: 1,
            pulls: 1,
            seed: 1,
        };
        assert!(
            plan(&req)
                .unwrap_err()
                .to_string()
                .contains("--message-sizes")
        );
        req.p99_bytes = 50_000.0;
        req.link_gbps = 0.0;
        assert!(plan(&req).unwrap_err().to_string().contains("--link-gbps"));
    }
}
