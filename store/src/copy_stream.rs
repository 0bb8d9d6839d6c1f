//! A shard copy as a byte stream, encoded and decoded piece by piece.
//!
//! The stream is what a replica copies (ps-server's `replication::sync`)
//! and a checkpoint writes: the number of tables (u32),
//! then per table, by name, the name's length (u32) and bytes, the row
//! file's length (u64) and the row file ([`crate::rowfile`]: a 24-byte
//! header, fixed-size rows, then the deduplication windows).
//!
//! - [`CopySource`] (the serving side) keeps the shard's snapshot — rows
//!   shared with the live store, so a copy costs a reference per row and
//!   the rows Pushes change meanwhile, not a second shard — and encodes any
//!   byte range of the stream on request. Rows have a fixed size per
//!   table, so an offset maps to a row without encoding what comes before:
//!   a chunk asked twice (its answer was lost) is the same bytes, and the
//!   whole stream never exists in memory at once.
//! - [`CopyDecoder`] (the receiving side) takes the chunks as they come
//!   and hands out whole rows and windows, keeping at most one partial
//!   item between chunks, so a replica installs a copy chunk by chunk
//!   instead of holding the download, its decoded image and the rows at
//!   once. It is sans-IO: bytes in ([`CopyDecoder::handle_bytes`]), items
//!   out, [`CopyDecoder::finish`] at the end; it fails, never panics, on
//!   any input.

use crate::dedup::WorkerWindow;
use crate::image::{RowImage, ShardSnapshot, TableShape};

/// Bytes of a row file's header: magic, dim, slots, row count.
const HEADER: u64 = 24;
use crate::rowfile::{MAGIC, row_bytes, row_head};
/// Longest table name a copy may carry.
const MAX_NAME: usize = 4096;
/// Most words in one deduplication window a copy may carry (a window has
/// 16; the bound keeps a corrupt count from allocating much).
const MAX_WORDS: usize = 1024;

/// One table's place in the stream.
#[derive(Debug)]
struct Part {
    /// Name length, name, row file length, row file header.
    prefix: Vec<u8>,
    /// Deduplication windows, as encoded.
    trailer: Vec<u8>,
    row_bytes: u64,
}

/// A shard copy being served: its snapshot and where each piece of the
/// stream lies.
#[derive(Debug)]
pub struct CopySource {
    snapshot: ShardSnapshot,
    parts: Vec<Part>,
    total: u64,
}

impl CopySource {
    /// The stream of `snapshot`.
    pub fn new(snapshot: ShardSnapshot) -> Self {
        let mut parts = Vec::with_capacity(snapshot.tables.len());
        let mut total = 4u64;
        for (shape, table) in &snapshot.tables {
            let row_bytes = row_bytes(shape.dim, shape.slots);
            let mut trailer = Vec::new();
            trailer.extend_from_slice(&(table.dedup.len() as u64).to_le_bytes());
            for window in &table.dedup {
                trailer.extend_from_slice(&window.worker.to_le_bytes());
                trailer.extend_from_slice(&window.highest.to_le_bytes());
                trailer.extend_from_slice(&(window.bits.len() as u32).to_le_bytes());
                for word in &window.bits {
                    trailer.extend_from_slice(&word.to_le_bytes());
                }
            }
            let rows = table.rows.len() as u64;
            let file = HEADER + rows * row_bytes + trailer.len() as u64;
            let mut prefix = Vec::with_capacity(12 + shape.name.len() + HEADER as usize);
            prefix.extend_from_slice(&(shape.name.len() as u32).to_le_bytes());
            prefix.extend_from_slice(shape.name.as_bytes());
            prefix.extend_from_slice(&file.to_le_bytes());
            prefix.extend_from_slice(MAGIC);
            prefix.extend_from_slice(&shape.dim.to_le_bytes());
            prefix.extend_from_slice(&shape.slots.to_le_bytes());
            prefix.extend_from_slice(&rows.to_le_bytes());
            total += prefix.len() as u64 - HEADER + file;
            parts.push(Part {
                prefix,
                trailer,
                row_bytes,
            });
        }
        Self {
            snapshot,
            parts,
            total,
        }
    }

