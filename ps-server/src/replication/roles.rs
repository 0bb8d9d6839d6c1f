//! Role changes of a shard, as the coordination decides them: follow a
//! primary, stand down, recover, lead. Each happens under the shard's
//! write lock and its cell's lock, so that no Push straddles one.

use std::time::{Duration, Instant};

use tessera_proto::v1::NotPrimary;

use super::shard::{Follow, Role, ShardState};
use super::{RecoveryError, Replication};
use tessera_store::version::Version;

impl Replication {
    /// Steps down from `state` (under the shard's write lock): the
    /// replicas are detached, and Pushes waiting for them fail.
    pub(super) fn step_down_locked(&self, shard: u32, state: &mut ShardState, why: &str) {
        // (The store's version does not wait for the write lock the
        // caller holds.)
        state.note_held(self.store.version(shard).map_or(0, |v| v.position));
        if let Role::Primary { epoch, .. } = state.role {
            tracing::warn!(shard, epoch, why, "stepping down as the shard's primary");
            metrics::counter!("tessera_ps_step_downs_total").increment(1);
        }
        state.role = Role::Idle;
        state.handing_over = false;
        for forwarder in &self.forwarders {
            if forwarder.shards.contains(&shard) {
                forwarder.detach(shard, None);
            }
        }
    }

    /// Makes this server a replica of `primary` at `epoch` for `shard`
    /// (stepping down if it was the primary of an older epoch), and starts
    /// attaching to it. Ignored if a newer epoch is known.
    pub fn follow(&self, shard: u32, primary: &str, epoch: u64) {
        if primary == self.me {
            return;
        }
        let (Some(cell), Some(writing)) = (self.cell(shard), self.store.lock_shard(shard)) else {
            return;
        };
        let mut state = cell.lock();
        if epoch < state.known_epoch {
            return;
        }
        state.note_held(writing.version().position);
        state.learn(epoch, primary);
        if epoch == state.known_epoch {
            state.known_primary = Some(primary.to_owned());
        }
        match &mut state.role {
            Role::Replica(f) if f.primary == primary && f.epoch >= epoch => return,
            Role::Replica(f) if f.primary == primary => {
                f.epoch = epoch;
                f.in_step = false;
            }
            Role::Primary { .. } | Role::Recovering { .. } => {
                self.step_down_locked(shard, &mut state, "another server holds a newer epoch");
                state.role = Role::Replica(Follow::new(primary.to_owned(), epoch));
            }
            _ => {
                state.role =
                    Role::Replica(Follow::replacing(&state.role, primary.to_owned(), epoch))
            }
        }
        drop(state);
        drop(writing);
        self.spawn_attach(shard);
    }

    /// A replica told this server that `hint.primary` leads `hint.shard` at
    /// a newer epoch: it follows that primary (stepping down).
    pub(super) fn deposed(&self, hint: &NotPrimary, from: &str) {
        tracing::warn!(shard = hint.shard, replica = from, primary = %hint.primary, epoch = hint.epoch, "a replica follows a newer primary");
        if hint.primary.is_empty() {
            self.stand_down(hint.shard);
        } else {
            self.follow(hint.shard, &hint.primary, hint.epoch);
        }
    }

    /// `shard` has no primary now (its lease expired): this server stops
    /// being its primary, or a replica of the old one. Its copy is still
    /// served.
    pub fn stand_down(&self, shard: u32) {
        let (Some(cell), Some(_writing)) = (self.cell(shard), self.store.lock_shard(shard)) else {
            return;
        };
        let mut state = cell.lock();
        self.step_down_locked(shard, &mut state, "the shard has no primary any more");
    }

    /// Stops taking Pushes of `shard` (a primary shutting down) while what
    /// is queued still reaches the replicas ([`Replication::drain`]).
    pub fn stand_down_for_handover(&self, shard: u32) {
        let (Some(cell), Some(_writing)) = (self.cell(shard), self.store.lock_shard(shard)) else {
            return;
        };
        let mut state = cell.lock();
        if state.primary_epoch().is_some() {
            state.handing_over = true;
        }
    }

