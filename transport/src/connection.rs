use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tessera_config::Validate;
use tokio::sync::mpsc;

use crate::inbound::{
    AddressSlot, ConnectionSlot, Deadlines, InboundBudget, InboundLimits, Stall, admit_connection,
};
use crate::inbound::{Addresses, ConnectionCap};
use crate::pool::{Access, CountingHook, Pool, RegistrationHook};
use crate::rdma::Role;
use crate::rdma::connection::{HANDSHAKE_TIMEOUT, RdmaRuntime};
use crate::rdma::io::RdmaSender;
use crate::tcp::{self, TcpReceiver, TcpSender, Wire};
use crate::tls::{PeerIdentity, Tls};
use crate::verbs::Device;
use crate::{Message, RdmaProvider, TransportConfig, TransportError, TransportKind};
use tokio::io::AsyncReadExt;

/// A transport instance: its configuration and its registered-memory pools.
///
/// Create one per process (or per NIC context) and share it: every
/// connection made through it receives into its receive pool, and the layers
/// above encode outgoing messages into its send pool. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Transport {
    inner: Arc<TransportInner>,
}

struct TransportInner {
    config: TransportConfig,
    send_pool: Pool,
    recv_pool: Pool,
    /// The RDMA device and I/O threads (kind `rdma`, or `auto` with a
    /// device).
    rdma: Option<Arc<RdmaRuntime>>,
    /// Bytes of large messages on accepted connections, all listeners
    /// together (`inbound.max_bytes`).
    inbound: InboundBudget,
    /// Accepted connections and budget shares per peer address.
    addresses: Addresses,
    /// Mutual TLS, if configured.
    tls: Option<Tls>,
}

impl std::fmt::Debug for TransportInner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransportInner")
            .field("kind", &self.config.kind)
            .field(
                "device",
                &self.rdma.as_ref().map(|r| r.device_name().to_owned()),
            )
            .finish()
    }
}

/// Soft devices opened by transports of this process (each its own name).
static SOFT_DEVICES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Opens the RDMA device `config` names.
fn open_device(config: &TransportConfig) -> Result<Arc<dyn Device>, TransportError> {
    let rdma = &config.rdma;
    match rdma.provider {
        RdmaProvider::Soft => {
            let fabric = crate::verbs::soft::SoftFabric::process();
            let profile = crate::verbs::soft::SoftProfile {
                port: crate::verbs::soft::SoftPort {
                    rate_mbps: rdma.soft_link_mbps,
                    ..Default::default()
                },
                ..Default::default()
            };
            let device = fabric
                .open_with(
                    format!(
                        "soft-{}",
                        SOFT_DEVICES.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                    ),
                    rdma.soft_faults,
                    profile,
                )
                .map_err(TransportError::rdma_error)?;
            if let Some(path) = &rdma.soft_port_file {
                device
                    .follow_port_file(path.clone())
                    .map_err(TransportError::Io)?;
            }
            Ok(Arc::new(device) as Arc<dyn Device>)
        }
        #[cfg(feature = "ibverbs")]
        RdmaProvider::Ibverbs => crate::verbs::ibverbs::IbvDevice::open(
            rdma.device.as_deref(),
            rdma.port,
            rdma.gid_index,
            rdma.traffic_class,
        )
        .map(|device| Arc::new(device) as Arc<dyn Device>)
        .map_err(TransportError::rdma_error),
        #[cfg(not(feature = "ibverbs"))]
        RdmaProvider::Ibverbs => Err(TransportError::rdma_error(crate::RdmaError::NoProvider)),
    }
}

