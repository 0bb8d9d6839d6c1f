//! One accepted connection's requests, each through the same steps:
//! read ([`Serving::next`], which also runs the graceful drain on stop),
//! decode ([`Serving::decode`]), admit or refuse ([`Serving::admit`]), run
//! and answer ([`Serving::dispatch`], inline or in a task of its own); and
//! the connection's end ([`Serving::finish`]).
//!
//! On stop the connection keeps reading: requests already in flight
//! finish and are answered; new ones are answered `Unavailable` at once
//! (never applied: safe to retry elsewhere), and every answer says the
//! server is going away. It closes once nothing is in flight (or the grace
//! period is over), so no caller waits for a deadline on a connection that
//! looks usable.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::task::Poll;
use std::time::Instant;

use bytes::Bytes;
use futures::FutureExt;
use tessera_transport::pool::Pool;
use tessera_transport::warn_limit;
use tessera_transport::{
    Connection, Message, MessageReceiver, MessageSender, PeerIdentity, TransportError,
};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{DRAIN_QUIET, MethodMetrics, Route, truncate_error_message};
use crate::wire::{Kind, RpcHeader};
use crate::{Code, RequestContext, Status};

/// What the server shares with every connection's task.
pub(super) struct Shared {
    pub(super) routes: Arc<HashMap<u32, Route>>,
    pub(super) send_pool: Pool,
    pub(super) max_requests: usize,
    /// A graceful stop: drain, then close.
    pub(super) stop: CancellationToken,
    /// The grace period is over: drop everything.
    pub(super) abort: CancellationToken,
    /// The server's tasks, which its stop waits for.
    pub(super) tracker: TaskTracker,
}

/// Serves `connection` until the peer closes it, it breaks, or the server
/// stops (module docs).
pub(super) async fn serve(connection: Connection, shared: Shared) {
    let peer = connection.peer_addr();
    let identity = connection.peer_identity().cloned();
    let Connection {
        sender,
        mut receiver,
        ..
    } = connection;
    let mut serving = Serving {
        shared,
        peer,
        identity,
        sender,
        inflight: TaskTracker::new(),
        draining: false,
        quiet_until: tokio::time::Instant::now(),
        drained: false,
    };
    loop {
        let message = match serving.next(&mut receiver).await {
            Next::Message(message) => message,
            Next::Again => continue,
            Next::Close => break,
        };
        let Some((header, body)) = serving.decode(&message) else {
            break;
        };
        let received = Instant::now();
        let route = match serving.admit(&header) {
            Ok(route) => route,
            Err(refusal) => {
                serving
                    .answer(&header, &refusal.metrics, Err(refusal.status), received)
                    .await;
                continue;
            }
        };
        if serving
            .dispatch(route, header, body, received, receiver.has_ready())
            .await
            .is_err()
        {
            break;
        }
    }
    serving.finish().await;
}

/// One connection's state while it is served.
struct Serving {
    shared: Shared,
    peer: SocketAddr,
    identity: Option<Arc<PeerIdentity>>,
    sender: MessageSender,
    /// The requests running in tasks of their own.
    inflight: TaskTracker,
    /// The server is stopping: requests are refused, answers say so.
    draining: bool,
    /// While draining: close once nothing is in flight and no request came
    /// for `DRAIN_QUIET` (a client that saw the going-away flag sends no
    /// more; requests already on their way are still answered).
    quiet_until: tokio::time::Instant,
    /// Every request read here was answered and no more are read, which
    /// the last message says (`FLAG_DRAINED`).
    drained: bool,
}

/// What [`Serving::next`] found.
enum Next {
    /// A request's bytes.
    Message(Bytes),
    /// Nothing to serve yet (the drain moved on): look again.
    Again,
    /// The connection is done.
    Close,
}

/// A request refused unrun, and the metrics label it is counted under.
struct Refusal {
    metrics: MethodMetrics,
    status: Status,
}

/// The connection's send queue stayed full until the grace period ended.
struct Aborted;

