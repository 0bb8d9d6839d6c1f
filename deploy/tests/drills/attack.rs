//! The hostile-peers drill (issue 16) on a ps-server process: while a
//! worker's Fetches run at a fixed rate, 300 connections announce 60 MiB
//! frames and stall, and 60 more try to send 55 MiB of a 60 MiB frame (less
//! where the kernel's TCP memory would pass half its pressure threshold). The
//! server's resident memory may grow by no more than its inbound budget,
//! no Fetch fails, the Fetch p99 stays within 3x of the same run's p99
//! without the attack, and the frame timeout closes every attacker.

use std::time::{Duration, Instant};

use rand::SeedableRng;
use tessera_proto::v1::ShardRole;
use tessera_ps_server::PsServerConfig;
use tessera_rpc::{InboundConfig, TransportKind};
use tessera_test_support::wait::Waiting;
use tessera_test_support::{Layout, PsProcess};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::ONE_AT_A_TIME;
use super::load::{Load, big_table, fill, percentiles, quiet_window, rss_mib};
use super::trainer::rdma_settings;
use super::trainer::{data_client, wait_role};

const MIB: usize = 1 << 20;
/// The worker's Fetch rate: the other drills' 400/s. (The p99 ratio
/// measured 1.6-2.6 in 16 plain runs and 1.0-1.5 in 6 under two CPU hogs
/// once a message past its frame timeout could no longer take freed budget
/// or keep reading; 1.2-4.4 plain before. The attackers' 600 MiB cross
/// this host's two cores too, which a fleet's attackers, on other hosts,
/// would not.)
const FETCHES_PER_SEC: u64 = 400;
/// The drill's inbound budget: four 60 MiB frames.
const BUDGET: u64 = 256 << 20;
/// The drill's frame timeout (the default is 30 s: shorter here so the
/// drill takes seconds).
const FRAME_TIMEOUT_MS: u64 = 4000;
const STALLED: usize = 300;
const PARTIAL: usize = 60;
const ANNOUNCED: usize = 60 * MIB;
const SENT: usize = 55 * MIB;

/// What each partial sender sends: [`SENT`], or less where that many
/// bodies would take the kernel's TCP memory past half its pressure
/// threshold (`net.ipv4.tcp_mem`, 1.46 GiB on the development machine).
/// Past the threshold the kernel throttles every TCP socket of the host,
/// the drill's own Fetches included: in two whole-suite runs 1.2-1.5 GiB
/// of bodies in the kernel stalled every Fetch for about 100 ms at once,
/// 500 ms into the attack, the server idle; alone, below the threshold,
/// it never did. (An attacker on another host fills this host's receive
/// buffers just the same: the server does not yet shrink the buffers of
/// peers it has not admitted.)
fn sent_per_sender() -> usize {
    let pressure = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_mem")
        .ok()
        .and_then(|t| t.split_whitespace().nth(1)?.parse::<usize>().ok())
        .map_or(usize::MAX, |pages| pages.saturating_mul(4096));
    SENT.min(pressure / 2 / PARTIAL / MIB * MIB).max(8 * MIB)
}

/// A ps-server process of one shard with table `big` filled, under a
/// worker's Fetches at `FETCHES_PER_SEC`, after a quiet window measured.
struct Loaded {
    _dir: tempfile::TempDir,
    server: PsProcess,
    addr: String,
    pid: i32,
    load: Load,
    /// The quiet window before the event.
    before: (Instant, Instant),
    rss_before: f64,
}

/// Starts [`Loaded`] over `transport` with `base`'s other settings.
async fn loaded_server(transport: TransportKind, base: PsServerConfig) -> Loaded {
    let dir = tempfile::tempdir().unwrap();
    let bin = tessera_test_support::process::ps_server_bin();
    let layout = Layout::new(1, 1);
    let config = layout.config(
        0,
        &PsServerConfig {
            transport,
            rdma: rdma_settings(),
            tables: vec![big_table()],
            ..base
        },
    );
    let server = PsProcess::spawn(&bin, &config, dir.path(), "server");
    let addr = layout.addr(0, 0).to_owned();
    wait_role(&addr, ShardRole::Primary, Duration::from_secs(30)).await;
    let data = data_client(&addr, transport);
    fill(&data, 0, 1).await;
    let pid = server.pid().unwrap();
    let load = Load::start_at(data, 0, 1, false, FETCHES_PER_SEC);
    load.flowing().await;
    let before = quiet_window().await;
    let rss_before = rss_mib(pid);
    Loaded {
        _dir: dir,
        server,
        addr,
        pid,
        load,
        before,
        rss_before,
    }
}

