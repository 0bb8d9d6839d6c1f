//! Loading: everything read and verified into memory before the store is
//! touched.

use std::fs;
use std::path::Path;

use super::dir::LATEST;
use super::manifest::{MANIFEST, Manifest, VERSION};
use super::{CheckpointError, Corruption, Difference, Missing, tables_sorted};
use crate::image::LoadedCheckpoint;
use crate::rowfile;
use crate::store::Store;
use crate::version::Version;

/// Reads and verifies the checkpoint `LATEST` names in `dir` against
/// `store`'s tables and shards. `Ok(None)` when `dir` has no checkpoint.
///
/// `other_counts`: a checkpoint saved under another shard count than the
/// configured one is loaded too, and the store routes by its count
/// (etcd mode, where the cluster's shard map reconciles the two after a
/// resize: `crate::reshard`); otherwise it is refused.
pub fn load_latest(
    store: &Store,
    dir: &Path,
    other_counts: bool,
) -> Result<Option<LoadedCheckpoint>, CheckpointError> {
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
            why: Corruption::LatestName(name),
        });
    }
    load(store, &dir.join(name), other_counts).map(Some)
}

/// Reads and verifies the checkpoint at `path` (see the module docs).
pub fn load(
    store: &Store,
    path: &Path,
    other_counts: bool,
) -> Result<LoadedCheckpoint, CheckpointError> {
    let manifest_path = path.join(MANIFEST);
    let text = match fs::read(&manifest_path) {
        Ok(text) => text,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            return Err(CheckpointError::Partial {
                path: path.to_owned(),
                why: Missing::Manifest,
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
            why: err.into(),
        })?;
    let mismatch = |why: Difference| CheckpointError::Mismatch {
        path: path.to_owned(),
        why,
    };
    if manifest.version != VERSION && manifest.version != 1 {
        return Err(mismatch(Difference::Version {
            saved: manifest.version,
            reads: VERSION,
        }));
    }
    if manifest.num_shards != store.configured_shards()
        && !(other_counts && manifest.num_shards > 0)
    {
        return Err(mismatch(Difference::Shards {
            saved: manifest.num_shards,
            configured: store.configured_shards(),
        }));
    }
    let mut loaded = LoadedCheckpoint {
        path: path.to_owned(),
        num_shards: manifest.num_shards,
        saved_at_secs: manifest.created_unix_ms / 1000,
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
            .ok_or_else(|| mismatch(Difference::NoTable(config.name.clone())))?;
        if saved.dim != config.dim
            || saved.slots != slots
            || saved.optimizer != config.optimizer.name()
        {
            return Err(mismatch(Difference::Table {
                table: config.name.clone(),
                saved_dim: saved.dim,
                saved_optimizer: saved.optimizer.clone(),
                dim: config.dim,
                optimizer: config.optimizer.name().to_owned(),
            }));
        }
        for &shard in store.hosted() {
            let entry = manifest
                .files
                .iter()
                .find(|f| f.table == config.name && f.shard == shard)
                .ok_or_else(|| CheckpointError::Partial {
                    path: path.to_owned(),
                    why: Missing::Entry {
                        table: config.name.clone(),
                        shard,
                    },
                })?;
            if entry.file.contains('/') || entry.file.contains("..") {
                return Err(CheckpointError::Corrupt {
                    path: manifest_path.clone(),
                    why: Corruption::FileName(entry.file.clone()),
                });
            }
            let file = path.join(&entry.file);
            let bytes = match fs::read(&file) {
                Ok(bytes) => bytes,
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
                    return Err(CheckpointError::Partial {
                        path: path.to_owned(),
                        why: Missing::File(entry.file.clone()),
                    });
                }
                Err(source) => return Err(CheckpointError::Io { path: file, source }),
            };
            let corrupt = |why: Corruption| CheckpointError::Corrupt {
                path: file.clone(),
                why,
            };
            if bytes.len() as u64 != entry.bytes {
                return Err(corrupt(Corruption::Length {
                    got: bytes.len() as u64,
                    expected: entry.bytes,
                }));
            }
            let crc = crc32fast::hash(&bytes);
            if crc != entry.crc32 {
                return Err(corrupt(Corruption::Crc {
                    got: crc,
                    expected: entry.crc32,
                }));
            }
            let image =
                rowfile::decode(&bytes, config.dim, slots).map_err(|err| corrupt(err.into()))?;
            if image.rows.len() as u64 != entry.rows {
                return Err(corrupt(Corruption::RowCount {
                    got: image.rows.len() as u64,
                    expected: entry.rows,
                }));
            }
            loaded.shards.push((config.name.clone(), shard, image));
        }
    }
    Ok(loaded)
}
