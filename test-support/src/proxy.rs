//! A fault-injecting TCP proxy for the recovery tests: forwards each
//! accepted connection to an upstream address and, on command, delays the
//! bytes, resets every open connection, loses responses (resets a
//! connection instead of forwarding the server's answer, after the server
//! acted on the request), or turns away connections that
//! open with an RDMA hello (a broken RDMA path to a healthy server: the
//! soft provider's data moves through shared memory, but every RDMA
//! connection is set up, and watched, over its TCP control stream, which
//! runs through the proxy), or holds every byte back (a partition: the
//! bytes flow again, in order, when it heals, as TCP's retransmissions
//! would deliver them).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A running proxy; dropping it stops accepting (open connections end at
/// the next reset or when either side closes).
pub struct FaultProxy {
    /// The address clients dial.
    pub addr: String,
    faults: Arc<Faults>,
    reset: watch::Sender<u64>,
    accept: tokio::task::JoinHandle<()>,
}

#[derive(Default)]
struct Faults {
    refuse_rdma: AtomicBool,
    partitioned: AtomicBool,
    delay_ms: AtomicU64,
    lose_responses: AtomicU64,
    lost: AtomicU64,
    accepted: AtomicU64,
    refused: AtomicU64,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl FaultProxy {
    /// A proxy on a free loopback port in front of `upstream`.
    pub async fn start(upstream: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binding the proxy");
        let addr = listener
            .local_addr()
            .expect("the proxy's address")
            .to_string();
        let faults = Arc::new(Faults::default());
        let (reset, resets) = watch::channel(0u64);
        let accept = tokio::spawn({
            let faults = Arc::clone(&faults);
            async move {
                loop {
                    let Ok((client, _)) = listener.accept().await else {
                        continue;
                    };
                    faults.accepted.fetch_add(1, Ordering::SeqCst);
                    tokio::spawn(forward(
                        client,
                        upstream.clone(),
                        Arc::clone(&faults),
                        resets.clone(),
                    ));
                }
            }
        });
        Self {
            addr,
            faults,
            reset,
            accept,
        }
    }

    /// Turn away (close at once) new connections that open with an RDMA
    /// hello, or stop doing so.
    pub fn refuse_rdma(&self, refuse: bool) {
        self.faults.refuse_rdma.store(refuse, Ordering::SeqCst);
    }

    /// Hold every byte in both directions (and new connections) back until
    /// `partition(false)`: the peers see silence, not an error.
    pub fn partition(&self, on: bool) {
        self.faults.partitioned.store(on, Ordering::SeqCst);
    }

    /// Delay every forwarded chunk by `delay`.
    pub fn delay(&self, delay: Duration) {
        self.faults
            .delay_ms
            .store(delay.as_millis() as u64, Ordering::SeqCst);
    }

    /// The next `n` times the server sends something, reset that
    /// connection instead of forwarding it.
    pub fn lose_responses(&self, n: u64) {
        self.faults.lose_responses.store(n, Ordering::SeqCst);
    }

    /// Server answers lost so far.
    pub fn lost(&self) -> u64 {
        self.faults.lost.load(Ordering::SeqCst)
    }

    /// Reset every connection open now (RST to both sides).
    pub fn reset_all(&self) {
        self.reset.send_modify(|generation| *generation += 1);
    }

    /// Connections turned away for opening with an RDMA hello.
    pub fn refused(&self) -> u64 {
        self.faults.refused.load(Ordering::SeqCst)
    }
}

async fn forward(
    client: TcpStream,
    upstream: String,
    faults: Arc<Faults>,
    mut resets: watch::Receiver<u64>,
) {
    resets.mark_unchanged();
    if faults.refuse_rdma.load(Ordering::SeqCst) {
        let mut magic = [0u8; 4];
        let peeked = tokio::time::timeout(Duration::from_secs(1), client.peek(&mut magic)).await;
        if matches!(peeked, Ok(Ok(4))) && &magic == tessera_transport::rdma::connection::HELLO_MAGIC
        {
            faults.refused.fetch_add(1, Ordering::SeqCst);
            let _ = client.set_zero_linger();
            return;
        }
    }
    while faults.partitioned.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let Ok(server) = TcpStream::connect(&upstream).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let _ = client.set_zero_linger();
    let _ = server.set_zero_linger();
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let up = pipe(client_read, server_write, Arc::clone(&faults), false);
    let down = pipe(server_read, client_write, faults, true);
    // Either direction ending, or a reset, drops both streams; with linger
    // 0 the peers see a reset rather than an orderly close.
    tokio::select! {
        _ = up => {}
        _ = down => {}
        _ = resets.changed() => {}
    }
}

async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    faults: Arc<Faults>,
    from_server: bool,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if from_server
            && faults
                .lose_responses
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
        {
            faults.lost.fetch_add(1, Ordering::SeqCst);
            // Ending the pipe drops both streams: a reset to both sides.
            return;
        }
        while faults.partitioned.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let delay = faults.delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
