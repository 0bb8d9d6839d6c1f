//! What a shard looks like outside the live store: a snapshot of its rows
//! at one cut (to encode), a row as saved, a (table, shard) as saved or
//! copied, a table's row shape, a loaded checkpoint. The store, the
//! checkpoint, the row file, the tables and the copy stream all speak
//! these; this module imports none of them (only the rows' snapshot type
//! from `rows`, which imports nothing of these, and the
//! deduplication windows), so their imports point one way.

use std::path::PathBuf;

use crate::dedup::WorkerWindow;
use crate::rows::RowsSnapshot;
use crate::version::Version;

/// One row as saved.
#[derive(Debug, Clone, PartialEq)]
pub struct RowImage {
    /// Its key.
    pub key: u64,
    /// Optimizer steps applied to it.
    pub steps: u32,
    /// Its expiry stamp (`table/expiry.rs`; 0: none, or unknown).
    pub stamp: u32,
    /// Its values (`dim`).
    pub values: Vec<f32>,
    /// Its optimizer state (`dim * slots`).
    pub state: Vec<f32>,
}

/// One (table, shard) as saved: rows and deduplication windows.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct ShardImage {
    /// The rows, in no particular order.
    pub rows: Vec<RowImage>,
    /// The Push deduplication window of every worker remembered.
    pub dedup: Vec<WorkerWindow>,
}

/// Every table of one shard at one cut
/// ([`crate::store::Store::snapshot_shard`]): owns what it holds (rows are
/// shared with the store, see [`crate::rows::slab`]), so it can outlive the lock and travel to other
/// threads.
#[derive(Debug, Clone)]
pub struct ShardSnapshot {
    /// The shard.
    pub shard: u32,
    /// The version the rows are at.
    pub version: Version,
    /// Each table hosting the shard, by name, and its rows.
    pub tables: Vec<(TableShape, TableSnapshot)>,
}

/// A table's name and row shape, as a snapshot carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableShape {
    /// The table.
    pub name: String,
    /// Values per row.
    pub dim: u32,
    /// Optimizer state slots per value.
    pub slots: u32,
}

/// One (table, shard) at a cut: rows shared with the live ones, and the
/// deduplication windows.
#[derive(Debug, Clone)]
pub struct TableSnapshot {
    /// Every row, shared with the live rows chunk by chunk.
    pub rows: RowsSnapshot,
    /// The Push deduplication windows.
    pub dedup: Vec<WorkerWindow>,
}

/// A verified checkpoint, ready to install: images by (table, shard), and
/// each shard's version.
#[derive(Debug, Default)]
pub struct LoadedCheckpoint {
    /// Where it was read from.
    pub path: PathBuf,
    /// The shard count its rows are routed by.
    pub num_shards: u32,
    /// (table name, shard) -> image.
    pub shards: Vec<(String, u32, ShardImage)>,
    /// shard -> the version it was saved at.
    pub versions: Vec<(u32, Version)>,
    /// When it was saved, seconds since the Unix epoch (its cut's time
    /// for expiry).
    pub saved_at_secs: u64,
}
