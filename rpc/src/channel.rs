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

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};
use tessera_transport::sync::lock;

use bytes::Bytes;
use tessera_transport::{
    Connection, Message, MessageReceiver, MessageSender, Transport, TransportKind,
};
use tokio::sync::oneshot;
use tracing::Instrument;

use crate::policy::{FallbackLadder, LadderStep, Path};
use crate::wire::{Kind, RpcHeader};
use crate::{ChannelConfig, Code, LinkClosed, MethodDescriptor, RpcError, Status};

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
}

/// How long an RDMA probe of a destination on TCP may take. Generous: a
/// probe is off every call's path, and a spurious failure would keep the
/// destination on TCP for another interval.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

type Reply = Result<(RpcHeader, Bytes), RpcError>;

/// One connection and the calls outstanding on it.
#[derive(Debug)]
struct Link {
    sender: MessageSender,
    /// `Tcp` or `Rdma`.
    kind: TransportKind,
    shared: Arc<LinkShared>,
    reader: tokio::task::JoinHandle<()>,
}

#[derive(Debug)]
struct LinkShared {
    addr: String,
    /// This link's number among the channel's events.
    event: u64,
    /// When it was installed.
    since: Instant,
    /// It carried successful calls for `HEALTHY_AFTER` (reported once).
    healthy: AtomicBool,
    closed: AtomicBool,
    pending: Mutex<PendingTable>,
    /// Whether the peer went silent (TCP links: `silence.rs`).
    silence: crate::silence::Silence,
}

#[derive(Debug, Default)]
struct PendingTable {
    /// Set once the link is dead; no call may register after that.
    closed_reason: Option<Arc<LinkClosed>>,
    calls: HashMap<u64, oneshot::Sender<Reply>>,
}

impl Drop for Link {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl Link {
    fn is_usable(&self) -> bool {
        !self.shared.closed.load(Ordering::Acquire) && !self.sender.is_closed()
    }
}

impl LinkShared {
    fn pending(&self) -> MutexGuard<'_, PendingTable> {
        // A panic while holding this lock cannot leave the table inconsistent
        // (every operation is a single insert or remove), so poisoning is ignored.
        lock(&self.pending)
    }

    fn fail_all(&self, reason: LinkClosed) {
        self.closed.store(true, Ordering::Release);
        let reason = Arc::new(reason);
        let calls = {
            let mut table = self.pending();
            table.closed_reason = Some(Arc::clone(&reason));
            std::mem::take(&mut table.calls)
        };
        for (_, slot) in calls {
            let _ = slot.send(Err(RpcError::ConnectionLost {
                addr: self.addr.clone(),
                reason: Arc::clone(&reason),
                event: self.event,
            }));
        }
    }
}

