//! A driver's worker: the engines of one completion queue, and the round
//! that moves them (commands, completions, timers, posts, deliveries).
//! The drivers (`thread.rs`, `runtime.rs`) decide when rounds run and how
//! an idle worker sleeps.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use super::late::{LateWrites, Routes};
use super::metrics::{EngineMetrics, IoStats};
use super::slot::{EngineSlot, NEXT_ORIGIN, deliver_backlog, isolated, mark};
use super::{BACKLOG_LIMIT, Command, ORPHAN_LIMIT, SharedReceives, WeakIoThread};
use crate::TransportError;
use crate::verbs::{CompletionQueue, WorkCompletion};

// What the tests name through `super::*`, unused here since `drive.rs`
// took the engines' events.
#[cfg(test)]
use super::{Attached, IoThread};

#[cfg(test)]
mod model;
#[cfg(test)]
mod testkit;
#[cfg(test)]
mod tests;

/// A worker's clock for what its engines decide by time (timers, grants,
/// the window): the real one, or in tests one moved by hand
/// (`worker/model.rs`), so that a timer fires at the step a test picks.
#[derive(Clone, Copy, Default)]
pub(super) struct Clock {
    #[cfg(test)]
    fixed: Option<Instant>,
}

impl Clock {
    fn now(self) -> Instant {
        #[cfg(test)]
        if let Some(now) = self.fixed {
            return now;
        }
        Instant::now()
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
    origins: Routes,
    /// Buffers of failed engines held until late writes cannot land
    /// (`late.rs`).
    late: LateWrites,
    clock: Clock,
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
            origins: Routes::default(),
            late: LateWrites::default(),
            clock: Clock::default(),
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
        let mut progress = self.take_commands()?;
        // Completions, dispatched by QP number.
        let now = self.clock.now();
        progress |= self.poll_completions(now);
        self.repost_shared();
        progress |= self.fire_timers(now);
        let (worked, removed) = self.visit_ready();
        progress |= worked;
        self.metrics_stale |= progress;
        // Updated at least every METRICS_INTERVAL while busy, and once more
        // as the worker goes idle (an idle worker's counts would otherwise
        // wait for its next timer; with keepalive off, for ever). Messages
        // are counted before delivery besides (`drive.rs`).
        if removed
            || self.engines.len() as u64 != self.stats.qps_open.load(Ordering::Relaxed)
            || now.saturating_duration_since(self.last_metrics) >= METRICS_INTERVAL
            || (self.metrics_stale && !progress)
        {
            self.update_metrics();
        }
        Some(progress)
    }

    /// Handles the queued commands: whether there were any, or `None` once
    /// no transport and no sender refers to this worker.
    fn take_commands(&mut self) -> Option<bool> {
        let mut progress = false;
        loop {
            match self.queue.try_recv() {
                Ok(command) => {
                    progress = true;
                    self.handle_command(command);
                }
                Err(mpsc::error::TryRecvError::Empty) => return Some(progress),
                Err(mpsc::error::TryRecvError::Disconnected) => return None,
            }
        }
    }

    /// Reposts the shared receive queue's buffers, unless the applications
    /// are behind: senders then meet receiver-not-ready and retry (the
    /// shared queue's backpressure, as credits are a dedicated one's). An
    /// engine holding messages is always on the ready list, so the list
    /// gives the whole backlog.
    fn repost_shared(&mut self) {
        let Some(shared) = &mut self.shared else {
            return;
        };
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
            // Said at most once a second: a queue that keeps failing would
            // say it every round.
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

    /// Runs the timers of the engines whose deadline has come; whether the
    /// earliest had. A deadline that moved later since brings a harmless
    /// early look (engines check their own deadlines); the next one is the
    /// earliest of the rest, and of those that run this round once they
    /// have.
    fn fire_timers(&mut self, now: Instant) -> bool {
        if self.next_timer.is_none_or(|at| now < at) {
            return false;
        }
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
        true
    }

    /// Drives each engine on the ready list (`drive.rs`) and removes the
    /// failed ones once their sockets have their error. Returns whether
    /// any did something, and whether any was removed.
    fn visit_ready(&mut self) -> (bool, bool) {
        let mut progress = false;
        let io = self.self_handle.as_ref().and_then(WeakIoThread::upgrade);
        let panic_on_len = self.panic_on_len;
        let totals = Arc::clone(&self.stats);
        let origins = &mut self.origins;
        let clock = self.clock;
        self.late.release();
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
                    super::drive::drive(qpn, slot, io, &totals, panic_on_len, origins, clock.now())
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
                }
                // What outlives the engine, a panicked one's too (its state
                // is what the panic left; taking it out cannot make it
                // worse, and a second panic here leaves it all with it):
                // its grants whose keys on other rails were told, and the
                // chunks of other engines it did not answer (issue 57,
                // holes 6 and 7: before, a panicked engine freed the first
                // at once and never answered the second, so their origins
                // waited for ever).
                let engine = &mut slot.attached.engine;
                let (exposed, abandoned) =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        (engine.take_exposed(), engine.take_abandoned_stripes())
                    }))
                    .unwrap_or_default();
                let guards = slot.partners.iter().map(|p| Arc::clone(&p.alive)).collect();
                metrics::gauge!("tessera_rdma_qps_open").decrement(1.0);
                // The queue pair is destroyed with the slot: no write of it
                // can be carried out any more, so the chunks it did not
                // answer may be written again by their origins.
                drop(self.engines.remove(&qpn));
                for (origin, token) in abandoned {
                    origins.answer(origin, token, false);
                }
                self.late.hold(exposed, guards);
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
        (progress, removed)
    }

    /// Arms the completion queue for sleeping and looks once more; true if
    /// there is work after all (the caller runs another round instead of
    /// sleeping). A completion or a command that comes after this wakes
    /// the sleeper ([`CompletionQueue::wake`]).
    pub(super) fn arm(&mut self) -> bool {
        self.cq.arm();
        !self.queue.is_empty() || self.poll_completions(self.clock.now())
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
                    Some(buf) => engine.handle_shared_receive(completion, buf, now),
                    None => tracing::warn!(
                        wr_id = completion.wr_id,
                        "completion for an unknown shared receive"
                    ),
                }
            }
            _ => engine.handle_completion(completion, now),
        }
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
                let now = self.clock.now();
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
                let now = self.clock.now();
                self.with_engine(qpn, |slot| slot.attached.engine.peer_ready(info, now));
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
                self.origins.handed_in(origin, reply);
                let taken = self.with_engine(qpn, |slot| {
                    slot.attached
                        .engine
                        .handle_stripe_writes(origin, token, chunk);
                });
                if taken.is_none() {
                    self.origins.answer(origin, token, false);
                }
            }
            Command::StripeDone { qpn, token, ok } => {
                self.with_engine(qpn, |slot| {
                    slot.attached.engine.handle_stripe_done(token, ok);
                });
            }
            Command::StripeCancel { qpn, origin } => {
                self.origins.cancel(origin);
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
