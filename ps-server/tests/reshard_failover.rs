//! Failover at the steps of a resize where a review of the safety
//! argument found exactly-once broken (issue 57, holes 1 and 2),
//! in-process with etcd; each interleaving is placed by fail points.
//!
//! - A shrink's remaining primary opens its shard (its own window moved
//!   among the kept ones, a new one started), its replica copies it, and
//!   it is killed before the map says it opened (`reshard::report_opened`
//!   holds every report). The replica leads and opens again: it keeps the
//!   windows of the first opening, so a Push split by the old count and
//!   retried split by the new one is applied once.
//! - A growth's giving primary fences, the new shard opens on its fenced
//!   delta, and the primary is killed while its replica's resize follower
//!   is stalled (`reshard::step`, naming the replica): the replica does
//!   not lead, and so acknowledges no Push of a moved key, until its
//!   resize state has caught up with the map etcd holds.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tessera_coord::{EtcdCoordinator, ResizeState, ShardMap};
use tessera_proto::sharding::shard_for_key;
use tessera_proto::v1::PushRequest;
use tessera_ps_server::TableConfig;
use tessera_ps_server::config::OptimizerConfig;
use tessera_test_support::wait::{Waiting, eventually};
use tessera_test_support::{
    Etcd, InProcess, etcd_coordination, keys_moved, resize_pair, resize_server, shard_map_now,
    split_push, wait_map, wait_serving,
};

/// The fail points are process-wide: under a runner that runs a binary's
/// tests on threads (not nextest), one test at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const DIM: usize = 4;

/// A Push of `step` to `keys` of `shard`, split by `split_by`.
fn push(step: u64, shard: u32, keys: &[u64], split_by: u32) -> PushRequest {
    split_push(DIM, step, shard, keys, split_by)
}

fn table() -> TableConfig {
    TableConfig {
        optimizer: OptimizerConfig::adam(0.01),
        ..TableConfig::new("emb", DIM as u32)
    }
}

/// The keys `num_shards` routes to `shard`.
fn keys(shard: u32, num_shards: u32) -> Vec<u64> {
    (0..900)
        .filter(|&k| shard_for_key(k, num_shards) == shard)
        .collect()
}

/// Waits until `done` holds. A `Waiting` loop, not `eventually`: `done` is
/// an `AsyncFnMut`, whose futures borrow it.
async fn wait_until(what: &str, mut done: impl AsyncFnMut() -> bool) {
    let mut waiting = Waiting::new(Duration::from_secs(40), what);
    while !done().await {
        waiting.tick("it did not hold").await;
    }
}

/// Shard 0's keys (of `from`) that a growth to `to` moves to shard `from`.
fn moving(from: u32, to: u32) -> Vec<u64> {
    keys(0, from)
        .into_iter()
        .filter(|&k| shard_for_key(k, to) == from)
        .collect()
}

/// A cluster of `from` shards, shard 0 on a primary and a replica, the
/// others on one server each; every key's acknowledged Pushes.
struct Cluster {
    pair: Vec<InProcess>,
    others: Vec<InProcess>,
    coord: EtcdCoordinator,
    counts: HashMap<u64, u32>,
    from: u32,
    step: u64,
}

impl Cluster {
    async fn start(etcd: &Etcd, cluster: &str, from: u32) -> Self {
        let mut pair = Vec::new();
        for config in resize_pair(etcd, cluster, from, 0, &table()) {
            pair.push(InProcess::start(&config).await);
        }
        let mut others = Vec::new();
        for shard in 1..from {
            others
                .push(InProcess::start(&resize_server(etcd, cluster, from, shard, &table())).await);
        }
        for s in pair.iter().chain(&others) {
            wait_serving(&s.addr).await;
        }
        let coord = EtcdCoordinator::connect(&etcd_coordination(etcd, cluster, 2000))
            .await
            .unwrap();
        Self {
            pair,
            others,
            coord,
            counts: HashMap::new(),
            from,
            step: 0,
        }
    }

