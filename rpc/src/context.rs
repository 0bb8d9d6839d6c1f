use std::net::SocketAddr;
use std::time::{Duration, Instant};

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
}

impl RequestContext {
    /// Time left before the deadline (`None` without a deadline).
    pub fn remaining(&self) -> Option<Duration> {
        self.deadline
            .map(|deadline| deadline.saturating_duration_since(Instant::now()))
    }
}
