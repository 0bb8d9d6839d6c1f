//! The listener: accepts connections, and on an RDMA or TLS listener runs
//! each one's handshake in a task of its own (`handshake.rs`), so a slow or
//! silent client never holds up the others.

#[allow(clippy::wildcard_imports)]
use super::*;

/// Accepts incoming connections.
#[derive(Debug)]
pub struct Listener {
    inner: ListenerInner,
    local_addr: SocketAddr,
}

#[derive(Debug)]
pub(super) enum ListenerInner {
    Tcp {
        listener: tokio::net::TcpListener,
        transport: Transport,
        cap: ConnectionCap,
    },
    /// RDMA or TLS: a task accepts TCP connections and runs each
    /// handshake in a task of its own, so a slow or silent client never
    /// holds up the others; finished connections queue here.
    Handshaking {
        ready: tokio::sync::Mutex<mpsc::Receiver<Connection>>,
        _acceptor: AbortOnDrop,
    },
}

/// Stops the accepting task when the listener goes away.
#[derive(Debug)]
pub(super) struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Listener {
    pub(super) fn new(
        listener: tokio::net::TcpListener,
        transport: Transport,
    ) -> Result<Self, TransportError> {
        let local_addr = listener.local_addr()?;
        let rdma = match transport.inner.config.kind {
            TransportKind::Tcp => false,
            TransportKind::Rdma => true,
            TransportKind::Auto => transport.inner.rdma.is_some(),
        };
        let cap = ConnectionCap::new(transport.inner.config.inbound.max_connections);
        let handshakes = rdma || transport.inner.tls.is_some();
        let inner = match handshakes {
            false => ListenerInner::Tcp {
                listener,
                transport,
                cap,
            },
            true => {
                let (tx, rx) = mpsc::channel(64);
                let acceptor = tokio::spawn(accept_handshaking(listener, transport, rdma, cap, tx));
                ListenerInner::Handshaking {
                    ready: tokio::sync::Mutex::new(rx),
                    _acceptor: AbortOnDrop(acceptor),
                }
            }
        };
        Ok(Self { inner, local_addr })
    }

    /// Waits for the next connection.
    pub async fn accept(&self) -> Result<Connection, TransportError> {
        match &self.inner {
            ListenerInner::Tcp {
                listener,
                transport,
                cap,
            } => loop {
                let (stream, peer) = listener.accept().await?;
                let Some(slot) = admit_connection(cap, &transport.inner.addresses, peer) else {
                    continue;
                };
                let accepted = tokio::time::Instant::now();
                let limits = transport.inbound_limits(slot, accepted, false);
                if let Err(err) = crate::tls::prepare(&stream) {
                    tracing::debug!(%peer, %err, "accepted connection already gone");
                    continue;
                }
                break Ok(transport.tcp_connection(Wire::Plain(stream), peer, Some(limits), None));
            },
            ListenerInner::Handshaking { ready, .. } => ready
                .lock()
                .await
                .recv()
                .await
                .ok_or(TransportError::Closed),
        }
    }

    /// The address actually bound (useful after binding port 0).
    pub fn local_addr(&self) -> Result<SocketAddr, TransportError> {
        Ok(self.local_addr)
    }
}

/// Handshakes (TLS, RDMA) a listener runs at once; more wait their turn
/// within their handshake bound. 256: far more than a fleet's reconnect
/// burst needs at once, few enough that a flood of TLS handshakes leaves
/// the cores to the requests.
pub(super) const MAX_CONCURRENT_HANDSHAKES: usize = 256;

/// Accepts connections that need a handshake before they carry messages:
/// TLS (if configured) and then, on an RDMA listener (`rdma`), the RDMA
/// hello or a TCP peer's first frame. Each handshake runs in a task of its
/// own within `handshake_timeout_ms`.
pub(super) async fn accept_handshaking(
    listener: tokio::net::TcpListener,
    transport: Transport,
    rdma: bool,
    cap: ConnectionCap,
    ready: mpsc::Sender<Connection>,
) {
    let listener_label = if rdma { "rdma" } else { "tls" };
    // Handshakes at once, at most: a TLS handshake costs the server a key
    // exchange and a signature before the client has shown anything, so a
    // flood of them must not take every core. More wait for a turn,
    // within their handshake bound.
    let turns = Arc::new(tokio::sync::Semaphore::new(MAX_CONCURRENT_HANDSHAKES));
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(err) => {
                tracing::warn!(%err, "accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            }
        };
        let Some(slot) = admit_connection(&cap, &transport.inner.addresses, peer) else {
            continue;
        };
        let accepted = tokio::time::Instant::now();
        let transport = transport.clone();
        let ready = ready.clone();
        let turns = Arc::clone(&turns);
        tokio::spawn(async move {
            let handshake = async {
                let _turn = turns.acquire().await;
                handshake(&transport, stream, peer, rdma, slot, accepted, &ready).await
            };
            // `handshake_timeout_ms = 0` turns the bound off.
            let limit = match transport.inner.config.inbound.handshake_timeout_ms {
                0 => Duration::MAX,
                _ => transport
                    .inner
                    .config
                    .inbound
                    .handshake_timeout()
                    .unwrap_or(HANDSHAKE_TIMEOUT),
            };
            let bounded = async {
                match limit {
                    Duration::MAX => Ok(handshake.await),
                    limit => tokio::time::timeout(limit, handshake).await,
                }
            };
            match bounded.await {
                // Handed on outside the bound: a finished connection is
                // not dropped for a full queue (the listener's owner is
                // slow to accept), it waits its turn.
                Ok(Ok(Some(connection))) => {
                    let _ = ready.send(connection).await;
                }
                Ok(Ok(None)) => {}
                // A dialer asked for a rail whose port is down here: it
                // tries its next one. Failover, not hostile input.
                Ok(Err(err))
                    if matches!(
                        err.rdma(),
                        Some(crate::RdmaError::Handshake(
                            crate::HandshakeError::RailDown { .. }
                        ))
                    ) =>
                {
                    metrics::counter!("tessera_rdma_rail_refusals_total").increment(1);
                    tracing::debug!(%peer, %err, "handshake on a rail whose port is down refused");
                }
                Ok(Err(err)) => {
                    metrics::counter!(crate::warn_limit::MALFORMED, "listener" => listener_label)
                        .increment(1);
                    if let Some(suppressed) = crate::warn_limit::allow(peer.ip()) {
                        tracing::warn!(%peer, %err, suppressed, listener = listener_label, "handshake failed");
                    }
                }
                Err(_) => {
                    metrics::counter!(crate::inbound::CLOSED_BY_LIMIT, "reason" => Stall::Handshake.label())
                        .increment(1);
                    if let Some(suppressed) = crate::warn_limit::allow(peer.ip()) {
                        tracing::warn!(%peer, suppressed, listener = listener_label, "handshake timed out");
                    }
                }
            }
        });
    }
}
