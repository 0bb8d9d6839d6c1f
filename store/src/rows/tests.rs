use super::*;

fn layout(dim: usize, steps: bool) -> RowLayout {
    RowLayout::new(dim, 0, Storage::F32, steps)
}

fn rows(max: Option<u64>, policy: EvictionPolicy) -> ShardRows {
    ShardRows::new(layout(1, policy == EvictionPolicy::Lfu), max, policy)
}

fn put(rows: &ShardRows, key: u64, v: f32) {
    rows.upsert(key, |values, _| values.fill(v), |_, _, _| ())
        .unwrap();
}

#[test]
fn the_row_limit_holds_and_evictions_are_counted() {
    for (max, policy) in [(10u64, EvictionPolicy::Lru), (1000, EvictionPolicy::Lfu)] {
        let rows = rows(Some(max), policy);
        for key in 0..5 * max {
            put(&rows, key, 1.0);
            assert!(rows.len() as u64 <= max, "{} rows, limit {max}", rows.len());
        }
        assert_eq!(rows.evictions(), 5 * max - rows.len() as u64);
    }
    let unlimited = rows(None, EvictionPolicy::Lru);
    for key in 0..10_000 {
        put(&unlimited, key, 0.0);
    }
    assert_eq!(unlimited.len(), 10_000);
    assert_eq!(unlimited.evictions(), 0);
}

#[test]
fn lru_keeps_rows_that_are_read_often() {
    let rows = rows(Some(6400), EvictionPolicy::Lru);
    let hot: Vec<u64> = (0..640).collect();
    for key in &hot {
        put(&rows, *key, 1.0);
    }
    for cold in 1_000_000..1_040_000u64 {
        put(&rows, cold, 0.0);
        // The hot set is read between every few inserts.
        if cold.is_multiple_of(8) {
            for key in &hot {
                rows.read(*key, |_| ());
            }
        }
    }
    let kept = hot
        .iter()
        .filter(|k| rows.read(**k, |_| ()).is_some())
        .count();
    assert!(kept >= 600, "only {kept} of 640 hot rows survived");
}

#[test]
fn lfu_keeps_rows_that_are_updated_often() {
    let rows = rows(Some(640), EvictionPolicy::Lfu);
    for key in 0..64u64 {
        rows.upsert(key, |v, _| v.fill(1.0), |_, _, steps| *steps = 100)
            .unwrap();
    }
    for cold in 1_000..20_000u64 {
        rows.upsert(cold, |v, _| v.fill(0.0), |_, _, steps| *steps = 1)
            .unwrap();
    }
    let kept = (0..64u64)
        .filter(|k| rows.read(*k, |_| ()).is_some())
        .count();
    assert!(
        kept >= 60,
        "only {kept} of 64 frequently updated rows survived"
    );
}

/// The stall of issue 34: the old store's stripes (`IndexMap`) moved every
/// row of a stripe when one insert outgrew it (more than 7,000 rows per
/// stripe past 460,000 rows). Here no insert moves more than the index's
/// bound, at any size.
#[test]
fn no_insert_moves_more_than_a_bounded_number_of_rows_for_a_growth() {
    let rows = ShardRows::new(layout(4, false), None, EvictionPolicy::Lru);
    let mut most = 0;
    for key in 0..600_000u64 {
        put(&rows, key.wrapping_mul(0x2545_f491_4f6c_dd1d), 0.5);
        if key % 10_000 == 9_999 {
            most = most.max(rows.take_most_moved());
        }
    }
    most = most.max(rows.take_most_moved());
    assert!(most > 0, "the index never grew");
    assert!(
        most <= index::MIGRATE_PER_INSERT,
        "an insert moved {most} rows"
    );
    assert_eq!(rows.len(), 600_000);
    for key in (0..600_000u64).step_by(997) {
        let key = key.wrapping_mul(0x2545_f491_4f6c_dd1d);
        assert_eq!(rows.read(key, |r| r.values()), Some(vec![0.5; 4]));
    }
}

