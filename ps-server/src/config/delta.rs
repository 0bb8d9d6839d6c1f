//! `[delta]` (a training server feeding a serving fleet) and `[serving]`
//! (a serving server's freshness bound): see `crate::delta`.

use serde::{Deserialize, Serialize};
use tessera_config::{ConfigError, invalid};

/// One server of the serving fleet, as a training server sends to it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServingServer {
    /// Its address (`host:port`).
    pub address: String,
    /// The serving shards it hosts.
    pub shards: Vec<u32>,
}

/// The delta stream from this training server's primary shards to a
/// serving fleet (`[delta]`). Off while `servers` is empty.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DeltaConfig {
    /// The serving fleet's shard count (rows go to the serving shard of
    /// their key, whatever this fleet's count). Default 1.
    pub num_shards: u32,
    /// Every server of the serving fleet (`[[delta.servers]]`: `address`,
    /// `shards`), every replica of every serving shard: each gets the
    /// rows of the shards it hosts. Default none (no stream).
    pub servers: Vec<ServingServer>,
    /// How often a primary sends each shard's changed rows, in
    /// milliseconds. Default 1000: serving sees a Push within about a
    /// second (Monolith syncs every minute, PERSIA every ~10 s), and a
    /// second of changes makes batches of thousands of rows on a busy
    /// shard rather than a message per Push.
    pub interval_ms: u64,
    /// Changed rows of one shard that send a delta before the interval
    /// ends. Default 100,000: a delta of at most a few tens of MiB, so a
    /// burst of new ids neither grows the set of changes without bound nor
    /// makes one delta a long stall for its receivers.
    pub max_rows: u64,
    /// Send the optimizer state with the values. Default false: rankers
    /// read values only, and the state doubles to quadruples the bytes
    /// (Adagrad, Adam).
    pub optimizer_state: bool,
}

impl Default for DeltaConfig {
    fn default() -> Self {
        Self {
            num_shards: 1,
            servers: Vec::new(),
            interval_ms: 1000,
            max_rows: 100_000,
            optimizer_state: false,
        }
    }
}

impl DeltaConfig {
    /// Whether a stream is configured.
    pub fn enabled(&self) -> bool {
        !self.servers.is_empty()
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if !self.enabled() {
            return Ok(());
        }
        if self.num_shards == 0 {
            return Err(invalid("delta.num_shards", "must be at least 1"));
        }
        if !(10..=3_600_000).contains(&self.interval_ms) {
            return Err(invalid(
                "delta.interval_ms",
                format!("{} is outside 10..=3600000", self.interval_ms),
            ));
        }
        if self.max_rows == 0 {
            return Err(invalid("delta.max_rows", "must be at least 1"));
        }
        let mut covered = vec![false; self.num_shards as usize];
        for (i, server) in self.servers.iter().enumerate() {
            if server.address.is_empty() {
                return Err(invalid(
                    format!("delta.servers[{i}].address"),
                    "must not be empty",
                ));
            }
            if server.shards.is_empty() {
                return Err(invalid(
                    format!("delta.servers[{i}].shards"),
                    "a serving server hosts at least one shard",
                ));
            }
            for (j, &shard) in server.shards.iter().enumerate() {
                match covered.get_mut(shard as usize) {
                    Some(c) => *c = true,
                    None => {
                        return Err(invalid(
                            format!("delta.servers[{i}].shards[{j}]"),
                            format!(
                                "serving shard {shard} does not exist (delta.num_shards = {})",
                                self.num_shards
                            ),
                        ));
                    }
                }
            }
            if self.servers[..i]
                .iter()
                .any(|s| s.address == server.address)
            {
                return Err(invalid(
                    format!("delta.servers[{i}].address"),
                    format!("{} is listed twice", server.address),
                ));
            }
        }
        // A serving shard nobody hosts would never get its rows.
        if let Some(missing) = covered.iter().position(|c| !c) {
            return Err(invalid(
                "delta.servers",
                format!("no server hosts serving shard {missing}"),
            ));
        }
        Ok(())
    }
}

/// A serving server (`mode = "serving"`): how stale it may be and still
/// answer (`[serving]`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServingConfig {
    /// Refuse Fetches (`Unavailable`, so rankers read another replica)
    /// while a training shard's rows here are older than this, in
    /// milliseconds: no delta of it applied for that long, or a copy of
    /// it in progress, or none heard of yet. 0: always answer. Default 0:
    /// a fleet of one copy per shard is better stale than silent; set it
    /// (a few delta intervals) where rankers have replicas to go to.
    pub max_delay_ms: u64,
}

impl ServingConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.max_delay_ms > 86_400_000 {
            return Err(invalid(
                "serving.max_delay_ms",
                format!("{} is more than a day", self.max_delay_ms),
            ));
        }
        Ok(())
    }
}
