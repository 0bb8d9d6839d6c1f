//! Saving: each shard cut under its write lock, encoded and written after
//! the lock is released, then made durable and named by `LATEST`.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use super::dir::{LATEST, checkpoints, prune, remove_temporaries};
use super::durable::{sync_dir, write_range_synced, write_synced};
use super::manifest::{MANIFEST, Manifest, ManifestFile, ManifestShard, ManifestTable, VERSION};
use super::{CheckpointError, CheckpointInfo, io, tables_sorted};
use crate::store::Store;

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Saves every hosted shard of `store` as a new checkpoint under `dir`,
/// then keeps only the newest `keep` checkpoints.
pub fn save(store: &Store, dir: &Path, keep: usize) -> Result<CheckpointInfo, CheckpointError> {
    let started = Instant::now();
    fs::create_dir_all(dir).map_err(io(dir))?;
    let created = unix_ms();
    // Leftovers of a save a crash interrupted are never loaded: remove.
    remove_temporaries(dir)?;
    let number = checkpoints(dir)?.last().map_or(1, |(n, _)| n + 1);
    let name = format!("ckpt-{number:020}");
    let tmp = dir.join(format!(".tmp-{name}"));
    fs::create_dir(&tmp).map_err(io(&tmp))?;
    match write_checkpoint(store, dir, &tmp, &name, created) {
        Ok((path, rows, bytes)) => {
            prune(dir, keep.max(1))?;
            metrics::counter!("tessera_ps_checkpoints_total").increment(1);
            metrics::histogram!("tessera_ps_checkpoint_duration_seconds")
                .record(started.elapsed().as_secs_f64());
            tracing::info!(path = %path.display(), rows, bytes, took = ?started.elapsed(), "checkpoint saved");
            Ok(CheckpointInfo { path, rows, bytes })
        }
        Err(err) => {
            if let Err(cleanup) = fs::remove_dir_all(&tmp)
                && cleanup.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(path = %tmp.display(), %cleanup, "cannot remove a failed checkpoint's files");
            }
            Err(err)
        }
    }
}

/// Writes every shard into `tmp`, then moves it to `dir/name` and points
/// `LATEST` at it. Returns the path, rows and bytes.
fn write_checkpoint(
    store: &Store,
    dir: &Path,
    tmp: &Path,
    name: &str,
    created: u64,
) -> Result<(PathBuf, u64, u64), CheckpointError> {
    let mut manifest = Manifest {
        version: VERSION,
        created_unix_ms: created,
        // The count its rows are routed by: a server that took a finished
        // resize's count saves that (`Store::num_shards`).
        num_shards: store.num_shards(),
        tables: Vec::new(),
        files: Vec::new(),
        shards: Vec::new(),
    };
    let tables = tables_sorted(store);
    for table in &tables {
        let config = table.config();
        manifest.tables.push(ManifestTable {
            name: config.name.clone(),
            dim: config.dim,
            optimizer: config.optimizer.name().to_owned(),
            slots: config.optimizer.slots() as u32,
        });
    }
    let (mut rows, mut bytes) = (0u64, 0u64);
    for &shard in store.hosted() {
        // Every table of the shard at one cut, with its version: the lock
        // is held for a reference count per row; encoding and writing
        // follow without it.
        let snapshot = {
            let Some(cut) = store.lock_shard(shard) else {
                continue;
            };
            store.snapshot_shard(&cut)
        };
        manifest.shards.push(ManifestShard {
            shard,
            epoch: snapshot.version.epoch,
            position: snapshot.version.position,
        });
        // Each table's row file is encoded and written a chunk at a time
        // from the snapshot (the copy stream's range encoder, which yields
        // the same bytes): before, the whole shard's file was one
        // allocation (83 MiB for the drills' shard), whose page faults and
        // unmapping stalled the server's other threads for up to 150 ms.
        let source = crate::copy_stream::CopySource::new(snapshot);
        for (table, offset, len, shard_rows) in source.table_files() {
            let index = tables
                .iter()
                .position(|t| t.config().name == table)
                .unwrap_or_default();
            let file = format!("t{index}-s{shard}.rows");
            let crc32 = write_range_synced(&tmp.join(&file), &source, offset, len)?;
            rows += shard_rows;
            bytes += len;
            manifest.files.push(ManifestFile {
                file,
                table: table.to_owned(),
                shard,
                rows: shard_rows,
                bytes: len,
                crc32,
            });
            // A crash here leaves a partial temporary directory (drills);
            // `return` makes the save fail here, `return(DIR)` only a save
            // into DIR (a test run beside other tests' saves).
            #[cfg(feature = "failpoints")]
            if let Some(Some(err)) = fail::eval("checkpoint::after_shard_file", |only| match only {
                Some(dir) if !tmp.starts_with(&dir) => None,
                _ => Some(CheckpointError::Io {
                    path: tmp.to_owned(),
                    source: std::io::Error::other("fail point checkpoint::after_shard_file"),
                }),
            }) {
                return Err(err);
            }
        }
    }
    let manifest_path = tmp.join(MANIFEST);
    let text = serde_json::to_vec_pretty(&manifest).map_err(|err| CheckpointError::Io {
        path: manifest_path.clone(),
        source: std::io::Error::other(err),
    })?;
    write_synced(&manifest_path, &text)?;
    sync_dir(tmp)?;
    let path = dir.join(name);
    fs::rename(tmp, &path).map_err(io(&path))?;
    sync_dir(dir)?;
    let latest_tmp = dir.join(format!("{LATEST}.tmp"));
    write_synced(&latest_tmp, name.as_bytes())?;
    fs::rename(&latest_tmp, dir.join(LATEST)).map_err(io(dir))?;
    sync_dir(dir)?;
    Ok((path, rows, bytes))
}
