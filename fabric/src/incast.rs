//! The paper's synthetic incast (Figure 14, Table 4, Figure 15) with
//! Tessera's real engines: a worker (host 0) pulls from N servers, with
//! `pulls_in_flight` Pulls outstanding at a time, each a small request to
//! every server (one connection and socket each, as the worker's RPC
//! channels hold) answered by a message whose size is drawn from the
//! paper's training distribution (20 KB mean, 50 KB p99: a log-normal).
//! Beside it, a victim flow (a bandwidth test between two other hosts
//! whose path shares the fabric) shows what PFC's propagation costs
//! traffic that is not part of the incast. The questions: how many
//! servers before the first PFC pause, with no send window and with
//! windows of 16, 8 and 4 KB (Table 4); the worker's and the victim's
//! bandwidth and the p50/p99 Pull latency by window (Figure 15).
//!
//! Hosts: 0 is the worker, 1 the victim's receiver (beside the worker),
//! 2..2+N the servers, and the last the victim's sender. On a leaf-spine
//! (the default: 16 hosts per leaf, 16 spines, so no leaf is
//! oversubscribed) the servers sit on many leaves and the incast meets at
//! the worker's leaf; a ToR puts everyone on one switch.
use rand::Rng;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use tessera_transport::TransportConfig;
use tessera_transport::rdma::engine::EngineConfig;

use std::collections::HashMap;

use crate::cluster::{AppEvent, Cluster, ClusterConfig, ClusterError, ConnId};
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
    /// The fabric (hosts as in the module docs).
    pub net: NetParams,
    /// Servers answering.
    pub servers: u32,
    /// Every engine's send window in bytes (0: none).
    pub window: usize,
    /// The answers' sizes.
    pub sizes: MessageSizes,
    /// Pulls the worker keeps outstanding.
    pub pulls_in_flight: u32,
    /// Pulls in all (`u32::MAX`: as many as `until_ns` allows).
    pub pulls: u32,
    /// Bytes of each request (the keys asked for).
    pub request_bytes: usize,
    /// Whether the victim flow runs.
    pub victim: bool,
    /// Virtual time the run may take from its first Pull, ns (Pulls not
    /// done by then are counted lost).
    pub until_ns: u64,
    /// End the run at the first PFC pause (all Table 4 asks of a run;
    /// the Pulls left are then counted lost).
    pub stop_at_pause: bool,
    /// The seed (sizes, ECN marks).
    pub seed: u64,
}

/// Hosts per leaf and spines of [`IncastRun::new`]'s leaf-spine.
pub const PER_LEAF: u32 = 16;
/// (See [`PER_LEAF`].)
pub const SPINES: u32 = 16;

impl IncastRun {
    /// `servers` servers, the worker and the victim on a leaf-spine at
    /// 25 Gbit/s, window `window`, the paper's sizes, 4 Pulls outstanding
    /// of 8, a victim flow.
    pub fn new(servers: u32, window: usize, seed: u64) -> Self {
        let mut run = Self {
            net: NetParams::new(Topology::LeafSpine {
                leaves: 1,
                spines: SPINES,
                per_leaf: PER_LEAF,
            }),
            servers,
            window,
            sizes: MessageSizes::default(),
            pulls_in_flight: 4,
            pulls: 8,
            request_bytes: 512,
            victim: true,
            until_ns: 10_000_000_000,
            stop_at_pause: false,
            seed,
        };
        run.set_servers(servers);
        run
    }

    /// The same on one ToR.
    pub fn tor(servers: u32, window: usize, seed: u64) -> Self {
        let mut run = Self::new(servers, window, seed);
        run.net.topology = Topology::Tor { hosts: run.hosts() };
        run
    }

    /// Hosts the run needs.
    pub fn hosts(&self) -> u32 {
        self.servers + 3
    }

    /// Sets the server count, growing a leaf-spine to hold them.
    pub fn set_servers(&mut self, servers: u32) {
        self.servers = servers;
        let hosts = self.hosts();
        self.net.topology = match self.net.topology {
            Topology::Tor { .. } => Topology::Tor { hosts },
            Topology::LeafSpine { .. } => Topology::LeafSpine {
                leaves: hosts.div_ceil(PER_LEAF),
                spines: SPINES,
                per_leaf: PER_LEAF,
            },
        };
    }

