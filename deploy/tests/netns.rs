//! Drills on a multi-host cluster of network namespaces
//! (`tessera_test_support::netns`): real ps-server processes on their own
//! hosts and addresses, a worker on another, and faults of the hosts and
//! of the links between them.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stderr,
    missing_docs
)]

use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tessera_proto::v1::ShardRole;
use tessera_ps_server::config::{CoordinatorConfig, CoordinatorKind, PeerConfig};
use tessera_ps_server::{Mode, PsServerConfig, TableConfig};
use tessera_rpc::TransportKind;
use tessera_test_support::FaultProxy;
use tessera_test_support::netns::NetCluster;
use tessera_test_support::process::{PsProcess, ps_server_bin};
use tessera_worker::config::ServerEndpoint;
use tessera_worker::{PsClient, WorkerConfig};

mod common;
use common::KillOnDrop;

// The local drills use all of it; these drills a part.
#[allow(dead_code)]
#[path = "drills/trainer.rs"]
mod trainer;
use trainer::{Trainer, audit, wait_identical, wait_role, wait_settled};

/// `tessera status --json` of `servers`, run on host `from`: each server's
/// (reachable, serving).
fn status(cluster: &NetCluster, from: usize, servers: &[String]) -> Vec<(bool, bool)> {
    let output = cluster
        .command(from, common::binary("tessera"))
        .args(["status", "--json"])
        .args(servers)
        .stderr(Stdio::null())
        .output()
        .unwrap();
    let rows: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    rows.as_array()
        .unwrap()
        .iter()
        .map(|r| (r["reachable"] == true, r["serving"] == true))
        .collect()
}

