//! Benchmarks of the RDMA engine's scaling controls (paper §6), over the
//! soft RNIC between two processes (a `tessera-bench transport-server`
//! child is the receiver):
//!
//! - [`fragment`]: throughput of 1 MiB messages vs fragment size (Fig. 10).
//! - [`hol`]: round trip of a small flow sharing its QP with 0..8 large
//!   flows, with and without fragmentation (Fig. 13).
//! - [`incast`]: many senders, each with its own engine, towards one
//!   receiver, with the send window off and at 4, 8, 16 KiB (Fig. 15,
//!   Table 4).
//! - [`qps`]: 512-byte message rate vs number of QPs (Fig. 11).
//!
//! Every run reports rows as JSON values (the `bench` and `test` fields
//! name them) that the binary writes to `<bench>.json` and `<bench>.md`.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use tessera_transport::{Message, Transport, TransportConfig};

use crate::transport::{
    ACK, ACK_LEN, BoxError, ECHO, Kind, Server, Tuning, histogram, nanos, payload, recv,
    throughput, us,
};

/// The default fragment size, and "no fragmentation" (one WRITE per
/// message of up to 64 MiB).
const WITH_FRAGMENTS: u32 = 64 << 10;
const WHOLE_MESSAGES: u32 = 64 << 20;

fn rdma(fragment_size: u32, tuning: &Tuning) -> TransportConfig {
    Kind::RdmaSoft { fragment_size }.config(tuning)
}

/// Throughput of 1 MiB messages (8 outstanding) for each fragment size.
pub async fn fragment(sizes: &[u32], secs: f64, tuning: &Tuning) -> Result<Vec<Value>, BoxError> {
    let mut rows = Vec::new();
    for &size in sizes {
        let kind = Kind::RdmaSoft {
            fragment_size: size,
        };
        let server = Server::start(kind, tuning)?;
        let transport = Transport::new(kind.config(tuning))?;
        let mut conn = transport.connect(&server.addr).await?;
        let row = throughput(&transport, &mut conn, kind, 1 << 20, 8, secs).await?;
        rows.push(json!({
            "bench": "fragment",
            "test": "fragment",
            "fragment_bytes": size,
            "gbytes_per_sec": row.gbytes_per_sec,
            "p50_us": row.p50_us,
            "p99_us": row.p99_us,
        }));
    }
    Ok(rows)
}

/// Small-flow round trips (512 B) with `large` concurrent 1 MiB flows on
/// the same QP.
async fn hol_once(
    fragmentation: bool,
    large: usize,
    iterations: u32,
    tuning: &Tuning,
) -> Result<Value, BoxError> {
    let fragment_size = if fragmentation {
        WITH_FRAGMENTS
    } else {
        WHOLE_MESSAGES
    };
    let kind = Kind::RdmaSoft { fragment_size };
    let server = Server::start(kind, tuning)?;
    let transport = Transport::new(rdma(fragment_size, tuning))?;
    let mut small = transport.connect(&server.addr).await?;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut flows = Vec::new();
    for _ in 0..large {
        // Multiplexed: the same QP as the small flow.
        let mut conn = transport.connect(&server.addr).await?;
        let message = payload(&transport, 1 << 20, ACK)?;
        let stop = std::sync::Arc::clone(&stop);
        flows.push(tokio::spawn(async move {
            let mut outstanding = 0;
            loop {
                while outstanding < 4 && !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    conn.sender.send(Message::from(message.clone())).await?;
                    outstanding += 1;
                }
                if outstanding == 0 {
                    return Ok::<_, BoxError>(());
                }
                recv(&mut conn).await?;
                outstanding -= 1;
            }
        }));
    }
    let qps = transport.rdma_stats().map_or(0, |s| s.qps_open);
    let message = payload(&transport, 512, ECHO)?;
    let mut hist = histogram()?;
    // Let the large flows get going.
    tokio::time::sleep(Duration::from_millis(100)).await;
    for i in 0..iterations + iterations / 10 {
        let started = Instant::now();
        small.sender.send(Message::from(message.clone())).await?;
        let back = recv(&mut small).await?;
        if back.len() != 512 {
            return Err(format!("small echo of {} bytes", back.len()).into());
        }
        if i >= iterations / 10 {
            hist.record(nanos(started.elapsed()))?;
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for flow in flows {
        flow.await??;
    }
    Ok(json!({
        "bench": "hol",
        "test": "hol",
        "fragmentation": fragmentation,
        "fragment_bytes": fragment_size,
        "large_flows": large,
        "qps_open": qps,
        "p50_us": us(hist.value_at_quantile(0.5) as f64),
        "p99_us": us(hist.value_at_quantile(0.99) as f64),
        "mean_us": us(hist.mean()),
    }))
}

/// `hol_once` for each count of large flows, with and without
/// fragmentation.
pub async fn hol(
    large: &[usize],
    iterations: u32,
    tuning: &Tuning,
) -> Result<Vec<Value>, BoxError> {
    let mut rows = Vec::new();
    for fragmentation in [true, false] {
        for &n in large {
            rows.push(hol_once(fragmentation, n, iterations, tuning).await?);
        }
    }
    Ok(rows)
}

/// One sender of an incast: its own transport (device, engine), messages
/// of 20–50 KiB, `depth` outstanding, for `secs`.
/// Messages each incast sender keeps outstanding (the simulator's
/// calibration keeps as many).
pub const INCAST_DEPTH: usize = 4;

/// The message sizes an incast sender of `seed` cycles through: 8 drawn
/// uniformly from 20 to 50 KiB (the fabric simulator's calibration sends
/// the very same).
pub fn incast_sizes(seed: u64) -> Vec<usize> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..8)
        .map(|_| rng.random_range(20 << 10..=50 << 10))
        .collect()
}