    /// The server leading `shard` of the old count.
    fn primary(&self, shard: u32) -> &InProcess {
        self.pair
            .iter()
            .chain(&self.others)
            .find(|s| s.store.hosted().contains(&shard) && s.replication.is_primary(shard))
            .unwrap_or_else(|| panic!("shard {shard} has no primary"))
    }

    /// One Push of every key, split by the old count; returns its step.
    async fn push_all(&mut self) -> u64 {
        self.step += 1;
        for shard in 0..self.from {
            let request = push(self.step, shard, &keys(shard, self.from), self.from);
            let keys = request.keys.clone();
            let answer = self.primary(shard).data.push(request).await.unwrap();
            assert!(!answer.duplicate);
            for key in keys {
                *self.counts.entry(key).or_default() += 1;
            }
        }
        self.step
    }

    /// Pushes until the resize planned (held) has `ready` ready.
    async fn push_until_ready(&mut self, ready: &[u32]) {
        let mut waiting = Waiting::new(
            Duration::from_secs(30),
            &format!("shards {ready:?} are reported ready"),
        );
        loop {
            self.push_all().await;
            let m = shard_map_now(&self.coord).await;
            let r = m.resize.clone().unwrap();
            if r.state == ResizeState::Copying && r.ready == ready {
                return;
            }
            waiting.tick(&m).await;
        }
    }

    /// Three Pushes of every key, then a growth to `to` planned held with
    /// the new shard's server, Pushes going on until it is ready; the new
    /// server.
    async fn grow_until_ready(&mut self, etcd: &Etcd, cluster: &str, to: u32) -> InProcess {
        for _ in 0..3 {
            self.push_all().await;
        }
        self.coord
            .update_shard_map(|m| m.plan_held(to))
            .await
            .unwrap();
        let new = InProcess::start(&resize_server(etcd, cluster, to, self.from, &table())).await;
        let receiving: Vec<u32> = (self.from..to).collect();
        self.push_until_ready(&receiving).await;
        new
    }

    /// Where shard 0's primary and replica are in `pair`.
    fn pair_roles(&self) -> (usize, usize) {
        let p = self
            .pair
            .iter()
            .position(|s| s.replication.is_primary(0))
            .unwrap();
        (p, 1 - p)
    }

    /// Every key of `shard` of `num_shards` at `server` has as many
    /// updates as Pushes were acknowledged for it.
    fn audit(&self, server: &InProcess, shard: u32, num_shards: u32) {
        let keys = keys(shard, num_shards);
        let rows = server.store.read_rows("emb", shard, &keys, true).unwrap();
        assert_eq!(rows.keys, keys, "shard {shard} lacks rows");
        for (key, steps) in rows.keys.iter().zip(&rows.steps) {
            assert_eq!(
                *steps, self.counts[key],
                "key {key} (shard {shard} of {num_shards})"
            );
        }
    }

    async fn stop(self) {
        for s in self.pair.into_iter().chain(self.others) {
            s.stop().await;
        }
    }
}

