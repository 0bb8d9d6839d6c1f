//! `tessera-bench recovery`: what the RPC layer's recovery policies cost
//! and how fast they recover, measured in one run.
//!
//! - **Policy overhead**: p50/p99 of a unary call on a plain `Channel` (no
//!   policies) against the same call through a `ReplicaSet` of two
//!   replicas with every policy on (replica selection, retry decision,
//!   budget, quarantine, backoff, call and attempt metrics into an
//!   installed Prometheus recorder), in interleaved blocks so that both
//!   see the same machine state. Over TCP and over RDMA with the soft
//!   provider.
//! - **Fallback and return**: a channel over soft RDMA to a healthy server
//!   through a fault-injecting proxy; the RDMA path is broken (control
//!   streams reset, new RDMA handshakes turned away; TCP passes) and the
//!   time until a call succeeds again (over TCP) is measured; then RDMA is
//!   repaired and the time until the channel is back on RDMA.
//! - **Failover**: two server processes behind a `ReplicaSet`, eight
//!   callers in a loop, one server SIGKILLed: failed calls (should be 0)
//!   and the longest call that was in flight at the kill.
//! - **Rolling restart**: three server processes behind a `ReplicaSet`,
//!   eight callers of a *non-idempotent* call in a loop, each server in
//!   turn stopped with SIGTERM (graceful) and started again on its
//!   address: failed calls (target 0), replicas quarantined at the end
//!   (target 0), the slowest call against the median, and — over
//!   rdma-soft — the time any destination spent fallen back to TCP while
//!   RDMA was healthy (target 0).

use std::sync::Arc;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use tessera_rpc::policy::FallbackConfig;
use tessera_rpc::{
    CallOptions, Channel, ChannelConfig, ReplicaEndpoint, ReplicaSet, ReplicaSetConfig, Server,
    ServerConfig, Transport, TransportConfig, TransportKind,
};

use crate::echo::{BenchClient, BenchServer, EchoService, Payload};
use crate::out_line;
use crate::transport::{BoxError, histogram, micros};

/// The transports compared.
const TRANSPORTS: [(&str, TransportKind); 2] = [
    ("tcp", TransportKind::Tcp),
    ("rdma-soft", TransportKind::Rdma),
];

fn transport(kind: TransportKind) -> TransportConfig {
    match kind {
        TransportKind::Rdma => TransportConfig::soft_rdma(),
        _ => TransportConfig::default(),
    }
}

/// Generous timeouts: the bench measures the policies, not this host's
/// scheduling delays.
fn channel_config(kind: TransportKind) -> ChannelConfig {
    ChannelConfig {
        connect_timeout_ms: 2000,
        request_timeout_ms: 5000,
        transport: transport(kind),
        ..ChannelConfig::default()
    }
}

