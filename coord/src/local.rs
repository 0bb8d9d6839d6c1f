//! A local etcd: one member (or three, five, seven) on loopback ports,
//! its logs in a directory of the caller's, for a one-host cluster
//! (`tessera up` with `local_etcd`) and for tests; members can be killed
//! and restarted, and the leader found, for drills. Stopped when dropped.
//! (etcd itself, rather than an in-process fake: the coordinator's
//! leases, transactions and watches are what the drills exercise.)
//!
//! Its data lives in memory (a directory under `/dev/shm`, removed with
//! it) where the host has that tmpfs, else in the caller's directory: a
//! one-host cluster's coordinator needs no durability beyond its own
//! life, and etcd's fsyncs behind a disk busy writing back a build's
//! gigabytes could hold up its Raft writes for seconds, past the drills'
//! 2 s leases (two failover drills of a clean-clone CI run saw a new
//! primary lose its lease that way, it seems; never on a warm disk).
//!
//! It dies with the process that started it, even one killed with
//! SIGKILL (no destructor runs then): it is started through util-linux's
//! `setpriv --pdeathsig KILL` (on every Debian host: util-linux is
//! essential), which asks the kernel to kill it when its parent goes,
//! rather than code of ours running in the child between fork and exec.
//! Where `setpriv` is missing it is started directly and only `Drop`
//! stops it. The data a killed parent left under `/dev/shm` is removed by
//! the next local etcd started on the host.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Why a local etcd could not be started.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LocalEtcdError {
    /// No etcd binary where it was looked for.
    #[error(
        "etcd not found at {0}: install it (Debian: `apt-get install etcd-server`; `scripts/dev setup` does) or name it with etcd_bin / TESSERA_ETCD_BIN"
    )]
    NotFound(PathBuf),
    /// Starting it, or its directory, failed.
    #[error("starting etcd: {0}")]
    Io(#[from] std::io::Error),
    /// It exited while starting.
    #[error("etcd exited while starting ({status}); see {log}")]
    Exited {
        /// Its exit status.
        status: String,
        /// Its log.
        log: PathBuf,
    },
    /// It did not answer its health check in time.
    #[error("etcd not healthy after {0:?}")]
    Unhealthy(Duration),
    /// A member count Raft cannot use well.
    #[error("a local etcd has an odd number of members from 1 to 7, not {0}")]
    Members(usize),
    /// No member of that index.
    #[error("the local etcd has no member {0}")]
    NoMember(usize),
}

/// Starts of a local etcd tried when its port was taken meanwhile.
const START_ATTEMPTS: u32 = 3;

/// A running local etcd (module docs).
#[derive(Debug)]
pub struct LocalEtcd {
    bin: PathBuf,
    members: Vec<Member>,
    /// The members' client endpoints, by index.
    endpoints: Vec<String>,
    /// `--initial-cluster`: every member's name and peer URL.
    initial_cluster: String,
    /// Its data directory in memory, removed when it goes (after the
    /// child: fields drop in order, and `Drop` stops the child first).
    _memory: Option<MemoryDir>,
}

/// A directory under `/dev/shm`, removed when dropped.
#[derive(Debug)]
struct MemoryDir(PathBuf);

impl MemoryDir {
    /// A fresh one, where the host has `/dev/shm`.
    fn create() -> Option<Self> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let shm = Path::new("/dev/shm");
        if !shm.is_dir() {
            return None;
        }
        remove_orphans(shm);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = shm.join(format!("tessera-etcd-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).ok()?;
        Some(Self(dir))
    }
}

/// Removes the memory directories of processes that are gone (named
/// `tessera-etcd-PID-N`; a parent killed with SIGKILL could not remove
/// its own).
fn remove_orphans(shm: &Path) {
    let Ok(entries) = std::fs::read_dir(shm) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("tessera-etcd-"))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            tracing::info!(dir = %entry.path().display(), "removing the data of a local etcd whose parent is gone");
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// `setpriv`, where the host has it (module docs).
fn setpriv() -> Option<PathBuf> {
    ["/usr/bin/setpriv", "/bin/setpriv"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
}

impl Drop for MemoryDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The etcd binary: `explicit`, else `TESSERA_ETCD_BIN`, else `etcd` on
/// `PATH`, else `/usr/bin/etcd`.
pub fn etcd_bin(explicit: Option<&Path>) -> PathBuf {
    if let Some(path) = explicit {
        return path.to_owned();
    }
    if let Some(path) = std::env::var_os("TESSERA_ETCD_BIN") {
        return PathBuf::from(path);
    }
    if let Some(paths) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&paths) {
            let candidate = dir.join("etcd");
            if candidate.is_file() {
                return candidate;
            }
        }
    }
    PathBuf::from("/usr/bin/etcd")
}

fn free_port(host: &str) -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind((host, 0))?.local_addr()?.port())
}