/// An incast sender's transport configuration (the simulator's
/// calibration runs its engines with the very same).
pub fn incast_config(window: usize, tuning: &Tuning) -> TransportConfig {
    let mut config = rdma(WITH_FRAGMENTS, tuning);
    config.rdma.window_bytes = window;
    config
}

async fn incast_sender(
    addr: String,
    window: usize,
    seed: u64,
    secs: f64,
    tuning: Tuning,
    ready: Arc<tokio::sync::Barrier>,
) -> Result<SenderRun, BoxError> {
    let transport = Transport::new(incast_config(window, &tuning))?;
    let mut conn = transport.connect(&addr).await?;
    let buffers: Vec<_> = incast_sizes(seed)
        .into_iter()
        .map(|len| payload(&transport, len, ACK))
        .collect::<Result<_, _>>()?;
    // Every sender connected before any sends: connecting is not part of
    // the measured time.
    ready.wait().await;
    let started = Instant::now();
    let mut ended = started;
    let depth = INCAST_DEPTH;
    let until = started + Duration::from_secs_f64(secs);
    let mut sent_at = VecDeque::new();
    let mut bytes = 0u64;
    let mut latencies = Vec::new();
    let mut i = 0;
    loop {
        while sent_at.len() < depth && Instant::now() < until {
            let message = buffers[i % buffers.len()].clone();
            i += 1;
            sent_at.push_back((Instant::now(), message.len()));
            conn.sender.send(Message::from(message)).await?;
        }
        let Some((sent, len)) = sent_at.pop_front() else {
            break;
        };
        let ack = recv(&mut conn).await?;
        if ack.len() != ACK_LEN {
            return Err("bad acknowledgement".into());
        }
        ended = Instant::now();
        latencies.push(nanos(ended - sent));
        bytes += len as u64;
    }
    // The counters are refreshed every 100 ms.
    tokio::time::sleep(Duration::from_millis(150)).await;
    let peak = transport.rdma_stats().map_or(0, |s| s.peak_in_flight_bytes);
    Ok(SenderRun {
        bytes,
        latencies,
        peak,
        started,
        ended,
    })
}

/// What one incast sender measured.
struct SenderRun {
    bytes: u64,
    latencies: Vec<u64>,
    peak: u64,
    /// When it began sending (all began together).
    started: Instant,
    /// Its last acknowledgement.
    ended: Instant,
}

