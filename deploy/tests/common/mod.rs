//! Set-up shared by the deployment tests.

// Each test crate uses a part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// Where cargo put this build's binaries (`ps-server` and `worker` are
/// built with the workspace, next to `tessera`).
pub fn bin_dir() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_tessera"))
        .parent()
        .expect("a directory")
        .to_owned()
}

/// This build's `name` binary; a clear failure if it is not built.
pub fn binary(name: &str) -> PathBuf {
    let path = bin_dir().join(name);
    assert!(
        path.is_file(),
        "{} is not built: build the workspace (cargo build --workspace --bins)",
        path.display()
    );
    path
}

/// A child process killed (and reaped) when the test lets go of it,
/// also when it fails first.
pub struct KillOnDrop(pub std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}
