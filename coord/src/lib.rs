//! Coordination of a Tessera cluster: which server is the primary of each
//! shard, under which epoch, for how long.
//!
//! Tessera does not decide this with a protocol of its own. Agreeing on one
//! primary per shard while servers crash and networks partition is
//! consensus, and an unproven consensus implementation would be the least
//! trustworthy part of the system. It uses **etcd** instead: a
//! Raft-replicated key-value store whose leases (keys that disappear when
//! their holder stops renewing them), transactions (compare-and-swap over
//! several keys) and watches are exactly the primitives leader election is
//! built from; Kubernetes (leader election of its controllers) and Patroni
//! (PostgreSQL high availability: a leader key with a TTL, member keys,
//! the most advanced replica promoted) build theirs the same way. etcd is
//! packaged by Debian (`etcd-server`), runs as one small process on a
//! developer's host or as the three or five members a fleet already runs,
//! and the `etcd-client` crate speaks its v3 API over the tonic and prost
//! versions Tessera already builds on. ZooKeeper would do the same with
//! ephemeral nodes but brings a JVM and has no maintained async Rust
//! client; Consul's sessions are close to etcd's leases but it is a far
//! larger dependency for three primitives.
//!
//! This crate holds what servers, workers and the launcher share: the
//! [`CoordinatorConfig`], the [`keys`] layout and the records stored under
//! them, [`EtcdCoordinator`], a thin client over `etcd-client` for the
//! operations Tessera needs (leases, the campaign transaction, primaries
//! and their watch, members; each call fails over between the etcd
//! members, see `endpoints.rs`), and [`LocalEtcd`], a local etcd of one
//! or three members for a one-host cluster, a test or a drill. The decisions (when to campaign, fencing,
//! recovery) are the ps-server's.
//!
//! The shard map's resize state machine, as etcd stores it and `tessera
//! reshard` moves it (every step a new version, a step out of order
//! refused):
//!
//! ```
//! use tessera_coord::{ResizeState, ShardMap};
//!
//! let map = ShardMap::new(4);
//! let planned = map.plan(8)?;
//! assert_eq!(planned.version, map.version + 1);
//! assert_eq!(planned.resize.as_ref().map(|r| r.state), Some(ResizeState::Planned));
//! assert!(planned.plan(16).is_err(), "one resize at a time");
//! let cancelled = planned.cancel()?;
//! assert_eq!(cancelled.num_shards, 4);
//! # Ok::<(), tessera_coord::ResizeError>(())
//! ```

mod config;
mod endpoints;
mod etcd;
pub mod keys;
mod local;
pub mod shard_map;

pub use config::{CoordinatorConfig, CoordinatorKind};
pub use etcd::{
    CoordError, EtcdCoordinator, LeaseKeepAlive, PrimaryChange, PrimaryWatch, ShardMapWatch,
};
pub use keys::{InStepRecord, MemberRecord, PrimaryRecord};
pub use local::{LocalEtcd, LocalEtcdError, etcd_bin};
pub use shard_map::{Resize, ResizeError, ResizeState, ShardMap};
