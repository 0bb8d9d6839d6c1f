//! The `tessera` launcher as a user runs it: `up` starts and stops a 2x2
//! cluster of real ps-server processes (and `status` reports it); `demo`
//! prints its table.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stderr,
    missing_docs
)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use tessera_proto::sharding::shard_for_key;
use tessera_test_support::wait::{Waiting, eventually_blocking};
use tessera_worker::{PsClient, WorkerConfig};

mod common;
// The launcher's servers follow it when it is killed (`--parent-pid`).
use common::KillOnDrop;

/// The ps-server binary of this build (built when missing; see
/// `tessera_test_support::process::ps_server_bin`).
fn ps_server_bin() -> PathBuf {
    tessera_test_support::process::ps_server_bin()
}

fn wait_for_file(path: &Path, child: &mut std::process::Child, timeout: Duration) {
    eventually_blocking(timeout, "the cluster up", || {
        if path.is_file() {
            return Ok(());
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("launcher exited early: {status}");
        }
        Err(format!("no {} yet", path.display()))
    });
}

#[test]
fn up_starts_and_stops_a_2x2_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let config = dir.path().join("cluster.toml");
    std::fs::write(
        &config,
        "num_shards = 2\nreplica_groups = 2\n[[tables]]\nname = \"emb\"\ndim = 4\n",
    )
    .unwrap();
    let launcher = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["up", "--config"])
        .arg(&config)
        .arg("--run-dir")
        .arg(&run_dir)
        .env("TESSERA_PS_SERVER_BIN", ps_server_bin())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut launcher = KillOnDrop(launcher);
    wait_for_file(
        &run_dir.join("worker.toml"),
        &mut launcher.0,
        Duration::from_secs(60),
    );

    let worker = WorkerConfig::load(&run_dir.join("worker.toml")).unwrap();
    assert_eq!(worker.num_shards, 2);
    assert_eq!(worker.servers.len(), 4);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let client = PsClient::new(&worker).unwrap();
        let health = client.health().await;
        assert_eq!(health.len(), 4);
        let mut layout: Vec<(u32, Vec<u32>)> = health
            .into_iter()
            .map(|(addr, h)| {
                let h = h.unwrap_or_else(|e| panic!("{addr}: {e}"));
                assert!(h.serving);
                (h.replica_group, h.shards)
            })
            .collect();
        layout.sort();
        assert_eq!(
            layout,
            vec![(0, vec![0]), (0, vec![1]), (1, vec![0]), (1, vec![1])]
        );
        let keys: Vec<u64> = (0..100).collect();
        assert!(keys.iter().any(|&k| shard_for_key(k, 2) == 1));
        let rows = client.fetch("emb", &keys).await.unwrap();
        assert_eq!((rows.len(), rows.dim()), (100, 4));
    });

    // `tessera status RUN_DIR`: every server, serving, each shard with one
    // primary; exit 0.
    let status = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["status", "--json"])
        .arg(&run_dir)
        .output()
        .unwrap();
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    let rows: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 4);
    let mut primaries: Vec<u64> = Vec::new();
    for row in rows {
        assert_eq!(row["reachable"], true, "{row}");
        assert_eq!(row["serving"], true, "{row}");
        assert_eq!(row["state"], "SERVING", "{row}");
        assert_eq!(row["transport"], "tcp", "{row}");
        primaries.extend(
            row["primary_of"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap()),
        );
    }
    primaries.sort_unstable();
    assert_eq!(primaries, [0, 1], "each shard has one primary");
    let table = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .arg("status")
        .arg(&run_dir)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(table.status.success());
    assert_eq!(text.matches("| SERVING |").count(), 4, "{text}");
    assert!(text.contains("replicas in step"), "{text}");
    // A server that does not answer is a row, and the exit code says so.
    let dead = tessera_test_support::free_addr();
    let partial = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .arg("status")
        .arg(&worker.servers[0].address)
        .arg(&dead)
        .output()
        .unwrap();
    assert!(!partial.status.success());
    let text = String::from_utf8_lossy(&partial.stdout);
    assert!(text.contains(&format!("| {dead} | UNREACHABLE")), "{text}");
    assert_eq!(text.matches("| SERVING |").count(), 1, "{text}");

    let status = Command::new("kill")
        .args(["-INT", &launcher.0.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exit = eventually_blocking(Duration::from_secs(30), "the launcher stopping", || {
        launcher.0.try_wait().unwrap().ok_or("still running")
    });
    assert!(exit.success(), "{exit}");
    for server in &worker.servers {
        assert!(
            std::net::TcpStream::connect(&server.address).is_err(),
            "{} still accepts connections",
            server.address
        );
    }
}

#[test]
fn demo_prints_its_table_and_exits_zero() {
    let output = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["demo", "--duration-secs", "1"])
        .env("TESSERA_PS_SERVER_BIN", ps_server_bin())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    for needle in [
        "| trainer  | fetch",
        "| trainer  | push",
        "| ranker   | fetch",
        "demo finished",
    ] {
        assert!(stdout.contains(needle), "missing {needle:?} in:\n{stdout}");
    }
}

