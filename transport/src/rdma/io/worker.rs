//! A driver's worker: the engines of one completion queue, and the round
//! that moves them (commands, completions, timers, posts, deliveries).
//! The drivers (`thread.rs`, `runtime.rs`) decide when rounds run and how
//! an idle worker sleeps.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use super::metrics::{EngineMetrics, IoStats};
use super::{
    Attached, BACKLOG_LIMIT, Command, IoThread, ORPHAN_LIMIT, SharedReceives, SocketSlot,
    WeakIoThread, new_socket,
};
use crate::rdma::engine::{EngineEvent, SocketId};
use crate::verbs::{CompletionQueue, WorkCompletion};
use crate::{Connection, TransportError};

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
fn deliver_backlog(socket: &mut SocketSlot) -> bool {
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
    /// It is on the worker's ready list.
    ready: bool,
    /// Its engine's deadline as it was after the engine last ran.
    deadline: Option<Instant>,
    /// Its name as the origin of chunks it hands to partners (unique in
    /// the process).
    origin: u64,
    /// Engines on other rails to the same peer (`rdma/partners.rs`).
    partners: Vec<super::Partner>,
}

/// Names of engines as origins of chunks (`stripes.rs`).
static NEXT_ORIGIN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// How long the buffers of a failed engine's grants stay out of the pool
/// when their keys on other rails were told (`Engine::take_exposed`): a
/// chunk the peer's queue pair on another rail posted before it learnt of
/// the failure may still land. 5 s: a queue pair's own retries give up
/// within about that on the default transport timeouts.
const LATE_WRITE_HOLD: Duration = Duration::from_secs(5);

impl EngineSlot {
    /// Puts this engine (`qpn`) on the ready list, once.
    fn list(&mut self, qpn: u32, ready: &mut Vec<u32>) {
        if !self.ready {
            self.ready = true;
            ready.push(qpn);
        }
    }
}

/// Puts engine `qpn`, if there is one, on the ready list (once).
fn mark(engines: &mut HashMap<u32, EngineSlot>, ready: &mut Vec<u32>, qpn: u32) {
    if let Some(slot) = engines.get_mut(&qpn) {
        slot.list(qpn, ready);
    }
}

// Field order is drop order: the engines (and their QPs) go before the
// shared receive queue's buffers, which a QP still alive could receive
// into (before, the buffers went first).
pub(super) struct Worker {
    /// `soft_faults.panic_on_message_len` (drills of panic isolation).
    panic_on_len: Option<usize>,
    engines: HashMap<u32, EngineSlot>,
    /// The engines the next round visits: those that got a command, a
    /// completion or a due timer, that did something in their last visit
    /// (they may have more), or that hold messages their applications have
    /// not taken yet. A round costs O(engines with work), not O(engines):
    /// before, every round walked every engine, and with hundreds of queue
    /// pairs on one completion queue that walk was most of a round.
    ready: Vec<u32>,
    /// The list being visited (kept to spare an allocation per round).
    visiting: Vec<u32>,
    cq: Arc<dyn CompletionQueue>,
    shared: Option<SharedReceives>,
    queue: mpsc::UnboundedReceiver<Command>,
    /// Completions of QPs not (yet) attached, replayed on attach.
    orphans: HashMap<u32, Vec<WorkCompletion>>,
    self_handle: Option<WeakIoThread>,
    stats: Arc<IoStats>,
    last_metrics: Instant,
    /// Work was done since the metrics were last updated: they are updated
    /// again when the worker goes idle, so that a snapshot taken after the
    /// last message of a burst counts it.
    metrics_stale: bool,
    /// When a failed shared-receive repost was last logged.
    last_repost_warning: Option<Instant>,
    /// The earliest engine deadline (keepalive, window), as the last round
    /// left it.
    next_timer: Option<Instant>,
    /// Where a round polls completions into (kept to spare an allocation
    /// per round).
    completions: Vec<WorkCompletion>,
    /// Rounds run and engines visited, published with the metrics.
    rounds: u64,
    engine_visits: u64,
    /// Where the answers for chunks of other drivers' engines go, by the
    /// origin's name: its driver and QP number (`stripes.rs`).
    origins: HashMap<u64, (IoThread, u32)>,
    /// Buffers of failed engines held until late writes cannot land
    /// ([`LATE_WRITE_HOLD`]).
    late: std::collections::VecDeque<(Instant, Vec<crate::pool::PoolBuf>)>,
}

