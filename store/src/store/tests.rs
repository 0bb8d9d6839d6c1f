use super::*;
use crate::config::{Initializer, OptimizerConfig, TableConfig};
use tessera_proto::rows::{get_f32s, put_f32s};

const NO_ID: PushId = PushId {
    worker: 0,
    sequence: 0,
};

pub(super) fn config(mode: Mode) -> StoreConfig {
    StoreConfig {
        mode,
        num_shards: 2,
        shards: vec![0, 1],
        tables: vec![TableConfig {
            optimizer: OptimizerConfig::sgd(0.5),
            initializer: Initializer::Uniform { scale: 0.1 },
            ..TableConfig::new("t", 3)
        }],
        ..StoreConfig::default()
    }
}

pub(super) fn keys_of_shard(shard: u32, n: usize) -> Vec<u64> {
    (0..)
        .filter(|&k| shard_for_key(k, 2) == shard)
        .take(n)
        .collect()
}

pub(super) fn decode(bytes: &[u8]) -> Vec<f32> {
    let mut out = vec![0f32; bytes.len() / 4];
    assert!(get_f32s(bytes, &mut out));
    out
}

#[test]
fn training_fetch_initialises_deterministically_and_stores() {
    let a = Store::new(&config(Mode::Training));
    let b = Store::new(&config(Mode::Training));
    let keys = keys_of_shard(1, 4);
    let (dim, rows_a) = a.fetch("t", 1, &keys).unwrap();
    let (_, rows_b) = b.fetch("t", 1, &keys).unwrap();
    assert_eq!(dim, 3);
    assert_eq!(rows_a, rows_b, "two replicas initialise identically");
    let values = decode(&rows_a);
    assert!(values.iter().all(|v| (-0.1..0.1).contains(v)), "{values:?}");
    assert!(values.iter().any(|v| *v != 0.0));
    assert_ne!(values[0..3], values[3..6], "rows differ by key");
    assert_eq!(a.tables().map(Table::rows).sum::<u64>(), 4);
    // A second fetch reads the stored rows.
    assert_eq!(a.fetch("t", 1, &keys).unwrap().1, rows_a);
}

#[test]
fn other_seed_or_table_gives_other_rows() {
    let mut other = config(Mode::Training);
    other.seed = 7;
    let keys = keys_of_shard(0, 1);
    let a = Store::new(&config(Mode::Training))
        .fetch("t", 0, &keys)
        .unwrap()
        .1;
    let b = Store::new(&other).fetch("t", 0, &keys).unwrap().1;
    assert_ne!(a, b);
}

#[test]
fn inference_fetch_returns_zeros_without_storing_and_refuses_push() {
    let store = Store::new(&config(Mode::Inference));
    let keys = keys_of_shard(0, 2);
    let (_, rows) = store.fetch("t", 0, &keys).unwrap();
    assert_eq!(decode(&rows), vec![0.0; 6]);
    assert_eq!(store.tables().map(Table::rows).sum::<u64>(), 0);
    assert_eq!(
        store.push("t", 0, &keys, &[0u8; 24], NO_ID),
        Err(StoreError::InferenceMode)
    );
}

#[test]
fn a_fetch_of_new_keys_with_repeats_stores_each_once_and_answers_as_stored() {
    let store = Store::new(&config(Mode::Training));
    let keys = keys_of_shard(0, 3);
    let asked = [keys[0], keys[1], keys[0], keys[2], keys[1]];
    let (_, first) = store.fetch("t", 0, &asked).unwrap();
    assert_eq!(store.tables().map(Table::rows).sum::<u64>(), 3);
    assert_eq!(
        first[0..12],
        first[24..36],
        "a repeated new key reads one row"
    );
    assert_eq!(first[12..24], first[48..60]);
    // What was answered is what was stored, and what a fresh store answers
    // key by key.
    assert_eq!(store.fetch("t", 0, &asked).unwrap().1, first);
    let one_by_one: Vec<u8> = asked
        .iter()
        .flat_map(|&k| {
            Store::new(&config(Mode::Training))
                .fetch("t", 0, &[k])
                .unwrap()
                .1
        })
        .collect();
    assert_eq!(one_by_one, first);
}

