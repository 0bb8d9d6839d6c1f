//! Exactly-once Push under a retry storm: every Push's answer is lost twice
//! on its way back (a fault proxy resets the connection after the server
//! applied it), so the worker sends it three times; the server
//! applies it once. The final rows equal those of a control server that
//! received each Push once, bit for bit, with Adam (whose state would show
//! any second application).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use tessera_ps_server::config::OptimizerConfig;
use tessera_ps_server::{PsServerConfig, TableConfig};
use tessera_rpc::policy::{RetryBudgetConfig, RetryPolicyConfig};
use tessera_test_support::{FaultProxy, InProcess};
use tessera_worker::{PsClient, ServerEndpoint, WorkerConfig};

async fn server() -> InProcess {
    InProcess::start(&PsServerConfig {
        listen: "127.0.0.1:0".into(),
        tables: vec![TableConfig {
            optimizer: OptimizerConfig::adam(0.01),
            ..TableConfig::new("emb", 4)
        }],
        ..PsServerConfig::default()
    })
    .await
}

fn worker(addr: &str) -> PsClient {
    PsClient::new(&WorkerConfig {
        servers: vec![ServerEndpoint {
            address: addr.to_owned(),
            shards: vec![0],
            replica_group: 0,
        }],
        connect_timeout_ms: 2000,
        request_timeout_ms: 5000,
        call_timeout_ms: 20_000,
        // A storm on purpose: every lost answer is retried, the budget
        // never runs dry.
        retry: RetryPolicyConfig {
            max_attempts: 4,
            ..RetryPolicyConfig::default()
        },
        budget: RetryBudgetConfig {
            max_tokens: 1e9,
            reserve_per_sec: 1e9,
            ..RetryBudgetConfig::default()
        },
        ..WorkerConfig::default()
    })
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_push_sent_three_times_is_applied_once() {
    let (faulty, control_server) = (server().await, server().await);
    let proxy = FaultProxy::start(faulty.addr.clone()).await;
    let stormy = worker(&proxy.addr);
    let control = worker(&control_server.addr);
    let keys: Vec<u64> = (1..=16).collect();
    // Repeated keys within a Push are summed by the client first.
    let mut pushed_keys = keys.clone();
    pushed_keys.extend([3, 3, 9]);
    let pushes = 25;
    for step in 0..pushes {
        let grads: Vec<f32> = (0..pushed_keys.len() * 4)
            .map(|i| ((i * 7 + step * 3) % 11) as f32 - 5.0)
            .collect();
        proxy.lose_responses(2);
        stormy.push("emb", &pushed_keys, &grads, 4).await.unwrap();
        control.push("emb", &pushed_keys, &grads, 4).await.unwrap();
    }
    assert_eq!(
        proxy.lost(),
        2 * pushes as u64,
        "every push lost two answers"
    );
    let stormy_rows = stormy.fetch("emb", &keys).await.unwrap();
    let control_rows = control.fetch("emb", &keys).await.unwrap();
    let bits = |rows: &[f32]| rows.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(stormy_rows.values()),
        bits(control_rows.values()),
        "the retried pushes were applied exactly once"
    );
    faulty.stop().await;
    control_server.stop().await;
}
