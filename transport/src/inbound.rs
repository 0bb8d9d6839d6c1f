//! Inbound limits of *accepted* connections: what a peer that connected to
//! one of our listeners may make this process hold, and for how long.
//!
//! A server faces whatever can reach its ports. Without limits, a peer that
//! announces a large message and then stalls makes the server allocate the
//! whole message and hold it until the peer closes: a few hundred such
//! connections exhaust the receive pool and every legitimate call fails.
//! Three mechanisms, all applied before anything is allocated:
//!
//! - **Budget with backpressure** ([`InboundBudget`]): bytes of large
//!   inbound messages, from their first byte until the layers above drop
//!   them (requests are decoded as slices of their buffer), all accepted
//!   TCP connections together, are bounded by `max_bytes`; what one RDMA
//!   peer has been granted by `max_connection_bytes`. A
//!   message that does not fit waits, unread, until budget frees (the
//!   connection's socket buffers fill and the sender blocks): TCP's own
//!   backpressure, never an allocation. The budget is a tokio [`Semaphore`]
//!   (FIFO, so a large message is not starved by smaller ones behind it; a
//!   well-kept primitive instead of a hand-written counter with wake-ups).
//!   Messages of at most half a read buffer (`read_buffer_bytes`) are read
//!   into the connection's own buffer and draw no budget: what they hold is
//!   bounded by `max_connections` x `read_buffer_bytes` while they arrive;
//!   a small request still held by its handler keeps its 64 KiB read
//!   buffer alive, so what small requests hold is bounded by the requests
//!   in flight (`max_requests_per_connection`) instead, a looser bound.
//! - **Timeouts** ([`Deadlines`]): a message that has begun must be complete
//!   within `frame_timeout_ms` of its first byte, waiting for budget
//!   included (so a stalled peer holds budget for a bounded time; under
//!   pressure, waiters are served first come, first served, and one that
//!   waits past its deadline is closed: there is no per-peer share of the
//!   budget yet, so a peer that announces many large messages delays
//!   others' large messages until its own time out); a new
//!   connection must begin its first message (TCP) or finish its handshake
//!   (RDMA) within `handshake_timeout_ms`. Idle connections are kept unless
//!   `idle_timeout_ms` is set: workers are long-lived.
//! - **Caps**: at most `max_connections` accepted TCP connections (and RDMA
//!   handshakes in progress) per listener; one beyond is closed at once.
//!   Established RDMA peers are bounded by the device's queue pairs and the
//!   completion queues' room instead. There is no per-address cap yet.
//!
//! Connections this process dialed are not limited here: what they receive
//! answers what we asked for.

use crate::sync::LockExt;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tessera_config::{ConfigError, Validate, invalid};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// Metric: bytes of large inbound messages held (gauge).
pub const INBOUND_BYTES: &str = "tessera_transport_inbound_bytes";
/// Metric: inbound messages that waited for budget before being read.
pub const INBOUND_WAITS: &str = "tessera_transport_inbound_waits_total";
/// Metric: accepted connections closed by a limit, by `reason`
/// (`frame_timeout`, `handshake_timeout`, `idle_timeout`, `max_connections`).
pub const CLOSED_BY_LIMIT: &str = "tessera_transport_connections_closed_by_limit_total";