/// Removes a call's pending slot if the call is abandoned (deadline, or the
/// caller dropped the future), so the table never leaks.
struct PendingGuard<'a> {
    shared: &'a LinkShared,
    request_id: u64,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        self.shared.pending().calls.remove(&self.request_id);
    }
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
                dials: AtomicU64::new(0),
                last_failed_dial: Mutex::new(None),
                next_request_id: AtomicU64::new(1),
                ladder,
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
            method.path,
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
        metrics::histogram!(
            crate::observe::CLIENT_ATTEMPT_DURATION,
            "method" => method,
            "code" => code_label(code),
            "transport" => transport
        )
        .record(started.elapsed().as_secs_f64());
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
        if remaining.is_zero() {
            // Nothing left for the server to do it in: never sent.
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

    /// A usable link of any lane (the first).
    fn current_link(&self) -> Option<Arc<Link>> {
        lock(&self.inner.lanes)
            .iter()
            .flatten()
            .find(|link| link.is_usable())
            .cloned()
    }

    /// The link of `lane`, if it is usable.
    fn lane_link(&self, lane: usize) -> Option<Arc<Link>> {
        lock(&self.inner.lanes)
            .get(lane)
            .and_then(Option::as_ref)
            .filter(|link| link.is_usable())
            .cloned()
    }

    async fn link(&self, deadline: Instant) -> Result<Arc<Link>, RpcError> {
        let lanes = lock(&self.inner.lanes).len();
        let lane = self.inner.next_lane.fetch_add(1, Ordering::Relaxed) % lanes.max(1);
        if let Some(link) = self.lane_link(lane) {
            if link.kind == TransportKind::Tcp {
                self.maybe_probe();
            }
            return Ok(link);
        }
        // Another lane's dial is under way: a lane with a link serves
        // this call rather than making it wait (its own lane is dialed by
        // a later call).
        if lanes > 1
            && self.inner.connecting.try_lock().is_err()
            && let Some(link) = self.current_link()
        {
            return Ok(link);
        }
        // One dialer at a time; the others wait for its result, no longer
        // than their own deadlines, and share a failure of the dial they
        // waited for (one failed dial, however many callers: one event).
        let waited = Instant::now();
        let dials_before = self.inner.dials.load(Ordering::Acquire);
        let Ok(_connecting) =
            tokio::time::timeout_at(deadline.into(), self.inner.connecting.lock()).await
        else {
            return Err(RpcError::ConnectTimeout {
                addr: self.inner.addr.clone(),
                timeout: waited.elapsed(),
                event: self.inner.dials.load(Ordering::Acquire),
            });
        };
        if let Some(link) = self.lane_link(lane) {
            return Ok(link);
        }
        if let Some((event, reason)) = lock(&self.inner.last_failed_dial).clone()
            && event > dials_before
        {
            return Err(RpcError::Connect {
                addr: self.inner.addr.clone(),
                source: tessera_transport::TransportError::Io(std::io::Error::new(
                    std::io::ErrorKind::ConnectionRefused,
                    format!("the dial this call waited for failed: {reason}"),
                )),
                event,
            });
        }
        // No time left to dial in: this call's deadline is spent (it waited
        // for the lock to the end), and a dial it started would be cut at
        // once, half-opened to the server for nothing.
        if Instant::now() >= deadline {
            return Err(RpcError::ConnectTimeout {
                addr: self.inner.addr.clone(),
                timeout: waited.elapsed(),
                event: self.inner.dials.load(Ordering::Acquire),
            });
        }
        let path = self
            .inner
            .ladder
            .as_ref()
            .map_or(Path::Rdma, |ladder| lock(ladder).path());
        let connection = match (path, &self.inner.ladder) {
            (Path::Rdma, None) => self.inner.dial(Path::Rdma, deadline).await?,
            (Path::Tcp, _) => self.inner.dial(Path::Tcp, deadline).await?,
            (Path::Rdma, Some(ladder)) => match self.inner.dial(Path::Rdma, deadline).await {
                Ok(connection) => connection,
                Err(err) if !self.inner.is_rdma_path_failure(&err) => return Err(err),
                Err(err) => {
                    let step = lock(ladder).handle_rdma_failure(Instant::now());
                    self.inner.record_step(step, &err.to_string());
                    // Fallen back: this very call goes over TCP if its
                    // deadline leaves time.
                    if step != Some(LadderStep::FallBack) || Instant::now() >= deadline {
                        return Err(err);
                    }
                    self.inner.dial(Path::Tcp, deadline).await?
                }
            },
        };
        Ok(ChannelInner::install(&self.inner, connection, lane))
    }

    /// On a destination that fell back to TCP: starts an RDMA probe when
    /// one is due; a probe that connects becomes the current connection
    /// (calls on the TCP one finish there).
    fn maybe_probe(&self) {
        let Some(ladder) = &self.inner.ladder else {
            return;
        };
        let mut ladder = lock(ladder);
        let disagree = ladder.path() == Path::Rdma;
        let now = Instant::now();
        if !(ladder.poll_probe(now) || disagree && ladder.poll_return(now)) {
            return;
        }
        drop(ladder);
        let inner = Arc::clone(&self.inner);
        tokio::spawn(async move {
            let outcome = inner
                .probe_dial(Instant::now() + PROBE_TIMEOUT.max(inner.config.connect_timeout()))
                .await;
            let connected = outcome.is_ok();
            if let Ok(connection) = outcome {
                // Installed under the connect lock: a TCP dial racing with
                // the probe must not replace the RDMA link afterwards (the
                // ladder would say RDMA while calls went over TCP, and no
                // probe would run again).
                let _connecting = inner.connecting.lock().await;
                ChannelInner::install(&inner, connection, 0);
                // The other lanes' TCP links take no new calls: their
                // lanes dial again, over RDMA now.
                for link in lock(&inner.lanes).iter().skip(1).flatten() {
                    link.shared.closed.store(true, Ordering::Release);
                }
            }
            if let Some(ladder) = &inner.ladder {
                let step = lock(ladder).handle_probe(connected, Instant::now());
                inner.record_step(step, "probe connected");
            }
            if !connected {
                tracing::debug!(addr = %inner.addr, "RDMA probe failed; staying on TCP");
            }
        });
    }
}

