//! Growing a cluster's shard count (issue 39), in-process with etcd, as
//! far as it is built: an operator plans 1 -> 2 shards; the server of the
//! new shard moves the resize to copying; the old shard's primary streams
//! it the moving rows (whole: optimizer state and update counts) while
//! Pushes go on; the new shard reports ready, and its rows are the old
//! primary's, bit for bit, once the Pushes stop. A cancel stops the
//! stream and closes the new server's feed.
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
use tessera_proto::v1::{HealthRequest, PushRequest};
use tessera_ps_server::config::{DeltaConfig, OptimizerConfig};
use tessera_ps_server::{PsServerConfig, TableConfig};
use tessera_test_support::{Etcd, InProcess, etcd_coordination, free_addr, wait_serving, wire};

const DIM: usize = 8;

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
            ..TableConfig::new("emb", DIM as u32)
        }],
        ..PsServerConfig::default()
    }
}

fn push(step: u64, keys: &[u64]) -> PushRequest {
    let grads: Vec<f32> = (0..keys.len() * DIM)
        .map(|i| ((i as u64 * 13 + step * 7) % 17) as f32 - 8.0)
        .collect();
    PushRequest {
        table: "emb".into(),
        shard: 0,
        keys: keys.to_vec(),
        gradients: Bytes::from(wire(&grads)),
        worker_id: 11,
        sequence: step,
    }
}

async fn map(coord: &EtcdCoordinator) -> ShardMap {
    coord.shard_map().await.unwrap().unwrap().0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_shard_copies_and_follows_its_moving_rows_until_ready() {
    let etcd = Etcd::start();
    let cluster = "grow";
    let old = InProcess::start(&server(&etcd, cluster, 1, 0)).await;
    wait_serving(&old.addr).await;
    let coord = EtcdCoordinator::connect(&etcd_coordination(&etcd, cluster, 2000))
        .await
        .unwrap();
    let keys: Vec<u64> = (0..400).collect();
    let moving: Vec<u64> = keys
        .iter()
        .copied()
        .filter(|&k| shard_for_key(k, 2) == 1)
        .collect();
    assert!(moving.len() > 100 && moving.len() < 300, "about half move");
    let mut step = 0u64;
    for _ in 0..5 {
        step += 1;
        old.data.push(push(step, &keys)).await.unwrap();
    }

    // The operator plans 2 shards; the new shard's server starts.
    coord.update_shard_map(|m| m.plan(2)).await.unwrap();
    let new = InProcess::start(&server(&etcd, cluster, 2, 1)).await;
    wait_serving(&new.addr).await;

    // Pushes go on at the old shard while the new one copies and follows,
    // until the new shard reports ready.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        step += 1;
        old.data.push(push(step, &keys)).await.unwrap();
        let m = map(&coord).await;
        let resize = m.resize.clone().unwrap();
        if resize.state == ResizeState::Copying && resize.ready == [1] {
            break;
        }
        assert!(Instant::now() < deadline, "never ready: {m:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        map(&coord).await.num_shards,
        1,
        "routing changes only at the cut-over"
    );

    // Pushes stop: the new shard's moving rows become the old primary's,
    // whole (values, Adam's moments, update counts), bit for bit.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let want = old.store.read_rows("emb", 0, &moving, true).unwrap();
        let got = new.store.read_rows("emb", 1, &moving, true).unwrap();
        if got == want {
            assert!(got.removed.is_empty());
            assert!(
                got.steps.iter().all(|&s| s == step as u32),
                "every Push counted"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the new shard's rows never caught up: {} of {} rows held",
            got.keys.len(),
            moving.len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let streams = old
        .data
        .health(HealthRequest {})
        .await
        .unwrap()
        .delta_streams;
    assert!(
        streams.len() == 1 && streams[0].rows_sent > 0,
        "{streams:?}"
    );
    let feed = new
        .data
        .health(HealthRequest {})
        .await
        .unwrap()
        .serving_feed
        .expect("a receiving server reports its feed");
    assert_eq!(feed.source_shards, 1);
    assert!(feed.sources[0].copies >= 1, "{feed:?}");

    // A cancel: the stream to the new shard ends, its feed closes, and
    // the old shard stops keeping changes.
    coord.update_shard_map(ShardMap::cancel).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while new
        .data
        .health(HealthRequest {})
        .await
        .unwrap()
        .serving_feed
        .is_some()
        || old.store.tracks_changes()
    {
        assert!(Instant::now() < deadline, "the resize's stream never ended");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(map(&coord).await.num_shards, 1);
    new.stop().await;
    old.stop().await;
}
