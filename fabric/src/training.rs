//! The paper's training fleet (Table 7) with Tessera's real engines: P
//! parameter servers and T trainers on a leaf-spine, every trainer
//! connected to every server (one queue pair each way, as QP
//! multiplexing leaves one per peer). Each trainer runs steps: a Fetch
//! fans a request out to every server, each answering with the rows
//! asked for; once all have answered the trainer computes for
//! `compute_ns`, then a Push fans its gradients out to every server,
//! each acknowledging; then the next step. Answer and gradient sizes are
//! drawn from the paper's training distribution (20 KB mean, 50 KB p99);
//! a request carries one key (8 bytes) per 256-byte row asked for, an
//! acknowledgement 64 bytes. Trainers start at random instants in the
//! first step's time so that they do not march in step, or, with
//! `synchronous`, all at once and again after every step's last Push
//! (a barrier, as synchronous training has).
//!
//! Two controls are compared, as in the paper: `hw` (DCQCN at every NIC
//! and PFC in the fabric, no software window) and `hw+window` (the same
//! with Tessera's send window). Measured: each Fetch's and Push's
//! latency (the trainer's call, request to its last answer), PFC pause
//! time, retransmissions.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tessera_transport::TransportConfig;
use tessera_transport::rdma::engine::{EngineConfig, SocketId};

use crate::cluster::{AppEvent, Cluster, ClusterConfig, ClusterError, ConnId};
use crate::dcqcn::DcqcnParams;
use crate::incast::{MessageSizes, PER_LEAF, SPINES, quantile};
use crate::net::{NetParams, Topology};

/// One training run.
#[derive(Debug, Clone)]
pub struct TrainingRun {
    /// The fabric (hosts placed by `placement`).
    pub net: NetParams,
    /// Parameter servers.
    pub servers: u32,
    /// Trainers.
    pub trainers: u32,
    /// Every engine's send window, bytes (0: none).
    pub window: usize,
    /// Answer and gradient sizes.
    pub sizes: MessageSizes,
    /// A trainer's compute between its Fetch and its Push, ns.
    pub compute_ns: u64,
    /// Virtual time the run takes, ns.
    pub until_ns: u64,
    /// Where servers and trainers sit.
    pub placement: Placement,
    /// Synchronous steps: every trainer starts each step at once, after
    /// the last one's Push (a barrier, as synchronous training has);
    /// otherwise each trainer runs its own steps from a random start.
    pub synchronous: bool,
    /// The seed.
    pub seed: u64,
}

/// Where a fleet's servers and trainers sit on the leaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Placement {
    /// Servers on the first hosts (hence the first leaves, 16 to a leaf),
    /// trainers after them: racks of servers and racks of trainers.
    #[default]
    Grouped,
    /// Servers spread evenly over all hosts, trainers in between: every
    /// rack holds both, in the fleet's proportion.
    Interleaved,
}

impl Placement {
    /// The hosts of `servers` servers and `trainers` trainers, in order.
    pub fn hosts(self, servers: u32, trainers: u32) -> (Vec<u32>, Vec<u32>) {
        let total = servers + trainers;
        match self {
            Placement::Grouped => ((0..servers).collect(), (servers..total).collect()),
            Placement::Interleaved => {
                let server_hosts: Vec<u32> = (0..servers)
                    .map(|s| {
                        let h = u64::from(s) * u64::from(total) / u64::from(servers.max(1));
                        u32::try_from(h).unwrap_or(u32::MAX)
                    })
                    .collect();
                let trainer_hosts = (0..total)
                    .filter(|h| server_hosts.binary_search(h).is_err())
                    .collect();
                (server_hosts, trainer_hosts)
            }
        }
    }
}

