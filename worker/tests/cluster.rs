//! The worker client against an in-process cluster of 2 shards x 2 replica
//! groups.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::sync::Arc;

use tessera_proto::sharding::shard_for_key;
use tessera_proto::v1::{FetchRequest, ParameterServerClient};
use tessera_ps_server::config::{Initializer, OptimizerConfig};
use tessera_ps_server::{PsServerConfig, TableConfig};
use tessera_rpc::{Channel, RdmaConfig, TransportKind};
use tessera_test_support::wait::eventually;
use tessera_test_support::{InProcess, InProcessCluster, f32s};
use tessera_worker::workload::{self, WorkloadKind};
use tessera_worker::{PsClient, ServerEndpoint, WorkerConfig, WorkerError, WorkloadConfig};
use tokio::sync::oneshot;

struct Cluster {
    config: WorkerConfig,
    servers: InProcessCluster,
}

async fn cluster() -> Cluster {
    cluster_over(TransportKind::Tcp).await
}

fn rdma_settings() -> RdmaConfig {
    tessera_test_support::rdma::config_rdma()
}

async fn cluster_over(transport: TransportKind) -> Cluster {
    let base = PsServerConfig {
        transport,
        rdma: rdma_settings(),
        tables: vec![TableConfig {
            optimizer: OptimizerConfig::sgd(0.5),
            initializer: Initializer::Uniform { scale: 0.1 },
            ..TableConfig::new("emb", 8)
        }],
        ..PsServerConfig::default()
    };
    let servers = InProcessCluster::start(2, 2, &base).await;
    let endpoints = common::endpoints(&servers);
    Cluster {
        config: WorkerConfig {
            transport,
            rdma: rdma_settings(),
            num_shards: 2,
            servers: endpoints,
            // Generous timeouts: this 2-core host runs many tests at once.
            connect_timeout_ms: 2000,
            request_timeout_ms: 5000,
            call_timeout_ms: 10_000,
            workload: WorkloadConfig {
                table: "emb".into(),
                duration_secs: 0.5,
                concurrency: 2,
                response_bytes_max: 64 * 1024,
                key_space: 10_000,
                seed: 3,
                ..WorkloadConfig::default()
            },
            ..WorkerConfig::default()
        },
        servers,
    }
}

impl Cluster {
    async fn stop(self) {
        self.servers.stop().await;
    }

    /// Reads `key` directly from the server at `index`.
    async fn direct(&self, index: usize, key: u64) -> Vec<f32> {
        let server = &self.config.servers[index];
        let client = ParameterServerClient::new(
            Channel::connect(&server.address, self.config.channel_config())
                .await
                .unwrap(),
        );
        let response = client
            .fetch(FetchRequest {
                table: "emb".into(),
                shard: server.shards[0],
                keys: vec![key],
            })
            .await
            .unwrap();
        f32s(&response.values)
    }
}

#[tokio::test]
async fn fetch_merges_shards_in_caller_order_with_duplicates() {
    let cluster = cluster().await;
    let client = PsClient::new(&cluster.config).unwrap();
    let keys = [11u64, 4, 11, 900, 4, 77, 3];
    assert!(keys.iter().any(|&k| shard_for_key(k, 2) == 0));
    assert!(keys.iter().any(|&k| shard_for_key(k, 2) == 1));
    let rows = client.fetch("emb", &keys).await.unwrap();
    assert_eq!((rows.len(), rows.dim()), (keys.len(), 8));
    for (i, &key) in keys.iter().enumerate() {
        // Server index = group * 2 + shard; group 0 answers for itself.
        let direct = cluster.direct(shard_for_key(key, 2) as usize, key).await;
        assert_eq!(rows.row(i), &direct[..], "key {key} at position {i}");
    }
    assert_eq!(rows.row(0), rows.row(2));
    cluster.stop().await;
}

#[tokio::test]
async fn push_sums_duplicates_and_reaches_every_replica() {
    let cluster = cluster().await;
    let client = PsClient::new(&cluster.config).unwrap();
    let keys = [5u64, 6, 5];
    let before = client.fetch("emb", &keys).await.unwrap();
    let mut gradients = vec![0.0f32; 3 * 8];
    gradients[..8].fill(1.0);
    gradients[8..16].fill(2.0);
    gradients[16..].fill(3.0);
    client.push("emb", &keys, &gradients, 8).await.unwrap();
    // The primary has it at once; the other group once forwarding drains.
    for (position, key, total) in [(0usize, 5u64, 4.0f32), (1, 6, 2.0)] {
        let shard = shard_for_key(key, 2) as usize;
        let expected: Vec<f32> = before
            .row(position)
            .iter()
            .map(|w| w - 0.5 * total)
            .collect();
        for group in 0..2 {
            eventually(
                std::time::Duration::from_secs(10),
                &format!("key {key} on replica group {group} at {expected:?}"),
                || async {
                    let row = cluster.direct(group * 2 + shard, key).await;
                    if row == expected { Ok(()) } else { Err(row) }
                },
            )
            .await;
        }
    }
    let err = client
        .push("emb", &keys, &gradients[..8], 8)
        .await
        .unwrap_err();
    assert!(matches!(err, WorkerError::GradientLength { .. }));
    cluster.stop().await;
}

