//! `tessera-bench transport`: the transport alone (no RPC), between two
//! processes, RDMA over the soft RNIC against TCP on loopback, measured in
//! the same run (the paper's Figures 8 and 9).
//!
//! - **latency**: round trip of one message echoed whole, one outstanding,
//!   sizes 32 B to 16 KiB: mean, p50, p99.
//! - **throughput**: 1 MiB messages answered with 32 bytes, `concurrency`
//!   outstanding on one connection, for a fixed time: GB/s of payload.
//! - **memcpy**: one thread copying 1 MiB buffers, the ceiling a soft NIC
//!   (which moves bytes with the CPU) can approach.
//!
//! The server is a child process (`tessera-bench transport-server`); the
//! first byte of each message tells it whether to echo (0) or acknowledge
//! (1).

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use serde::Serialize;
use tessera_transport::{Connection, Message, Transport, TransportConfig};

/// Boxed error of the benchmark.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// First byte of a message the server echoes whole.
pub const ECHO: u8 = 0;
/// First byte of a message the server answers with 32 bytes.
pub const ACK: u8 = 1;
/// Bytes of an acknowledgement.
pub const ACK_LEN: usize = 32;

/// A transport under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// TCP on loopback.
    Tcp,
    /// RDMA over the soft RNIC, with this fragment size.
    RdmaSoft {
        /// Bytes per RDMA WRITE of a large message.
        fragment_size: u32,
    },
    /// The same without remote-write confinement
    /// (`rdma.confine_remote_writes = false`: grants use the receive
    /// pool's own keys, no window bind or invalidation per large message):
    /// what confinement costs.
    RdmaSoftOpen {
        /// Bytes per RDMA WRITE of a large message.
        fragment_size: u32,
    },
}

impl Kind {
    /// The name in reports.
    pub fn label(self) -> &'static str {
        match self {
            Kind::Tcp => "tcp",
            Kind::RdmaSoft { .. } => "rdma-soft",
            Kind::RdmaSoftOpen { .. } => "rdma-soft-open",
        }
    }

    /// The transport configuration it stands for.
    pub fn config(self, tuning: &Tuning) -> TransportConfig {
        match self {
            Kind::Tcp => TransportConfig::default(),
            Kind::RdmaSoft { fragment_size } | Kind::RdmaSoftOpen { fragment_size } => {
                let mut config = TransportConfig::soft_rdma();
                config.rdma.fragment_size = fragment_size as usize;
                config.rdma.polling = tuning.polling;
                config.rdma.spin_us = tuning.spin_us;
                config.rdma.io_threads = tuning.io_threads;
                config.rdma.soft_link_mbps = tuning.link_mbps;
                config.rdma.confine_remote_writes = matches!(self, Kind::RdmaSoft { .. });
                config
            }
        }
    }

    /// Command-line form (`tcp`, `rdma-soft:65536`).
    pub fn arg(self) -> String {
        match self {
            Kind::Tcp => "tcp".into(),
            Kind::RdmaSoft { fragment_size } => format!("rdma-soft:{fragment_size}"),
            Kind::RdmaSoftOpen { fragment_size } => format!("rdma-soft-open:{fragment_size}"),
        }
    }

    /// Parses [`Kind::arg`]'s form.
    pub fn parse(arg: &str) -> Result<Self, BoxError> {
        match arg.split_once(':') {
            None if arg == "tcp" => Ok(Kind::Tcp),
            Some(("rdma-soft", size)) => Ok(Kind::RdmaSoft {
                fragment_size: size.parse()?,
            }),
            Some(("rdma-soft-open", size)) => Ok(Kind::RdmaSoftOpen {
                fragment_size: size.parse()?,
            }),
            _ => Err(format!("unknown transport {arg}").into()),
        }
    }
}

/// How the RDMA side's I/O threads run (both processes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tuning {
    /// Event or busy I/O threads, or the runtime.
    pub polling: tessera_transport::Polling,
    /// Spin budget of event mode, microseconds.
    pub spin_us: u64,
    /// I/O threads per process.
    pub io_threads: usize,
    /// The soft devices' link rate, Mbit/s each way (`soft_link_mbps`;
    /// 0: unlimited, a copy in memory).
    pub link_mbps: u64,
}