#[test]
fn up_refuses_a_bad_config_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("cluster.toml");
    std::fs::write(&config, "replica_groups = 0\n").unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["up", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("replica_groups"), "{stderr}");
}

/// `tessera admin` against a running ps-server: health, a checkpoint on
/// demand, per-shard stats.
#[test]
fn admin_calls_report_health_stats_and_save_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let mut server = Command::new(ps_server_bin())
        .args(["--listen", &addr, "--checkpoint-dir"])
        .arg(dir.path())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let tessera = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
            .arg("admin")
            .args(args)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let health = eventually_blocking(
        Duration::from_secs(30),
        "the server up (`tessera admin health` answering)",
        || {
            let (ok, stdout, stderr) = tessera(&["health", &addr]);
            if ok { Ok(stdout) } else { Err(stderr) }
        },
    );
    assert!(health.contains("SERVER_STATE_SERVING"), "{health}");
    assert!(health.contains("table embeddings: dim 16"), "{health}");
    // One server alone: the primary of its shard, at its first epoch.
    assert!(health.contains("| 0 | PRIMARY | 1 | 0:0 | "), "{health}");
    let (ok, saved, err) = tessera(&["checkpoint", &addr]);
    assert!(ok, "{err}");
    assert!(
        saved.contains("checkpoint ") && saved.contains("ckpt-"),
        "{saved}"
    );
    assert!(dir.path().join("LATEST").exists());
    let (ok, stats, err) = tessera(&["stats", &addr]);
    assert!(ok, "{err}");
    assert!(stats.contains("| embeddings | 0 |"), "{stats}");
    // A worker address that does not answer: a clear error, exit non-zero.
    let (ok, _, err) = tessera(&["quarantine", "127.0.0.1:1"]);
    assert!(!ok && err.contains("127.0.0.1:1"), "{err}");
    let _ = server.kill();
    let _ = server.wait();
}

/// Pids of the processes whose command line mentions `path` (the run
/// directory every server's `--config` is in).
fn processes_mentioning(path: &Path) -> Vec<i32> {
    let needle = path.to_string_lossy().into_owned();
    processes_where(|cmdline| cmdline.contains("ps-server") && cmdline.contains(&needle))
}

/// Pids of the processes whose command line (arguments joined by spaces)
/// satisfies `wanted`.
fn processes_where(wanted: impl Fn(&str) -> bool) -> Vec<i32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        if wanted(&String::from_utf8_lossy(&cmdline).replace('\0', " ")) {
            found.push(pid);
        }
    }
    found
}

/// Waits until no process mentions `path`, at most `timeout`.
fn wait_until_gone(path: &Path, timeout: Duration) {
    eventually_blocking(timeout, "every server stopped", || {
        let left = processes_mentioning(path);
        if left.is_empty() { Ok(()) } else { Err(left) }
    });
}