#[tokio::test]
async fn workloads_run_without_errors() {
    let cluster = cluster().await;
    let client = Arc::new(PsClient::new(&cluster.config).unwrap());
    for kind in [WorkloadKind::Ranker, WorkloadKind::Trainer] {
        let report = workload::run(kind, Arc::clone(&client), &cluster.config.workload).await;
        assert!(report.iterations > 0, "{report:?}");
        assert_eq!(report.errors, 0, "{:?}", report.first_error);
        assert_eq!(report.fetch.count, report.iterations);
        assert_eq!(report.push.is_some(), kind == WorkloadKind::Trainer);
        let table = report.to_string();
        assert!(table.contains("p999 ms"), "{table}");
    }
    cluster.stop().await;
}

/// At `rate_per_sec` the workload starts iterations on a schedule (open
/// loop), whatever the answers take: a second at 60/s is 60 of them.
#[tokio::test]
async fn an_open_loop_starts_iterations_at_the_offered_rate() {
    let cluster = cluster().await;
    let client = Arc::new(PsClient::new(&cluster.config).unwrap());
    let options = tessera_worker::config::WorkloadConfig {
        duration_secs: 1.0,
        concurrency: 4,
        rate_per_sec: 60.0,
        ..cluster.config.workload.clone()
    };
    for kind in [WorkloadKind::Ranker, WorkloadKind::Trainer] {
        let report = workload::run(kind, Arc::clone(&client), &options).await;
        assert_eq!(report.errors, 0, "{:?}", report.first_error);
        assert!(
            (58..=60).contains(&report.iterations),
            "{} iterations in 1 s at 60/s",
            report.iterations
        );
        assert_eq!(report.offered_rate, Some(60.0));
        // The timeline accounts for every iteration, by the second it
        // was due in: the one second of the run (a late task's last
        // iteration can be due at its very end).
        let timeline = &report.timeline;
        assert!((1..=2).contains(&timeline.len()), "{timeline:?}");
        assert_eq!(
            timeline.iter().map(|s| s.iterations).sum::<u64>(),
            report.iterations
        );
        assert_eq!(timeline.iter().map(|s| s.errors).sum::<u64>(), 0);
        assert!(timeline[0].iterations >= 58, "{timeline:?}");
        assert!(timeline[0].max_us >= timeline[0].p99_us && timeline[0].p99_us > 0);
        let split = report.cpu_user_us_per_iteration + report.cpu_system_us_per_iteration;
        assert!((split - report.cpu_us_per_iteration).abs() < 1e-6);
    }
    // Four tasks at 4/s: each task's next iteration falls 1-1.75 s in; the
    // run ends with its second, not when those are due (before, it slept
    // until them and took 1.75 s).
    let slow = tessera_worker::config::WorkloadConfig {
        rate_per_sec: 4.0,
        ..options
    };
    let report = workload::run(WorkloadKind::Ranker, Arc::clone(&client), &slow).await;
    assert_eq!(report.iterations, 4);
    assert!(
        report.elapsed < std::time::Duration::from_millis(1500),
        "{:?}",
        report.elapsed
    );
    cluster.stop().await;
}

