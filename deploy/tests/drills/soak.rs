//! The fault soak (issue 33): a 2 x 2 cluster with failover (a local
//! etcd of three members) and periodic checkpoints, a trainer and a Fetch
//! load, and a nemesis that applies a seeded schedule of faults
//! (`tessera_deploy::soak`): SIGKILL and restart of a server, SIGSTOP/
//! SIGCONT pauses, graceful restarts, SIGKILL of etcd's leader member, a
//! server's checkpoint disk filled (a small tmpfs), a server's host cut
//! off the network (its link down for the hold) or its link flapping (down
//! and up several times, at seeded intervals), overlapping where the
//! schedule says so. Each server runs on a host of its own (a network
//! namespace, `tessera_test_support::netns`), the test (trainer, Fetches)
//! and etcd's members on another, so a cut link isolates one server from
//! etcd, its peers and the worker; over RDMA its soft NIC's port goes down
//! with the link. A destructive fault waits while its shard has no
//! other copy in step (what a replicated cluster is built to survive is one
//! copy lost at a time). At the end, the audit against the trainer's own
//! record (an independent model of what was acknowledged): every
//! acknowledged Push applied exactly once, none twice, the hot rows the sum
//! of exactly the Pushes applied, every copy of every shard bit-identical
//! to its primary; every faulted server back in step.
//!
//! It prints the schedule, and per fault kind the faults, failed steps and
//! Fetches in their windows, the longest stall and the recovery times
//! (server faults: from the fault's end until the server is in step again;
//! etcd: from the kill until a new leader; disk: from freeing it until the
//! next checkpoint saved). Every failed request is printed with its error
//! and whether some shard had no copy serving at the time (every copy of
//! it under a fault or not yet back in step), or it was in flight as a
//! server went silent (paused, its link cut or flapping: a client cannot
//! tell for up to 2 s, past the request's 1 s deadline); a failure
//! otherwise fails the soak. A destructive fault waits until another copy
//! is in step by its own word and its primary's.
//!
//! `TESSERA_SOAK_SECS` (default 120), `TESSERA_SOAK_SEED` (default 33;
//! `random` draws one, printed), `TESSERA_SOAK_KINDS` (the kinds to draw,
//! by name), `TESSERA_SOAK_TRANSPORT` (`tcp`, or `rdma`) and
//! `TESSERA_SOAK_KEEP` (keep the run directory) and `TESSERA_SOAK_NET`
//! (`loopback`: every process on this host's loopback, no link faults)
//! set the run; `scripts/dev soak` runs it longer. The link faults need
//! network namespaces and the disk fault a tmpfs (both root): without
//! them, they are not drawn and the soak says why.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nix::sys::signal::Signal;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tessera_deploy::soak::{FaultKind, Schedule, ScheduleConfig};
use tessera_deploy::{Cluster, Placement};
use tessera_proto::v1::{HealthResponse, ShardRole};
use tessera_ps_server::config::{AckMode, CoordinatorKind};
use tessera_rpc::TransportKind;
use tessera_test_support::netns::NetCluster;

use super::trainer::{Step, TABLE, Trainer, audit, hot_keys, wait_identical, worker_client};
use super::{ONE_AT_A_TIME, cluster_config, label};

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

/// `TESSERA_SOAK_KINDS`: the fault kinds to draw (comma-separated names,
/// as the report prints them); default every kind the soak applies.
fn soak_kinds() -> Option<Vec<FaultKind>> {
    let names = std::env::var("TESSERA_SOAK_KINDS").ok()?;
    Some(
        names
            .split(',')
            .map(|name| {
                FaultKind::from_name(name.trim()).unwrap_or_else(|| {
                    panic!(
                        "TESSERA_SOAK_KINDS: no fault kind {name:?} (kinds: {:?})",
                        FaultKind::ALL.map(FaultKind::name)
                    )
                })
            })
            .collect(),
    )
}

/// Seconds between the soak's servers' checkpoints: often, so that a
/// filled disk fails saves within its hold.
const CHECKPOINT_SECS: u64 = 2;
/// Each server's checkpoint disk (a tmpfs): room for the checkpoints kept.
const DISK_MIB: u64 = 256;

