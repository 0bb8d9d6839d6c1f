//! The drills' trainer, and what its Pushes left in the rows (shared by
//! the drills on a local cluster and those on a multi-host one,
//! `netns/`).
//!
//! SGD with learning rate 1 from zero rows and integer gradients (sums of
//! small integers are exact in f32, in any order), and in every Push one
//! *marker* key of its own with gradient -1, whose row reads 1 if the Push
//! was applied once, 0 if it was lost, 2 if it was applied twice.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tessera_deploy::Cluster;
use tessera_proto::sharding::shard_for_key;
use tessera_proto::v1::{
    AdminClient, DigestRequest, FetchRequest, ParameterServerClient, ShardRole,
};
use tessera_rpc::{Channel, TransportKind};
use tessera_test_support::health::patient;
use tessera_test_support::wait::{Waiting, eventually};
use tessera_test_support::{f32s, wait_for_health};
use tessera_worker::{PsClient, WorkerConfig};

use tessera_ps_server::TableConfig;
use tessera_ps_server::config::{Initializer, OptimizerConfig};
use tessera_rpc::RdmaConfig;

pub const DIM: usize = 4;
pub const TABLE: &str = "drill";
pub const HOT_KEYS: usize = 256;

/// The drills' table: SGD with learning rate 1 from zero rows.
pub fn table() -> TableConfig {
    TableConfig {
        optimizer: OptimizerConfig::sgd(1.0),
        initializer: Initializer::Zeros,
        ..TableConfig::new(TABLE, DIM as u32)
    }
}

/// The RDMA settings of the drills' servers and clients, over the provider
/// the suite runs on (`tessera_test_support::rdma`).
pub fn rdma_settings() -> RdmaConfig {
    tessera_test_support::rdma::config_rdma()
}

/// The servers of a drill's fleet: each one's address and shard.
pub trait Servers {
    fn servers(&self) -> Vec<(String, u32)>;
}

impl Servers for Cluster {
    fn servers(&self) -> Vec<(String, u32)> {
        Cluster::servers(self)
            .iter()
            .map(|s| (s.address.clone(), s.shard))
            .collect()
    }
}

impl Servers for Vec<(String, u32)> {
    fn servers(&self) -> Vec<(String, u32)> {
        self.clone()
    }
}

/// One Push of the trainer, as acknowledged (or not).
#[derive(Debug, Clone)]
pub struct PushRecord {
    pub shard: u32,
    pub marker: u64,
    pub keys: Vec<u64>,
    pub grads: Vec<f32>,
    pub acked_at: Option<Instant>,
    /// The shard's primary epoch the worker knew right after the
    /// acknowledgement (acknowledgements carry it).
    pub epoch: u64,
    pub error: Option<String>,
}

/// One trainer step.
#[derive(Debug, Clone)]
pub struct Step {
    pub started: Instant,
    pub ended: Instant,
    pub ok: bool,
    /// Why the step's Fetch failed, if it did.
    pub fetch_error: Option<String>,
}

