//! The server side: routes requests to generated service dispatchers.
//!
//! Each connection gets a task that reads requests. A lone request runs in
//! that task at once and is answered from it when its handler finishes
//! without waiting (the common case: no task, timer or wake-up per call);
//! a request of a burst, or one whose handler waits, runs in a task of its
//! own, so many requests of one connection are served concurrently and
//! answered in completion order (the client matches them by request id).
//! A request whose deadline has passed is dropped unanswered: the caller has
//! stopped waiting for it.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::FutureExt;
use futures::future::BoxFuture;
use tessera_config::Validate;
use tessera_transport::pool::Pool;
use tessera_transport::warn_limit;
use tessera_transport::{Connection, Listener, Message, MessageSender, Transport, TransportError};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::wire::{Kind, RpcHeader};
use crate::{
    Code, MethodDescriptor, RequestContext, ServerConfig, ServerError, ServiceDescriptor, Status,
};

/// Longest error message sent back to a caller; longer ones are cut.
const MAX_ERROR_MESSAGE: usize = 4096;

/// How long a stopping server's connection must be quiet (nothing in
/// flight, no request) before it closes: time for the client to see the
/// going-away flag on an answer and stop sending there. 100 ms: many
/// round trips on any network a parameter server runs on.
const DRAIN_QUIET: Duration = Duration::from_millis(100);

/// A service a [`Server`] can route to. Implemented by the dispatchers that
/// `tessera-rpc-build` generates (`FooServer<T>`); rarely by hand.
pub trait Service: Send + Sync + 'static {
    /// The service's name and methods.
    fn descriptor(&self) -> &'static ServiceDescriptor;

    /// Decodes `body` as the request of `method_id`, runs the handler and
    /// returns the encoded response.
    fn call(
        &self,
        method_id: u32,
        context: RequestContext,
        body: Bytes,
    ) -> BoxFuture<'static, Result<Message, Status>>;
}

#[derive(Clone)]
struct Route {
    service: Arc<dyn Service>,
    method: &'static MethodDescriptor,
    /// The role a caller's certificate must give (see [`ServerBuilder::require_role`]).
    role: Option<Arc<str>>,
    /// Its label and its handles for answers with code OK.
    metrics: MethodMetrics,
}

/// A method's label in the server's metrics and, for a routed method, the
/// handles of its counter and histogram for answers with code OK, resolved
/// when the service is added: a lookup in a Prometheus registry per answer
/// hashes the name and labels (the rpc benchmark with Prometheus installed
/// lost 4-9% of its throughput to such lookups). Other codes are rare and
/// looked up when they happen. The recorder must therefore be installed
/// before the server is built (as `install_prometheus` is in the binaries).
#[derive(Clone)]
struct MethodMetrics {
    path: &'static str,
    ok: Option<Arc<OkHandles>>,
}

struct OkHandles {
    requests: metrics::Counter,
    duration: metrics::Histogram,
}

impl MethodMetrics {
    fn routed(path: &'static str) -> Self {
        let code = Code::Ok.label();
        Self {
            path,
            ok: Some(Arc::new(OkHandles {
                requests: metrics::counter!(crate::observe::SERVER_REQUESTS, "method" => path, "code" => code),
                duration: metrics::histogram!(crate::observe::SERVER_DURATION, "method" => path, "code" => code),
            })),
        }
    }

    /// A label for answers without a method (`draining`, `unknown`).
    const fn unrouted(path: &'static str) -> Self {
        Self { path, ok: None }
    }

    fn record(&self, code: Code, took: Duration) {
        match (&self.ok, code) {
            (Some(ok), Code::Ok) => {
                ok.requests.increment(1);
                ok.duration.record(took.as_secs_f64());
            }
            _ => {
                let method = self.path;
                metrics::counter!(crate::observe::SERVER_REQUESTS, "method" => method, "code" => code.label())
                    .increment(1);
                metrics::histogram!(crate::observe::SERVER_DURATION, "method" => method, "code" => code.label())
                    .record(took.as_secs_f64());
            }
        }
    }
}

/// Collects services, then binds a [`Server`].
pub struct ServerBuilder {
    config: ServerConfig,
    routes: HashMap<u32, Route>,
    transport: Option<Transport>,
}

impl std::fmt::Debug for ServerBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerBuilder")
            .field("config", &self.config)
            .field("methods", &self.routes.len())
            .finish()
    }
}

impl ServerBuilder {
    /// A builder with `config`.
    pub fn new(config: ServerConfig) -> Self {
        Self {
            config,
            routes: HashMap::new(),
            transport: None,
        }
    }

    /// Serves over a shared `transport` instead of one built from the
    /// configuration (`config.transport` is then not used).
    pub fn transport(mut self, transport: Transport) -> Self {
        self.transport = Some(transport);
        self
    }

