//! Splitting a request by shard and merging the answers, without I/O.
//!
//! A caller's keys may repeat and may span every shard. A plan deduplicates
//! them, groups the unique keys by shard (one sub-request per shard), and
//! remembers where each of the caller's keys landed, so the answers can be
//! merged back in the caller's order.

use std::collections::HashMap;

use tessera_proto::rows::F32_BYTES;
use tessera_proto::sharding::shard_for_key;

/// The unique keys of one shard, in first-seen order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardKeys {
    /// The shard.
    pub shard: u32,
    /// Its keys, each once.
    pub keys: Vec<u64>,
}

/// Where a caller's key is answered: sub-request `group`, row `row`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slot {
    group: u32,
    row: u32,
}

/// A deduplicated, shard-split Fetch.
#[derive(Debug, Clone)]
pub struct FetchPlan {
    groups: Vec<ShardKeys>,
    slots: Vec<Slot>,
    /// The shard count it was split by.
    num_shards: u32,
}

/// Why answers could not be merged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MergeError {
    /// A sub-response holds the wrong number of bytes.
    #[error(
        "shard {shard} answered {got} bytes for {keys} keys of dim {dim} (expected {expected})"
    )]
    Length {
        /// The shard.
        shard: u32,
        /// Keys asked of it.
        keys: usize,
        /// Dimension.
        dim: usize,
        /// Bytes expected.
        expected: usize,
        /// Bytes received.
        got: usize,
    },
    /// Shards disagree on the table's dimension.
    #[error("shard {shard} reports dim {got}, other shards dim {expected}")]
    Dimension {
        /// The shard.
        shard: u32,
        /// Dimension of the first answer.
        expected: usize,
        /// Its dimension.
        got: usize,
    },
    /// The number of answers is not the number of sub-requests.
    #[error("expected {expected} shard answers, got {got}")]
    Count {
        /// Sub-requests.
        expected: usize,
        /// Answers.
        got: usize,
    },
}

/// Shards up to which a plan finds a shard's group in a table indexed by
/// shard (4 bytes a shard, zeroed per plan); above it, in a hash map.
const DENSE_SHARDS: u32 = 4096;

/// The group (sub-request) of each shard touched so far.
enum GroupOf {
    /// Indexed by shard; `u32::MAX` for none yet.
    Dense(Vec<u32>),
    /// For very many shards.
    Sparse(HashMap<u32, u32, FastHash>),
}

impl GroupOf {
    fn new(num_shards: u32) -> Self {
        if num_shards <= DENSE_SHARDS {
            GroupOf::Dense(vec![u32::MAX; num_shards as usize])
        } else {
            GroupOf::Sparse(HashMap::default())
        }
    }

    /// The group of `shard`, or `add()`'s new group.
    fn get_or(&mut self, shard: u32, add: impl FnOnce() -> u32) -> u32 {
        match self {
            GroupOf::Dense(groups) => match groups.get_mut(shard as usize) {
                Some(group) if *group != u32::MAX => *group,
                Some(group) => {
                    *group = add();
                    *group
                }
                // A shard past the count cannot come from
                // `shard_for_key`; kept total rather than trusted (each
                // such key would get a group of its own, still merged
                // right).
                None => add(),
            },
            GroupOf::Sparse(groups) => *groups.entry(shard).or_insert_with(add),
        }
    }
}

/// The hasher of a plan's maps: keys are the caller's own ids (no
/// adversary picks them), and SipHash, std's default, was the largest
/// cost of planning (a fifth of a trainer's CPU in `ps-training`);
/// `foldhash` is hashbrown's own default hasher.
type FastHash = foldhash::fast::RandomState;

