//! A ps-server process: started from a configuration, SIGKILLed,
//! SIGSTOPped, restarted.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tessera_ps_server::PsServerConfig;

/// The ps-server binary of this build. Tests of `tessera-ps-server` pass
/// `env!("CARGO_BIN_EXE_ps-server")`; others find it next to their own
/// test binary's directory (`target/<profile>/`), where `cargo test
/// --workspace` builds it (with the `failpoints` feature the tests turn
/// on), and build it the same way when it is missing (saying so).
pub fn ps_server_bin() -> PathBuf {
    built(
        Path::new("ps-server"),
        &[
            "-p",
            "tessera-ps-server",
            "--bin",
            "ps-server",
            "--features",
            "failpoints",
        ],
    )
}

/// The example `name` of `package` as a user runs it:
/// `target/<profile>/examples/<name>`. `cargo test --all-targets` builds
/// examples as tests (`examples/<name>-<hash>`, a test harness, not the
/// program), so this builds the program with cargo when it is missing
/// (saying so), as a clean checkout's first suite run finds it.
pub fn example_bin(package: &str, name: &str) -> PathBuf {
    built(
        &Path::new("examples").join(name),
        &["-p", package, "--example", name],
    )
}

/// `path` under this build's profile directory (`target/<profile>/`, the
/// parent of the test binary's `deps/`), built with `cargo build ARGS`
/// when it is missing.
fn built(path: &Path, args: &[&str]) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(Path::parent).unwrap().to_owned();
    let path = profile_dir.join(path);
    if !path.is_file() {
        eprintln!("{} missing: building it with cargo", path.display());
        let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .arg("build")
            .args(args)
            .status()
            .unwrap();
        assert!(status.success(), "cargo build {args:?} failed");
    }
    assert!(path.is_file(), "nothing at {}", path.display());
    path
}

/// A running (or stopped) ps-server process.
pub struct PsProcess {
    /// Its address (`listen`).
    pub addr: String,
    /// Its configuration file.
    pub config_path: PathBuf,
    /// Its log (stderr).
    pub log: PathBuf,
    binary: PathBuf,
    env: Vec<(String, String)>,
    /// A command it runs under (`ip netns exec HOST` on a test cluster's
    /// host: [`crate::netns::NetCluster::prefix`]); empty: none.
    prefix: Vec<String>,
    child: Option<Child>,
}

impl PsProcess {
    /// Writes `config` to `<dir>/<name>.toml` and starts `binary` on it.
    pub fn spawn(binary: &Path, config: &PsServerConfig, dir: &Path, name: &str) -> Self {
        Self::spawn_with_env(binary, config, dir, name, &[])
    }

    /// [`PsProcess::spawn`] with extra environment variables (for example
    /// `FAILPOINTS`).
    pub fn spawn_with_env(
        binary: &Path,
        config: &PsServerConfig,
        dir: &Path,
        name: &str,
        env: &[(&str, &str)],
    ) -> Self {
        Self::spawn_under(Vec::new(), binary, config, dir, name, env)
    }

    /// [`PsProcess::spawn_with_env`] under the command `prefix` (a host of
    /// a multi-host test cluster: [`crate::netns::NetCluster::prefix`]).
    pub fn spawn_under(
        prefix: Vec<String>,
        binary: &Path,
        config: &PsServerConfig,
        dir: &Path,
        name: &str,
        env: &[(&str, &str)],
    ) -> Self {
        let config_path = dir.join(format!("{name}.toml"));
        std::fs::write(&config_path, toml::to_string(config).unwrap()).unwrap();
        let mut process = Self {
            addr: config.listen.clone(),
            config_path,
            log: dir.join(format!("{name}.log")),
            binary: binary.to_owned(),
            env: env
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            prefix,
            child: None,
        };
        process.start();
        process
    }

    /// (Re)starts it from its configuration file; its log is appended to.
    pub fn start(&mut self) {
        assert!(self.child.is_none(), "{} is running", self.addr);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let mut command = match self.prefix.split_first() {
            Some((program, args)) => {
                let mut command = Command::new(program);
                command.args(args).arg(&self.binary);
                command
            }
            None => Command::new(&self.binary),
        };
        let child = command
            .arg("--config")
            .arg(&self.config_path)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
    }

    /// Restarts it without the extra environment (a fault injected once).
    pub fn restart_clean(&mut self) {
        self.env.clear();
        self.start();
    }

    /// Its process id, while it runs.
    pub fn pid(&self) -> Option<i32> {
        self.child.as_ref().and_then(|c| i32::try_from(c.id()).ok())
    }

    /// SIGKILLs it and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends it `signal` (SIGTERM, SIGSTOP, SIGCONT).
    pub fn signal(&self, signal: Signal) {
        if let Some(pid) = self.pid() {
            let _ = kill(Pid::from_raw(pid), signal);
        }
    }

    /// SIGSTOPs it and waits until every thread of it is stopped (state
    /// `T` in `/proc/<pid>/task/*/stat`): the signal takes effect
    /// asynchronously, and a request sent before then may still be
    /// answered. Panics if it is not stopped within 10 s.
    pub fn freeze(&self) {
        let Some(pid) = self.pid() else {
            panic!("{}: freeze of a process that is not running", self.addr);
        };
        self.signal(Signal::SIGSTOP);
        crate::wait::eventually_blocking(
            std::time::Duration::from_secs(10),
            "every thread of the process is stopped",
            || {
                let running: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/task"))
                    .map_err(|e| vec![e.to_string()])?
                    .flatten()
                    .filter(|task| {
                        let stat = std::fs::read_to_string(task.path().join("stat"));
                        // A thread that ended meanwhile has no stat: not running.
                        stat.ok().is_some_and(|stat| {
                            let state = stat
                                .rsplit_once(") ")
                                .and_then(|(_, rest)| rest.split(' ').next());
                            !matches!(state, Some("T" | "t"))
                        })
                    })
                    .map(|task| task.file_name().to_string_lossy().into_owned())
                    .collect();
                if running.is_empty() {
                    Ok(())
                } else {
                    Err(running)
                }
            },
        );
    }

    /// Waits for it to exit (after SIGTERM); `None` if it is not running.
    pub fn wait(&mut self) -> Option<std::process::ExitStatus> {
        let mut child = self.child.take()?;
        child.wait().ok()
    }

    /// Whether it has exited (reaping it if so).
    pub fn exited(&mut self) -> bool {
        match self.child.as_mut().map(Child::try_wait) {
            Some(Ok(Some(_))) | None => {
                self.child = None;
                true
            }
            _ => false,
        }
    }

    /// Its log so far (for failure messages).
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for PsProcess {
    fn drop(&mut self) {
        self.kill();
    }
}
