//! A local etcd for a test ([`tessera_coord::LocalEtcd`] in a temporary
//! directory), stopped when dropped.
//!
//! The test command installs Debian's `etcd-server` package when `etcd`
//! is missing; a test that needs etcd and finds none fails, with that
//! advice, rather than skip the coordinated path silently.

use std::time::Duration;

use tessera_coord::{LocalEtcd, etcd_bin};

/// A running etcd.
pub struct Etcd {
    /// Its client endpoint (`127.0.0.1:<port>`).
    pub endpoint: String,
    _etcd: LocalEtcd,
    _dir: tempfile::TempDir,
}

impl Etcd {
    /// Starts one and waits until it answers (at most 20 s).
    pub fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let etcd = LocalEtcd::start(&etcd_bin(None), dir.path(), Duration::from_secs(20))
            .unwrap_or_else(|err| panic!("{err}"));
        Self {
            endpoint: etcd.endpoint().to_owned(),
            _etcd: etcd,
            _dir: dir,
        }
    }
}