/// Hole 1: a shrink's remaining primary killed between its opening and
/// the map's record of it. Its replica, which copied it after the
/// opening, opens again and keeps the windows of that opening: a Push
/// applied before the cut-over and retried split by the new count is a
/// duplicate at every key (the shard's own window was lost before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shrinks_primary_killed_between_its_opening_and_its_report_loses_no_window() {
    let _serial = SERIAL.lock().await;
    let etcd = Etcd::start();
    let (from, to) = (3, 2);
    let mut c = Cluster::start(&etcd, "shrink-reopen", from).await;
    for _ in 0..3 {
        c.push_all().await;
    }
    c.coord.update_shard_map(|m| m.plan_held(to)).await.unwrap();
    c.push_until_ready(&[0, 1]).await;
    // Applied at every shard before the cut-over; the worker's answer is
    // lost, it retries split by the new count after the resize.
    let y = c.push_all().await;

    fail::cfg("reshard::report_opened", "return").unwrap();
    let id = shard_map_now(&c.coord).await.resize.unwrap().id;
    c.coord.update_shard_map(ShardMap::release).await.unwrap();
    let (p, r) = c.pair_roles();
    // Opened at the primary, and its replica copied it since (the kept
    // windows, its own among them, travel with the copy).
    wait_until("the primary opened", async || {
        c.pair[p].store.opened_in(0, id)
    })
    .await;
    wait_until("the replica copied the opened primary", async || {
        c.pair[r].store.opened_in(0, id)
    })
    .await;
    assert!(
        shard_map_now(&c.coord)
            .await
            .resize
            .unwrap()
            .opened
            .is_empty(),
        "an opening was reported through the fail point"
    );
    c.pair.remove(p).crash();
    fail::remove("reshard::report_opened");
    wait_map(&c.coord, "done", |m| {
        m.resize
            .as_ref()
            .is_some_and(|r| r.state == ResizeState::Done)
    })
    .await;
    let replica = &c.pair[0];
    wait_until("the replica leads the opened shard", async || {
        replica.replication.is_primary(0) && replica.store.route_count(0) == to
    })
    .await;
    // `y` retried split by 2: applied at shard 0 and shard 2 before, so
    // at no key now.
    let keys0 = keys(0, to);
    let again = replica.data.push(push(y, 0, &keys0, to)).await.unwrap();
    assert_eq!(
        again.applied, 0,
        "a Push applied before the cut-over was applied again after the failover"
    );
    let answer = replica
        .data
        .push(push(c.step + 1, 0, &keys0, to))
        .await
        .unwrap();
    assert!(!answer.duplicate);
    for &key in &keys0 {
        *c.counts.get_mut(&key).unwrap() += 1;
    }
    c.audit(replica, 0, to);
    c.stop().await;
}

