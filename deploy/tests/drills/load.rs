//! Drills of correctness under load (issue 13), on ps-server processes:
//! replicas of a table with a row limit agree; a checkpoint and a shard
//! copy of a large shard leave Fetches served (their p99 against the same
//! run without one); the primary's memory while it serves a copy.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tessera_deploy::{Cluster, ClusterConfig};
use tessera_proto::v1::{
    AdminClient, CheckpointRequest, FetchRequest, ParameterServerClient, PushRequest, ShardRole,
    StatsRequest,
};
use tessera_ps_server::PsServerConfig;
use tessera_ps_server::config::{OptimizerConfig, TableConfig};
use tessera_rpc::{Channel, TransportKind};
use tessera_test_support::health::patient;
use tessera_test_support::wait::eventually;
use tessera_test_support::{Layout, PsProcess, keys_of_shard, wire};

use super::ONE_AT_A_TIME;
use super::trainer::{TABLE, rdma_settings, table};
use super::trainer::{Trainer, data_client, hot_keys, wait_identical, wait_role, worker_client};

/// Rows of the large shard of the checkpoint and copy drills, and their
/// dimension (Adam: three floats per value, 204 bytes a row as saved).
pub(super) const BIG_ROWS: u64 = 400_000;
const BIG_DIM: usize = 16;

pub(super) fn big_table() -> TableConfig {
    TableConfig {
        optimizer: OptimizerConfig::adam(0.01),
        ..TableConfig::new("big", BIG_DIM as u32)
    }
}

/// Fills `shard` of table `big` with `BIG_ROWS` trained rows.
pub(super) async fn fill(data: &ParameterServerClient, shard: u32, num_shards: u32) {
    let keys = keys_of_shard(shard, num_shards, BIG_ROWS as usize);
    for (i, chunk) in keys.chunks(10_000).enumerate() {
        data.push(PushRequest {
            num_shards: 0,
            table: "big".into(),
            shard,
            keys: chunk.to_vec(),
            gradients: wire(&vec![0.5; chunk.len() * BIG_DIM]).into(),
            worker_id: 77,
            sequence: i as u64 + 1,
        })
        .await
        .unwrap();
    }
}

/// New rows per Fetch with `fresh`. Few enough that the shard does not
/// grow past a resize of its stripes' tables during a drill: a shard that
/// grows rehashes all 64 stripes at about the same time (its keys spread
/// evenly), which blocked every Fetch for about 100 ms in this debug build
/// at 460,000 rows and, landing in a quiet window or a checkpoint at
/// random, made the drill fail one run in three with 32 new rows per
/// Fetch (12,800 rows a second). That growth burst is a latency problem of
/// its own (see the stop note), not the stall this drill is about.
const FRESH: usize = 4;

/// Fetches sent per second by [`Load`], whatever the answers take (an
/// open loop: a stall shows in every Fetch scheduled during it, not in
/// one late answer of a client that waited).
pub(super) const FETCHES_PER_SEC: u64 = 400;

/// Fetches of `big` at a fixed rate — 64 present rows, or with `fresh`
/// [`FRESH`] of them new (which a training server inserts: they take a
/// stripe's write lock) — and a Push with every fourth; each Fetch's
/// latency, counted from when it was due, with the time it ended.
pub(super) struct Load {
    stop: Arc<AtomicBool>,
    /// Fetches answered so far.
    answered: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<Vec<(Instant, Duration)>>,
}

impl Load {
    pub(super) fn start(
        data: ParameterServerClient,
        shard: u32,
        num_shards: u32,
        fresh: bool,
    ) -> Self {
        Self::start_at(data, shard, num_shards, fresh, FETCHES_PER_SEC)
    }