/// `senders` senders towards one receiver, for each window size (0 = off).
pub async fn incast(
    senders: usize,
    windows: &[usize],
    secs: f64,
    tuning: &Tuning,
) -> Result<Vec<Value>, BoxError> {
    let mut rows = Vec::new();
    for &window in windows {
        let server = Server::start(
            Kind::RdmaSoft {
                fragment_size: WITH_FRAGMENTS,
            },
            tuning,
        )?;
        let ready = Arc::new(tokio::sync::Barrier::new(senders));
        let tasks: Vec<_> = (0..senders)
            .map(|s| {
                tokio::spawn(incast_sender(
                    server.addr.clone(),
                    window,
                    s as u64 + 1,
                    secs,
                    *tuning,
                    ready.clone(),
                ))
            })
            .collect();
        let mut bytes = 0u64;
        let mut hist = histogram()?;
        let mut peak_sum = 0u64;
        let mut peak_max = 0u64;
        let mut span: Option<(Instant, Instant)> = None;
        let (mut least, mut most) = (u64::MAX, 0u64);
        for task in tasks {
            let run = task.await??;
            bytes += run.bytes;
            least = least.min(run.bytes);
            most = most.max(run.bytes);
            for l in run.latencies {
                hist.record(l)?;
            }
            peak_sum += run.peak;
            peak_max = peak_max.max(run.peak);
            span = Some(match span {
                None => (run.started, run.ended),
                Some((a, b)) => (a.min(run.started), b.max(run.ended)),
            });
        }
        // From the first send to the last acknowledgement.
        let elapsed = span.map_or(0.0, |(a, b)| (b - a).as_secs_f64());
        rows.push(json!({
            "bench": "incast",
            "test": "incast",
            "senders": senders,
            "window_bytes": window,
            "link_mbps": tuning.link_mbps,
            "goodput_gbytes_per_sec": bytes as f64 / elapsed.max(1e-9) / 1e9,
            "p50_us": us(hist.value_at_quantile(0.5) as f64),
            "p99_us": us(hist.value_at_quantile(0.99) as f64),
            // How evenly the receiver's link was shared (1: evenly).
            "sender_bytes_min_over_max": least as f64 / most.max(1) as f64,
            "peak_inflight_bytes": peak_sum,
            "peak_inflight_per_sender_max": peak_max,
            "bound_bytes": if window == 0 { Value::Null } else { json!(senders * window) },
        }));
    }
    Ok(rows)
}

/// 512-byte messages over `n` QPs (no multiplexing), `depth` outstanding
/// on each, for `secs`.
async fn qps_once(n: usize, secs: f64, tuning: &Tuning) -> Result<Value, BoxError> {
    let kind = Kind::RdmaSoft {
        fragment_size: WITH_FRAGMENTS,
    };
    let server = Server::start(kind, tuning)?;
    let mut config = kind.config(tuning);
    config.rdma.multiplex = false;
    let transport = Transport::new(config)?;
    let mut conns = Vec::with_capacity(n);
    for _ in 0..n {
        conns.push(transport.connect(&server.addr).await?);
    }
    let message = payload(&transport, 512, ACK)?;
    let depth = 4;
    let until = Instant::now() + Duration::from_secs_f64(secs);
    let started = Instant::now();
    let tasks: Vec<_> = conns
        .into_iter()
        .map(|mut conn| {
            let message = message.clone();
            tokio::spawn(async move {
                let mut done = 0u64;
                let mut outstanding = 0;
                loop {
                    while outstanding < depth && Instant::now() < until {
                        conn.sender.send(Message::from(message.clone())).await?;
                        outstanding += 1;
                    }
                    if outstanding == 0 {
                        return Ok::<_, BoxError>(done);
                    }
                    recv(&mut conn).await?;
                    outstanding -= 1;
                    done += 1;
                }
            })
        })
        .collect();
    let qps_open = transport.rdma_stats().map_or(0, |s| s.qps_open);
    let mut done = 0;
    for task in tasks {
        done += task.await??;
    }
    Ok(json!({
        "bench": "qps",
        "test": "qps",
        "qps": n,
        "qps_open": qps_open,
        "io_threads": tuning.io_threads,
        "msgs_per_sec": done as f64 / started.elapsed().as_secs_f64(),
    }))
}

/// `qps_once` for each QP count.
pub async fn qps(counts: &[usize], secs: f64, tuning: &Tuning) -> Result<Vec<Value>, BoxError> {
    let mut rows = Vec::new();
    for &n in counts {
        rows.push(qps_once(n, secs, tuning).await?);
    }
    Ok(rows)
}

/// A markdown table of `rows` with these columns (JSON field names).
pub fn markdown(title: &str, rows: &[Value], columns: &[&str]) -> String {
    let mut out = format!("{title}\n\n| {} |\n", columns.join(" | "));
    out.push_str(&format!("|{}\n", "---:|".repeat(columns.len())));
    for row in rows {
        let cells: Vec<String> = columns
            .iter()
            .map(|c| match &row[*c] {
                Value::Number(n) if n.is_f64() => format!("{:.2}", n.as_f64().unwrap_or(0.0)),
                Value::Null => "-".into(),
                Value::String(text) => text.clone(),
                other => other.to_string(),
            })
            .collect();
        out.push_str(&format!("| {} |\n", cells.join(" | ")));
    }
    out
}
