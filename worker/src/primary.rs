//! Which server takes each shard's Pushes, as this worker knows it, and
//! the Push path that follows it through failovers.
//!
//! The worker starts from the configured primaries (the server of replica
//! group `shard % groups`) and learns newer ones from two sources, keeping
//! per shard the one of the highest epoch:
//!
//! - **the servers' answers**: every acknowledgement carries the primary's
//!   epoch, and a server that is not the primary refuses a Push with a
//!   `NotPrimary` in the status details ("shard s's primary is X at epoch
//!   E"), upon which the Push is sent to X at once;
//! - **the coordinator** (`[coordinator]` with `kind = "etcd"`): a watch
//!   of every shard's primary key, so that the worker moves to a new
//!   primary the moment it is elected.
//!
//! A primary named by a server or the coordinator need not be in the
//! worker's configuration (a worker may list only the replica groups it
//! fetches from): the worker connects to it on first use. The servers and
//! the coordinator, not the worker's guess, are the source of truth for
//! who is primary.
//!
//! While a shard has no primary (the old one died and the lease has not
//! expired yet, or the new one is recovering), a Push is retried with an
//! exponential backoff (10 ms doubling to 200 ms), going round the shard's
//! servers so that the first to know the new primary redirects it, until
//! `push_timeout_ms`. Every attempt carries the same worker id and
//! sequence, and the deduplication windows travel with the shard, so a
//! Push whose answer was lost is applied exactly once, on whichever
//! primary. Pushes do not draw on the Fetch retry budget: a trainer would
//! rather wait out a failover than drop an update, and the backoff bounds
//! the load to one attempt per 200 ms per outstanding Push.
//!
//! A primary that acknowledges only once its replicas applied a Push holds
//! it up to its `replica_timeout_ms` for a replica that stopped confirming,
//! then cuts the replica off and acknowledges. Every Push answer says how
//! long that may be (`replica_wait_ms`), and each attempt gets it on top of
//! `request_timeout_ms`: a worker whose request timeout is below the
//! servers' replica timeout no longer gives up on the first Push after a
//! replica died, and sends it again while the primary is still waiting.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use tessera_rpc::sync::lock;

use prost::Message as _;
use tessera_proto::v1::{NotPrimary, ParameterServerClient, PushRequest, PushResponse};
use tessera_rpc::{CallOptions, Code, NoReplica, RpcError};

/// The primary of one shard as known now.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Known {
    addr: String,
    epoch: u64,
}

/// One shard: its primary as known now, and its servers.
#[derive(Debug)]
struct Shard {
    known: Mutex<Known>,
    /// The servers hosting it, in configuration order.
    hosts: Vec<String>,
}

/// Every shard's primary as this worker knows it (module docs).
pub struct Primaries {
    /// The longest wait for a replica any primary said it may hold a
    /// Push for (`PushResponse.replica_wait_ms`): each attempt gets it on
    /// top of the attempt timeout.
    replica_wait_ms: std::sync::atomic::AtomicU64,
    /// Every shard (more once the cluster grew: [`Primaries::grow`]).
    shards: RwLock<Vec<Arc<Shard>>>,
    /// Woken whenever a shard's primary is learned: Pushes waiting out a
    /// backoff go to it at once.
    learned: tokio::sync::Notify,
    /// A client for every server Pushes may go to: the configured ones,
    /// and primaries learned that are not configured.
    clients: Mutex<HashMap<String, ParameterServerClient>>,
    /// Makes the client of a learned server.
    connect: Connect,
    /// Servers in the configuration (clients made up front).
    configured: usize,
}

impl std::fmt::Debug for Primaries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Primaries")
            .field("shards", &self.shards)
            .finish_non_exhaustive()
    }
}

/// Makes a client for a server address.
pub type Connect = Box<dyn Fn(&str) -> ParameterServerClient + Send + Sync>;

/// The most servers outside the configuration a worker connects to as
/// primaries (a bound against a misbehaving server or coordinator naming
/// ever new addresses; a real cluster needs a handful).
const MAX_LEARNED: usize = 256;

/// The longest wait between two attempts of a Push.
const MAX_BACKOFF: Duration = Duration::from_millis(200);