/// Whether `health` says its server holds a copy of `shard` that serves:
/// a primary, or a replica in step and not copying.
fn serves(health: &HealthResponse, shard: u32) -> bool {
    health.shard_health.iter().any(|s| {
        s.shard == shard
            && (s.role == ShardRole::Primary as i32
                || (s.role == ShardRole::Replica as i32 && s.in_step && !s.syncing))
    })
}

/// Whether `shard` has a copy in step on a server other than `except`:
/// by its own word and its primary's (a replica the primary cut off, and
/// acknowledged Pushes without, does not know it until it hears so; the
/// soak once killed the primary then and lost those Pushes). One health
/// scan of the shard's servers.
async fn another_copy_in_step(cluster: &Cluster, shard: u32, except: usize) -> bool {
    let mut answers = Vec::new();
    for (i, server) in cluster.servers().iter().enumerate() {
        if server.shard == shard
            && let Ok(health) = tessera_test_support::health(&server.address).await
        {
            answers.push((i, server.address.as_str(), health));
        }
    }
    let Some((primary, replicas)) = answers.iter().find_map(|(_, address, health)| {
        health
            .shard_health
            .iter()
            .find(|s| s.shard == shard && s.role == ShardRole::Primary as i32 && !s.fenced)
            .map(|s| (*address, &s.replicas))
    }) else {
        return false;
    };
    answers.iter().any(|(i, address, health)| {
        *i != except
            && serves(health, shard)
            && (*address == primary || replicas.iter().any(|r| r.address == *address && r.in_step))
    })
}

/// One request of the load: when it ran and why it failed, if it did.
#[derive(Debug, Clone)]
struct Outcome {
    started: Instant,
    ended: Instant,
    error: Option<String>,
}

