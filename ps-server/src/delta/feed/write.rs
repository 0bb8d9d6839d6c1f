//! Writing a delta's rows into the store: each table chunk's rows under
//! their shard's write lock, on a blocking thread.

use super::*;

/// The write lock of `shard` for a feed's rows. A resize feed (`resize`:
/// its lead check) writes a shard only while it receives keys and this
/// server leads it: the receiving primary opens the shard
/// (`crate::reshard`) under this lock, so that no row of a delta or copy
/// still on its way lands after its first Push, and a primary that lost
/// the lead (paused, its lease run out) writes nothing its replicas'
/// stream does not carry when it wakes to deltas that waited for it
/// (its copy would differ from the new primary's at the same version).
pub(super) fn lock_for_feed<'a>(
    store: &'a Store,
    shard: u32,
    resize: Option<&LeadCheck>,
) -> Result<tessera_store::store::ShardGuard<'a>, FeedError> {
    let writing = store.lock_shard(shard).ok_or(StoreError::ShardNotHosted {
        shard,
        hosted: store.hosted().to_vec(),
    })?;
    if let Some(leads) = resize
        && (!store.taking_rows(shard) || !leads.leads(shard))
    {
        return Err(FeedError::Reset);
    }
    Ok(writing)
}

/// Whether this server leads a shard now (a resize feed's writes,
/// [`Feed::check_leads`]).
#[derive(Clone)]
pub struct LeadCheck(Arc<dyn Fn(u32) -> bool + Send + Sync>);

impl LeadCheck {
    /// A check answered by `leads`.
    pub fn new(leads: impl Fn(u32) -> bool + Send + Sync + 'static) -> Self {
        Self(Arc::new(leads))
    }

    /// Whether this server leads `shard` now.
    pub fn leads(&self, shard: u32) -> bool {
        (self.0)(shard)
    }
}

impl std::fmt::Debug for LeadCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LeadCheck")
    }
}

/// Writes rows and removals of `tables` into `store`, each chunk's rows
/// under the write lock of the shard `n` shards route them to (`resize`:
/// a resize feed's lead check, see [`lock_for_feed`]).
pub(super) fn write_tables(
    store: &Store,
    tables: &[DeltaTable],
    seen: Option<&Seen>,
    n: u32,
    resize: Option<&LeadCheck>,
) -> Result<(), FeedError> {
    for table in tables {
        let row_bytes = store.row_bytes(&table.name)?;
        let state_bytes = if table.keys.is_empty() {
            0
        } else {
            table.state.len() / table.keys.len()
        };
        if table.state.len() != state_bytes * table.keys.len() {
            return Err(StoreError::DeltaLength {
                table: table.name.clone(),
                part: "state",
                keys: table.keys.len(),
                expected: state_bytes * table.keys.len(),
                got: table.state.len(),
            }
            .into());
        }
        for (part, got) in [("steps", table.steps.len()), ("stamps", table.stamps.len())] {
            if got != 0 && got != table.keys.len() {
                return Err(StoreError::DeltaLength {
                    table: table.name.clone(),
                    part,
                    keys: table.keys.len(),
                    expected: table.keys.len(),
                    got,
                }
                .into());
            }
        }
        if table.values.len() != table.keys.len() * row_bytes {
            return Err(StoreError::DeltaLength {
                table: table.name.clone(),
                part: "values",
                keys: table.keys.len(),
                expected: table.keys.len() * row_bytes,
                got: table.values.len(),
            }
            .into());
        }
        // Rows by serving shard, in order.
        let mut by_shard: HashMap<u32, Vec<usize>> = HashMap::new();
        for (i, &k) in table.keys.iter().enumerate() {
            by_shard.entry(shard_for_key(k, n)).or_default().push(i);
        }
        if by_shard.len() == 1
            && let Some(&shard) = by_shard.keys().next()
        {
            // One serving shard (the sender routes per shard, so nearly
            // always): the rows as they came, no copy.
            let writing = lock_for_feed(store, shard, resize)?;
            store.put_whole_rows(
                &writing,
                &table.name,
                &table.keys,
                &table.values,
                &table.state,
                &table.steps,
                &table.stamps,
            )?;
            by_shard.clear();
        }
        for (shard, rows) in by_shard {
            let writing = lock_for_feed(store, shard, resize)?;
            let keys: Vec<u64> = rows.iter().map(|&i| table.keys[i]).collect();
            let mut values = Vec::with_capacity(rows.len() * row_bytes);
            let mut state = Vec::with_capacity(rows.len() * state_bytes);
            for &i in &rows {
                values.extend_from_slice(&table.values[i * row_bytes..(i + 1) * row_bytes]);
                if state_bytes > 0 {
                    state.extend_from_slice(&table.state[i * state_bytes..(i + 1) * state_bytes]);
                }
            }
            // (Each empty or one per key: checked above.)
            let pick = |all: &[u32]| -> Vec<u32> {
                if all.is_empty() {
                    Vec::new()
                } else {
                    rows.iter().map(|&i| all[i]).collect()
                }
            };
            store.put_whole_rows(
                &writing,
                &table.name,
                &keys,
                &values,
                &state,
                &pick(&table.steps),
                &pick(&table.stamps),
            )?;
        }
        let mut removed: HashMap<u32, Vec<u64>> = HashMap::new();
        for &k in &table.removed {
            removed.entry(shard_for_key(k, n)).or_default().push(k);
        }
        for (shard, keys) in removed {
            if !store.hosted().contains(&shard) {
                continue;
            }
            let writing = lock_for_feed(store, shard, resize)?;
            store.remove_rows(&writing, &table.name, &keys)?;
        }
        if let Some(seen) = seen {
            seen.locked()
                .entry(table.name.clone())
                .or_default()
                .extend(table.keys.iter().copied());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{StoreConfig, TableConfig};

    /// Found by the control-plane simulation (seed 1182): a receiving
    /// primary paused past its lease woke to the deltas that waited for it
    /// and wrote them, outside its replicas' stream, after the new primary
    /// had opened the shard: its copy differed at the same version.
    #[test]
    fn a_resize_feed_writes_only_a_receiving_shard_this_server_leads() {
        let store = Store::new(&StoreConfig {
            num_shards: 3,
            shards: vec![2],
            tables: vec![TableConfig::new("t", 1)],
            ..StoreConfig::default()
        });
        store.set_receiving(2, true);
        let leads = LeadCheck::new(|_| true);
        let lost = LeadCheck::new(|_| false);
        assert!(lock_for_feed(&store, 2, Some(&leads)).is_ok());
        assert!(matches!(
            lock_for_feed(&store, 2, Some(&lost)),
            Err(FeedError::Reset)
        ));
        // A serving server's feed has no such check.
        assert!(lock_for_feed(&store, 2, None).is_ok());
        store.set_receiving(2, false);
        assert!(matches!(
            lock_for_feed(&store, 2, Some(&leads)),
            Err(FeedError::Reset)
        ));
    }
}