/// Limits of accepted connections (the `[transport.inbound]` table).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct InboundConfig {
    /// Bytes all accepted TCP connections together may hold in large
    /// inbound messages (more than half a read buffer), from their first
    /// byte until they are dropped. Default 1 GiB: sixteen maximum-size (64 MiB)
    /// messages arriving at once, or hundreds of typical Pushes, and far
    /// below the receive pool's ceiling (16 GiB), so slow or hostile peers
    /// can never exhaust the pool that every other call needs. Must hold
    /// one message of `max_message_size`.
    pub max_bytes: u64,
    /// Bytes one peer may hold in incomplete messages. Default 256 MiB: four
    /// maximum-size messages (an RDMA socket asks for `rts_ahead` = 4
    /// destinations ahead). A TCP connection holds at most one incomplete
    /// message, so this binds RDMA peers, whose several sockets share one
    /// queue pair. At least `max_message_size`; more than `max_bytes`
    /// means `max_bytes`.
    pub max_connection_bytes: u64,
    /// A message that has begun must be complete this long after its first
    /// byte, milliseconds, waiting for budget included. Default 30,000: a
    /// 64 MiB message takes half a second at 1 Gb/s and five at 100 Mb/s; a
    /// peer that cannot do better is stalled or hostile. 0 turns it off.
    pub frame_timeout_ms: u64,
    /// A new connection must begin its first message (TCP) or finish its
    /// handshake (RDMA) this long after it was accepted, milliseconds.
    /// Default 10,000: clients connect when they have a call to make.
    /// 0 turns it off.
    pub handshake_timeout_ms: u64,
    /// Close a connection that has sent no byte for this long (answers it
    /// still waits for included), milliseconds. Default 0 (never): workers keep their
    /// connections for the life of a job, and an idle connection costs one
    /// socket and no buffer.
    pub idle_timeout_ms: u64,
    /// Bytes the accepted TCP connections of one peer address together may
    /// hold in large inbound messages: its share of `max_bytes`, so that one
    /// host cannot take the whole budget and make every other host's large
    /// Pushes wait. Default 256 MiB (four maximum-size messages, a quarter
    /// of the default budget). At least `max_message_size`; more than
    /// `max_bytes` means `max_bytes`.
    pub max_address_bytes: u64,
    /// Accepted TCP connections (and RDMA handshakes in progress) of one
    /// peer address at once, all listeners of the transport together; one
    /// more is closed at once. Default 256: a host runs a few workers with
    /// a connection or two to each server, so 256 is a misbehaving host,
    /// and sixteen such hosts are needed to fill `max_connections`.
    pub max_connections_per_address: usize,
    /// Accepted TCP connections (and RDMA handshakes in progress) one
    /// listener keeps at once; one more is closed at once. Default 4096: the
    /// paper's largest clusters have a few hundred clients per server, each
    /// with a connection or two; a descriptor limit (`ulimit -n`) below this
    /// fails accepts before the cap does.
    pub max_connections: usize,
}

impl Default for InboundConfig {
    fn default() -> Self {
        Self {
            max_bytes: 1 << 30,
            max_connection_bytes: 256 << 20,
            frame_timeout_ms: 30_000,
            handshake_timeout_ms: 10_000,
            idle_timeout_ms: 0,
            max_address_bytes: 256 << 20,
            max_connections_per_address: 256,
            max_connections: 4096,
        }
    }
}

impl InboundConfig {
    /// Checks the limits against `max_message_size`, naming the key at
    /// fault (relative to this table).
    pub fn validate_for(&self, max_message_size: u64) -> Result<(), ConfigError> {
        self.validate()?;
        if self.max_bytes < max_message_size {
            return Err(invalid(
                "max_bytes",
                format!(
                    "{} cannot hold one message of max_message_size ({max_message_size} bytes)",
                    self.max_bytes
                ),
            ));
        }
        if self.max_address_bytes < max_message_size {
            return Err(invalid(
                "max_address_bytes",
                format!(
                    "{} cannot hold one message of max_message_size ({max_message_size} bytes)",
                    self.max_address_bytes
                ),
            ));
        }
        if self.max_connection_bytes < max_message_size {
            return Err(invalid(
                "max_connection_bytes",
                format!(
                    "{} cannot hold one message of max_message_size ({max_message_size} bytes)",
                    self.max_connection_bytes
                ),
            ));
        }
        Ok(())
    }

    fn millis(ms: u64) -> Option<Duration> {
        (ms > 0).then(|| Duration::from_millis(ms))
    }

    /// `max_connection_bytes` as it applies (at most `max_bytes`).
    pub fn connection_bytes(&self) -> u64 {
        self.max_connection_bytes.min(self.max_bytes)
    }

