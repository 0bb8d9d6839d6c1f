//! Rails (issue 36): 1 MiB message throughput between two transports of
//! one process with 1, 2 and 4 soft rails, each device's link limited to
//! the same rate, so that the links and not the CPU are the bottleneck.
//!
//! Two layouts, each measured on 1, 2 and 4 rails:
//! - `spread`: the client opens `sockets` connections (each RDMA
//!   connection goes to the least-used rail, `transport/src/rdma/rails.rs`),
//!   the default configuration (confinement on, so no striping);
//! - `striped`: one connection, confinement off, so that its messages are
//!   striped over every rail (`transport/src/rdma/engine/stripes.rs`).
//!
//! Each connection keeps sending 1 MiB messages into a sink that counts
//! what arrives; the figure is the bytes received in the measured seconds,
//! after a warm-up. Rounds are interleaved (every layout and rail count,
//! then again), and each row reports its median and its ratio to one
//! rail's median of the same layout and run.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tessera_transport::{Message, SoftRail, Transport, TransportConfig};

use crate::transport::{BoxError, Tuning};

/// Bytes of each message.
const MESSAGE: usize = 1 << 20;

/// How the client loads the rails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// Many connections, each on one rail (no striping).
    Spread,
    /// One connection, its messages striped over the rails.
    Striped,
}

impl Layout {
    fn name(self) -> &'static str {
        match self {
            Layout::Spread => "spread",
            Layout::Striped => "striped",
        }
    }
}

/// One measurement: bytes per second through `rails` rails.
async fn once(
    layout: Layout,
    rails: usize,
    link_mbps: u64,
    sockets: usize,
    secs: f64,
    tuning: &Tuning,
) -> Result<(f64, Vec<f64>), BoxError> {
    let sockets = match layout {
        Layout::Spread => sockets,
        Layout::Striped => 1,
    };
    let config = || {
        let mut config = TransportConfig::soft_rdma();
        config.rdma.confine_remote_writes = layout == Layout::Spread;
        config.rdma.polling = tuning.polling;
        config.rdma.spin_us = tuning.spin_us;
        config.rdma.io_threads = tuning.io_threads;
        config.rdma.soft_rails = vec![
            SoftRail {
                link_mbps,
                port_file: None,
            };
            rails
        ];
        config
    };
    let server = Transport::new(config())?;
    let client = Transport::new(config())?;
    let listener = server.listen("127.0.0.1:0").await?;
    let addr = listener.local_addr()?.to_string();
    let received = Arc::new(AtomicU64::new(0));
    let sink = {
        let received = Arc::clone(&received);
        tokio::spawn(async move {
            while let Ok(mut conn) = listener.accept().await {
                let received = Arc::clone(&received);
                tokio::spawn(async move {
                    while let Ok(Some(message)) = conn.receiver.recv().await {
                        received.fetch_add(message.len() as u64, Ordering::Relaxed);
                    }
                });
            }
        })
    };
    let stop = Arc::new(AtomicBool::new(false));
    let mut senders = Vec::new();
    for _ in 0..sockets {
        let conn = client.connect(&addr).await?;
        let (client, stop) = (client.clone(), Arc::clone(&stop));
        senders.push(tokio::spawn(async move {
            let mut buf = client.send_pool().alloc(MESSAGE)?;
            buf.fill(0x5a);
            let message = buf.freeze();
            while !stop.load(Ordering::Relaxed) {
                conn.sender.send(Message::from(message.clone())).await?;
            }
            Ok::<_, BoxError>(conn)
        }));
    }
    // Warm-up: every connection set up and the links full.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (from, start) = (received.load(Ordering::Relaxed), Instant::now());
    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    let (to, elapsed) = (received.load(Ordering::Relaxed), start.elapsed());
    stop.store(true, Ordering::Relaxed);
    for sender in senders {
        sender.await??;
    }
    sink.abort();
    // With a connection per rail at least, every rail must have carried
    // some: the figure is then the rails', not one rail's.
    let spread = client.rail_stats();
    let carried = |rail: &tessera_transport::rdma::RdmaStats| match layout {
        Layout::Spread => rail.messages_sent > 0,
        Layout::Striped => rail.messages_sent > 0 || rail.striped_bytes > 0,
    };
    if (sockets >= rails || layout == Layout::Striped) && !spread.iter().all(carried) {
        return Err(format!("a rail carried nothing: {spread:?}").into());
    }
    // Each rail's share of the bytes the client put on the wire (the
    // whole run, warm-up included): its own messages' bytes less what
    // other rails wrote of them, plus what it wrote of theirs.
    let striped: u64 = spread.iter().map(|r| r.striped_bytes).sum();
    let wire: Vec<u64> = spread
        .iter()
        .map(|r| match r.stripe_chunks > 0 {
            true => r.bytes_sent.saturating_sub(striped) + r.striped_bytes,
            false => r.bytes_sent + r.striped_bytes,
        })
        .collect();
    let total = wire.iter().sum::<u64>().max(1) as f64;
    let shares = wire.iter().map(|&w| w as f64 / total).collect();
    Ok(((to - from) as f64 / elapsed.as_secs_f64(), shares))
}

/// Throughput of 1 MiB messages over each count of `rails` (soft devices
/// whose links run at `link_mbps` each), `sockets` connections, `rounds`
/// interleaved rounds of `secs` seconds; rows with the median and the
/// ratio to one rail's.
pub async fn rails(
    counts: &[usize],
    link_mbps: u64,
    sockets: usize,
    secs: f64,
    rounds: usize,
    tuning: &Tuning,
) -> Result<Vec<Value>, BoxError> {
    let layouts = [Layout::Spread, Layout::Striped];
    let cases: Vec<(Layout, usize)> = layouts
        .iter()
        .flat_map(|&layout| counts.iter().map(move |&rails| (layout, rails)))
        .collect();
    let mut measured: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    // The rails' shares in each case's last run.
    let mut shares: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    for _ in 0..rounds.max(1) {
        for (i, &(layout, rails)) in cases.iter().enumerate() {
            let (rate, share) = once(layout, rails, link_mbps, sockets, secs, tuning).await?;
            measured[i].push(rate);
            shares[i] = share;
        }
    }
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    // One rail's median of the same layout.
    let one = |layout: Layout| {
        cases
            .iter()
            .position(|&case| case == (layout, 1))
            .map(|i| median(&measured[i]))
    };
    let link = link_mbps as f64 * 1e6 / 8.0;
    Ok(cases
        .iter()
        .zip(measured.iter().zip(&shares))
        .map(|(&(layout, rails), (runs, share))| {
            let m = median(runs);
            let target = match rails {
                2 => json!(">= 1.8"),
                4 => json!(">= 3.4"),
                _ => Value::Null,
            };
            json!({
                "bench": "rails",
                "test": "rails",
                "layout": layout.name(),
                "rails": rails,
                "link_mbps": link_mbps,
                "sockets": if layout == Layout::Spread { sockets } else { 1 },
                "mbytes_per_sec": m / 1e6,
                "runs_mbytes_per_sec": runs.iter().map(|r| format!("{:.1}", r / 1e6)).collect::<Vec<_>>().join(", "),
                "of_the_links": m / (link * rails as f64),
                "x_one_rail": one(layout).map(|one| m / one),
                "rail_shares": share.iter().map(|s| format!("{s:.2}")).collect::<Vec<_>>().join(", "),
                "target": target,
            })
        })
        .collect())
}