    /// The engines' configuration: what a transport of the default
    /// configuration runs (`rdma::connection::engine_config`: keepalive,
    /// grant timeout, offers and all) with this window, and 16 receives
    /// per queue pair (the worker holds one
    /// engine per server: 2,000 of them at the default 64 would pin a
    /// gigabyte of receive buffers for a few messages each).
    pub fn engine_config(&self) -> EngineConfig {
        let mut transport = TransportConfig::default();
        transport.rdma.recv_queue_depth = 16;
        transport.rdma.window_bytes = self.window;
        tessera_transport::rdma::connection::engine_config(&transport, 0, 1, false)
    }
}

/// What an incast run measured.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct IncastOutcome {
    /// When the first PFC pause was sent, ns after the first Pull (`None`:
    /// none was).
    pub first_pause_ns: Option<u64>,
    /// Pauses sent.
    pub pauses: u64,
    /// Time paused, summed over ports, ns.
    pub paused_ns: u64,
    /// Packets dropped.
    pub drops: u64,
    /// Packets sent again (go-back-N), all NICs.
    pub retransmitted: u64,
    /// Answer bytes the worker received.
    pub bytes: u64,
    /// Each Pull's latency (request to its last answer), ns, sorted.
    pub pull_latencies_ns: Vec<u64>,
    /// When the last Pull completed, ns after the first began.
    pub done_ns: u64,
    /// The victim's bytes delivered while the Pulls ran.
    pub victim_bytes: u64,
    /// Events handled (the network's, the engines' timers, the
    /// application's).
    pub events: u64,
    /// Pauses by where they were sent: from leaf switches towards hosts,
    /// from leaves towards spines, from spines towards leaves (a ToR's
    /// count as leaves').
    pub pauses_by_tier: [u64; 3],
    /// Pulls that did not complete (an engine failed, or `until_ns`
    /// passed).
    pub lost: u32,
}

impl IncastOutcome {
    /// The `q`-quantile of the Pull latencies, ns.
    pub fn latency_quantile(&self, q: f64) -> u64 {
        quantile(&self.pull_latencies_ns, q)
    }

    /// Bits per second the worker received, first Pull to last answer.
    pub fn goodput_bps(&self) -> f64 {
        rate(self.bytes, self.done_ns)
    }

    /// Bits per second the victim moved over the same time.
    pub fn victim_bps(&self) -> f64 {
        rate(self.victim_bytes, self.done_ns)
    }
}

fn rate(bytes: u64, ns: u64) -> f64 {
    if ns == 0 {
        return 0.0;
    }
    bytes as f64 * 8.0 * 1e9 / ns as f64
}

/// The `q`-quantile (nearest rank) of sorted `values`.
pub fn quantile(values: &[u64], q: f64) -> u64 {
    if values.is_empty() {
        return 0;
    }
    let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len());
    values[rank - 1]
}

/// Bytes of each victim message; two are kept outstanding.
const VICTIM_MESSAGE: usize = 256 << 10;

/// The incast's connections: the worker to each server, and the victim's
/// (a bandwidth test, not Tessera traffic: no window), each with its
/// socket open.
struct Fleet {
    /// The worker's connection to server i.
    worker_ends: Vec<ConnId>,
    /// Server i's end of its connection from the worker.
    server_of: HashMap<ConnId, usize>,
    /// Which server a worker's connection goes to.
    worker_index: HashMap<ConnId, usize>,
    /// The victim's two ends.
    victim: Option<(ConnId, ConnId)>,
    /// The worker's socket to server i is `sockets[i]`; the victim's last.
    sockets: Vec<Option<tessera_transport::rdma::engine::SocketId>>,
}

