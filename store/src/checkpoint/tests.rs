use super::dir::{LATEST, prune};
use super::manifest::MANIFEST;
use std::fs;

use super::*;
use crate::image::ShardImage;
use crate::rowfile;

use crate::config::{Initializer, OptimizerConfig, StoreConfig, TableConfig};
use crate::store::PushId;
use tessera_proto::rows::put_f32s;
use tessera_proto::sharding::shard_for_key;

fn config() -> StoreConfig {
    StoreConfig {
        num_shards: 2,
        shards: vec![0, 1],
        tables: vec![
            TableConfig {
                optimizer: OptimizerConfig::adam(0.01),
                ..TableConfig::new("adam", 3)
            },
            TableConfig {
                optimizer: OptimizerConfig::sgd(1.0),
                initializer: Initializer::Zeros,
                ..TableConfig::new("counter", 2)
            },
        ],
        ..StoreConfig::default()
    }
}

fn keys(shard: u32, n: usize) -> Vec<u64> {
    (0..)
        .filter(|&k| shard_for_key(k, 2) == shard)
        .take(n)
        .collect()
}

fn wire(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    put_f32s(&mut out, values);
    out
}

/// Every (table, shard) image of `store`, rows sorted by key.
fn images(store: &Store) -> Vec<(String, u32, ShardImage)> {
    let mut out = Vec::new();
    for table in tables_sorted(store) {
        for &shard in store.hosted() {
            let config = table.config();
            let cut = store.lock_shard(shard).unwrap();
            let (bytes, _) = rowfile::encode_snapshot(
                &table.snapshot(&cut, shard),
                config.dim,
                config.optimizer.slots() as u32,
            );
            drop(cut);
            let mut image =
                rowfile::decode(&bytes, config.dim, config.optimizer.slots() as u32).unwrap();
            image.rows.sort_by_key(|r| r.key);
            image.dedup.sort_by_key(|d| d.worker);
            out.push((table.config().name.clone(), shard, image));
        }
    }
    out
}

fn trained_store() -> Store {
    let store = Store::new(&config());
    for step in 1..=5u64 {
        for shard in 0..2 {
            let k = keys(shard, 40);
            let grads: Vec<f32> = (0..k.len() * 3).map(|i| (i as f32 - 50.0) / 7.0).collect();
            let id = PushId {
                worker: 9 + u64::from(shard),
                sequence: step,
            };
            store.push("adam", shard, &k, &wire(&grads), id).unwrap();
            store
                .push("counter", shard, &k, &wire(&vec![-1.0; k.len() * 2]), id)
                .unwrap();
        }
    }
    store
}

/// The files written chunk by chunk from the copy stream are the bytes
/// the whole-file encoder makes (checkpoints of older builds read the
/// same, and vice versa).
#[test]
fn streamed_row_files_are_the_encoders_bytes() {
    let store = trained_store();
    for &shard in store.hosted() {
        let snapshot = store.snapshot_shard(&store.lock_shard(shard).unwrap());
        let whole: Vec<(String, Vec<u8>, u64)> = rowfile::encode_shard(&snapshot)
            .into_iter()
            .map(|(t, bytes, rows)| (t.to_owned(), bytes, rows))
            .collect();
        let source = crate::copy_stream::CopySource::new(snapshot);
        let files = source.table_files();
        assert_eq!(files.len(), whole.len());
        for ((name, offset, len, rows), (table, bytes, want_rows)) in files.iter().zip(&whole) {
            assert_eq!((*name, *rows), (table.as_str(), *want_rows));
            // In pieces of an odd size, to cross row boundaries.
            let mut streamed = Vec::new();
            let mut at = *offset;
            while at < offset + len {
                let chunk = source.read_at(at, 777.min((offset + len - at) as usize));
                at += chunk.len() as u64;
                streamed.extend_from_slice(&chunk);
            }
            assert_eq!(&streamed, bytes, "table {table} of shard {shard}");
        }
    }
}