#[test]
fn fetch_returns_rows_in_request_order_with_duplicates() {
    let store = Store::new(&config(Mode::Training));
    let keys = keys_of_shard(0, 2);
    let (_, single) = store.fetch("t", 0, &keys).unwrap();
    let (_, mixed) = store.fetch("t", 0, &[keys[1], keys[0], keys[1]]).unwrap();
    assert_eq!(mixed[0..12], single[12..24]);
    assert_eq!(mixed[12..24], single[0..12]);
    assert_eq!(mixed[24..36], single[12..24]);
}

#[test]
fn sgd_numerics_match_hand_computation() {
    let store = Store::new(&config(Mode::Training));
    let key = keys_of_shard(0, 1)[0];
    let before = decode(&store.fetch("t", 0, &[key]).unwrap().1);
    let grads = [1.0f32, -2.0, 0.25];
    let mut wire = Vec::new();
    put_f32s(&mut wire, &grads);
    assert_eq!(store.push("t", 0, &[key], &wire, NO_ID).unwrap().applied, 1);
    let after = decode(&store.fetch("t", 0, &[key]).unwrap().1);
    // lr = 0.5: w' = w - 0.5 * g
    let expected = [before[0] - 0.5, before[1] + 1.0, before[2] - 0.125];
    assert_eq!(after, expected);
    // Pushing the same key twice in one request applies both.
    let mut twice = Vec::new();
    put_f32s(&mut twice, &[1.0, 1.0, 1.0, 1.0, 1.0, 1.0]);
    store.push("t", 0, &[key, key], &twice, NO_ID).unwrap();
    let again = decode(&store.fetch("t", 0, &[key]).unwrap().1);
    assert_eq!(
        again,
        [expected[0] - 1.0, expected[1] - 1.0, expected[2] - 1.0]
    );
}

#[test]
fn push_to_a_missing_row_starts_from_its_initial_value() {
    let store = Store::new(&config(Mode::Training));
    let key = keys_of_shard(1, 1)[0];
    let init = store.tables().next().unwrap().initial_row(key);
    let mut wire = Vec::new();
    put_f32s(&mut wire, &[2.0, 2.0, 2.0]);
    store.push("t", 1, &[key], &wire, NO_ID).unwrap();
    let after = decode(&store.fetch("t", 1, &[key]).unwrap().1);
    assert_eq!(after, init.iter().map(|w| w - 1.0).collect::<Vec<_>>());
}

#[test]
fn bad_requests_are_refused_and_change_nothing() {
    let store = Store::new(&config(Mode::Training));
    let good = keys_of_shard(0, 1)[0];
    let wrong = keys_of_shard(1, 1)[0];
    assert!(matches!(
        store.fetch("nope", 0, &[good]),
        Err(StoreError::UnknownTable(_))
    ));
    assert!(matches!(
        store.fetch("t", 5, &[good]),
        Err(StoreError::ShardNotHosted { shard: 5, .. })
    ));
    assert!(matches!(
        store.fetch("t", 0, &[good, wrong]),
        Err(StoreError::WrongShard { .. })
    ));
    assert!(matches!(
        store.push("t", 0, &[good], &[0u8; 8], NO_ID),
        Err(StoreError::GradientLength {
            expected: 12,
            got: 8,
            ..
        })
    ));
    assert!(matches!(
        store.push("t", 0, &[good, wrong], &[0u8; 24], NO_ID),
        Err(StoreError::WrongShard { .. })
    ));
    assert_eq!(
        store.tables().map(Table::rows).sum::<u64>(),
        0,
        "nothing stored"
    );
}

pub(super) fn wire(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    put_f32s(&mut out, values);
    out
}

