//! Drill 6: incast of 16 trainer processes into one rate-limited server.

use super::*;

/// The trainers of drill 6.
const INCAST_TRAINERS: usize = 16;
/// The server's link in drill 6, each way: 50 Mbit/s, so that 16
/// trainers on 2 cores overrun it (at 200 Mbit/s the cores were the
/// bottleneck, not the link).
const INCAST_LINK_MBPS: u64 = 50;

/// One run of drill 6: what the trainers saw and the server's memory.
struct IncastRun {
    label: String,
    steps: u64,
    errors: u64,
    push_p50_us: u64,
    push_p99_us: u64,
    push_worst_p99_us: u64,
    server_hwm_kib: u64,
    server_rss_kib: u64,
}

/// A process's `VmHWM` and `VmRSS`, in KiB.
fn memory_kib(pid: i32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    };
    (field("VmHWM:"), field("VmRSS:"))
}

/// Drill 6's server on host 1 (one shard, table `emb` of dim 64) over
/// `transport`, and 16 trainer processes, one per host 2-17, pushing to
/// it for 5 s through its rate-limited link; every process's `rdma` as
/// given (the send window is the trainers').
fn incast_run(
    cluster: &NetCluster,
    dir: &std::path::Path,
    label: &str,
    transport: TransportKind,
    rdma: &tessera_rpc::RdmaConfig,
) -> IncastRun {
    let server_addr = format!("{}:7000", cluster.addr(1));
    let config = PsServerConfig {
        listen: server_addr.clone(),
        transport,
        rdma: rdma.clone(),
        tables: vec![TableConfig::new("emb", 64)],
        ..PsServerConfig::default()
    };
    let mut server = PsProcess::spawn_under(
        cluster.prefix(1),
        &ps_server_bin(),
        &config,
        dir,
        &format!("incast-{label}"),
        &[],
    );
    until(
        cluster,
        2,
        std::slice::from_ref(&server_addr),
        Duration::from_secs(30),
        |s| s == [(true, true)],
    );
    let worker = WorkerConfig {
        transport,
        rdma: rdma.clone(),
        servers: vec![ServerEndpoint {
            address: server_addr.clone(),
            shards: vec![0],
            replica_group: 0,
        }],
        // 16 processes connect at once on 2 cores: a connection may take
        // longer than the default 10 ms, which would send it to TCP.
        connect_timeout_ms: 2000,
        call_timeout_ms: 10_000,
        push_timeout_ms: 20_000,
        request_timeout_ms: 10_000,
        workload: tessera_worker::config::WorkloadConfig {
            table: "emb".into(),
            duration_secs: 5.0,
            concurrency: 1,
            // Pushes (and Fetches) of 64 KiB on average, 256 KiB at p99.
            message_bytes_mean: 64 << 10,
            message_bytes_p99: 256 << 10,
            ..Default::default()
        },
        ..WorkerConfig::default()
    };
    let worker_path = dir.join(format!("incast-{label}.toml"));
    std::fs::write(&worker_path, toml::to_string(&worker).unwrap()).unwrap();
    let mut trainers: Vec<(KillOnDrop, std::path::PathBuf)> = (0..INCAST_TRAINERS)
        .map(|i| {
            let report = dir.join(format!("incast-{label}-{i}.json"));
            let log = std::fs::File::create(dir.join(format!("incast-{label}-{i}.log"))).unwrap();
            let child = cluster
                .command(2 + i, common::binary("worker"))
                .arg("--config")
                .arg(&worker_path)
                .arg("--json")
                .arg(&report)
                .arg("trainer")
                // Its warnings (a fallback to TCP among them) are read below.
                .env_remove("RUST_LOG")
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .unwrap();
            (KillOnDrop(child), report)
        })
        .collect();
    let mut latencies = Vec::new();
    let (mut steps, mut errors) = (0, 0);
    for (i, (child, report)) in trainers.iter_mut().enumerate() {
        let exit = child.0.wait().unwrap();
        assert!(exit.success(), "a trainer failed: {exit}");
        // An RDMA run is over RDMA all along: no trainer fell back to TCP.
        let log = std::fs::read_to_string(dir.join(format!("incast-{label}-{i}.log"))).unwrap();
        assert!(
            transport == TransportKind::Tcp || !log.contains("falling back to TCP"),
            "{label}: trainer {i} fell back to TCP: {log}"
        );
        let report: serde_json::Value =
            serde_json::from_slice(&std::fs::read(report).unwrap()).unwrap();
        steps += report["iterations"].as_u64().unwrap();
        errors += report["errors"].as_u64().unwrap();
        latencies.push(report["push"].clone());
    }
    let (server_hwm_kib, server_rss_kib) = memory_kib(server.pid().unwrap());
    server.kill();
    // Each trainer's percentiles are its own: the drill reports the
    // median trainer's p50 and p99, and the worst trainer's p99.
    let field = |name: &str| -> Vec<u64> {
        let mut v: Vec<u64> = latencies.iter().filter_map(|l| l[name].as_u64()).collect();
        v.sort_unstable();
        v
    };
    let (p50s, p99s) = (field("p50_us"), field("p99_us"));
    IncastRun {
        label: label.to_owned(),
        steps,
        errors,
        push_p50_us: p50s.get(p50s.len() / 2).copied().unwrap_or(0),
        push_p99_us: p99s.get(p99s.len() / 2).copied().unwrap_or(0),
        push_worst_p99_us: p99s.last().copied().unwrap_or(0),
        server_hwm_kib,
        server_rss_kib,
    }
}