#[test]
fn a_snapshot_is_a_cut_while_rows_change_and_go() {
    let rows = ShardRows::new(
        RowLayout::new(2, 2, Storage::F32, true),
        None,
        EvictionPolicy::Lru,
    );
    for key in 0..1000u64 {
        rows.upsert(
            key,
            |v, s| {
                v.fill(key as f32);
                s.fill(1.0);
            },
            |_, _, steps| *steps += 1,
        )
        .unwrap();
    }
    let snapshot = rows.snapshot();
    for key in 0..1000u64 {
        rows.upsert(
            key,
            |_, _| (),
            |v, s, steps| {
                v[0] = -1.0;
                s[1] = -1.0;
                *steps += 1;
            },
        )
        .unwrap();
    }
    for key in 1000..2000u64 {
        put(&rows, key, 3.0);
    }
    for key in 0..10 {
        rows.evict(key);
    }
    assert_eq!(snapshot.len(), 1000);
    let mut seen: Vec<(u64, Vec<f32>, Vec<f32>, u32)> = Vec::new();
    snapshot.for_each_from(0, |r| {
        seen.push((r.key(), r.values(), r.state(), r.steps()));
        true
    });
    seen.sort_by_key(|r| r.0);
    for (key, (k, values, state, steps)) in seen.into_iter().enumerate() {
        assert_eq!(k, key as u64);
        assert_eq!(values, vec![key as f32; 2]);
        assert_eq!(state, vec![1.0; 2]);
        assert_eq!(steps, 1);
    }
    // Reading from an offset gives the same order.
    let keys_from = |skip: usize, n: usize| {
        let mut out = Vec::new();
        snapshot.for_each_from(skip, |r| {
            out.push(r.key());
            out.len() < n
        });
        out
    };
    let all = keys_from(0, usize::MAX);
    assert_eq!(all.len(), 1000);
    // From an offset, in pieces as a copy reads them, and back again.
    assert_eq!(keys_from(371, usize::MAX), all[371..]);
    let mut pieces = Vec::new();
    for start in (0..1000).step_by(100) {
        pieces.extend(keys_from(start, 100));
    }
    assert_eq!(pieces, all);
    assert_eq!(keys_from(5, 3), all[5..8]);
    assert_eq!(rows.len(), 1990);
    drop(snapshot);
    assert_eq!(
        rows.bytes().cut_bytes,
        0,
        "a dropped snapshot's copies are freed"
    );
}

#[test]
fn narrow_storage_rounds_values_and_keeps_the_state_in_bf16() {
    for storage in [Storage::F16, Storage::Bf16] {
        let rows = ShardRows::new(
            RowLayout::new(3, 3, storage, true),
            None,
            EvictionPolicy::Lru,
        );
        rows.upsert(
            7,
            |v, s| {
                v.copy_from_slice(&[0.1, -2.5, 1000.3]);
                s.copy_from_slice(&[0.1, 0.2, 1e-9]);
            },
            |_, _, _| (),
        )
        .unwrap();
        let values = rows.read(7, |r| r.values()).unwrap();
        let expected: Vec<f32> = [0.1f32, -2.5, 1000.3]
            .iter()
            .enumerate()
            .map(|(i, v)| storage.round(7, i, *v))
            .collect();
        assert_eq!(values, expected, "{storage:?}");
        // The state in bf16 whatever the values' format: 1e-9 (below f16's
        // range) survives, within a unit in the last place (2^-7).
        let state = rows.read(7, |r| r.state()).unwrap();
        for (got, want) in state.iter().zip([0.1f32, 0.2, 1e-9]) {
            assert!(
                (got - want).abs() <= want * 2f32.powi(-7),
                "{storage:?}: state {want} stored as {got}"
            );
        }
        let mut le = vec![0u8; 12];
        rows.read(7, |r| r.write_values_le(&mut le));
        let back: Vec<f32> = le
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(back, expected);
    }
}

#[test]
fn rows_swap_between_layouts_of_different_limits() {
    let a = rows(None, EvictionPolicy::Lru);
    let b = rows(Some(640), EvictionPolicy::Lru);
    for key in 0..100 {
        put(&a, key, 1.0);
    }
    for key in 1000..1010 {
        put(&b, key, 2.0);
    }
    a.swap_rows(&b);
    assert_eq!((a.len(), b.len()), (10, 100));
    assert_eq!(a.read(1005, |r| r.values()), Some(vec![2.0]));
    assert_eq!(b.read(5, |r| r.values()), Some(vec![1.0]));
}

/// The largest stripe goes with the rows in a swap (a copy installed
/// whole), so the room check before a Push counts the rows installed.
/// Before, the receiving rows kept their own figure (an empty shard's 0):
/// a Push near the limit passed the check and was refused row by row.
#[test]
fn a_swap_carries_the_largest_stripe_into_the_room_check() {
    let a = rows(None, EvictionPolicy::Lru);
    let b = rows(None, EvictionPolicy::Lru);
    for key in 0..6400 {
        put(&b, key, 1.0);
    }
    let near = super::index::MAX_SLOTS as usize - 50;
    assert!(a.has_room(near) && !b.has_room(near));
    a.swap_rows(&b);
    assert!(!a.has_room(near), "a holds b's rows now");
    assert!(b.has_room(near), "b holds a's empty stripes");
}