fn connect(cluster: &mut Cluster, run: &IncastRun) -> Result<Fleet, ClusterError> {
    let n = run.servers as usize;
    // The worker dialed each server.
    let mut worker_ends = Vec::with_capacity(n);
    let mut server_of = HashMap::new();
    for i in 0..run.servers {
        let (w, s) = cluster.connect(0, 2 + i)?;
        worker_ends.push(w);
        server_of.insert(s, i as usize);
    }
    let worker_index: HashMap<ConnId, usize> = worker_ends
        .iter()
        .enumerate()
        .map(|(i, &c)| (c, i))
        .collect();
    // The victim is a bandwidth test, not Tessera traffic: no window.
    let victim = if run.victim {
        let sender = run.hosts() - 1;
        let mut config = run.engine_config();
        config.window.max_bytes = 0;
        Some(cluster.connect_with(sender, 1, config)?)
    } else {
        None
    };
    let mut dialers = worker_ends.clone();
    dialers.extend(victim.map(|(v, _)| v));
    let sockets = cluster.open_all(&dialers)?;
    Ok(Fleet {
        worker_ends,
        server_of,
        worker_index,
        victim,
        sockets,
    })
}

/// Runs one incast (module docs).
pub fn run(run: &IncastRun) -> Result<IncastOutcome, ClusterError> {
    let mut cluster = Cluster::new(ClusterConfig {
        net: run.net,
        engine: run.engine_config(),
        seed: run.seed,
    })?;
    let mut sizes_rng = ChaCha8Rng::seed_from_u64(run.seed ^ 0x5eed_5153);
    let n = run.servers as usize;
    let Fleet {
        worker_ends,
        server_of,
        worker_index,
        victim,
        sockets,
    } = connect(&mut cluster, run)?;
    // A server answers on the socket the request came on; the worker's
    // socket to server i is sockets[i].
    let t0 = cluster.now();
    let pauses_before = cluster.net().pauses().count();
    let retransmitted_before = retransmissions(&cluster);
    let mut victim_bytes = 0u64;
    if let (Some((v, _)), Some(Some(socket))) = (victim, sockets.last().filter(|_| run.victim)) {
        for _ in 0..2 {
            let m = cluster.message(run.hosts() - 1, VICTIM_MESSAGE, 0xee)?;
            cluster.send(v, *socket, m)?;
        }
    }
    // Pull p began at started[p]; answered[p] answers so far; the j-th
    // answer from a server is for Pull j (a socket delivers in order).
    let mut started: Vec<u64> = Vec::new();
    let mut answered: Vec<u32> = Vec::new();
    let mut next_answer = vec![0usize; n];
    let mut latencies = Vec::new();
    let mut bytes = 0u64;
    let mut done_ns = 0;
    let begin_pull = |cluster: &mut Cluster,
                      started: &mut Vec<u64>,
                      answered: &mut Vec<u32>|
     -> Result<(), ClusterError> {
        started.push(cluster.now());
        answered.push(0);
        for (i, &w) in worker_ends.iter().enumerate() {
            if let Some(socket) = sockets[i] {
                let m = cluster.message(0, run.request_bytes, 0x11)?;
                cluster.send(w, socket, m)?;
            }
        }
        Ok(())
    };
    for _ in 0..run.pulls_in_flight.min(run.pulls) {
        begin_pull(&mut cluster, &mut started, &mut answered)?;
    }
    let limit = t0.saturating_add(run.until_ns);
    let mut completed = 0u32;
    while completed < run.pulls {
        let Some((t, event)) = cluster.next(limit) else {
            break;
        };
        if run.stop_at_pause && cluster.net().pauses().count() > pauses_before {
            break;
        }
        let AppEvent::Message {
            conn,
            socket,
            bytes: message,
        } = event
        else {
            if let AppEvent::Failed { .. } = event {
                break;
            }
            continue;
        };
        if let Some(&i) = server_of.get(&conn) {
            // A request at server i: the answer.
            let len = run.sizes.draw(&mut sizes_rng);
            let host = 2 + i as u32;
            let answer = cluster.message(host, len, host as u8)?;
            cluster.send(conn, socket, answer)?;
        } else if let Some(&i) = worker_index.get(&conn) {
            let p = next_answer[i];
            next_answer[i] += 1;
            bytes += message.len() as u64;
            if let Some(count) = answered.get_mut(p) {
                *count += 1;
                if *count == run.servers {
                    latencies.push(t - started[p]);
                    completed += 1;
                    done_ns = t - t0;
                    if (started.len() as u32) < run.pulls {
                        begin_pull(&mut cluster, &mut started, &mut answered)?;
                    }
                }
            }
        } else if victim.is_some_and(|(_, r)| r == conn) {
            if completed < run.pulls {
                victim_bytes += message.len() as u64;
            }
            if let (Some((v, _)), Some(Some(socket))) = (victim, sockets.last()) {
                let m = cluster.message(run.hosts() - 1, VICTIM_MESSAGE, 0xee)?;
                cluster.send(v, *socket, m)?;
            }
        }
    }
    latencies.sort_unstable();
    let retransmitted = retransmissions(&cluster) - retransmitted_before;
    let events = cluster.events();
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
        retransmitted,
        bytes,
        lost: if run.pulls == u32::MAX {
            0
        } else {
            run.pulls - completed
        },
        pull_latencies_ns: latencies,
        done_ns,
        victim_bytes,
        events,
        pauses_by_tier: pauses_by_tier(net),
    })
}

