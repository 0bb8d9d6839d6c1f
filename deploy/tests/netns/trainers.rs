//! Drills 4 and 5: a trainer's Pushes through a flapping link, and
//! through the failover of a primary whose host was cut off.

use super::*;
use tessera_test_support::health::shard_position;

/// Issue 19's drill 4: a trainer on host 5 pushes to the fleet through a
/// flapping link: a proxy per server on the trainer's host that, every
/// 200-600 ms (a seeded draw), resets every connection, or holds every
/// byte back for 200-600 ms (a link that drops out and returns: the held
/// requests arrive late, after their retries), or loses the next answer
/// of one server (the Push applied, its acknowledgement lost). The rows
/// must hold exactly one application of each acknowledged Push, and no
/// Push applied twice.
#[test]
fn pushes_through_a_flapping_link_are_applied_exactly_once() {
    let Some(cluster) = NetCluster::create_or_skip(5) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let base = PsServerConfig {
        tables: vec![trainer::table()],
        ..PsServerConfig::default()
    };
    let _servers = start_fleet(&cluster, 2, dir.path(), 5, &|_, _| base.clone());
    let fleet_servers = training_fleet(&cluster);
    cluster.run_on(5, || {
        runtime().block_on(async {
            let mut proxies = Vec::new();
            for (g, s) in fleet(2) {
                proxies.push(FaultProxy::start(fleet_address(&cluster, 2, g, s)).await);
            }
            let dial = |g: u32, s: u32| {
                let i = fleet(2).iter().position(|&m| m == (g, s)).unwrap();
                proxies[i].addr.clone()
            };
            let client = trainer_client(dial, Default::default());
            let trainer = Trainer::start(Arc::clone(&client), 4);
            let mut rng = SmallRng::seed_from_u64(194);
            let (mut resets, mut outages, mut lost) = (0, 0, 0);
            let flapping = Instant::now();
            while flapping.elapsed() < Duration::from_secs(8) {
                tokio::time::sleep(Duration::from_millis(rng.random_range(200..600))).await;
                match rng.random_range(0..3) {
                    0 => {
                        proxies.iter().for_each(FaultProxy::reset_all);
                        resets += 1;
                    }
                    1 => {
                        proxies.iter().for_each(|p| p.partition(true));
                        tokio::time::sleep(Duration::from_millis(rng.random_range(200..600)))
                            .await;
                        proxies.iter().for_each(|p| p.partition(false));
                        outages += 1;
                    }
                    _ => {
                        proxies[rng.random_range(0..proxies.len())].lose_responses(1);
                        lost += 1;
                    }
                }
            }
            let (records, steps) = trainer.stop().await;
            let answers_lost: u64 = proxies.iter().map(FaultProxy::lost).sum();
            // Every call has returned; nothing a proxy still holds may land
            // later: every connection through them reset (what they hold
            // dropped), and no new one accepted.
            proxies.iter().for_each(FaultProxy::reset_all);
            drop(proxies);
            let copies = wait_identical(&fleet_servers).await;
            let audit = audit(&fleet_servers, &records, TransportKind::Tcp).await;
            let failed_steps = steps.iter().filter(|s| !s.ok).count();
            let step_ms: Vec<f64> = steps
                .iter()
                .map(|s| (s.ended - s.started).as_secs_f64() * 1000.0)
                .collect();
            eprintln!(
                "drill netns flapping-link: a trainer on host 5 (4 tasks) through a flapping link to 4 servers on 4 hosts for 8 s: \
                 {resets} resets of every connection, {outages} outages of 200-600 ms, {lost} answers marked to lose ({answers_lost} lost after the server acted); \
                 {} steps ({failed_steps} failed, the first: {:?}), step p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms; {} Pushes; copies {copies:?}; audit {audit:?}",
                steps.len(),
                steps.iter().find_map(|s| s.fetch_error.as_deref()),
                percentile(&step_ms, 0.5),
                percentile(&step_ms, 0.99),
                percentile(&step_ms, 1.0),
                records.len(),
            );
            assert!(audit.acked > 0, "no Push was acknowledged");
            assert_eq!(audit.acked_lost, 0, "an acknowledged Push was lost");
            assert_eq!(audit.applied_twice, 0, "a Push was applied twice");
            assert!(audit.hot_rows_match, "rows differ from the Pushes applied");
        });
    });
}

