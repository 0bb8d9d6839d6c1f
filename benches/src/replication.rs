//! `tessera-bench replication`: what `ack = "replicas"` costs a Push
//! against `ack = "primary"`, measured in one run.
//!
//! Two pairs of ps-servers in this process, each a primary and a replica
//! of one shard in static mode; one pair acknowledges once the primary
//! applied a Push, the other once the replica applied it too. A client
//! pushes 64 keys of dimension 32 (8 KiB of gradients, with Adam) to each
//! pair's primary in interleaved blocks, so that both modes see the same
//! machine state, one Push outstanding (latency) and then eight
//! (throughput). Over TCP and over RDMA with the soft provider. The ratio
//! is `replicas / primary`.

use std::sync::Arc;

use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use tessera_proto::rows::put_f32s;
use tessera_proto::v1::{HealthRequest, ParameterServerClient, PushRequest};
use tessera_ps_server::config::{AckMode, OptimizerConfig, PeerConfig, ReplicationConfig};
use tessera_ps_server::{PsServer, PsServerConfig, TableConfig};
use tessera_rpc::{Channel, ChannelConfig, RdmaConfig, RdmaProvider, TransportKind};

use crate::out_line;
use crate::transport::{BoxError, histogram, micros};

const KEYS: u64 = 64;
const DIM: usize = 32;

/// Two free loopback addresses, distinct: both ports are held until both
/// are chosen (the kernel may hand a port just released to the next bind,
/// and the two servers were once given the same one).
fn free_addrs() -> Result<(String, String), BoxError> {
    let a = std::net::TcpListener::bind("127.0.0.1:0")?;
    let b = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok((
        format!("127.0.0.1:{}", a.local_addr()?.port()),
        format!("127.0.0.1:{}", b.local_addr()?.port()),
    ))
}

fn rdma_soft() -> RdmaConfig {
    RdmaConfig {
        provider: RdmaProvider::Soft,
        ..RdmaConfig::default()
    }
}

fn server(
    listen: &str,
    group: u32,
    peer: &str,
    ack: AckMode,
    transport: TransportKind,
) -> PsServerConfig {
    PsServerConfig {
        listen: listen.to_owned(),
        transport,
        rdma: rdma_soft(),
        replica_group: group,
        replica_groups: 2,
        peers: vec![PeerConfig {
            address: peer.to_owned(),
            replica_group: 1 - group,
            shards: vec![0],
        }],
        replication: ReplicationConfig {
            ack,
            ..ReplicationConfig::default()
        },
        tables: vec![TableConfig {
            optimizer: OptimizerConfig::adam(0.001),
            ..TableConfig::new("emb", DIM as u32)
        }],
        ..PsServerConfig::default()
    }
}

/// A primary and its replica serving on this runtime; stopped on drop.
struct Pair {
    client: ParameterServerClient,
    _stops: Vec<tokio::sync::oneshot::Sender<()>>,
}

