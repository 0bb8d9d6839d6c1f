//! Tessera's real RDMA engines on simulated hosts: each connection is a
//! pair of `tessera_transport::rdma::Engine`s, one per host, each on a
//! queue pair of its host's simulated NIC ([`crate::rnic`]), driven
//! through their `handle_*`/`poll_*` surface in virtual time exactly as
//! the transport's I/O threads drive them over a real NIC: receives
//! posted, doorbell batches of send work requests, completions fed back,
//! timers at the instants the engines ask for. Receive credits, the send
//! window, fragmenting, the fragment scheduler, offers and keepalive are
//! the engine's own, unchanged.
//!
//! # Call order
//!
//! [`Cluster::new`]; [`Cluster::connect`] hosts pairwise (a connection's
//! engines are ready at once, as after the transport's handshake);
//! [`Cluster::open`] sockets on them, [`Cluster::accept`] what the peer
//! opened, [`Cluster::send`] messages built with [`Cluster::message`],
//! [`Cluster::wake_at`] to be called back; and in a loop
//! [`Cluster::next`], which runs the simulation to the next thing the
//! application sees ([`AppEvent`]) and returns it with its time.
//!
//! # Time
//!
//! Engines take `std::time::Instant`s. The cluster reads the clock once,
//! at creation, as the origin of a line on which virtual nanosecond `t`
//! is `origin + t` ([`tessera_sim::SimTime::to_instant`]): engines only
//! compare and subtract instants, so the origin changes nothing they
//! decide, and two runs of a seed are the same.
//!
//! # Host CPU
//!
//! An engine's work takes no virtual time here: a completion is handled
//! the moment the NIC produces it. The fabric's figures (queues, pauses,
//! goodput at line rate) do not depend on it; latencies under a loaded
//! CPU do, and are among the model's known gaps (`docs/`).

use std::collections::VecDeque;
use std::time::Instant;

use bytes::Bytes;
use tessera_sim::{SimTime, Simulator};
use tessera_transport::Message;
use tessera_transport::pool::{Access, Pool, PoolConfig};
use tessera_transport::rdma::engine::{
    Engine, EngineConfig, EngineError, EngineEvent, PeerInfo, Role, SocketId,
};
use tessera_transport::verbs::VerbsError;
use tessera_transport::verbs::sim::SimMemory;

use crate::net::{NetEvent, NetParams, Network};
use crate::params::ParamsError;
use crate::rnic::{HostId, PostError, Qpn};

/// A connection end: an engine on a host.
pub type ConnId = usize;

/// What to simulate.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// The fabric.
    pub net: NetParams,
    /// Every engine's configuration (the transport's defaults unless a
    /// scenario sets the window or sizes).
    pub engine: EngineConfig,
    /// The seed of every random choice.
    pub seed: u64,
}

