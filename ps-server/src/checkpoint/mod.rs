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
//! applies: the cut waits for the Push in flight and opens a cut of every
//! row ([`crate::store::Store::snapshot_shard`]: nothing per row; a row a
//! later Push changes is copied first, see [`crate::table::rows::slab`]),
//! so the saved shard reflects whole Pushes only and matches the
//! [`crate::version::Version`] the manifest records for it. Pushes wait
//! only for the cut; encoding ([`crate::rowfile`]) and writing run after
//! the lock is released, on a blocking thread. A restarted server loads
//! the newest complete
//! checkpoint and then, being behind its replicas, catches up from the
//! freshest of them (see [`crate::replication`]); a save that fails removes its
//! `.tmp-` directory; one interrupted by a crash leaves it, never loaded,
//! and the next save removes it.
//!
//! crc32fast (CRC-32, SIMD) checks integrity: the threat is torn or
//! bit-rotted files, not an adversary.

mod dir;
mod durable;
mod load;
mod manifest;
mod save;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};

pub use self::load::{load, load_latest};
pub use self::save::save;
use crate::store::Store;
use crate::table::Table;

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

fn tables_sorted(store: &Store) -> Vec<&Table> {
    let mut tables: Vec<&Table> = store.tables().collect();
    tables.sort_by(|a, b| a.config().name.cmp(&b.config().name));
    tables
}