impl TrainingRun {
    /// `servers` x `trainers` on a leaf-spine at 25 Gbit/s with DCQCN on,
    /// window `window`, 1 ms of compute per step, for `until_ns`.
    pub fn new(servers: u32, trainers: u32, window: usize, until_ns: u64, seed: u64) -> Self {
        let hosts = servers + trainers;
        let mut net = NetParams::new(Topology::LeafSpine {
            leaves: hosts.div_ceil(PER_LEAF),
            spines: SPINES,
            per_leaf: PER_LEAF,
        });
        net.dcqcn = Some(DcqcnParams::for_line_rate(net.link.rate_bps));
        Self {
            net,
            servers,
            trainers,
            window,
            sizes: MessageSizes::default(),
            compute_ns: 1_000_000,
            until_ns,
            placement: Placement::Grouped,
            synchronous: false,
            seed,
        }
    }

    /// The engines' configuration: what a transport of the default
    /// configuration runs with this window, and 8 receives of 2 KB per
    /// queue pair (a fleet of 124 x 346
    /// holds 85,808 engines in one process; larger messages go by
    /// RTS/CTS and WRITE, as most of these do anyway).
    pub fn engine_config(&self) -> EngineConfig {
        let mut transport = TransportConfig::default();
        transport.rdma.recv_queue_depth = 8;
        transport.rdma.small_message_limit = 2048;
        transport.rdma.window_bytes = self.window;
        tessera_transport::rdma::connection::engine_config(&transport, 0, 1, false)
    }
}

/// What a training run measured.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TrainingOutcome {
    /// Each Fetch's latency (all servers answered), ns, sorted; one still
    /// under way at the end counts at its age.
    pub fetch_ns: Vec<u64>,
    /// Each Push's latency (all servers acknowledged), ns, sorted; as
    /// Fetch's.
    pub push_ns: Vec<u64>,
    /// PFC pauses sent.
    pub pauses: u64,
    /// Time paused, summed over ports, ns.
    pub paused_ns: u64,
    /// Packets sent again, all NICs.
    pub retransmitted: u64,
    /// Packets dropped.
    pub drops: u64,
    /// CNPs sent by notification points.
    pub cnps: u64,
    /// Events handled.
    pub events: u64,
    /// Engines that failed.
    pub failed: u32,
}

impl TrainingOutcome {
    /// The `q`-quantile of Fetch latency, ns.
    pub fn fetch_quantile(&self, q: f64) -> u64 {
        quantile(&self.fetch_ns, q)
    }

