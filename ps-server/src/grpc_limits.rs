//! Limits of the gRPC endpoint (`grpc_listen`), the listener that tools and
//! clients in other languages reach: caps of the same sizes as the Tessera
//! endpoint's (`[inbound] max_connections`, `max_connections_per_address`,
//! counted for this listener by a transport [`ConnectionGate`] of its
//! own), the handshake bound (the first byte within
//! `handshake_timeout_ms`), `TCP_NODELAY` on every accepted socket, and
//! HTTP/2's own limits set from the server's: requests in flight per
//! connection (`max_requests_per_connection`, as concurrent streams and as
//! tower's concurrency limit), a bound on each request's whole life
//! (`frame_timeout_ms`: a body trickled in slowly is cut off), and HTTP/2
//! keepalive pings so dead peers are noticed. With `[tls]`, every
//! connection is mutual TLS (ALPN `h2`) before hyper sees it, and the
//! Admin service lets in only certificates with the admin role
//! ([`RoleCheck`]).
//!
//! HTTP/2 (hyper's `h2`) already refuses malformed frames by closing the
//! connection and bounds what one stream may send ahead by flow control;
//! message sizes are bounded by `max_message_size` in the generated
//! service. What it lacks is admission, which the gate adds: a socket the
//! gate refuses is closed before hyper sees it.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::{Stream, StreamExt};
use tessera_rpc::grpc::GrpcPeerInfo;
use tessera_rpc::tls::{BoxStream, TlsAcceptor};
use tessera_rpc::{ConnectionGate, GateTicket, InboundConfig, PeerIdentity};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tonic::transport::server::{Connected, TcpIncoming};

/// An accepted gRPC connection (TCP, or TLS over it) with its place under
/// the gate, and until its first byte the handshake bound
/// (`handshake_timeout_ms`): hyper's HTTP/2 server waits for the
/// connection preface for ever, and keepalive pings start only after it,
/// so a silent connection would hold its place under the gate for good.
pub(crate) struct GatedStream {
    /// First, so that it is dropped first: the place under the gate is
    /// free before the socket closes, and a client that reconnects when it
    /// sees the close is not refused for the place it held.
    _ticket: GateTicket,
    stream: BoxStream,
    peer: SocketAddr,
    identity: Option<Arc<PeerIdentity>>,
    first_byte_by: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Whether the accepted socket has `TCP_NODELAY`, read back from it
    /// at accept.
    nodelay: bool,
}

impl GatedStream {
    /// `stream` from `peer` (who its certificate says it is, with TLS),
    /// holding `ticket`; its first byte is due within `handshake`.
    fn new(
        stream: BoxStream,
        accepted: Accepted,
        identity: Option<Arc<PeerIdentity>>,
        handshake: Option<Duration>,
    ) -> Self {
        Self {
            _ticket: accepted.ticket,
            stream,
            peer: accepted.peer,
            identity,
            first_byte_by: handshake.map(|limit| Box::pin(tokio::time::sleep(limit))),
            nodelay: accepted.nodelay,
        }
    }

    /// Whether the socket had `TCP_NODELAY` when it was accepted.
    #[cfg(test)]
    fn nodelay(&self) -> bool {
        self.nodelay
    }
}

/// What the gate's admission leaves of an accepted socket besides the
/// socket.
struct Accepted {
    peer: SocketAddr,
    nodelay: bool,
    ticket: GateTicket,
}

impl std::fmt::Debug for GatedStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatedStream")
            .field("peer", &self.peer)
            .field("identity", &self.identity)
            .field("nodelay", &self.nodelay)
            .finish_non_exhaustive()
    }
}

impl Connected for GatedStream {
    type ConnectInfo = GrpcPeerInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        GrpcPeerInfo {
            remote_addr: Some(self.peer),
            identity: self.identity.clone(),
        }
    }
}

impl AsyncRead for GatedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.stream).poll_read(cx, buf);
        match &polled {
            Poll::Ready(Ok(())) if buf.filled().len() > before => self.first_byte_by = None,
            Poll::Pending => {
                if let Some(deadline) = self.first_byte_by.as_mut()
                    && deadline.as_mut().poll(cx).is_ready()
                {
                    metrics::counter!(
                        tessera_rpc::inbound::CLOSED_BY_LIMIT,
                        "reason" => tessera_rpc::Stall::Handshake.label()
                    )
                    .increment(1);
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "nothing arrived within handshake_timeout_ms",
                    )));
                }
            }
            _ => {}
        }
        polled
    }
}

impl AsyncWrite for GatedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

