//! A checkpoint directory that fills up or stops being one (issue 33):
//! the save fails with an error that names the path and the cause,
//! serving and Pushes go on, Health says so (and `tessera status` with
//! it) until a save succeeds, and the next save retries. Real errors from
//! the kernel, without mounting anything: `LATEST.tmp` as a link to
//! `/dev/full` (ENOSPC when the save writes its pointer), and a plain file
//! where the directory was (a save cannot make its temporary directory).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::path::Path;

use bytes::Bytes;
use tessera_proto::rows::put_f32s;
use tessera_proto::v1::{CheckpointRequest, FetchRequest, HealthRequest, PushRequest};
use tessera_ps_server::config::{CheckpointConfig, OptimizerConfig};
use tessera_ps_server::{PsServerConfig, TableConfig};
use tessera_test_support::InProcess;

fn config(dir: &Path) -> PsServerConfig {
    PsServerConfig {
        listen: "127.0.0.1:0".into(),
        tables: vec![TableConfig {
            optimizer: OptimizerConfig::sgd(1.0),
            ..TableConfig::new("emb", 4)
        }],
        checkpoint: CheckpointConfig {
            dir: Some(dir.to_owned()),
            ..CheckpointConfig::default()
        },
        ..PsServerConfig::default()
    }
}

async fn push(server: &InProcess, sequence: u64) {
    let mut grads = Vec::new();
    put_f32s(&mut grads, &[1.0; 4 * 8]);
    server
        .data
        .push(PushRequest {
            num_shards: 0,
            table: "emb".into(),
            shard: 0,
            keys: (0..8).collect(),
            gradients: Bytes::from(grads),
            worker_id: 9,
            sequence,
        })
        .await
        .expect("Pushes go on whatever the disk does");
}

async fn fetches(server: &InProcess) {
    server
        .data
        .fetch(FetchRequest {
            table: "emb".into(),
            shard: 0,
            keys: (0..8).collect(),
        })
        .await
        .expect("Fetches go on whatever the disk does");
}

async fn checkpoint_health(server: &InProcess) -> tessera_proto::v1::CheckpointHealth {
    server
        .data
        .health(HealthRequest {})
        .await
        .unwrap()
        .checkpoint
        .expect("a server with checkpoint.dir reports its checkpoints")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_or_missing_checkpoint_directory_fails_the_save_loudly_and_nothing_else() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let server = InProcess::start(&config(&dir)).await;
    push(&server, 1).await;
    server.admin.checkpoint(CheckpointRequest {}).await.unwrap();
    let health = checkpoint_health(&server).await;
    assert!(health.last_success_unix_ms > 0, "{health:?}");
    assert!(health.last_error.is_empty());
    assert_eq!(health.consecutive_failures, 0);

    // The disk is full (a real ENOSPC from the kernel when the save
    // writes its pointer).
    let latest_tmp = dir.join("LATEST.tmp");
    std::os::unix::fs::symlink("/dev/full", &latest_tmp).unwrap();
    let latest_before = std::fs::read_to_string(dir.join("LATEST")).unwrap();
    for (sequence, failures) in [(2, 1), (3, 2)] {
        push(&server, sequence).await;
        let err = server
            .admin
            .checkpoint(CheckpointRequest {})
            .await
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("LATEST.tmp") && err.contains("No space left on device"),
            "the error names the path and the cause: {err}"
        );
        fetches(&server).await;
        let health = checkpoint_health(&server).await;
        assert_eq!(health.consecutive_failures, failures, "{health:?}");
        assert!(
            health.last_error.contains("LATEST.tmp")
                && health.last_error.contains("No space left on device"),
            "{health:?}"
        );
        assert!(health.last_failure_unix_ms >= health.last_success_unix_ms);
    }
    assert_eq!(
        std::fs::read_to_string(dir.join("LATEST")).unwrap(),
        latest_before,
        "a failed save leaves the last good checkpoint the latest"
    );
    // Space again: the next save succeeds and the failure is forgotten.
    std::fs::remove_file(&latest_tmp).unwrap();
    server.admin.checkpoint(CheckpointRequest {}).await.unwrap();
    let health = checkpoint_health(&server).await;
    assert!(health.last_error.is_empty(), "{health:?}");
    assert_eq!(health.consecutive_failures, 0);

    // The directory is gone and a file stands in its place (an unmounted
    // volume, an operator's mistake): the save cannot make its files.
    let away = tmp.path().join("ckpt-away");
    std::fs::rename(&dir, &away).unwrap();
    std::fs::write(&dir, b"not a directory").unwrap();
    push(&server, 4).await;
    let err = server
        .admin
        .checkpoint(CheckpointRequest {})
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&*dir.to_string_lossy()) && err.contains("os error"),
        "the error names the path and the cause: {err}"
    );
    fetches(&server).await;
    assert_eq!(checkpoint_health(&server).await.consecutive_failures, 1);
    // Put back: the next save retries and succeeds.
    std::fs::remove_file(&dir).unwrap();
    std::fs::rename(&away, &dir).unwrap();
    let saved = server.admin.checkpoint(CheckpointRequest {}).await.unwrap();
    assert_eq!(saved.rows, 8);
    let health = checkpoint_health(&server).await;
    assert!(health.last_error.is_empty() && health.consecutive_failures == 0);
    assert_eq!(health.last_success_path, saved.path);
    server.stop().await;
}
