//! A delta's rows on the wire: routed to the serving shard of each key,
//! cut into tables of at most [`CHUNK_BYTES`], packed into messages of
//! at most [`PART_BYTES`].

use tessera_proto::rows::F32_BYTES;
use tessera_proto::sharding::shard_for_key;
use tessera_proto::v1::DeltaTable;

use tessera_store::store::DeltaRows;

/// Bytes of rows in one [`DeltaTable`] at most: a serving server applies
/// one under its shard's write lock.
pub const CHUNK_BYTES: usize = 4 << 20;

/// Bytes of rows in one message at most: far below the default message
/// limit (64 MiB), and small enough that a part's round trip never
/// stalls the sender's queue for long.
pub const PART_BYTES: usize = 8 << 20;

/// Bytes a table's rows take on the wire.
pub fn table_bytes(table: &DeltaTable) -> usize {
    table.values.len()
        + table.state.len()
        + 8 * (table.keys.len() + table.removed.len())
        + 4 * (table.steps.len() + table.stamps.len())
}

/// The rows of `table` (`dim` values and `state_len` state values each)
/// by serving shard of `num_shards`: element `t` holds the tables for
/// serving shard `t`, each at most [`CHUNK_BYTES`] (none where no row
/// goes to it).
pub fn route(
    table: &str,
    rows: &DeltaRows,
    dim: usize,
    state_len: usize,
    num_shards: u32,
) -> Vec<Vec<DeltaTable>> {
    let row_bytes = dim * F32_BYTES;
    let state_bytes = if rows.state.is_empty() {
        0
    } else {
        state_len * F32_BYTES
    };
    let whole = !rows.steps.is_empty();
    let meta_bytes = if whole { 8 } else { 0 };
    let per_chunk = (CHUNK_BYTES / (row_bytes + state_bytes + meta_bytes + 8).max(1)).max(1);
    let mut out: Vec<Vec<DeltaTable>> = vec![Vec::new(); num_shards as usize];
    let open = |tables: &mut Vec<DeltaTable>| -> usize {
        let full = tables
            .last()
            .is_none_or(|t| t.keys.len() + t.removed.len() >= per_chunk);
        if full {
            tables.push(DeltaTable {
                name: table.to_owned(),
                ..DeltaTable::default()
            });
        }
        tables.len() - 1
    };
    // Values and state are built as vectors, then frozen.
    let mut values: Vec<Vec<Vec<u8>>> = vec![Vec::new(); num_shards as usize];
    let mut states: Vec<Vec<Vec<u8>>> = vec![Vec::new(); num_shards as usize];
    for (i, &key) in rows.keys.iter().enumerate() {
        let t = shard_for_key(key, num_shards) as usize;
        let at = open(&mut out[t]);
        if values[t].len() <= at {
            values[t].resize(at + 1, Vec::new());
            states[t].resize(at + 1, Vec::new());
        }
        out[t][at].keys.push(key);
        values[t][at].extend_from_slice(&rows.values[i * row_bytes..(i + 1) * row_bytes]);
        if state_bytes > 0 {
            states[t][at].extend_from_slice(&rows.state[i * state_bytes..(i + 1) * state_bytes]);
        }
        if whole {
            out[t][at]
                .steps
                .push(rows.steps.get(i).copied().unwrap_or(0));
            out[t][at]
                .stamps
                .push(rows.stamps.get(i).copied().unwrap_or(0));
        }
    }
    for &key in &rows.removed {
        let t = shard_for_key(key, num_shards) as usize;
        let at = open(&mut out[t]);
        out[t][at].removed.push(key);
    }
    for (t, tables) in out.iter_mut().enumerate() {
        for (at, table) in tables.iter_mut().enumerate() {
            if let Some(v) = values[t].get_mut(at) {
                table.values = std::mem::take(v).into();
            }
            if let Some(s) = states[t].get_mut(at) {
                table.state = std::mem::take(s).into();
            }
        }
    }
    out
}

/// `tables` packed into messages of at most [`PART_BYTES`] of rows each
/// (a table larger than that alone in its own); always at least one,
/// empty where there are no tables (a delta with no change still moves
/// the stream on and says the source is alive).
pub fn pack(tables: Vec<DeltaTable>) -> Vec<Vec<DeltaTable>> {
    let mut parts: Vec<Vec<DeltaTable>> = vec![Vec::new()];
    let mut bytes = 0usize;
    for table in tables {
        let size = table_bytes(&table);
        if bytes > 0 && bytes + size > PART_BYTES {
            parts.push(Vec::new());
            bytes = 0;
        }
        bytes += size;
        if let Some(last) = parts.last_mut() {
            last.push(table);
        }
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(n: u64, dim: usize) -> DeltaRows {
        let keys: Vec<u64> = (0..n).collect();
        let mut values = Vec::new();
        for &k in &keys {
            for j in 0..dim {
                values.extend_from_slice(&((k * 100 + j as u64) as f32).to_le_bytes());
            }
        }
        DeltaRows {
            keys,
            values,
            state: Vec::new(),
            steps: Vec::new(),
            stamps: Vec::new(),
            removed: vec![1_000, 1_001],
        }
    }

    #[test]
    fn every_row_goes_to_its_keys_serving_shard_with_its_values() {
        let dim = 4;
        let routed = route("t", &rows(500, dim), dim, 0, 3);
        let mut seen = 0;
        let mut removed = 0;
        for (shard, tables) in routed.iter().enumerate() {
            for table in tables {
                assert_eq!(table.name, "t");
                assert_eq!(table.values.len(), table.keys.len() * dim * 4);
                for (i, &k) in table.keys.iter().enumerate() {
                    assert_eq!(shard_for_key(k, 3) as usize, shard);
                    let first = f32::from_le_bytes(
                        table.values[i * dim * 4..i * dim * 4 + 4]
                            .try_into()
                            .unwrap(),
                    );
                    assert_eq!(first, (k * 100) as f32);
                    seen += 1;
                }
                for &k in &table.removed {
                    assert_eq!(shard_for_key(k, 3) as usize, shard);
                    removed += 1;
                }
            }
        }
        assert_eq!((seen, removed), (500, 2));
    }

    #[test]
    fn large_deltas_are_cut_into_chunks_and_parts_within_their_bounds() {
        // 64 KiB rows: 64 per chunk, 128 per part.
        let dim = 16_384;
        let routed = route("t", &rows(300, dim), dim, 0, 1);
        assert!(routed[0].len() >= 5);
        assert!(
            routed[0]
                .iter()
                .all(|t| table_bytes(t) <= CHUNK_BYTES + 8 * 64)
        );
        let parts = pack(routed.into_iter().flatten().collect());
        assert!(parts.len() >= 3);
        for part in &parts {
            assert!(part.iter().map(table_bytes).sum::<usize>() <= PART_BYTES + 2 * 8 * 64);
        }
        let keys: usize = parts.iter().flatten().map(|t| t.keys.len()).sum();
        assert_eq!(keys, 300);
        assert_eq!(pack(Vec::new()).len(), 1);
    }
}
