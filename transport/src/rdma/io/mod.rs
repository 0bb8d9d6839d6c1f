//! I/O drivers (§6.2) and the connection table (§6.1): the thin driver
//! around the sans-IO engines.
//!
//! A transport runs `rdma.io_threads` drivers. Each owns one completion
//! queue and the engines assigned to it (round robin), in a [`Worker`]
//! (`worker.rs`) that polls its CQ in batches and dispatches completions
//! by QP number, so drivers share nothing on the data path. The async side
//! talks to a driver through an unbounded command queue plus a wake-up of
//! its CQ ([`CompletionQueue::wake`]); under the runtime driver a sender
//! that finds the worker free runs its rounds itself (a `try_lock`: it
//! never waits for the worker), and the driver task holds the worker's
//! mutex for a round at a time. What the driver has for the async side
//! goes through per-socket tokio channels.
//!
//! Two drivers run a worker (`rdma.polling`):
//! - a dedicated thread (`event`, `busy`; `thread.rs`), for hosts with
//!   cores to spare;
//! - a task of the application's runtime (`runtime`; `runtime.rs`): no
//!   thread, senders post on their own thread when the worker is free, and
//!   completions wake the task through a descriptor, for small hosts where
//!   a thread hop per message costs more than it saves.
//!
//! Backpressure: a socket whose application does not read keeps its
//! messages in a backlog here; while an engine's sockets hold more than
//! [`BACKLOG_LIMIT`] messages, it stops reposting receives, so its credits
//! stop flowing back and the peer waits. On the sending side each socket
//! holds `send_queue_depth` permits, returned as its messages are wholly
//! handed to the NIC.

mod drive;
mod late;
mod metrics;
mod runtime;
mod shared_receives;
mod slot;
mod thread;
mod worker;

use crate::sync::lock;
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{Semaphore, mpsc, oneshot};

use crate::rdma::engine::{Engine, PeerInfo, SocketId, StripeChunk};
use crate::verbs::{CompletionQueue, QueuePair, SharedReceiveQueue};
use crate::{Connection, Message, Polling, TransportError};
pub(crate) use metrics::IoStats;
pub(crate) use shared_receives::SharedReceives;
use worker::Worker;

/// Received messages held per engine before it stops reposting receives.
pub(crate) const BACKLOG_LIMIT: usize = 256;

/// Completions kept for QPs not yet attached (a bound against completions
/// of QPs that will never be).
const ORPHAN_LIMIT: usize = 4096;

/// Longest sleep of an idle I/O thread: it notices a transport that went
/// away (its command queue closed) at least this often.
const MAX_SLEEP: Duration = Duration::from_millis(100);

/// What the async side asks of an I/O thread.
pub(crate) enum Command {
    /// Run a freshly connected engine.
    Attach(Box<Attached>),
    /// The device reported an asynchronous event.
    Event(crate::verbs::AsyncEvent),
    /// Open a socket on an engine (dialer side).
    Open {
        qpn: u32,
        reply: oneshot::Sender<Result<Connection, TransportError>>,
    },
    /// Send a message on a socket.
    Send {
        qpn: u32,
        socket: SocketId,
        message: Message,
    },
    /// Every sender of a socket is gone: close its sending half.
    Close { qpn: u32, socket: SocketId },
    /// The peer confirmed the connection: the engine may send.
    PeerReady { qpn: u32, info: PeerInfo },
    /// The peer's handshake connection closed.
    PeerClosed { qpn: u32 },
    /// The engines on other rails to the same peer (`rdma/partners.rs`).
    Partners { qpn: u32, partners: Vec<Partner> },
    /// A chunk of engine `origin`'s message to write (`stripes.rs`);
    /// answered to `reply` (the origin's driver and QP number).
    StripeWrites {
        qpn: u32,
        origin: u64,
        token: u64,
        chunk: StripeChunk,
        reply: (IoThread, u32),
    },
    /// The answer for a chunk this engine handed out.
    StripeDone { qpn: u32, token: u64, ok: bool },
    /// Engine `origin` failed: drop its chunks not yet written.
    StripeCancel { qpn: u32, origin: u64 },
}

/// An engine on another rail to the same peer, as its partners know it.
#[derive(Clone)]
pub(crate) struct Partner {
    /// Its rail.
    pub(crate) rail: usize,
    /// Its driver.
    pub(crate) io: IoThread,
    /// Its QP number there.
    pub(crate) qpn: u32,
    /// Whether it still runs.
    pub(crate) alive: Arc<AtomicBool>,
}

impl std::fmt::Debug for Partner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Partner")
            .field("rail", &self.rail)
            .field("qpn", &self.qpn)
            .finish_non_exhaustive()
    }
}

