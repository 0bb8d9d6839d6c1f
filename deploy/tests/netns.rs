//! Drills on a multi-host cluster of network namespaces
//! (`tessera_test_support::netns`): real ps-server processes on their own
//! hosts and addresses, and faults of the links between them.
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
