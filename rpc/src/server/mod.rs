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

mod connection;

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use tessera_config::Validate;
use tessera_transport::pool::Pool;
use tessera_transport::{Listener, Message, Transport};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

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
                        tracker.spawn(connection::serve(
                            connection,
                            connection::Shared {
                                routes: Arc::clone(&self.routes),
                                send_pool: self.send_pool.clone(),
                                max_requests: self.config.max_requests_per_connection,
                                stop: stop.clone(),
                                abort: abort.clone(),
                                tracker: tracker.clone(),
                            },
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
