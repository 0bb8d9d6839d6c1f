//! Driving one engine in a round of its worker (`worker.rs`): post the
//! receives and the batch of sends it has, hand the chunks it delegates to
//! its partners on other rails, handle its events (messages for the
//! sockets, sockets opened and refused, stripes done, the engine's
//! failure), deliver what the applications can take, and close an engine
//! no socket uses any more.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::Instant;

use tokio::sync::oneshot;

use super::late::Routes;
use super::metrics::IoStats;
use super::slot::{EngineSlot, deliver_backlog, fail_sockets, to_backlog};
use super::{Attached, BACKLOG_LIMIT, Command, IoThread, Partner, SocketSlot, new_socket};
use crate::rdma::engine::{EngineError, EngineEvent, SocketId};
use crate::{Connection, TransportError};

type Sockets = HashMap<SocketId, SocketSlot>;
type Opening = HashMap<SocketId, oneshot::Sender<Result<Connection, TransportError>>>;

/// Posts what the engine of `slot` (queue pair `qpn`) has, and hands its
/// events on, at `now`. Returns whether anything happened.
pub(super) fn drive(
    qpn: u32,
    slot: &mut EngineSlot,
    io: Option<&IoThread>,
    totals: &IoStats,
    panic_on_len: Option<usize>,
    origins: &mut Routes,
    now: Instant,
) -> bool {
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
    let mut progress = post(attached, backlog, now);
    progress |= delegate(qpn, attached, partners, *origin, io);
    let mut driving = Driving {
        qpn,
        attached,
        sockets,
        opening,
        partners,
        origin: *origin,
        io,
        origins,
    };
    // Counted before they are handed on: a message the application has is
    // in the transport's counters (were they counted only every 100 ms of
    // work, a test reading them after its last echo could find one missing).
    let mut counted = false;
    while let Some(event) = driving.attached.engine.poll_event() {
        if !std::mem::replace(&mut counted, true) {
            metrics.count(&driving.attached.engine, totals);
        }
        progress = true;
        driving.handle_event(event, panic_on_len);
    }
    // Deliver what the applications can take.
    for s in driving.sockets.values_mut() {
        if deliver_backlog(s) {
            progress = true;
        }
    }
    driving
        .sockets
        .retain(|_, s| !(s.tx_closed && s.deliver.is_none()));
    let attached = driving.attached;
    if attached.close_when_unused
        && *had_socket
        && driving.sockets.is_empty()
        && driving.opening.is_empty()
        && !attached.engine.is_failed()
        && attached.engine.is_idle()
    {
        attached.engine.handle_unused();
        progress = true;
    }
    progress
}

/// Posts the receives the engine wants (unless its sockets hold
/// `backlog` messages already, at the limit) and one batch of sends: the
/// completions, the answers to what was sent, are polled between batches.
fn post(attached: &mut Attached, backlog: usize, now: Instant) -> bool {
    let mut progress = false;
    if backlog < BACKLOG_LIMIT
        && let Some(wrs) = attached.engine.poll_recv_post()
    {
        progress = true;
        if let Err(err) = attached.qp.post_recv(&wrs) {
            post_failed(attached, err);
        }
    }
    if let Some(batch) = attached.engine.poll_transmit(now) {
        progress = true;
        if let Err(err) = attached.qp.post_send(&batch) {
            post_failed(attached, err);
        }
    }
    progress
}

