//! Expiry steps (`table/expiry.rs`): the primary's sweep of a shard's
//! tables, and a replica removing what the primary's sweep removed, both
//! under the shard's write lock.

use super::{ShardGuard, Store, StoreError};

/// What one step of a table's sweep removed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expired {
    /// The table.
    pub table: String,
    /// The keys of the rows removed.
    pub keys: Vec<u64>,
    /// The step finished a pass over the table's rows of the shard.
    pub pass_done: bool,
}

impl Store {
    /// Tables with expiry, by name (the sweeper's work list).
    pub fn expiring_tables(&self) -> Vec<(String, u64)> {
        let mut out: Vec<(String, u64)> = self
            .tables
            .values()
            .filter_map(|t| {
                let e = t.config().expiry?;
                Some((t.config().name.clone(), e.sweep_rows_per_sec))
            })
            .collect();
        out.sort();
        out
    }

    /// One step of `table`'s expiry sweep on the shard `writing` locks,
    /// at the wall-clock `secs` (the primary's):
    /// visits at most `max_slots` record slots and removes the expired
    /// rows among them. `None` if the table does not exist, does not
    /// expire, or the shard is not hosted.
    pub fn expire_step(
        &self,
        writing: &ShardGuard<'_>,
        table: &str,
        secs: u64,
        max_slots: usize,
    ) -> Option<Expired> {
        let t = self.tables.get(table)?;
        t.config().expiry?;
        let state = t.shard(writing.shard())?;
        let mut pass_done = false;
        let keys = t.expire_step(writing, state, secs, max_slots, &mut pass_done);
        Some(Expired {
            table: table.to_owned(),
            keys,
            pass_done,
        })
    }

    /// Moves `table`'s clock on the shard `writing` locks to the wall
    /// clock `secs` (a table expiring `after_secs`, on a server that does
    /// not sweep the shard): Fetch marks (`refresh = "access"`) then
    /// carry the time they happened, not that of the last Push, should
    /// this server lead the shard later.
    pub fn advance_clock(&self, writing: &ShardGuard<'_>, table: &str, secs: u64) {
        let Some(t) = self.tables.get(table) else {
            return;
        };
        if let (Some(expiry), Some(state)) = (t.config().expiry, t.shard(writing.shard()))
            && matches!(expiry.bound(), crate::table::expiry::Bound::Secs(_))
        {
            state.rows.note_stamp(expiry.bound().now(secs, 0));
        }
    }

