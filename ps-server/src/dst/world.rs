//! The simulated world: etcd, the network, the workers, the operator and
//! the nemesis, around the servers ([`super::server`]).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use rand::Rng;
use tessera_coord::{ResizeError, ResizeState, ShardMap};
use tessera_proto::sharding::shard_for_key;
use tessera_proto::v1::PushRequest;
use tessera_sim::{SimTime, Simulator, Trace};

use super::Run;
use super::server::{Role, Server};

/// How long a primary's lease runs without a renewal.
pub const LEASE: Duration = Duration::from_secs(2);
/// How long before its lease ends a primary stops taking Pushes (its
/// fence: `fence.rs`).
pub const FENCE_MARGIN: Duration = Duration::from_millis(300);
/// How long a new primary waits for its resize state to reach the map it
/// read after winning before it resigns (the failover timeout).
pub const GATE_TIMEOUT: Duration = Duration::from_secs(3);
/// Servers' renewals, replication checks and resize cuts.
pub const TICK: Duration = Duration::from_millis(100);
/// A resize look besides the map's changes (`reshard::EVERY`).
pub const LOOK_EVERY: Duration = Duration::from_secs(1);
/// A forward not acknowledged in this long drops its replica (it copies
/// the shard again).
pub const REPLICA_TIMEOUT: Duration = Duration::from_millis(400);
/// A worker's attempt of one part.
pub const ATTEMPT_TIMEOUT: Duration = Duration::from_millis(800);
/// Keys the workers push to.
pub const KEYS: u64 = 48;
/// The table.
pub const TABLE: &str = "t";
/// Faults and resizes before the cluster is let settle.
const FAULT_PHASE: Duration = Duration::from_secs(24);
/// The most a run settles before it counts as stuck.
const SETTLE: Duration = Duration::from_secs(60);

/// What happens.
#[derive(Debug, Clone)]
pub enum Event {
    /// A server's periodic work.
    Tick(usize),
    /// A server's resize look.
    Look(usize),
    /// A message arrives.
    Deliver(usize, u64, Msg),
    /// A worker's next step.
    Worker(usize),
    /// A worker's attempt of a part timed out.
    AttemptTimeout(usize, u64, u32, u64),
    /// The nemesis strikes.
    Nemesis,
    /// A fault ends.
    Heal(usize, Heal),
    /// The operator looks at the resize.
    Operator,
    /// A placed fault: kill a server.
    Kill(usize),
    /// A worker's routing watch delivers a map (version, count).
    WorkerWatch(usize, u64, u32),
}

/// A fault that ends.
#[derive(Debug, Clone, Copy)]
pub enum Heal {
    Restart,
}

/// A message between processes. Addressed to a server (by index and
/// incarnation) or to a worker.
#[derive(Debug, Clone)]
pub enum Msg {
    /// A part of a Push.
    Part {
        worker: usize,
        seq: u64,
        attempt: u64,
        request: PushRequest,
    },
    /// A part's answer.
    Answer {
        seq: u64,
        attempt: u64,
        shard: u32,
        outcome: PartOutcome,
    },
    /// A Push forwarded to a replica.
    Forward {
        from: usize,
        epoch: u64,
        position: u64,
        request: PushRequest,
        outcome: tessera_store::store::PushOutcome,
    },
    /// A replica applied a forwarded Push up to `position`.
    ForwardAck {
        from: usize,
        epoch: u64,
        position: u64,
    },
    /// A giving primary's cut of its moving rows, for one receiving shard.
    Cut(Box<super::server::Cut>),
}

/// How a part went.
#[derive(Debug, Clone, PartialEq)]
pub enum PartOutcome {
    /// Applied (or a duplicate), and held by the shard's copies.
    Acked,
    /// Its keys moved (a resize cut over): split anew once the map moved
    /// past this version.
    Moved(u64),
    /// Refused for now (not the primary, receiving, not cut over here).
    Retry,
}

