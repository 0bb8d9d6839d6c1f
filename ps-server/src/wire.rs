//! The shard engine's values as `ps.proto` carries them, converted in one
//! place for every stream that carries them (replication, the delta
//! stream, resharding, Health, Admin): a shard's [`Version`], and a giving
//! shard's Push deduplication windows at a resize's fence
//! (`tessera_store`'s `store/resize.rs`), as its fenced deltas and copies
//! carry them to the receiving shards (`DeltaRequest.windows`,
//! `DeltaCopyResponse.windows`) and a shard copy carries a receiving
//! shard's origins (`SyncResponse.origins`).
//!
//! Functions, not `From` impls: both sides are other crates' types.

use tessera_proto::v1;

use tessera_store::dedup::{WINDOW, WorkerWindow};
use tessera_store::store::{OriginSet, TableWindows};
use tessera_store::version::Version;

/// A shard's version as the wire carries it.
pub fn version_to_wire(version: Version) -> v1::ShardVersion {
    v1::ShardVersion {
        epoch: version.epoch,
        position: version.position,
    }
}

/// A shard's version from the wire.
pub fn version_from_wire(version: v1::ShardVersion) -> Version {
    Version::new(version.epoch, version.position)
}

/// Words of one window (more from the network are dropped).
const WORDS: usize = (WINDOW / 64) as usize;

/// The windows as the wire carries them.
pub fn windows_to_wire(windows: &TableWindows) -> Vec<v1::TableWindows> {
    windows
        .iter()
        .map(|(table, list)| v1::TableWindows {
            table: table.clone(),
            windows: list
                .iter()
                .map(|w| v1::DedupWindow {
                    worker: w.worker,
                    highest: w.highest,
                    bits: w.bits.clone(),
                })
                .collect(),
        })
        .collect()
}

/// The windows a fenced delta or copy carried.
pub fn windows_from_wire(windows: &[v1::TableWindows]) -> TableWindows {
    windows
        .iter()
        .map(|t| {
            (
                t.table.clone(),
                t.windows
                    .iter()
                    .map(|w| WorkerWindow {
                        worker: w.worker,
                        highest: w.highest,
                        bits: w.bits.iter().copied().take(WORDS).collect(),
                    })
                    .collect(),
            )
        })
        .collect()
}

/// A receiving shard's giving shards' windows (`from`: the count before
/// the resize) as a shard copy carries them (`SyncResponse.origins`).
pub fn origins_to_wire(set: &OriginSet) -> v1::OriginWindows {
    v1::OriginWindows {
        from: set.from,
        resize: set.resize,
        giving: set
            .giving
            .iter()
            .map(|(shard, tables)| v1::GivingWindows {
                shard: *shard,
                tables: windows_to_wire(tables),
            })
            .collect(),
    }
}

/// [`origins_to_wire`]'s inverse.
pub fn origins_from_wire(origins: &v1::OriginWindows) -> OriginSet {
    OriginSet {
        from: origins.from,
        resize: origins.resize,
        giving: origins
            .giving
            .iter()
            .map(|g| (g.shard, windows_from_wire(&g.tables)))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_round_trip_and_oversized_ones_are_cut() {
        let windows: TableWindows = vec![(
            "emb".into(),
            vec![WorkerWindow {
                worker: 7,
                highest: 90,
                bits: vec![5; WORDS],
            }],
        )];
        assert_eq!(windows_from_wire(&windows_to_wire(&windows)), windows);
        let mut wire = windows_to_wire(&windows);
        wire[0].windows[0].bits = vec![1; WORDS * 100];
        assert_eq!(windows_from_wire(&wire)[0].1[0].bits.len(), WORDS);
    }
}
