//! Checkpoints through the server: the `Admin.Checkpoint` call saves, a
//! graceful stop saves, a
//! server started on the same directory comes back with the same rows, a
//! periodic checkpoint appears by itself, and a corrupt checkpoint stops
//! the server from starting with an error that names the file.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use tessera_proto::rows::put_f32s;
use tessera_proto::v1::{CheckpointRequest, FetchRequest, PushRequest, StatsRequest};
use tessera_ps_server::config::{CheckpointConfig, OptimizerConfig};
use tessera_ps_server::{PsError, PsServerConfig, TableConfig};
use tessera_test_support::InProcess;
use tessera_test_support::wait::eventually;

fn config(dir: &Path, interval_secs: u64) -> PsServerConfig {
    PsServerConfig {
        listen: "127.0.0.1:0".into(),
        tables: vec![TableConfig {
            optimizer: OptimizerConfig::adagrad(0.1),
            ..TableConfig::new("emb", 4)
        }],
        checkpoint: CheckpointConfig {
            dir: Some(dir.to_owned()),
            interval_secs,
            ..CheckpointConfig::default()
        },
        ..PsServerConfig::default()
    }
}

async fn start(config: &PsServerConfig) -> Result<InProcess, PsError> {
    InProcess::try_start(config).await
}

async fn rows(server: &InProcess, keys: &[u64]) -> Bytes {
    server
        .data
        .fetch(FetchRequest {
            table: "emb".into(),
            shard: 0,
            keys: keys.to_vec(),
        })
        .await
        .unwrap()
        .values
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_checkpoint_survives_a_restart_and_corruption_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), 0);
    let server = start(&config).await.unwrap();
    let keys: Vec<u64> = (0..100).collect();
    let mut grads = Vec::new();
    put_f32s(&mut grads, &vec![0.5; keys.len() * 4]);
    for sequence in 1..=3 {
        server
            .data
            .push(PushRequest {
                num_shards: 0,
                table: "emb".into(),
                shard: 0,
                keys: keys.clone(),
                gradients: Bytes::from(grads.clone()),
                worker_id: 42,
                sequence,
            })
            .await
            .unwrap();
    }
    let before = rows(&server, &keys).await;
    let saved = server.admin.checkpoint(CheckpointRequest {}).await.unwrap();
    assert_eq!(saved.rows, 100);
    let stats = server.admin.stats(StatsRequest {}).await.unwrap();
    assert_eq!(stats.shards.len(), 1);
    assert_eq!((stats.shards[0].rows, stats.shards[0].pushes), (100, 3));
    server.stop().await;

    // A new server on the same directory starts with the same rows (and
    // optimizer state: one more identical Push moves both alike).
    let restarted = start(&config).await.unwrap();
    assert_eq!(rows(&restarted, &keys).await, before);
    restarted.stop().await;

    // Corrupt the newest checkpoint (the one the graceful stop just wrote,
    // after the Admin call's): the server refuses to start.
    let latest = std::fs::read_to_string(dir.path().join("LATEST")).unwrap();
    let newest = dir.path().join(latest.trim());
    assert_ne!(newest, Path::new(&saved.path), "the stop saved a newer one");
    let file = newest.join("t0-s0.rows");
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&file, bytes).unwrap();
    let err = start(&config)
        .await
        .err()
        .expect("a corrupt checkpoint is refused");
    let text = err.to_string();
    assert!(
        text.contains("t0-s0.rows") && text.contains("corrupt"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn periodic_checkpoints_appear_while_serving() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&config(dir.path(), 1)).await.unwrap();
    rows(&server, &[1, 2, 3]).await;
    eventually(
        Duration::from_secs(10),
        "a periodic checkpoint (LATEST) appears",
        || async {
            if dir.path().join("LATEST").exists() {
                Ok(())
            } else {
                Err("no LATEST yet")
            }
        },
    )
    .await;
    server.stop().await;
}

/// A graceful stop writes a last checkpoint: a server restarted on the same
/// directory has every acknowledged Push, not the state of its last
/// periodic checkpoint. Before, shutdown saved nothing, so a restart of
/// every copy of a shard at once (a configuration rollout) rolled back up
/// to `interval_secs` of training.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_saves_a_last_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    // Periodic checkpoints far apart: only the stop can have saved.
    let config = config(dir.path(), 3600);
    let server = start(&config).await.unwrap();
    let keys: Vec<u64> = (0..50).collect();
    let mut grads = Vec::new();
    put_f32s(&mut grads, &vec![0.25; keys.len() * 4]);
    server
        .data
        .push(PushRequest {
            num_shards: 0,
            table: "emb".into(),
            shard: 0,
            keys: keys.clone(),
            gradients: Bytes::from(grads),
            worker_id: 7,
            sequence: 1,
        })
        .await
        .unwrap();
    let before = rows(&server, &keys).await;
    server.stop().await;
    let restarted = start(&config).await.unwrap();
    assert_eq!(
        rows(&restarted, &keys).await,
        before,
        "the pushed rows came back"
    );
    let stats = restarted.admin.stats(StatsRequest {}).await.unwrap();
    assert_eq!(stats.shards[0].rows, 50);
    restarted.stop().await;
}
