//! The keys a cluster keeps in etcd, and the records under them.
//!
//! ```text
//! /<cluster>/shards/<shard>/primary   PrimaryRecord (JSON), on the primary's lease
//! /<cluster>/shards/<shard>/epoch     the last epoch issued (decimal), kept forever
//! /<cluster>/shards/<shard>/in_step   InStepRecord (JSON), written by the primary, kept
//! /<cluster>/members/<address>        MemberRecord (JSON), on the server's lease
//! /<cluster>/shard_map                ShardMap (JSON): the shard count and any resize
//! ```
//!
//! Shards are written with six digits (`000007`) so that keys sort by
//! shard. A primary key disappears with its holder's lease: that deletion
//! is what starts a failover. The epoch key outlives every lease, so that
//! each campaign issues an epoch above all earlier ones.

use serde::{Deserialize, Serialize};

/// The primary of a shard, as stored in its primary key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrimaryRecord {
    /// The primary's address as its peers and workers know it.
    pub address: String,
    /// Its epoch: unique to this primary, above every earlier one.
    pub epoch: u64,
    /// Its replica group.
    pub replica_group: u32,
}

/// Which copies of a shard hold every Push its primary acknowledged, as
/// that primary last wrote it (its in-step key; Kafka calls this the
/// in-sync replica set). The primary writes a replica out *before* it
/// acknowledges a Push without it, and back in once it holds every
/// acknowledged Push, so that a server that wins a later campaign can tell
/// whether its own copy may lead or which live server's copy must be
/// taken first.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct InStepRecord {
    /// The epoch of the primary that wrote it.
    pub epoch: u64,
    /// The servers (addresses) whose copies hold every acknowledged Push:
    /// the primary and each replica it waits for.
    pub members: Vec<String>,
}

/// A live server, as stored in its member key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberRecord {
    /// Its address as its peers and workers know it.
    pub address: String,
    /// Its replica group.
    pub replica_group: u32,
    /// The shards it hosts.
    pub shards: Vec<u32>,
}

/// Every key of the cluster called `cluster`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keys {
    root: String,
}

impl Keys {
    /// The keys of `cluster` (the `coordinator.cluster` setting).
    pub fn new(cluster: &str) -> Self {
        Self {
            root: format!("/{cluster}"),
        }
    }

    /// The cluster's name (`coordinator.cluster`).
    pub fn cluster(&self) -> &str {
        self.root.strip_prefix('/').unwrap_or(&self.root)
    }

    /// The prefix of every shard's keys.
    pub fn shards_prefix(&self) -> String {
        format!("{}/shards/", self.root)
    }

    /// The primary key of `shard`.
    pub fn primary(&self, shard: u32) -> String {
        format!("{}/shards/{shard:06}/primary", self.root)
    }

    /// The epoch key of `shard`.
    pub fn epoch(&self, shard: u32) -> String {
        format!("{}/shards/{shard:06}/epoch", self.root)
    }

    /// The in-step key of `shard` ([`InStepRecord`]).
    pub fn in_step(&self, shard: u32) -> String {
        format!("{}/shards/{shard:06}/in_step", self.root)
    }

    /// The shard-map key ([`crate::ShardMap`]).
    pub fn shard_map(&self) -> String {
        format!("{}/shard_map", self.root)
    }

    /// The prefix of the member keys.
    pub fn members_prefix(&self) -> String {
        format!("{}/members/", self.root)
    }

    /// The member key of the server at `address`.
    pub fn member(&self, address: &str) -> String {
        format!("{}/members/{address}", self.root)
    }

    /// The shard whose primary key `key` is, if it is one.
    pub fn shard_of_primary_key(&self, key: &str) -> Option<u32> {
        key.strip_prefix(&self.shards_prefix())?
            .strip_suffix("/primary")?
            .parse()
            .ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_laid_out_and_parsed_back() {
        let keys = Keys::new("prod-a");
        assert_eq!(keys.primary(7), "/prod-a/shards/000007/primary");
        assert_eq!(keys.epoch(7), "/prod-a/shards/000007/epoch");
        assert_eq!(
            keys.member("10.0.0.1:7070"),
            "/prod-a/members/10.0.0.1:7070"
        );
        assert_eq!(
            keys.shard_of_primary_key(&keys.primary(123_456)),
            Some(123_456)
        );
        assert_eq!(keys.shard_of_primary_key(&keys.epoch(3)), None);
        assert_eq!(
            keys.shard_of_primary_key("/other/shards/000001/primary"),
            None
        );
        assert!(keys.primary(1).starts_with(&keys.shards_prefix()));
    }

    #[test]
    fn records_round_trip_as_json() {
        let record = PrimaryRecord {
            address: "127.0.0.1:7070".into(),
            epoch: 12,
            replica_group: 1,
        };
        let text = serde_json::to_string(&record).unwrap();
        assert_eq!(
            serde_json::from_str::<PrimaryRecord>(&text).unwrap(),
            record
        );
    }
}