#[test]
fn non_finite_gradients_are_rejected_or_clipped_per_table() {
    let mut config = config(Mode::Training);
    config.tables.push(TableConfig {
        non_finite: crate::config::NonFinite::Clip,
        gradient_clip: 2.0,
        initializer: Initializer::Zeros,
        optimizer: OptimizerConfig::sgd(1.0),
        ..TableConfig::new("clipped", 3)
    });
    let store = Store::new(&config);
    let key = keys_of_shard(0, 1)[0];
    let bad = wire(&[1.0, f32::NAN, 0.5]);
    assert_eq!(
        store.push("t", 0, &[key], &bad, NO_ID),
        Err(StoreError::NonFiniteGradient {
            table: "t".into(),
            index: 1
        })
    );
    assert_eq!(store.table("t").unwrap().rows(), 0, "nothing applied");
    let wild = wire(&[f32::INFINITY, f32::NAN, -5.0]);
    store.push("clipped", 0, &[key], &wild, NO_ID).unwrap();
    let row = decode(&store.fetch("clipped", 0, &[key]).unwrap().1);
    assert_eq!(
        row,
        [-2.0, 0.0, 2.0],
        "clamped to ±2, NaN as 0, then w -= g"
    );
}

#[test]
fn requests_over_the_key_limit_are_refused() {
    let mut config = config(Mode::Training);
    config.max_keys_per_request = 3;
    let store = Store::new(&config);
    let keys = keys_of_shard(0, 4);
    assert_eq!(
        store.fetch("t", 0, &keys).unwrap_err(),
        StoreError::TooManyKeys { got: 4, max: 3 }
    );
    assert!(matches!(
        store.push("t", 0, &keys, &wire(&[0.0; 12]), NO_ID),
        Err(StoreError::TooManyKeys { got: 4, max: 3 })
    ));
    assert!(store.fetch("t", 0, &keys[..3]).is_ok());
}

#[test]
fn a_fetch_whose_answer_exceeds_a_message_is_refused_before_allocating() {
    // 1 MiB messages, dim 3: 87,040 rows fit, the request's keys are
    // checked against it before any row is stored or allocated.
    let mut config = config(Mode::Training);
    config.max_message_size = 1 << 20;
    let store = Store::new(&config);
    let fit = ((1usize << 20) - 4096) / 12;
    let keys = keys_of_shard(0, fit + 1);
    assert_eq!(
        store.fetch_bytes("t", 0, &keys).unwrap_err(),
        StoreError::ResponseTooLarge {
            keys: fit + 1,
            row_bytes: 12,
            max: (1 << 20) - 4096
        }
    );
    assert!(store.fetch("t", 0, &keys).is_err());
    assert_eq!(store.table("t").unwrap().rows(), 0, "nothing was inserted");
    assert_eq!(store.fetch_bytes("t", 0, &keys[..fit]).unwrap(), fit * 12);
}

#[test]
fn a_spoofed_huge_sequence_is_refused_and_the_worker_keeps_pushing() {
    let store = Store::new(&config(Mode::Training));
    let key = keys_of_shard(0, 1)[0];
    let grads = wire(&[1.0, 1.0, 1.0]);
    let id = |sequence| PushId {
        worker: 9,
        sequence,
    };
    store.push("t", 0, &[key], &grads, id(1)).unwrap();
    // Before: accepted, and every later Push of worker 9 was "too old"
    // (and `highest + 1` overflowed in debug builds).
    for sequence in [
        u64::MAX,
        crate::dedup::MAX_SEQUENCE + 1,
        2 + crate::dedup::MAX_JUMP,
    ] {
        assert!(
            matches!(
                store.push("t", 0, &[key], &grads, id(sequence)),
                Err(StoreError::SequenceImplausible { highest: 1, .. })
            ),
            "{sequence}"
        );
    }
    let applied = store.push("t", 0, &[key], &grads, id(2)).unwrap();
    assert_eq!((applied.applied, applied.duplicate), (1, false));
    let far = store
        .push("t", 0, &[key], &grads, id(2 + crate::dedup::MAX_JUMP))
        .unwrap();
    assert_eq!(far.applied, 1, "a jump within the bound is fine");
}

