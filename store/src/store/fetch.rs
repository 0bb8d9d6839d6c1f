//! Fetches: checked once before anything is allocated for their rows, then
//! written as little-endian f32 straight into the caller's buffer.

use tessera_proto::rows::{F32_BYTES, write_f32s};

use super::{Store, StoreError};
use crate::config::Mode;
use crate::table::{ShardState, Table};

/// A Fetch that passed every check of [`Store::check_fetch`].
#[derive(Debug)]
pub struct CheckedFetch<'a> {
    store: &'a Store,
    table: &'a Table,
    state: &'a ShardState,
    keys: &'a [u64],
    bytes: usize,
}

impl CheckedFetch<'_> {
    /// Bytes its rows take.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Writes the rows, in order, as little-endian f32 into `out` (exactly
    /// [`CheckedFetch::bytes`] long). Returns the dimension.
    pub fn fetch_into(self, out: &mut [u8]) -> Result<u32, StoreError> {
        let (table, state, keys) = (self.table, self.state, self.keys);
        let dim = table.config().dim;
        let row_bytes = dim as usize * F32_BYTES;
        if out.len() != self.bytes {
            return Err(StoreError::OutputLength {
                expected: self.bytes,
                got: out.len(),
            });
        }
        state
            .fetches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let row_bytes = row_bytes.max(1);
        let mut missing = Vec::new();
        state.rows.read_many(
            keys,
            |i, row| row.write_values_le(&mut out[i * row_bytes..(i + 1) * row_bytes]),
            &mut missing,
        );
        for i in missing {
            let (key, slot) = (keys[i], &mut out[i * row_bytes..(i + 1) * row_bytes]);
            match self.store.mode {
                // A table with a row limit stores rows only from Pushes
                // (under the shard's lock, where the primary's evictions
                // go into the stream): a Fetch storing one would evict a
                // trained row that no replica hears of. A table with
                // admission creates rows only for ids pushed often enough
                // (`table/admission.rs`). A table with expiry neither: its
                // primary's sweep removes rows by the stream, and a row a
                // Fetch stored on one copy only would be missing on the
                // others when the sweep names it (`table/expiry.rs`). The
                // initial values are a pure function of the key, so the
                // answer is the same either way.
                Mode::Training
                    if state.rows.limited()
                        || state.admission.is_some()
                        || table.config().expiry.is_some() =>
                {
                    write_f32s(slot, &table.initial_row(key));
                }
                Mode::Training => {
                    let storage = table.config().storage;
                    let stored = state.rows.upsert(
                        key,
                        |values, st| table.init_row(key, values, st),
                        // As stored: rounded to the table's storage.
                        |values, _, _| {
                            for (i, (out, v)) in slot
                                .chunks_exact_mut(F32_BYTES)
                                .zip(values.iter())
                                .enumerate()
                            {
                                out.copy_from_slice(&storage.round(key, i, *v).to_le_bytes());
                            }
                        },
                    );
                    match stored {
                        // A row the delta stream sends (it now exists).
                        Ok(()) => state.note_changed([key]),
                        // A full stripe: answered, not stored.
                        Err(_) => {
                            write_f32s(slot, &table.initial_row(key));
                        }
                    }
                }
                Mode::Inference | Mode::Serving => slot.fill(0),
            }
        }
        metrics::counter!("tessera_ps_fetch_keys_total").increment(keys.len() as u64);
        Ok(dim)
    }
}

/// Bytes of a Fetch response besides its rows (RPC header, protobuf tags
/// and lengths); generous, so that an answer within the check always fits
/// in a message.
pub(super) const RESPONSE_OVERHEAD: u64 = 4096;

impl Store {
    /// Checks a Fetch of `keys` from `table`'s `shard` once, before anything
    /// is allocated for its rows: table and shard hosted, no more than
    /// `max_keys_per_request` keys, every key of that shard, and the answer
    /// within the largest message. The checked Fetch says how many bytes
    /// its rows take and then writes them ([`CheckedFetch::fetch_into`]).
    pub fn check_fetch<'a>(
        &'a self,
        table: &str,
        shard: u32,
        keys: &'a [u64],
    ) -> Result<CheckedFetch<'a>, StoreError> {
        let (table_ref, state) = self.shard_state(table, shard, keys)?;
        // Keys a resize moved away are served by their new shard once it
        // serves; until then nobody writes them (their Pushes are refused
        // here, and the new shard takes none), so they are served here,
        // Keys this shard receives in a shrink: once this copy holds them
        // (an earlier growth's fence may name them moved away).
        if let Some(to) = self.incoming(shard) {
            super::resize::refuse_incoming(shard, keys, self.route_count(shard), to)?;
        }
        // Served here from the fence for at most the stale-read bound
        // (`Store::moved_reads_over`).
        if self.new_count_open(shard) || self.moved_reads_over(shard, std::time::Instant::now()) {
            self.check_moved(shard, keys)?;
        }
        let row_bytes = table_ref.config().dim as usize * F32_BYTES;
        match keys.len().checked_mul(row_bytes) {
            Some(bytes) if bytes <= self.max_response_bytes => Ok(CheckedFetch {
                store: self,
                table: table_ref,
                state,
                keys,
                bytes,
            }),
            _ => Err(StoreError::ResponseTooLarge {
                keys: keys.len(),
                row_bytes,
                max: self.max_response_bytes,
            }),
        }
    }

    /// Bytes the rows of an allowed Fetch take (see [`Store::check_fetch`]).
    pub fn fetch_bytes(&self, table: &str, shard: u32, keys: &[u64]) -> Result<usize, StoreError> {
        self.check_fetch(table, shard, keys).map(|c| c.bytes())
    }

    /// Bytes of one row of `table` on the wire.
    pub fn row_bytes(&self, table: &str) -> Result<usize, StoreError> {
        self.tables
            .get(table)
            .map(|t| t.config().dim as usize * F32_BYTES)
            .ok_or_else(|| StoreError::UnknownTable(table.to_owned()))
    }

    /// Writes the rows of `keys`, in order, as little-endian f32 into `out`
    /// (exactly `keys.len() * row_bytes(table)` bytes: the caller allocates
    /// it, in the send pool, so the response goes out from there without a
    /// copy). Returns the dimension.
    pub fn fetch_into(
        &self,
        table: &str,
        shard: u32,
        keys: &[u64],
        out: &mut [u8],
    ) -> Result<u32, StoreError> {
        self.check_fetch(table, shard, keys)?.fetch_into(out)
    }

    /// The rows of `keys`, in order, as little-endian f32 in a new vector,
    /// and the dimension (for tests and tools; the server uses
    /// [`Store::fetch_into`]).
    pub fn fetch(
        &self,
        table: &str,
        shard: u32,
        keys: &[u64],
    ) -> Result<(u32, Vec<u8>), StoreError> {
        let checked = self.check_fetch(table, shard, keys)?;
        let mut out = vec![0u8; checked.bytes()];
        let dim = checked.fetch_into(&mut out)?;
        Ok((dim, out))
    }
}
