//! The parameter-server protocol shared by `ps-server` and `worker`: the
//! messages and stubs generated from `ps.proto`, the key-to-shard function
//! both sides must agree on, and the row encoding of `bytes` value fields.

pub mod rows;
pub mod sharding;

/// Messages and stubs of `tessera.ps.v1`, generated from `ps.proto`.
#[allow(missing_docs, clippy::all)]
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/tessera.ps.v1.rs"));
}
