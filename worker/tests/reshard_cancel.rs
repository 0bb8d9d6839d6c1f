//! A worker through a resize that cannot finish (issue 57, hole 3): 2
//! shards grow to 3, and after the cut-over shard 1's server stops
//! looking at the shard map (a fail point naming it), so it never fences
//! and the new shard never opens. A Push that ran into shard 0's fence
//! waits; the operator cancels the resize; the Push goes again split by
//! the old count and is applied once, without waiting out its timeout,
//! even when shard 0's server sees the cancel after the worker does.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_coord::{ResizeState, ShardMap};
use tessera_proto::sharding::shard_for_key;
use tessera_ps_server::TableConfig;
use tessera_ps_server::config::OptimizerConfig;
use tessera_test_support::wait::{Waiting, eventually};
use tessera_test_support::{Etcd, InProcess, resize_server, resize_servers, shard_map_now};

const DIM: usize = 4;

fn table() -> TableConfig {
    TableConfig {
        optimizer: OptimizerConfig::adam(0.01),
        ..TableConfig::new("emb", DIM as u32)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_held_by_a_stuck_resize_completes_once_it_is_cancelled() {
    let etcd = Etcd::start();
    let cluster = "grow-cancelled";
    let (old, coord) = resize_servers(&etcd, cluster, 2, &table()).await;
    let client = Arc::new(common::resize_client(&etcd, cluster, &old, 30_000));
    let keys: Vec<u64> = (0..400).collect();
    let grads = vec![0.25f32; keys.len() * DIM];
    let mut acked = 0u32;
    for _ in 0..3 {
        client.push("emb", &keys, &grads, DIM).await.unwrap();
        acked += 1;
    }
    coord.update_shard_map(|m| m.plan_held(3)).await.unwrap();
    let new = InProcess::start(&resize_server(&etcd, cluster, 3, 2, &table())).await;
    // Each look pushes first: a loop, not a probe.
    let mut waiting = Waiting::new(Duration::from_secs(30), "the new shard ready");
    loop {
        client.push("emb", &keys, &grads, DIM).await.unwrap();
        acked += 1;
        let m = shard_map_now(&coord).await;
        if m.active().is_some_and(|r| r.ready == [2]) {
            break;
        }
        waiting.tick(&m).await;
    }
    fail::cfg("reshard::step", &format!("return({})", old[1].addr)).unwrap();
    coord.update_shard_map(ShardMap::release).await.unwrap();
    eventually(Duration::from_secs(30), "shard 0 fenced", || async {
        if old[0].store.moved(0).is_some() {
            Ok(())
        } else {
            Err("shard 0 not moved yet")
        }
    })
    .await;
    assert_eq!(
        shard_map_now(&coord).await.active().map(|r| r.state),
        Some(ResizeState::CutOver)
    );
    // Held at shard 0's fence: it cannot finish while the resize is
    // stuck.
    let pushing = {
        let (client, keys, grads) = (Arc::clone(&client), keys.clone(), grads.clone());
        tokio::spawn(async move { client.push("emb", &keys, &grads, DIM).await })
    };
    eventually(
        Duration::from_secs(10),
        "the Push is held at shard 0's fence",
        || async {
            match (client.calls_held_at_fences(), pushing.is_finished()) {
                (0, false) => Err("not held yet"),
                (_, true) => panic!("a Push went through a stuck resize"),
                (_, false) => Ok(()),
            }
        },
    )
    .await;
    // Shard 0's server lags behind the cancel (its looks stall too): the
    // worker sees the fence lifted before the server does, and its Push
    // goes again after a pause rather than fail at a fence the map has
    // lifted (CI, stop 64: three tries spent in a millisecond).
    fail::cfg(
        "reshard::step",
        &format!("return({},{})", old[1].addr, old[0].addr),
    )
    .unwrap();
    let cancelled_at = Instant::now();
    coord.update_shard_map(ShardMap::cancel).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert!(
        !pushing.is_finished(),
        "a Push gave up at a fence its map had lifted"
    );
    fail::cfg("reshard::step", &format!("return({})", old[1].addr)).unwrap();
    let outcome = tokio::time::timeout(Duration::from_secs(15), pushing)
        .await
        .expect("the Push waited on after the cancel")
        .unwrap();
    outcome.unwrap_or_else(|err| panic!("push: {err}"));
    acked += 1;
    assert!(cancelled_at.elapsed() < Duration::from_secs(15));
    fail::remove("reshard::step");
    client.push("emb", &keys, &grads, DIM).await.unwrap();
    acked += 1;
    assert_eq!(client.num_shards(), 2);
    for &key in &keys {
        let shard = shard_for_key(key, 2);
        let steps = old[shard as usize]
            .store
            .read_rows("emb", shard, &[key], true)
            .unwrap()
            .steps;
        assert_eq!(steps, [acked], "key {key} (shard {shard})");
    }
    new.stop().await;
    for s in old {
        s.stop().await;
    }
}