/// Groups the unique keys by shard (first-seen order within a shard) and
/// says where each of `keys` landed.
fn group_keys(keys: &[u64], num_shards: u32) -> (Vec<ShardKeys>, Vec<Slot>) {
    let mut groups: Vec<ShardKeys> = Vec::new();
    let mut group_of = GroupOf::new(num_shards);
    let mut seen: HashMap<u64, Slot, FastHash> =
        HashMap::with_capacity_and_hasher(keys.len(), FastHash::default());
    let mut slots = Vec::with_capacity(keys.len());
    // Keys spread evenly over the shards they touch: reserve a little
    // over an even share, so a group's Vec rarely grows.
    let touched = (num_shards as usize).clamp(1, keys.len().max(1));
    let share = keys.len() / touched;
    let reserve = share + share / 4 + 8;
    for &key in keys {
        let slot = *seen.entry(key).or_insert_with(|| {
            let shard = shard_for_key(key, num_shards);
            let group = group_of.get_or(shard, || {
                groups.push(ShardKeys {
                    shard,
                    keys: Vec::with_capacity(reserve),
                });
                // At most num_shards groups, which is a u32.
                (groups.len() - 1) as u32
            });
            let keys = &mut groups[group as usize].keys;
            keys.push(key);
            Slot {
                group,
                row: (keys.len() - 1) as u32,
            }
        });
        slots.push(slot);
    }
    (groups, slots)
}

impl FetchPlan {
    /// Plans a Fetch of `keys` over `num_shards` shards.
    pub fn new(keys: &[u64], num_shards: u32) -> Self {
        let (groups, slots) = group_keys(keys, num_shards);
        Self {
            groups,
            slots,
            num_shards,
        }
    }

    /// The shard count it was split by.
    pub fn num_shards(&self) -> u32 {
        self.num_shards
    }

    /// The same Fetch split by `num_shards` (the cluster's shard count
    /// changed since it was planned).
    pub fn resplit(&self, num_shards: u32) -> Self {
        let keys: Vec<u64> = self
            .slots
            .iter()
            .map(|s| self.groups[s.group as usize].keys[s.row as usize])
            .collect();
        Self::new(&keys, num_shards)
    }

    /// One sub-request per shard touched.
    pub fn groups(&self) -> &[ShardKeys] {
        &self.groups
    }

    /// The caller's keys, with repeats: the rows the merged answer holds.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether the plan asks for no rows.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Unique keys in the plan.
    pub fn unique_keys(&self) -> usize {
        self.groups.iter().map(|g| g.keys.len()).sum()
    }

    /// Merges the sub-responses (`(dim, values)` per group, in group order)
    /// into rows in the caller's order: `keys.len() * dim` values.
    pub fn merge<B: AsRef<[u8]>>(
        &self,
        answers: &[(u32, B)],
    ) -> Result<(usize, Vec<f32>), MergeError> {
        if answers.len() != self.groups.len() {
            return Err(MergeError::Count {
                expected: self.groups.len(),
                got: answers.len(),
            });
        }
        let dim = answers.first().map_or(0, |(dim, _)| *dim as usize);
        for (group, (answer_dim, values)) in self.groups.iter().zip(answers) {
            let got_dim = *answer_dim as usize;
            if got_dim != dim {
                return Err(MergeError::Dimension {
                    shard: group.shard,
                    expected: dim,
                    got: got_dim,
                });
            }
            let expected = group.keys.len() * dim * F32_BYTES;
            let got = values.as_ref().len();
            if got != expected {
                return Err(MergeError::Length {
                    shard: group.shard,
                    keys: group.keys.len(),
                    dim,
                    expected,
                    got,
                });
            }
        }
        let row_bytes = dim * F32_BYTES;
        let mut out = Vec::with_capacity(self.slots.len() * dim);
        for slot in &self.slots {
            let values = answers[slot.group as usize].1.as_ref();
            let start = slot.row as usize * row_bytes;
            out.extend(
                values[start..start + row_bytes]
                    .chunks_exact(F32_BYTES)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            );
        }
        Ok((dim, out))
    }
}

/// A deduplicated, shard-split Push: gradients of repeated keys are summed.
#[derive(Debug, Clone)]
pub struct PushPlan {
    /// One sub-request per shard touched: its keys and their summed
    /// gradients (`keys.len() * dim` values).
    pub groups: Vec<(ShardKeys, Vec<f32>)>,
    /// The shard count it was split by.
    pub num_shards: u32,
}

impl PushPlan {
    /// Plans a Push of `gradients` (`keys.len() * dim` values, row i for
    /// keys\[i\]). Returns `None` if the lengths disagree.
    pub fn new(keys: &[u64], gradients: &[f32], dim: usize, num_shards: u32) -> Option<Self> {
        if dim == 0 || gradients.len() != keys.len() * dim {
            return None;
        }
        let (groups, slots) = group_keys(keys, num_shards);
        Some(Self::summed(groups, &slots, gradients, dim, num_shards))
    }

