//! The Tessera worker: a client that fetches embedding rows from, and pushes
//! gradients to, a sharded parameter server ([`PsClient`]), and the load
//! generators of the `worker` binary ([`workload`]).

pub mod admin;
pub mod client;
pub mod config;
pub mod freshness;
pub mod plan;
pub mod primary;
pub mod push;
pub mod routing;
pub mod spread;
pub mod workload;

pub use admin::WorkerAdminService;
pub use client::{FetchSpec, PlannedFetch, PlannedPush, PsClient, PushSpec, Rows, WorkerError};
pub use config::{ServerEndpoint, WorkerConfig, WorkloadConfig};
pub use push::{PartFailure, PushFailure, PushId, SpecError};
