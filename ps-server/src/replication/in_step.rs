//! The in-step record: which copies of a shard hold every Push its primary
//! acknowledged, kept in etcd (`tessera_coord::InStepRecord`; Kafka's
//! in-sync replica set), so that a failover never leads from a copy that
//! misses an acknowledged Push.
//!
//! Without it a recovering server took the freshest copy among the servers
//! that answered it; a primary that had cut off a restarted replica and
//! acknowledged Pushes alone, then paused past its lease, left that
//! replica to win the next campaign, hear no one, and lead from its stale
//! copy (the fault soak lost 1,081 acknowledged Pushes so).
//!
//! **Primary side** ([`Replication::ensure_in_step`], before each
//! acknowledgement with `ack = "replicas"` and a coordinator): the record
//! must never list a copy that lacks a Push being acknowledged. A replica
//! that has not applied it (cut off, or never confirmed) is written out of
//! the record first, and the Push is acknowledged only once etcd took the
//! write (a failed write acknowledges nothing). A replica that holds every
//! acknowledged Push again is written back in at the next
//! acknowledgement. A new primary writes the record of its epoch before
//! its first acknowledgement. Writes are guarded by the primary key's
//! lease: only the shard's primary writes.
//!
//! **Recovery side** ([`eligible`]): a copy may lead (or be copied by the
//! winner) when this process held every acknowledged Push of an epoch
//! newer than the record's, or of the record's epoch and it is listed. A
//! winner that finds no such copy among itself and the servers that
//! answered resigns and tries again, unless every server of the shard
//! answered (then the freshest of all copies is the best there is).
//!
//! Written by hand rather than with etcd's election recipe: the record is
//! one key per shard written by its primary in a transaction on its lease,
//! the same mechanism as the primary key itself.

use std::collections::HashMap;
use std::sync::Mutex;
use tessera_rpc::sync::lock;

use tessera_coord::{EtcdCoordinator, InStepRecord};

use super::Replication;
use super::ack::Refusal;
use crate::config::AckMode;

/// Where the record is written: the coordinator and this server's current
/// lease (set by the etcd coordination at each session).
#[derive(Debug, Clone)]
pub struct InStepWriter {
    /// The coordinator.
    pub coord: EtcdCoordinator,
    /// The lease this server's primary keys are on.
    pub lease: i64,
}

/// What etcd may list for one shard, as this primary wrote it.
#[derive(Debug, Default)]
struct View {
    /// The last record etcd took (epoch, replicas besides this server).
    published: Option<(u64, Vec<String>)>,
    /// A record written but not known to be taken (in flight, or its write
    /// failed): etcd may hold it, so it counts too.
    pending: Option<(u64, Vec<String>)>,
}

/// Every hosted shard's [`View`], and the writer.
#[derive(Debug, Default)]
pub(crate) struct InStepBook {
    writer: Mutex<Option<InStepWriter>>,
    views: HashMap<u32, (Mutex<View>, tokio::sync::Mutex<()>)>,
}

impl InStepBook {
    pub(crate) fn new(shards: &[u32]) -> Self {
        Self {
            writer: Mutex::new(None),
            views: shards
                .iter()
                .map(|&s| {
                    (
                        s,
                        (Mutex::new(View::default()), tokio::sync::Mutex::new(())),
                    )
                })
                .collect(),
        }
    }
}

/// Whether a copy that held every acknowledged Push of `in_step_epoch`
/// (this process's, [`Replication::in_step_epoch`]) at `address` holds
/// every Push acknowledged under `record`.
pub fn eligible(record: &InStepRecord, address: &str, in_step_epoch: u64) -> bool {
    in_step_epoch > record.epoch
        || (in_step_epoch == record.epoch
            && in_step_epoch > 0
            && record.members.iter().any(|m| m == address))
}

impl Replication {
    /// Sets where the in-step record is written (the etcd coordination,
    /// at each session's start); without it (static mode) nothing is.
    pub fn set_in_step_writer(&self, writer: InStepWriter) {
        *lock(&self.in_step.writer) = Some(writer);
    }

