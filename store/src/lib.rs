//! Tessera's shard engine: everything a parameter server does to the rows
//! of the shards it holds, with no network, no RPC and no async runtime.
//!
//! - [`rows`]: the rows of one (table, shard): records in a slab of
//!   stable slots, a key index, cuts for snapshots, spares, row limits
//!   with eviction, expiry stamps.
//! - [`table`]: one embedding table over its shards' rows: optimizers,
//!   admission, expiry, initializers and the keys changed for a stream.
//! - [`Store`]: every table of a server's shards, each shard behind one
//!   write lock ([`ShardGuard`]) that guards its [`Version`]; Fetch, Push
//!   with exactly-once deduplication ([`dedup`]), expiry, and what a
//!   resize of the shard count does to the shards.
//! - [`image`], [`rowfile`], [`checkpoint`], [`copy_stream`]: a shard's
//!   rows at one cut, as a row file, as a checkpoint on disk, and as the
//!   stream a replica or a serving server copies.
//!
//! `tessera-ps-server` puts the service, replication, coordination, the
//! delta stream and resharding on top. A program that needs the tables
//! without a server (a benchmark, an offline tool) uses this crate alone:
//!
//! ```
//! use tessera_store::config::{StoreConfig, TableConfig};
//! use tessera_store::{PushId, Store};
//!
//! let config = StoreConfig {
//!     tables: vec![TableConfig::new("emb", 4)],
//!     ..StoreConfig::default()
//! };
//! let store = Store::new(&config);
//! let id = PushId { worker: 1, sequence: 1 };
//! // One key's gradient, as little-endian f32s (SGD, learning rate 0.01).
//! let mut grads = Vec::new();
//! tessera_proto::rows::put_f32s(&mut grads, &[1.0; 4]);
//! store.push("emb", 0, &[7], &grads, id)?;
//! let (dim, values) = store.fetch("emb", 0, &[7])?;
//! assert_eq!((dim, values.len()), (4, 4 * 4));
//! # Ok::<(), tessera_store::StoreError>(())
//! ```

pub mod checkpoint;
pub mod config;
pub mod copy_stream;
pub mod dedup;
pub mod image;
pub mod rowfile;
pub mod rows;
pub mod shard_lock;
pub mod store;
pub mod table;
pub mod version;
pub mod wake;

pub use config::{Mode, StoreConfig, TableConfig};
pub use store::{PushId, PushOutcome, ShardGuard, Store, StoreError};
pub use version::Version;