impl Tuning {
    /// Command-line form for the server process.
    pub fn args(&self) -> Vec<String> {
        let polling = match self.polling {
            tessera_transport::Polling::Busy => "busy",
            tessera_transport::Polling::Runtime => "runtime",
            _ => "event",
        };
        vec![
            "--polling".into(),
            polling.into(),
            "--spin-us".into(),
            self.spin_us.to_string(),
            "--io-threads".into(),
            self.io_threads.to_string(),
            "--link-mbps".into(),
            self.link_mbps.to_string(),
        ]
    }
}

/// One JSON row of the report.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// Always `transport`.
    pub bench: &'static str,
    /// `latency`, `throughput` or `memcpy`.
    pub test: &'static str,
    /// `tcp`, `rdma-soft` or `memcpy`.
    pub transport: &'static str,
    /// Message size in bytes.
    pub size: usize,
    /// RDMA fragment size (rdma rows).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fragment_size: Option<u32>,
    /// Round-trip percentiles and mean, microseconds.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// Mean.
    pub mean_us: f64,
    /// Payload bytes per second / 1e9 (throughput and memcpy rows).
    pub gbytes_per_sec: f64,
}

/// What to measure.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Measured round trips per latency size (plus 10% warm-up).
    pub iterations: u32,
    /// Latency message sizes.
    pub sizes: Vec<usize>,
    /// Seconds of each throughput run.
    pub throughput_secs: f64,
    /// Throughput message size.
    pub throughput_size: usize,
    /// Messages outstanding in a throughput run.
    pub concurrency: usize,
    /// RDMA fragment sizes to run throughput with (the first is used for
    /// latency).
    pub fragment_sizes: Vec<u32>,
    /// I/O thread settings of the RDMA runs.
    pub tuning: Tuning,
}

/// A benchmark server process (`tessera-bench transport-server`).
pub struct Server {
    child: Child,
    /// Its address.
    pub addr: String,
}

