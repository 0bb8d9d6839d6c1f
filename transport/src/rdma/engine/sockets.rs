//! Sockets (§6.1, QP multiplexing): logical connections on one queue pair,
//! opened, accepted, refused and closed by control messages, and the queue
//! of messages each one sends.

use super::offers::PeerOffer;
#[allow(clippy::wildcard_imports)]
use super::*;

/// A message queued on a socket: its parts (in registered memory) and
/// length.
#[derive(Debug)]
pub(super) struct Outgoing {
    pub(super) parts: Vec<Bytes>,
    pub(super) len: usize,
}

/// What a socket queues: a message, or the close of its sending half.
#[derive(Debug)]
pub(super) enum Item {
    Message(Outgoing),
    Close,
}

/// The sending half of a socket.
#[derive(Debug, Default)]
pub(super) struct SocketTx {
    pub(super) queue: VecDeque<Item>,
    pub(super) large: VecDeque<LargeSend>,
    pub(super) scheduled: bool,
    /// The destination the peer offered for this socket's next large
    /// message (`offers.rs`).
    pub(super) offer: Option<PeerOffer>,
}

impl Engine {
    /// Opens a socket (its `Open` goes to the peer before its first
    /// message).
    pub fn open_socket(&mut self) -> Result<SocketId, EngineError> {
        if self.failed {
            return Err(EngineError::Failed);
        }
        let id = loop {
            let candidate = match self.role {
                Role::Dialer => self.next_socket & !ACCEPTOR_BIT,
                Role::Acceptor => self.next_socket | ACCEPTOR_BIT,
            };
            self.next_socket = self.next_socket.wrapping_add(1).max(1);
            if candidate & !ACCEPTOR_BIT != 0
                && candidate != super::stripes::STRIPES
                && !self.open.contains(&candidate)
                && !self.sockets.contains_key(&candidate)
            {
                break candidate;
            }
        };
        self.sockets.insert(id, SocketTx::default());
        self.open.insert(id);
        self.control.push_back(Control::Open(id));
        Ok(id)
    }

    /// Takes a socket the peer opened (it may carry messages now).
    pub fn accept_socket(&mut self, socket: SocketId) {
        if self.open.contains(&socket) {
            self.control.push_back(Control::Accept(socket));
        }
    }

    /// Turns away a socket the peer opened.
    pub fn refuse_socket(&mut self, socket: SocketId) {
        if self.open.remove(&socket) {
            self.sockets.remove(&socket);
            self.withdraw_offer(socket);
            self.control.push_back(Control::Refuse(socket));
        }
    }

    /// Closes the sending half of a socket: its queued messages still go,
    /// then `Close` (the peer's end of file). Messages from the peer are
    /// still delivered until it closes its half.
    pub fn close_socket(&mut self, socket: SocketId) {
        if let Some(tx) = self.sockets.get_mut(&socket) {
            tx.queue.push_back(Item::Close);
            self.schedule(socket);
        }
    }

    pub(super) fn schedule(&mut self, socket: SocketId) {
        if let Some(tx) = self.sockets.get_mut(&socket)
            && !tx.scheduled
        {
            tx.scheduled = true;
            self.active.push_back(socket);
        }
    }

    /// Queues a message on a socket. Parts outside registered memory are
    /// copied into the send pool (and counted); small messages with more
    /// parts than fit in one work request are gathered into one buffer.
    pub fn send(&mut self, socket: SocketId, message: Message) -> Result<(), EngineError> {
        if self.failed {
            return Err(EngineError::Failed);
        }
        if !self.sockets.contains_key(&socket) {
            return Err(EngineError::SocketClosed(socket));
        }
        let len = message.len();
        if len as u64 > self.config.max_message_size {
            return Err(EngineError::TooLarge {
                len: len as u64,
                max: self.config.max_message_size,
            });
        }
        let mut parts = Vec::with_capacity(message.parts().len());
        // Only this engine's pools are registered with its device: memory of
        // any other pool (another transport's, keys from another device) is
        // as foreign to the NIC as unregistered memory.
        let own = [self.send_pool.id(), self.recv_pool.id()];
        for part in message.parts() {
            if part.is_empty() {
                continue;
            }
            if lookup(&part[..]).is_some_and(|region| own.contains(&region.pool_id)) {
                parts.push(part.clone());
            } else {
                self.stats.fallback_copies += 1;
                parts.push(
                    self.send_pool
                        .alloc_copy(part)
                        .map_err(EngineError::Memory)?
                        .freeze(),
                );
            }
        }
        if len <= self.small_limit && parts.len() + 1 > self.config.max_sge as usize {
            let mut joined = Self::alloc(&self.send_pool, len)?;
            let mut at = 0;
            for part in &parts {
                joined[at..at + part.len()].copy_from_slice(part);
                at += part.len();
            }
            parts = vec![joined.freeze()];
        }
        if let Some(tx) = self.sockets.get_mut(&socket) {
            tx.queue.push_back(Item::Message(Outgoing { parts, len }));
        }
        self.schedule(socket);
        Ok(())
    }

    /// A scatter/gather entry for `bytes` (pool memory) with its local key
    /// on rail `rail`.
    pub(super) fn sge(bytes: &Bytes, rail: usize) -> Option<Sge> {
        let region = crate::pool::lookup_on(&bytes[..], rail)?;
        Some(Sge {
            addr: bytes.as_ptr() as usize,
            len: u32::try_from(bytes.len()).ok()?,
            lkey: region.lkey,
        })
    }
}