/// etcd, modelled: the shard map under compare-and-swap and the
/// primaries' keys with their leases.
#[derive(Debug)]
pub struct Etcd {
    pub map: ShardMap,
    /// Shard -> (server, epoch, lease end).
    pub primaries: BTreeMap<u32, (usize, u64, SimTime)>,
    /// The last epoch granted per shard.
    pub epochs: BTreeMap<u32, u64>,
    /// Down (every member) until then: no write, no lease kept or won,
    /// no watch delivered.
    pub down_until: Option<SimTime>,
}

impl Etcd {
    /// Whether it answers at `now`.
    pub fn up(&self, now: SimTime) -> bool {
        self.down_until.is_none_or(|u| u <= now)
    }
}

impl Etcd {
    /// The live primary key of `shard` at `now`.
    pub fn primary(&self, shard: u32, now: SimTime) -> Option<(usize, u64)> {
        self.primaries
            .get(&shard)
            .filter(|(_, _, until)| *until > now)
            .map(|&(s, e, _)| (s, e))
    }
}

/// One worker's Push in flight.
#[derive(Debug)]
struct Push {
    seq: u64,
    keys: Vec<u64>,
    split_by: u32,
    /// Shard -> (keys, acknowledged, attempt).
    parts: BTreeMap<u32, (Vec<u64>, bool, u64)>,
    /// Waiting for the map to move past this version, then split anew.
    moved_at: Option<u64>,
    /// Attempts sent, over every split: an answer names its attempt, so
    /// one to an earlier split's part is told from the current one's.
    attempts: u64,
}

#[derive(Debug)]
struct Worker {
    id: u64,
    next_seq: u64,
    push: Option<Push>,
    /// Acknowledged Pushes' keys, by sequence: the audit's record.
    acked: BTreeMap<u64, Vec<u64>>,
    /// Pushes in flight when the worker restarted, never acknowledged:
    /// each applied once or not at all (the audit's range).
    abandoned: Vec<Vec<u64>>,
    /// The map its routing watch last delivered (version, count): it
    /// splits by that count, which may lag etcd's.
    seen: (u64, u32),
}

/// The world.
pub struct World {
    pub sim: Simulator<Event>,
    /// `Instant` at virtual time zero (the store takes times as
    /// `Instant`s; nothing reads the wall clock after this).
    pub base: Instant,
    pub etcd: Etcd,
    pub servers: Vec<Server>,
    workers: Vec<Worker>,
    /// The highest stream position a copy must hold to take a shard's
    /// lead (the election model: an acknowledged Push, or an opening,
    /// which cuts the replicas off so that none is in step until it
    /// copies the opened shard).
    pub acked_high: BTreeMap<u32, u64>,
    /// When each link last delivered (FIFO per link).
    links: BTreeMap<(u64, u64), SimTime>,
    pub trace: Trace,
    run: Run,
    faults_on: bool,
    /// Resizes planned so far.
    resizes: u32,
    logging: bool,
    /// `TESSERA_DST_LOG=looks`: every look, with the row of key
    /// `TESSERA_DST_KEY` (default 0) on that server.
    pub log_looks: Option<u64>,
    /// `TESSERA_DST_LOG=cuts`: every resize cut a feed takes.
    pub log_cuts: bool,
}

/// Endpoints of a link: servers by index, workers after them.
fn endpoint_server(index: usize) -> u64 {
    index as u64
}
fn endpoint_worker(index: usize) -> u64 {
    1_000_000 + index as u64
}

