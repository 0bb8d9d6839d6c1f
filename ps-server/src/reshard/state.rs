//! What a shard map calls for on a store's shards, as pure functions of
//! the map and the store: which shards receive keys and serve none, a
//! shrink's incoming and routed-by counts, the fence of moved keys. The
//! resize core ([`super::core`]) and a server starting during a resize
//! ([`prepare`]) set the store from them.

use tessera_coord::{Resize, ResizeState, ShardMap};

use tessera_store::store::Store;

/// Whether each hosted shard of `store` receives keys now as `map` says
/// (no copy of it serves): a receiving shard of a growth in progress, of
/// a server of the new count, from the plan until its copy holds the
/// moved keys. After the cut-over that is once the map names the
/// position its primary opened it at and this copy holds it (a replica
/// copied the opened primary's rows; a primary promoted from such a
/// replica), or, on the primary that opened it, until the map says so
/// (`opened_here`: shard and position). A growth cancelled (before any
/// receiving shard claimed its opening) leaves its receiving shards
/// closed: the map routes no key to them, and a worker that has not seen
/// the cancel would have a Push split by the new count acknowledged on a
/// shard about to be stopped.
pub(crate) fn receiving_now(
    store: &Store,
    map: Option<&ShardMap>,
    opened_here: &[(u32, u64)],
) -> Vec<(u32, bool)> {
    // The last resize, done included: a replica that has not copied its
    // opened primary yet does not serve after the resize is done either.
    let resize = map
        .and_then(|m| m.resize.as_ref())
        .filter(|r| r.to > r.from && store.num_shards() == r.to);
    store
        .hosted()
        .iter()
        .map(|&shard| {
            let closed = resize.is_some_and(|r| {
                if !r.receiving().any(|s| s == shard) || given_away(store, shard) {
                    return false;
                }
                if matches!(
                    r.state,
                    ResizeState::Planned | ResizeState::Copying | ResizeState::Cancelled
                ) {
                    return true;
                }
                !holds_opened(store, r, shard, opened_here)
            });
            (shard, closed)
        })
        .collect()
}

/// Whether this copy of receiving shard `shard` holds the position its
/// primary opened it at in `r` (the map's `opened`, or `opened_here` on
/// the primary that opened it, until the map says so).
fn holds_opened(store: &Store, r: &Resize, shard: u32, opened_here: &[(u32, u64)]) -> bool {
    let held = store.version(shard).unwrap_or_default().position;
    let at = r.opened.get(&shard).copied().or_else(|| {
        opened_here
            .iter()
            .find(|(s, _)| *s == shard)
            .map(|&(_, p)| p)
    });
    at.is_some_and(|at| held >= at)
}

/// Whether `shard` of `store` was given away whole in a shrink (its keys
/// fenced, from the cut-over, for a count that has no such shard): it
/// takes no part in a later resize.
pub(crate) fn given_away(store: &Store, shard: u32) -> bool {
    store.moved(shard).is_some_and(|(to, _)| shard >= to)
}

/// What a shrink `map` names calls for on each hosted shard of `store`
/// that receives keys in it: the count it receives keys of, not opened
/// on this copy yet (`incoming`: its own keys served, the incoming ones
/// refused, a resize feed writes them), or the count it routes by since
/// it opened here (`routes_by`, with the resize's id: the shard's fence
/// is set to it too); both `None` for any other shard, a
/// cancelled shrink, or a server that took the shrunk count. Opened here
/// as in [`receiving_now`].
pub(crate) fn shrink_now(
    store: &Store,
    map: Option<&ShardMap>,
    opened_here: &[(u32, u64)],
) -> Vec<ShrinkState> {
    let resize = map.and_then(|m| m.resize.as_ref()).filter(|r| {
        r.to < r.from && store.num_shards() == r.from && r.state != ResizeState::Cancelled
    });
    store
        .hosted()
        .iter()
        .map(|&shard| {
            let Some(r) = resize.filter(|r| shard < r.to && !given_away(store, shard)) else {
                return (shard, None, None);
            };
            if matches!(r.state, ResizeState::Planned | ResizeState::Copying) {
                return (shard, Some(r.to), None);
            }
            if holds_opened(store, r, shard, opened_here) {
                (shard, None, Some((r.to, r.id)))
            } else {
                (shard, Some(r.to), None)
            }
        })
        .collect()
}

/// Sets each shard's shrink state as `states` ([`shrink_now`]) says,
/// under its write lock where it changes; returns the shards that
/// stopped receiving without opening (a cancel: the caller drops the
/// rows they took). A shrunk count a shard routes by stays until the
/// store takes it (`ReshardCore::look`), even once the map has moved
/// on to another resize.
pub(crate) fn set_shrink_state(store: &Store, states: &[ShrinkState]) -> Vec<u32> {
    let mut cancelled = Vec::new();
    for &(shard, incoming, routes_by) in states {
        let count = routes_by.map(|(to, _)| to);
        let opens = count.is_some() && store.routes_by(shard) != count;
        if store.incoming(shard) == incoming && !opens {
            continue;
        }
        if let Some(writing) = store.lock_shard(shard) {
            if writing.incoming().is_some() && incoming.is_none() && routes_by.is_none() {
                cancelled.push(shard);
            }
            if let Some((to, id)) = routes_by {
                open_shrunk(store, &writing, to, id);
            }
            store.set_incoming(&writing, incoming);
        }
    }
    cancelled
}