impl Serving {
    /// The next request's bytes, moving the drain on as the server stops.
    async fn next(&mut self, receiver: &mut MessageReceiver) -> Next {
        let idle = self.inflight.is_empty();
        let message = tokio::select! {
            biased;
            () = self.shared.abort.cancelled() => return Next::Close,
            () = self.shared.stop.cancelled(), if !self.draining => {
                self.draining = true;
                self.inflight.close();
                self.quiet_until = tokio::time::Instant::now() + DRAIN_QUIET;
                return Next::Again;
            }
            () = self.inflight.wait(), if self.draining && !idle => return Next::Again,
            () = tokio::time::sleep_until(self.quiet_until), if self.draining && idle => {
                self.drained = true;
                return Next::Close;
            }
            message = receiver.recv() => message,
        };
        if self.draining {
            self.quiet_until = tokio::time::Instant::now() + DRAIN_QUIET;
        }
        match message {
            Ok(Some(message)) => Next::Message(message),
            Ok(None) => Next::Close,
            Err(err) => {
                self.read_failed(&err);
                Next::Close
            }
        }
    }

    /// What the peer sent broke the framing or a limit: counted, and
    /// warned about at a rate a flood cannot raise.
    fn read_failed(&self, err: &TransportError) {
        let peer = self.peer;
        let malformed = matches!(
            err,
            TransportError::MessageTooLarge { .. } | TransportError::Stalled(_)
        );
        if malformed {
            if matches!(err, TransportError::MessageTooLarge { .. }) {
                metrics::counter!(warn_limit::MALFORMED, "listener" => "tcp").increment(1);
            }
            if let Some(suppressed) = warn_limit::allow(peer.ip()) {
                tracing::warn!(%peer, %err, suppressed, "closing the connection");
            }
        } else {
            tracing::debug!(%peer, %err, "closing connection after a transport error");
        }
    }

    /// The request's header and body; `None` (close the connection) when
    /// the peer does not speak this protocol.
    fn decode(&self, message: &Bytes) -> Option<(RpcHeader, Bytes)> {
        let peer = self.peer;
        match RpcHeader::decode(message) {
            Ok((header, body)) if header.kind == Kind::Request => Some((header, body)),
            Ok(_) => {
                metrics::counter!(crate::observe::SERVER_PROTOCOL_ERRORS).increment(1);
                if let Some(suppressed) = warn_limit::allow(peer.ip()) {
                    tracing::warn!(%peer, suppressed, "client sent a response; closing the connection");
                }
                None
            }
            Err(err) => {
                // The frame arrived whole but its header is garbage: the
                // peer does not speak this protocol. Closing is the only
                // safe answer, since its request id cannot be trusted.
                metrics::counter!(crate::observe::SERVER_PROTOCOL_ERRORS).increment(1);
                metrics::counter!(warn_limit::MALFORMED, "listener" => "rpc").increment(1);
                if let Some(suppressed) = warn_limit::allow(peer.ip()) {
                    tracing::warn!(%peer, %err, suppressed, "malformed request header; closing the connection");
                }
                None
            }
        }
    }

    /// The request's route, or why it is refused unrun: the server is
    /// stopping, no such method, a caller without the service's role, or
    /// one over its connection's requests in flight.
    fn admit(&self, header: &RpcHeader) -> Result<Route, Refusal> {
        if self.draining {
            metrics::counter!(crate::observe::SERVER_REFUSED_DRAINING).increment(1);
            return Err(Refusal {
                metrics: MethodMetrics::unrouted("draining"),
                status: Status::unavailable("the server is shutting down; retry elsewhere"),
            });
        }
        // A method id of another service than the one the caller named
        // (ids are hashes; two services may share one) is not routed.
        let Some(route) = self
            .shared
            .routes
            .get(&header.method)
            .filter(|route| header.service == 0 || header.service == route.method.service)
            .cloned()
        else {
            return Err(Refusal {
                metrics: MethodMetrics::unrouted("unknown"),
                status: Status::unimplemented(format!(
                    "no method with id {:#010x} in the service tagged {:#06x}",
                    header.method, header.service
                )),
            });
        };
        let status = match &route.role {
            Some(role) if !self.identity.as_ref().is_some_and(|id| id.has_role(role)) => {
                metrics::counter!(crate::observe::SERVER_REFUSED_ROLE, "method" => route.method.path)
                    .increment(1);
                if let Some(suppressed) = warn_limit::allow(self.peer.ip()) {
                    tracing::warn!(
                        peer = %self.peer,
                        method = route.method.path,
                        subject = self.identity.as_ref().map(|id| id.subject()),
                        role = &**role,
                        suppressed,
                        "refused a call from a peer without the role"
                    );
                }
                Status::permission_denied(format!(
                    "{} needs a certificate with the role `{role}` (urn:tessera:role:{role})",
                    route.method.path
                ))
            }
            _ if self.inflight.len() >= self.shared.max_requests => {
                metrics::counter!(crate::observe::SERVER_REFUSED_CONCURRENCY, "method" => route.method.path)
                    .increment(1);
                Status::resource_exhausted(format!(
                    "{} requests are in flight on this connection \
                     (max_requests_per_connection); wait for answers before sending more",
                    self.shared.max_requests
                ))
            }
            _ => return Ok(route),
        };
        Err(Refusal {
            metrics: route.metrics,
            status,
        })
    }

