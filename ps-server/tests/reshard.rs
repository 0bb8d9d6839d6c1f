//! Growing a cluster's shard count (issue 39), in-process with etcd, as
//! far as it is built: an operator plans 2 -> 3 shards, the cut-over
//! held; the primary of the new shard (two servers, two replica groups)
//! moves the resize to copying; both old shards' primaries stream it
//! their moving rows (whole: optimizer state and update counts) while
//! Pushes go on; the new shard reports ready, and its rows are the old
//! primaries', bit for bit, once the Pushes stop; held, it does not cut
//! over. A cancel stops the streams and closes the new server's feed.
//! Planned again without a hold, under Pushes: the resize starts over
//! with copies, comes back in step and cuts over by itself; the old
//! shards refuse the moved keys from then on (`KeysMoved`), the new
//! primary serves them once it holds both old shards' fenced deltas, with
//! every Push applied before the fence and none after, and its replica
//! copies the shard from it. Pushes retried across the cut-over (split by
//! the new count) leave out the keys their old shard applied, at the new
//! primary and, after it stops, at its replica that took over; a server
//! of an old shard restarted after the cut-over refuses the moved keys
//! from its first request.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stderr,
    missing_docs
)]

use std::time::{Duration, Instant};

use bytes::Bytes;
use tessera_coord::{EtcdCoordinator, ResizeState, ShardMap};
use tessera_proto::sharding::shard_for_key;
use tessera_proto::v1::{FetchRequest, HealthRequest, PushRequest};
use tessera_ps_server::TableConfig;
use tessera_ps_server::config::OptimizerConfig;
use tessera_ps_server::table::ExpiryConfig;
use tessera_rpc::{Code, RpcError};
use tessera_test_support::wait::{Waiting, eventually};
use tessera_test_support::{
    Etcd, InProcess, etcd_coordination, keys_moved, resize_pair, resize_server, shard_map_now,
    wait_serving, wire,
};

const DIM: usize = 8;
const OLD: u32 = 2;
const NEW: u32 = 3;

/// The one table: Adam, with expiry counted in each shard's own Pushes:
/// the new shard gets rows of two counts (shard 0 pushed 30 times more),
/// and must not expire shard 1's rows as 30 Pushes old.
fn table() -> TableConfig {
    TableConfig {
        optimizer: OptimizerConfig::adam(0.01),
        expiry: Some(ExpiryConfig::after_pushes(20)),
        ..TableConfig::new("emb", DIM as u32)
    }
}

/// A Push of `step` to `keys` of old shard `shard`.
fn push(step: u64, shard: u32, keys: &[u64]) -> PushRequest {
    let grads: Vec<f32> = (0..keys.len() * DIM)
        .map(|i| ((i as u64 * 13 + step * 7) % 17) as f32 - 8.0)
        .collect();
    PushRequest {
        // Split by the old count, as a worker on the old map does.
        num_shards: OLD,
        table: "emb".into(),
        shard,
        keys: keys.to_vec(),
        gradients: Bytes::from(wire(&grads)),
        worker_id: 11,
        sequence: step,
    }
}

/// A Fetch of `key` of `shard` at `server`.
async fn fetch_at(server: &InProcess, shard: u32, key: u64) -> Result<Vec<u8>, RpcError> {
    server
        .data
        .fetch(FetchRequest {
            table: "emb".into(),
            shard,
            keys: vec![key],
        })
        .await
        .map(|r| r.values.to_vec())
}

/// A Fetch of `key` at a server of the new shard.
async fn fetch_new(new: &InProcess, key: u64) -> Result<Vec<u8>, RpcError> {
    fetch_at(new, OLD, key).await
}

/// The resize feed `server` reports (none while closed).
async fn feed_of(server: &InProcess) -> Option<tessera_proto::v1::ServingHealth> {
    server
        .data
        .health(HealthRequest {})
        .await
        .unwrap()
        .serving_feed
}

async fn map(coord: &EtcdCoordinator) -> ShardMap {
    shard_map_now(coord).await
}

/// Rows as compared: values, optimizer state and update counts (expiry
/// stamps start from the new shard's own clock).
fn rows(server: &InProcess, shard: u32, keys: &[u64]) -> (Vec<u64>, Vec<u8>, Vec<u8>, Vec<u32>) {
    let r = server.store.read_rows("emb", shard, keys, true).unwrap();
    (r.keys, r.values, r.state, r.steps)
}

