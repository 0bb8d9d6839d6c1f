//! Resizes interrupted in the states `tests/reshard.rs` and the drill do
//! not stop in (issue 39), in-process with etcd: a server of an old shard
//! restarted while the resize is only planned, and a growth whose new
//! primary stops after the cut-over, before it opened its shard (a fail
//! point, `reshard::open`, holds every opening until the test lifts it):
//! the new shard's replica leads, follows the old shards anew from their
//! fenced copies and opens; the resize is done, the moved rows bit for
//! bit the old primaries' at the fence. And a server of an old shard
//! restarted after a growth, its configuration saying the new count, from
//! a checkpoint saved under the old one: it loads it, drops the moved
//! rows and serves the staying ones as they were.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::Duration;

use bytes::Bytes;
use tessera_coord::ResizeState;
use tessera_proto::sharding::shard_for_key;
use tessera_proto::v1::{CheckpointRequest, FetchRequest, PushRequest};
use tessera_ps_server::TableConfig;
use tessera_ps_server::config::OptimizerConfig;
use tessera_test_support::wait::{Waiting, eventually};
use tessera_test_support::{
    Etcd, InProcess, keys_moved, resize_pair, resize_server, resize_servers, shard_map_now,
    wait_map, wait_serving, wire,
};

/// The fail point is process-wide: under a runner that runs a binary's
/// tests on threads (not nextest), one test at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const DIM: usize = 4;
const OLD: u32 = 2;
const NEW: u32 = 3;

fn table() -> TableConfig {
    TableConfig {
        optimizer: OptimizerConfig::adam(0.01),
        ..TableConfig::new("emb", DIM as u32)
    }
}

/// `config` with its checkpoints in `dir`.
fn with_checkpoints(
    config: tessera_ps_server::PsServerConfig,
    dir: &std::path::Path,
) -> tessera_ps_server::PsServerConfig {
    tessera_ps_server::PsServerConfig {
        checkpoint: tessera_ps_server::config::CheckpointConfig {
            dir: Some(dir.to_owned()),
            ..Default::default()
        },
        ..config
    }
}

fn keys_of(shard: u32) -> Vec<u64> {
    (0..600)
        .filter(|&k| shard_for_key(k, OLD) == shard)
        .collect()
}

fn moving(shard: u32) -> Vec<u64> {
    keys_of(shard)
        .into_iter()
        .filter(|&k| shard_for_key(k, NEW) == OLD)
        .collect()
}

fn push(step: u64, shard: u32) -> PushRequest {
    let keys = keys_of(shard);
    let grads: Vec<f32> = (0..keys.len() * DIM)
        .map(|i| ((i as u64 * 7 + step) % 9) as f32 - 4.0)
        .collect();
    PushRequest {
        num_shards: OLD,
        table: "emb".into(),
        shard,
        keys,
        gradients: Bytes::from(wire(&grads)),
        worker_id: 3,
        sequence: step,
    }
}

