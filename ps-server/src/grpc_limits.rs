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
//! keepalive pings so dead peers are noticed.
//!
//! HTTP/2 (hyper's `h2`) already refuses malformed frames by closing the
//! connection and bounds what one stream may send ahead by flow control;
//! message sizes are bounded by `max_message_size` in the generated
//! service. What it lacks is admission, which the gate adds: a socket the
//! gate refuses is closed before hyper sees it.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::{Stream, StreamExt};
use tessera_rpc::{ConnectionGate, GateTicket, InboundConfig};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tonic::transport::server::{Connected, TcpConnectInfo, TcpIncoming};

/// An accepted gRPC connection with its place under the gate, and until
/// its first byte the handshake bound (`handshake_timeout_ms`): hyper's
/// HTTP/2 server waits for the connection preface for ever, and keepalive
/// pings start only after it, so a silent connection would hold its place
/// under the gate for good.
#[derive(Debug)]
pub(crate) struct GatedStream {
    stream: TcpStream,
    first_byte_by: Option<Pin<Box<tokio::time::Sleep>>>,
    _ticket: GateTicket,
}

impl Connected for GatedStream {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream.connect_info()
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
/// to responses that span several segments). Accept errors are passed on;
/// refused sockets are dropped (closed) here.
pub(crate) fn incoming(
    listener: TcpListener,
    inbound: &InboundConfig,
) -> impl Stream<Item = io::Result<GatedStream>> + Send + 'static {
    let gate = ConnectionGate::new(inbound);
    let handshake = inbound.handshake_timeout();
    TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .filter_map(move |accepted| {
            let admitted = match accepted {
                Err(err) => Some(Err(err)),
                Ok(stream) => stream.peer_addr().ok().and_then(|peer| {
                    gate.admit(peer).map(|ticket| {
                        Ok(GatedStream {
                            stream,
                            first_byte_by: handshake
                                .map(|limit| Box::pin(tokio::time::sleep(limit))),
                            _ticket: ticket,
                        })
                    })
                }),
            };
            std::future::ready(admitted)
        })
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
    pub(crate) fn of(config: &crate::PsServerConfig) -> Self {
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
