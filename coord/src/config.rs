//! The `[coordinator]` section shared by ps-servers, workers and the
//! launcher.

use serde::{Deserialize, Serialize};
use tessera_config::{ConfigError, Validate, invalid};

/// How the primaries of shards are decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CoordinatorKind {
    /// Fixed primaries: shard `s`'s primary is the server of replica group
    /// `s % replica_groups`, always. No coordinator runs and nothing fails
    /// over: when a primary is down its shard takes no Pushes until it is
    /// back. For one host's development, and the default so that a single
    /// server starts with nothing else running.
    #[default]
    Static,
    /// Leases and epochs in etcd: when a primary stops renewing its lease,
    /// one replica is promoted under a new epoch, and the old primary is
    /// fenced. For anything that must keep training through a failure.
    Etcd,
}

/// Where the coordinator is and how failures are timed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CoordinatorConfig {
    /// `static` or `etcd` (see [`CoordinatorKind`]). Default `static`.
    pub kind: CoordinatorKind,
    /// etcd's client endpoints, `host:port` or `http://host:port`.
    /// Default `["127.0.0.1:2379"]`, etcd's own default.
    pub endpoints: Vec<String>,
    /// The prefix of this cluster's keys (`/<cluster>/...`), so that
    /// several clusters can share one etcd. Default `tessera`.
    pub cluster: String,
    /// How long after a primary's last lease renewal a replica has taken
    /// over, at the latest, in milliseconds. Each server's lease lives
    /// this less one second (whole seconds, at least one): etcd checks for
    /// expired leases every 500 ms, and the campaign and the new primary's
    /// recovery take the rest. A primary stops acknowledging Pushes before
    /// its lease can expire (fencing), so a partitioned primary takes
    /// Pushes for at most the lease time. Default 3000 (a 2 s lease):
    /// Pushes resume within a few seconds of a crash, while a lease renewed
    /// every 200 ms survives nine missed renewals of a loaded host before
    /// anything fails over. A multiple of 1000, at least 2000; etcd raises
    /// leases below its minimum TTL (2 s with its default timings; the
    /// granted TTL is logged), which then lengthens the failover.
    pub failover_timeout_ms: u64,
    /// Timeout of one request to etcd, in milliseconds. Default 1000: etcd
    /// answers in milliseconds; a request that takes a second is a
    /// coordinator in trouble, and retrying beats waiting.
    pub request_timeout_ms: u64,
}

impl Default for CoordinatorConfig {
    fn default() -> Self {
        Self {
            kind: CoordinatorKind::Static,
            endpoints: vec!["127.0.0.1:2379".into()],
            cluster: "tessera".into(),
            failover_timeout_ms: 3000,
            request_timeout_ms: 1000,
        }
    }
}

impl CoordinatorConfig {
    /// Whether primaries fail over (an etcd coordinator).
    pub fn is_etcd(&self) -> bool {
        self.kind == CoordinatorKind::Etcd
    }

    /// The lease time-to-live, in whole seconds: `failover_timeout_ms`
    /// less one second (see there), at least one.
    pub fn lease_ttl_secs(&self) -> i64 {
        ((self.failover_timeout_ms / 1000) as i64 - 1).max(1)
    }
}

impl Validate for CoordinatorConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.kind == CoordinatorKind::Static {
            return Ok(());
        }
        if self.endpoints.is_empty() || self.endpoints.iter().any(|e| e.trim().is_empty()) {
            return Err(invalid(
                "coordinator.endpoints",
                "needs at least one etcd endpoint, none empty",
            ));
        }
        if self.cluster.is_empty()
            || !self
                .cluster
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(invalid(
                "coordinator.cluster",
                format!(
                    "`{}` must be non-empty letters, digits, `-` or `_` (it is a key prefix)",
                    self.cluster
                ),
            ));
        }
        if self.failover_timeout_ms < 2000 || !self.failover_timeout_ms.is_multiple_of(1000) {
            return Err(invalid(
                "coordinator.failover_timeout_ms",
                format!(
                    "{} must be a whole number of seconds, at least 2000 (etcd leases count seconds)",
                    self.failover_timeout_ms
                ),
            ));
        }
        if self.request_timeout_ms == 0 {
            return Err(invalid(
                "coordinator.request_timeout_ms",
                "must be at least 1",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<CoordinatorConfig, String> {
        let config: CoordinatorConfig = toml::from_str(text).map_err(|e| e.to_string())?;
        config.validate().map_err(|e| e.to_string())?;
        Ok(config)
    }

    #[test]
    fn defaults_are_static_and_valid() {
        assert_eq!(parse("").unwrap(), CoordinatorConfig::default());
        assert!(!CoordinatorConfig::default().is_etcd());
        let etcd = parse("kind = \"etcd\"").unwrap();
        assert_eq!(etcd.lease_ttl_secs(), 2);
    }

    #[test]
    fn bad_values_name_their_key() {
        for (text, key) in [
            ("kind = \"etcd\"\nendpoints = []", "coordinator.endpoints"),
            ("kind = \"etcd\"\ncluster = \"a/b\"", "coordinator.cluster"),
            (
                "kind = \"etcd\"\nfailover_timeout_ms = 1500",
                "coordinator.failover_timeout_ms",
            ),
            (
                "kind = \"etcd\"\nfailover_timeout_ms = 1000",
                "coordinator.failover_timeout_ms",
            ),
            ("kind = \"zookeeper\"", "kind"),
        ] {
            let err = parse(text).unwrap_err();
            assert!(err.contains(key), "{text:?}: {err}");
        }
    }
}
