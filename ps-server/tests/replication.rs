//! Replication: Pushes go to a shard's primary, which forwards them in
//! order to the replica; the replica converges bit for bit (Adam, which
//! would show any reordering or double application), catches up after a
//! restart, and copies the shard again after the primary cut it off for
//! lagging too far.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

#[allow(dead_code)]
#[path = "../../rpc/tests/support/proxy.rs"]
mod proxy;

use std::time::{Duration, Instant};

use bytes::Bytes;
use tessera_proto::rows::put_f32s;
use tessera_proto::v1::{
    AdminClient, FetchRequest, HealthRequest, ParameterServerClient, PushRequest, StatsRequest,
};
use tessera_ps_server::config::{OptimizerConfig, PeerConfig, ReplicationConfig};
use tessera_ps_server::{PsServer, PsServerConfig, TableConfig};
use tessera_rpc::{Channel, ChannelConfig, Code, RpcError};
use tokio::sync::oneshot;

fn free_addr() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    format!("127.0.0.1:{port}")
}

/// A server of shard 0 in `group` (group 0 is the primary), knowing the
/// other at `peer` (as `peer_group`), advertising itself as `advertise`.
fn config(listen: &str, group: u32, peer: &str, advertise: &str, max_lag: usize) -> PsServerConfig {
    PsServerConfig {
        listen: listen.to_owned(),
        advertise: Some(advertise.to_owned()),
        replica_group: group,
        replica_groups: 2,
        peers: vec![PeerConfig {
            address: peer.to_owned(),
            replica_group: 1 - group,
            shards: vec![0],
        }],
        replication: ReplicationConfig {
            max_lag_pushes: max_lag,
            ..ReplicationConfig::default()
        },
        tables: vec![TableConfig {
            optimizer: OptimizerConfig::adam(0.01),
            ..TableConfig::new("emb", 4)
        }],
        ..PsServerConfig::default()
    }
}

struct Running {
    replication: std::sync::Arc<tessera_ps_server::Replication>,
    data: Data,
    admin: AdminClient,
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

async fn start(config: &PsServerConfig) -> Running {
    let server = PsServer::bind(config).await.unwrap();
    let replication = std::sync::Arc::clone(server.replication());
    let channel = Channel::lazy(
        server.local_addr().to_string(),
        ChannelConfig {
            connect_timeout_ms: 2000,
            request_timeout_ms: 10_000,
            ..ChannelConfig::default()
        },
    )
    .unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(server.serve(async {
        let _ = stopped.await;
    }));
    Running {
        replication,
        data: Data(ParameterServerClient::new(channel.clone())),
        admin: AdminClient::new(channel),
        stop,
        task,
    }
}

impl Running {
    async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.unwrap();
    }

    async fn push(&self, step: u64) -> Result<(), RpcError> {
        self.data.push(step).await
    }

    async fn rows(&self) -> Result<Bytes, RpcError> {
        self.data.rows().await
    }

    async fn pushes(&self) -> u64 {
        let stats = self.admin.stats(StatsRequest {}).await.unwrap();
        stats.shards.iter().map(|s| s.pushes).sum()
    }
}

/// The data client of a server: Pushes of a step's gradients (every row
/// changes) and reads of all 64 rows.
struct Data(ParameterServerClient);

impl Data {
    async fn push(&self, step: u64) -> Result<(), RpcError> {
        let keys: Vec<u64> = (0..64).collect();
        let grads: Vec<f32> = (0..keys.len() * 4)
            .map(|i| ((i as u64 * 13 + step * 7) % 17) as f32 - 8.0)
            .collect();
        let mut wire = Vec::new();
        put_f32s(&mut wire, &grads);
        self.0
            .push(PushRequest {
                table: "emb".into(),
                shard: 0,
                keys,
                gradients: Bytes::from(wire),
                worker_id: 5,
                sequence: step,
            })
            .await
            .map(|_| ())
    }

    async fn rows(&self) -> Result<Bytes, RpcError> {
        self.0
            .fetch(FetchRequest {
                table: "emb".into(),
                shard: 0,
                keys: (0..64).collect(),
            })
            .await
            .map(|r| r.values)
    }
}