impl Server {
    /// Starts one serving `kind` with `tuning`.
    pub fn start(kind: Kind, tuning: &Tuning) -> Result<Self, BoxError> {
        let mut child = Command::new(std::env::current_exe()?)
            .args(["transport-server", &kind.arg()])
            .args(tuning.args())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let stdout = child.stdout.take().ok_or("server without stdout")?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .ok_or_else(|| format!("transport server said {line:?}"))?
            .to_string();
        Ok(Self { child, addr })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The server side: echo or acknowledge every message until stdin closes.
#[allow(clippy::print_stdout)]
pub async fn serve(kind: Kind, tuning: &Tuning) -> Result<(), BoxError> {
    let transport = Transport::new(kind.config(tuning))?;
    let listener = transport.listen("127.0.0.1:0").await?;
    println!("listening on {}", listener.local_addr()?);
    let stdin_closed = tokio::task::spawn_blocking(|| {
        let mut sink = [0u8; 64];
        while matches!(std::io::stdin().read(&mut sink), Ok(n) if n > 0) {}
    });
    let mut ack = transport.send_pool().alloc(ACK_LEN)?;
    ack.fill(ACK);
    let ack = ack.freeze();
    let accept = async {
        loop {
            let Ok(mut conn) = listener.accept().await else {
                continue;
            };
            let ack = ack.clone();
            tokio::spawn(async move {
                while let Ok(Some(message)) = conn.receiver.recv().await {
                    let reply = if message.first() == Some(&ACK) {
                        ack.clone()
                    } else {
                        message
                    };
                    if conn.sender.send(Message::from(reply)).await.is_err() {
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

/// A histogram of nanoseconds.
pub fn histogram() -> Result<Histogram<u64>, BoxError> {
    Ok(Histogram::new_with_bounds(1, 60_000_000_000, 3)?)
}

/// `d` in nanoseconds, at least 1.
/// Whole microseconds of `d`, at least 1 (histograms record from 1).
pub fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_nanos() / 1000)
        .unwrap_or(u64::MAX)
        .max(1)
}

/// Whole nanoseconds of `d`.
pub fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX).max(1)
}

/// Nanoseconds as microseconds.
pub fn us(ns: f64) -> f64 {
    ns / 1000.0
}

/// The next message, within 30 s.
pub async fn recv(conn: &mut Connection) -> Result<Bytes, BoxError> {
    match tokio::time::timeout(Duration::from_secs(30), conn.receiver.recv()).await {
        Ok(Ok(Some(message))) => Ok(message),
        Ok(Ok(None)) => Err("server closed the connection".into()),
        Ok(Err(err)) => Err(err.into()),
        Err(_) => Err("no answer within 30 s".into()),
    }
}

/// A `size`-byte message in `transport`'s send pool, first byte `mode`.
pub fn payload(transport: &Transport, size: usize, mode: u8) -> Result<Bytes, BoxError> {
    let mut buf = transport.send_pool().alloc(size)?;
    for (i, byte) in buf.iter_mut().enumerate() {
        *byte = (i % 251) as u8;
    }
    if let Some(first) = buf.first_mut() {
        *first = mode;
    }
    Ok(buf.freeze())
}

async fn latency(
    transport: &Transport,
    conn: &mut Connection,
    kind: Kind,
    size: usize,
    iterations: u32,
) -> Result<Row, BoxError> {
    let message = payload(transport, size, ECHO)?;
    let mut hist = histogram()?;
    for i in 0..iterations + iterations / 10 {
        let started = Instant::now();
        conn.sender.send(Message::from(message.clone())).await?;
        let back = recv(conn).await?;
        let elapsed = started.elapsed();
        if back.len() != size {
            return Err(format!("echo of {size} bytes came back with {}", back.len()).into());
        }
        if i >= iterations / 10 {
            hist.record(nanos(elapsed))?;
        }
    }
    Ok(Row {
        bench: "transport",
        test: "latency",
        transport: kind.label(),
        size,
        fragment_size: fragment_of(kind),
        p50_us: us(hist.value_at_quantile(0.5) as f64),
        p99_us: us(hist.value_at_quantile(0.99) as f64),
        mean_us: us(hist.mean()),
        gbytes_per_sec: 0.0,
    })
}

fn fragment_of(kind: Kind) -> Option<u32> {
    match kind {
        Kind::Tcp => None,
        Kind::RdmaSoft { fragment_size } | Kind::RdmaSoftOpen { fragment_size } => {
            Some(fragment_size)
        }
    }
}

/// Throughput of `size`-byte messages, `concurrency` outstanding, for
/// `secs`, each answered with an acknowledgement.
pub async fn throughput(
    transport: &Transport,
    conn: &mut Connection,
    kind: Kind,
    size: usize,
    concurrency: usize,
    secs: f64,
) -> Result<Row, BoxError> {
    let message = payload(transport, size, ACK)?;
    let mut hist = histogram()?;
    let mut sent_at = std::collections::VecDeque::new();
    // Warm-up: one round of the window.
    for _ in 0..concurrency {
        conn.sender.send(Message::from(message.clone())).await?;
    }
    for _ in 0..concurrency {
        recv(conn).await?;
    }
    let started = Instant::now();
    let until = started + Duration::from_secs_f64(secs);
    for _ in 0..concurrency {
        sent_at.push_back(Instant::now());
        conn.sender.send(Message::from(message.clone())).await?;
    }
    let mut done: u64 = 0;
    while let Some(sent) = sent_at.pop_front() {
        let ack = recv(conn).await?;
        if ack.len() != ACK_LEN {
            return Err(format!("acknowledgement of {} bytes", ack.len()).into());
        }
        hist.record(nanos(sent.elapsed()))?;
        done += 1;
        if Instant::now() < until {
            sent_at.push_back(Instant::now());
            conn.sender.send(Message::from(message.clone())).await?;
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    Ok(Row {
        bench: "transport",
        test: "throughput",
        transport: kind.label(),
        size,
        fragment_size: fragment_of(kind),
        p50_us: us(hist.value_at_quantile(0.5) as f64),
        p99_us: us(hist.value_at_quantile(0.99) as f64),
        mean_us: us(hist.mean()),
        gbytes_per_sec: done as f64 * size as f64 / elapsed / 1e9,
    })
}

/// Single-thread memcpy bandwidth over `size`-byte buffers (pool memory,
/// as the soft NIC copies), for about `secs` seconds.
pub fn memcpy(size: usize, secs: f64) -> Result<Row, BoxError> {
    let transport = Transport::new(TransportConfig::default())?;
    let source = payload(&transport, size, 0)?;
    // Several destinations, so the copy is not served from one hot cache
    // line set.
    let mut targets = (0..8)
        .map(|_| transport.recv_pool().alloc(size))
        .collect::<Result<Vec<_>, _>>()?;
    let started = Instant::now();
    let mut copies: u64 = 0;
    while started.elapsed().as_secs_f64() < secs {
        for target in &mut targets {
            target.copy_from_slice(&source);
            copies += 1;
        }
        std::hint::black_box(&targets);
    }
    let elapsed = started.elapsed().as_secs_f64();
    Ok(Row {
        bench: "transport",
        test: "memcpy",
        transport: "memcpy",
        size,
        fragment_size: None,
        p50_us: 0.0,
        p99_us: 0.0,
        mean_us: 0.0,
        gbytes_per_sec: copies as f64 * size as f64 / elapsed / 1e9,
    })
}

/// Runs the plan against a server process per transport.
pub async fn run(plan: &Plan) -> Result<Vec<Row>, BoxError> {
    let mut rows = Vec::new();
    let first_fragment = plan.fragment_sizes.first().copied().unwrap_or(65536);
    let mut kinds = vec![Kind::Tcp];
    kinds.extend(
        plan.fragment_sizes
            .iter()
            .map(|&fragment_size| Kind::RdmaSoft { fragment_size }),
    );
    // What confinement costs: the first fragment size again without it.
    kinds.push(Kind::RdmaSoftOpen {
        fragment_size: first_fragment,
    });
    for kind in kinds {
        let server = Server::start(kind, &plan.tuning)?;
        let transport = Transport::new(kind.config(&plan.tuning))?;
        let mut conn = transport.connect(&server.addr).await?;
        let latency_run = match kind {
            Kind::Tcp | Kind::RdmaSoftOpen { .. } => true,
            Kind::RdmaSoft { fragment_size } => fragment_size == first_fragment,
        };
        if latency_run {
            // Warm the connection up first (first touches of pool memory
            // and of the peer's mappings, thread wake-ups settling).
            latency(&transport, &mut conn, kind, 32, plan.iterations.min(2000)).await?;
            for &size in &plan.sizes {
                rows.push(latency(&transport, &mut conn, kind, size, plan.iterations).await?);
            }
        }
        rows.push(
            throughput(
                &transport,
                &mut conn,
                kind,
                plan.throughput_size,
                plan.concurrency,
                plan.throughput_secs,
            )
            .await?,
        );
        drop(conn);
        drop(server);
    }
    rows.push(memcpy(plan.throughput_size, plan.throughput_secs.min(2.0))?);
    Ok(rows)
}

/// The report: latency by size, throughput by fragment size, ratios.
pub fn markdown(rows: &[Row], plan: &Plan) -> String {
    let find = |test: &str, transport: &str, size: usize, fragment: Option<u32>| {
        rows.iter().find(|r| {
            r.test == test
                && r.transport == transport
                && r.size == size
                && (fragment.is_none() || r.fragment_size == fragment)
        })
    };
    let mut out = format!(
        "transport: two processes on loopback; latency = one message outstanding, {} round trips per size; \
         throughput = {} B messages, {} outstanding, {} s, 32-byte answers; rdma I/O threads: {} per process, {:?} polling, spin {} µs\n\n",
        plan.iterations,
        plan.throughput_size,
        plan.concurrency,
        plan.throughput_secs,
        plan.tuning.io_threads,
        plan.tuning.polling,
        plan.tuning.spin_us
    );
    out.push_str("| size B | tcp p50 µs | tcp p99 µs | tcp mean µs | rdma-soft p50 µs | rdma-soft p99 µs | rdma-soft mean µs | p50 rdma/tcp |\n");
    out.push_str("|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for &size in &plan.sizes {
        let (Some(tcp), Some(rdma)) = (
            find("latency", "tcp", size, None),
            find("latency", "rdma-soft", size, None),
        ) else {
            continue;
        };
        out.push_str(&format!(
            "| {size} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} |\n",
            tcp.p50_us,
            tcp.p99_us,
            tcp.mean_us,
            rdma.p50_us,
            rdma.p99_us,
            rdma.mean_us,
            rdma.p50_us / tcp.p50_us.max(f64::MIN_POSITIVE)
        ));
    }
    let tcp = find("throughput", "tcp", plan.throughput_size, None);
    let memcpy = find("memcpy", "memcpy", plan.throughput_size, None);
    let tcp_gbs = tcp.map_or(0.0, |r| r.gbytes_per_sec);
    let memcpy_gbs = memcpy.map_or(0.0, |r| r.gbytes_per_sec);
    out.push_str(&format!(
        "\n| transport | fragment | GB/s | vs tcp | vs memcpy | p50 µs | p99 µs |\n|---|---:|---:|---:|---:|---:|---:|\n| memcpy | | {memcpy_gbs:.2} | {:.2} | 1.00 | | |\n",
        memcpy_gbs / tcp_gbs.max(f64::MIN_POSITIVE)
    ));
    for row in rows.iter().filter(|r| r.test == "throughput") {
        out.push_str(&format!(
            "| {} | {} | {:.2} | {:.2} | {:.2} | {:.0} | {:.0} |\n",
            row.transport,
            row.fragment_size.map_or(String::new(), |f| f.to_string()),
            row.gbytes_per_sec,
            row.gbytes_per_sec / tcp_gbs.max(f64::MIN_POSITIVE),
            row.gbytes_per_sec / memcpy_gbs.max(f64::MIN_POSITIVE),
            row.p50_us,
            row.p99_us
        ));
    }
    // Confinement's cost: the same runs with grants through the pool's
    // own keys (no window bind and invalidation per large message).
    // Messages up to `small_message_limit` go by SEND and never use a
    // window: their ratio is the run's noise.
    out.push_str(&format!(
        "\nremote-write confinement: messages above {} B go through a memory window (a bind and an invalidation each); smaller ones never do, so their ratio is this run's noise\n\n| | size B | confined (windows) | open (pool keys) | confined / open |\n|---|---:|---:|---:|---:|\n",
        TransportConfig::default().rdma.small_message_limit
    ));
    for &size in &plan.sizes {
        let (Some(confined), Some(open)) = (
            find("latency", "rdma-soft", size, None),
            find("latency", "rdma-soft-open", size, None),
        ) else {
            continue;
        };
        out.push_str(&format!(
            "| latency p50 µs | {size} | {:.1} | {:.1} | {:.2} |\n| latency p99 µs | {size} | {:.1} | {:.1} | {:.2} |\n",
            confined.p50_us,
            open.p50_us,
            confined.p50_us / open.p50_us.max(f64::MIN_POSITIVE),
            confined.p99_us,
            open.p99_us,
            confined.p99_us / open.p99_us.max(f64::MIN_POSITIVE),
        ));
    }
    let first = plan.fragment_sizes.first().copied();
    if let (Some(confined), Some(open)) = (
        find("throughput", "rdma-soft", plan.throughput_size, first),
        find("throughput", "rdma-soft-open", plan.throughput_size, first),
    ) {
        out.push_str(&format!(
            "| throughput GB/s | {} | {:.2} | {:.2} | {:.2} |\n",
            plan.throughput_size,
            confined.gbytes_per_sec,
            open.gbytes_per_sec,
            confined.gbytes_per_sec / open.gbytes_per_sec.max(f64::MIN_POSITIVE),
        ));
    }
    out
}
