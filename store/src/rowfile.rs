//! The row file: one (table, shard)'s rows, optimizer state and Push
//! deduplication windows as bytes. Checkpoints store one row file per
//! (table, shard); a shard copy between servers (replication) carries one
//! per table; the `checkpoint_rows` fuzz target feeds [`decode`] whatever
//! bytes it likes.
//!
//! ```text
//! magic "TSCKROW2" | dim u32 | slots u32 | rows u64
//! rows x (key u64 | steps u32 | stamp u32 | values dim x f32 | state dim*slots x f32)
//! workers u64 | workers x (worker u64 | highest u64 | words u32 | words x u64)
//! ```
//!
//! `stamp` is the row's expiry stamp (`table/expiry.rs`; 0 in a table
//! without expiry). Files of the first format (magic "TSCKROW1", rows
//! without `stamp`) still decode, their stamps 0 ("unknown": a table with
//! expiry stamps them at load).
//!
//! Little-endian throughout. Decoding checks the shape against the table's
//! configuration, refuses counts the input cannot hold before allocating
//! for them, and fails (never panics) on short or trailing input.

use crate::dedup::WorkerWindow;
use crate::image::{RowImage, ShardImage, ShardSnapshot, TableSnapshot};

/// Magic at the start of every row file written now.
pub(crate) const MAGIC: &[u8; 8] = b"TSCKROW2";
/// Magic of the first format (no stamps).
pub(crate) const MAGIC_V1: &[u8; 8] = b"TSCKROW1";

/// Bytes of a row's fixed part (key, steps, and stamp from the second
/// format on) after `magic`; `None` for anything but a row file's magic.
pub(crate) fn row_head(magic: &[u8]) -> Option<u64> {
    if magic == MAGIC {
        Some(16)
    } else if magic == MAGIC_V1 {
        Some(12)
    } else {
        None
    }
}

/// Bytes of one row of `dim` values and `slots` state slots, written now.
pub(crate) fn row_bytes(dim: u32, slots: u32) -> u64 {
    16 + u64::from(dim) * (1 + u64::from(slots)) * 4
}
/// Where the row count sits: after the magic, dim and slots.
const COUNT_AT: usize = 16;
/// Bytes of a worker window's fixed part (worker, highest, words).
const WINDOW_FIXED: u64 = 20;

/// Writes a row file as rows come.
struct Writer {
    out: Vec<u8>,
    rows: u64,
}

impl Writer {
    fn new(dim: u32, slots: u32, rows_hint: usize) -> Self {
        let row_bytes = row_bytes(dim, slots) as usize;
        let mut out = Vec::with_capacity(32 + rows_hint * row_bytes);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&dim.to_le_bytes());
        out.extend_from_slice(&slots.to_le_bytes());
        out.extend_from_slice(&0u64.to_le_bytes());
        Self { out, rows: 0 }
    }

    fn row(&mut self, key: u64, steps: u32, stamp: u32, values: &[f32], state: &[f32]) {
        self.out.extend_from_slice(&key.to_le_bytes());
        self.out.extend_from_slice(&steps.to_le_bytes());
        self.out.extend_from_slice(&stamp.to_le_bytes());
        for v in values.iter().chain(state) {
            self.out.extend_from_slice(&v.to_le_bytes());
        }
        self.rows += 1;
    }

    fn finish(mut self, dedup: &[WorkerWindow]) -> (Vec<u8>, u64) {
        self.out[COUNT_AT..COUNT_AT + 8].copy_from_slice(&self.rows.to_le_bytes());
        self.out
            .extend_from_slice(&(dedup.len() as u64).to_le_bytes());
        for window in dedup {
            self.out.extend_from_slice(&window.worker.to_le_bytes());
            self.out.extend_from_slice(&window.highest.to_le_bytes());
            self.out
                .extend_from_slice(&(window.bits.len() as u32).to_le_bytes());
            for word in &window.bits {
                self.out.extend_from_slice(&word.to_le_bytes());
            }
        }
        (self.out, self.rows)
    }
}

/// The row file of one (table, shard) snapshot ([`crate::table::Table::snapshot`]),
/// for a table of `dim` and `slots`. Encoding runs after the shard's
/// write lock is released: the snapshot is already a cut. Returns the
/// bytes and the row count.
pub fn encode_snapshot(snapshot: &TableSnapshot, dim: u32, slots: u32) -> (Vec<u8>, u64) {
    let mut writer = Writer::new(dim, slots, snapshot.rows.len());
    snapshot.rows.for_each_from(0, |row| {
        row.encode(&mut writer.out);
        writer.rows += 1;
        true
    });
    writer.finish(&snapshot.dedup)
}