/// PFC pauses by the tier of the port that sent them: a ToR's port to a
/// host (0), a leaf's uplink (1), a spine's port (2).
fn pauses_by_tier(net: &crate::net::Network) -> [u64; 3] {
    let mut tiers = [0; 3];
    for ((switch, port), n, _) in net.pauses().per_port() {
        let tier = match net.params().topology {
            Topology::LeafSpine {
                leaves, per_leaf, ..
            } => {
                if switch >= leaves {
                    2
                } else if port >= per_leaf {
                    1
                } else {
                    0
                }
            }
            Topology::Tor { .. } => 0,
        };
        tiers[tier] += n;
    }
    tiers
}

fn retransmissions(cluster: &Cluster) -> u64 {
    (0..cluster.net().hosts())
        .map(|h| cluster.net().nic(h).stats().retransmitted)
        .sum()
}

/// Table 4's measure for one window: the most servers (up to `max`) whose
/// incast sends no PFC pause, found by doubling then bisecting (the count
/// is taken as monotonic, as the paper's is). Returns (the largest count
/// without a pause, the smallest with one: `None` when even `max` paused
/// nothing, a capped result).
pub fn servers_before_pause(
    base: &IncastRun,
    max: u32,
) -> Result<(u32, Option<u32>), ClusterError> {
    let pauses = |servers: u32| -> Result<bool, ClusterError> {
        let mut r = base.clone();
        r.set_servers(servers);
        r.stop_at_pause = true;
        Ok(run(&r)?.pauses > 0)
    };
    let mut lo = 0;
    let mut n = 8.min(max).max(1);
    let hi = loop {
        if pauses(n)? {
            break n;
        }
        lo = n;
        if n == max {
            return Ok((max, None));
        }
        n = (n * 2).min(max);
    };
    let mut hi = hi;
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if pauses(mid)? {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Ok((lo, Some(hi)))
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
    fn a_small_incast_completes_every_pull_without_a_pause() {
        let mut r = IncastRun::new(16, 0, 1);
        r.pulls = 4;
        let o = run(&r).unwrap();
        assert_eq!((o.lost, o.pauses, o.drops), (0, 0, 0), "{o:?}");
        assert_eq!(o.pull_latencies_ns.len(), 4);
        // 4 Pulls of 16 answers of about 20 KB (1.3 MB) through the
        // worker's 25 Gbit/s port: about 0.4 ms at line rate.
        assert!((300_000..1_000_000).contains(&o.done_ns), "{o:?}");
        assert!(o.victim_bytes > 0);
    }

    #[test]
    fn the_same_seed_gives_the_same_bytes_and_another_seed_other_sizes() {
        let mut r = IncastRun::new(24, 8192, 5);
        r.pulls = 3;
        let a = format!("{:?}", run(&r).unwrap());
        assert_eq!(a, format!("{:?}", run(&r).unwrap()));
        r.seed = 6;
        let b = run(&r).unwrap();
        assert_ne!(a, format!("{b:?}"));
        assert_eq!(b.lost, 0);
    }

    #[test]
    fn on_one_tor_the_same_pulls_complete_too() {
        let mut r = IncastRun::tor(8, 4096, 1);
        r.pulls = 2;
        let o = run(&r).unwrap();
        assert_eq!(o.lost, 0, "{o:?}");
    }
}
