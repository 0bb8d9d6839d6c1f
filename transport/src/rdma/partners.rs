//! Partners: a transport's engines to one peer on each rail, which stripe
//! large messages for each other (`rdma/engine/stripes.rs`).
//!
//! Every engine is set up by a handshake whose hellos carry each
//! transport's *instance*, a random number per transport; engines of this
//! transport to the same peer instance are partners whatever rail, role or
//! address they took (one receive pool per transport, registered on every
//! rail, so a key a peer tells for its rail r is good on any queue pair
//! between the two transports' rail r). As each engine comes up ready it
//! joins its peer's group here, and every member of the group is told,
//! through its I/O driver, the group's engines on the other rails (the
//! newest one of each rail). A member that died is dropped at the next
//! join; until then its partners learn of its death when a chunk handed
//! to it comes back unwritten (its driver checks `alive` first), and stop
//! using its rail.
//!
//! The dialer makes partners: a connection to an address with striping on
//! also dials the address on every other rail that is up
//! (`rdma/rails.rs`), once; the acceptor learns of them by the instance.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::Ordering;

use super::io::{Command, Partner};
use crate::sync::LockExt;

/// Peers remembered at most: past it, groups with no live engine go.
const MAX_PEERS: usize = 4096;

/// The partner groups of one transport (shared by its rails).
#[derive(Debug)]
pub(crate) struct Partners {
    /// This transport's instance, told in every hello (never 0).
    instance: u64,
    /// Rails of the transport.
    rails: usize,
    /// Whether messages are striped at all (several rails, no confinement,
    /// `stripe_min_bytes` above 0, multiplexed engines).
    striping: bool,
    /// Per peer instance, its engines on every rail.
    groups: Mutex<HashMap<u64, Vec<Partner>>>,
}

impl Partners {
    /// The groups of a transport with `rails` rails; `striping` as the
    /// configuration allows it.
    pub(crate) fn new(rails: usize, striping: bool) -> Self {
        Self {
            instance: rand::random::<u64>().max(1),
            rails,
            striping: striping && rails > 1,
            groups: Mutex::new(HashMap::new()),
        }
    }

    /// This transport's instance.
    pub(crate) fn instance(&self) -> u64 {
        self.instance
    }

    /// Rails of the transport.
    pub(crate) fn rails(&self) -> usize {
        self.rails
    }

    /// Whether messages are striped.
    pub(crate) fn striping(&self) -> bool {
        self.striping
    }

    /// A ready engine to peer instance `peer` (0: a peer that does not
    /// say, which has no partners) joins its group; every member is told
    /// its partners anew.
    pub(crate) fn join(&self, peer: u64, engine: Partner) {
        if !self.striping || peer == 0 {
            return;
        }
        let mut groups = self.groups.locked();
        if groups.len() >= MAX_PEERS && !groups.contains_key(&peer) {
            groups.retain(|_, group| group.iter().any(Partner::is_alive));
        }
        let group = groups.entry(peer).or_default();
        group.retain(|member| member.is_alive() && member.qpn_on(engine.rail) != Some(engine.qpn));
        group.push(engine);
        for member in group.iter() {
            // The newest live engine of each other rail.
            let mut others: Vec<Partner> = Vec::new();
            for candidate in group.iter().rev() {
                if candidate.rail != member.rail
                    && candidate.is_alive()
                    && !others.iter().any(|o| o.rail == candidate.rail)
                {
                    others.push(candidate.clone());
                }
            }
            member.io.submit(Command::Partners {
                qpn: member.qpn,
                partners: others,
            });
        }
    }
}

impl Partner {
    /// Whether its engine still runs.
    pub(crate) fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    /// Its QP number if it is on `rail`.
    fn qpn_on(&self, rail: usize) -> Option<u32> {
        (self.rail == rail).then_some(self.qpn)
    }
}