/// Why a cluster could not be built or a call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClusterError {
    /// A fabric parameter out of range.
    #[error(transparent)]
    Params(#[from] ParamsError),
    /// An engine refused its configuration or a call.
    #[error("engine: {0}")]
    Engine(#[from] EngineError),
    /// A host's memory pool could not be built.
    #[error("memory pool: {0}")]
    Pool(#[from] tessera_transport::ConfigError),
    /// A message buffer could not be allocated.
    #[error("message buffer: {0}")]
    Alloc(#[from] tessera_transport::pool::PoolError),
    /// No such host or connection.
    #[error("no {what} {id}")]
    Unknown {
        /// Host or connection.
        what: &'static str,
        /// Its number.
        id: usize,
    },
}

/// What the application sees.
#[derive(Debug)]
pub enum AppEvent {
    /// The peer opened `socket` on connection `conn` (accept or refuse).
    Opened {
        /// Where.
        conn: ConnId,
        /// The socket.
        socket: SocketId,
    },
    /// The peer accepted `socket`, which `conn` opened.
    Accepted {
        /// Where.
        conn: ConnId,
        /// The socket.
        socket: SocketId,
    },
    /// A whole message arrived.
    Message {
        /// Where.
        conn: ConnId,
        /// On which socket.
        socket: SocketId,
        /// Its bytes.
        bytes: Bytes,
    },
    /// A message of `socket` was sent whole (its last work request
    /// completed).
    Sent {
        /// Where.
        conn: ConnId,
        /// The socket.
        socket: SocketId,
    },
    /// Another socket change (refused, closed).
    Socket {
        /// Where.
        conn: ConnId,
        /// What the engine said.
        event: EngineEvent,
    },
    /// The engine failed.
    Failed {
        /// Where.
        conn: ConnId,
        /// Why.
        error: EngineError,
    },
    /// [`Cluster::wake_at`]'s call back.
    Wake(u64),
}

#[derive(Debug)]
enum Event {
    Net(NetEvent),
    EngineTimer(ConnId),
    App(u64),
}

#[derive(Debug)]
struct Conn {
    host: HostId,
    qpn: Qpn,
    engine: Engine,
    /// Its live timer event's time.
    timer: Option<u64>,
}

#[derive(Debug)]
struct HostMemory {
    memory: SimMemory,
    pools: Option<(Pool, Pool)>,
}

/// Engines on a simulated fabric (module docs).
#[derive(Debug)]
pub struct Cluster {
    sim: Simulator<Event>,
    net: Network,
    engine: EngineConfig,
    hosts: Vec<HostMemory>,
    conns: Vec<Conn>,
    /// `by_qp[host][qpn]`: the connection on that queue pair.
    by_qp: Vec<Vec<ConnId>>,
    origin: Instant,
    app: VecDeque<(u64, AppEvent)>,
    dirty: Vec<ConnId>,
}

impl Cluster {
    /// A fabric of idle hosts.
    pub fn new(config: ClusterConfig) -> Result<Self, ClusterError> {
        let n = config.net.topology.hosts();
        let hosts: Vec<HostMemory> = (0..n)
            .map(|_| HostMemory {
                memory: SimMemory::new(),
                pools: None,
            })
            .collect();
        let net = Network::new(config.net, config.seed, |h| {
            hosts[h as usize].memory.clone()
        })?;
        Ok(Self {
            sim: Simulator::new(config.seed),
            net,
            engine: config.engine,
            hosts,
            conns: Vec::new(),
            by_qp: vec![Vec::new(); n as usize],
            origin: Instant::now(),
            app: VecDeque::new(),
            dirty: Vec::new(),
        })
    }

    /// Virtual time now, ns.
    pub fn now(&self) -> u64 {
        self.sim.now().as_nanos()
    }

    fn instant(&self) -> Instant {
        self.sim.now().to_instant(self.origin)
    }

    /// Events handled so far (the network's, the engines' timers, the
    /// application's).
    pub fn events(&self) -> u64 {
        self.sim.delivered()
    }

    /// The network (its counters, its pause log, its NICs).
    pub fn net(&self) -> &Network {
        &self.net
    }

    /// Connection `conn`'s engine.
    pub fn engine(&self, conn: ConnId) -> Option<&Engine> {
        self.conns.get(conn).map(|c| &c.engine)
    }

    /// The host of connection end `conn`.
    pub fn host_of(&self, conn: ConnId) -> Option<HostId> {
        self.conns.get(conn).map(|c| c.host)
    }

    /// Host `h`'s send and receive pools, made on first use (1 MiB
    /// blocks: a thousand hosts' pools stay small).
    fn pools(&mut self, h: HostId) -> Result<(Pool, Pool), ClusterError> {
        let host = self
            .hosts
            .get_mut(h as usize)
            .ok_or(ClusterError::Unknown {
                what: "host",
                id: h as usize,
            })?;
        if let Some(pools) = &host.pools {
            return Ok(pools.clone());
        }
        let config = |name: &str| PoolConfig {
            block_size: 1 << 20,
            max_class_size: 512 << 10,
            dedicated_cache_bytes: 4 << 20,
            thread_cache_bytes: 64 << 10,
            ..PoolConfig::named(format!("sim-host{h}-{name}"))
        };
        let hook = host.memory.hook();
        let pools = (
            Pool::new(config("send"), Access::LocalOnly, hook.clone())?,
            Pool::new(config("recv"), Access::RemoteWrite, hook)?,
        );
        host.pools = Some(pools.clone());
        Ok(pools)
    }

    /// A message of `len` bytes in host `h`'s send pool, its bytes
    /// `fill`.
    pub fn message(&mut self, h: HostId, len: usize, fill: u8) -> Result<Message, ClusterError> {
        let (send, _) = self.pools(h)?;
        let mut buf = send.alloc(len)?;
        buf.fill(fill);
        Ok(Message::from(buf.freeze()))
    }

    /// Connects host `a` (the dialer) to host `b`: a queue pair on each
    /// NIC and an engine on each, ready (the handshake's outcome).
    pub fn connect(&mut self, a: HostId, b: HostId) -> Result<(ConnId, ConnId), ClusterError> {
        let config = self.engine.clone();
        self.connect_with(a, b, config)
    }

    /// [`Cluster::connect`] with engines of `config` instead of the
    /// cluster's.
    pub fn connect_with(
        &mut self,
        a: HostId,
        b: HostId,
        config: EngineConfig,
    ) -> Result<(ConnId, ConnId), ClusterError> {
        let now = self.now();
        let at = self.instant();
        let mut ends = Vec::new();
        for (h, role) in [(a, Role::Dialer), (b, Role::Acceptor)] {
            let (send, recv) = self.pools(h)?;
            let engine = Engine::new(config.clone(), send, recv, role, at)?;
            // RNR retries without end, as the transport asks of its
            // queue pairs (credits make an RNR impossible anyway).
            let qpn = self
                .net
                .nic_mut(h)
                .create_qp(config.send_queue_depth, 7, now);
            ends.push((h, qpn, engine));
        }
        let (hb, qb, mut eb) = ends
            .pop()
            .ok_or(ClusterError::Unknown { what: "end", id: 1 })?;
        let (ha, qa, mut ea) = ends
            .pop()
            .ok_or(ClusterError::Unknown { what: "end", id: 0 })?;
        self.net.nic_mut(ha).connect(qa, hb, qb);
        self.net.nic_mut(hb).connect(qb, ha, qa);
        // Receives first, before the peer can learn of them.
        for (h, q, e) in [(ha, qa, &mut ea), (hb, qb, &mut eb)] {
            if let Some(wrs) = e.poll_recv_post() {
                let _ = self.net.nic_mut(h).post_recv(q, &wrs);
            }
        }
        let info = |e: &Engine| PeerInfo {
            recv_depth: config.recv_queue_depth,
            recv_buffer: u32::try_from(e.recv_buffer_size()).unwrap_or(u32::MAX),
            keepalive_slot: e.keepalive_slot(),
            shared_receives: false,
        };
        let (ia, ib) = (info(&ea), info(&eb));
        ea.peer_ready(ib, at);
        eb.peer_ready(ia, at);
        let mut ids = [0; 2];
        for (i, (h, qpn, engine)) in [(ha, qa, ea), (hb, qb, eb)].into_iter().enumerate() {
            let id = self.conns.len();
            self.conns.push(Conn {
                host: h,
                qpn,
                engine,
                timer: None,
            });
            let slots = &mut self.by_qp[h as usize];
            if slots.len() <= qpn as usize {
                slots.resize(qpn as usize + 1, usize::MAX);
            }
            slots[qpn as usize] = id;
            ids[i] = id;
        }
        for id in ids {
            self.drive(id);
        }
        self.flush_net();
        Ok((ids[0], ids[1]))
    }

    fn conn_mut(&mut self, conn: ConnId) -> Result<&mut Conn, ClusterError> {
        self.conns.get_mut(conn).ok_or(ClusterError::Unknown {
            what: "connection",
            id: conn,
        })
    }

    /// Opens a socket on `conn` (the peer sees [`AppEvent::Opened`]).
    pub fn open(&mut self, conn: ConnId) -> Result<SocketId, ClusterError> {
        let socket = self.conn_mut(conn)?.engine.open_socket()?;
        self.drive(conn);
        self.flush_net();
        Ok(socket)
    }

    /// Opens a socket on each of `dialers` and runs until each is
    /// accepted, accepting every socket peers open meanwhile: the sockets
    /// in `dialers`' order (`None`: not accepted within a second of
    /// virtual time).
    pub fn open_all(&mut self, dialers: &[ConnId]) -> Result<Vec<Option<SocketId>>, ClusterError> {
        let mut sockets = vec![None; dialers.len()];
        let index: std::collections::HashMap<ConnId, usize> =
            dialers.iter().enumerate().map(|(i, &c)| (c, i)).collect();
        for &d in dialers {
            self.open(d)?;
        }
        let mut accepted = 0;
        let limit = self.now() + 1_000_000_000;
        while accepted < dialers.len() {
            let Some((_, event)) = self.next(limit) else {
                break;
            };
            match event {
                AppEvent::Opened { conn, socket } => self.accept(conn, socket)?,
                AppEvent::Accepted { conn, socket } => {
                    if let Some(&i) = index.get(&conn) {
                        sockets[i] = Some(socket);
                        accepted += 1;
                    }
                }
                _ => {}
            }
        }
        Ok(sockets)
    }

    /// Accepts `socket`, which the peer opened, on `conn`.
    pub fn accept(&mut self, conn: ConnId, socket: SocketId) -> Result<(), ClusterError> {
        self.conn_mut(conn)?.engine.accept_socket(socket);
        self.drive(conn);
        self.flush_net();
        Ok(())
    }

    /// Sends `message` on `socket` of `conn`.
    pub fn send(
        &mut self,
        conn: ConnId,
        socket: SocketId,
        message: Message,
    ) -> Result<(), ClusterError> {
        self.conn_mut(conn)?.engine.send(socket, message)?;
        self.drive(conn);
        self.flush_net();
        Ok(())
    }

    /// Calls back with [`AppEvent::Wake`]`(token)` at `at` ns (now, if
    /// that has passed).
    pub fn wake_at(&mut self, at: u64, token: u64) {
        let at = SimTime::from_nanos(at.max(self.now()));
        let _ = self.sim.schedule_at(at, Event::App(token));
    }

    /// Runs until the application has something to see, at most until
    /// `until` ns: the event and its time, or `None` (nothing happened
    /// before `until`; the clock is then at the last event handled).
    pub fn next(&mut self, until: u64) -> Option<(u64, AppEvent)> {
        loop {
            if let Some(next) = self.app.pop_front() {
                return Some(next);
            }
            let due = self.sim.next_event_until(SimTime::from_nanos(until))?;
            let now = due.at.as_nanos();
            match due.event {
                Event::Net(event) => self.net.handle(event, now),
                Event::EngineTimer(id) => {
                    let Some(conn) = self.conns.get_mut(id) else {
                        continue;
                    };
                    if conn.timer != Some(now) {
                        continue;
                    }
                    conn.timer = None;
                    let at = self.sim.now().to_instant(self.origin);
                    conn.engine.handle_timeout(at);
                    self.drive(id);
                }
                Event::App(token) => self.app.push_back((now, AppEvent::Wake(token))),
            }
            self.flush_net();
        }
    }

    /// Completions to engines, their outputs to the NICs, the network's
    /// events to the simulator, until nothing is left to pass on.
    fn flush_net(&mut self) {
        loop {
            let now = self.now();
            let at = self.instant();
            while let Some(h) = self.net.poll_touched() {
                while let Some(wc) = self.net.nic_mut(h).poll_completion() {
                    let Some(&id) = self.by_qp[h as usize].get(wc.qpn as usize) else {
                        continue;
                    };
                    if let Some(conn) = self.conns.get_mut(id) {
                        conn.engine.handle_completion(&wc, at);
                        self.dirty.push(id);
                    }
                }
            }
            let dirty = std::mem::take(&mut self.dirty);
            let mut driven = false;
            for id in dirty {
                self.drive(id);
                driven = true;
            }
            for (t, event) in self.net.poll_scheduled().collect::<Vec<_>>() {
                let _ = self
                    .sim
                    .schedule_at(SimTime::from_nanos(t.max(now)), Event::Net(event));
            }
            if !driven {
                return;
            }
        }
    }

    /// Drains connection `id`'s engine into its NIC and the application,
    /// and arms its timer.
    fn drive(&mut self, id: ConnId) {
        let now = self.now();
        let at = self.instant();
        let origin = self.origin;
        let Some(conn) = self.conns.get_mut(id) else {
            return;
        };
        let nic = self.net.nic_mut(conn.host);
        if let Some(wrs) = conn.engine.poll_recv_post()
            && let Err(err) = nic.post_recv(conn.qpn, &wrs)
        {
            conn.engine.handle_post_error(post_error(err));
        }
        while let Some(batch) = conn.engine.poll_transmit(at) {
            if let Err(err) = nic.post_send(conn.qpn, &batch, now) {
                conn.engine.handle_post_error(post_error(err));
            }
        }
        while let Some(event) = conn.engine.poll_event() {
            let event = match event {
                EngineEvent::Opened(socket) => AppEvent::Opened { conn: id, socket },
                EngineEvent::Accepted(socket) => AppEvent::Accepted { conn: id, socket },
                EngineEvent::Message { socket, bytes } => AppEvent::Message {
                    conn: id,
                    socket,
                    bytes,
                },
                EngineEvent::Sent(socket) => AppEvent::Sent { conn: id, socket },
                EngineEvent::Failed(error) => AppEvent::Failed { conn: id, error },
                other => AppEvent::Socket {
                    conn: id,
                    event: other,
                },
            };
            self.app.push_back((now, event));
        }
        if let Some(deadline) = conn.engine.poll_timeout() {
            let ns = u64::try_from(deadline.saturating_duration_since(origin).as_nanos())
                .unwrap_or(u64::MAX)
                .max(now);
            if conn.timer.is_none_or(|t| ns < t) {
                conn.timer = Some(ns);
                let _ = self
                    .sim
                    .schedule_at(SimTime::from_nanos(ns), Event::EngineTimer(id));
            }
        }
        let host = conn.host;
        self.net.kick(host, now);
    }
}

fn post_error(err: PostError) -> VerbsError {
    match err {
        PostError::SendQueueFull(_) => VerbsError::QueueFull {
            queue: "send",
            posted: 0,
            depth: 0,
        },
        other => VerbsError::InvalidRequest(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::Topology;

    fn cluster(hosts: u32, window: usize) -> Cluster {
        let mut engine = EngineConfig::default();
        engine.window.max_bytes = window;
        Cluster::new(ClusterConfig {
            net: NetParams::new(Topology::Tor { hosts }),
            engine,
            seed: 1,
        })
        .unwrap()
    }

    /// Opens a socket from `a` to `b` and runs until it is accepted.
    fn open(c: &mut Cluster, a: ConnId, b: ConnId) -> SocketId {
        let socket = c.open(a).unwrap();
        loop {
            match c.next(1_000_000_000).expect("the socket opens") {
                (_, AppEvent::Opened { conn, socket: s }) if conn == b => c.accept(b, s).unwrap(),
                (_, AppEvent::Accepted { conn, .. }) if conn == a => return socket,
                (_, AppEvent::Failed { error, .. }) => panic!("{error}"),
                _ => {}
            }
        }
    }

    fn pattern(len: usize, seed: u8) -> impl Iterator<Item = u8> {
        (0..len).map(move |i| seed.wrapping_add((i % 251) as u8))
    }

    #[test]
    fn messages_small_and_large_cross_the_fabric_whole_and_in_order() {
        let mut c = cluster(2, 0);
        let (a, b) = c.connect(0, 1).unwrap();
        let socket = open(&mut c, a, b);
        let sizes = [100, 8_000, 20_000, 50_000, 1_000_000, 3];
        for (i, &len) in sizes.iter().enumerate() {
            let (send, _) = c.pools(0).unwrap();
            let mut buf = send.alloc(len).unwrap();
            for (byte, v) in buf.iter_mut().zip(pattern(len, i as u8)) {
                *byte = v;
            }
            c.send(a, socket, Message::from(buf.freeze())).unwrap();
        }
        let mut got = Vec::new();
        while got.len() < sizes.len() {
            match c.next(1_000_000_000).expect("every message arrives") {
                (t, AppEvent::Message { conn, bytes, .. }) if conn == b => got.push((t, bytes)),
                (_, AppEvent::Failed { error, .. }) => panic!("{error}"),
                _ => {}
            }
        }
        for (i, (_, bytes)) in got.iter().enumerate() {
            assert_eq!(bytes.len(), sizes[i]);
            assert!(
                bytes.iter().copied().eq(pattern(sizes[i], i as u8)),
                "message {i}"
            );
        }
        // About 1.08 MB at 25 Gbit/s (plus headers, RTS/CTS round trips):
        // a little over 350 us.
        let last = got.last().unwrap().0;
        assert!((340_000..600_000).contains(&last), "{last}");
        assert_eq!(c.net().stats().drops, 0);
    }

    #[test]
    fn the_send_window_bounds_the_bytes_in_flight() {
        let window = 4096;
        let mut c = cluster(2, window);
        let (a, b) = c.connect(0, 1).unwrap();
        let socket = open(&mut c, a, b);
        for i in 0..4 {
            let m = c.message(0, 50_000, i).unwrap();
            c.send(a, socket, m).unwrap();
        }
        let mut n = 0;
        while n < 4 {
            if let (_, AppEvent::Message { conn, .. }) = c.next(1_000_000_000).expect("arrives") {
                n += usize::from(conn == b);
            }
        }
        let peak = c.engine(a).unwrap().stats().peak_in_flight_bytes;
        assert!(peak > 0 && peak <= window as u64, "{peak}");
    }

    #[test]
    fn the_same_seed_gives_the_same_run() {
        let run = || {
            let mut c = cluster(9, 8192);
            let mut pairs = Vec::new();
            for h in 1..9 {
                let (a, b) = c.connect(h, 0).unwrap();
                pairs.push((a, b, open(&mut c, a, b)));
            }
            for (i, &(a, _, socket)) in pairs.iter().enumerate() {
                let m = c.message(i as u32 + 1, 30_000 + i * 1000, 1).unwrap();
                c.send(a, socket, m).unwrap();
            }
            let mut log = Vec::new();
            while let Some((t, event)) = c.next(1_000_000_000) {
                if let AppEvent::Message { conn, bytes, .. } = event {
                    log.push((t, conn, bytes.len()));
                }
            }
            (log, c.net().stats(), c.now())
        };
        let first = run();
        assert_eq!(first.0.len(), 8);
        assert_eq!(first, run());
    }
}
