//! A worker through resizes of the cluster's shard count (issue 39): a
//! trainer pushes and fetches without pause while 2 shards grow to 3,
//! then to 4 (the old shards' servers, configured with 2, take 3 when the
//! first growth is done, so the second can follow), then shrink back to
//! 3 (shard 3 gives its keys to the others, which serve their own keys
//! throughout). The worker follows the shard map in etcd and routes by
//! each new count once its resize's receiving shards serve; no call
//! fails. After each resize every key's update count at the shard that
//! owns it now is the number of Pushes the worker had acknowledged: none
//! lost, none applied twice across the cut-overs; and every copy of a
//! shard comes to hold its primary's rows.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::time::Duration;

use tessera_coord::ResizeState;
use tessera_proto::sharding::shard_for_key;
use tessera_ps_server::TableConfig;
use tessera_ps_server::config::OptimizerConfig;
use tessera_test_support::wait::{Waiting, eventually};
use tessera_test_support::{Etcd, InProcess, resize_pair, resize_servers};

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
    let (old, coord) = resize_servers(&etcd, cluster, OLD, &table()).await;
    // The worker knows only the old servers; etcd tells it the rest.
    let client = common::resize_client(&etcd, cluster, &old, 20_000);
    let keys: Vec<u64> = (0..KEYS).collect();
    let grads = vec![0.25f32; keys.len() * DIM];
    let mut acked = 0u64;
    let step = || async {
        client
            .push("emb", &keys, &grads, DIM)
            .await
            .unwrap_or_else(|err| panic!("push: {err}"));
        let rows = client
            .fetch("emb", &keys)
            .await
            .unwrap_or_else(|err| panic!("fetch: {err}"));
        assert_eq!(rows.len(), keys.len());
    };
    for _ in 0..5 {
        step().await;
        acked += 1;
    }

    // Servers by shard (each shard's servers; the primary is found
    // when counting).
    let mut servers: Vec<Vec<InProcess>> = old.into_iter().map(|s| vec![s]).collect();
    // 2 -> 3, then 3 -> 4 (the old shards' servers, configured with 2,
    // took 3 when the first growth was done), then back to 3.
    for to in [NEW, NEW + 1, NEW] {
        let from = coord.shard_map().await.unwrap().unwrap().0.num_shards;
        // The operator plans it; a growth's new shard's two servers start.
        coord.update_shard_map(|m| m.plan(to)).await.unwrap();
        if to > from {
            let mut pair = Vec::new();
            for config in resize_pair(&etcd, cluster, to, from, &table()) {
                pair.push(InProcess::start(&config).await);
            }
            servers.push(pair);
        }
        // Training goes on through the copy and the cut-over, until the
        // resize is done, the worker routes by the new count, and a
        // while after.
        // Each look takes a training step first: a loop, not a probe.
        let mut waiting = Waiting::new(
            Duration::from_secs(60),
            &format!("the resize to {to} done, and 10 steps routed by {to} shards"),
        );
        let mut after = 0;
        while after < 10 {
            step().await;
            acked += 1;
            let map = coord.shard_map().await.unwrap().unwrap().0;
            let done = map
                .resize
                .as_ref()
                .is_some_and(|r| r.to == to && r.state == ResizeState::Done);
            if done && client.num_shards() == to {
                after += 1;
            }
            waiting.tick(&map).await;
        }
        // Every key counted each acknowledged Push once, where it lives
        // now.
        for &key in &keys {
            let shard = shard_for_key(key, to);
            let owner = servers[shard as usize]
                .iter()
                .find(|s| s.replication.is_primary(shard))
                .expect("every shard has a primary");
            let steps = owner
                .store
                .read_rows("emb", shard, &[key], true)
                .unwrap()
                .steps;
            assert_eq!(steps, [acked as u32], "key {key} (shard {shard} of {to})");
        }
        // Every other copy of a shard comes to hold its primary's rows
        // (a receiving shard's replicas copy it after its opening).
        for shard in 0..to {
            let copies = &servers[shard as usize];
            let mine: Vec<u64> = keys
                .iter()
                .copied()
                .filter(|&k| shard_for_key(k, to) == shard)
                .collect();
            eventually(
                Duration::from_secs(30),
                &format!("every copy of shard {shard} holding its primary's rows"),
                || async {
                    let Some(primary) = copies.iter().find(|s| s.replication.is_primary(shard))
                    else {
                        panic!("shard {shard} has no primary");
                    };
                    let want = primary.store.read_rows("emb", shard, &mine, true).unwrap();
                    let differ = copies
                        .iter()
                        .filter(|c| {
                            !c.store
                                .read_rows("emb", shard, &mine, true)
                                .is_ok_and(|r| r.values == want.values && r.steps == want.steps)
                        })
                        .count();
                    if differ == 0 {
                        Ok(())
                    } else {
                        Err(format!("{differ} of {} copies differ", copies.len()))
                    }
                },
            )
            .await;
        }
    }
    drop(client);
    for s in servers.into_iter().flatten() {
        s.stop().await;
    }
}
