//! The fault soak, first step (issue 33): a 2 x 2 cluster with failover
//! (its local etcd), a trainer and a Fetch load, and a nemesis that applies
//! a seeded schedule of server faults (`tessera_deploy::soak`): SIGKILL
//! and restart, SIGSTOP/SIGCONT pauses, graceful restarts, overlapping
//! where the schedule says so. A destructive fault waits while its shard
//! has no other copy in step (what a replicated cluster is built to
//! survive is one copy lost at a time). At the end, the audit against the
//! trainer's own record (an independent model of what was acknowledged):
//! every acknowledged Push applied exactly once, none twice, the hot rows
//! the sum of exactly the Pushes applied, every copy of every shard
//! bit-identical to its primary. It prints the schedule, the faults by
//! kind, failed steps and Fetches by fault kind, and the longest stall
//! per kind.
//!
//! `TESSERA_SOAK_SECS` (default 120) and `TESSERA_SOAK_SEED` (default 33;
//! `random` draws one, printed) set the run; `scripts/dev soak` runs it
//! longer. Not yet drawn here: etcd leader kills (the launcher's etcd has
//! one member), link cuts and flaps (the netns cluster), a full checkpoint
//! disk.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use tessera_deploy::Cluster;
use tessera_deploy::soak::{FaultKind, Schedule, ScheduleConfig};
use tessera_proto::v1::ShardRole;
use tessera_ps_server::config::{AckMode, CoordinatorKind};
use tessera_rpc::TransportKind;

use super::trainer::{Step, TABLE, Trainer, audit, hot_keys, wait_identical, worker_client};
use super::{ONE_AT_A_TIME, cluster, label};

