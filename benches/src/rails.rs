//! Rails (issue 36): 1 MiB message throughput between two transports of
//! one process with 1, 2 and 4 soft rails, each device's link limited to
//! the same rate, so that the links and not the CPU are the bottleneck.
//!
//! The client opens `sockets` connections (each RDMA connection goes to
//! the least-used rail, `transport/src/rdma/rails.rs`) and keeps each sending
//! 1 MiB messages into a sink that counts what arrives; the figure is the
//! bytes received in the measured seconds, after a warm-up. Rounds are
//! interleaved (1, 2, 4 rails, then again), and each rail count reports
//! its median and its ratio to one rail's median of the same run. One
//! connection uses one rail: several connections spread over the rails,
//! a single busy socket does not (striping is not built yet).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tessera_transport::{Message, SoftRail, Transport, TransportConfig};

use crate::transport::{BoxError, Tuning};

/// Bytes of each message.
const MESSAGE: usize = 1 << 20;

/// One measurement: bytes per second through `rails` rails.
async fn once(
    rails: usize,
    link_mbps: u64,
    sockets: usize,
    secs: f64,
    tuning: &Tuning,
) -> Result<f64, BoxError> {
    let config = || {
        let mut config = TransportConfig::soft_rdma();
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
    if sockets >= rails && spread.iter().any(|rail| rail.messages_sent == 0) {
        return Err(format!("a rail carried nothing: {spread:?}").into());
    }
    Ok((to - from) as f64 / elapsed.as_secs_f64())
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
    let mut measured: Vec<Vec<f64>> = vec![Vec::new(); counts.len()];
    for _ in 0..rounds.max(1) {
        for (i, &rails) in counts.iter().enumerate() {
            measured[i].push(once(rails, link_mbps, sockets, secs, tuning).await?);
        }
    }
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let one = counts
        .iter()
        .position(|&c| c == 1)
        .map(|i| median(&measured[i]));
    let link = link_mbps as f64 * 1e6 / 8.0;
    Ok(counts
        .iter()
        .zip(&measured)
        .map(|(&rails, runs)| {
            let m = median(runs);
            let target = match rails {
                2 => json!(">= 1.8"),
                4 => json!(">= 3.4"),
                _ => Value::Null,
            };
            json!({
                "bench": "rails",
                "test": "rails",
                "rails": rails,
                "link_mbps": link_mbps,
                "sockets": sockets,
                "mbytes_per_sec": m / 1e6,
                "runs_mbytes_per_sec": runs.iter().map(|r| format!("{:.1}", r / 1e6)).collect::<Vec<_>>().join(", "),
                "of_the_links": m / (link * rails as f64),
                "x_one_rail": one.map(|one| m / one),
                "target": target,
            })
        })
        .collect())
}