impl World {
    pub fn new(seed: u64) -> Self {
        let mut world = Self {
            sim: Simulator::new(seed),
            base: Instant::now(),
            etcd: Etcd {
                map: ShardMap::new(2),
                primaries: BTreeMap::new(),
                epochs: BTreeMap::new(),
                down_until: None,
            },
            servers: Vec::new(),
            workers: Vec::new(),
            acked_high: BTreeMap::new(),
            links: BTreeMap::new(),
            trace: Trace::default(),
            run: Run {
                seed,
                ..Run::default()
            },
            faults_on: true,
            resizes: 0,
            logging: false,
            log_looks: None,
            log_cuts: false,
        };
        // Read once: nothing in a run reads the environment after this.
        if let Ok(log) = std::env::var("TESSERA_DST_LOG") {
            world.logging = true;
            let key = std::env::var("TESSERA_DST_KEY")
                .ok()
                .and_then(|k| k.parse().ok())
                .unwrap_or(0);
            world.log_looks = log.contains("looks").then_some(key);
            world.log_cuts = log.contains("cuts");
        }
        for shard in 0..2 {
            for _ in 0..2 {
                world.add_server(shard, 2);
            }
        }
        for w in 0..2 {
            world.workers.push(Worker {
                id: 1 + w as u64,
                next_seq: 1,
                push: None,
                acked: BTreeMap::new(),
                abandoned: Vec::new(),
                seen: (world.etcd.map.version, world.etcd.map.num_shards),
            });
            world.at(Duration::from_millis(300), Event::Worker(w));
        }
        world.at(Duration::from_millis(1500), Event::Operator);
        world.at(Duration::from_secs(2), Event::Nemesis);
        world
    }

    /// Virtual now.
    pub fn now(&self) -> SimTime {
        self.sim.now()
    }

    /// Virtual now as the store's `Instant`.
    pub fn instant(&self) -> Instant {
        self.now().to_instant(self.base)
    }

    /// Schedules `event` after `d`.
    pub fn at(&mut self, d: Duration, event: Event) {
        // The queue holds far fewer events than its limits.
        let _ = self.sim.schedule_in(d, event);
    }

    /// Logs a line at virtual now (`TESSERA_DST_LOG=1`).
    pub fn log(&self, line: impl std::fmt::Display) {
        if self.logging {
            eprintln!(
                "{:>10.3} {line}",
                self.now().saturating_since(SimTime::ZERO).as_secs_f64()
            );
        }
    }

    /// Fault counter.
    pub fn count(&mut self, kind: &'static str) {
        *self.run.faults.entry(kind).or_default() += 1;
    }

    fn add_server(&mut self, shard: u32, count: u32) -> usize {
        let index = self.servers.len();
        let server = Server::new(shard, count, Some(&self.etcd.map));
        self.servers.push(server);
        let jitter = Duration::from_millis(self.sim.rng().random_range(0..100));
        self.at(jitter, Event::Tick(index));
        self.at(jitter + LOOK_EVERY, Event::Look(index));
        index
    }

    /// Sends `msg` to server `to` (its current incarnation) after a
    /// latency, in order on its link.
    pub fn send_server(&mut self, from: u64, to: usize, msg: Msg) {
        let incarnation = self.servers[to].incarnation;
        let at = self.link_time(from, endpoint_server(to));
        let _ = self
            .sim
            .schedule_at(at, Event::Deliver(to, incarnation, msg));
    }

    /// Sends `msg` to worker `to`.
    pub fn send_worker(&mut self, from: u64, to: usize, msg: Msg) {
        let at = self.link_time(from, endpoint_worker(to));
        let _ = self
            .sim
            .schedule_at(at, Event::Deliver(usize::MAX - to, 0, msg));
    }

    fn link_time(&mut self, from: u64, to: u64) -> SimTime {
        let latency = Duration::from_micros(self.sim.rng().random_range(200..3000));
        let now = self.now();
        let earliest = now.checked_add(latency).unwrap_or(now);
        let last = self.links.get(&(from, to)).copied().unwrap_or(now);
        let at = earliest.max(last);
        self.links.insert((from, to), at);
        at
    }