    /// Adds a service. Fails if one of its method ids is already taken.
    pub fn add_service<S: Service>(mut self, service: S) -> Result<Self, ServerError> {
        let service: Arc<dyn Service> = Arc::new(service);
        let descriptor = service.descriptor();
        for method in descriptor.methods {
            if let Some(existing) = self.routes.get(&method.id) {
                return Err(ServerError::DuplicateMethod {
                    existing: existing.method.path,
                    new: method.path,
                    id: method.id,
                });
            }
            self.routes.insert(
                method.id,
                Route {
                    service: Arc::clone(&service),
                    method,
                    role: None,
                    metrics: MethodMetrics::routed(method.path),
                },
            );
        }
        Ok(self)
    }

    /// Accepts calls to the methods of `service` (its full name,
    /// `tessera.ps.v1.Admin`) only from peers whose TLS certificate gives
    /// `role` (a `urn:tessera:role:<role>` URI SAN, see
    /// [`tessera_transport::tls`]); others are answered
    /// `PermissionDenied`, their handler never run. Needs TLS on the
    /// transport (else [`bind`](Self::bind) fails: without certificates
    /// nobody could be told apart). Call after adding the service.
    pub fn require_role(mut self, service: &str, role: &str) -> Result<Self, ServerError> {
        let role: Arc<str> = Arc::from(role);
        let mut found = false;
        for route in self.routes.values_mut() {
            if route.service.descriptor().name == service {
                route.role = Some(Arc::clone(&role));
                found = true;
            }
        }
        match found {
            true => Ok(self),
            false => Err(ServerError::UnknownService(service.to_owned())),
        }
    }

    /// Binds `addr` ("host:port"; port 0 picks a free port).
    pub async fn bind(self, addr: &str) -> Result<Server, ServerError> {
        self.config.validate()?;
        let transport = match self.transport {
            Some(transport) => transport,
            None => Transport::new(self.config.transport.clone()).map_err(ServerError::Bind)?,
        };
        if !transport.tls_enabled()
            && let Some(route) = self.routes.values().find(|r| r.role.is_some())
        {
            return Err(ServerError::RoleWithoutTls {
                service: route.service.descriptor().name.to_owned(),
                role: route.role.as_deref().unwrap_or_default().to_owned(),
            });
        }
        let listener = transport.listen(addr).await.map_err(ServerError::Bind)?;
        let local_addr = listener.local_addr().map_err(ServerError::Bind)?;
        Ok(Server {
            routes: Arc::new(self.routes),
            send_pool: transport.send_pool().clone(),
            listener,
            local_addr,
            config: self.config,
        })
    }
}

/// A bound RPC server.
pub struct Server {
    routes: Arc<HashMap<u32, Route>>,
    send_pool: Pool,
    listener: Listener,
    local_addr: SocketAddr,
    config: ServerConfig,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("local_addr", &self.local_addr)
            .field("methods", &self.routes.len())
            .finish()
    }
}

impl Server {
    /// A builder.
    pub fn builder(config: ServerConfig) -> ServerBuilder {
        ServerBuilder::new(config)
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Serves until `shutdown` completes, then shuts down gracefully: stops
    /// accepting connections; on each connection lets in-flight requests
    /// finish and send their responses, answers new ones `Unavailable`
    /// (never applied, so callers retry them elsewhere) and marks every
    /// answer going-away ([`crate::wire::FLAG_GOING_AWAY`]: the client
    /// sends nothing more there); closes each connection once it is quiet,
    /// and every one after `shutdown_grace_ms` at most.
    pub async fn serve_with_shutdown(self, shutdown: impl Future<Output = ()>) {
        let tracker = TaskTracker::new();
        let stop = CancellationToken::new();
        let abort = CancellationToken::new();
        // Dropped without a shutdown (its task aborted, its runtime gone):
        // the connections' tasks end too, instead of serving on with the
        // state of a server that is gone (a peer holding such a connection
        // took its answers for the server's: a restarted replica never
        // heard its primary, whose stream went to the old one's).
        let _connections_end_with_it = abort.clone().drop_guard();
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                accepted = self.listener.accept() => match accepted {
                    Ok(connection) => {
                        metrics::counter!(crate::observe::SERVER_CONNECTIONS).increment(1);
                        tracker.spawn(serve_connection(
                            connection,
                            Arc::clone(&self.routes),
                            self.send_pool.clone(),
                            self.config.max_requests_per_connection,
                            stop.clone(),
                            abort.clone(),
                            tracker.clone(),
                        ));
                    }
                    Err(err) => {
                        // Usually a transient resource shortage (EMFILE):
                        // back off briefly instead of spinning.
                        tracing::warn!(%err, "accept failed");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                },
            }
        }
        drop(self.listener);
        stop.cancel();
        tracker.close();
        let grace = Duration::from_millis(self.config.shutdown_grace_ms);
        if tokio::time::timeout(grace, tracker.wait()).await.is_err() {
            tracing::warn!(
                remaining = tracker.len(),
                "shutdown grace period over; dropping unfinished requests"
            );
            // Handlers drop their work (and their hold on the connections,
            // which then close) as soon as they are next polled.
            abort.cancel();
            tracker.wait().await;
        }
    }
}