impl LocalEtcd {
    /// Starts `bin`, one member, with its data and log under `dir`, and
    /// waits (at most `timeout`) until it answers.
    ///
    /// The kernel kills it when the *thread* that called this ends (that is
    /// what a parent-death signal follows): call it from a thread that
    /// lives as long as the etcd should, such as the main thread or a
    /// runtime's worker, never from a pool thread that exits when idle
    /// (`spawn_blocking`).
    pub fn start(bin: &Path, dir: &Path, timeout: Duration) -> Result<Self, LocalEtcdError> {
        Self::start_members(bin, dir, 1, timeout)
    }

    /// Starts `members` members of one etcd cluster (an odd number from 1
    /// to 7: Raft's majority), each on loopback ports of its own with its
    /// log `etcd-N.log` under `dir` (`etcd.log` for one member), and waits
    /// (at most `timeout`) until every one answers. Three members let a
    /// one-host cluster (and the fault soak) lose any one of them, its
    /// leader included. Same thread caveat as [`LocalEtcd::start`].
    pub fn start_members(
        bin: &Path,
        dir: &Path,
        members: usize,
        timeout: Duration,
    ) -> Result<Self, LocalEtcdError> {
        Self::start_members_on(bin, dir, members, "127.0.0.1", timeout)
    }

    /// [`LocalEtcd::start_members`] on `host`'s ports instead of
    /// loopback's (an address of this host, in this thread's network
    /// namespace): for servers on other hosts, such as network namespaces
    /// of a multi-host test cluster, that reach it there.
    pub fn start_members_on(
        bin: &Path,
        dir: &Path,
        members: usize,
        host: &str,
        timeout: Duration,
    ) -> Result<Self, LocalEtcdError> {
        if !(1..=7).contains(&members) || members.is_multiple_of(2) {
            return Err(LocalEtcdError::Members(members));
        }
        if !bin.is_file() {
            return Err(LocalEtcdError::NotFound(bin.to_owned()));
        }
        std::fs::create_dir_all(dir)?;
        // Its ports are found free and then bound by etcd, so another
        // process may take one in between: etcd then exits at once
        // ("address already in use"), and a start on fresh ports succeeds.
        let mut attempt = 0;
        loop {
            attempt += 1;
            match Self::start_once(bin, dir, members, host, timeout) {
                Err(LocalEtcdError::Exited { status, log })
                    if attempt < START_ATTEMPTS
                        && std::fs::read_to_string(&log)
                            .is_ok_and(|text| text.contains("address already in use")) =>
                {
                    tracing::warn!(%status, attempt, "etcd's port was taken; starting it on others");
                    let _ = std::fs::remove_dir_all(dir.join("data"));
                }
                outcome => return outcome,
            }
        }
    }

    fn start_once(
        bin: &Path,
        dir: &Path,
        count: usize,
        host: &str,
        timeout: Duration,
    ) -> Result<Self, LocalEtcdError> {
        let memory = MemoryDir::create();
        let data_root = match &memory {
            Some(memory) => memory.0.clone(),
            None => dir.to_owned(),
        };
        let mut members = Vec::with_capacity(count);
        for index in 0..count {
            let (client, peer) = (free_port(host)?, free_port(host)?);
            let (name, log, data) = if count == 1 {
                (
                    "tessera".to_owned(),
                    dir.join("etcd.log"),
                    data_root.join("data"),
                )
            } else {
                (
                    format!("tessera-{index}"),
                    dir.join(format!("etcd-{index}.log")),
                    data_root.join("data").join(index.to_string()),
                )
            };
            members.push(Member {
                name,
                endpoint: format!("{host}:{client}"),
                peer: format!("{host}:{peer}"),
                data,
                log,
                child: None,
            });
        }
        let initial_cluster = members
            .iter()
            .map(|m| format!("{}=http://{}", m.name, m.peer))
            .collect::<Vec<_>>()
            .join(",");
        let mut etcd = Self {
            bin: bin.to_owned(),
            endpoints: members.iter().map(|m| m.endpoint.clone()).collect(),
            members,
            initial_cluster,
            _memory: memory,
        };
        for index in 0..count {
            etcd.spawn(index)?;
        }
        etcd.wait_ready(timeout)?;
        Ok(etcd)
    }

