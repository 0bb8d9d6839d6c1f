//! An engine as its driver's worker holds it: the engine, its sockets'
//! backlogs and pending opens, and the isolation of a panic in it (that
//! engine fails, the worker goes on).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::Instant;

use tokio::sync::{mpsc, oneshot};

use super::metrics::EngineMetrics;
use super::{Attached, IoThread, SocketSlot};
use crate::rdma::engine::{EngineEvent, SocketId};
use crate::{Connection, TransportError};

/// Runs `f` on `slot`; if it panics, the panic stops here: that engine
/// fails (its QP to error, each socket and pending open an error, the
/// slot never called again and dropped once its sockets have their error)
/// and the thread goes on serving its other engines. A panic is a bug; it
/// is logged as an error (once per engine) and counted
/// (`tessera_rdma_engine_panics_total`).
pub(super) fn isolated<R>(
    slot: &mut EngineSlot,
    io: Option<&IoThread>,
    f: impl FnOnce(&mut EngineSlot) -> R,
) -> Option<R> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&mut *slot))) {
        Ok(result) => Some(result),
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            tracing::error!(peer = %slot.attached.peer, panic = %what, "rdma engine panicked: that connection fails, the others go on");
            metrics::counter!("tessera_rdma_engine_panics_total").increment(1);
            slot.panicked = true;
            if let Err(err) = slot.attached.qp.fail() {
                tracing::warn!(peer = %slot.attached.peer, %err, "moving the queue pair to error failed");
            }
            // Not alive only once its QP takes no more writes: buffers of
            // a partner held for late writes wait for that (`late.rs`).
            if !slot.partners.is_empty() {
                slot.attached.qp.quiesce();
            }
            slot.attached.alive.store(false, Ordering::Release);
            if let Some(io) = io {
                io.stats.engines_failed.fetch_add(1, Ordering::Relaxed);
            }
            fail_sockets(
                &mut slot.opening,
                &mut slot.sockets,
                &crate::rdma::engine::EngineError::Panicked,
            );
            for s in slot.sockets.values_mut() {
                deliver_backlog(s);
            }
            None
        }
    }
}

/// A message for a socket's application, or the end of its stream, into
/// the socket's backlog (other events are not for the backlog).
pub(super) fn to_backlog(sockets: &mut HashMap<SocketId, SocketSlot>, event: EngineEvent) {
    match event {
        EngineEvent::Message { socket, bytes } => {
            if let Some(s) = sockets.get_mut(&socket)
                && s.deliver.is_some()
            {
                s.backlog.push_back(Ok(bytes));
            }
        }
        EngineEvent::Closed(socket) => {
            if let Some(s) = sockets.get_mut(&socket) {
                s.rx_closed = true;
            }
        }
        _ => {}
    }
}

/// A failed engine's pending opens and sockets get `err`: senders stop
/// (their permits close), and each open receiver gets it as its last item.
pub(super) fn fail_sockets(
    opening: &mut HashMap<SocketId, oneshot::Sender<Result<Connection, TransportError>>>,
    sockets: &mut HashMap<SocketId, SocketSlot>,
    err: &crate::rdma::engine::EngineError,
) {
    for (_, reply) in opening.drain() {
        let _ = reply.send(Err(TransportError::rdma_error(err.clone())));
    }
    for s in sockets.values_mut() {
        s.permits.close();
        if s.deliver.is_some() && !s.rx_closed {
            s.backlog
                .push_back(Err(TransportError::rdma_error(err.clone())));
            s.rx_closed = true;
        }
    }
}

/// Hands `socket`'s backlog to its application as far as it takes it, and
/// lets go of a receiver whose stream has ended; whether anything went.
pub(super) fn deliver_backlog(socket: &mut SocketSlot) -> bool {
    let mut delivered = false;
    while let Some(item) = socket.backlog.pop_front() {
        let Some(deliver) = &socket.deliver else {
            socket.backlog.clear();
            delivered = true;
            break;
        };
        match deliver.try_send(item) {
            Ok(()) => delivered = true,
            Err(mpsc::error::TrySendError::Full(item)) => {
                socket.backlog.push_front(item);
                break;
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                // The application dropped its receiver: what it held is
                // gone, which counts as progress (an engine held at
                // `BACKLOG_LIMIT` may repost its receives now; before, it
                // left the ready list with them unposted and stalled).
                socket.deliver = None;
                socket.backlog.clear();
                delivered = true;
                break;
            }
        }
    }
    if socket.rx_closed && socket.backlog.is_empty() {
        socket.deliver = None;
    }
    delivered
}

/// One engine of a worker, with its sockets and striping partners.
pub(super) struct EngineSlot {
    pub(super) metrics: EngineMetrics,
    pub(super) attached: Attached,
    pub(super) sockets: HashMap<SocketId, SocketSlot>,
    /// Sockets this end opened, waiting for the peer's answer.
    pub(super) opening: HashMap<SocketId, oneshot::Sender<Result<Connection, TransportError>>>,
    /// Whether a socket was ever opened on it.
    pub(super) had_socket: bool,
    /// Its engine panicked: it is failed and never called again.
    pub(super) panicked: bool,
    /// It is on the worker's ready list.
    pub(super) ready: bool,
    /// Its engine's deadline as it was after the engine last ran.
    pub(super) deadline: Option<Instant>,
    /// Its name as the origin of chunks it hands to partners (unique in
    /// the process).
    pub(super) origin: u64,
    /// Engines on other rails to the same peer (`rdma/partners.rs`).
    pub(super) partners: Vec<super::Partner>,
}

/// Names of engines as origins of chunks (`stripes.rs`).
pub(super) static NEXT_ORIGIN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl EngineSlot {
    /// Puts this engine (`qpn`) on the ready list, once.
    pub(super) fn list(&mut self, qpn: u32, ready: &mut Vec<u32>) {
        if !self.ready {
            self.ready = true;
            ready.push(qpn);
        }
    }
}

/// Puts engine `qpn`, if there is one, on the ready list (once).
pub(super) fn mark(engines: &mut HashMap<u32, EngineSlot>, ready: &mut Vec<u32>, qpn: u32) {
    if let Some(slot) = engines.get_mut(&qpn) {
        slot.list(qpn, ready);
    }
}