#[test]
fn a_duplicate_push_is_acknowledged_and_not_applied() {
    let store = Store::new(&config(Mode::Training));
    let key = keys_of_shard(0, 1)[0];
    let id = PushId {
        worker: 77,
        sequence: 1,
    };
    let grads = wire(&[1.0, 1.0, 1.0]);
    let first = store.push("t", 0, &[key], &grads, id).unwrap();
    assert_eq!(
        first,
        PushOutcome {
            applied: 1,
            duplicate: false,
            evicted: Vec::new(),
            not_admitted: Vec::new(),
            stamp: 0,
        }
    );
    let row = store.fetch("t", 0, &[key]).unwrap().1;
    let again = store.push("t", 0, &[key], &grads, id).unwrap();
    assert_eq!(
        again,
        PushOutcome {
            applied: 0,
            duplicate: true,
            evicted: Vec::new(),
            not_admitted: Vec::new(),
            stamp: 0,
        }
    );
    assert_eq!(store.fetch("t", 0, &[key]).unwrap().1, row, "unchanged");
    // A refused Push does not use up its id: fixed, it applies.
    let next = PushId {
        worker: 77,
        sequence: 2,
    };
    assert!(store.push("t", 0, &[key], &wire(&[1.0]), next).is_err());
    assert_eq!(store.push("t", 0, &[key], &grads, next).unwrap().applied, 1);
}

#[test]
fn table_row_limits_hold_through_fetches_and_pushes() {
    let mut config = config(Mode::Training);
    config.tables[0].max_rows = Some(100);
    let store = Store::new(&config);
    let keys = keys_of_shard(0, 1000);
    for chunk in keys.chunks(50) {
        store.fetch("t", 0, chunk).unwrap();
        store
            .push("t", 0, chunk, &wire(&vec![0.1; chunk.len() * 3]), NO_ID)
            .unwrap();
        let table = store.table("t").unwrap();
        assert!(table.shard(0).unwrap().rows.len() <= 100);
    }
    let table = store.table("t").unwrap();
    assert_eq!(table.rows(), 100, "full, not more");
    assert!(table.evictions() >= 900, "{} evictions", table.evictions());
}

pub(super) fn digest(store: &Store, shard: u32) -> Vec<(u64, u64)> {
    let cut = store.lock_shard(shard).unwrap();
    store
        .snapshot_shard(&cut)
        .tables
        .iter()
        .map(|(_, rows)| crate::rowfile::digest_snapshot(rows))
        .collect()
}

/// Pushes `keys` (gradients 0.25, sequence `sequence`) to `primary` and
/// applies it on `replica` as the primary's stream entry says (its
/// evictions and the keys admission left out).
fn replay(primary: &Store, replica: &Store, keys: &[u64], sequence: u64) {
    let grads = wire(&vec![0.25; keys.len() * 3]);
    let id = PushId {
        worker: 1,
        sequence,
    };
    let outcome = primary.push("t", 0, keys, &grads, id).unwrap();
    let checked = replica.check_push("t", 0, keys, &grads, id).unwrap();
    let guard = replica.lock_shard(0).unwrap();
    checked
        .apply_replicated(
            &guard,
            &outcome.evicted,
            &outcome.not_admitted,
            Instant::now(),
            clock_of(&guard, &outcome),
        )
        .unwrap();
}

/// The stamp the primary gave `outcome`'s rows, for a replica replaying
/// it.
fn clock_of(_guard: &ShardGuard<'_>, outcome: &PushOutcome) -> u32 {
    outcome.stamp
}

/// Each side serves Fetches of its own: the first half of `fetches` (as
/// indices into `keys`) on `primary`, the rest on `replica`.
fn fetch_apart(primary: &Store, replica: &Store, keys: &[u64], fetches: &[usize]) {
    let (a, b) = fetches.split_at(fetches.len() / 2);
    let a: Vec<u64> = a.iter().map(|&k| keys[k]).collect();
    let b: Vec<u64> = b.iter().map(|&k| keys[k]).collect();
    primary.fetch("t", 0, &a).unwrap();
    replica.fetch("t", 0, &b).unwrap();
}