impl Primaries {
    /// `initial[shard]` is the configured primary, `hosts[shard]` the
    /// servers of the shard; `clients` reach every configured server, and
    /// `connect` makes clients for primaries learned beyond them.
    pub fn new(
        initial: Vec<String>,
        hosts: Vec<Vec<String>>,
        clients: HashMap<String, ParameterServerClient>,
        connect: Connect,
    ) -> Self {
        Self {
            replica_wait_ms: std::sync::atomic::AtomicU64::new(0),
            shards: RwLock::new(
                initial
                    .into_iter()
                    .zip(hosts.into_iter().chain(std::iter::repeat_with(Vec::new)))
                    .map(|(addr, hosts)| {
                        Arc::new(Shard {
                            known: Mutex::new(Known { addr, epoch: 0 }),
                            hosts,
                        })
                    })
                    .collect(),
            ),
            learned: tokio::sync::Notify::new(),
            configured: clients.len(),
            clients: Mutex::new(clients),
            connect,
        }
    }

    fn shard(&self, shard: u32) -> Option<Arc<Shard>> {
        self.shards
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(shard as usize)
            .cloned()
    }

    /// How many shards it knows.
    pub fn len(&self) -> usize {
        self.shards
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len()
    }

    /// Whether it knows no shard.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Adds the shards of a grown cluster: `hosts[shard]` for each shard
    /// beyond those known (their first server is tried first; a server's
    /// redirect or the coordinator names the primary). Shards known keep
    /// their primary and servers.
    pub fn grow(&self, hosts: Vec<Vec<String>>) {
        let mut shards = self
            .shards
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for hosts in hosts.into_iter().skip(shards.len()) {
            shards.push(Arc::new(Shard {
                known: Mutex::new(Known {
                    addr: hosts.first().cloned().unwrap_or_default(),
                    epoch: 0,
                }),
                hosts,
            }));
        }
    }

    /// Forgets the shards from `len` on (a shrunk cluster's shards given
    /// away): a later growth learns their servers anew.
    pub fn truncate(&self, len: usize) {
        self.shards
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .truncate(len);
    }

    /// The primary of `shard` as known now, and its epoch.
    pub fn current(&self, shard: u32) -> Option<(String, u64)> {
        let entry = self.shard(shard)?;
        let known = lock(&entry.known);
        Some((known.addr.clone(), known.epoch))
    }

    /// Takes `addr` as `shard`'s primary if `epoch` is not older than the
    /// one known and `addr` is a server address (`host:port`); returns
    /// whether it did.
    pub fn learn(&self, shard: u32, addr: &str, epoch: u64) -> bool {
        let Some(entry) = self.shard(shard) else {
            return false;
        };
        let known = &entry.known;
        let stale =
            |known: &Known| epoch < known.epoch || (epoch == known.epoch && known.addr == addr);
        // Checked before connecting: a stale name costs no client.
        if stale(&lock(known)) || self.client(addr).is_none() {
            return false;
        }
        let mut known = lock(known);
        if stale(&known) {
            return false;
        }
        if known.addr != addr {
            tracing::info!(shard, primary = addr, epoch, "new primary");
        }
        *known = Known {
            addr: addr.to_owned(),
            epoch,
        };
        drop(known);
        self.learned.notify_waiters();
        true
    }

    /// The client of `addr`, made now if it is a `host:port` not seen
    /// before (and the bound on learned servers allows).
    fn client(&self, addr: &str) -> Option<ParameterServerClient> {
        let mut clients = lock(&self.clients);
        if let Some(client) = clients.get(addr) {
            return Some(client.clone());
        }
        if !is_host_port(addr) || clients.len() >= self.configured + MAX_LEARNED {
            return None;
        }
        tracing::info!(
            server = addr,
            "connecting to a primary outside the configuration"
        );
        let client = (self.connect)(addr);
        clients.insert(addr.to_owned(), client.clone());
        Some(client)
    }

    /// What a Push attempt gets on top of its attempt timeout: the longest
    /// wait for a replica a primary said it may hold a Push for (zero
    /// until a primary answered).
    pub fn replica_wait(&self) -> Duration {
        Duration::from_millis(
            self.replica_wait_ms
                .load(std::sync::atomic::Ordering::Relaxed),
        )
    }

    /// The server of `shard` after `addr`, round the shard's servers.
    fn next_host(&self, shard: u32, addr: &str) -> String {
        let Some(entry) = self.shard(shard) else {
            return addr.to_owned();
        };
        let hosts = &entry.hosts;
        if hosts.is_empty() {
            return addr.to_owned();
        }
        let at = hosts.iter().position(|h| h == addr).map_or(0, |i| i + 1);
        hosts[at % hosts.len()].clone()
    }