/// Hole 2: a growth's giving primary killed after its fenced delta
/// opened the new shard, while its replica's resize follower is stalled
/// (it has not fenced). The replica wins the lead but does not take
/// Pushes until its fence stands: a Push to a moved key is never
/// acknowledged there (before, it was, and the new shard never saw it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_giving_replica_whose_resize_follower_stalls_takes_no_push_of_a_moved_key() {
    let _serial = SERIAL.lock().await;
    let etcd = Etcd::start();
    let (from, to) = (2, 3);
    let cluster = "grow-stalled";
    let mut c = Cluster::start(&etcd, cluster, from).await;
    let new = c.grow_until_ready(&etcd, cluster, to).await;
    let (p, r) = c.pair_roles();
    let moving = moving(from, to);
    let staying: Vec<u64> = keys(0, from)
        .into_iter()
        .filter(|&k| shard_for_key(k, to) == 0)
        .collect();
    // The replica's resize follower looks no more.
    fail::cfg("reshard::step", &format!("return({})", c.pair[r].addr)).unwrap();
    c.coord.update_shard_map(ShardMap::release).await.unwrap();
    wait_map(&c.coord, "the new shard opened", |m| {
        m.resize.as_ref().is_some_and(|r| r.opened.contains_key(&2))
    })
    .await;
    assert!(c.pair[p].store.moved(0).is_some(), "the primary fenced");
    assert!(
        c.pair[r].store.moved(0).is_none(),
        "the stalled replica fenced"
    );
    c.pair.remove(p).crash();
    let replica_addr = c.pair[0].addr.clone();
    // The replica wins the lead (its primary key in etcd) ...
    eventually(
        Duration::from_secs(30),
        "the replica campaigns (holds shard 0's primary key)",
        || async {
            let (primaries, _) = c.coord.primaries().await.unwrap();
            match primaries.get(&0) {
                Some((record, _)) if record.address == replica_addr => Ok(()),
                other => Err(other.map(|(record, _)| record.address.clone())),
            }
        },
    )
    .await;
    // ... and for longer than its recovery may wait (the failover
    // timeout, 2 s) takes no Push of a moved key.
    let until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < until {
        let step = c.step + 1_000;
        let answer = c.pair[0].data.push(push(step, 0, &moving, from)).await;
        assert!(
            answer.is_err(),
            "the replica acknowledged a Push of a key its old primary fenced"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Caught up: it fences, leads, refuses the moved keys and takes the
    // staying ones.
    fail::remove("reshard::step");
    let replica = &c.pair[0];
    wait_until("the replica leads", async || {
        replica.replication.is_primary(0)
            && replica
                .data
                .push(push(c.step + 2_000, 0, &staying, from))
                .await
                .is_ok()
    })
    .await;
    let err = replica
        .data
        .push(push(c.step + 3_000, 0, &moving, from))
        .await
        .unwrap_err();
    assert!(keys_moved(&err).is_some(), "{err:?}");
    new.stop().await;
    c.stop().await;
}

/// Hole 3: a growth that one giving shard cannot finish after the
/// cut-over (its resize follower stalled: it never fences, so its
/// fenced delta never comes and the new shard never opens) is cancelled:
/// the giving shard that fenced lifts its fence and takes the moved
/// keys' Pushes again, the map routes by the old count, and every
/// acknowledged Push is applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_growth_stuck_after_its_cut_over_is_cancelled_and_the_old_shards_serve_again() {
    let _serial = SERIAL.lock().await;
    let etcd = Etcd::start();
    let (from, to) = (2, 3);
    let cluster = "grow-stuck";
    let mut c = Cluster::start(&etcd, cluster, from).await;
    let new = c.grow_until_ready(&etcd, cluster, to).await;
    // Shard 1's server never looks at the map again: it does not fence.
    fail::cfg("reshard::step", &format!("return({})", c.others[0].addr)).unwrap();
    c.coord.update_shard_map(ShardMap::release).await.unwrap();
    wait_map(&c.coord, "cut over", |m| {
        m.active().is_some_and(|r| r.state == ResizeState::CutOver)
    })
    .await;
    wait_until("shard 0 fenced", async || {
        c.primary(0).store.moved(0).is_some()
    })
    .await;
    let moving = moving(from, to);
    let err = c
        .primary(0)
        .data
        .push(push(c.step + 1, 0, &moving, from))
        .await
        .unwrap_err();
    assert!(keys_moved(&err).is_some(), "{err:?}");
    // Stuck: the new shard has no fenced delta of shard 1, so it neither
    // claims nor opens.
    let m = shard_map_now(&c.coord).await;
    let r = m.active().unwrap();
    assert!(r.opening.is_empty() && r.opened.is_empty(), "{m:?}");
    assert!(
        new.store.receiving(2),
        "the new shard serves without every fenced delta"
    );

    // The way out.
    let cancelled = c.coord.update_shard_map(ShardMap::cancel).await.unwrap();
    assert_eq!(cancelled.num_shards, from);
    wait_until("shard 0 lifted its fence", async || {
        c.primary(0).store.moved(0).is_none()
    })
    .await;
    fail::remove("reshard::step");
    // The moved keys' Pushes go to their old shard again, under the
    // old count; a Push refused at the fence goes again and is applied
    // once.
    c.step += 1;
    let step = c.step;
    let answer = c
        .primary(0)
        .data
        .push(push(step, 0, &moving, from))
        .await
        .unwrap();
    assert!(!answer.duplicate);
    for &key in &moving {
        *c.counts.get_mut(&key).unwrap() += 1;
    }
    c.push_all().await;
    for shard in 0..from {
        c.audit(c.primary(shard), shard, from);
    }
    // A resize may be planned again.
    c.coord.update_shard_map(|m| m.plan_held(to)).await.unwrap();
    new.stop().await;
    c.stop().await;
}
