//! Workloads shared by the `tessera-bench` binaries.

pub mod alloc;
pub mod engine;
pub mod transport;
