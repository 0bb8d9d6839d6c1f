//! The `tessera` launcher: starts a cluster of ps-server processes on one
//! host ([`Cluster`]), and the end-to-end demo.
//!
//! Most users run the `tessera` binary (`tessera up --config FILE`); the
//! library reads the same cluster description (`deploy/local/*.toml`):
//!
//! ```
//! use tessera_config::Validate;
//! use tessera_deploy::config::ClusterConfig;
//!
//! let cluster: ClusterConfig = toml::from_str(
//!     "num_shards = 2\nreplica_groups = 2\n[[tables]]\nname = \"emb\"\ndim = 16\n",
//! )?;
//! cluster.validate()?;
//! assert_eq!(cluster.servers(), 4);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod cluster;
pub mod config;
pub mod plan;
pub mod reshard;
pub mod resizing;
pub mod soak;
pub mod status;

pub use cluster::{Cluster, LaunchError, Placement};
pub use config::ClusterConfig;
