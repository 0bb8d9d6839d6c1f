//! The ps-server's other endpoints: gRPC (called from Python's grpcio with
//! stubs generated from nothing but the `.proto` files) and Prometheus.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stderr,
    missing_docs
)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use tessera_proto::v1::{FetchRequest, ParameterServerClient};
use tessera_ps_server::config::{Initializer, OptimizerConfig};
use tessera_ps_server::{PsServer, PsServerConfig, TableConfig};
use tessera_rpc::{Channel, ChannelConfig};
use tessera_test_support::free_port;
use tessera_test_support::wait::eventually;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A `PYTHONPATH` under which `import grpc, grpc_tools` works: the
/// interpreter's own packages when it has them, else grpcio and
/// grpcio-tools installed from PyPI into the target directory (kept between
/// runs). Fails, never skips, when neither works.
fn python_with_grpc() -> Option<PathBuf> {
    let has_grpc = |pythonpath: Option<&Path>| {
        let mut command = Command::new("python3");
        command.args(["-c", "import grpc, grpc_tools"]);
        if let Some(path) = pythonpath {
            command.env("PYTHONPATH", path);
        }
        command.output().is_ok_and(|out| out.status.success())
    };
    if has_grpc(None) {
        return None;
    }
    let target = Path::new(env!("CARGO_TARGET_TMPDIR")).join("python-grpc");
    if has_grpc(Some(&target)) {
        return Some(target);
    }
    eprintln!(
        "installing grpcio and grpcio-tools from PyPI into {}",
        target.display()
    );
    let out = Command::new("python3")
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
        ])
        .arg("--target")
        .arg(&target)
        .args(["grpcio", "grpcio-tools"])
        // Debian's Python refuses installs it does not manage (PEP 668);
        // an install into our own target directory is not one of those.
        .env("PIP_BREAK_SYSTEM_PACKAGES", "1")
        .output()
        .expect("python3 is required for this test (scripts/dev setup installs it)");
    assert!(
        out.status.success(),
        "pip install grpcio grpcio-tools failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(has_grpc(Some(&target)), "grpc still not importable");
    Some(target)
}

fn table() -> TableConfig {
    TableConfig {
        optimizer: OptimizerConfig::sgd(0.5),
        initializer: Initializer::Uniform { scale: 0.5 },
        ..TableConfig::new("emb", 8)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_grpcio_calls_fetch_and_push_through_the_grpc_endpoint() {
    let pythonpath = tokio::task::spawn_blocking(python_with_grpc).await.unwrap();
    let config = PsServerConfig {
        listen: "127.0.0.1:0".into(),
        grpc_listen: Some("127.0.0.1:0".into()),
        tables: vec![table()],
        ..PsServerConfig::default()
    };
    let server = PsServer::bind(&config).await.unwrap();
    let grpc_addr = server.grpc_addr().unwrap().to_string();
    let store = std::sync::Arc::clone(server.store());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(server.serve(async {
        let _ = stopped.await;
    }));

    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let script = manifest.join("tests/python/grpc_client.py");
    let proto_dir = manifest.join("../proto");
    let options_dir = tessera_rpc_build_options_dir();
    let out = tokio::task::spawn_blocking(move || {
        let mut command = Command::new("python3");
        command
            .arg(&script)
            .arg(&grpc_addr)
            .arg(&proto_dir)
            .arg(&options_dir);
        if let Some(path) = pythonpath {
            command.env("PYTHONPATH", path);
        }
        command.output().unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "python client failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("\"applied\": 3"), "{stdout}");
    assert!(stdout.contains("no-such-table"), "{stdout}");
    // The Push landed in the same store the Tessera endpoint serves.
    let rows: u64 = store
        .tables()
        .filter(|t| t.config().name == "emb")
        .map(|t| t.rows())
        .sum();
    assert_eq!(rows, 3);

    let _ = stop.send(());
    task.await.unwrap();
}

/// Where `tessera/options.proto` lives (shipped with tessera-rpc-build).
fn tessera_rpc_build_options_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../rpc/build/proto")
}

async fn http_get(addr: &str, path: &str) -> Option<String> {
    let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut body = String::new();
    stream.read_to_string(&mut body).await.ok()?;
    Some(body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_exposes_rpc_metrics_to_prometheus() {
    let (rpc_port, metrics_port) = (free_port(), free_port());
    let mut child = Command::new(env!("CARGO_BIN_EXE_ps-server"))
        .args(["--listen", &format!("127.0.0.1:{rpc_port}")])
        .args(["--metrics-listen", &format!("127.0.0.1:{metrics_port}")])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let channel_config = ChannelConfig {
        connect_timeout_ms: 2000,
        request_timeout_ms: 5000,
        ..ChannelConfig::default()
    };
    let client = eventually(
        Duration::from_secs(20),
        "the server comes up (takes a connection)",
        || async {
            Channel::connect(format!("127.0.0.1:{rpc_port}"), channel_config.clone())
                .await
                .map(ParameterServerClient::new)
        },
    )
    .await;
    for _ in 0..3 {
        client
            .fetch(FetchRequest {
                table: "embeddings".into(),
                shard: 0,
                keys: vec![1, 2, 3],
            })
            .await
            .unwrap();
    }
    let metrics_addr = format!("127.0.0.1:{metrics_port}");
    let body = http_get(&metrics_addr, "/metrics").await.unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    let fetch = "method=\"/tessera.ps.v1.ParameterServer/Fetch\"";
    let requests = body
        .lines()
        .find(|l| l.starts_with("tessera_rpc_server_requests_total") && l.contains(fetch))
        .unwrap_or_else(|| panic!("no request counter for Fetch:\n{body}"));
    assert!(requests.ends_with(" 3"), "{requests}");
    // A histogram with explicit buckets, not a summary.
    assert!(
        body.lines().any(
            |l| l.starts_with("tessera_rpc_server_duration_seconds_bucket")
                && l.contains("le=\"0.001\"")
                && l.contains(fetch)
        ),
        "{body}"
    );
}