/// The `q` quantile (0..=1) of `values`, by nearest rank.
fn percentile(values: &[f64], q: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// An etcd of one member on host `host` (client port 2379), its data and
/// log under `dir`, killed when dropped; and its endpoint.
fn start_etcd(cluster: &NetCluster, host: usize, dir: &std::path::Path) -> (KillOnDrop, String) {
    let ip = cluster.addr(host);
    let endpoint = format!("{ip}:2379");
    let child = cluster
        .command(host, tessera_coord::etcd_bin(None))
        .args(["--name", "tessera", "--data-dir"])
        .arg(dir.join("etcd-data"))
        .arg(format!("--listen-client-urls=http://{endpoint}"))
        .arg(format!("--advertise-client-urls=http://{endpoint}"))
        .arg(format!("--listen-peer-urls=http://{ip}:2380"))
        .arg(format!("--initial-advertise-peer-urls=http://{ip}:2380"))
        .arg(format!("--initial-cluster=tessera=http://{ip}:2380"))
        // One member: short Raft timings, as the local etcd of the tests.
        .args(["--heartbeat-interval=50", "--election-timeout=500"])
        .args(["--logger=zap", "--log-level=warn"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("etcd.log")).unwrap())
        .spawn()
        .unwrap();
    (KillOnDrop(child), endpoint)
}

/// Shard `shard`'s status on `server`, asked on host `from`: (role,
/// fenced); `None` while it does not answer.
fn shard_role(cluster: &NetCluster, from: usize, server: &str) -> Option<(String, bool)> {
    let output = cluster
        .command(from, common::binary("tessera"))
        .args(["status", "--json", server])
        .stderr(Stdio::null())
        .output()
        .unwrap();
    let rows: serde_json::Value = serde_json::from_slice(&output.stdout).ok()?;
    let shard = &rows[0]["shard_health"][0];
    Some((shard["role"].as_str()?.to_owned(), shard["fenced"] == true))
}

/// `failover_timeout_ms` of drill 5: the default.
const FAILOVER_MS: u64 = 3000;

/// Issue 19's drill 5: etcd on host 6, the fleet on hosts 1-4, a trainer
/// on host 5. The link of shard 0's primary's host goes down for 8 s with
/// the process left running: the primary, cut off from etcd, fences
/// itself (stops acknowledging) within its lease; the replica takes over
/// under a new epoch and Pushes resume; when the link returns, the stale
/// primary follows the new one and catches up. No acknowledged Push lost,
/// none applied twice, every copy identical.
#[test]
fn a_primarys_host_cut_off_fails_over_and_the_stale_primary_rejoins() {
    let Some(cluster) = NetCluster::create_or_skip(6) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (_etcd, endpoint) = start_etcd(&cluster, 6, dir.path());
    let coordinator = CoordinatorConfig {
        kind: CoordinatorKind::Etcd,
        endpoints: vec![endpoint],
        failover_timeout_ms: FAILOVER_MS,
        ..CoordinatorConfig::default()
    };
    let base = PsServerConfig {
        tables: vec![trainer::table()],
        coordinator: coordinator.clone(),
        ..PsServerConfig::default()
    };
    let _servers = start_fleet(&cluster, 2, dir.path(), 5, &|_, _| base.clone());
    let fleet_servers = training_fleet(&cluster);
    cluster.run_on(5, || {
        runtime().block_on(async {
            let victim = wait_settled(&fleet_servers, 0, Duration::from_secs(30)).await;
            let (victim_group, other) = if victim == fleet_address(&cluster, 2, 0, 0) {
                (0, fleet_address(&cluster, 2, 1, 0))
            } else {
                (1, fleet_address(&cluster, 2, 0, 0))
            };
            let victim_host = fleet_host(2, victim_group, 0);
            let old_epoch = tessera_test_support::health(&victim).await.unwrap().shard_health[0].epoch;
            let client = trainer_client(|g, s| fleet_address(&cluster, 2, g, s), coordinator);
            let trainer = Trainer::start(Arc::clone(&client), 4);
            tessera_test_support::wait_for_health(
                &victim,
                "the primary of shard 0 taking the trainer's Pushes",
                Duration::from_secs(30),
                |h| shard_position(h, 0) >= 100,
            )
            .await;
            cluster.set_link(victim_host, false);
            let down = Instant::now();
            // Asked on its own host, the cut-off primary says it is fenced
            // (or no longer primary) once its lease cannot be renewed.
            let fenced = loop {
                match shard_role(&cluster, victim_host, &victim) {
                    Some((role, fenced)) if role != "primary" || fenced => break down.elapsed(),
                    _ => {}
                }
                assert!(down.elapsed() < Duration::from_secs(8), "the cut-off primary never fenced itself");
                tokio::time::sleep(Duration::from_millis(50)).await;
            };
            wait_role(&other, ShardRole::Primary, Duration::from_secs(30)).await;
            let took_over = down.elapsed();
            tokio::time::sleep(Duration::from_secs(8).saturating_sub(down.elapsed())).await;
            cluster.set_link(victim_host, true);
            let up = Instant::now();
            wait_role(&victim, ShardRole::Replica, Duration::from_secs(30)).await;
            let rejoined = up.elapsed();
            // Pushes flow to the rejoined server: its copy passes where the
            // new primary stood once it had rejoined.
            let primary_at = shard_position(&tessera_test_support::health(&other).await.unwrap(), 0);
            tessera_test_support::wait_for_health(
                &victim,
                "the rejoined server applying the new primary's Pushes",
                Duration::from_secs(30),
                |h| shard_position(h, 0) > primary_at,
            )
            .await;
            let (records, steps) = trainer.stop().await;
            let first_new_ack = records
                .iter()
                .filter(|r| r.shard == 0 && r.epoch > old_epoch)
                .filter_map(|r| r.acked_at)
                .min()
                .expect("shard 0's new primary acknowledged Pushes");
            let resumed = first_new_ack.saturating_duration_since(down);
            let failed_steps = steps.iter().filter(|s| !s.ok).count();
            let copies = wait_identical(&fleet_servers).await;
            let audit = audit(&fleet_servers, &records, TransportKind::Tcp).await;
            eprintln!(
                "drill netns primary-host-cut-off: etcd on host 6, 4 servers on hosts 1-4, a trainer on host 5 (4 tasks); \
                 link of shard 0's primary's host down 8 s (failover_timeout {FAILOVER_MS} ms): it fenced itself {:.0} ms after the cut; \
                 the replica primary {:.0} ms after; shard-0 Pushes resumed {:.0} ms after; link back: the stale primary a replica in step {:.0} ms later; \
                 {} steps ({failed_steps} failed), {} Pushes; copies {copies:?}; audit {audit:?}",
                fenced.as_secs_f64() * 1000.0,
                took_over.as_secs_f64() * 1000.0,
                resumed.as_secs_f64() * 1000.0,
                rejoined.as_secs_f64() * 1000.0,
                steps.len(),
                records.len(),
            );
            assert_eq!(audit.acked_lost, 0, "an acknowledged Push was lost");
            assert_eq!(audit.applied_twice, 0, "a Push was applied twice");
            assert!(audit.hot_rows_match, "rows differ from the Pushes applied");
            assert!(
                resumed < Duration::from_millis(FAILOVER_MS + 3000),
                "Pushes resumed {resumed:?} after the cut"
            );
        });
    });
}
