//! The acknowledgement of a Push on a primary: whether it may be applied
//! here at all ([`Refusal`] otherwise, with where to go instead), its place
//! in the replicas' queues, and what its acknowledgement waits for
//! ([`AckTicket`]: with `ack = "replicas"`, every replica in step).

use std::sync::Arc;
use std::time::Instant;

use prost::Message as _;
use tessera_proto::v1::{NotPrimary, PushRequest};
use tessera_rpc::{Code, Status};

use super::Replication;
use super::forward::{Confirmation, Forwarder};
use super::shard::Role;
use crate::config::AckMode;
use tessera_store::version::Version;

/// Why this server does not take a Push for a shard now.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    /// Another server is (or none is known to be) the shard's primary.
    #[error("this server is not the primary of shard {}; {}", .0.shard, where_to(.0))]
    NotPrimary(NotPrimary),
    /// This server is becoming the primary: it copies the freshest copy
    /// from the replicas first.
    #[error("this server is recovering shard {0} before taking its Pushes")]
    Recovering(u32),
    /// This primary's lease is not confirmed: it may have been replaced.
    #[error("this server's lease is not confirmed; it takes no Pushes of shard {0} until it is")]
    Fenced(u32),
    /// This server stopped being the primary before the replicas confirmed
    /// the Push (it was not acknowledged; retry at the new primary).
    #[error("this server stopped being the primary of shard {} before its replicas confirmed the push; {}", .0.shard, where_to(.0))]
    Deposed(NotPrimary),
}

fn where_to(hint: &NotPrimary) -> String {
    if hint.primary.is_empty() {
        "no primary is known yet (a failover is in progress)".to_owned()
    } else {
        format!("it is {} at epoch {}", hint.primary, hint.epoch)
    }
}

impl Refusal {
    fn hint(&self) -> NotPrimary {
        match self {
            Refusal::NotPrimary(hint) | Refusal::Deposed(hint) => hint.clone(),
            Refusal::Recovering(shard) | Refusal::Fenced(shard) => NotPrimary {
                shard: *shard,
                ..NotPrimary::default()
            },
        }
    }
}

impl From<Refusal> for Status {
    /// `FAILED_PRECONDITION` when it names the primary to go to instead,
    /// `UNAVAILABLE` (retry shortly) otherwise; both with a [`NotPrimary`]
    /// in the details.
    fn from(refusal: Refusal) -> Self {
        let hint = refusal.hint();
        let code = match &refusal {
            Refusal::NotPrimary(h) if !h.primary.is_empty() => Code::FailedPrecondition,
            _ => Code::Unavailable,
        };
        Status::with_details(code, refusal.to_string(), hint.encode_to_vec())
    }
}

/// Pushes a primary waits on before acknowledging one (`ack =
/// "replicas"`): each confirmed replica's attachment and the position it
/// must reach.
#[derive(Debug)]
#[must_use = "a ticket must be awaited with Replication::confirmed"]
pub struct AckTicket {
    shard: u32,
    epoch: u64,
    position: u64,
    waits: Vec<(Arc<Forwarder>, u64)>,
}

impl Replication {
    /// The epoch this server leads `shard` under, if it may change the
    /// shard's rows now: as for a Push (primary, not handing over, fence
    /// valid), without counting a refusal. An expiry step is applied, and
    /// a delta cut, under it. Called under the shard's write lock.
    pub fn leading_epoch(&self, shard: u32, now: Instant) -> Option<u64> {
        let cell = self.cell(shard)?;
        let state = cell.lock();
        match &state.role {
            Role::Primary { epoch, .. } if !state.handing_over && self.fence.is_valid(now) => {
                Some(*epoch)
            }
            _ => None,
        }
    }

    /// Whether a Push to `shard` may be applied now; returns the epoch to
    /// apply it under. Called under the shard's write lock.
    pub fn admit_push(&self, shard: u32, now: Instant) -> Result<u64, Refusal> {
        let Some(cell) = self.cell(shard) else {
            return Err(Refusal::NotPrimary(NotPrimary {
                shard,
                ..NotPrimary::default()
            }));
        };
        let state = cell.lock();
        match &state.role {
            Role::Primary { .. } if state.handing_over => Err(Refusal::NotPrimary(NotPrimary {
                shard,
                ..NotPrimary::default()
            })),
            Role::Primary { epoch, .. } => {
                if self.fence.is_valid(now) {
                    Ok(*epoch)
                } else {
                    metrics::counter!("tessera_ps_fenced_pushes_total").increment(1);
                    Err(Refusal::Fenced(shard))
                }
            }
            Role::Recovering { .. } => Err(Refusal::Recovering(shard)),
            Role::Replica(_) | Role::Idle => Err(Refusal::NotPrimary(state.redirect(shard))),
        }
    }