/// Each table's row file of a shard snapshot (name, bytes, rows), in name
/// order.
pub fn encode_shard(snapshot: &ShardSnapshot) -> Vec<(&str, Vec<u8>, u64)> {
    snapshot
        .tables
        .iter()
        .map(|(shape, table)| {
            let (bytes, rows) = encode_snapshot(table, shape.dim, shape.slots);
            (shape.name.as_str(), bytes, rows)
        })
        .collect()
}

/// A fingerprint of one (table, shard) snapshot that does not depend on
/// the order rows are stored in: the wrapping sum of a 64-bit hash (FNV-1a,
/// then SplitMix64's finaliser) of every row's key, steps, values and state
/// as bits, and of every deduplication window. Equal rows, state and
/// windows give equal digests on any server. Returns the row count and the
/// digest.
pub fn digest_snapshot(snapshot: &TableSnapshot) -> (u64, u64) {
    let mut digest = 0u64;
    let mut bytes = Vec::new();
    snapshot.rows.for_each_from(0, |row| {
        // Key, steps, values and state bits: the row as a row file has
        // it, less the expiry stamp (each copy's own Fetch marks may move
        // it: `table/expiry.rs`).
        bytes.clear();
        row.encode(&mut bytes);
        bytes.drain(12..16);
        digest = digest.wrapping_add(fnv(bytes.iter().copied()));
        true
    });
    for window in &snapshot.dedup {
        let bytes = window
            .worker
            .to_le_bytes()
            .into_iter()
            .chain(window.highest.to_le_bytes())
            .chain(window.bits.iter().flat_map(|w| w.to_le_bytes()))
            .chain(*b"dedup");
        digest = digest.wrapping_add(fnv(bytes));
    }
    (snapshot.rows.len() as u64, digest)
}

/// FNV-1a, then SplitMix64's finaliser.
fn fnv(bytes: impl IntoIterator<Item = u8>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    tessera_proto::sharding::splitmix64(h)
}

/// The wrapping sum of a hash of every row's key and values (as f32 bits)
/// of `snapshot`: summed over the shards of a fleet's copy, the same for
/// any two fleets holding the same rows, whatever their shard counts,
/// optimizer state and Push history (`ShardDigest.values_digest`).
pub fn values_digest(snapshot: &TableSnapshot) -> u64 {
    let mut digest = 0u64;
    let mut bytes = Vec::new();
    snapshot.rows.for_each_from(0, |row| {
        bytes.clear();
        bytes.extend_from_slice(&row.key().to_le_bytes());
        for v in row.values() {
            bytes.extend_from_slice(&v.to_bits().to_le_bytes());
        }
        digest = digest.wrapping_add(fnv(bytes.iter().copied()));
        true
    });
    digest
}

/// The row file of an image (tests and tools; servers write from the live
/// rows with [`encode_snapshot`]).
pub fn encode(image: &ShardImage, dim: u32, slots: u32) -> Vec<u8> {
    let mut writer = Writer::new(dim, slots, image.rows.len());
    for row in &image.rows {
        writer.row(row.key, row.steps, row.stamp, &row.values, &row.state);
    }
    writer.finish(&image.dedup).0
}

/// A cursor over a row file that fails, never panics, on short input.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&end| end <= self.bytes.len())
            .ok_or(DecodeError::Truncated { at: self.at })?;
        let slice = &self.bytes[self.at..end];
        self.at = end;
        Ok(slice)
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, DecodeError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }

    fn f32s(&mut self, n: usize) -> Result<Vec<f32>, DecodeError> {
        let bytes = n
            .checked_mul(4)
            .ok_or(DecodeError::Truncated { at: self.at })?;
        Ok(self
            .take(bytes)?
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
}

/// Why bytes are not a row file of the expected shape.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The input ends before the file does.
    #[error("truncated at byte {at}")]
    Truncated {
        /// Where the input ran out.
        at: usize,
    },
    /// The input does not start with the row file's magic.
    #[error("not a Tessera row file (bad magic)")]
    BadMagic,
    /// The rows have another shape than the table.
    #[error("rows of dim {dim} with {slots} state slots, expected {want_dim} and {want_slots}")]
    Shape {
        /// Dimension in the file.
        dim: u32,
        /// Optimizer state slots in the file.
        slots: u32,
        /// The table's dimension.
        want_dim: u32,
        /// The table's slots.
        want_slots: u32,
    },
    /// A count larger than the input could hold.
    #[error("claims {count} {what}, more than the input holds")]
    Count {
        /// What is counted.
        what: &'static str,
        /// The count claimed.
        count: u64,
    },
    /// Bytes after the end of the file.
    #[error("{0} bytes after the end")]
    Trailing(usize),
}

