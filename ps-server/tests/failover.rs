//! A replica killed (SIGKILL) under load: no call fails that had a healthy
//! replica and time left in its deadline. Two `ps-server` processes serve
//! the same shard; concurrent Fetches go through a `ReplicaSet` with the
//! default retry, budget and quarantine policies; one server is killed in
//! the middle of the run. Over TCP and over RDMA with the soft provider.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stderr,
    missing_docs
)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tessera_proto::v1::{FetchRequest, HealthRequest, ParameterServerClient};
use tessera_rpc::{
    Channel, ChannelConfig, ReplicaEndpoint, ReplicaSet, ReplicaSetConfig, Transport,
    TransportConfig, TransportKind,
};

fn transport(kind: TransportKind) -> TransportConfig {
    match kind {
        TransportKind::Rdma => TransportConfig::soft_rdma(),
        _ => TransportConfig::default(),
    }
}

/// A ps-server process on a free port: (process, address, its config's
/// directory, kept alive by the caller).
fn spawn_server(kind: TransportKind) -> (std::process::Child, String, tempfile::TempDir) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ps.toml");
    std::fs::write(
        &path,
        format!("listen = \"{addr}\"\ntransport = \"{kind}\"\n[rdma]\nprovider = \"soft\"\n"),
    )
    .unwrap();
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_ps-server"))
        .arg("--config")
        .arg(&path)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    (child, addr, dir)
}

async fn wait_healthy(addr: &str, config: &ChannelConfig) {
    let started = Instant::now();
    loop {
        if let Ok(channel) = Channel::connect(addr, config.clone()).await
            && ParameterServerClient::new(channel)
                .health(HealthRequest {})
                .await
                .is_ok()
        {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{addr} never became healthy"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn killed_replica_under_load(kind: TransportKind) {
    let (victim, victim_addr, _victim_dir) = spawn_server(kind);
    let (mut survivor, survivor_addr, _survivor_dir) = spawn_server(kind);
    let mut victim = Some(victim);
    // Timeouts for a loaded 2-core host running the suite in parallel;
    // the policies (retry, budget, quarantine, backoff) are the defaults.
    let channel = ChannelConfig {
        connect_timeout_ms: 500,
        request_timeout_ms: 2000,
        transport: transport(kind),
        ..ChannelConfig::default()
    };
    wait_healthy(&victim_addr, &channel).await;
    wait_healthy(&survivor_addr, &channel).await;
    let set = ReplicaSet::new(
        ReplicaSetConfig {
            replicas: [&victim_addr, &survivor_addr]
                .into_iter()
                .map(|addr| ReplicaEndpoint {
                    addr: addr.clone(),
                    domain: String::new(),
                })
                .collect(),
            call_timeout_ms: 5000,
            channel: channel.clone(),
            seed: Some(17),
            ..ReplicaSetConfig::default()
        },
        Transport::new(transport(kind)).unwrap(),
    );
    let client = ParameterServerClient::new(set);
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let slowest_us = Arc::new(AtomicU64::new(0));
    let run_for = Duration::from_millis(2500);
    let started = Instant::now();
    let mut workers = Vec::new();
    for w in 0..8u64 {
        let client = client.clone();
        let (ok, failed, slowest_us) = (ok.clone(), failed.clone(), slowest_us.clone());
        workers.push(tokio::spawn(async move {
            let mut key = w * 1_000_000;
            let mut first_error = None;
            while started.elapsed() < run_for {
                key += 64;
                let call = Instant::now();
                match client
                    .fetch(FetchRequest {
                        table: "embeddings".into(),
                        shard: 0,
                        keys: (key..key + 64).collect(),
                    })
                    .await
                {
                    Ok(response) => {
                        assert_eq!(response.values.len(), 64 * 16 * 4);
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(err) => {
                        failed.fetch_add(1, Ordering::Relaxed);
                        first_error.get_or_insert(err.to_string());
                    }
                }
                slowest_us.fetch_max(call.elapsed().as_micros() as u64, Ordering::Relaxed);
            }
            first_error
        }));
    }
    tokio::time::sleep(Duration::from_millis(800)).await;
    let before_kill = ok.load(Ordering::Relaxed);
    let mut child = victim.take().unwrap();
    child.kill().unwrap(); // SIGKILL
    let killed_at = Instant::now();
    child.wait().unwrap();
    let mut errors = Vec::new();
    for worker in workers {
        if let Some(err) = worker.await.unwrap() {
            errors.push(err);
        }
    }
    let after_kill = ok.load(Ordering::Relaxed) - before_kill;
    let _ = survivor.kill();
    let _ = survivor.wait();
    eprintln!(
        "{kind}: {} calls before the kill, {after_kill} after it ({:?} of run after the kill), {} failed, slowest call {} µs",
        before_kill,
        run_for.saturating_sub(killed_at - started),
        failed.load(Ordering::Relaxed),
        slowest_us.load(Ordering::Relaxed)
    );
    assert!(
        before_kill > 0 && after_kill > 0,
        "load ran on both sides of the kill"
    );
    assert_eq!(
        failed.load(Ordering::Relaxed),
        0,
        "no call may fail while a healthy replica is left: {errors:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_a_killed_replica_under_load_fails_no_call() {
    killed_replica_under_load(TransportKind::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_soft_a_killed_replica_under_load_fails_no_call() {
    killed_replica_under_load(TransportKind::Rdma).await;
}