impl Transport {
    /// A transport with `config`. TCP needs no NIC registration, so its
    /// pools use a counting hook; RDMA opens the configured device (an
    /// error if there is none, or if the configuration asks for more than
    /// the device holds: see [`crate::verbs::limits::fit`]), registers the
    /// pools with it and starts the I/O threads. `auto` falls back to TCP,
    /// saying why in the log, wherever RDMA would have failed.
    pub fn new(config: TransportConfig) -> Result<Self, TransportError> {
        config.validate()?;
        // Loaded once, first: a bad certificate is the same error whatever
        // the transport (not a reason for `auto` to try TCP).
        let tls = config.tls.as_ref().map(Tls::load).transpose()?;
        match config.kind {
            TransportKind::Tcp => Self::tcp(config, tls),
            TransportKind::Rdma => Self::rdma(config, tls),
            TransportKind::Auto => match Self::rdma(config.clone(), tls.clone()) {
                Ok(transport) => {
                    tracing::info!(
                        device = transport
                            .inner
                            .rdma
                            .as_ref()
                            .map(|r| r.device_name().to_owned()),
                        "transport auto: RDMA device available; RDMA with peers that speak it"
                    );
                    Ok(transport)
                }
                Err(err) => {
                    tracing::warn!(%err, "transport auto: RDMA cannot start here; using TCP");
                    Self::tcp(config, tls)
                }
            },
        }
    }

    fn tcp(config: TransportConfig, tls: Option<Tls>) -> Result<Self, TransportError> {
        let hook: Arc<dyn RegistrationHook> = Arc::new(CountingHook::new());
        let send_pool = Pool::new(
            config.send_pool.clone(),
            Access::LocalOnly,
            Arc::clone(&hook),
        )?;
        let recv_pool = Pool::new(config.recv_pool.clone(), Access::RemoteWrite, hook)?;
        Ok(Self {
            inner: Arc::new(TransportInner {
                inbound: InboundBudget::new(config.inbound.max_bytes),
                addresses: Addresses::new(&config.inbound),
                config,
                send_pool,
                recv_pool,
                rdma: None,
                tls,
            }),
        })
    }

    /// The RDMA runtime on the configured device, with the configuration
    /// fitted to the device's limits (what [`Transport::config`] reports).
    fn rdma(mut config: TransportConfig, tls: Option<Tls>) -> Result<Self, TransportError> {
        let device = open_device(&config)?;
        // Real NICs pin what they register (the soft one shares it).
        if config.rdma.provider == RdmaProvider::Ibverbs {
            use crate::verbs::memlock;
            let need = memlock::first_connection_bytes(&config);
            if let Some(err) = memlock::shortfall(memlock::limit(), need) {
                return Err(err.into());
            }
        }
        config.rdma = crate::verbs::limits::fit(&config.rdma, &device.limits(), device.name())?;
        let hook = device.registration_hook();
        let send_pool = Pool::new(
            config.send_pool.clone(),
            Access::LocalOnly,
            Arc::clone(&hook),
        )?;
        // Confined: peers reach receive memory only through the windows
        // bound for their grants.
        let recv_access = match config.rdma.confine_remote_writes {
            true => Access::Windows,
            false => Access::RemoteWrite,
        };
        let recv_pool = Pool::new(config.recv_pool.clone(), recv_access, hook)?;
        let inbound = InboundBudget::new(config.inbound.max_bytes);
        let rdma = RdmaRuntime::new(
            device,
            &config,
            (send_pool.clone(), recv_pool.clone()),
            Some(inbound.clone()),
            tls.clone(),
        )?;
        Ok(Self {
            inner: Arc::new(TransportInner {
                inbound,
                addresses: Addresses::new(&config.inbound),
                config,
                send_pool,
                recv_pool,
                rdma: Some(Arc::new(rdma)),
                tls,
            }),
        })
    }

    /// The name of the RDMA device this transport runs on, if it does.
    pub fn rdma_device(&self) -> Option<&str> {
        self.inner.rdma.as_ref().map(|r| r.device_name())
    }

    /// The configuration.
    pub fn config(&self) -> &TransportConfig {
        &self.inner.config
    }

    /// The pool outgoing messages are built in (local access only).
    pub fn send_pool(&self) -> &Pool {
        &self.inner.send_pool
    }

