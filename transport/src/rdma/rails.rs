//! Rails at the connection level: one [`RdmaRuntime`] per rail (device,
//! completion queues, I/O drivers, engine table), all sharing the
//! transport's pools, which every rail has registered.
//!
//! **Which rail a connection takes.** The rail with the fewest live
//! connections to that address (each counted while its sender lives;
//! ties go in turn), so that many connections, an RPC channel's, spread
//! over the links; a dialer passes over a rail whose port is down (the
//! last port event of its device said so) or whose handshake with the
//! peer fails, and the connection is then *displaced*
//! (`Connection::displaced`): the RPC channel dials such a link again
//! after a second, and it lands on the rail that came back, the least
//! used; its hello
//! names the rail ([`RAIL_BYTE`]), and the acceptor sets up its side on
//! its own rail of that place (its last when it has fewer), refusing the
//! handshake when that rail's port is down so that the dialer moves on at
//! once (rails pair by place: rail i of each host on the same fabric, so
//! another rail of the acceptor may not reach the dialer's). A rail the
//! address refused is tried last for a while ([`REFUSAL_MEMORY`]), so that
//! dials during a peer's rail outage do not each pay a refused handshake
//! first. Only when no rail connects does the dial fail, and the RPC
//! layer's ladder (`rpc/src/policy/fallback.rs`) falls back to TCP, as
//! with one device.
//!
//! **A port going down.** The device's `PortDown` fails every engine on
//! that rail (`rdma/io/worker.rs`); their calls end as with any lost
//! connection, and the RPC layer reconnects, which the dialer now puts on
//! a rail that is up: the paper's "reconnect over another port" before
//! TCP. `PortUp` makes the rail eligible again, and being the least used
//! it takes the next connections, displaced links' included.
//!
//! **Striping.** With `rdma.stripe_min_bytes` above 0 and confinement
//! off, a connection's large messages are written through the engines to
//! the same peer on every rail (`rdma/engine/stripes.rs`, partners in
//! `rdma/partners.rs`): a connection to an address makes sure each rail
//! has an engine there. A rail failing under a striped message costs its
//! chunks a rewrite on the others, not the message. What is not done: a
//! connection's *home* rail failing still ends the connection (its small
//! messages and order live there), which the RPC layer retries.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::AsyncReadExt;

use crate::sync::LockExt;
use tokio::sync::mpsc;

use super::connection::{HELLO_LEN, HELLO_MAGIC, Hello, PROTOCOL_VERSION, RAIL_BYTE, RdmaRuntime};
use super::engine::Role;
use crate::tls::BoxStream;
use crate::verbs::Device;
use crate::{Connection, HandshakeError, RdmaError, TransportConfig, TransportError};

/// How long a rail whose handshake with an address failed is tried last
/// for that address: 500 ms, so that a dial during a peer's rail outage
/// does not pay a refused handshake first each time, and the rail is
/// preferred again soon after the peer's port is back.
const REFUSAL_MEMORY: Duration = Duration::from_millis(500);

/// Addresses remembered at most (their live connections per rail and
/// their recent refusals): a client of a whole fleet stays within a few
/// hundred KiB; past it, addresses with nothing to remember go first.
const MAX_ADDRESSES: usize = 4096;

/// The RDMA side of a transport: a runtime per rail, the primary first.
#[derive(Debug)]
pub(crate) struct RdmaRails {
    runtimes: Vec<Arc<RdmaRuntime>>,
    /// Per address: its live connections and recent refusals per rail.
    peers: Mutex<HashMap<String, Arc<Peer>>>,
    /// Breaks ties between rails equally used: the next in turn.
    next: std::sync::atomic::AtomicUsize,
    /// Large messages are striped over rails (`rdma/partners.rs`): a
    /// connection to an address makes sure every rail has an engine there.
    striping: bool,
}

/// What the rails know of one address, per rail.
#[derive(Debug)]
struct Peer {
    /// Live connections (each held by its sender's [`LiveGuard`]).
    live: Box<[AtomicUsize]>,
    /// When the address last refused the rail's handshake.
    refused: Mutex<Box<[Option<Instant>]>>,
}

impl Peer {
    fn new(rails: usize) -> Self {
        Self {
            live: (0..rails).map(|_| AtomicUsize::new(0)).collect(),
            refused: Mutex::new(vec![None; rails].into_boxed_slice()),
        }
    }

