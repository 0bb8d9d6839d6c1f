//! The simulator against a real run: the incast `tessera-bench incast`
//! measures over soft NICs at a set link rate, replayed in virtual time.
//!
//! The real run (`benches/src/engine.rs`): `senders` senders, each a
//! transport of its own (one engine), send to one receiving process; each
//! keeps `depth` messages outstanding and cycles through 8 sizes of its
//! own (uniform 20 to 50 KiB); the receiver answers every message with a
//! short acknowledgement; a message's latency runs from its send to its
//! acknowledgement. The soft NICs' ports run at `soft_link_mbps`, so the
//! receiver's link is the bottleneck, as a real NIC's is.
//!
//! Here the same senders, with the same sizes in the same order, the same
//! depth and the very engine configuration of the real run
//! (`rdma::connection::engine_config` of its `TransportConfig`), sit on
//! one ToR whose links run at that rate; the ToR's port to the receiver
//! is the bottleneck. Figures compared: goodput (bytes acknowledged per
//! second, drained at the end as the real run drains) and the p50/p99
//! latency.
//!
//! What the two leave out of each other (the differences a calibration
//! has to explain): the soft port books a whole message on the link at
//! once and delivers it at the start of its slot (one message's
//! serialization early), where the model sends packets and delivers a
//! message with its last one; the model's hosts take no CPU time, where
//! the real run's eight senders and their I/O threads share two cores
//! with the receiver; the model has a switch (buffers, PFC) between
//! them, the soft NICs a direct link; and the soft NIC's engines bind
//! memory windows for remote writes, which the model's do not.

use tessera_transport::TransportConfig;
use tessera_transport::rdma::engine::EngineConfig;

use crate::cluster::{AppEvent, Cluster, ClusterConfig, ClusterError};
use crate::incast::quantile;
use crate::net::{NetParams, Topology};
use crate::params::SwitchParams;

/// Bytes of the receiver's acknowledgement (the benchmark's `ACK_LEN`).
pub const ACK_BYTES: usize = 64;

/// One calibration run.
#[derive(Debug, Clone)]
pub struct CalibrationRun {
    /// The fabric: one ToR, the receiver host 0, sender `i` host `1 + i`.
    pub net: NetParams,
    /// Each sender's message sizes, cycled in order.
    pub sizes: Vec<Vec<usize>>,
    /// Messages each sender keeps outstanding.
    pub depth: usize,
    /// The engines' configuration, as the real run's transports have it.
    pub transport: TransportConfig,
    /// Virtual time senders start messages for, ns (then they drain).
    pub until_ns: u64,
    /// The seed.
    pub seed: u64,
}

impl CalibrationRun {
    /// Senders with `sizes` (one list each) into one receiver on a ToR at
    /// `link_mbps`, 4 outstanding each, the engines configured from
    /// `transport`, for `until_ns`. The NICs' MTU is the soft port's
    /// (4,096 bytes); DCQCN is off (the soft NIC has none).
    pub fn new(
        sizes: Vec<Vec<usize>>,
        link_mbps: u64,
        transport: TransportConfig,
        until_ns: u64,
        seed: u64,
    ) -> Self {
        let hosts = u32::try_from(sizes.len())
            .unwrap_or(u32::MAX)
            .saturating_add(1);
        let mut net = NetParams::new(Topology::Tor { hosts });
        net.link.rate_bps = link_mbps.saturating_mul(1_000_000);
        net.switch = SwitchParams::for_nic_rate(net.link.rate_bps);
        net.rnic.mtu = 4096;
        Self {
            net,
            sizes,
            depth: 4,
            transport,
            until_ns,
            seed,
        }
    }

    /// The engines' configuration (`rdma::connection::engine_config`).
    pub fn engine_config(&self) -> EngineConfig {
        tessera_transport::rdma::connection::engine_config(&self.transport, 0, 1, false)
    }
}

/// What a calibration run measured.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CalibrationOutcome {
    /// Payload bytes acknowledged.
    pub bytes: u64,
    /// Payload bytes acknowledged, per sender.
    pub sender_bytes: Vec<u64>,
    /// From the first send to the last acknowledgement, ns.
    pub elapsed_ns: u64,
    /// Each message's latency, ns, sorted.
    pub latencies_ns: Vec<u64>,
    /// PFC pauses.
    pub pauses: u64,
    /// Engines that failed.
    pub failed: u32,
    /// Events handled.
    pub events: u64,
}

impl CalibrationOutcome {
    /// Goodput, bytes per second.
    pub fn goodput_bytes_per_sec(&self) -> f64 {
        self.bytes as f64 * 1e9 / self.elapsed_ns.max(1) as f64
    }

    /// The least sender's bytes over the most's (1: the link was shared
    /// evenly).
    pub fn sender_bytes_min_over_max(&self) -> f64 {
        let least = self.sender_bytes.iter().copied().min().unwrap_or(0);
        let most = self.sender_bytes.iter().copied().max().unwrap_or(0);
        least as f64 / most.max(1) as f64
    }

    /// The `q`-quantile of latency, ns.
    pub fn latency_quantile(&self, q: f64) -> u64 {
        quantile(&self.latencies_ns, q)
    }
}

