use std::net::SocketAddr;

use bytes::Bytes;
use tokio::sync::mpsc;

use crate::tcp::{self, TcpReceiver};
use crate::{Message, TransportConfig, TransportError, TransportKind};

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
}

/// Dials `addr` ("host:port") with the configured transport.
pub async fn connect(config: &TransportConfig, addr: &str) -> Result<Connection, TransportError> {
    match config.kind {
        TransportKind::Tcp => {
            let (tx, rx, peer) = tcp::connect(config, addr).await?;
            Ok(Connection::tcp(config, tx, rx, peer))
        }
    }
}

/// Listens on `addr` ("host:port"; port 0 picks a free one) with the
/// configured transport.
pub async fn listen(config: &TransportConfig, addr: &str) -> Result<Listener, TransportError> {
    match config.kind {
        TransportKind::Tcp => Ok(Listener {
            inner: ListenerInner::Tcp(tcp::bind(addr).await?),
            config: config.clone(),
        }),
    }
}

impl Connection {
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
    config: TransportConfig,
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
                let (tx, rx, peer) = tcp::setup(&self.config, stream)?;
                Ok(Connection::tcp(&self.config, tx, rx, peer))
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
    /// The next whole message; `Ok(None)` when the peer closed cleanly.
    ///
    /// After an error the connection is unusable and every later call
    /// returns [`TransportError::Closed`].
    pub async fn recv(&mut self) -> Result<Option<Bytes>, TransportError> {
        match &mut self.inner {
            ReceiverInner::Tcp(rx) => rx.recv().await,
        }
    }
}
