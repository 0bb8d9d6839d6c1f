//! A stateful model of engines on rails (issue 57): two hosts, A (the
//! dialer) and B (the acceptor, its grants on a server's inbound budget),
//! joined by one engine pair on each of 2 or 3 rails, each engine on its
//! own I/O worker (one per host and rail, as the transport runs them), the
//! engines of a host partners of each other. Large messages are striped:
//! the socket's *home* engine asks for the destination (RTS/CTS, or an
//! offer of the peer) and hands chunks to its partners on the other rails,
//! which write them into the same destination through their own queue
//! pairs, with the keys the grant told for their rails.
//!
//! **What runs.** Per seed, a random schedule from a seeded RNG of: one
//! round of one worker; an application sending a message (small, large,
//! or large enough to stripe) on either end of a socket, or reading what
//! arrived; the (hand-moved) clock advancing; the handshake connection of
//! an engine the worker dropped closing (the peer engine is told, as the
//! connection table tells it); and faults: a queue pair in error (with or
//! without the device's event), an engine that panics (a bug, isolated by
//! the worker), a handshake connection that breaks, and a worker that
//! stops while the clock passes `grant_timeout` (a peer that took its
//! grants and never writes). Half the seeds also have the soft NIC delay
//! completions, some have it fail work requests at random. No sleep, and
//! no decision by the real clock: the workers read the model's clock.
//!
//! **What is checked.** After every worker round: (a) every RDMA WRITE
//! the round carried out landed inside a destination the receiving host
//! held out at that moment: a grant or offer of one of its engines (alive,
//! failed or panicked, until the worker drops it), or a buffer held for
//! late writes (`late.rs`); anything else is memory that went back to the
//! pool. After every read: (b) a message arrives at most once, in order,
//! intact. At the end, after a drain with no faults that must reach
//! quiescence within a bound of rounds: (b) every message was delivered,
//! or the receiving socket failed, and a socket failed at one end failed
//! at the other; (c) nothing leaks: a live engine is idle, has nothing
//! granted but its offers, no chunk out or held (its rails' counters at
//! zero), the workers route no chunk answers, the inbound budget is whole;
//! and once every engine is failed and dropped, no buffer is held for late
//! writes and both hosts' pools have nothing in use.
//!
//! `TESSERA_MODEL_SEEDS` sets how many seeds run (default 200), and
//! `TESSERA_MODEL_SEED` runs one alone. A failure names its seed and the
//! last steps.

use std::collections::VecDeque;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::FutureExt;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::{mpsc, oneshot};

use super::testkit::{AttachedView, attached, caps, worker};
use super::*;
use crate::inbound::InboundBudget;
use crate::pool::{Access, Pool, PoolConfig};
use crate::rdma::engine::{Engine, EngineConfig, PeerInfo, Role, StripeConfig};
use crate::rdma::io::Partner;
use crate::verbs::soft::{SoftDevice, SoftFabric, SoftFaults, tap};
use crate::verbs::{AsyncEvent, Device, QueuePair};
use crate::{Connection, Message};

/// The hosts, as indices.
const A: usize = 0;
const B: usize = 1;
const SMALL: usize = 512;
const FRAGMENT: usize = 4 << 10;
const STRIPE_MIN: usize = 8 << 10;
const MAX_MESSAGE: usize = 40 << 10;
const RECV_DEPTH: u32 = 16;
const SEND_DEPTH: u32 = 32;
const GRANT_TIMEOUT: Duration = Duration::from_secs(2);
/// Messages a socket's sender may have queued.
const SOCKET_DEPTH: usize = 4;
const STEPS: usize = 200;
/// Rounds of every worker the final drain may take to reach quiescence.
const DRAIN_ROUNDS: usize = 3000;
/// Idle passes in a row that count as quiescence (delayed completions
/// come back within 2 polls).
const QUIET: usize = 6;
/// What every injected panic's message starts with.
const INJECTED: &str = "injected: an engine bug";