/// The accepted sockets of `listener` that the gate admits, with
/// `TCP_NODELAY` set (a stock `TcpIncoming` built from a listener sets
/// none, and Nagle's algorithm meeting delayed ACKs then adds about 40 ms
/// to responses that span several segments), after a TLS handshake where
/// `tls` is set (the client must present a certificate of the CA). Accept
/// errors are passed on; refused sockets are dropped (closed) here.
///
/// TLS handshakes run in a task each, bounded by `handshake_timeout_ms`,
/// so a client that stalls in its handshake holds up nobody else;
/// finished ones queue for the server.
pub(crate) fn incoming(
    listener: TcpListener,
    inbound: &InboundConfig,
    tls: Option<TlsAcceptor>,
) -> Pin<Box<dyn Stream<Item = io::Result<GatedStream>> + Send + 'static>> {
    let gate = ConnectionGate::new(inbound);
    let handshake = inbound.handshake_timeout();
    let admitted = TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .filter_map(move |accepted| {
            let admitted = match accepted {
                Err(err) => Some(Err(err)),
                Ok(stream) => stream.peer_addr().ok().and_then(|peer| {
                    gate.admit(peer).map(|ticket| {
                        let nodelay = stream.nodelay().unwrap_or(false);
                        Ok((
                            stream,
                            Accepted {
                                peer,
                                nodelay,
                                ticket,
                            },
                        ))
                    })
                }),
            };
            std::future::ready(admitted)
        });
    let Some(tls) = tls else {
        return Box::pin(admitted.map(move |accepted| {
            accepted.map(|(stream, accepted)| {
                GatedStream::new(Box::new(stream), accepted, None, handshake)
            })
        }));
    };
    let (ready, queued) = tokio::sync::mpsc::channel::<io::Result<GatedStream>>(64);
    // TLS handshakes at once, at most (each costs a key exchange and a
    // signature before the client has shown anything); more wait their
    // turn within the handshake bound, as on the Tessera listener.
    let turns = Arc::new(tokio::sync::Semaphore::new(256));
    tokio::spawn(async move {
        let mut admitted = std::pin::pin!(admitted);
        loop {
            let next = tokio::select! {
                () = ready.closed() => return,
                next = admitted.next() => next,
            };
            let (stream, accepted) = match next {
                None => return,
                Some(Err(err)) => {
                    if ready.send(Err(err)).await.is_err() {
                        return;
                    }
                    continue;
                }
                Some(Ok(accepted)) => accepted,
            };
            let tls = tls.clone();
            let ready = ready.clone();
            let turns = Arc::clone(&turns);
            let peer = accepted.peer;
            tokio::spawn(async move {
                let accept = async {
                    let _turn = turns.acquire().await;
                    tessera_rpc::tls::accept_with(&tls, stream, peer).await
                };
                let outcome = match handshake {
                    Some(limit) => tokio::time::timeout(limit, accept).await.ok(),
                    None => Some(accept.await),
                };
                match outcome {
                    Some(Ok((stream, identity))) => {
                        let _ = ready
                            .send(Ok(GatedStream::new(
                                Box::new(stream),
                                accepted,
                                Some(Arc::new(identity)),
                                handshake,
                            )))
                            .await;
                    }
                    Some(Err(err)) => {
                        metrics::counter!(tessera_rpc::warn_limit::MALFORMED, "listener" => "grpc")
                            .increment(1);
                        if let Some(suppressed) = tessera_rpc::warn_limit::allow(peer.ip()) {
                            tracing::warn!(%peer, %err, suppressed, "gRPC TLS handshake failed");
                        }
                    }
                    None => {
                        metrics::counter!(
                            tessera_rpc::inbound::CLOSED_BY_LIMIT,
                            "reason" => tessera_rpc::Stall::Handshake.label()
                        )
                        .increment(1);
                    }
                }
            });
        }
    });
    Box::pin(tokio_stream_from(queued))
}

/// The items of `receiver`, as a stream.
fn tokio_stream_from<T: Send + 'static>(
    receiver: tokio::sync::mpsc::Receiver<T>,
) -> impl Stream<Item = T> + Send + 'static {
    futures::stream::unfold(receiver, |mut receiver| async move {
        receiver.recv().await.map(|item| (item, receiver))
    })
}

/// A tonic interceptor that lets through only callers whose certificate
/// gives `role` (the gRPC endpoint's counterpart of the Tessera server's
/// `require_role`); without a role (TLS off) everyone.
#[derive(Debug, Clone)]
pub(crate) struct RoleCheck {
    role: Option<String>,
}

impl RoleCheck {
    /// Checks `role` when set.
    pub(crate) fn new(role: Option<String>) -> Self {
        Self { role }
    }
}

impl tonic::service::Interceptor for RoleCheck {
    fn call(&mut self, request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(role) = &self.role {
            tessera_rpc::grpc::check_role(&request, role)?;
        }
        Ok(request)
    }
}

/// The endpoint's HTTP/2 and request limits, from the server's settings.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GrpcLimits {
    /// Streams (requests) one connection may have open.
    pub(crate) max_requests_per_connection: usize,
    /// A request's whole life at most (`frame_timeout_ms`; none when 0).
    pub(crate) request_timeout: Option<Duration>,
}

impl GrpcLimits {
    /// HTTP/2 keepalive: a ping this often on an idle connection...
    pub(crate) const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
    /// ...answered within this, or the connection is closed.
    pub(crate) const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);

    /// The limits of `config`.
    pub(crate) fn of(config: &crate::config::PsServerConfig) -> Self {
        Self {
            max_requests_per_connection: config.max_requests_per_connection,
            request_timeout: config.inbound.frame_timeout(),
        }
    }

    /// A tonic server builder with these limits.
    pub(crate) fn builder(self) -> tonic::transport::Server {
        let streams = u32::try_from(self.max_requests_per_connection).unwrap_or(u32::MAX);
        let builder = tonic::transport::Server::builder()
            .concurrency_limit_per_connection(self.max_requests_per_connection)
            .max_concurrent_streams(streams)
            .http2_keepalive_interval(Some(Self::KEEPALIVE_INTERVAL))
            .http2_keepalive_timeout(Some(Self::KEEPALIVE_TIMEOUT));
        match self.request_timeout {
            Some(timeout) => builder.timeout(timeout),
            None => builder,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every socket the endpoint accepts has `TCP_NODELAY`: without it, an
    /// answer of a few segments waits for the client's delayed ACK (a
    /// stock gRPC client's 250 KiB Fetch saw p99 about 45 ms against a
    /// p50 of 1.7 ms).
    #[tokio::test]
    async fn accepted_grpc_sockets_have_nodelay() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut accepted = incoming(listener, &InboundConfig::default(), None);
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let stream = accepted.next().await.unwrap().unwrap();
        assert!(stream.nodelay(), "{stream:?}");
    }
}
