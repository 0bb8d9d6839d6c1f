//! A simulated server: a real [`Store`] and [`ReshardCore`], with its
//! role, forward stream, copies and resize feed and sender modelled
//! around them (module docs of [`super`]).

use std::collections::BTreeMap;

use rand::Rng;
use std::sync::Arc;
use std::time::Duration;

use tessera_coord::{Resize, ResizeError, ShardMap};
use tessera_proto::sharding::shard_for_key;
use tessera_proto::v1::{PushRequest, ServingHealth, SourceFeed};
use tessera_sim::SimTime;

use super::world::{
    Event, FENCE_MARGIN, GATE_TIMEOUT, LEASE, LOOK_EVERY, Msg, PartOutcome, REPLICA_TIMEOUT, TABLE,
    TICK, World,
};
use crate::config::{Initializer, Mode, OptimizerConfig, StoreConfig, TableConfig};
use crate::replication::Stager;
use crate::reshard::{Action, Look, ReshardCore, Transition};
use tessera_store::copy_stream::CopySource;
use tessera_store::store::{DeltaRows, PushId, Store, StoreError, TableWindows};
use tessera_store::version::Version;

/// The delta interval the servers cut at.
const INTERVAL: Duration = Duration::from_millis(100);

/// A server's role in its shard.
#[derive(Debug)]
pub enum Role {
    /// Following the primary (or waiting for a copy).
    Replica,
    /// Won the lease; takes Pushes once its resize state reached `gate`
    /// (the map version read after winning), or resigns at `deadline`.
    Candidate {
        epoch: u64,
        gate: u64,
        deadline: SimTime,
    },
    /// Leads the shard while `now < fence_until`.
    Primary {
        epoch: u64,
        fence_until: SimTime,
        /// Replica -> (position acknowledged, last position sent, waiting
        /// since, the replica's incarnation: a restarted one copies anew).
        followers: BTreeMap<usize, (u64, u64, Option<SimTime>, u64)>,
        /// Pushes to acknowledge once every follower holds `position`:
        /// (position, worker, sequence, attempt, shard).
        pending: Vec<(u64, usize, u64, u64, u32)>,
    },
}

/// The resize feed of a receiving primary.
#[derive(Debug)]
struct Feed {
    from: u32,
    to: u32,
    /// By giving shard: what its cuts left here.
    sources: BTreeMap<u32, Source>,
}

/// What a receiving primary's feed holds of one giving shard.
#[derive(Debug)]
struct Source {
    cuts: u64,
    /// The giving primary's term and version of the last cut.
    at: (u64, Version),
    /// The map version of the fence the last cut was taken under (`None`:
    /// not fenced), and the windows it carried.
    fenced_at: Option<u64>,
    windows: Option<TableWindows>,
    applied: SimTime,
}

/// A giving primary's cut for one receiving shard.
#[derive(Debug, Clone)]
pub struct Cut {
    pub giving: u32,
    pub to_count: u32,
    pub dest: u32,
    /// The epoch the giving primary leads its shard under: a new one is
    /// a new stream (`delta/feed`), which the receiver copies whatever
    /// its version (a primary's rows may hold Pushes its successor never
    /// saw, and the successor's version can be lower).
    pub term: u64,
    pub version: Version,
    /// Taken after the giving shard fenced the keys moving to `to_count`:
    /// the map version it set the fence at (`Store::moved`).
    pub fenced_at: Option<u64>,
    pub windows: Option<TableWindows>,
    pub rows: DeltaRows,
}

/// One simulated server.
#[derive(Debug)]
pub struct Server {
    pub shard: u32,
    pub count: u32,
    pub store: Arc<Store>,
    core: ReshardCore,
    pub up: bool,
    pub retired: bool,
    pub incarnation: u64,
    pub paused_until: Option<SimTime>,
    pub stalled_until: Option<SimTime>,
    pub cut_off_until: Option<SimTime>,
    pub role: Role,
    /// The map its watch last delivered.
    seen: Option<ShardMap>,
    feed: Option<Feed>,
    giving: Option<Resize>,
    ticks: u64,
}