    /// `max_address_bytes` as it applies (at most `max_bytes`).
    pub fn address_bytes(&self) -> u64 {
        self.max_address_bytes.min(self.max_bytes)
    }

    /// The frame timeout, `None` when off.
    pub fn frame_timeout(&self) -> Option<Duration> {
        Self::millis(self.frame_timeout_ms)
    }

    /// The handshake timeout, `None` when off.
    pub fn handshake_timeout(&self) -> Option<Duration> {
        Self::millis(self.handshake_timeout_ms)
    }

    /// The idle timeout, `None` when off.
    pub fn idle_timeout(&self) -> Option<Duration> {
        Self::millis(self.idle_timeout_ms)
    }
}

impl Validate for InboundConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        // The semaphore holds at most usize::MAX >> 3 permits; one message
        // is at most u32::MAX bytes.
        let most = (Semaphore::MAX_PERMITS as u64).min(1 << 48);
        if self.max_bytes == 0 || self.max_bytes > most {
            return Err(invalid(
                "max_bytes",
                format!("{} is outside 1..={most}", self.max_bytes),
            ));
        }
        if self.max_connection_bytes == 0 {
            return Err(invalid("max_connection_bytes", "must be at least 1"));
        }
        if self.max_address_bytes == 0 {
            return Err(invalid("max_address_bytes", "must be at least 1"));
        }
        if self.max_connections == 0 {
            return Err(invalid("max_connections", "must be at least 1"));
        }
        if self.max_connections_per_address == 0 {
            return Err(invalid("max_connections_per_address", "must be at least 1"));
        }
        Ok(())
    }
}

/// The budget of bytes in incomplete inbound messages shared by every
/// accepted connection of a transport. Cheap to clone.
#[derive(Debug, Clone)]
pub struct InboundBudget {
    bytes: Arc<Semaphore>,
    max: usize,
    /// Messages waiting in [`InboundBudget::acquire`] now.
    waiting: Arc<AtomicUsize>,
    /// Whether held bytes are reported in [`INBOUND_BYTES`] (the server's
    /// budget; an address's share is part of it, not counted again).
    reported: bool,
}

/// Budget held for one incomplete message; given back when dropped.
#[derive(Debug)]
pub struct InboundPermit {
    _permit: OwnedSemaphorePermit,
    bytes: usize,
    reported: bool,
}

impl Drop for InboundPermit {
    fn drop(&mut self) {
        if self.reported {
            metrics::gauge!(INBOUND_BYTES).decrement(self.bytes as f64);
        }
    }
}

impl InboundBudget {
    /// A budget of `max` bytes.
    pub fn new(max: u64) -> Self {
        let max = usize::try_from(max)
            .unwrap_or(usize::MAX)
            .min(Semaphore::MAX_PERMITS);
        Self {
            bytes: Arc::new(Semaphore::new(max)),
            max,
            waiting: Arc::new(AtomicUsize::new(0)),
            reported: true,
        }
    }

    /// A budget of `max` bytes that is part of another (not reported in
    /// the metric).
    fn share(max: u64) -> Self {
        Self {
            reported: false,
            ..Self::new(max)
        }
    }

    /// Bytes not held right now.
    pub fn available(&self) -> usize {
        self.bytes.available_permits()
    }

    /// The whole budget.
    pub fn capacity(&self) -> usize {
        self.max
    }