    /// The `q`-quantile of Push latency, ns.
    pub fn push_quantile(&self, q: f64) -> u64 {
        quantile(&self.push_ns, q)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Waiting,
    Fetching,
    Computing,
    Pushing,
}

#[derive(Debug)]
struct Trainer {
    phase: Phase,
    started: u64,
    answered: u32,
    /// Its end of each connection (to server s) and socket.
    ends: Vec<(ConnId, SocketId)>,
}

/// What a connection end is, by id.
#[derive(Debug, Clone, Copy)]
enum End {
    Trainer(u32),
    Server(u32),
}

/// Every trainer's connection to every server, with its socket open and
/// accepted (dialers run trainer by trainer, server by server): which end
/// each connection id is, and the trainers with their ends.
fn connect(
    cluster: &mut Cluster,
    p: u32,
    t: u32,
    server_host: &[u32],
    trainer_host: &[u32],
) -> Result<(Vec<Option<End>>, Vec<Trainer>), ClusterError> {
    let mut ends_of: Vec<Option<End>> = Vec::new();
    let mut trainers: Vec<Trainer> = Vec::with_capacity(t as usize);
    let mut dialers = Vec::new();
    for tr in 0..t {
        for s in 0..p {
            let (a, b) = cluster.connect(trainer_host[tr as usize], server_host[s as usize])?;
            let need = a.max(b) + 1;
            if ends_of.len() < need {
                ends_of.resize(need, None);
            }
            ends_of[a] = Some(End::Trainer(tr));
            ends_of[b] = Some(End::Server(s));
            dialers.push(a);
        }
        trainers.push(Trainer {
            phase: Phase::Waiting,
            started: 0,
            answered: 0,
            ends: Vec::with_capacity(p as usize),
        });
    }
    // Every trainer's sockets, opened and accepted (dialers run trainer
    // by trainer, server by server).
    let sockets = cluster.open_all(&dialers)?;
    for (&conn, socket) in dialers.iter().zip(sockets) {
        if let (Some(socket), Some(Some(End::Trainer(tr)))) = (socket, ends_of.get(conn)) {
            trainers[*tr as usize].ends.push((conn, socket));
        }
    }
    Ok((ends_of, trainers))
}

/// Runs one training fleet (module docs).
pub fn run(run: &TrainingRun) -> Result<TrainingOutcome, ClusterError> {
    let mut cluster = Cluster::new(ClusterConfig {
        net: run.net,
        engine: run.engine_config(),
        seed: run.seed,
    })?;
    let mut rng = ChaCha8Rng::seed_from_u64(run.seed ^ 0x7a1e);
    let (p, t) = (run.servers, run.trainers);
    let (server_host, trainer_host) = run.placement.hosts(p, t);
    let (ends_of, mut trainers) = connect(&mut cluster, p, t, &server_host, &trainer_host)?;
    let t0 = cluster.now();
    let pauses_before = cluster.net().pauses().count();
    let paused_before = cluster
        .net()
        .pauses()
        .paused_ns(tessera_sim::SimTime::from_nanos(t0))
        .0;
    // Staggered starts over one step's worth of compute, or all at once.
    for tr in 0..t {
        let at = match run.synchronous {
            true => t0,
            false => t0 + rng.random_range(0..run.compute_ns.max(1)),
        };
        cluster.wake_at(at, u64::from(tr));
    }
    let mut at_barrier = 0u32;
    let end = t0.saturating_add(run.until_ns);
    let mut out = TrainingOutcome::default();
    // Wake tokens: trainer index for "start a Fetch", + (1 << 32) for
    // "computed: Push".
    const PUSH: u64 = 1 << 32;
    while let Some((now, event)) = cluster.next(end) {
        match event {
            AppEvent::Wake(token) => {
                let tr = (token & (PUSH - 1)) as usize;
                let push = token & PUSH != 0;
                let trainer = &mut trainers[tr];
                trainer.started = now;
                trainer.answered = 0;
                trainer.phase = if push {
                    Phase::Pushing
                } else {
                    Phase::Fetching
                };
                let host = trainer_host[tr];
                for i in 0..trainers[tr].ends.len() {
                    let (conn, socket) = trainers[tr].ends[i];
                    let len = if push {
                        run.sizes.draw(&mut rng)
                    } else {
                        (run.sizes.draw(&mut rng) / 32).max(64)
                    };
                    let m = cluster.message(host, len, if push { 0x50 } else { 0xf0 })?;
                    cluster.send(conn, socket, m)?;
                }
            }
            AppEvent::Message {
                conn,
                socket,
                bytes,
            } => match ends_of.get(conn).copied().flatten() {
                Some(End::Server(s)) => {
                    // A Fetch request (keys: 1/32 of the answer) or a
                    // Push's gradients: the first byte says which.
                    let fetch = bytes.first() == Some(&0xf0);
                    let len = if fetch { run.sizes.draw(&mut rng) } else { 64 };
                    let m = cluster.message(server_host[s as usize], len, 0xa0)?;
                    cluster.send(conn, socket, m)?;
                }
                Some(End::Trainer(tr)) => {
                    let trainer = &mut trainers[tr as usize];
                    trainer.answered += 1;
                    if trainer.answered < p {
                        continue;
                    }
                    let took = now - trainer.started;
                    match trainer.phase {
                        Phase::Fetching => {
                            out.fetch_ns.push(took);
                            trainer.phase = Phase::Computing;
                            cluster.wake_at(now + run.compute_ns, u64::from(tr) | PUSH);
                        }
                        Phase::Pushing => {
                            out.push_ns.push(took);
                            trainer.phase = Phase::Waiting;
                            if !run.synchronous {
                                cluster.wake_at(now, u64::from(tr));
                            } else {
                                at_barrier += 1;
                                if at_barrier == t {
                                    at_barrier = 0;
                                    for tr in 0..t {
                                        cluster.wake_at(now, u64::from(tr));
                                    }
                                }
                            }
                        }
                        Phase::Waiting | Phase::Computing => {}
                    }
                }
                None => {}
            },
            AppEvent::Failed { .. } => out.failed += 1,
            _ => {}
        }
    }
    // Calls still under way at the end count at their age so far (left
    // out, the slowest would be the ones missing from the tail).
    for trainer in &trainers {
        let age = end.saturating_sub(trainer.started);
        match trainer.phase {
            Phase::Fetching => out.fetch_ns.push(age),
            Phase::Pushing => out.push_ns.push(age),
            Phase::Waiting | Phase::Computing => {}
        }
    }
    out.fetch_ns.sort_unstable();
    out.push_ns.sort_unstable();
    let net = cluster.net();
    let log = net.pauses();
    out.pauses = log.count() - pauses_before;
    out.paused_ns = log
        .paused_ns(tessera_sim::SimTime::from_nanos(end))
        .0
        .saturating_sub(paused_before);
    for h in 0..net.hosts() {
        let stats = net.nic(h).stats();
        out.retransmitted += stats.retransmitted;
        out.cnps += stats.cnps_sent;
    }
    out.drops = net.stats().drops;
    out.events = cluster.events();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interleaved_placement_puts_servers_in_every_rack_in_proportion() {
        let (servers, trainers) = Placement::Interleaved.hosts(124, 346);
        let mut all: Vec<u32> = servers.iter().chain(&trainers).copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..470).collect::<Vec<_>>());
        // 30 leaves of 16 (the last one short): 4 or 5 servers on each.
        let mut per_leaf = [0u32; 30];
        for h in &servers {
            per_leaf[(*h / PER_LEAF) as usize] += 1;
        }
        assert!(
            per_leaf[..29].iter().all(|&n| (4..=5).contains(&n)),
            "{per_leaf:?}"
        );
        let (grouped, _) = Placement::Grouped.hosts(124, 346);
        assert_eq!(grouped, (0..124).collect::<Vec<_>>());
    }

    #[test]
    fn synchronous_trainers_wait_for_each_other_at_every_step() {
        let mut r = TrainingRun::new(4, 6, 4096, 20_000_000, 3);
        r.synchronous = true;
        let o = run(&r).unwrap();
        assert_eq!((o.failed, o.drops), (0, 0), "{o:?}");
        // Every step has all six trainers' Fetches: a whole number of
        // steps (a Fetch under way at the end counts at its age, and a
        // step's Fetches all start before any of its Pushes ends).
        assert!(o.fetch_ns.len() >= 6 * 5, "{}", o.fetch_ns.len());
        assert_eq!(o.fetch_ns.len() % 6, 0, "{}", o.fetch_ns.len());
        // Staggered, the counts need not be multiples of six.
        r.synchronous = false;
        let staggered = run(&r).unwrap();
        assert_ne!(staggered.fetch_ns, o.fetch_ns);
    }

    #[test]
    fn a_small_fleet_trains_in_steps_with_every_fetch_and_push_answered() {
        let r = TrainingRun::new(4, 6, 4096, 20_000_000, 3);
        let o = run(&r).unwrap();
        assert_eq!((o.failed, o.drops), (0, 0), "{o:?}");
        // 20 ms of 1 ms compute and short calls: several steps each.
        assert!(o.fetch_ns.len() >= 6 * 5, "{}", o.fetch_ns.len());
        assert!(o.push_ns.len() >= 6 * 5, "{}", o.push_ns.len());
        assert!(o.fetch_quantile(0.5) < 1_000_000, "{o:?}");
    }
}
