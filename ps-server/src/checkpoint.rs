//! Checkpoints: every hosted shard of every table (values, optimizer state
//! and Push deduplication windows) saved to a directory atomically, and
//! restored at start.
//!
//! Layout under the checkpoint directory:
//!
//! ```text
//! ckpt-<n>/MANIFEST.json     tables, files, row counts, CRC-32s
//! ckpt-<n>/t<i>-s<shard>.rows one file per (table i, shard)
//! LATEST                      the name of the newest complete one
//! ```
//!
//! `<n>` counts saves: one more than the highest number in the directory
//! (names of older versions, `ckpt-<unix ms>`, count as their number), so
//! a clock stepping back cannot make a new checkpoint sort before an old
//! one, and two saves never share a name. Pruning keeps the newest `keep`
//! by number and never removes the one `LATEST` names.
//!
//! Saving writes into `.tmp-ckpt-<n>/`, fsyncs every file and the
//! manifest (written last), renames the directory into place, fsyncs the
//! parent, and only then points `LATEST` at it (write, fsync, rename). A
//! crash at any point leaves either the previous checkpoint as `LATEST` or
//! the new one complete. Loading reads and verifies everything (sizes,
//! CRC-32s, headers, table shapes against the configuration, every hosted
//! shard present) into memory before the store is touched, so a partial or
//! corrupt checkpoint is refused with an error naming the file, never half
//! loaded.
//!
//! Each shard is cut under its write lock, which every Push holds while it
//! applies: the cut waits for the Push in flight and takes a snapshot that
//! shares every row ([`crate::store::Store::snapshot_shard`], a reference
//! count per row, copy-on-write after), so the saved shard reflects whole
//! Pushes only and matches the [`Version`] the manifest records for it.
//! Pushes wait only for the snapshot; encoding ([`crate::rowfile`]) and
//! writing run after the lock is released, on a blocking thread. A restarted server loads the newest complete
//! checkpoint and then, being behind its replicas, catches up from the
//! freshest of them (see [`crate::replication`]); a save that fails removes its
//! `.tmp-` directory; one interrupted by a crash leaves it, never loaded,
//! and the next save removes it.
//!
//! crc32fast (CRC-32, SIMD) checks integrity: the threat is torn or
//! bit-rotted files, not an adversary.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::rowfile::{self, ShardImage};
use crate::store::Store;
use crate::table::Table;
use crate::version::Version;

/// Manifest format version: 2 records each shard's version; 1 (without)
/// is read as version 0:0.
const VERSION: u32 = 2;
const MANIFEST: &str = "MANIFEST.json";
const LATEST: &str = "LATEST";