fn config(shard: u32, count: u32) -> StoreConfig {
    StoreConfig {
        mode: Mode::Training,
        num_shards: count,
        shards: vec![shard],
        tables: vec![TableConfig {
            optimizer: OptimizerConfig::sgd(1.0),
            initializer: Initializer::Zeros,
            ..TableConfig::new(TABLE, 1)
        }],
        ..StoreConfig::default()
    }
}

impl Server {
    pub fn new(shard: u32, count: u32, map: Option<&ShardMap>) -> Self {
        let (store, core) = Self::start(shard, count, map);
        Self {
            shard,
            count,
            store,
            core,
            up: true,
            retired: false,
            incarnation: 0,
            paused_until: None,
            stalled_until: None,
            cut_off_until: None,
            role: Role::Replica,
            seen: map.cloned(),
            feed: None,
            giving: None,
            ticks: 0,
        }
    }

    /// A store as the server starts it (empty: it copies its shard), set
    /// from the map it joins (`reshard::prepare`).
    fn start(shard: u32, count: u32, map: Option<&ShardMap>) -> (Arc<Store>, ReshardCore) {
        let store = Arc::new(Store::new(&config(shard, count)));
        crate::reshard::prepare(&store, map);
        store.follow_resizes(map.map_or(0, |m| m.version));
        let within = crate::reshard::in_step_within(INTERVAL);
        store.bound_moved_reads(within);
        (store, ReshardCore::new(within))
    }

    pub fn kill(&mut self) {
        self.up = false;
        self.incarnation += 1;
        self.role = Role::Replica;
        self.feed = None;
        self.giving = None;
    }

    pub fn retire(&mut self) {
        self.kill();
        self.retired = true;
    }

    pub fn restart(&mut self, map: Option<&ShardMap>) {
        let (store, core) = Self::start(self.shard, self.count, map);
        self.store = store;
        self.core = core;
        self.seen = map.cloned();
        self.up = true;
        self.incarnation += 1;
        self.paused_until = None;
        self.stalled_until = None;
        self.cut_off_until = None;
    }

    /// Whether this server is a copy of `shard` still in service.
    pub fn serves_shard(&self, shard: u32) -> bool {
        self.shard == shard && !self.retired
    }

    /// Its shard's stream position.
    pub fn version_position(&self) -> u64 {
        self.store.version(self.shard).unwrap_or_default().position
    }

    /// The epoch it leads its shard under now, if it does.
    pub fn leading(&self, now: SimTime) -> Option<u64> {
        match &self.role {
            Role::Primary {
                epoch, fence_until, ..
            } if now < *fence_until => Some(*epoch),
            _ => None,
        }
    }

    fn paused(&self, now: SimTime) -> bool {
        self.paused_until.is_some_and(|u| u > now)
    }

    /// Whether it reaches etcd at `now` (itself not cut off; etcd up is
    /// the world's part: `World::connected`).
    pub fn reaches_etcd(&self, now: SimTime) -> bool {
        self.cut_off_until.is_none_or(|u| u <= now)
    }

    fn health(&self, now: SimTime) -> Option<ServingHealth> {
        let feed = self.feed.as_ref()?;
        Some(ServingHealth {
            source_shards: feed.from,
            sources: feed
                .sources
                .iter()
                .map(|(&g, source)| SourceFeed {
                    source_shard: g,
                    seq: source.cuts,
                    fenced: source.fenced_at.is_some(),
                    fenced_at: source.fenced_at.unwrap_or(0),
                    applied_age_ms: now.saturating_since(source.applied).as_millis() as u64,
                    ..SourceFeed::default()
                })
                .collect(),
            ..ServingHealth::default()
        })
    }
}

/// How a refused Push part is answered (as the worker classes it).
fn classify(err: &StoreError, seen_version: u64) -> PartOutcome {
    match err {
        StoreError::Moved { map_version, .. } => PartOutcome::Moved(*map_version),
        StoreError::Resplit { .. } => PartOutcome::Moved(seen_version),
        _ => PartOutcome::Retry,
    }
}