/// Makes the locked shard, receiving keys in a shrink to `to` (resize
/// `id`), route by `to` on this copy: a key `to` routes elsewhere is
/// answered `KeysMoved` (the fence of an earlier growth, which named
/// keys that come back now, is replaced). The caller clears the shard's
/// incoming count after this (a Push checked against neither count is
/// refused).
pub(crate) fn open_shrunk(
    store: &Store,
    writing: &tessera_store::store::ShardGuard<'_>,
    to: u32,
    id: u64,
) {
    store.set_routes_by(writing, Some(to));
    store.set_moved(writing, Some((to, id)));
    store.set_moved_open(writing, true);
}

/// A hosted shard, the count it receives keys of in a shrink, and the
/// count (and resize id) it routes by since the shrink opened here.
pub(crate) type ShrinkState = (u32, Option<u32>, Option<(u32, u64)>);

/// The fence `map` calls for on `store`'s giving shards: the count the
/// moved keys are routed by, the map's version, and whether Pushes split
/// by that count are taken (every receiving shard opened); `None` unless
/// a resize from this server's count cut over (or is done). A shrink's
/// giving shards are fenced whole: no key routes to them any more. As
/// (giving shards hosted here, count, map version, open, resize id).
pub(crate) fn fence_of(store: &Store, map: &ShardMap) -> Option<(Vec<u32>, u32, u64, bool, u64)> {
    let r = map.resize.as_ref().filter(|r| {
        matches!(r.state, ResizeState::CutOver | ResizeState::Done) && gave(store, r)
    })?;
    // Pushes split by the new count wait until every receiving shard
    // serves: until then a giving shard's windows name only Pushes split
    // by the old count, whatever copy of it sends them
    // (`store/resize.rs`).
    let open = r.state == ResizeState::Done || r.receiving().all(|s| r.opened.contains_key(&s));
    let giving = r.giving().filter(|s| store.hosted().contains(s)).collect();
    Some((giving, r.to, map.version, open, r.id))
}

/// Whether `shard`'s fence is the one resize `id` to `to` calls for: of
/// that count, and set since the resize was planned. A fence of the same
/// count set earlier is an earlier resize's that was cancelled and that
/// this copy kept (its looks stalled through the cancel): it is set anew,
/// so that the version its cuts carry is this resize's
/// (`DeltaRequest.fenced_at`).
pub(crate) fn fenced_for(store: &Store, shard: u32, to: u32, id: u64) -> bool {
    store.moved(shard).is_some_and(|(n, at)| n == to && at > id)
}

/// Whether `store`'s shards are of `r`'s old count: routed by it, or
/// configured with it (a server that took the count `r` grew to keeps
/// its fence).
pub(crate) fn gave(store: &Store, r: &Resize) -> bool {
    store.num_shards() == r.from || store.configured_shards() == r.from
}

/// Whether `map` reconciles a store that routes by `saved` shards (a
/// checkpoint saved under another count than the configured one): the
/// map's count, or either count of its last resize that was not
/// cancelled (a growth's old count: the moved rows are dropped at the
/// first look, `Resharding::catch_up`; a shrink's old count: its
/// remaining shards route by the new one once they hold their opening
/// position, `shrink_now`). Anything else (a map of another cluster's
/// history, a checkpoint two resizes back) is not.
pub fn reconciles(map: Option<&ShardMap>, saved: u32) -> bool {
    map.is_some_and(|m| {
        m.num_shards == saved
            || m.resize.as_ref().is_some_and(|r| {
                r.state != ResizeState::Cancelled && (r.from == saved || r.to == saved)
            })
    })
}

/// Sets what `map` calls for on `store` before the server serves (the
/// driver keeps it up to date from then on): which shards receive keys,
/// and the fence of moved keys, so that a server started or restarted
/// during a resize serves nothing and applies no Push against them.
pub fn prepare(store: &Store, map: Option<&ShardMap>) {
    for (shard, closed) in receiving_now(store, map, &[]) {
        store.set_receiving(shard, closed);
    }
    set_shrink_state(store, &shrink_now(store, map, &[]));
    // A checkpoint taken while a shrink that was cancelled since copied
    // rows here holds rows of keys this server does not route to it.
    let cancelled = map.and_then(|m| m.resize.as_ref()).filter(|r| {
        r.to < r.from && r.state == ResizeState::Cancelled && store.num_shards() == r.from
    });
    if let Some(r) = cancelled {
        for &shard in store.hosted().iter().filter(|&&s| s < r.to) {
            let dropped = store.drop_moved_rows(shard, store.num_shards());
            if dropped > 0 {
                tracing::info!(shard, rows = dropped, "a cancelled shrink's rows dropped");
            }
        }
    }
    if let Some((giving, to, version, open, id)) = map.and_then(|m| fence_of(store, m)) {
        for shard in giving {
            if let Some(writing) = store.lock_shard(shard) {
                if !fenced_for(store, shard, to, id) {
                    store.set_moved(&writing, Some((to, version)));
                }
                store.set_moved_open(&writing, open);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{StoreConfig, TableConfig};

    fn new_server() -> Store {
        Store::new(&StoreConfig {
            num_shards: 3,
            shards: vec![2],
            tables: vec![TableConfig::new("t", 1)],
            ..StoreConfig::default()
        })
    }

    #[test]
    fn a_cancelled_growths_new_shard_stays_closed() {
        let store = new_server();
        let planned = ShardMap::new(2).plan(3).unwrap();
        assert_eq!(receiving_now(&store, Some(&planned), &[]), vec![(2, true)]);
        let copying = planned.start_copying().unwrap();
        let cancelled = copying.cancel().unwrap();
        // Before the fix it served: a worker still splitting by 3 had its
        // Push applied and acknowledged on a shard the map routes nothing
        // to (found by the control-plane simulation, seed 5).
        assert_eq!(
            receiving_now(&store, Some(&cancelled), &[]),
            vec![(2, true)]
        );
    }
}