    /// The pool incoming messages are received into.
    pub fn recv_pool(&self) -> &Pool {
        &self.inner.recv_pool
    }

    /// Counters of the RDMA side (`None` without one).
    pub fn rdma_stats(&self) -> Option<crate::rdma::RdmaStats> {
        self.inner.rdma.as_ref().map(|rdma| rdma.stats())
    }

    /// Dials `addr` ("host:port"). For RDMA, `addr` is the peer's
    /// handshake listener, and the connection is a logical socket on the
    /// queue pair to that address (a new one the first time).
    pub async fn connect(&self, addr: &str) -> Result<Connection, TransportError> {
        let tcp = || self.connect_tcp(addr);
        match (self.inner.config.kind, &self.inner.rdma) {
            (TransportKind::Tcp, _) | (TransportKind::Auto, None) => tcp().await,
            (TransportKind::Rdma, Some(rdma)) => rdma.connect(addr).await,
            (TransportKind::Rdma, None) => {
                Err(TransportError::rdma_error(crate::RdmaError::NoDevice))
            }
            (TransportKind::Auto, Some(rdma)) => {
                match tokio::time::timeout(AUTO_HANDSHAKE_TIMEOUT, rdma.connect(addr)).await {
                    Ok(Ok(connection)) => Ok(connection),
                    outcome => {
                        let why = match outcome {
                            Ok(Err(err)) => err.to_string(),
                            _ => "handshake timed out".to_owned(),
                        };
                        tracing::warn!(%addr, %why, "transport auto: RDMA not possible with this peer; falling back to TCP");
                        tcp().await
                    }
                }
            }
        }
    }

    /// Dials `addr` over TCP whatever the configured kind: the RPC layer's
    /// fallback path when RDMA to a peer is broken (an RDMA listener also
    /// accepts TCP peers on the same address).
    pub async fn connect_tcp(&self, addr: &str) -> Result<Connection, TransportError> {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|source| TransportError::Connect {
                addr: addr.to_owned(),
                source,
            })?;
        let peer = crate::tls::prepare(&stream)?;
        match &self.inner.tls {
            None => Ok(self.tcp_connection(Wire::Plain(stream), peer, None, None)),
            Some(tls) => {
                let (stream, identity) = tls.connect(addr, stream, peer).await?;
                Ok(self.tcp_connection(
                    Wire::Secured(Box::new(stream)),
                    peer,
                    None,
                    Some(Arc::new(identity)),
                ))
            }
        }
    }

    /// Whether connections are mutually authenticated with TLS (and so
    /// carry a [`PeerIdentity`]).
    pub fn tls_enabled(&self) -> bool {
        self.inner.tls.is_some()
    }

    /// The loaded TLS settings, for another listener of this process
    /// with the same identity (the gRPC endpoint).
    pub fn tls(&self) -> Option<&Tls> {
        self.inner.tls.as_ref()
    }

    /// Whether connections to peers go over RDMA first (`rdma`, or `auto`
    /// with a device).
    pub fn prefers_rdma(&self) -> bool {
        self.inner.rdma.is_some() && self.inner.config.kind != TransportKind::Tcp
    }

    /// Listens on `addr` ("host:port"; port 0 picks a free one).
    pub async fn listen(&self, addr: &str) -> Result<Listener, TransportError> {
        // Both kinds listen on TCP: RDMA for its connection handshake.
        Listener::new(tcp::bind(addr).await?, self.clone())
    }

    fn tcp_connection(
        &self,
        wire: Wire,
        peer: SocketAddr,
        limits: Option<InboundLimits>,
        identity: Option<Arc<PeerIdentity>>,
    ) -> Connection {
        let config = &self.inner.config;
        let (tx, rx) = tcp::setup(config, self.inner.recv_pool.clone(), wire, peer, limits);
        Connection::tcp(config, tx, rx, peer, identity)
    }

    /// The limits of a connection accepted at `accepted` holding `slots`.
    fn inbound_limits(
        &self,
        (slot, address): (ConnectionSlot, AddressSlot),
        accepted: tokio::time::Instant,
        handshake_done: bool,
    ) -> InboundLimits {
        InboundLimits {
            budget: self.inner.inbound.clone(),
            deadlines: Deadlines::new(&self.inner.config.inbound, accepted, handshake_done),
            _slot: slot,
            address,
        }
    }

    /// The budget of incomplete inbound messages of accepted connections.
    pub fn inbound_budget(&self) -> &InboundBudget {
        &self.inner.inbound
    }
}