#[test]
fn a_checkpoint_restores_values_state_and_dedup_bit_identically() {
    let dir = tempfile::tempdir().unwrap();
    let store = trained_store();
    let info = save(&store, dir.path(), 3).unwrap();
    assert_eq!(info.rows, 2 * 2 * 40);
    let restored = Store::new(&config());
    restored.install(load_latest(&restored, dir.path(), false).unwrap().unwrap());
    let bits = |images: Vec<(String, u32, ShardImage)>| {
        images
            .into_iter()
            .map(|(t, s, image)| {
                let rows: Vec<_> = image
                    .rows
                    .into_iter()
                    .map(|r| {
                        (
                            r.key,
                            r.steps,
                            r.values.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                            r.state.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        )
                    })
                    .collect();
                (t, s, rows, image.dedup)
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(bits(images(&restored)), bits(images(&store)));
    // The deduplication windows came back too: a retried Push of
    // before the checkpoint is still recognised.
    let k = keys(0, 40);
    let again = restored
        .push(
            "counter",
            0,
            &k,
            &wire(&vec![-1.0; 80]),
            PushId {
                worker: 9,
                sequence: 5,
            },
        )
        .unwrap();
    assert!(again.duplicate);
}

#[test]
fn partial_corrupt_and_mismatched_checkpoints_are_refused() {
    let store = trained_store();
    let check = |damage: &dyn Fn(&Path), expect: &dyn Fn(&CheckpointError) -> bool| {
        let dir = tempfile::tempdir().unwrap();
        let info = save(&store, dir.path(), 3).unwrap();
        damage(&info.path);
        let fresh = Store::new(&config());
        let err = load_latest(&fresh, dir.path(), false).unwrap_err();
        assert!(expect(&err), "unexpected: {err:?}");
    };
    let file_is = |err_path: &Path, name: &str| err_path.file_name().is_some_and(|f| f == name);
    // A flipped byte in a row file.
    check(
        &|path| {
            let file = path.join("t0-s1.rows");
            let mut bytes = fs::read(&file).unwrap();
            bytes[100] ^= 0x40;
            fs::write(&file, bytes).unwrap();
        },
        &|err| {
            matches!(err, CheckpointError::Corrupt { path, why: Corruption::Crc { .. } }
                if file_is(path, "t0-s1.rows"))
        },
    );
    // A truncated row file.
    check(
        &|path| {
            let file = path.join("t1-s0.rows");
            let bytes = fs::read(&file).unwrap();
            fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();
        },
        &|err| {
            matches!(err, CheckpointError::Corrupt { path, why: Corruption::Length { .. } }
                if file_is(path, "t1-s0.rows"))
        },
    );
    // A lost file, a lost manifest (an interrupted save).
    check(
        &|path| fs::remove_file(path.join("t0-s0.rows")).unwrap(),
        &|err| {
            matches!(err, CheckpointError::Partial { why: Missing::File(file), .. }
                if file == "t0-s0.rows")
        },
    );
    check(
        &|path| fs::remove_file(path.join(MANIFEST)).unwrap(),
        &|err| {
            matches!(
                err,
                CheckpointError::Partial {
                    why: Missing::Manifest,
                    ..
                }
            )
        },
    );
    // A manifest that is not JSON.
    check(
        &|path| fs::write(path.join(MANIFEST), b"{ not json").unwrap(),
        &|err| {
            matches!(err, CheckpointError::Corrupt { path, why: Corruption::Manifest(_) }
                if file_is(path, MANIFEST))
        },
    );
    // A different shape in the configuration.
    let dir = tempfile::tempdir().unwrap();
    save(&store, dir.path(), 3).unwrap();
    let mut other = config();
    other.tables[0].dim = 4;
    let err = load_latest(&Store::new(&other), dir.path(), false).unwrap_err();
    assert!(
        matches!(
            &err,
            CheckpointError::Mismatch { why: Difference::Table { saved_optimizer, dim: 4, .. }, .. }
                if saved_optimizer == "adam"
        ),
        "{err:?}"
    );
    other = config();
    other.tables[1].optimizer = OptimizerConfig::adagrad(0.1);
    assert!(load_latest(&Store::new(&other), dir.path(), false).is_err());
}

/// A checkpoint saved under another shard count: refused in static mode;
/// in etcd mode (`other_counts`) loaded, and the store routes by its
/// count (a server restarted with a finished resize's count in its
/// configuration, or the one before it: the shard map reconciles them).
#[test]
fn a_checkpoint_of_another_count_loads_only_where_the_map_reconciles_it() {
    let store = trained_store();
    let dir = tempfile::tempdir().unwrap();
    save(&store, dir.path(), 3).unwrap();
    let other = StoreConfig {
        num_shards: 3,
        ..config()
    };
    let err = load_latest(&Store::new(&other), dir.path(), false).unwrap_err();
    assert!(
        matches!(
            err,
            CheckpointError::Mismatch {
                why: Difference::Shards {
                    saved: 2,
                    configured: 3
                },
                ..
            }
        ),
        "{err:?}"
    );
    let restored = Store::new(&other);
    restored.install(load_latest(&restored, dir.path(), true).unwrap().unwrap());
    assert_eq!(restored.num_shards(), 2);
    assert_eq!(images(&restored), images(&store));
    // A store that took a finished growth's count saves that count.
    assert!(store.adopt_num_shards(4));
    let dir = tempfile::tempdir().unwrap();
    save(&store, dir.path(), 3).unwrap();
    let fresh = Store::new(&config());
    fresh.install(load_latest(&fresh, dir.path(), true).unwrap().unwrap());
    assert_eq!(fresh.num_shards(), 4);
}

#[test]
fn no_checkpoint_is_not_an_error_and_old_ones_are_pruned() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::new(&config());
    assert!(load_latest(&store, dir.path(), false).unwrap().is_none());
    for _ in 0..5 {
        save(&store, dir.path(), 2).unwrap();
    }
    let kept = fs::read_dir(dir.path())
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("ckpt-")
        })
        .count();
    assert_eq!(kept, 2);
    assert!(load_latest(&store, dir.path(), false).unwrap().is_some());
}