/// A connected engine and what goes with it.
pub(crate) struct Attached {
    // Field order is drop order: the QP before the engine that owns the
    // buffers it may write into.
    pub(crate) qp: Arc<dyn QueuePair>,
    pub(crate) engine: Engine,
    pub(crate) peer: SocketAddr,
    pub(crate) alive: Arc<AtomicBool>,
    /// Where sockets the peer opens go (acceptor side).
    pub(crate) accepts: Option<mpsc::Sender<Connection>>,
    /// Dropped with the engine: ends the task watching the handshake
    /// connection (which closes it, telling the peer).
    pub(crate) _control: oneshot::Sender<()>,
    pub(crate) max_message_size: u64,
    pub(crate) send_queue_depth: usize,
    /// Its room on the thread's CQ, given back with it (after the QP).
    pub(crate) _cq_room: super::cq_budget::CqReservation,
    /// Close it once its last socket is gone (a dialer's engine that is not
    /// shared: `multiplex = false`).
    pub(crate) close_when_unused: bool,
    /// Who the peer is, as the handshake's TLS certificate said (`None`
    /// without TLS); every socket of the engine carries it.
    pub(crate) identity: Option<Arc<crate::tls::PeerIdentity>>,
}

impl Drop for Attached {
    fn drop(&mut self) {
        // The engine's memory windows before the QP they are bound on (the
        // fields then drop in order: the QP, then the engine's buffers).
        self.engine.release_windows();
    }
}

/// A handle on one I/O driver (a thread, or a task of the runtime).
#[derive(Clone)]
pub(crate) struct IoThread {
    commands: mpsc::UnboundedSender<Command>,
    cq: Arc<dyn CompletionQueue>,
    srq: Option<Arc<dyn SharedReceiveQueue>>,
    stats: Arc<IoStats>,
    /// The worker itself, for senders to post on their own thread when it
    /// is free (runtime drivers only).
    direct: Option<Arc<Mutex<Worker>>>,
}

impl std::fmt::Debug for IoThread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoThread").finish_non_exhaustive()
    }
}

impl IoThread {
    /// Starts a driver of `cq`: a thread named `name` for `event` and
    /// `busy` polling, a task of the current tokio runtime for `runtime`
    /// (which needs one, and a queue that notifies through a descriptor).
    pub(crate) fn start(
        name: String,
        cq: Arc<dyn CompletionQueue>,
        shared: Option<SharedReceives>,
        polling: Polling,
        spin: Duration,
        panic_on_len: Option<usize>,
        cpus: Option<Vec<usize>>,
    ) -> Result<Self, TransportError> {
        let (commands, queue) = mpsc::unbounded_channel();
        let stats = Arc::new(IoStats::default());
        let srq = shared.as_ref().map(|s| Arc::clone(&s.srq));
        let mut worker = Worker::new(
            Arc::clone(&cq),
            shared,
            queue,
            Arc::clone(&stats),
            panic_on_len,
        );
        let mut handle = Self {
            commands,
            cq,
            srq,
            stats,
            direct: None,
        };
        match polling {
            Polling::Runtime => {
                let notifier = runtime::Notifier::new(&handle.cq)?;
                let worker = Arc::new(Mutex::new(worker));
                handle.direct = Some(Arc::clone(&worker));
                lock(&worker).set_handle(handle.downgrade());
                runtime::spawn(worker, notifier)?;
            }
            Polling::Event | Polling::Busy => {
                worker.set_handle(handle.downgrade());
                std::thread::Builder::new().name(name).spawn(move || {
                    // Next to its rail's NIC (`rdma/topology.rs`).
                    if let Some(cpus) = cpus
                        && let Err(err) = crate::rdma::topology::pin_current_thread(&cpus)
                    {
                        tracing::warn!(%err, ?cpus, "could not pin an RDMA I/O thread to its NIC's NUMA node");
                    }
                    thread::run(worker, polling, spin)
                })?;
            }
        }
        Ok(handle)
    }

    fn downgrade(&self) -> WeakIoThread {
        WeakIoThread {
            commands: self.commands.downgrade(),
            cq: Arc::clone(&self.cq),
            srq: self.srq.clone(),
            stats: Arc::clone(&self.stats),
            direct: self.direct.as_ref().map(Arc::downgrade),
        }
    }

    /// The thread's shared receive queue (QPs of its engines take from it),
    /// if it runs one.
    pub(crate) fn srq(&self) -> Option<Arc<dyn SharedReceiveQueue>> {
        self.srq.clone()
    }

    /// The thread's counters.
    pub(crate) fn stats(&self) -> &IoStats {
        &self.stats
    }

    /// The thread's completion queue (QPs of its engines complete on it).
    pub(crate) fn cq(&self) -> &Arc<dyn CompletionQueue> {
        &self.cq
    }

    /// Queues a command and wakes the thread; false if it has stopped.
    pub(crate) fn submit(&self, command: Command) -> bool {
        let queued = self.commands.send(command).is_ok();
        self.cq.wake();
        queued
    }