    /// Queues `push`, just applied to `shard` at `version`, for the
    /// replicas; returns what its acknowledgement waits for. Called under
    /// the shard's write lock, in stream order.
    pub fn record_push(
        &self,
        shard: u32,
        version: Version,
        push: &PushRequest,
        outcome: &tessera_store::store::PushOutcome,
    ) -> AckTicket {
        let mut ticket = AckTicket {
            shard,
            epoch: version.epoch,
            position: version.position,
            waits: Vec::new(),
        };
        let mut shared = None;
        for forwarder in &self.forwarders {
            if forwarder.shards.contains(&shard) {
                let push = shared.get_or_insert_with(|| {
                    Arc::new(super::forward::Forwarded {
                        request: push.clone(),
                        evicted_before: outcome.evicted.iter().map(|e| e.before).collect(),
                        evicted_keys: outcome.evicted.iter().map(|e| e.key).collect(),
                        not_admitted: outcome.not_admitted.clone(),
                        stamp: outcome.stamp,
                        expired: None,
                    })
                });
                if let Some(generation) =
                    forwarder.enqueue(shard, version.epoch, version.position, push)
                    && self.ack == AckMode::Replicas
                {
                    ticket.waits.push((Arc::clone(forwarder), generation));
                }
            }
        }
        ticket
    }

    /// Queues an expiry step of `shard`'s sweep, just applied at
    /// `version` (it removed `expired`), for the replicas. Nothing waits
    /// for it: a replica that misses it is out of step and copies the
    /// shard again. Called under the shard's write lock, in stream order.
    pub fn record_expiry(
        &self,
        shard: u32,
        version: Version,
        expired: &tessera_store::store::Expired,
    ) {
        let mut shared = None;
        for forwarder in &self.forwarders {
            if forwarder.shards.contains(&shard) {
                let entry = shared.get_or_insert_with(|| {
                    Arc::new(super::forward::Forwarded {
                        expired: Some(tessera_proto::v1::ExpiredRows {
                            table: expired.table.clone(),
                            keys: expired.keys.clone(),
                        }),
                        ..Default::default()
                    })
                });
                forwarder.enqueue(shard, version.epoch, version.position, entry);
            }
        }
    }

    /// Starts the replicas of the shard `writing` locks over from this
    /// primary's rows, which changed outside its stream (a resize's
    /// receiving shard opening at the cut-over: `crate::reshard`). The
    /// shard takes the next stream position as a gap: every attached
    /// replica is cut off at it, and one attaching later holds an older
    /// version; either copies the shard. Returns the new version, or
    /// `None` (nothing changed) when this server does not lead the shard.
    pub fn restart_replicas(
        &self,
        writing: &mut tessera_store::store::ShardGuard<'_>,
    ) -> Option<Version> {
        let shard = writing.shard();
        let epoch = self.leading_epoch(shard, std::time::Instant::now())?;
        let version = writing.version().next(epoch);
        writing.set_version(version);
        for forwarder in &self.forwarders {
            if forwarder.shards.contains(&shard) {
                forwarder.cut_off_for_resize(shard, version.epoch, version.position);
            }
        }
        Some(version)
    }

    /// What acknowledging a duplicate of a Push already applied to `shard`
    /// (now at `version`, under `epoch`) waits for: its original may still
    /// be on its way to the replicas, so every confirmed replica must
    /// reach `version`. Called under the shard's write lock.
    pub fn duplicate_ticket(&self, shard: u32, epoch: u64, version: Version) -> AckTicket {
        let waits = if self.ack == AckMode::Replicas {
            self.forwarders
                .iter()
                .filter(|f| f.shards.contains(&shard))
                .filter_map(|f| Some((Arc::clone(f), f.confirmed_generation(shard)?)))
                .collect()
        } else {
            Vec::new()
        };
        AckTicket {
            shard,
            epoch,
            position: version.position,
            waits,
        }
    }

