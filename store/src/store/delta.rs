//! What the delta stream (`crate::delta`) asks of the store: at a
//! training primary, the keys each table changed (taken under the shard's
//! write lock, so that they line up with a stream position) and their
//! rows as they are now; at a serving server, rows put in place and rows
//! removed as the training fleet says.

use tessera_proto::rows::F32_BYTES;
use tessera_proto::sharding::shard_for_key;

use super::{ShardGuard, Store, StoreError};
use crate::table::changes::Taken;

/// Rows of one table as a delta carries them.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct DeltaRows {
    /// Keys with a row, in the order read.
    pub keys: Vec<u64>,
    /// Their values: `keys.len() * dim` little-endian f32.
    pub values: Vec<u8>,
    /// Their optimizer state when asked: `keys.len() * dim * slots`
    /// little-endian f32; empty otherwise.
    pub state: Vec<u8>,
    /// With the state: each row's updates applied and expiry stamp (one
    /// per key); empty otherwise.
    pub steps: Vec<u32>,
    /// See `steps`.
    pub stamps: Vec<u32>,
    /// Keys asked for that have no row.
    pub removed: Vec<u64>,
}

impl Store {
    /// Every table's keys changed on the shard `writing` locks since the
    /// last take (`table/changes.rs`), by table name; the sets start
    /// again empty. Taken under the lock, so that they are exactly the
    /// changes up to the shard's version.
    pub fn take_changes(&self, writing: &ShardGuard<'_>) -> Vec<(String, Taken)> {
        let mut out: Vec<(String, Taken)> = self
            .tables
            .values()
            .filter_map(|t| {
                let changes = t.shard(writing.shard())?.changes.as_ref()?;
                Some((t.config().name.clone(), changes.take()))
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// The most keys one table of `shard` changed since the last take
    /// (`table/changes.rs`): whether its delta is due before the
    /// interval ends.
    pub fn changed_rows(&self, shard: u32) -> usize {
        self.tables
            .values()
            .filter_map(|t| t.shard(shard)?.changes.as_ref().map(|c| c.len()))
            .max()
            .unwrap_or(0)
    }

    /// The rows of `keys` in `table`'s `shard` as they are now, without
    /// counting as a use (an LRU clock or an access mark stays as it is);
    /// keys without a row are listed as removed. With `with_state`, their
    /// optimizer state, updates applied and expiry stamps too: the whole
    /// row.
    pub fn read_rows(
        &self,
        table: &str,
        shard: u32,
        keys: &[u64],
        with_state: bool,
    ) -> Result<DeltaRows, StoreError> {
        let (table_ref, state) = self.table_shard(table, shard)?;
        let row_bytes = table_ref.config().dim as usize * F32_BYTES;
        let state_bytes = if with_state {
            state.rows.layout().state_len() * F32_BYTES
        } else {
            0
        };
        let mut missing = Vec::new();
        // Each row lands at its key's index (rows are read stripe by
        // stripe, not in key order); rows missing are squeezed out after,
        // in place.
        let mut values = vec![0u8; keys.len() * row_bytes];
        let mut states = vec![0u8; keys.len() * state_bytes];
        let meta_len = if with_state { keys.len() } else { 0 };
        let (mut steps, mut stamps) = (vec![0u32; meta_len], vec![0u32; meta_len]);
        let mut scratch = Vec::with_capacity(state_bytes);
        state.rows.peek_many(
            keys,
            |i, row| {
                row.write_values_le(&mut values[i * row_bytes..(i + 1) * row_bytes]);
                if with_state {
                    scratch.clear();
                    row.write_state_le(&mut scratch);
                    states[i * state_bytes..(i + 1) * state_bytes].copy_from_slice(&scratch);
                    steps[i] = row.steps();
                    stamps[i] = row.stamp();
                }
            },
            &mut missing,
        );
        let mut out = DeltaRows::default();
        if missing.is_empty() {
            out.keys = keys.to_vec();
        } else {
            let mut gone = missing.iter().peekable();
            let mut kept = 0;
            for (i, &key) in keys.iter().enumerate() {
                if gone.peek() == Some(&&i) {
                    gone.next();
                    out.removed.push(key);
                    continue;
                }
                values.copy_within(i * row_bytes..(i + 1) * row_bytes, kept * row_bytes);
                states.copy_within(i * state_bytes..(i + 1) * state_bytes, kept * state_bytes);
                if with_state {
                    steps[kept] = steps[i];
                    stamps[kept] = stamps[i];
                }
                out.keys.push(key);
                kept += 1;
            }
            values.truncate(kept * row_bytes);
            states.truncate(kept * state_bytes);
            steps.truncate(kept.min(meta_len));
            stamps.truncate(kept.min(meta_len));
        }
        out.values = values;
        out.state = states;
        out.steps = steps;
        out.stamps = stamps;
        Ok(out)
    }

    /// Puts the rows of `keys` with `values` (`keys.len() * dim`
    /// little-endian f32) and `state` (the same times the table's slots,
    /// or empty: zeros) in place of whatever the shard `writing` locks
    /// held for them: a serving server applying a delta. Every key must
    /// belong to that shard. Checks everything before changing a row.
    pub fn put_rows(
        &self,
        writing: &ShardGuard<'_>,
        table: &str,
        keys: &[u64],
        values: &[u8],
        state: &[u8],
    ) -> Result<(), StoreError> {
        self.put_whole_rows(writing, table, keys, values, state, &[], &[])
    }

    /// [`Store::put_rows`] with each row's updates applied (`steps`) and
    /// expiry stamp (`stamps`), one per key, or empty (zeros): rows as
    /// [`Store::read_rows`] read them whole.
    #[allow(clippy::too_many_arguments)]
    pub fn put_whole_rows(
        &self,
        writing: &ShardGuard<'_>,
        table: &str,
        keys: &[u64],
        values: &[u8],
        state: &[u8],
        steps: &[u32],
        stamps: &[u32],
    ) -> Result<(), StoreError> {
        let shard = writing.shard();
        let (table_ref, shard_state) = self.table_shard(table, shard)?;
        let rows = &shard_state.rows;
        let dim = table_ref.config().dim as usize;
        let state_len = rows.layout().state_len();
        let length = |part: &'static str, expected: usize, got: usize| StoreError::DeltaLength {
            table: table.to_owned(),
            part,
            keys: keys.len(),
            expected,
            got,
        };
        if values.len() != keys.len() * dim * F32_BYTES {
            return Err(length("values", keys.len() * dim * F32_BYTES, values.len()));
        }
        if !state.is_empty() && state.len() != keys.len() * state_len * F32_BYTES {
            return Err(length(
                "state",
                keys.len() * state_len * F32_BYTES,
                state.len(),
            ));
        }
        if !steps.is_empty() && steps.len() != keys.len() {
            return Err(length("steps", keys.len(), steps.len()));
        }
        if !stamps.is_empty() && stamps.len() != keys.len() {
            return Err(length("stamps", keys.len(), stamps.len()));
        }
        // The shard's keys, or those it receives in a shrink.
        let (num_shards, incoming) = (self.route_count(shard), self.incoming(shard));
        for &key in keys {
            let actual = shard_for_key(key, num_shards);
            if actual != shard && incoming.is_none_or(|to| shard_for_key(key, to) != shard) {
                return Err(StoreError::WrongShard { key, shard, actual });
            }
        }
        // A stamp counted in Pushes is the giving shard's own count, which
        // means nothing here (another shard's count, or several): such
        // rows start from this shard's clock, and live a whole period
        // from their arrival. Stamps in wall-clock seconds are kept.
        let counted = matches!(
            table_ref.config().expiry.map(|e| e.bound()),
            Some(crate::table::expiry::Bound::Pushes(_))
        );
        let here = rows.stamp_now();
        let mut row_values = vec![0f32; dim];
        let mut row_state = vec![0f32; state_len];
        for (i, &key) in keys.iter().enumerate() {
            decode_f32s(
                &values[i * dim * F32_BYTES..(i + 1) * dim * F32_BYTES],
                &mut row_values,
            );
            if !state.is_empty() {
                let n = state_len * F32_BYTES;
                decode_f32s(&state[i * n..(i + 1) * n], &mut row_state);
            }
            let (steps, stamp) = (
                steps.get(i).copied().unwrap_or(0),
                if counted {
                    here
                } else {
                    stamps.get(i).copied().unwrap_or(0)
                },
            );
            rows.insert(key, steps, stamp, &row_values, &row_state)
                .map_err(|_| StoreError::ShardFull {
                    table: table.to_owned(),
                    shard,
                })?;
        }
        Ok(())
    }

    /// Removes the rows of `keys` from the shard `writing` locks, where
    /// held (a serving server applying a delta's removals, or dropping
    /// rows a copy of the training shard no longer has). Returns how many
    /// were held.
    pub fn remove_rows(
        &self,
        writing: &ShardGuard<'_>,
        table: &str,
        keys: &[u64],
    ) -> Result<usize, StoreError> {
        let table_ref = self
            .tables
            .get(table)
            .ok_or_else(|| StoreError::UnknownTable(table.to_owned()))?;
        let Some(state) = table_ref.shard(writing.shard()) else {
            return Ok(0);
        };
        Ok(keys.iter().filter(|&&k| state.rows.remove(k)).count())
    }

    /// The keys of `table`'s rows on the shard `writing` locks for which
    /// `pick` says yes (a serving server finding the rows of one training
    /// shard that a copy of it did not hold).
    pub fn keys_where(
        &self,
        writing: &ShardGuard<'_>,
        table: &str,
        mut pick: impl FnMut(u64) -> bool,
    ) -> Vec<u64> {
        let Some(state) = self
            .tables
            .get(table)
            .and_then(|t| t.shard(writing.shard()))
        else {
            return Vec::new();
        };
        let mut out = Vec::new();
        state.rows.snapshot().for_each_from(0, |row| {
            if pick(row.key()) {
                out.push(row.key());
            }
            true
        });
        out
    }
}

fn decode_f32s(bytes: &[u8], out: &mut [f32]) {
    for (v, b) in out.iter_mut().zip(bytes.chunks_exact(F32_BYTES)) {
        *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Mode, OptimizerConfig, Storage, StoreConfig, TableConfig};
    use crate::store::PushId;

    fn store(mode: Mode, num_shards: u32, storage: Storage, max_rows: Option<u64>) -> Store {
        Store::new(&StoreConfig {
            mode,
            num_shards,
            shards: (0..num_shards).collect(),
            tables: vec![TableConfig {
                optimizer: OptimizerConfig::adagrad(0.1),
                storage,
                max_rows,
                ..TableConfig::new("t", 4)
            }],
            keep_changes: crate::config::KeepChanges::Always,
            ..StoreConfig::default()
        })
    }

    fn keys(n: u64) -> Vec<u64> {
        (0..n).collect()
    }

    /// Rows read at a training shard with their state and put at serving
    /// shards of another count hold the same values and state; keys
    /// without a row are listed as removed.
    #[test]
    fn rows_and_state_travel_whole_between_shard_counts() {
        let training = store(Mode::Training, 1, Storage::F32, None);
        let keys = keys(200);
        let grads: Vec<u8> = (0..keys.len() * 4)
            .flat_map(|i| ((i % 5) as f32 - 2.0).to_le_bytes())
            .collect();
        training
            .push("t", 0, &keys, &grads, PushId::default())
            .unwrap();
        let mut asked = keys.clone();
        asked.push(10_000);
        let read = training.read_rows("t", 0, &asked, true).unwrap();
        assert_eq!(read.keys, keys);
        assert_eq!(read.removed, vec![10_000]);
        assert_eq!(read.values.len(), 200 * 4 * 4);
        assert_eq!(read.state.len(), 200 * 4 * 4, "Adagrad: one slot");
        // Every key changed was noted for the stream, once.
        let taken = training.take_changes(&training.lock_shard(0).unwrap());
        assert_eq!(taken.len(), 1);
        let mut noted = taken[0].1.keys.clone();
        noted.sort_unstable();
        assert_eq!(noted, keys);

        let serving = store(Mode::Serving, 3, Storage::F32, Some(1));
        for shard in 0..3 {
            let mine: Vec<usize> = (0..keys.len())
                .filter(|&i| shard_for_key(keys[i], 3) == shard)
                .collect();
            let ks: Vec<u64> = mine.iter().map(|&i| keys[i]).collect();
            let vs: Vec<u8> = mine
                .iter()
                .flat_map(|&i| read.values[i * 16..(i + 1) * 16].to_vec())
                .collect();
            let ss: Vec<u8> = mine
                .iter()
                .flat_map(|&i| read.state[i * 16..(i + 1) * 16].to_vec())
                .collect();
            let writing = serving.lock_shard(shard).unwrap();
            // A key of another serving shard is refused whole.
            if let Some(&other) = keys.iter().find(|&&k| shard_for_key(k, 3) != shard) {
                assert!(matches!(
                    serving.put_rows(&writing, "t", &[other], &vs[..16], &[]),
                    Err(StoreError::WrongShard { .. })
                ));
            }
            serving.put_rows(&writing, "t", &ks, &vs, &ss).unwrap();
            // A row limit of 1 does not apply to a serving server.
            let back = serving.read_rows("t", shard, &ks, true).unwrap();
            assert_eq!(back.keys, ks);
            assert_eq!(back.values, vs);
            assert_eq!(back.state, ss);
            assert_eq!(serving.remove_rows(&writing, "t", &ks[..1]).unwrap(), 1);
            assert_eq!(serving.remove_rows(&writing, "t", &ks[..1]).unwrap(), 0);
        }
        let writing = serving.lock_shard(0).unwrap();
        assert!(matches!(
            serving.put_rows(&writing, "t", &[0], &[0; 12], &[]),
            Err(StoreError::DeltaLength { part: "values", .. })
        ));
        // A serving server notes no changes of its own.
        assert!(serving.take_changes(&writing).is_empty());
    }

    /// Rows read whole (state, updates applied, expiry stamps), routed by
    /// another shard count and put at a training store of that count (a
    /// resize's receiving shards) are the same rows, bit for bit: an Adam
    /// row's bias correction goes with it, and so does a wall-clock
    /// expiry stamp; a stamp counted in the giving shard's Pushes is
    /// replaced by the receiving shard's clock (another shard's count
    /// means nothing there). Lengths that do not match the keys are
    /// refused.
    #[test]
    fn whole_rows_move_between_training_stores_of_other_counts() {
        use crate::table::ExpiryConfig;
        for (expiry, counted) in [
            (ExpiryConfig::after_secs(3_600), false),
            (ExpiryConfig::after_pushes(1_000), true),
        ] {
            let config = |num_shards: u32| StoreConfig {
                num_shards,
                shards: (0..num_shards).collect(),
                tables: vec![TableConfig {
                    optimizer: OptimizerConfig::adam(0.01),
                    expiry: Some(expiry),
                    ..TableConfig::new("t", 4)
                }],
                ..StoreConfig::default()
            };
            let giving = Store::new(&config(1));
            let keys = keys(300);
            // Rows pushed a different number of times: steps (and stamps
            // counted in Pushes) differ.
            for round in 0..4u64 {
                let ks: Vec<u64> = keys.iter().copied().filter(|k| k % 4 >= round).collect();
                let grads: Vec<u8> = (0..ks.len() * 4)
                    .flat_map(|i| ((i as u64 % 7 + round) as f32 * 0.25 - 1.0).to_le_bytes())
                    .collect();
                giving.push("t", 0, &ks, &grads, PushId::default()).unwrap();
            }
            let read = giving.read_rows("t", 0, &keys, true).unwrap();
            assert_eq!(read.steps.len(), keys.len());
            assert!(read.steps.contains(&1) && read.steps.contains(&4));
            assert!(read.stamps.iter().all(|&s| s != 0));
            let receiving = Store::new(&config(3));
            let state_len = 4 * 2;
            // Each row put whole at the shard the new count routes it to
            // (as the delta stream's router splits them).
            for (at, &key) in keys.iter().enumerate() {
                let writing = receiving.lock_shard(shard_for_key(key, 3)).unwrap();
                let (values, state) = (
                    &read.values[at * 16..(at + 1) * 16],
                    &read.state[at * 4 * state_len..(at + 1) * 4 * state_len],
                );
                receiving
                    .put_whole_rows(
                        &writing,
                        "t",
                        &[key],
                        values,
                        state,
                        &read.steps[at..=at],
                        &read.stamps[at..=at],
                    )
                    .unwrap();
            }
            for (at, &key) in keys.iter().enumerate() {
                let shard = shard_for_key(key, 3);
                let back = receiving.read_rows("t", shard, &[key], true).unwrap();
                assert_eq!(back.values, read.values[at * 16..(at + 1) * 16]);
                assert_eq!(back.state, read.state[at * 32..(at + 1) * 32]);
                assert_eq!(back.steps[0], read.steps[at]);
                if counted {
                    // The receiving shard had no Push: its clock is 0.
                    assert_eq!(back.stamps[0], 0, "{expiry:?}");
                } else {
                    assert_eq!(back.stamps[0], read.stamps[at], "{expiry:?}");
                }
            }
            let writing = receiving.lock_shard(0).unwrap();
            assert!(matches!(
                receiving.put_whole_rows(&writing, "t", &[0], &[0; 16], &[], &[1, 2], &[]),
                Err(StoreError::DeltaLength { part: "steps", .. })
            ));
        }
    }

    /// A serving table stored as `f16` holds each value within half a
    /// unit of `f16` of what training sent.
    #[test]
    fn a_narrow_serving_table_holds_the_values_within_its_rounding() {
        let serving = store(Mode::Serving, 1, Storage::F16, None);
        let values: Vec<f32> = (0..400).map(|i| (i as f32 - 200.0) * 0.0137).collect();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let ks = keys(100);
        serving
            .put_rows(&serving.lock_shard(0).unwrap(), "t", &ks, &bytes, &[])
            .unwrap();
        let back = serving.read_rows("t", 0, &ks, false).unwrap();
        for (got, want) in back.values.chunks_exact(4).zip(&values) {
            let got = f32::from_le_bytes([got[0], got[1], got[2], got[3]]);
            assert!(
                (got - want).abs() <= want.abs() * 2f32.powi(-10) + 1e-7,
                "{got} for {want}"
            );
        }
    }
}