proptest::proptest! {
    /// A replica replaying the primary's evictions holds exactly the
    /// primary's rows, whatever the keys (repeats, keys evicted by a
    /// later key of the same Push) and whatever each side fetched.
    #[test]
    fn replayed_evictions_keep_a_replica_identical(
        pushes in proptest::collection::vec(proptest::collection::vec(0usize..300, 1..40), 1..60),
        fetches in proptest::collection::vec(0usize..300, 0..200),
    ) {
        let mut config = config(Mode::Training);
        config.tables[0].max_rows = Some(100);
        let (primary, replica) = (Store::new(&config), Store::new(&config));
        let keys = keys_of_shard(0, 300);
        for (i, push) in pushes.iter().enumerate() {
            // Keys deduplicated as the worker sends them.
            let mut picked: Vec<u64> = Vec::new();
            for &k in push {
                if !picked.contains(&keys[k]) {
                    picked.push(keys[k]);
                }
            }
            replay(&primary, &replica, &picked, i as u64 + 1);
            fetch_apart(&primary, &replica, &keys, &fetches);
            proptest::prop_assert!(primary.table("t").unwrap().shard(0).unwrap().rows.len() <= 100);
        }
        proptest::prop_assert_eq!(digest(&primary, 0), digest(&replica, 0));
    }
}

/// A table admitting ids at their second Push.
fn admitting(admission: crate::table::AdmissionConfig, max_rows: Option<u64>) -> StoreConfig {
    let mut config = config(Mode::Training);
    config.tables[0].admission = Some(admission);
    config.tables[0].max_rows = max_rows;
    config
}

const TWICE: crate::table::AdmissionConfig = crate::table::AdmissionConfig::Count {
    min_pushes: 2,
    sketch_width: 1 << 12,
};

/// Admission (issue 37): the first Push of an id creates no row and is
/// dropped; the second creates it (and only its gradient is applied);
/// Fetches of an id without a row answer its initial values and store
/// nothing, whatever the order.
#[test]
fn an_id_gets_its_row_at_its_second_push_and_fetches_store_nothing() {
    let store = Store::new(&admitting(TWICE, None));
    let plain = Store::new(&config(Mode::Training));
    let keys = keys_of_shard(0, 3);
    let initial = plain.fetch("t", 0, &keys).unwrap().1;
    assert_eq!(store.fetch("t", 0, &keys).unwrap().1, initial);
    assert_eq!(store.table("t").unwrap().rows(), 0, "a Fetch stores no row");
    let grads = wire(&[1.0; 9]);
    let first = store.push("t", 0, &keys, &grads, NO_ID).unwrap();
    assert_eq!(
        (first.applied, &first.not_admitted[..]),
        (0, &[0, 1, 2][..])
    );
    assert_eq!(store.table("t").unwrap().rows(), 0);
    assert_eq!(store.fetch("t", 0, &keys).unwrap().1, initial);
    // The second Push of the first two keys: their rows, with that one
    // gradient applied (SGD, learning rate 0.5).
    let second = store
        .push("t", 0, &keys[..2], &wire(&[1.0; 6]), NO_ID)
        .unwrap();
    assert_eq!((second.applied, second.not_admitted.len()), (2, 0));
    assert_eq!(store.table("t").unwrap().rows(), 2);
    let got = decode(&store.fetch("t", 0, &keys).unwrap().1);
    let want = decode(&initial);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let expected = if i < 6 { w - 0.5 } else { *w };
        assert!((g - expected).abs() < 1e-6, "value {i}: {g} vs {expected}");
    }
    let (candidates, admitted, bytes) = store
        .table("t")
        .unwrap()
        .shard(0)
        .unwrap()
        .admission_counts();
    assert_eq!((candidates, admitted, bytes), (5, 2, 4 << 12));
}

proptest::proptest! {
    /// A replica following the primary's admissions (and evictions, with a
    /// row limit) holds exactly the primary's rows and the same sketch,
    /// whatever the keys, repeats within a Push included, and whatever
    /// each side fetched; the sketch small enough to halve on the way.
    #[test]
    fn followed_admissions_keep_a_replica_identical(
        pushes in proptest::collection::vec(proptest::collection::vec(0usize..400, 1..40), 1..80),
        fetches in proptest::collection::vec(0usize..400, 0..100),
        limited in proptest::bool::ANY,
        probability in proptest::bool::ANY,
    ) {
        let admission = match probability {
            true => crate::table::AdmissionConfig::Probability { p: 0.3 },
            false => crate::table::AdmissionConfig::Count { min_pushes: 2, sketch_width: 1 << 10 },
        };
        let config = admitting(admission, limited.then_some(100));
        let (primary, replica) = (Store::new(&config), Store::new(&config));
        let keys = keys_of_shard(0, 400);
        for (i, push) in pushes.iter().enumerate() {
            // Repeats kept: a Push may name a key twice.
            let picked: Vec<u64> = push.iter().map(|&k| keys[k]).collect();
            replay(&primary, &replica, &picked, i as u64 + 1);
            fetch_apart(&primary, &replica, &keys, &fetches);
        }
        proptest::prop_assert_eq!(digest(&primary, 0), digest(&replica, 0));
        let sketch = |store: &Store| {
            let table = store.table("t").unwrap();
            let state = table.shard(0).unwrap();
            let admission = state.admission.as_ref().unwrap().lock().unwrap();
            let (counters, since) = admission.image();
            (counters.to_vec(), since, admission.counts())
        };
        proptest::prop_assert_eq!(sketch(&primary), sketch(&replica));
    }
}