    /// The same Push split by `num_shards` (the cluster's shard count
    /// changed since it was planned): the summed gradient of every key,
    /// grouped anew. `None` for a plan without keys.
    pub fn resplit(&self, num_shards: u32) -> Option<Self> {
        let keys: Vec<u64> = self
            .groups
            .iter()
            .flat_map(|(g, _)| g.keys.iter().copied())
            .collect();
        let sums: Vec<f32> = self
            .groups
            .iter()
            .flat_map(|(_, s)| s.iter().copied())
            .collect();
        let dim = sums.len().checked_div(keys.len())?;
        Self::new(&keys, &sums, dim, num_shards)
    }

    /// Plans a Push of the gradients of the rows `fetch` returned
    /// (`fetch.len() * dim` values, in the order of the Fetch's keys):
    /// the Fetch's grouping is reused, so no key is hashed again, which
    /// halves a training step's planning. Returns `None` if the lengths
    /// disagree.
    pub fn for_fetch(fetch: &FetchPlan, gradients: &[f32], dim: usize) -> Option<Self> {
        if dim == 0 || gradients.len() != fetch.slots.len() * dim {
            return None;
        }
        Some(Self::summed(
            fetch.groups.clone(),
            &fetch.slots,
            gradients,
            dim,
            fetch.num_shards,
        ))
    }

