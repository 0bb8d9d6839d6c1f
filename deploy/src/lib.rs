//! The `tessera` launcher: starts a cluster of ps-server processes on one
//! host ([`Cluster`]), and the end-to-end demo.

pub mod cluster;
pub mod config;
pub mod plan;
pub mod reshard;
pub mod resizing;
pub mod soak;
pub mod status;

pub use cluster::{Cluster, LaunchError, Placement};
pub use config::ClusterConfig;