    /// Messages waiting for bytes of this budget now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    fn units(&self, bytes: usize) -> Option<u32> {
        // A request above the whole budget could never be met; callers
        // validate against it, and a message is at most u32::MAX bytes.
        if bytes > self.max {
            return None;
        }
        u32::try_from(bytes).ok()
    }

    fn permit(&self, permit: OwnedSemaphorePermit, bytes: usize) -> InboundPermit {
        if self.reported {
            metrics::gauge!(INBOUND_BYTES).increment(bytes as f64);
        }
        InboundPermit {
            _permit: permit,
            bytes,
            reported: self.reported,
        }
    }

    /// Takes `bytes` now if they are free (never for more than the whole
    /// budget).
    pub fn try_acquire(&self, bytes: usize) -> Option<InboundPermit> {
        let units = self.units(bytes)?;
        let permit = Arc::clone(&self.bytes).try_acquire_many_owned(units).ok()?;
        Some(self.permit(permit, bytes))
    }

    /// Waits for `bytes` (first come, first served); `None` for a request
    /// above the whole budget, which could never be met.
    pub async fn acquire(&self, bytes: usize) -> Option<InboundPermit> {
        if let Some(permit) = self.try_acquire(bytes) {
            return Some(permit);
        }
        let units = self.units(bytes)?;
        metrics::counter!(INBOUND_WAITS).increment(1);
        /// Counts a waiter for as long as it waits, cancelled or not.
        struct Waiting<'a>(&'a AtomicUsize);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::AcqRel);
            }
        }
        self.waiting.fetch_add(1, Ordering::AcqRel);
        let _waiting = Waiting(&self.waiting);
        // The semaphore is never closed.
        let permit = Arc::clone(&self.bytes)
            .acquire_many_owned(units)
            .await
            .ok()?;
        Some(self.permit(permit, bytes))
    }
}

/// A received message that holds inbound budget until its bytes (and every
/// slice of them) are dropped.
struct Budgeted {
    body: crate::pool::PoolBuf,
    _permits: [Option<InboundPermit>; 2],
}

impl AsRef<[u8]> for Budgeted {
    fn as_ref(&self) -> &[u8] {
        &self.body
    }
}

/// `body` as a message that gives `permits` back when its last slice goes.
pub(crate) fn budgeted(
    body: crate::pool::PoolBuf,
    permits: [Option<InboundPermit>; 2],
) -> bytes::Bytes {
    match permits {
        [None, None] => body.freeze(),
        permits => bytes::Bytes::from_owner(Budgeted {
            body,
            _permits: permits,
        }),
    }
}

/// Why a connection was closed by a limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Stall {
    /// A message was not complete within `frame_timeout_ms` of its first
    /// byte.
    Frame,
    /// Nothing (TCP) or no complete handshake (RDMA) within
    /// `handshake_timeout_ms` of the accept.
    Handshake,
    /// No byte for `idle_timeout_ms` with nothing in progress.
    Idle,
}

impl Stall {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Stall::Frame => "frame_timeout",
            Stall::Handshake => "handshake_timeout",
            Stall::Idle => "idle_timeout",
        }
    }
}

impl std::fmt::Display for Stall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Stall::Frame => "a message was not complete within the frame timeout",
            Stall::Handshake => "nothing arrived within the handshake timeout",
            Stall::Idle => "the connection was idle past the idle timeout",
        })
    }
}

/// The deadlines of one accepted connection, as a small state machine: the
/// receiver reports when bytes arrive and when a message completes, and
/// asks which deadline applies now.
#[derive(Debug, Clone)]
pub struct Deadlines {
    frame: Option<Duration>,
    idle: Option<Duration>,
    /// Until the first byte: accept time + handshake timeout.
    handshake: Option<Instant>,
    /// When the first byte of the message in progress arrived.
    started: Option<Instant>,
    last_byte: Instant,
}

impl Deadlines {
    /// The deadlines of a connection accepted at `accepted` (handshake
    /// timeout measured from then; `handshake_done` when the handshake is
    /// already over, as for a TCP peer of an RDMA listener whose first
    /// bytes have been seen).
    pub fn new(config: &InboundConfig, accepted: Instant, handshake_done: bool) -> Self {
        Self {
            frame: config.frame_timeout(),
            idle: config.idle_timeout(),
            handshake: match handshake_done {
                true => None,
                false => config.handshake_timeout().map(|t| accepted + t),
            },
            started: None,
            last_byte: accepted,
        }
    }

    /// Bytes arrived at `now`; `partial` when they leave a message
    /// incomplete.
    pub fn on_bytes(&mut self, now: Instant, partial: bool) {
        self.handshake = None;
        self.last_byte = now;
        self.on_progress(now, partial);
    }