fn config(rail: usize, rails: usize, offers: bool) -> EngineConfig {
    EngineConfig {
        send_queue_depth: SEND_DEPTH,
        recv_queue_depth: RECV_DEPTH,
        small_message_limit: SMALL,
        fragment_size: FRAGMENT,
        max_message_size: MAX_MESSAGE as u64,
        rts_ahead: 2,
        max_granted_bytes: 3 * MAX_MESSAGE as u64,
        offers,
        rail,
        rails,
        stripe: Some(StripeConfig {
            min_bytes: STRIPE_MIN,
            chunk_bytes: FRAGMENT,
            depth: 2,
        }),
        grant_timeout: Some(GRANT_TIMEOUT),
        ..EngineConfig::default()
    }
}

/// Fills `buf` with message `tag`'s bytes: 8-byte words (tag, index).
fn fill(buf: &mut [u8], tag: u32) {
    for (k, chunk) in buf.chunks_mut(8).enumerate() {
        let word = ((u64::from(tag) << 32) | k as u64).to_le_bytes();
        chunk.copy_from_slice(&word[..chunk.len()]);
    }
}

/// Whether `bytes` are message `tag`'s.
fn intact(bytes: &[u8], tag: u32) -> bool {
    bytes.chunks(8).enumerate().all(|(k, chunk)| {
        let word = ((u64::from(tag) << 32) | k as u64).to_le_bytes();
        *chunk == word[..chunk.len()]
    })
}

struct Driver {
    worker: Worker,
    handle: IoThread,
    host: usize,
}

/// An engine as the model knows it.
struct EngineRef {
    host: usize,
    rail: usize,
    qpn: u32,
    qp: Weak<dyn QueuePair>,
    view: AttachedView,
    /// Sockets its peer opened (B's engines).
    accepted: Option<mpsc::Receiver<Connection>>,
    /// Its worker dropped it (its handshake connection closed).
    gone: bool,
    /// Its peer was told so.
    told: bool,
}

struct Host {
    send_pool: Pool,
    recv_pool: Pool,
    /// B's: the server's budget of large inbound messages.
    budget: Option<InboundBudget>,
}

/// A socket, end 0 on A and end 1 on B.
struct Socket {
    rail: usize,
    ends: [Connection; 2],
    /// Per end, what it sent: (tag, length), in order.
    sent: [Vec<(u32, usize)>; 2],
    /// Per end, how many of the other end's messages it received.
    got: [usize; 2],
    /// Per end, the error its receiver ended with.
    failed: [Option<String>; 2],
}

// Field order is drop order: the workers (engines, queue pairs) first.
struct Model {
    drivers: Vec<Driver>,
    engines: Vec<EngineRef>,
    sockets: Vec<Socket>,
    hosts: [Host; 2],
    _devices: Vec<SoftDevice>,
    _fabric: SoftFabric,
    seed: u64,
    rng: StdRng,
    rails: usize,
    now: Instant,
    step: usize,
    next_tag: u32,
    faults_left: usize,
    /// Messages the applications still hold (the budget's bytes with them).
    held: VecDeque<Bytes>,
    /// The last steps, for a failure's message.
    log: VecDeque<String>,
    tally: Tally,
}

