//! A local etcd for a test: its own data directory and loopback ports,
//! stopped when dropped.
//!
//! The test command installs Debian's `etcd-server` package when `etcd`
//! is missing; a test that needs etcd and finds none fails, with that
//! advice, rather than skip the coordinated path silently.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running etcd.
pub struct Etcd {
    /// Its client endpoint (`127.0.0.1:<port>`).
    pub endpoint: String,
    child: Child,
    _dir: tempfile::TempDir,
}

/// The etcd binary: `TESSERA_ETCD_BIN`, else `etcd` on `PATH`, else
/// `/usr/bin/etcd`.
pub fn etcd_bin() -> PathBuf {
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

impl Etcd {
    /// Starts one and waits until it answers (at most 20 s).
    pub fn start() -> Self {
        let bin = etcd_bin();
        assert!(
            bin.is_file(),
            "etcd not found at {}: `scripts/dev setup` installs Debian's etcd-server (or set TESSERA_ETCD_BIN)",
            bin.display()
        );
        let dir = tempfile::tempdir().unwrap();
        let (client, peer) = (crate::free_port(), crate::free_port());
        let endpoint = format!("127.0.0.1:{client}");
        let log = std::fs::File::create(dir.path().join("etcd.log")).unwrap();
        let child = Command::new(&bin)
            .args(["--name", "test", "--data-dir"])
            .arg(dir.path().join("data"))
            .arg(format!("--listen-client-urls=http://{endpoint}"))
            .arg(format!("--advertise-client-urls=http://{endpoint}"))
            .arg(format!("--listen-peer-urls=http://127.0.0.1:{peer}"))
            .arg(format!(
                "--initial-advertise-peer-urls=http://127.0.0.1:{peer}"
            ))
            .arg(format!("--initial-cluster=test=http://127.0.0.1:{peer}"))
            // A single member on loopback: short Raft timings (leases may
            // then be as short as a second).
            .args(["--heartbeat-interval=50", "--election-timeout=500"])
            .args(["--logger=zap", "--log-level=warn"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let mut etcd = Self {
            endpoint,
            child,
            _dir: dir,
        };
        etcd.wait_ready(Duration::from_secs(20));
        etcd
    }

    fn wait_ready(&mut self, timeout: Duration) {
        use std::io::{Read, Write};
        let started = Instant::now();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("etcd exited at start: {status}");
            }
            if let Ok(mut stream) = std::net::TcpStream::connect(&self.endpoint) {
                let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
                let request = format!("GET /health HTTP/1.0\r\nHost: {}\r\n\r\n", self.endpoint);
                let mut answer = String::new();
                if stream.write_all(request.as_bytes()).is_ok()
                    && stream.read_to_string(&mut answer).is_ok()
                    && answer.contains("\"health\":\"true\"")
                {
                    return;
                }
            }
            assert!(
                started.elapsed() < timeout,
                "etcd not healthy after {timeout:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