/// An established connection: a cloneable sending half and a receiving half.
#[derive(Debug)]
pub struct Connection {
    /// Queues whole messages for the peer.
    pub sender: MessageSender,
    /// Yields whole messages from the peer.
    pub receiver: MessageReceiver,
    peer: SocketAddr,
    identity: Option<Arc<PeerIdentity>>,
}

impl Connection {
    /// The peer's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    /// Who the peer is, as its TLS certificate says (verified against the
    /// configured CA); `None` when TLS is off.
    pub fn peer_identity(&self) -> Option<&Arc<PeerIdentity>> {
        self.identity.as_ref()
    }

    /// The transport this connection runs over: [`TransportKind::Tcp`] or
    /// [`TransportKind::Rdma`] (never `Auto`).
    pub fn kind(&self) -> TransportKind {
        self.sender.kind()
    }

    pub(crate) fn rdma(
        sender: RdmaSender,
        receiver: mpsc::Receiver<Result<Bytes, TransportError>>,
        max_message_size: u64,
        peer: SocketAddr,
        identity: Option<Arc<PeerIdentity>>,
    ) -> Self {
        Connection {
            sender: MessageSender {
                inner: SenderInner::Rdma(sender),
                max_message_size,
            },
            receiver: MessageReceiver {
                inner: ReceiverInner::Rdma(receiver),
            },
            peer,
            identity,
        }
    }

    fn tcp(
        config: &TransportConfig,
        tx: TcpSender,
        rx: TcpReceiver,
        peer: SocketAddr,
        identity: Option<Arc<PeerIdentity>>,
    ) -> Self {
        Connection {
            sender: MessageSender {
                inner: SenderInner::Tcp(tx),
                max_message_size: config.max_message_size,
            },
            receiver: MessageReceiver {
                inner: ReceiverInner::Tcp(rx),
            },
            peer,
            identity,
        }
    }
}

/// Accepts incoming connections.
#[derive(Debug)]
pub struct Listener {
    inner: ListenerInner,
    local_addr: SocketAddr,
}

#[derive(Debug)]
enum ListenerInner {
    Tcp {
        listener: tokio::net::TcpListener,
        transport: Transport,
        cap: ConnectionCap,
    },
    /// RDMA or TLS: a task accepts TCP connections and runs each
    /// handshake in a task of its own, so a slow or silent client never
    /// holds up the others; finished connections queue here.
    Handshaking {
        ready: tokio::sync::Mutex<mpsc::Receiver<Connection>>,
        _acceptor: AbortOnDrop,
    },
}