    /// Sends `request` to its shard's primary, following redirects and
    /// failovers, until `deadline` (module docs). Each attempt is bounded
    /// by `attempt_timeout`.
    pub async fn push(
        &self,
        request: &PushRequest,
        attempt_timeout: Duration,
        deadline: Instant,
    ) -> Result<(String, PushResponse), (String, RpcError)> {
        let shard = request.shard;
        let Some((mut target, mut target_epoch)) = self.current(shard) else {
            return Err((String::new(), RpcError::NoReplica(NoReplica::Shard(shard))));
        };
        let mut backoff = Duration::from_millis(10);
        let mut hops = 0;
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            let Some(client) = self.client(&target) else {
                return Err((
                    target.clone(),
                    RpcError::NoReplica(NoReplica::NotConfigured(target.clone())),
                ));
            };
            let attempt = attempt_timeout.saturating_add(self.replica_wait());
            let options = CallOptions::with_timeout(remaining.min(attempt)).deduplicated();
            let error = match client.push_with_options(request.clone(), &options).await {
                Ok(answer) => {
                    self.replica_wait_ms.fetch_max(
                        u64::from(answer.replica_wait_ms),
                        std::sync::atomic::Ordering::Relaxed,
                    );
                    self.learn(shard, &target, answer.epoch);
                    return Ok((target, answer));
                }
                Err(error) => error,
            };
            let hint = match &error {
                // ABORTED carries a `KeysMoved` (a resize moved the keys:
                // the caller splits the Push anew), never a redirect.
                RpcError::Status(status)
                    if !status.details().is_empty() && status.code() != Code::Aborted =>
                {
                    NotPrimary::decode(status.details().clone()).ok()
                }
                _ => None,
            };
            let retry_now = match (&error, &hint) {
                // "Not the primary; it is X": go there at once (a few hops
                // at most without a pause, in case two servers disagree).
                (_, Some(hint))
                    if !hint.primary.is_empty()
                        && hint.primary != target
                        && (self.learn(shard, &hint.primary, hint.epoch)
                            || self
                                .current(shard)
                                .is_some_and(|(known, _)| known != target)) =>
                {
                    (target, target_epoch) = self.current(shard).unwrap_or_default();
                    hops += 1;
                    hops <= 4
                }
                // No primary known there (a failover, a recovery): wait,
                // and ask the next server.
                (_, Some(_)) => {
                    (target, target_epoch) = self.next_after(shard, &target, target_epoch);
                    false
                }
                // The server (or the way to it) is gone, or the attempt
                // timed out: the Push may have been applied; try again,
                // moving on to the next server if no newer primary is known.
                (e, None) if retriable(e) => {
                    (target, target_epoch) = self.next_after(shard, &target, target_epoch);
                    false
                }
                _ => return Err((target, error)),
            };
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err((target, error));
            }
            if !retry_now {
                // The last pause is cut to what is left: one more attempt
                // at the deadline rather than giving up early. A primary
                // learned meanwhile (from the coordinator's watch, or
                // another Push's answer) ends the pause.
                let learned = self.learned.notified();
                tokio::pin!(learned);
                learned.as_mut().enable();
                tokio::select! {
                    _ = tokio::time::sleep(backoff.min(remaining)) => {}
                    _ = learned => {
                        if let Some((known, epoch)) = self.current(shard)
                            && epoch > target_epoch
                        {
                            (target, target_epoch) = (known, epoch);
                        }
                    }
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
                hops = 0;
            }
        }
    }

    /// Where to try after `failed` (chosen when the primary's epoch was
    /// `tried`): the primary known now if it was learned since, else the
    /// next server of the shard.
    fn next_after(&self, shard: u32, failed: &str, tried: u64) -> (String, u64) {
        match self.current(shard) {
            Some((known, epoch)) if epoch > tried && known != failed => (known, epoch),
            _ => (self.next_host(shard, failed), tried),
        }
    }
}

/// Whether `addr` looks like `host:port` (a name or an IP, a port number).
fn is_host_port(addr: &str) -> bool {
    addr.rsplit_once(':').is_some_and(|(host, port)| {
        !host.is_empty()
            && port.parse::<u16>().is_ok_and(|p| p != 0)
            && host.chars().all(|c| {
                c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | '[' | ']' | ':')
            })
    })
}

