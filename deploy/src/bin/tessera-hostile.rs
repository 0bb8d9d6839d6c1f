//! `tessera-hostile`: hostile peers for the drills (issue 16), in a process
//! of their own.
//!
//! Opens `--stalled` + `--partial` TCP connections to `--addr`, from source
//! addresses `127.0.1.1` up to `127.0.1.<sources>` (loopback has all of
//! 127/8), the partial ones first; each announces a frame of `--announce`
//! bytes, sends `--send` bytes of its body (the partial ones; the stalled
//! ones nothing) and waits for the server to close the connection. For
//! each it prints one line when it is closed:
//! `closed <ms from its announcement to the close> <late 0|1> <body bytes the kernel took>`
//! (`late`: it could announce only over a second after its connection was
//! made, so the server's handshake bound may have closed it first), or
//! `failed <why>`, then `done`. The second counts from the connect call
//! (on loopback the kernel completes the handshake at once, whether or
//! not this process gets the CPU), not from when the peer was set out: a
//! starved process of these peers (the drill runs it at the lowest
//! priority, beside two CPU hogs) once waited seconds to open its sockets
//! at all, and every peer counted as late.
//!
//! Why a process: a drill runs these next to the worker whose Fetches it
//! measures. As a thread of the worker's process (at the lowest priority,
//! since in a fleet they are other hosts), a starved attacker thread
//! holding the process's memory-map lock (faulting in its 55 MiB body,
//! freeing it at the end) stalled every thread of the worker for 250-460 ms
//! under CPU hogs: priority inversion in the drill, not the server's doing.
//! Run it under `nice -n 19`.

#![allow(clippy::print_stdout)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Hostile peers against one address.
#[derive(Debug, Parser)]
struct Args {
    /// The server's Tessera TCP address (`ip:port`).
    #[arg(long)]
    addr: std::net::SocketAddr,
    /// Connections that announce a frame and send nothing of it.
    #[arg(long, default_value_t = 300)]
    stalled: usize,
    /// Connections that send `--send` bytes of the announced frame.
    #[arg(long, default_value_t = 60)]
    partial: usize,
    /// The frame length each announces.
    #[arg(long, default_value_t = 60 << 20)]
    announce: u32,
    /// The bytes of its body each partial sender tries to send.
    #[arg(long, default_value_t = 55 << 20)]
    send: usize,
    /// Source addresses `127.0.1.1 ..= 127.0.1.<sources>`.
    #[arg(long, default_value_t = 60)]
    sources: u8,
}

/// One hostile peer: (ms from its announcement to the close, late, body
/// bytes sent).
async fn attacker(
    addr: std::net::SocketAddr,
    from: std::net::IpAddr,
    announce: u32,
    body: Arc<Vec<u8>>,
) -> std::io::Result<(u128, bool, usize)> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind(std::net::SocketAddr::new(from, 0))?;
    let connecting = Instant::now();
    let mut raw = socket.connect(addr).await?;
    let announced = Instant::now();
    let late = announced.saturating_duration_since(connecting) > Duration::from_secs(1);
    raw.write_all(&announce.to_le_bytes()).await?;
    // The writes fail (or stop) once the server closes the connection.
    let mut sent = 0;
    for chunk in body.chunks(1 << 20) {
        if raw.write_all(chunk).await.is_err() {
            break;
        }
        sent += chunk.len();
    }
    let mut byte = [0u8; 1];
    loop {
        match raw.read(&mut byte).await {
            Ok(0) | Err(_) => return Ok((announced.elapsed().as_millis(), late, sent)),
            Ok(_) => {}
        }
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let body = Arc::new(vec![0x5Au8; args.send]);
        let empty = Arc::new(Vec::new());
        let sources = usize::from(args.sources.max(1));
        let mut attackers = tokio::task::JoinSet::new();
        // The partial senders first: they take the budget and fill it
        // (the stalled ones would take it with nothing sent).
        for i in 0..args.stalled + args.partial {
            let body = if i < args.partial {
                Arc::clone(&body)
            } else {
                Arc::clone(&empty)
            };
            let host = u8::try_from(1 + i % sources).unwrap_or(1);
            let from = std::net::IpAddr::from([127, 0, 1, host]);
            attackers.spawn(attacker(args.addr, from, args.announce, body));
        }
        while let Some(done) = attackers.join_next().await {
            match done {
                Ok(Ok((after, late, sent))) => {
                    println!("closed {after} {} {sent}", u8::from(late));
                }
                Ok(Err(err)) => println!("failed {err}"),
                Err(err) => println!("failed {err}"),
            }
        }
        println!("done");
    });
    Ok(())
}