/// Stops the accepting task when the listener goes away.
#[derive(Debug)]
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Listener {
    fn new(
        listener: tokio::net::TcpListener,
        transport: Transport,
    ) -> Result<Self, TransportError> {
        let local_addr = listener.local_addr()?;
        let rdma = match transport.inner.config.kind {
            TransportKind::Tcp => false,
            TransportKind::Rdma => true,
            TransportKind::Auto => transport.inner.rdma.is_some(),
        };
        let cap = ConnectionCap::new(transport.inner.config.inbound.max_connections);
        let handshakes = rdma || transport.inner.tls.is_some();
        let inner = match handshakes {
            false => ListenerInner::Tcp {
                listener,
                transport,
                cap,
            },
            true => {
                let (tx, rx) = mpsc::channel(64);
                let acceptor = tokio::spawn(accept_handshaking(listener, transport, rdma, cap, tx));
                ListenerInner::Handshaking {
                    ready: tokio::sync::Mutex::new(rx),
                    _acceptor: AbortOnDrop(acceptor),
                }
            }
        };
        Ok(Self { inner, local_addr })
    }

    /// Waits for the next connection.
    pub async fn accept(&self) -> Result<Connection, TransportError> {
        match &self.inner {
            ListenerInner::Tcp {
                listener,
                transport,
                cap,
            } => loop {
                let (stream, peer) = listener.accept().await?;
                let Some(slot) = admit_connection(cap, &transport.inner.addresses, peer) else {
                    continue;
                };
                let accepted = tokio::time::Instant::now();
                let limits = transport.inbound_limits(slot, accepted, false);
                if let Err(err) = crate::tls::prepare(&stream) {
                    tracing::debug!(%peer, %err, "accepted connection already gone");
                    continue;
                }
                break Ok(transport.tcp_connection(Wire::Plain(stream), peer, Some(limits), None));
            },
            ListenerInner::Handshaking { ready, .. } => ready
                .lock()
                .await
                .recv()
                .await
                .ok_or(TransportError::Closed),
        }
    }

    /// The address actually bound (useful after binding port 0).
    pub fn local_addr(&self) -> Result<SocketAddr, TransportError> {
        Ok(self.local_addr)
    }
}

/// Handshakes (TLS, RDMA) a listener runs at once; more wait their turn
/// within their handshake bound. 256: far more than a fleet's reconnect
/// burst needs at once, few enough that a flood of TLS handshakes leaves
/// the cores to the requests.
const MAX_CONCURRENT_HANDSHAKES: usize = 256;