#[derive(Debug, Default)]
struct Sender {
    /// Send instants and sizes of the outstanding messages, oldest first
    /// (a socket delivers in order, and so do the acknowledgements).
    outstanding: std::collections::VecDeque<(u64, usize)>,
    next: usize,
}

/// Runs one calibration (module docs).
pub fn run(run: &CalibrationRun) -> Result<CalibrationOutcome, ClusterError> {
    let mut cluster = Cluster::new(ClusterConfig {
        net: run.net,
        engine: run.engine_config(),
        seed: run.seed,
    })?;
    let mut dialers = Vec::with_capacity(run.sizes.len());
    for i in 0..run.sizes.len() {
        let host = u32::try_from(i + 1).unwrap_or(u32::MAX);
        let (s, _) = cluster.connect(host, 0)?;
        dialers.push(s);
    }
    let sockets = cluster.open_all(&dialers)?;
    let index: std::collections::HashMap<_, _> =
        dialers.iter().enumerate().map(|(i, &c)| (c, i)).collect();
    let mut senders: Vec<Sender> = (0..run.sizes.len()).map(|_| Sender::default()).collect();
    let t0 = cluster.now();
    let stop = t0.saturating_add(run.until_ns);
    let mut out = CalibrationOutcome {
        sender_bytes: vec![0; run.sizes.len()],
        ..CalibrationOutcome::default()
    };
    let pauses_before = cluster.net().pauses().count();
    let send_next = |cluster: &mut Cluster, i: usize, sender: &mut Sender| {
        let (Some(list), Some(Some(socket))) = (run.sizes.get(i), sockets.get(i)) else {
            return Ok(());
        };
        if list.is_empty() {
            return Ok(());
        }
        let len = list[sender.next % list.len()];
        sender.next += 1;
        let host = u32::try_from(i + 1).unwrap_or(u32::MAX);
        let m = cluster.message(host, len, 0xac)?;
        sender.outstanding.push_back((cluster.now(), len));
        cluster.send(dialers[i], *socket, m)
    };
    for (i, sender) in senders.iter_mut().enumerate() {
        for _ in 0..run.depth {
            send_next(&mut cluster, i, sender)?;
        }
    }
    // Drained when nothing is outstanding; a run that cannot drain (a
    // failed engine) ends a second of virtual time after `stop`.
    let limit = stop.saturating_add(1_000_000_000);
    let mut last = t0;
    while senders.iter().any(|s| !s.outstanding.is_empty()) {
        let Some((now, event)) = cluster.next(limit) else {
            break;
        };
        match event {
            AppEvent::Message { conn, socket, .. } => match index.get(&conn) {
                // An acknowledgement at a sender.
                Some(&i) => {
                    let sender = &mut senders[i];
                    if let Some((sent, len)) = sender.outstanding.pop_front() {
                        out.latencies_ns.push(now - sent);
                        out.bytes += len as u64;
                        out.sender_bytes[i] += len as u64;
                        last = now;
                    }
                    if now < stop {
                        send_next(&mut cluster, i, sender)?;
                    }
                }
                // A message at the receiver: acknowledge it.
                None => {
                    let m = cluster.message(0, ACK_BYTES, 0xac)?;
                    cluster.send(conn, socket, m)?;
                }
            },
            AppEvent::Failed { .. } => out.failed += 1,
            _ => {}
        }
    }
    out.latencies_ns.sort_unstable();
    out.elapsed_ns = last - t0;
    out.pauses = cluster.net().pauses().count() - pauses_before;
    out.events = cluster.events();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes(senders: usize) -> Vec<Vec<usize>> {
        (0..senders)
            .map(|s| (0..8).map(|k| 20_480 + 3_840 * ((s + k) % 9)).collect())
            .collect()
    }

    #[test]
    fn the_receivers_link_is_full_and_latency_is_the_queue_it_holds() {
        // 8 senders x 4 outstanding of about 35 KB into a 2 Gbit/s link:
        // the link runs full, and by Little's law a message waits for
        // about the bytes outstanding (about 1.1 MB) at the link's rate.
        let mut transport = TransportConfig::soft_rdma();
        transport.rdma.fragment_size = 64 << 10;
        let r = CalibrationRun::new(sizes(8), 2_000, transport, 100_000_000, 1);
        let o = run(&r).unwrap();
        assert_eq!(o.failed, 0);
        let rate = o.goodput_bytes_per_sec();
        assert!(rate > 0.9 * 250e6 && rate <= 250e6, "{rate}");
        let outstanding: usize = r
            .sizes
            .iter()
            .map(|s| 4 * s.iter().sum::<usize>() / s.len())
            .sum();
        let little = outstanding as f64 / 250e6 * 1e9;
        let p50 = o.latency_quantile(0.5) as f64;
        assert!(p50 > 0.8 * little && p50 < 1.2 * little, "{p50} {little}");
        // The switch serves the senders in turn (within a few messages
        // in 100 ms).
        assert!(o.sender_bytes_min_over_max() > 0.8, "{o:?}");
    }
}
