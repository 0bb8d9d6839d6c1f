//! Where a training server's deltas go: a **route** is a shard count to
//! route rows by, whether rows go whole (optimizer state, updates applied,
//! expiry stamps) and the servers that receive them, each behind a queue
//! of its own with one call in flight (`sender.rs` delivers). A training
//! server has up to two: the serving fleet's (`[delta]`, fixed at start)
//! and a resize's (the receiving shards' servers, whole rows, set while
//! it gives keys to one: `crate::reshard`). [`deliver`] sends one
//! server its queue.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tessera_proto::v1::{DeltaClient, DeltaRequest};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// How often a warning about one receiving server is logged at most.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// How a receiving server's deliveries go, for the cut's choice between
/// waiting and dropping.
#[derive(Debug, Default)]
pub(super) struct Delivery {
    /// Milliseconds from the sender's start to the last delta that
    /// arrived whole (at first: when the destination was made, which
    /// counts as one).
    pub last_ok_ms: AtomicU64,
    /// Whether a delta failed since the last that arrived.
    pub failing: AtomicBool,
}

/// One delta for one receiving server: its parts, and the training shard
/// it is of.
#[derive(Debug)]
pub(super) struct Outgoing {
    pub shard: u32,
    pub parts: Vec<DeltaRequest>,
}

/// One receiving server of a route.
#[derive(Debug)]
pub(super) struct Destination {
    pub address: String,
    /// Receiving shard -> hosted there.
    pub hosts: Vec<bool>,
    /// The receiving shards it hosts (sent with each delta, which it
    /// checks).
    pub shards: Vec<u32>,
    pub queue: mpsc::Sender<Outgoing>,
    pub delivery: Arc<Delivery>,
}

impl Destination {
    /// A destination at `address` hosting `shards` of `num_shards`, with
    /// a queue of `depth` deltas, made `now_ms` after the sender's start;
    /// and the queue's receiving end.
    pub fn new(
        address: &str,
        shards: &[u32],
        num_shards: u32,
        depth: usize,
        now_ms: u64,
    ) -> (Arc<Self>, mpsc::Receiver<Outgoing>) {
        let (queue, rx) = mpsc::channel(depth.max(1));
        let mut hosts = vec![false; num_shards as usize];
        for &s in shards {
            if let Some(h) = hosts.get_mut(s as usize) {
                *h = true;
            }
        }
        (
            Arc::new(Self {
                address: address.to_owned(),
                hosts,
                shards: shards.to_vec(),
                queue,
                delivery: Arc::new(Delivery {
                    last_ok_ms: AtomicU64::new(now_ms),
                    failing: AtomicBool::new(false),
                }),
            }),
            rx,
        )
    }

    /// Whether a cut should wait for this destination: its queue is full
    /// while it keeps up (a delta arrived within `stall`, none failed
    /// since), `now_ms` after the sender's start.
    pub fn holds_back(&self, now_ms: u64, stall: Duration) -> bool {
        let stall_ms = u64::try_from(stall.as_millis()).unwrap_or(u64::MAX);
        self.queue.capacity() == 0
            && !self.delivery.failing.load(Ordering::Relaxed)
            && now_ms.saturating_sub(self.delivery.last_ok_ms.load(Ordering::Relaxed)) < stall_ms
    }
}

/// The servers a resize's deltas go to, as `crate::reshard` sets them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResizePlan {
    /// The shard count after the resize: rows are routed by it.
    pub num_shards: u32,
    /// Each receiving server's address and the receiving shards it
    /// hosts.
    pub servers: Vec<(String, Vec<u32>)>,
}

/// A shard count, whether rows go whole, and the servers (module docs).
#[derive(Debug)]
pub(super) struct Route {
    pub num_shards: u32,
    pub whole_rows: bool,
    pub destinations: Vec<Arc<Destination>>,
    /// What it was built from (a resize's plan), to tell a change.
    pub plan: Option<ResizePlan>,
}

impl Route {
    /// Whether it sends anywhere.
    pub fn is_empty(&self) -> bool {
        self.destinations.is_empty()
    }
}

/// What a delivery tells the sender that queued it (`sender.rs`
/// implements it): defined here, under the delivery loop, so that the loop
/// does not reach up into the sender for it.
pub(super) trait Reports: Send + Sync {
    /// A delta of `shard` did not reach `address`.
    fn delivery_failed(&self, shard: u32, address: &str, err: &dyn std::fmt::Display);
    /// Milliseconds on the sender's clock.
    fn now_ms(&self) -> u64;
    /// A delivery finished a delta: a cut waiting for room may go.
    fn room_made(&self);
}

/// Sends the server at `address` its queue, one delta at a time, until
/// `stop` or until its queue is dropped (a resize's route changed); notes
/// how its deliveries go in `delivery`, for the cut's choice between
/// waiting and dropping.
pub(super) async fn deliver(
    sender: Arc<dyn Reports>,
    address: String,
    client: DeltaClient,
    mut rx: mpsc::Receiver<Outgoing>,
    delivery: Arc<Delivery>,
    stop: CancellationToken,
) {
    let mut warned: Option<Instant> = None;
    let mut failures = 0u64;
    loop {
        let outgoing = tokio::select! {
            o = rx.recv() => o,
            () = stop.cancelled() => return,
        };
        let Some(outgoing) = outgoing else {
            return;
        };
        let mut whole = true;
        for part in outgoing.parts {
            let sent = tokio::select! {
                sent = client.apply(part) => sent,
                () = stop.cancelled() => return,
            };
            if let Err(err) = sent {
                // The rest of this delta is of no use to it now: it sees
                // the gap at the next and copies.
                failures += 1;
                sender.delivery_failed(outgoing.shard, &address, &err);
                if warned.is_none_or(|at| at.elapsed() >= WARN_EVERY) {
                    tracing::warn!(server = %address, shard = outgoing.shard, %err, failures, "a delta did not reach a receiving server");
                    warned = Some(Instant::now());
                    failures = 0;
                }
                whole = false;
                break;
            }
        }
        if whole {
            delivery
                .last_ok_ms
                .store(sender.now_ms().max(1), Ordering::Relaxed);
            delivery.failing.store(false, Ordering::Relaxed);
        } else {
            delivery.failing.store(true, Ordering::Relaxed);
        }
        sender.room_made();
    }
}