    /// Writes a transition of the shard map, as etcd's compare-and-swap
    /// on the revision read; every server's watch delivers it.
    pub fn update_map(
        &mut self,
        step: impl FnOnce(&ShardMap) -> Result<ShardMap, ResizeError>,
    ) -> bool {
        if !self.etcd.up(self.now()) {
            return false;
        }
        match step(&self.etcd.map) {
            Ok(map) => {
                if let (Some(b), Some(a)) = (&self.etcd.map.resize, &map.resize)
                    && a.id == b.id
                    && a.state != b.state
                {
                    match a.state {
                        ResizeState::Done => self.run.resizes_done += 1,
                        ResizeState::Cancelled => self.run.resizes_cancelled += 1,
                        _ => {}
                    }
                }
                self.log(format!("map {map:?}"));
                self.etcd.map = map;
                self.trace.record_u64(self.etcd.map.version);
                for i in 0..self.servers.len() {
                    let delay = Duration::from_millis(self.sim.rng().random_range(1..40));
                    self.at(delay, Event::Look(i));
                }
                // The workers' watches: most deliver within milliseconds,
                // some lag for seconds (Pushes split by the count before
                // keep coming after a cut-over).
                // Most of all at a cut-over: a worker splitting by the old
                // count past a failover of a giving shard is where a
                // primary leading before its store fenced would take a
                // moved key (hole 2).
                let (version, count) = (self.etcd.map.version, self.etcd.map.num_shards);
                let cut_over = self
                    .etcd
                    .map
                    .active()
                    .is_some_and(|r| r.state == ResizeState::CutOver);
                let (p, lag) = if cut_over {
                    (0.5, 1500..5000)
                } else {
                    (0.1, 300..3000)
                };
                for w in 0..self.workers.len() {
                    let ms = if self.buggify(p) {
                        self.count("worker watch lagging");
                        self.sim.rng().random_range(lag.clone())
                    } else {
                        self.sim.rng().random_range(1..40)
                    };
                    self.at(
                        Duration::from_millis(ms),
                        Event::WorkerWatch(w, version, count),
                    );
                }
                true
            }
            Err(_) => false,
        }
    }

    /// Runs to the end and audits.
    pub fn run(mut self) -> Run {
        let fault_end = SimTime::ZERO
            .checked_add(FAULT_PHASE)
            .unwrap_or(SimTime::ZERO);
        let end = fault_end.checked_add(SETTLE).unwrap_or(fault_end);
        let mut settled = false;
        while let Some(due) = self.sim.next_event_until(end) {
            if self.faults_on && due.at >= fault_end {
                self.faults_on = false;
                self.heal_all();
            }
            self.handle(due.event);
            if !self.faults_on && self.quiet() {
                settled = true;
                break;
            }
        }
        self.run.virtual_time = self.now().saturating_since(SimTime::ZERO);
        let mut violations = Vec::new();
        if !settled {
            violations.push(super::Violation::Stuck(self.stuck_why()));
        }
        let abandoned: Vec<Vec<u64>> = self
            .workers
            .iter()
            .flat_map(|w| w.abandoned.iter().cloned())
            .collect();
        violations.extend(super::audit::audit(&self, &self.acked_record(), &abandoned));
        self.run.violations = violations;
        self.run.pushes = self.workers.iter().map(|w| w.acked.len() as u64).sum();
        self.trace.record_u64(self.run.pushes);
        self.run.digest = self.trace.digest();
        self.run
    }

    fn acked_record(&self) -> Vec<(u64, u64, Vec<u64>)> {
        self.workers
            .iter()
            .flat_map(|w| w.acked.iter().map(|(s, k)| (w.id, *s, k.clone())))
            .collect()
    }

