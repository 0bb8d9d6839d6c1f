//! Which shard a key lives on.
//!
//! `shard = jump_consistent_hash(splitmix64(key), num_shards)`.
//!
//! SplitMix64's finaliser spreads keys that differ in few bits (sequential
//! ids) evenly; Lamping & Veach's jump consistent hash then maps the 64-bit
//! value to a shard so that growing from n to n+1 shards moves only 1/(n+1)
//! of the keys. Both are pure integer functions with no seed: this mapping
//! must never change between versions, or a cluster would read its rows
//! from the wrong shards. A test pins known key -> shard pairs.

/// SplitMix64's output function (Steele, Lea & Flood), a bijection on u64.
pub const fn splitmix64(key: u64) -> u64 {
    let mut z = key.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Lamping & Veach's jump consistent hash: a bucket in `0..buckets`.
/// `buckets` of 0 is treated as 1.
pub fn jump_consistent_hash(mut key: u64, buckets: u32) -> u32 {
    if buckets <= 1 {
        // The loop below ends after one step with 0; a server checks every
        // key of every request, so the one-shard case skips its division.
        return 0;
    }
    let buckets = i64::from(buckets);
    let mut b: i64 = -1;
    let mut j: i64 = 0;
    while j < buckets {
        b = j;
        key = key.wrapping_mul(2_862_933_555_777_941_757).wrapping_add(1);
        // (b + 1) * 2^31 / ((key >> 33) + 1), in floating point as published.
        j = (((b + 1) as f64) * ((1u64 << 31) as f64 / (((key >> 33) + 1) as f64))) as i64;
    }
    // 0 <= b < buckets <= u32::MAX.
    b as u32
}

/// The replica group holding the primary of `shard` when the model has
/// `replica_groups` groups: `shard % replica_groups`, spreading primaries
/// (and so Push load) over the groups. Servers and workers must agree on
/// it, so both call this.
pub fn primary_group(shard: u32, replica_groups: u32) -> u32 {
    shard % replica_groups.max(1)
}

/// The shard of `key` among `num_shards` shards.
pub fn shard_for_key(key: u64, num_shards: u32) -> u32 {
    if num_shards <= 1 {
        return 0;
    }
    jump_consistent_hash(splitmix64(key), num_shards)
}

#[cfg(test)]
mod tests {
    #[test]
    fn primaries_rotate_over_the_replica_groups() {
        let groups: Vec<u32> = (0..6).map(|shard| primary_group(shard, 3)).collect();
        assert_eq!(groups, [0, 1, 2, 0, 1, 2]);
        assert_eq!(primary_group(7, 1), 0);
        assert_eq!(primary_group(7, 0), 0, "no groups configured: group 0");
    }

    use super::*;
    use proptest::prelude::*;

    #[test]
    fn mapping_is_pinned() {
        // Computed by an independent implementation (Python) of the same
        // published functions. These pairs must never change: a change would move rows between
        // shards of a running cluster.
        let pinned: [(u64, u32, u32); 8] = [
            (0, 4, 3),
            (1, 4, 3),
            (2, 4, 0),
            (42, 4, 0),
            (1_000_003, 4, 0),
            (u64::MAX, 4, 3),
            (42, 16, 0),
            (123_456_789, 300, 295),
        ];
        for (key, shards, expected) in pinned {
            assert_eq!(
                shard_for_key(key, shards),
                expected,
                "key {key} of {shards} shards"
            );
        }
        assert_eq!(splitmix64(0), 0xe220_a839_7b1d_cdaf);
    }

    #[test]
    fn keys_spread_evenly() {
        let mut counts = [0u32; 8];
        for key in 0..80_000u64 {
            counts[shard_for_key(key, 8) as usize] += 1;
        }
        for count in counts {
            assert!((9_000..11_000).contains(&count), "{counts:?}");
        }
    }

    proptest! {
        #[test]
        fn shard_is_in_range_and_growth_only_moves_keys_to_the_new_shard(key in any::<u64>(), n in 1u32..500) {
            let before = shard_for_key(key, n);
            let after = shard_for_key(key, n + 1);
            prop_assert!(before < n);
            prop_assert!(after == before || after == n);
        }
    }
}
