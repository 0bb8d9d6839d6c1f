//! The Tessera worker: a client that fetches embedding rows from, and pushes
//! gradients to, a sharded parameter server ([`PsClient`]), and the load
//! generators of the `worker` binary ([`workload`]).
//!
//! A Fetch and a Push against one in-process server (a real `ps-server`
//! hosting shard 0 of 1 on a loopback port); against a fleet, the
//! `WorkerConfig` lists its servers (`tessera up` writes one as
//! `worker.toml`):
//!
//! ```
//! use tessera_ps_server::{PsServer, PsServerConfig, TableConfig};
//! use tessera_worker::config::ServerEndpoint;
//! use tessera_worker::{PsClient, WorkerConfig};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let server = PsServer::bind(&PsServerConfig {
//!     listen: "127.0.0.1:0".into(),
//!     tables: vec![TableConfig::new("emb", 4)],
//!     ..PsServerConfig::default()
//! })
//! .await?;
//! let address = server.local_addr().to_string();
//! let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
//! let serving = tokio::spawn(server.serve(async move { let _ = stopped.await; }));
//!
//! let client = PsClient::new(&WorkerConfig {
//!     num_shards: 1,
//!     servers: vec![ServerEndpoint { address, shards: vec![0], replica_group: 0 }],
//!     ..WorkerConfig::default()
//! })?;
//! let rows = client.fetch("emb", &[7, 11]).await?;
//! assert_eq!((rows.len(), rows.dim()), (2, 4));
//! // One gradient row per key, applied exactly once however often it is retried.
//! client.push("emb", &[7], &[0.5; 4], 4).await?;
//!
//! let _ = stop.send(());
//! serving.await?;
//! # Ok(())
//! # }
//! ```

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
