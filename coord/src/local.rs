//! A local etcd process: one member on a loopback port, its log in a
//! directory of the caller's, for a one-host cluster (`tessera up` with
//! `local_etcd`) and for tests. Stopped when dropped.
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
}

/// Starts of a local etcd tried when its port was taken meanwhile.
const START_ATTEMPTS: u32 = 3;

/// A running local etcd (module docs).
#[derive(Debug)]
pub struct LocalEtcd {
    endpoint: String,
    log: PathBuf,
    child: Child,
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

fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

impl LocalEtcd {
    /// Starts `bin` with its data and log under `dir`, and waits (at most
    /// `timeout`) until it answers.
    ///
    /// The kernel kills it when the *thread* that called this ends (that is
    /// what a parent-death signal follows): call it from a thread that
    /// lives as long as the etcd should, such as the main thread or a
    /// runtime's worker, never from a pool thread that exits when idle
    /// (`spawn_blocking`).
    pub fn start(bin: &Path, dir: &Path, timeout: Duration) -> Result<Self, LocalEtcdError> {
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
            match Self::start_once(bin, dir, timeout) {
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

    fn start_once(bin: &Path, dir: &Path, timeout: Duration) -> Result<Self, LocalEtcdError> {
        let (client, peer) = (free_port()?, free_port()?);
        let endpoint = format!("127.0.0.1:{client}");
        let log = dir.join("etcd.log");
        let memory = MemoryDir::create();
        let data = match &memory {
            Some(memory) => memory.0.join("data"),
            None => dir.join("data"),
        };
        let mut command = match setpriv() {
            Some(setpriv) => {
                let mut command = Command::new(setpriv);
                command.args(["--pdeathsig", "KILL", "--"]).arg(bin);
                command
            }
            None => Command::new(bin),
        };
        let child = command
            .args(["--name", "tessera", "--data-dir"])
            .arg(data)
            .arg(format!("--listen-client-urls=http://{endpoint}"))
            .arg(format!("--advertise-client-urls=http://{endpoint}"))
            .arg(format!("--listen-peer-urls=http://127.0.0.1:{peer}"))
            .arg(format!(
                "--initial-advertise-peer-urls=http://127.0.0.1:{peer}"
            ))
            .arg(format!("--initial-cluster=tessera=http://127.0.0.1:{peer}"))
            // One member on loopback: short Raft timings (so leases may be
            // as short as a second).
            .args(["--heartbeat-interval=50", "--election-timeout=500"])
            .args(["--logger=zap", "--log-level=warn"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()?;
        let mut etcd = Self {
            endpoint,
            log,
            child,
            _memory: memory,
        };
        etcd.wait_ready(timeout)?;
        Ok(etcd)
    }

    /// Its client endpoint (`127.0.0.1:<port>`).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    fn healthy(&self) -> bool {
        let Ok(mut stream) = std::net::TcpStream::connect(&self.endpoint) else {
            return false;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
        let request = format!("GET /health HTTP/1.0\r\nHost: {}\r\n\r\n", self.endpoint);
        let mut answer = String::new();
        stream.write_all(request.as_bytes()).is_ok()
            && stream.read_to_string(&mut answer).is_ok()
            && answer.contains("\"health\":\"true\"")
    }

    fn wait_ready(&mut self, timeout: Duration) -> Result<(), LocalEtcdError> {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Err(LocalEtcdError::Exited {
                    status: status.to_string(),
                    log: self.log.clone(),
                });
            }
            if self.healthy() {
                return Ok(());
            }
            if started.elapsed() >= timeout {
                return Err(LocalEtcdError::Unhealthy(timeout));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for LocalEtcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
