//! The parameter-server protocol shared by `ps-server` and `worker`: the
//! messages and stubs generated from `ps.proto`, the key-to-shard function
//! both sides must agree on, and the row encoding of `bytes` value fields.
//!
//! Which shard a key lives on, and a row as a `bytes` field carries it:
//!
//! ```
//! use tessera_proto::rows::{get_f32s, put_f32s};
//! use tessera_proto::sharding::shard_for_key;
//!
//! // Every worker and server computes the same shard for a key.
//! let shard = shard_for_key(42, 4);
//! assert!(shard < 4);
//! assert_eq!(shard, shard_for_key(42, 4));
//!
//! let mut bytes = Vec::new();
//! put_f32s(&mut bytes, &[1.0, -2.5]);
//! let mut row = [0f32; 2];
//! assert!(get_f32s(&bytes, &mut row));
//! assert_eq!(row, [1.0, -2.5]);
//! ```

pub mod rows;
pub mod sharding;

/// Push sequences a server remembers below a worker's highest one (per
/// shard): a Push retried under an id this far below the newest it has
/// seen from the worker cannot be told applied or not, and is refused.
/// Workers keep the ids they have in flight within half of it.
pub const DEDUP_WINDOW: u64 = 1024;

/// Messages and stubs of `tessera.ps.v1`, generated from `ps.proto`
/// (the `stubs` feature, on by default).
#[cfg(feature = "stubs")]
#[allow(missing_docs, clippy::all)]
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/tessera.ps.v1.rs"));
}