    /// Bytes in the whole stream.
    pub fn total_bytes(&self) -> u64 {
        self.total
    }

    /// Where each table's row file lies in the stream (name, offset,
    /// length, rows): a checkpoint writes each as a file of its own,
    /// encoded range by range ([`CopySource::read_at`]) instead of whole.
    pub fn table_files(&self) -> Vec<(&str, u64, u64, u64)> {
        let mut at = 4u64;
        let mut out = Vec::with_capacity(self.parts.len());
        for (part, (shape, table)) in self.parts.iter().zip(&self.snapshot.tables) {
            let rows = table.rows.len() as u64;
            let file = HEADER + rows * part.row_bytes + part.trailer.len() as u64;
            let start = at + 4 + shape.name.len() as u64 + 8;
            out.push((shape.name.as_str(), start, file, rows));
            at = start + file;
        }
        out
    }

    /// The stream's bytes from `offset`, at most `max` of them (fewer at
    /// the end; none at or past it).
    pub fn read_at(&self, offset: u64, max: usize) -> Vec<u8> {
        let end = offset.saturating_add(max as u64).min(self.total);
        let mut out = Vec::with_capacity(end.saturating_sub(offset) as usize);
        if offset >= end {
            return out;
        }
        let mut at = 0u64;
        // Appends the part of `bytes` (at `at` in the stream) in range.
        let small = |at: &mut u64, bytes: &[u8], out: &mut Vec<u8>| {
            let (from, to) = (*at, *at + bytes.len() as u64);
            if to > offset && from < end {
                let lo = (offset.max(from) - from) as usize;
                let hi = (end.min(to) - from) as usize;
                out.extend_from_slice(&bytes[lo..hi]);
            }
            *at = to;
        };
        small(&mut at, &(self.parts.len() as u32).to_le_bytes(), &mut out);
        for (part, (_, table)) in self.parts.iter().zip(&self.snapshot.tables) {
            if at >= end {
                break;
            }
            small(&mut at, &part.prefix, &mut out);
            let rows_len = table.rows.len() as u64 * part.row_bytes;
            let (from, to) = (at, at + rows_len);
            if rows_len > 0 && to > offset && from < end {
                let lo = offset.max(from) - from;
                let hi = end.min(to) - from;
                let (first, last) = (lo / part.row_bytes, (hi - 1) / part.row_bytes);
                let mut rows = Vec::with_capacity(((last - first + 1) * part.row_bytes) as usize);
                let mut left = last - first + 1;
                table.rows.for_each_from(first as usize, |row| {
                    row.encode(&mut rows);
                    left -= 1;
                    left > 0
                });
                let skip = (lo - first * part.row_bytes) as usize;
                out.extend_from_slice(&rows[skip..skip + (hi - lo) as usize]);
            }
            at = to;
            small(&mut at, &part.trailer, &mut out);
        }
        out
    }
}

/// Why a copy stream does not decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StreamError {
    /// A table name is not UTF-8 or too long.
    #[error("a table name in the copy is not a name")]
    BadName,
    /// A table this server is not configured with.
    #[error("the copy has a table `{0}` this server lacks")]
    UnknownTable(String),
    /// A row file does not start with the magic.
    #[error("table `{0}` of the copy is not a row file")]
    BadMagic(String),
    /// Rows of another shape than the table's.
    #[error(
        "table `{table}` of the copy has dim {dim} and {slots} slots, configured {want_dim} and {want_slots}"
    )]
    Shape {
        /// The table.
        table: String,
        /// Dimension in the copy.
        dim: u32,
        /// Slots in the copy.
        slots: u32,
        /// Configured dimension.
        want_dim: u32,
        /// Configured slots.
        want_slots: u32,
    },
    /// A row file's length disagrees with what it holds.
    #[error("table `{0}` of the copy has a wrong length")]
    Length(String),
    /// A deduplication window with more words than any has.
    #[error("a deduplication window of {0} words")]
    Window(usize),
    /// The stream ended in the middle of something.
    #[error("the copy is truncated")]
    Truncated,
    /// Bytes after the last table.
    #[error("bytes after the end of the copy")]
    Trailing,
}