impl World {
    /// A server's periodic work: its lease and election, its followers,
    /// copies to replicas out of step, its resize cuts, and every
    /// [`LOOK_EVERY`] a look.
    pub fn tick(&mut self, i: usize) {
        let now = self.now();
        if self.servers[i].paused(now) {
            return;
        }
        self.servers[i].ticks += 1;
        let shard = self.servers[i].shard;
        let connected = self.connected(i, now);
        let lease_end = now.checked_add(LEASE).unwrap_or(now);
        let fence_end = now.checked_add(LEASE - FENCE_MARGIN).unwrap_or(now);
        match &mut self.servers[i].role {
            Role::Primary {
                epoch, fence_until, ..
            } => {
                if connected {
                    match self.etcd.primaries.get_mut(&shard) {
                        Some((s, e, until)) if *s == i && *e == *epoch && *until > now => {
                            *until = lease_end;
                            *fence_until = fence_end;
                        }
                        _ => {
                            // Its key lapsed: it follows again.
                            self.log(format!("{i} steps down from shard {shard}"));
                            self.servers[i].role = Role::Replica;
                        }
                    }
                }
            }
            Role::Candidate {
                epoch,
                gate,
                deadline,
            } => {
                let (epoch, gate, deadline) = (*epoch, *gate, *deadline);
                let ours = matches!(self.etcd.primaries.get(&shard), Some((s, e, until)) if *s == i && *e == epoch && *until > now);
                if !ours {
                    self.servers[i].role = Role::Replica;
                } else if connected {
                    if let Some(entry) = self.etcd.primaries.get_mut(&shard) {
                        entry.2 = lease_end;
                    }
                    // The lead gate (`coordination/etcd_driver.rs`): the
                    // fence of a cut-over its last primary acted on is in
                    // place before it applies a Push.
                    if self.servers[i].store.resize_state_reached(gate) {
                        self.servers[i].role = Role::Primary {
                            epoch,
                            fence_until: fence_end,
                            followers: BTreeMap::new(),
                            pending: Vec::new(),
                        };
                        self.trace.record_u64(epoch);
                        self.log(format!("{i} leads shard {shard} in epoch {epoch}"));
                    } else if now >= deadline {
                        self.count("lead resigned at the gate");
                        self.etcd.primaries.remove(&shard);
                        self.servers[i].role = Role::Replica;
                    }
                }
            }
            Role::Replica => {
                let lapsed = self.etcd.primary(shard, now).is_none();
                let holds = self.servers[i].version_position()
                    >= self.acked_high.get(&shard).copied().unwrap_or(0);
                if connected && lapsed && holds {
                    let epoch = self.etcd.epochs.get(&shard).copied().unwrap_or(0) + 1;
                    self.etcd.epochs.insert(shard, epoch);
                    self.etcd.primaries.insert(shard, (i, epoch, lease_end));
                    self.servers[i].role = Role::Candidate {
                        epoch,
                        gate: self.etcd.map.version,
                        deadline: now.checked_add(GATE_TIMEOUT).unwrap_or(now),
                    };
                    self.count("leads won");
                }
            }
        }
        if self.servers[i].leading(now).is_some() {
            self.check_followers(i);
            self.copy_to_replicas(i);
            if let Some(resize) = self.servers[i].giving.clone() {
                self.cut(i, &resize);
            }
        }
        let every = (LOOK_EVERY.as_millis() / TICK.as_millis()) as u64;
        if self.servers[i].ticks.is_multiple_of(every) {
            self.look(i);
        }
    }

    /// Drops followers that did not acknowledge in time, then acknowledges
    /// the Pushes every remaining follower holds.
    fn check_followers(&mut self, i: usize) {
        let now = self.now();
        let incarnations: Vec<(u64, bool)> =
            self.servers.iter().map(|s| (s.incarnation, s.up)).collect();
        if let Role::Primary { followers, .. } = &mut self.servers[i].role {
            followers.retain(|&j, (_, _, since, incarnation)| {
                incarnations[j] == (*incarnation, true)
                    && since.is_none_or(|s| now.saturating_since(s) < REPLICA_TIMEOUT)
            });
        }
        self.resolve(i);
    }