    /// Whether a message is in progress changed (a message completed, and
    /// `partial` says whether another one has begun behind it).
    pub fn on_progress(&mut self, now: Instant, partial: bool) {
        match (partial, self.started) {
            (true, None) => self.started = Some(now),
            (false, _) => self.started = None,
            (true, Some(_)) => {}
        }
    }

    /// The deadline that applies now and what missing it means; `None`
    /// when the connection may wait for ever.
    pub fn next(&self) -> Option<(Instant, Stall)> {
        if let Some(at) = self.handshake {
            return Some((at, Stall::Handshake));
        }
        match self.started {
            Some(started) => self.frame.map(|t| (started + t, Stall::Frame)),
            None => self.idle.map(|t| (self.last_byte + t, Stall::Idle)),
        }
    }
}

/// Counts the accepted connections of one listener.
#[derive(Debug, Clone)]
pub(crate) struct ConnectionCap {
    live: Arc<AtomicUsize>,
    max: usize,
}

/// One accepted connection's place under its listener's cap; freed when
/// dropped.
#[derive(Debug)]
pub(crate) struct ConnectionSlot {
    live: Arc<AtomicUsize>,
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::AcqRel);
    }
}

impl ConnectionCap {
    pub(crate) fn new(max: usize) -> Self {
        Self {
            live: Arc::new(AtomicUsize::new(0)),
            max,
        }
    }

    /// A slot, or `None` when `max` connections are live.
    pub(crate) fn admit(&self) -> Option<ConnectionSlot> {
        let mut live = self.live.load(Ordering::Acquire);
        loop {
            if live >= self.max {
                return None;
            }
            match self.live.compare_exchange_weak(
                live,
                live + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    return Some(ConnectionSlot {
                        live: Arc::clone(&self.live),
                    });
                }
                Err(now) => live = now,
            }
        }
    }
}

/// The accepted connections of each peer address, all listeners of a
/// transport together: how many (`max_connections_per_address`), and the
/// address's share of the budget (`max_address_bytes`). An entry lives
/// while the address has a connection.
#[derive(Debug, Clone)]
pub(crate) struct Addresses {
    entries: Arc<Mutex<HashMap<IpAddr, AddressEntry>>>,
    max_connections: usize,
    share: u64,
}

#[derive(Debug)]
struct AddressEntry {
    connections: usize,
    budget: InboundBudget,
}

/// One accepted connection's place under its address's cap, with the
/// address's share of the budget; freed when dropped.
#[derive(Debug)]
pub(crate) struct AddressSlot {
    table: Addresses,
    ip: IpAddr,
    pub(crate) budget: InboundBudget,
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        let mut entries = self.table.lock();
        if let Some(entry) = entries.get_mut(&self.ip) {
            entry.connections = entry.connections.saturating_sub(1);
            // Kept while messages of the address still hold its share, so
            // that reconnecting does not bring a fresh one; swept later.
            if entry.connections == 0 && entry.budget.available() == entry.budget.capacity() {
                entries.remove(&self.ip);
            }
        }
    }
}

/// Addresses remembered before the table is swept of those with no
/// connection and their whole share back.
const SWEEP_ABOVE: usize = 1024;