/// What a decoded piece of the stream is.
#[derive(Debug, Clone, PartialEq)]
pub enum CopyItem {
    /// The rows that follow, until the next `Table`, are this table's.
    Table(String),
    /// One row of the current table.
    Row(RowImage),
    /// The current table's deduplication windows (its last item).
    Windows(Vec<WorkerWindow>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Need {
    Count,
    NameLen,
    Name(usize),
    FileLen,
    Header,
    Row,
    Workers,
    WindowHead,
    Words(usize),
    Done,
}

/// Decodes a copy stream as it arrives (module docs).
pub struct CopyDecoder<F> {
    /// The configured shape of a table, by name.
    shape_of: F,
    need: Need,
    buf: Vec<u8>,
    tables_left: u32,
    table: Option<TableShape>,
    file_left: u64,
    rows_left: u64,
    workers_left: u64,
    windows: Vec<WorkerWindow>,
    window: (u64, u64),
    /// Bytes of a row's fixed part in the current table's file (its
    /// format's: [`row_head`]).
    head: u64,
}

impl<F: Fn(&str) -> Option<TableShape>> CopyDecoder<F> {
    /// A decoder checking each table against `shape_of` (the receiver's
    /// configuration).
    pub fn new(shape_of: F) -> Self {
        Self {
            shape_of,
            need: Need::Count,
            buf: Vec::new(),
            tables_left: 0,
            table: None,
            file_left: 0,
            rows_left: 0,
            workers_left: 0,
            windows: Vec::new(),
            window: (0, 0),
            head: 16,
        }
    }

    fn wanted(&self) -> usize {
        match self.need {
            Need::Count | Need::NameLen => 4,
            Need::Name(n) => n,
            Need::FileLen | Need::Workers => 8,
            Need::Header => HEADER as usize,
            Need::Row => self.table.as_ref().map_or(0, |t| {
                (self.head + u64::from(t.dim) * (1 + u64::from(t.slots)) * 4) as usize
            }),
            Need::WindowHead => 20,
            Need::Words(n) => n * 8,
            Need::Done => 0,
        }
    }

    /// Takes the next bytes of the stream; appends the items they complete
    /// to `out`.
    pub fn handle_bytes(
        &mut self,
        mut bytes: &[u8],
        out: &mut Vec<CopyItem>,
    ) -> Result<(), StreamError> {
        while !bytes.is_empty() {
            if self.need == Need::Done {
                return Err(StreamError::Trailing);
            }
            let wanted = self.wanted();
            if self.buf.is_empty() && bytes.len() >= wanted {
                // Whole items straight from the input.
                let (item, rest) = bytes.split_at(wanted);
                bytes = rest;
                self.item(item, out)?;
                continue;
            }
            let take = (wanted - self.buf.len()).min(bytes.len());
            self.buf.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            if self.buf.len() == wanted {
                let item = std::mem::take(&mut self.buf);
                self.item(&item, out)?;
            }
        }
        Ok(())
    }

    /// Checks that the stream ended where a stream may end.
    pub fn finish(&self) -> Result<(), StreamError> {
        if self.need == Need::Done {
            Ok(())
        } else {
            Err(StreamError::Truncated)
        }
    }

    fn table_name(&self) -> String {
        self.table
            .as_ref()
            .map(|t| t.name.clone())
            .unwrap_or_default()
    }

    /// Consumes `n` bytes of the current row file.
    fn file_bytes(&mut self, n: u64) -> Result<(), StreamError> {
        self.file_left = self
            .file_left
            .checked_sub(n)
            .ok_or_else(|| StreamError::Length(self.table_name()))?;
        Ok(())
    }

    fn next_table(&mut self) {
        self.table = None;
        self.need = if self.tables_left == 0 {
            Need::Done
        } else {
            self.tables_left -= 1;
            Need::NameLen
        };
    }

    fn item(&mut self, item: &[u8], out: &mut Vec<CopyItem>) -> Result<(), StreamError> {
        let u32_at =
            |i: usize| u32::from_le_bytes([item[i], item[i + 1], item[i + 2], item[i + 3]]);
        let u64_at = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&item[i..i + 8]);
            u64::from_le_bytes(b)
        };
        match self.need {
            Need::Count => {
                self.tables_left = u32_at(0);
                self.next_table();
            }
            Need::NameLen => {
                let len = u32_at(0) as usize;
                if len > MAX_NAME {
                    return Err(StreamError::BadName);
                }
                self.need = Need::Name(len);
            }
            Need::Name(_) => {
                let name = std::str::from_utf8(item).map_err(|_| StreamError::BadName)?;
                let shape = (self.shape_of)(name)
                    .ok_or_else(|| StreamError::UnknownTable(name.to_owned()))?;
                out.push(CopyItem::Table(name.to_owned()));
                self.table = Some(shape);
                self.need = Need::FileLen;
            }
            Need::FileLen => {
                self.file_left = u64_at(0);
                self.need = Need::Header;
            }
            Need::Header => {
                self.file_bytes(HEADER)?;
                let table = self.table.clone().unwrap_or_else(|| TableShape {
                    name: String::new(),
                    dim: 0,
                    slots: 0,
                });
                let Some(head) = row_head(&item[..8]) else {
                    return Err(StreamError::BadMagic(table.name));
                };
                self.head = head;
                let (dim, slots) = (u32_at(8), u32_at(12));
                if (dim, slots) != (table.dim, table.slots) {
                    return Err(StreamError::Shape {
                        table: table.name,
                        dim,
                        slots,
                        want_dim: table.dim,
                        want_slots: table.slots,
                    });
                }
                self.rows_left = u64_at(16);
                // The rows must fit in what the file says it holds (a
                // corrupt count cannot make the decoder wait forever).
                let row = head + u64::from(dim) * (1 + u64::from(slots)) * 4;
                if self.rows_left.saturating_mul(row) > self.file_left {
                    return Err(StreamError::Length(table.name));
                }
                self.need = if self.rows_left == 0 {
                    Need::Workers
                } else {
                    Need::Row
                };
            }
            Need::Row => {
                self.file_bytes(item.len() as u64)?;
                let dim = self.table.as_ref().map_or(0, |t| t.dim as usize);
                let f32_at =
                    |i: usize| f32::from_le_bytes([item[i], item[i + 1], item[i + 2], item[i + 3]]);
                let head = self.head as usize;
                let floats = (item.len() - head) / 4;
                out.push(CopyItem::Row(RowImage {
                    key: u64_at(0),
                    steps: u32_at(8),
                    stamp: if head == 16 { u32_at(12) } else { 0 },
                    values: (0..dim).map(|j| f32_at(head + 4 * j)).collect(),
                    state: (dim..floats).map(|j| f32_at(head + 4 * j)).collect(),
                }));
                self.rows_left -= 1;
                if self.rows_left == 0 {
                    self.need = Need::Workers;
                }
            }
            Need::Workers => {
                self.file_bytes(8)?;
                self.workers_left = u64_at(0);
                if self.workers_left.saturating_mul(20) > self.file_left {
                    return Err(StreamError::Length(self.table_name()));
                }
                self.end_window_or_table(out)?;
            }
            Need::WindowHead => {
                self.file_bytes(20)?;
                self.window = (u64_at(0), u64_at(8));
                let words = u32_at(16) as usize;
                if words > MAX_WORDS {
                    return Err(StreamError::Window(words));
                }
                if words == 0 {
                    self.push_window(Vec::new(), out)?;
                } else {
                    self.need = Need::Words(words);
                }
            }
            Need::Words(words) => {
                self.file_bytes(item.len() as u64)?;
                let bits = (0..words).map(|i| u64_at(8 * i)).collect();
                self.push_window(bits, out)?;
            }
            Need::Done => return Err(StreamError::Trailing),
        }
        Ok(())
    }