    /// Runs the request and answers it. A lone request (`burst`: another
    /// is already here) runs here at once: most handlers (a Fetch, a Push,
    /// Health) finish without waiting, and then the request costs no task,
    /// no timer and no wake-up. A request of a burst, or one whose handler
    /// waits, gets a task of its own, so that the connection's requests
    /// run in parallel and this connection goes on reading. A request
    /// whose deadline has passed is dropped unanswered.
    async fn dispatch(
        &self,
        route: Route,
        header: RpcHeader,
        body: Bytes,
        received: Instant,
        burst: bool,
    ) -> Result<(), Aborted> {
        let context = RequestContext {
            method: route.method.path,
            request_id: header.request_id,
            deadline: header.deadline().map(|remaining| received + remaining),
            peer: self.peer,
            send_pool: self.shared.send_pool.clone(),
            peer_identity: self.identity.clone(),
        };
        let deadline = context.deadline;
        // Expired before dispatch (queued behind other work, or sent with
        // almost nothing left): the caller has given up; running it could
        // apply a Push the caller was told failed.
        if deadline.is_some_and(|d| d <= Instant::now()) {
            metrics::counter!(crate::observe::SERVER_DEADLINE_DROPPED, "method" => route.method.path)
                .increment(1);
            return Ok(());
        }
        let path = route.method.path;
        let mut call =
            AssertUnwindSafe(route.service.call(header.method, context, body)).catch_unwind();
        if !burst && let Poll::Ready(outcome) = futures::poll!(&mut call) {
            let answer = self.answer(
                &header,
                &route.metrics,
                outcome.unwrap_or_else(|_| panicked(path)),
                received,
            );
            tokio::pin!(answer);
            // Sent at once unless the connection's send queue is full; a
            // peer that stops reading must not keep an aborted server's
            // connection task waiting here.
            if futures::poll!(&mut answer).is_pending() {
                tokio::select! {
                    () = self.shared.abort.cancelled() => return Err(Aborted),
                    () = &mut answer => {}
                }
            }
            return Ok(());
        }
        let sender = self.sender.clone();
        let send_pool = self.shared.send_pool.clone();
        let abort = self.shared.abort.clone();
        let stop = self.shared.stop.clone();
        let labels = route.metrics;
        self.shared
            .tracker
            .spawn(self.inflight.track_future(async move {
                let bounded = async {
                    match deadline {
                        Some(deadline) => tokio::time::timeout_at(deadline.into(), call).await.ok(),
                        None => Some(call.await),
                    }
                };
                let outcome = tokio::select! {
                    () = abort.cancelled() => return,
                    outcome = bounded => outcome,
                };
                let Some(outcome) = outcome else {
                    metrics::counter!(crate::observe::SERVER_DEADLINE_DROPPED, "method" => path)
                        .increment(1);
                    return;
                };
                respond(
                    &sender,
                    &send_pool,
                    &header,
                    &labels,
                    outcome.unwrap_or_else(|_| panicked(path)),
                    received,
                    stop.is_cancelled(),
                )
                .await;
            }));
        Ok(())
    }

