//! RDMA connections: the out-of-band handshake, and the runtime that owns a
//! transport's I/O threads and its table of engines.
//!
//! **Handshake.** The dialer connects over TCP to the listener's address;
//! each side creates its queue pair (on the completion queue of the I/O
//! thread it will run on) and posts its receives. The dialer sends a
//! [`Hello`] (protocol version, QP number, LID/GID, PSN, receive depth and
//! receive-buffer size, message limit, keepalive slot); the listener
//! connects its QP to it and answers with its own; the dialer connects and
//! confirms with one byte, after which both may send. A different version
//! is refused with a clear error. The TCP connection stays open: its
//! closing tells the other side at once that the peer went away (keepalive
//! covers hosts that vanish without closing it).
//!
//! **Connection table** (§6.1). With `multiplex` on, each rail of a
//! transport keeps one engine per remote address (`rdma/rails.rs` picks
//! the rail): `connect` opens a new logical socket on it,
//! or dials and sets one up first (concurrent connects to the same address
//! wait for the same setup). An engine that fails leaves the table, and the
//! next `connect` dials afresh.

use crate::sync::LockExt;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{OnceCell, mpsc, oneshot};

use super::cq_budget::{CqBudget, CqReservation};
use super::engine::{Engine, EngineConfig, KeepaliveConfig, PeerInfo, Role, StripeConfig};
use super::io::{Attached, Command, IoThread, SharedReceives};
use super::partners::Partners;
use super::window::WindowConfig;
use crate::pool::Pool;
use crate::tls::BoxStream;
use crate::verbs::{Device, GidType, LinkLayer, QpCaps, QpEndpoint};
use crate::{Connection, HandshakeError, Polling, RdmaError, TransportConfig, TransportError};

/// Version of the RDMA connection protocol (handshake and control header).
pub const PROTOCOL_VERSION: u16 = 6;
/// First bytes of every hello (how an `auto` listener tells RDMA from TCP).
pub const HELLO_MAGIC: &[u8; 4] = b"TSRD";
/// Bytes of a hello.
pub const HELLO_LEN: usize = 96;
/// Where a hello carries its sender's rail (a byte that was zero before
/// rails: a peer that predates them dials on rail 0).
pub(crate) const RAIL_BYTE: usize = 82;
/// Where a hello carries its sender's transport instance (8 bytes, a
/// random number per transport; 0 before striping): the acceptor knows
/// its engines to one peer on several rails by it (`rdma/partners.rs`).
pub(crate) const INSTANCE_AT: usize = 84;
/// The dialer's last handshake byte: its QP is connected too.
const READY: u8 = 0x52;

/// What each side tells the other at connection setup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// Protocol version.
    pub version: u16,
    /// The sender's queue pair.
    pub endpoint: QpEndpoint,
    /// Receives the sender has posted (the peer's initial credits).
    pub recv_depth: u32,
    /// Bytes of each of the sender's receive buffers.
    pub recv_buffer: u32,
    /// Largest message the sender accepts.
    pub max_message: u64,
    /// The sender's rail (its place among its devices, 0 the primary): the
    /// acceptor sets up its side on its rail of the same place.
    pub rail: u8,
    /// Where the peer writes its keepalive (address, rkey), if the sender
    /// runs keepalive without remote-write confinement (a confined sender
    /// tells it later, in a `Slot` control message behind the bind of a
    /// window on the slot: see `rdma/windows.rs`).
    pub keepalive_slot: Option<(u64, u32)>,
    /// The sender's receives come from a shared receive queue.
    pub shared_receives: bool,
    /// The sender's transport (random per transport; 0: unknown), which
    /// engines on several rails to one peer share (`rdma/partners.rs`).
    pub instance: u64,
}

