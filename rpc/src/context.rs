//! What a handler knows of the request it serves ([`RequestContext`]):
//! the method, the request id, the deadline, the peer and its identity,
//! and the send pool to build the answer in.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_transport::PeerIdentity;
use tessera_transport::pool::Pool;

/// What a handler knows about the call it serves.
#[derive(Debug, Clone)]
pub struct RequestContext {
    /// The method's path (`/package.Service/Method`).
    pub method: &'static str,
    /// The caller's request id (unique per connection).
    pub request_id: u64,
    /// When the caller stops waiting, if it sent a deadline. Measured from
    /// the moment the request was read, so it never overestimates.
    pub deadline: Option<Instant>,
    /// The caller's address.
    pub peer: SocketAddr,
    /// The transport's send pool: a handler that builds a large `bytes`
    /// field (a Fetch response) builds it here, in registered memory.
    pub send_pool: Pool,
    /// Who the caller is, as its TLS certificate says (`None` when TLS is
    /// off).
    pub peer_identity: Option<Arc<PeerIdentity>>,
}

impl RequestContext {
    /// Time left before the deadline (`None` without a deadline).
    pub fn remaining(&self) -> Option<Duration> {
        self.deadline
            .map(|deadline| deadline.saturating_duration_since(Instant::now()))
    }
}