    fn handle(&mut self, event: Event) {
        match event {
            Event::Tick(i) => {
                if self.servers[i].up {
                    self.tick(i);
                }
                self.at(TICK, Event::Tick(i));
            }
            Event::Look(i) => self.look(i),
            Event::Deliver(to, incarnation, msg) => {
                if to > usize::MAX / 2 {
                    self.worker_answer(usize::MAX - to, msg);
                } else {
                    let s = &self.servers[to];
                    if !s.up || s.incarnation != incarnation {
                        return;
                    }
                    if let Some(until) = s.paused_until.filter(|&u| u > self.now()) {
                        // A paused process reads it when it wakes.
                        let _ = self
                            .sim
                            .schedule_at(until, Event::Deliver(to, incarnation, msg));
                        return;
                    }
                    self.deliver(to, msg);
                }
            }
            Event::Worker(w) => self.worker_step(w),
            Event::AttemptTimeout(w, seq, shard, attempt) => {
                self.attempt_timeout(w, seq, shard, attempt)
            }
            Event::Nemesis => self.nemesis(),
            Event::Heal(i, Heal::Restart) => self.restart(i),
            Event::Operator => self.operator(),
            Event::Kill(i) => self.kill(i, "kill placed after an opening or a cut-over"),
            Event::WorkerWatch(w, version, count) => {
                let worker = &mut self.workers[w];
                if version > worker.seen.0 {
                    worker.seen = (version, count);
                }
            }
        }
    }

    /// Everything at rest: no Push in flight, no resize in progress, every
    /// shard led with each live copy following its primary.
    fn quiet(&self) -> bool {
        if self.workers.iter().any(|w| w.push.is_some()) {
            return false;
        }
        if self.etcd.map.active().is_some() {
            return false;
        }
        let now = self.now();
        (0..self.etcd.map.num_shards).all(|shard| {
            let Some((p, _)) = self.etcd.primary(shard, now) else {
                return false;
            };
            let Role::Primary { followers, .. } = &self.servers[p].role else {
                return false;
            };
            self.servers
                .iter()
                .enumerate()
                .filter(|(i, s)| *i != p && s.serves_shard(shard) && s.up)
                .all(|(i, s)| followers.get(&i).is_some_and(|f| f.3 == s.incarnation))
                && self.servers[p].store.num_shards() == self.etcd.map.num_shards
        })
    }

    fn stuck_why(&self) -> String {
        let in_flight: Vec<String> = self
            .workers
            .iter()
            .filter_map(|w| {
                w.push
                    .as_ref()
                    .map(|p| format!("{}:{} {:?}", w.id, p.seq, p.parts))
            })
            .collect();
        format!(
            "not quiet after {:?}: map {:?}; Pushes in flight {in_flight:?}; primaries {:?}",
            SETTLE, self.etcd.map, self.etcd.primaries
        )
    }

    // ---- the operator ----

    /// Plans a growth from 2 or a shrink from 3 when no resize is in
    /// progress (each growth on new servers; a shrink's given-away
    /// servers are stopped once it is done), and sometimes cancels.
    fn operator(&mut self) {
        let now_faulting = self.faults_on;
        let map = self.etcd.map.clone();
        match map.active() {
            None => {
                if let Some(r) = &map.resize
                    && r.state == ResizeState::Cancelled
                    && r.to > r.from
                {
                    // A cancelled growth's new servers are stopped.
                    for s in self.servers.iter_mut().filter(|s| s.shard >= r.from) {
                        s.retire();
                    }
                }
                if let Some(r) = &map.resize
                    && r.state == ResizeState::Done
                {
                    // The operator's part once it is done (the resharding
                    // chapter): the servers' configurations say the count
                    // they route by now, and a shrink's given-away
                    // shard's servers are stopped.
                    for s in self.servers.iter_mut().filter(|s| !s.retired) {
                        s.count = r.to;
                        if s.shard >= r.to {
                            s.retire();
                        }
                    }
                }
                if now_faulting && self.resizes < 3 {
                    let to = if map.num_shards == 2 { 3 } else { 2 };
                    if self.update_map(|m| m.plan(to)) {
                        self.resizes += 1;
                        if to > map.num_shards {
                            // New servers: nothing acknowledged on shard 2 yet.
                            self.acked_high.remove(&2);
                            // Servers of the new count for the new shard.
                            for _ in 0..2 {
                                self.add_server(2, 3);
                            }
                        }
                    }
                }
            }
            Some(r) => {
                let cancel_p = if now_faulting { 0.03 } else { 0.0 };
                let cancellable = matches!(r.state, ResizeState::Planned | ResizeState::Copying)
                    || (r.state == ResizeState::CutOver
                        && r.opening.is_empty()
                        && r.opened.is_empty());
                let stuck_long = !now_faulting && self.sim.rng().random_bool(0.02);
                if cancellable && (self.sim.rng().random_bool(cancel_p) || stuck_long) {
                    self.update_map(|m| m.cancel());
                }
            }
        }
        let next = Duration::from_millis(self.sim.rng().random_range(300..1500));
        self.at(next, Event::Operator);
    }