    /// Each group's gradients: row i of `gradients` added into the row of
    /// `slots[i]`. `gradients` holds `slots.len() * dim` values.
    fn summed(
        groups: Vec<ShardKeys>,
        slots: &[Slot],
        gradients: &[f32],
        dim: usize,
        num_shards: u32,
    ) -> Self {
        let mut sums: Vec<Vec<f32>> = groups
            .iter()
            .map(|g| vec![0f32; g.keys.len() * dim])
            .collect();
        for (slot, grad) in slots.iter().zip(gradients.chunks_exact(dim)) {
            let start = slot.row as usize * dim;
            for (sum, g) in sums[slot.group as usize][start..start + dim]
                .iter_mut()
                .zip(grad)
            {
                *sum += g;
            }
        }
        Self {
            groups: groups.into_iter().zip(sums).collect(),
            num_shards,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tessera_proto::rows::put_f32s;

    /// A fake shard: the row of key k is [k, k + 0.5].
    fn answer(group: &ShardKeys) -> (u32, Vec<u8>) {
        let mut out = Vec::new();
        for &k in &group.keys {
            put_f32s(&mut out, &[k as f32, k as f32 + 0.5]);
        }
        (2, out)
    }

    #[test]
    fn a_plan_split_again_by_a_new_count_keeps_the_keys_and_sums() {
        let keys: Vec<u64> = (0..200).chain(0..50).collect();
        let fetch = FetchPlan::new(&keys, 2);
        let again = fetch.resplit(3);
        assert_eq!(again.num_shards(), 3);
        assert_eq!(again.groups().len(), 3);
        assert_eq!(again.len(), keys.len());
        let answers: Vec<(u32, Vec<u8>)> = again.groups().iter().map(answer).collect();
        let direct: Vec<(u32, Vec<u8>)> = FetchPlan::new(&keys, 3)
            .groups()
            .iter()
            .map(answer)
            .collect();
        assert_eq!(
            again.merge(&answers),
            FetchPlan::new(&keys, 3).merge(&direct)
        );
        for g in again.groups() {
            assert!(g.keys.iter().all(|&k| shard_for_key(k, 3) == g.shard));
        }
        // A Push: every key's sum survives the new split.
        let grads: Vec<f32> = (0..keys.len() * 2).map(|i| i as f32).collect();
        let push = PushPlan::new(&keys, &grads, 2, 2).unwrap();
        let moved = push.resplit(3).unwrap();
        assert_eq!(moved.num_shards, 3);
        let sums = |p: &PushPlan| -> HashMap<u64, Vec<f32>> {
            p.groups
                .iter()
                .flat_map(|(g, s)| g.keys.iter().copied().zip(s.chunks(2).map(<[f32]>::to_vec)))
                .collect()
        };
        assert_eq!(sums(&moved), sums(&push));
        for (g, _) in &moved.groups {
            assert!(g.keys.iter().all(|&k| shard_for_key(k, 3) == g.shard));
        }
    }

    #[test]
    fn duplicates_are_fetched_once_and_merged_in_caller_order() {
        let keys = [5u64, 9, 5, 1, 9, 9, 100];
        let plan = FetchPlan::new(&keys, 3);
        assert_eq!(plan.unique_keys(), 4);
        for group in plan.groups() {
            for &k in &group.keys {
                assert_eq!(shard_for_key(k, 3), group.shard);
            }
        }
        let answers: Vec<_> = plan.groups().iter().map(answer).collect();
        let (dim, rows) = plan.merge(&answers).unwrap();
        assert_eq!(dim, 2);
        let expected: Vec<f32> = keys
            .iter()
            .flat_map(|&k| [k as f32, k as f32 + 0.5])
            .collect();
        assert_eq!(rows, expected);
    }

    #[test]
    fn wrong_answers_are_refused() {
        let plan = FetchPlan::new(&[1, 2, 3, 4, 5, 6], 2);
        let mut answers: Vec<_> = plan.groups().iter().map(answer).collect();
        answers[0].1.pop();
        assert!(matches!(
            plan.merge(&answers),
            Err(MergeError::Length { .. })
        ));
        let mut answers: Vec<_> = plan.groups().iter().map(answer).collect();
        answers[1].0 = 3;
        assert!(matches!(
            plan.merge(&answers),
            Err(MergeError::Dimension { .. })
        ));
        assert!(matches!(
            plan.merge::<Vec<u8>>(&[]),
            Err(MergeError::Count { .. })
        ));
    }

    #[test]
    fn push_sums_gradients_of_repeated_keys() {
        let plan = PushPlan::new(&[7, 8, 7], &[1.0, 2.0, 10.0, 20.0, 0.5, 0.25], 2, 1).unwrap();
        assert_eq!(plan.groups.len(), 1);
        let (group, grads) = &plan.groups[0];
        assert_eq!(group.keys, vec![7, 8]);
        assert_eq!(grads, &vec![1.5, 2.25, 10.0, 20.0]);
        assert!(PushPlan::new(&[1], &[1.0], 2, 1).is_none());
    }

    #[test]
    fn a_push_planned_from_a_fetch_is_the_push_planned_from_its_keys() {
        let keys = [7u64, 8, 7, 1_000_003, 8, 42];
        let gradients: Vec<f32> = (0..keys.len() * 2).map(|i| i as f32 * 0.5).collect();
        let fetch = FetchPlan::new(&keys, 3);
        let from_fetch = PushPlan::for_fetch(&fetch, &gradients, 2).unwrap();
        let from_keys = PushPlan::new(&keys, &gradients, 2, 3).unwrap();
        assert_eq!(from_fetch.groups, from_keys.groups);
        assert!(PushPlan::for_fetch(&fetch, &gradients[1..], 2).is_none());
        assert!(PushPlan::for_fetch(&fetch, &gradients, 0).is_none());
    }

    proptest! {
        #[test]
        fn merge_reproduces_every_key_in_order(
            keys in proptest::collection::vec(0u64..50, 0..200),
            // Both ways of finding a shard's group: by index, and by map
            // above DENSE_SHARDS.
            shards in prop_oneof![1u32..8, DENSE_SHARDS - 2..DENSE_SHARDS + 3],
        ) {
            let plan = FetchPlan::new(&keys, shards);
            let unique: std::collections::HashSet<_> = keys.iter().collect();
            prop_assert_eq!(plan.unique_keys(), unique.len());
            prop_assert!(plan.groups().len() <= shards as usize);
            let answers: Vec<_> = plan.groups().iter().map(answer).collect();
            let (_, rows) = plan.merge(&answers).unwrap();
            let expected: Vec<f32> = keys.iter().flat_map(|&k| [k as f32, k as f32 + 0.5]).collect();
            prop_assert_eq!(rows, expected);
            let mut shards_seen: Vec<u32> = plan.groups().iter().map(|g| g.shard).collect();
            shards_seen.sort_unstable();
            shards_seen.dedup();
            prop_assert_eq!(shards_seen.len(), plan.groups().len(), "one group per shard");
        }
    }
}