fn wait_exit(child: &mut std::process::Child, timeout: Duration) -> std::process::ExitStatus {
    eventually_blocking(timeout, "the launcher exiting", || {
        child.try_wait().unwrap().ok_or("still running")
    })
}

fn signal(child: &std::process::Child, signal: &str) {
    let status = Command::new("kill")
        .args([signal, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

/// 64 servers on ports the launcher picks: every one distinct (probing
/// one port at a time and releasing it let two servers get the same one,
/// 1 launch in 5 of this size failed), all serving.
#[test]
fn sixty_four_servers_start_on_distinct_ports() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let config = dir.path().join("cluster.toml");
    std::fs::write(
        &config,
        "num_shards = 32\nreplica_groups = 2\n[[tables]]\nname = \"emb\"\ndim = 4\n",
    )
    .unwrap();
    let mut launcher = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["up", "--config"])
        .arg(&config)
        .arg("--run-dir")
        .arg(&run_dir)
        .env("TESSERA_PS_SERVER_BIN", ps_server_bin())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_file(
        &run_dir.join("worker.toml"),
        &mut launcher,
        Duration::from_secs(90),
    );
    let worker = WorkerConfig::load(&run_dir.join("worker.toml")).unwrap();
    let mut addresses: Vec<&str> = worker.servers.iter().map(|s| s.address.as_str()).collect();
    addresses.sort_unstable();
    addresses.dedup();
    assert_eq!(addresses.len(), 64, "distinct addresses");
    assert_eq!(processes_mentioning(&run_dir).len(), 64);
    signal(&launcher, "-TERM");
    let exit = wait_exit(&mut launcher, Duration::from_secs(60));
    assert!(exit.success(), "{exit}");
    wait_until_gone(&run_dir, Duration::from_secs(10));
}

/// A SIGTERM while the servers start: the launcher stops them and removes
/// its temporary run directory (before, the signal killed it at once and
/// left them running).
#[test]
fn a_signal_during_start_up_stops_every_server_and_removes_the_run_dir() {
    let tmp = tempfile::tempdir().unwrap();
    let config = tmp.path().join("cluster.toml");
    std::fs::write(
        &config,
        "num_shards = 8\nreplica_groups = 2\n[[tables]]\nname = \"emb\"\ndim = 4\n",
    )
    .unwrap();
    let temp_root = tmp.path().join("tmp");
    std::fs::create_dir(&temp_root).unwrap();
    // Servers that take 3 s to start: the signal surely comes during the
    // start.
    let slow = tmp.path().join("slow-ps-server");
    std::fs::write(
        &slow,
        format!(
            "#!/bin/sh\nsleep 3\nexec {} \"$@\"\n",
            ps_server_bin().display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&slow, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let mut launcher = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["up", "--config"])
        .arg(&config)
        .env("TESSERA_PS_SERVER_BIN", &slow)
        .env("TMPDIR", &temp_root)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    // As soon as the first server runs.
    eventually_blocking(Duration::from_secs(60), "a first server started", || {
        if !processes_mentioning(&temp_root).is_empty() {
            return Ok(());
        }
        assert!(launcher.try_wait().unwrap().is_none(), "launcher exited");
        Err("no server process yet")
    });
    signal(&launcher, "-TERM");
    let exit = wait_exit(&mut launcher, Duration::from_secs(30));
    assert!(!exit.success(), "an interrupted start is a failure: {exit}");
    wait_until_gone(&temp_root, Duration::from_secs(10));
    let left: Vec<_> = std::fs::read_dir(&temp_root).unwrap().flatten().collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// A launcher killed with SIGKILL (no handler runs): its servers stop by
/// themselves (`--parent-pid`, PR_SET_PDEATHSIG).
#[test]
fn servers_stop_when_their_launcher_is_killed() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let config = dir.path().join("cluster.toml");
    std::fs::write(
        &config,
        "num_shards = 2\nreplica_groups = 2\n[[tables]]\nname = \"emb\"\ndim = 4\n",
    )
    .unwrap();
    let mut launcher = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["up", "--config"])
        .arg(&config)
        .arg("--run-dir")
        .arg(&run_dir)
        .env("TESSERA_PS_SERVER_BIN", ps_server_bin())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_file(
        &run_dir.join("worker.toml"),
        &mut launcher,
        Duration::from_secs(60),
    );
    assert_eq!(processes_mentioning(&run_dir).len(), 4);
    launcher.kill().unwrap();
    launcher.wait().unwrap();
    wait_until_gone(&run_dir, Duration::from_secs(15));
}

/// Pids of the processes whose command line contains `needle`.
fn processes_with(needle: &str) -> Vec<i32> {
    processes_where(|cmdline| cmdline.contains(needle))
}

/// Issue 33: the launcher's local etcd outlived a SIGKILLed launcher (its
/// servers stopped, the etcd ran on with its data in /dev/shm). Now it
/// stops with its launcher too, and the next launcher removes the data a
/// killed one left.
#[test]
fn the_local_etcd_stops_when_its_launcher_is_killed() {
    if !Path::new(&tessera_coord::etcd_bin(None)).is_file() {
        eprintln!("SKIPPED the_local_etcd_stops_when_its_launcher_is_killed: no etcd binary");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let config = dir.path().join("cluster.toml");
    std::fs::write(
        &config,
        "num_shards = 1\nreplica_groups = 2\nlocal_etcd = true\n\
         [coordinator]\nkind = \"etcd\"\n[[tables]]\nname = \"emb\"\ndim = 4\n",
    )
    .unwrap();
    let mut launcher = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["up", "--config"])
        .arg(&config)
        .arg("--run-dir")
        .arg(&run_dir)
        .env("TESSERA_PS_SERVER_BIN", ps_server_bin())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_file(
        &run_dir.join("worker.toml"),
        &mut launcher,
        Duration::from_secs(60),
    );
    // The etcd's data directory is named after its launcher's pid.
    let marker = format!("tessera-etcd-{}-", launcher.id());
    let etcd = processes_with(&marker);
    assert_eq!(etcd.len(), 1, "one local etcd: {etcd:?}");
    let data: Vec<_> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&marker))
        .map(|e| e.path())
        .collect();
    launcher.kill().unwrap();
    launcher.wait().unwrap();
    wait_until_gone(&run_dir, Duration::from_secs(15));
    eventually_blocking(
        Duration::from_secs(15),
        &format!("the local etcd {etcd:?} stopped with its launcher"),
        || {
            let left = processes_with(&marker);
            if left.is_empty() { Ok(()) } else { Err(left) }
        },
    );
    // The next local etcd started on this host removes the data the killed
    // launcher's left behind.
    let next = tessera_coord::LocalEtcd::start(
        &tessera_coord::etcd_bin(None),
        &dir.path().join("next-etcd"),
        Duration::from_secs(20),
    )
    .unwrap();
    for path in &data {
        assert!(!path.exists(), "{} left behind", path.display());
    }
    drop(next);
}