impl ChannelInner {
    /// Connects over the configured transport (`Path::Rdma`, which is
    /// whatever the transport dials) or over TCP, within the connection
    /// timeout and `deadline`.
    /// An RDMA probe's dial: like [`ChannelInner::dial`], but its failure
    /// is not one that callers waiting for a connection share.
    async fn probe_dial(&self, deadline: Instant) -> Result<Connection, RpcError> {
        let shared = lock(&self.last_failed_dial).clone();
        let outcome = self.dial(Path::Rdma, deadline).await;
        if outcome.is_err() {
            *lock(&self.last_failed_dial) = shared;
        }
        outcome
    }

    async fn dial(&self, path: Path, deadline: Instant) -> Result<Connection, RpcError> {
        let timeout = self
            .config
            .connect_timeout()
            .min(deadline.saturating_duration_since(Instant::now()));
        let addr = self.addr.clone();
        let event = self.dials.fetch_add(1, Ordering::AcqRel) + 1;
        let connect = async {
            match path {
                Path::Rdma => self.transport.connect(&addr).await,
                Path::Tcp => self.transport.connect_tcp(&addr).await,
            }
        };
        let failed = match tokio::time::timeout(timeout, connect).await {
            Ok(Ok(connection)) => return Ok(connection),
            Ok(Err(source)) => RpcError::Connect {
                addr,
                source,
                event,
            },
            Err(_) if timeout < self.config.connect_timeout() => {
                // Cut short by this caller's deadline, not the dial's own
                // timeout: nothing is known about the peer, so the calls
                // that waited for this dial (with more time left) dial
                // again instead of failing with it. Under load a call often
                // reaches the dial with almost no time left (0 ns: a
                // ranker in the Soft-RoCE VM failed a third of its
                // requests with this caller's "timed out after 0ns").
                return Err(RpcError::ConnectTimeout {
                    addr,
                    timeout,
                    event,
                });
            }
            Err(_) => RpcError::ConnectTimeout {
                addr,
                timeout,
                event,
            },
        };
        metrics::counter!(crate::observe::CLIENT_CONNECT_FAILURES).increment(1);
        *lock(&self.last_failed_dial) = Some((event, failed.to_string()));
        Err(failed)
    }

    /// Makes `connection` the link of `lane` and starts its reader.
    fn install(inner: &Arc<ChannelInner>, connection: Connection, lane: usize) -> Arc<Link> {
        let kind = connection.kind();
        let since = Instant::now();
        let shared = Arc::new(LinkShared {
            addr: inner.addr.clone(),
            // Numbered after every dial so far (its own included).
            event: inner.dials.fetch_add(1, Ordering::AcqRel) + 1,
            since,
            healthy: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            pending: Mutex::new(PendingTable::default()),
            silence: crate::silence::Silence::new(since),
        });
        let reader = tokio::spawn(read_responses(
            connection.receiver,
            Arc::clone(&shared),
            (kind == TransportKind::Rdma).then(|| Arc::downgrade(inner)),
        ));
        let link = Arc::new(Link {
            sender: connection.sender,
            kind,
            shared,
            reader,
        });
        if let Some(slot) = lock(&inner.lanes).get_mut(lane) {
            *slot = Some(Arc::clone(&link));
        }
        tracing::debug!(addr = %inner.addr, transport = %kind, "connected");
        link
    }

    /// Whether a failed RDMA dial says the RDMA *path* is broken: it had
    /// the whole connection timeout (not one cut short by a caller's
    /// nearly spent deadline), and the server was there (a refused
    /// connection is a server down or restarting, which TCP would not
    /// reach either).
    fn is_rdma_path_failure(&self, err: &RpcError) -> bool {
        match err {
            RpcError::ConnectTimeout { timeout, .. } => *timeout >= self.config.connect_timeout(),
            RpcError::Connect {
                source: tessera_transport::TransportError::Connect { source, .. },
                ..
            } => !matches!(
                source.kind(),
                std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::ConnectionReset
            ),
            _ => true,
        }
    }

