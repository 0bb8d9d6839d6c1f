//! The parameter server over RPC, in-process and as a binary; the RPC cases
//! run over TCP and over RDMA (`tcp::`, `rdma::`), the RDMA cases over the
//! provider the suite runs on (`tessera_test_support::rdma`).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::Duration;

use bytes::Bytes;
use tessera_proto::rows::put_f32s;
use tessera_proto::v1::{FetchRequest, HealthRequest, ParameterServerClient, PushRequest};
use tessera_ps_server::config::{Initializer, OptimizerConfig};
use tessera_ps_server::{Mode, PsServerConfig, TableConfig};
use tessera_rpc::{Channel, ChannelConfig, Code, RdmaConfig, TransportConfig, TransportKind};
use tessera_test_support::wait::eventually;
use tessera_test_support::{InProcess, PsProcess, f32s, free_addr, keys_of_shard};

/// Which transport a case runs over.
#[derive(Clone, Copy)]
enum Over {
    Tcp,
    Rdma,
}

impl Over {
    fn kind(self) -> TransportKind {
        match self {
            Over::Tcp => TransportKind::Tcp,
            Over::Rdma => TransportKind::Rdma,
        }
    }

    fn rdma(self) -> RdmaConfig {
        tessera_test_support::rdma::config_rdma()
    }

    /// Generous timeouts: this 2-core host runs many tests at once (the
    /// paper's 10/40 ms defaults are for a fleet, and tested in the RPC
    /// crate).
    fn channel(self) -> ChannelConfig {
        ChannelConfig {
            connect_timeout_ms: 2000,
            request_timeout_ms: 5000,
            transport: TransportConfig {
                kind: self.kind(),
                rdma: self.rdma(),
                ..TransportConfig::default()
            },
            ..ChannelConfig::default()
        }
    }
}

/// A server of shard 1 of 2 in this process, and a client of it over
/// `over`; stopped with [`InProcess::stop`].
async fn start(mode: Mode, over: Over) -> (ParameterServerClient, InProcess) {
    let config = PsServerConfig {
        listen: "127.0.0.1:0".into(),
        mode,
        transport: over.kind(),
        rdma: over.rdma(),
        num_shards: 2,
        shards: vec![1],
        tables: vec![TableConfig {
            optimizer: OptimizerConfig::sgd(0.1),
            initializer: Initializer::Uniform { scale: 0.5 },
            ..TableConfig::new("emb", 4)
        }],
        ..PsServerConfig::default()
    };
    let server = InProcess::start(&config).await;
    let channel = Channel::connect(server.addr.clone(), over.channel())
        .await
        .unwrap();
    (ParameterServerClient::new(channel), server)
}

fn shard1_keys(n: usize) -> Vec<u64> {
    keys_of_shard(1, 2, n)
}

async fn fetch_push_fetch_over_rpc(over: Over) {
    let (client, server) = start(Mode::Training, over).await;
    let keys = shard1_keys(3);
    let before = client
        .fetch(FetchRequest {
            table: "emb".into(),
            shard: 1,
            keys: keys.clone(),
        })
        .await
        .unwrap();
    assert_eq!(before.dim, 4);
    let before = f32s(&before.values);
    assert_eq!(before.len(), 12);
    let mut grads = Vec::new();
    put_f32s(&mut grads, &[1.0; 12]);
    let pushed = client
        .push(PushRequest {
            table: "emb".into(),
            shard: 1,
            keys: keys.clone(),
            gradients: Bytes::from(grads),
            ..PushRequest::default()
        })
        .await
        .unwrap();
    assert_eq!(pushed.applied, 3);
    let after = client
        .fetch(FetchRequest {
            table: "emb".into(),
            shard: 1,
            keys,
        })
        .await
        .unwrap();
    let after = f32s(&after.values);
    for (b, a) in before.iter().zip(&after) {
        assert_eq!(*a, b - 0.1);
    }
    let health = client.health(HealthRequest {}).await.unwrap();
    assert!(health.serving);
    assert_eq!(health.shards, vec![1]);
    assert_eq!(health.tables[0].rows, 3);
    server.stop().await;
}

async fn bad_requests_get_clear_statuses_and_the_server_keeps_serving(over: Over) {
    let (client, server) = start(Mode::Training, over).await;
    let keys = shard1_keys(2);
    let cases = [
        (
            client
                .fetch(FetchRequest {
                    table: "missing".into(),
                    shard: 1,
                    keys: keys.clone(),
                })
                .await
                .map(|_| ()),
            Code::NotFound,
            "no table named `missing`",
        ),
        (
            client
                .push(PushRequest {
                    table: "emb".into(),
                    shard: 1,
                    keys: keys.clone(),
                    gradients: Bytes::from(vec![0u8; 12]),
                    ..PushRequest::default()
                })
                .await
                .map(|_| ()),
            Code::InvalidArgument,
            "expected 32 gradient bytes",
        ),
        (
            client
                .fetch(FetchRequest {
                    table: "emb".into(),
                    shard: 0,
                    keys: keys.clone(),
                })
                .await
                .map(|_| ()),
            Code::FailedPrecondition,
            "shard 0 is not hosted",
        ),
        (
            client
                .fetch(FetchRequest {
                    table: "emb".into(),
                    shard: 1,
                    keys: keys_of_shard(0, 2, 1),
                })
                .await
                .map(|_| ()),
            Code::FailedPrecondition,
            "belongs to shard 0",
        ),
    ];
    for (result, code, text) in cases {
        let err = result.unwrap_err();
        assert_eq!(err.code(), code, "{err}");
        assert!(err.to_string().contains(text), "{err}");
    }
    let ok = client
        .fetch(FetchRequest {
            table: "emb".into(),
            shard: 1,
            keys,
        })
        .await
        .unwrap();
    assert_eq!(ok.values.len(), 32);
    server.stop().await;
}