    /// The replicas of `shard` that may be listed for an acknowledgement
    /// of `position`: attached, confirmed, and holding every Push
    /// acknowledged so far and this one.
    fn holding(&self, shard: u32, position: u64) -> Vec<String> {
        let mut holding: Vec<String> = self
            .forwarders
            .iter()
            .filter(|f| f.shards.contains(&shard) && f.holds(shard, position))
            .map(|f| f.addr.clone())
            .collect();
        holding.sort();
        holding
    }

    /// Makes sure the in-step record of `shard` lists no copy that lacks
    /// the Push at `position` being acknowledged under `epoch`, and lists
    /// the replicas that hold it (module docs). Fails when the record
    /// could not be written.
    pub(super) async fn ensure_in_step(
        &self,
        shard: u32,
        epoch: u64,
        position: u64,
    ) -> Result<(), Refusal> {
        if self.ack != AckMode::Replicas {
            return Ok(());
        }
        let Some(writer) = lock(&self.in_step.writer).clone() else {
            return Ok(());
        };
        let Some((view, writing)) = self.in_step.views.get(&shard) else {
            return Ok(());
        };
        if self.record_holds(view, shard, epoch, position) {
            return Ok(());
        }
        let _writing = writing.lock().await;
        // Another acknowledgement may have written it meanwhile.
        if self.record_holds(view, shard, epoch, position) {
            return Ok(());
        }
        let replicas = self.holding(shard, position);
        lock(view).pending = Some((epoch, replicas.clone()));
        let mut members = vec![self.me.clone()];
        members.extend(replicas.iter().cloned());
        let record = InStepRecord { epoch, members };
        match writer
            .coord
            .publish_in_step(shard, writer.lease, &record)
            .await
        {
            Ok(true) => {
                let mut view = lock(view);
                view.published = Some((epoch, replicas));
                view.pending = None;
                metrics::counter!("tessera_ps_in_step_writes_total").increment(1);
                tracing::info!(shard, epoch, members = ?record.members, "in-step record written");
                Ok(())
            }
            Ok(false) => {
                tracing::warn!(
                    shard,
                    epoch,
                    "the in-step record was not written: this server's lease no longer holds the shard"
                );
                Err(Refusal::Fenced(shard))
            }
            Err(err) => {
                tracing::warn!(shard, epoch, %err, "cannot write the in-step record; the push is not acknowledged");
                Err(Refusal::Fenced(shard))
            }
        }
    }

    /// Whether what etcd may list for `shard` is right for acknowledging
    /// `position` under `epoch`: of this epoch, every listed replica holds
    /// it, and every replica that holds it is listed.
    fn record_holds(&self, view: &Mutex<View>, shard: u32, epoch: u64, position: u64) -> bool {
        let view = lock(view);
        let Some((published_epoch, listed)) = &view.published else {
            return false;
        };
        if *published_epoch != epoch {
            return false;
        }
        // Runs before every acknowledgement: walks the (few) forwarders
        // instead of collecting the holding set.
        let holding = || {
            self.forwarders
                .iter()
                .filter(|f| f.shards.contains(&shard) && f.holds(shard, position))
        };
        let may_list = listed
            .iter()
            .chain(view.pending.iter().flat_map(|(_, p)| p.iter()));
        for replica in may_list {
            if !holding().any(|f| f.addr == *replica) {
                return false;
            }
        }
        holding().all(|f| listed.contains(&f.addr))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(epoch: u64, members: &[&str]) -> InStepRecord {
        InStepRecord {
            epoch,
            members: members.iter().map(|m| (*m).to_owned()).collect(),
        }
    }

    #[test]
    fn a_listed_copy_of_the_records_epoch_or_any_copy_of_a_newer_one_is_eligible() {
        let r = record(7, &["a", "b"]);
        assert!(eligible(&r, "a", 7));
        assert!(!eligible(&r, "c", 7), "not listed");
        assert!(
            !eligible(&r, "a", 6),
            "listed, but this process was not in step at 7"
        );
        assert!(!eligible(&r, "a", 0), "a restarted server");
        assert!(eligible(&r, "c", 8), "in step with a newer primary");
        assert!(!eligible(&record(0, &["a"]), "a", 0));
    }
}