    // ---- the nemesis ----

    fn nemesis(&mut self) {
        if !self.faults_on {
            return;
        }
        let now = self.now();
        if self.sim.rng().random_bool(0.03) {
            // etcd down whole: no lease kept, no map written or watched.
            self.count("etcd down");
            let d = Duration::from_millis(self.sim.rng().random_range(500..5000));
            let until = now.checked_add(d);
            self.etcd.down_until = self.etcd.down_until.max(until);
            self.log(format!("etcd down for {d:?}"));
        } else if self.sim.rng().random_bool(0.05) {
            let w = self.sim.rng().random_range(0..self.workers.len());
            self.restart_worker(w);
        }
        let candidates: Vec<usize> = (0..self.servers.len())
            .filter(|&i| self.servers[i].up && !self.servers[i].retired)
            .collect();
        if !candidates.is_empty() {
            let i = candidates[self.sim.rng().random_range(0..candidates.len())];
            match self.sim.rng().random_range(0..4) {
                0 => self.kill(i, "kill"),
                1 => {
                    self.count("pause");
                    let d = Duration::from_millis(self.sim.rng().random_range(300..4000));
                    self.servers[i].paused_until = now.checked_add(d);
                }
                2 => {
                    self.count("stall resize looks");
                    let d = Duration::from_millis(self.sim.rng().random_range(500..6000));
                    self.servers[i].stalled_until = now.checked_add(d);
                }
                _ => {
                    self.count("cut off from etcd");
                    let d = Duration::from_millis(self.sim.rng().random_range(300..4000));
                    self.servers[i].cut_off_until = now.checked_add(d);
                }
            }
        }
        let next = Duration::from_millis(self.sim.rng().random_range(200..1500));
        self.at(next, Event::Nemesis);
    }

    /// Kills server `i` (restarted 0.5-4 s later), only while another
    /// copy holds its shard: with none, nothing could recover it (a
    /// checkpoint would, which this harness leaves out).
    pub fn kill(&mut self, i: usize, kind: &'static str) {
        let now = self.now();
        if !self.faults_on || !self.servers[i].up || self.servers[i].retired {
            return;
        }
        let shard = self.servers[i].shard;
        let other_holds = self.servers.iter().enumerate().any(|(j, s)| {
            j != i
                && s.up
                && s.serves_shard(shard)
                && s.version_position() >= self.acked_high.get(&shard).copied().unwrap_or(0)
                && s.paused_until.is_none_or(|u| u <= now)
        });
        if other_holds {
            self.log(format!("kill {i} ({kind})"));
            self.count(kind);
            self.servers[i].kill();
            let after = Duration::from_millis(self.sim.rng().random_range(500..4000));
            self.at(after, Event::Heal(i, Heal::Restart));
        }
    }

    /// A fault placed where the resize is at its most delicate (the
    /// nemesis's random timing rarely lands in a window of milliseconds),
    /// with probability `p` while faults run: FoundationDB's "buggify".
    pub fn buggify(&mut self, p: f64) -> bool {
        self.faults_on && self.sim.rng().random_bool(p)
    }

    /// Whether server `i` reaches etcd at `now`.
    pub fn connected(&self, i: usize, now: SimTime) -> bool {
        self.etcd.up(now) && self.servers[i].reaches_etcd(now)
    }

