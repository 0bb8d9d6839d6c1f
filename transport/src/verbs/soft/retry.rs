//! The soft NIC's retry engine: SENDs that met a receiver-not-ready NAK
//! are retried here, off the posting thread, as an RNIC's hardware retries
//! them while the posting thread goes on.
//!
//! A QP whose SEND (or WRITE with immediate) finds no receive posted, and
//! whose `rnr_retry` allows retries, keeps that work request and every one
//! posted after it (RC order) in its stall queue, and registers with the
//! engine. One thread per process (started on the first stall, parked
//! while no QP is stalled) retries each stalled QP every [`RNR_BACKOFF`]
//! until its head lands, fails for good (its retries are spent: the QP
//! fails with `ReceiverNotReady`), or the QP leaves RTS (the rest flush).
//! Completions it makes go to the QP's send CQ with a wake-up, since the
//! owner did not make them.
//!
//! Work requests a busy link holds (`port.rs`) wait here too, in the same
//! order; they never fail for waiting. While every stalled QP waits on a
//! link, the thread sleeps until the first link frees (at most
//! [`LINK_WAIT_MAX`]), not a pass every 20 µs.
//!
//! Before, the posting thread slept and retried itself, for up to 500 ms:
//! under `polling = "runtime"` that thread is a runtime worker, and a
//! receiver whose repost waited on that runtime never came.

use crate::sync::LockExt;
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::Duration;

use super::qp::{Left, SoftQpInner};

/// Wait between two passes over the stalled QPs.
pub(crate) const RNR_BACKOFF: Duration = Duration::from_micros(20);

/// Longest sleep while every stalled QP waits on a link: a registration
/// wakes the thread anyway, and bookings by other processes can move a
/// link's free time.
const LINK_WAIT_MAX: Duration = Duration::from_millis(1);

/// Stalled QPs, and the retry thread's wake-up.
struct Engine {
    stalled: Mutex<Vec<Weak<SoftQpInner>>>,
    wake: Condvar,
    /// Whether the retry thread started.
    running: bool,
    /// Registrations so far (a pass that saw none since its start may
    /// sleep until a link frees).
    registrations: std::sync::atomic::AtomicU64,
}

fn engine() -> &'static Engine {
    static ENGINE: OnceLock<Engine> = OnceLock::new();
    ENGINE.get_or_init(|| {
        let started = std::thread::Builder::new()
            .name("tessera-soft-rnr".into())
            .spawn(run);
        if let Err(err) = &started {
            // Posts then retry in their own thread, as before (see
            // `register`); said once.
            tracing::warn!(%err, "the soft NIC's retry thread did not start");
        }
        Engine {
            stalled: Mutex::new(Vec::new()),
            wake: Condvar::new(),
            running: started.is_ok(),
            registrations: std::sync::atomic::AtomicU64::new(0),
        }
    })
}

/// Has the engine retry `qp`'s stalled work requests until none is left.
/// Without a retry thread, the caller's thread retries them now, sleeping
/// between tries.
pub(crate) fn register(qp: &Arc<SoftQpInner>) {
    let engine = engine();
    if !engine.running {
        while qp.retry_stalled() != Left::Nothing {
            std::thread::sleep(RNR_BACKOFF);
        }
        return;
    }
    let mut stalled = engine.stalled.locked();
    if !stalled
        .iter()
        .any(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(qp)))
    {
        stalled.push(Arc::downgrade(qp));
    }
    engine
        .registrations
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    engine.wake.notify_one();
}

fn run() {
    let engine = engine();
    let mut registrations;
    loop {
        let batch: Vec<Weak<SoftQpInner>> = {
            let mut stalled = engine.stalled.locked();
            while stalled.is_empty() {
                stalled = engine.wake.wait(stalled).unwrap_or_else(|p| p.into_inner());
            }
            registrations = engine
                .registrations
                .load(std::sync::atomic::Ordering::Relaxed);
            stalled.clone()
        };
        let mut done = Vec::new();
        // The first time a link frees, while every QP left waits on one.
        let mut links_free_at: Option<u64> = None;
        let mut rnr = false;
        for weak in &batch {
            match weak
                .upgrade()
                .map_or(Left::Nothing, |qp| qp.retry_stalled())
            {
                Left::Nothing => done.push(weak.as_ptr()),
                Left::Rnr => rnr = true,
                Left::HeldByLink(at) => {
                    links_free_at = Some(links_free_at.map_or(at, |first| first.min(at)));
                }
            }
        }
        let mut stalled = engine.stalled.locked();
        if !done.is_empty() {
            // A QP that stalled again since its pass registered anew, which
            // put it back (or kept it): only drop those with nothing left.
            stalled.retain(|w| {
                !done.contains(&w.as_ptr()) || w.upgrade().is_some_and(|qp| qp.has_stalled())
            });
        }
        // Registrations come under the lock held here: none since the
        // pass began means none is missed by a longer wait.
        let quiet = engine
            .registrations
            .load(std::sync::atomic::Ordering::Relaxed)
            == registrations;
        let pause = match links_free_at {
            Some(at) if !rnr && quiet => {
                Duration::from_nanos(at.saturating_sub(super::port::now_ns()))
                    .clamp(RNR_BACKOFF, LINK_WAIT_MAX)
            }
            _ => RNR_BACKOFF,
        };
        // A registration in the meantime wakes it.
        drop(
            engine
                .wake
                .wait_timeout(stalled, pause)
                .unwrap_or_else(|p| p.into_inner()),
        );
    }
}