    /// An RDMA connection of this channel ended with `reason`.
    fn rdma_link_ended(&self, reason: &str) {
        if let Some(ladder) = &self.ladder {
            let step = lock(ladder).handle_rdma_failure(Instant::now());
            self.record_step(step, reason);
        }
    }

    fn record_step(&self, step: Option<LadderStep>, why: &str) {
        match step {
            Some(LadderStep::Reconnect) => {
                tracing::info!(addr = %self.addr, %why, "RDMA path failed; reconnecting over RDMA");
                metrics::counter!(crate::observe::CLIENT_RECONNECTS).increment(1);
            }
            Some(LadderStep::FallBack) => {
                tracing::warn!(addr = %self.addr, %why, "RDMA path failed again; falling back to TCP");
                metrics::counter!(crate::observe::CLIENT_FALLBACKS).increment(1);
            }
            Some(LadderStep::Return) => {
                tracing::info!(addr = %self.addr, "RDMA probe connected; back on RDMA");
                metrics::counter!(crate::observe::CLIENT_FALLBACK_RETURNS).increment(1);
            }
            None => {}
        }
    }
}

/// Reads responses until the connection ends; an RDMA connection that
/// ends tells its channel's ladder (`channel`).
async fn read_responses(
    mut receiver: MessageReceiver,
    shared: Arc<LinkShared>,
    channel: Option<Weak<ChannelInner>>,
) {
    // The server said it is shutting down: a clean end, not the RDMA
    // path's fault.
    let mut going_away = false;
    let reason = loop {
        match receiver.recv().await {
            Ok(Some(message)) => {
                shared.silence.handle_heard();
                match RpcHeader::decode(&message) {
                    Ok((header, body)) if header.kind == Kind::Response => {
                        if header.flags & crate::wire::FLAG_GOING_AWAY != 0 && !going_away {
                            // No new calls here; the outstanding ones are
                            // still answered on it.
                            going_away = true;
                            shared.closed.store(true, Ordering::Release);
                            tracing::debug!(addr = %shared.addr, "server going away; new calls dial again");
                        }
                        let slot = shared.pending().calls.remove(&header.request_id);
                        match slot {
                            Some(slot) => {
                                let _ = slot.send(Ok((header, body)));
                            }
                            // The caller gave up (deadline) before the answer came.
                            None => metrics::counter!(crate::observe::CLIENT_LATE_RESPONSES)
                                .increment(1),
                        }
                    }
                    Ok(_) => break LinkClosed::RequestFromServer,
                    Err(err) => break LinkClosed::Malformed(err),
                }
            }
            Ok(None) => {
                // A clean close (a server stopping or restarting), not the
                // RDMA path failing.
                going_away = true;
                break LinkClosed::ByServer;
            }
            Err(err) => break LinkClosed::Transport(err),
        }
    };
    tracing::debug!(addr = %shared.addr, %reason, "connection ended");
    let why = (!going_away).then(|| reason.to_string());
    shared.fail_all(reason);
    if let Some(why) = why
        && let Some(channel) = channel.and_then(|weak| weak.upgrade())
    {
        channel.rdma_link_ended(&why);
    }
}

/// A `'static` label for a code (metrics labels must not allocate per call).
pub(crate) fn code_label(code: Code) -> &'static str {
    match code {
        Code::Ok => "ok",
        Code::Cancelled => "cancelled",
        Code::InvalidArgument => "invalid_argument",
        Code::DeadlineExceeded => "deadline_exceeded",
        Code::NotFound => "not_found",
        Code::AlreadyExists => "already_exists",
        Code::PermissionDenied => "permission_denied",
        Code::ResourceExhausted => "resource_exhausted",
        Code::FailedPrecondition => "failed_precondition",
        Code::Aborted => "aborted",
        Code::OutOfRange => "out_of_range",
        Code::Unimplemented => "unimplemented",
        Code::Internal => "internal",
        Code::Unavailable => "unavailable",
        Code::DataLoss => "data_loss",
        Code::Unauthenticated => "unauthenticated",
        _ => "unknown",
    }
}