    /// A trainer process restarted: its Push in flight is abandoned
    /// (never acknowledged, perhaps applied in part), and it pushes on as
    /// a new worker (a new id; sequences go on, so late answers to the
    /// old one are told apart).
    fn restart_worker(&mut self, w: usize) {
        self.count("worker restarts");
        let worker = &mut self.workers[w];
        if let Some(push) = worker.push.take() {
            worker.abandoned.push(push.keys);
            self.count("Pushes abandoned");
        }
        let worker = &mut self.workers[w];
        worker.id += 2;
        let id = worker.id;
        self.log(format!("worker {w} restarts as {id}"));
        self.trace.record_u64(id);
        let think = Duration::from_millis(self.sim.rng().random_range(50..500));
        self.at(think, Event::Worker(w));
    }

    fn heal_all(&mut self) {
        self.etcd.down_until = None;
        for i in 0..self.servers.len() {
            let s = &mut self.servers[i];
            s.paused_until = None;
            s.stalled_until = None;
            s.cut_off_until = None;
            if !s.up && !s.retired {
                self.restart(i);
            }
        }
    }

    fn restart(&mut self, i: usize) {
        if self.servers[i].up || self.servers[i].retired {
            return;
        }
        let map = self.etcd.map.clone();
        self.log(format!("restart {i}"));
        self.servers[i].restart(Some(&map));
        self.trace.record_u64(i as u64);
    }

    // ---- workers ----

    fn worker_step(&mut self, w: usize) {
        if let Some(push) = &self.workers[w].push {
            if push.moved_at.is_some() {
                self.resplit_when_moved(w);
            }
            return;
        }
        if !self.faults_on {
            // No new Pushes once the cluster settles.
            return;
        }
        let n = self.sim.rng().random_range(1..4);
        let mut keys = BTreeSet::new();
        while keys.len() < n {
            keys.insert(self.sim.rng().random_range(0..KEYS));
        }
        let seq = self.workers[w].next_seq;
        self.workers[w].next_seq += 1;
        let split_by = self.workers[w].seen.1;
        let keys: Vec<u64> = keys.into_iter().collect();
        let push = Push {
            seq,
            parts: split(&keys, split_by),
            keys,
            split_by,
            moved_at: None,
            attempts: 0,
        };
        self.workers[w].push = Some(push);
        let shards: Vec<u32> = self.workers[w]
            .push
            .as_ref()
            .map_or(Vec::new(), |p| p.parts.keys().copied().collect());
        for shard in shards {
            self.send_part(w, shard);
        }
    }

    /// Sends a part to its shard's primary as etcd names it (or tries
    /// again shortly if none).
    fn send_part(&mut self, w: usize, shard: u32) {
        let now = self.now();
        let worker_id = self.workers[w].id;
        let Some(push) = self.workers[w].push.as_mut() else {
            return;
        };
        let Some(part) = push.parts.get_mut(&shard) else {
            return;
        };
        if part.1 {
            return;
        }
        push.attempts += 1;
        part.2 = push.attempts;
        let attempt = part.2;
        let keys = part.0.clone();
        let (seq, split_by) = (push.seq, push.split_by);
        self.at(
            ATTEMPT_TIMEOUT,
            Event::AttemptTimeout(w, seq, shard, attempt),
        );
        let Some((primary, _)) = self.etcd.primary(shard, now) else {
            return;
        };
        let gradients: Vec<u8> = keys.iter().flat_map(|_| (-1.0f32).to_le_bytes()).collect();
        let request = PushRequest {
            num_shards: split_by,
            table: TABLE.to_owned(),
            shard,
            keys,
            gradients: gradients.into(),
            worker_id,
            sequence: seq,
        };
        self.send_server(
            endpoint_worker(w),
            primary,
            Msg::Part {
                worker: w,
                seq,
                attempt,
                request,
            },
        );
    }

