//! What a worker keeps for striping (`rdma/engine/stripes.rs`) beyond its
//! engines' lives: where the answers for other engines' chunks go, and the
//! buffers of failed engines that a peer's queue pairs on other rails may
//! still write into.
//!
//! **Routes.** A chunk handed in by another driver's engine (its *origin*)
//! is answered there ([`Routes::answer`]). The route is kept while chunks
//! of that origin are unanswered here, and goes with the last answer or
//! when the origin cancels (it failed). Before, a route was kept from the
//! first chunk for the worker's life: one entry per origin engine that
//! ever striped through it, never freed.
//!
//! **Late writes.** A receiving engine that told its grants' keys on other
//! rails (unconfined striping: those keys are its pool's registrations
//! there, good on any queue pair of that rail) lets the peer's engines on
//! those rails write chunks into the grants, through this transport's
//! engines on those rails to the same peer, its *partners*. When the
//! engine fails or panics, its own queue pair is in error, but the
//! partners' are not, and the peer's other rails may not have learnt of
//! the failure yet. Those buffers are held ([`LateWrites::hold`]) until
//! every partner's queue pair is in error and quiet (its `alive` flag,
//! cleared only after `QueuePair::fail` and, where it has partners,
//! `QueuePair::quiesce`): then no write can reach them through those
//! queue pairs, whatever the peer knows. The partners are those the
//! transport's partner group named for the engine last (`partners.rs`:
//! the newest live engine of each other rail), through which the peer's
//! partners write. A partner that never
//! fails keeps them for as long as it lives; that costs at most the failed
//! engine's granted bytes (`max_granted_bytes` and its offers), counted in
//! `tessera_rdma_late_write_held_bytes`. Before, they were held 5 s, a
//! figure no queue pair's state backed (and a panicked engine's not at
//! all: they went back to the pool at once).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::{Command, IoThread};
use crate::pool::PoolBuf;

/// Where one origin's answers go, and how many it waits for here.
struct Route {
    io: IoThread,
    qpn: u32,
    unanswered: usize,
}

/// The routes of the chunks handed to this worker's engines, by origin.
#[derive(Default)]
pub(super) struct Routes {
    by_origin: HashMap<u64, Route>,
}

impl Routes {
    /// A chunk of `origin` came, to be answered to `reply` (its driver and
    /// QP number).
    pub(super) fn handed_in(&mut self, origin: u64, reply: (IoThread, u32)) {
        let route = self.by_origin.entry(origin).or_insert_with(|| Route {
            io: reply.0.clone(),
            qpn: reply.1,
            unanswered: 0,
        });
        route.io = reply.0;
        route.qpn = reply.1;
        route.unanswered += 1;
    }

    /// Answers chunk `token` of `origin`; the route goes with its last
    /// unanswered chunk. An origin that cancelled has no route: its
    /// answers are dropped (nobody waits for them).
    pub(super) fn answer(&mut self, origin: u64, token: u64, ok: bool) {
        let Some(route) = self.by_origin.get_mut(&origin) else {
            return;
        };
        route.io.submit(Command::StripeDone {
            qpn: route.qpn,
            token,
            ok,
        });
        route.unanswered = route.unanswered.saturating_sub(1);
        if route.unanswered == 0 {
            self.by_origin.remove(&origin);
        }
    }

    /// `origin` failed: its route goes.
    pub(super) fn cancel(&mut self, origin: u64) {
        self.by_origin.remove(&origin);
    }

    /// Origins with a route.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.by_origin.len()
    }
}

/// Buffers held from the pool until no write can land in them.
struct Held {
    /// Kept from the pool while held.
    buffers: Vec<PoolBuf>,
    /// The partners' `alive` flags: held while any is set.
    guards: Vec<Arc<AtomicBool>>,
}

/// The buffers of failed engines held for late writes (module docs).
#[derive(Default)]
pub(super) struct LateWrites {
    held: Vec<Held>,
}

impl LateWrites {
    /// Holds `buffers` (of an engine whose queue pair is in error) while
    /// any of `guards` (its partners' `alive` flags) is set; with none
    /// set, they go back to the pool now.
    pub(super) fn hold(&mut self, buffers: Vec<PoolBuf>, guards: Vec<Arc<AtomicBool>>) {
        let guards: Vec<_> = guards
            .into_iter()
            .filter(|g| g.load(Ordering::Acquire))
            .collect();
        if buffers.is_empty() || guards.is_empty() {
            return;
        }
        let bytes: u64 = buffers.iter().map(|b| b.len() as u64).sum();
        metrics::counter!("tessera_rdma_late_write_holds_total").increment(1);
        metrics::gauge!("tessera_rdma_late_write_held_bytes").increment(bytes as f64);
        tracing::debug!(
            bytes,
            partners = guards.len(),
            "a failed engine's grants are held until its partners' queue pairs are in error"
        );
        self.held.push(Held { buffers, guards });
    }

    /// Lets go of the buffers whose partners are all gone.
    pub(super) fn release(&mut self) {
        self.held.retain(|held| {
            let keep = held.guards.iter().any(|g| g.load(Ordering::Acquire));
            if !keep {
                let bytes: u64 = held.buffers.iter().map(|b| b.len() as u64).sum();
                metrics::gauge!("tessera_rdma_late_write_held_bytes").decrement(bytes as f64);
            }
            keep
        });
    }

    /// The held buffers, as (address, length).
    #[cfg(test)]
    pub(super) fn ranges(&self) -> Vec<(usize, usize)> {
        self.held
            .iter()
            .flat_map(|h| &h.buffers)
            .map(|b| (b.as_ptr() as usize, b.len()))
            .collect()
    }

    /// Buffers held now.
    #[cfg(test)]
    pub(super) fn buffers(&self) -> usize {
        self.held.iter().map(|h| h.buffers.len()).sum()
    }
}