/// A replica whose rows are not the primary's (it holds a row the primary
/// left out) says so, as a missing victim does: it copies the shard again.
#[test]
fn a_replica_holding_a_row_the_primary_left_out_is_told_apart() {
    let primary = Store::new(&admitting(TWICE, None));
    let replica = Store::new(&config(Mode::Training));
    let key = keys_of_shard(0, 1)[0];
    let one = [key];
    let grads = wire(&[1.0; 3]);
    let outcome = primary.push("t", 0, &one, &grads, NO_ID).unwrap();
    assert_eq!(outcome.not_admitted, vec![0]);
    // A replica without admission is configured differently: refused.
    let checked = replica.check_push("t", 0, &one, &grads, NO_ID).unwrap();
    let guard = replica.lock_shard(0).unwrap();
    assert!(
        checked
            .apply_replicated(
                &guard,
                &[],
                &outcome.not_admitted,
                Instant::now(),
                clock_of(&guard, &outcome),
            )
            .is_err()
    );
    drop(guard);
    // One with admission that has the row (from elsewhere): told apart.
    let other = Store::new(&admitting(TWICE, None));
    other.push("t", 0, &[key], &grads, NO_ID).unwrap();
    other.push("t", 0, &[key], &grads, NO_ID).unwrap();
    let checked = other.check_push("t", 0, &one, &grads, NO_ID).unwrap();
    let guard = other.lock_shard(0).unwrap();
    assert!(
        checked
            .apply_replicated(
                &guard,
                &[],
                &outcome.not_admitted,
                Instant::now(),
                clock_of(&guard, &outcome),
            )
            .is_err()
    );
    // Out of order or out of range: refused before anything applies.
    for bad in [&[1u32][..], &[0, 0][..]] {
        assert!(
            checked
                .apply_replicated(&guard, &[], bad, Instant::now(), clock_of(&guard, &outcome))
                .is_err()
        );
    }
}