    /// Answers `header`'s request from this connection's task; the answer
    /// says the server is going away once it stops.
    async fn answer(
        &self,
        header: &RpcHeader,
        labels: &MethodMetrics,
        result: Result<Message, Status>,
        received: Instant,
    ) {
        respond(
            &self.sender,
            &self.shared.send_pool,
            header,
            labels,
            result,
            received,
            self.draining || self.shared.stop.is_cancelled(),
        )
        .await;
    }

    /// Ends the connection: tells a drained peer so, and waits for the
    /// last answers to leave.
    async fn finish(self) {
        let peer = self.peer;
        // Every answer was handed to the sender before this (the handlers
        // are done, refusals were sent inline), and a connection delivers
        // in order: a request the client still waits on after this
        // message was never read. Not sent when the grace period ran out
        // (handlers were dropped, perhaps after applying their request).
        if self.drained && !self.shared.abort.is_cancelled() {
            match self
                .shared
                .send_pool
                .alloc_copy(&RpcHeader::drained().encode())
            {
                Ok(buf) => {
                    if let Err(err) = self.sender.send(Message::from(buf.freeze())).await {
                        tracing::debug!(%peer, %err, "drained notice not sent; connection closed");
                    }
                }
                Err(err) => tracing::warn!(%err, "no send-pool memory for a drained notice"),
            }
        }
        // A graceful stop is done with this connection once its answers
        // have left, not once they were handed to the transport (an RDMA
        // engine posts them later): what a process does after its server
        // stopped (exiting, or freeing a large store, whose allocator work
        // held up a stopping ps-server's last answers for 25-150 ms)
        // cannot delay or lose them. Bounded by the grace period like the
        // requests.
        if self.draining {
            tokio::select! {
                () = self.shared.abort.cancelled() => {}
                () = self.sender.flushed() => {}
            }
        }
    }
}

/// The answer to a request whose handler panicked.
fn panicked(method: &'static str) -> Result<Message, Status> {
    tracing::error!(method, "handler panicked");
    Err(Status::internal("handler panicked"))
}

/// Sends the answer to `request`; `going_away` marks it
/// [`crate::wire::FLAG_GOING_AWAY`] (the server is shutting down).
async fn respond(
    sender: &MessageSender,
    send_pool: &Pool,
    request: &RpcHeader,
    labels: &MethodMetrics,
    result: Result<Message, Status>,
    received: Instant,
    going_away: bool,
) {
    let method = labels.path;
    let (code, flags, body) = match result {
        Ok(body) => (Code::Ok, 0, body),
        Err(status) => {
            let text = truncate_error_message(status.message());
            let (flags, body) = crate::wire::encode_status_body(&text, status.details());
            (status.code(), flags, Message::from(body))
        }
    };
    labels.record(code, received.elapsed());
    let mut header = RpcHeader::response(request, code.as_u16());
    header.flags = flags;
    if going_away {
        header.flags |= crate::wire::FLAG_GOING_AWAY;
    }
    let header = match send_pool.alloc_copy(&header.encode()) {
        Ok(buf) => buf.freeze(),
        Err(err) => {
            // Without memory for 24 bytes there is nothing to answer with;
            // the caller's deadline will report the failure.
            tracing::warn!(%err, method, "no send-pool memory for a response header");
            return;
        }
    };
    let message = Message::from_parts(std::iter::once(header).chain(body.parts().iter().cloned()));
    match sender.send(message).await {
        Ok(()) => {}
        Err(TransportError::MessageTooLarge { len, max }) => {
            // The caller must hear it now, not at its deadline, and as
            // final: a retry elsewhere would get the same answer.
            metrics::counter!(crate::observe::SERVER_OVERSIZED_RESPONSES, "method" => method)
                .increment(1);
            tracing::debug!(
                method,
                len,
                max,
                "response over max_message_size; answering ResourceExhausted"
            );
            let status = Status::resource_exhausted(format!(
                "the response of {len} bytes exceeds max_message_size ({max})"
            ));
            Box::pin(respond(
                sender,
                send_pool,
                request,
                labels,
                Err(status),
                received,
                going_away,
            ))
            .await;
        }
        Err(err) => tracing::debug!(%err, method, "response not sent; connection closed"),
    }
}