async fn stalled_and_partial_senders(transport: TransportKind) {
    let _alone = ONE_AT_A_TIME.lock().await;
    let Loaded {
        _dir,
        server: _server,
        addr,
        pid,
        load,
        before,
        rss_before,
    } = loaded_server(
        transport,
        PsServerConfig {
            inbound: InboundConfig {
                max_bytes: BUDGET,
                frame_timeout_ms: FRAME_TIMEOUT_MS,
                ..InboundConfig::default()
            },
            ..PsServerConfig::default()
        },
    )
    .await;

    // The attackers run in a process of their own at the lowest CPU
    // priority: in a fleet they are other hosts, while here they share
    // this host's two cores with the server and the worker. (As a thread
    // of this process, a starved attacker holding the process's memory-map
    // lock stalled the worker's Fetches for 250-460 ms under CPU hogs.)
    let per_sender = sent_per_sender();
    let attack_started = Instant::now();
    let mut attackers = tokio::process::Command::new("nice")
        .args([
            "-n",
            "19",
            env!("CARGO_BIN_EXE_tessera-hostile"),
            "--addr",
            &addr,
        ])
        .args([
            "--stalled",
            &STALLED.to_string(),
            "--partial",
            &PARTIAL.to_string(),
        ])
        .args([
            "--announce",
            &ANNOUNCED.to_string(),
            "--send",
            &per_sender.to_string(),
        ])
        .args(["--sources", "60"])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("nice and tessera-hostile");
    let mut reports =
        tokio::io::BufReader::new(attackers.stdout.take().expect("its stdout")).lines();
    let mut peak = rss_before;
    let mut closed = Vec::new();
    let mut late = 0usize;
    // Late peers' closes, from their announcement: the handshake bound may
    // have closed them earlier than the frame timeout, but never later.
    let mut late_closed = Vec::new();
    let mut sent = 0usize;
    // Bounded, generously: the attackers' process is the last to get this
    // host's CPU (each is checked against its own announcement below).
    let mut waiting = Waiting::new(
        Duration::from_secs(90),
        "every attacker closed by the server",
    );
    loop {
        tokio::select! {
            line = reports.next_line() => match line.expect("the attackers' report") {
                Some(line) if line == "done" => break,
                Some(line) => {
                    let fields: Vec<&str> = line.split_whitespace().collect();
                    let ["closed", after, was_late, bytes] = fields[..] else {
                        panic!("an attacker could not connect: {line}");
                    };
                    let after = Duration::from_millis(after.parse().unwrap());
                    if was_late == "1" {
                        late += 1;
                        late_closed.push(after);
                    } else {
                        closed.push(after);
                    }
                    sent += bytes.parse::<usize>().unwrap();
                }
                None => break,
            },
            // Fails the drill once the deadline has passed; else 20 ms
            // without a report: a sample of the server's RSS.
            () = waiting.tick(format!(
                "{} of {} attackers closed by the server",
                closed.len() + late,
                STALLED + PARTIAL
            )) => {
                peak = peak.max(rss_mib(pid));
            }
        }
    }
    let _ = attackers.wait().await;
    peak = peak.max(rss_mib(pid));
    let attack = (attack_started, Instant::now());
    let after = quiet_window().await;
    let samples = load.stop().await;
    let rss_after = rss_mib(pid);
    let base = percentiles(&samples, &[before, after]);
    let during = percentiles(&samples, &[attack]);
    let timeline = slow_fetches(&samples, attack.0, 3.0 * base.2);
    closed.sort();
    let budget_mib = (BUDGET >> 20) as f64;
    eprintln!(
        "drill hostile-peers [{}]: {STALLED} connections announcing 60 MiB and stalling + {PARTIAL} sending {} MiB of 60 MiB, from 60 addresses; inbound budget {budget_mib:.0} MiB, frame timeout {FRAME_TIMEOUT_MS} ms; the partial senders wrote {:.0} MiB of their bodies (whole MiB the kernel took); server RSS {rss_before:.0} MiB before, peak {peak:.0} MiB during (+{:.0} MiB), {rss_after:.0} MiB after; attackers closed by the server {} of {} (first {:?}, last {:?} after their announcement; {late} more connected over a second before announcing, not timed); Fetch (64 keys, {FETCHES_PER_SEC}/s open loop) without the attack: {} calls p50 {:.2} ms p99 {:.2} ms; during: {} calls p50 {:.2} ms p99 {:.2} ms max {:.1} ms (p99 ratio {:.2}); failed Fetches 0 (any failure fails the drill)",
        super::label(transport),
        per_sender / MIB,
        sent as f64 / MIB as f64,
        peak - rss_before,
        closed.len() + late,
        STALLED + PARTIAL,
        closed.first().copied().unwrap_or_default(),
        closed.last().copied().unwrap_or_default(),
        base.0,
        base.1,
        base.2,
        during.0,
        during.1,
        during.2,
        during.3,
        during.2 / base.2.max(1e-9)
    );
    assert_eq!(closed.len() + late, STALLED + PARTIAL);
    let timeout = Duration::from_millis(FRAME_TIMEOUT_MS);
    match closed.first() {
        Some(&first) => assert!(
            first >= timeout - Duration::from_millis(500),
            "closed by the frame timeout, not before: {first:?}"
        ),
        // Beside two CPU hogs the attackers' process (at the lowest
        // priority) once announced every peer over a second after its
        // connect: none can be timed from its announcement.
        None => eprintln!(
            "drill hostile-peers: every attacker announced over a second after connecting (a starved attacker process); the frame timeout's lower bound is not checked this run"
        ),
    }
    let last = closed.iter().chain(&late_closed).max().copied();
    assert!(
        last.is_some_and(|last| last <= 3 * timeout),
        "every attacker closed soon after its frame timeout: {last:?}"
    );
    assert!(
        peak - rss_before <= budget_mib,
        "the server grew by {:.0} MiB with an inbound budget of {budget_mib:.0} MiB",
        peak - rss_before
    );
    assert!(during.0 > 0);
    // 3x, or 25 ms (a floor for this VM's own pauses of a few ms). The
    // stalls of 130-460 ms under two CPU hogs (5 of 12 runs, then 3 of 3)
    // were the attackers' starved thread holding this process's
    // memory-map lock; as a process of their own, none in 16 runs. A
    // failure's message says where in the attack the slow Fetches were.
    let bound = (3.0 * base.2).max(25.0);
    assert!(
        during.2 <= bound,
        "Fetch p99 {:.2} ms during the attack against {:.2} ms without (bound {bound:.1} ms); Fetches over 3x the p99 without, by 250 ms from the attack's start: {timeline}",
        during.2,
        base.2
    );
}

