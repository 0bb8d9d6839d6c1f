//! The two halves of a connection, over TCP or RDMA alike: the sending half
//! (cheap to clone, one ordered queue) and the receiving half.

#[allow(clippy::wildcard_imports)]
use super::*;

/// The sending half of a connection. Cheap to clone; all clones feed one
/// ordered send queue.
#[derive(Debug, Clone)]
pub struct MessageSender {
    pub(super) inner: SenderInner,
    pub(super) max_message_size: u64,
    /// Counts this connection among its rail's live ones to the peer for
    /// as long as a clone of the sender lives (`rdma/rails.rs`).
    pub(super) live: Option<Arc<crate::rdma::rails::LiveGuard>>,
}

#[derive(Debug, Clone)]
pub(super) enum SenderInner {
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

    /// Until what was sent so far has left: over RDMA, until every message
    /// sent on this connection has completed (the peer's NIC took it), or
    /// the connection failed; over TCP at once (each message was written
    /// to the kernel or sits in the connection's queue, which its writer
    /// empties by itself even after the last sender is gone). A server
    /// stopping gracefully awaits it before its shutdown counts as done,
    /// so that a process exiting right after still sends its last answers.
    pub async fn flushed(&self) {
        match &self.inner {
            SenderInner::Tcp(_) => {}
            SenderInner::Rdma(socket) => socket.flushed().await,
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
    pub(super) inner: ReceiverInner,
}

#[derive(Debug)]
pub(super) enum ReceiverInner {
    Tcp(TcpReceiver),
    Rdma(mpsc::Receiver<Result<Bytes, TransportError>>),
}

impl MessageReceiver {
    /// Whether another whole message is here already, so that
    /// [`MessageReceiver::recv`] would return at once (frames read off the
    /// socket and not handed out yet, or delivered by the RDMA engine). A
    /// server uses it to tell a burst, whose requests it runs on tasks of
    /// their own in parallel, from a lone request, which it runs at once.
    pub fn has_ready(&self) -> bool {
        match &self.inner {
            ReceiverInner::Tcp(rx) => rx.has_ready(),
            ReceiverInner::Rdma(rx) => !rx.is_empty(),
        }
    }

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