/// Failures after which the same Push may be sent again.
fn retriable(error: &RpcError) -> bool {
    matches!(error.code(), Code::Unavailable | Code::DeadlineExceeded)
}

/// Keeps `primaries` up to date from the coordinator's watch until the
/// returned task is dropped (aborted).
pub fn watch(
    primaries: Arc<Primaries>,
    config: tessera_coord::CoordinatorConfig,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut backoff = Duration::from_millis(100);
        loop {
            if let Err(err) = follow(&primaries, &config).await {
                tracing::info!(%err, "coordinator watch failed; the worker follows servers' redirects meanwhile");
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    })
}

async fn follow(
    primaries: &Primaries,
    config: &tessera_coord::CoordinatorConfig,
) -> Result<(), tessera_coord::CoordError> {
    let coord = tessera_coord::EtcdCoordinator::connect(config).await?;
    let (now, revision) = coord.primaries().await?;
    for (shard, (record, _)) in now {
        primaries.learn(shard, &record.address, record.epoch);
    }
    let mut watch = coord.watch_primaries(revision + 1).await?;
    loop {
        for change in watch.next().await? {
            if let Some((record, _)) = change.primary {
                primaries.learn(change.shard, &record.address, record.epoch);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_rpc::{Channel, ChannelConfig};

    fn client(addr: &str) -> ParameterServerClient {
        ParameterServerClient::new(Channel::lazy(addr, ChannelConfig::default()).unwrap())
    }

    fn primaries() -> Primaries {
        Primaries::new(
            vec!["a:1".into()],
            vec![vec!["a:1".into(), "b:1".into(), "c:1".into()]],
            ["a:1", "b:1", "c:1"]
                .into_iter()
                .map(|a| (a.to_owned(), client(a)))
                .collect(),
            Box::new(client),
        )
    }

    #[test]
    fn only_newer_or_equal_epochs_of_server_addresses_are_learned() {
        let p = primaries();
        assert_eq!(p.current(0), Some(("a:1".into(), 0)));
        assert!(p.learn(0, "b:1", 3));
        assert!(!p.learn(0, "c:1", 2), "older epoch");
        for bad in ["", "x", "x:", ":9", "x:0", "x:99999", "x y:1"] {
            assert!(!p.learn(0, bad, 9), "{bad:?} is not host:port");
        }
        assert!(!p.learn(0, "b:1", 3), "nothing new");
        assert!(p.learn(0, "c:1", 4));
        assert_eq!(p.current(0), Some(("c:1".into(), 4)));
        assert_eq!(p.current(7), None);
        // A primary outside the configuration is connected to.
        assert!(p.learn(0, "10.0.0.9:7070", 5));
        assert_eq!(p.current(0), Some(("10.0.0.9:7070".into(), 5)));
    }

    #[test]
    fn a_grown_cluster_adds_shards_and_keeps_those_known() {
        let p = primaries();
        assert!(p.learn(0, "b:1", 3));
        assert!(!p.learn(1, "d:1", 1), "no shard 1 yet");
        p.grow(vec![vec!["x:1".into()], vec!["d:1".into(), "e:1".into()]]);
        assert_eq!(p.len(), 2);
        assert_eq!(p.current(0), Some(("b:1".into(), 3)), "kept");
        assert_eq!(p.current(1), Some(("d:1".into(), 0)));
        assert_eq!(p.next_after(1, "d:1", 0), ("e:1".into(), 0));
        assert!(p.learn(1, "e:1", 2));
    }

    #[test]
    fn learned_servers_are_bounded() {
        let p = primaries();
        for i in 0..MAX_LEARNED {
            assert!(p.learn(0, &format!("h{i}:1"), i as u64 + 1));
        }
        assert!(!p.learn(0, "one-too-many:1", u64::MAX));
    }

    #[test]
    fn a_failed_primary_moves_on_round_the_shards_servers() {
        let p = primaries();
        assert_eq!(p.next_after(0, "a:1", 0), ("b:1".into(), 0));
        assert_eq!(p.next_after(0, "b:1", 0), ("c:1".into(), 0));
        assert_eq!(
            p.next_after(0, "c:1", 0),
            ("a:1".into(), 0),
            "round the servers"
        );
        // A newer primary learned meanwhile is tried first.
        assert!(p.learn(0, "c:1", 5));
        assert_eq!(p.next_after(0, "a:1", 0), ("c:1".into(), 5));
        assert_eq!(p.next_after(0, "c:1", 5), ("a:1".into(), 5));
    }
}
