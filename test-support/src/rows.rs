//! Keys of a shard and rows as little-endian f32.

use tessera_proto::rows::{get_f32s, put_f32s};
use tessera_proto::sharding::shard_for_key;

/// The first `n` keys (counting from 0) of `shard` among `num_shards`.
pub fn keys_of_shard(shard: u32, num_shards: u32, n: usize) -> Vec<u64> {
    (0..)
        .filter(|&k| shard_for_key(k, num_shards) == shard)
        .take(n)
        .collect()
}

/// `values` as little-endian f32 bytes.
pub fn wire(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    put_f32s(&mut out, values);
    out
}

/// Little-endian f32 bytes as values.
pub fn f32s(bytes: &[u8]) -> Vec<f32> {
    let mut out = vec![0f32; bytes.len() / 4];
    assert!(get_f32s(bytes, &mut out), "not a whole number of f32");
    out
}