    /// [`Load::start`] at `per_sec` Fetches a second.
    pub(super) fn start_at(
        data: ParameterServerClient,
        shard: u32,
        num_shards: u32,
        fresh: bool,
        per_sec: u64,
    ) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let answered = Arc::new(AtomicU64::new(0));
        let present = Arc::new(keys_of_shard(shard, num_shards, BIG_ROWS as usize));
        let task = tokio::spawn({
            let stop = Arc::clone(&stop);
            let answered = Arc::clone(&answered);
            async move {
                let mut rng = SmallRng::seed_from_u64(5);
                let mut fresh_keys = keys_of_shard(shard, num_shards, 3 * BIG_ROWS as usize)
                    .into_iter()
                    .skip(BIG_ROWS as usize);
                let mut calls = tokio::task::JoinSet::new();
                let mut ticks =
                    tokio::time::interval(Duration::from_micros(1_000_000 / per_sec.max(1)));
                ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let due = ticks.tick().await;
                    n += 1;
                    let mut keys: Vec<u64> = (0..if fresh { 64 - FRESH } else { 64 })
                        .map(|_| present[rng.random_range(0..present.len())])
                        .collect();
                    if fresh {
                        keys.extend(fresh_keys.by_ref().take(FRESH));
                    }
                    let data = data.clone();
                    let answered = Arc::clone(&answered);
                    calls.spawn(async move {
                        data.fetch(FetchRequest {
                            table: "big".into(),
                            shard,
                            keys: keys.clone(),
                        })
                        .await
                        .unwrap();
                        let ended = Instant::now();
                        answered.fetch_add(1, Ordering::Relaxed);
                        if n.is_multiple_of(4) {
                            data.push(PushRequest {
                                num_shards: 0,
                                table: "big".into(),
                                shard,
                                keys: keys[..32].to_vec(),
                                gradients: wire(&vec![0.25; 32 * BIG_DIM]).into(),
                                worker_id: 78,
                                sequence: 1000 + n,
                            })
                            .await
                            .unwrap();
                        }
                        (ended, ended - due.into_std())
                    });
                }
                calls.join_all().await
            }
        });
        Self {
            stop,
            answered,
            task,
        }
    }

    /// Waits until the load flows: 100 Fetches answered.
    pub(super) async fn flowing(&self) {
        eventually(
            Duration::from_secs(30),
            "the load flowing (100 Fetches answered)",
            || async {
                match self.answered.load(Ordering::Relaxed) {
                    n if n >= 100 => Ok(()),
                    n => Err(n),
                }
            },
        )
        .await;
    }

    pub(super) async fn stop(self) -> Vec<(Instant, Duration)> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap()
    }
}

/// (count, p50, p99, max) in ms of the samples that ended in one of
/// `windows` (each `[from, to)`).
pub(super) fn percentiles(
    samples: &[(Instant, Duration)],
    windows: &[(Instant, Instant)],
) -> (usize, f64, f64, f64) {
    let mut window: Vec<f64> = samples
        .iter()
        .filter(|(at, _)| windows.iter().any(|(from, to)| at >= from && at < to))
        .map(|(_, d)| d.as_secs_f64() * 1e3)
        .collect();
    window.sort_by(f64::total_cmp);
    if window.is_empty() {
        return (0, 0.0, 0.0, 0.0);
    }
    let at = |q: f64| window[((window.len() - 1) as f64 * q).round() as usize];
    (window.len(), at(0.5), at(0.99), window[window.len() - 1])
}

