//! The training-to-serving drill (`ps-server/src/delta`): trainers push
//! into a 2 x 2 training fleet (etcd, failover) while rankers read a
//! 3 x 2 serving fleet fed by its delta stream, and a probe measures the
//! delay from a Push to its visibility there; a training primary and a
//! serving server are SIGKILLed in the middle and restarted. At the end,
//! once the stream drains, every serving copy holds bit for bit the
//! training fleet's rows (fleet-wide value digests), every acknowledged
//! Push reads as applied exactly once at the serving fleet (its marker
//! row), and no ranker request failed.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tessera_deploy::config::ServingFleetConfig;
use tessera_deploy::{Cluster, ClusterConfig};
use tessera_proto::v1::{AdminClient, DigestRequest, HealthResponse, ShardRole};
use tessera_ps_server::config::{AckMode, CoordinatorKind};
use tessera_rpc::{Channel, TransportKind};
use tessera_test_support::health::patient;
use tessera_test_support::wait::eventually;
use tessera_test_support::wait_for_health;
use tessera_worker::freshness::{self, ProbeConfig};
use tessera_worker::{PsClient, WorkerConfig};

use crate::trainer::{
    DIM, PushRecord, TABLE, Trainer, audit, wait_role, wait_settled, worker_client,
};
use crate::{FAILOVER_MS, ONE_AT_A_TIME, cluster_config, label};

/// The delta interval of the drill: short, so that the drill is short.
const INTERVAL_MS: u64 = 200;

fn config(transport: TransportKind) -> ClusterConfig {
    ClusterConfig {
        serving: Some(ServingFleetConfig {
            num_shards: 3,
            replica_groups: 2,
            interval_ms: INTERVAL_MS,
            ..ServingFleetConfig::default()
        }),
        ..cluster_config(transport, CoordinatorKind::Etcd, AckMode::Replicas)
    }
}

/// The training fleet's servers (address, shard), for the trainer's
/// audit.
fn training(cluster: &Cluster) -> Vec<(String, u32)> {
    cluster
        .servers()
        .iter()
        .filter(|s| !s.serving)
        .map(|s| (s.address.clone(), s.shard))
        .collect()
}

/// Whether a serving server's Health says it follows both training shards
/// with a training position past 0 (training shard 0 from `source0`, where
/// given: the address of the primary it follows).
fn follows(h: &HealthResponse, source0: Option<&str>) -> bool {
    h.serving_feed.as_ref().is_some_and(|feed| {
        (0..2u32).all(|shard| {
            feed.sources.iter().any(|s| {
                s.source_shard == shard
                    && s.position > 0
                    && (shard != 0 || source0.is_none_or(|a| s.source == a))
            })
        })
    })
}

/// The sum of the value digests of `servers` (one copy of a fleet), and
/// their rows.
async fn digest(servers: &[String]) -> Option<(u64, u64)> {
    let mut sum = (0u64, 0u64);
    for address in servers {
        let admin = AdminClient::new(Channel::lazy(address, patient()).ok()?);
        let digests = admin.digest(DigestRequest {}).await.ok()?;
        for d in digests.shards {
            sum.0 = sum.0.wrapping_add(d.values_digest);
            sum.1 += d.rows;
        }
    }
    Some(sum)
}

/// The training fleet's primaries (one copy of it).
async fn primaries(cluster: &Cluster) -> Vec<String> {
    let mut out = Vec::new();
    for shard in 0..2 {
        out.push(
            crate::trainer::wait_settled(&training(cluster), shard, Duration::from_secs(30)).await,
        );
    }
    out
}