/// Hands the chunks for the other rails' engines (`stripes.rs`) to their
/// workers; one whose engine is gone comes back at once, to be written
/// here.
fn delegate(
    qpn: u32,
    attached: &mut Attached,
    partners: &[Partner],
    origin: u64,
    io: Option<&IoThread>,
) -> bool {
    let mut progress = false;
    while let Some(delegation) = attached.engine.poll_delegation() {
        progress = true;
        let partner = partners
            .iter()
            .find(|p| p.rail == delegation.rail && p.is_alive());
        let handed = match (partner, io) {
            (Some(partner), Some(io)) => partner.io.submit(Command::StripeWrites {
                qpn: partner.qpn,
                origin,
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
    progress
}

/// A post of `attached`'s QP failed: the QP goes to ERROR (what was posted
/// is flushed back) and the engine fails, failing its sockets, rather than
/// wait for ever for completions of work requests that were never posted.
fn post_failed(attached: &mut Attached, err: crate::verbs::VerbsError) {
    tracing::warn!(peer = %attached.peer, %err, "rdma post failed: the connection fails");
    metrics::counter!("tessera_rdma_post_failures_total").increment(1);
    if let Err(modify) = attached.qp.fail() {
        tracing::warn!(peer = %attached.peer, err = %modify, "moving the queue pair to error failed");
    }
    attached.engine.handle_post_error(err);
}

/// The parts of an engine's slot its events change.
struct Driving<'a> {
    qpn: u32,
    attached: &'a mut Attached,
    sockets: &'a mut Sockets,
    opening: &'a mut Opening,
    partners: &'a [Partner],
    origin: u64,
    io: Option<&'a IoThread>,
    origins: &'a mut Routes,
}

impl Driving<'_> {
    fn handle_event(&mut self, event: EngineEvent, panic_on_len: Option<usize>) {
        let attached = &mut *self.attached;
        match event {
            EngineEvent::Message { socket, bytes } => {
                // The drill knob: what a bug in the engine would do.
                if panic_on_len == Some(bytes.len()) {
                    panic!(
                        "injected panic: soft_faults.panic_on_message_len = {}",
                        bytes.len()
                    );
                }
                to_backlog(self.sockets, EngineEvent::Message { socket, bytes });
            }
            EngineEvent::Sent(socket) => {
                if let Some(s) = self.sockets.get(&socket) {
                    s.permits.add_permits(1);
                }
            }
            EngineEvent::Opened(socket) => {
                let accepted = match (self.io, &attached.accepts) {
                    (Some(io), Some(accepts)) => {
                        let connection = new_socket(io, self.qpn, socket, attached, self.sockets);
                        accepts.try_send(connection).is_ok()
                    }
                    _ => false,
                };
                if accepted {
                    attached.engine.accept_socket(socket);
                } else {
                    tracing::debug!(peer = %attached.peer, "no listener takes the socket: refused");
                    self.sockets.remove(&socket);
                    attached.engine.refuse_socket(socket);
                }
            }
            EngineEvent::Accepted(socket) => {
                if let (Some(reply), Some(io)) = (self.opening.remove(&socket), self.io) {
                    let connection = new_socket(io, self.qpn, socket, attached, self.sockets);
                    // A caller that gave up drops the connection, which
                    // closes the socket again.
                    let _ = reply.send(Ok(connection));
                }
            }
            EngineEvent::Refused(socket) => {
                if let Some(reply) = self.opening.remove(&socket) {
                    let _ = reply.send(Err(TransportError::Connect {
                        addr: attached.peer.to_string(),
                        source: std::io::Error::new(
                            std::io::ErrorKind::ConnectionRefused,
                            "the peer has no listener for new connections",
                        ),
                    }));
                }
            }
            EngineEvent::Closed(socket) => to_backlog(self.sockets, EngineEvent::Closed(socket)),
            EngineEvent::StripeDone { origin, token, ok } => {
                self.origins.answer(origin, token, ok);
            }
            EngineEvent::Failed(EngineError::Unused) => {
                // Not alive once its QP takes no more writes (`late.rs`);
                // the QP is destroyed with the slot, next.
                if let Err(err) = attached.qp.fail() {
                    tracing::warn!(peer = %attached.peer, %err, "moving the queue pair to error failed");
                }
                if !self.partners.is_empty() {
                    attached.qp.quiesce();
                }
                attached.alive.store(false, Ordering::Release);
            }
            EngineEvent::Failed(err) => self.failed(&err),
        }
    }

    /// The engine failed: counted and said, its queue pair to error, the
    /// messages it held handed on, its partners told, its sockets failed.
    fn failed(&mut self, err: &EngineError) {
        let attached = &mut *self.attached;
        metrics::counter!("tessera_rdma_engine_failures_total").increment(1);
        if matches!(err, EngineError::PeerDead(_)) {
            tracing::warn!(peer = %attached.peer, %err, "rdma peer declared dead");
            metrics::counter!("tessera_rdma_keepalive_failures_total").increment(1);
            if let Some(io) = self.io {
                io.stats.keepalive_failures.fetch_add(1, Ordering::Relaxed);
            }
        }
        if let Some(io) = self.io {
            io.stats.engines_failed.fetch_add(1, Ordering::Relaxed);
        }
        if matches!(err, EngineError::GrantTimeout { .. }) {
            // The peer's doing: said once per peer per interval.
            metrics::counter!("tessera_rdma_grant_timeouts_total").increment(1);
            if let Some(suppressed) = crate::warn_limit::allow(attached.peer.ip()) {
                tracing::warn!(peer = %attached.peer, %err, suppressed, "rdma peer left its grants unwritten: the connection fails");
            }
        }
        tracing::debug!(peer = %attached.peer, %err, "rdma engine failed");
        // Messages that arrived whole but wait for their window's
        // invalidation go first, once the QP is in error and quiet: no
        // write can land in them any more.
        if let Err(err) = attached.qp.fail() {
            tracing::warn!(peer = %attached.peer, %err, "moving the queue pair to error failed");
        }
        let held = attached.engine.take_held();
        // Quiet first where a write could still be landing in what it
        // hands on (a held message) or in a partner's grants (`late.rs`);
        // without either the error goes at once (a peer frozen in the
        // middle of a copy does not hold it up).
        if !held.is_empty() || !self.partners.is_empty() {
            attached.qp.quiesce();
        }
        // Not alive only now: a partner's buffers held for late writes
        // through this QP wait for it (`late.rs`).
        attached.alive.store(false, Ordering::Release);
        // Chunks of other engines it did not write are answered by the
        // engine as its QP's flushes come back, or when the QP is
        // destroyed (`settle_stripes`); its own chunks on other rails are
        // no longer wanted.
        for partner in self.partners {
            partner.io.submit(Command::StripeCancel {
                qpn: partner.qpn,
                origin: self.origin,
            });
        }
        for held in held {
            to_backlog(self.sockets, held);
        }
        fail_sockets(self.opening, self.sockets, err);
    }
}
