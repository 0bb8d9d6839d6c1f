//! `tessera-echo`: serves an echo over a Tessera transport — every message
//! received on any connection is sent back on it. A diagnostic (is RDMA
//! working between these two hosts?) and the peer process of the
//! transport's cross-process tests.
//!
//! ```text
//! tessera-echo [--transport tcp|rdma-soft|rdma|auto] [--listen ADDR]
//!              [--keepalive INTERVAL_MS,TIMEOUT_MS] [--polling event|busy|runtime]
//! ```
//!
//! Prints `listening on ADDR` once it accepts connections, and exits when
//! its standard input closes (so a parent process controls its lifetime).

// A command-line tool: its output is its interface.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::io::Read;
use std::process::ExitCode;

use tessera_transport::{Message, Transport, TransportConfig, TransportKind};

fn usage() -> ExitCode {
    eprintln!(
        "usage: tessera-echo [--transport tcp|rdma-soft|rdma|auto] [--listen ADDR] [--keepalive INTERVAL_MS,TIMEOUT_MS] [--polling event|busy|runtime]"
    );
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let mut transport = "tcp".to_string();
    let mut listen = "127.0.0.1:0".to_string();
    let mut keepalive: Option<(u64, u64)> = None;
    let mut polling = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let value = args.next();
        match (arg.as_str(), value) {
            ("--transport", Some(v)) => transport = v,
            ("--listen", Some(v)) => listen = v,
            ("--keepalive", Some(v)) => {
                let parsed = v
                    .split_once(',')
                    .and_then(|(i, t)| Some((i.parse().ok()?, t.parse().ok()?)));
                match parsed {
                    Some(pair) => keepalive = Some(pair),
                    None => return usage(),
                }
            }
            ("--polling", Some(v)) => {
                polling = Some(match v.as_str() {
                    "event" => tessera_transport::Polling::Event,
                    "busy" => tessera_transport::Polling::Busy,
                    "runtime" => tessera_transport::Polling::Runtime,
                    _ => return usage(),
                });
            }
            _ => return usage(),
        }
    }
    let mut config = match transport.as_str() {
        "tcp" => TransportConfig::default(),
        "rdma-soft" => TransportConfig::soft_rdma(),
        "rdma" => TransportConfig {
            kind: TransportKind::Rdma,
            ..TransportConfig::default()
        },
        "auto" => TransportConfig {
            kind: TransportKind::Auto,
            ..TransportConfig::default()
        },
        _ => return usage(),
    };
    if let Some(polling) = polling {
        config.rdma.polling = polling;
    }
    if let Some((interval, timeout)) = keepalive {
        config.rdma.keepalive_interval_ms = interval;
        config.rdma.keepalive_timeout_ms = timeout;
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("tessera-echo: {err}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(serve(config, &listen)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("tessera-echo: {err}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(config: TransportConfig, listen: &str) -> Result<(), Box<dyn std::error::Error>> {
    let transport = Transport::new(config)?;
    let listener = transport.listen(listen).await?;
    println!("listening on {}", listener.local_addr()?);
    let stdin_closed = tokio::task::spawn_blocking(|| {
        let mut sink = [0u8; 64];
        while matches!(std::io::stdin().read(&mut sink), Ok(n) if n > 0) {}
    });
    let accept = async {
        loop {
            let mut conn = match listener.accept().await {
                Ok(conn) => conn,
                Err(err) => {
                    eprintln!("tessera-echo: accept: {err}");
                    continue;
                }
            };
            tokio::spawn(async move {
                while let Ok(Some(message)) = conn.receiver.recv().await {
                    if conn.sender.send(Message::from(message)).await.is_err() {
                        break;
                    }
                }
            });
        }
    };
    tokio::select! {
        _ = stdin_closed => Ok(()),
        () = accept => Ok(()),
    }
}