/// A SIGTERM in the middle of `tessera demo`: the cluster is stopped and
/// the temporary directory removed.
#[test]
fn a_signal_during_the_demo_stops_its_cluster() {
    use std::io::BufRead;
    let tmp = tempfile::tempdir().unwrap();
    let temp_root = tmp.path().join("tmp");
    std::fs::create_dir(&temp_root).unwrap();
    let mut demo = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["demo", "--duration-secs", "30", "--transports", "tcp"])
        .env("TESSERA_PS_SERVER_BIN", ps_server_bin())
        .env("TMPDIR", &temp_root)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = demo.stdout.take().unwrap();
    let mut lines = std::io::BufReader::new(stdout).lines();
    loop {
        let line = lines
            .next()
            .expect("the demo printed nothing about running")
            .unwrap();
        if line.starts_with("running") {
            break;
        }
    }
    assert!(!processes_mentioning(&temp_root).is_empty());
    signal(&demo, "-TERM");
    let exit = wait_exit(&mut demo, Duration::from_secs(30));
    assert!(!exit.success(), "{exit}");
    wait_until_gone(&temp_root, Duration::from_secs(10));
    let left: Vec<_> = std::fs::read_dir(&temp_root).unwrap().flatten().collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// `tessera up` follows its cluster's resizes (etcd mode): planned with
