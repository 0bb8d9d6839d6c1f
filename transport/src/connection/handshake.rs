//! An accepted connection's handshakes: TLS first where configured, then
//! protocol sniffing on an RDMA listener (the first bytes are an RDMA hello
//! or a TCP peer's first frame), then the RDMA handshake or a TCP
//! connection. The dialer's side is `Transport::connect` and
//! `rdma/connection.rs`.

#[allow(clippy::wildcard_imports)]
use super::*;

/// How long a dialer in `auto` mode waits for an RDMA handshake before it
/// falls back to TCP. 1 s: a handshake takes milliseconds; a TCP-only peer
/// either closes at once or waits for a frame that never comes.
pub(super) const AUTO_HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// Whether the first bytes a peer sent are an RDMA hello (as opposed to a
/// TCP frame), without consuming them.
pub(super) async fn speaks_rdma(stream: &tokio::net::TcpStream) -> Result<bool, TransportError> {
    let mut magic = [0u8; 4];
    loop {
        let seen = stream.peek(&mut magic).await?;
        if seen == 0 {
            return Err(TransportError::Closed);
        }
        if seen == magic.len() {
            return Ok(&magic == crate::rdma::connection::HELLO_MAGIC);
        }
        // Fewer bytes so far: wait for the rest of the magic.
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
}

/// One accepted connection's handshakes: TLS first where configured, then
/// RDMA's hello or a TCP peer's first frame on an RDMA listener. Returns
/// the finished connection (TCP) for the caller to hand on; an RDMA
/// peer's sockets go to `ready` as it opens them.
pub(super) async fn handshake(
    transport: &Transport,
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    rdma: bool,
    slot: (ConnectionSlot, AddressSlot),
    accepted: tokio::time::Instant,
    ready: &mpsc::Sender<Connection>,
) -> Result<Option<Connection>, TransportError> {
    crate::tls::prepare(&stream)?;
    // TLS first where configured: it says who the peer is.
    let (wire, identity) = match &transport.inner.tls {
        None => (Wire::Plain(stream), None),
        Some(tls) => {
            let (stream, identity) = tls.accept(stream, peer).await?;
            (Wire::Secured(Box::new(stream)), Some(Arc::new(identity)))
        }
    };
    let runtime = match rdma {
        true => transport.inner.rdma.clone(),
        false => None,
    };
    let Some(runtime) = runtime else {
        // A TCP listener: the first message's deadline runs from the
        // accept.
        let limits = transport.inbound_limits(slot, accepted, false);
        return Ok(Some(transport.tcp_connection(
            wire,
            peer,
            Some(limits),
            identity,
        )));
    };
    // Every RDMA listener also serves TCP peers on the same address: they
    // are clients that fell back to TCP because their RDMA path is broken
    // (or `auto` clients without RDMA). Their first bytes tell.
    let (wire, speaks_rdma) = match wire {
        Wire::Plain(stream) => {
            let rdma = speaks_rdma(&stream).await?;
            (Wire::Plain(stream), rdma)
        }
        // Inside TLS nothing can be peeked at: the first bytes are read,
        // and read again by whoever takes the stream.
        Wire::Secured(mut stream) => {
            let mut magic = [0u8; 4];
            stream.read_exact(&mut magic).await?;
            let rdma = &magic == crate::rdma::connection::HELLO_MAGIC;
            let stream = crate::tls::Prefixed::new(magic.to_vec(), stream);
            (Wire::Secured(Box::new(stream)), rdma)
        }
    };
    if !speaks_rdma {
        tracing::debug!(%peer, "peer speaks TCP");
        // Its first bytes are here: the handshake is over.
        let limits = transport.inbound_limits(slot, accepted, true);
        return Ok(Some(transport.tcp_connection(
            wire,
            peer,
            Some(limits),
            identity,
        )));
    }
    let stream: crate::tls::BoxStream = match wire {
        Wire::Plain(stream) => Box::new(stream),
        Wire::Secured(stream) => stream,
    };
    // The sockets the peer opens on this engine come to the listener's
    // queue from the I/O thread. The slot is held for the handshake: the
    // engine's own limits (queue pairs, completion queue room) bound what
    // comes after.
    runtime
        .accept(stream, peer, ready.clone(), identity)
        .await?;
    drop(slot);
    Ok(None)
}
