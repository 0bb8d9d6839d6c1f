//! I/O threads (§6.2) and the connection table (§6.1): the thin driver
//! around the sans-IO engines.
//!
//! A transport runs `rdma.io_threads` I/O threads. Each owns one completion
//! queue and the engines assigned to it (round robin); it polls its CQ in
//! batches and dispatches completions by QP number, so I/O threads share
//! nothing on the data path. The async side talks to a thread through an
//! unbounded command queue plus a wake-up of its CQ
//! ([`CompletionQueue::wake`]), so no tokio worker ever blocks on it; what
//! the thread has for the async side goes through per-socket tokio
//! channels.
//!
//! A thread in `event` mode that finds nothing to do keeps polling for
//! `spin_us` (the answer to what it just sent often comes within it),
//! then arms its CQ and sleeps until a completion (from any process, for
//! the soft NIC) or a command wakes it, or the next keepalive is due: an
//! idle server uses no CPU. In `busy` mode it never sleeps.
//!
//! Backpressure: a socket whose application does not read keeps its
//! messages in a backlog here; while an engine's sockets hold more than
//! [`BACKLOG_LIMIT`] messages, it stops reposting receives, so its credits
//! stop flowing back and the peer waits. On the sending side each socket
//! holds `send_queue_depth` permits, returned as its messages are wholly
//! handed to the NIC.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{Semaphore, mpsc, oneshot};

use super::engine::{Engine, EngineEvent, PeerInfo, SocketId, recv_wr};
use crate::pool::{Pool, PoolBuf};
use crate::verbs::{CompletionQueue, QueuePair, SharedReceiveQueue, WorkCompletion};
use crate::{Connection, Message, Polling, TransportError};

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

/// An I/O thread's shared receive queue and the buffers posted on it.
pub(crate) struct SharedReceives {
    srq: Arc<dyn SharedReceiveQueue>,
    pool: Pool,
    buffer: usize,
    /// Buffer of each posted receive, by `wr_id`.
    slots: Vec<Option<PoolBuf>>,
    /// Slots whose receive was consumed, to post again.
    free: Vec<usize>,
}

impl SharedReceives {
    /// A queue of `depth` receives of `buffer` bytes from `pool`, posted.
    pub(crate) fn new(
        srq: Arc<dyn SharedReceiveQueue>,
        pool: Pool,
        buffer: usize,
        depth: u32,
    ) -> Result<Self, TransportError> {
        let mut this = Self {
            srq,
            pool,
            buffer,
            slots: (0..depth).map(|_| None).collect(),
            free: (0..depth as usize).collect(),
        };
        this.repost()?;
        Ok(this)
    }

    /// Posts a fresh buffer in every free slot, with one doorbell.
    fn repost(&mut self) -> Result<(), TransportError> {
        if self.free.is_empty() {
            return Ok(());
        }
        let mut wrs = Vec::with_capacity(self.free.len());
        while let Some(slot) = self.free.pop() {
            let mut buf = match self.pool.alloc(self.buffer) {
                Ok(buf) => buf,
                Err(err) => {
                    // Try again next time; post what was allocated.
                    self.free.push(slot);
                    tracing::warn!(%err, "no memory for shared receives");
                    break;
                }
            };
            buf.set_len(self.buffer);
            let wr = recv_wr(super::wr_id::shared_recv(slot), &buf).ok_or(
                TransportError::rdma_error(crate::RdmaError::BufferOutsidePool),
            )?;
            wrs.push(wr);
            self.slots[slot] = Some(buf);
        }
        if wrs.is_empty() {
            return Ok(());
        }
        match self.srq.post_recv(&wrs) {
            Ok(()) => Ok(()),
            Err(err) => {
                // What did not go up is not the NIC's: its slots are free
                // again (the next round tries them anew), its buffers go
                // back to the pool.
                // A post that says how far it got frees the rest; any other
                // error posted nothing (it was refused before the list).
                let posted = match err {
                    crate::verbs::VerbsError::PostFailed { posted, .. } => posted as usize,
                    _ => 0,
                };
                for wr in &wrs[posted.min(wrs.len())..] {
                    let super::wr_id::WrKind::SharedRecv(slot) = super::wr_id::classify(wr.wr_id)
                    else {
                        continue;
                    };
                    if let Some(buf) = self.slots.get_mut(slot) {
                        drop(buf.take());
                        self.free.push(slot);
                    }
                }
                Err(TransportError::rdma_error(err))
            }
        }
    }