    fn push_window(&mut self, bits: Vec<u64>, out: &mut Vec<CopyItem>) -> Result<(), StreamError> {
        let (worker, highest) = self.window;
        self.windows.push(WorkerWindow {
            worker,
            highest,
            bits,
        });
        self.workers_left -= 1;
        self.end_window_or_table(out)
    }

    fn end_window_or_table(&mut self, out: &mut Vec<CopyItem>) -> Result<(), StreamError> {
        if self.workers_left > 0 {
            self.need = Need::WindowHead;
            return Ok(());
        }
        if self.file_left != 0 {
            return Err(StreamError::Length(self.table_name()));
        }
        out.push(CopyItem::Windows(std::mem::take(&mut self.windows)));
        self.next_table();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{OptimizerConfig, StoreConfig, TableConfig};
    use crate::image::ShardImage;
    use crate::rowfile;
    use crate::store::{PushId, Store};
    use proptest::prelude::*;
    use tessera_proto::rows::put_f32s;

    fn store() -> Store {
        Store::new(&StoreConfig {
            tables: vec![
                TableConfig {
                    optimizer: OptimizerConfig::adam(0.1),
                    ..TableConfig::new("a", 3)
                },
                TableConfig::new("b", 2),
                TableConfig::new("empty", 1),
            ],
            ..StoreConfig::default()
        })
    }

    fn filled(rows: u64, workers: u64) -> Store {
        let store = store();
        for w in 1..=workers.max(1) {
            let keys: Vec<u64> = (0..rows).collect();
            let mut a = Vec::new();
            put_f32s(&mut a, &vec![0.5; keys.len() * 3]);
            let mut b = Vec::new();
            put_f32s(&mut b, &vec![0.25; keys.len() * 2]);
            let id = PushId {
                worker: if workers == 0 { 0 } else { w },
                sequence: if workers == 0 { 0 } else { w * 3 },
            };
            store.push("a", 0, &keys, &a, id).unwrap();
            store.push("b", 0, &keys, &b, id).unwrap();
        }
        store
    }

    fn shape_of(store: &Store) -> impl Fn(&str) -> Option<TableShape> + '_ {
        |name| {
            store.table(name).map(|t| TableShape {
                name: name.to_owned(),
                dim: t.config().dim,
                slots: t.config().optimizer.slots() as u32,
            })
        }
    }

