use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use tessera_config::{ConfigError, Validate};
use tokio::sync::mpsc;

use crate::pool::{Access, CountingHook, Pool};
use crate::tcp::{self, TcpReceiver};
use crate::{Message, TransportConfig, TransportError, TransportKind};

/// A transport instance: its configuration and its registered-memory pools.
///
/// Create one per process (or per NIC context) and share it: every
/// connection made through it receives into its receive pool, and the layers
/// above encode outgoing messages into its send pool. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Transport {
    inner: Arc<TransportInner>,
}

#[derive(Debug)]
struct TransportInner {
    config: TransportConfig,
    send_pool: Pool,
    recv_pool: Pool,
}

impl Transport {
    /// A transport with `config`. TCP needs no NIC registration, so its
    /// pools use a counting hook.
    pub fn new(config: TransportConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        let send_pool = Pool::new(
            config.send_pool.clone(),
            Access::LocalOnly,
            Arc::new(CountingHook::new()),
        )?;
        let recv_pool = Pool::new(
            config.recv_pool.clone(),
            Access::RemoteWrite,
            Arc::new(CountingHook::new()),
        )?;
        Ok(Self {
            inner: Arc::new(TransportInner {
                config,
                send_pool,
                recv_pool,
            }),
        })
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

    /// Dials `addr` ("host:port").
    pub async fn connect(&self, addr: &str) -> Result<Connection, TransportError> {
        match self.inner.config.kind {
            TransportKind::Tcp => {
                let stream = tokio::net::TcpStream::connect(addr)
                    .await
                    .map_err(|source| TransportError::Connect {
                        addr: addr.to_owned(),
                        source,
                    })?;
                self.tcp_connection(stream)
            }
        }
    }

    /// Listens on `addr` ("host:port"; port 0 picks a free one).
    pub async fn listen(&self, addr: &str) -> Result<Listener, TransportError> {
        match self.inner.config.kind {
            TransportKind::Tcp => Ok(Listener {
                inner: ListenerInner::Tcp(tcp::bind(addr).await?),
                transport: self.clone(),
            }),
        }
    }

    fn tcp_connection(&self, stream: tokio::net::TcpStream) -> Result<Connection, TransportError> {
        let config = &self.inner.config;
        let (tx, rx, peer) = tcp::setup(config, self.inner.recv_pool.clone(), stream)?;
        Ok(Connection::tcp(config, tx, rx, peer))
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
}

impl Connection {
    /// The peer's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    fn tcp(
        config: &TransportConfig,
        tx: mpsc::Sender<Message>,
        rx: TcpReceiver,
        peer: SocketAddr,
    ) -> Self {
        Connection {
            sender: MessageSender {
                queue: tx,
                max_message_size: config.max_message_size,
            },
            receiver: MessageReceiver {
                inner: ReceiverInner::Tcp(rx),
            },
            peer,
        }
    }
}

/// Accepts incoming connections.
#[derive(Debug)]
pub struct Listener {
    inner: ListenerInner,
    transport: Transport,
}

#[derive(Debug)]
enum ListenerInner {
    Tcp(tokio::net::TcpListener),
}

impl Listener {
    /// Waits for the next connection.
    pub async fn accept(&self) -> Result<Connection, TransportError> {
        match &self.inner {
            ListenerInner::Tcp(listener) => {
                let (stream, _) = listener.accept().await?;
                self.transport.tcp_connection(stream)
            }
        }
    }

    /// The address actually bound (useful after binding port 0).
    pub fn local_addr(&self) -> Result<SocketAddr, TransportError> {
        match &self.inner {
            ListenerInner::Tcp(listener) => Ok(listener.local_addr()?),
        }
    }
}

/// The sending half of a connection. Cheap to clone; all clones feed one
/// ordered send queue.
#[derive(Debug, Clone)]
pub struct MessageSender {
    queue: mpsc::Sender<Message>,
    max_message_size: u64,
}

impl MessageSender {
    /// Queues `message` for sending, waiting while the send queue is full.
    ///
    /// Returns once the message is queued, not once it is on the wire; a
    /// message larger than `max_message_size` is refused here, and the
    /// connection stays usable.
    pub async fn send(&self, message: Message) -> Result<(), TransportError> {
        let len = message.len() as u64;
        if len > self.max_message_size {
            return Err(TransportError::MessageTooLarge {
                len,
                max: self.max_message_size,
            });
        }
        self.queue
            .send(message)
            .await
            .map_err(|_| TransportError::Closed)
    }

    /// Whether the connection's writer has stopped (error or shutdown).
    pub fn is_closed(&self) -> bool {
        self.queue.is_closed()
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
        }
    }
}