impl Model {
    fn new(seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let rails = rng.random_range(2..=3);
        let offers = rng.random_bool(0.5);
        let delays = rng.random_bool(0.5);
        let nic_errors = rng.random_bool(0.15);
        let faults_left = rng.random_range(0..=2);
        let fabric = SoftFabric::new();
        let now = Instant::now();
        let mut devices = Vec::new();
        let mut drivers = Vec::new();
        let hosts = [A, B].map(|host| {
            let rail_devices: Vec<SoftDevice> = (0..rails)
                .map(|rail| {
                    let faults = SoftFaults {
                        seed: seed.wrapping_mul(8) + (host * 4 + rail) as u64,
                        delay_per_million: if delays { 200_000 } else { 0 },
                        max_delay_polls: 2,
                        qp_error_per_million: if nic_errors { 1_000 } else { 0 },
                        ..SoftFaults::default()
                    };
                    fabric.open(format!("m{host}{rail}"), faults).unwrap()
                })
                .collect();
            let hooks: Vec<_> = rail_devices.iter().map(|d| d.registration_hook()).collect();
            let pool = |name: &str, access| {
                let config = PoolConfig {
                    block_size: 1 << 20,
                    max_class_size: 128 << 10,
                    ..PoolConfig::named(format!("model-{host}-{name}"))
                };
                Pool::on_rails(config, access, hooks.clone()).unwrap()
            };
            for device in &rail_devices {
                let (worker, handle) = worker(device.create_cq(1024).unwrap());
                drivers.push(Driver {
                    worker,
                    handle,
                    host,
                });
            }
            devices.extend(rail_devices);
            Host {
                send_pool: pool("send", Access::LocalOnly),
                recv_pool: pool("recv", Access::RemoteWrite),
                budget: (host == B).then(|| InboundBudget::new(4 * MAX_MESSAGE as u64)),
            }
        });
        let mut model = Self {
            drivers,
            engines: Vec::new(),
            sockets: Vec::new(),
            hosts,
            _devices: devices,
            _fabric: fabric,
            seed,
            rng,
            rails,
            now,
            step: 0,
            next_tag: 1,
            faults_left,
            held: VecDeque::new(),
            log: VecDeque::new(),
            tally: Tally::default(),
        };
        model.connect(offers);
        model
    }

    /// Driver (and engine) index of `host`'s `rail`.
    fn index(&self, host: usize, rail: usize) -> usize {
        host * self.rails + rail
    }

    /// An engine pair on every rail, partners per host, as the handshake
    /// and the partner groups set them up; then the sockets.
    fn connect(&mut self, offers: bool) {
        // Queue pairs and engines, by index (host, then rail).
        let mut made = Vec::new();
        for host in [A, B] {
            for rail in 0..self.rails {
                let index = self.index(host, rail);
                let cq = Arc::clone(&self.drivers[index].handle.cq);
                let qp = self._devices[index]
                    .create_qp(Arc::clone(&cq), cq, caps(SEND_DEPTH, RECV_DEPTH))
                    .unwrap();
                qp.init().unwrap();
                let role = if host == A {
                    Role::Dialer
                } else {
                    Role::Acceptor
                };
                let pools = &self.hosts[host];
                let mut engine = Engine::new(
                    config(rail, self.rails, offers),
                    pools.send_pool.clone(),
                    pools.recv_pool.clone(),
                    role,
                    self.now,
                )
                .unwrap();
                if let Some(budget) = &pools.budget {
                    engine.set_inbound_budget(budget.clone());
                }
                qp.post_recv(&engine.poll_recv_post().unwrap()).unwrap();
                let info = PeerInfo {
                    recv_depth: RECV_DEPTH,
                    recv_buffer: engine.recv_buffer_size() as u32,
                    keepalive_slot: None,
                    shared_receives: false,
                };
                made.push((host, rail, qp, engine, info));
            }
        }
        for rail in 0..self.rails {
            let (a, b) = (self.index(A, rail), self.index(B, rail));
            made[a].2.connect(&made[b].2.endpoint()).unwrap();
            made[b].2.connect(&made[a].2.endpoint()).unwrap();
        }
        let infos: Vec<PeerInfo> = made.iter().map(|m| m.4).collect();
        for (index, (host, rail, qp, engine, _)) in made.into_iter().enumerate() {
            let qpn = qp.qpn();
            let weak = Arc::downgrade(&qp);
            let (accepts, accepted) = match host {
                B => {
                    let (tx, rx) = mpsc::channel(16);
                    (Some(tx), Some(rx))
                }
                _ => (None, None),
            };
            let (attached, view) = attached(qp, engine, accepts, MAX_MESSAGE as u64, SOCKET_DEPTH);
            let handle = &self.drivers[index].handle;
            handle.submit(Command::Attach(Box::new(attached)));
            let peer = self.index(1 - host, rail);
            handle.submit(Command::PeerReady {
                qpn,
                info: infos[peer],
            });
            self.engines.push(EngineRef {
                host,
                rail,
                qpn,
                qp: weak,
                view,
                accepted,
                gone: false,
                told: false,
            });
        }
        // Partners: the host's engines on the other rails.
        for me in 0..self.engines.len() {
            let (host, rail) = (self.engines[me].host, self.engines[me].rail);
            let partners = (0..self.rails)
                .filter(|&r| r != rail)
                .map(|r| {
                    let other = self.index(host, r);
                    Partner {
                        rail: r,
                        io: self.drivers[other].handle.clone(),
                        qpn: self.engines[other].qpn,
                        alive: Arc::clone(&self.engines[other].view.alive),
                    }
                })
                .collect();
            self.drivers[me].handle.submit(Command::Partners {
                qpn: self.engines[me].qpn,
                partners,
            });
        }
        self.settle("setting up");
        // Sockets, opened by A's application one at a time (so that the
        // connection B's listener gets is known to be that one).
        for _ in 0..self.rng.random_range(2..=4) {
            let rail = self.rng.random_range(0..self.rails);
            let home = self.index(A, rail);
            let (reply, mut opened) = oneshot::channel();
            self.drivers[home].handle.submit(Command::Open {
                qpn: self.engines[home].qpn,
                reply,
            });
            self.settle("opening a socket");
            let dialed = opened
                .try_recv()
                .expect("the socket was opened")
                .expect("the socket was accepted");
            let peer = self.index(B, rail);
            let accepted = self.engines[peer]
                .accepted
                .as_mut()
                .and_then(|rx| rx.try_recv().ok())
                .expect("B's listener got the socket");
            self.sockets.push(Socket {
                rail,
                ends: [dialed, accepted],
                sent: [Vec::new(), Vec::new()],
                got: [0, 0],
                failed: [None, None],
            });
        }
    }
}

