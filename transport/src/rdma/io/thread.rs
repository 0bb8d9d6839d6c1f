//! The thread driver: a dedicated I/O thread runs a [`Worker`]'s rounds,
//! for hosts with cores to spare for it.
//!
//! In `event` mode a thread that finds nothing to do keeps polling for
//! `spin_us` (the answer to what it just sent often comes within it),
//! then arms its CQ and sleeps until a completion (from any process, for
//! the soft NIC) or a command wakes it, or the next keepalive is due: an
//! idle server uses no CPU. In `busy` mode it never sleeps.

use std::time::{Duration, Instant};

use super::MAX_SLEEP;
use super::worker::Worker;
use crate::Polling;

/// Runs `worker` on this thread until no handle to it is left.
pub(super) fn run(mut worker: Worker, polling: Polling, spin: Duration) {
    let mut idle_rounds: u32 = 0;
    let mut last_work = Instant::now();
    loop {
        let Some(progress) = worker.round() else {
            return;
        };
        let now = Instant::now();
        if progress {
            idle_rounds = 0;
            last_work = now;
            continue;
        }
        idle_rounds = idle_rounds.wrapping_add(1);
        let spinning = match polling {
            // Never sleeps; yields the core every few empty rounds, so the
            // application threads it serves (which must run for anything
            // to happen) are not kept waiting for a time slice.
            Polling::Busy => true,
            // Keeps polling a moment after activity (the answer to what
            // was just sent often comes within it), then sleeps.
            _ => now.saturating_duration_since(last_work) < spin,
        };
        if spinning {
            if idle_rounds.is_multiple_of(16) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            continue;
        }
        // Sleep: arm, look once more, then wait.
        if worker.arm() {
            continue;
        }
        let now = Instant::now();
        let sleep = worker
            .next_timer()
            .map_or(MAX_SLEEP, |at| at.saturating_duration_since(now))
            .min(MAX_SLEEP);
        if !sleep.is_zero() {
            worker.cq().wait(sleep);
        }
    }
}