/// Pushes that add 1 to *every* row of a shard, saved while they run:
/// each saved shard holds whole Pushes only, so its rows are all equal.
#[test]
fn a_checkpoint_under_concurrent_pushes_is_consistent_per_shard() {
    let dir = tempfile::tempdir().unwrap();
    let store = std::sync::Arc::new(Store::new(&config()));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Both pushers and the test: the saves start once each pusher has
    // applied a Push.
    let pushed = std::sync::Arc::new(std::sync::Barrier::new(3));
    let mut pushers = Vec::new();
    for shard in 0..2u32 {
        let (store, stop, pushed) = (store.clone(), stop.clone(), pushed.clone());
        pushers.push(std::thread::spawn(move || {
            let k = keys(shard, 500);
            let grads = wire(&vec![-1.0; k.len() * 2]);
            let mut n = 0u64;
            let mut told = false;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                store
                    .push("counter", shard, &k, &grads, PushId::default())
                    .unwrap();
                n += 1;
                if !told {
                    pushed.wait();
                    told = true;
                }
            }
            n
        }));
    }
    pushed.wait();
    let mut checked = 0;
    for _ in 0..5 {
        let info = save(&store, dir.path(), 10).unwrap();
        let fresh = Store::new(&config());
        let loaded = load(&fresh, &info.path, false).unwrap();
        for (table, shard, image) in &loaded.shards {
            if table != "counter" || image.rows.is_empty() {
                continue;
            }
            let first = image.rows[0].values[0];
            assert!(
                image
                    .rows
                    .iter()
                    .all(|r| r.values.iter().all(|&v| v == first)),
                "shard {shard} saved a Push half applied"
            );
            checked += 1;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let pushes: u64 = pushers.into_iter().map(|p| p.join().unwrap()).sum();
    assert!(pushes > 0 && checked > 0);
}

fn entries(dir: &Path, prefix: &str) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with(prefix))
        .collect();
    names.sort();
    names
}

/// A checkpoint left by a clock that ran ahead (or a name from the
/// future) must not make the new one sort first and be pruned.
#[test]
fn a_clock_stepping_back_cannot_prune_the_new_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let store = trained_store();
    let ahead = save(&store, dir.path(), 5).unwrap();
    fs::rename(&ahead.path, dir.path().join("ckpt-999999999999999")).unwrap();
    let info = save(&store, dir.path(), 1).unwrap();
    assert_eq!(
        entries(dir.path(), "ckpt-"),
        vec![
            info.path
                .file_name()
                .unwrap()
                .to_string_lossy()
                .into_owned()
        ]
    );
    let loaded = load_latest(&Store::new(&config()), dir.path(), false)
        .unwrap()
        .unwrap();
    assert_eq!(loaded.path, info.path);
}

