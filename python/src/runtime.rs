//! The process-wide tokio runtime every client's calls run on, shared by
//! the blocking API and the asyncio one (pyo3-async-runtimes' runtime, so
//! that `await client.fetch(...)` and `client.fetch(...)` drive the same
//! connections).
//!
//! A tokio runtime does not survive `fork`: the child has the runtime's
//! memory but none of its threads. A client made before a fork, or any
//! client in a child of a process that had used one, would hang; both
//! raise an error that says so instead ([`check_process`]).

use std::sync::OnceLock;

use tokio::runtime::Runtime;

/// The process that started the runtime.
static STARTED_IN: OnceLock<u32> = OnceLock::new();

/// The runtime, started on first use.
pub(crate) fn get() -> Result<&'static Runtime, ForkedError> {
    let pid = std::process::id();
    let started_in = *STARTED_IN.get_or_init(|| pid);
    check_process(started_in)?;
    Ok(pyo3_async_runtimes::tokio::get_runtime())
}

/// Refuses to run in a process other than `owner` (a forked child).
pub(crate) fn check_process(owner: u32) -> Result<(), ForkedError> {
    let now = std::process::id();
    if now == owner {
        Ok(())
    } else {
        Err(ForkedError { owner, now })
    }
}

/// Tessera was used in process `owner` and is now called in its forked
/// child `now`.
#[derive(Debug, thiserror::Error)]
#[error(
    "tessera's runtime belongs to process {owner}, and this is its forked child {now}: \
     create clients only in processes that have not inherited one (multiprocessing's \
     'spawn' or 'forkserver' start method, or fork before the first client)"
)]
pub(crate) struct ForkedError {
    owner: u32,
    now: u32,
}
