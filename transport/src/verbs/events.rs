//! Asynchronous events of a device: what it reports outside any work
//! completion (a QP that failed on its own, a CQ that overran, a port that
//! went down, a device that died).
//!
//! Nothing read them before, so a CQ overrun or a port going down went
//! unnoticed until every QP's retries ran out. Now a provider hands each
//! event to a handler ([`super::Device::watch_events`]); the transport
//! fails the engines it concerns at once and counts it
//! (`tessera_rdma_async_events_total{event}`).

use std::sync::Arc;

/// One asynchronous event (`ibv_async_event`, as far as Tessera acts on
/// it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AsyncEvent {
    /// A QP failed outside a completion (`IBV_EVENT_QP_FATAL`,
    /// `_QP_REQ_ERR`, `_QP_ACCESS_ERR`): it is in error.
    QpFailed {
        /// The QP.
        qpn: u32,
    },
    /// A completion queue overran or failed (`IBV_EVENT_CQ_ERR`): every QP
    /// on it is in error.
    CqFailed,
    /// A shared receive queue failed (`IBV_EVENT_SRQ_ERR`): every QP
    /// taking receives from it is stuck.
    SrqFailed,
    /// A port went down (`IBV_EVENT_PORT_ERR`): its QPs cannot reach
    /// anyone until it is back.
    PortDown {
        /// The port.
        port: u8,
    },
    /// A port came (back) up (`IBV_EVENT_PORT_ACTIVE`).
    PortUp {
        /// The port.
        port: u8,
    },
    /// The device failed (`IBV_EVENT_DEVICE_FATAL`): nothing on it works.
    DeviceFailed,
    /// Anything else, by its `ibv_event_type` (counted, not acted on).
    Other {
        /// The event type.
        code: u32,
    },
}

impl AsyncEvent {
    /// A stable label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            AsyncEvent::QpFailed { .. } => "qp_failed",
            AsyncEvent::CqFailed => "cq_failed",
            AsyncEvent::SrqFailed => "srq_failed",
            AsyncEvent::PortDown { .. } => "port_down",
            AsyncEvent::PortUp { .. } => "port_up",
            AsyncEvent::DeviceFailed => "device_failed",
            AsyncEvent::Other { .. } => "other",
        }
    }
}

/// Who hears a device's events (called on the provider's thread).
pub type EventHandler = Arc<dyn Fn(AsyncEvent) + Send + Sync>;

/// A running watch of a device's events: dropping it stops it (the handler
/// is not called after the drop returns).
pub struct EventWatch {
    // In a mutex so that the watch is `Sync` (held in shared runtimes).
    stop: std::sync::Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl EventWatch {
    /// A watch that `stop` ends.
    pub fn new(stop: impl FnOnce() + Send + 'static) -> Self {
        Self {
            stop: std::sync::Mutex::new(Some(Box::new(stop))),
        }
    }
}

impl std::fmt::Debug for EventWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventWatch").finish_non_exhaustive()
    }
}

impl Drop for EventWatch {
    fn drop(&mut self) {
        let stop = self
            .stop
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(stop) = stop {
            stop();
        }
    }
}
