//! Failover between an etcd cluster's members.
//!
//! `etcd-client` balances one channel over every endpoint it is given
//! (tower's power-of-two-choices over reconnecting connections): a call
//! routed to a member that is gone fails ("tcp connect error") rather
//! than going to a live one, and a coordinator session that met such an
//! error ended, so a server stood down from every shard it led each time
//! one of three members died (found by the fault soak's etcd-leader
//! kills: 16 s without Pushes). So each member gets a client of its own,
//! and a call goes to the member that answered last; when that member
//! cannot be reached (the call did no work there: no connection, or etcd
//! answered "unavailable", as it does while it elects a leader), the call
//! is sent to the next member at once, round the members until the
//! request timeout. etcd's own clients (`clientv3`) fail over the same
//! way. Every call Tessera makes is safe to send again: reads, puts of
//! the same value, and transactions guarded by a compare (a campaign
//! whose first answer was lost finds its key on its own lease).

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};
use tokio::time::Instant;

use crate::etcd::CoordError;

/// A client per member, and the one that answered last.
#[derive(Clone)]
pub(crate) struct Members {
    clients: Arc<[Client]>,
    preferred: Arc<AtomicUsize>,
    /// The configured endpoints, for errors.
    pub(crate) endpoints: String,
    timeout: Duration,
}

/// The pause before going round the members again once each failed.
const ROUND_PAUSE: Duration = Duration::from_millis(50);

impl Members {
    /// Clients of `urls` (connected lazily, as calls need them).
    pub(crate) async fn connect(
        urls: &[String],
        endpoints: String,
        timeout: Duration,
        options: ConnectOptions,
    ) -> Result<Self, CoordError> {
        let mut clients = Vec::with_capacity(urls.len());
        for url in urls {
            let client = crate::etcd::within(
                timeout,
                &endpoints,
                Client::connect([url], Some(options.clone())),
            )
            .await?;
            clients.push(client);
        }
        Ok(Self {
            clients: clients.into(),
            preferred: Arc::new(AtomicUsize::new(0)),
            endpoints,
            timeout,
        })
    }

    /// Runs `call` with a member's client: the preferred one, then the
    /// others in turn while a member cannot be reached (module docs),
    /// all within the request timeout. Each member gets at most the
    /// timeout's share so that a member that hangs (stopped, cut off) does
    /// not take the whole of it.
    pub(crate) async fn call<T, F, Fut>(&self, call: F) -> Result<T, CoordError>
    where
        F: Fn(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let deadline = Instant::now() + self.timeout;
        let n = self.clients.len().max(1);
        let share = (self.timeout / n as u32).max(Duration::from_millis(100));
        let mut index = self.preferred.load(Ordering::Relaxed) % n;
        let mut tried = 0;
        loop {
            let now = Instant::now();
            if now >= deadline {
                return Err(CoordError::Timeout {
                    endpoints: self.endpoints.clone(),
                    timeout: self.timeout,
                });
            }
            let bound = share.min(deadline - now);
            let client = self.clients[index].clone();
            let last_chance = now + bound >= deadline;
            match tokio::time::timeout(bound, call(client)).await {
                Ok(Ok(value)) => {
                    self.preferred.store(index, Ordering::Relaxed);
                    return Ok(value);
                }
                Ok(Err(source)) if !unreachable(&source) || last_chance => {
                    return Err(CoordError::Etcd {
                        endpoints: self.endpoints.clone(),
                        source,
                    });
                }
                // Unreachable, or no answer within its share: the next.
                Ok(Err(_)) | Err(_) => {}
            }
            tracing::debug!(
                member = index,
                "etcd member did not answer; trying the next"
            );
            index = (index + 1) % n;
            tried += 1;
            if tried % n == 0 {
                tokio::time::sleep(
                    ROUND_PAUSE.min(deadline.saturating_duration_since(Instant::now())),
                )
                .await;
            }
        }
    }
}

/// Whether `err` says the member could not be reached or could not serve
/// the call (it did no work there): no connection, the connection broke,
/// or etcd's `Unavailable` (no leader, leader changed, stopping).
pub(crate) fn unreachable(err: &etcd_client::Error) -> bool {
    match err {
        etcd_client::Error::TransportError(_) => true,
        etcd_client::Error::GRpcStatus(status) => {
            status.code() == tonic::Code::Unavailable
                || std::error::Error::source(status)
                    .is_some_and(|s| s.downcast_ref::<tonic::transport::Error>().is_some())
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unavailable_and_broken_connections_are_unreachable_other_errors_are_not() {
        let unavailable = tonic::Status::unavailable("etcdserver: leader changed");
        assert!(unreachable(&etcd_client::Error::GRpcStatus(unavailable)));
        let refused = tonic::Status::failed_precondition("etcdserver: requested lease not found");
        assert!(!unreachable(&etcd_client::Error::GRpcStatus(refused)));
        assert!(!unreachable(&etcd_client::Error::InvalidArgs("x".into())));
    }
}