/// What the runs did, summed over seeds (printed: a model that stopped
/// exercising something shows it).
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    sent: u64,
    delivered: u64,
    writes_checked: u64,
    faults: u64,
    sockets_failed: u64,
    stripe_chunks: u64,
    stripe_redone: u64,
    late_holds: u64,
}

impl std::ops::AddAssign for Tally {
    fn add_assign(&mut self, o: Self) {
        self.sent += o.sent;
        self.delivered += o.delivered;
        self.writes_checked += o.writes_checked;
        self.faults += o.faults;
        self.sockets_failed += o.sockets_failed;
        self.stripe_chunks += o.stripe_chunks;
        self.stripe_redone += o.stripe_redone;
        self.late_holds += o.late_holds;
    }
}

impl Model {
    /// Fails the run, naming the seed, the step and the last steps.
    #[track_caller]
    fn fail(&self, what: &str) -> ! {
        let steps: Vec<&str> = self.log.iter().map(String::as_str).collect();
        panic!(
            "rails model, seed {} (TESSERA_MODEL_SEED={}), step {}: {what}\nlast steps:\n  {}",
            self.seed,
            self.seed,
            self.step,
            steps.join("\n  ")
        );
    }

    fn note(&mut self, note: String) {
        if self.log.len() == 40 {
            self.log.pop_front();
        }
        self.log.push_back(format!("{}: {note}", self.step));
    }