    /// Every table's rows of a shard snapshot, as one blob (what [`CopySource`] serves chunk by chunk).
    fn encode_blob(snapshot: &ShardSnapshot) -> Vec<u8> {
        let files = rowfile::encode_shard(snapshot);
        let mut blob = Vec::with_capacity(
            4 + files
                .iter()
                .map(|(n, f, _)| n.len() + f.len() + 12)
                .sum::<usize>(),
        );
        blob.extend_from_slice(&(files.len() as u32).to_le_bytes());
        for (name, bytes, _) in files {
            blob.extend_from_slice(&(name.len() as u32).to_le_bytes());
            blob.extend_from_slice(name.as_bytes());
            blob.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
            blob.extend_from_slice(&bytes);
        }
        blob
    }

    /// Parses a blob into each table's image, checking every table against
    /// `store`'s configuration (what [`CopyDecoder`] decodes chunk by chunk).
    fn decode(store: &Store, mut data: &[u8]) -> Result<Vec<(String, ShardImage)>, String> {
        fn take<'a>(n: usize, data: &mut &'a [u8]) -> Result<&'a [u8], String> {
            if data.len() < n {
                return Err("truncated".into());
            }
            let (head, rest) = data.split_at(n);
            *data = rest;
            Ok(head)
        }
        let mut count = [0u8; 4];
        count.copy_from_slice(take(4, &mut data)?);
        let mut out = Vec::new();
        for _ in 0..u32::from_le_bytes(count) {
            let mut len = [0u8; 4];
            len.copy_from_slice(take(4, &mut data)?);
            let name = std::str::from_utf8(take(u32::from_le_bytes(len) as usize, &mut data)?)
                .map_err(|e| e.to_string())?
                .to_owned();
            let mut len = [0u8; 8];
            len.copy_from_slice(take(8, &mut data)?);
            let len = usize::try_from(u64::from_le_bytes(len)).map_err(|e| e.to_string())?;
            let bytes = take(len, &mut data)?;
            let table = store
                .table(&name)
                .ok_or_else(|| format!("unknown table {name}"))?;
            let config = table.config();
            let image = rowfile::decode(bytes, config.dim, config.optimizer.slots() as u32)
                .map_err(|e| e.to_string())?;
            out.push((name, image));
        }
        if !data.is_empty() {
            return Err(format!("{} trailing bytes", data.len()));
        }
        Ok(out)
    }

    fn source(store: &Store) -> (CopySource, Vec<u8>) {
        let guard = store.lock_shard(0).unwrap();
        let snapshot = store.snapshot_shard(&guard);
        drop(guard);
        let blob = encode_blob(&snapshot);
        (CopySource::new(snapshot), blob)
    }

    proptest! {
        /// Any byte range is the blob's bytes there, and the decoder fed in
        /// any chunking yields what the blob decodes to.
        #[test]
        fn ranges_are_the_blob_and_any_chunking_decodes_alike(
            rows in 0u64..40,
            workers in 0u64..4,
            chunk in 1usize..300,
            offset in 0u64..3000,
            len in 0usize..3000,
        ) {
            let store = filled(rows, workers);
            let (source, blob) = source(&store);
            prop_assert_eq!(source.total_bytes(), blob.len() as u64);
            let lo = (offset as usize).min(blob.len());
            let hi = (lo + len).min(blob.len());
            prop_assert_eq!(source.read_at(offset, len), blob[lo..hi].to_vec());
            let whole = decode(&store, &blob).unwrap();
            let mut decoder = CopyDecoder::new(shape_of(&store));
            let mut items = Vec::new();
            let mut at = 0u64;
            loop {
                let piece = source.read_at(at, chunk);
                if piece.is_empty() {
                    break;
                }
                at += piece.len() as u64;
                decoder.handle_bytes(&piece, &mut items).unwrap();
            }
            decoder.finish().unwrap();
            let mut tables: Vec<(String, crate::image::ShardImage)> = Vec::new();
            for item in items {
                match item {
                    CopyItem::Table(name) => tables.push((name, Default::default())),
                    CopyItem::Row(row) => tables.last_mut().unwrap().1.rows.push(row),
                    CopyItem::Windows(w) => tables.last_mut().unwrap().1.dedup = w,
                }
            }
            prop_assert_eq!(tables, whole);
        }

        /// Every truncation is refused at the end, and corrupt bytes fail
        /// without a panic.
        #[test]
        fn truncated_or_corrupt_streams_fail(
            cut in 0usize..2000,
            flip in 0usize..2000,
            byte in any::<u8>(),
        ) {
            let store = filled(10, 2);
            let (_, blob) = source(&store);
            let cut = cut.min(blob.len().saturating_sub(1));
            let mut decoder = CopyDecoder::new(shape_of(&store));
            let mut items = Vec::new();
            let fed = decoder.handle_bytes(&blob[..cut], &mut items);
            prop_assert!(fed.is_err() || decoder.finish().is_err());
            let mut corrupt = blob.clone();
            let at = flip % corrupt.len();
            corrupt[at] = byte;
            let mut decoder = CopyDecoder::new(shape_of(&store));
            let _ = decoder
                .handle_bytes(&corrupt, &mut Vec::new())
                .and_then(|()| decoder.finish());
        }
    }

    #[test]
    fn past_the_end_is_empty() {
        let store = filled(3, 1);
        let (source, blob) = source(&store);
        assert!(source.read_at(blob.len() as u64, 10).is_empty());
        assert!(source.read_at(u64::MAX, 10).is_empty());
        assert_eq!(source.read_at(0, usize::MAX), blob);
    }
}
