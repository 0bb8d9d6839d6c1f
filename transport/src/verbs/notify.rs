//! Completion notification through file descriptors, registered with
//! tokio's reactor: what a driver inside the async runtime sleeps on
//! ([`super::CompletionQueue::notify_by_fd`]).

use std::os::fd::OwnedFd;

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

/// A queue's notification descriptor, registered for readability with the
/// current runtime's reactor.
pub type NotifyFd = AsyncFd<OwnedFd>;

/// Registers `fd` with the current runtime's reactor, for readability.
/// Fails, instead of panicking as tokio would, outside a runtime or in one
/// whose I/O driver is off.
pub fn register(fd: OwnedFd) -> std::io::Result<NotifyFd> {
    let no_reactor = || {
        std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "no tokio runtime with I/O enabled",
        )
    };
    if tokio::runtime::Handle::try_current().is_err() {
        return Err(no_reactor());
    }
    // tokio panics when the runtime's I/O driver is off: that panic is
    // this function's error.
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        // SAFETY: the `AsyncFd` owns `fd` (an `OwnedFd`) until it is
        // dropped or taken back, so the descriptor stays open and names
        // the same open file description for its whole life, and
        // `OwnedFd::as_raw_fd` always returns that one descriptor.
        unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
    }))
    .map_err(|_| no_reactor())?
    .map_err(std::io::Error::from)
}