/// Polls `status` from host `from` until `want` holds or `timeout` passes;
/// how long it took.
fn until(
    cluster: &NetCluster,
    from: usize,
    servers: &[String],
    timeout: Duration,
    want: impl Fn(&[(bool, bool)]) -> bool,
) -> Duration {
    let started = Instant::now();
    loop {
        let now = status(cluster, from, servers);
        if want(&now) {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < timeout,
            "not within {timeout:?}: status {now:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The link to the host of shard 0's primary goes down and comes back: a
/// client on a third host sees that server unreachable while the replica
/// on the second host keeps serving, and both serving again once the link
/// is back.
#[test]
fn a_hosts_link_going_down_isolates_it_and_it_returns_with_the_link() {
    let Some(cluster) = NetCluster::create_or_skip(3) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    // Shard 0 of 1: group 0's server on host 1, group 1's on host 2.
    let (_servers, addresses) = start_fleet(&cluster, 1, dir.path(), 3, &|_, _| inference());
    cluster.set_link(1, false);
    let isolated = until(&cluster, 3, &addresses, Duration::from_secs(30), |s| {
        s == [(false, false), (true, true)]
    });
    cluster.set_link(1, true);
    let back = until(&cluster, 3, &addresses, Duration::from_secs(30), |s| {
        s == [(true, true), (true, true)]
    });
    eprintln!(
        "drill netns link-down: 3 hosts (namespaces), servers on 2; \
         link of host 1 down: unreachable from host 3 within {:.2} s while host 2 serves; \
         link up: both serving again within {:.2} s",
        isolated.as_secs_f64(),
        back.as_secs_f64()
    );
}

/// The servers of `num_shards` shards x 2 replica groups, one per host:
/// the server of (group, shard) on host 1 + group * num_shards + shard.
fn fleet_host(num_shards: u32, group: u32, shard: u32) -> usize {
    1 + (group * num_shards + shard) as usize
}

fn fleet(num_shards: u32) -> Vec<(u32, u32)> {
    (0..2)
        .flat_map(|g| (0..num_shards).map(move |s| (g, s)))
        .collect()
}

fn fleet_address(cluster: &NetCluster, num_shards: u32, group: u32, shard: u32) -> String {
    format!(
        "{}:7000",
        cluster.addr(fleet_host(num_shards, group, shard))
    )
}

/// The fleet's servers for the ranker drills: inference mode, table `emb`
/// of dim 16.
fn inference() -> PsServerConfig {
    PsServerConfig {
        mode: Mode::Inference,
        tables: vec![TableConfig::new("emb", 16)],
        ..PsServerConfig::default()
    }
}

/// Starts the fleet of `num_shards` shards x 2 replica groups, each server
/// configured as `base(group, shard)` with its own address, shard, group
/// and peers, and
/// waits until host `watcher` sees every server serving; its processes,
/// and their addresses in host order.
fn start_fleet(
    cluster: &NetCluster,
    num_shards: u32,
    dir: &std::path::Path,
    watcher: usize,
    base: &dyn Fn(u32, u32) -> PsServerConfig,
) -> (Vec<PsProcess>, Vec<String>) {
    let members = fleet(num_shards);
    let address = |g, s| fleet_address(cluster, num_shards, g, s);
    let servers: Vec<PsProcess> = members
        .iter()
        .map(|&(group, shard)| {
            let config = PsServerConfig {
                listen: address(group, shard),
                num_shards,
                shards: vec![shard],
                replica_group: group,
                replica_groups: 2,
                peers: members
                    .iter()
                    .filter(|&&member| member != (group, shard))
                    .map(|&(g, s)| PeerConfig {
                        address: address(g, s),
                        replica_group: g,
                        shards: vec![s],
                    })
                    .collect(),
                ..base(group, shard)
            };
            PsProcess::spawn_under(
                cluster.prefix(fleet_host(num_shards, group, shard)),
                &ps_server_bin(),
                &config,
                dir,
                &format!("ps-g{group}-s{shard}"),
                &[],
            )
        })
        .collect();
    let addresses: Vec<String> = members.iter().map(|&(g, s)| address(g, s)).collect();
    until(cluster, watcher, &addresses, Duration::from_secs(30), |s| {
        s.iter().all(|&(reachable, serving)| reachable && serving)
    });
    (servers, addresses)
}

/// A ranker's configuration against the fleet: user requests of 2 models'
/// Fetches at 100 per second for `secs`, plus `extra` (TOML).
fn ranker_config(cluster: &NetCluster, secs: f64, extra: &str) -> String {
    let mut text = format!(
        "transport = \"tcp\"\nnum_shards = 2\n{extra}\n\
         [workload]\ntable = \"emb\"\nduration_secs = {secs:.1}\nconcurrency = 8\nmodels = 2\n\
         rate_per_sec = 100.0\nresponse_bytes_min = 1024\nresponse_bytes_max = 65536\n"
    );
    for (g, s) in fleet(2) {
        text += &format!(
            "[[servers]]\naddress = \"{}\"\nshards = [{s}]\nreplica_group = {g}\n",
            fleet_address(cluster, 2, g, s)
        );
    }
    text
}

/// Starts the `worker` binary as a ranker on `host` with `config`, its
/// report going to `report`.
fn start_ranker(
    cluster: &NetCluster,
    host: usize,
    config: &std::path::Path,
    report: &std::path::Path,
) -> KillOnDrop {
    KillOnDrop(
        cluster
            .command(host, common::binary("worker"))
            .arg("--config")
            .arg(config)
            .arg("--json")
            .arg(report)
            .arg("ranker")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// Issue 19's drill 1: 2 shards x 2 replica groups, a server per host (4
/// hosts), a ranker on a fifth. The server of group 0 hosting shard 0 is
/// SIGKILLed a third of the way into the load: every Fetch of the user
/// requests still succeeds (from group 1, through the replica set's
/// retries and quarantine), and the run's p99 is printed.
#[test]
fn a_server_killed_under_a_ranker_load_costs_no_failed_fetch() {
    let Some(cluster) = NetCluster::create_or_skip(5) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (mut servers, _) = start_fleet(&cluster, 2, dir.path(), 5, &|_, _| inference());
    // The ranker runs 9 s; the kill comes at 3 s.
    let worker_path = dir.path().join("worker.toml");
    std::fs::write(
        &worker_path,
        ranker_config(&cluster, 9.0, "request_timeout_ms = 1000"),
    )
    .unwrap();
    let report_path = dir.path().join("ranker.json");
    let mut ranker = start_ranker(&cluster, 5, &worker_path, &report_path);
    // The drill's schedule: the kill a third of the way in.
    std::thread::sleep(Duration::from_secs(3));
    servers[0].kill();
    let killed = Instant::now();
    let exit = ranker.0.wait().unwrap();
    assert!(exit.success(), "the ranker failed: {exit}");
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&report_path).unwrap()).unwrap();
    let iterations = report["iterations"].as_u64().unwrap();
    let errors = report["errors"].as_u64().unwrap();
    let p99 = &report["fetch"];
    eprintln!(
        "drill netns kill-under-ranker: 4 servers on 4 hosts, a ranker on a fifth at 100 requests/s; \
         group 0's shard-0 server SIGKILLed 3 s in, the load ran {:.1} s more; \
         {iterations} user requests, {errors} failed (target 0); Fetch latency over the run: {p99}",
        (Instant::now() - killed).as_secs_f64()
    );
    assert!(iterations > 0);
    assert_eq!(errors, 0, "failed user requests: {}", report["first_error"]);
}

/// The servers a worker's `WorkerAdmin` lists as quarantined, asked from
/// host `from`; `None` while it does not answer.
fn quarantined(cluster: &NetCluster, from: usize, admin: &str) -> Option<String> {
    let output = cluster
        .command(from, common::binary("tessera"))
        .args(["admin", "quarantine", admin])
        .stderr(Stdio::null())
        .output()
        .unwrap();
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Fetches `server` served so far, asked on its own host (its link may be
/// down).
fn fetches_served(cluster: &NetCluster, host: usize, server: &str) -> u64 {
    let output = cluster
        .command(host, common::binary("tessera"))
        .args(["admin", "stats", server])
        .output()
        .unwrap();
    assert!(output.status.success());
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .skip(2)
        .filter_map(|line| line.split('|').nth(5)?.trim().parse::<u64>().ok())
        .sum()
}

/// How long drill 2's link stays down: the 30 s with
/// `TESSERA_DRILLS=full` (`scripts/dev drills`), 8 s in the suite.
fn link_down_secs() -> u64 {
    match std::env::var("TESSERA_DRILLS").as_deref() {
        Ok("full") => 30,
        _ => 8,
    }
}

/// Issue 19's drill 2: the link to a server's host goes down under a
/// ranker on another host for `link_down_secs` (30 s in the full
/// profile), with a 10 s quarantine cooldown. Quarantine takes that
/// server out, the load goes on from the other replica group, and after
/// the link is back the server is readmitted once its cooldown ends and
/// serves again. A dead link answers nothing (no reset), so each attempt
/// is bounded at 40 ms (`request_timeout_ms`), leaving a retry on the
/// other replica room within the call's 100 ms deadline. Figures: when
/// requests stopped paying for the dead server (the ranker's per-second
/// timeline: none of a second's requests failed or took 40 ms or more),
/// when it was quarantined, readmitted, and served again.
#[test]
fn a_link_down_is_quarantined_and_readmitted_after_its_cooldown() {
    let Some(cluster) = NetCluster::create_or_skip(5) else {
        return;
    };
    let down_for = Duration::from_secs(link_down_secs());
    let dir = tempfile::tempdir().unwrap();
    let (_servers, addresses) = start_fleet(&cluster, 2, dir.path(), 5, &|_, _| inference());
    let admin = format!("{}:7090", cluster.addr(5));
    let extra = format!(
        "admin_listen = \"{admin}\"\nrequest_timeout_ms = 40\n[quarantine]\nmax_connect_failures = 2\nmax_request_failures = 3\nbase_cooldown_secs = 10\nwindow_secs = 30\n"
    );
    let worker_path = dir.path().join("worker.toml");
    let load_secs = down_for.as_secs_f64() + 16.0;
    std::fs::write(&worker_path, ranker_config(&cluster, load_secs, &extra)).unwrap();
    let report_path = dir.path().join("ranker.json");
    let mut ranker = start_ranker(&cluster, 5, &worker_path, &report_path);
    // The load is on once the worker's admin endpoint answers; then a
    // baseline of 2 s (the drill's schedule).
    let started = Instant::now();
    while quarantined(&cluster, 5, &admin).is_none() {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the ranker's admin endpoint never answered"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let load_started = Instant::now();
    std::thread::sleep(Duration::from_secs(2));
    let victim = addresses[0].clone();
    let victim_host = fleet_host(2, 0, 0);
    cluster.set_link(victim_host, false);
    let down = Instant::now();
    let listed = |text: &Option<String>| text.as_deref().is_some_and(|t| t.contains(&victim));
    while !listed(&quarantined(&cluster, 5, &admin)) {
        assert!(
            down.elapsed() < Duration::from_secs(8),
            "not quarantined within 8 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let quarantined_after = down.elapsed();
    let served_while_out = fetches_served(&cluster, victim_host, &victim);
    std::thread::sleep(down_for.saturating_sub(down.elapsed()));
    cluster.set_link(victim_host, true);
    let up = Instant::now();
    while listed(&quarantined(&cluster, 5, &admin)) {
        assert!(
            up.elapsed() < Duration::from_secs(15),
            "not readmitted within 15 s of the link's return"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let readmitted = up.elapsed();
    // Traffic is back once the server serves Fetches again.
    while fetches_served(&cluster, victim_host, &victim) <= served_while_out {
        assert!(
            up.elapsed() < Duration::from_secs(20),
            "no Fetch reached the readmitted server"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let returned = up.elapsed();
    let exit = ranker.0.wait().unwrap();
    assert!(exit.success(), "the ranker failed: {exit}");
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&report_path).unwrap()).unwrap();
    let (iterations, errors) = (
        report["iterations"].as_u64().unwrap(),
        report["errors"].as_u64().unwrap(),
    );
    // The ranker's seconds while the link was down: which ones paid for
    // the dead server.
    let down_second = (down - load_started).as_secs();
    let up_second = (up - load_started).as_secs();
    let paid: Vec<u64> = report["timeline"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| {
            let second = s["second"].as_u64().unwrap();
            (down_second..up_second).contains(&second)
                && (s["errors"].as_u64().unwrap() > 0 || s["max_us"].as_u64().unwrap() >= 40_000)
        })
        .map(|s| s["second"].as_u64().unwrap() - down_second)
        .collect();
    let moved_away = paid.last().map_or(0, |last| last + 1);
    eprintln!(
        "drill netns link-down-quarantine: link of group 0's shard-0 host down {} s under a ranker at 100 requests/s \
         (attempts 40 ms, calls 100 ms; quarantine after 2 connect / 3 request failures, cooldown 10 s): \
         requests paid for the dead server (failed, or took 40 ms or more) in seconds {paid:?} after the cut, none from second {moved_away} on; \
         quarantined {:.2} s after the cut; link back: readmitted {:.2} s after, serving Fetches again {:.2} s after; \
         {iterations} user requests, {errors} failed; Fetch p99 over the run {} us, max {} us",
        down_for.as_secs(),
        quarantined_after.as_secs_f64(),
        readmitted.as_secs_f64(),
        returned.as_secs_f64(),
        report["fetch"]["p99_us"],
        report["fetch"]["max_us"],
    );
    // The target is none. Here an attempt on the healthy replica
    // now and then misses its 40 ms bound too on two loaded cores (0 to 3
    // of 2,400 in a run), so the drill holds failures to 1% and prints
    // them.
    assert!(
        errors * 100 <= iterations,
        "{errors} of {iterations} user requests failed: {}",
        report["first_error"]
    );
}

/// The fleet of the trainer drills: 2 shards x 2 groups on hosts 1-4,
/// each server's (address, shard).
fn training_fleet(cluster: &NetCluster) -> Vec<(String, u32)> {
    fleet(2)
        .into_iter()
        .map(|(g, s)| (fleet_address(cluster, 2, g, s), s))
        .collect()
}

/// A trainer's client of the fleet, dialling `dial(group, shard)` for
/// each server: Fetches fail over to the replica, Pushes wait out a
/// failover (as the local drills' trainer).
fn trainer_client(
    dial: impl Fn(u32, u32) -> String,
    coordinator: tessera_coord::CoordinatorConfig,
) -> Arc<PsClient> {
    let config = WorkerConfig {
        transport: TransportKind::Tcp,
        num_shards: 2,
        servers: fleet(2)
            .into_iter()
            .map(|(g, s)| ServerEndpoint {
                address: dial(g, s),
                shards: vec![s],
                replica_group: g,
            })
            .collect(),
        call_timeout_ms: 5000,
        push_timeout_ms: 20_000,
        coordinator,
        ..WorkerConfig::default()
    };
    Arc::new(PsClient::new(&config).unwrap())
}

/// The test's own runtime (built on the host `run_on` entered).
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

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
            // A calm second: what was held or retried lands.
            tokio::time::sleep(Duration::from_secs(1)).await;
            let (records, steps) = trainer.stop().await;
            let answers_lost: u64 = proxies.iter().map(FaultProxy::lost).sum();
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
            tokio::time::sleep(Duration::from_secs(3)).await;
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
            tokio::time::sleep(Duration::from_secs(1)).await;
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

/// How often drill 3's clients probe RDMA while on TCP: 2 s, so that the
/// return is measured within the suite's time (the default is 5 s).
const PROBE_MS: u64 = 2000;

/// Issue 19's drill 3: the fleet over RDMA (soft provider) on hosts 1-4, a
/// client on host 5. The RDMA path to group 0's shard-0 server breaks
/// while its TCP works (its soft NIC's port goes down: every queue pair of
/// the server fails and none can be made, as with an RNIC whose cable is
/// pulled): calls to it move to TCP (target: under 1 s), and back to RDMA
/// once the port is up again (target: within the probe interval). A
/// worker client's Fetches over the whole fleet run meanwhile; what
/// failed is printed.
#[test]
fn a_broken_rdma_path_moves_calls_to_tcp_and_back() {
    let Some(cluster) = NetCluster::create_or_skip(5) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    // Each server's NIC port is down while its file exists.
    let port_file = |g: u32, s: u32| dir.path().join(format!("rnic-down-g{g}-s{s}"));
    let rdma = |g, s| tessera_rpc::RdmaConfig {
        soft_port_file: Some(port_file(g, s)),
        ..trainer::rdma_soft()
    };
    let _servers = start_fleet(&cluster, 2, dir.path(), 5, &|g, s| PsServerConfig {
        transport: TransportKind::Rdma,
        rdma: rdma(g, s),
        ..inference()
    });
    let victim = fleet_address(&cluster, 2, 0, 0);
    cluster.run_on(5, || {
        runtime().block_on(async {
            let fallback = tessera_rpc::policy::FallbackConfig {
                probe_interval_ms: PROBE_MS,
                ..Default::default()
            };
            // The fleet's worker client over RDMA, Fetching all along.
            let worker = Arc::new(
                PsClient::new(&WorkerConfig {
                    transport: TransportKind::Rdma,
                    rdma: trainer::rdma_soft(),
                    fallback,
                    num_shards: 2,
                    servers: fleet(2)
                        .into_iter()
                        .map(|(g, s)| ServerEndpoint {
                            address: fleet_address(&cluster, 2, g, s),
                            shards: vec![s],
                            replica_group: g,
                        })
                        .collect(),
                    call_timeout_ms: 1000,
                    ..WorkerConfig::default()
                })
                .unwrap(),
            );
            let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let load = tokio::spawn({
                let (worker, stop) = (Arc::clone(&worker), Arc::clone(&stop));
                async move {
                    let keys: Vec<u64> = (0..64).collect();
                    let (mut ok, mut failed, mut first_error) = (0u64, 0u64, None);
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        match worker.fetch("emb", &keys).await {
                            Ok(_) => ok += 1,
                            Err(err) => {
                                failed += 1;
                                first_error.get_or_insert(err.to_string());
                            }
                        }
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    (ok, failed, first_error)
                }
            });
            // A channel of its own to the server whose path breaks: which
            // transport carries its calls.
            let channel = tessera_rpc::Channel::lazy(
                &victim,
                tessera_rpc::ChannelConfig {
                    connect_timeout_ms: 1000,
                    request_timeout_ms: 1000,
                    fallback,
                    transport: tessera_rpc::TransportConfig::soft_rdma(),
                },
            )
            .unwrap();
            let data = tessera_proto::v1::ParameterServerClient::new(channel.clone());
            let call = || {
                let data = data.clone();
                async move {
                    data.fetch(tessera_proto::v1::FetchRequest {
                        table: "emb".into(),
                        shard: 0,
                        keys: tessera_test_support::keys_of_shard(0, 2, 3),
                    })
                    .await
                }
            };
            call().await.unwrap();
            assert_eq!(channel.current_transport(), Some(TransportKind::Rdma));
            tokio::time::sleep(Duration::from_secs(1)).await;

            std::fs::write(port_file(0, 0), b"").unwrap();
            let broken = Instant::now();
            let mut failed = 0;
            let moved = loop {
                match call().await {
                    Ok(_) if channel.current_transport() == Some(TransportKind::Tcp) => {
                        break broken.elapsed();
                    }
                    Ok(_) => {}
                    Err(_) => failed += 1,
                }
                assert!(
                    broken.elapsed() < Duration::from_secs(10),
                    "calls never moved to TCP"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            };
            // Stays on TCP while the port is down: the probes fail.
            let stay = Instant::now() + Duration::from_millis(PROBE_MS + 500);
            while Instant::now() < stay {
                call().await.unwrap();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert_eq!(channel.current_transport(), Some(TransportKind::Tcp));

            std::fs::remove_file(port_file(0, 0)).unwrap();
            let repaired = Instant::now();
            let returned = loop {
                call().await.unwrap();
                if channel.current_transport() == Some(TransportKind::Rdma) {
                    break repaired.elapsed();
                }
                assert!(
                    repaired.elapsed() < Duration::from_millis(4 * PROBE_MS),
                    "calls never returned to RDMA"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            };
            tokio::time::sleep(Duration::from_secs(1)).await;
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            let (fetched, fetch_failed, first_error) = load.await.unwrap();
            eprintln!(
                "drill netns rdma-path-breaks: 4 servers over RDMA (soft NIC) on hosts 1-4, a client on host 5; \
                 group 0's shard-0 server's NIC port down for {:.1} s, its TCP up: calls to it on TCP {:.0} ms after the break \
                 ({failed} failed on the way); back on RDMA {:.0} ms after the port came up (probe interval {PROBE_MS} ms); \
                 the worker client's Fetches over the fleet meanwhile: {fetched} ok, {fetch_failed} failed (first: {first_error:?})",
                (repaired - broken).as_secs_f64(),
                moved.as_secs_f64() * 1000.0,
                returned.as_secs_f64() * 1000.0,
            );
            assert!(moved < Duration::from_secs(1), "moved to TCP after {moved:?}");
            // A probe that began just before the port came back, and
            // failed, leaves the next one an interval later.
            assert!(
                returned <= Duration::from_millis(2 * PROBE_MS),
                "back on RDMA after {returned:?}"
            );
            // The fleet's client retries a failed attempt on the other
            // replica: its Fetches should not fail (0 in the runs here);
            // held to 1% on two loaded cores, as drill 2.
            assert!(
                fetch_failed * 100 <= fetched + fetch_failed,
                "{fetch_failed} Fetches failed: {first_error:?}"
            );
        });
    });
}

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
        ..trainer::rdma_soft()
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

/// A TCP link that goes silent for 7 s, with a call left unanswered on
/// it, is closed by the channel at the next timed-out attempt (calls
/// timing out for 2 s with nothing heard: `rpc/src/silence.rs`), so calls
/// reconnect as soon as the link is back. Before, the stale connection
/// stayed: calls after the link's return waited for TCP's next
/// retransmission, which after a 7 s outage is 5-6 s later (and 20 s or
/// more after 30 s: drill 2's full profile found it).
#[test]
fn a_connection_through_a_silent_link_is_dropped_and_calls_reconnect_when_it_returns() {
    let Some(cluster) = NetCluster::create_or_skip(2) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let addr = format!("{}:7000", cluster.addr(1));
    let _server = PsProcess::spawn_under(
        cluster.prefix(1),
        &ps_server_bin(),
        &PsServerConfig {
            listen: addr.clone(),
            ..inference()
        },
        dir.path(),
        "server",
        &[],
    );
    until(
        &cluster,
        2,
        std::slice::from_ref(&addr),
        Duration::from_secs(30),
        |s| s == [(true, true)],
    );
    cluster.run_on(2, || {
        runtime().block_on(async {
            let config = tessera_rpc::ChannelConfig {
                connect_timeout_ms: 200,
                ..Default::default()
            };
            let channel = tessera_rpc::Channel::lazy(&addr, config).unwrap();
            let data = tessera_proto::v1::ParameterServerClient::new(channel);
            let call = |ms| {
                let data = data.clone();
                async move {
                    data.fetch_with_options(
                        tessera_proto::v1::FetchRequest {
                            table: "emb".into(),
                            shard: 0,
                            keys: vec![1, 2, 3],
                        },
                        &tessera_rpc::CallOptions::with_timeout(Duration::from_millis(ms)),
                    )
                    .await
                }
            };
            call(5000).await.unwrap();
            cluster.set_link(1, false);
            // A call goes out on the connection and is not answered.
            assert!(call(300).await.is_err());
            tokio::time::sleep(Duration::from_secs(7)).await;
            cluster.set_link(1, true);
            let up = Instant::now();
            let mut failed = 0;
            while call(300).await.is_err() {
                failed += 1;
                assert!(
                    up.elapsed() < Duration::from_secs(3),
                    "no call answered within 3 s of the link's return ({failed} failed)"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            eprintln!(
                "silent link 7 s: calls answered again {:.0} ms after its return ({failed} failed first)",
                up.elapsed().as_secs_f64() * 1000.0
            );
        });
    });
}
