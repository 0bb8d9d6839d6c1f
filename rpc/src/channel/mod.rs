//! The client side: a [`Channel`] to one server address.
//!
//! A channel holds up to `connections` connections (*links*, one per
//! *lane*; one by default) and multiplexes any number of outstanding calls
//! over them: each call takes the next lane in turn, gets a fresh request
//! id, registers a one-shot slot in the link's pending table, sends its
//! request, and waits for the reader task to fill the slot with the
//! response of the same id. A broken link fails every outstanding call on
//! it at once; the next call on its lane dials a new one. One dial runs at
//! a time: a call whose lane has no link while another lane's dial is
//! under way uses a lane that has one rather than wait.
//!
//! Here: the calls (an attempt on a link, its deadline, its answer).
//! `link.rs`: a link, its pending calls and its reader task. `dial.rs`:
//! choosing a call's link, dialing, and the RDMA-to-TCP ladder's probes.

mod dial;
mod link;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tessera_transport::sync::lock;
use tessera_transport::{Message, Transport, TransportKind};
use tokio::sync::oneshot;
use tracing::Instrument;

use crate::policy::{FallbackLadder, Path};
use crate::wire::RpcHeader;
use crate::{ChannelConfig, Code, LinkClosed, MethodDescriptor, RpcError, Status};
use link::{Link, PendingGuard};

/// The least time a request must have left to be sent: less than any
/// call's round trip (about 10 µs over a real RNIC, tens over TCP), so a
/// request with less left could only be answered after its caller gave
/// up. (A call that times out with more left has an unknown outcome, as
/// always: the retry policy never repeats it unless it is safe.)
const MIN_REMAINING: Duration = Duration::from_micros(10);

/// Per-call options.
#[derive(Debug, Clone, Default)]
pub struct CallOptions {
    /// This call's deadline, counted from when it is issued; `None` uses the
    /// channel's request timeout Tr (a replica set's call timeout).
    pub timeout: Option<Duration>,
    /// The request carries an id that the server deduplicates (for example
    /// a Push with its worker id and sequence number), so a retry of a
    /// non-idempotent method is harmless.
    pub deduplicated: bool,
}

impl CallOptions {
    /// Options with a deadline of `timeout` from now.
    pub fn with_timeout(timeout: Duration) -> Self {
        Self {
            timeout: Some(timeout),
            ..Self::default()
        }
    }

    /// These options, saying that the request is deduplicated by the server.
    pub fn deduplicated(mut self) -> Self {
        self.deduplicated = true;
        self
    }
}

/// What a request names on the wire: the method id and its service's tag
/// (0 for a raw call, which the server does not check).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Target {
    id: u32,
    service: u16,
}

impl Target {
    pub(crate) fn of(method: &MethodDescriptor) -> Self {
        Self {
            id: method.id,
            service: method.service,
        }
    }

    pub(crate) fn raw(id: u32) -> Self {
        Self { id, service: 0 }
    }
}

/// A client channel to one server. Cheap to clone: clones share the
/// connection.
#[derive(Debug, Clone)]
pub struct Channel {
    inner: Arc<ChannelInner>,
}

#[derive(Debug)]
struct ChannelInner {
    addr: String,
    config: ChannelConfig,
    transport: Transport,
    /// The link of each lane (`config.connections` of them).
    lanes: Mutex<Vec<Option<Arc<Link>>>>,
    /// The lane the next call takes (modulo the lane count).
    next_lane: AtomicUsize,
    connecting: tokio::sync::Mutex<()>,
    /// Calls queued on `connecting` behind another call's dial (counted
    /// once queued: the lock is fair, so their order is settled).
    dial_waiters: AtomicUsize,
    /// Events (dials and links) numbered so far; the last dial's number
    /// is the count of dials, links take the next numbers too.
    dials: AtomicU64,
    /// The latest failed dial: its event and why.
    last_failed_dial: Mutex<Option<(u64, String)>>,
    next_request_id: AtomicU64,
    /// The RDMA-to-TCP rungs of the recovery ladder; `None` when the
    /// transport does not dial RDMA (`tcp`), or decides per connection
    /// itself (`auto`).
    ladder: Option<Mutex<FallbackLadder>>,
    /// Handles of the per-method call metrics.
    call_metrics: crate::observe::CallMetrics,
}

impl Channel {
    /// A channel to `addr` that connects now, within the connection timeout,
    /// over a transport of its own (see [`Channel::with_transport`] to share
    /// one).
    pub async fn connect(addr: impl Into<String>, config: ChannelConfig) -> Result<Self, RpcError> {
        let channel = Self::lazy(addr, config)?;
        let deadline = Instant::now() + channel.inner.config.connect_timeout();
        channel.link(deadline).await?;
        Ok(channel)
    }