    /// The buffer the receive in `slot` landed in, or failed with (the
    /// slot is reposted).
    fn take(&mut self, slot: usize) -> Option<PoolBuf> {
        let buf = self.slots.get_mut(slot)?.take()?;
        self.free.push(slot);
        Some(buf)
    }

    /// Receives posted on the queue now.
    fn posted(&self) -> usize {
        self.slots.len() - self.free.len()
    }
}

/// A post of `attached`'s QP failed: the QP goes to ERROR (what was posted
/// is flushed back) and the engine fails, failing its sockets; before, the
/// error was logged and the engine waited forever for completions of work
/// requests that were never posted.
fn post_failed(attached: &mut Attached, err: crate::verbs::VerbsError) {
    tracing::warn!(peer = %attached.peer, %err, "rdma post failed: the connection fails");
    metrics::counter!("tessera_rdma_post_failures_total").increment(1);
    if let Err(modify) = attached.qp.fail() {
        tracing::warn!(peer = %attached.peer, err = %modify, "moving the queue pair to error failed");
    }
    attached.engine.handle_post_error(err);
}

/// Runs `f` on `slot`; if it panics, the panic stops here: that engine
/// fails (its QP to error, each socket and pending open an error, the
/// slot never called again and dropped once its sockets have their error)
/// and the thread goes on serving its other engines. A panic is a bug; it
/// is logged as an error (once per engine) and counted
/// (`tessera_rdma_engine_panics_total`).
fn isolated<R>(
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
            slot.attached.alive.store(false, Ordering::Release);
            if let Err(err) = slot.attached.qp.fail() {
                tracing::warn!(peer = %slot.attached.peer, %err, "moving the queue pair to error failed");
            }
            if let Some(io) = io {
                io.stats.engines_failed.fetch_add(1, Ordering::Relaxed);
            }
            fail_sockets(
                &mut slot.opening,
                &mut slot.sockets,
                &super::engine::EngineError::Panicked,
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
fn to_backlog(sockets: &mut HashMap<SocketId, SocketSlot>, event: EngineEvent) {
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
fn fail_sockets(
    opening: &mut HashMap<SocketId, oneshot::Sender<Result<Connection, TransportError>>>,
    sockets: &mut HashMap<SocketId, SocketSlot>,
    err: &super::engine::EngineError,
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
fn deliver_backlog(socket: &mut SocketSlot) -> bool {
    let mut delivered = false;
    while let Some(item) = socket.backlog.pop_front() {
        let Some(deliver) = &socket.deliver else {
            socket.backlog.clear();
            break;
        };
        match deliver.try_send(item) {
            Ok(()) => delivered = true,
            Err(mpsc::error::TrySendError::Full(item)) => {
                socket.backlog.push_front(item);
                break;
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                // The application dropped its receiver.
                socket.deliver = None;
                socket.backlog.clear();
                break;
            }
        }
    }
    if socket.rx_closed && socket.backlog.is_empty() {
        socket.deliver = None;
    }
    delivered
}

/// A handle on one I/O thread.
#[derive(Clone)]
pub(crate) struct IoThread {
    commands: mpsc::UnboundedSender<Command>,
    cq: Arc<dyn CompletionQueue>,
    srq: Option<Arc<dyn SharedReceiveQueue>>,
    stats: Arc<IoStats>,
}

impl std::fmt::Debug for IoThread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoThread").finish_non_exhaustive()
    }
}

impl IoThread {
    /// Starts a thread polling `cq`.
    pub(crate) fn start(
        name: String,
        cq: Arc<dyn CompletionQueue>,
        shared: Option<SharedReceives>,
        polling: Polling,
        spin: Duration,
        panic_on_len: Option<usize>,
    ) -> Result<Self, TransportError> {
        let (commands, queue) = mpsc::unbounded_channel();
        let stats = Arc::new(IoStats::default());
        let srq = shared.as_ref().map(|s| Arc::clone(&s.srq));
        let worker = Worker {
            shared,
            cq: Arc::clone(&cq),
            queue,
            engines: HashMap::new(),
            orphans: HashMap::new(),
            polling,
            spin,
            self_handle: None,
            stats: Arc::clone(&stats),
            last_metrics: Instant::now(),
            last_repost_warning: None,
            panic_on_len,
        };
        let handle = Self {
            commands,
            cq,
            srq,
            stats,
        };
        let mut worker = worker;
        worker.self_handle = Some(handle.downgrade());
        std::thread::Builder::new()
            .name(name)
            .spawn(move || worker.run())?;
        Ok(handle)
    }

    fn downgrade(&self) -> WeakIoThread {
        WeakIoThread {
            commands: self.commands.downgrade(),
            cq: Arc::clone(&self.cq),
            srq: self.srq.clone(),
            stats: Arc::clone(&self.stats),
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
}

/// What the thread keeps of its own handle (to build senders without
/// keeping itself alive).
struct WeakIoThread {
    commands: mpsc::WeakUnboundedSender<Command>,
    cq: Arc<dyn CompletionQueue>,
    srq: Option<Arc<dyn SharedReceiveQueue>>,
    stats: Arc<IoStats>,
}

impl WeakIoThread {
    fn upgrade(&self) -> Option<IoThread> {
        Some(IoThread {
            commands: self.commands.upgrade()?,
            cq: Arc::clone(&self.cq),
            srq: self.srq.clone(),
            stats: Arc::clone(&self.stats),
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
    permits: Arc<Semaphore>,
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
        let queued = self.io.submit(Command::Send {
            qpn: self.qpn,
            socket: self.socket,
            message,
        });
        if queued {
            Ok(())
        } else {
            Err(TransportError::Closed)
        }
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.permits.is_closed()
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

/// Per-engine metrics (labelled by peer address) and the last counters
/// they were brought up to date with.
struct EngineMetrics {
    last: super::engine::EngineStats,
    bytes_sent: metrics::Counter,
    bytes_received: metrics::Counter,
    messages_sent: metrics::Counter,
    messages_received: metrics::Counter,
    credit_stalls: metrics::Counter,
    window_stalls: metrics::Counter,
    keepalives_sent: metrics::Counter,
    ring_occupancy: metrics::Histogram,
}

impl EngineMetrics {
    fn new(peer: &SocketAddr) -> Self {
        let peer = peer.to_string();
        Self {
            last: super::engine::EngineStats::default(),
            bytes_sent: metrics::counter!("tessera_rdma_bytes_sent_total", "peer" => peer.clone()),
            bytes_received: metrics::counter!("tessera_rdma_bytes_received_total", "peer" => peer.clone()),
            messages_sent: metrics::counter!("tessera_rdma_messages_sent_total", "peer" => peer.clone()),
            messages_received: metrics::counter!("tessera_rdma_messages_received_total", "peer" => peer.clone()),
            credit_stalls: metrics::counter!("tessera_rdma_credit_stalls_total", "peer" => peer.clone()),
            window_stalls: metrics::counter!("tessera_rdma_window_stalls_total", "peer" => peer.clone()),
            keepalives_sent: metrics::counter!("tessera_rdma_keepalives_sent_total", "peer" => peer.clone()),
            ring_occupancy: metrics::histogram!("tessera_rdma_ring_occupancy", "peer" => peer),
        }
    }

    /// Brings the metrics and the thread's totals up to `now`'s counters.
    fn update(&mut self, engine: &Engine, totals: &IoStats) {
        let now = engine.stats();
        let last = std::mem::replace(&mut self.last, now);
        let sent = (now.small_sent + now.large_sent) - (last.small_sent + last.large_sent);
        let pairs = [
            (
                &self.bytes_sent,
                &totals.bytes_sent,
                now.bytes_sent - last.bytes_sent,
            ),
            (
                &self.bytes_received,
                &totals.bytes_received,
                now.bytes_received - last.bytes_received,
            ),
            (&self.messages_sent, &totals.messages_sent, sent),
            (
                &self.messages_received,
                &totals.messages_received,
                now.received - last.received,
            ),
            (
                &self.credit_stalls,
                &totals.credit_stalls,
                now.credit_stalls - last.credit_stalls,
            ),
            (
                &self.window_stalls,
                &totals.window_stalls,
                now.window_stalls - last.window_stalls,
            ),
            (
                &self.keepalives_sent,
                &totals.keepalives_sent,
                now.keepalives_sent - last.keepalives_sent,
            ),
        ];
        for (counter, total, delta) in pairs {
            if delta > 0 {
                counter.increment(delta);
                total.fetch_add(delta, Ordering::Relaxed);
            }
        }
        self.ring_occupancy.record(engine.in_flight() as f64);
        totals
            .peak_in_flight_bytes
            .fetch_max(now.peak_in_flight_bytes, Ordering::Relaxed);
    }
}

/// Counters of one I/O thread (summed over a transport's threads by
/// [`crate::Transport::rdma_stats`]).
#[derive(Debug, Default)]
pub(crate) struct IoStats {
    pub(crate) qps_open: AtomicU64,
    pub(crate) sockets_open: AtomicU64,
    pub(crate) bytes_sent: AtomicU64,
    pub(crate) bytes_received: AtomicU64,
    pub(crate) messages_sent: AtomicU64,
    pub(crate) messages_received: AtomicU64,
    pub(crate) credit_stalls: AtomicU64,
    pub(crate) window_stalls: AtomicU64,
    pub(crate) keepalives_sent: AtomicU64,
    pub(crate) keepalive_failures: AtomicU64,
    pub(crate) engines_failed: AtomicU64,
    pub(crate) peak_in_flight_bytes: AtomicU64,
    /// Receives posted on the thread's shared receive queue now.
    pub(crate) shared_receives_posted: AtomicU64,
}

struct EngineSlot {
    metrics: EngineMetrics,
    attached: Attached,
    sockets: HashMap<SocketId, SocketSlot>,
    /// Sockets this end opened, waiting for the peer's answer.
    opening: HashMap<SocketId, oneshot::Sender<Result<Connection, TransportError>>>,
    /// Whether a socket was ever opened on it.
    had_socket: bool,
    /// Its engine panicked: it is failed and never called again.
    panicked: bool,
}

// Field order is drop order: the engines (and their QPs) go before the
// shared receive queue's buffers, which a QP still alive could receive
// into (before, the buffers went first).
struct Worker {
    /// `soft_faults.panic_on_message_len` (drills of panic isolation).
    panic_on_len: Option<usize>,
    engines: HashMap<u32, EngineSlot>,
    cq: Arc<dyn CompletionQueue>,
    shared: Option<SharedReceives>,
    queue: mpsc::UnboundedReceiver<Command>,
    /// Completions of QPs not (yet) attached, replayed on attach.
    orphans: HashMap<u32, Vec<WorkCompletion>>,
    polling: Polling,
    spin: Duration,
    self_handle: Option<WeakIoThread>,
    stats: Arc<IoStats>,
    last_metrics: Instant,
    /// When a failed shared-receive repost was last logged.
    last_repost_warning: Option<Instant>,
}

/// How often an I/O thread brings its metrics up to date.
const METRICS_INTERVAL: Duration = Duration::from_millis(100);

impl Worker {
    /// Metrics of every engine, and the thread's gauges.
    fn update_metrics(&mut self) {
        for slot in self.engines.values_mut().filter(|s| !s.panicked) {
            slot.metrics.update(&slot.attached.engine, &self.stats);
        }
        let sockets: usize = self.engines.values().map(|s| s.sockets.len()).sum();
        self.stats
            .qps_open
            .store(self.engines.len() as u64, Ordering::Relaxed);
        self.stats
            .sockets_open
            .store(sockets as u64, Ordering::Relaxed);
        if let Some(shared) = &self.shared {
            self.stats
                .shared_receives_posted
                .store(shared.posted() as u64, Ordering::Relaxed);
        }
        self.last_metrics = Instant::now();
    }

    fn run(mut self) {
        let mut completions: Vec<WorkCompletion> = Vec::with_capacity(64);
        let mut idle_rounds: u32 = 0;
        let mut last_work = Instant::now();
        let mut next_timer: Option<Instant> = None;
        loop {
            let mut progress = false;
            // Commands.
            loop {
                match self.queue.try_recv() {
                    Ok(command) => {
                        progress = true;
                        self.handle_command(command);
                    }
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => {
                        // No transport and no sender refers to this thread.
                        return;
                    }
                }
            }
            // Completions, dispatched by QP number.
            completions.clear();
            self.cq.poll(&mut completions, 64);
            let now = Instant::now();
            for completion in &completions {
                progress = true;
                self.dispatch(completion, now);
            }
            // Shared receives are not reposted while the applications are
            // behind: senders then meet receiver-not-ready and retry (the
            // shared queue's backpressure, as credits are a dedicated one's).
            if let Some(shared) = &mut self.shared {
                let backlog: usize = self
                    .engines
                    .values()
                    .flat_map(|e| e.sockets.values())
                    .map(|s| s.backlog.len())
                    .sum();
                if backlog < BACKLOG_LIMIT
                    && let Err(err) = shared.repost()
                {
                    // Said at most once a second: a queue that keeps
                    // failing would say it every round.
                    if self
                        .last_repost_warning
                        .is_none_or(|at| at.elapsed() >= Duration::from_secs(1))
                    {
                        tracing::warn!(%err, "reposting shared receives failed");
                        self.last_repost_warning = Some(Instant::now());
                    }
                    metrics::counter!("tessera_rdma_srq_repost_failures_total").increment(1);
                }
            }
            // Timers.
            if next_timer.is_some_and(|at| now >= at) {
                let io = self.self_handle.as_ref().and_then(WeakIoThread::upgrade);
                for slot in self.engines.values_mut().filter(|s| !s.panicked) {
                    isolated(slot, io.as_ref(), |slot| {
                        slot.attached.engine.handle_timeout(now)
                    });
                }
                next_timer = None;
                progress = true;
            }
            // Each engine: post, collect events, deliver.
            let io = self.self_handle.as_ref().and_then(WeakIoThread::upgrade);
            let panic_on_len = self.panic_on_len;
            for (qpn, slot) in self.engines.iter_mut().filter(|(_, s)| !s.panicked) {
                let io = io.as_ref();
                if isolated(slot, io, |slot| Self::drive(*qpn, slot, io, panic_on_len))
                    == Some(true)
                {
                    progress = true;
                }
            }
            drop(io);
            // A failed engine goes once its sockets have their error.
            let stats = &self.stats;
            let before = self.engines.len();
            self.engines.retain(|_, slot| {
                if slot.panicked {
                    // Its sockets had their error pushed when it panicked.
                    for s in slot.sockets.values_mut() {
                        deliver_backlog(s);
                    }
                }
                let keep = !(slot.panicked || slot.attached.engine.is_failed())
                    || slot.sockets.values().any(|s| !s.backlog.is_empty());
                if !keep {
                    if !slot.panicked {
                        slot.metrics.update(&slot.attached.engine, stats);
                    }
                    metrics::gauge!("tessera_rdma_qps_open").decrement(1.0);
                }
                keep
            });
            if self.engines.len() != before
                || self.engines.len() as u64 != self.stats.qps_open.load(Ordering::Relaxed)
                || now.saturating_duration_since(self.last_metrics) >= METRICS_INTERVAL
            {
                self.update_metrics();
            }
            // Recomputed after any work too: what an engine handled may
            // have brought its timer forward (a keepalive slot learnt
            // from the peer's `Slot` message starts the keepalive; before,
            // the thread slept on to the old deadline and both sides took
            // each other for dead).
            if next_timer.is_none() || progress {
                next_timer = self
                    .engines
                    .values()
                    .filter(|slot| !slot.panicked)
                    .filter_map(|slot| slot.attached.engine.poll_timeout())
                    .min();
            }
            if progress {
                idle_rounds = 0;
                last_work = now;
                continue;
            }
            idle_rounds = idle_rounds.wrapping_add(1);
            match self.polling {
                // Never sleeps; yields the core every few empty rounds, so
                // the application threads it serves (which must run for
                // anything to happen) are not kept waiting for a time
                // slice.
                Polling::Busy => {
                    if idle_rounds.is_multiple_of(16) {
                        std::thread::yield_now();
                    } else {
                        std::hint::spin_loop();
                    }
                    continue;
                }
                // Keeps polling a moment after activity (the answer to what
                // was just sent often comes within it), then sleeps.
                Polling::Event if now.saturating_duration_since(last_work) < self.spin => {
                    if idle_rounds.is_multiple_of(16) {
                        std::thread::yield_now();
                    } else {
                        std::hint::spin_loop();
                    }
                    continue;
                }
                Polling::Event => {}
            }
            // Sleep: arm, look once more, then wait.
            self.cq.arm();
            if !self.queue.is_empty() {
                continue;
            }
            let mut late: Vec<WorkCompletion> = Vec::new();
            if self.cq.poll(&mut late, 64) > 0 {
                let now = Instant::now();
                for completion in &late {
                    self.dispatch(completion, now);
                }
                continue;
            }
            let now = Instant::now();
            let sleep = next_timer
                .map_or(MAX_SLEEP, |at| at.saturating_duration_since(now))
                .min(MAX_SLEEP);
            if !sleep.is_zero() {
                self.cq.wait(sleep);
            }
        }
    }

    /// Hands a completion to its engine (or keeps it until the engine is
    /// attached).
    fn dispatch(&mut self, completion: &WorkCompletion, now: Instant) {
        match self.engines.get_mut(&completion.qpn) {
            // A panicked engine's completions (flushes of its QP, now in
            // error, or receives that came before it) are not handled; a
            // shared receive's slot is given back to be posted again.
            Some(slot) if slot.panicked => Self::forget_completion(&mut self.shared, completion),
            Some(slot) => {
                let shared = &mut self.shared;
                let io = self.self_handle.as_ref().and_then(WeakIoThread::upgrade);
                isolated(slot, io.as_ref(), |slot| {
                    Self::deliver_completion(shared, slot, completion, now)
                });
            }
            None => {
                // Mostly flushes of QPs already gone; a QP about to be
                // attached has its few here for a moment.
                let held: usize = self.orphans.values().map(Vec::len).sum();
                if held >= ORPHAN_LIMIT {
                    self.orphans.clear();
                }
                self.orphans
                    .entry(completion.qpn)
                    .or_default()
                    .push(*completion);
            }
        }
    }

    /// Drops `completion` unhandled, giving a shared receive's slot (and
    /// buffer) back so that the shared queue does not shrink.
    fn forget_completion(shared: &mut Option<SharedReceives>, completion: &WorkCompletion) {
        if let (Some(shared), super::wr_id::WrKind::SharedRecv(index)) =
            (shared, super::wr_id::classify(completion.wr_id))
        {
            drop(shared.take(index));
        }
    }

    /// Feeds `completion` to its engine; a receive of the shared receive
    /// queue comes with its buffer.
    fn deliver_completion(
        shared: &mut Option<SharedReceives>,
        slot: &mut EngineSlot,
        completion: &WorkCompletion,
        now: Instant,
    ) {
        let engine = &mut slot.attached.engine;
        // By the id: an error completion's opcode is undefined, and a
        // failed shared receive must give its slot back all the same.
        match (shared, super::wr_id::classify(completion.wr_id)) {
            (Some(shared), super::wr_id::WrKind::SharedRecv(index)) => match shared.take(index) {
                Some(buf) => engine.handle_shared_receive(completion, buf),
                None => tracing::warn!(
                    wr_id = completion.wr_id,
                    "completion for an unknown shared receive"
                ),
            },
            _ => engine.handle_completion(completion, now),
        }
    }

    /// Posts what the engine has, and hands its events on. Returns whether
    /// anything happened.
    fn drive(
        qpn: u32,
        slot: &mut EngineSlot,
        io: Option<&IoThread>,
        panic_on_len: Option<usize>,
    ) -> bool {
        let mut progress = false;
        let now = Instant::now();
        let backlog: usize = slot.sockets.values().map(|s| s.backlog.len()).sum();
        let EngineSlot {
            attached,
            sockets,
            opening,
            had_socket,
            ..
        } = slot;
        if !sockets.is_empty() {
            *had_socket = true;
        }
        if backlog < BACKLOG_LIMIT
            && let Some(wrs) = attached.engine.poll_recv_post()
        {
            progress = true;
            if let Err(err) = attached.qp.post_recv(&wrs) {
                post_failed(attached, err);
            }
        }
        // One batch per engine per round: completions (the answers to what
        // was sent) are polled between batches.
        if let Some(batch) = attached.engine.poll_transmit(now) {
            progress = true;
            if let Err(err) = attached.qp.post_send(&batch) {
                post_failed(attached, err);
            }
        }
        while let Some(event) = attached.engine.poll_event() {
            progress = true;
            match event {
                EngineEvent::Message { socket, bytes } => {
                    // The drill knob: what a bug in the engine would do.
                    if panic_on_len == Some(bytes.len()) {
                        panic!(
                            "injected panic: soft_faults.panic_on_message_len = {}",
                            bytes.len()
                        );
                    }
                    to_backlog(sockets, EngineEvent::Message { socket, bytes });
                }
                EngineEvent::Sent(socket) => {
                    if let Some(s) = sockets.get(&socket) {
                        s.permits.add_permits(1);
                    }
                }
                EngineEvent::Opened(socket) => {
                    let accepted = match (io, &attached.accepts) {
                        (Some(io), Some(accepts)) => {
                            let connection = new_socket(io, qpn, socket, attached, sockets);
                            accepts.try_send(connection).is_ok()
                        }
                        _ => false,
                    };
                    if accepted {
                        attached.engine.accept_socket(socket);
                    } else {
                        tracing::debug!(peer = %attached.peer, "no listener takes the socket: refused");
                        sockets.remove(&socket);
                        attached.engine.refuse_socket(socket);
                    }
                }
                EngineEvent::Accepted(socket) => {
                    if let (Some(reply), Some(io)) = (opening.remove(&socket), io) {
                        let connection = new_socket(io, qpn, socket, attached, sockets);
                        // A caller that gave up drops the connection, which
                        // closes the socket again.
                        let _ = reply.send(Ok(connection));
                    }
                }
                EngineEvent::Refused(socket) => {
                    if let Some(reply) = opening.remove(&socket) {
                        let _ = reply.send(Err(TransportError::Connect {
                            addr: attached.peer.to_string(),
                            source: std::io::Error::new(
                                std::io::ErrorKind::ConnectionRefused,
                                "the peer has no listener for new connections",
                            ),
                        }));
                    }
                }
                EngineEvent::Closed(socket) => to_backlog(sockets, EngineEvent::Closed(socket)),
                EngineEvent::Failed(super::engine::EngineError::Unused) => {
                    attached.alive.store(false, Ordering::Release);
                }
                EngineEvent::Failed(err) => {
                    attached.alive.store(false, Ordering::Release);
                    metrics::counter!("tessera_rdma_engine_failures_total").increment(1);
                    if matches!(err, super::engine::EngineError::PeerDead(_)) {
                        tracing::warn!(peer = %attached.peer, %err, "rdma peer declared dead");
                        metrics::counter!("tessera_rdma_keepalive_failures_total").increment(1);
                        if let Some(io) = io {
                            io.stats.keepalive_failures.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    if let Some(io) = io {
                        io.stats.engines_failed.fetch_add(1, Ordering::Relaxed);
                    }
                    tracing::debug!(peer = %attached.peer, %err, "rdma engine failed");
                    // Messages that arrived whole but wait for their
                    // window's invalidation go first, once the QP is in
                    // error: no write can land in them any more.
                    if let Err(err) = attached.qp.fail() {
                        tracing::warn!(peer = %attached.peer, %err, "moving the queue pair to error failed");
                    }
                    for held in attached.engine.take_held() {
                        to_backlog(sockets, held);
                    }
                    fail_sockets(opening, sockets, &err);
                }
            }
        }
        // Deliver what the applications can take.
        for s in sockets.values_mut() {
            if deliver_backlog(s) {
                progress = true;
            }
        }
        sockets.retain(|_, s| !(s.tx_closed && s.deliver.is_none()));
        if attached.close_when_unused
            && *had_socket
            && sockets.is_empty()
            && opening.is_empty()
            && !attached.engine.is_failed()
            && attached.engine.is_idle()
        {
            attached.engine.handle_unused();
            progress = true;
        }
        progress
    }

    /// Runs `f` on engine `qpn` unless it is gone or panicked, isolated
    /// (see [`isolated`]); `None` if it did not run to its end.
    fn with_engine<R>(&mut self, qpn: u32, f: impl FnOnce(&mut EngineSlot) -> R) -> Option<R> {
        let io = self.self_handle.as_ref().and_then(WeakIoThread::upgrade);
        let slot = self.engines.get_mut(&qpn).filter(|s| !s.panicked)?;
        isolated(slot, io.as_ref(), f)
    }

    fn handle_command(&mut self, command: Command) {
        match command {
            Command::Attach(attached) => {
                let qpn = attached.qp.qpn();
                let mut slot = EngineSlot {
                    metrics: EngineMetrics::new(&attached.peer),
                    attached: *attached,
                    sockets: HashMap::new(),
                    opening: HashMap::new(),
                    had_socket: false,
                    panicked: false,
                };
                let now = Instant::now();
                let io = self.self_handle.as_ref().and_then(WeakIoThread::upgrade);
                for completion in self.orphans.remove(&qpn).unwrap_or_default() {
                    if slot.panicked {
                        Self::forget_completion(&mut self.shared, &completion);
                        continue;
                    }
                    let shared = &mut self.shared;
                    isolated(&mut slot, io.as_ref(), |slot| {
                        Self::deliver_completion(shared, slot, &completion, now)
                    });
                }
                self.engines.insert(qpn, slot);
                metrics::gauge!("tessera_rdma_qps_open").increment(1.0);
            }
            Command::Open { qpn, reply } => {
                let mut reply = Some(reply);
                let opened =
                    self.with_engine(qpn, |slot| match slot.attached.engine.open_socket() {
                        Ok(socket) => {
                            if let Some(reply) = reply.take() {
                                slot.opening.insert(socket, reply);
                            }
                        }
                        Err(err) => {
                            if let Some(reply) = reply.take() {
                                let _ = reply.send(Err(TransportError::rdma_error(err)));
                            }
                        }
                    });
                if opened.is_none()
                    && let Some(reply) = reply
                {
                    let _ = reply.send(Err(TransportError::rdma_error(
                        crate::RdmaError::EngineGone,
                    )));
                }
            }
            Command::Send {
                qpn,
                socket,
                message,
            } => {
                self.with_engine(qpn, |slot| {
                    if let Err(err) = slot.attached.engine.send(socket, message) {
                        tracing::debug!(%err, "rdma send refused");
                        if let Some(s) = slot.sockets.get(&socket) {
                            // The message never went: its permit comes back.
                            s.permits.add_permits(1);
                        }
                    }
                });
            }
            Command::Close { qpn, socket } => {
                self.with_engine(qpn, |slot| {
                    slot.attached.engine.close_socket(socket);
                    if let Some(s) = slot.sockets.get_mut(&socket) {
                        s.tx_closed = true;
                    }
                });
            }
            Command::PeerReady { qpn, info } => {
                self.with_engine(qpn, |slot| {
                    slot.attached.engine.peer_ready(info, Instant::now())
                });
            }
            Command::PeerClosed { qpn } => {
                self.with_engine(qpn, |slot| slot.attached.engine.handle_peer_closed());
            }
            Command::Event(event) => {
                use crate::verbs::AsyncEvent;
                match event {
                    // That QP only (the thread that has it).
                    AsyncEvent::QpFailed { qpn } => {
                        self.with_engine(qpn, |slot| {
                            slot.attached.engine.handle_device_event(event)
                        });
                    }
                    // Every QP of the device may be affected: which CQ
                    // overran is not said in a way the thread can match,
                    // and a CQ that overran is a configuration beyond the
                    // CQ budget, so failing all at once is the safe side.
                    AsyncEvent::CqFailed
                    | AsyncEvent::SrqFailed
                    | AsyncEvent::DeviceFailed
                    | AsyncEvent::PortDown { .. } => {
                        let io = self.self_handle.as_ref().and_then(WeakIoThread::upgrade);
                        for slot in self.engines.values_mut().filter(|s| !s.panicked) {
                            isolated(slot, io.as_ref(), |slot| {
                                slot.attached.engine.handle_device_event(event)
                            });
                        }
                    }
                    _ => {}
                }
            }
        }
    }
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