    /// Every range `host` holds out to its peer's writes now: its engines'
    /// grants and offers (whatever state they are in, until their worker
    /// drops them) and its workers' buffers held for late writes.
    fn destinations(&self, host: usize) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        for driver in self.drivers.iter().filter(|d| d.host == host) {
            for slot in driver.worker.engines.values() {
                out.extend(slot.attached.engine.destinations());
            }
            out.extend(driver.worker.late.ranges());
        }
        out
    }

    /// One round of worker `d` at the model's clock; checks (a) for every
    /// WRITE it carried out. Whether it did anything.
    fn round(&mut self, d: usize) -> bool {
        let peer = 1 - self.drivers[d].host;
        let live = self.destinations(peer);
        tap::take();
        let before = self.drivers[d].worker.late.buffers();
        let driver = &mut self.drivers[d];
        driver.worker.clock.fixed = Some(self.now);
        let progress = driver.worker.round().expect("the worker's handle lives");
        let writes = tap::take();
        self.tally.writes_checked += writes.len() as u64;
        if self.drivers[d].worker.late.buffers() > before {
            self.tally.late_holds += 1;
        }
        for (addr, len) in writes {
            let inside = live
                .iter()
                .any(|&(start, n)| addr >= start && addr + len <= start + n);
            if !inside {
                self.fail(&format!(
                    "(a) a WRITE of {len} bytes at {addr:#x} by worker {d} landed outside every \
                     destination host {} held out (grants, offers, buffers held for late \
                     writes): memory back in the pool, or handed on",
                    ["A", "B"][peer]
                ));
            }
        }
        progress
    }

    /// Engines whose worker dropped them: their peers are told, as their
    /// handshake connection closes. Whether any was.
    fn notice(&mut self) -> bool {
        let mut any = false;
        for e in 0..self.engines.len() {
            let engine = &mut self.engines[e];
            if !engine.gone
                && matches!(
                    engine.view.control.try_recv(),
                    Err(oneshot::error::TryRecvError::Closed)
                )
            {
                engine.gone = true;
            }
            if engine.gone && !engine.told {
                engine.told = true;
                any = true;
                let peer = (1 - engine.host) * self.rails + engine.rail;
                let qpn = self.engines[peer].qpn;
                self.drivers[peer]
                    .handle
                    .submit(Command::PeerClosed { qpn });
                self.note(format!("engine {e} gone: its peer {peer} told"));
            }
        }
        any
    }

    /// Reads what arrived at `end` of socket `s`, checking (b) as it goes.
    /// Whether anything came.
    fn read(&mut self, s: usize, end: usize) -> bool {
        let mut any = false;
        loop {
            let socket = &mut self.sockets[s];
            if socket.failed[end].is_some() {
                return any;
            }
            let Some(item) = socket.ends[end].receiver.recv().now_or_never() else {
                return any;
            };
            any = true;
            match item {
                Ok(Some(bytes)) => {
                    let from = 1 - end;
                    let Some(&(tag, len)) = socket.sent[from].get(socket.got[end]) else {
                        let got = socket.got[end];
                        self.fail(&format!(
                            "(b) socket {s} end {end} received a message of {} bytes past the \
                             {got} sent to it (delivered twice?)",
                            bytes.len()
                        ));
                    };
                    if bytes.len() != len || !intact(&bytes, tag) {
                        let first = bytes
                            .get(..8)
                            .map(|w| u64::from_le_bytes(w.try_into().unwrap()));
                        self.fail(&format!(
                            "(b) socket {s} end {end}: message {tag} ({len} bytes) arrived as {} \
                             bytes not its own (first word {first:#x?}): corrupted, out of order \
                             or twice",
                            bytes.len()
                        ));
                    }
                    socket.got[end] += 1;
                    self.tally.delivered += 1;
                    self.held.push_back(bytes);
                    if self.held.len() > 3 {
                        self.held.pop_front();
                    }
                }
                Ok(None) => self.fail(&format!(
                    "socket {s} end {end} ended cleanly, though no end closed"
                )),
                Err(err) => {
                    socket.failed[end] = Some(err.to_string());
                    self.tally.sockets_failed += 1;
                    self.note(format!("socket {s} end {end} failed: {err}"));
                }
            }
        }
    }

    /// `end` of socket `s` sends a message of `len` bytes.
    fn send(&mut self, s: usize, end: usize, len: usize) {
        let tag = self.next_tag;
        self.next_tag += 1;
        let mut buf = self.hosts[end].send_pool.alloc(len).unwrap();
        buf.set_len(len);
        fill(&mut buf, tag);
        let message = Message::from(buf.freeze());
        let socket = &mut self.sockets[s];
        let outcome = socket.ends[end].sender.send(message).now_or_never();
        let what = match outcome {
            Some(Ok(())) => {
                socket.sent[end].push((tag, len));
                self.tally.sent += 1;
                "queued"
            }
            Some(Err(_)) => "refused (the socket failed)",
            None => "no room (the socket's queue is full)",
        };
        self.note(format!(
            "socket {s} end {end} sends {tag} ({len} bytes): {what}"
        ));
    }

    /// Rounds of every worker, reads and notices until nothing moves
    /// (setup, and the final drain); fails if that never comes.
    fn settle(&mut self, what: &str) {
        let mut quiet = 0;
        for _ in 0..DRAIN_ROUNDS {
            let mut progress = false;
            for d in 0..self.drivers.len() {
                progress |= self.round(d);
            }
            for s in 0..self.sockets.len() {
                progress |= self.read(s, A);
                progress |= self.read(s, B);
            }
            progress |= self.notice();
            quiet = if progress { 0 } else { quiet + 1 };
            if quiet == QUIET {
                return;
            }
        }
        self.fail(&format!(
            "no quiescence {what} within {DRAIN_ROUNDS} rounds"
        ));
    }

    /// A random message length: small, large, or large enough to stripe.
    fn length(&mut self) -> usize {
        match self.rng.random_range(0..10) {
            0..3 => self.rng.random_range(0..=SMALL),
            3..5 => self.rng.random_range(SMALL + 1..STRIPE_MIN),
            _ => self.rng.random_range(STRIPE_MIN..=MAX_MESSAGE),
        }
    }

    /// One random step. Faults come at any step, and most often while
    /// striping is under way (where they have the most to get wrong).
    fn random_step(&mut self) {
        self.step += 1;
        if self.faults_left > 0 {
            let busy = self.busy();
            let chance = match (busy.is_empty(), busy.iter().any(|&(_, held)| held)) {
                (_, true) => 0.3,
                (false, false) => 0.05,
                (true, false) => 0.01,
            };
            if self.rng.random_bool(chance) {
                self.faults_left -= 1;
                self.tally.faults += 1;
                self.fault();
                return;
            }
        }
        let roll = self.rng.random_range(0..96);
        match roll {
            0..55 => {
                let d = self.rng.random_range(0..self.drivers.len());
                self.round(d);
            }
            55..70 => {
                let s = self.rng.random_range(0..self.sockets.len());
                let end = self.rng.random_range(0..2);
                let len = self.length();
                self.send(s, end, len);
            }
            70..82 => {
                let s = self.rng.random_range(0..self.sockets.len());
                let end = self.rng.random_range(0..2);
                self.read(s, end);
                // The application lets go of what it held.
                if self.rng.random_bool(0.5) {
                    self.held.clear();
                }
            }
            82..88 => {
                let ms = self.rng.random_range(0..50);
                self.now += Duration::from_millis(ms);
                self.note(format!("the clock moves {ms} ms"));
            }
            _ => {
                self.notice();
            }
        }
    }

    /// A random engine for a fault; most often one in the middle of
    /// striping (chunks of others held, its own out, or destinations held
    /// out), where a failure has the most to get wrong.
    fn pick_engine(&mut self) -> usize {
        let busy = self.busy();
        let partners: Vec<usize> = busy
            .iter()
            .copied()
            .filter(|&(_, held)| held)
            .map(|(e, _)| e)
            .collect();
        if !partners.is_empty() && self.rng.random_bool(0.6) {
            partners[self.rng.random_range(0..partners.len())]
        } else if !busy.is_empty() && self.rng.random_bool(0.75) {
            busy[self.rng.random_range(0..busy.len())].0
        } else {
            self.rng.random_range(0..self.engines.len())
        }
    }

    /// Live engines in the middle of striping: chunks of its own out, or
    /// grants out (not only offers), or chunks of others held (the flag).
    fn busy(&self) -> Vec<(usize, bool)> {
        (0..self.engines.len())
            .filter_map(|e| {
                let qpn = self.engines[e].qpn;
                let slot = self.drivers[e].worker.engines.get(&qpn)?;
                let engine = &slot.attached.engine;
                let [out, _, _, held] = engine.stripe_counts();
                let granting = engine.granted().0 > engine.offers_out().1;
                (!slot.panicked && !engine.is_failed() && (out + held > 0 || granting))
                    .then_some((e, held > 0))
            })
            .collect()
    }

    /// One injected fault, on a random engine or worker.
    fn fault(&mut self) {
        let e = self.pick_engine();
        // Engine e runs on worker e (one engine per host and rail).
        let d = e;
        let qpn = self.engines[e].qpn;
        match self.rng.random_range(0..10) {
            0..3 => {
                // The queue pair fails; the device says so, or not (the
                // engine learns of it from its next work request).
                let event = self.rng.random_bool(0.5);
                if let Some(qp) = self.engines[e].qp.upgrade() {
                    let _ = qp.fail();
                }
                if event {
                    self.drivers[d]
                        .handle
                        .submit(Command::Event(AsyncEvent::QpFailed { qpn }));
                }
                self.note(format!(
                    "fault: engine {e}'s queue pair fails (event: {event})"
                ));
            }
            3..7 => {
                let panicked = self.drivers[d]
                    .worker
                    .with_engine(qpn, |_| injected_panic())
                    .is_none();
                self.note(format!("fault: engine {e} panics ({panicked})"));
            }
            7..9 => {
                self.drivers[d].handle.submit(Command::PeerClosed { qpn });
                self.note(format!("fault: engine {e}'s handshake connection breaks"));
            }
            _ => {
                // Worker d stops while the clock passes the grant timeout:
                // its engines write none of the grants they hold.
                self.note(format!("fault: worker {d} stops past the grant timeout"));
                let others: Vec<usize> = (0..self.drivers.len()).filter(|&o| o != d).collect();
                for _ in 0..4 {
                    for &o in &others {
                        self.round(o);
                    }
                }
                self.now += GRANT_TIMEOUT + Duration::from_millis(1);
                for _ in 0..4 {
                    for &o in &others {
                        self.round(o);
                    }
                }
            }
        }
    }

    /// The checks at quiescence: (b) every message delivered or its socket
    /// failed (at both ends), (c) nothing left over on live engines.
    fn check_quiescent(&mut self) {
        let mut tally = self.tally;
        for (s, socket) in self.sockets.iter().enumerate() {
            for end in [A, B] {
                let from = 1 - end;
                let got = socket.got[end];
                if got < socket.sent[from].len() && socket.failed[end].is_none() {
                    let (tag, len) = socket.sent[from][got];
                    self.fail(&format!(
                        "(b) socket {s} (rail {}): message {tag} ({len} bytes) to end {end} was \
                         neither delivered nor its socket failed, at quiescence (it hangs); {} of \
                         {} arrived, the other end {}",
                        socket.rail,
                        got,
                        socket.sent[from].len(),
                        socket.failed[from].as_deref().unwrap_or("is healthy"),
                    ));
                }
            }
            if socket.failed[A].is_some() != socket.failed[B].is_some() {
                self.fail(&format!(
                    "(b) socket {s} failed at one end only: {:?}",
                    socket.failed
                ));
            }
        }
        for (d, driver) in self.drivers.iter().enumerate() {
            for (qpn, slot) in &driver.worker.engines {
                let engine = &slot.attached.engine;
                if slot.panicked || engine.is_failed() {
                    self.fail(&format!(
                        "(c) worker {d} still holds failed engine {qpn} at quiescence"
                    ));
                }
                tally.stripe_chunks += engine.stats().stripe_chunks;
                tally.stripe_redone += engine.stats().stripe_redone;
                let stripes = engine.stripe_counts();
                if stripes != [0; 4] {
                    self.fail(&format!(
                        "(c) engine {qpn} of worker {d}: striping left over at quiescence \
                         (unanswered, rails' counts, unpolled, held for others): {stripes:?}"
                    ));
                }
                let offered = engine.offers_out().1;
                if engine.granted() != (offered, 0) {
                    self.fail(&format!(
                        "(c) engine {qpn} of worker {d}: {:?} granted/waiting at quiescence, \
                         {offered} of it offers",
                        engine.granted()
                    ));
                }
                if !engine.is_idle() {
                    self.fail(&format!(
                        "(c) engine {qpn} of worker {d} is not idle at quiescence"
                    ));
                }
            }
            if driver.worker.origins.len() != 0 {
                self.fail(&format!(
                    "(c) worker {d} routes answers for {} origins at quiescence",
                    driver.worker.origins.len()
                ));
            }
        }
        self.tally = tally;
        self.held.clear();
        if let Some(budget) = &self.hosts[B].budget
            && budget.available() != budget.capacity()
        {
            self.fail(&format!(
                "(c) B's inbound budget: {} of {} bytes available at quiescence",
                budget.available(),
                budget.capacity()
            ));
        }
    }

    /// Every engine fails (its handshake connection breaks), and every one
    /// goes: then nothing is held for late writes and the pools are empty.
    fn check_teardown(&mut self) {
        for e in 0..self.engines.len() {
            let (d, qpn) = (e, self.engines[e].qpn);
            self.drivers[d].handle.submit(Command::PeerClosed { qpn });
        }
        self.settle("tearing down");
        for (d, driver) in self.drivers.iter().enumerate() {
            if !driver.worker.engines.is_empty() {
                self.fail(&format!(
                    "(c) worker {d} keeps {} engines after every one failed",
                    driver.worker.engines.len()
                ));
            }
            if driver.worker.late.buffers() != 0 {
                self.fail(&format!(
                    "(c) worker {d} holds {} buffers for late writes after every partner went",
                    driver.worker.late.buffers()
                ));
            }
            if driver.worker.origins.len() != 0 {
                self.fail(&format!(
                    "(c) worker {d} keeps routes after every engine went"
                ));
            }
        }
        self.sockets.clear();
        self.held.clear();
        for (host, pools) in self.hosts.iter().enumerate() {
            for pool in [&pools.send_pool, &pools.recv_pool] {
                pool.flush_thread_cache();
                let in_use = pool.stats().in_use_bytes;
                if in_use != 0 {
                    self.fail(&format!(
                        "(c) host {}'s pool {} has {in_use} bytes in use after every engine went",
                        ["A", "B"][host],
                        pool.config().name
                    ));
                }
            }
        }
        if let Some(budget) = &self.hosts[B].budget
            && budget.available() != budget.capacity()
        {
            self.fail("(c) B's inbound budget is not whole after every engine went");
        }
    }

    /// One seed's run.
    fn run(seed: u64) -> Tally {
        tap::record();
        let mut model = Self::new(seed);
        for _ in 0..STEPS {
            model.random_step();
        }
        model.note("the drain".into());
        model.settle("after the schedule");
        model.check_quiescent();
        model.check_teardown();
        let tally = model.tally;
        drop(model);
        tap::stop();
        tally
    }
}