/// A trainer of `tasks` concurrent loops: Fetch the step's keys, compute
/// integer gradients, Push each shard's part.
pub struct Trainer {
    stop: Arc<AtomicBool>,
    records: Arc<Mutex<Vec<PushRecord>>>,
    /// When each step started and ended, and whether it succeeded.
    steps: Arc<Mutex<Vec<Step>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

pub fn hot_keys(shard: u32) -> Vec<u64> {
    (0..)
        .filter(|&k| shard_for_key(k, 2) == shard)
        .take(HOT_KEYS)
        .collect()
}

impl Trainer {
    pub fn start(client: Arc<PsClient>, tasks: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let records = Arc::new(Mutex::new(Vec::new()));
        let steps = Arc::new(Mutex::new(Vec::new()));
        let hot = [hot_keys(0), hot_keys(1)];
        let handles = (0..tasks)
            .map(|task| {
                let (client, stop, records, steps, hot) = (
                    Arc::clone(&client),
                    Arc::clone(&stop),
                    Arc::clone(&records),
                    Arc::clone(&steps),
                    hot.clone(),
                );
                tokio::spawn(async move {
                    let mut rng = SmallRng::seed_from_u64(task as u64 + 1);
                    // Marker keys of this task, per shard: never shared.
                    let mut markers = [1_000_000_000 + task as u64 * 10_000_000; 2];
                    while !stop.load(Ordering::Relaxed) {
                        let mut parts = Vec::new();
                        for shard in 0..2u32 {
                            let marker = (markers[shard as usize]..)
                                .find(|&k| shard_for_key(k, 2) == shard)
                                .unwrap();
                            markers[shard as usize] = marker + 1;
                            let mut keys: Vec<u64> = (0..16)
                                .map(|_| hot[shard as usize][rng.random_range(0..HOT_KEYS)])
                                .collect();
                            keys.push(marker);
                            let mut grads: Vec<f32> = (0..16 * DIM)
                                .map(|_| [-3.0, -2.0, -1.0, 1.0, 2.0, 3.0][rng.random_range(0..6)])
                                .collect();
                            grads.extend([-1.0f32; DIM]);
                            parts.push((shard, marker, keys, grads));
                        }
                        let started = Instant::now();
                        let all: Vec<u64> = parts.iter().flat_map(|p| p.2.clone()).collect();
                        let fetched = client.fetch(TABLE, &all).await;
                        let pushes = parts.iter().map(|(_, _, keys, grads)| {
                            let client = &client;
                            async move { client.push(TABLE, keys, grads, DIM).await }
                        });
                        let results = futures::future::join_all(pushes).await;
                        let now = Instant::now();
                        let mut ok = fetched.is_ok();
                        let fetch_error = fetched.err().map(|e| e.to_string());
                        {
                            let mut out = records.lock().unwrap();
                            for ((shard, marker, keys, grads), result) in
                                parts.into_iter().zip(results)
                            {
                                ok &= result.is_ok();
                                out.push(PushRecord {
                                    shard,
                                    marker,
                                    keys,
                                    grads,
                                    acked_at: result.is_ok().then_some(now),
                                    epoch: client.primary(shard).map_or(0, |(_, e)| e),
                                    error: result.err().map(|e| e.to_string()),
                                });
                            }
                        }
                        steps.lock().unwrap().push(Step {
                            started,
                            ended: Instant::now(),
                            ok,
                            fetch_error,
                        });
                        if !ok {
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    }
                })
            })
            .collect();
        Self {
            stop,
            records,
            steps,
            tasks: handles,
        }
    }

    pub async fn stop(self) -> (Vec<PushRecord>, Vec<Step>) {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks {
            task.await.unwrap();
        }
        let records = self.records.lock().unwrap().clone();
        let steps = self.steps.lock().unwrap().clone();
        (records, steps)
    }
}

pub fn worker_client(cluster: &Cluster) -> Arc<PsClient> {
    let base = cluster.worker_config().clone();
    let config = WorkerConfig {
        // Fetches fail over to the replica; Pushes wait out the failover.
        call_timeout_ms: 5000,
        push_timeout_ms: 20_000,
        // A trainer would rather wait than lose a step: every timed-out
        // Fetch is retried (the default, one in two, is a ranker's).
        // Over RDMA a request sent to a primary in the instant it is
        // killed, before its connection is seen to end, lands in the dead
        // process's memory and times out (1 s); at one in two, one step
        // in about 4,000 failed in 2 of about 20 runs.
        retry: tessera_rpc::policy::RetryPolicyConfig {
            probability: 1.0,
            ..base.retry
        },
        ..base
    };
    Arc::new(PsClient::new(&config).unwrap())
}

pub fn data_client(addr: &str, transport: TransportKind) -> ParameterServerClient {
    let mut config = patient();
    config.transport.kind = transport;
    config.transport.rdma = rdma_settings();
    ParameterServerClient::new(Channel::lazy(addr, config).unwrap())
}

pub async fn wait_role(addr: &str, role: ShardRole, timeout: Duration) {
    wait_for_health(addr, &format!("{role:?}"), timeout, |h| {
        h.shard_health
            .first()
            .is_some_and(|s| s.role == role as i32)
            && (role != ShardRole::Replica || h.shard_health[0].in_step)
    })
    .await;
}

/// Waits until `shard` has settled: one server its primary, every other
/// an in-step replica. Which one leads is not the drill's to decide: a
/// lease that lapses under load (2 s on a loaded 2-core host) can hand the
/// shard over again, and that is a correct outcome. Returns the primary.
pub async fn wait_settled(cluster: &impl Servers, shard: u32, timeout: Duration) -> String {
    eventually(timeout, &format!("shard {shard} settled"), || async {
        let mut primary = Vec::new();
        let mut unsettled = Vec::new();
        for (address, _) in cluster.servers().iter().filter(|s| s.1 == shard) {
            let settled = match tessera_test_support::health(address).await {
                Ok(h) => match h.shard_health.iter().find(|s| s.shard == shard) {
                    Some(s) if s.role == ShardRole::Primary as i32 => {
                        primary.push(address.clone());
                        true
                    }
                    Some(s) => s.role == ShardRole::Replica as i32 && s.in_step,
                    None => false,
                },
                Err(_) => false,
            };
            if !settled {
                unsettled.push(address.clone());
            }
        }
        if primary.len() == 1 && unsettled.is_empty() {
            Ok(primary.remove(0))
        } else {
            Err(format!("primaries {primary:?}, not in step {unsettled:?}"))
        }
    })
    .await
}

/// Every server's digests of every table of its shard: equal within a
/// shard, and at equal versions. Returns when they are (or panics).
pub async fn wait_identical(cluster: &impl Servers) -> Vec<(u32, String)> {
    let mut waiting = Waiting::new(
        Duration::from_secs(60),
        "the copies of every shard identical",
    );
    loop {
        let mut by_shard: HashMap<u32, Vec<_>> = HashMap::new();
        let mut ok = true;
        for (address, shard) in cluster.servers() {
            let admin = AdminClient::new(Channel::lazy(&address, patient()).unwrap());
            match admin.digest(DigestRequest {}).await {
                Ok(d) => by_shard.entry(shard).or_default().push(d.shards),
                Err(_) => ok = false,
            }
        }
        if ok
            && by_shard
                .values()
                .all(|copies| copies.windows(2).all(|w| w[0] == w[1]))
        {
            return by_shard
                .into_iter()
                .map(|(shard, copies)| {
                    let d = &copies[0][0];
                    let v = d.version.unwrap_or_default();
                    (
                        shard,
                        format!("{}:{} digest {:016x}", v.epoch, v.position, d.digest),
                    )
                })
                .collect();
        }
        waiting.tick(&by_shard).await;
        // Each look digests every table of every server: keep them about
        // 100 ms apart, as before (the tick waits 20 ms of them).
        tokio::time::sleep(Duration::from_millis(80)).await;
    }
}

/// What the rows say about the Pushes (module docs): per acknowledged
/// Push whether it was applied once, lost or applied twice; and whether
/// the hot rows equal the sum of exactly the Pushes applied.
#[derive(Debug, Default)]
pub struct Audit {
    pub acked: usize,
    pub unacked: usize,
    pub acked_lost: usize,
    pub applied_twice: usize,
    pub hot_rows_match: bool,
    /// The acknowledged Pushes lost: shard, when acknowledged, and the
    /// epoch the worker knew then (for a failure's message).
    pub lost: Vec<(u32, Option<Instant>, u64)>,
}

pub async fn audit(
    cluster: &impl Servers,
    records: &[PushRecord],
    transport: TransportKind,
) -> Audit {
    let mut audit = Audit {
        hot_rows_match: true,
        ..Audit::default()
    };
    for shard in 0..2u32 {
        // The primary of the shard now (waiting out a hand-over under way).
        let primary = wait_settled(cluster, shard, Duration::from_secs(30)).await;
        let client = data_client(&primary, transport);
        let ours: Vec<&PushRecord> = records.iter().filter(|r| r.shard == shard).collect();
        let markers: Vec<u64> = ours.iter().map(|r| r.marker).collect();
        let mut marker_rows = Vec::new();
        for chunk in markers.chunks(4096) {
            let rows = client
                .fetch(FetchRequest {
                    table: TABLE.into(),
                    shard,
                    keys: chunk.to_vec(),
                })
                .await
                .unwrap();
            marker_rows.extend(
                f32s(&rows.values)
                    .chunks(DIM)
                    .map(|r| r[0])
                    .collect::<Vec<_>>(),
            );
        }
        let mut expected: HashMap<u64, [f32; DIM]> = HashMap::new();
        for (record, &applied) in ours.iter().zip(&marker_rows) {
            match (record.acked_at.is_some(), applied) {
                (true, 1.0) => audit.acked += 1,
                (true, 0.0) => {
                    audit.acked += 1;
                    audit.acked_lost += 1;
                    audit.lost.push((shard, record.acked_at, record.epoch));
                }
                (false, _) => audit.unacked += 1,
                _ => {}
            }
            if applied >= 2.0 {
                audit.applied_twice += 1;
            }
            // The hot rows must hold exactly the Pushes applied.
            for _ in 0..applied as usize {
                for (key, grad) in record.keys.iter().zip(record.grads.chunks(DIM)) {
                    if *key == record.marker {
                        continue;
                    }
                    let row = expected.entry(*key).or_insert([0.0; DIM]);
                    for (w, g) in row.iter_mut().zip(grad) {
                        *w -= g;
                    }
                }
            }
        }
        let hot = hot_keys(shard);
        let rows = client
            .fetch(FetchRequest {
                table: TABLE.into(),
                shard,
                keys: hot.clone(),
            })
            .await
            .unwrap();
        let got = f32s(&rows.values);
        for (i, key) in hot.iter().enumerate() {
            let want = expected.get(key).copied().unwrap_or([0.0; DIM]);
            if got[i * DIM..(i + 1) * DIM]
                .iter()
                .zip(&want)
                .any(|(a, b)| a.to_bits() != b.to_bits())
            {
                audit.hot_rows_match = false;
            }
        }
    }
    audit
}

/// Steps per second that both started and ended, successfully, in
/// `[from, from + window)` (a step held up across a failure does not count
/// towards the rate after it).
pub fn rate(steps: &[Step], from: Instant, window: Duration) -> f64 {
    steps
        .iter()
        .filter(|s| s.ok && s.started >= from && s.ended < from + window)
        .count() as f64
        / window.as_secs_f64()
}
