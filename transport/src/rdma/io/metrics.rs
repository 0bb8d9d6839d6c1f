//! Per-engine metrics and a driver's counters.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::rdma::engine::Engine;

/// Per-engine metrics (labelled by peer address) and the last counters
/// they were brought up to date with.
pub(super) struct EngineMetrics {
    last: crate::rdma::engine::EngineStats,
    bytes_sent: metrics::Counter,
    bytes_received: metrics::Counter,
    messages_sent: metrics::Counter,
    messages_received: metrics::Counter,
    credit_stalls: metrics::Counter,
    window_stalls: metrics::Counter,
    keepalives_sent: metrics::Counter,
    offered_sends: metrics::Counter,
    stripe_chunks: metrics::Counter,
    stripe_redone: metrics::Counter,
    striped_bytes: metrics::Counter,
    ring_occupancy: metrics::Histogram,
}

impl EngineMetrics {
    pub(super) fn new(peer: &SocketAddr) -> Self {
        let peer = peer.to_string();
        Self {
            last: crate::rdma::engine::EngineStats::default(),
            bytes_sent: metrics::counter!("tessera_rdma_bytes_sent_total", "peer" => peer.clone()),
            bytes_received: metrics::counter!("tessera_rdma_bytes_received_total", "peer" => peer.clone()),
            messages_sent: metrics::counter!("tessera_rdma_messages_sent_total", "peer" => peer.clone()),
            messages_received: metrics::counter!("tessera_rdma_messages_received_total", "peer" => peer.clone()),
            credit_stalls: metrics::counter!("tessera_rdma_credit_stalls_total", "peer" => peer.clone()),
            window_stalls: metrics::counter!("tessera_rdma_window_stalls_total", "peer" => peer.clone()),
            keepalives_sent: metrics::counter!("tessera_rdma_keepalives_sent_total", "peer" => peer.clone()),
            offered_sends: metrics::counter!("tessera_rdma_offered_sends_total", "peer" => peer.clone()),
            stripe_chunks: metrics::counter!("tessera_rdma_stripe_chunks_total", "peer" => peer.clone()),
            stripe_redone: metrics::counter!("tessera_rdma_stripe_redone_total", "peer" => peer.clone()),
            striped_bytes: metrics::counter!("tessera_rdma_striped_bytes_total", "peer" => peer.clone()),
            ring_occupancy: metrics::histogram!("tessera_rdma_ring_occupancy", "peer" => peer),
        }
    }

    /// Brings the metrics and the thread's totals up to the engine's
    /// counters, and samples its ring.
    pub(super) fn update(&mut self, engine: &Engine, totals: &IoStats) {
        self.count(engine, totals);
        self.ring_occupancy.record(engine.in_flight() as f64);
    }

    /// Brings the counters and the thread's totals up to the engine's: the
    /// driver calls it before it hands the engine's events on, so that a
    /// message the application has is counted in
    /// [`crate::Transport::rdma_stats`].
    pub(super) fn count(&mut self, engine: &Engine, totals: &IoStats) {
        let now = engine.stats();
        let last = std::mem::replace(&mut self.last, now);
        let sent = (now.small_sent + now.large_sent) - (last.small_sent + last.large_sent);
        let pairs = [
            (
                &self.bytes_sent,
                &totals.bytes_sent,
                now.bytes_sent - last.bytes_sent,
            ),
            (
                &self.bytes_received,
                &totals.bytes_received,
                now.bytes_received - last.bytes_received,
            ),
            (&self.messages_sent, &totals.messages_sent, sent),
            (
                &self.messages_received,
                &totals.messages_received,
                now.received - last.received,
            ),
            (
                &self.credit_stalls,
                &totals.credit_stalls,
                now.credit_stalls - last.credit_stalls,
            ),
            (
                &self.window_stalls,
                &totals.window_stalls,
                now.window_stalls - last.window_stalls,
            ),
            (
                &self.keepalives_sent,
                &totals.keepalives_sent,
                now.keepalives_sent - last.keepalives_sent,
            ),
            (
                &self.offered_sends,
                &totals.offered_sends,
                now.offered_sends - last.offered_sends,
            ),
            (
                &self.stripe_chunks,
                &totals.stripe_chunks,
                now.stripe_chunks - last.stripe_chunks,
            ),
            (
                &self.stripe_redone,
                &totals.stripe_redone,
                now.stripe_redone - last.stripe_redone,
            ),
            (
                &self.striped_bytes,
                &totals.striped_bytes,
                now.striped_bytes - last.striped_bytes,
            ),
        ];
        for (counter, total, delta) in pairs {
            if delta > 0 {
                counter.increment(delta);
                total.fetch_add(delta, Ordering::Relaxed);
            }
        }
        totals
            .peak_in_flight_bytes
            .fetch_max(now.peak_in_flight_bytes, Ordering::Relaxed);
    }
}

/// Counters of one I/O thread (summed over a transport's threads by
/// [`crate::Transport::rdma_stats`]).
#[derive(Debug, Default)]
pub(crate) struct IoStats {
    pub(crate) qps_open: AtomicU64,
    pub(crate) sockets_open: AtomicU64,
    pub(crate) bytes_sent: AtomicU64,
    pub(crate) bytes_received: AtomicU64,
    pub(crate) messages_sent: AtomicU64,
    pub(crate) messages_received: AtomicU64,
    pub(crate) credit_stalls: AtomicU64,
    pub(crate) window_stalls: AtomicU64,
    pub(crate) keepalives_sent: AtomicU64,
    pub(crate) offered_sends: AtomicU64,
    pub(crate) stripe_chunks: AtomicU64,
    pub(crate) stripe_redone: AtomicU64,
    pub(crate) striped_bytes: AtomicU64,
    pub(crate) keepalive_failures: AtomicU64,
    pub(crate) engines_failed: AtomicU64,
    pub(crate) peak_in_flight_bytes: AtomicU64,
    /// Receives posted on the thread's shared receive queue now.
    pub(crate) shared_receives_posted: AtomicU64,
    /// Rounds the driver ran.
    pub(crate) rounds: AtomicU64,
    /// Engines those rounds visited.
    pub(crate) engine_visits: AtomicU64,
}
