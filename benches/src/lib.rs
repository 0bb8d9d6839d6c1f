//! Workloads shared by the `tessera-bench` binaries.

pub mod alloc;
pub mod engine;
pub mod report;
pub mod rpc;
pub mod transport;
