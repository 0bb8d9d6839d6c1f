//! The paper's incast (Table 4, Figure 15) with Tessera's real engines:
//! one worker (host 0) has fanned a Fetch out to N servers (hosts 1..=N,
//! one connection each, as the worker's RPC channels hold), and every
//! server answers at the same instant with one message whose size is
//! drawn from the paper's distribution (20 KB mean, 50 KB p99: a
//! log-normal). The question: how many servers before the switch sends
//! its first PFC pause, with no send window and with windows of 16, 8
//! and 4 KB; and at what latency and goodput the answers arrive.
//!
//! Where the servers sit is the caller's: one ToR (Table 4's setting) or
//! a leaf-spine.

use rand::Rng;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use tessera_transport::rdma::engine::EngineConfig;

use crate::cluster::{AppEvent, Cluster, ClusterConfig, ClusterError};
use crate::net::{NetParams, Topology};

/// The paper's message sizes: log-normal with a 20 KB mean and a 50 KB
/// 99th percentile (σ ≈ 0.4345, μ = ln 20,000 − σ²/2).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MessageSizes {
    /// Mean, bytes.
    pub mean: f64,
    /// 99th percentile, bytes.
    pub p99: f64,
}

impl Default for MessageSizes {
    fn default() -> Self {
        Self {
            mean: 20_000.0,
            p99: 50_000.0,
        }
    }
}

impl MessageSizes {
    /// Every message `bytes` long.
    pub fn fixed(bytes: f64) -> Self {
        Self {
            mean: bytes,
            p99: bytes,
        }
    }

    /// (μ, σ) of the log-normal with this mean and p99.
    fn params(&self) -> (f64, f64) {
        // p99 / mean = exp(2.3263 σ − σ²/2): the smaller root.
        const Z99: f64 = 2.326_347_874;
        let r = (self.p99 / self.mean).max(1.0).ln();
        let sigma = Z99 - (Z99 * Z99 - 2.0 * r).max(0.0).sqrt();
        (self.mean.ln() - sigma * sigma / 2.0, sigma)
    }

    /// One size drawn from `rng` (at least 1 byte).
    pub fn draw(&self, rng: &mut impl Rng) -> usize {
        let (mu, sigma) = self.params();
        // Box-Muller: one standard normal from two uniforms.
        let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
        let u2: f64 = rng.random();
        let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
        ((mu + sigma * z).exp().round() as usize).max(1)
    }
}

/// One incast run.
#[derive(Debug, Clone)]
pub struct IncastRun {
    /// The fabric (host 0 is the worker; hosts 1..=servers answer).
    pub net: NetParams,
    /// Servers answering.
    pub servers: u32,
    /// Every engine's send window in bytes (0: none).
    pub window: usize,
    /// The answers' sizes.
    pub sizes: MessageSizes,
    /// The seed (sizes, ECN marks).
    pub seed: u64,
}

impl IncastRun {
    /// `servers` servers and a worker on one ToR at 25 Gbit/s, window
    /// `window`, the paper's sizes.
    pub fn tor(servers: u32, window: usize, seed: u64) -> Self {
        Self {
            net: NetParams::new(Topology::Tor { hosts: servers + 1 }),
            servers,
            window,
            sizes: MessageSizes::default(),
            seed,
        }
    }

    /// The engines' configuration: the transport's defaults with this
    /// window, and 16 receives per queue pair (the worker holds one
    /// engine per server: 2,000 of them at the default 64 would pin a
    /// gigabyte of receive buffers for one message each).
    pub fn engine_config(&self) -> EngineConfig {
        let mut engine = EngineConfig {
            recv_queue_depth: 16,
            ..EngineConfig::default()
        };
        engine.window.max_bytes = self.window;
        engine
    }
}

/// What an incast run measured (times from the instant the servers
/// answer).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct IncastOutcome {
    /// When the first PFC pause was sent, ns (`None`: none was).
    pub first_pause_ns: Option<u64>,
    /// Pauses sent.
    pub pauses: u64,
    /// Time paused, summed over ports, ns.
    pub paused_ns: u64,
    /// Packets dropped.
    pub drops: u64,
    /// Bytes answered.
    pub bytes: u64,
    /// Each answer's latency (answer to arrival), ns, sorted.
    pub latencies_ns: Vec<u64>,
    /// When the last answer arrived, ns.
    pub done_ns: u64,
    /// Network events handled.
    pub events: u64,
    /// Answers that did not arrive (an engine failed, or 1 s passed).
    pub lost: u32,
}

impl IncastOutcome {
    /// The `q`-quantile of the latencies, ns.
    pub fn latency_quantile(&self, q: f64) -> u64 {
        quantile(&self.latencies_ns, q)
    }

    /// Bytes per second delivered to the worker, answer to last arrival.
    pub fn goodput_bps(&self) -> f64 {
        if self.done_ns == 0 {
            return 0.0;
        }
        self.bytes as f64 * 8.0 * 1e9 / self.done_ns as f64
    }
}

/// The `q`-quantile (nearest rank) of sorted `values`.
pub fn quantile(values: &[u64], q: f64) -> u64 {
    if values.is_empty() {
        return 0;
    }
    let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len());
    values[rank - 1]
}

