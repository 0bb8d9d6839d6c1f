//! The parameter-server protocol shared by `ps-server` and `worker`: the
//! messages and stubs generated from `ps.proto`, the key-to-shard function
//! both sides must agree on, and the row encoding of `bytes` value fields.

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
