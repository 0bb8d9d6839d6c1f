//! Long holds of a shard's write lock (a snapshot, a copy being
//! installed) must not stop the server: Pushes waiting for the lock wait
//! as tasks, and Fetch and Health go on.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use tessera_proto::rows::put_f32s;
use tessera_proto::v1::{FetchRequest, HealthRequest, PushRequest};
use tessera_ps_server::PsServerConfig;
use tessera_test_support::wait::eventually;
use tessera_test_support::{InProcess, keys_of_shard};

/// The server runs on this test's runtime (two threads). With the lock of
/// shard 0 held by another thread, eight Pushes to shard 0 wait; a Fetch
/// of shard 0 and a Health call must still be answered before the lock
/// is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_waiting_for_a_held_shard_lock_do_not_stop_fetches() {
    let server = InProcess::start(&PsServerConfig {
        listen: "127.0.0.1:0".into(),
        ..PsServerConfig::default()
    })
    .await;
    let keys = keys_of_shard(0, 1, 4);
    let dim = server.store.row_bytes("embeddings").unwrap() / 4;
    let mut gradients = Vec::new();
    put_f32s(&mut gradients, &vec![0.5; keys.len() * dim]);
    let gradients = Bytes::from(gradients);
    // Connected first.
    server.data.health(HealthRequest {}).await.unwrap();

    let held = Arc::new(AtomicBool::new(true));
    let (locked_tx, locked_rx) = std::sync::mpsc::channel();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let holder = std::thread::spawn({
        let (store, held) = (Arc::clone(&server.store), Arc::clone(&held));
        move || {
            let guard = store.lock_shard(0).unwrap();
            locked_tx.send(()).unwrap();
            // Released when the test says so, or after 20 s at most (the
            // test then fails rather than hangs).
            let _ = release_rx.recv_timeout(Duration::from_secs(20));
            held.store(false, Ordering::SeqCst);
            drop(guard);
        }
    });
    locked_rx.recv().unwrap();

    let pushes: Vec<_> = (0..8)
        .map(|i| {
            let data = server.data.clone();
            let request = PushRequest {
                num_shards: 0,
                table: "embeddings".into(),
                shard: 0,
                keys: keys.clone(),
                gradients: gradients.clone(),
                worker_id: 7,
                sequence: i + 1,
            };
            tokio::spawn(async move { data.push(request).await })
        })
        .collect();
    // Every Push waits for the lock before the Fetch is sent.
    eventually(
        Duration::from_secs(10),
        "8 Pushes wait for the lock as tasks",
        || async {
            match server.store.waiting_for_lock(0) {
                waiting if waiting >= 8 => Ok(()),
                waiting => Err(format!("{waiting} wait")),
            }
        },
    )
    .await;
    let fetched = server
        .data
        .fetch(FetchRequest {
            table: "embeddings".into(),
            shard: 0,
            keys: keys.clone(),
        })
        .await
        .unwrap();
    assert_eq!(fetched.values.len(), keys.len() * dim * 4);
    server.data.health(HealthRequest {}).await.unwrap();
    assert!(
        held.load(Ordering::SeqCst),
        "Fetch and Health were answered only after the lock was released"
    );
    release_tx.send(()).unwrap();
    holder.join().unwrap();
    for push in pushes {
        assert!(!push.await.unwrap().unwrap().duplicate);
    }
    server.stop().await;
}
