//! The RDMA transport between two processes: the peer is a `tessera-echo`
//! child, so every WRITE and SEND lands in another process's memory (through
//! the shared mappings of the soft NIC, or the kernel's verbs when the
//! suite runs over ibverbs: `tessera_test_support::rdma`).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use tessera_transport::{Message, Transport, TransportConfig};

/// Keepalive every 50 ms, dead after 600 ms of silence.
const KEEPALIVE: (u64, u64) = (50, 600);

fn keepalive_config() -> TransportConfig {
    let mut config = tessera_test_support::rdma::transport();
    config.rdma.keepalive_interval_ms = KEEPALIVE.0;
    config.rdma.keepalive_timeout_ms = KEEPALIVE.1;
    config
}

/// `tessera-echo`'s `--transport` for the provider the suite runs over.
fn echo_transport() -> &'static str {
    if tessera_test_support::rdma::is_ibverbs() {
        "rdma"
    } else {
        "rdma-soft"
    }
}

fn signal(child: &Child, signal: &str) {
    let status = Command::new("kill")
        .args([signal, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

async fn ping(conn: &mut tessera_transport::Connection) -> Result<(), String> {
    conn.sender
        .send(Message::from(Bytes::from_static(b"ping")))
        .await
        .map_err(|e| e.to_string())?;
    match tokio::time::timeout(Duration::from_secs(5), conn.receiver.recv()).await {
        Ok(Ok(Some(back))) if &back[..] == b"ping" => Ok(()),
        other => Err(format!("{other:?}")),
    }
}

struct EchoChild {
    child: Child,
    addr: String,
}

impl EchoChild {
    fn start() -> Self {
        Self::start_with(&[])
    }

    fn start_with(extra: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tessera-echo"))
            .args(["--transport", echo_transport(), "--listen", "127.0.0.1:0"])
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start tessera-echo");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .expect("tessera-echo prints its address")
            .to_string();
        Self { child, addr }
    }
}

impl Drop for EchoChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_of_every_size_cross_to_another_process_and_back() {
    every_size_to_another_process_and_back(tessera_test_support::rdma::transport(), &[]).await;
}

/// The same with both processes' completion queues driven from their
/// tokio runtimes (`polling = "runtime"`): the peer's pushes wake this
/// process through the eventfd its agent handed out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runtime_driven_queues_carry_messages_of_every_size_across_processes() {
    let mut config = tessera_test_support::rdma::transport();
    config.rdma.polling = tessera_transport::Polling::Runtime;
    every_size_to_another_process_and_back(config, &["--polling", "runtime"]).await;
}

async fn every_size_to_another_process_and_back(config: TransportConfig, echo_args: &[&str]) {
    let echo = EchoChild::start_with(echo_args);
    let client = Transport::new(config).unwrap();
    let mut conn = client.connect(&echo.addr).await.unwrap();
    let sizes = [
        0usize,
        1,
        31,
        8 << 10,
        (8 << 10) + 1,
        65_536,
        100_000,
        1 << 20,
        (3 << 20) + 7,
        16 << 20,
    ];
    for round in 0..3 {
        for (i, &len) in sizes.iter().enumerate() {
            let mut buf = client.send_pool().alloc(len).unwrap();
            let seed = (round * 31 + i) as u8;
            for (j, byte) in buf.iter_mut().enumerate() {
                *byte = seed.wrapping_add((j % 253) as u8);
            }
            conn.sender.send(Message::from(buf.freeze())).await.unwrap();
        }
        for (i, &len) in sizes.iter().enumerate() {
            let back: Bytes = tokio::time::timeout(Duration::from_secs(20), conn.receiver.recv())
                .await
                .expect("echo within 20 s")
                .unwrap()
                .expect("echo");
            assert_eq!(back.len(), len, "echo {i} of round {round}");
            let seed = (round * 31 + i) as u8;
            assert!(
                back.iter()
                    .enumerate()
                    .all(|(j, &b)| b == seed.wrapping_add((j % 253) as u8)),
                "{len}-byte echo corrupted"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_process_that_dies_fails_the_connection_without_a_hang() {
    let mut echo = EchoChild::start();
    let client = Transport::new(tessera_test_support::rdma::transport()).unwrap();
    let mut conn = client.connect(&echo.addr).await.unwrap();
    conn.sender
        .send(Message::from(Bytes::from_static(b"ping")))
        .await
        .unwrap();
    let back = conn.receiver.recv().await.unwrap().unwrap();
    assert_eq!(&back[..], b"ping");
    echo.child.kill().unwrap();
    echo.child.wait().unwrap();
    let end = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let _ = conn
                .sender
                .send(Message::from(Bytes::from_static(b"anyone?")))
                .await;
            match conn.receiver.recv().await {
                Ok(Some(_)) => continue,
                other => return other,
            }
        }
    })
    .await
    .expect("the connection ends within 10 s of the peer's death");
    assert!(matches!(end, Ok(None) | Err(_)), "{end:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_paused_for_less_than_the_keepalive_timeout_is_not_declared_dead() {
    let echo = EchoChild::start_with(&["--keepalive", "50,600"]);
    let client = Transport::new(keepalive_config()).unwrap();
    let mut conn = client.connect(&echo.addr).await.unwrap();
    ping(&mut conn).await.unwrap();
    signal(&echo.child, "-STOP");
    tokio::time::sleep(Duration::from_millis(250)).await;
    signal(&echo.child, "-CONT");
    ping(&mut conn)
        .await
        .expect("the connection survives a short pause");
    tokio::time::sleep(Duration::from_millis(800)).await;
    ping(&mut conn).await.unwrap();
    let stats = client.rdma_stats().unwrap();
    assert_eq!(stats.keepalive_failures, 0);
    assert!(stats.keepalives_sent > 5, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_frozen_past_the_keepalive_timeout_is_declared_dead() {
    // SIGSTOP keeps its TCP connection open: only keepalive can tell.
    let echo = EchoChild::start_with(&["--keepalive", "50,600"]);
    let client = Transport::new(keepalive_config()).unwrap();
    let mut conn = client.connect(&echo.addr).await.unwrap();
    ping(&mut conn).await.unwrap();
    signal(&echo.child, "-STOP");
    let stopped = std::time::Instant::now();
    let end = tokio::time::timeout(Duration::from_secs(5), conn.receiver.recv())
        .await
        .expect("declared dead within 5 s");
    let waited = stopped.elapsed();
    signal(&echo.child, "-CONT");
    eprintln!(
        "{}: a SIGSTOPped peer declared dead {waited:?} after the stop (keepalive {} ms / {} ms): {end:?}",
        tessera_test_support::rdma::provider_name(),
        KEEPALIVE.0,
        KEEPALIVE.1
    );
    let err = end.expect_err("a dead peer is an error");
    let timeout = Duration::from_millis(KEEPALIVE.1);
    // Never before a whole timeout of silence, as the engine saw it.
    use tessera_transport::rdma::engine::EngineError;
    use tessera_transport::{RdmaError, TransportError};
    match TransportError::rdma(&err) {
        Some(RdmaError::Engine(EngineError::PeerDead(silent))) => {
            assert!(
                *silent >= timeout,
                "declared dead after {silent:?} of silence"
            )
        }
        other => panic!("expected a dead peer, got {other:?} ({err})"),
    }
    // The last keepalive landed about an interval before the stop; two
    // allow for a late one (the peer's timer on a loaded or emulated CPU:
    // in the Soft-RoCE VM it came 57 ms before the stop).
    assert!(
        waited + Duration::from_millis(2 * KEEPALIVE.0) >= timeout,
        "declared dead {waited:?} after the stop, before the timeout"
    );
    // Scheduling slack: one interval plus the I/O thread's wake-up.
    assert!(
        waited <= timeout + Duration::from_millis(KEEPALIVE.0 + 400),
        "declared dead only after {waited:?}"
    );
    assert_eq!(client.rdma_stats().unwrap().keepalive_failures, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_killed_with_sigkill_is_detected_within_the_keepalive_timeout() {
    let mut echo = EchoChild::start_with(&["--keepalive", "50,600"]);
    let client = Transport::new(keepalive_config()).unwrap();
    let mut conn = client.connect(&echo.addr).await.unwrap();
    ping(&mut conn).await.unwrap();
    echo.child.kill().unwrap();
    let killed = std::time::Instant::now();
    echo.child.wait().unwrap();
    let end = tokio::time::timeout(Duration::from_secs(5), conn.receiver.recv())
        .await
        .expect("detected within 5 s");
    let detected = killed.elapsed();
    eprintln!(
        "{}: a SIGKILLed peer detected {detected:?} after the kill (keepalive {} ms / {} ms): {end:?}",
        tessera_test_support::rdma::provider_name(),
        KEEPALIVE.0,
        KEEPALIVE.1
    );
    assert!(end.is_err(), "{end:?}");
    assert!(
        detected <= Duration::from_millis(KEEPALIVE.1 + 400),
        "detected after {detected:?}"
    );
}
