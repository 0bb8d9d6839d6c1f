//! A worker through a resize of the cluster's shard count (issue 39):
//! a trainer pushes and fetches without pause while 2 shards grow to 3;
//! the worker follows the shard map in etcd, routes by 3 shards once the
//! resize cuts over, and no call fails. At the end every key's update
//! count at the shard that owns it now is the number of Pushes the worker
//! had acknowledged: none lost, none applied twice across the cut-over.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::{Duration, Instant};

use tessera_coord::{EtcdCoordinator, ResizeState};
use tessera_proto::sharding::shard_for_key;
use tessera_ps_server::TableConfig;
use tessera_ps_server::config::OptimizerConfig;
use tessera_test_support::{
    Etcd, InProcess, etcd_coordination, resize_pair, resize_server, wait_serving,
};
use tessera_worker::{PsClient, ServerEndpoint, WorkerConfig};

const DIM: usize = 4;
const OLD: u32 = 2;
const NEW: u32 = 3;
const KEYS: u64 = 600;

fn table() -> TableConfig {
    TableConfig {
        optimizer: OptimizerConfig::adam(0.01),
        ..TableConfig::new("emb", DIM as u32)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trainer_goes_on_through_a_resize_and_every_push_counts_once() {
    let etcd = Etcd::start();
    let cluster = "grow-worker";
    let mut old = Vec::new();
    for shard in 0..OLD {
        old.push(InProcess::start(&resize_server(&etcd, cluster, OLD, shard, &table())).await);
    }
    for s in &old {
        wait_serving(&s.addr).await;
    }
    let coord = EtcdCoordinator::connect(&etcd_coordination(&etcd, cluster, 2000))
        .await
        .unwrap();
    // The worker knows only the old servers; etcd tells it the rest.
    let client = PsClient::new(&WorkerConfig {
        num_shards: OLD,
        servers: old
            .iter()
            .enumerate()
            .map(|(shard, s)| ServerEndpoint {
                address: s.addr.clone(),
                shards: vec![shard as u32],
                replica_group: 0,
            })
            .collect(),
        coordinator: etcd_coordination(&etcd, cluster, 2000),
        connect_timeout_ms: 2000,
        request_timeout_ms: 5000,
        call_timeout_ms: 10_000,
        push_timeout_ms: 20_000,
        ..WorkerConfig::default()
    })
    .unwrap();
    let keys: Vec<u64> = (0..KEYS).collect();
    let grads = vec![0.25f32; keys.len() * DIM];
    let mut acked = 0u64;
    let step = || async {
        client.push("emb", &keys, &grads, DIM).await.unwrap();
        let rows = client.fetch("emb", &keys).await.unwrap();
        assert_eq!(rows.len(), keys.len());
    };
    for _ in 0..5 {
        step().await;
        acked += 1;
    }

    // The operator plans 3 shards; the new shard's two servers start.
    coord.update_shard_map(|m| m.plan(NEW)).await.unwrap();
    let mut news = Vec::new();
    for config in resize_pair(&etcd, cluster, NEW, OLD, &table()) {
        news.push(InProcess::start(&config).await);
    }
    // Training goes on through the copy and the cut-over, until the
    // worker routes by 3 shards and the new shard serves, and a while
    // after.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut after = 0;
    while after < 10 {
        assert!(
            Instant::now() < deadline,
            "never cut over: {:?}",
            coord.shard_map().await
        );
        step().await;
        acked += 1;
        let map = coord.shard_map().await.unwrap().unwrap().0;
        let opened = map.resize.as_ref().is_some_and(|r| {
            matches!(r.state, ResizeState::CutOver | ResizeState::Done)
                && r.opened.keys().eq([&OLD])
        });
        if opened && client.num_shards() == NEW {
            after += 1;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Every key counted each acknowledged Push once, where it lives now.
    let primary = news
        .iter()
        .find(|s| s.replication.is_primary(OLD))
        .expect("the new shard has a primary");
    for &key in &keys {
        let shard = shard_for_key(key, NEW);
        let owner = if shard == OLD {
            primary
        } else {
            &old[shard as usize]
        };
        let steps = owner
            .store
            .read_rows("emb", shard, &[key], true)
            .unwrap()
            .steps;
        assert_eq!(steps, [acked as u32], "key {key} (shard {shard} of {NEW})");
    }
    drop(client);
    for s in news.into_iter().chain(old) {
        s.stop().await;
    }
}
