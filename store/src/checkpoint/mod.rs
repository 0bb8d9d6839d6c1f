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
//! later Push changes is copied first, see [`crate::rows::slab`]),
//! so the saved shard reflects whole Pushes only and matches the
//! [`crate::version::Version`] the manifest records for it. Pushes wait
//! only for the cut; encoding ([`crate::rowfile`]) and writing run after
//! the lock is released, on a blocking thread. A restarted server loads
//! the newest complete
//! checkpoint and then, being behind its replicas, catches up from the
//! freshest of them (ps-server's `replication`); a save that fails removes its
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
        why: Corruption,
    },
    /// The checkpoint lacks something (an interrupted save, a lost file).
    #[error("checkpoint {path} is incomplete: {why}")]
    Partial {
        /// The checkpoint directory.
        path: PathBuf,
        /// What is missing.
        why: Missing,
    },
    /// The checkpoint does not fit this server's configuration.
    #[error("checkpoint {path} does not match the configuration: {why}")]
    Mismatch {
        /// The checkpoint directory.
        path: PathBuf,
        /// What differs.
        why: Difference,
    },
}

/// What is wrong with a checkpoint file ([`CheckpointError::Corrupt`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Corruption {
    /// `LATEST` names something that is not a checkpoint directory.
    #[error("`{0}` is not a checkpoint name")]
    LatestName(String),
    /// The manifest is not valid JSON of the manifest's shape.
    #[error(transparent)]
    Manifest(#[from] serde_json::Error),
    /// The manifest names a file outside the checkpoint's directory.
    #[error("file name `{0}`")]
    FileName(String),
    /// A shard file's length is not the manifest's.
    #[error("{got} bytes, the manifest says {expected}")]
    Length {
        /// The file's length.
        got: u64,
        /// The manifest's.
        expected: u64,
    },
    /// A shard file's CRC-32 is not the manifest's.
    #[error("CRC-32 {got:#010x}, the manifest says {expected:#010x}")]
    Crc {
        /// The file's.
        got: u32,
        /// The manifest's.
        expected: u32,
    },
    /// A shard file does not decode.
    #[error(transparent)]
    Rows(#[from] crate::rowfile::DecodeError),
    /// A shard file holds another number of rows than the manifest says.
    #[error("{got} rows, the manifest says {expected}")]
    RowCount {
        /// Rows in the file.
        got: u64,
        /// The manifest's.
        expected: u64,
    },
}

/// What a checkpoint lacks ([`CheckpointError::Partial`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Missing {
    /// No manifest: the save was interrupted before its last step.
    #[error("no MANIFEST.json (an interrupted save?)")]
    Manifest,
    /// The manifest lists no file for a (table, shard) this server hosts.
    #[error("no file for table `{table}` shard {shard}")]
    Entry {
        /// The table.
        table: String,
        /// The shard.
        shard: u32,
    },
    /// A file the manifest lists is not there.
    #[error("{0} is missing")]
    File(String),
}

/// How a checkpoint differs from the server's configuration
/// ([`CheckpointError::Mismatch`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Difference {
    /// A manifest format this server cannot read.
    #[error("format version {saved} (this server reads {reads})")]
    Version {
        /// The checkpoint's.
        saved: u32,
        /// This server's.
        reads: u32,
    },
    /// Another shard count.
    #[error("saved with num_shards = {saved}, configured {configured}")]
    Shards {
        /// The checkpoint's.
        saved: u32,
        /// The configuration's.
        configured: u32,
    },
    /// A configured table the checkpoint does not hold.
    #[error("no table `{0}` in it")]
    NoTable(String),
    /// A table saved with another shape or optimizer.
    #[error(
        "table `{table}` was saved with dim {saved_dim} and optimizer {saved_optimizer}, configured dim {dim} and optimizer {optimizer}"
    )]
    Table {
        /// The table.
        table: String,
        /// Its dimension in the checkpoint.
        saved_dim: u32,
        /// Its optimizer in the checkpoint.
        saved_optimizer: String,
        /// The configured dimension.
        dim: u32,
        /// The configured optimizer.
        optimizer: String,
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