    /// Waits until every queued forward reached its replica, or `within`
    /// passed.
    pub async fn drain(&self, within: Duration) {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline && !self.forwarders.iter().all(|f| f.is_drained()) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The version of this server's copy of `shard` (default when not
    /// hosted).
    pub fn store_version(&self, shard: u32) -> Version {
        self.store.version(shard).unwrap_or_default()
    }

    /// Marks `shard` as recovering under `epoch` (0: not known yet): its
    /// Pushes and Fetches are refused until [`Replication::lead`].
    pub fn begin_recovery(&self, shard: u32, epoch: u64) {
        let (Some(cell), Some(_writing)) = (self.cell(shard), self.store.lock_shard(shard)) else {
            return;
        };
        let mut state = cell.lock();
        if state.primary_epoch().is_some() {
            self.step_down_locked(shard, &mut state, "recovering again");
        }
        state.note_held(self.store.version(shard).map_or(0, |v| v.position));
        // The epoch won is the newest there is: the old primary's stream is
        // refused (and told so) from now on, so it cannot get a Push
        // confirmed here while this server takes over.
        state.learn(epoch, &self.me);
        state.role = Role::Recovering { epoch };
    }

    /// Makes this server the primary of `shard` under `epoch`, from the
    /// copy it holds now (after [`Replication::recover`]). Refused when a
    /// newer epoch is known.
    pub fn lead(&self, shard: u32, epoch: u64) -> Result<(), RecoveryError> {
        let (Some(cell), Some(writing)) = (self.cell(shard), self.store.lock_shard(shard)) else {
            return Err(RecoveryError::NotHosted(shard));
        };
        let mut state = cell.lock();
        if state.known_epoch > epoch {
            return Err(RecoveryError::Superseded {
                shard,
                known: state.known_epoch,
            });
        }
        let base = writing.version();
        // Replicas attach to the new stream afresh: detached before the
        // locks go, so that no replica's attachment (a Sync, which needs
        // the role and the lock) can fall in between and be undone.
        for forwarder in &self.forwarders {
            if forwarder.shards.contains(&shard) {
                forwarder.detach(shard, None);
            }
        }
        state.role = Role::Primary { epoch, base };
        state.handing_over = false;
        state.known_epoch = epoch;
        state.known_primary = Some(self.me.clone());
        state.has_copy = true;
        drop(state);
        drop(writing);
        for forwarder in &self.forwarders {
            if forwarder.shards.contains(&shard) {
                forwarder.nudge();
            }
        }
        metrics::counter!("tessera_ps_primary_takeovers_total").increment(1);
        metrics::gauge!("tessera_ps_shard_epoch", "shard" => shard.to_string()).set(epoch as f64);
        tracing::info!(shard, epoch, from = %base, "primary of the shard");
        Ok(())
    }

    /// The newest epoch whose primary's every acknowledged Push this
    /// process's copy of `shard` held (`in_step`); 0: none.
    pub fn in_step_epoch(&self, shard: u32) -> u64 {
        let position = self.store.version(shard).map_or(0, |v| v.position);
        self.cell(shard)
            .map_or(0, |c| c.lock().in_step_epoch(position))
    }

    /// The newest epoch this server has heard of for `shard`.
    pub fn known_epoch(&self, shard: u32) -> u64 {
        self.cell(shard).map_or(0, |c| c.lock().known_epoch)
    }

    /// Whether this server's copy of `shard` follows its primary's stream
    /// in order (a replica that may take over without losing Pushes).
    pub fn in_step(&self, shard: u32) -> bool {
        self.cell(shard)
            .is_some_and(|c| matches!(&c.lock().role, Role::Replica(f) if f.in_step && !f.syncing))
    }
}
