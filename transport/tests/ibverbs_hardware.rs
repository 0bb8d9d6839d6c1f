//! The ibverbs provider on a real device, between two processes: a
//! `tessera-echo --transport rdma` child and this process, every message
//! size through SEND and RTS/CTS + WRITE. Runs where an RDMA device with an
//! active port exists (`scripts/dev hw-test` runs it with `tessera doctor`
//! first); elsewhere each test prints why it skipped and passes, so the
//! suite stays green on machines without one and says so.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stderr,
    missing_docs
)]

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use tessera_transport::{Message, Transport, TransportConfig, TransportKind};

/// The ibverbs transport config, or why this host cannot run it.
fn hardware() -> Result<TransportConfig, String> {
    let config = TransportConfig {
        kind: TransportKind::Rdma,
        ..TransportConfig::default()
    };
    match Transport::new(config.clone()) {
        Ok(_) => Ok(config),
        Err(err) => Err(err.to_string()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ibverbs_messages_of_every_size_cross_to_another_process_and_back() {
    let config = match hardware() {
        Ok(config) => config,
        Err(reason) => {
            eprintln!("SKIPPED ibverbs two-process test: {reason}");
            return;
        }
    };
    let mut child = Command::new(env!("CARGO_BIN_EXE_tessera-echo"))
        .args(["--transport", "rdma", "--listen", "127.0.0.1:0"])
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
        .unwrap()
        .to_owned();
    let client = Transport::new(config).unwrap();
    let mut conn = client.connect(&addr).await.unwrap();
    assert_eq!(conn.kind(), TransportKind::Rdma);
    for len in [
        1usize,
        100,
        8 << 10,
        (8 << 10) + 1,
        100_000,
        1 << 20,
        8 << 20,
    ] {
        let payload: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let started = std::time::Instant::now();
        let buf = client.send_pool().alloc_copy(&payload).unwrap();
        conn.sender.send(Message::from(buf.freeze())).await.unwrap();
        let back = tokio::time::timeout(Duration::from_secs(10), conn.receiver.recv())
            .await
            .expect("echo within 10 s")
            .unwrap()
            .expect("an echo");
        assert_eq!(&back[..], &payload[..], "{len}-byte echo");
        eprintln!("{len}-byte echo: {:?}", started.elapsed());
    }
    let stats = client.rdma_stats().unwrap();
    eprintln!("ibverbs two-process test: {stats:?}");
    drop(child.stdin.take());
    let _ = child.wait();
}