/// `tessera reshard --to 3`, it starts the new shard's servers and the
/// resize runs to done, after which the configurations say 3; shrunk back
/// to 2, it stops the given-away shard's servers once done.
#[test]
fn up_starts_a_growths_new_servers_and_stops_a_shrinks_given_away_ones() {
    if !Path::new(&tessera_coord::etcd_bin(None)).is_file() {
        eprintln!(
            "SKIPPED up_starts_a_growths_new_servers_and_stops_a_shrinks_given_away_ones: no etcd binary"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let config = dir.path().join("cluster.toml");
    std::fs::write(
        &config,
        "num_shards = 2\nreplica_groups = 2\nlocal_etcd = true\n\
         [coordinator]\nkind = \"etcd\"\n[[tables]]\nname = \"emb\"\ndim = 4\n",
    )
    .unwrap();
    let out = dir.path().join("up.out");
    let mut launcher = KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_tessera"))
            .args(["up", "--config"])
            .arg(&config)
            .arg("--run-dir")
            .arg(&run_dir)
            .env("TESSERA_PS_SERVER_BIN", ps_server_bin())
            .stdout(std::fs::File::create(&out).unwrap())
            .spawn()
            .unwrap(),
    );
    wait_for_file(
        &run_dir.join("worker.toml"),
        &mut launcher.0,
        Duration::from_secs(60),
    );
    // `--config RUN_DIR`: the run directory's worker.toml names the
    // local etcd, which listens on a port picked at start.
    let reshard = |args: &[&str]| {
        let output = Command::new(env!("CARGO_BIN_EXE_tessera"))
            .args(["reshard", "--config"])
            .arg(&run_dir)
            .args(args)
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "tessera reshard {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    };
    let wait_done = |to: u32, printed: &str| {
        let mut waiting = Waiting::new(
            Duration::from_secs(90),
            &format!("the resize to {to} done (and followed by the launcher)"),
        );
        loop {
            let map: tessera_coord::ShardMap = serde_json::from_str(&reshard(&["--json"])).unwrap();
            let done = map
                .resize
                .as_ref()
                .is_some_and(|r| r.to == to && r.state == tessera_coord::ResizeState::Done);
            let said = std::fs::read_to_string(&out).unwrap_or_default();
            if done && said.contains(printed) {
                return said;
            }
            waiting.tick_blocking(format_args!("{map:?}\n{said}"));
            // Each look runs `tessera reshard`: keep them about 200 ms
            // apart, as before (the tick waits 20 ms of them).
            std::thread::sleep(Duration::from_millis(180));
        }
    };
    reshard(&["--to", "3"]);
    let said = wait_done(3, "resize to 3 shards done");
    assert!(
        said.contains("started ps-server group 0 shard 2")
            && said.contains("started ps-server group 1 shard 2"),
        "{said}"
    );
    let server_config = std::fs::read_to_string(run_dir.join("ps-g0-s0.toml")).unwrap();
    assert!(server_config.contains("num_shards = 3"), "{server_config}");
    reshard(&["--to", "2"]);
    wait_done(2, "shard 2 is not in the cluster's 2 shards");
    signal(&launcher.0, "-INT");
    let status = wait_exit(&mut launcher.0, Duration::from_secs(60));
    assert!(status.success(), "{status}");
}