/// Waits until the replica serves the same bytes as the primary (every
/// Push changes every row, so equal rows mean nothing is pending).
async fn converged(primary: &Running, replica: &Running) -> Bytes {
    let started = Instant::now();
    loop {
        if let (Ok(a), Ok(b)) = (primary.rows().await, replica.rows().await)
            && a == b
        {
            return a;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the replica never converged"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_to_the_primary_reach_the_replica_in_order_and_a_restarted_replica_catches_up() {
    let (a, b) = (free_addr(), free_addr());
    let primary = start(&config(&a, 0, &b, &a, 10_000)).await;
    let replica_config = config(&b, 1, &a, &b, 10_000);
    let replica = start(&replica_config).await;

    // Concurrent Pushes (distinct sequences): the primary serialises them
    // per shard, the replica replays its order.
    let mut steps = Vec::new();
    for step in 1..=40u64 {
        steps.push(primary.push(step));
    }
    for result in futures::future::join_all(steps).await {
        result.unwrap();
    }
    let rows = converged(&primary, &replica).await;
    assert_eq!(rows.len(), 64 * 4 * 4);
    // Replayed one by one, not copied.
    assert_eq!(replica.pushes().await, primary.pushes().await);

    // The replica refuses Pushes: they belong to the primary.
    let err = replica.push(1000).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");

    // Replica away; the primary goes on; a new replica process (empty
    // store) copies the shard and follows the stream again.
    replica.stop().await;
    for step in 41..=60u64 {
        primary.push(step).await.unwrap();
    }
    let replica = start(&replica_config).await;
    let health = replica.data.0.health(HealthRequest {}).await.unwrap();
    assert!(health.primary_shards.is_empty());
    for step in 61..=70u64 {
        primary.push(step).await.unwrap();
    }
    let started = Instant::now();
    loop {
        if let (Ok(a), Ok(b)) = (primary.rows().await, replica.rows().await)
            && a == b
        {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(20), "no catch-up");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let health = replica.data.0.health(HealthRequest {}).await.unwrap();
    assert!(health.serving);
    replica.stop().await;
    primary.stop().await;
}

/// The primary reaches the replica through a proxy that stalls: the queue
/// passes `max_lag_pushes`, the primary cuts the replica off with a gap
/// marker, and once the path recovers the replica copies the shard again
/// and converges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_cut_off_for_lagging_copies_the_shard_again() {
    let (a, b) = (free_addr(), free_addr());
    let to_replica = proxy::FaultProxy::start(b.clone()).await;
    let primary = start(&config(&a, 0, &to_replica.addr, &a, 5)).await;
    // The replica is known to the primary by the proxy's address.
    let replica = start(&config(&b, 1, &a, &to_replica.addr, 5)).await;
    primary.push(1).await.unwrap();
    converged(&primary, &replica).await;

    to_replica.delay(Duration::from_millis(400));
    for step in 2..=30u64 {
        primary.push(step).await.unwrap();
    }
    assert!(
        primary.replication.cutoffs() >= 1,
        "the replica was cut off"
    );
    to_replica.delay(Duration::ZERO);
    to_replica.reset_all();
    converged(&primary, &replica).await;
    assert!(
        replica.replication.syncs() >= 2,
        "copied at start and again after the cut-off"
    );
    replica.stop().await;
    primary.stop().await;
}

/// A `ps-server` process from `config` (written to a file in `dir`).
fn spawn(config: &PsServerConfig, dir: &std::path::Path, name: &str) -> std::process::Child {
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, toml::to_string(config).unwrap()).unwrap();
    std::process::Command::new(env!("CARGO_BIN_EXE_ps-server"))
        .arg("--config")
        .arg(&path)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap()
}

fn client_of(addr: &str) -> Data {
    let channel = Channel::lazy(
        addr,
        ChannelConfig {
            connect_timeout_ms: 2000,
            request_timeout_ms: 10_000,
            ..ChannelConfig::default()
        },
    )
    .unwrap();
    Data(ParameterServerClient::new(channel))
}

async fn processes_converge(primary: &Data, replica: &Data) {
    let started = Instant::now();
    loop {
        if let (Ok(a), Ok(b)) = (primary.rows().await, replica.rows().await)
            && a == b
        {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the replica process never converged"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The replica *process* is SIGKILLed while the primary keeps taking
/// Pushes; a new replica process catches up and converges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_replica_process_restarts_and_catches_up() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (free_addr(), free_addr());
    let mut primary_process = spawn(&config(&a, 0, &b, &a, 10_000), dir.path(), "primary");
    let replica_config = config(&b, 1, &a, &b, 10_000);
    let mut replica_process = spawn(&replica_config, dir.path(), "replica");
    let (primary, replica) = (client_of(&a), client_of(&b));
    let started = Instant::now();
    while primary.push(1).await.is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "primary never came up"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for step in 2..=20 {
        primary.push(step).await.unwrap();
    }
    processes_converge(&primary, &replica).await;

    replica_process.kill().unwrap(); // SIGKILL
    replica_process.wait().unwrap();
    for step in 21..=50 {
        primary.push(step).await.unwrap();
    }
    let mut replica_process = spawn(&replica_config, dir.path(), "replica");
    for step in 51..=60 {
        primary.push(step).await.unwrap();
    }
    processes_converge(&primary, &replica).await;
    let _ = replica_process.kill();
    let _ = replica_process.wait();
    let _ = primary_process.kill();
    let _ = primary_process.wait();
}