struct Cluster {
    old: Vec<InProcess>,
    /// The new shard's two servers.
    news: Vec<InProcess>,
    coord: EtcdCoordinator,
    /// Per old shard: its keys, and those of them that move.
    keys: Vec<(Vec<u64>, Vec<u64>)>,
    step: u64,
}

impl Cluster {
    /// The new shard's primary (waits for one).
    async fn new_primary(&self) -> &InProcess {
        eventually(
            Duration::from_secs(20),
            "the new shard has a primary",
            || async {
                self.news
                    .iter()
                    .find(|s| s.replication.is_primary(OLD))
                    .ok_or("neither of its servers is primary")
            },
        )
        .await
    }

    async fn push_all(&mut self) {
        self.step += 1;
        for (shard, server) in self.old.iter().enumerate() {
            let request = push(self.step, shard as u32, &self.keys[shard].0);
            server.data.push(request).await.unwrap();
        }
    }

    /// Pushes until the new shard is reported ready in the resize
    /// planned at `id`.
    async fn push_until_ready(&mut self, id: u64) {
        let mut waiting = Waiting::new(Duration::from_secs(30), "the new shard is reported ready");
        loop {
            self.push_all().await;
            let m = map(&self.coord).await;
            let resize = m.resize.clone().unwrap();
            if resize.id == id && resize.state == ResizeState::Copying && resize.ready == [OLD] {
                return;
            }
            waiting.tick(&m).await;
        }
    }

    /// Waits until the new shard's rows are the old primaries' moving
    /// rows, bit for bit (Pushes stopped).
    async fn wait_equal(&self) {
        let new = self.new_primary().await;
        eventually(
            Duration::from_secs(20),
            "the new shard's rows catch up with the old primaries' moving rows",
            || async {
                for (shard, server) in self.old.iter().enumerate() {
                    let moving = &self.keys[shard].1;
                    let want = rows(server, shard as u32, moving);
                    let got = rows(new, OLD, moving);
                    if got != want {
                        return Err(format!(
                            "old shard {shard}'s rows differ: {} of {} held",
                            got.0.len(),
                            moving.len()
                        ));
                    }
                }
                Ok(())
            },
        )
        .await;
    }
}