/// How long a dialer in `auto` mode waits for an RDMA handshake before it
/// falls back to TCP. 1 s: a handshake takes milliseconds; a TCP-only peer
/// either closes at once or waits for a frame that never comes.
const AUTO_HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// Whether the first bytes a peer sent are an RDMA hello (as opposed to a
/// TCP frame), without consuming them.
async fn speaks_rdma(stream: &tokio::net::TcpStream) -> Result<bool, TransportError> {
    let mut magic = [0u8; 4];
    loop {
        let seen = stream.peek(&mut magic).await?;
        if seen == 0 {
            return Err(TransportError::Closed);
        }
        if seen == magic.len() {
            return Ok(&magic == crate::rdma::connection::HELLO_MAGIC);
        }
        // Fewer bytes so far: wait for the rest of the magic.
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
}

/// Accepts connections that need a handshake before they carry messages:
/// TLS (if configured) and then, on an RDMA listener (`rdma`), the RDMA
/// hello or a TCP peer's first frame. Each handshake runs in a task of its
/// own within `handshake_timeout_ms`.
async fn accept_handshaking(
    listener: tokio::net::TcpListener,
    transport: Transport,
    rdma: bool,
    cap: ConnectionCap,
    ready: mpsc::Sender<Connection>,
) {
    let listener_label = if rdma { "rdma" } else { "tls" };
    // Handshakes at once, at most: a TLS handshake costs the server a key
    // exchange and a signature before the client has shown anything, so a
    // flood of them must not take every core. More wait for a turn,
    // within their handshake bound.
    let turns = Arc::new(tokio::sync::Semaphore::new(MAX_CONCURRENT_HANDSHAKES));
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(err) => {
                tracing::warn!(%err, "accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            }
        };
        let Some(slot) = admit_connection(&cap, &transport.inner.addresses, peer) else {
            continue;
        };
        let accepted = tokio::time::Instant::now();
        let transport = transport.clone();
        let ready = ready.clone();
        let turns = Arc::clone(&turns);
        tokio::spawn(async move {
            let handshake = async {
                let _turn = turns.acquire().await;
                handshake(&transport, stream, peer, rdma, slot, accepted, &ready).await
            };
            // `handshake_timeout_ms = 0` turns the bound off.
            let limit = match transport.inner.config.inbound.handshake_timeout_ms {
                0 => Duration::MAX,
                _ => transport
                    .inner
                    .config
                    .inbound
                    .handshake_timeout()
                    .unwrap_or(HANDSHAKE_TIMEOUT),
            };
            let bounded = async {
                match limit {
                    Duration::MAX => Ok(handshake.await),
                    limit => tokio::time::timeout(limit, handshake).await,
                }
            };
            match bounded.await {
                // Handed on outside the bound: a finished connection is
                // not dropped for a full queue (the listener's owner is
                // slow to accept), it waits its turn.
                Ok(Ok(Some(connection))) => {
                    let _ = ready.send(connection).await;
                }
                Ok(Ok(None)) => {}
                Ok(Err(err)) => {
                    metrics::counter!(crate::warn_limit::MALFORMED, "listener" => listener_label)
                        .increment(1);
                    if let Some(suppressed) = crate::warn_limit::allow(peer.ip()) {
                        tracing::warn!(%peer, %err, suppressed, listener = listener_label, "handshake failed");
                    }
                }
                Err(_) => {
                    metrics::counter!(crate::inbound::CLOSED_BY_LIMIT, "reason" => Stall::Handshake.label())
                        .increment(1);
                    if let Some(suppressed) = crate::warn_limit::allow(peer.ip()) {
                        tracing::warn!(%peer, suppressed, listener = listener_label, "handshake timed out");
                    }
                }
            }
        });
    }
}

/// One accepted connection's handshakes: TLS first where configured, then
/// RDMA's hello or a TCP peer's first frame on an RDMA listener. Returns
/// the finished connection (TCP) for the caller to hand on; an RDMA
/// peer's sockets go to `ready` as it opens them.
async fn handshake(
    transport: &Transport,
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    rdma: bool,
    slot: (ConnectionSlot, AddressSlot),
    accepted: tokio::time::Instant,
    ready: &mpsc::Sender<Connection>,
) -> Result<Option<Connection>, TransportError> {
    crate::tls::prepare(&stream)?;
    // TLS first where configured: it says who the peer is.
    let (wire, identity) = match &transport.inner.tls {
        None => (Wire::Plain(stream), None),
        Some(tls) => {
            let (stream, identity) = tls.accept(stream, peer).await?;
            (Wire::Secured(Box::new(stream)), Some(Arc::new(identity)))
        }
    };
    let runtime = match rdma {
        true => transport.inner.rdma.clone(),
        false => None,
    };
    let Some(runtime) = runtime else {
        // A TCP listener: the first message's deadline runs from the
        // accept.
        let limits = transport.inbound_limits(slot, accepted, false);
        return Ok(Some(transport.tcp_connection(
            wire,
            peer,
            Some(limits),
            identity,
        )));
    };
    // Every RDMA listener also serves TCP peers on the same address: they
    // are clients that fell back to TCP because their RDMA path is broken
    // (or `auto` clients without RDMA). Their first bytes tell.
    let (wire, speaks_rdma) = match wire {
        Wire::Plain(stream) => {
            let rdma = speaks_rdma(&stream).await?;
            (Wire::Plain(stream), rdma)
        }
        // Inside TLS nothing can be peeked at: the first bytes are read,
        // and read again by whoever takes the stream.
        Wire::Secured(mut stream) => {
            let mut magic = [0u8; 4];
            stream.read_exact(&mut magic).await?;
            let rdma = &magic == crate::rdma::connection::HELLO_MAGIC;
            let stream = crate::tls::Prefixed::new(magic.to_vec(), stream);
            (Wire::Secured(Box::new(stream)), rdma)
        }
    };
    if !speaks_rdma {
        tracing::debug!(%peer, "peer speaks TCP");
        // Its first bytes are here: the handshake is over.
        let limits = transport.inbound_limits(slot, accepted, true);
        return Ok(Some(transport.tcp_connection(
            wire,
            peer,
            Some(limits),
            identity,
        )));
    }
    let stream: crate::tls::BoxStream = match wire {
        Wire::Plain(stream) => Box::new(stream),
        Wire::Secured(stream) => stream,
    };
    // The sockets the peer opens on this engine come to the listener's
    // queue from the I/O thread. The slot is held for the handshake: the
    // engine's own limits (queue pairs, completion queue room) bound what
    // comes after.
    runtime
        .establish(stream, peer, Role::Acceptor, Some(ready.clone()), identity)
        .await?;
    drop(slot);
    Ok(None)
}

/// The sending half of a connection. Cheap to clone; all clones feed one
/// ordered send queue.
#[derive(Debug, Clone)]
pub struct MessageSender {
    inner: SenderInner,
    max_message_size: u64,
}

#[derive(Debug, Clone)]
enum SenderInner {
    /// The TCP connection's writer (direct, or through its queue).
    Tcp(TcpSender),
    /// A socket on an RDMA engine.
    Rdma(RdmaSender),
}

impl MessageSender {
    /// Sends `message`: over TCP it is written at once from the calling
    /// task when no other write holds the socket, and queued for the
    /// connection's writer otherwise (waiting while the send queue is
    /// full); over RDMA it is queued for the engine, and under the runtime
    /// driver posted from the calling task when no one else is running
    /// that engine's worker.
    ///
    /// Returns once the message is written or queued, not once the peer
    /// has it; a message larger than `max_message_size` is refused here,
    /// and the connection stays usable.
    pub async fn send(&self, message: Message) -> Result<(), TransportError> {
        let len = message.len() as u64;
        if len > self.max_message_size {
            return Err(TransportError::MessageTooLarge {
                len,
                max: self.max_message_size,
            });
        }
        match &self.inner {
            SenderInner::Tcp(sender) => sender.send(message).await,
            SenderInner::Rdma(socket) => socket.send(message).await,
        }
    }

    /// The transport this sender writes to: `Tcp` or `Rdma`.
    pub fn kind(&self) -> TransportKind {
        match &self.inner {
            SenderInner::Tcp(_) => TransportKind::Tcp,
            SenderInner::Rdma(_) => TransportKind::Rdma,
        }
    }

    /// Whether the connection's writer has stopped (error or shutdown).
    pub fn is_closed(&self) -> bool {
        match &self.inner {
            SenderInner::Tcp(sender) => sender.is_closed(),
            SenderInner::Rdma(socket) => socket.is_closed(),
        }
    }

    /// Ends a TCP connection now, for a peer presumed dead (one that went
    /// silent): sends fail from here on, and the socket is shut down, so
    /// nothing waits on the kernel's retransmissions to a peer that will
    /// not answer. RDMA connections are left alone: their keepalive ends
    /// a silent peer's.
    pub fn abort(&self) {
        if let SenderInner::Tcp(sender) = &self.inner {
            sender.abort();
        }
    }
}

/// The receiving half of a connection.
#[derive(Debug)]
pub struct MessageReceiver {
    inner: ReceiverInner,
}

#[derive(Debug)]
enum ReceiverInner {
    Tcp(TcpReceiver),
    Rdma(mpsc::Receiver<Result<Bytes, TransportError>>),
}

impl MessageReceiver {
    /// The next whole message; `Ok(None)` when the peer closed cleanly. The
    /// message lies in the transport's receive pool.
    ///
    /// After an error the connection is unusable and every later call
    /// returns [`TransportError::Closed`].
    pub async fn recv(&mut self) -> Result<Option<Bytes>, TransportError> {
        match &mut self.inner {
            ReceiverInner::Tcp(rx) => rx.recv().await,
            ReceiverInner::Rdma(rx) => rx.recv().await.transpose(),
        }
    }
}
