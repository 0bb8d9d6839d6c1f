//! Writes that survive a crash: a file written and fsynced, a directory
//! fsynced after a rename into it.

use std::fs::File;
use std::io::Write;
use std::path::Path;

use super::{CheckpointError, io};

/// Bytes of the stream encoded and written at a time.
const WRITE_CHUNK: usize = 1 << 20;

/// Writes `len` bytes of `source`'s stream from `offset` to a new file at
/// `path`, a chunk at a time, and syncs it; returns the bytes' CRC-32.
pub(super) fn write_range_synced(
    path: &Path,
    source: &crate::copy_stream::CopySource,
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

pub(super) fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let mut file = File::create(path).map_err(io(path))?;
    file.write_all(bytes).map_err(io(path))?;
    file.sync_all().map_err(io(path))
}

pub(super) fn sync_dir(path: &Path) -> Result<(), CheckpointError> {
    File::open(path)
        .and_then(|dir| dir.sync_all())
        .map_err(io(path))
}
