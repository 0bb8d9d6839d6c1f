//! Loading: everything read and verified into memory before the store is
//! touched.

use std::fs;
use std::path::Path;

use super::dir::LATEST;
use super::manifest::{MANIFEST, Manifest, VERSION};
use super::{CheckpointError, tables_sorted};
use crate::image::LoadedCheckpoint;
use crate::rowfile;
use crate::store::Store;
use crate::version::Version;

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
