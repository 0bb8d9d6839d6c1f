//! The Rust guide's example (`worker/examples/train.rs`, shown whole in
//! `docs/src/guides/rust-client.md`) runs against a 2 x 2 cluster as a
//! user runs it: a process given a `worker.toml`.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::process::Command;

use tessera_ps_server::config::{Initializer, OptimizerConfig};
use tessera_ps_server::{PsServerConfig, TableConfig};
use tessera_rpc::TransportKind;
use tessera_test_support::InProcessCluster;
use tessera_test_support::process::example_bin;
use tessera_worker::{PsClient, WorkerConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rust_guides_training_loop_runs_and_applies_each_push_once() {
    let base = PsServerConfig {
        transport: TransportKind::Tcp,
        tables: vec![TableConfig {
            optimizer: OptimizerConfig::sgd(0.5),
            initializer: Initializer::Uniform { scale: 0.01 },
            ..TableConfig::new("embeddings", 16)
        }],
        ..PsServerConfig::default()
    };
    let servers = InProcessCluster::start(2, 2, &base).await;
    let config = WorkerConfig {
        num_shards: 2,
        servers: common::endpoints(&servers),
        // Generous timeouts: this 2-core host runs many tests at once.
        connect_timeout_ms: 2000,
        request_timeout_ms: 5000,
        call_timeout_ms: 10_000,
        ..WorkerConfig::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let config_path = dir.path().join("worker.toml");
    std::fs::write(&config_path, toml::to_string(&config).unwrap()).unwrap();

    let output = tokio::task::spawn_blocking(move || {
        Command::new(example_bin("tessera-worker", "train"))
            .arg(&config_path)
            .arg("20")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "the example failed: {}\n{stdout}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.starts_with("20 steps; row 0 starts ["), "{stdout}");

    // Key 0 is in the first step's batch only: one SGD step at rate 0.5
    // towards 0.1 takes a value v in [-0.01, 0.01] to 0.5 v + 0.05. Two
    // (a Push applied twice) would give 0.0725 to 0.0775.
    let client = PsClient::new(&config).unwrap();
    let rows = client.fetch("embeddings", &[0]).await.unwrap();
    for &value in rows.row(0) {
        assert!((0.0449..=0.0551).contains(&value), "{:?}", rows.row(0));
    }
    servers.stop().await;
}