/// What an engine bug does.
fn injected_panic() {
    panic!("{INJECTED}");
}

/// Injected panics say nothing (each would print a backtrace note); any
/// other panic goes to the hook as before.
fn quiet_injected_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let injected = info
                .payload()
                .downcast_ref::<String>()
                .is_some_and(|s| s.starts_with(INJECTED));
            if !injected {
                previous(info);
            }
        }));
    });
}

/// The seeds to run: `TESSERA_MODEL_SEED` alone, or `TESSERA_MODEL_SEEDS`
/// (default 200) from `TESSERA_MODEL_FIRST` (default 0).
fn seeds() -> std::ops::Range<u64> {
    let var = |name| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
    match var("TESSERA_MODEL_SEED") {
        Some(seed) => seed..seed + 1,
        None => {
            let first = var("TESSERA_MODEL_FIRST").unwrap_or(0);
            first..first + var("TESSERA_MODEL_SEEDS").unwrap_or(200)
        }
    }
}

/// The model (module docs) over many seeded schedules.
#[test]
fn engines_on_rails_place_every_byte_and_message_once_whatever_fails() {
    quiet_injected_panics();
    let seeds = seeds();
    let started = Instant::now();
    let mut tally = Tally::default();
    for seed in seeds.clone() {
        match std::panic::catch_unwind(|| Model::run(seed)) {
            Ok(run) => tally += run,
            Err(panic) => {
                let what = panic
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| panic.downcast_ref::<&str>().copied())
                    .unwrap_or("(not a string)");
                eprintln!("{what}");
                eprintln!(
                    "the rails model failed at seed {seed}, after {} runs",
                    seed - seeds.start + 1
                );
                std::panic::resume_unwind(panic);
            }
        }
    }
    eprintln!(
        "rails model: {} seeds in {:.2?}: {tally:?}",
        seeds.end - seeds.start,
        started.elapsed()
    );
}
