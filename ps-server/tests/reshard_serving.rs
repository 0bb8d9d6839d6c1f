//! A serving fleet through a growth of the training fleet (issue 57, hole
//! 4), in-process with etcd: 2 training shards grow to 3 while a serving
//! server follows every training shard's delta stream. Old shard 0 is
//! held after its fence (its resize follower stalled by a fail point: it
//! keeps the moved rows, as a slow old server does until it drops them),
//! the new shard takes Pushes of the moved keys, and old shard 0 evicts
//! moved rows of a row-limited table. The serving fleet must hold, for
//! every key, its owner's row: the new shard's for the moved keys (not
//! the old shard's frozen one, not removed by the old shard's eviction),
//! through a restart that copies every training shard.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use tessera_coord::{EtcdCoordinator, ResizeState, ShardMap};
use tessera_proto::sharding::shard_for_key;
use tessera_proto::v1::{HealthRequest, PushRequest};
use tessera_ps_server::config::{DeltaConfig, OptimizerConfig, ServingServer};
use tessera_ps_server::{Mode, PsServerConfig, TableConfig};
use tessera_test_support::wait::{Waiting, eventually};
use tessera_test_support::{
    Etcd, InProcess, etcd_coordination, free_addr, resize_server, shard_map_now, wait_map,
    wait_serving, wire,
};

const FROM: u32 = 2;
const TO: u32 = 3;
const KEYS: u64 = 600;
/// The row limit of the small table on each training shard.
const SMALL_ROWS: u64 = 64;

fn tables(limited: bool) -> Vec<TableConfig> {
    vec![
        TableConfig {
            optimizer: OptimizerConfig::sgd(0.1),
            ..TableConfig::new("emb", 8)
        },
        TableConfig {
            optimizer: OptimizerConfig::sgd(0.1),
            max_rows: limited.then_some(SMALL_ROWS),
            ..TableConfig::new("small", 4)
        },
    ]
}

fn training(
    etcd: &Etcd,
    cluster: &str,
    num_shards: u32,
    shard: u32,
    serving: &str,
) -> PsServerConfig {
    PsServerConfig {
        delta: DeltaConfig {
            num_shards: 1,
            servers: vec![ServingServer {
                address: serving.to_owned(),
                shards: vec![0],
            }],
            interval_ms: 50,
            ..DeltaConfig::default()
        },
        tables: tables(true),
        ..resize_server(etcd, cluster, num_shards, shard, &tables(true)[0])
    }
}

fn serving(address: &str) -> PsServerConfig {
    PsServerConfig {
        listen: address.to_owned(),
        mode: Mode::Serving,
        num_shards: 1,
        shards: vec![0],
        // Its one shard holds every training shard's rows: no limit of
        // its own (the training fleet's evictions reach it as removals).
        tables: tables(false),
        ..PsServerConfig::default()
    }
}

async fn push(
    server: &InProcess,
    table: &str,
    dim: usize,
    shard: u32,
    split_by: u32,
    keys: Vec<u64>,
    round: u32,
) {
    let grads: Vec<f32> = (0..keys.len() * dim)
        .map(|i| ((i as u32 + round) % 7) as f32 - 3.0)
        .collect();
    server
        .data
        .push(PushRequest {
            num_shards: split_by,
            table: table.into(),
            shard,
            keys,
            gradients: Bytes::from(wire(&grads)),
            ..PushRequest::default()
        })
        .await
        .unwrap();
}

/// One round of Pushes to every key of the old shards (split by the old
/// count), and to 40 keys of each one's small table.
async fn push_old(old: &[InProcess], round: u32) {
    for (shard, server) in old.iter().enumerate() {
        let shard = shard as u32;
        push(server, "emb", 8, shard, FROM, keys_of(shard, FROM), round).await;
        let small: Vec<u64> = keys_of(shard, FROM)
            .into_iter()
            .skip(round as usize * 13 % 100)
            .take(40)
            .collect();
        push(server, "small", 4, shard, FROM, small, round).await;
    }
}