async fn inference_server_serves_zeros_and_refuses_push(over: Over) {
    let (client, server) = start(Mode::Inference, over).await;
    let keys = shard1_keys(2);
    let rows = client
        .fetch(FetchRequest {
            table: "emb".into(),
            shard: 1,
            keys: keys.clone(),
        })
        .await
        .unwrap();
    assert_eq!(f32s(&rows.values), vec![0.0; 8]);
    let err = client
        .push(PushRequest {
            table: "emb".into(),
            shard: 1,
            keys,
            gradients: Bytes::from(vec![0u8; 32]),
            ..PushRequest::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    server.stop().await;
}

#[test]
fn binary_refuses_a_bad_config_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(&path, "transport = \"rdma-over-pigeons\"\n").unwrap();
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_ps-server"))
        .arg("--config")
        .arg(&path)
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("transport") && stderr.contains("allowed: tcp"),
        "{stderr}"
    );
}

#[test]
fn binary_serves_and_stops_on_sigterm() {
    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_ps-server"))
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(eventually(
        Duration::from_secs(10),
        "ps-server answers Health, serving",
        || async {
            let channel = Channel::connect(format!("127.0.0.1:{port}"), Over::Tcp.channel())
                .await
                .map_err(|e| e.to_string())?;
            let health = ParameterServerClient::new(channel)
                .health(HealthRequest {})
                .await
                .map_err(|e| e.to_string())?;
            if health.serving {
                Ok(())
            } else {
                Err("not serving".to_owned())
            }
        },
    ));
    let status = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exit = child.wait().unwrap();
    assert!(exit.success(), "{exit:?}");
}

/// Every RPC case runs over TCP and over RDMA.
macro_rules! over_both_transports {
    ($($case:ident),* $(,)?) => {
        mod tcp {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(super::Over::Tcp).await;
                }
            )*
        }
        mod rdma {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(super::Over::Rdma).await;
                }
            )*
        }
    };
}

over_both_transports!(
    fetch_push_fetch_over_rpc,
    bad_requests_get_clear_statuses_and_the_server_keeps_serving,
    inference_server_serves_zeros_and_refuses_push,
);

/// A `ps-server` process serving shard 1 of 2 over RDMA with `rdma`
/// settings, its configuration in `dir`.
fn spawn_rdma_ps_server(rdma: RdmaConfig, dir: &std::path::Path) -> (PsProcess, String) {
    let addr = free_addr();
    let config = PsServerConfig {
        listen: addr.clone(),
        transport: TransportKind::Rdma,
        rdma,
        num_shards: 2,
        shards: vec![1],
        tables: vec![TableConfig::new("emb", 4)],
        ..PsServerConfig::default()
    };
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_ps-server"));
    (PsProcess::spawn(bin, &config, dir, "ps"), addr)
}

#[test]
fn the_binary_serves_a_client_in_another_process_over_rdma() {
    let dir = tempfile::tempdir().unwrap();
    let (mut child, addr) = spawn_rdma_ps_server(Over::Rdma.rdma(), dir.path());
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let rows = runtime.block_on(eventually(
        Duration::from_secs(10),
        "a Fetch over RDMA from another process answered",
        || async {
            let channel = Channel::connect(addr.clone(), Over::Rdma.channel())
                .await
                .map_err(|e| e.to_string())?;
            let rows = ParameterServerClient::new(channel)
                .fetch(FetchRequest {
                    table: "emb".into(),
                    shard: 1,
                    keys: shard1_keys(3),
                })
                .await
                .map_err(|e| e.to_string())?;
            Ok::<_, String>(rows.values.len())
        },
    ));
    child.kill();
    assert_eq!(
        rows,
        3 * 4 * 4,
        "three rows of four f32 over RDMA from another process"
    );
}

#[test]
fn a_frozen_server_fails_outstanding_calls_at_keepalive_not_at_their_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let (mut child, addr) = spawn_rdma_ps_server(
        RdmaConfig {
            keepalive_interval_ms: 50,
            keepalive_timeout_ms: 500,
            ..Over::Rdma.rdma()
        },
        dir.path(),
    );
    let mut channel_config = Over::Rdma.channel();
    channel_config.transport.rdma.keepalive_interval_ms = 50;
    channel_config.transport.rdma.keepalive_timeout_ms = 500;
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let outcome = runtime.block_on(async {
        let client = eventually(
            Duration::from_secs(10),
            "ps-server answers Health",
            || async {
                let channel = Channel::connect(addr.clone(), channel_config.clone())
                    .await
                    .map_err(|e| e.to_string())?;
                let client = ParameterServerClient::new(channel);
                client
                    .health(HealthRequest {})
                    .await
                    .map_err(|e| e.to_string())?;
                Ok::<_, String>(client)
            },
        )
        .await;
        // Freeze it: its TCP connections stay open, only keepalive can tell.
        child.freeze();
        let started = std::time::Instant::now();
        let result = client
            .fetch_with_options(
                FetchRequest {
                    table: "emb".into(),
                    shard: 1,
                    keys: shard1_keys(1),
                },
                &tessera_rpc::CallOptions::with_timeout(Duration::from_secs(10)),
            )
            .await;
        (result.map(|_| ()), started.elapsed())
    });
    child.signal(nix::sys::signal::Signal::SIGCONT);
    child.kill();
    let (result, waited) = outcome;
    let err = result.expect_err("a frozen server does not answer");
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(
        waited < Duration::from_secs(3),
        "failed after {waited:?}: at keepalive (0.5 s), long before the 10 s deadline"
    );
}