impl Hello {
    fn encode(&self) -> [u8; HELLO_LEN] {
        let mut out = [0u8; HELLO_LEN];
        out[0..4].copy_from_slice(HELLO_MAGIC);
        out[4..6].copy_from_slice(&self.version.to_le_bytes());
        out[8..12].copy_from_slice(&self.endpoint.qpn.to_le_bytes());
        out[12..14].copy_from_slice(&self.endpoint.lid.to_le_bytes());
        out[16..32].copy_from_slice(&self.endpoint.gid);
        out[32..36].copy_from_slice(&self.endpoint.psn.to_le_bytes());
        out[36..40].copy_from_slice(&self.recv_depth.to_le_bytes());
        out[40..48].copy_from_slice(&self.endpoint.node.to_le_bytes());
        out[48..56].copy_from_slice(&self.max_message.to_le_bytes());
        out[56..60].copy_from_slice(&self.recv_buffer.to_le_bytes());
        let mut flags = 0u32;
        if let Some((addr, rkey)) = self.keepalive_slot {
            flags |= 1;
            out[64..72].copy_from_slice(&addr.to_le_bytes());
            out[72..76].copy_from_slice(&rkey.to_le_bytes());
        }
        if self.shared_receives {
            flags |= 2;
        }
        out[60..64].copy_from_slice(&flags.to_le_bytes());
        out[76..80].copy_from_slice(&self.endpoint.mtu.to_le_bytes());
        out[80] = self.endpoint.link_layer.code();
        out[81] = self.endpoint.gid_type.code();
        out[RAIL_BYTE] = self.rail;
        out[INSTANCE_AT..INSTANCE_AT + 8].copy_from_slice(&self.instance.to_le_bytes());
        out
    }

    /// Decodes a hello; anything but the Tessera RDMA handshake is refused.
    pub fn decode(raw: &[u8; HELLO_LEN]) -> Result<Self, TransportError> {
        if &raw[0..4] != HELLO_MAGIC {
            return Err(TransportError::rdma_error(HandshakeError::NotTessera));
        }
        let u32_at = |i: usize| u32::from_le_bytes([raw[i], raw[i + 1], raw[i + 2], raw[i + 3]]);
        let u64_at = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&raw[i..i + 8]);
            u64::from_le_bytes(b)
        };
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&raw[16..32]);
        // A peer of another version says so first (its port fields may be
        // elsewhere or missing).
        let version = u16::from_le_bytes([raw[4], raw[5]]);
        let (link_layer, gid_type) = if version == PROTOCOL_VERSION {
            let link_layer = LinkLayer::from_code(raw[80]).ok_or(TransportError::rdma_error(
                HandshakeError::LinkLayer(raw[80]),
            ))?;
            let gid_type = GidType::from_code(raw[81])
                .ok_or(TransportError::rdma_error(HandshakeError::GidType(raw[81])))?;
            (link_layer, gid_type)
        } else {
            (LinkLayer::Ethernet, GidType::RoceV2)
        };
        Ok(Self {
            version,
            endpoint: QpEndpoint {
                qpn: u32_at(8),
                lid: u16::from_le_bytes([raw[12], raw[13]]),
                gid,
                // 24 bits on the wire.
                psn: u32_at(32) & 0x00ff_ffff,
                node: u64_at(40),
                mtu: u32_at(76),
                link_layer,
                gid_type,
            },
            recv_depth: u32_at(36),
            max_message: u64_at(48),
            recv_buffer: u32_at(56),
            keepalive_slot: (u32_at(60) & 1 == 1).then(|| (u64_at(64), u32_at(72))),
            shared_receives: u32_at(60) & 2 == 2,
            rail: raw[RAIL_BYTE],
            instance: u64_at(INSTANCE_AT),
        })
    }
}

/// How long an incoming RDMA handshake may take. 10 s: far longer than a
/// handshake on a loaded host, short enough that silent peers do not pile up.
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// One rail of a transport's RDMA side (`rdma/rails.rs` holds them all):
/// device, I/O threads, engine table.
pub(crate) struct RdmaRuntime {
    /// The device's asynchronous events, handed to the I/O threads (first:
    /// dropped first, so that its handler's handles on the threads go
    /// before the threads are asked to end).
    _events: crate::verbs::EventWatch,
    /// Events seen.
    async_events: Arc<std::sync::atomic::AtomicU64>,
    device: Arc<dyn Device>,
    /// The device's place among the transport's rails (0: the primary):
    /// the engines' buffers use that rail's keys.
    rail: usize,
    /// Whether the device's port is up, as its last port event said (a
    /// rail whose port is down takes no new connection).
    port_up: Arc<AtomicBool>,
    config: TransportConfig,
    pools: (Pool, Pool),
    threads: Vec<IoThread>,
    /// Room on each thread's CQ (by index of `threads`).
    budgets: Vec<Arc<CqBudget>>,
    /// The transport's budget of large inbound messages, which accepted
    /// engines' grants draw on too.
    inbound: Option<crate::inbound::InboundBudget>,
    /// Mutual TLS on the handshake's control connection, if configured.
    tls: Option<crate::tls::Tls>,
    next_thread: AtomicUsize,
    table: Mutex<HashMap<String, Arc<OnceCell<EngineRef>>>>,
    /// The engines to each peer on every rail, for striping
    /// (`rdma/partners.rs`; shared by the transport's rails).
    partners: Arc<Partners>,
}

