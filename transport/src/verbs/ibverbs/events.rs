//! The device's asynchronous events, read on a thread of their own from
//! the context's async fd and handed to the transport's handler.

#[allow(clippy::wildcard_imports)]
use super::*;

/// `ibv_async_event` with its type as a plain integer: rdma-sys types it as
/// a Rust enum, and a type a newer library reports would be an invalid
/// value of it. Same layout (the enum is `repr(u32)`).
#[repr(C)]
pub(super) struct RawAsyncEvent {
    pub(super) element: ibv_async_event_element_t,
    pub(super) event_type: u32,
}

/// Reads `ctx`'s asynchronous events until `stop`, handing each to
/// `handler` (after acknowledging it: a QP or CQ cannot be destroyed while
/// one of its events is unacknowledged).
pub(super) fn watch_async_events(
    ctx: &Context,
    fd: i32,
    stop: &std::sync::atomic::AtomicBool,
    handler: &(dyn Fn(crate::verbs::AsyncEvent) + Send + Sync),
) {
    use crate::verbs::AsyncEvent;
    while !stop.load(std::sync::atomic::Ordering::Acquire) {
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd; a bounded wait.
        let ready = unsafe { libc::poll(&mut pfd, 1, 100) };
        if ready <= 0 {
            continue;
        }
        if pfd.revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0 {
            // A broken descriptor stays ready: back off instead of spinning.
            std::thread::sleep(std::time::Duration::from_millis(100));
            continue;
        }
        // SAFETY: plain data; zeroed is a valid value of both fields.
        let mut raw: RawAsyncEvent = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open (held by `ctx`); `raw` has the layout
        // of `ibv_async_event`.
        let rc = unsafe { ibv_get_async_event(ctx.ctx, (&mut raw as *mut RawAsyncEvent).cast()) };
        if rc != 0 {
            // Nothing to read after all (or a failing read): back off.
            std::thread::sleep(std::time::Duration::from_millis(10));
            continue;
        }
        // SAFETY: the union member read is the one the event type says the
        // library filled; a QP stays alive until its event is acknowledged.
        let event = unsafe {
            match raw.event_type {
                1..=3 => AsyncEvent::QpFailed {
                    qpn: (*raw.element.qp).qp_num,
                },
                0 => AsyncEvent::CqFailed,
                14 => AsyncEvent::SrqFailed,
                8 => AsyncEvent::DeviceFailed,
                9 => AsyncEvent::PortUp {
                    port: u8::try_from(raw.element.port_num).unwrap_or(0),
                },
                10 => AsyncEvent::PortDown {
                    port: u8::try_from(raw.element.port_num).unwrap_or(0),
                },
                code => AsyncEvent::Other { code },
            }
        };
        // SAFETY: the event was returned by ibv_get_async_event above and
        // is acknowledged once.
        unsafe { ibv_ack_async_event((&mut raw as *mut RawAsyncEvent).cast()) };
        handler(event);
    }
}