/// Waits until each serving group's digest equals the training fleet's;
/// returns how long that took.
async fn wait_agree(cluster: &Cluster) -> (Duration, (u64, u64)) {
    let started = Instant::now();
    let groups: Vec<Vec<String>> = (0..2)
        .map(|g| {
            cluster
                .servers()
                .iter()
                .filter(|s| s.serving && s.group == g)
                .map(|s| s.address.clone())
                .collect()
        })
        .collect();
    loop {
        let want = digest(&primaries(cluster).await).await;
        let mut got = Vec::new();
        for group in &groups {
            got.push(digest(group).await);
        }
        if want.is_some() && got.iter().all(|g| *g == want) {
            return (started.elapsed(), want.unwrap_or_default());
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the serving fleet never agreed with the training fleet: training {want:?}, serving groups {got:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Rankers: `tasks` loops reading hot keys from the serving fleet; the
/// requests that failed.
struct Rankers {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    first_error: Arc<std::sync::Mutex<Option<String>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Rankers {
    fn start(client: Arc<PsClient>, tasks: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let ok = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        let first_error = Arc::new(std::sync::Mutex::new(None));
        let tasks = (0..tasks)
            .map(|task| {
                let (client, stop, ok, failed, first_error) = (
                    Arc::clone(&client),
                    Arc::clone(&stop),
                    Arc::clone(&ok),
                    Arc::clone(&failed),
                    Arc::clone(&first_error),
                );
                tokio::spawn(async move {
                    let keys: Vec<u64> = (0..64).map(|i| i * 7 + task as u64).collect();
                    while !stop.load(Ordering::Relaxed) {
                        match client.fetch(TABLE, &keys).await {
                            Ok(_) => ok.fetch_add(1, Ordering::Relaxed),
                            Err(err) => {
                                first_error.lock().unwrap().get_or_insert(err.to_string());
                                failed.fetch_add(1, Ordering::Relaxed)
                            }
                        };
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                })
            })
            .collect();
        Self {
            stop,
            ok,
            failed,
            first_error,
            tasks,
        }
    }

    async fn stop(self) -> (u64, u64, Option<String>) {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks {
            task.await.unwrap();
        }
        let first = self.first_error.lock().unwrap().clone();
        (
            self.ok.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
            first,
        )
    }
}

/// The rankers' client of the serving fleet: a Fetch fails over to the
/// other copy of its shard.
fn ranker_client(cluster: &Cluster) -> Arc<PsClient> {
    let base = cluster.serving_config().expect("a serving fleet").clone();
    Arc::new(
        PsClient::new(&WorkerConfig {
            call_timeout_ms: 5000,
            ..base
        })
        .unwrap(),
    )
}

/// Acknowledged Pushes whose marker row at the serving fleet does not
/// read 1 (lost or applied twice on the way there).
async fn serving_markers(serving: &PsClient, records: &[PushRecord]) -> (usize, usize) {
    let acked: Vec<u64> = records
        .iter()
        .filter(|r| r.acked_at.is_some())
        .map(|r| r.marker)
        .collect();
    let mut wrong = 0;
    for chunk in acked.chunks(2048) {
        let rows = serving.fetch(TABLE, chunk).await.unwrap();
        wrong += rows
            .values()
            .chunks(DIM)
            .filter(|r| r[0].to_bits() != 1.0f32.to_bits())
            .count();
    }
    (acked.len(), wrong)
}

async fn serving_drill(transport: TransportKind) {
    let _alone = ONE_AT_A_TIME.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let mut cluster = Cluster::start(&config(transport), dir.path())
        .await
        .unwrap();
    let client = worker_client(&cluster);
    let serving = ranker_client(&cluster);
    let victim = cluster.index_of(0, 0).unwrap();
    let victim_addr = cluster.servers()[victim].address.clone();
    wait_role(&victim_addr, ShardRole::Primary, Duration::from_secs(30)).await;
    let serving_victim = cluster.serving_index_of(0, 1).unwrap();
    let serving_victim_addr = cluster.servers()[serving_victim].address.clone();
    let serving_addrs: Vec<String> = cluster
        .servers()
        .iter()
        .filter(|s| s.serving)
        .map(|s| s.address.clone())
        .collect();
    // Shard 0's replica (group 1): it takes over when the victim dies.
    let successor_addr = cluster.servers()[cluster.index_of(1, 0).unwrap()]
        .address
        .clone();

    let started = Instant::now();
    let trainer = Trainer::start(Arc::clone(&client), 4);
    let rankers = Rankers::start(Arc::clone(&serving), 4);
    let (stop_probe, probe_stopped) = tokio::sync::oneshot::channel::<()>();
    let probe = {
        let (client, serving) = (Arc::clone(&client), Arc::clone(&serving));
        tokio::spawn(async move {
            freshness::probe(
                client,
                serving,
                &ProbeConfig {
                    table: TABLE.into(),
                    dim: DIM,
                    every: Duration::from_millis(100),
                    poll: Duration::from_millis(10),
                    ..ProbeConfig::default()
                },
                async {
                    let _ = probe_stopped.await;
                },
            )
            .await
        })
    };
    // Every serving server follows both training shards, and the rankers
    // are served.
    for address in &serving_addrs {
        wait_for_health(
            address,
            "following both training shards",
            Duration::from_secs(30),
            |h| follows(h, None),
        )
        .await;
    }
    eventually(
        Duration::from_secs(30),
        "ranker Fetches answered",
        || async {
            match rankers.ok.load(Ordering::Relaxed) {
                0 => Err(0),
                n => Ok(n),
            }
        },
    )
    .await;
    // The figure around the training failover counts the probes from 1 s
    // before it: the probe has run that long.
    tokio::time::sleep_until((started + Duration::from_secs(1)).into()).await;
    // The training primary of shard 0 dies: its replica takes over (a new
    // stream, which every serving server copies once).
    let killed = started.elapsed();
    cluster.kill(victim).await;
    wait_role(&successor_addr, ShardRole::Primary, Duration::from_secs(30)).await;
    for address in &serving_addrs {
        wait_for_health(
            address,
            "following training shard 0's new primary",
            Duration::from_secs(30),
            |h| follows(h, Some(successor_addr.as_str())),
        )
        .await;
    }
    // A serving server dies, and comes back empty: it copies its rows.
    let serving_killed = started.elapsed();
    cluster.kill(serving_victim).await;
    tokio::time::sleep(Duration::from_millis(FAILOVER_MS)).await;
    cluster.restart(serving_victim).unwrap();
    cluster.restart(victim).unwrap();
    wait_for_health(
        &serving_victim_addr,
        "following both training shards after its restart",
        Duration::from_secs(60),
        |h| follows(h, None),
    )
    .await;
    // The restarted training server in step again (as a replica; should a
    // lease lapse under load hand shard 0 back to it, as its primary).
    wait_settled(&training(&cluster), 0, Duration::from_secs(30)).await;
    // The figures around each failure count the probes pushed up to 5 s
    // after it: the trainer and the probe run at least that long.
    tokio::time::sleep_until((started + serving_killed + Duration::from_secs(5)).into()).await;
    let (records, steps) = trainer.stop().await;
    let _ = stop_probe.send(());
    let delay = probe.await.unwrap();
    let (ranker_ok, ranker_failed, ranker_error) = rankers.stop().await;

    let (drained, (digest_value, rows)) = wait_agree(&cluster).await;
    let training_audit = audit(&training(&cluster), &records, transport).await;
    let (acked, wrong_markers) = serving_markers(&serving, &records).await;
    // The delay of the probes pushed around each failure: from 1 s
    // before it to 5 s after.
    let around = |at: Duration| -> String {
        let window: Vec<Duration> = delay
            .timeline
            .iter()
            .filter(|(pushed, _)| {
                *pushed + Duration::from_secs(1) >= at && *pushed <= at + Duration::from_secs(5)
            })
            .map(|(_, d)| *d)
            .collect();
        let max = window.iter().max().copied().unwrap_or_default();
        format!(
            "{} probes, max {:.0} ms",
            window.len(),
            max.as_secs_f64() * 1e3
        )
    };
    eprintln!(
        "drill serving [{}]: {} steps ({} failed), {} Pushes ({acked} acknowledged); delay over the run: {}; around the training failover: {}; around the serving kill: {}; serving fleet agreed {:.0} ms after the trainer stopped ({rows} rows, values digest {digest_value:016x}); ranker requests {ranker_ok} ok, {ranker_failed} failed; serving markers not 1: {wrong_markers}; training audit: {training_audit:?}",
        label(transport),
        steps.len(),
        steps.iter().filter(|s| !s.ok).count(),
        records.len(),
        delay.summary(),
        around(killed),
        around(serving_killed),
        drained.as_secs_f64() * 1e3,
    );
    assert_eq!(
        wrong_markers, 0,
        "acknowledged Pushes not applied exactly once at the serving fleet"
    );
    assert_eq!(training_audit.applied_twice, 0);
    assert_eq!(training_audit.acked_lost, 0);
    assert!(training_audit.hot_rows_match);
    assert_eq!(
        ranker_failed, 0,
        "ranker requests failed; the first: {ranker_error:?}"
    );
    assert_eq!(
        delay.unseen, 0,
        "a probed Push never reached the serving fleet"
    );
    assert!(!delay.delays.is_empty());
    cluster.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drill_tcp_serving_fleet_follows_training_through_failovers() {
    serving_drill(TransportKind::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drill_rdma_serving_fleet_follows_training_through_failovers() {
    serving_drill(TransportKind::Rdma).await;
}
