//! Which link a call goes on: the channel's lanes, one dial at a time
//! whose failure the callers waiting for it share, and the RDMA-to-TCP
//! ladder's probes back to RDMA.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tessera_transport::sync::lock;
use tessera_transport::{Connection, TransportKind};

use super::link::{Link, LinkShared, PendingTable, read_responses};
use super::{Channel, ChannelInner};
use crate::RpcError;
use crate::policy::{LadderStep, Path};

/// How long an RDMA probe of a destination on TCP may take. Generous: a
/// probe is off every call's path, and a spurious failure would keep the
/// destination on TCP for another interval.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

impl Channel {
    /// A usable link of any lane (the first).
    pub(super) fn current_link(&self) -> Option<Arc<Link>> {
        lock(&self.inner.lanes)
            .iter()
            .flatten()
            .find(|link| link.is_usable())
            .cloned()
    }

    /// The link of `lane`, if it is usable (a displaced one that has
    /// served its while is not: the lane dials again).
    pub(super) fn lane_link(&self, lane: usize) -> Option<Arc<Link>> {
        lock(&self.inner.lanes)
            .get(lane)
            .and_then(Option::as_ref)
            .filter(|link| link.is_usable() && !link.retire_if_displaced())
            .cloned()
    }

    pub(super) async fn link(&self, deadline: Instant) -> Result<Arc<Link>, RpcError> {
        // The lane count is the configuration's (the Vec never changes
        // length): no lock for it on every call.
        let lanes = self.inner.config.connections.max(1);
        let lane = self.inner.next_lane.fetch_add(1, Ordering::Relaxed) % lanes;
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
        let Ok(_connecting) = self.wait_for_dial(deadline).await else {
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
                    let (step, to_tcp) = after_rdma_dial_failure(&mut lock(ladder), Instant::now());
                    self.inner.record_step(step, &err.to_string());
                    if !to_tcp || Instant::now() >= deadline {
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
    pub(super) fn maybe_probe(&self) {
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

/// An RDMA dial of a call failed (a path failure): records it on
/// `ladder`, and says whether this very call goes over TCP now (when its
/// deadline leaves time): whenever the ladder is on TCP, by this failure
/// or meanwhile (another link of the channel broke while this dial ran,
/// and its end moved the ladder). Before, only a fall back by this
/// failure did; one that came first failed the call's attempt although
/// TCP was the path, and with every rail down the rails drill lost a call
/// about once in a hundred runs under two CPU hogs (three attempts, each
/// behind such a dial).
fn after_rdma_dial_failure(
    ladder: &mut crate::policy::FallbackLadder,
    now: Instant,
) -> (Option<LadderStep>, bool) {
    let step = ladder.handle_rdma_failure(now);
    (step, ladder.path() == Path::Tcp)
}

impl Channel {
    /// Waits for the dial lock until `deadline`, counted in
    /// [`Channel::dial_waiters`] from the moment it is queued (its first
    /// poll that found the lock held) until it has the lock or gives up.
    async fn wait_for_dial(
        &self,
        deadline: Instant,
    ) -> Result<tokio::sync::MutexGuard<'_, ()>, tokio::time::error::Elapsed> {
        let mut lock = std::pin::pin!(tokio::time::timeout_at(
            deadline.into(),
            self.inner.connecting.lock()
        ));
        let mut queued: Option<Queued<'_>> = None;
        std::future::poll_fn(|cx| {
            let poll = lock.as_mut().poll(cx);
            if poll.is_pending() && queued.is_none() {
                queued = Some(Queued::new(&self.inner.dial_waiters));
            }
            poll
        })
        .await
    }
}

/// One call counted in a channel's dial waiters while it lives.
struct Queued<'a>(&'a AtomicUsize);

impl<'a> Queued<'a> {
    fn new(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::AcqRel);
        Self(count)
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl ChannelInner {
    /// Connects over the configured transport (`Path::Rdma`, which is
    /// whatever the transport dials) or over TCP, within the connection
    /// timeout and `deadline`.
    /// An RDMA probe's dial: like [`ChannelInner::dial`], but its failure
    /// is not one that callers waiting for a connection share.
    pub(super) async fn probe_dial(&self, deadline: Instant) -> Result<Connection, RpcError> {
        let shared = lock(&self.last_failed_dial).clone();
        let outcome = self.dial(Path::Rdma, deadline).await;
        if outcome.is_err() {
            *lock(&self.last_failed_dial) = shared;
        }
        outcome
    }

    pub(super) async fn dial(&self, path: Path, deadline: Instant) -> Result<Connection, RpcError> {
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
    pub(super) fn install(
        inner: &Arc<ChannelInner>,
        connection: Connection,
        lane: usize,
    ) -> Arc<Link> {
        let kind = connection.kind();
        let displaced = connection.displaced();
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
            displaced,
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
    pub(super) fn is_rdma_path_failure(&self, err: &RpcError) -> bool {
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
    pub(super) fn rdma_link_ended(&self, reason: &str) {
        if let Some(ladder) = &self.ladder {
            let step = lock(ladder).handle_rdma_failure(Instant::now());
            self.record_step(step, reason);
        }
    }

    pub(super) fn record_step(&self, step: Option<LadderStep>, why: &str) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{FallbackConfig, FallbackLadder};

    /// A dial that fails after the ladder already fell back (another
    /// link's end moved it) goes over TCP in the same attempt, as one whose
    /// own failure makes the ladder fall back does; a first failure
    /// reconnects over RDMA, and with the fallback off nothing goes to TCP.
    /// Before, the first case failed the call's attempt.
    #[test]
    fn a_call_goes_over_tcp_whenever_the_ladder_is_on_tcp_after_its_rdma_dial_failed() {
        let now = Instant::now();
        let mut ladder = FallbackLadder::new(FallbackConfig::default());
        assert_eq!(
            after_rdma_dial_failure(&mut ladder, now),
            (Some(LadderStep::Reconnect), false)
        );
        assert_eq!(
            after_rdma_dial_failure(&mut ladder, now),
            (Some(LadderStep::FallBack), true)
        );
        // Fallen back meanwhile: no step of its own, still over TCP.
        assert_eq!(after_rdma_dial_failure(&mut ladder, now), (None, true));
        let mut off = FallbackLadder::new(FallbackConfig {
            enabled: false,
            ..FallbackConfig::default()
        });
        for _ in 0..3 {
            assert!(!after_rdma_dial_failure(&mut off, now).1);
        }
    }
}
