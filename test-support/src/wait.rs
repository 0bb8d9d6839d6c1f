//! Waiting in a test for something another task or process does: poll a
//! probe until it holds, and fail the test, naming what never happened and
//! the last thing the probe saw, once a deadline passes. One helper instead
//! of a deadline, an `assert!` and a `sleep` written out in every test.
//!
//! - [`eventually`] / [`eventually_blocking`]: the probe is a closure that
//!   answers `Ok(value)` once the condition holds, or `Err(what it saw)`.
//! - [`Waiting`]: for a loop that must act between looks (push, then
//!   look), where a closure cannot hold the loop's state: the loop calls
//!   [`Waiting::tick`] where it would have slept.
//!
//! Polling, not a signal: these wait on other processes and servers that
//! offer no notification a test could subscribe to. A test that can wait
//! on a signal (a channel, a `Notify`, a watch) does that instead.

use std::fmt::Debug;
use std::future::Future;
use std::time::{Duration, Instant};

/// How often a probe is asked again: short beside every deadline the
/// suite uses (seconds), long enough not to busy a 2-core machine.
pub const POLL: Duration = Duration::from_millis(20);

/// Asks `probe` every [`POLL`] until it answers `Ok`, and returns that
/// value; panics with `what` and the last `Err` once `within` has passed.
pub async fn eventually<T, E, F, Fut>(within: Duration, what: &str, mut probe: F) -> T
where
    E: Debug,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let mut waiting = Waiting::new(within, what);
    loop {
        match probe().await {
            Ok(value) => return value,
            Err(seen) => waiting.tick(seen).await,
        }
    }
}

/// [`eventually`] for a test without a runtime: the thread sleeps
/// between looks.
pub fn eventually_blocking<T, E, F>(within: Duration, what: &str, mut probe: F) -> T
where
    E: Debug,
    F: FnMut() -> Result<T, E>,
{
    let mut waiting = Waiting::new(within, what);
    loop {
        match probe() {
            Ok(value) => return value,
            Err(seen) => waiting.tick_blocking(seen),
        }
    }
}

/// A deadline for a loop that acts between its looks (module docs).
#[derive(Debug)]
pub struct Waiting {
    what: String,
    within: Duration,
    deadline: Instant,
    looks: u64,
}

impl Waiting {
    /// Starts waiting for `what`, for at most `within`.
    pub fn new(within: Duration, what: &str) -> Self {
        Self {
            what: what.to_owned(),
            within,
            deadline: Instant::now() + within,
            looks: 0,
        }
    }

    /// Whether the deadline has passed.
    pub fn expired(&self) -> bool {
        Instant::now() >= self.deadline
    }

    /// The condition did not hold at this look, which saw `seen`: panics
    /// if the deadline has passed, else waits [`POLL`].
    pub async fn tick(&mut self, seen: impl Debug) {
        self.check(&seen);
        tokio::time::sleep(POLL).await;
    }

    /// [`Waiting::tick`] on a thread without a runtime.
    pub fn tick_blocking(&mut self, seen: impl Debug) {
        self.check(&seen);
        std::thread::sleep(POLL);
    }

    fn check(&mut self, seen: &dyn Debug) {
        self.looks += 1;
        assert!(
            !self.expired(),
            "{} did not happen within {:?} ({} looks); the last look saw {seen:?}",
            self.what,
            self.within,
            self.looks
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[tokio::test]
    async fn returns_the_value_once_the_probe_holds() {
        let looks = AtomicU32::new(0);
        let got = eventually(Duration::from_secs(5), "three looks", || async {
            match looks.fetch_add(1, Ordering::SeqCst) {
                n if n >= 2 => Ok(n),
                n => Err(n),
            }
        })
        .await;
        assert_eq!(got, 2);
    }

    #[test]
    fn fails_naming_what_and_the_last_look() {
        let failed = std::panic::catch_unwind(|| {
            eventually_blocking(Duration::ZERO, "the impossible", || {
                Err::<(), _>("still not")
            })
        });
        let message = failed
            .err()
            .and_then(|p| p.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        assert!(message.contains("the impossible"), "{message}");
        assert!(message.contains("still not"), "{message}");
    }
}