    /// A channel to `addr` that connects on its first call (and reconnects
    /// on the first call after a connection broke), over a transport of its
    /// own built from `config.transport`.
    pub fn lazy(addr: impl Into<String>, config: ChannelConfig) -> Result<Self, RpcError> {
        let addr = addr.into();
        let transport =
            Transport::new(config.transport.clone()).map_err(|source| RpcError::Connect {
                addr: addr.clone(),
                source,
                event: 0,
            })?;
        Ok(Self::with_transport(addr, config, transport))
    }

    /// A lazily connecting channel over a shared `transport` (its pools are
    /// process-lived: share one transport among a process's channels rather
    /// than creating one per channel). `config.transport` is not used.
    pub fn with_transport(
        addr: impl Into<String>,
        config: ChannelConfig,
        transport: Transport,
    ) -> Self {
        let ladder = (transport.config().kind == TransportKind::Rdma && transport.prefers_rdma())
            .then(|| Mutex::new(FallbackLadder::new(config.fallback)));
        let lanes = config.connections.max(1);
        Self {
            inner: Arc::new(ChannelInner {
                addr: addr.into(),
                config,
                transport,
                lanes: Mutex::new(vec![None; lanes]),
                next_lane: AtomicUsize::new(0),
                connecting: tokio::sync::Mutex::new(()),
                dial_waiters: AtomicUsize::new(0),
                dials: AtomicU64::new(0),
                last_failed_dial: Mutex::new(None),
                next_request_id: AtomicU64::new(1),
                ladder,
                call_metrics: crate::observe::CallMetrics::default(),
            }),
        }
    }

    /// The transport of the current connection (`Tcp` or `Rdma`), `None`
    /// while there is none: after a fallback, `Tcp` on an RDMA channel.
    pub fn current_transport(&self) -> Option<TransportKind> {
        self.current_link().map(|link| link.kind)
    }

    /// Whether this destination's RDMA-to-TCP ladder has fallen back: new
    /// connections go over TCP until a probe finds RDMA working again
    /// (false on channels that do not dial RDMA).
    pub fn fallen_back(&self) -> bool {
        self.inner
            .ladder
            .as_ref()
            .is_some_and(|ladder| lock(ladder).path() == Path::Tcp)
    }

    /// How many calls wait for another call's dial to end (queued in
    /// arrival order: the first of them dials next if that dial fails).
    /// A call is counted once it is in the queue, so a caller that sees
    /// the count rise knows that call is ahead of any call it starts now.
    pub fn dial_waiters(&self) -> usize {
        self.inner.dial_waiters.load(Ordering::Acquire)
    }

    /// The server address.
    pub fn addr(&self) -> &str {
        &self.inner.addr
    }

    /// The channel's configuration.
    pub fn config(&self) -> &ChannelConfig {
        &self.inner.config
    }

    /// The send pool of the channel's transport (requests are encoded there).
    pub fn send_pool(&self) -> &tessera_transport::pool::Pool {
        self.inner.transport.send_pool()
    }

    /// Calls a unary method: encodes `request` (whole) into the send pool,
    /// sends it, waits for the response within the deadline and decodes it.
    pub async fn unary<Req, Resp>(
        &self,
        method: &'static MethodDescriptor,
        request: &Req,
        options: &CallOptions,
    ) -> Result<Resp, RpcError>
    where
        Req: prost::Message,
        Resp: prost::Message + Default,
    {
        let body =
            crate::codegen::encode_to_pool(request, self.send_pool()).map_err(RpcError::Memory)?;
        self.unary_message(method, Message::from(body), options)
            .await
    }

    /// Calls a unary method with an already encoded request body (the
    /// generated clients encode large `bytes` fields as parts of their own).
    pub async fn unary_message<Resp>(
        &self,
        method: &'static MethodDescriptor,
        body: Message,
        options: &CallOptions,
    ) -> Result<Resp, RpcError>
    where
        Resp: prost::Message + Default,
    {
        let timeout = options
            .timeout
            .unwrap_or_else(|| self.inner.config.request_timeout());
        let span = tracing::debug_span!("rpc.call", method = method.path, peer = %self.inner.addr);
        let deadline = Instant::now() + timeout;
        crate::observe::measured_call(
            &self.inner.call_metrics,
            method,
            span,
            self.attempt(method.path, Target::of(method), body, deadline, timeout, 1),
        )
        .await
    }