/// Rounds a direct send runs at most before it leaves the rest to the
/// driver (a large message's fragments are not all copied by the caller).
const DIRECT_ROUNDS: usize = 4;

/// How often an I/O thread brings its metrics up to date.
const METRICS_INTERVAL: Duration = Duration::from_millis(100);

impl Worker {
    /// A worker polling `cq` (and running `shared` receives, if given),
    /// taking commands from `queue`.
    pub(super) fn new(
        cq: Arc<dyn CompletionQueue>,
        shared: Option<SharedReceives>,
        queue: mpsc::UnboundedReceiver<Command>,
        stats: Arc<IoStats>,
        panic_on_len: Option<usize>,
    ) -> Self {
        Self {
            panic_on_len,
            engines: HashMap::new(),
            ready: Vec::new(),
            visiting: Vec::new(),
            cq,
            shared,
            queue,
            orphans: HashMap::new(),
            self_handle: None,
            stats,
            last_metrics: Instant::now(),
            metrics_stale: false,
            last_repost_warning: None,
            next_timer: None,
            completions: Vec::with_capacity(64),
            rounds: 0,
            engine_visits: 0,
            origins: HashMap::new(),
            late: std::collections::VecDeque::new(),
        }
    }

    /// Gives the worker its own (weak) handle, from which sockets it opens
    /// build their senders.
    pub(super) fn set_handle(&mut self, handle: WeakIoThread) {
        self.self_handle = Some(handle);
    }