/// Parses a row file for a table of `dim` values and `slots` optimizer
/// state slots per row.
pub fn decode(bytes: &[u8], dim: u32, slots: u32) -> Result<ShardImage, DecodeError> {
    let mut r = Reader { bytes, at: 0 };
    let head = row_head(r.take(MAGIC.len())?).ok_or(DecodeError::BadMagic)?;
    let (file_dim, file_slots) = (r.u32()?, r.u32()?);
    if (file_dim, file_slots) != (dim, slots) {
        return Err(DecodeError::Shape {
            dim: file_dim,
            slots: file_slots,
            want_dim: dim,
            want_slots: slots,
        });
    }
    let count = r.u64()?;
    let row_bytes = head + u64::from(dim) * (1 + u64::from(slots)) * 4;
    if count.saturating_mul(row_bytes) > bytes.len() as u64 {
        return Err(DecodeError::Count {
            what: "rows",
            count,
        });
    }
    let mut image = ShardImage::default();
    image.rows.reserve(count as usize);
    for _ in 0..count {
        let key = r.u64()?;
        let steps = r.u32()?;
        let stamp = if head == 16 { r.u32()? } else { 0 };
        let values = r.f32s(dim as usize)?;
        let state = r.f32s(dim as usize * slots as usize)?;
        image.rows.push(RowImage {
            key,
            steps,
            stamp,
            values,
            state,
        });
    }
    let workers = r.u64()?;
    if workers.saturating_mul(WINDOW_FIXED) > bytes.len() as u64 {
        return Err(DecodeError::Count {
            what: "workers",
            count: workers,
        });
    }
    for _ in 0..workers {
        let (worker, highest) = (r.u64()?, r.u64()?);
        let words = r.u32()? as usize;
        // Bounded by the input: each word is 8 bytes of it.
        let mut bits = Vec::with_capacity(words.min(r.bytes.len().saturating_sub(r.at) / 8));
        for _ in 0..words {
            bits.push(r.u64()?);
        }
        image.dedup.push(WorkerWindow {
            worker,
            highest,
            bits,
        });
    }
    if r.at != bytes.len() {
        return Err(DecodeError::Trailing(bytes.len() - r.at));
    }
    Ok(image)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn row_files_round_trip_and_every_truncation_is_refused(
            dim in 1u32..6,
            slots in 0u32..3,
            rows in proptest::collection::vec((any::<u64>(), any::<u32>(), any::<u32>(), any::<u32>()), 0..20),
            dedup in proptest::collection::vec((any::<u64>(), any::<u64>(), proptest::collection::vec(any::<u64>(), 0..17)), 0..4),
        ) {
            let image = ShardImage {
                rows: rows
                    .iter()
                    .map(|&(key, steps, stamp, seed)| RowImage {
                        key,
                        steps,
                        stamp,
                        values: (0..dim).map(|j| (seed ^ j) as f32 * 0.5).collect(),
                        state: (0..dim * slots).map(|j| f32::from_bits(seed.wrapping_add(j) & 0x7f7f_ffff)).collect(),
                    })
                    .collect(),
                dedup: dedup
                    .into_iter()
                    .map(|(worker, highest, bits)| WorkerWindow { worker, highest, bits })
                    .collect(),
            };
            let bytes = encode(&image, dim, slots);
            prop_assert_eq!(decode(&bytes, dim, slots).unwrap(), image);
            for cut in 0..bytes.len() {
                prop_assert!(decode(&bytes[..cut], dim, slots).is_err());
            }
        }
    }

    #[test]
    fn garbage_is_refused_without_panicking() {
        assert!(matches!(
            decode(b"", 2, 0),
            Err(DecodeError::Truncated { at: 0 })
        ));
        assert_eq!(
            decode(
                b"TSCKROW2\x02\0\0\0\0\0\0\0\xff\xff\xff\xff\xff\xff\xff\xff",
                2,
                0
            ),
            Err(DecodeError::Count {
                what: "rows",
                count: u64::MAX
            })
        );
        let mut ok = encode(&ShardImage::default(), 2, 0);
        assert!(matches!(
            decode(&ok, 3, 0),
            Err(DecodeError::Shape { dim: 2, .. })
        ));
        ok.push(0);
        assert_eq!(decode(&ok, 2, 0), Err(DecodeError::Trailing(1)));
    }

    #[test]
    fn files_of_the_first_format_decode_with_unknown_stamps() {
        // TSCKROW1, dim 1, no slots, one row (key 7, steps 3, value 1.5),
        // no workers.
        let mut v1 = b"TSCKROW1".to_vec();
        for word in [1u32, 0] {
            v1.extend_from_slice(&word.to_le_bytes());
        }
        v1.extend_from_slice(&1u64.to_le_bytes());
        v1.extend_from_slice(&7u64.to_le_bytes());
        v1.extend_from_slice(&3u32.to_le_bytes());
        v1.extend_from_slice(&1.5f32.to_le_bytes());
        v1.extend_from_slice(&0u64.to_le_bytes());
        let image = decode(&v1, 1, 0).unwrap();
        assert_eq!(
            image.rows,
            vec![RowImage {
                key: 7,
                steps: 3,
                stamp: 0,
                values: vec![1.5],
                state: vec![],
            }]
        );
    }
}