    /// Answers the pending Pushes every follower holds.
    fn resolve(&mut self, i: usize) {
        let shard = self.servers[i].shard;
        let Role::Primary {
            followers, pending, ..
        } = &mut self.servers[i].role
        else {
            return;
        };
        let held = followers.values().map(|f| f.0).min().unwrap_or(u64::MAX);
        let mut answers = Vec::new();
        pending.retain(|&(position, worker, seq, attempt, shard)| {
            if position <= held {
                answers.push((position, worker, seq, attempt, shard));
                false
            } else {
                true
            }
        });
        for (position, worker, seq, attempt, part_shard) in answers {
            let high = self.acked_high.entry(shard).or_default();
            *high = (*high).max(position);
            self.send_worker(
                i as u64,
                worker,
                Msg::Answer {
                    seq,
                    attempt,
                    shard: part_shard,
                    outcome: PartOutcome::Acked,
                },
            );
        }
    }

    /// Copies the shard, whole, to each live replica that does not follow
    /// (restarted, dropped, or cut off by an opening), through the copy
    /// stream's codec, and makes it a follower.
    fn copy_to_replicas(&mut self, i: usize) {
        let now = self.now();
        let shard = self.servers[i].shard;
        let targets: Vec<usize> = (0..self.servers.len())
            .filter(|&j| {
                let s = &self.servers[j];
                j != i
                    && s.up
                    && s.serves_shard(shard)
                    && !s.paused(now)
                    && matches!(s.role, Role::Replica)
                    && match &self.servers[i].role {
                        Role::Primary { followers, .. } => !followers.contains_key(&j),
                        _ => false,
                    }
            })
            .collect();
        for j in targets {
            let (snapshot, origins) = {
                let p = &self.servers[i].store;
                let Some(w) = p.lock_shard(shard) else {
                    return;
                };
                (p.snapshot_shard(&w), p.origin_windows(shard))
            };
            let version = snapshot.version;
            let source = CopySource::new(snapshot);
            let mut bytes = Vec::new();
            while (bytes.len() as u64) < source.total_bytes() {
                let chunk = source.read_at(bytes.len() as u64, 1 << 20);
                if chunk.is_empty() {
                    break;
                }
                bytes.extend_from_slice(&chunk);
            }
            let r = Arc::clone(&self.servers[j].store);
            let mut stager = Stager::new(Arc::clone(&r));
            let staged = stager.feed(&bytes).and_then(|()| stager.finish());
            let Ok(staged) = staged else {
                self.count("copy refused");
                continue;
            };
            {
                let Some(mut w) = r.lock_shard(shard) else {
                    continue;
                };
                let _old = staged.install(&r, &w, self.instant());
                w.set_version(version);
                if let Some(set) = origins {
                    r.set_origin_windows(shard, set);
                }
                r.drop_unrouted(&w);
            }
            self.trace.record_u64(version.position);
            let incarnation = self.servers[j].incarnation;
            if let Role::Primary { followers, .. } = &mut self.servers[i].role {
                followers.insert(j, (version.position, version.position, None, incarnation));
            }
            self.log(format!("{i} copied shard {shard} at {version} to {j}"));
            self.count("copies");
        }
    }

    /// A giving primary's cut: its shard's moving rows, whole, routed by
    /// the resize's new count to each receiving shard's primary that has
    /// not opened; marked fenced, with the shard's windows, once its store
    /// fenced them.
    fn cut(&mut self, i: usize, resize: &Resize) {
        let now = self.now();
        let g = self.servers[i].shard;
        if !resize.giving().any(|s| s == g) {
            return;
        }
        let Some(term) = self.servers[i].leading(now) else {
            return;
        };
        let store = Arc::clone(&self.servers[i].store);
        let (fenced_at, windows, keys, version) = {
            let Some(w) = store.lock_shard(g) else {
                return;
            };
            let fenced_at = store
                .moved(g)
                .filter(|&(n, _)| n == resize.to)
                .map(|(_, at)| at);
            let windows = fenced_at.map(|_| store.dedup_windows(g));
            let to = resize.to;
            let keys = store.keys_where(&w, TABLE, |k| shard_for_key(k, to) != g);
            (fenced_at, windows, keys, w.version())
        };
        let Ok(rows) = store.read_rows(TABLE, g, &keys, true) else {
            return;
        };
        for dest in resize.receiving() {
            if resize.opened.contains_key(&dest) {
                continue;
            }
            let Some((to, _)) = self.etcd.primary(dest, now) else {
                continue;
            };
            let part = rows_for(&rows, |k| shard_for_key(k, resize.to) == dest);
            self.send_server(
                i as u64,
                to,
                Msg::Cut(Box::new(Cut {
                    giving: g,
                    to_count: resize.to,
                    dest,
                    term,
                    version,
                    fenced_at,
                    windows: windows.clone(),
                    rows: part,
                })),
            );
        }
    }