    /// Queues `message` and, if the worker is free, posts it on this
    /// thread (a runtime driver's direct path: no hop, no wake-up); else
    /// wakes the driver. Through the queue either way, so a socket's
    /// messages keep their order whichever path each takes. False if the
    /// driver has stopped.
    fn send(&self, qpn: u32, socket: SocketId, message: Message) -> bool {
        let command = Command::Send {
            qpn,
            socket,
            message,
        };
        if self.commands.send(command).is_err() {
            return false;
        }
        if let Some(direct) = &self.direct {
            match direct.try_lock() {
                Ok(mut worker) => {
                    worker.run_direct();
                    return true;
                }
                Err(std::sync::TryLockError::Poisoned(poisoned)) => {
                    poisoned.into_inner().run_direct();
                    return true;
                }
                // Whoever holds it takes the queue before it sleeps.
                Err(std::sync::TryLockError::WouldBlock) => {}
            }
        }
        self.cq.wake();
        true
    }
}

/// What the thread keeps of its own handle (to build senders without
/// keeping itself alive).
struct WeakIoThread {
    commands: mpsc::WeakUnboundedSender<Command>,
    cq: Arc<dyn CompletionQueue>,
    srq: Option<Arc<dyn SharedReceiveQueue>>,
    stats: Arc<IoStats>,
    direct: Option<std::sync::Weak<Mutex<Worker>>>,
}

impl WeakIoThread {
    fn upgrade(&self) -> Option<IoThread> {
        Some(IoThread {
            commands: self.commands.upgrade()?,
            cq: Arc::clone(&self.cq),
            srq: self.srq.clone(),
            stats: Arc::clone(&self.stats),
            direct: match &self.direct {
                Some(direct) => Some(direct.upgrade()?),
                None => None,
            },
        })
    }
}

/// Closes a socket's sending half when its last sender goes.
#[derive(Debug)]
pub(crate) struct SocketCloser {
    io: IoThread,
    qpn: u32,
    socket: SocketId,
}

impl Drop for SocketCloser {
    fn drop(&mut self) {
        self.io.submit(Command::Close {
            qpn: self.qpn,
            socket: self.socket,
        });
    }
}

/// The sending side of an RDMA socket, as [`crate::MessageSender`] holds it.
#[derive(Debug, Clone)]
pub(crate) struct RdmaSender {
    io: IoThread,
    qpn: u32,
    socket: SocketId,
    /// One per message that may be queued or in flight: taken by a send,
    /// given back when its send completed.
    permits: Arc<Semaphore>,
    /// How many there are in all.
    depth: u32,
    _closer: Arc<SocketCloser>,
}

impl RdmaSender {
    pub(crate) async fn send(&self, message: Message) -> Result<(), TransportError> {
        let permit = self
            .permits
            .acquire()
            .await
            .map_err(|_| TransportError::Closed)?;
        permit.forget();
        if self.io.send(self.qpn, self.socket, message) {
            Ok(())
        } else {
            Err(TransportError::Closed)
        }
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.permits.is_closed()
    }

    /// Until every message sent so far has completed (all permits are
    /// back), or the socket failed (its permits are closed then).
    pub(crate) async fn flushed(&self) {
        if let Ok(all) = self.permits.acquire_many(self.depth).await {
            drop(all);
        }
    }
}

struct SocketSlot {
    deliver: Option<mpsc::Sender<Result<Bytes, TransportError>>>,
    backlog: VecDeque<Result<Bytes, TransportError>>,
    permits: Arc<Semaphore>,
    /// The peer closed its half: drop `deliver` once the backlog is out.
    rx_closed: bool,
    /// Our half is closed (every sender gone).
    tx_closed: bool,
}

/// Sets up socket `socket` of engine `qpn` and returns its connection.
fn new_socket(
    io: &IoThread,
    qpn: u32,
    socket: SocketId,
    attached: &Attached,
    sockets: &mut HashMap<SocketId, SocketSlot>,
) -> Connection {
    let depth = attached.send_queue_depth.max(1);
    let (deliver, receiver) = mpsc::channel(depth);
    let permits = Arc::new(Semaphore::new(depth));
    sockets.insert(
        socket,
        SocketSlot {
            deliver: Some(deliver),
            backlog: VecDeque::new(),
            permits: Arc::clone(&permits),
            rx_closed: false,
            tx_closed: false,
        },
    );
    let sender = RdmaSender {
        io: io.clone(),
        qpn,
        socket,
        permits,
        depth: u32::try_from(depth).unwrap_or(u32::MAX),
        _closer: Arc::new(SocketCloser {
            io: io.clone(),
            qpn,
            socket,
        }),
    };
    Connection::rdma(
        sender,
        receiver,
        attached.max_message_size,
        attached.peer,
        attached.identity.clone(),
    )
}