fn keys_of(shard: u32, num_shards: u32) -> Vec<u64> {
    (0..KEYS)
        .filter(|&k| shard_for_key(k, num_shards) == shard)
        .collect()
}

/// Key -> value bytes of the rows `server` holds of `keys` in `table`'s
/// `shard`.
fn rows(server: &InProcess, table: &str, shard: u32, keys: &[u64]) -> BTreeMap<u64, Vec<u8>> {
    let r = server.store.read_rows(table, shard, keys, false).unwrap();
    let width = if r.keys.is_empty() {
        0
    } else {
        r.values.len() / r.keys.len()
    };
    r.keys
        .iter()
        .enumerate()
        .map(|(i, &k)| (k, r.values[i * width..(i + 1) * width].to_vec()))
        .collect()
}

/// Waits until the serving server holds, for every key of both tables,
/// exactly its owner's row (`owners[s]`: training shard `s` of
/// `num_shards`).
async fn wait_matches(serving: &InProcess, owners: &[&InProcess], num_shards: u32, what: &str) {
    let all: Vec<u64> = (0..KEYS).collect();
    eventually(
        Duration::from_secs(40),
        &format!("{what}: the serving fleet holds the owners' rows"),
        || async {
            let mut diff = String::new();
            for table in ["emb", "small"] {
                let mut want = BTreeMap::new();
                for (s, owner) in owners.iter().enumerate() {
                    want.extend(rows(owner, table, s as u32, &keys_of(s as u32, num_shards)));
                }
                let got = rows(serving, table, 0, &all);
                if got != want {
                    let missing = want.keys().filter(|k| !got.contains_key(k)).count();
                    let extra = got.keys().filter(|k| !want.contains_key(k)).count();
                    let differ = want
                        .iter()
                        .filter(|(k, v)| got.get(k).is_some_and(|g| g != *v))
                        .count();
                    diff += &format!(
                        "{table}: {missing} rows missing, {extra} extra, {differ} differ; "
                    );
                }
            }
            if diff.is_empty() { Ok(()) } else { Err(diff) }
        },
    )
    .await;
}

