//! The resharding drill (issue 39), on real processes: a 2 x 2 cluster
//! (etcd) under a trainer and a ranker grows to 3 shards, then to 4, then
//! shrinks back to 3. Each resize is planned by a `tessera reshard`
//! process that is SIGKILLed as it runs (planned again if the kill came
//! before its write), and one server that moves rows is SIGKILLed while
//! the resize copies (a growth's new primary; in the shrink, a remaining
//! shard's primary) and restarted. The growths' new servers are started
//! by the launcher (`Cluster::add_shard`).
//!
//! The trainer pushes SGD integer gradients through the worker client,
//! split by whatever count it routes by, with one marker key per Push
//! (`trainer.rs`); the ranker fetches hot rows. At the end the audit: every
//! acknowledged Push applied exactly once (its marker reads 1), the hot
//! rows the sum of exactly the Pushes applied, every copy of every shard
//! identical to its primary, every row on the shard the final map names
//! and nowhere else (the primaries' rows add up to the keys written, the
//! given-away shard's servers hold none). Printed: per resize the time
//! from the plan to done, and the share of rows that moved against the
//! jump hash's (1/(n+1) growing from n, 1/n shrinking from n).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tessera_coord::{EtcdCoordinator, ResizeState, ShardMap};
use tessera_deploy::Cluster;
use tessera_proto::sharding::shard_for_key;
use tessera_proto::v1::{FetchRequest, ShardRole};
use tessera_ps_server::config::{AckMode, CoordinatorKind};
use tessera_rpc::TransportKind;
use tessera_test_support::f32s;
use tessera_test_support::wait::eventually;
use tessera_worker::{PsClient, WorkerConfig};

use super::trainer::{DIM, TABLE, data_client, wait_identical, wait_settled, worker_client};
use super::{ONE_AT_A_TIME, cluster, label};

/// Hot keys every step draws from.
const HOT: u64 = 2048;
/// Marker keys: one per Push, never reused (above every hot key).
const MARKERS: u64 = 1_000_000_000;

/// One Push of the trainer.
#[derive(Debug, Clone)]
struct Pushed {
    marker: u64,
    keys: Vec<u64>,
    grads: Vec<f32>,
    acked: bool,
    error: Option<String>,
}

/// A trainer that pushes whole batches through the worker client (it
/// splits them by the count it routes by): 16 hot keys and a marker.
struct ReshardTrainer {
    stop: Arc<AtomicBool>,
    pushed: Arc<Mutex<Vec<Pushed>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl ReshardTrainer {
    fn start(client: Arc<PsClient>, tasks: u64) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let pushed = Arc::new(Mutex::new(Vec::new()));
        let tasks = (0..tasks)
            .map(|task| {
                let (client, stop, pushed) =
                    (Arc::clone(&client), Arc::clone(&stop), Arc::clone(&pushed));
                tokio::spawn(async move {
                    let mut rng = SmallRng::seed_from_u64(task + 11);
                    let mut marker = MARKERS + task * 100_000_000;
                    while !stop.load(Ordering::Relaxed) {
                        marker += 1;
                        let mut keys: Vec<u64> =
                            (0..16).map(|_| rng.random_range(0..HOT)).collect();
                        keys.push(marker);
                        let mut grads: Vec<f32> = (0..16 * DIM)
                            .map(|_| [-3.0, -2.0, -1.0, 1.0, 2.0, 3.0][rng.random_range(0..6)])
                            .collect();
                        grads.extend([-1.0f32; DIM]);
                        let fetched = client.fetch(TABLE, &keys).await;
                        let result = client.push(TABLE, &keys, &grads, DIM).await;
                        let error = fetched
                            .err()
                            .map(|e| format!("fetch: {e}"))
                            .or_else(|| result.as_ref().err().map(|e| format!("push: {e}")));
                        pushed.lock().unwrap().push(Pushed {
                            marker,
                            keys,
                            grads,
                            acked: result.is_ok(),
                            error,
                        });
                    }
                })
            })
            .collect();
        Self {
            stop,
            pushed,
            tasks,
        }
    }

    /// Keys written so far: every hot key (the ranker and the trainer
    /// have read them all within the first seconds) and every step's
    /// marker (a training Fetch makes the rows it reads).
    fn written(&self) -> u64 {
        HOT + self.pushed.lock().unwrap().len() as u64
    }