/// Values, optimizer state and update counts of `keys` of `shard`.
fn rows(server: &InProcess, shard: u32, keys: &[u64]) -> (Vec<u64>, Vec<u8>, Vec<u8>, Vec<u32>) {
    let r = server.store.read_rows("emb", shard, keys, true).unwrap();
    (r.keys, r.values, r.state, r.steps)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_growth_interrupted_while_planned_and_between_its_cut_over_and_opening_completes() {
    let _serial = SERIAL.lock().await;
    let etcd = Etcd::start();
    let cluster = "grow-states";
    let (mut old, coord) = resize_servers(&etcd, cluster, OLD, &table()).await;
    let mut step = 0;
    for _ in 0..3 {
        step += 1;
        for (shard, server) in old.iter().enumerate() {
            server.data.push(push(step, shard as u32)).await.unwrap();
        }
    }

    // Planned: old shard 0's server restarts (its rows come back from
    // nowhere: no checkpoint, no replica; only its keys' Pushes from now
    // on are compared), and the resize goes on once the new servers come.
    coord.update_shard_map(|m| m.plan(NEW)).await.unwrap();
    let config0 = tessera_ps_server::PsServerConfig {
        listen: old[0].addr.clone(),
        ..resize_server(&etcd, cluster, OLD, 0, &table())
    };
    old.remove(0).stop().await;
    old.insert(0, InProcess::start(&config0).await);
    wait_serving(&old[0].addr).await;
    assert_eq!(
        shard_map_now(&coord).await.active().map(|r| r.state),
        Some(ResizeState::Planned)
    );

    // No shard opens until the fail point is lifted.
    fail::cfg("reshard::open", "return").unwrap();
    let mut news = Vec::new();
    for config in resize_pair(&etcd, cluster, NEW, OLD, &table()) {
        news.push(InProcess::start(&config).await);
    }
    // Pushes until the cut-over; the fence refuses the moved keys then.
    let mut waiting = Waiting::new(Duration::from_secs(30), "the resize cuts over");
    loop {
        let m = shard_map_now(&coord).await;
        if m.active().is_some_and(|r| r.state == ResizeState::CutOver) {
            break;
        }
        step += 1;
        for (shard, server) in old.iter().enumerate() {
            match server.data.push(push(step, shard as u32)).await {
                Ok(_) => {}
                Err(err) if keys_moved(&err).is_some() => {}
                Err(err) => panic!("push: {err}"),
            }
        }
        waiting.tick(&m).await;
    }
    // Every old server fenced the moved keys: their rows are final.
    eventually(
        Duration::from_secs(10),
        "every old shard fences the moved keys",
        || async {
            if old
                .iter()
                .any(|s| s.store.moved(s.store.hosted()[0]).is_none())
            {
                Err("an old shard has not fenced")
            } else {
                Ok(())
            }
        },
    )
    .await;
    let frozen: Vec<_> = (0..OLD)
        .map(|shard| rows(&old[shard as usize], shard, &moving(shard)))
        .collect();
    // Held at the opening for a while: still cut over, nothing opened.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let m = shard_map_now(&coord).await;
    assert!(
        m.active()
            .is_some_and(|r| r.state == ResizeState::CutOver && r.opened.is_empty()),
        "{m:?}"
    );
    // The new primary stops before opening; its replica leads.
    let at = news
        .iter()
        .position(|s| s.replication.is_primary(OLD))
        .expect("the new shard has a primary");
    news.remove(at).stop().await;
    eventually(Duration::from_secs(30), "the replica leads", || async {
        if news[0].replication.is_primary(OLD) {
            Ok(())
        } else {
            Err("it is not primary")
        }
    })
    .await;
    fail::remove("reshard::open");
    wait_map(&coord, "done", |m| {
        m.resize
            .as_ref()
            .is_some_and(|r| r.state == ResizeState::Done)
    })
    .await;
    for (shard, want) in frozen.into_iter().enumerate() {
        assert_eq!(
            rows(&news[0], OLD, &moving(shard as u32)),
            want,
            "old shard {shard}'s moved rows"
        );
    }
    news[0]
        .data
        .fetch(FetchRequest {
            table: "emb".into(),
            shard: OLD,
            keys: moving(0),
        })
        .await
        .unwrap();
    for s in news.into_iter().chain(old) {
        s.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_shard_restarts_with_the_new_count_from_a_checkpoint_of_the_old_one() {
    let _serial = SERIAL.lock().await;
    let etcd = Etcd::start();
    let cluster = "grow-checkpoint";
    let dir = tempfile::tempdir().unwrap();
    let with_checkpoints = |config| with_checkpoints(config, dir.path());
    let mut old = vec![
        InProcess::start(&with_checkpoints(resize_server(
            &etcd,
            cluster,
            OLD,
            0,
            &table(),
        )))
        .await,
        InProcess::start(&resize_server(&etcd, cluster, OLD, 1, &table())).await,
    ];
    for s in &old {
        wait_serving(&s.addr).await;
    }
    for step in 1..=3 {
        for (shard, server) in old.iter().enumerate() {
            server.data.push(push(step, shard as u32)).await.unwrap();
        }
    }
    // Saved under 2 shards, before the growth.
    old[0].admin.checkpoint(CheckpointRequest {}).await.unwrap();
    let staying: Vec<u64> = keys_of(0)
        .into_iter()
        .filter(|&k| shard_for_key(k, NEW) == 0)
        .collect();
    let before = rows(&old[0], 0, &staying);
    let coord = tessera_coord::EtcdCoordinator::connect(&tessera_test_support::etcd_coordination(
        &etcd, cluster, 2000,
    ))
    .await
    .unwrap();
    coord.update_shard_map(|m| m.plan(NEW)).await.unwrap();
    let mut news = Vec::new();
    for config in resize_pair(&etcd, cluster, NEW, OLD, &table()) {
        news.push(InProcess::start(&config).await);
    }
    wait_map(&coord, "done", |m| {
        m.resize
            .as_ref()
            .is_some_and(|r| r.state == ResizeState::Done)
    })
    .await;
    // Restarted with the new count in its configuration.
    let config = tessera_ps_server::PsServerConfig {
        listen: old[0].addr.clone(),
        ..with_checkpoints(resize_server(&etcd, cluster, NEW, 0, &table()))
    };
    // A crash: no last checkpoint (a graceful stop saves one, under the
    // count it took); the latest one is from before the growth.
    old.remove(0).crash();
    let again = InProcess::start(&config).await;
    wait_serving(&again.addr).await;
    eventually(
        Duration::from_secs(20),
        "the restarted server takes the new count and drops the moved rows",
        || async {
            let shards = again.store.num_shards();
            if shards != NEW {
                return Err(format!("{shards} shards"));
            }
            match rows(&again, 0, &moving(0)).0.len() {
                0 => Ok(()),
                moved => Err(format!("{moved} moved rows")),
            }
        },
    )
    .await;
    assert_eq!(rows(&again, 0, &staying), before);
    again
        .data
        .fetch(FetchRequest {
            table: "emb".into(),
            shard: 0,
            keys: staying,
        })
        .await
        .unwrap();
    for s in news.into_iter().chain(old).chain([again]) {
        s.stop().await;
    }
}

/// A checkpoint saved under a count that the cluster's shard map does not
/// name (another cluster's, or etcd's data lost): the server refuses to
/// start rather than route by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_of_a_count_the_map_does_not_name_is_refused() {
    let _serial = SERIAL.lock().await;
    let etcd = Etcd::start();
    let dir = tempfile::tempdir().unwrap();
    let with_checkpoints = |config| with_checkpoints(config, dir.path());
    let first = InProcess::start(&with_checkpoints(resize_server(
        &etcd,
        "first",
        OLD,
        0,
        &table(),
    )))
    .await;
    wait_serving(&first.addr).await;
    first.data.push(push(1, 0)).await.unwrap();
    first.stop().await;
    // A fresh cluster of 3 shards: its map names 3 only.
    let err = InProcess::try_start(&with_checkpoints(resize_server(
        &etcd,
        "fresh",
        NEW,
        0,
        &table(),
    )))
    .await
    .map(|_| ())
    .unwrap_err();
    assert!(
        err.to_string().contains("saved with num_shards = 2")
            && err.to_string().contains("configured with 3"),
        "{err}"
    );
}