#[tokio::test]
async fn a_stopped_shard_fails_fetches_with_its_shard_and_address() {
    let mut cluster = cluster().await;
    // Keep only replica group 0; stop its shard-1 server.
    cluster.config.servers.truncate(2);
    let client = PsClient::new(&cluster.config).unwrap();
    let key = (0..).find(|&k| shard_for_key(k, 2) == 1).unwrap();
    client.fetch("emb", &[key]).await.unwrap();
    cluster.servers.servers.remove(1).stop().await;
    let err = client.fetch("emb", &[key]).await.unwrap_err();
    match &err {
        WorkerError::Rpc { shard, addr, .. } => {
            assert_eq!(*shard, 1);
            assert_eq!(addr, &cluster.config.servers[1].address);
        }
        other => panic!("expected an RPC error, got {other:?}"),
    }
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetch_push_and_workloads_over_rdma() {
    let cluster = cluster_over(TransportKind::Rdma).await;
    let client = Arc::new(PsClient::new(&cluster.config).unwrap());
    let keys = [11u64, 4, 11, 900, 4, 77, 3];
    let before = client.fetch("emb", &keys).await.unwrap();
    assert_eq!((before.len(), before.dim()), (keys.len(), 8));
    assert_eq!(before.row(0), before.row(2));
    client.push("emb", &keys[..1], &[1.0; 8], 8).await.unwrap();
    // A Fetch may be served by the replica, which sees the Push once
    // forwarding has delivered it.
    let expected: Vec<f32> = before.row(0).iter().map(|w| w - 0.5).collect();
    eventually(
        std::time::Duration::from_secs(10),
        "a Fetch seeing the Push (from the primary or the replica)",
        || async {
            let rows = client.fetch("emb", &keys[..1]).await.unwrap();
            if rows.row(0) == &expected[..] {
                Ok(())
            } else {
                Err(rows.row(0).to_vec())
            }
        },
    )
    .await;
    for kind in [WorkloadKind::Ranker, WorkloadKind::Trainer] {
        let report = workload::run(kind, Arc::clone(&client), &cluster.config.workload).await;
        assert!(report.iterations > 0, "{report:?}");
        assert_eq!(report.errors, 0, "{:?}", report.first_error);
    }
    cluster.stop().await;
}

/// The `WorkerAdmin` call lists the servers a worker's replica sets
/// quarantined and clears them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_call_lists_and_clears_the_quarantine() {
    use tessera_proto::v1::{QuarantineRequest, WorkerAdminClient, WorkerAdminServer};
    use tessera_rpc::policy::QuarantineConfig;
    use tessera_rpc::{ChannelConfig, Server, ServerConfig};
    use tessera_worker::WorkerAdminService;

    let live = InProcess::start(&PsServerConfig {
        listen: "127.0.0.1:0".into(),
        tables: vec![TableConfig::new("emb", 4)],
        ..PsServerConfig::default()
    })
    .await;
    let live_addr = live.addr.clone();
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let client = Arc::new(
        PsClient::new(&WorkerConfig {
            servers: vec![
                ServerEndpoint {
                    address: live_addr,
                    shards: vec![0],
                    replica_group: 0,
                },
                ServerEndpoint {
                    address: dead.clone(),
                    shards: vec![0],
                    replica_group: 1,
                },
            ],
            connect_timeout_ms: 2000,
            request_timeout_ms: 5000,
            call_timeout_ms: 10_000,
            // Eject at the first refused connection.
            quarantine: QuarantineConfig {
                max_connect_failures: 0,
                ..QuarantineConfig::default()
            },
            ..WorkerConfig::default()
        })
        .unwrap(),
    );
    // Fetches succeed; the dead replica is tried, refused and ejected.
    let started = std::time::Instant::now();
    while client.replica_set(0).unwrap().quarantined().is_empty() {
        client.fetch("emb", &[1, 2, 3]).await.unwrap();
        assert!(started.elapsed() < std::time::Duration::from_secs(10));
    }
    let admin_server = Server::builder(ServerConfig::default())
        .add_service(WorkerAdminServer::new(WorkerAdminService::new(Arc::clone(
            &client,
        ))))
        .unwrap()
        .bind("127.0.0.1:0")
        .await
        .unwrap();
    let admin_addr = admin_server.local_addr().to_string();
    let (stop_admin, admin_stopped) = oneshot::channel::<()>();
    let admin_task = tokio::spawn(admin_server.serve_with_shutdown(async {
        let _ = admin_stopped.await;
    }));
    let admin = WorkerAdminClient::new(
        Channel::connect(
            admin_addr,
            ChannelConfig {
                connect_timeout_ms: 2000,
                request_timeout_ms: 5000,
                ..ChannelConfig::default()
            },
        )
        .await
        .unwrap(),
    );
    let listed = admin
        .quarantine(QuarantineRequest { clear: true })
        .await
        .unwrap();
    assert_eq!(listed.servers.len(), 1, "{listed:?}");
    assert_eq!(listed.servers[0].address, dead);
    assert_eq!(listed.servers[0].shard, 0);
    assert!(listed.servers[0].seconds_left > 0.0);
    let after = admin
        .quarantine(QuarantineRequest { clear: false })
        .await
        .unwrap();
    assert!(after.servers.is_empty(), "cleared: {after:?}");
    let _ = stop_admin.send(());
    admin_task.await.unwrap();
    live.stop().await;
}