    /// Waits until the Push of `ticket` may be acknowledged: every replica
    /// it waits for applied it, or left the set of replicas in step with
    /// this primary (cut off for not confirming within
    /// `replica_timeout_ms`, or out of sync). Fails if this server stopped
    /// being the primary meanwhile, or its lease is not proven now (the
    /// Push must then be retried where the shard is led).
    ///
    /// The cut-off does not hinge on the caller: when the Push's handler
    /// is dropped during the wait (the worker gave up on the attempt
    /// sooner than `replica_timeout_ms`), a task of its own finishes the
    /// wait and cuts off what did not confirm. Without it a dead replica
    /// stalled the shard's Pushes for good: every retry was a duplicate
    /// waiting on the same replica, abandoned before its cut-off.
    pub async fn confirmed(&self, ticket: AckTicket) -> Result<(), Refusal> {
        if !ticket.waits.is_empty() {
            let deadline = Instant::now() + self.replica_timeout;
            // The guard holds the waits (no copy per Push) and lends them
            // to the wait; emptied once it finished, it spawns nothing.
            let mut guard = CutOffOnDrop {
                waits: ticket.waits,
                shard: ticket.shard,
                epoch: ticket.epoch,
                position: ticket.position,
                deadline,
            };
            confirm_or_cut_off(
                &guard.waits,
                ticket.shard,
                ticket.epoch,
                ticket.position,
                deadline,
            )
            .await;
            guard.waits.clear();
        }
        // The in-step record lists no copy that lacks this Push
        // (`in_step`): written first where it would.
        self.ensure_in_step(ticket.shard, ticket.epoch, ticket.position)
            .await?;
        let Some(cell) = self.cell(ticket.shard) else {
            return Ok(());
        };
        let state = cell.lock();
        if state.primary_epoch() != Some(ticket.epoch) {
            return Err(Refusal::Deposed(state.redirect(ticket.shard)));
        }
        // The acknowledgement is what the fence guards: a lease that may
        // have expired while the replicas were confirming acknowledges
        // nothing (the worker retries at whichever server leads).
        if !self.fence.is_valid(Instant::now()) {
            metrics::counter!("tessera_ps_fenced_pushes_total").increment(1);
            return Err(Refusal::Fenced(ticket.shard));
        }
        Ok(())
    }
}

/// Waits for every replica of `waits` to apply `position` of `shard` until
/// `deadline`, and cuts off each that did not.
async fn confirm_or_cut_off(
    waits: &[(Arc<Forwarder>, u64)],
    shard: u32,
    epoch: u64,
    position: u64,
    deadline: Instant,
) {
    let waits = waits.iter().map(|(forwarder, generation)| async move {
        let outcome = forwarder
            .wait_applied(shard, *generation, position, deadline)
            .await;
        if outcome == Confirmation::TimedOut {
            forwarder.cut_off(shard, *generation, epoch, position);
        }
    });
    futures::future::join_all(waits).await;
}

/// The rest of an abandoned confirmation wait ([`Replication::confirmed`]):
/// dropped with `waits` left, it spawns the wait and cut-off on the
/// runtime it was dropped on.
struct CutOffOnDrop {
    waits: Vec<(Arc<Forwarder>, u64)>,
    shard: u32,
    epoch: u64,
    position: u64,
    deadline: Instant,
}

impl Drop for CutOffOnDrop {
    fn drop(&mut self) {
        if self.waits.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let waits = std::mem::take(&mut self.waits);
        let (shard, epoch, position, deadline) =
            (self.shard, self.epoch, self.position, self.deadline);
        runtime.spawn(async move {
            confirm_or_cut_off(&waits, shard, epoch, position, deadline).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::forward::tests::{answer, forwarder, push};
    use super::*;

    /// The Push's handler is dropped at 1 s (the worker gave up on the
    /// attempt) while a silent replica has until 2 s to confirm: the
    /// replica is still cut off at 2 s. Before, the cut-off lived in the
    /// dropped future, so no Push of the shard was acknowledged again.
    #[tokio::test(start_paused = true)]
    async fn an_abandoned_wait_still_cuts_off_a_silent_replica() {
        let f = Arc::new(forwarder(100));
        f.attach(0, 0);
        answer(&f, 0, 0, 1, 0);
        let generation = f.enqueue(0, 1, 1, &push()).expect("confirmed replica");
        let deadline = Instant::now() + Duration::from_secs(2);
        let waits = vec![(Arc::clone(&f), generation)];
        let guard = CutOffOnDrop {
            waits: waits.clone(),
            shard: 0,
            epoch: 1,
            position: 1,
            deadline,
        };
        let handler = async move {
            let _guard = guard;
            confirm_or_cut_off(&waits, 0, 1, 1, deadline).await;
        };
        assert!(
            tokio::time::timeout(Duration::from_secs(1), handler)
                .await
                .is_err()
        );
        assert!(f.status(0).0, "attached until its deadline");
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert!(!f.status(0).0, "cut off at its deadline");
    }
}
