//! `tessera-bench`: benchmarks, each reporting medians and percentiles and
//! the ratio to a baseline measured in the same run (timings on shared
//! machines are noisy; ratios travel better than absolute numbers).
//!
//! - `rpc-latency`: round-trip latency of a Tessera unary call over TCP on
//!   loopback, one call outstanding, for several payload sizes, against the
//!   floor any RPC stack pays: a bare length-prefixed echo over a tokio
//!   `TcpStream` with no framework at all.

use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::{Parser, Subcommand};
use hdrhistogram::Histogram;
use tessera_rpc::{Channel, ChannelConfig, RequestContext, Server, ServerConfig, Status};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[allow(missing_docs, dead_code, clippy::all)]
mod generated {
    include!(concat!(env!("OUT_DIR"), "/tessera.bench.v1.rs"));
}
use generated::{Bench, BenchClient, BenchServer, Payload};

/// Tessera benchmarks.
#[derive(Debug, Parser)]
#[command(name = "tessera-bench")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Unary call latency vs a bare TCP echo.
    RpcLatency {
        /// Measured round trips per payload size.
        #[arg(long, default_value_t = 5000)]
        iterations: u32,
        /// Payload sizes in bytes.
        #[arg(long, value_delimiter = ',', default_values_t = vec![64usize, 4096, 65536, 1 << 20])]
        sizes: Vec<usize>,
    },
}

struct EchoService;

impl Bench for EchoService {
    async fn echo(&self, _context: RequestContext, request: Payload) -> Result<Payload, Status> {
        Ok(request)
    }
}

type BoxError = Box<dyn std::error::Error>;

fn histogram() -> Result<Histogram<u64>, BoxError> {
    Ok(Histogram::new_with_bounds(1, 60_000_000, 3)?)
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_nanos() / 1000)
        .unwrap_or(u64::MAX)
        .max(1)
}

async fn bare_tcp(size: usize, iterations: u32) -> Result<Histogram<u64>, BoxError> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await?;
        stream.set_nodelay(true)?;
        let mut buf = Vec::new();
        loop {
            let mut len = [0u8; 4];
            if stream.read_exact(&mut len).await.is_err() {
                return Ok::<_, std::io::Error>(());
            }
            buf.resize(u32::from_le_bytes(len) as usize, 0);
            stream.read_exact(&mut buf).await?;
            stream.write_all(&len).await?;
            stream.write_all(&buf).await?;
        }
    });
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let payload = vec![7u8; size];
    let mut back = vec![0u8; size];
    let mut hist = histogram()?;
    let len = u32::try_from(size)?.to_le_bytes();
    for i in 0..iterations + iterations / 10 {
        let started = Instant::now();
        stream.write_all(&len).await?;
        stream.write_all(&payload).await?;
        let mut got = [0u8; 4];
        stream.read_exact(&mut got).await?;
        stream.read_exact(&mut back).await?;
        // The first 10% are warm-up.
        if i >= iterations / 10 {
            hist.record(micros(started.elapsed()))?;
        }
    }
    drop(stream);
    server.await??;
    Ok(hist)
}

async fn tessera_rpc(size: usize, iterations: u32) -> Result<Histogram<u64>, BoxError> {
    let server = Server::builder(ServerConfig::default())
        .add_service(BenchServer::new(EchoService))?
        .bind("127.0.0.1:0")
        .await?;
    let addr = server.local_addr().to_string();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(server.serve_with_shutdown(async {
        let _ = stopped.await;
    }));
    let config = ChannelConfig {
        request_timeout_ms: 10_000,
        ..ChannelConfig::default()
    };
    let client = BenchClient::new(Channel::connect(addr, config).await?);
    let payload = Bytes::from(vec![7u8; size]);
    let mut hist = histogram()?;
    for i in 0..iterations + iterations / 10 {
        let started = Instant::now();
        let response = client
            .echo(Payload {
                data: payload.clone(),
            })
            .await?;
        if response.data.len() != size {
            return Err(format!("echo returned {} bytes, sent {size}", response.data.len()).into());
        }
        if i >= iterations / 10 {
            hist.record(micros(started.elapsed()))?;
        }
    }
    let _ = stop.send(());
    task.await?;
    Ok(hist)
}

#[allow(clippy::print_stdout)]
async fn rpc_latency(iterations: u32, sizes: &[usize]) -> Result<(), BoxError> {
    println!("rpc-latency: {iterations} round trips per size, one outstanding, loopback TCP");
    println!(
        "| payload | bare TCP p50 µs | p99 µs | Tessera p50 µs | p99 µs | p999 µs | p50 ratio | p99 ratio |"
    );
    println!(
        "|--------:|----------------:|-------:|---------------:|-------:|--------:|----------:|----------:|"
    );
    for &size in sizes {
        let base = bare_tcp(size, iterations).await?;
        let tessera = tessera_rpc(size, iterations).await?;
        let ratio =
            |q: f64| tessera.value_at_quantile(q) as f64 / base.value_at_quantile(q).max(1) as f64;
        println!(
            "| {size} | {} | {} | {} | {} | {} | {:.2} | {:.2} |",
            base.value_at_quantile(0.5),
            base.value_at_quantile(0.99),
            tessera.value_at_quantile(0.5),
            tessera.value_at_quantile(0.99),
            tessera.value_at_quantile(0.999),
            ratio(0.5),
            ratio(0.99),
        );
    }
    Ok(())
}

fn main() -> Result<(), BoxError> {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        match cli.command {
            Command::RpcLatency { iterations, sizes } => rpc_latency(iterations, &sizes).await,
        }
    })
}