#[test]
fn pruning_never_removes_the_checkpoint_latest_names() {
    let dir = tempfile::tempdir().unwrap();
    let store = trained_store();
    let first = save(&store, dir.path(), 5).unwrap();
    save(&store, dir.path(), 5).unwrap();
    save(&store, dir.path(), 5).unwrap();
    // LATEST back at the oldest (an operator rolled back).
    let name = first
        .path
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    fs::write(dir.path().join(LATEST), &name).unwrap();
    prune(dir.path(), 1).unwrap();
    let kept = entries(dir.path(), "ckpt-");
    assert_eq!(kept.len(), 2, "{kept:?}");
    assert!(kept.contains(&name), "{kept:?}");
    let loaded = load_latest(&Store::new(&config()), dir.path(), false).unwrap();
    assert_eq!(loaded.unwrap().path, first.path);
}

#[test]
fn a_failed_save_removes_its_files_and_leaves_latest_alone() {
    let dir = tempfile::tempdir().unwrap();
    let store = trained_store();
    let good = save(&store, dir.path(), 5).unwrap();
    // Only this test's saves fail: others run beside it in this process.
    let only_here = format!("return({})", dir.path().display());
    fail::cfg("checkpoint::after_shard_file", &only_here).unwrap();
    let failed = save(&store, dir.path(), 5);
    fail::remove("checkpoint::after_shard_file");
    assert!(
        matches!(failed, Err(CheckpointError::Io { .. })),
        "{failed:?}"
    );
    assert_eq!(entries(dir.path(), ".tmp-"), Vec::<String>::new());
    let loaded = load_latest(&Store::new(&config()), dir.path(), false).unwrap();
    assert_eq!(loaded.unwrap().path, good.path);
    // Numbers go on from the highest present.
    let next = save(&store, dir.path(), 5).unwrap();
    assert!(next.path > good.path);
}

/// Expiry (issue 37): a row's stamp survives a checkpoint, and rows
/// expired but not swept yet are restored too: a server restarting from
/// it holds what a replica at the same version that did not restart
/// holds (leaving them out at load made the two differ for good; the
/// primary's sweep removes them through the stream).
#[test]
fn stamps_survive_a_checkpoint_and_a_restart_holds_what_a_replica_holds() {
    let mut config = config();
    config.tables[1].expiry = Some(crate::table::ExpiryConfig::after_pushes(5));
    let store = Store::new(&config);
    let ks = keys(0, 4);
    let push = |keys: &[u64]| {
        let mut guard = store.lock_shard(0).unwrap();
        store
            .check_push(
                "counter",
                0,
                keys,
                &wire(&vec![1.0; keys.len() * 2]),
                PushId::default(),
            )
            .unwrap()
            .apply(&guard, std::time::Instant::now())
            .unwrap();
        let next = guard.version().next(1);
        guard.set_version(next);
    };
    push(&ks[..2]);
    for _ in 0..6 {
        push(&ks[2..]);
    }
    // Positions: ks[..2] at 1 (age 6 at 7: expired), ks[2..] at 7.
    let dir = tempfile::tempdir().unwrap();
    save(&store, dir.path(), 3).unwrap();
    let restored = Store::new(&config);
    restored.install(load_latest(&restored, dir.path(), false).unwrap().unwrap());
    let stamps = |store: &Store| {
        let table = store.table("counter").unwrap();
        let mut out: Vec<(u64, u32)> = Vec::new();
        table
            .shard(0)
            .unwrap()
            .rows
            .snapshot()
            .for_each_from(0, |row| {
                out.push((row.key(), row.stamp()));
                true
            });
        out.sort_unstable();
        out
    };
    let mut want: Vec<(u64, u32)> = ks[..2]
        .iter()
        .map(|&k| (k, 1))
        .chain(ks[2..].iter().map(|&k| (k, 7)))
        .collect();
    want.sort_unstable();
    assert_eq!(stamps(&restored), want);
    assert_eq!(stamps(&restored), stamps(&store));
    // The restarted server's Push count goes on from the latest stamp.
    let state = restored.table("counter").unwrap();
    assert_eq!(state.shard(0).unwrap().rows.stamp_now(), 7);
}