impl Addresses {
    pub(crate) fn new(config: &InboundConfig) -> Self {
        Self {
            entries: Arc::new(Mutex::new(HashMap::new())),
            max_connections: config.max_connections_per_address,
            share: config.address_bytes(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, AddressEntry>> {
        // A poisoned lock only means a panic elsewhere while holding it;
        // the counts are still whole.
        self.entries.locked()
    }

    /// A slot for a connection from `ip`, or `None` when the address has
    /// `max_connections_per_address` already.
    pub(crate) fn admit(&self, ip: IpAddr) -> Option<AddressSlot> {
        // An IPv4 peer seen through an IPv6 socket is the same host.
        let ip = ip.to_canonical();
        let mut entries = self.lock();
        if entries.len() >= SWEEP_ABOVE && !entries.contains_key(&ip) {
            entries.retain(|_, e| e.connections > 0 || e.budget.available() != e.budget.capacity());
        }
        let entry = entries.entry(ip).or_insert_with(|| AddressEntry {
            connections: 0,
            budget: InboundBudget::share(self.share),
        });
        if entry.connections >= self.max_connections {
            return None;
        }
        entry.connections += 1;
        let budget = entry.budget.clone();
        drop(entries);
        Some(AddressSlot {
            table: self.clone(),
            ip,
            budget,
        })
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().len()
    }
}

/// The connection caps of a listener that is not the transport's own (the
/// gRPC endpoint): `max_connections` in all, `max_connections_per_address`
/// from one address. Cheap to clone.
#[derive(Debug, Clone)]
pub struct ConnectionGate {
    cap: ConnectionCap,
    addresses: Addresses,
}

/// One admitted connection's place under a [`ConnectionGate`]; freed when
/// dropped.
#[derive(Debug)]
pub struct GateTicket {
    _slot: ConnectionSlot,
    _address: AddressSlot,
}

impl ConnectionGate {
    /// A gate with `config`'s caps.
    pub fn new(config: &InboundConfig) -> Self {
        Self {
            cap: ConnectionCap::new(config.max_connections),
            addresses: Addresses::new(config),
        }
    }

    /// A ticket for a connection from `peer`, or `None` (close it) when the
    /// listener or the address is full; counted in [`CLOSED_BY_LIMIT`] and
    /// warned about at a limited rate.
    pub fn admit(&self, peer: std::net::SocketAddr) -> Option<GateTicket> {
        let (slot, address) = admit_connection(&self.cap, &self.addresses, peer)?;
        Some(GateTicket {
            _slot: slot,
            _address: address,
        })
    }
}

/// Slots under the listener's cap and the peer address's for a connection
/// from `peer`, or `None` (the caller drops the stream, closing it) when
/// either is full.
pub(crate) fn admit_connection(
    cap: &ConnectionCap,
    addresses: &Addresses,
    peer: std::net::SocketAddr,
) -> Option<(ConnectionSlot, AddressSlot)> {
    let refused = |reason: &'static str| {
        metrics::counter!(CLOSED_BY_LIMIT, "reason" => reason).increment(1);
        if let Some(suppressed) = crate::warn_limit::allow(peer.ip()) {
            tracing::warn!(%peer, suppressed, reason, "connection refused");
        }
    };
    let Some(address) = addresses.admit(peer.ip()) else {
        refused("max_connections_per_address");
        return None;
    };
    let Some(slot) = cap.admit() else {
        refused("max_connections");
        return None;
    };
    Some((slot, address))
}

/// What an accepted TCP connection's receiver enforces.
#[derive(Debug)]
pub(crate) struct InboundLimits {
    pub(crate) budget: InboundBudget,
    pub(crate) deadlines: Deadlines,
    pub(crate) _slot: ConnectionSlot,
    pub(crate) address: AddressSlot,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_each_bad_key_is_named() {
        InboundConfig::default().validate_for(64 << 20).unwrap();
        let small = InboundConfig {
            max_bytes: 1 << 20,
            max_connection_bytes: 1 << 20,
            ..InboundConfig::default()
        };
        let err = small.validate_for(64 << 20).unwrap_err().to_string();
        assert!(err.contains("max_bytes"), "{err}");
        let per_connection = InboundConfig {
            max_connection_bytes: 1 << 20,
            ..InboundConfig::default()
        };
        let err = per_connection
            .validate_for(64 << 20)
            .unwrap_err()
            .to_string();
        assert!(err.contains("max_connection_bytes"), "{err}");
        // Shares above the whole budget are the whole budget.
        let large = InboundConfig {
            max_bytes: 128 << 20,
            ..InboundConfig::default()
        };
        large.validate_for(64 << 20).unwrap();
        assert_eq!(large.address_bytes(), 128 << 20);
        assert_eq!(large.connection_bytes(), 128 << 20);
        let none = InboundConfig {
            max_connections: 0,
            ..InboundConfig::default()
        };
        assert!(
            none.validate()
                .unwrap_err()
                .to_string()
                .contains("max_connections")
        );
    }

    #[tokio::test]
    async fn the_budget_admits_what_fits_and_wakes_waiters_in_order() {
        let budget = InboundBudget::new(100);
        let a = budget.try_acquire(60).unwrap();
        assert!(budget.try_acquire(50).is_none(), "over the budget");
        assert!(budget.try_acquire(101).is_none(), "above the whole budget");
        assert!(budget.acquire(101).await.is_none());
        let waiting = tokio::spawn({
            let budget = budget.clone();
            async move { budget.acquire(50).await.map(|p| p.bytes) }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        drop(a);
        assert_eq!(waiting.await.unwrap(), Some(50));
        assert_eq!(budget.available(), 100, "every permit given back");
    }

    #[test]
    fn deadlines_follow_handshake_then_frames_then_idle() {
        let config = InboundConfig {
            frame_timeout_ms: 1000,
            handshake_timeout_ms: 300,
            idle_timeout_ms: 0,
            ..InboundConfig::default()
        };
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut deadlines = Deadlines::new(&config, t0, false);
        assert_eq!(deadlines.next(), Some((t0 + ms(300), Stall::Handshake)));
        // The first bytes begin a message: the frame deadline runs from them.
        deadlines.on_bytes(t0 + ms(100), true);
        assert_eq!(deadlines.next(), Some((t0 + ms(1100), Stall::Frame)));
        // More bytes of the same message do not move it.
        deadlines.on_bytes(t0 + ms(900), true);
        assert_eq!(deadlines.next(), Some((t0 + ms(1100), Stall::Frame)));
        // Complete: idle connections are kept.
        deadlines.on_bytes(t0 + ms(1000), false);
        assert_eq!(deadlines.next(), None);
        let idle = InboundConfig {
            idle_timeout_ms: 500,
            ..config
        };
        let mut deadlines = Deadlines::new(&idle, t0, true);
        assert_eq!(deadlines.next(), Some((t0 + ms(500), Stall::Idle)));
        deadlines.on_bytes(t0 + ms(200), false);
        assert_eq!(deadlines.next(), Some((t0 + ms(700), Stall::Idle)));
    }

    #[test]
    fn each_address_has_its_own_cap_and_share_and_is_forgotten_when_gone() {
        let config = InboundConfig {
            max_connections_per_address: 2,
            max_address_bytes: 100,
            ..InboundConfig::default()
        };
        let table = Addresses::new(&config);
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let a1 = table.admit(a).unwrap();
        let a2 = table.admit(a).unwrap();
        assert!(table.admit(a).is_none(), "a third from one address");
        let b1 = table.admit(b).unwrap();
        // The connections of one address share one budget.
        let held = a1.budget.try_acquire(80).unwrap();
        assert!(a2.budget.try_acquire(30).is_none());
        assert!(
            b1.budget.try_acquire(100).is_some(),
            "another address's is whole"
        );
        drop((a1, a2));
        // Its messages still hold its share: reconnecting gets no new one.
        let again = table.admit(a).unwrap();
        assert!(
            again.budget.try_acquire(30).is_none(),
            "the share is still held"
        );
        drop(again);
        drop(held);
        assert_eq!(table.len(), 2, "kept while its share was held");
        let last = table.admit(a).unwrap();
        assert!(last.budget.try_acquire(100).is_some());
        drop(last);
        assert_eq!(
            table.len(),
            1,
            "a's entry is gone with its last connection and share"
        );
        drop(b1);
        assert_eq!(table.len(), 0);
        assert!(table.admit(a).is_some());
    }

    #[test]
    fn the_cap_admits_up_to_its_maximum_and_frees_on_drop() {
        let cap = ConnectionCap::new(2);
        let a = cap.admit().unwrap();
        let _b = cap.admit().unwrap();
        assert!(cap.admit().is_none());
        drop(a);
        assert!(cap.admit().is_some());
    }
}