    /// Runs rounds on the caller's thread (the runtime driver's direct
    /// path, after the caller queued its message): the queued commands are
    /// taken in order, so the message is posted behind any queued before
    /// it, and what the post completed at once (the soft NIC's sends) is
    /// handled before the caller goes on. The driver is woken if work is
    /// left after [`DIRECT_ROUNDS`] rounds, or if the rounds brought an
    /// engine deadline forward (the driver sleeps to the one it saw).
    pub(super) fn run_direct(&mut self) {
        let deadline = self.next_timer;
        let mut left = true;
        for _ in 0..DIRECT_ROUNDS {
            if self.round() != Some(true) {
                left = false;
                break;
            }
        }
        let earlier = match (self.next_timer, deadline) {
            (Some(now), Some(before)) => now < before,
            (Some(_), None) => true,
            (None, _) => false,
        };
        if left || earlier {
            self.cq.wake();
        }
    }

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
        let rounds = self.rounds - self.stats.rounds.load(Ordering::Relaxed);
        let visits = self.engine_visits - self.stats.engine_visits.load(Ordering::Relaxed);
        metrics::counter!("tessera_rdma_io_rounds_total").increment(rounds);
        metrics::counter!("tessera_rdma_engine_visits_total").increment(visits);
        self.stats.rounds.store(self.rounds, Ordering::Relaxed);
        self.stats
            .engine_visits
            .store(self.engine_visits, Ordering::Relaxed);
        if let Some(shared) = &self.shared {
            self.stats
                .shared_receives_posted
                .store(shared.posted() as u64, Ordering::Relaxed);
        }
        self.last_metrics = Instant::now();
        self.metrics_stale = false;
    }

    /// One round of work: commands, completions, shared receives, timers,
    /// then each engine (post, events, delivery), and the metrics. Returns
    /// whether anything happened, or `None` once no handle to this worker
    /// is left (its driver stops).
    pub(super) fn round(&mut self) -> Option<bool> {
        let mut progress = false;
        // Commands.
        loop {
            match self.queue.try_recv() {
                Ok(command) => {
                    progress = true;
                    self.handle_command(command);
                }
                Err(mpsc::error::TryRecvError::Empty) => break,
                // No transport and no sender refers to this worker.
                Err(mpsc::error::TryRecvError::Disconnected) => return None,
            }
        }
        // Completions, dispatched by QP number.
        let now = Instant::now();
        if self.poll_completions(now) {
            progress = true;
        }
        // Shared receives are not reposted while the applications are
        // behind: senders then meet receiver-not-ready and retry (the
        // shared queue's backpressure, as credits are a dedicated one's).
        // An engine holding messages is always on the ready list, so the
        // list gives the whole backlog.
        if let Some(shared) = &mut self.shared {
            let engines = &self.engines;
            let backlog: usize = self
                .ready
                .iter()
                .filter_map(|qpn| engines.get(qpn))
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
        // Timers: the engines whose deadline has come. A deadline that
        // moved later since brings a harmless early look (engines check
        // their own deadlines); the next one is the earliest of the rest,
        // and of those that run this round once they have.
        if self.next_timer.is_some_and(|at| now >= at) {
            let io = self.self_handle.as_ref().and_then(WeakIoThread::upgrade);
            let mut next: Option<Instant> = None;
            for (qpn, slot) in self.engines.iter_mut().filter(|(_, s)| !s.panicked) {
                if slot.deadline.is_some_and(|at| now >= at) {
                    isolated(slot, io.as_ref(), |slot| {
                        slot.attached.engine.handle_timeout(now)
                    });
                    slot.list(*qpn, &mut self.ready);
                } else if let Some(at) = slot.deadline {
                    next = Some(next.map_or(at, |n| n.min(at)));
                }
            }
            self.next_timer = next;
            progress = true;
        }
        // Each engine on the ready list: post, collect events, deliver.
        let io = self.self_handle.as_ref().and_then(WeakIoThread::upgrade);
        let panic_on_len = self.panic_on_len;
        let totals = Arc::clone(&self.stats);
        let origins = &self.origins;
        while self.late.front().is_some_and(|(until, _)| now >= *until) {
            self.late.pop_front();
        }
        // What a round cut short by a panic left unvisited goes first (its
        // engines are still marked ready, so nothing else would list them).
        self.ready.append(&mut self.visiting);
        std::mem::swap(&mut self.visiting, &mut self.ready);
        self.rounds += 1;
        self.engine_visits += self.visiting.len() as u64;
        let mut removed = false;
        let mut next = 0;
        while let Some(&qpn) = self.visiting.get(next) {
            next += 1;
            let Some(slot) = self.engines.get_mut(&qpn) else {
                continue;
            };
            slot.ready = false;
            let mut worked = false;
            if !slot.panicked {
                let io = io.as_ref();
                worked = isolated(slot, io, |slot| {
                    Self::drive(qpn, slot, io, &totals, panic_on_len, origins)
                }) == Some(true);
            }
            if slot.panicked {
                // Its sockets had their error pushed when it panicked.
                for s in slot.sockets.values_mut() {
                    deliver_backlog(s);
                }
            } else {
                // What it handled may have brought its deadline forward (a
                // keepalive slot learnt from the peer's `Slot` message
                // starts the keepalive; before, the thread slept on to the
                // old deadline and both sides took each other for dead).
                let io = io.as_ref();
                slot.deadline =
                    isolated(slot, io, |slot| slot.attached.engine.poll_timeout()).flatten();
                if let Some(at) = slot.deadline {
                    self.next_timer = Some(self.next_timer.map_or(at, |t| t.min(at)));
                }
            }
            progress |= worked;
            let holding = slot.sockets.values().any(|s| !s.backlog.is_empty());
            // A failed engine goes once its sockets have their error (an
            // engine fails while it handles something, which puts it on
            // the list).
            if (slot.panicked || slot.attached.engine.is_failed()) && !holding {
                if !slot.panicked {
                    slot.metrics.update(&slot.attached.engine, &self.stats);
                    let exposed = slot.attached.engine.take_exposed();
                    if !exposed.is_empty() {
                        self.late.push_back((now + LATE_WRITE_HOLD, exposed));
                    }
                }
                metrics::gauge!("tessera_rdma_qps_open").decrement(1.0);
                self.engines.remove(&qpn);
                removed = true;
                continue;
            }
            // One that did something may have more; one holding messages
            // tries to hand them on again; one waiting for the inbound
            // budget (which other connections free) asks again.
            if worked || holding || (!slot.panicked && slot.attached.engine.waits_for_budget()) {
                slot.list(qpn, &mut self.ready);
            }
        }
        self.visiting.clear();
        drop(io);
        self.metrics_stale |= progress;
        // Updated at least every METRICS_INTERVAL while busy, and once more
        // as the worker goes idle (before, an idle worker's counts waited for
        // its next timer; with keepalive off, for ever). Messages are counted
        // before delivery besides (`drive`).
        if removed
            || self.engines.len() as u64 != self.stats.qps_open.load(Ordering::Relaxed)
            || now.saturating_duration_since(self.last_metrics) >= METRICS_INTERVAL
            || (self.metrics_stale && !progress)
        {
            self.update_metrics();
        }
        Some(progress)
    }

    /// Arms the completion queue for sleeping and looks once more; true if
    /// there is work after all (the caller runs another round instead of
    /// sleeping). A completion or a command that comes after this wakes
    /// the sleeper ([`CompletionQueue::wake`]).
    pub(super) fn arm(&mut self) -> bool {
        self.cq.arm();
        !self.queue.is_empty() || self.poll_completions(Instant::now())
    }

    /// Polls a batch of completions and hands each to its engine; whether
    /// there were any.
    fn poll_completions(&mut self, now: Instant) -> bool {
        let mut completions = std::mem::take(&mut self.completions);
        completions.clear();
        self.cq.poll(&mut completions, 64);
        for completion in &completions {
            self.dispatch(completion, now);
        }
        let any = !completions.is_empty();
        self.completions = completions;
        any
    }

    /// The earliest engine deadline as of the last round.
    pub(super) fn next_timer(&self) -> Option<Instant> {
        self.next_timer
    }

    /// The completion queue this worker polls.
    pub(super) fn cq(&self) -> &Arc<dyn CompletionQueue> {
        &self.cq
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
                slot.list(completion.qpn, &mut self.ready);
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
        if let (Some(shared), crate::rdma::wr_id::WrKind::SharedRecv(index)) =
            (shared, crate::rdma::wr_id::classify(completion.wr_id))
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
        match (shared, crate::rdma::wr_id::classify(completion.wr_id)) {
            (Some(shared), crate::rdma::wr_id::WrKind::SharedRecv(index)) => {
                match shared.take(index) {
                    Some(buf) => engine.handle_shared_receive(completion, buf),
                    None => tracing::warn!(
                        wr_id = completion.wr_id,
                        "completion for an unknown shared receive"
                    ),
                }
            }
            _ => engine.handle_completion(completion, now),
        }
    }

    /// Posts what the engine has, and hands its events on. Returns whether
    /// anything happened.
    fn drive(
        qpn: u32,
        slot: &mut EngineSlot,
        io: Option<&IoThread>,
        totals: &IoStats,
        panic_on_len: Option<usize>,
        origins: &HashMap<u64, (IoThread, u32)>,
    ) -> bool {
        let mut progress = false;
        let now = Instant::now();
        let backlog: usize = slot.sockets.values().map(|s| s.backlog.len()).sum();
        let EngineSlot {
            attached,
            sockets,
            opening,
            had_socket,
            metrics,
            origin,
            partners,
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
        // Chunks for the other rails' engines (`stripes.rs`); one whose
        // engine is gone comes back at once, to be written here.
        while let Some(delegation) = attached.engine.poll_delegation() {
            progress = true;
            let partner = partners
                .iter()
                .find(|p| p.rail == delegation.rail && p.is_alive());
            let handed = match (partner, io) {
                (Some(partner), Some(io)) => partner.io.submit(Command::StripeWrites {
                    qpn: partner.qpn,
                    origin: *origin,
                    token: delegation.token,
                    chunk: delegation.chunk,
                    reply: (io.clone(), qpn),
                }),
                _ => false,
            };
            if !handed {
                attached.engine.handle_stripe_done(delegation.token, false);
            }
        }
        // Counted before they are handed on: a message the application has
        // is in the transport's counters (before, they were brought up to
        // date every 100 ms of work, and not once the worker went idle: the
        // ibverbs two-process test read 7 messages sent and 6 received after
        // all 7 echoes had arrived).
        let mut counted = false;
        while let Some(event) = attached.engine.poll_event() {
            if !std::mem::replace(&mut counted, true) {
                metrics.count(&attached.engine, totals);
            }
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
                EngineEvent::StripeDone { origin, token, ok } => {
                    if let Some((io, qpn)) = origins.get(&origin) {
                        io.submit(Command::StripeDone {
                            qpn: *qpn,
                            token,
                            ok,
                        });
                    }
                }
                EngineEvent::Failed(crate::rdma::engine::EngineError::Unused) => {
                    attached.alive.store(false, Ordering::Release);
                }
                EngineEvent::Failed(err) => {
                    attached.alive.store(false, Ordering::Release);
                    metrics::counter!("tessera_rdma_engine_failures_total").increment(1);
                    if matches!(err, crate::rdma::engine::EngineError::PeerDead(_)) {
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
                    // error and quiet: no write can land in them any more.
                    // Without such messages the error goes at once (a peer
                    // frozen in the middle of a copy does not hold it up).
                    if let Err(err) = attached.qp.fail() {
                        tracing::warn!(peer = %attached.peer, %err, "moving the queue pair to error failed");
                    }
                    let held = attached.engine.take_held();
                    if !held.is_empty() {
                        attached.qp.quiesce();
                    }
                    // Its QP in error: chunks of other engines it did not
                    // write go back to be written by their own, and its
                    // own chunks on other rails are no longer wanted.
                    for (origin, token) in attached.engine.take_abandoned_stripes() {
                        if let Some((io, qpn)) = origins.get(&origin) {
                            io.submit(Command::StripeDone {
                                qpn: *qpn,
                                token,
                                ok: false,
                            });
                        }
                    }
                    for partner in partners.iter() {
                        partner.io.submit(Command::StripeCancel {
                            qpn: partner.qpn,
                            origin: *origin,
                        });
                    }
                    for held in held {
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
    /// It goes on the ready list, to run in this round.
    fn with_engine<R>(&mut self, qpn: u32, f: impl FnOnce(&mut EngineSlot) -> R) -> Option<R> {
        let io = self.self_handle.as_ref().and_then(WeakIoThread::upgrade);
        let slot = self.engines.get_mut(&qpn).filter(|s| !s.panicked)?;
        let result = isolated(slot, io.as_ref(), f);
        mark(&mut self.engines, &mut self.ready, qpn);
        result
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
                    ready: false,
                    deadline: None,
                    origin: NEXT_ORIGIN.fetch_add(1, Ordering::Relaxed),
                    partners: Vec::new(),
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
                mark(&mut self.engines, &mut self.ready, qpn);
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
            Command::Partners { qpn, partners } => {
                self.with_engine(qpn, |slot| {
                    let rails = partners.iter().map(|p| p.rail).collect();
                    slot.partners = partners;
                    slot.attached.engine.set_stripe_rails(rails);
                });
            }
            Command::StripeWrites {
                qpn,
                origin,
                token,
                chunk,
                reply,
            } => {
                let answer = reply.clone();
                self.origins.insert(origin, reply);
                let taken = self.with_engine(qpn, |slot| {
                    slot.attached
                        .engine
                        .handle_stripe_writes(origin, token, chunk);
                });
                if taken.is_none() {
                    answer.0.submit(Command::StripeDone {
                        qpn: answer.1,
                        token,
                        ok: false,
                    });
                }
            }
            Command::StripeDone { qpn, token, ok } => {
                self.with_engine(qpn, |slot| {
                    slot.attached.engine.handle_stripe_done(token, ok);
                });
            }
            Command::StripeCancel { qpn, origin } => {
                self.origins.remove(&origin);
                self.with_engine(qpn, |slot| slot.attached.engine.cancel_stripes(origin));
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
                        for (qpn, slot) in self.engines.iter_mut().filter(|(_, s)| !s.panicked) {
                            isolated(slot, io.as_ref(), |slot| {
                                slot.attached.engine.handle_device_event(event)
                            });
                            slot.list(*qpn, &mut self.ready);
                        }
                    }
                    _ => {}
                }
            }
        }
    }
}