    /// A resize look: the core's, then its actions.
    pub fn look(&mut self, i: usize) {
        let now = self.now();
        let s = &self.servers[i];
        if !s.up {
            return;
        }
        if let Some(until) = s.paused_until.filter(|&u| u > now) {
            let _ = self.sim.schedule_at(until, Event::Look(i));
            return;
        }
        if s.stalled_until.is_some_and(|u| u > now) {
            return;
        }
        let connected = self.connected(i, now);
        if connected {
            self.servers[i].seen = Some(self.etcd.map.clone());
        }
        let s = &mut self.servers[i];
        let look = Look {
            map: s.seen.clone(),
            leads: s
                .leading(now)
                .map(|e| vec![(s.shard, e)])
                .unwrap_or_default(),
            feed: s.health(now),
        };
        let state = |s: &Server| {
            (
                s.store.num_shards(),
                s.store.moved(s.shard),
                s.store.new_count_open(s.shard),
                s.store.routes_by(s.shard),
                s.store.incoming(s.shard),
                s.store.receiving(s.shard),
            )
        };
        let before = state(s);
        if let Some(key) = self.log_looks {
            let seen = s.seen.as_ref().map(|m| m.version);
            let row = s
                .store
                .read_rows(TABLE, s.shard, &[key], false)
                .ok()
                .map(|r| r.values);
            self.log(format!(
                "{i} looks at {seen:?}: {before:?} key {key}: {row:?}"
            ));
        }
        let s = &mut self.servers[i];
        let actions = s.core.look(&s.store, &look);
        let after = state(s);
        if before != after {
            self.log(format!(
                "{i} (shard {}) resize state (count, moved, open, routes by, incoming, receiving) {after:?}",
                self.servers[i].shard
            ));
        }
        for action in actions {
            let connected = self.connected(i, now);
            match action {
                Action::Update(t) => {
                    if !connected {
                        continue;
                    }
                    if matches!(t, Transition::Opened { .. }) && self.buggify(0.3) {
                        // Its report is late: cut off from etcd just
                        // after the opening (`reshard::report_opened`).
                        self.count("opening reported late");
                        let d = Duration::from_millis(self.sim.rng().random_range(300..2000));
                        self.servers[i].cut_off_until = now.checked_add(d);
                        continue;
                    }
                    if t == Transition::CutOver {
                        let led = self.etcd.map.active().is_some_and(|r| {
                            r.receiving().all(|s| self.etcd.primary(s, now).is_some())
                        });
                        if !led {
                            continue;
                        }
                    }
                    let written = self.update_map(|m| t.apply(m));
                    if written && t == Transition::CutOver && self.buggify(0.6) {
                        self.stall_a_giving_replica();
                    }
                }
                Action::Open { resize, shards } => {
                    if connected {
                        self.open(i, &resize, &shards);
                    }
                }
                Action::Give(resize) => self.servers[i].giving = resize,
                Action::Receive(Some(to)) => {
                    let from = look
                        .map
                        .as_ref()
                        .and_then(ShardMap::active)
                        .map_or(0, |r| r.from);
                    let s = &mut self.servers[i];
                    if s.feed.as_ref().is_none_or(|f| f.to != to || f.from != from) {
                        s.feed = Some(Feed {
                            from,
                            to,
                            sources: BTreeMap::new(),
                        });
                    }
                }
                Action::Receive(None) => self.servers[i].feed = None,
            }
        }
    }

