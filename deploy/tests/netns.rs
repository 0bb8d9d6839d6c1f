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

use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use tessera_test_support::netns::NetCluster;

mod common;

struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Shard 0's server of `group` on `me`, the other group's on `peer`.
fn server_config(me: &str, group: u32, peer: &str) -> String {
    format!(
        "listen = \"{me}:7000\"\nnum_shards = 1\nshards = [0]\nreplica_group = {group}\nreplica_groups = 2\n\
         [[peers]]\naddress = \"{peer}:7000\"\nreplica_group = {}\nshards = [0]\n\
         [[tables]]\nname = \"emb\"\ndim = 4\n",
        1 - group
    )
}

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
    let cluster = match NetCluster::create(3) {
        Ok(cluster) => cluster,
        Err(why) => {
            eprintln!("SKIP: no network namespaces here, so no multi-host drill: {why}");
            return;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let (h1, h2) = (cluster.addr(1), cluster.addr(2));
    let mut servers = Vec::new();
    for (host, group, me, peer) in [(1, 0, &h1, &h2), (2, 1, &h2, &h1)] {
        let path = dir.path().join(format!("ps-{host}.toml"));
        std::fs::write(&path, server_config(me, group, peer)).unwrap();
        let log = std::fs::File::create(dir.path().join(format!("ps-{host}.log"))).unwrap();
        servers.push(KillOnDrop(
            cluster
                .command(host, tessera_test_support::process::ps_server_bin())
                .arg("--config")
                .arg(&path)
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .unwrap(),
        ));
    }
    let addresses = [format!("{h1}:7000"), format!("{h2}:7000")];
    let up = until(&cluster, 3, &addresses, Duration::from_secs(30), |s| {
        s == [(true, true), (true, true)]
    });
    cluster.set_link(1, false);
    let isolated = until(&cluster, 3, &addresses, Duration::from_secs(30), |s| {
        s == [(false, false), (true, true)]
    });
    cluster.set_link(1, true);
    let back = until(&cluster, 3, &addresses, Duration::from_secs(30), |s| {
        s == [(true, true), (true, true)]
    });
    eprintln!(
        "drill netns link-down: 3 hosts (namespaces), servers on 2; both serving {:.2} s after start; \
         link of host 1 down: unreachable from host 3 within {:.2} s while host 2 serves; \
         link up: both serving again within {:.2} s",
        up.as_secs_f64(),
        isolated.as_secs_f64(),
        back.as_secs_f64()
    );
    drop(servers);
}

/// Issue 19's drill 1: 2 shards x 2 replica groups, a server per host (4
/// hosts), a ranker on a fifth. The server of group 0 hosting shard 0 is
/// SIGKILLed a third of the way into the load: every Fetch of the user
/// requests still succeeds (from group 1, through the replica set's
/// retries and quarantine), and the run's p99 is printed.
#[test]
fn a_server_killed_under_a_ranker_load_costs_no_failed_fetch() {
    let cluster = match NetCluster::create(5) {
        Ok(cluster) => cluster,
        Err(why) => {
            eprintln!("SKIP: no network namespaces here, so no multi-host drill: {why}");
            return;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    // Host of (group, shard): 1 + 2 * group + shard.
    let host = |group: u32, shard: u32| 1 + 2 * group as usize + shard as usize;
    let address = |group: u32, shard: u32| format!("{}:7000", cluster.addr(host(group, shard)));
    let table = "[[tables]]\nname = \"emb\"\ndim = 16\n";
    let mut servers = Vec::new();
    for group in 0..2u32 {
        for shard in 0..2u32 {
            let mut text = format!(
                "listen = \"{}\"\nnum_shards = 2\nshards = [{shard}]\nreplica_group = {group}\nreplica_groups = 2\nmode = \"inference\"\n",
                address(group, shard)
            );
            for (g, s) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
                if (g, s) != (group, shard) {
                    text += &format!(
                        "[[peers]]\naddress = \"{}\"\nreplica_group = {g}\nshards = [{s}]\n",
                        address(g, s)
                    );
                }
            }
            text += table;
            let path = dir.path().join(format!("ps-g{group}-s{shard}.toml"));
            std::fs::write(&path, text).unwrap();
            let log = std::fs::File::create(path.with_extension("log")).unwrap();
            servers.push(KillOnDrop(
                cluster
                    .command(
                        host(group, shard),
                        tessera_test_support::process::ps_server_bin(),
                    )
                    .arg("--config")
                    .arg(&path)
                    .stdout(Stdio::null())
                    .stderr(log)
                    .spawn()
                    .unwrap(),
            ));
        }
    }
    let all: Vec<String> = [(0, 0), (0, 1), (1, 0), (1, 1)]
        .iter()
        .map(|&(g, s)| address(g, s))
        .collect();
    until(&cluster, 5, &all, Duration::from_secs(30), |s| {
        s.iter().all(|&(reachable, serving)| reachable && serving)
    });
    // The ranker: user requests of 2 models' Fetches at a fixed rate, for
    // 9 s; the kill comes at 3 s.
    let mut worker_config = String::from(
        "transport = \"tcp\"\nnum_shards = 2\nrequest_timeout_ms = 1000\n\
         [workload]\ntable = \"emb\"\nduration_secs = 9.0\nconcurrency = 8\nmodels = 2\n\
         rate_per_sec = 100.0\nresponse_bytes_min = 1024\nresponse_bytes_max = 65536\n",
    );
    for (g, s) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
        worker_config += &format!(
            "[[servers]]\naddress = \"{}\"\nshards = [{s}]\nreplica_group = {g}\n",
            address(g, s)
        );
    }
    let worker_path = dir.path().join("worker.toml");
    std::fs::write(&worker_path, worker_config).unwrap();
    let report_path = dir.path().join("ranker.json");
    let ranker = cluster
        .command(5, common::binary("worker"))
        .arg("--config")
        .arg(&worker_path)
        .arg("--json")
        .arg(&report_path)
        .arg("ranker")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut ranker = KillOnDrop(ranker);
    // The drill's schedule: the kill a third of the way in.
    std::thread::sleep(Duration::from_secs(3));
    let victim = &mut servers[0].0;
    victim.kill().unwrap();
    victim.wait().unwrap();
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