    /// Removes the rows the primary's sweep removed (`expired`) from the
    /// shard `writing` locks. Refused when the table does not expire here
    /// or a row is missing (this copy is not the primary's; the rest are
    /// removed anyway, and the caller copies the shard again).
    pub fn apply_expired(
        &self,
        writing: &ShardGuard<'_>,
        expired: &Expired,
    ) -> Result<(), StoreError> {
        let bad = || StoreError::BadExpiry {
            table: expired.table.clone(),
        };
        let t = self.tables.get(&expired.table).ok_or_else(bad)?;
        if t.config().expiry.is_none() {
            return Err(bad());
        }
        let state = t.shard(writing.shard()).ok_or_else(bad)?;
        if t.remove_expired(writing, state, &expired.keys) {
            Ok(())
        } else {
            Err(bad())
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::time::Instant;

    use super::super::tests::{config, digest, keys_of_shard, wire};
    use super::*;
    use crate::config::{Mode, StoreConfig};
    use crate::store::PushId;
    use crate::table::{ExpiryConfig, Refresh};

    fn expiring(expiry: ExpiryConfig) -> StoreConfig {
        let mut config = config(Mode::Training);
        config.tables[0].expiry = Some(expiry);
        config
    }

    /// A primary and a replica following its stream by hand: Pushes and
    /// sweep steps take stream positions, the replica applies each as the
    /// primary's entry says, and the wall clock is `secs`.
    struct Pair {
        primary: Store,
        replica: Store,
        secs: u64,
        sequence: u64,
    }

    impl Pair {
        fn new(config: &StoreConfig) -> Self {
            Self {
                primary: Store::new(config),
                replica: Store::new(config),
                secs: 1_000_000,
                sequence: 0,
            }
        }

        fn push(&mut self, keys: &[u64]) {
            self.sequence += 1;
            let grads = wire(&vec![0.25; keys.len() * 3]);
            let id = PushId {
                worker: 1,
                sequence: self.sequence,
            };
            let mut g = self.primary.lock_shard(0).unwrap();
            let outcome = self
                .primary
                .check_push("t", 0, keys, &grads, id)
                .unwrap()
                .apply_at(&g, Instant::now(), self.secs)
                .unwrap();
            let version = g.version().next(1);
            g.set_version(version);
            let mut r = self.replica.lock_shard(0).unwrap();
            self.replica
                .check_push("t", 0, keys, &grads, id)
                .unwrap()
                .apply_replicated(
                    &r,
                    &outcome.evicted,
                    &outcome.not_admitted,
                    Instant::now(),
                    outcome.stamp,
                )
                .unwrap();
            r.set_version(version);
        }

        /// One sweep step of `slots` on the primary, followed by the
        /// replica; the keys removed.
        fn sweep(&mut self, slots: usize) -> Vec<u64> {
            let mut g = self.primary.lock_shard(0).unwrap();
            let expired = self.primary.expire_step(&g, "t", self.secs, slots).unwrap();
            if expired.keys.is_empty() {
                return Vec::new();
            }
            let version = g.version().next(1);
            g.set_version(version);
            let mut r = self.replica.lock_shard(0).unwrap();
            self.replica.apply_expired(&r, &expired).unwrap();
            r.set_version(version);
            expired.keys
        }

        /// Sweeps until a whole pass is done.
        fn full_pass(&mut self) {
            let state = |s: &Store| {
                s.table("t")
                    .unwrap()
                    .shard(0)
                    .unwrap()
                    .sweep
                    .lock()
                    .unwrap()
                    .passes
            };
            let start = state(&self.primary);
            while state(&self.primary) < start + 2 {
                self.sweep(1 << 20);
            }
        }
    }

    /// Each row's key and stamp, sorted.
    fn stamps(store: &Store) -> Vec<(u64, u32)> {
        let cut = store.lock_shard(0).unwrap();
        let snapshot = store.snapshot_shard(&cut);
        let mut out = Vec::new();
        snapshot.tables[0].1.rows.for_each_from(0, |row| {
            out.push((row.key(), row.stamp()));
            true
        });
        out.sort_unstable();
        out
    }

    #[test]
    fn rows_not_pushed_within_the_bound_go_and_the_rest_stay() {
        let mut pair = Pair::new(&expiring(ExpiryConfig::after_pushes(5)));
        let keys = keys_of_shard(0, 20);
        pair.push(&keys[..10]);
        for _ in 0..5 {
            pair.push(&keys[10..12]);
        }
        // Age 5 at the bound: nothing goes yet.
        pair.full_pass();
        assert_eq!(pair.primary.table("t").unwrap().rows(), 12);
        pair.push(&keys[12..13]);
        pair.full_pass();
        let held: Vec<u64> = stamps(&pair.primary).iter().map(|r| r.0).collect();
        let mut want = keys[10..13].to_vec();
        want.sort_unstable();
        assert_eq!(held, want, "the first ten expired");
        assert_eq!(pair.primary.table("t").unwrap().expired(), 10);
        assert_eq!(pair.replica.table("t").unwrap().expired(), 10);
        assert_eq!(stamps(&pair.primary), stamps(&pair.replica));
        // An expired id pushed again starts from its initial values.
        let fresh = pair.primary.fetch("t", 0, &keys[..1]).unwrap().1;
        let initial = Store::new(&config(Mode::Training))
            .fetch("t", 0, &keys[..1])
            .unwrap()
            .1;
        assert_eq!(fresh, initial);
    }

    #[test]
    fn a_step_visits_at_most_its_slots_and_a_pass_reaches_every_row() {
        let mut pair = Pair::new(&expiring(ExpiryConfig::after_pushes(100)));
        let keys = keys_of_shard(0, 20_000);
        pair.push(&keys);
        // The rest 101 positions old; the first fresh (the sweep's own
        // steps take 20 positions or so).
        for _ in 0..101 {
            pair.push(&keys[..1]);
        }
        let mut steps = 0;
        let mut removed = 0;
        while removed < keys.len() - 1 {
            let got = pair.sweep(1000);
            assert!(got.len() <= 1000, "{} rows in one step", got.len());
            removed += got.len();
            steps += 1;
            assert!(steps < 10_000, "the sweep does not end");
        }
        assert!(steps >= 20, "{steps} steps for 20,000 rows of 1,000 slots");
        assert_eq!(pair.primary.table("t").unwrap().rows(), 1);
    }

    /// A table's clock starts from its rows' latest stamp when rows are
    /// installed, also past 2^31 (the first version compared with an
    /// unset 0, called every stamp past 2^31 earlier, and a promoted
    /// replica's first sweep then removed nearly every row).
    #[test]
    fn the_clock_starts_from_installed_stamps_past_two_to_the_31() {
        let store = Store::new(&expiring(ExpiryConfig::after_pushes(100)));
        let rows = &store.table("t").unwrap().shard(0).unwrap().rows;
        let key = keys_of_shard(0, 2);
        rows.insert(key[0], 0, 3_000_000_000, &[0.0; 3], &[])
            .unwrap();
        assert_eq!(rows.stamp_now(), 3_000_000_000);
        rows.insert(key[1], 0, 2_999_999_990, &[0.0; 3], &[])
            .unwrap();
        assert_eq!(rows.stamp_now(), 3_000_000_000, "the later of the two");
        let g = store.lock_shard(0).unwrap();
        let step = store.expire_step(&g, "t", 0, 1 << 20).unwrap();
        assert!(step.keys.is_empty(), "{:?} swept", step.keys);
    }

    /// A server that does not sweep a shard (a replica) still moves a
    /// wall-clock table's clock on, so its Fetch marks carry their own
    /// time, not that of the last Push it followed.
    #[test]
    fn a_replica_marks_fetches_with_the_time_they_happen() {
        let mut pair = Pair::new(&expiring(ExpiryConfig {
            refresh: Refresh::Access,
            ..ExpiryConfig::after_secs(60)
        }));
        let keys = keys_of_shard(0, 1);
        pair.push(&keys);
        let g = pair.replica.lock_shard(0).unwrap();
        pair.replica.advance_clock(&g, "t", pair.secs + 500);
        drop(g);
        let rows = &pair.replica.table("t").unwrap().shard(0).unwrap().rows;
        assert_eq!(rows.stamp_now(), 1_000_500);
        // Promoted, the replica's sweep 50 s later keeps the row it served.
        pair.replica.fetch("t", 0, &keys).unwrap();
        let g = pair.replica.lock_shard(0).unwrap();
        let step = pair
            .replica
            .expire_step(&g, "t", 1_000_550, 1 << 20)
            .unwrap();
        assert!(step.keys.is_empty());
    }

    /// A step ends where a pass does, whatever its budget: the sweeper
    /// paces passes, and a small table is not walked twice in one step.
    #[test]
    fn a_step_ends_at_the_end_of_a_pass() {
        let mut pair = Pair::new(&expiring(ExpiryConfig::after_pushes(100)));
        pair.push(&keys_of_shard(0, 10));
        let g = pair.primary.lock_shard(0).unwrap();
        let step = pair.primary.expire_step(&g, "t", 0, 1 << 20).unwrap();
        assert!(step.pass_done && step.keys.is_empty());
        let state = pair.primary.table("t").unwrap().shard(0).unwrap();
        let cursor = *state.sweep.lock().unwrap();
        assert_eq!((cursor.passes, cursor.stripe, cursor.slot), (1, 0, 0));
        let step = pair.primary.expire_step(&g, "t", 0, 1).unwrap();
        assert!(!step.pass_done);
    }

    #[test]
    fn wall_clock_expiry_follows_the_primarys_seconds_and_fetches_refresh_on_access() {
        for refresh in [Refresh::Push, Refresh::Access] {
            let mut pair = Pair::new(&expiring(ExpiryConfig {
                refresh,
                ..ExpiryConfig::after_secs(60)
            }));
            let keys = keys_of_shard(0, 4);
            pair.push(&keys);
            pair.secs += 50;
            // Marks carry the sweeper's time: one step sets it.
            pair.sweep(1);
            pair.primary.fetch("t", 0, &keys[..2]).unwrap();
            pair.secs += 20;
            pair.full_pass();
            let held = pair.primary.table("t").unwrap().rows();
            match refresh {
                Refresh::Push => assert_eq!(held, 0, "fetched or not, 70 s without a Push"),
                Refresh::Access => {
                    assert_eq!(held, 2, "the two fetched 20 s ago stay");
                    // The pass folded the Fetch marks into the stamps (a
                    // checkpoint or copy carries them).
                    let folded: Vec<u32> = stamps(&pair.primary).iter().map(|r| r.1).collect();
                    assert_eq!(folded, vec![1_000_050; 2]);
                }
            }
            assert_eq!(digest(&pair.primary, 0), digest(&pair.replica, 0));
        }
    }

    #[test]
    fn a_replica_missing_a_row_the_primary_expired_is_told_apart() {
        let store = Store::new(&expiring(ExpiryConfig::after_pushes(1)));
        let guard = store.lock_shard(0).unwrap();
        let key = keys_of_shard(0, 1)[0];
        let expired = Expired {
            table: "t".into(),
            keys: vec![key],
            pass_done: false,
        };
        assert!(matches!(
            store.apply_expired(&guard, &expired),
            Err(StoreError::BadExpiry { .. })
        ));
        let plain = Store::new(&config(Mode::Training));
        let guard = plain.lock_shard(0).unwrap();
        assert!(
            plain.apply_expired(&guard, &expired).is_err(),
            "no expiry here"
        );
        assert!(plain.expire_step(&guard, "t", 0, 10).is_none());
    }

    proptest::proptest! {
        /// Whatever the Pushes, sweep steps, clock and Fetches on either
        /// side, the replica holds the primary's rows with the primary's
        /// stamps, and after a full pass the rows are exactly the ids
        /// pushed within the bound (an independent model).
        #[test]
        fn followed_sweeps_keep_a_replica_identical_and_match_the_model(
            ops in proptest::collection::vec((0u8..4, proptest::collection::vec(0usize..300, 1..30), 1usize..3000), 1..80),
            secs_mode in proptest::bool::ANY,
        ) {
            let expiry = match secs_mode {
                true => ExpiryConfig::after_secs(30),
                false => ExpiryConfig::after_pushes(12),
            };
            let mut pair = Pair::new(&expiring(expiry));
            let keys = keys_of_shard(0, 300);
            // key -> (Push count, secs) at its last Push.
            let mut last: HashMap<u64, (u64, u64)> = HashMap::new();
            for (op, picks, n) in &ops {
                let picked: Vec<u64> = picks.iter().map(|&k| keys[k]).collect();
                match op {
                    0 | 1 => {
                        pair.push(&picked);
                        let at = (pair.sequence, pair.secs);
                        for k in picked {
                            last.insert(k, at);
                        }
                    }
                    2 => {
                        pair.sweep(*n);
                    }
                    _ => {
                        pair.secs += (*n % 10) as u64;
                        let (a, b) = picked.split_at(picked.len() / 2);
                        pair.primary.fetch("t", 0, a).unwrap();
                        pair.replica.fetch("t", 0, b).unwrap();
                    }
                }
                proptest::prop_assert_eq!(stamps(&pair.primary), stamps(&pair.replica));
            }
            pair.full_pass();
            let (now_pushes, now_secs) = (pair.sequence, pair.secs);
            let mut want: Vec<u64> = last
                .iter()
                .filter(|&(_, &(p, s))| match secs_mode {
                    true => now_secs - s <= 30,
                    false => now_pushes - p <= 12,
                })
                .map(|(&k, _)| k)
                .collect();
            want.sort_unstable();
            let held: Vec<u64> = stamps(&pair.primary).iter().map(|r| r.0).collect();
            proptest::prop_assert_eq!(held, want);
            proptest::prop_assert_eq!(digest(&pair.primary, 0), digest(&pair.replica, 0));
            proptest::prop_assert_eq!(stamps(&pair.primary), stamps(&pair.replica));
        }
    }
}