    /// At a cut-over: a replica of a giving shard stops looking at the
    /// map for a while (its watch stalls: `reshard::step`), and its
    /// primary is killed or paused soon after, so that the replica may
    /// win the lead before its store is fenced.
    fn stall_a_giving_replica(&mut self) {
        let now = self.now();
        let Some(r) = self.etcd.map.active().cloned() else {
            return;
        };
        let giving: Vec<u32> = r.giving().collect();
        let shard = giving[self.sim.rng().random_range(0..giving.len())];
        let Some((primary, _)) = self.etcd.primary(shard, now) else {
            return;
        };
        let replicas: Vec<usize> = (0..self.servers.len())
            .filter(|&j| j != primary && self.servers[j].up && self.servers[j].serves_shard(shard))
            .collect();
        let Some(&replica) = replicas.first() else {
            return;
        };
        self.count("giving replica stalled at a cut-over");
        let d = Duration::from_millis(self.sim.rng().random_range(1000..6000));
        self.servers[replica].stalled_until = now.checked_add(d);
        let d = Duration::from_millis(self.sim.rng().random_range(0..500));
        if self.sim.rng().random_bool(0.5) {
            self.at(d, Event::Kill(primary));
        } else {
            let until = now.checked_add(d + Duration::from_millis(2500));
            self.servers[primary].paused_until = until;
        }
    }

    /// Opens receiving shards as the driver does: claims each in the map,
    /// reads the feed's fenced windows and closes it, then under the
    /// shard's lock cuts its replicas off at the next position and opens
    /// it through the core.
    fn open(&mut self, i: usize, resize: &Resize, shards: &[u32]) {
        let now = self.now();
        for &shard in shards {
            if resize.opening.contains(&shard) || resize.opened.contains_key(&shard) {
                continue;
            }
            let id = resize.id;
            let claimed = self.update_map(|m| {
                if m.active().map(|r| r.id) != Some(id) {
                    return Err(ResizeError::NoResize);
                }
                m.handle_opening(shard)
            });
            if !claimed {
                return;
            }
        }
        let windows: Vec<(u32, TableWindows)> = self.servers[i]
            .feed
            .take()
            .map(|f| {
                f.sources
                    .into_iter()
                    .filter_map(|(g, source)| {
                        source
                            .fenced_at
                            .map(|_| (g, source.windows.unwrap_or_default()))
                    })
                    .collect()
            })
            .unwrap_or_default();
        for &shard in shards {
            let s = &mut self.servers[i];
            let Some(epoch) = s.leading(now) else {
                continue;
            };
            let store = Arc::clone(&s.store);
            let Some(mut w) = store.lock_shard(shard) else {
                continue;
            };
            let version = w.version().next(epoch);
            w.set_version(version);
            if let Role::Primary { followers, .. } = &mut s.role {
                // Cut off: they copy the shard as it opened.
                followers.clear();
            }
            s.core.open_shard(&store, &w, resize, version, &windows);
            drop(w);
            // Its replicas are cut off: none is in step until it copies
            // the opened shard (`Forwarder::cut_off_for_resize`).
            let high = self.acked_high.entry(shard).or_default();
            *high = (*high).max(version.position);
            self.log(format!("{i} opened shard {shard} at {version}"));
            self.trace.record_u64(version.position);
            self.count("openings");
            if self.buggify(0.5) {
                // Killed once its replica may have copied the opened
                // shard, perhaps before it said so in the map.
                let d = Duration::from_millis(self.sim.rng().random_range(50..600));
                self.at(d, Event::Kill(i));
            }
        }
        self.resolve(i);
    }

    /// A message arrives at server `i` (up, awake).
    pub fn deliver(&mut self, i: usize, msg: Msg) {
        match msg {
            Msg::Part {
                worker,
                seq,
                attempt,
                request,
            } => self.handle_part(i, worker, seq, attempt, request),
            Msg::Forward {
                from,
                epoch,
                position,
                request,
                outcome,
            } => self.handle_forward(i, from, epoch, position, &request, &outcome),
            Msg::ForwardAck {
                from,
                epoch,
                position,
            } => {
                if let Role::Primary {
                    epoch: e,
                    followers,
                    ..
                } = &mut self.servers[i].role
                    && *e == epoch
                    && let Some(f) = followers.get_mut(&from)
                {
                    f.0 = f.0.max(position);
                    if f.0 >= f.1 {
                        f.2 = None;
                    }
                }
                self.resolve(i);
            }
            Msg::Cut(cut) => self.apply_cut(i, *cut),
            Msg::Answer { .. } => {}
        }
    }

