//! A wake-up that is kept until it is taken: what the store signals to a
//! task outside it (a delta stream's sender, woken once a shard's changed
//! keys reach their bound) without depending on an async runtime.
//!
//! Built on `event-listener` (smol-rs; the primitive under `async-lock`
//! and `async-channel`), which works with any executor: the store is used
//! by tokio servers and by plain threads alike and so must not own a
//! runtime's `Notify`. A notification while no task waits is kept as one
//! pending wake, as `tokio::sync::Notify::notify_one` keeps a permit: a
//! sender busy with the last batch when the bound is reached is woken at
//! once when it next waits, not an interval later.

use std::sync::atomic::{AtomicBool, Ordering};

use event_listener::Event;

/// One pending wake-up and the tasks waiting for it (module docs).
#[derive(Debug, Default)]
pub struct Wake {
    pending: AtomicBool,
    event: Event,
}

impl Wake {
    /// Wakes one waiting task, or the next one to wait if none waits now.
    pub fn notify(&self) {
        self.pending.store(true, Ordering::SeqCst);
        self.event.notify(1);
    }

    /// Waits for a notification, taking it: returns at once if one came
    /// while nobody waited.
    pub async fn notified(&self) {
        loop {
            if self.pending.swap(false, Ordering::SeqCst) {
                return;
            }
            // Registered before the second look: a notification between
            // the look and the wait wakes this listener.
            let listener = self.event.listen();
            if self.pending.swap(false, Ordering::SeqCst) {
                return;
            }
            listener.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;

    #[test]
    fn a_notification_with_nobody_waiting_is_kept_for_the_next_wait() {
        let wake = Wake::default();
        assert!(wake.notified().now_or_never().is_none(), "nothing pending");
        wake.notify();
        wake.notify();
        assert!(wake.notified().now_or_never().is_some(), "kept");
        assert!(
            wake.notified().now_or_never().is_none(),
            "one pending wake, however many notifications"
        );
    }

    #[test]
    fn a_waiting_task_is_woken_from_another_thread() {
        let wake = std::sync::Arc::new(Wake::default());
        let notifier = {
            let wake = std::sync::Arc::clone(&wake);
            std::thread::spawn(move || wake.notify())
        };
        futures::executor::block_on(wake.notified());
        assert!(notifier.join().is_ok());
    }
}