async fn serve_connection(
    connection: Connection,
    routes: Arc<HashMap<u32, Route>>,
    send_pool: Pool,
    max_requests: usize,
    stop: CancellationToken,
    abort: CancellationToken,
    tracker: TaskTracker,
) {
    let peer = connection.peer_addr();
    let identity = connection.peer_identity().cloned();
    let Connection {
        sender,
        mut receiver,
        ..
    } = connection;
    // On stop the connection keeps reading: requests already in flight
    // finish and are answered; new ones are answered `Unavailable` at once
    // (never applied: safe to retry elsewhere), and every answer says the
    // server is going away. It closes once nothing is in flight (or the
    // grace period is over), so no caller waits for a deadline on a
    // connection that looks usable.
    let inflight = TaskTracker::new();
    let mut draining = false;
    // While draining: close once nothing is in flight and no request came
    // for `DRAIN_QUIET` (a client that saw the going-away flag sends no
    // more; requests already on their way are still answered).
    let mut quiet_until = tokio::time::Instant::now();
    // Drained: every request read here was answered and no more are read,
    // which the last message says (`FLAG_DRAINED`).
    let mut drained = false;
    loop {
        let idle = inflight.is_empty();
        let message = tokio::select! {
            biased;
            () = abort.cancelled() => break,
            () = stop.cancelled(), if !draining => {
                draining = true;
                inflight.close();
                quiet_until = tokio::time::Instant::now() + DRAIN_QUIET;
                continue;
            }
            () = inflight.wait(), if draining && !idle => continue,
            () = tokio::time::sleep_until(quiet_until), if draining && idle => {
                drained = true;
                break;
            }
            message = receiver.recv() => message,
        };
        if draining {
            quiet_until = tokio::time::Instant::now() + DRAIN_QUIET;
        }
        let message = match message {
            Ok(Some(message)) => message,
            Ok(None) => break,
            Err(err) => {
                // What the peer sent broke the framing or a limit: counted,
                // and warned about at a rate a flood cannot raise.
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
                break;
            }
        };
        let (header, body) = match RpcHeader::decode(&message) {
            Ok((header, body)) if header.kind == Kind::Request => (header, body),
            Ok(_) => {
                metrics::counter!(crate::observe::SERVER_PROTOCOL_ERRORS).increment(1);
                if let Some(suppressed) = warn_limit::allow(peer.ip()) {
                    tracing::warn!(%peer, suppressed, "client sent a response; closing the connection");
                }
                break;
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
                break;
            }
        };
        let received = Instant::now();
        if draining {
            metrics::counter!(crate::observe::SERVER_REFUSED_DRAINING).increment(1);
            let status = Status::unavailable("the server is shutting down; retry elsewhere");
            respond(
                &sender,
                &send_pool,
                &header,
                &MethodMetrics::unrouted("draining"),
                Err(status),
                received,
                true,
            )
            .await;
            continue;
        }
        // A method id of another service than the one the caller named
        // (ids are hashes; two services may share one) is not routed.
        let route = routes
            .get(&header.method)
            .filter(|route| header.service == 0 || header.service == route.method.service)
            .cloned();
        let Some(route) = route else {
            let status = Status::unimplemented(format!(
                "no method with id {:#010x} in the service tagged {:#06x}",
                header.method, header.service
            ));
            respond(
                &sender,
                &send_pool,
                &header,
                &MethodMetrics::unrouted("unknown"),
                Err(status),
                received,
                false,
            )
            .await;
            continue;
        };
        // Refused unrun: a caller without the service's role, or one
        // over its connection's requests in flight.
        let refusal = match &route.role {
            Some(role) if !identity.as_ref().is_some_and(|id| id.has_role(role)) => {
                metrics::counter!(crate::observe::SERVER_REFUSED_ROLE, "method" => route.method.path)
                    .increment(1);
                if let Some(suppressed) = warn_limit::allow(peer.ip()) {
                    tracing::warn!(
                        %peer,
                        method = route.method.path,
                        subject = identity.as_ref().map(|id| id.subject()),
                        role = &**role,
                        suppressed,
                        "refused a call from a peer without the role"
                    );
                }
                Some(Status::permission_denied(format!(
                    "{} needs a certificate with the role `{role}` (urn:tessera:role:{role})",
                    route.method.path
                )))
            }
            _ if inflight.len() >= max_requests => {
                metrics::counter!(crate::observe::SERVER_REFUSED_CONCURRENCY, "method" => route.method.path)
                    .increment(1);
                Some(Status::resource_exhausted(format!(
                    "{max_requests} requests are in flight on this connection \
                     (max_requests_per_connection); wait for answers before sending more"
                )))
            }
            _ => None,
        };
        if let Some(status) = refusal {
            respond(
                &sender,
                &send_pool,
                &header,
                &route.metrics,
                Err(status),
                received,
                false,
            )
            .await;
            continue;
        }
        let context = RequestContext {
            method: route.method.path,
            request_id: header.request_id,
            deadline: header.deadline().map(|remaining| received + remaining),
            peer,
            send_pool: send_pool.clone(),
            peer_identity: identity.clone(),
        };
        let deadline = context.deadline;
        // Expired before dispatch (queued behind other work, or sent with
        // almost nothing left): the caller has given up; running it could
        // apply a Push the caller was told failed.
        if deadline.is_some_and(|d| d <= Instant::now()) {
            metrics::counter!(crate::observe::SERVER_DEADLINE_DROPPED, "method" => route.method.path)
                .increment(1);
            continue;
        }
        let path = route.method.path;
        let mut call =
            AssertUnwindSafe(route.service.call(header.method, context, body)).catch_unwind();
        // A lone request runs here at once: most handlers (a Fetch, a
        // Push, Health) finish without waiting, and then the request costs
        // no task, no timer and no wake-up. A request of a burst (another
        // one is already here), or one whose handler waits, gets a task of
        // its own, so that the connection's requests run in parallel and
        // this loop goes on reading.
        if !receiver.has_ready()
            && let Poll::Ready(outcome) = futures::poll!(&mut call)
        {
            let answer = respond(
                &sender,
                &send_pool,
                &header,
                &route.metrics,
                outcome.unwrap_or_else(|_| panicked(path)),
                received,
                stop.is_cancelled(),
            );
            tokio::pin!(answer);
            // Sent at once unless the connection's send queue is full; a
            // peer that stops reading must not keep an aborted server's
            // connection task waiting here.
            if futures::poll!(&mut answer).is_pending() {
                tokio::select! {
                    () = abort.cancelled() => break,
                    () = &mut answer => {}
                }
            }
            continue;
        }
        let sender = sender.clone();
        let send_pool = send_pool.clone();
        let abort = abort.clone();
        let stop = stop.clone();
        let labels = route.metrics.clone();
        tracker.spawn(inflight.track_future(async move {
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
    }
    // Every answer was handed to the sender before this (the handlers are
    // done, refusals were sent inline), and a connection delivers in
    // order: a request the client still waits on after this message was
    // never read. Not sent when the grace period ran out (handlers were
    // dropped, perhaps after applying their request).
    if drained && !abort.is_cancelled() {
        match send_pool.alloc_copy(&RpcHeader::drained().encode()) {
            Ok(buf) => {
                if let Err(err) = sender.send(Message::from(buf.freeze())).await {
                    tracing::debug!(%peer, %err, "drained notice not sent; connection closed");
                }
            }
            Err(err) => tracing::warn!(%err, "no send-pool memory for a drained notice"),
        }
    }
    // A graceful stop is done with this connection once its answers have
    // left, not once they were handed to the transport (an RDMA engine
    // posts them later): what a process does after its server stopped
    // (exiting, or freeing a large store, whose allocator work held up a
    // stopping ps-server's last answers for 25-150 ms) cannot delay or
    // lose them. Bounded by the grace period like the requests.
    if draining {
        tokio::select! {
            () = abort.cancelled() => {}
            () = sender.flushed() => {}
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

/// An error message cut to [`MAX_ERROR_MESSAGE`] bytes (at a character
/// boundary): a handler's message must not make a response large.
pub(crate) fn truncate_error_message(message: &str) -> String {
    let mut text = message.to_owned();
    if text.len() > MAX_ERROR_MESSAGE {
        let mut cut = MAX_ERROR_MESSAGE;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
    }
    text
}

/// Completes when the process receives SIGINT (Ctrl-C) or SIGTERM: the
/// usual trigger of [`Server::serve_with_shutdown`] in a server binary.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) {
        (Ok(mut interrupt), Ok(mut terminate)) => {
            tokio::select! {
                _ = interrupt.recv() => {}
                _ = terminate.recv() => {}
            }
        }
        _ => {
            // Without signal handlers, fall back to tokio's portable Ctrl-C.
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