/// A Fetch's batched read finds what a key-by-key read finds, in order,
/// with duplicates and missing keys, also while the index grows.
#[test]
fn a_batched_read_agrees_with_reading_key_by_key() {
    let rows = ShardRows::new(layout(2, false), None, EvictionPolicy::Lru);
    let mut draw = 1u64;
    for round in 0..40u64 {
        for key in round * 997..(round + 1) * 997 {
            put(&rows, key, key as f32);
        }
        let keys: Vec<u64> = (0..300)
            .map(|_| {
                draw = tessera_proto::sharding::splitmix64(draw);
                draw % ((round + 2) * 997)
            })
            .chain([5, 5, u64::MAX])
            .collect();
        let mut got = vec![None; keys.len()];
        let mut missing = Vec::new();
        rows.read_many(&keys, |i, r| got[i] = Some(r.values()), &mut missing);
        for (i, &key) in keys.iter().enumerate() {
            let one = rows.read(key, |r| r.values());
            assert_eq!(got[i], one, "key {key} (round {round})");
            assert_eq!(missing.contains(&i), one.is_none());
        }
        assert!(missing.windows(2).all(|w| w[0] < w[1]), "in order");
    }
}

/// A Push applied stripe by stripe ([`ShardRows::upsert_many`]) leaves the
/// rows a row-by-row Push leaves: new and old keys, a key repeated in
/// one Push (its updates in order), narrow storage rounded alike.
#[test]
fn upsert_many_is_upserting_each_row_in_order() {
    for storage in [Storage::F32, Storage::F16] {
        let layout = || RowLayout::new(4, 2, storage, true);
        let (one, many) = (
            ShardRows::new(layout(), None, EvictionPolicy::Lru),
            ShardRows::new(layout(), None, EvictionPolicy::Lru),
        );
        let mut draw = 7u64;
        for push in 0..30u64 {
            let keys: Vec<u64> = (0..200)
                .map(|_| {
                    draw = tessera_proto::sharding::splitmix64(draw);
                    draw % 3_000
                })
                .chain([11, 11, 11])
                .collect();
            let seed = tessera_proto::sharding::splitmix64(push);
            let init = |key: u64, v: &mut [f32], s: &mut [f32]| {
                v.fill(key as f32 * 0.001);
                s.fill(0.5);
            };
            // Not commutative: the order of a key's updates shows.
            let update = |i: usize, v: &mut [f32], s: &mut [f32], steps: &mut u32| {
                *steps += 1;
                for x in v.iter_mut() {
                    *x = *x * 0.9 + i as f32 * 0.01;
                }
                s[0] += v[0];
            };
            for (i, &key) in keys.iter().enumerate() {
                one.upsert_following(
                    key,
                    seed,
                    |v, s| init(key, v, s),
                    |v, s, steps| update(i, v, s, steps),
                )
                .unwrap();
            }
            let refused = many.upsert_many(
                &keys,
                seed,
                |i, v, s| init(keys[i], v, s),
                |i, v, s, steps| update(i, v, s, steps),
            );
            assert_eq!(refused, 0);
        }
        assert_eq!(one.len(), many.len(), "{storage:?}");
        for key in 0..3_000u64 {
            let row = |rows: &ShardRows| rows.read(key, |r| (r.steps(), r.values(), r.state()));
            assert_eq!(row(&one), row(&many), "{storage:?}: key {key}");
        }
    }
}

/// A large shard growing through Pushes opens its stripes' blocks from
/// blocks the Pushes made outside the stripes' locks: none is faulted in
/// while a stripe's Fetches wait (`batch::ShardRows::ready_blocks`).
#[test]
fn a_growing_shard_opens_blocks_made_ahead_of_its_locks() {
    let rows = rows(None, EvictionPolicy::Lru);
    // About 79,700 rows a stripe: two blocks past the mark from which a
    // stripe asks ahead (73,728 records), in Pushes of 1,000 rows.
    let keys: Vec<u64> = (0..5_100_000u64)
        .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .collect();
    for batch in keys.chunks(1000) {
        let refused = rows.upsert_many(batch, 1, |_, v, _| v.fill(0.5), |_, _, _, _| ());
        assert_eq!(refused, 0);
    }
    let ahead: Vec<u64> = (0..rows.stripes.len())
        .map(|i| rows.read_stripe(i).slab.blocks_ahead())
        .collect();
    // Every stripe's block past the mark was made ahead (a stripe asks
    // half a block, 130 Pushes, before it needs one; a Push makes two).
    assert!(ahead.iter().all(|&n| n >= 1), "{ahead:?}");
}

#[test]
fn keys_spread_evenly_over_any_count_of_stripes() {
    // 64 stripes (no limit) and 5 (a limit of 5 x MIN_STRIPE_ROWS): the
    // stripe is scaled from the hash by a multiply, not a remainder, so a
    // count that is no power of two must still spread evenly.
    for (max, stripes) in [(None, STRIPES), (Some(5 * MIN_STRIPE_ROWS as u64), 5)] {
        let rows = rows(max, EvictionPolicy::Lru);
        assert_eq!(rows.stripes.len(), stripes);
        let mut counts = vec![0usize; stripes];
        let keys = 1000 * stripes as u64;
        for key in 0..keys {
            counts[rows.stripe(key.wrapping_mul(0x9e37_79b9_7f4a_7c15))] += 1;
        }
        assert!(
            counts.iter().all(|&n| (850..1150).contains(&n)),
            "{counts:?}"
        );
    }
}