    /// Sends an already encoded request body and returns the raw response
    /// body. `timeout` is only used to report which deadline expired.
    pub async fn call_raw(
        &self,
        method_id: u32,
        body: Message,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<Bytes, RpcError> {
        self.attempt("raw", Target::raw(method_id), body, deadline, timeout, 1)
            .await
    }

    /// One attempt of a call on this channel, in a span of its own and
    /// measured (`method` labels the metrics; `attempt` counts from 1).
    pub(crate) async fn attempt(
        &self,
        method: &'static str,
        target: Target,
        body: Message,
        deadline: Instant,
        timeout: Duration,
        attempt: u32,
    ) -> Result<Bytes, RpcError> {
        let started = Instant::now();
        let span = tracing::debug_span!(
            "rpc.attempt",
            method,
            peer = %self.inner.addr,
            attempt,
            transport = tracing::field::Empty
        );
        let mut transport = "none";
        let result = self
            .attempt_inner(target, body, deadline, timeout, &mut transport)
            .instrument(span)
            .await;
        let code = match &result {
            Ok(_) => Code::Ok,
            Err(err) => err.code(),
        };
        self.inner.call_metrics.attempt(
            target.id,
            method,
            transport,
            code,
            started.elapsed().as_secs_f64(),
        );
        result
    }

    async fn attempt_inner(
        &self,
        target: Target,
        body: Message,
        deadline: Instant,
        timeout: Duration,
        transport: &mut &'static str,
    ) -> Result<Bytes, RpcError> {
        let link = self.link(deadline).await?;
        *transport = crate::observe::transport_label(link.kind);
        tracing::Span::current().record("transport", *transport);
        let request_id = self.inner.next_request_id.fetch_add(1, Ordering::Relaxed);
        let (slot, reply) = oneshot::channel();
        {
            let mut table = link.shared.pending();
            if let Some(reason) = &table.closed_reason {
                return Err(RpcError::ConnectionLost {
                    addr: self.inner.addr.clone(),
                    reason: Arc::clone(reason),
                    event: link.shared.event,
                });
            }
            table.calls.insert(request_id, slot);
        }
        let _guard = PendingGuard {
            shared: &link.shared,
            request_id,
        };
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining < MIN_REMAINING {
            // Too little left for the request to reach the server and its
            // answer to come back: never sent. (Sent, a lone request runs
            // at once on arrival and could be applied while its caller,
            // whose deadline passed on the way back, hears it failed.)
            return Err(RpcError::DeadlineExceeded(timeout));
        }
        let header = RpcHeader::request(target.id, target.service, request_id, Some(remaining));
        let header = self
            .inner
            .transport
            .send_pool()
            .alloc_copy(&header.encode())
            .map_err(RpcError::Memory)?
            .freeze();
        let message =
            Message::from_parts(std::iter::once(header).chain(body.parts().iter().cloned()));
        let sent = Instant::now();
        let exchange = async {
            link.sender
                .send(message)
                .await
                .map_err(|source| match source {
                    tessera_transport::TransportError::MessageTooLarge { len, max } => {
                        RpcError::MessageTooLarge { len, max }
                    }
                    source => RpcError::Send {
                        addr: self.inner.addr.clone(),
                        source,
                    },
                })?;
            match reply.await {
                Ok(reply) => reply,
                // The reader dropped the slot without answering: it is gone.
                Err(_) => Err(RpcError::ConnectionLost {
                    addr: self.inner.addr.clone(),
                    reason: Arc::new(LinkClosed::ReaderStopped),
                    event: link.shared.event,
                }),
            }
        };
        let (header, body) = match tokio::time::timeout_at(deadline.into(), exchange).await {
            Ok(result) => result?,
            Err(_) => {
                link.shared.silence.handle_timed_out(sent);
                if link.kind == TransportKind::Tcp && link.shared.silence.is_silent(Instant::now())
                {
                    // Presumed dead: closed, and the next call dials again.
                    metrics::counter!(crate::observe::CLIENT_SILENT_LINKS).increment(1);
                    tracing::debug!(addr = %link.shared.addr, "link silent; closing it");
                    link.shared
                        .fail_all(LinkClosed::Silent(crate::silence::SILENT_AFTER));
                    link.sender.abort();
                }
                return Err(RpcError::DeadlineExceeded(timeout));
            }
        };
        if header.status == Code::Ok.as_u16() {
            self.note_success(&link);
            Ok(body)
        } else {
            let (message, details) = crate::wire::decode_status_body(header.flags, &body);
            Err(RpcError::Status(Status::with_details(
                Code::from_u16(header.status),
                message,
                details,
            )))
        }
    }

    /// A call succeeded on `link`: an RDMA link that has done so for
    /// [`crate::policy::HEALTHY_AFTER`] clears its destination's failures
    /// (once).
    fn note_success(&self, link: &Link) {
        if link.kind != TransportKind::Rdma
            || link.shared.healthy.load(Ordering::Relaxed)
            || link.shared.since.elapsed() < crate::policy::HEALTHY_AFTER
        {
            return;
        }
        if !link.shared.healthy.swap(true, Ordering::Relaxed)
            && let Some(ladder) = &self.inner.ladder
        {
            lock(ladder).handle_rdma_healthy();
        }
    }
}