    /// Starts member `index`'s process (its data directory, if any, holds
    /// its state: a restarted member rejoins).
    fn spawn(&mut self, index: usize) -> Result<(), LocalEtcdError> {
        let mut command = match setpriv() {
            Some(setpriv) => {
                let mut command = Command::new(setpriv);
                command.args(["--pdeathsig", "KILL", "--"]).arg(&self.bin);
                command
            }
            None => Command::new(&self.bin),
        };
        let member = &mut self.members[index];
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&member.log)?;
        let child = command
            .args(["--name", &member.name, "--data-dir"])
            .arg(&member.data)
            .arg(format!("--listen-client-urls=http://{}", member.endpoint))
            .arg(format!(
                "--advertise-client-urls=http://{}",
                member.endpoint
            ))
            .arg(format!("--listen-peer-urls=http://{}", member.peer))
            .arg(format!(
                "--initial-advertise-peer-urls=http://{}",
                member.peer
            ))
            .arg(format!("--initial-cluster={}", self.initial_cluster))
            .arg("--initial-cluster-token=tessera-local")
            // Loopback: short Raft timings (so leases may be as short as a
            // second, and a lost leader is replaced within about one).
            .args(["--heartbeat-interval=50", "--election-timeout=500"])
            .args(["--logger=zap", "--log-level=warn"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()?;
        member.child = Some(child);
        Ok(())
    }

    /// Its first member's client endpoint (`host:port`, loopback unless started [`LocalEtcd::start_members_on`] another host).
    pub fn endpoint(&self) -> &str {
        &self.endpoints[0]
    }

    /// Every member's client endpoint, by member index.
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// Kills member `index` with SIGKILL (its data stays, for
    /// [`LocalEtcd::restart_member`]); false if it was not running.
    pub fn kill_member(&mut self, index: usize) -> bool {
        let Some(mut child) = self.members.get_mut(index).and_then(|m| m.child.take()) else {
            return false;
        };
        let _ = child.kill();
        let _ = child.wait();
        true
    }

    /// Starts a killed member again on its ports with its data (it
    /// rejoins the cluster); does nothing if it runs. Same thread caveat
    /// as [`LocalEtcd::start`].
    pub fn restart_member(&mut self, index: usize) -> Result<(), LocalEtcdError> {
        match self.members.get(index) {
            None => Err(LocalEtcdError::NoMember(index)),
            Some(member) if member.child.is_some() => Ok(()),
            Some(_) => self.spawn(index),
        }
    }

    /// The index of the member that leads now, as the running members
    /// report it (`None` while there is no leader, or none answers).
    pub fn leader(&self) -> Option<usize> {
        self.members
            .iter()
            .filter(|m| m.child.is_some())
            .find_map(|m| {
                let status = status(&m.endpoint)?;
                (status.leader != 0 && status.leader == status.member).then_some(())?;
                self.members.iter().position(|x| x.endpoint == m.endpoint)
            })
    }

    fn wait_ready(&mut self, timeout: Duration) -> Result<(), LocalEtcdError> {
        let started = Instant::now();
        loop {
            let mut ready = true;
            for member in &mut self.members {
                if let Some(child) = member.child.as_mut()
                    && let Some(status) = child.try_wait()?
                {
                    return Err(LocalEtcdError::Exited {
                        status: status.to_string(),
                        log: member.log.clone(),
                    });
                }
                ready &= healthy(&member.endpoint);
            }
            if ready {
                return Ok(());
            }
            if started.elapsed() >= timeout {
                return Err(LocalEtcdError::Unhealthy(timeout));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// One member of a [`LocalEtcd`].
#[derive(Debug)]
struct Member {
    name: String,
    /// Its client endpoint.
    endpoint: String,
    /// Its peer address (`host:port`).
    peer: String,
    data: PathBuf,
    log: PathBuf,
    /// `None` while killed.
    child: Option<Child>,
}

/// One HTTP/1.0 exchange with a member's JSON gateway: the answer's body
/// (bounded by a one-second read timeout).
fn http(endpoint: &str, request: &str) -> Option<String> {
    let mut stream = std::net::TcpStream::connect(endpoint).ok()?;
    let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
    stream.write_all(request.as_bytes()).ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    answer
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
}

fn healthy(endpoint: &str) -> bool {
    let request = format!("GET /health HTTP/1.0\r\nHost: {endpoint}\r\n\r\n");
    http(endpoint, &request).is_some_and(|body| body.contains("\"health\":\"true\""))
}

/// A member's view of who leads: its own id and the leader's (etcd's
/// JSON gateway writes 64-bit ids as strings).
struct Status {
    member: u64,
    leader: u64,
}

fn status(endpoint: &str) -> Option<Status> {
    let body = "{}";
    let request = format!(
        "POST /v3/maintenance/status HTTP/1.0\r\nHost: {endpoint}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let answer: serde_json::Value = serde_json::from_str(&http(endpoint, &request)?).ok()?;
    let id = |v: &serde_json::Value| v.as_str().and_then(|s| s.parse::<u64>().ok());
    Some(Status {
        member: id(&answer["header"]["member_id"])?,
        leader: id(&answer["leader"])?,
    })
}

impl Drop for LocalEtcd {
    fn drop(&mut self) {
        for index in 0..self.members.len() {
            self.kill_member(index);
        }
    }
}