    /// A Push part at a server: the service's screen and checks, applied
    /// under the lock as its primary, forwarded to its followers and
    /// answered once they hold it.
    fn handle_part(
        &mut self,
        i: usize,
        worker: usize,
        seq: u64,
        attempt: u64,
        request: PushRequest,
    ) {
        let now = self.now();
        let instant = self.instant();
        let shard = request.shard;
        let s = &self.servers[i];
        let seen = s.seen.as_ref().map_or(0, |m| m.version);
        let answer = |world: &mut World, outcome: PartOutcome| {
            world.send_worker(
                i as u64,
                worker,
                Msg::Answer {
                    seq,
                    attempt,
                    shard,
                    outcome,
                },
            );
        };
        let Some(epoch) = s.leading(now).filter(|_| s.shard == shard) else {
            answer(self, PartOutcome::Retry);
            return;
        };
        let store = Arc::clone(&s.store);
        let screened = match crate::service::screen_push(&store, request) {
            Ok(r) => r,
            Err(status) => {
                self.log(format!(
                    "{i} screened out part {worker}:{seq} of shard {shard}: {}",
                    status.message()
                ));
                let outcome = if status.code() == tessera_rpc::Code::Aborted {
                    PartOutcome::Moved(seen)
                } else {
                    PartOutcome::Retry
                };
                answer(self, outcome);
                return;
            }
        };
        let id = PushId {
            worker: screened.worker_id,
            sequence: screened.sequence,
        };
        let applied = store
            .check_push(
                &screened.table,
                screened.shard,
                &screened.keys,
                &screened.gradients,
                id,
            )
            .map(|c| c.split_by(screened.num_shards))
            .and_then(|checked| {
                let mut w = store.lock_shard(shard).ok_or(StoreError::ShardNotHosted {
                    shard,
                    hosted: store.hosted().to_vec(),
                })?;
                let outcome = checked.apply(&w, instant)?;
                if outcome.duplicate {
                    return Ok((outcome, w.version().position, false));
                }
                let version = w.version().next(epoch);
                w.set_version(version);
                Ok((outcome, version.position, true))
            });
        let (outcome, position, fresh) = match applied {
            Ok(a) => a,
            Err(err) => {
                self.log(format!(
                    "{i} refused part {worker}:{seq} of shard {shard}: {err}"
                ));
                answer(self, classify(&err, seen));
                return;
            }
        };
        self.trace.record_u64(position);
        self.log(format!(
            "{i} applied part {worker}:{seq} {:?} of shard {shard} at {position}{}",
            screened.keys,
            if fresh { "" } else { " (duplicate)" }
        ));
        let followers: Vec<usize> = match &mut self.servers[i].role {
            Role::Primary {
                followers, pending, ..
            } => {
                pending.push((position, worker, seq, attempt, shard));
                if fresh {
                    for f in followers.values_mut() {
                        f.1 = position;
                        f.2.get_or_insert(now);
                    }
                }
                followers.keys().copied().collect()
            }
            _ => Vec::new(),
        };
        if fresh {
            for j in followers {
                self.send_server(
                    i as u64,
                    j,
                    Msg::Forward {
                        from: i,
                        epoch,
                        position,
                        request: screened.clone(),
                        outcome: outcome.clone(),
                    },
                );
            }
        }
        self.resolve(i);
    }

    /// A forwarded Push at a replica: applied in order as its primary did
    /// it, or dropped on a gap (the primary copies the shard again).
    fn handle_forward(
        &mut self,
        i: usize,
        from: usize,
        epoch: u64,
        position: u64,
        request: &PushRequest,
        outcome: &tessera_store::store::PushOutcome,
    ) {
        let s = &self.servers[i];
        if !matches!(s.role, Role::Replica) || s.shard != request.shard {
            return;
        }
        let store = Arc::clone(&s.store);
        let own = store.version(s.shard).unwrap_or_default();
        if own.epoch > epoch {
            return;
        }
        if position == own.position + 1 {
            let id = PushId {
                worker: request.worker_id,
                sequence: request.sequence,
            };
            let Some(mut w) = store.lock_shard(request.shard) else {
                return;
            };
            let applied = store
                .check_push(
                    &request.table,
                    request.shard,
                    &request.keys,
                    &request.gradients,
                    id,
                )
                .and_then(|c| {
                    c.apply_replicated(
                        &w,
                        &outcome.evicted,
                        &outcome.not_admitted,
                        self.instant(),
                        outcome.stamp,
                    )
                });
            if let Err(err) = applied {
                self.log(format!("{i} refused a forward: {err}"));
                self.count("forward refused");
                return;
            }
            w.set_version(Version::new(epoch, position));
        } else if position > own.position + 1 {
            return;
        }
        let held = store.version(request.shard).unwrap_or_default().position;
        self.send_server(
            i as u64,
            from,
            Msg::ForwardAck {
                from: i,
                epoch,
                position: held,
            },
        );
    }