/// Narrow storage against the `f32` reference, through the store's own
/// Push and Fetch: the same 100 Pushes (every row updated each step) to
/// an `f32`, an `f16` and a `bf16` table of each optimizer. Stochastic
/// rounding makes each update's error a draw of mean zero and at most one
/// unit in the last place, so after `n` updates a value strays from the
/// `f32` one like a random walk: about `sqrt(n) / 2` units, and under `5 *
/// sqrt(n) / 2` units (of the largest value) for every one of many rows.
/// That bound, `5 * sqrt(n) * 2^-12` for `f16` and `5 * sqrt(n) * 2^-9` for
/// `bf16` of the largest value, is the one docs/src/concepts/row-store.md states.
#[test]
fn narrow_storage_follows_the_f32_reference_within_the_stated_tolerance() {
    use crate::table::Storage;
    for optimizer in [
        OptimizerConfig::sgd(0.05),
        OptimizerConfig::adagrad(0.05),
        OptimizerConfig::adam(0.005),
    ] {
        let store = |storage: Storage| {
            Store::new(&StoreConfig {
                num_shards: 1,
                shards: vec![0],
                tables: vec![TableConfig {
                    optimizer,
                    initializer: Initializer::Uniform { scale: 0.05 },
                    storage,
                    ..TableConfig::new("t", 16)
                }],
                ..StoreConfig::default()
            })
        };
        let (reference, half, brain) = (
            store(Storage::F32),
            store(Storage::F16),
            store(Storage::Bf16),
        );
        let keys: Vec<u64> = (0..64).collect();
        for step in 0..100u64 {
            let grads: Vec<f32> = (0..keys.len() * 16)
                .map(|i| {
                    let h = tessera_proto::sharding::splitmix64(step * 10_007 + i as u64);
                    ((h >> 40) as f32 / (1u32 << 24) as f32 - 0.5) * 0.02
                })
                .collect();
            let mut bytes = Vec::new();
            put_f32s(&mut bytes, &grads);
            let id = PushId {
                worker: 3,
                sequence: step + 1,
            };
            for s in [&reference, &half, &brain] {
                s.push("t", 0, &keys, &bytes, id).unwrap();
            }
        }
        let exact = decode(&reference.fetch("t", 0, &keys).unwrap().1);
        let scale = exact.iter().fold(0f32, |m, v| m.max(v.abs()));
        let walk = 5.0 * 100f32.sqrt();
        for (name, s, tolerance) in [
            ("f16", &half, walk * 2f32.powi(-12)),
            ("bf16", &brain, walk * 2f32.powi(-9)),
        ] {
            let got = decode(&s.fetch("t", 0, &keys).unwrap().1);
            let worst = exact
                .iter()
                .zip(&got)
                .map(|(a, b)| (a - b).abs() / scale)
                .fold(0f32, f32::max);
            assert!(
                worst <= tolerance,
                "{} {name}: the largest difference from f32 is {worst} of the largest value, above {tolerance}",
                optimizer.name()
            );
            assert!(
                worst > 0.0,
                "{} {name} stored exactly: not narrow",
                optimizer.name()
            );
        }
    }
}

/// Updates smaller than half a unit in the last place of a narrow value
/// still move it on average (stochastic rounding): rounding to nearest
/// would keep every value above 0.25 (f16) where it started.
#[test]
fn small_updates_are_not_lost_in_narrow_storage() {
    use crate::table::Storage;
    for (storage, ulp_at_half) in [
        (Storage::F16, 2f32.powi(-11)),
        (Storage::Bf16, 2f32.powi(-8)),
    ] {
        let store = |storage: Storage| {
            Store::new(&StoreConfig {
                num_shards: 1,
                shards: vec![0],
                tables: vec![TableConfig {
                    optimizer: OptimizerConfig::sgd(0.001),
                    initializer: Initializer::Uniform { scale: 1.0 },
                    storage,
                    ..TableConfig::new("t", 8)
                }],
                ..StoreConfig::default()
            })
        };
        let (exact, narrow) = (store(Storage::F32), store(storage));
        let keys: Vec<u64> = (0..128).collect();
        // Each step moves every value by lr * 0.1 = 1e-4, below half a
        // unit in the last place of any value above 0.25 in f16.
        let step = 0.001 * 0.1;
        assert!(storage != Storage::F16 || step < ulp_at_half / 2.0);
        let mut grads = Vec::new();
        put_f32s(&mut grads, &vec![0.1; keys.len() * 8]);
        let start = decode(&exact.fetch("t", 0, &keys).unwrap().1);
        let steps = 500;
        for step in 1..=steps {
            // As a worker sends them: with an identity.
            let id = PushId {
                worker: 3,
                sequence: step,
            };
            exact.push("t", 0, &keys, &grads, id).unwrap();
            narrow.push("t", 0, &keys, &grads, id).unwrap();
        }
        let (a, b) = (
            decode(&exact.fetch("t", 0, &keys).unwrap().1),
            decode(&narrow.fetch("t", 0, &keys).unwrap().1),
        );
        let moved: Vec<f32> = start
            .iter()
            .zip(&b)
            .filter(|(s, _)| s.abs() > 0.5)
            .map(|(s, n)| s - n)
            .collect();
        let mean = moved.iter().sum::<f32>() / moved.len() as f32;
        let expected = step * steps as f32;
        assert!(
            (mean - expected).abs() < 0.1 * expected,
            "{storage:?}: values above 0.5 moved {mean} on average, f32 {expected}"
        );
        let worst = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        eprintln!(
            "{storage:?}: mean move {mean} (f32 {expected}), largest difference from f32 {worst}"
        );
    }
}
