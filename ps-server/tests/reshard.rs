//! Growing a cluster's shard count (issue 39), in-process with etcd, as
//! far as it is built: an operator plans 2 -> 3 shards; the server of the
//! new shard moves the resize to copying; both old shards' primaries
//! stream it their moving rows (whole: optimizer state and update counts)
//! while Pushes go on; the new shard reports ready, and its rows are the
//! old primaries', bit for bit, once the Pushes stop. A cancel stops the
//! streams and closes the new server's feed; planned again, the resize
//! starts over with copies and comes back in step.
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
use tessera_ps_server::config::{DeltaConfig, OptimizerConfig};
use tessera_ps_server::table::ExpiryConfig;
use tessera_ps_server::{PsServerConfig, TableConfig};
use tessera_rpc::{Code, RpcError};
use tessera_test_support::{Etcd, InProcess, etcd_coordination, free_addr, wait_serving, wire};

const DIM: usize = 8;
const OLD: u32 = 2;
const NEW: u32 = 3;

fn server(etcd: &Etcd, cluster: &str, num_shards: u32, shard: u32) -> PsServerConfig {
    PsServerConfig {
        listen: free_addr(),
        num_shards,
        shards: vec![shard],
        coordinator: etcd_coordination(etcd, cluster, 2000),
        // Deltas every 50 ms (no serving fleet: only a resize uses them).
        delta: DeltaConfig {
            interval_ms: 50,
            ..DeltaConfig::default()
        },
        tables: vec![TableConfig {
            optimizer: OptimizerConfig::adam(0.01),
            // Expiry counted in each shard's own Pushes: the new shard
            // gets rows of two counts (shard 0 pushed 30 times more), and
            // must not expire shard 1's rows as 30 Pushes old.
            expiry: Some(ExpiryConfig::after_pushes(20)),
            ..TableConfig::new("emb", DIM as u32)
        }],
        ..PsServerConfig::default()
    }
}

/// A Push of `step` to `keys` of old shard `shard`.
fn push(step: u64, shard: u32, keys: &[u64]) -> PushRequest {
    let grads: Vec<f32> = (0..keys.len() * DIM)
        .map(|i| ((i as u64 * 13 + step * 7) % 17) as f32 - 8.0)
        .collect();
    PushRequest {
        table: "emb".into(),
        shard,
        keys: keys.to_vec(),
        gradients: Bytes::from(wire(&grads)),
        worker_id: 11,
        sequence: step,
    }
}

/// A Fetch of `key` at the new shard's server.
async fn fetch_new(new: &InProcess, key: u64) -> Result<Vec<u8>, RpcError> {
    new.data
        .fetch(FetchRequest {
            table: "emb".into(),
            shard: OLD,
            keys: vec![key],
        })
        .await
        .map(|r| r.values.to_vec())
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
    coord.shard_map().await.unwrap().unwrap().0
}

/// Rows as compared: values, optimizer state and update counts (expiry
/// stamps start from the new shard's own clock).
fn rows(server: &InProcess, shard: u32, keys: &[u64]) -> (Vec<u64>, Vec<u8>, Vec<u8>, Vec<u32>) {
    let r = server.store.read_rows("emb", shard, keys, true).unwrap();
    (r.keys, r.values, r.state, r.steps)
}

struct Cluster {
    old: Vec<InProcess>,
    new: InProcess,
    coord: EtcdCoordinator,
    /// Per old shard: its keys, and those of them that move.
    keys: Vec<(Vec<u64>, Vec<u64>)>,
    step: u64,
}

impl Cluster {
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
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            self.push_all().await;
            let m = map(&self.coord).await;
            let resize = m.resize.clone().unwrap();
            if resize.id == id && resize.state == ResizeState::Copying && resize.ready == [OLD] {
                return;
            }
            assert!(Instant::now() < deadline, "never ready: {m:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until the new shard's rows are the old primaries' moving
    /// rows, bit for bit (Pushes stopped).
    async fn wait_equal(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let mut equal = true;
            for (shard, server) in self.old.iter().enumerate() {
                let moving = &self.keys[shard].1;
                let want = rows(server, shard as u32, moving);
                let got = rows(&self.new, OLD, moving);
                if got != want {
                    equal = false;
                    assert!(
                        Instant::now() < deadline,
                        "the new shard's rows of old shard {shard} never caught up: {} of {} held",
                        got.0.len(),
                        moving.len()
                    );
                }
            }
            if equal {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_shard_copies_and_follows_its_moving_rows_until_ready() {
    let etcd = Etcd::start();
    let cluster = "grow";
    let mut old = Vec::new();
    for shard in 0..OLD {
        old.push(InProcess::start(&server(&etcd, cluster, OLD, shard)).await);
    }
    for server in &old {
        wait_serving(&server.addr).await;
    }
    let coord = EtcdCoordinator::connect(&etcd_coordination(&etcd, cluster, 2000))
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
    // The operator plans 3 shards; the new shard's server starts.
    let planned = coord.update_shard_map(|m| m.plan(NEW)).await.unwrap();
    let new = InProcess::start(&server(&etcd, cluster, NEW, OLD)).await;
    wait_serving(&new.addr).await;
    let mut c = Cluster {
        old,
        new,
        coord,
        keys,
        step: 0,
    };
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
    c.push_until_ready(planned.version).await;
    assert_eq!(
        map(&c.coord).await.num_shards,
        OLD,
        "routing changes only at the cut-over"
    );
    c.wait_equal().await;
    // Every Push counted: shard 0's keys had all of them, shard 1's all
    // but the 30 to shard 0 alone.
    for (shard, (_, moving)) in c.keys.iter().enumerate() {
        let want = if shard == 0 { c.step } else { c.step - 30 };
        let steps = rows(&c.new, OLD, moving).3;
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
    let feed = feed_of(&c.new)
        .await
        .expect("a receiving primary reports its feed");
    assert_eq!(feed.source_shards, OLD);
    assert!(feed.sources.iter().all(|s| s.copies >= 1), "{feed:?}");
    // Its rows are incomplete until the cut-over: it serves none.
    let key = c.keys[0].1[0];
    match fetch_new(&c.new, key).await {
        Err(RpcError::Status(status)) => {
            assert_eq!(status.code(), Code::Unavailable, "{status:?}");
            assert!(status.message().contains("resize"), "{status:?}");
        }
        other => panic!("a receiving shard served a Fetch: {other:?}"),
    }

    // A cancel: the streams to the new shard end, its feed closes, and
    // the old shards stop keeping changes.
    c.coord.update_shard_map(ShardMap::cancel).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while feed_of(&c.new).await.is_some() || c.old.iter().any(|s| s.store.tracks_changes()) {
        assert!(
            Instant::now() < deadline,
            "the resize's streams never ended"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(map(&c.coord).await.num_shards, OLD);
    // Cancelled, the new server serves its shard again (nobody routes to
    // it: the operator stops it).
    let deadline = Instant::now() + Duration::from_secs(20);
    while fetch_new(&c.new, key).await.is_err() {
        assert!(Instant::now() < deadline, "still refusing after the cancel");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Planned again, with Pushes meanwhile: the new shard starts over
    // (copies) and is in step again.
    c.push_all().await;
    let again = c.coord.update_shard_map(|m| m.plan(NEW)).await.unwrap();
    c.push_until_ready(again.version).await;
    c.wait_equal().await;
    let Cluster { old, new, .. } = c;
    new.stop().await;
    for server in old {
        server.stop().await;
    }
}