    /// A giving shard's cut at a receiving primary's feed: written while
    /// its feed takes the resize's deltas and the shard takes rows, in
    /// the order of the giving copies' versions.
    fn apply_cut(&mut self, i: usize, cut: Cut) {
        let now = self.now();
        let line = self.log_cuts.then(|| {
            format!(
                "{i} took shard {}'s cut at {} ({} rows{})",
                cut.giving,
                cut.version,
                cut.rows.keys.len(),
                if cut.fenced_at.is_some() {
                    ", fenced"
                } else {
                    ""
                }
            )
        });
        let s = &mut self.servers[i];
        let Some(feed) = s.feed.as_mut() else {
            return;
        };
        // A resize feed writes a shard only while it receives and this
        // server leads it (`delta/feed/write.rs`).
        if feed.to != cut.to_count
            || s.shard != cut.dest
            || !s.store.taking_rows(cut.dest)
            || !matches!(&s.role, Role::Primary { fence_until, .. } if now < *fence_until)
        {
            return;
        }
        if feed
            .sources
            .get(&cut.giving)
            .is_some_and(|src| src.at > (cut.term, cut.version))
        {
            return;
        }
        {
            let Some(w) = s.store.lock_shard(cut.dest) else {
                return;
            };
            let rows = &cut.rows;
            // A cut holds every moving row of its giving shard, as a
            // copy does: the giving shard's rows it lacks are gone
            // there (`delta/feed/copy.rs`), such as a row only a Push
            // its last primary never replicated made.
            let from = feed.from;
            let gone = s.store.keys_where(&w, TABLE, |k| {
                shard_for_key(k, from) == cut.giving && !rows.keys.contains(&k)
            });
            if s.store.remove_rows(&w, TABLE, &gone).is_err() {
                return;
            }
            if s.store
                .put_whole_rows(
                    &w,
                    TABLE,
                    &rows.keys,
                    &rows.values,
                    &rows.state,
                    &rows.steps,
                    &rows.stamps,
                )
                .is_err()
            {
                return;
            }
        }
        let cuts = feed.sources.get(&cut.giving).map_or(0, |s| s.cuts);
        feed.sources.insert(
            cut.giving,
            Source {
                cuts: cuts + 1,
                at: (cut.term, cut.version),
                fenced_at: cut.fenced_at,
                windows: cut.windows,
                applied: now,
            },
        );
        self.trace.record_u64(cut.version.position);
        if let Some(line) = line {
            self.log(line);
        }
    }
}

/// The rows of `rows` whose key `pick` says yes to.
fn rows_for(rows: &DeltaRows, pick: impl Fn(u64) -> bool) -> DeltaRows {
    let n = rows.keys.len();
    let vb = rows.values.len().checked_div(n).unwrap_or(0);
    let sb = rows.state.len().checked_div(n).unwrap_or(0);
    let mut out = DeltaRows::default();
    for (i, &k) in rows.keys.iter().enumerate() {
        if !pick(k) {
            continue;
        }
        out.keys.push(k);
        out.values
            .extend_from_slice(&rows.values[i * vb..(i + 1) * vb]);
        out.state
            .extend_from_slice(&rows.state[i * sb..(i + 1) * sb]);
        if let Some(&s) = rows.steps.get(i) {
            out.steps.push(s);
        }
        if let Some(&s) = rows.stamps.get(i) {
            out.stamps.push(s);
        }
    }
    out
}
