//! Workloads shared by the `tessera-bench` binaries.

pub mod admission;
pub mod all;
pub mod alloc;
pub mod echo;
pub mod engine;
pub mod fabric;
pub mod plot;
pub mod ps;
pub mod rails;
pub mod recovery;
pub mod replication;
pub mod report;
pub mod rpc;
pub mod scale;
pub mod store;
pub mod transport;