async fn pair(ack: AckMode, transport: TransportKind) -> Result<Pair, BoxError> {
    let (a, b) = free_addrs()?;
    let mut stops = Vec::new();
    for config in [
        server(&a, 0, &b, ack, transport),
        server(&b, 1, &a, ack, transport),
    ] {
        let server = PsServer::bind(&config).await?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(server.serve(async {
            let _ = stopped.await;
        }));
        stops.push(stop);
    }
    let mut channel = ChannelConfig {
        connect_timeout_ms: 2000,
        request_timeout_ms: 10_000,
        ..ChannelConfig::default()
    };
    channel.transport.kind = transport;
    channel.transport.rdma = rdma_soft();
    let client = ParameterServerClient::new(Channel::lazy(&a, channel.clone())?);
    // Serving, with the replica attached and confirmed: every shard led,
    // every replica in step.
    let started = Instant::now();
    loop {
        let health = client.health(HealthRequest {}).await;
        if let Ok(h) = &health
            && h.serving
            && h.shard_health
                .iter()
                .all(|s| !s.replicas.is_empty() && s.replicas.iter().all(|r| r.in_step))
        {
            break;
        }
        if started.elapsed() > Duration::from_secs(30) {
            let replica = ParameterServerClient::new(Channel::lazy(&b, channel.clone())?)
                .health(HealthRequest {})
                .await;
            return Err(format!(
                "the pair never got its replica in step: primary {health:?}; replica {replica:?}"
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(Pair {
        client,
        _stops: stops,
    })
}

fn request(worker: u64, sequence: u64) -> PushRequest {
    let grads: Vec<f32> = (0..KEYS as usize * DIM)
        .map(|i| ((i as u64 + sequence) % 7) as f32 * 0.01 - 0.03)
        .collect();
    let mut wire = Vec::new();
    put_f32s(&mut wire, &grads);
    PushRequest {
        num_shards: 0,
        table: "emb".into(),
        shard: 0,
        keys: (0..KEYS).map(|k| k * 17 + sequence % 5).collect(),
        gradients: Bytes::from(wire),
        worker_id: worker,
        sequence,
    }
}

/// `pushes` Pushes from `concurrency` callers; their latencies, and the
/// wall time.
async fn block(
    client: &ParameterServerClient,
    concurrency: u64,
    pushes: u64,
    first_sequence: u64,
) -> Result<(Histogram<u64>, Duration), BoxError> {
    let started = Instant::now();
    let per = pushes / concurrency;
    let tasks = (0..concurrency).map(|c| {
        let client = client.clone();
        async move {
            let mut h = histogram()?;
            for i in 0..per {
                let t = Instant::now();
                client
                    .push(request(100 + c, first_sequence + i))
                    .await
                    .map_err(|e| -> BoxError { e.to_string().into() })?;
                h.record(micros(t.elapsed()))?;
            }
            Ok::<_, BoxError>(h)
        }
    });
    let mut all = histogram()?;
    for h in futures::future::join_all(tasks).await {
        all.add(h?)?;
    }
    Ok((all, started.elapsed()))
}

/// Runs the comparison (module docs): its rows and table.
pub async fn run(pushes: u64, blocks: u64) -> Result<(Vec<serde_json::Value>, String), BoxError> {
    let mut out = String::new();
    let mut rows = Vec::new();
    out_line!(
        out,
        "push latency by ack mode: {KEYS} keys x dim {DIM} (Adam), primary + 1 replica in this process, {pushes} pushes per mode in {blocks} interleaved blocks\n"
    );
    out_line!(
        out,
        "| transport | outstanding | ack | p50 µs | p99 µs | mean µs | pushes/s | p50 replicas/primary |"
    );
    out_line!(out, "|---|---:|---|---:|---:|---:|---:|---:|");
    for (label, transport) in [
        ("tcp", TransportKind::Tcp),
        ("rdma-soft", TransportKind::Rdma),
    ] {
        let primary = Arc::new(pair(AckMode::Primary, transport).await?);
        let replicas = Arc::new(pair(AckMode::Replicas, transport).await?);
        for concurrency in [1u64, 8] {
            let mut results = [
                (histogram()?, Duration::ZERO),
                (histogram()?, Duration::ZERO),
            ];
            let mut sequence = 1 + concurrency * 1_000_000;
            let per_block = (pushes / blocks).max(concurrency);
            for _ in 0..blocks {
                for (i, pair) in [&primary, &replicas].into_iter().enumerate() {
                    let (h, took) = block(&pair.client, concurrency, per_block, sequence).await?;
                    results[i].0.add(h)?;
                    results[i].1 += took;
                }
                sequence += per_block;
            }
            let p50 = |h: &Histogram<u64>| h.value_at_quantile(0.5);
            for (i, ack) in ["primary", "replicas"].into_iter().enumerate() {
                let (h, took) = &results[i];
                let p50_ratio = p50(h) as f64 / p50(&results[0].0).max(1) as f64;
                rows.push(serde_json::json!({
                    "bench": "replication",
                    "transport": label,
                    "outstanding": concurrency,
                    "ack": ack,
                    "p50_us": p50(h),
                    "p99_us": h.value_at_quantile(0.99),
                    "mean_us": h.mean(),
                    "pushes_per_s": h.len() as f64 / took.as_secs_f64(),
                    "p50_vs_primary": p50_ratio,
                }));
                out_line!(
                    out,
                    "| {label} | {concurrency} | {ack} | {} | {} | {:.0} | {:.0} | {} |",
                    p50(h),
                    h.value_at_quantile(0.99),
                    h.mean(),
                    h.len() as f64 / took.as_secs_f64(),
                    if i == 1 {
                        format!("{:.2}", p50(h) as f64 / p50(&results[0].0).max(1) as f64)
                    } else {
                        "-".into()
                    }
                );
            }
        }
    }
    Ok((rows, out))
}