/// Resident memory of process `pid` in MiB.
pub(super) fn rss_mib(pid: i32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// A stall caught, not a speed target: the p99 during the event must stay
/// within 10x the same run's p99 without it (or 150 ms, whichever is more:
/// this host's noise floor). A Fetch blocked for the whole encode of the
/// shard, as before, took 1,100-1,300 ms. The floor was 25 ms until two
/// whole-suite runs of one afternoon failed on single pauses of every
/// Fetch for 40-150 ms (a copy: p99 42 ms; a checkpoint: p99 110 ms, max
/// 154 ms), while the same drills alone measured ratios of 0.5-4.4, quiet
/// windows with such pauses included: pauses of this VM, or of the
/// checkpoint's writes, not the stall this catches (see the stop note).
/// The quiet windows
/// alternate with the events (before and after each), so that other tests
/// sharing this host's two cores load both alike: a quiet window taken
/// only before the events once saw 2.8 ms against 39 ms during them, in a
/// CI run where another test started meanwhile.
fn assert_no_stall(what: &str, base_p99: f64, during_p99: f64) {
    let bound = (10.0 * base_p99).max(150.0);
    assert!(
        during_p99 <= bound,
        "{what}: Fetch p99 {during_p99:.2} ms against {base_p99:.2} ms without (bound {bound:.1} ms)"
    );
}

/// How long each quiet window of the stall drills lasts.
pub(super) const QUIET: Duration = Duration::from_secs(1);

/// The quiet window starting now.
pub(super) async fn quiet_window() -> (Instant, Instant) {
    let from = Instant::now();
    tokio::time::sleep(QUIET).await;
    (from, Instant::now())
}

/// A checkpoint of a large shard while Fetches (present and new rows) and
/// Pushes go on: Fetch p99 during the checkpoints against before.
async fn fetches_during_a_checkpoint(transport: TransportKind) {
    let _alone = ONE_AT_A_TIME.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let bin = tessera_test_support::process::ps_server_bin();
    let layout = Layout::new(1, 1);
    let mut config = layout.config(
        0,
        &PsServerConfig {
            transport,
            rdma: rdma_settings(),
            tables: vec![big_table()],
            ..PsServerConfig::default()
        },
    );
    config.checkpoint.dir = Some(dir.path().join("ckpt"));
    let _server = PsProcess::spawn(&bin, &config, dir.path(), "server");
    let addr = layout.addr(0, 0).to_owned();
    wait_role(&addr, ShardRole::Primary, Duration::from_secs(30)).await;
    let data = data_client(&addr, transport);
    fill(&data, 0, 1).await;
    let load = Load::start(data.clone(), 0, 1, true);
    let admin = AdminClient::new(Channel::lazy(&addr, patient()).unwrap());
    // Warm-up, then quiet windows and checkpoints in turn.
    load.flowing().await;
    let mut quiet = vec![quiet_window().await];
    let mut events = Vec::new();
    let mut saves = Vec::new();
    for _ in 0..3 {
        let started = Instant::now();
        let info = admin.checkpoint(CheckpointRequest {}).await.unwrap();
        events.push((started, Instant::now()));
        saves.push((started.elapsed(), info.rows, info.bytes));
        quiet.push(quiet_window().await);
    }
    let samples = load.stop().await;
    let base = percentiles(&samples, &quiet);
    let during = percentiles(&samples, &events);
    eprintln!(
        "drill fetch-during-checkpoint [{}]: shard of {} rows ({:.0} MiB saved), {} checkpoints of up to {:?}; Fetch (64 keys, 4 of them new rows, 400/s open loop) without (quiet windows between them): {} calls p50 {:.2} ms p99 {:.2} ms max {:.1} ms; during: {} calls p50 {:.2} ms p99 {:.2} ms max {:.1} ms (p99 ratio {:.2})",
        super::label(transport),
        saves.first().map_or(0, |s| s.1),
        saves.first().map_or(0, |s| s.2) as f64 / (1 << 20) as f64,
        saves.len(),
        saves.iter().map(|s| s.0).max().unwrap_or_default(),
        base.0,
        base.1,
        base.2,
        base.3,
        during.0,
        during.1,
        during.2,
        during.3,
        during.2 / base.2.max(1e-9)
    );
    assert!(!saves.is_empty() && during.0 > 0);
    assert_no_stall("checkpoint", base.2, during.2);
}

/// A replica restarted empty copies a large shard from its primary while
/// Fetches and Pushes go on at the primary: Fetch p99 during the copy
/// against before, and the primary's memory (the copy shares its rows).
async fn a_copy_of_a_large_shard(transport: TransportKind) {
    let _alone = ONE_AT_A_TIME.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let bin = tessera_test_support::process::ps_server_bin();
    let layout = Layout::new(1, 2);
    let base = PsServerConfig {
        transport,
        rdma: rdma_settings(),
        tables: vec![big_table()],
        ..PsServerConfig::default()
    };
    let primary = PsProcess::spawn(&bin, &layout.config(0, &base), dir.path(), "primary");
    let mut replica = PsProcess::spawn(&bin, &layout.config(1, &base), dir.path(), "replica");
    let (a, b) = (layout.addr(0, 0).to_owned(), layout.addr(1, 0).to_owned());
    wait_role(&a, ShardRole::Primary, Duration::from_secs(30)).await;
    wait_role(&b, ShardRole::Replica, Duration::from_secs(30)).await;
    let data = data_client(&a, transport);
    fill(&data, 0, 1).await;
    wait_role(&b, ShardRole::Replica, Duration::from_secs(30)).await;
    let pid = primary.pid().unwrap();
    let load = Load::start(data.clone(), 0, 1, false);
    load.flowing().await;
    let before = quiet_window().await;
    let rss_before = rss_mib(pid);
    let cut = Instant::now();
    replica.kill();
    replica.restart_clean();
    // Until the replica is in step again, sample the primary's memory.
    let mut peak = rss_before;
    loop {
        peak = peak.max(rss_mib(pid));
        let health = tessera_test_support::health(&b).await;
        if health.is_ok_and(|h| {
            h.shard_health
                .first()
                .is_some_and(|s| s.role == ShardRole::Replica as i32 && s.in_step)
        }) && replica.log_text().contains("shard copied from its primary")
        {
            break;
        }
        assert!(
            cut.elapsed() < Duration::from_secs(120),
            "the copy never finished"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let end = Instant::now();
    let after = quiet_window().await;
    let samples = load.stop().await;
    let copied = replica
        .log_text()
        .lines()
        .rev()
        .find(|l| l.contains("shard copied from its primary"))
        .unwrap_or_default()
        .to_owned();
    let bytes: f64 = copied
        .split_whitespace()
        .find_map(|w| w.strip_prefix("bytes="))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    let base = percentiles(&samples, &[before, after]);
    let during = percentiles(&samples, &[(cut, end)]);
    eprintln!(
        "drill copy-of-a-large-shard [{}]: {:.0} MiB copied in {:?} under load; primary RSS {rss_before:.0} MiB before, peak {peak:.0} MiB during (+{:.0} MiB); Fetch (64 present rows, 400/s open loop) at the primary without (quiet windows before and after): {} calls p50 {:.2} ms p99 {:.2} ms; during: {} calls p50 {:.2} ms p99 {:.2} ms max {:.1} ms (p99 ratio {:.2})",
        super::label(transport),
        bytes / (1 << 20) as f64,
        end - cut,
        peak - rss_before,
        base.0,
        base.1,
        base.2,
        during.0,
        during.1,
        during.2,
        during.3,
        during.2 / base.2.max(1e-9)
    );
    assert!(bytes > 0.0, "{copied}");
    // The copy shares the primary's rows: its memory grows by the rows
    // changed meanwhile and a chunk or two, not by the copy (before: one
    // whole-shard blob per session, briefly two).
    assert!(
        peak - rss_before < 0.5 * bytes / (1 << 20) as f64,
        "the primary grew by {:.0} MiB for a copy of {:.0} MiB",
        peak - rss_before,
        bytes / (1 << 20) as f64
    );
    assert_no_stall("copy", base.2, during.2);
}

/// Replicas of a table with a row limit under the trainer, with Fetches
/// served by both replica groups: every copy identical afterwards, and
/// the hot rows equal on both groups.
async fn row_limited_replicas_agree(transport: TransportKind) {
    let _alone = ONE_AT_A_TIME.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let config = ClusterConfig {
        num_shards: 2,
        replica_groups: 2,
        transport,
        rdma: rdma_settings(),
        tables: vec![TableConfig {
            max_rows: Some(600),
            ..table()
        }],
        ps_server_bin: Some(tessera_test_support::process::ps_server_bin()),
        startup_timeout_ms: 60_000,
        ..ClusterConfig::default()
    };
    let cluster = Cluster::start(&config, dir.path()).await.unwrap();
    let client = worker_client(&cluster);
    let trainer = Trainer::start(Arc::clone(&client), 4);
    // Until the limit was reached and both groups served Fetches (what the
    // drill asserts below, from the same stats).
    eventually(
        Duration::from_secs(60),
        "evictions at the primaries and Fetches served by both groups",
        || async {
            let mut evictions = 0;
            let mut fetches_by_group = [0u64; 2];
            for server in cluster.servers().iter().filter(|s| s.shard < 2) {
                let admin = AdminClient::new(Channel::lazy(&server.address, patient()).unwrap());
                let stats = match admin.stats(StatsRequest {}).await {
                    Ok(stats) => stats,
                    Err(e) => return Err(format!("{}: {e}", server.address)),
                };
                for s in &stats.shards {
                    fetches_by_group[server.group as usize] += s.fetches;
                    if server.group == 0 {
                        evictions += s.evictions;
                    }
                }
            }
            if evictions > 0 && fetches_by_group.iter().all(|&f| f > 0) {
                Ok(())
            } else {
                Err(format!(
                    "{evictions} evictions, Fetches by group {fetches_by_group:?}"
                ))
            }
        },
    )
    .await;
    let (records, _) = trainer.stop().await;
    let identical = wait_identical(&cluster).await;
    let mut evictions = 0;
    let mut fetches_by_group = [0u64; 2];
    let mut differ = 0;
    let mut compared = 0;
    for shard in 0..2u32 {
        let keys = hot_keys(shard);
        let mut rows = Vec::new();
        for server in cluster.servers().iter().filter(|s| s.shard == shard) {
            let admin = AdminClient::new(Channel::lazy(&server.address, patient()).unwrap());
            let stats = admin.stats(StatsRequest {}).await.unwrap();
            for s in &stats.shards {
                fetches_by_group[server.group as usize] += s.fetches;
                if server.group == 0 {
                    evictions += s.evictions;
                }
            }
            let fetched = data_client(&server.address, transport)
                .fetch(FetchRequest {
                    table: TABLE.into(),
                    shard,
                    keys: keys.clone(),
                })
                .await
                .unwrap();
            rows.push(fetched.values);
        }
        compared += keys.len();
        let width = super::trainer::DIM * 4;
        differ += (0..keys.len())
            .filter(|&i| rows[0][i * width..(i + 1) * width] != rows[1][i * width..(i + 1) * width])
            .count();
    }
    eprintln!(
        "drill row-limit-agreement [{}]: {} Pushes, max_rows 600 per shard, {evictions} evictions at the primaries; Fetches served by group 0 / 1: {} / {}; hot rows differing between the groups: {differ} of {compared}; copies identical: {identical:?}",
        super::label(transport),
        records.iter().filter(|r| r.acked_at.is_some()).count(),
        fetches_by_group[0],
        fetches_by_group[1],
    );
    assert!(evictions > 0, "the limit was reached");
    assert!(
        fetches_by_group.iter().all(|&f| f > 0),
        "both groups served Fetches: {fetches_by_group:?}"
    );
    assert_eq!(differ, 0);
    cluster.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drill_tcp_fetches_during_a_checkpoint_of_a_large_shard() {
    fetches_during_a_checkpoint(TransportKind::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drill_tcp_a_copy_of_a_large_shard_under_load() {
    a_copy_of_a_large_shard(TransportKind::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drill_tcp_replicas_of_a_row_limited_table_agree() {
    row_limited_replicas_agree(TransportKind::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drill_rdma_replicas_of_a_row_limited_table_agree() {
    row_limited_replicas_agree(TransportKind::Rdma).await;
}
