//! What the drills share: the fleet of servers on the hosts, `tessera
//! status` from a host, a ranker process, a trainer's client, a runtime.

use super::*;

/// `tessera status --json` of `servers`, run on host `from`: each server's
/// (reachable, serving).
pub fn status(cluster: &NetCluster, from: usize, servers: &[String]) -> Vec<(bool, bool)> {
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
pub fn until(
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

/// The servers of `num_shards` shards x 2 replica groups, one per host:
/// the server of (group, shard) on host 1 + group * num_shards + shard.
pub fn fleet_host(num_shards: u32, group: u32, shard: u32) -> usize {
    1 + (group * num_shards + shard) as usize
}

pub fn fleet(num_shards: u32) -> Vec<(u32, u32)> {
    (0..2)
        .flat_map(|g| (0..num_shards).map(move |s| (g, s)))
        .collect()
}

pub fn fleet_address(cluster: &NetCluster, num_shards: u32, group: u32, shard: u32) -> String {
    format!(
        "{}:7000",
        cluster.addr(fleet_host(num_shards, group, shard))
    )
}

/// The fleet's servers for the ranker drills: inference mode, table `emb`
/// of dim 16.
pub fn inference() -> PsServerConfig {
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
pub fn start_fleet(
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
pub fn ranker_config(cluster: &NetCluster, secs: f64, extra: &str) -> String {
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
pub fn start_ranker(
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

/// The fleet of the trainer drills: 2 shards x 2 groups on hosts 1-4,
/// each server's (address, shard).
pub fn training_fleet(cluster: &NetCluster) -> Vec<(String, u32)> {
    fleet(2)
        .into_iter()
        .map(|(g, s)| (fleet_address(cluster, 2, g, s), s))
        .collect()
}

/// A trainer's client of the fleet, dialling `dial(group, shard)` for
/// each server: Fetches fail over to the replica, Pushes wait out a
/// failover (as the local drills' trainer).
pub fn trainer_client(
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
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}
