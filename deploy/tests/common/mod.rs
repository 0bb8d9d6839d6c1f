//! Set-up shared by the deployment tests.

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
