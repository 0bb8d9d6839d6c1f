//! A multi-host test cluster on one machine: hosts are network namespaces
//! joined by veth pairs through a bridge (`deploy/netns/cluster.sh`, which
//! the operator can also run by hand). Each host has its own address, so
//! link faults (down/up, a rate limit) hit one host's traffic only.
//!
//! [`NetCluster::create`] says why it cannot build one (not root, no
//! `ip netns`) instead of failing: a test prints that reason and skips.
//! Dropping the cluster removes every namespace, killing what still runs in
//! them, also after a failed test.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

/// Clusters made by this process (their names differ).
static MADE: AtomicU32 = AtomicU32::new(0);

/// The niceness of every program run on a cluster's host (see
/// [`NetCluster::prefix`]); a cluster needs root, which may lower it.
pub const HOST_NICENESS: i32 = -10;

/// Hosts as network namespaces behind one switch.
#[derive(Debug)]
pub struct NetCluster {
    name: String,
    hosts: usize,
}

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/netns/cluster.sh")
}

fn run(args: &[&str]) -> Result<(), String> {
    let output = Command::new(script())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|err| format!("cluster.sh: {err}"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "cluster.sh {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

impl NetCluster {
    /// Builds `hosts` hosts (1-based: host 1 is `10.77.0.1`), or says why
    /// it cannot.
    pub fn create(hosts: usize) -> Result<Self, String> {
        // The whole pid: two test processes never share a name (a shared
        // one would let either remove the other's namespaces).
        let name = format!(
            "ts{}x{}",
            std::process::id(),
            MADE.fetch_add(1, Ordering::Relaxed)
        );
        let cluster = Self { name, hosts };
        if let Err(err) = run(&["up", &cluster.name, &hosts.to_string()]) {
            // What `up` made before it failed goes (it is ours: the name is
            // this process's).
            drop(cluster);
            return Err(err);
        }
        Ok(cluster)
    }

    /// Host `host`'s address.
    pub fn addr(&self, host: usize) -> String {
        assert!((1..=self.hosts).contains(&host), "no host {host}");
        format!("10.77.0.{host}")
    }

    /// The command that runs a program on host `host` (its network
    /// namespace): the program and its arguments follow.
    ///
    /// The program runs at niceness [`HOST_NICENESS`], above whatever else
    /// this machine runs: a cluster's servers and clients stand for the
    /// hosts' main workload, whose drills bound calls at tens of
    /// milliseconds, and on this 2-core machine two CPU hogs at the same
    /// priority (the suite is also run under them) took those
    /// milliseconds from them, which measured the machine, not failover.
    pub fn prefix(&self, host: usize) -> Vec<String> {
        assert!((1..=self.hosts).contains(&host), "no host {host}");
        vec![
            "nice".into(),
            "-n".into(),
            HOST_NICENESS.to_string(),
            "ip".into(),
            "netns".into(),
            "exec".into(),
            format!("{}-h{host}", self.name),
        ]
    }

    /// `program` to run on host `host`.
    pub fn command(&self, host: usize, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let prefix = self.prefix(host);
        let mut command = Command::new(&prefix[0]);
        command.args(&prefix[1..]).arg(program);
        command
    }

    /// A cluster of `hosts` hosts, or `None` after printing why there can
    /// be none here (the caller skips).
    pub fn create_or_skip(hosts: usize) -> Option<Self> {
        match Self::create(hosts) {
            Ok(cluster) => Some(cluster),
            Err(why) => {
                eprintln!("SKIP: no network namespaces here, so no multi-host drill: {why}");
                None
            }
        }
    }

    /// Runs `f` on a thread of its own inside host `host`'s network
    /// namespace, and returns what it returns: every socket `f` opens, and
    /// every thread it starts (a tokio runtime's workers, built inside
    /// `f`), is on that host. So a test's own client, proxy or trainer
    /// runs on a host of the cluster without a process of its own. The
    /// rest of the test process stays where it was (a network namespace
    /// belongs to a thread, and `setns` changes only the caller's).
    pub fn run_on<T: Send>(&self, host: usize, f: impl FnOnce() -> T + Send) -> T {
        let path = format!("/var/run/netns/{}-h{host}", self.name);
        assert!((1..=self.hosts).contains(&host), "no host {host}");
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    let ns = std::fs::File::open(&path)
                        .unwrap_or_else(|err| panic!("opening {path}: {err}"));
                    nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)
                        .unwrap_or_else(|err| panic!("entering {path}: {err}"));
                    f()
                })
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })
    }

    /// Takes host `host`'s link down (`false`) or up (`true`).
    pub fn set_link(&self, host: usize, up: bool) {
        run(&[
            "link",
            &self.name,
            &host.to_string(),
            if up { "up" } else { "down" },
        ])
        .unwrap_or_else(|err| panic!("{err}"));
    }

    /// Limits host `host`'s link to `rate` both ways (`tc tbf`, e.g.
    /// `"10mbit"`; `"off"` lifts it).
    pub fn set_rate(&self, host: usize, rate: &str) {
        run(&["rate", &self.name, &host.to_string(), rate]).unwrap_or_else(|err| panic!("{err}"));
    }
}

impl Drop for NetCluster {
    fn drop(&mut self) {
        if let Err(err) = run(&["down", &self.name]) {
            eprintln!("removing the test cluster {}: {err}", self.name);
        }
    }
}
