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
//! Before, the posting thread slept and retried itself, for up to 500 ms:
//! under `polling = "runtime"` that thread is a runtime worker, and a
//! receiver whose repost waited on that runtime never came.

use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::Duration;

use super::qp::SoftQpInner;

/// Wait between two passes over the stalled QPs.
pub(crate) const RNR_BACKOFF: Duration = Duration::from_micros(20);

/// Stalled QPs, and the retry thread's wake-up.
struct Engine {
    stalled: Mutex<Vec<Weak<SoftQpInner>>>,
    wake: Condvar,
    /// Whether the retry thread started.
    running: bool,
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
        }
    })
}

/// Has the engine retry `qp`'s stalled work requests until none is left.
/// Without a retry thread, the caller's thread retries them now, sleeping
/// between tries.
pub(crate) fn register(qp: &Arc<SoftQpInner>) {
    let engine = engine();
    if !engine.running {
        while qp.retry_stalled() {
            std::thread::sleep(RNR_BACKOFF);
        }
        return;
    }
    let mut stalled = engine.stalled.lock().unwrap_or_else(|p| p.into_inner());
    if !stalled
        .iter()
        .any(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(qp)))
    {
        stalled.push(Arc::downgrade(qp));
    }
    engine.wake.notify_one();
}

fn run() {
    let engine = engine();
    loop {
        let batch: Vec<Weak<SoftQpInner>> = {
            let mut stalled = engine.stalled.lock().unwrap_or_else(|p| p.into_inner());
            while stalled.is_empty() {
                stalled = engine.wake.wait(stalled).unwrap_or_else(|p| p.into_inner());
            }
            stalled.clone()
        };
        let mut done = Vec::new();
        for weak in &batch {
            let still = weak.upgrade().is_some_and(|qp| qp.retry_stalled());
            if !still {
                done.push(weak.as_ptr());
            }
        }
        if !done.is_empty() {
            let mut stalled = engine.stalled.lock().unwrap_or_else(|p| p.into_inner());
            // A QP that stalled again since its pass registered anew, which
            // put it back (or kept it): only drop those with nothing left.
            stalled.retain(|w| {
                !done.contains(&w.as_ptr()) || w.upgrade().is_some_and(|qp| qp.has_stalled())
            });
        }
        std::thread::sleep(RNR_BACKOFF);
    }
}