/// Why a checkpoint could not be saved or loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A file's contents do not check out.
    #[error("checkpoint file {path} is corrupt: {why}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// The checkpoint lacks something (an interrupted save, a lost file).
    #[error("checkpoint {path} is incomplete: {why}")]
    Partial {
        /// The checkpoint directory.
        path: PathBuf,
        /// What is missing.
        why: String,
    },
    /// The checkpoint does not fit this server's configuration.
    #[error("checkpoint {path} does not match the configuration: {why}")]
    Mismatch {
        /// The checkpoint directory.
        path: PathBuf,
        /// What differs.
        why: String,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_owned(),
        source,
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Manifest {
    version: u32,
    created_unix_ms: u64,
    num_shards: u32,
    tables: Vec<ManifestTable>,
    files: Vec<ManifestFile>,
    /// The version of every saved shard.
    #[serde(default)]
    shards: Vec<ManifestShard>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct ManifestShard {
    shard: u32,
    epoch: u64,
    position: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct ManifestTable {
    name: String,
    dim: u32,
    optimizer: String,
    slots: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct ManifestFile {
    file: String,
    table: String,
    shard: u32,
    rows: u64,
    bytes: u64,
    crc32: u32,
}

/// What a save wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointInfo {
    /// The checkpoint's directory.
    pub path: PathBuf,
    /// Rows saved, all shards together.
    pub rows: u64,
    /// Bytes of row files.
    pub bytes: u64,
}

/// A verified checkpoint, ready to install: images by (table, shard), and
/// each shard's version.
#[derive(Debug, Default)]
pub struct LoadedCheckpoint {
    /// Where it was read from.
    pub path: PathBuf,
    /// (table name, shard) -> image.
    pub shards: Vec<(String, u32, ShardImage)>,
    /// shard -> the version it was saved at.
    pub versions: Vec<(u32, Version)>,
}

/// Bytes of the stream encoded and written at a time.
const WRITE_CHUNK: usize = 1 << 20;

/// Writes `len` bytes of `source`'s stream from `offset` to a new file at
/// `path`, a chunk at a time, and syncs it; returns the bytes' CRC-32.
fn write_range_synced(
    path: &Path,
    source: &crate::replication::copy_stream::CopySource,
    offset: u64,
    len: u64,
) -> Result<u32, CheckpointError> {
    let mut file = File::create(path).map_err(io(path))?;
    let mut crc = crc32fast::Hasher::new();
    let mut at = offset;
    while at < offset + len {
        let want = (offset + len - at).min(WRITE_CHUNK as u64) as usize;
        let chunk = source.read_at(at, want);
        if chunk.is_empty() {
            return Err(CheckpointError::Io {
                path: path.to_owned(),
                source: std::io::Error::other("the snapshot ended early"),
            });
        }
        file.write_all(&chunk).map_err(io(path))?;
        crc.update(&chunk);
        at += chunk.len() as u64;
    }
    file.sync_all().map_err(io(path))?;
    Ok(crc.finalize())
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let mut file = File::create(path).map_err(io(path))?;
    file.write_all(bytes).map_err(io(path))?;
    file.sync_all().map_err(io(path))
}

fn sync_dir(path: &Path) -> Result<(), CheckpointError> {
    File::open(path)
        .and_then(|dir| dir.sync_all())
        .map_err(io(path))
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn tables_sorted(store: &Store) -> Vec<&Table> {
    let mut tables: Vec<&Table> = store.tables().collect();
    tables.sort_by(|a, b| a.config().name.cmp(&b.config().name));
    tables
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
        let source = crate::replication::copy_stream::CopySource::new(snapshot);
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
            // `return` makes the save fail here (tests).
            fail::fail_point!("checkpoint::after_shard_file", |_| {
                Err(CheckpointError::Io {
                    path: tmp.to_owned(),
                    source: std::io::Error::other("fail point checkpoint::after_shard_file"),
                })
            });
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

/// The checkpoints (complete or not) in `dir`: (number, name), by number.
/// A name that is `ckpt-` and digits counts; anything else is not ours.
fn checkpoints(dir: &Path) -> Result<Vec<(u64, String)>, CheckpointError> {
    let mut found: Vec<(u64, String)> = fs::read_dir(dir)
        .map_err(io(dir))?
        .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
        .filter_map(|name| {
            let number = name
                .strip_prefix("ckpt-")
                .filter(|digits| !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()))?
                .parse()
                .ok()?;
            Some((number, name))
        })
        .collect();
    found.sort();
    Ok(found)
}

/// Removes the temporary directories of interrupted saves (saves run one
/// at a time, so any that exists when one starts is stale).
fn remove_temporaries(dir: &Path) -> Result<(), CheckpointError> {
    for entry in fs::read_dir(dir).map_err(io(dir))?.flatten() {
        if entry
            .file_name()
            .to_string_lossy()
            .starts_with(".tmp-ckpt-")
        {
            let path = entry.path();
            tracing::info!(path = %path.display(), "removing an interrupted checkpoint");
            fs::remove_dir_all(&path).map_err(io(&path))?;
        }
    }
    Ok(())
}

/// Removes all but the newest `keep` checkpoints (by number), never the
/// one `LATEST` names.
fn prune(dir: &Path, keep: usize) -> Result<(), CheckpointError> {
    let latest = fs::read_to_string(dir.join(LATEST))
        .map(|name| name.trim().to_owned())
        .unwrap_or_default();
    let found = checkpoints(dir)?;
    let stale = found.len().saturating_sub(keep);
    for (_, name) in &found[..stale] {
        if *name == latest {
            continue;
        }
        let path = dir.join(name);
        fs::remove_dir_all(&path).map_err(io(&path))?;
    }
    Ok(())
}

/// Reads and verifies the checkpoint `LATEST` names in `dir` against
/// `store`'s tables and shards. `Ok(None)` when `dir` has no checkpoint.
pub fn load_latest(store: &Store, dir: &Path) -> Result<Option<LoadedCheckpoint>, CheckpointError> {
    let latest = dir.join(LATEST);
    let name = match fs::read_to_string(&latest) {
        Ok(name) => name.trim().to_owned(),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(CheckpointError::Io {
                path: latest,
                source,
            });
        }
    };
    if name.is_empty() || name.contains('/') || name.contains("..") {
        return Err(CheckpointError::Corrupt {
            path: latest,
            why: format!("`{name}` is not a checkpoint name"),
        });
    }
    load(store, &dir.join(name)).map(Some)
}

/// Reads and verifies the checkpoint at `path` (see the module docs).
pub fn load(store: &Store, path: &Path) -> Result<LoadedCheckpoint, CheckpointError> {
    let manifest_path = path.join(MANIFEST);
    let text = match fs::read(&manifest_path) {
        Ok(text) => text,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            return Err(CheckpointError::Partial {
                path: path.to_owned(),
                why: format!("no {MANIFEST} (an interrupted save?)"),
            });
        }
        Err(source) => {
            return Err(CheckpointError::Io {
                path: manifest_path,
                source,
            });
        }
    };
    let manifest: Manifest =
        serde_json::from_slice(&text).map_err(|err| CheckpointError::Corrupt {
            path: manifest_path.clone(),
            why: err.to_string(),
        })?;
    let mismatch = |why: String| CheckpointError::Mismatch {
        path: path.to_owned(),
        why,
    };
    if manifest.version != VERSION && manifest.version != 1 {
        return Err(mismatch(format!(
            "format version {} (this server reads {VERSION})",
            manifest.version
        )));
    }
    if manifest.num_shards != store.num_shards() {
        return Err(mismatch(format!(
            "saved with num_shards = {}, configured {}",
            manifest.num_shards,
            store.num_shards()
        )));
    }
    let mut loaded = LoadedCheckpoint {
        path: path.to_owned(),
        shards: Vec::new(),
        versions: store
            .hosted()
            .iter()
            .map(|&shard| {
                let saved = manifest.shards.iter().find(|s| s.shard == shard);
                (
                    shard,
                    saved.map_or_else(Version::default, |s| Version::new(s.epoch, s.position)),
                )
            })
            .collect(),
    };
    for table in tables_sorted(store) {
        let config = table.config();
        let slots = config.optimizer.slots() as u32;
        let saved = manifest
            .tables
            .iter()
            .find(|t| t.name == config.name)
            .ok_or_else(|| mismatch(format!("no table `{}` in it", config.name)))?;
        if saved.dim != config.dim
            || saved.slots != slots
            || saved.optimizer != config.optimizer.name()
        {
            return Err(mismatch(format!(
                "table `{}` was saved with dim {} and optimizer {}, configured dim {} and optimizer {}",
                config.name,
                saved.dim,
                saved.optimizer,
                config.dim,
                config.optimizer.name()
            )));
        }
        for &shard in store.hosted() {
            let entry = manifest
                .files
                .iter()
                .find(|f| f.table == config.name && f.shard == shard)
                .ok_or_else(|| CheckpointError::Partial {
                    path: path.to_owned(),
                    why: format!("no file for table `{}` shard {shard}", config.name),
                })?;
            if entry.file.contains('/') || entry.file.contains("..") {
                return Err(CheckpointError::Corrupt {
                    path: manifest_path.clone(),
                    why: format!("file name `{}`", entry.file),
                });
            }
            let file = path.join(&entry.file);
            let bytes = match fs::read(&file) {
                Ok(bytes) => bytes,
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
                    return Err(CheckpointError::Partial {
                        path: path.to_owned(),
                        why: format!("{} is missing", entry.file),
                    });
                }
                Err(source) => return Err(CheckpointError::Io { path: file, source }),
            };
            let corrupt = |why: String| CheckpointError::Corrupt {
                path: file.clone(),
                why,
            };
            if bytes.len() as u64 != entry.bytes {
                return Err(corrupt(format!(
                    "{} bytes, the manifest says {}",
                    bytes.len(),
                    entry.bytes
                )));
            }
            let crc = crc32fast::hash(&bytes);
            if crc != entry.crc32 {
                return Err(corrupt(format!(
                    "CRC-32 {crc:#010x}, the manifest says {:#010x}",
                    entry.crc32
                )));
            }
            let image = rowfile::decode(&bytes, config.dim, slots)
                .map_err(|err| corrupt(err.to_string()))?;
            if image.rows.len() as u64 != entry.rows {
                return Err(corrupt(format!(
                    "{} rows, the manifest says {}",
                    image.rows.len(),
                    entry.rows
                )));
            }
            loaded.shards.push((config.name.clone(), shard, image));
        }
    }
    Ok(loaded)
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::config::{Initializer, OptimizerConfig, PsServerConfig, TableConfig};
    use crate::store::PushId;
    use tessera_proto::rows::put_f32s;
    use tessera_proto::sharding::shard_for_key;

    fn config() -> PsServerConfig {
        PsServerConfig {
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
            ..PsServerConfig::default()
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
            let whole: Vec<(String, Vec<u8>, u64)> = snapshot
                .encode()
                .into_iter()
                .map(|(t, bytes, rows)| (t.to_owned(), bytes, rows))
                .collect();
            let source = crate::replication::copy_stream::CopySource::new(snapshot);
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
        restored.install(load_latest(&restored, dir.path()).unwrap().unwrap());
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
        let check = |damage: &dyn Fn(&Path), expect: &str| {
            let dir = tempfile::tempdir().unwrap();
            let info = save(&store, dir.path(), 3).unwrap();
            damage(&info.path);
            let fresh = Store::new(&config());
            let err = load_latest(&fresh, dir.path()).unwrap_err().to_string();
            assert!(err.contains(expect), "expected {expect:?} in: {err}");
        };
        // A flipped byte in a row file.
        check(
            &|path| {
                let file = path.join("t0-s1.rows");
                let mut bytes = fs::read(&file).unwrap();
                bytes[100] ^= 0x40;
                fs::write(&file, bytes).unwrap();
            },
            "t0-s1.rows is corrupt: CRC-32",
        );
        // A truncated row file.
        check(
            &|path| {
                let file = path.join("t1-s0.rows");
                let bytes = fs::read(&file).unwrap();
                fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();
            },
            "t1-s0.rows is corrupt",
        );
        // A lost file, a lost manifest (an interrupted save).
        check(
            &|path| fs::remove_file(path.join("t0-s0.rows")).unwrap(),
            "incomplete: t0-s0.rows is missing",
        );
        check(
            &|path| fs::remove_file(path.join(MANIFEST)).unwrap(),
            "incomplete: no MANIFEST.json",
        );
        // A manifest that is not JSON.
        check(
            &|path| fs::write(path.join(MANIFEST), b"{ not json").unwrap(),
            "MANIFEST.json is corrupt",
        );
        // A different shape in the configuration.
        let dir = tempfile::tempdir().unwrap();
        save(&store, dir.path(), 3).unwrap();
        let mut other = config();
        other.tables[0].dim = 4;
        let err = load_latest(&Store::new(&other), dir.path())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("does not match") && err.contains("`adam`"),
            "{err}"
        );
        other = config();
        other.tables[1].optimizer = OptimizerConfig::adagrad(0.1);
        assert!(load_latest(&Store::new(&other), dir.path()).is_err());
    }

    #[test]
    fn no_checkpoint_is_not_an_error_and_old_ones_are_pruned() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(&config());
        assert!(load_latest(&store, dir.path()).unwrap().is_none());
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
        assert!(load_latest(&store, dir.path()).unwrap().is_some());
    }

    /// Pushes that add 1 to *every* row of a shard, saved while they run:
    /// each saved shard holds whole Pushes only, so its rows are all equal.
    #[test]
    fn a_checkpoint_under_concurrent_pushes_is_consistent_per_shard() {
        let dir = tempfile::tempdir().unwrap();
        let store = std::sync::Arc::new(Store::new(&config()));
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut pushers = Vec::new();
        for shard in 0..2u32 {
            let (store, stop) = (store.clone(), stop.clone());
            pushers.push(std::thread::spawn(move || {
                let k = keys(shard, 500);
                let grads = wire(&vec![-1.0; k.len() * 2]);
                let mut n = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    store
                        .push("counter", shard, &k, &grads, PushId::default())
                        .unwrap();
                    n += 1;
                }
                n
            }));
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
        let mut checked = 0;
        for _ in 0..5 {
            let info = save(&store, dir.path(), 10).unwrap();
            let fresh = Store::new(&config());
            let loaded = load(&fresh, &info.path).unwrap();
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
        let loaded = load_latest(&Store::new(&config()), dir.path())
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
        let loaded = load_latest(&Store::new(&config()), dir.path()).unwrap();
        assert_eq!(loaded.unwrap().path, first.path);
    }

    #[test]
    fn a_failed_save_removes_its_files_and_leaves_latest_alone() {
        let dir = tempfile::tempdir().unwrap();
        let store = trained_store();
        let good = save(&store, dir.path(), 5).unwrap();
        fail::cfg("checkpoint::after_shard_file", "return").unwrap();
        let failed = save(&store, dir.path(), 5);
        fail::remove("checkpoint::after_shard_file");
        assert!(
            matches!(failed, Err(CheckpointError::Io { .. })),
            "{failed:?}"
        );
        assert_eq!(entries(dir.path(), ".tmp-"), Vec::<String>::new());
        let loaded = load_latest(&Store::new(&config()), dir.path()).unwrap();
        assert_eq!(loaded.unwrap().path, good.path);
        // Numbers go on from the highest present.
        let next = save(&store, dir.path(), 5).unwrap();
        assert!(next.path > good.path);
    }
}
