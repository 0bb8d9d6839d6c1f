//! The runtime driver: a completion queue driven from inside the
//! application's tokio runtime, with no I/O thread (`rdma.polling =
//! "runtime"`).
//!
//! On a host with few cores, a dedicated I/O thread is a hop on every
//! message: the application's task hands a message to the thread, the
//! thread posts it; a completion wakes the thread, the thread wakes the
//! task. Each hop is a context switch, and while the I/O thread spins it
//! takes a core from the tasks it serves. Here instead:
//!
//! - **Sending:** the task that sends runs the worker itself when no one
//!   else is (a `try_lock`): it posts, and handles what the post completed,
//!   on its own thread ([`Worker::send_now`]). Under contention the message
//!   goes through the command queue as before, for whoever holds the
//!   worker.
//! - **Completions:** the completion queue notifies through file
//!   descriptors ([`CompletionQueue::notify_by_fd`]: an eventfd that soft-NIC
//!   peers write, as a real NIC raises an interrupt; the ibverbs completion
//!   channel and a wake-up eventfd), registered with tokio's reactor
//!   ([`AsyncFd`]). A task sleeps on them and on the next engine deadline,
//!   and runs rounds while there is work; what it delivers wakes the
//!   sockets' tasks within the runtime, often on the same worker thread.
//!
//! The arm protocol is the thread driver's: arm, look once more, sleep; a
//! completion or command after the arm makes a descriptor readable.
//!
//! Rounds hold a `std` mutex for as long as they run (they never await);
//! the task gives the runtime a turn between busy rounds (tokio's
//! cooperative budget), so a flood of completions does not starve the
//! tasks on its thread.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::worker::Worker;
use super::{MAX_SLEEP, lock};
use crate::verbs::CompletionQueue;
use crate::verbs::notify::{NotifyFd, register};
use crate::{RdmaError, TransportError};

/// A completion queue's notification descriptors, registered with the
/// runtime's reactor.
pub(super) struct Notifier {
    cq: Arc<dyn CompletionQueue>,
    fds: Vec<NotifyFd>,
}

impl Notifier {
    /// Switches `cq` to notification through descriptors and registers
    /// them with the current runtime.
    pub(super) fn new(cq: &Arc<dyn CompletionQueue>) -> Result<Self, TransportError> {
        // Checked before `notify_by_fd`, so that outside a runtime the
        // queue is not switched to descriptors nobody would watch.
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(TransportError::rdma_error(RdmaError::NoRuntime));
        }
        let raw = cq
            .notify_by_fd()
            .filter(|fds| (1..=2).contains(&fds.len()))
            .ok_or(TransportError::rdma_error(RdmaError::NoNotification))?;
        let fds = raw
            .into_iter()
            .map(register)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| TransportError::rdma_error(RdmaError::NoRuntime))?;
        Ok(Self {
            cq: Arc::clone(cq),
            fds,
        })
    }

    /// Waits until a descriptor turns readable or `deadline` passes, then
    /// consumes the notification.
    async fn wait(&self, deadline: Instant) {
        let first = &self.fds[0];
        let second = self.fds.get(1);
        tokio::select! {
            ready = first.readable() => {
                if let Ok(mut guard) = ready {
                    guard.clear_ready();
                }
            }
            ready = async {
                match second {
                    Some(fd) => fd.readable().await,
                    None => std::future::pending().await,
                }
            } => {
                if let Ok(mut guard) = ready {
                    guard.clear_ready();
                }
            }
            () = tokio::time::sleep_until(deadline.into()) => {}
        }
        // After clearing the readiness: a notification that comes now
        // sets it again, so none is lost.
        self.cq.clear_notification();
    }
}

/// Spawns the task that drives `worker` on the current runtime.
pub(super) fn spawn(worker: Arc<Mutex<Worker>>, notifier: Notifier) -> Result<(), TransportError> {
    let runtime = tokio::runtime::Handle::try_current()
        .map_err(|_| TransportError::rdma_error(RdmaError::NoRuntime))?;
    runtime.spawn(drive(worker, notifier));
    Ok(())
}

/// Runs rounds while there is work, sleeps on the notifier when there is
/// none, until no handle to the worker is left.
async fn drive(worker: Arc<Mutex<Worker>>, notifier: Notifier) {
    loop {
        let (busy, next_timer) = {
            let mut worker = lock(&worker);
            let Some(progress) = worker.round() else {
                return;
            };
            (progress || worker.arm(), worker.next_timer())
        };
        if busy {
            tokio::task::consume_budget().await;
            continue;
        }
        let bound = Instant::now() + MAX_SLEEP;
        notifier
            .wait(next_timer.map_or(bound, |at| at.min(bound)))
            .await;
    }
}