    async fn stop(self) -> Vec<Pushed> {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks {
            task.await.unwrap();
        }
        self.pushed.lock().unwrap().clone()
    }
}

/// A ranker: Fetches of 64 hot rows in a loop, each within the call's
/// deadline; counts those that failed with time left (none may).
struct Ranker {
    stop: Arc<AtomicBool>,
    calls: Arc<AtomicU64>,
    failed: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Ranker {
    fn start(client: Arc<PsClient>, deadline: Duration) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let calls = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(Mutex::new(Vec::new()));
        let task = {
            let (stop, calls, failed) =
                (Arc::clone(&stop), Arc::clone(&calls), Arc::clone(&failed));
            tokio::spawn(async move {
                let mut rng = SmallRng::seed_from_u64(7);
                while !stop.load(Ordering::Relaxed) {
                    let keys: Vec<u64> = (0..64).map(|_| rng.random_range(0..HOT)).collect();
                    let started = Instant::now();
                    let result = client.fetch(TABLE, &keys).await;
                    calls.fetch_add(1, Ordering::Relaxed);
                    if let Err(err) = result
                        && started.elapsed() < deadline
                    {
                        failed.lock().unwrap().push(err.to_string());
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
        };
        Self {
            stop,
            calls,
            failed,
            task,
        }
    }

    async fn stop(self) -> (u64, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap();
        let failed = self.failed.lock().unwrap().clone();
        (self.calls.load(Ordering::Relaxed), failed)
    }
}

/// The drill's own etcd client: a read that fails is tried again on a
/// new connection (the drill, not the cluster, would fail otherwise).
struct MapReader {
    config: tessera_ps_server::config::CoordinatorConfig,
    coord: tokio::sync::Mutex<EtcdCoordinator>,
}

impl MapReader {
    async fn connect(config: &tessera_ps_server::config::CoordinatorConfig) -> Self {
        Self {
            config: config.clone(),
            coord: tokio::sync::Mutex::new(EtcdCoordinator::connect(config).await.unwrap()),
        }
    }

    async fn map(&self) -> ShardMap {
        let mut last = None;
        for _ in 0..50 {
            let mut coord = self.coord.lock().await;
            match coord.shard_map().await {
                Ok(Some((map, _))) => return map,
                other => last = Some(format!("{other:?}")),
            }
            if let Ok(fresh) = EtcdCoordinator::connect(&self.config).await {
                *coord = fresh;
            }
            drop(coord);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("the shard map could not be read: {last:?}");
    }
}

/// Rows held by `address` (every table).
async fn rows_at(address: &str) -> u64 {
    tessera_test_support::health(address)
        .await
        .map(|h| h.tables.iter().map(|t| t.rows).sum())
        .unwrap_or(0)
}

/// The primary of `shard` among the cluster's servers, as they say.
async fn primary_of(cluster: &Cluster, shard: u32) -> Option<usize> {
    for (index, server) in cluster.servers().iter().enumerate() {
        if server.shard != shard {
            continue;
        }
        if let Ok(h) = tessera_test_support::health(&server.address).await
            && h.shard_health
                .iter()
                .any(|s| s.shard == shard && s.role == ShardRole::Primary as i32)
        {
            return Some(index);
        }
    }
    None
}

/// Plans the resize to `to` with a `tessera reshard` process SIGKILLed
/// as it runs; planned again, whole, if the kill came before its write.
/// `hold`: its cut-over waits for [`release_cut_over`]. Returns whether
/// the killed one had written it.
async fn plan_killing_the_planner(
    cluster: &Cluster,
    coord: &MapReader,
    to: u32,
    hold: bool,
    kill_after: Duration,
) -> bool {
    let config = &cluster.worker_config().coordinator;
    let args = |cmd: &mut tokio::process::Command| {
        cmd.args([
            "reshard",
            "--endpoints",
            &config.endpoints.join(","),
            "--cluster",
            &config.cluster,
            "--to",
            &to.to_string(),
        ]);
        if hold {
            cmd.arg("--hold");
        }
    };
    let before = coord.map().await.version;
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_tessera"));
    args(&mut cmd);
    let mut child = cmd
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Killed as it connects to etcd, as it writes, or after.
    tokio::time::sleep(kill_after).await;
    let _ = child.kill().await;
    let planned = |m: &ShardMap| {
        m.version > before
            && m.resize
                .as_ref()
                .is_some_and(|r| r.to == to && r.state != ResizeState::Cancelled)
    };
    if planned(&coord.map().await) {
        return true;
    }
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_tessera"));
    args(&mut cmd);
    let status = cmd.status().await.unwrap();
    assert!(status.success(), "tessera reshard --to {to} failed");
    assert!(planned(&coord.map().await));
    false
}

/// `tessera reshard --cut-over`: the held resize cuts over.
async fn release_cut_over(cluster: &Cluster) {
    let config = &cluster.worker_config().coordinator;
    let status = tokio::process::Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args([
            "reshard",
            "--endpoints",
            &config.endpoints.join(","),
            "--cluster",
            &config.cluster,
            "--cut-over",
        ])
        .stdout(std::process::Stdio::null())
        .status()
        .await
        .unwrap();
    assert!(status.success(), "tessera reshard --cut-over failed");
}

/// One resize's figures.
struct Resized {
    from: u32,
    to: u32,
    took: Duration,
    planner_killed_after_write: bool,
    killed: String,
    moved_share: f64,
}

/// The whole drill over `transport`.
pub async fn reshard_under_load(transport: TransportKind) {
    let _alone = ONE_AT_A_TIME.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let mut cluster = cluster(
        transport,
        CoordinatorKind::Etcd,
        AckMode::Replicas,
        dir.path(),
    )
    .await;
    let coord = MapReader::connect(&cluster.worker_config().coordinator).await;
    let trainer_client = worker_client(&cluster);
    let call_timeout = Duration::from_secs(5);
    // Each timed-out Fetch retried, as the trainer's: over RDMA a request
    // sent to a server in the instant it is killed waits out its timeout.
    let base = cluster.worker_config().clone();
    let ranker_client = Arc::new(
        PsClient::new(&WorkerConfig {
            call_timeout_ms: call_timeout.as_millis() as u64,
            retry: tessera_rpc::policy::RetryPolicyConfig {
                probability: 1.0,
                ..base.retry
            },
            ..base
        })
        .unwrap(),
    );
    let trainer = ReshardTrainer::start(Arc::clone(&trainer_client), 2);
    let ranker = Ranker::start(Arc::clone(&ranker_client), call_timeout);
    // Every key written has a row at its primary: every hot key (read by
    // the ranker and the trainer) and every step's marker.
    eventually(
        Duration::from_secs(30),
        "a row for every hot key and marker at the primaries of shards 0 and 1",
        || async {
            let written = trainer.written();
            let mut held = 0;
            for shard in 0..2 {
                if let Some(index) = primary_of(&cluster, shard).await {
                    held += rows_at(&cluster.servers()[index].address).await;
                }
            }
            if held >= written {
                Ok(())
            } else {
                Err(format!("{held} rows held, {written} keys written"))
            }
        },
    )
    .await;

    let mut figures = Vec::new();
    for (to, kill_after) in [(3u32, 5), (4, 40), (3, 150)] {
        let from = coord.map().await.num_shards;
        let started = Instant::now();
        // A shrink's copy of its given-away rows can be over in less
        // time than one look at the map takes (a growth's waits for its
        // new servers to start): it is planned held, so that the kill
        // below comes while it copies, and released after the restart.
        let hold = to < from;
        let planner_killed_after_write = plan_killing_the_planner(
            &cluster,
            &coord,
            to,
            hold,
            Duration::from_millis(kill_after),
        )
        .await;
        if to > from {
            cluster.add_shard(from, to).unwrap();
        }
        // The server that moves rows: the new shard's primary (growing),
        // the first remaining shard's (shrinking), killed while copying
        // and restarted once its replica leads.
        let moving = if to > from { from } else { 0 };
        let victim = eventually(
            Duration::from_secs(60),
            "the resize copying, with a primary of the moving shard",
            || async {
                let m = coord.map().await;
                let copying = m
                    .resize
                    .as_ref()
                    .is_some_and(|r| r.state == ResizeState::Copying);
                if copying && let Some(index) = primary_of(&cluster, moving).await {
                    return Ok(index);
                }
                Err(m)
            },
        )
        .await;
        let killed = format!(
            "shard {moving}'s primary (group {}) in {:?}",
            cluster.servers()[victim].group,
            coord.map().await.resize.map(|r| r.state)
        );
        // A shrink's moving rows are every row of its given-away shards,
        // read while it copies (they drop them once it is done).
        let shrink_share = if to < from {
            Some(moved_rows(&cluster, from, to).await as f64 / trainer.written() as f64)
        } else {
            None
        };
        cluster.kill(victim).await;
        eventually(
            Duration::from_secs(60),
            &format!("shard {moving}'s replica leading after its primary was killed"),
            || async {
                match primary_of(&cluster, moving).await {
                    Some(index) if index != victim => Ok(()),
                    other => Err(other),
                }
            },
        )
        .await;
        cluster.restart(victim).unwrap();
        if hold {
            release_cut_over(&cluster).await;
        }
        // Until done.
        eventually(
            Duration::from_secs(120),
            &format!("the resize to {to} done"),
            || async {
                let m = coord.map().await;
                let r = m.resize.clone().unwrap();
                if r.state == ResizeState::Done {
                    Ok(())
                } else {
                    Err(m)
                }
            },
        )
        .await;
        // A growth's moving rows are every row its new shards hold once
        // it is done (with the new keys routed there since, in the same
        // share).
        let moved_share = match shrink_share {
            Some(share) => share,
            None => moved_rows(&cluster, from, to).await as f64 / trainer.written() as f64,
        };
        // The operator's part once it is done: the servers' configurations
        // say the count they route by now.
        cluster.set_num_shards(to).unwrap();
        figures.push(Resized {
            from,
            to,
            took: started.elapsed(),
            planner_killed_after_write,
            killed,
            moved_share,
        });
        // Training goes on a while at the new count.
        let written = trainer.written();
        eventually(
            Duration::from_secs(30),
            &format!("100 more steps with the trainer routing by {to} shards"),
            || async {
                let (count, now) = (trainer_client.num_shards(), trainer.written());
                if count == to && now >= written + 100 {
                    Ok(())
                } else {
                    Err(format!(
                        "routing by {count}, {now} keys written (from {written})"
                    ))
                }
            },
        )
        .await;
    }
    let pushed = trainer.stop().await;
    let (ranked, rank_failed) = ranker.stop().await;
    let final_count = coord.map().await.num_shards;

    // The audit against the trainer's own record.
    let serving: Vec<(String, u32)> = cluster
        .servers()
        .iter()
        .filter(|s| s.shard < final_count)
        .map(|s| (s.address.clone(), s.shard))
        .collect();
    let copies = wait_identical(&serving).await;
    let audit = audit(&serving, final_count, &pushed, transport).await;
    let given_away: Vec<(String, u64)> = {
        let mut out = Vec::new();
        for s in cluster.servers().iter().filter(|s| s.shard >= final_count) {
            out.push((s.address.clone(), rows_at(&s.address).await));
        }
        out
    };
    let failed_steps: Vec<&Pushed> = pushed.iter().filter(|p| p.error.is_some()).collect();
    eprintln!(
        "drill reshard [{}]: {} steps ({} failed), ranker {} Fetches ({} failed with time left); copies: {copies:?}",
        label(transport),
        pushed.len(),
        failed_steps.len(),
        ranked,
        rank_failed.len()
    );
    for f in &figures {
        let expected = if f.to > f.from {
            1.0 / f64::from(f.to)
        } else {
            1.0 / f64::from(f.from)
        };
        eprintln!(
            "  {} -> {}: done {:.1} s after the plan; rows moved {:.1}% (jump hash {:.1}%); planner SIGKILLed {} its write; SIGKILLed {}",
            f.from,
            f.to,
            f.took.as_secs_f64(),
            f.moved_share * 100.0,
            expected * 100.0,
            if f.planner_killed_after_write {
                "after"
            } else {
                "before"
            },
            f.killed
        );
        assert!(
            (f.moved_share - expected).abs() <= expected * 0.1,
            "{} -> {}: {:.3} of the rows moved, the jump hash moves {expected:.3}",
            f.from,
            f.to,
            f.moved_share
        );
    }
    eprintln!("  audit: {audit:?}; the given-away shard's servers' rows: {given_away:?}");
    assert!(
        failed_steps.is_empty(),
        "{} steps failed; the first: {:?}",
        failed_steps.len(),
        failed_steps.first().and_then(|p| p.error.as_deref())
    );
    assert!(
        rank_failed.is_empty(),
        "ranker Fetches failed: {:?}",
        &rank_failed[..rank_failed.len().min(3)]
    );
    assert_eq!(audit.lost, 0, "acknowledged Pushes lost");
    assert_eq!(audit.twice, 0, "Pushes applied twice");
    assert!(
        audit.hot_rows_match,
        "hot rows differ from the Pushes applied"
    );
    assert_eq!(
        audit.rows_held, audit.rows_written,
        "rows held by the primaries of the final map differ from the keys written"
    );
    assert!(
        given_away.iter().all(|(_, rows)| *rows == 0),
        "{given_away:?}"
    );
    drop(trainer_client);
    drop(ranker_client);
    cluster.stop().await.unwrap();
}

/// The rows of the shards of only one of the counts `from` and `to` (a
/// growth's new shards, a shrink's given-away ones), at their primaries.
async fn moved_rows(cluster: &Cluster, from: u32, to: u32) -> u64 {
    let mut moved = 0;
    for shard in from.min(to)..from.max(to) {
        if let Some(index) = primary_of(cluster, shard).await {
            moved += rows_at(&cluster.servers()[index].address).await;
        }
    }
    moved
}

#[derive(Debug, Default)]
struct Audit {
    acked: usize,
    lost: usize,
    twice: usize,
    hot_rows_match: bool,
    /// Rows the final primaries hold, and keys any applied Push wrote.
    rows_held: u64,
    rows_written: u64,
}

/// Reads every marker and hot row at the primary of the shard
/// `final_count` routes it to (each Fetch also says the row lives there).
async fn audit(
    servers: &[(String, u32)],
    final_count: u32,
    pushed: &[Pushed],
    transport: TransportKind,
) -> Audit {
    let mut audit = Audit {
        hot_rows_match: true,
        ..Audit::default()
    };
    let mut primaries = Vec::new();
    let mut addresses = Vec::new();
    for shard in 0..final_count {
        let primary = wait_settled(&servers.to_vec(), shard, Duration::from_secs(30)).await;
        primaries.push(data_client(&primary, transport));
        addresses.push(primary);
    }
    let read = |keys: Vec<u64>| {
        let primaries = &primaries;
        async move {
            let mut by_shard: Vec<Vec<usize>> = vec![Vec::new(); final_count as usize];
            for (i, &k) in keys.iter().enumerate() {
                by_shard[shard_for_key(k, final_count) as usize].push(i);
            }
            let mut out = vec![[0f32; DIM]; keys.len()];
            for (shard, at) in by_shard.iter().enumerate() {
                for chunk in at.chunks(4096) {
                    let rows = primaries[shard]
                        .fetch(FetchRequest {
                            table: TABLE.into(),
                            shard: shard as u32,
                            keys: chunk.iter().map(|&i| keys[i]).collect(),
                        })
                        .await
                        .unwrap();
                    for (&i, row) in chunk.iter().zip(f32s(&rows.values).chunks(DIM)) {
                        out[i].copy_from_slice(row);
                    }
                }
            }
            out
        }
    };
    let markers = read(pushed.iter().map(|p| p.marker).collect()).await;
    let mut expected = vec![[0f32; DIM]; HOT as usize];
    for (p, row) in pushed.iter().zip(&markers) {
        let applied = row[0];
        if p.acked {
            audit.acked += 1;
            if applied == 0.0 {
                audit.lost += 1;
            }
        }
        if applied >= 2.0 {
            audit.twice += 1;
        }
        for _ in 0..applied as usize {
            for (key, grad) in p.keys.iter().zip(p.grads.chunks(DIM)) {
                if *key == p.marker {
                    continue;
                }
                for (w, g) in expected[*key as usize].iter_mut().zip(grad) {
                    *w -= g;
                }
            }
        }
    }
    let hot = read((0..HOT).collect()).await;
    // A training Fetch makes the rows it reads: every hot key and every
    // marker has a row now, on its shard of the final map and on no other
    // of its primaries.
    audit.rows_written = HOT + pushed.len() as u64;
    for address in &addresses {
        audit.rows_held += rows_at(address).await;
    }
    for (key, (got, want)) in hot.iter().zip(&expected).enumerate() {
        if got
            .iter()
            .zip(want)
            .any(|(a, b)| a.to_bits() != b.to_bits())
        {
            audit.hot_rows_match = false;
            eprintln!("  hot key {key}: {got:?}, want {want:?}");
            break;
        }
    }
    audit
}