struct Running {
    addr: String,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

async fn serve(kind: TransportKind, listen: &str) -> Result<Running, BoxError> {
    let server = Server::builder(ServerConfig {
        transport: transport(kind),
        ..ServerConfig::default()
    })
    .add_service(BenchServer::new(EchoService))?
    .bind(listen)
    .await?;
    let addr = server.local_addr().to_string();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(server.serve_with_shutdown(async {
        let _ = stopped.await;
    }));
    Ok(Running { addr, stop, task })
}

impl Running {
    async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}

fn payload() -> Payload {
    Payload {
        data: Bytes::from_static(&[7u8; 64]),
    }
}

fn replica_set(kind: TransportKind, addrs: &[String], seed: u64) -> Result<ReplicaSet, BoxError> {
    Ok(ReplicaSet::new(
        ReplicaSetConfig {
            replicas: addrs
                .iter()
                .map(|addr| ReplicaEndpoint {
                    addr: addr.clone(),
                    domain: String::new(),
                })
                .collect(),
            call_timeout_ms: 10_000,
            channel: channel_config(kind),
            seed: Some(seed),
            ..ReplicaSetConfig::default()
        },
        Transport::new(transport(kind))?,
    ))
}

/// p50 and p99 in µs.
fn p50_p99(hist: &Histogram<u64>) -> (u64, u64) {
    (hist.value_at_quantile(0.5), hist.value_at_quantile(0.99))
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

async fn overhead(
    kind: TransportKind,
    calls: u32,
) -> Result<(Histogram<u64>, Histogram<u64>), BoxError> {
    let a = serve(kind, "127.0.0.1:0").await?;
    let b = serve(kind, "127.0.0.1:0").await?;
    let plain = BenchClient::new(Channel::connect(&a.addr, channel_config(kind)).await?);
    let policed = BenchClient::new(replica_set(kind, &[a.addr.clone(), b.addr.clone()], 1)?);
    // Warm both (connections, pools, EWMAs).
    for _ in 0..200 {
        plain.echo(payload()).await?;
        policed.echo(payload()).await?;
    }
    let (mut off, mut on) = (histogram()?, histogram()?);
    let blocks = 20;
    for _ in 0..blocks {
        for _ in 0..calls / blocks {
            let started = Instant::now();
            plain.echo(payload()).await?;
            off.record(micros(started.elapsed()))?;
        }
        for _ in 0..calls / blocks {
            let started = Instant::now();
            policed.echo(payload()).await?;
            on.record(micros(started.elapsed()))?;
        }
    }
    a.stop().await;
    b.stop().await;
    Ok((off, on))
}

/// One break-and-repair cycle: (time until a call succeeds after the
/// break, time until the channel is back on RDMA after the repair).
async fn fallback_cycle(probe: Duration) -> Result<(Duration, Duration), BoxError> {
    let server = serve(TransportKind::Rdma, "127.0.0.1:0").await?;
    let proxy = tessera_test_support::proxy::FaultProxy::start(server.addr.clone()).await;
    let channel = Channel::lazy(
        &proxy.addr,
        ChannelConfig {
            fallback: FallbackConfig {
                probe_interval_ms: probe.as_millis() as u64,
                ..FallbackConfig::default()
            },
            ..channel_config(TransportKind::Rdma)
        },
    )?;
    let client = BenchClient::new(channel.clone());
    let call = |timeout_ms| {
        let client = client.clone();
        async move {
            client
                .echo_with_options(
                    payload(),
                    &CallOptions::with_timeout(Duration::from_millis(timeout_ms)),
                )
                .await
        }
    };
    call(5000).await?;
    if channel.current_transport() != Some(TransportKind::Rdma) {
        return Err("the channel did not start on RDMA".into());
    }
    proxy.refuse_rdma(true);
    let broken = Instant::now();
    proxy.reset_all();
    while channel.current_transport() == Some(TransportKind::Rdma) {
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    while call(300).await.is_err() {
        if broken.elapsed() > Duration::from_secs(10) {
            return Err("no call succeeded within 10 s of the break".into());
        }
    }
    let fallback = broken.elapsed();
    if channel.current_transport() != Some(TransportKind::Tcp) {
        return Err("calls succeeded, but not over TCP".into());
    }
    // A steady trickle of calls while RDMA is still broken.
    let until = Instant::now() + probe / 2;
    while Instant::now() < until {
        call(2000).await?;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    proxy.refuse_rdma(false);
    let repaired = Instant::now();
    while channel.current_transport() != Some(TransportKind::Rdma) {
        call(2000).await?;
        tokio::time::sleep(Duration::from_millis(2)).await;
        if repaired.elapsed() > probe * 4 + Duration::from_secs(2) {
            return Err("never returned to RDMA".into());
        }
    }
    let returned = repaired.elapsed();
    server.stop().await;
    Ok((fallback, returned))
}

/// Server processes, killed when dropped (also on an early error return).
struct Children(Vec<std::process::Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Failover around a SIGKILLed replica: (failed calls, longest call in
/// flight at the kill in µs, median call before the kill in µs).
async fn failover(kind: TransportKind) -> Result<(u64, u64, u64), BoxError> {
    let mut children = Children(Vec::new());
    let mut addrs = Vec::new();
    for _ in 0..2 {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let addr = format!("127.0.0.1:{port}");
        children.0.push(spawn_child(kind, &addr)?);
        addrs.push(addr);
    }
    for addr in &addrs {
        wait_up(kind, addr).await?;
    }
    let client = BenchClient::new(replica_set(kind, &addrs, 7)?);
    let failed = Arc::new(AtomicU64::new(0));
    let spanning_max = Arc::new(AtomicU64::new(0));
    let killed_at_us = Arc::new(AtomicU64::new(u64::MAX));
    let before = Arc::new(std::sync::Mutex::new(histogram()?));
    let t0 = Instant::now();
    let run_for = Duration::from_millis(2500);
    let mut callers = Vec::new();
    for _ in 0..8 {
        let client = client.clone();
        let (failed, spanning_max, killed_at_us, before) = (
            failed.clone(),
            spanning_max.clone(),
            killed_at_us.clone(),
            before.clone(),
        );
        callers.push(tokio::spawn(async move {
            while t0.elapsed() < run_for {
                let start_us = micros(t0.elapsed());
                let result = client.echo(payload()).await;
                let end_us = micros(t0.elapsed());
                if result.is_err() {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
                let killed = killed_at_us.load(Ordering::Relaxed);
                if start_us <= killed && end_us >= killed {
                    spanning_max.fetch_max(end_us - start_us, Ordering::Relaxed);
                } else if end_us < killed
                    && let Ok(mut hist) = before.lock()
                {
                    let _ = hist.record(end_us - start_us);
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(1000)).await;
    killed_at_us.store(micros(t0.elapsed()), Ordering::Relaxed);
    // SIGKILL; the guard reaps it (and the survivor) at the end.
    children.0[0].kill()?;
    for caller in callers {
        caller.await?;
    }
    drop(children);
    let median_before = before.lock().map(|h| h.value_at_quantile(0.5)).unwrap_or(0);
    Ok((
        failed.load(Ordering::Relaxed),
        spanning_max.load(Ordering::Relaxed),
        median_before,
    ))
}

/// The `rpc-server` child of the failover and rolling-restart
/// measurements: serves until killed, or stops gracefully on SIGTERM.
pub async fn child_server(kind: TransportKind, listen: &str) -> Result<(), BoxError> {
    let server = Server::builder(ServerConfig {
        transport: transport(kind),
        ..ServerConfig::default()
    })
    .add_service(BenchServer::new(EchoService))?
    .bind(listen)
    .await?;
    server
        .serve_with_shutdown(tessera_rpc::shutdown_signal())
        .await;
    Ok(())
}

fn spawn_child(kind: TransportKind, addr: &str) -> Result<std::process::Child, BoxError> {
    Ok(std::process::Command::new(std::env::current_exe()?)
        .args(["rpc-server", kind.as_str(), addr])
        .stderr(std::process::Stdio::null())
        .spawn()?)
}

async fn wait_up(kind: TransportKind, addr: &str) -> Result<(), BoxError> {
    let started = Instant::now();
    loop {
        if let Ok(channel) = Channel::connect(addr, channel_config(kind)).await
            && BenchClient::new(channel).echo(payload()).await.is_ok()
        {
            return Ok(());
        }
        if started.elapsed() > Duration::from_secs(30) {
            return Err(format!("rpc-server {addr} never came up").into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What a rolling restart cost.
struct Rolling {
    calls: u64,
    failed: u64,
    quarantined: usize,
    slowest_us: u64,
    median_us: u64,
    /// Time any destination was fallen back to TCP, summed over them.
    on_tcp: Duration,
}

/// Rolling restart of three server processes under eight callers of a
/// non-idempotent call (module docs).
async fn rolling_restart(kind: TransportKind) -> Result<Rolling, BoxError> {
    let mut children = Children(Vec::new());
    let mut addrs = Vec::new();
    for _ in 0..3 {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let addr = format!("127.0.0.1:{port}");
        children.0.push(spawn_child(kind, &addr)?);
        addrs.push(addr);
    }
    for addr in &addrs {
        wait_up(kind, addr).await?;
    }
    let transport = Transport::new(transport(kind))?;
    let channels: Vec<Channel> = addrs
        .iter()
        .map(|a| Channel::with_transport(a.clone(), channel_config(kind), transport.clone()))
        .collect();
    let set = ReplicaSet::over_channels(
        ReplicaSetConfig {
            replicas: addrs
                .iter()
                .map(|addr| ReplicaEndpoint {
                    addr: addr.clone(),
                    domain: String::new(),
                })
                .collect(),
            call_timeout_ms: 10_000,
            channel: channel_config(kind),
            seed: Some(9),
            ..ReplicaSetConfig::default()
        },
        channels.clone(),
        transport,
    );
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let failed = Arc::new(AtomicU64::new(0));
    let hist = Arc::new(std::sync::Mutex::new(histogram()?));
    let method = crate::echo::generated::BENCH_DESCRIPTOR.methods[0].id;
    let body =
        tessera_transport::Message::from(Bytes::from(prost::Message::encode_to_vec(&payload())));
    let mut callers = Vec::new();
    for _ in 0..8 {
        let (set, stop, failed, hist, body) = (
            set.clone(),
            stop.clone(),
            failed.clone(),
            hist.clone(),
            body.clone(),
        );
        callers.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let started = Instant::now();
                // Not safe to retry after an unknown outcome: only calls
                // the server refused (never applied) may go elsewhere.
                let result = set
                    .call_raw(method, body.clone(), false, Duration::from_secs(10))
                    .await;
                if result.is_err() {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
                if let Ok(mut hist) = hist.lock() {
                    let _ = hist.record(micros(started.elapsed()));
                }
            }
        }));
    }
    // Sample whether each destination is fallen back to TCP.
    let sampler = tokio::spawn({
        let (channels, stop) = (channels.clone(), stop.clone());
        async move {
            let mut on_tcp = Duration::ZERO;
            let tick = Duration::from_millis(5);
            while !stop.load(Ordering::Relaxed) {
                tokio::time::sleep(tick).await;
                on_tcp += tick * channels.iter().filter(|c| c.fallen_back()).count() as u32;
            }
            on_tcp
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    for (child, addr) in children.0.iter_mut().zip(&addrs) {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )?;
        child.wait()?;
        *child = spawn_child(kind, addr)?;
        wait_up(kind, addr).await?;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for caller in callers {
        caller.await?;
    }
    let on_tcp = sampler.await?;
    let quarantined = set.quarantined().len();
    drop(children);
    let hist = hist.lock().map_err(|_| "histogram poisoned")?;
    Ok(Rolling {
        calls: hist.len(),
        failed: failed.load(Ordering::Relaxed),
        quarantined,
        slowest_us: hist.max(),
        median_us: hist.value_at_quantile(0.5),
        on_tcp,
    })
}

/// Runs the whole benchmark: its rows and tables.
pub async fn run(
    calls: u32,
    rounds: u32,
    probe: Duration,
) -> Result<(Vec<serde_json::Value>, String), BoxError> {
    let mut out = String::new();
    let mut rows = Vec::new();
    // The policy layer records metrics; measure it with a recorder in place.
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .map_err(|err| err.to_string())?;

    out_line!(
        out,
        "policy overhead: 64 B unary echo, {calls} calls each, interleaved in 20 blocks"
    );
    out_line!(out);
    out_line!(
        out,
        "| transport | policies off p50 µs | off p99 µs | all on p50 µs | on p99 µs | p50 on/off |"
    );
    out_line!(out, "|---|---:|---:|---:|---:|---:|");
    for (name, kind) in TRANSPORTS {
        let (off, on) = overhead(kind, calls).await?;
        let ((off50, off99), (on50, on99)) = (p50_p99(&off), p50_p99(&on));
        rows.push(serde_json::json!({
            "bench": "recovery", "test": "policy_overhead", "transport": name,
            "off_p50_us": off50, "off_p99_us": off99, "on_p50_us": on50, "on_p99_us": on99,
            "p50_on_vs_off": on50 as f64 / off50.max(1) as f64,
        }));
        out_line!(
            out,
            "| {name} | {off50} | {off99} | {on50} | {on99} | {:.2} |",
            on50 as f64 / off50.max(1) as f64
        );
    }
    out_line!(out);

    out_line!(
        out,
        "RDMA-to-TCP fallback and return (rdma-soft behind a fault proxy, probe interval {} ms, {rounds} rounds)",
        probe.as_millis()
    );
    out_line!(out);
    let mut fallbacks = Vec::new();
    let mut returns = Vec::new();
    for _ in 0..rounds {
        let (fallback, returned) = fallback_cycle(probe).await?;
        fallbacks.push(fallback.as_secs_f64() * 1e3);
        returns.push(returned.as_secs_f64() * 1e3);
    }
    let max = |v: &[f64]| v.iter().copied().fold(f64::NAN, f64::max);
    for (step, values) in [("fallback", &fallbacks), ("return", &returns)] {
        rows.push(serde_json::json!({
            "bench": "recovery", "test": step, "transport": "rdma-soft",
            "median_ms": median(values.clone()), "max_ms": max(values),
            "probe_ms": probe.as_millis() as u64,
        }));
    }
    out_line!(out, "| step | median ms | max ms |");
    out_line!(out, "|---|---:|---:|");
    out_line!(
        out,
        "| break -> first call succeeds (over TCP) | {:.1} | {:.1} |",
        median(fallbacks.clone()),
        max(&fallbacks)
    );
    out_line!(
        out,
        "| repair -> back on RDMA | {:.1} | {:.1} |",
        median(returns.clone()),
        max(&returns)
    );
    out_line!(out);

    out_line!(
        out,
        "failover: 2 server processes, 8 callers, one SIGKILLed after 1 s of a 2.5 s run"
    );
    out_line!(out);
    out_line!(
        out,
        "| transport | round | failed calls | longest call across the kill ms | median call before ms |"
    );
    out_line!(out, "|---|---:|---:|---:|---:|");
    for (name, kind) in TRANSPORTS {
        for round in 1..=rounds.min(3) {
            let (failed, spanning, before) = failover(kind).await?;
            rows.push(serde_json::json!({
                "bench": "recovery", "test": "failover", "transport": name, "round": round,
                "failed_calls": failed, "longest_across_kill_ms": spanning as f64 / 1e3,
                "median_before_ms": before as f64 / 1e3,
            }));
            out_line!(
                out,
                "| {name} | {round} | {failed} | {:.2} | {:.3} |",
                spanning as f64 / 1e3,
                before as f64 / 1e3
            );
        }
    }
    out_line!(out);

    out_line!(
        out,
        "rolling restart: 3 server processes, 8 callers of a non-idempotent call, each server in turn SIGTERMed and started again"
    );
    out_line!(out);
    out_line!(
        out,
        "| transport | round | calls | failed calls | quarantined | slowest call ms | median call ms | time on TCP with RDMA healthy ms |"
    );
    out_line!(out, "|---|---:|---:|---:|---:|---:|---:|---:|");
    for (name, kind) in TRANSPORTS {
        for round in 1..=rounds.min(3) {
            let r = rolling_restart(kind).await?;
            rows.push(serde_json::json!({
                "bench": "recovery", "test": "rolling_restart", "transport": name, "round": round,
                "calls": r.calls, "failed_calls": r.failed, "quarantined": r.quarantined,
                "slowest_ms": r.slowest_us as f64 / 1e3, "median_ms": r.median_us as f64 / 1e3,
                "on_tcp_ms": r.on_tcp.as_millis() as u64,
            }));
            out_line!(
                out,
                "| {name} | {round} | {} | {} | {} | {:.2} | {:.3} | {} |",
                r.calls,
                r.failed,
                r.quarantined,
                r.slowest_us as f64 / 1e3,
                r.median_us as f64 / 1e3,
                r.on_tcp.as_millis()
            );
        }
    }
    Ok((rows, out))
}