fn soak_secs() -> u64 {
    std::env::var("TESSERA_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(120)
}

fn soak_seed() -> u64 {
    match std::env::var("TESSERA_SOAK_SEED").ok().as_deref() {
        Some("random") => rand::random(),
        Some(seed) => seed
            .parse()
            .expect("TESSERA_SOAK_SEED: a number or `random`"),
        None => 33,
    }
}

/// Whether `shard` has a copy in step on a server other than `except`
/// (a primary, or a replica in step and not copying), which answers.
async fn another_copy_in_step(cluster: &Cluster, shard: u32, except: usize) -> bool {
    for (i, server) in cluster.servers().iter().enumerate() {
        if i == except || server.shard != shard {
            continue;
        }
        let Ok(health) = tessera_test_support::health(&server.address).await else {
            continue;
        };
        if health.shard_health.iter().any(|s| {
            s.shard == shard
                && (s.role == ShardRole::Primary as i32
                    || (s.role == ShardRole::Replica as i32 && s.in_step && !s.syncing))
        }) {
            return true;
        }
    }
    false
}

/// A Fetch load beside the trainer: its outcomes, by when they started.
fn fetch_load(
    client: Arc<tessera_worker::PsClient>,
    stop: Arc<AtomicBool>,
    outcomes: Arc<Mutex<Vec<(Instant, bool)>>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let keys: Vec<u64> = hot_keys(0).into_iter().chain(hot_keys(1)).collect();
        while !stop.load(Ordering::Relaxed) {
            let started = Instant::now();
            let ok = client.fetch(TABLE, &keys).await.is_ok();
            outcomes.lock().unwrap().push((started, ok));
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
}

/// What happened to the load during one fault.
#[derive(Debug, Default, Clone)]
struct KindReport {
    faults: usize,
    deferred: usize,
    failed_steps: usize,
    steps: usize,
    failed_fetches: usize,
    fetches: usize,
    /// The longest time without a successful step ending, in a fault's
    /// window.
    longest_stall: Duration,
}

/// The longest time in `[from, to]` without a successful step ending.
fn longest_stall(steps: &[Step], from: Instant, to: Instant) -> Duration {
    let mut ends: Vec<Instant> = steps
        .iter()
        .filter(|s| s.ok && s.ended >= from && s.ended <= to)
        .map(|s| s.ended)
        .collect();
    ends.sort();
    let mut last = from;
    let mut longest = Duration::ZERO;
    for end in ends.into_iter().chain(std::iter::once(to)) {
        longest = longest.max(end.saturating_duration_since(last));
        last = end;
    }
    longest
}

/// A fault's window as applied: its kind, when it started and ended, and
/// whether it waited for its shard.
type Window = (FaultKind, Instant, Instant, bool);

/// Ends, in time order, every fault of `pending` (end time, index in the
/// schedule) due by `until`, each once its time has come; notes when it
/// ended in its window.
async fn end_due(
    cluster: &mut Cluster,
    schedule: &Schedule,
    pending: &mut Vec<(Instant, usize)>,
    windows: &mut [Window],
    until: Instant,
) {
    pending.sort_by_key(|p| p.0);
    while let Some(&(at, ended)) = pending.first().filter(|p| p.0 <= until) {
        tokio::time::sleep_until(at.into()).await;
        let fault = &schedule.faults[ended];
        match fault.kind {
            FaultKind::PauseServer => cluster.signal(fault.target, Signal::SIGCONT),
            FaultKind::KillServer | FaultKind::RestartServer => {
                cluster.restart(fault.target).unwrap();
            }
            _ => unreachable!("not drawn"),
        }
        windows[ended].2 = Instant::now();
        pending.remove(0);
    }
}

async fn soak(transport: TransportKind) {
    let _alone = ONE_AT_A_TIME.lock().await;
    let seed = soak_seed();
    let duration = Duration::from_secs(soak_secs());
    let dir = tempfile::tempdir().unwrap();
    let mut cluster = cluster(
        transport,
        CoordinatorKind::Etcd,
        AckMode::Replicas,
        dir.path(),
    )
    .await;
    let schedule = Schedule::draw(
        seed,
        &ScheduleConfig {
            duration,
            quiet_tail: Duration::from_secs(15).min(duration / 4),
            mean_gap: Duration::from_secs(6),
            kinds: vec![
                FaultKind::KillServer,
                FaultKind::PauseServer,
                FaultKind::RestartServer,
            ],
            servers: cluster.servers().len(),
            etcd_members: 0,
            max_concurrent: 2,
        },
    );
    eprintln!(
        "soak [{}]: seed {seed} (replay: TESSERA_SOAK_SEED={seed} TESSERA_SOAK_SECS={}), {} faults: {}",
        label(transport),
        duration.as_secs(),
        schedule.faults.len(),
        serde_json::to_string(&schedule.faults).unwrap()
    );
    let client = worker_client(&cluster);
    let trainer = Trainer::start(Arc::clone(&client), 4);
    let stop_fetches = Arc::new(AtomicBool::new(false));
    let fetches = Arc::new(Mutex::new(Vec::new()));
    let fetcher = fetch_load(
        Arc::clone(&client),
        Arc::clone(&stop_fetches),
        Arc::clone(&fetches),
    );

    // The nemesis: faults in order; each one's end is due `hold` after it
    // actually started (a destructive one may wait for its shard).
    let started = Instant::now();
    let mut pending: Vec<(Instant, usize)> = Vec::new();
    let mut windows: Vec<Window> = Vec::new();
    for (index, fault) in schedule.faults.iter().enumerate() {
        let due = started + fault.at;
        // Ends that fall before this start come first.
        end_due(&mut cluster, &schedule, &mut pending, &mut windows, due).await;
        tokio::time::sleep_until(due.into()).await;
        let shard = cluster.servers()[fault.target].shard;
        let mut deferred = false;
        if fault.kind.destructive() {
            let waiting = Instant::now();
            while !another_copy_in_step(&cluster, shard, fault.target).await {
                deferred = true;
                // Faults due to end meanwhile end (the other copy may be
                // the one a pending restart brings back).
                end_due(
                    &mut cluster,
                    &schedule,
                    &mut pending,
                    &mut windows,
                    Instant::now(),
                )
                .await;
                if waiting.elapsed() > Duration::from_secs(60) {
                    let mut seen = Vec::new();
                    for server in cluster.servers().iter().filter(|s| s.shard == shard) {
                        seen.push((
                            server.address.clone(),
                            tessera_test_support::health(&server.address)
                                .await
                                .map(|h| h.shard_health),
                        ));
                    }
                    panic!(
                        "shard {shard} had no other copy in step for 60 s (seed {seed}): {seen:?}"
                    );
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        let at = Instant::now();
        match fault.kind {
            FaultKind::KillServer => cluster.kill(fault.target).await,
            FaultKind::PauseServer => cluster.signal(fault.target, Signal::SIGSTOP),
            FaultKind::RestartServer => {
                cluster.signal(fault.target, Signal::SIGTERM);
                assert!(
                    cluster.wait_exit(fault.target).await,
                    "server {} did not stop on SIGTERM (seed {seed})",
                    fault.target
                );
            }
            _ => unreachable!("not drawn"),
        }
        windows.push((fault.kind, at, at + fault.hold, deferred));
        pending.push((at + fault.hold, index));
    }
    let last = pending.iter().map(|p| p.0).max().unwrap_or(started);
    end_due(&mut cluster, &schedule, &mut pending, &mut windows, last).await;
    // The quiet tail: the cluster settles under load.
    tokio::time::sleep_until((started + duration).into()).await;
    let (records, steps) = trainer.stop().await;
    stop_fetches.store(true, Ordering::Relaxed);
    fetcher.await.unwrap();
    let fetches = fetches.lock().unwrap().clone();

    let copies = wait_identical(&cluster).await;
    let audit = audit(&cluster, &records, transport).await;

    // By kind: what the load saw from each fault's start to 3 s after its
    // end (overlapping faults count for each).
    let mut by_kind: std::collections::BTreeMap<FaultKind, KindReport> = Default::default();
    for (kind, from, to, deferred) in &windows {
        let to = *to + Duration::from_secs(3);
        let report = by_kind.entry(*kind).or_default();
        report.faults += 1;
        report.deferred += usize::from(*deferred);
        let in_window: Vec<&Step> = steps
            .iter()
            .filter(|s| s.started >= *from && s.started <= to)
            .collect();
        report.steps += in_window.len();
        report.failed_steps += in_window.iter().filter(|s| !s.ok).count();
        let f: Vec<&(Instant, bool)> = fetches
            .iter()
            .filter(|(at, _)| at >= from && *at <= to)
            .collect();
        report.fetches += f.len();
        report.failed_fetches += f.iter().filter(|(_, ok)| !ok).count();
        report.longest_stall = report.longest_stall.max(longest_stall(&steps, *from, to));
    }
    let failed_steps = steps.iter().filter(|s| !s.ok).count();
    let failed_fetches = fetches.iter().filter(|(_, ok)| !ok).count();
    let mut table = String::from(
        "| fault | injected | deferred (no other copy in step) | failed steps / in its windows | failed Fetches / in its windows | longest stall ms |\n|---|---:|---:|---:|---:|---:|\n",
    );
    for (kind, r) in &by_kind {
        table.push_str(&format!(
            "| {kind:?} | {} | {} | {} / {} | {} / {} | {} |\n",
            r.faults,
            r.deferred,
            r.failed_steps,
            r.steps,
            r.failed_fetches,
            r.fetches,
            r.longest_stall.as_millis()
        ));
    }
    eprintln!(
        "soak [{}] seed {seed}, {} s: {} steps ({failed_steps} failed), {} Fetches ({failed_fetches} failed); audit {audit:?}; copies {copies:?}\n{table}",
        label(transport),
        duration.as_secs(),
        steps.len(),
        fetches.len(),
    );
    assert!(audit.acked > 0, "the trainer made progress (seed {seed})");
    assert_eq!(
        audit.acked_lost, 0,
        "acknowledged Pushes lost (seed {seed}: replay with TESSERA_SOAK_SEED={seed})"
    );
    assert_eq!(
        audit.applied_twice, 0,
        "Pushes applied twice (seed {seed}: replay with TESSERA_SOAK_SEED={seed})"
    );
    assert!(
        audit.hot_rows_match,
        "the hot rows are not the sum of the Pushes applied (seed {seed})"
    );
    cluster.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drill_tcp_soak_seeded_server_faults_cost_no_acknowledged_push() {
    soak(TransportKind::Tcp).await;
}
