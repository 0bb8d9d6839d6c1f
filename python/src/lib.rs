//! `tessera._native`: the worker's [`tessera_worker::PsClient`] for Python.
//!
//! The Python package (`python/tessera/`) wraps this module: it turns any
//! integer key array into `uint64`, reads configuration files and dicts,
//! and defines the exceptions. This module does the rest: a Fetch or Push
//! is planned with the interpreter lock held (the keys and gradients are
//! read straight out of the NumPy arrays into the per-shard sub-requests),
//! then the lock is released while the calls run on a process-wide tokio
//! runtime (`runtime.rs`); answers become NumPy arrays without a second copy
//! (`arrays.rs`). Errors become the package's exceptions (`errors.rs`).
//!
//! Why PyO3, rust-numpy and pyo3-async-runtimes rather than a C API by
//! hand: they are the maintained bindings (reference counting, the
//! interpreter lock, NumPy's array API and asyncio futures are exactly
//! where hand-written glue goes wrong), and maturin builds the abi3 wheel.

mod arrays;
mod client;
mod errors;
mod runtime;

use pyo3::prelude::*;

/// The native part of the `tessera` package (use `tessera.Client`).
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<client::Client>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
