//! The transport's public face: a [`Transport`] (its configuration, device
//! and pools) dials and listens; a [`Connection`] is a pair of halves over
//! TCP or RDMA alike. The listener and its per-connection tasks live in
//! `listener.rs`, an accepted connection's handshakes (TLS, protocol
//! sniffing, RDMA's hello) in `handshake.rs`, the halves in `halves.rs`.

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
use crate::rdma::connection::HANDSHAKE_TIMEOUT;
use crate::rdma::io::RdmaSender;
use crate::rdma::rails::RdmaRails;
use crate::tcp::{self, TcpReceiver, TcpSender, Wire};
use crate::tls::{PeerIdentity, Tls};
use crate::verbs::Device;
use crate::{Message, RdmaProvider, TransportConfig, TransportError, TransportKind};
use tokio::io::AsyncReadExt;

mod halves;
mod handshake;
mod listener;
mod rails;

pub use halves::{MessageReceiver, MessageSender};
pub use listener::Listener;

use halves::{ReceiverInner, SenderInner};
use handshake::{AUTO_HANDSHAKE_TIMEOUT, handshake};

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
    rdma: Option<Arc<RdmaRails>>,
    /// Every rail's device, the primary (the runtime's) first: held open,
    /// the pools registered on each.
    rails: Vec<Arc<dyn Device>>,
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
                rails: Vec::new(),
                tls,
            }),
        })
    }

    /// The RDMA runtime on the configured device, with the configuration
    /// fitted to the device's limits (what [`Transport::config`] reports).
    fn rdma(mut config: TransportConfig, tls: Option<Tls>) -> Result<Self, TransportError> {
        let rails = rails::open_rails(&config)?;
        // Real NICs pin what they register (the soft one shares it), once
        // per rail: every rail registers the pools.
        if config.rdma.provider == RdmaProvider::Ibverbs {
            use crate::verbs::memlock;
            let need = memlock::first_connection_bytes_on(&config, rails.len() as u64);
            if let Some(err) = memlock::shortfall(memlock::limit(), need) {
                return Err(err.into());
            }
        }
        for rail in &rails {
            config.rdma = crate::verbs::limits::fit(&config.rdma, &rail.limits(), rail.name())?;
        }
        if rails.len() > 1 {
            tracing::info!(
                rails = ?rails.iter().map(|r| r.name().to_owned()).collect::<Vec<_>>(),
                "RDMA rails open and registered: connections go to the least used"
            );
        }
        let send_pool = Pool::on_rails(
            config.send_pool.clone(),
            Access::LocalOnly,
            rails::hooks(&rails),
        )?;
        // Confined: peers reach receive memory only through the windows
        // bound for their grants.
        let recv_access = match config.rdma.confine_remote_writes {
            true => Access::Windows,
            false => Access::RemoteWrite,
        };
        let recv_pool =
            Pool::on_rails(config.recv_pool.clone(), recv_access, rails::hooks(&rails))?;
        let inbound = InboundBudget::new(config.inbound.max_bytes);
        let rdma = RdmaRails::new(
            &rails,
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
                rails,
                tls,
            }),
        })
    }

    /// The names of the rails (RDMA devices) this transport opened, the
    /// primary first; empty over TCP.
    pub fn rails(&self) -> Vec<String> {
        self.inner
            .rails
            .iter()
            .map(|d| d.name().to_owned())
            .collect()
    }

    /// The name of the primary rail's RDMA device, if the transport runs
    /// on RDMA ([`Transport::rails`] lists them all).
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

    /// Counters of each RDMA rail, the primary first (empty without
    /// RDMA): which rail carries the traffic, and which is down.
    pub fn rail_stats(&self) -> Vec<crate::rdma::RdmaStats> {
        self.inner
            .rdma
            .as_ref()
            .map_or_else(Vec::new, |rdma| rdma.rail_stats())
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
    /// On another rail than the one it would have taken with every rail up
    /// (see [`Connection::displaced`]).
    displaced: bool,
}

impl Connection {
    /// Whether this RDMA connection sits on another rail than the one it
    /// would have taken with every rail up and willing (that rail's port
    /// was down, or the peer refused it: `rdma/rails.rs`). A caller that
    /// holds connections for long may dial again after a while, so that
    /// connections return to a rail once it is back (the RPC channel does,
    /// after a second). Always false over TCP and with one rail.
    pub fn displaced(&self) -> bool {
        self.displaced
    }

    /// Marks the connection placed by the rails (`live` counts it among
    /// its rail's connections to the peer while its sender lives).
    pub(crate) fn placed(&mut self, displaced: bool, live: Arc<crate::rdma::rails::LiveGuard>) {
        self.displaced = displaced;
        self.sender.live = Some(live);
    }

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
                live: None,
            },
            receiver: MessageReceiver {
                inner: ReceiverInner::Rdma(receiver),
            },
            peer,
            identity,
            displaced: false,
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
                live: None,
            },
            receiver: MessageReceiver {
                inner: ReceiverInner::Tcp(rx),
            },
            peer,
            identity,
            displaced: false,
        }
    }
}