/// Copies the serving server took of training shard `source`.
async fn copies_of(serving: &InProcess, source: u32) -> u64 {
    let health = serving.data.health(HealthRequest {}).await.unwrap();
    health.serving_feed.map_or(0, |f| {
        f.sources
            .iter()
            .filter(|s| s.source_shard == source)
            .map(|s| s.copies)
            .sum()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_serving_fleet_holds_each_keys_owner_row_through_a_growth() {
    let etcd = Etcd::start();
    let cluster = "grow-serving";
    let serving_addr = free_addr();
    let mut serving_server = InProcess::start(&serving(&serving_addr)).await;
    let mut old = Vec::new();
    for shard in 0..FROM {
        old.push(InProcess::start(&training(&etcd, cluster, FROM, shard, &serving_addr)).await);
    }
    for s in old.iter().chain([&serving_server]) {
        wait_serving(&s.addr).await;
    }
    let coord = EtcdCoordinator::connect(&etcd_coordination(&etcd, cluster, 2000))
        .await
        .unwrap();
    let mut round = 0;
    for _ in 0..3 {
        round += 1;
        push_old(&old, round).await;
    }
    wait_matches(
        &serving_server,
        &[&old[0], &old[1]],
        FROM,
        "before the resize",
    )
    .await;

    // The growth, with the new shard streaming to the serving fleet too.
    coord.update_shard_map(|m| m.plan_held(TO)).await.unwrap();
    let new = InProcess::start(&training(&etcd, cluster, TO, 2, &serving_addr)).await;
    let mut waiting = Waiting::new(Duration::from_secs(30), "the new shard is reported ready");
    loop {
        round += 1;
        push_old(&old, round).await;
        let m = shard_map_now(&coord).await;
        if m.active().is_some_and(|r| r.ready == [2]) {
            break;
        }
        waiting.tick(&m).await;
    }
    coord.update_shard_map(ShardMap::release).await.unwrap();
    eventually(Duration::from_secs(30), "shard 0 fences", || async {
        if old[0].store.moved(0).is_some() {
            Ok(())
        } else {
            Err("not fenced")
        }
    })
    .await;
    // Old shard 0 looks no more: it keeps its moved rows.
    fail::cfg("reshard::step", &format!("return({})", old[0].addr)).unwrap();
    wait_map(&coord, "done", |m| {
        m.resize
            .as_ref()
            .is_some_and(|r| r.state == ResizeState::Done)
    })
    .await;
    let moved: Vec<u64> = keys_of(0, FROM)
        .into_iter()
        .filter(|&k| shard_for_key(k, TO) == 2)
        .collect();
    assert!(
        !rows(&old[0], "emb", 0, &moved).is_empty(),
        "shard 0 dropped its moved rows while stalled"
    );
    // The new shard takes the moved keys' Pushes; old shard 0 evicts its
    // small table's rows, moved ones among them.
    for _ in 0..3 {
        round += 1;
        push(&new, "emb", 8, 2, TO, keys_of(2, TO), round).await;
        let small: Vec<u64> = keys_of(2, TO).into_iter().take(40).collect();
        push(&new, "small", 4, 2, TO, small, round).await;
    }
    let fresh: Vec<u64> = (KEYS..KEYS * 4)
        .filter(|&k| shard_for_key(k, TO) == 0)
        .take(SMALL_ROWS as usize * 2)
        .collect();
    // Old shard 0 has not seen the resize finish: it takes Pushes split
    // by the old count (of keys that stay); old shard 1 took the new one.
    round += 1;
    push(&old[0], "small", 4, 0, FROM, fresh, round).await;
    push(&old[0], "emb", 8, 0, FROM, keys_of(0, TO), round).await;
    push(&old[1], "emb", 8, 1, TO, keys_of(1, TO), round).await;
    let owners = [&old[0], &old[1], &new];
    wait_matches(
        &serving_server,
        &owners,
        TO,
        "after the growth, shard 0 evicting moved rows",
    )
    .await;

    // A restarted serving server copies every training shard, old shard 0
    // (still holding the frozen moved rows) included.
    // (Stopped, not crashed: its address is free again once it returns.)
    serving_server.stop().await;
    serving_server = InProcess::start(&serving(&serving_addr)).await;
    wait_serving(&serving_server.addr).await;
    wait_matches(&serving_server, &owners, TO, "after a serving restart").await;
    // Old shard 0's stream starts anew: the serving server copies it alone,
    // after the new shard's rows arrived.
    let before = copies_of(&serving_server, 0).await;
    old[0].store.restart_streams();
    let mut waiting = Waiting::new(
        Duration::from_secs(30),
        "the serving server copies old shard 0 again",
    );
    loop {
        let copies = copies_of(&serving_server, 0).await;
        if copies != before {
            break;
        }
        round += 1;
        push(&old[0], "emb", 8, 0, FROM, keys_of(0, TO), round).await;
        waiting
            .tick(format!("{copies} copies of old shard 0, as before"))
            .await;
    }
    wait_matches(
        &serving_server,
        &owners,
        TO,
        "after a copy of old shard 0 alone",
    )
    .await;

    fail::remove("reshard::step");
    eventually(
        Duration::from_secs(30),
        "shard 0 drops its moved rows",
        || async {
            match rows(&old[0], "emb", 0, &moved).len() {
                0 => Ok(()),
                held => Err(format!("{held} moved rows held")),
            }
        },
    )
    .await;
    wait_matches(
        &serving_server,
        &owners,
        TO,
        "once shard 0 dropped its moved rows",
    )
    .await;
    new.stop().await;
    for s in old {
        s.stop().await;
    }
    serving_server.stop().await;
}
