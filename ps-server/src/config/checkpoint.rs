//! `[checkpoint]`: where and when a server saves its shards.

use serde::{Deserialize, Serialize};

/// Where and when a server saves its shards, and whether it restores them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Directory of this server's checkpoints. Default: none (no
    /// checkpoints; the admin call to save one fails).
    pub dir: Option<std::path::PathBuf>,
    /// Seconds between periodic checkpoints; 0 saves only on demand (the
    /// admin call). Default 0: how much training a job may lose is its
    /// operator's choice.
    pub interval_secs: u64,
    /// Checkpoints kept; older ones are deleted after a save. Default 3:
    /// the newest, and two to fall back to by hand if it is bad.
    pub keep: usize,
    /// Load the newest checkpoint of `dir` at start. Default true: a
    /// restarted server should come back with its rows (and then catches
    /// up from the freshest replica; see the replication docs).
    pub restore: bool,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self {
            dir: None,
            interval_secs: 0,
            keep: 3,
            restore: true,
        }
    }
}