impl Cluster {
    /// Two old shards' servers, a resize to 3 planned (its cut-over held
    /// when `held`), and the new shard's two servers; returns the version
    /// that planned it.
    async fn start(etcd: &Etcd, cluster: &str, held: bool) -> (Self, u64) {
        let mut old = Vec::new();
        for shard in 0..OLD {
            old.push(InProcess::start(&resize_server(etcd, cluster, OLD, shard, &table())).await);
        }
        for server in &old {
            wait_serving(&server.addr).await;
        }
        let coord = EtcdCoordinator::connect(&etcd_coordination(etcd, cluster, 2000))
            .await
            .unwrap();
        let keys: Vec<(Vec<u64>, Vec<u64>)> = (0..OLD)
            .map(|shard| {
                let mine: Vec<u64> = (0..900)
                    .filter(|&k| shard_for_key(k, OLD) == shard)
                    .collect();
                let moving = mine
                    .iter()
                    .copied()
                    .filter(|&k| shard_for_key(k, NEW) == OLD)
                    .collect();
                (mine, moving)
            })
            .collect();
        for (mine, moving) in &keys {
            assert!(
                moving.len() * 5 > mine.len() && moving.len() * 2 < mine.len(),
                "about a third moves: {} of {}",
                moving.len(),
                mine.len()
            );
        }
        let planned = coord
            .update_shard_map(|m| if held { m.plan_held(NEW) } else { m.plan(NEW) })
            .await
            .unwrap();
        let mut news = Vec::new();
        for config in resize_pair(etcd, cluster, NEW, OLD, &table()) {
            news.push(InProcess::start(&config).await);
        }
        for server in &news {
            wait_serving(&server.addr).await;
        }
        let c = Self {
            old,
            news,
            coord,
            keys,
            step: 0,
        };
        (c, planned.version)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_shard_copies_and_follows_its_moving_rows_until_ready() {
    let etcd = Etcd::start();
    let cluster = "grow";
    // The operator plans 3 shards, the cut-over held; the new shard's
    // two servers start.
    let (mut c, planned) = Cluster::start(&etcd, cluster, true).await;
    for _ in 0..3 {
        c.push_all().await;
    }
    for _ in 0..30 {
        c.step += 1;
        let request = push(c.step, 0, &c.keys[0].0);
        c.old[0].data.push(request).await.unwrap();
    }

    // Pushes go on at the old shards while the new one copies and
    // follows, until the new shard reports ready.
    c.push_until_ready(planned).await;
    // Held: no cut-over however long it stays ready.
    let held_until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < held_until {
        c.push_all().await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let m = map(&c.coord).await;
    assert_eq!(m.num_shards, OLD, "routing changes only at the cut-over");
    // A part split by the new count waits for the cut-over at an old
    // shard (retried meanwhile).
    let staying: Vec<u64> = c.keys[0]
        .0
        .iter()
        .copied()
        .filter(|k| !c.keys[0].1.contains(k))
        .collect();
    let mut early = push(c.step + 1, 0, &staying);
    early.num_shards = NEW;
    match c.old[0].data.push(early).await {
        Err(RpcError::Status(status)) => assert_eq!(status.code(), Code::Unavailable, "{status:?}"),
        other => panic!("a part split by the new count was taken before the fence: {other:?}"),
    }
    assert!(
        m.resize
            .as_ref()
            .is_some_and(|r| r.state == ResizeState::Copying && r.hold),
        "a held resize cut over: {m:?}"
    );
    c.wait_equal().await;
    // Every Push counted: shard 0's keys had all of them, shard 1's all
    // but the 30 to shard 0 alone.
    let new = c.new_primary().await;
    for (shard, (_, moving)) in c.keys.iter().enumerate() {
        let want = if shard == 0 { c.step } else { c.step - 30 };
        let steps = rows(new, OLD, moving).3;
        assert!(
            steps.iter().all(|&s| u64::from(s) == want),
            "shard {shard}: {steps:?}"
        );
    }
    for server in &c.old {
        let streams = server
            .data
            .health(HealthRequest {})
            .await
            .unwrap()
            .delta_streams;
        assert!(
            streams.len() == 1 && streams[0].rows_sent > 0,
            "{streams:?}"
        );
    }
    let feed = feed_of(new)
        .await
        .expect("a receiving primary reports its feed");
    assert_eq!(feed.source_shards, OLD);
    assert!(
        feed.sources.iter().all(|s| s.copies >= 1 && !s.fenced),
        "{feed:?}"
    );
    // Its rows are incomplete until the cut-over: no copy serves.
    let key = c.keys[0].1[0];
    for server in &c.news {
        match fetch_new(server, key).await {
            Err(RpcError::Status(status)) => {
                assert_eq!(status.code(), Code::Unavailable, "{status:?}");
                assert!(status.message().contains("resize"), "{status:?}");
            }
            other => panic!("a receiving shard served a Fetch: {other:?}"),
        }
    }

    // A cancel: the streams to the new shard end, its feed closes, and
    // the old shards stop keeping changes.
    c.coord.update_shard_map(ShardMap::cancel).await.unwrap();
    eventually(
        Duration::from_secs(20),
        "the resize's streams end",
        || async {
            let feed = feed_of(c.new_primary().await).await;
            if feed.is_some() {
                return Err(format!("the new primary's feed is open: {feed:?}"));
            }
            if c.old.iter().any(|s| s.store.tracks_changes()) {
                return Err("an old shard still keeps changes".to_owned());
            }
            Ok(())
        },
    )
    .await;
    assert_eq!(map(&c.coord).await.num_shards, OLD);
    // Cancelled, the new server still serves nothing (nobody routes to
    // it: the operator stops it). Serving, it acknowledged a Push split by
    // the new count from a worker that had not seen the cancel, on a shard
    // about to be stopped (found by the control-plane simulation).
    for server in &c.news {
        match fetch_new(server, key).await {
            Err(RpcError::Status(status)) => {
                assert_eq!(status.code(), Code::Unavailable, "{status:?}");
            }
            other => panic!("a cancelled growth's new shard served a Fetch: {other:?}"),
        }
    }

    // Planned again, not held, with Pushes going on: the new shard starts
    // over (copies), is in step again, and the resize cuts over by
    // itself. From the fence on, each old shard refuses whole Pushes that
    // name a moved key; its other keys go on.
    c.push_all().await;
    // Push `x` reaches old shard 0 only, before the fence (its answer to
    // the worker, say, is lost; shard 1's part is sent after the fence).
    c.step += 1;
    let x = c.step;
    c.old[0].data.push(push(x, 0, &c.keys[0].0)).await.unwrap();
    // Push `y` likewise; it is retried only after the new shard's
    // primary fails over.
    c.step += 1;
    let y = c.step;
    c.old[0].data.push(push(y, 0, &c.keys[0].0)).await.unwrap();
    // The opening is held (a fail point, process-wide) until the old
    // primaries' moved rows are read below: once the new shard opens the
    // resize is soon done and they are dropped (a suite run under load
    // read them after that).
    fail::cfg("reshard::open", "return").unwrap();
    let again = c.coord.update_shard_map(|m| m.plan(NEW)).await.unwrap();
    let mut applied = [c.step, c.step - 32];
    let mut refused = [0u64; OLD as usize];
    let mut waiting = Waiting::new(
        Duration::from_secs(60),
        "the resize cuts over (each old shard refuses the moved keys 3 times)",
    );
    while refused.iter().any(|&r| r < 3) {
        c.step += 1;
        for shard in 0..OLD as usize {
            let (mine, moving) = &c.keys[shard];
            match c.old[shard]
                .data
                .push(push(c.step, shard as u32, mine))
                .await
            {
                Ok(_) => applied[shard] += 1,
                Err(err) => {
                    let moved = keys_moved(&err).unwrap_or_else(|| panic!("{err:?}"));
                    assert_eq!((moved.shard, moved.num_shards), (shard as u32, NEW));
                    assert!(moved.map_version > again.version, "{moved:?}");
                    refused[shard] += 1;
                    // The keys that stay are pushed on their own.
                    let staying: Vec<u64> = mine
                        .iter()
                        .copied()
                        .filter(|k| !moving.contains(k))
                        .collect();
                    let mut staying_push = push(c.step, shard as u32, &staying);
                    staying_push.worker_id = 12;
                    c.old[shard].data.push(staying_push).await.unwrap();
                }
            }
        }
        if refused.iter().any(|&r| r < 3) {
            waiting.tick((refused, map(&c.coord).await)).await;
        }
    }
    // The old primaries' moved rows, frozen by the fence (the new shard
    // holds them once it serves, and they are dropped once it is done).
    let frozen: Vec<_> = (0..OLD as usize)
        .map(|shard| rows(&c.old[shard], shard as u32, &c.keys[shard].1))
        .collect();
    fail::remove("reshard::open");
    let m = map(&c.coord).await;
    assert_eq!(m.num_shards, NEW, "{m:?}");
    assert!(
        m.resize.as_ref().is_some_and(|r| r.id == again.version
            && matches!(r.state, ResizeState::CutOver | ResizeState::Done)),
        "{m:?}"
    );
    // The new primary serves once it holds both fenced deltas: then its
    // moved rows are the old primaries' (which no Push changes any
    // more), with every Push applied before the fence counted once.
    let new = eventually(
        Duration::from_secs(30),
        "the new shard opens (serves a Fetch)",
        || async {
            let new = c.new_primary().await;
            match fetch_new(new, key).await {
                Ok(_) => Ok(new),
                Err(err) => Err((err, feed_of(new).await)),
            }
        },
    )
    .await;
    for (shard, want) in frozen.into_iter().enumerate() {
        let moving = &c.keys[shard].1;
        assert_eq!(
            rows(new, OLD, moving),
            want,
            "old shard {shard}'s moved rows"
        );
        assert!(
            want.3.iter().all(|&s| u64::from(s) == applied[shard]),
            "shard {shard}: {:?} != {}",
            want.3,
            applied[shard]
        );
    }
    assert!(
        feed_of(new).await.is_none(),
        "the feed closes once the shard opens"
    );
    // It says so in the map, the old shards stop streaming to it, the
    // resize is done, and the old shards drop the moved rows.
    eventually(
        Duration::from_secs(20),
        "the resize finishes after the shard opened",
        || async {
            let m = map(&c.coord).await;
            let done = m
                .resize
                .as_ref()
                .is_some_and(|r| r.opened.keys().eq([&OLD]) && r.state == ResizeState::Done);
            let dropped =
                (0..OLD as usize).all(|s| rows(&c.old[s], s as u32, &c.keys[s].1).0.is_empty());
            if done && dropped && c.old.iter().all(|s| !s.store.tracks_changes()) {
                Ok(())
            } else {
                Err(m)
            }
        },
    )
    .await;
    // Once the new shard serves, a Fetch of a moved key at an old shard
    // is refused too, naming the count (until then the old shard served
    // it: nobody wrote it); a key that stays is served.
    let moved_key = c.keys[1].1[0];
    let err = fetch_at(&c.old[1], 1, moved_key).await.unwrap_err();
    assert_eq!(keys_moved(&err).map(|m| m.num_shards), Some(NEW), "{err:?}");
    let staying = c.keys[1]
        .0
        .iter()
        .copied()
        .find(|k| !c.keys[1].1.contains(k))
        .unwrap();
    fetch_at(&c.old[1], 1, staying).await.unwrap();

    // Pushes to the moved keys go to the new shard now.
    let moved_all: Vec<u64> = c.keys.iter().flat_map(|(_, m)| m.iter().copied()).collect();
    let mut sorted = moved_all.clone();
    sorted.sort_unstable();
    let mut to_new = push(c.step + 1, OLD, &sorted);
    to_new.worker_id = 13;
    to_new.num_shards = NEW;
    new.data.push(to_new).await.unwrap();
    let steps_of = |server: &InProcess, shard: usize| rows(server, OLD, &c.keys[shard].1).3;
    let before = [steps_of(new, 0), steps_of(new, 1)];
    assert!(before[0].iter().all(|&s| u64::from(s) == applied[0] + 1));
    // Push `x` retried, split by the new count: its part to the new shard
    // holds both old shards' moved keys; old shard 0 applied it before
    // the fence (its window at the fence came with its last delta), old
    // shard 1 never did. Only shard 1's keys are applied, once.
    for attempt in 0..2 {
        let mut retry = push(x, OLD, &sorted);
        retry.num_shards = NEW;
        new.data.push(retry).await.unwrap();
        assert_eq!(
            steps_of(new, 0),
            before[0],
            "attempt {attempt}: applied twice"
        );
        let plus_one: Vec<u32> = before[1].iter().map(|s| s + 1).collect();
        assert_eq!(steps_of(new, 1), plus_one, "attempt {attempt}");
    }
    // Its part to old shard 0 (the keys that stay) is a duplicate there.
    let staying0: Vec<u64> = c.keys[0]
        .0
        .iter()
        .copied()
        .filter(|k| !c.keys[0].1.contains(k))
        .collect();
    let mut retry0 = push(x, 0, &staying0);
    retry0.num_shards = NEW;
    assert!(c.old[0].data.push(retry0).await.unwrap().duplicate);
    // Its replica copies the shard from it (the moved rows came outside
    // the stream) and then serves the same rows.
    let replica = c.news.iter().find(|s| !std::ptr::eq(*s, new)).unwrap();
    eventually(
        Duration::from_secs(30),
        "the new shard's replica copies it",
        || async {
            if let Err(err) = fetch_new(replica, key).await {
                return Err(format!("the replica refuses a Fetch: {err:?}"));
            }
            if rows(replica, OLD, &sorted) != rows(new, OLD, &sorted) {
                return Err("the replica's rows differ from the primary's".to_owned());
            }
            Ok(())
        },
    )
    .await;
    let Cluster {
        mut old,
        mut news,
        keys,
        ..
    } = c;
    // The new shard's primary stops; its replica leads. It kept the old
    // shards' windows with its copy: Push `y`, applied at old shard 0
    // before the fence and retried only now, split by 3, is applied to
    // old shard 1's keys alone.
    let at = news
        .iter()
        .position(|s| s.replication.is_primary(OLD))
        .unwrap();
    news.remove(at).stop().await;
    eventually(
        Duration::from_secs(30),
        "the replica takes over",
        || async {
            if !news[0].replication.is_primary(OLD) {
                return Err("it is not primary".to_owned());
            }
            match fetch_new(&news[0], key).await {
                Ok(_) => Ok(()),
                Err(err) => Err(format!("it refuses a Fetch: {err:?}")),
            }
        },
    )
    .await;
    let steps_at = |shard: usize| rows(&news[0], OLD, &keys[shard].1).3;
    let before = [steps_at(0), steps_at(1)];
    let mut retry = push(y, OLD, &sorted);
    retry.num_shards = NEW;
    news[0].data.push(retry).await.unwrap();
    assert_eq!(steps_at(0), before[0], "applied twice after the failover");
    let plus_one: Vec<u32> = before[1].iter().map(|s| s + 1).collect();
    assert_eq!(steps_at(1), plus_one);
    // A server of old shard 1 started after the cut-over (configured with
    // the old count, as its config still says) joins, and refuses the
    // moved keys from its first request: it fenced them before serving.
    // Pushes split by the new count are taken (the new shard serves).
    old.pop().unwrap().stop().await;
    let again = InProcess::start(&resize_server(&etcd, cluster, OLD, 1, &table())).await;
    wait_serving(&again.addr).await;
    let err = fetch_at(&again, 1, keys[1].1[0]).await.unwrap_err();
    assert_eq!(keys_moved(&err).map(|m| m.num_shards), Some(NEW), "{err:?}");
    let staying1: Vec<u64> = keys[1]
        .0
        .iter()
        .copied()
        .filter(|k| !keys[1].1.contains(k))
        .collect();
    let mut split_new = push(10_000, 1, &staying1);
    split_new.num_shards = NEW;
    again.data.push(split_new).await.unwrap();
    for server in news.into_iter().chain(old).chain([again]) {
        server.stop().await;
    }
}

/// A resize interrupted while copying: the new shard's primary stops; its
/// replica (which followed nothing) leads, copies the moving rows anew and
/// is in step again; released, the resize cuts over, the new primary opens
/// and the resize is done, the moved rows bit for bit the old primaries'.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resize_whose_new_primary_stops_while_copying_completes() {
    let etcd = Etcd::start();
    let (mut c, planned) = Cluster::start(&etcd, "grow-interrupted", true).await;
    for _ in 0..3 {
        c.push_all().await;
    }
    c.push_until_ready(planned).await;
    let at = c
        .news
        .iter()
        .position(|s| s.replication.is_primary(OLD))
        .unwrap();
    c.news.remove(at).stop().await;
    // The replica leads and follows both old shards anew (copies).
    let mut waiting = Waiting::new(
        Duration::from_secs(30),
        "the new primary follows the old shards",
    );
    loop {
        c.push_all().await;
        let feed = if c.news[0].replication.is_primary(OLD) {
            feed_of(&c.news[0]).await
        } else {
            None
        };
        let in_step = feed.as_ref().is_some_and(|f| {
            f.sources.len() == OLD as usize && f.sources.iter().all(|s| s.copies >= 1 && !s.copying)
        });
        if in_step {
            break;
        }
        waiting.tick(feed).await;
    }
    c.push_until_ready(planned).await;
    c.wait_equal().await;
    let frozen: Vec<_> = (0..OLD as usize)
        .map(|shard| rows(&c.old[shard], shard as u32, &c.keys[shard].1))
        .collect();
    // Released (no Push meanwhile): it cuts over, opens and is done.
    c.coord.update_shard_map(ShardMap::release).await.unwrap();
    eventually(Duration::from_secs(30), "the resize is done", || async {
        let m = map(&c.coord).await;
        if m.resize
            .as_ref()
            .is_some_and(|r| r.state == ResizeState::Done)
        {
            Ok(())
        } else {
            Err(m)
        }
    })
    .await;
    let new = c.new_primary().await;
    for (shard, want) in frozen.into_iter().enumerate() {
        assert_eq!(rows(new, OLD, &c.keys[shard].1), want, "old shard {shard}");
    }
    fetch_new(new, c.keys[0].1[0]).await.unwrap();
    let Cluster { old, news, .. } = c;
    for server in news.into_iter().chain(old) {
        server.stop().await;
    }
}