/// Fetches due from `from` on that took longer than `slow_ms`, counted by
/// 250 ms interval from `from`: `+<ms>: <slow>/<all> (max <ms>)`, for a
/// failure's message (where in the attack the time went: its start, when
/// the bodies arrive, or the frame timeout, when every attacker is closed
/// at once).
fn slow_fetches(samples: &[(Instant, Duration)], from: Instant, slow_ms: f64) -> String {
    let mut buckets = std::collections::BTreeMap::<u128, (usize, usize, f64)>::new();
    for (at, took) in samples.iter().filter(|(at, _)| *at >= from) {
        let ms = took.as_secs_f64() * 1e3;
        let bucket = buckets.entry((*at - from).as_millis() / 250).or_default();
        bucket.0 += 1;
        bucket.1 += usize::from(ms > slow_ms);
        bucket.2 = bucket.2.max(ms);
    }
    buckets
        .iter()
        .filter(|(_, (_, slow, _))| *slow > 0)
        .map(|(i, (all, slow, max))| format!("+{}: {slow}/{all} (max {max:.1})", i * 250))
        .collect::<Vec<_>>()
        .join(", ")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drill_tcp_stalled_and_partial_senders_cannot_exhaust_the_server() {
    stalled_and_partial_senders(TransportKind::Tcp).await;
}

/// Connections of each malformed kind in the flood drill.
const FLOOD_PER_KIND: usize = 200;

/// What one malformed connection sends, by kind: garbage with a huge
/// length prefix; well-framed messages whose RPC header is garbage; an
/// RDMA hello followed by garbage; an HTTP/2 preface followed by garbage
/// frames; garbage where the HTTP/2 preface belongs.
fn malformed(kind: usize, seed: u64) -> Vec<u8> {
    use rand::RngCore;
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let mut garbage = vec![0u8; 4096];
    rng.fill_bytes(&mut garbage);
    match kind {
        0 => {
            let mut out = u32::MAX.to_le_bytes().to_vec();
            out.extend_from_slice(&garbage);
            out
        }
        1 => {
            let mut out = Vec::new();
            for chunk in garbage.chunks(512) {
                out.extend_from_slice(&(chunk.len() as u32).to_le_bytes());
                out.extend_from_slice(chunk);
            }
            out
        }
        2 => {
            let mut out = b"TSRD".to_vec();
            out.extend_from_slice(&garbage);
            out
        }
        3 => {
            let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
            out.extend_from_slice(&garbage);
            out
        }
        _ => garbage,
    }
}

/// Sends `bytes` on a new connection to `addr`, then reads until the
/// server closes it (bounded). Whether the server closed it.
async fn malformed_peer(addr: String, bytes: Vec<u8>) -> bool {
    let Ok(mut raw) = TcpStream::connect(&addr).await else {
        return false;
    };
    let _ = raw.write_all(&bytes).await;
    let mut sink = [0u8; 4096];
    let closed = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match raw.read(&mut sink).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    closed.is_ok()
}

/// Malformed connections against every listener of a ps-server process
/// (its Tessera endpoint, over TCP or the RDMA listener, and its gRPC
/// endpoint) while a worker Fetches: the server stays up, its memory
/// bounded, every Fetch answered, and its log gets a few rate-limited
/// lines instead of one per connection.
async fn malformed_flood(transport: TransportKind) {
    let _alone = ONE_AT_A_TIME.lock().await;
    let grpc = tessera_test_support::free_addr();
    let Loaded {
        _dir,
        server,
        addr,
        pid,
        load,
        before,
        rss_before,
    } = loaded_server(
        transport,
        PsServerConfig {
            grpc_listen: Some(grpc.clone()),
            // The flood's connections come from one address.
            inbound: InboundConfig {
                max_connections_per_address: 4096,
                handshake_timeout_ms: 2000,
                ..InboundConfig::default()
            },
            ..PsServerConfig::default()
        },
    )
    .await;
    let warnings_before = server.log_text().matches(" WARN ").count();
    let started = Instant::now();
    let mut peers = tokio::task::JoinSet::new();
    let kinds = [
        (0, addr.clone()),
        (1, addr.clone()),
        (2, addr.clone()),
        (3, grpc.clone()),
        (4, grpc.clone()),
    ];
    let mut peak = rss_before;
    for i in 0..FLOOD_PER_KIND {
        for (kind, target) in &kinds {
            let kind = *kind;
            let peer = malformed_peer(target.clone(), malformed(kind, (i * 10 + kind) as u64));
            peers.spawn(async move { (kind, peer.await) });
        }
        if i % 20 == 0 {
            peak = peak.max(rss_mib(pid));
        }
    }
    // Closed by the server within 10 s, per kind.
    let mut closed = [0usize; 5];
    let mut total = 0;
    while let Some(outcome) = peers.join_next().await {
        total += 1;
        let (kind, was_closed) = outcome.unwrap();
        closed[kind] += usize::from(was_closed);
        if total % 50 == 0 {
            peak = peak.max(rss_mib(pid));
        }
    }
    let flood = (started, Instant::now());
    let after = quiet_window().await;
    let samples = load.stop().await;
    let health = tessera_test_support::health(&addr).await;
    let warnings = server.log_text().matches(" WARN ").count() - warnings_before;
    let base = percentiles(&samples, &[before, after]);
    let during = percentiles(&samples, &[flood]);
    eprintln!(
        "drill malformed-flood [{}]: {total} malformed connections ({FLOOD_PER_KIND} each: huge length prefix, garbage RPC headers, garbage after an RDMA hello, garbage after an HTTP/2 preface, garbage for a preface) in {:?}; closed by the server within 10 s, by kind: {closed:?} of {FLOOD_PER_KIND} each; server RSS {rss_before:.0} MiB before, peak {peak:.0} MiB (+{:.0} MiB); WARN lines logged {warnings}; Fetch (64 keys, {FETCHES_PER_SEC}/s) without: {} calls p99 {:.2} ms; during: {} calls p99 {:.2} ms max {:.1} ms; failed Fetches 0 (any failure fails the drill); Health after: {}",
        super::label(transport),
        flood.1 - flood.0,
        peak - rss_before,
        base.0,
        base.2,
        during.0,
        during.2,
        during.3,
        if health.is_ok() { "ok" } else { "FAILED" },
    );
    assert!(health.is_ok(), "the server answers Health after the flood");
    // The Tessera endpoint closes every malformed connection; the gRPC
    // endpoint (hyper's HTTP/2) closes those it can tell are malformed,
    // and may hold a connection that parses as a frame it waits to finish
    // until HTTP/2 keepalive gives up on it (reported, not asserted).
    assert_eq!(
        closed[..3].iter().sum::<usize>(),
        3 * FLOOD_PER_KIND,
        "the Tessera endpoint closed every malformed connection: {closed:?}"
    );
    assert!(
        peak - rss_before < 64.0,
        "the server grew by {:.0} MiB",
        peak - rss_before
    );
    assert!(
        warnings <= 20,
        "{warnings} WARN lines for {total} malformed connections from one address"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drill_tcp_a_malformed_flood_against_every_listener() {
    malformed_flood(TransportKind::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drill_rdma_a_malformed_flood_against_every_listener() {
    malformed_flood(TransportKind::Rdma).await;
}