/// Issue 19's drill 6: incast. 16 trainer processes, each on a host of
/// its own, push to one server whose link is limited to 50 Mbit/s each
/// way: over RDMA (soft NIC with the link's rate) with the send window
/// off, then at 8 KiB, and over TCP (the same rate by `tc tbf` on the
/// server's veth) for reference. The figures: Push latency (the median
/// trainer's p50 and p99, the worst trainer's p99) and the server's peak
/// memory.
#[test]
fn incast_of_16_trainers_with_and_without_a_send_window() {
    let Some(cluster) = NetCluster::create_or_skip(1 + INCAST_TRAINERS) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let rdma = |window_bytes| tessera_rpc::RdmaConfig {
        soft_link_mbps: INCAST_LINK_MBPS,
        window_bytes,
        ..tessera_rpc::TransportConfig::soft_rdma().rdma
    };
    let mut runs = vec![
        incast_run(
            &cluster,
            dir.path(),
            "rdma-window-off",
            TransportKind::Rdma,
            &rdma(0),
        ),
        incast_run(
            &cluster,
            dir.path(),
            "rdma-window-8KiB",
            TransportKind::Rdma,
            &rdma(8 << 10),
        ),
    ];
    cluster.set_rate(1, &format!("{INCAST_LINK_MBPS}mbit"));
    runs.push(incast_run(
        &cluster,
        dir.path(),
        "tcp",
        TransportKind::Tcp,
        &rdma(0),
    ));
    let mut table = format!(
        "drill netns incast: {INCAST_TRAINERS} trainers on {INCAST_TRAINERS} hosts -> 1 server, its link {INCAST_LINK_MBPS} Mbit/s each way, 5 s, Pushes of 64 KiB mean:\n\
         | run | steps | failed | Push p50 (median trainer) | Push p99 (median trainer) | Push p99 (worst trainer) | server peak RSS | server RSS at end |\n|---|---|---|---|---|---|---|---|\n"
    );
    for r in &runs {
        table += &format!(
            "| {} | {} | {} | {:.1} ms | {:.1} ms | {:.1} ms | {} MiB | {} MiB |\n",
            r.label,
            r.steps,
            r.errors,
            r.push_p50_us as f64 / 1000.0,
            r.push_p99_us as f64 / 1000.0,
            r.push_worst_p99_us as f64 / 1000.0,
            r.server_hwm_kib / 1024,
            r.server_rss_kib / 1024,
        );
    }
    eprintln!("{table}");
    for r in &runs {
        assert!(r.steps > 0, "{}: no step", r.label);
        assert_eq!(r.errors, 0, "{}: failed steps", r.label);
    }
}