/// Runs one incast: connects, opens a socket per server, then every
/// server answers at once.
pub fn run(run: &IncastRun) -> Result<IncastOutcome, ClusterError> {
    let mut cluster = Cluster::new(ClusterConfig {
        net: run.net,
        engine: run.engine_config(),
        seed: run.seed,
    })?;
    let mut sizes_rng = ChaCha8Rng::seed_from_u64(run.seed ^ 0x5eed_5153);
    let n = run.servers as usize;
    // The worker dialed each server; each answers on its own end.
    let mut ends = Vec::with_capacity(n);
    for s in 1..=run.servers {
        let (worker_end, server_end) = cluster.connect(0, s)?;
        ends.push((worker_end, server_end));
    }
    // The worker's Fetch opened a socket to each server (its request
    // itself is small and left out); run until every one is accepted.
    let mut sockets = vec![None; n];
    let index_of = |conn: usize| conn / 2;
    for &(w, _) in &ends {
        cluster.open(w)?;
    }
    let mut accepted = 0;
    let setup_limit = 1_000_000_000;
    while accepted < n {
        let Some((_, event)) = cluster.next(setup_limit) else {
            break;
        };
        match event {
            AppEvent::Opened { conn, socket } => cluster.accept(conn, socket)?,
            AppEvent::Accepted { conn, socket } => {
                sockets[index_of(conn)] = Some(socket);
                accepted += 1;
            }
            _ => {}
        }
    }
    let pauses_before = cluster.net().pauses().count();
    let t0 = cluster.now();
    let mut bytes = 0u64;
    for (i, &(_, server_end)) in ends.iter().enumerate() {
        let Some(socket) = sockets[i] else {
            continue;
        };
        let len = run.sizes.draw(&mut sizes_rng);
        bytes += len as u64;
        let host = i as u32 + 1;
        let message = cluster.message(host, len, host as u8)?;
        cluster.send(server_end, socket, message)?;
    }
    let mut latencies = Vec::with_capacity(n);
    let mut done = 0;
    let mut failed = 0u32;
    let limit = t0 + 1_000_000_000;
    while (latencies.len() as u32) + failed < run.servers {
        let Some((t, event)) = cluster.next(limit) else {
            break;
        };
        match event {
            AppEvent::Message { .. } => {
                latencies.push(t - t0);
                done = t - t0;
            }
            AppEvent::Failed { .. } => failed += 1,
            _ => {}
        }
    }
    latencies.sort_unstable();
    let net = cluster.net();
    let stats = net.stats();
    let log = net.pauses();
    Ok(IncastOutcome {
        first_pause_ns: (log.count() > pauses_before)
            .then(|| log.first().map(|(t, _)| t.as_nanos().saturating_sub(t0)))
            .flatten(),
        pauses: log.count() - pauses_before,
        paused_ns: log
            .paused_ns(tessera_sim::SimTime::from_nanos(cluster.now()))
            .0,
        drops: stats.drops,
        bytes,
        lost: run.servers - latencies.len() as u32,
        latencies_ns: latencies,
        done_ns: done,
        events: stats.events,
    })
}

/// Table 4's measure for one window: the most servers (up to `max`) whose
/// incast sends no PFC pause, found by doubling then bisecting (the count
/// is taken as monotonic, as the paper's is); `None` in `.1` when even
/// `max` pauses nothing (capped). Returns (largest count without a pause,
/// smallest count with one).
pub fn servers_before_pause(
    base: &IncastRun,
    max: u32,
) -> Result<(u32, Option<u32>), ClusterError> {
    let pauses = |servers: u32| -> Result<bool, ClusterError> {
        let mut r = base.clone();
        r.servers = servers;
        r.net.topology = Topology::Tor { hosts: servers + 1 };
        Ok(run(&r)?.pauses > 0)
    };
    let mut lo = 0;
    let mut hi = None;
    let mut n = 8.min(max);
    while hi.is_none() {
        if pauses(n)? {
            hi = Some(n);
        } else {
            lo = n;
            if n == max {
                return Ok((max, None));
            }
            n = (n * 2).min(max);
        }
    }
    let mut hi_n = hi.unwrap_or(max);
    while hi_n - lo > 1 {
        let mid = lo + (hi_n - lo) / 2;
        if pauses(mid)? {
            hi_n = mid;
        } else {
            lo = mid;
        }
    }
    Ok((lo, Some(hi_n)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_have_the_papers_mean_and_p99() {
        let sizes = MessageSizes::default();
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut drawn: Vec<u64> = (0..100_000).map(|_| sizes.draw(&mut rng) as u64).collect();
        drawn.sort_unstable();
        let mean = drawn.iter().sum::<u64>() as f64 / drawn.len() as f64;
        assert!((mean - 20_000.0).abs() < 300.0, "{mean}");
        let p99 = quantile(&drawn, 0.99) as f64;
        assert!((p99 - 50_000.0).abs() < 1_500.0, "{p99}");
        assert_eq!(MessageSizes::fixed(4096.0).draw(&mut rng), 4096);
    }

    #[test]
    fn a_small_incast_arrives_whole_without_a_pause_and_a_window_keeps_a_larger_one_free() {
        let small = run(&IncastRun::tor(16, 0, 1)).unwrap();
        assert_eq!((small.lost, small.pauses, small.drops), (0, 0, 0));
        assert_eq!(small.latencies_ns.len(), 16);
        // 16 answers of about 20 KB through one 25 Gbit/s port: about
        // 100 us at line rate.
        assert!(small.done_ns < 300_000, "{small:?}");
    }
}
