//! `MANIFEST.json`: a checkpoint's tables, files, row counts, CRC-32s and
//! each shard's version (written last: its presence marks a complete
//! save).

use serde::{Deserialize, Serialize};

/// Manifest format version: 2 records each shard's version; 1 (without)
/// is read as version 0:0.
pub(super) const VERSION: u32 = 2;

pub(super) const MANIFEST: &str = "MANIFEST.json";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct Manifest {
    pub(super) version: u32,
    pub(super) created_unix_ms: u64,
    pub(super) num_shards: u32,
    pub(super) tables: Vec<ManifestTable>,
    pub(super) files: Vec<ManifestFile>,
    /// The version of every saved shard.
    #[serde(default)]
    pub(super) shards: Vec<ManifestShard>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct ManifestShard {
    pub(super) shard: u32,
    pub(super) epoch: u64,
    pub(super) position: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct ManifestTable {
    pub(super) name: String,
    pub(super) dim: u32,
    pub(super) optimizer: String,
    pub(super) slots: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct ManifestFile {
    pub(super) file: String,
    pub(super) table: String,
    pub(super) shard: u32,
    pub(super) rows: u64,
    pub(super) bytes: u64,
    pub(super) crc32: u32,
}