    /// Whether there is anything to remember at `now`.
    fn remembers(&self, now: Instant) -> bool {
        self.live.iter().any(|c| c.load(Ordering::Acquire) > 0)
            || self
                .refused
                .locked()
                .iter()
                .flatten()
                .any(|at| now.duration_since(*at) < REFUSAL_MEMORY)
    }
}

/// One live connection on a rail to an address: counted while a clone of
/// its sender lives.
#[derive(Debug)]
pub(crate) struct LiveGuard {
    peer: Arc<Peer>,
    rail: usize,
}

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.peer.live[self.rail].fetch_sub(1, Ordering::AcqRel);
    }
}

impl RdmaRails {
    /// A runtime on each of `devices` (at least one), sharing `pools`.
    pub(crate) fn new(
        devices: &[Arc<dyn Device>],
        config: &TransportConfig,
        pools: (crate::pool::Pool, crate::pool::Pool),
        inbound: Option<crate::inbound::InboundBudget>,
        tls: Option<crate::tls::Tls>,
    ) -> Result<Self, TransportError> {
        let rdma = &config.rdma;
        let partners = Arc::new(super::partners::Partners::new(
            devices.len(),
            rdma.stripe_min_bytes > 0 && !rdma.confine_remote_writes && rdma.multiplex,
        ));
        if devices.len() > 1 && rdma.stripe_min_bytes > 0 && rdma.confine_remote_writes {
            tracing::info!(
                "rails: large messages are not striped while rdma.confine_remote_writes is on \
                 (a memory window is bound on one queue pair); connections still spread over rails"
            );
        }
        let runtimes = devices
            .iter()
            .enumerate()
            .map(|(rail, device)| {
                RdmaRuntime::new(
                    Arc::clone(device),
                    rail,
                    config,
                    pools.clone(),
                    inbound.clone(),
                    tls.clone(),
                    Arc::clone(&partners),
                )
                .map(Arc::new)
            })
            .collect::<Result<Vec<_>, _>>()?;
        if runtimes.is_empty() {
            return Err(TransportError::rdma_error(RdmaError::NoDevice));
        }
        Ok(Self {
            striping: partners.striping(),
            runtimes,
            peers: Mutex::new(HashMap::new()),
            next: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    /// The primary rail's device name.
    pub(crate) fn device_name(&self) -> &str {
        self.runtimes[0].device_name()
    }

    /// Counters of every rail, summed.
    pub(crate) fn stats(&self) -> super::RdmaStats {
        let mut total = super::RdmaStats::default();
        for runtime in &self.runtimes {
            runtime.add_stats(&mut total);
        }
        total.rails_down = self.runtimes.iter().filter(|r| !r.port_up()).count() as u64;
        total
    }

    /// Counters of each rail, in rail order (`rails_down`: 1 where that
    /// rail's port is down).
    pub(crate) fn rail_stats(&self) -> Vec<super::RdmaStats> {
        self.runtimes
            .iter()
            .map(|runtime| {
                let mut stats = super::RdmaStats::default();
                runtime.add_stats(&mut stats);
                stats.rails_down = u64::from(!runtime.port_up());
                stats
            })
            .collect()
    }

    /// A new logical connection to `addr` (see the module doc): on the rail
    /// that is up with the fewest live connections to `addr` (ties in
    /// turn), so that connections spread over the links; rails whose
    /// handshake with `addr` failed within [`REFUSAL_MEMORY`] tried last.
    /// A refused or unreachable TCP address ends the search at once: no
    /// rail reaches a peer that is not there.
    pub(crate) async fn connect(&self, addr: &str) -> Result<Connection, TransportError> {
        let now = Instant::now();
        let n = self.runtimes.len();
        let peer = {
            let mut peers = self.peers.locked();
            if peers.len() >= MAX_ADDRESSES && !peers.contains_key(addr) {
                peers.retain(|_, peer| peer.remembers(now));
            }
            Arc::clone(
                peers
                    .entry(addr.to_owned())
                    .or_insert_with(|| Arc::new(Peer::new(n))),
            )
        };
        let refused: Vec<bool> = peer
            .refused
            .locked()
            .iter()
            .map(|at| at.is_some_and(|at| now.duration_since(at) < REFUSAL_MEMORY))
            .collect();
        let turn = self.next.fetch_add(1, Ordering::Relaxed) % n;
        let rank = |rail: usize| {
            (
                peer.live[rail].load(Ordering::Acquire),
                (rail + n - turn) % n,
            )
        };
        // Where it would go with every rail up and willing.
        let best = (0..n).min_by_key(|&rail| rank(rail)).unwrap_or(0);
        let mut order: Vec<usize> = (0..n)
            .filter(|&rail| self.runtimes[rail].port_up())
            .collect();
        order.sort_by_key(|&rail| (refused[rail], rank(rail)));
        let mut last = None;
        for (k, &rail) in order.iter().enumerate() {
            let runtime = &self.runtimes[rail];
            match runtime.connect(addr).await {
                Ok(mut connection) => {
                    peer.refused.locked()[rail] = None;
                    peer.live[rail].fetch_add(1, Ordering::AcqRel);
                    let guard = Arc::new(LiveGuard {
                        peer: Arc::clone(&peer),
                        rail,
                    });
                    connection.placed(rail != best, guard);
                    self.complete_partners(addr, rail);
                    return Ok(connection);
                }
                Err(err @ TransportError::Connect { .. }) => return Err(err),
                Err(err) => {
                    if k + 1 < order.len() {
                        tracing::warn!(%addr, rail, device = runtime.device_name(), %err, "rail did not connect; trying the next");
                    }
                    peer.refused.locked()[rail] = Some(now);
                    last = Some(err);
                }
            }
        }
        Err(
            last.unwrap_or(TransportError::rdma_error(RdmaError::RailsDown {
                rails: self.runtimes.len(),
            })),
        )
    }

    /// With striping: dials `addr` on every other rail that is up and has
    /// no engine there yet, in the background (the connection on `rail`
    /// goes on at once, and stripes over them as they join its group).
    fn complete_partners(&self, addr: &str, rail: usize) {
        if !self.striping {
            return;
        }
        for (other, runtime) in self.runtimes.iter().enumerate() {
            if other == rail || !runtime.port_up() || runtime.has_engine(addr) {
                continue;
            }
            let (runtime, addr) = (Arc::clone(runtime), addr.to_owned());
            tokio::spawn(async move {
                if let Err(err) = runtime.ensure_engine(&addr).await {
                    tracing::debug!(%addr, rail = other, %err, "no partner engine on this rail");
                }
            });
        }
    }

    /// Sets up an accepted RDMA connection on the rail its hello names:
    /// the hello is read here, then handed to that rail's handshake with
    /// the rest of the stream.
    pub(crate) async fn accept(
        &self,
        mut stream: BoxStream,
        peer: std::net::SocketAddr,
        accepts: mpsc::Sender<Connection>,
        identity: Option<Arc<crate::tls::PeerIdentity>>,
    ) -> Result<(), TransportError> {
        let mut raw = [0u8; HELLO_LEN];
        // A stranger is turned away at its first bytes.
        stream.read_exact(&mut raw[..HELLO_MAGIC.len()]).await?;
        if &raw[..HELLO_MAGIC.len()] != HELLO_MAGIC {
            return Err(TransportError::rdma_error(HandshakeError::NotTessera));
        }
        stream.read_exact(&mut raw[HELLO_MAGIC.len()..]).await?;
        let hello = Hello::decode(&raw)?;
        // Another version is refused as such (by the handshake below),
        // whatever its rail byte means.
        let rail = match hello.version == PROTOCOL_VERSION {
            true => usize::from(hello.rail).min(self.runtimes.len() - 1),
            false => 0,
        };
        let runtime = &self.runtimes[rail];
        if hello.version == PROTOCOL_VERSION && !runtime.port_up() {
            // Rails pair by place (rail i of each host on the same fabric):
            // another rail here may not reach the dialer's, whose next
            // rail will.
            return Err(TransportError::rdma_error(HandshakeError::RailDown {
                rail: u8::try_from(rail).unwrap_or(u8::MAX),
            }));
        }
        let stream: BoxStream = Box::new(crate::tls::Prefixed::new(raw.to_vec(), stream));
        runtime
            .establish(stream, peer, Role::Acceptor, Some(accepts), identity)
            .await
            .map(drop)
    }
}

const _: () = assert!(RAIL_BYTE < HELLO_LEN);
