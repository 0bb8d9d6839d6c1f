//! The systemd deployment (`deploy/systemd/`): the units pass
//! `systemd-analyze verify` without a warning, and the fleet's example
//! configurations are ones the binaries accept.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stderr,
    missing_docs
)]

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;
use common::{bin_dir, binary};

fn systemd_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("systemd")
}

#[test]
fn the_units_verify_without_warnings() {
    let Ok(version) = Command::new("systemd-analyze").arg("--version").output() else {
        // `scripts/dev test` installs it (Debian's systemd package).
        eprintln!("SKIP: systemd-analyze is not installed, so the units are not verified");
        return;
    };
    assert!(version.status.success());
    // The binaries must exist where ExecStart= names them: point the
    // units at this build's.
    binary("ps-server");
    binary("worker");
    let dir = tempfile::tempdir().unwrap();
    let mut names = Vec::new();
    for entry in std::fs::read_dir(systemd_dir()).unwrap() {
        let path = entry.unwrap().path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if !(name.ends_with(".service") || name.ends_with(".target")) {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let text = text.replace(
            "/usr/local/bin/",
            &format!("{}/", bin_dir().to_str().expect("a UTF-8 path")),
        );
        // A template verifies as an instance of itself.
        let name = name.replace("@.", "@example.");
        std::fs::write(dir.path().join(&name), text).unwrap();
        names.push(name);
    }
    names.sort();
    assert_eq!(
        names,
        [
            "tessera-ps-server.target",
            "tessera-ps-server@example.service",
            "tessera-worker@example.service"
        ]
    );
    let output = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .args(&names)
        .current_dir(dir.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    // Warnings about other units of this host (its own, not ours) are not
    // this test's business; any line naming one of ours is.
    let ours: Vec<&str> = stderr
        .lines()
        .filter(|line| names.iter().any(|name| line.contains(name.as_str())))
        .collect();
    assert!(
        output.status.success() && ours.is_empty(),
        "systemd-analyze verify: {}\n{stderr}",
        output.status
    );
    eprintln!("verified: {}", names.join(", "));
}

#[test]
fn the_fleet_configurations_are_accepted() {
    let fleet = systemd_dir().join("fleet");
    let mut checked = 0;
    for entry in std::fs::read_dir(&fleet).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let mut command = if name.starts_with("ps-server-") {
            Command::new(binary("ps-server"))
        } else if name.starts_with("worker-") {
            Command::new(binary("worker"))
        } else {
            continue;
        };
        command.arg("--config").arg(&path).arg("--check-config");
        if name.starts_with("worker-") {
            command.arg("trainer");
        }
        let output = command.output().unwrap();
        assert!(
            output.status.success(),
            "{name} is refused: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        checked += 1;
    }
    assert_eq!(checked, 5, "four servers and a trainer");
}

/// `ps-server --config FILE ARGS... --check-config`.
fn check_server_config(path: &Path, args: &[&std::ffi::OsStr]) -> std::process::Output {
    Command::new(binary("ps-server"))
        .arg("--config")
        .arg(path)
        .args(args)
        .arg("--check-config")
        .output()
        .unwrap()
}

/// `--check-config` refuses a bad configuration naming the key, without
/// serving.
#[test]
fn a_bad_configuration_is_refused_naming_its_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(&path, "num_shards = 2\nshards = [5]\n").unwrap();
    let output = check_server_config(&path, &[]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("shards"), "{stderr}");
}

/// A file may leave a key to a flag: the flags are applied before the
/// whole is validated. Before, the file was validated alone, so one with
/// periodic checkpoints and the directory given by `--checkpoint-dir` (as
/// the Kubernetes manifests do) was refused.
#[test]
fn a_flag_completes_the_file_before_validation() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("server.toml");
    std::fs::write(&path, "[checkpoint]\ninterval_secs = 60\n").unwrap();
    let state = dir.path().join("state");
    let output = check_server_config(&path, &["--checkpoint-dir".as_ref(), state.as_os_str()]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    // Without the flag the file alone is incomplete, and said so.
    let output = check_server_config(&path, &[]);
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("checkpoint.dir"));
}