    fn attempt_timeout(&mut self, w: usize, seq: u64, shard: u32, attempt: u64) {
        let current = self.workers[w]
            .push
            .as_ref()
            .filter(|p| p.seq == seq && p.moved_at.is_none())
            .and_then(|p| p.parts.get(&shard))
            .is_some_and(|part| !part.1 && part.2 == attempt);
        if !current {
            return;
        }
        let count = self.workers[w].seen.1;
        if let Some(push) = self.workers[w].push.as_mut()
            && push.split_by != count
        {
            // Given up on (the client's deadline), and tried again by the
            // trainer under its id, split by the count routed by now.
            push.moved_at = Some(0);
            self.resplit_when_moved(w);
            return;
        }
        self.send_part(w, shard);
    }

    fn worker_answer(&mut self, w: usize, msg: Msg) {
        let Msg::Answer {
            seq,
            attempt,
            shard,
            outcome,
        } = msg
        else {
            return;
        };
        let seen_count = self.workers[w].seen.1;
        let Some(push) = self.workers[w].push.as_mut() else {
            return;
        };
        if push.seq != seq {
            return;
        }
        let Some(part) = push.parts.get_mut(&shard) else {
            return;
        };
        if part.2 != attempt || part.1 {
            return;
        }
        match outcome {
            PartOutcome::Acked => {
                part.1 = true;
                if push.moved_at.is_none() && push.parts.values().all(|p| p.1) {
                    let keys = push.keys.clone();
                    self.log(format!("worker {w} Push {seq} {keys:?} acknowledged"));
                    self.trace.record_u64(seq);
                    self.workers[w].acked.insert(seq, keys);
                    self.workers[w].push = None;
                    let think = Duration::from_millis(self.sim.rng().random_range(5..60));
                    self.at(think, Event::Worker(w));
                }
            }
            PartOutcome::Moved(version) => {
                push.attempts += 1;
                part.2 = push.attempts;
                push.moved_at = Some(push.moved_at.unwrap_or(0).max(version));
                self.resplit_when_moved(w);
            }
            PartOutcome::Retry => {
                push.attempts += 1;
                part.2 = push.attempts;
                let attempt = part.2;
                if seen_count != push.split_by {
                    // Given up on (the client's deadline), and tried
                    // again by the trainer under its id, split by the
                    // count routed by now.
                    push.moved_at = Some(0);
                    self.resplit_when_moved(w);
                    return;
                }
                let d = Duration::from_millis(self.sim.rng().random_range(20..120));
                self.at(d, Event::AttemptTimeout(w, seq, shard, attempt));
            }
        }
    }

    /// A Push whose keys moved: once the map routes by a count other than
    /// the one it was split by (and reached the fence's version), every
    /// part goes again under the same id, split by the new count.
    fn resplit_when_moved(&mut self, w: usize) {
        let (version, count) = self.workers[w].seen;
        let Some(push) = self.workers[w].push.as_mut() else {
            return;
        };
        let Some(at) = push.moved_at else {
            return;
        };
        if version >= at {
            if count != push.split_by {
                push.split_by = count;
                push.parts = split(&push.keys, count);
            }
            // Split anew, or (the resize cancelled: the client gives up
            // and the trainer tries the Push again under its id) as it
            // was: every part not acknowledged goes again.
            push.moved_at = None;
            let shards: Vec<u32> = push.parts.keys().copied().collect();
            for shard in shards {
                self.send_part(w, shard);
            }
        } else {
            // The routing's watch: looked at again shortly.
            self.at(Duration::from_millis(50), Event::Worker(w));
        }
    }
}

/// `keys` split by `count` shards, each part not acknowledged.
fn split(keys: &[u64], count: u32) -> BTreeMap<u32, (Vec<u64>, bool, u64)> {
    let mut parts: BTreeMap<u32, (Vec<u64>, bool, u64)> = BTreeMap::new();
    for &k in keys {
        parts
            .entry(shard_for_key(k, count))
            .or_insert_with(|| (Vec::new(), false, 0))
            .0
            .push(k);
    }
    parts
}
