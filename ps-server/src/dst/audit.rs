//! The exactly-once audit of one run, against the workers' own record:
//! each acknowledged Push added one to each of its keys (SGD, rate 1,
//! gradient -1, rows starting at zero), so once the cluster is quiet a
//! key's row at its shard's primary equals the number of acknowledged
//! Pushes that named it (below: one lost; above: one applied twice), and
//! every other copy of the shard holds the primary's rows.

use std::collections::BTreeMap;

use tessera_proto::sharding::shard_for_key;

use super::world::{KEYS, TABLE, World};

/// What an audit found.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Violation {
    /// The cluster did not come to rest (a Push never acknowledged, a
    /// resize never over, a shard without a primary).
    Stuck(String),
    /// A key's row holds fewer acknowledged Pushes than the workers made.
    Lost { key: u64, expected: u64, got: f32 },
    /// A key's row holds more than its acknowledged Pushes and any
    /// abandoned ones could (`expected`: that most): a Push applied twice.
    Twice { key: u64, expected: u64, got: f32 },
    /// A copy of a shard differs from its primary.
    CopiesDiffer { shard: u32, server: usize, key: u64 },
}

/// Reads key `key`'s value at `store`'s `shard` (0 without a row).
fn value(store: &tessera_store::store::Store, shard: u32, key: u64) -> Option<f32> {
    let rows = store.read_rows(TABLE, shard, &[key], false).ok()?;
    if rows.keys.is_empty() {
        return Some(0.0);
    }
    let b = rows.values.get(0..4)?;
    Some(f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// Audits `world` at rest against `acked` (worker, sequence, keys) and
/// `abandoned` (the keys of Pushes a restarted worker never saw
/// acknowledged: each applied once or not at all, so a key's row lies
/// between its acknowledged count and that plus its abandoned ones).
pub fn audit(
    world: &World,
    acked: &[(u64, u64, Vec<u64>)],
    abandoned: &[Vec<u64>],
) -> Vec<Violation> {
    let mut expected: BTreeMap<u64, u64> = BTreeMap::new();
    for (_, _, keys) in acked {
        for &k in keys {
            *expected.entry(k).or_default() += 1;
        }
    }
    let mut maybe: BTreeMap<u64, u64> = BTreeMap::new();
    for keys in abandoned {
        for &k in keys {
            *maybe.entry(k).or_default() += 1;
        }
    }
    let now = world.now();
    let count = world.etcd.map.num_shards;
    let mut out = Vec::new();
    for key in 0..KEYS {
        let shard = shard_for_key(key, count);
        let Some((p, _)) = world.etcd.primary(shard, now) else {
            continue;
        };
        let want = expected.get(&key).copied().unwrap_or(0);
        let Some(got) = value(&world.servers[p].store, shard, key) else {
            out.push(Violation::Stuck(format!(
                "key {key}'s row unreadable at shard {shard}"
            )));
            continue;
        };
        let most = want + maybe.get(&key).copied().unwrap_or(0);
        if got < want as f32 - 0.5 || got > most as f32 + 0.5 {
            out.push(if got < want as f32 {
                Violation::Lost {
                    key,
                    expected: want,
                    got,
                }
            } else {
                Violation::Twice {
                    key,
                    expected: most,
                    got,
                }
            });
        }
        for (j, s) in world.servers.iter().enumerate() {
            if j == p || !s.up || !s.serves_shard(shard) {
                continue;
            }
            if value(&s.store, shard, key) != Some(got) {
                out.push(Violation::CopiesDiffer {
                    shard,
                    server: j,
                    key,
                });
            }
        }
    }
    out
}