/// A Fetch load beside the trainer.
fn fetch_load(
    client: Arc<tessera_worker::PsClient>,
    stop: Arc<AtomicBool>,
    outcomes: Arc<Mutex<Vec<Outcome>>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let keys: Vec<u64> = hot_keys(0).into_iter().chain(hot_keys(1)).collect();
        while !stop.load(Ordering::Relaxed) {
            let started = Instant::now();
            let error = client
                .fetch(TABLE, &keys)
                .await
                .err()
                .map(|e| e.to_string());
            outcomes.lock().unwrap().push(Outcome {
                started,
                ended: Instant::now(),
                error,
            });
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
}

/// The checkpoint disks: a tmpfs per server, mounted before the cluster
/// starts (the launcher's `checkpoints/ps-gG-sS`), unmounted when
/// dropped.
struct Disks(Vec<PathBuf>);

impl Disks {
    /// Mounts one per server of a `groups` x `shards` cluster under
    /// `run_dir`; the reason if it cannot (not root, no `mount`).
    fn mount(run_dir: &Path, groups: u32, shards: u32) -> Result<Self, String> {
        let mut disks = Disks(Vec::new());
        for group in 0..groups {
            for shard in 0..shards {
                let dir = run_dir
                    .join("checkpoints")
                    .join(format!("ps-g{group}-s{shard}"));
                std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
                let out = std::process::Command::new("mount")
                    .args(["-t", "tmpfs", "-o", &format!("size={DISK_MIB}m"), "tmpfs"])
                    .arg(&dir)
                    .output()
                    .map_err(|e| format!("mount: {e}"))?;
                if !out.status.success() {
                    return Err(format!(
                        "mount -t tmpfs: {}",
                        String::from_utf8_lossy(&out.stderr).trim()
                    ));
                }
                disks.0.push(dir);
            }
        }
        Ok(disks)
    }

    fn filler(dir: &Path) -> PathBuf {
        dir.join("soak-filler")
    }

    /// Fills `dir`'s disk: writes until the disk says it is full.
    fn fill(dir: &Path) {
        use std::io::Write;
        let mut file = std::fs::File::create(Self::filler(dir)).unwrap();
        let chunk = vec![0u8; 1 << 20];
        loop {
            match file.write_all(&chunk) {
                Ok(()) => {}
                Err(err) if err.raw_os_error() == Some(nix::libc::ENOSPC) => break,
                Err(err) => panic!("filling {}: {err}", dir.display()),
            }
        }
    }

    fn free(dir: &Path) {
        std::fs::remove_file(Self::filler(dir)).unwrap();
    }
}

impl Drop for Disks {
    fn drop(&mut self) {
        for dir in &self.0 {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(dir)
                .status();
        }
    }
}

/// The soak's hosts, where it runs on network namespaces: server `i` on
/// host `i + 1`, the test itself and etcd's members on the last
/// ([`CLIENT_HOST`]).
struct Hosts {
    net: Arc<NetCluster>,
    /// Each server's soft NIC port file, over RDMA (the port is down
    /// while it exists): down with the server's link.
    port_files: Option<Vec<PathBuf>>,
}

/// The host of the test (trainer, Fetches, audit) and etcd.
const CLIENT_HOST: usize = 5;

impl Hosts {
    /// Takes server `index`'s host off the network (`up` false) or back.
    fn set_link(&self, index: usize, up: bool) {
        tokio::task::block_in_place(|| {
            if up {
                if let Some(files) = &self.port_files {
                    let _ = std::fs::remove_file(&files[index]);
                }
                self.net.set_link(index + 1, true);
            } else {
                self.net.set_link(index + 1, false);
                if let Some(files) = &self.port_files {
                    std::fs::write(&files[index], b"").unwrap();
                }
            }
        });
    }

    /// Flaps server `index`'s link until `hold` has passed: down and up
    /// for 150-1,200 ms each, drawn from `seed`; it ends up.
    fn flap(
        self: &Arc<Self>,
        index: usize,
        hold: Duration,
        seed: u64,
    ) -> tokio::task::JoinHandle<usize> {
        let hosts = Arc::clone(self);
        tokio::spawn(async move {
            let end = Instant::now() + hold;
            let mut rng = SmallRng::seed_from_u64(seed);
            let mut downs = 0;
            loop {
                hosts.set_link(index, false);
                downs += 1;
                let down = Duration::from_millis(rng.random_range(150..=1_200));
                tokio::time::sleep_until((Instant::now() + down).min(end).into()).await;
                hosts.set_link(index, true);
                let up = Duration::from_millis(rng.random_range(150..=1_200));
                if Instant::now() + up >= end {
                    break downs;
                }
                tokio::time::sleep(up).await;
            }
        })
    }
}

/// A fault as applied.
struct Applied {
    kind: FaultKind,
    /// The server it hit (the etcd member, for an etcd fault).
    target: usize,
    from: Instant,
    /// When it ended (set when it does).
    to: Instant,
    deferred: bool,
    /// When it had recovered (module docs), found by a watcher.
    recovered: Option<tokio::task::JoinHandle<Option<Instant>>>,
    /// A flapping link's flapper (how many times it went down).
    flapper: Option<tokio::task::JoinHandle<usize>>,
}

const RECOVERY_BOUND: Duration = Duration::from_secs(120);

/// How long a client may send requests to a server that went silent
/// before it can tell: its channel's silence limit (2 s) and a margin.
const SILENCE_NOTICED: Duration = Duration::from_millis(2500);

/// Polls until server `index` holds a copy in step again.
fn watch_in_step(cluster: &Cluster, index: usize) -> tokio::task::JoinHandle<Option<Instant>> {
    let (address, shard) = (
        cluster.servers()[index].address.clone(),
        cluster.servers()[index].shard,
    );
    tokio::spawn(async move {
        let started = Instant::now();
        while started.elapsed() < RECOVERY_BOUND {
            if let Ok(health) = tessera_test_support::health(&address).await
                && serves(&health, shard)
            {
                return Some(Instant::now());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    })
}

/// Polls until server `index` reports a checkpoint saved after `after`.
fn watch_saved(cluster: &Cluster, index: usize) -> tokio::task::JoinHandle<Option<Instant>> {
    let address = cluster.servers()[index].address.clone();
    let after = unix_ms();
    tokio::spawn(async move {
        let started = Instant::now();
        while started.elapsed() < RECOVERY_BOUND {
            if let Ok(health) = tessera_test_support::health(&address).await
                && health
                    .checkpoint
                    .is_some_and(|c| c.last_success_unix_ms > after)
            {
                return Some(Instant::now());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    })
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The etcd member that leads, waiting up to 10 s for one.
fn etcd_leader(cluster: &mut Cluster) -> Option<usize> {
    let etcd = cluster.etcd_mut()?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let leader = tokio::task::block_in_place(|| etcd.leader());
        if leader.is_some() || Instant::now() > deadline {
            return leader;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Ends, in time order, every fault of `pending` (end time, index in
/// `applied`) due by `until`, each once its time has come, and starts its
/// recovery watcher.
async fn end_due(
    cluster: &mut Cluster,
    disks: &Disks,
    hosts: Option<&Arc<Hosts>>,
    pending: &mut Vec<(Instant, usize)>,
    applied: &mut [Applied],
    until: Instant,
) {
    pending.sort_by_key(|p| p.0);
    while let Some(&(at, ended)) = pending.first().filter(|p| p.0 <= until) {
        tokio::time::sleep_until(at.into()).await;
        let fault = &mut applied[ended];
        match fault.kind {
            FaultKind::PauseServer => cluster.signal(fault.target, Signal::SIGCONT),
            FaultKind::KillServer | FaultKind::RestartServer => {
                cluster.restart(fault.target).unwrap();
            }
            FaultKind::KillEtcdLeader => {
                let etcd = cluster.etcd_mut().expect("a local etcd");
                tokio::task::block_in_place(|| etcd.restart_member(fault.target)).unwrap();
            }
            FaultKind::FillCheckpointDisk => Disks::free(&disks.0[fault.target]),
            FaultKind::CutLink => hosts.expect("hosts").set_link(fault.target, true),
            FaultKind::FlapLink => {
                if let Some(flapper) = fault.flapper.take() {
                    flapper.await.unwrap();
                }
                hosts.expect("hosts").set_link(fault.target, true);
            }
        }
        fault.to = Instant::now();
        match fault.kind {
            FaultKind::KillEtcdLeader => {}
            FaultKind::FillCheckpointDisk => {
                fault.recovered = Some(watch_saved(cluster, fault.target));
            }
            _ => fault.recovered = Some(watch_in_step(cluster, fault.target)),
        }
        pending.remove(0);
    }
}

/// Merges intervals into disjoint ones, in order.
fn merged(mut intervals: Vec<(Instant, Instant)>) -> Vec<(Instant, Instant)> {
    intervals.sort_by_key(|i| i.0);
    let mut out: Vec<(Instant, Instant)> = Vec::new();
    for (from, to) in intervals {
        match out.last_mut() {
            Some(last) if from <= last.1 => last.1 = last.1.max(to),
            _ => out.push((from, to)),
        }
    }
    out
}

/// The times when every one of `servers` (each a list of times it was
/// out) was out at once.
fn all_out(servers: &[Vec<(Instant, Instant)>]) -> Vec<(Instant, Instant)> {
    let mut common = merged(servers.first().cloned().unwrap_or_default());
    for other in &servers[1.min(servers.len())..] {
        let other = merged(other.clone());
        let mut next = Vec::new();
        for &(a, b) in &common {
            for &(c, d) in &other {
                let (from, to) = (a.max(c), b.min(d));
                if from < to {
                    next.push((from, to));
                }
            }
        }
        common = next;
    }
    common
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

/// What happened to the load during one kind of fault.
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
    /// Recovery times (module docs).
    recoveries: Vec<Duration>,
}

fn ms(d: Duration) -> u128 {
    d.as_millis()
}

async fn soak(transport: TransportKind, net: Option<Arc<NetCluster>>) {
    let _alone = ONE_AT_A_TIME.lock().await;
    let seed = soak_seed();
    let duration = Duration::from_secs(soak_secs());
    let dir = tempfile::tempdir().unwrap();
    // `TESSERA_SOAK_KEEP=1` keeps the run directory (logs, configs).
    let dir_path = dir.path().to_owned();
    let _dir = if std::env::var_os("TESSERA_SOAK_KEEP").is_some() {
        eprintln!("soak: keeping the run directory {}", dir.path().display());
        let _ = dir.keep();
        None
    } else {
        Some(dir)
    };
    let dir = dir_path;
    let mut config = cluster_config(transport, CoordinatorKind::Etcd, AckMode::Replicas);
    config.local_etcd_members = 3;
    config.checkpoint_interval_secs = CHECKPOINT_SECS;
    let mut kinds = vec![
        FaultKind::KillServer,
        FaultKind::PauseServer,
        FaultKind::RestartServer,
        FaultKind::KillEtcdLeader,
    ];
    let disks = match Disks::mount(&dir, config.replica_groups, config.num_shards) {
        Ok(disks) => {
            kinds.push(FaultKind::FillCheckpointDisk);
            disks
        }
        Err(why) => {
            eprintln!("soak: SKIPPED the checkpoint-disk fault: {why}");
            Disks(Vec::new())
        }
    };
    let servers = (config.replica_groups * config.num_shards) as usize;
    let hosts = net.map(|net| {
        let port_files = (transport == TransportKind::Rdma).then(|| {
            (0..servers)
                .map(|i| dir.join(format!("rnic-down-{i}")))
                .collect()
        });
        Arc::new(Hosts { net, port_files })
    });
    let mut cluster = match &hosts {
        Some(hosts) => {
            assert!(servers < CLIENT_HOST, "a host per server");
            kinds.extend([FaultKind::CutLink, FaultKind::FlapLink]);
            config.host = hosts.net.addr(CLIENT_HOST);
            let placements = (0..servers)
                .map(|i| Placement {
                    host: hosts.net.addr(i + 1),
                    prefix: hosts.net.prefix(i + 1),
                    soft_port_file: hosts.port_files.as_ref().map(|files| files[i].clone()),
                })
                .collect();
            Cluster::start_placed(&config, &dir, placements)
                .await
                .unwrap()
        }
        None => Cluster::start(&config, &dir).await.unwrap(),
    };
    // The launcher's order is group-major, as the disks were mounted.
    for (i, server) in cluster.servers().iter().enumerate().take(disks.0.len()) {
        assert!(
            disks.0[i].ends_with(format!("ps-g{}-s{}", server.group, server.shard)),
            "the disks follow the servers' order"
        );
    }
    if let Some(only) = soak_kinds() {
        for kind in &only {
            assert!(
                kinds.contains(kind),
                "TESSERA_SOAK_KINDS: the soak does not apply {}",
                kind.name()
            );
        }
        kinds = only;
    }
    let schedule = Schedule::draw(
        seed,
        &ScheduleConfig {
            duration,
            quiet_tail: Duration::from_secs(15).min(duration / 4),
            mean_gap: Duration::from_secs(6),
            kinds,
            servers: cluster.servers().len(),
            etcd_members: config.local_etcd_members,
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
    let mut applied: Vec<Applied> = Vec::new();
    for fault in &schedule.faults {
        let due = started + fault.at;
        // Ends that fall before this start come first.
        end_due(
            &mut cluster,
            &disks,
            hosts.as_ref(),
            &mut pending,
            &mut applied,
            due,
        )
        .await;
        tokio::time::sleep_until(due.into()).await;
        // A fault on the same target ends first: the schedule keeps them
        // apart, but a fault's end is due `hold` after it actually started
        // (a little after its time), and two etcd kills at once would take
        // the majority.
        let same: Vec<Instant> = pending
            .iter()
            .filter(|(_, i)| {
                let a = &applied[*i];
                a.kind.same_target(a.target, fault.kind, fault.target)
            })
            .map(|p| p.0)
            .collect();
        if let Some(&until) = same.iter().max() {
            end_due(
                &mut cluster,
                &disks,
                hosts.as_ref(),
                &mut pending,
                &mut applied,
                until,
            )
            .await;
        }
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
                    &disks,
                    hosts.as_ref(),
                    &mut pending,
                    &mut applied,
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
        let mut target = fault.target;
        let mut recovered = None;
        let mut flapper = None;
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
            FaultKind::KillEtcdLeader => {
                // The member that leads now (the schedule's target names
                // a member only for the record).
                target = etcd_leader(&mut cluster).expect("etcd has a leader");
                assert!(
                    cluster
                        .etcd_mut()
                        .expect("a local etcd")
                        .kill_member(target)
                );
                // Its recovery: a new leader among the others.
                let new_leader = etcd_leader(&mut cluster);
                let elected = Instant::now();
                recovered = Some(tokio::spawn(async move {
                    new_leader.filter(|&l| l != target).map(|_| elected)
                }));
            }
            FaultKind::FillCheckpointDisk => Disks::fill(&disks.0[fault.target]),
            FaultKind::CutLink => hosts.as_ref().expect("hosts").set_link(fault.target, false),
            FaultKind::FlapLink => {
                flapper = Some(hosts.as_ref().expect("hosts").flap(
                    fault.target,
                    fault.hold,
                    seed ^ (applied.len() as u64 + 1),
                ));
            }
        }
        applied.push(Applied {
            kind: fault.kind,
            target,
            from: at,
            to: at + fault.hold,
            deferred,
            recovered,
            flapper,
        });
        pending.push((at + fault.hold, applied.len() - 1));
    }
    let last = pending.iter().map(|p| p.0).max().unwrap_or(started);
    end_due(
        &mut cluster,
        &disks,
        hosts.as_ref(),
        &mut pending,
        &mut applied,
        last,
    )
    .await;
    // The quiet tail: the cluster settles under load.
    tokio::time::sleep_until((started + duration).into()).await;
    let (records, steps) = trainer.stop().await;
    stop_fetches.store(true, Ordering::Relaxed);
    fetcher.await.unwrap();
    let fetches = fetches.lock().unwrap().clone();

    let copies = wait_identical(&cluster).await;
    let audit = audit(&cluster, &records, transport).await;

    // Recoveries, and when each server was out (from a fault's start
    // until it was in step again).
    let mut recovered_at = Vec::new();
    for fault in &mut applied {
        let at = match fault.recovered.take() {
            Some(watcher) => watcher.await.unwrap(),
            None => None,
        };
        recovered_at.push(at);
    }
    let mut out: Vec<Vec<(Instant, Instant)>> = vec![Vec::new(); cluster.servers().len()];
    let end_of_run = Instant::now();
    for (fault, at) in applied.iter().zip(&recovered_at) {
        if !matches!(
            fault.kind,
            FaultKind::KillEtcdLeader | FaultKind::FillCheckpointDisk
        ) {
            out[fault.target].push((fault.from, at.unwrap_or(end_of_run)));
        }
    }
    let mut no_copy: Vec<(Instant, Instant)> = Vec::new();
    for shard in 0..config.num_shards {
        let copies: Vec<Vec<(Instant, Instant)>> = cluster
            .servers()
            .iter()
            .enumerate()
            .filter(|(_, s)| s.shard == shard)
            .map(|(i, _)| out[i].clone())
            .collect();
        no_copy.extend(all_out(&copies));
    }
    let no_copy_then =
        |from: Instant, to: Instant| no_copy.iter().any(|&(a, b)| a <= to && from <= b);
    // A server that goes silent (paused, its link cut or flapping) gives
    // no sign: a request already sent there, or sent before the client
    // could tell (its channel calls a link dead after 2 s with nothing
    // heard), fails if its deadline (1 s) comes first. No policy but
    // hedging saves it; these are counted apart.
    let silent: Vec<(Instant, Instant)> = applied
        .iter()
        .filter_map(|f| match f.kind {
            FaultKind::PauseServer | FaultKind::CutLink => Some((f.from, f.from + SILENCE_NOTICED)),
            FaultKind::FlapLink => Some((f.from, f.to + SILENCE_NOTICED)),
            _ => None,
        })
        .collect();
    let went_silent =
        |from: Instant, to: Instant| silent.iter().any(|&(a, b)| a <= to && from <= b);
    let cause_of = |from: Instant, to: Instant| {
        if no_copy_then(from, to) {
            Some("a shard had no copy serving")
        } else if went_silent(from, to) {
            Some("in flight as a server went silent")
        } else {
            None
        }
    };

    // By kind: what the load saw from each fault's start to 3 s after its
    // end (overlapping faults count for each).
    let mut by_kind: BTreeMap<FaultKind, KindReport> = BTreeMap::new();
    for (fault, at) in applied.iter().zip(&recovered_at) {
        let (from, to) = (fault.from, fault.to + Duration::from_secs(3));
        let report = by_kind.entry(fault.kind).or_default();
        report.faults += 1;
        report.deferred += usize::from(fault.deferred);
        if let Some(at) = at {
            let base = if fault.kind == FaultKind::KillEtcdLeader {
                fault.from
            } else {
                fault.to
            };
            report.recoveries.push(at.saturating_duration_since(base));
        }
        let in_window: Vec<&Step> = steps
            .iter()
            .filter(|s| s.started >= from && s.started <= to)
            .collect();
        report.steps += in_window.len();
        report.failed_steps += in_window.iter().filter(|s| !s.ok).count();
        let f: Vec<&Outcome> = fetches
            .iter()
            .filter(|o| o.started >= from && o.started <= to)
            .collect();
        report.fetches += f.len();
        report.failed_fetches += f.iter().filter(|o| o.error.is_some()).count();
        report.longest_stall = report.longest_stall.max(longest_stall(&steps, from, to));
    }
    let never: Vec<String> = applied
        .iter()
        .zip(&recovered_at)
        .filter(|(f, at)| at.is_none() && f.kind != FaultKind::KillEtcdLeader)
        .map(|(f, _)| {
            format!(
                "{:?} of {} at +{} ms",
                f.kind,
                f.target,
                ms(f.from - started)
            )
        })
        .collect();
    let mut table = String::from(
        "| fault | injected | deferred (no other copy in step) | failed steps / in its windows | failed Fetches / in its windows | longest stall ms | recovery ms (median / max) |\n|---|---:|---:|---:|---:|---:|---:|\n",
    );
    for (kind, r) in &mut by_kind {
        r.recoveries.sort();
        let median = r.recoveries.get(r.recoveries.len() / 2).copied();
        let max = r.recoveries.last().copied();
        table.push_str(&format!(
            "| {} | {} | {} | {} / {} | {} / {} | {} | {} / {} |\n",
            kind.name(),
            r.faults,
            r.deferred,
            r.failed_steps,
            r.steps,
            r.failed_fetches,
            r.fetches,
            ms(r.longest_stall),
            median.map_or("-".into(), |d| ms(d).to_string()),
            max.map_or("-".into(), |d| ms(d).to_string()),
        ));
    }

    // Every failed request: its error, and whether a shard had no copy
    // serving while it ran.
    // (count, first and last at, in ms from the start)
    let mut failures: BTreeMap<(Option<&str>, String), (usize, u128, u128)> = BTreeMap::new();
    let push_errors = records.iter().filter_map(|r| r.error.clone());
    let mut unexplained = 0;
    // The seconds (from the start) with unexplained failures: the faults
    // around them are printed.
    let mut unexplained_at = std::collections::BTreeSet::new();
    let mut note = |from: Instant, to: Instant, what: &str, error: &str| {
        let cause = cause_of(from, to);
        unexplained += usize::from(cause.is_none());
        if cause.is_none() {
            unexplained_at.insert((from - started).as_secs());
        }
        let short: String = error.chars().take(160).collect();
        let at = ms(from - started);
        let entry = failures
            .entry((cause, format!("{what}: {short}")))
            .or_insert((0, at, at));
        entry.0 += 1;
        entry.1 = entry.1.min(at);
        entry.2 = entry.2.max(at);
    };
    for o in &fetches {
        if let Some(error) = &o.error {
            note(o.started, o.ended, "Fetch", error);
        }
    }
    for s in steps.iter().filter(|s| !s.ok) {
        let error = s
            .fetch_error
            .clone()
            .unwrap_or_else(|| "a Push failed".into());
        note(s.started, s.ended, "step", &error);
    }
    let push_errors: Vec<String> = push_errors.take(5).collect();
    let failures: String = failures
        .iter()
        .map(|((cause, error), (count, first, last))| {
            format!(
                "  {count} x {error} [{}; first at +{first}, last at +{last} ms]\n",
                cause.unwrap_or("UNEXPLAINED: every shard had a copy serving")
            )
        })
        .collect();
    let failed_steps = steps.iter().filter(|s| !s.ok).count();
    let failed_fetches = fetches.iter().filter(|o| o.error.is_some()).count();
    let no_copy_ms: u128 = no_copy.iter().map(|(a, b)| ms(*b - *a)).sum();
    eprintln!(
        "soak [{}] seed {seed}, {} s: {} steps ({failed_steps} failed), {} Fetches ({failed_fetches} failed); some shard without a copy serving for {no_copy_ms} ms in all; audit (acked, unacked, lost, twice, hot rows exact) {:?}; copies {copies:?}\n{table}failed requests:\n{failures}push errors (first 5): {push_errors:?}",
        label(transport),
        duration.as_secs(),
        steps.len(),
        fetches.len(),
        (
            audit.acked,
            audit.unacked,
            audit.acked_lost,
            audit.applied_twice,
            audit.hot_rows_match
        ),
    );
    // Around each unexplained failure: the faults then, with when each
    // server was back in step.
    let mut around = Vec::new();
    for (fault, at) in applied.iter().zip(&recovered_at) {
        let from = (fault.from - started).as_secs();
        let back = at.map_or(u64::MAX, |at| (at - started).as_secs());
        if unexplained_at
            .iter()
            .any(|&t| t + 10 >= from && t <= back.saturating_add(10))
        {
            around.push(format!(
                "{} of {} +{}..+{} ms, in step again at {}",
                fault.kind.name(),
                fault.target,
                ms(fault.from - started),
                ms(fault.to - started),
                at.map_or("never".into(), |at| format!("+{} ms", ms(at - started)))
            ));
        }
    }
    if !unexplained_at.is_empty() {
        eprintln!(
            "unexplained failures in seconds {unexplained_at:?}; faults around them: {around:?}"
        );
    }
    let replay = format!("seed {seed}: replay with TESSERA_SOAK_SEED={seed}");
    if !audit.lost.is_empty() {
        let lost: Vec<String> = audit
            .lost
            .iter()
            .take(10)
            .map(|(shard, at, epoch)| {
                format!(
                    "shard {shard} epoch {epoch} acked at +{} ms",
                    at.map_or(0, |at| ms(at - started))
                )
            })
            .collect();
        let faults: Vec<String> = applied
            .iter()
            .map(|f| {
                format!(
                    "{} of {} +{}..+{} ms",
                    f.kind.name(),
                    f.target,
                    ms(f.from - started),
                    ms(f.to - started)
                )
            })
            .collect();
        eprintln!("lost (first 10): {lost:?}\nfaults as applied: {faults:?}");
    }
    assert!(audit.acked > 0, "the trainer made progress ({replay})");
    assert_eq!(audit.acked_lost, 0, "acknowledged Pushes lost ({replay})");
    assert_eq!(audit.applied_twice, 0, "Pushes applied twice ({replay})");
    assert!(
        audit.hot_rows_match,
        "the hot rows are not the sum of the Pushes applied ({replay})"
    );
    assert!(never.is_empty(), "never recovered: {never:?} ({replay})");
    assert_eq!(
        unexplained, 0,
        "requests failed while every shard had a copy serving ({replay})"
    );
    cluster.stop().await.unwrap();
    drop(disks);
}

/// `TESSERA_SOAK_TRANSPORT`: `tcp` (default) or `rdma` (the provider
/// switch's: soft, or ibverbs in the VM).
fn soak_transport() -> TransportKind {
    match std::env::var("TESSERA_SOAK_TRANSPORT").ok().as_deref() {
        None | Some("tcp") => TransportKind::Tcp,
        Some("rdma") => TransportKind::Rdma,
        Some(other) => panic!("TESSERA_SOAK_TRANSPORT: tcp or rdma, not {other:?}"),
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn drill_soak_seeded_faults_cost_no_acknowledged_push_and_no_request_a_copy_could_serve() {
    let transport = soak_transport();
    let net = if std::env::var("TESSERA_SOAK_NET").as_deref() == Ok("loopback") {
        eprintln!("soak: SKIPPED the link faults (cut_link, flap_link): TESSERA_SOAK_NET=loopback");
        None
    } else {
        match NetCluster::create(CLIENT_HOST) {
            Ok(net) => Some(Arc::new(net)),
            Err(why) => {
                eprintln!(
                    "soak: SKIPPED the link faults (cut_link, flap_link): no network namespaces here ({why}); every process on loopback"
                );
                None
            }
        }
    };
    match net {
        // The test's own threads (its runtime's, built inside) on the
        // client host: the servers' addresses and etcd's are there.
        Some(net) => {
            let hosts = Arc::clone(&net);
            net.run_on(CLIENT_HOST, move || {
                runtime().block_on(soak(transport, Some(hosts)));
            });
        }
        None => runtime().block_on(soak(transport, None)),
    }
}