impl std::fmt::Debug for RdmaRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaRuntime")
            .field("device", &self.device.name())
            .field("io_threads", &self.threads.len())
            .finish_non_exhaustive()
    }
}

/// An engine in the table.
#[derive(Clone)]
pub(crate) struct EngineRef {
    io: IoThread,
    qpn: u32,
    alive: Arc<AtomicBool>,
}

impl RdmaRuntime {
    /// Starts the I/O threads of a transport's rail `rail` (on `device`).
    pub(crate) fn new(
        device: Arc<dyn Device>,
        rail: usize,
        config: &TransportConfig,
        pools: (Pool, Pool),
        inbound: Option<crate::inbound::InboundBudget>,
        tls: Option<crate::tls::Tls>,
        partners: Arc<Partners>,
    ) -> Result<Self, TransportError> {
        let rdma = &config.rdma;
        let failed = |e: crate::verbs::VerbsError| TransportError::rdma_error(e);
        // The CPUs of the NIC's NUMA node, where the host says (threads
        // only: runtime drivers run on the application's threads).
        let node = device.numa_node();
        let cpus = node.and_then(super::topology::node_cpus);
        if let (Some(node), Some(cpus), Polling::Event | Polling::Busy) =
            (node, &cpus, rdma.polling)
        {
            tracing::info!(
                device = device.name(),
                node,
                cpus = cpus.len(),
                "RDMA I/O threads pinned to the NIC's NUMA node"
            );
        }
        let threads = (0..rdma.io_threads)
            .map(|i| {
                let cq = device.create_cq(rdma.cq_depth).map_err(failed)?;
                let shared = match rdma.srq {
                    true => Some(SharedReceives::new(
                        device.create_srq(rdma.srq_depth).map_err(failed)?,
                        pools.1.clone(),
                        super::control::HEADER_LEN + rdma.small_message_limit,
                        rdma.srq_depth,
                        rail,
                    )?),
                    false => None,
                };
                IoThread::start(
                    format!("tessera-io-{i}"),
                    cq,
                    shared,
                    rdma.polling,
                    Duration::from_micros(rdma.spin_us),
                    match (rdma.provider, rdma.soft_faults.panic_on_message_len) {
                        (crate::RdmaProvider::Soft, len) if len > 0 => Some(len as usize),
                        _ => None,
                    },
                    cpus.clone(),
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        let async_events = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let port_up = Arc::new(AtomicBool::new(true));
        let events = device
            .watch_events(Arc::new({
                let threads = threads.clone();
                let seen = Arc::clone(&async_events);
                let port_up = Arc::clone(&port_up);
                // The rail's own port (another port of the device is
                // another rail's, or none); the soft NIC has port 1 only.
                let ours = {
                    let (configured, soft) =
                        (rdma.port, rdma.provider == crate::RdmaProvider::Soft);
                    move |port: u8| soft || port == configured
                };
                let name = device.name().to_owned();
                move |event: crate::verbs::AsyncEvent| {
                    seen.fetch_add(1, Ordering::Relaxed);
                    match event {
                        crate::verbs::AsyncEvent::PortDown { port } if ours(port) => {
                            port_up.store(false, Ordering::Release);
                        }
                        crate::verbs::AsyncEvent::DeviceFailed => {
                            port_up.store(false, Ordering::Release);
                        }
                        crate::verbs::AsyncEvent::PortUp { port } if ours(port) => {
                            port_up.store(true, Ordering::Release);
                        }
                        _ => {}
                    }
                    metrics::counter!("tessera_rdma_async_events_total", "event" => event.label())
                        .increment(1);
                    tracing::warn!(device = %name, ?event, "rdma device event");
                    for thread in &threads {
                        thread.submit(Command::Event(event));
                    }
                }
            }))
            .map_err(failed)?;
        // A port that went down before the watch began raised its event to
        // nobody: its state now, with the watch in place, is the start.
        if !device.port_active() {
            port_up.store(false, Ordering::Release);
        }
        let fixed = if rdma.srq { rdma.srq_depth } else { 0 };
        let budgets = threads
            .iter()
            .map(|_| CqBudget::new(rdma.cq_depth, fixed))
            .collect();
        Ok(Self {
            _events: events,
            async_events,
            device,
            rail,
            port_up,
            config: config.clone(),
            pools,
            threads,
            budgets,
            inbound,
            tls,
            next_thread: AtomicUsize::new(0),
            table: Mutex::new(HashMap::new()),
            partners,
        })
    }

    /// The device's name.
    pub(crate) fn device_name(&self) -> &str {
        self.device.name()
    }

    /// Whether the device's port is up (as its last port event said).
    pub(crate) fn port_up(&self) -> bool {
        self.port_up.load(Ordering::Acquire)
    }

    /// Adds its counters, summed over the I/O threads (brought up to date
    /// every 100 ms and whenever an engine comes or goes), to `total`.
    pub(crate) fn add_stats(&self, total: &mut super::RdmaStats) {
        for thread in &self.threads {
            let s = thread.stats();
            let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
            total.qps_open += get(&s.qps_open);
            total.sockets_open += get(&s.sockets_open);
            total.bytes_sent += get(&s.bytes_sent);
            total.bytes_received += get(&s.bytes_received);
            total.messages_sent += get(&s.messages_sent);
            total.messages_received += get(&s.messages_received);
            total.credit_stalls += get(&s.credit_stalls);
            total.window_stalls += get(&s.window_stalls);
            total.keepalives_sent += get(&s.keepalives_sent);
            total.offered_sends += get(&s.offered_sends);
            total.stripe_chunks += get(&s.stripe_chunks);
            total.stripe_redone += get(&s.stripe_redone);
            total.striped_bytes += get(&s.striped_bytes);
            total.keepalive_failures += get(&s.keepalive_failures);
            total.engines_failed += get(&s.engines_failed);
            total.shared_receives_posted += get(&s.shared_receives_posted);
            total.io_rounds += get(&s.rounds);
            total.engine_visits += get(&s.engine_visits);
            total.peak_in_flight_bytes =
                total.peak_in_flight_bytes.max(get(&s.peak_in_flight_bytes));
        }
        if let Some(rnr) = self.device.rnr_events() {
            total.rnr_events += rnr;
        }
        total.async_events += self.async_events.load(Ordering::Relaxed);
    }

    /// The next I/O thread, round robin, whose CQ has room for one more
    /// QP's completions, with the room taken.
    fn thread(&self) -> Result<(IoThread, CqReservation), TransportError> {
        let rdma = &self.config.rdma;
        let need = rdma.send_queue_depth + if rdma.srq { 0 } else { rdma.recv_queue_depth };
        let start = self.next_thread.fetch_add(1, Ordering::Relaxed);
        (0..self.threads.len())
            .map(|k| (start + k) % self.threads.len())
            .find_map(|i| {
                self.budgets[i]
                    .reserve(need)
                    .map(|room| (self.threads[i].clone(), room))
            })
            .ok_or(TransportError::CompletionQueuesFull {
                io_threads: self.threads.len(),
                cq_depth: rdma.cq_depth,
                need,
            })
    }

    /// A new logical connection to `addr`, on the engine already connected
    /// there if multiplexing is on.
    pub(crate) async fn connect(&self, addr: &str) -> Result<Connection, TransportError> {
        if !self.config.rdma.multiplex {
            let engine = self.dial(addr).await?;
            return open_socket(&engine).await;
        }
        for _ in 0..3 {
            let cell = {
                let mut table = self.table.locked();
                Arc::clone(table.entry(addr.to_owned()).or_default())
            };
            let engine = cell.get_or_try_init(|| self.dial(addr)).await?;
            if engine.alive.load(Ordering::Acquire) {
                match open_socket(engine).await {
                    Ok(connection) => return Ok(connection),
                    // Refused: the peer is up but does not listen.
                    Err(err @ TransportError::Connect { .. }) => return Err(err),
                    Err(err) => tracing::debug!(%addr, %err, "engine went away; dialing again"),
                }
            }
            // A dead engine leaves the table (unless someone replaced it).
            let mut table = self.table.locked();
            if table.get(addr).is_some_and(|c| Arc::ptr_eq(c, &cell)) {
                table.remove(addr);
            }
        }
        Err(TransportError::rdma_error(RdmaError::NoConnection {
            addr: addr.to_owned(),
        }))
    }

    async fn dial(&self, addr: &str) -> Result<EngineRef, TransportError> {
        let stream = TcpStream::connect(addr)
            .await
            .map_err(|source| TransportError::Connect {
                addr: addr.to_owned(),
                source,
            })?;
        let peer = crate::tls::prepare(&stream)?;
        // With TLS the hello travels inside it: the QP is set up with the
        // server the certificate names, and nobody else learns its number.
        let (stream, identity): (BoxStream, _) = match &self.tls {
            None => (Box::new(stream), None),
            Some(tls) => {
                let (stream, identity) = tls.connect(addr, stream, peer).await?;
                (Box::new(stream), Some(Arc::new(identity)))
            }
        };
        self.establish(stream, peer, Role::Dialer, None, identity)
            .await
    }

    /// Runs the handshake with `peer` on `stream` (its control connection:
    /// TCP, or TLS over it, already verified) and hands the engine to an
    /// I/O thread. `accepts` receives the sockets the peer opens; every
    /// socket of the engine carries `identity`.
    pub(crate) async fn establish(
        &self,
        mut stream: BoxStream,
        peer: std::net::SocketAddr,
        role: Role,
        accepts: Option<mpsc::Sender<Connection>>,
        identity: Option<Arc<crate::tls::PeerIdentity>>,
    ) -> Result<EngineRef, TransportError> {
        let rdma = &self.config.rdma;
        let (io, cq_room) = self.thread()?;
        let mut engine = self.new_engine(role)?;
        // The QP after the engine: on every early return below, locals drop
        // in reverse, so the QP (which may hold the engine's receive
        // buffers) goes before the engine that owns them.
        let qp = self.new_qp(&io, &mut engine)?;
        let mine = Hello {
            version: PROTOCOL_VERSION,
            endpoint: qp.endpoint(),
            recv_depth: if rdma.srq { 0 } else { rdma.recv_queue_depth },
            recv_buffer: u32::try_from(engine.recv_buffer_size()).unwrap_or(u32::MAX),
            max_message: self.config.max_message_size,
            keepalive_slot: engine.keepalive_slot(),
            shared_receives: rdma.srq,
            rail: u8::try_from(self.rail).unwrap_or(0),
            instance: self.partners.instance(),
        };
        let theirs = exchange_hellos(&mut stream, role, &mine, &*qp).await?;
        let info = PeerInfo {
            recv_depth: theirs.recv_depth,
            recv_buffer: theirs.recv_buffer,
            keepalive_slot: theirs.keepalive_slot,
            shared_receives: theirs.shared_receives,
        };
        // The dialer's QP is connected (it sent READY): it may send. The
        // acceptor's engine may not before the dialer confirms, or its
        // first write would hit a QP that is not ready.
        if role == Role::Dialer {
            engine.peer_ready(info, Instant::now());
        }
        let qpn = qp.qpn();
        let alive = Arc::new(AtomicBool::new(true));
        let (stop, stopped) = oneshot::channel::<()>();
        // The engine runs before the acceptor answers: the dialer may send
        // (open a socket) the moment it has the answer, and the I/O thread
        // must know the QP by then (it receives at once, sends once ready).
        let attached = Attached {
            qp,
            engine,
            peer,
            alive: Arc::clone(&alive),
            accepts,
            _control: stop,
            max_message_size: self.config.max_message_size,
            send_queue_depth: self.config.send_queue_depth,
            _cq_room: cq_room,
            close_when_unused: role == Role::Dialer && !rdma.multiplex,
            identity,
        };
        if !io.submit(Command::Attach(Box::new(attached))) {
            return Err(TransportError::rdma_error(RdmaError::ThreadStopped));
        }
        if role == Role::Acceptor {
            confirm(&mut stream, &mine, &io, qpn, info).await?;
        }
        watch_control(stream, io.clone(), qpn, stopped);
        // Ready on both ends: its rail's engines to the same peer may hand
        // it chunks, and it them.
        self.partners.join(
            theirs.instance,
            super::io::Partner {
                rail: self.rail,
                io: io.clone(),
                qpn,
                alive: Arc::clone(&alive),
            },
        );
        Ok(EngineRef { io, qpn, alive })
    }

    /// A new engine of this rail for a connection in `role`; an acceptor's
    /// draws on the listener's inbound budget.
    fn new_engine(&self, role: Role) -> Result<Engine, TransportError> {
        let engine_config = engine_config(
            &self.config,
            self.rail,
            self.partners.rails(),
            self.partners.striping(),
        );
        let mut engine = Engine::new(
            engine_config,
            self.pools.0.clone(),
            self.pools.1.clone(),
            role,
            Instant::now(),
        )
        .map_err(TransportError::rdma_error)?;
        if role == Role::Acceptor
            && let Some(budget) = &self.inbound
        {
            engine.set_inbound_budget(budget.clone());
        }
        Ok(engine)
    }

    /// The engine's queue pair on `io`'s completion queue (and shared
    /// receive queue), in INIT, with the engine's memory windows and first
    /// receives: receives go up before the peer can learn of them.
    fn new_qp(
        &self,
        io: &IoThread,
        engine: &mut Engine,
    ) -> Result<Arc<dyn crate::verbs::QueuePair>, TransportError> {
        let rdma = &self.config.rdma;
        let failed = |e: crate::verbs::VerbsError| TransportError::rdma_error(e);
        let caps = QpCaps {
            max_send_wr: rdma.send_queue_depth,
            max_recv_wr: rdma.recv_queue_depth,
            max_sge: 4,
            // The peer may use a shared receive queue; with dedicated ones
            // credits make a receiver-not-ready impossible anyway.
            rnr_retry: 7,
        };
        let qp = match io.srq() {
            Some(srq) => {
                self.device
                    .create_qp_on_srq(Arc::clone(io.cq()), Arc::clone(io.cq()), srq, caps)
            }
            None => self
                .device
                .create_qp(Arc::clone(io.cq()), Arc::clone(io.cq()), caps),
        }
        .map_err(failed)?;
        // INIT before the first receives: real providers (rxe, hns) refuse
        // receives on a QP in RESET.
        qp.init().map_err(failed)?;
        // Confinement: the peer writes only through windows bound for
        // its grants (the receive pool has no remote access of its own).
        // Allocated after the QP they will be bound on: a process that dies
        // without closing its connections has its verbs objects destroyed
        // by the kernel newest first, so its windows go before its QP (rxe
        // waits 50 s for a window still bound on a QP being destroyed, and
        // the dying process with it). None is bound before the engine is
        // attached, so an early return drops them in any order.
        if rdma.confine_remote_writes {
            let windows = (0..rdma.windows_per_connection)
                .map(|_| self.device.alloc_window())
                .collect::<Result<Vec<_>, _>>()
                .map_err(failed)?;
            engine.set_windows(windows);
        }
        if let Some(wrs) = engine.poll_recv_post() {
            qp.post_recv(&wrs).map_err(failed)?;
        }
        Ok(qp)
    }

    /// Makes sure this rail has an engine to `addr` (dials one if not), for
    /// striping: a connection on another rail to `addr` then has a partner
    /// here. Only with multiplexing (engines shared per address).
    pub(crate) async fn ensure_engine(&self, addr: &str) -> Result<(), TransportError> {
        if !self.config.rdma.multiplex || !self.port_up() {
            return Ok(());
        }
        let cell = {
            let mut table = self.table.locked();
            Arc::clone(table.entry(addr.to_owned()).or_default())
        };
        if cell
            .get()
            .is_some_and(|engine| engine.alive.load(Ordering::Acquire))
        {
            return Ok(());
        }
        if cell.initialized() {
            // A dead engine leaves the table; the next dial replaces it.
            let mut table = self.table.locked();
            if table.get(addr).is_some_and(|c| Arc::ptr_eq(c, &cell)) {
                table.remove(addr);
            }
            return Ok(());
        }
        cell.get_or_try_init(|| self.dial(addr)).await.map(drop)
    }

    /// Whether this rail has a live engine to `addr` now.
    pub(crate) fn has_engine(&self, addr: &str) -> bool {
        self.table.locked().get(addr).is_some_and(|cell| {
            cell.get()
                .is_some_and(|engine| engine.alive.load(Ordering::Acquire))
        })
    }
}

/// Tells the I/O thread that an attached engine's peer is gone when
/// dropped armed: a handshake that failed or was abandoned after the
/// engine was attached.
struct DetachUnlessConfirmed {
    io: IoThread,
    qpn: u32,
    armed: bool,
}

impl Drop for DetachUnlessConfirmed {
    fn drop(&mut self) {
        if self.armed {
            self.io.submit(Command::PeerClosed { qpn: self.qpn });
        }
    }
}

async fn open_socket(engine: &EngineRef) -> Result<Connection, TransportError> {
    let (reply, opened) = oneshot::channel();
    if !engine.io.submit(Command::Open {
        qpn: engine.qpn,
        reply,
    }) {
        return Err(TransportError::rdma_error(RdmaError::ThreadStopped));
    }
    opened
        .await
        .map_err(|_| TransportError::rdma_error(RdmaError::ThreadStopped))?
}

/// The engine configuration a transport of `config` runs on rail `rail`
/// of `rails`, striping large messages over them when `striping`: what
/// every RDMA connection builds its engine from, and what the fabric
/// simulator runs (`tessera-fabric`), so that a simulated engine is
/// configured as a deployed one.
pub fn engine_config(
    config: &TransportConfig,
    rail: usize,
    rails: usize,
    striping: bool,
) -> EngineConfig {
    let rdma = &config.rdma;
    EngineConfig {
        send_queue_depth: rdma.send_queue_depth,
        recv_queue_depth: rdma.recv_queue_depth,
        small_message_limit: rdma.small_message_limit,
        fragment_size: rdma.fragment_size,
        // What the queue pairs are created with.
        max_sge: 4,
        max_message_size: config.max_message_size,
        window: WindowConfig {
            max_bytes: rdma.window_bytes,
            adaptive: rdma.window_adaptive,
            target_delay: Duration::from_micros(rdma.window_target_delay_us),
        },
        keepalive: (rdma.keepalive_timeout_ms > 0).then(|| KeepaliveConfig {
            interval: Duration::from_millis(rdma.keepalive_interval_ms),
            timeout: Duration::from_millis(rdma.keepalive_timeout_ms),
        }),
        rts_ahead: 4,
        max_granted_bytes: config.inbound.connection_bytes(),
        shared_receives: rdma.srq,
        // Both ends speak the same protocol version, which has them.
        offers: true,
        rail,
        rails,
        stripe: striping.then(|| StripeConfig {
            min_bytes: rdma.stripe_min_bytes,
            chunk_bytes: rdma.stripe_chunk_bytes,
            ..StripeConfig::default()
        }),
        grant_timeout: Some(Duration::from_millis(rdma.grant_timeout_ms)),
    }
}

/// The first two legs of the handshake: the hellos, each side's QP
/// connected to the other's. Three legs in all, so that neither side sends
/// before the other's QP is connected (a SEND into a QP that is not ready
/// is lost, and an RC QP retries it until it gives up): the listener
/// connects before it answers, the dialer confirms once it has connected
/// too ([`confirm`] is the acceptor's part of that).
async fn exchange_hellos(
    stream: &mut BoxStream,
    role: Role,
    mine: &Hello,
    qp: &dyn crate::verbs::QueuePair,
) -> Result<Hello, TransportError> {
    let failed = |e: crate::verbs::VerbsError| TransportError::rdma_error(e);
    let mut raw = [0u8; HELLO_LEN];
    let check = |raw: &[u8; HELLO_LEN]| -> Result<Hello, TransportError> {
        let theirs = Hello::decode(raw)?;
        if theirs.version != PROTOCOL_VERSION {
            return Err(TransportError::rdma_error(HandshakeError::Version {
                peer: theirs.version,
                ours: PROTOCOL_VERSION,
            }));
        }
        Ok(theirs)
    };
    match role {
        Role::Dialer => {
            stream.write_all(&mine.encode()).await?;
            stream.flush().await?;
            stream.read_exact(&mut raw).await?;
            let theirs = check(&raw)?;
            qp.connect(&theirs.endpoint).map_err(failed)?;
            stream.write_all(&[READY]).await?;
            stream.flush().await?;
            Ok(theirs)
        }
        Role::Acceptor => {
            // A stranger (a TCP-transport client, a port scanner) is
            // turned away at its first bytes rather than at the handshake
            // timeout.
            stream.read_exact(&mut raw[..HELLO_MAGIC.len()]).await?;
            if &raw[..HELLO_MAGIC.len()] != HELLO_MAGIC {
                return Err(TransportError::rdma_error(HandshakeError::NotTessera));
            }
            stream.read_exact(&mut raw[HELLO_MAGIC.len()..]).await?;
            let theirs = check(&raw)?;
            qp.connect(&theirs.endpoint).map_err(failed)?;
            Ok(theirs)
        }
    }
}

/// The acceptor's last leg: answers with its hello and waits for the
/// dialer's confirmation, then lets its engine send. Until the dialer
/// confirms, the engine is attached but not ready (no timers, no
/// keepalive): if this future is dropped (the handshake bound) or fails,
/// the I/O thread must still be told, or the QP, its windows and its CQ
/// room stay for ever.
async fn confirm(
    stream: &mut BoxStream,
    mine: &Hello,
    io: &IoThread,
    qpn: u32,
    info: PeerInfo,
) -> Result<(), TransportError> {
    let mut unconfirmed = DetachUnlessConfirmed {
        io: io.clone(),
        qpn,
        armed: true,
    };
    stream.write_all(&mine.encode()).await?;
    stream.flush().await?;
    let mut ready = [0u8; 1];
    stream.read_exact(&mut ready).await?;
    if ready[0] != READY {
        return Err(TransportError::rdma_error(HandshakeError::NotConfirmed));
    }
    unconfirmed.armed = false;
    io.submit(Command::PeerReady { qpn, info });
    Ok(())
}

/// The handshake connection is the peer's liveness line: when it closes,
/// the engine fails at once; it is dropped when the engine goes
/// (`stopped`).
fn watch_control(mut stream: BoxStream, io: IoThread, qpn: u32, stopped: oneshot::Receiver<()>) {
    tokio::spawn(async move {
        let mut byte = [0u8; 1];
        tokio::select! {
            _ = stream.read(&mut byte) => {
                io.submit(Command::PeerClosed { qpn });
            }
            _ = stopped => {}
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_round_trips_and_refuses_strangers() {
        let hello = Hello {
            version: PROTOCOL_VERSION,
            endpoint: QpEndpoint {
                qpn: 0x1234,
                lid: 7,
                gid: [9; 16],
                psn: 0xabcdef,
                node: 42,
                mtu: 1024,
                link_layer: LinkLayer::InfiniBand,
                gid_type: GidType::IbRoceV1,
            },
            recv_depth: 64,
            recv_buffer: 8216,
            max_message: 64 << 20,
            keepalive_slot: Some((0x7f00_0000_1000, 77)),
            shared_receives: true,
            rail: 3,
            instance: 0x1234_5678_9abc_def0,
        };
        assert_eq!(Hello::decode(&hello.encode()).unwrap(), hello);
        let without = Hello {
            keepalive_slot: None,
            ..hello
        };
        assert_eq!(Hello::decode(&without.encode()).unwrap(), without);
        let mut raw = hello.encode();
        raw[0] = b'X';
        assert!(Hello::decode(&raw).is_err());
        // A link layer this build does not know is refused.
        let mut raw = hello.encode();
        raw[80] = 9;
        assert!(Hello::decode(&raw).is_err());
        // PSNs are 24 bits.
        let mut raw = hello.encode();
        raw[35] = 0xff;
        assert_eq!(Hello::decode(&raw).unwrap().endpoint.psn, 0xabcdef);
    }

    /// A peer that sends a valid hello and never confirms is dropped at the
    /// handshake bound with everything its engine held. Before, the
    /// abandoned handshake left the engine attached and never ready (no
    /// timers, no keepalive): its QP, windows and CQ room stayed for good,
    /// and enough such peers filled the completion queues.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unconfirmed_handshake_gives_back_its_engine() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut config = TransportConfig::soft_rdma();
        config.inbound.handshake_timeout_ms = 300;
        let server = crate::Transport::new(config).unwrap();
        let listener = server.listen("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        // A QP of our own on the soft fabric, for the server to connect to.
        let device = crate::verbs::soft::SoftFabric::process()
            .open("unconfirmed", crate::verbs::soft::SoftFaults::default())
            .unwrap();
        let cq = device.create_cq(64).unwrap();
        let qp = device.create_qp(cq.clone(), cq, QpCaps::default()).unwrap();
        qp.init().unwrap();
        let hello = Hello {
            version: PROTOCOL_VERSION,
            endpoint: qp.endpoint(),
            recv_depth: 64,
            recv_buffer: 8216,
            max_message: 64 << 20,
            keepalive_slot: None,
            shared_receives: false,
            rail: 0,
            instance: 0,
        };
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream.write_all(&hello.encode()).await.unwrap();
        let mut answer = [0u8; HELLO_LEN];
        stream.read_exact(&mut answer).await.unwrap();
        assert!(Hello::decode(&answer).is_ok());
        // Attached (the I/O thread counts it on its next round)...
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut attached = false;
        loop {
            let open = server.rdma_stats().unwrap().qps_open;
            attached |= open == 1;
            // ...then, with no READY, given back at the handshake bound.
            if attached && open == 0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the unconfirmed engine was never given back (attached: {attached})"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        drop(stream);
    }
}
