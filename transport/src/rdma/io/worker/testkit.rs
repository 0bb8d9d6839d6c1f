//! Set-up shared by the worker's tests (`tests.rs`, `model.rs`): a worker
//! driven on the test's thread, and engines attached to it as the
//! connection table attaches them.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use tokio::sync::{mpsc, oneshot};

use super::*;
use crate::rdma::engine::Engine;
use crate::verbs::{QpCaps, QueuePair};

/// Queue pair capacities for an engine of `send` send and `recv` receive
/// work requests.
pub(super) fn caps(send: u32, recv: u32) -> QpCaps {
    QpCaps {
        max_send_wr: send,
        max_recv_wr: recv,
        max_sge: 4,
        rnr_retry: 0,
    }
}

/// A worker polling `cq`, and its handle (whose command queue stays open
/// while the handle lives). No driver runs it: the test calls its rounds.
pub(super) fn worker(cq: Arc<dyn CompletionQueue>) -> (Worker, IoThread) {
    let (commands, queue) = mpsc::unbounded_channel();
    let stats = Arc::new(IoStats::default());
    let handle = IoThread {
        commands,
        cq: Arc::clone(&cq),
        srq: None,
        stats: Arc::clone(&stats),
        direct: None,
    };
    let mut worker = Worker::new(cq, None, queue, stats, None);
    worker.set_handle(handle.downgrade());
    (worker, handle)
}

/// A driver that runs nothing: the commands sent to it (answers for
/// chunks, say) are the test's to read.
pub(super) fn fake_driver(
    cq: Arc<dyn CompletionQueue>,
) -> (IoThread, mpsc::UnboundedReceiver<Command>) {
    let (commands, queue) = mpsc::unbounded_channel();
    let handle = IoThread {
        commands,
        cq,
        srq: None,
        stats: Arc::new(IoStats::default()),
        direct: None,
    };
    (handle, queue)
}

/// What the test keeps of an engine it attaches: its `alive` flag (as its
/// partners see it), and the far end of its handshake connection, which
/// closes when the worker drops the engine (the peer then learns of it).
pub(super) struct AttachedView {
    pub(super) alive: Arc<AtomicBool>,
    pub(super) control: oneshot::Receiver<()>,
}

/// `engine` on `qp` as the connection table attaches it (sockets the peer
/// opens go to `accepts`; each socket holds `send_queue_depth` messages).
pub(super) fn attached(
    qp: Arc<dyn QueuePair>,
    engine: Engine,
    accepts: Option<mpsc::Sender<crate::Connection>>,
    max_message_size: u64,
    send_queue_depth: usize,
) -> (Attached, AttachedView) {
    let alive = Arc::new(AtomicBool::new(true));
    let (control_tx, control) = oneshot::channel();
    let attached = Attached {
        qp,
        engine,
        peer: "127.0.0.1:9".parse().unwrap(),
        alive: Arc::clone(&alive),
        accepts,
        _control: control_tx,
        max_message_size,
        send_queue_depth,
        _cq_room: crate::rdma::cq_budget::CqBudget::new(4096, 0)
            .reserve(128)
            .unwrap(),
        close_when_unused: false,
        identity: None,
    };
    (attached, AttachedView { alive, control })
}
