//! The replica side: following a primary's stream, and attaching to it.
//!
//! A forwarded batch carries the sender's stream heads. For each shard the
//! replica decides: the sender is the primary it follows, and it is in step
//! (apply the Pushes, in order); the sender leads a newer epoch than any it
//! knew (follow it: attach); or the sender's epoch is older than one it
//! knows (refuse, and tell it who the primary is: the sender was deposed).
//! A gap, a Push out of order or a new primary makes it attach again.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_proto::v1::{
    NotPrimary, ReplicateRequest, ReplicateResponse, ReplicatedPush, ShardStatusResponse,
    StreamHead,
};

use super::Replication;
use super::shard::{Follow, Role};
use super::sync::{self, CopyError};
use tessera_store::store::PushId;
use tessera_store::version::Version;

/// What a replica does with one shard of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Head {
    /// Apply its Pushes.
    Accept(u64),
    /// The sender is not the shard's primary any more.
    Deposed(NotPrimary),
    /// Not in step: it attaches (again), and drops the shard's Pushes.
    OutOfStep,
    /// It is copying the shard: the sender should retry shortly.
    Syncing,
    /// From a batch sent before the current attachment: ignored, and its
    /// Pushes for the shard dropped.
    Stale,
}

/// What became of a Push forwarded for a shard being copied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hold {
    Held,
    /// Over `copy_buffer_bytes`: dropped, with everything held.
    Overflow,
    /// The shard is not being copied from the sender (any more).
    NotCopying,
}

/// What became of one forwarded Push.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Entry {
    Applied,
    Already,
    OutOfStep,
    /// Out of step, and an attachment must start (after the locks).
    Resync,
    Syncing,
}

impl Replication {
    /// Handles a batch of forwarded Pushes and heads from `request.primary`.
    pub(super) fn handle_replicate(&self, request: &ReplicateRequest) -> ReplicateResponse {
        let now = Instant::now();
        let sender = request.primary.as_str();
        let mut answer = ReplicateResponse::default();
        let mut accepted: HashMap<u32, u64> = HashMap::new();
        let mut dropped: HashSet<u32> = HashSet::new();
        let mut syncing: HashSet<u32> = HashSet::new();
        for head in &request.heads {
            match self.on_head(sender, head, now) {
                Head::Accept(epoch) => {
                    accepted.insert(head.shard, epoch);
                }
                Head::Deposed(hint) => {
                    answer.deposed.push(hint);
                    dropped.insert(head.shard);
                }
                Head::OutOfStep => {
                    answer.out_of_sync.push(head.shard);
                    dropped.insert(head.shard);
                }
                Head::Syncing => {
                    syncing.insert(head.shard);
                }
                Head::Stale => {
                    dropped.insert(head.shard);
                }
            }
        }
        for entry in &request.pushes {
            if dropped.contains(&entry.shard) {
                answer.processed += 1;
                continue;
            }
            if syncing.contains(&entry.shard) {
                // Held to apply after the copy; other shards go on.
                let head = request.heads.iter().find(|h| h.shard == entry.shard);
                match head.map(|head| self.hold(sender, head, entry)) {
                    Some(Hold::Held) => {}
                    Some(Hold::Overflow) => {
                        // Over the bound: the primary cuts the shard off;
                        // it is copied again after this copy.
                        answer.out_of_sync.push(entry.shard);
                        dropped.insert(entry.shard);
                    }
                    // The copy was installed since the head was read: the
                    // primary sends it again, to be applied.
                    Some(Hold::NotCopying) | None => {
                        answer.syncing = true;
                        break;
                    }
                }
                answer.processed += 1;
                continue;
            }
            let Some(&epoch) = accepted.get(&entry.shard) else {
                // No head: not a stream this replica follows.
                answer.out_of_sync.push(entry.shard);
                dropped.insert(entry.shard);
                answer.processed += 1;
                continue;
            };
            match self.apply_forwarded(sender, epoch, entry, now) {
                Entry::Applied | Entry::Already => answer.processed += 1,
                Entry::OutOfStep => {
                    answer.out_of_sync.push(entry.shard);
                    dropped.insert(entry.shard);
                    accepted.remove(&entry.shard);
                    answer.processed += 1;
                }
                Entry::Resync => {
                    answer.out_of_sync.push(entry.shard);
                    dropped.insert(entry.shard);
                    accepted.remove(&entry.shard);
                    answer.processed += 1;
                }
                Entry::Syncing => {
                    answer.syncing = true;
                    break;
                }
            }
        }
        for (&shard, &epoch) in &accepted {
            if let Some(version) = self.store.version(shard) {
                answer.applied.push(StreamHead {
                    shard,
                    epoch,
                    position: version.position,
                    ..StreamHead::default()
                });
            }
        }
        answer
    }

    fn on_head(&self, sender: &str, head: &StreamHead, now: Instant) -> Head {
        let (Some(cell), Some(writing)) =
            (self.cell(head.shard), self.store.lock_shard(head.shard))
        else {
            return Head::OutOfStep;
        };
        let mut state = cell.lock();
        // What this copy held under the role it had, before this head
        // changes it (the in-step record's measure).
        state.note_held(writing.version().position);
        if head.epoch < state.known_epoch {
            metrics::counter!("tessera_ps_replication_stale_epoch_total").increment(1);
            return Head::Deposed(state.redirect(head.shard));
        }
        let mut attach = false;
        let decision = if state.learn(head.epoch, sender) {
            // A newer primary than any known: follow it.
            if state.primary_epoch().is_some() {
                self.step_down_locked(head.shard, &mut state, "a newer primary forwards the shard");
            }
            match &mut state.role {
                Role::Replica(f) if f.primary == sender && f.syncing => {
                    // The first head of the primary this replica is
                    // attaching to, arriving before its Sync answer: the
                    // attachment under way covers it (answering out of
                    // sync would make the primary end that very attachment,
                    // and the replica copy the shard again once it is in).
                    f.epoch = head.epoch;
                    f.last_heard = Some(now);
                    f.head = Version::new(head.epoch, head.position);
                    drop(state);
                    drop(writing);
                    return Head::Syncing;
                }
                Role::Replica(f) if f.primary == sender => {
                    // Its new stream (a restarted primary): attach again,
                    // keeping an attachment that is already running.
                    f.epoch = head.epoch;
                    f.in_step = false;
                    f.last_heard = Some(now);
                    f.head = Version::new(head.epoch, head.position);
                }
                _ => {
                    let mut follow = Follow::replacing(&state.role, sender.to_owned(), head.epoch);
                    follow.last_heard = Some(now);
                    follow.head = Version::new(head.epoch, head.position);
                    state.role = Role::Replica(follow);
                }
            }
            attach = true;
            Head::OutOfStep
        } else {
            let sender_is_known = state.known_primary.as_deref() == Some(sender);
            match &mut state.role {
                Role::Replica(f) if f.primary == sender && f.epoch == head.epoch => {
                    f.last_heard = Some(now);
                    f.head = Version::new(head.epoch, head.position);
                    if f.syncing {
                        Head::Syncing
                    } else if f.in_step && head.attachment == f.attachment && !head.detached {
                        if head.counted {
                            f.counted_through =
                                Some(f.counted_through.unwrap_or(0).max(head.acked_alone_through));
                        }

                        Head::Accept(head.epoch)
                    } else if f.in_step && head.attachment < f.attachment {
                        // A batch built before this replica attached,
                        // arriving late: nothing in it is for the current
                        // attachment (which it must not end).
                        metrics::counter!("tessera_ps_replication_stale_heads_total").increment(1);
                        Head::Stale
                    } else {
                        if f.in_step {
                            // In step by this replica's account, but the
                            // primary does not forward to it under that
                            // attachment (it detached it): attach again.
                            metrics::counter!("tessera_ps_replication_lost_attachments_total")
                                .increment(1);
                            tracing::info!(
                                shard = head.shard,
                                primary = sender,
                                "the primary's stream no longer includes this replica; attaching again"
                            );
                            f.in_step = false;
                        }
                        attach = true;
                        Head::OutOfStep
                    }
                }
                Role::Replica(_) if sender_is_known => {
                    // The known primary of the newest epoch: follow it.
                    let mut follow = Follow::replacing(&state.role, sender.to_owned(), head.epoch);
                    follow.last_heard = Some(now);
                    state.role = Role::Replica(follow);
                    attach = true;
                    Head::OutOfStep
                }
                _ => Head::OutOfStep,
            }
        };
        state.note_held(writing.version().position);
        drop(state);
        drop(writing);
        if attach {
            self.spawn_attach(head.shard);
        }
        decision
    }

    fn apply_forwarded(
        &self,
        sender: &str,
        epoch: u64,
        entry: &ReplicatedPush,
        now: Instant,
    ) -> Entry {
        let (Some(cell), Some(mut writing)) =
            (self.cell(entry.shard), self.store.lock_shard(entry.shard))
        else {
            return Entry::OutOfStep;
        };
        let mut state = cell.lock();
        match self.apply_locked(&mut writing, &mut state, sender, epoch, entry, now) {
            Entry::Resync => {
                drop(state);
                drop(writing);
                self.spawn_attach(entry.shard);
                Entry::OutOfStep
            }
            other => other,
        }
    }

    /// Applies a forwarded Push to the shard `writing` locks, whose state
    /// is `state`; [`Entry::Resync`] asks the caller to attach again once
    /// it has released both.
    fn apply_locked(
        &self,
        writing: &mut tessera_store::store::ShardGuard<'_>,
        state: &mut super::shard::StateGuard<'_>,
        sender: &str,
        epoch: u64,
        entry: &ReplicatedPush,
        now: Instant,
    ) -> Entry {
        let Role::Replica(follow) = &mut state.role else {
            return Entry::OutOfStep;
        };
        if follow.syncing {
            return Entry::Syncing;
        }
        if follow.primary != sender || follow.epoch != epoch || !follow.in_step {
            return Entry::OutOfStep;
        }
        let version = writing.version();
        if !entry.gap && entry.position <= version.position {
            return Entry::Already;
        }
        if entry.gap || version.position.checked_add(1) != Some(entry.position) {
            follow.in_step = false;
            metrics::counter!("tessera_ps_replication_out_of_sync_total").increment(1);
            return Entry::Resync;
        }
        if let Some(expired) = &entry.expired {
            let expired = tessera_store::store::Expired {
                table: expired.table.clone(),
                keys: expired.keys.clone(),
                pass_done: false,
            };
            if let Err(err) = self.store.apply_expired(writing, &expired) {
                metrics::counter!("tessera_ps_replication_apply_failures_total").increment(1);
                tracing::error!(shard = entry.shard, %err, "a forwarded expiry step does not apply here; copying the shard again");
                follow.in_step = false;
                return Entry::Resync;
            }
        }
        if let Some(push) = &entry.push {
            let checked = if push.shard == entry.shard {
                self.store.check_push(
                    &push.table,
                    push.shard,
                    &push.keys,
                    &push.gradients,
                    PushId {
                        worker: push.worker_id,
                        sequence: push.sequence,
                    },
                )
            } else {
                Err(tessera_store::store::StoreError::ShardNotHosted {
                    shard: push.shard,
                    hosted: vec![entry.shard],
                })
            };
            let evictions: Vec<tessera_store::table::Eviction> = entry
                .evicted_before
                .iter()
                .zip(&entry.evicted_keys)
                .map(|(&before, &key)| tessera_store::table::Eviction { before, key })
                .collect();
            let applied = checked.and_then(|checked| {
                if entry.evicted_before.len() != entry.evicted_keys.len() {
                    return Err(tessera_store::store::StoreError::BadEvictions {
                        keys: push.keys.len(),
                    });
                }
                checked.apply_replicated(writing, &evictions, &entry.not_admitted, now, entry.stamp)
            });
            if let Err(err) = applied {
                // The primary applied it, so this server is configured
                // differently (a table, a dimension): it must not claim
                // the primary's version. It copies the shard again, and
                // says why until the configurations agree.
                metrics::counter!("tessera_ps_replication_apply_failures_total").increment(1);
                tracing::error!(shard = entry.shard, %err, "a forwarded push does not apply here; copying the shard again");
                follow.in_step = false;
                return Entry::Resync;
            }
        }
        writing.set_version(Version::new(epoch, entry.position));
        Entry::Applied
    }

    /// Holds a Push forwarded by `sender` for a shard it is copying from
    /// it (see [`super::pending`]). Checked again under the cell's lock:
    /// the copy may have been installed since the batch's heads were read,
    /// and a Push held then would never be applied.
    fn hold(&self, sender: &str, head: &StreamHead, entry: &ReplicatedPush) -> Hold {
        let Some(cell) = self.cell(entry.shard) else {
            return Hold::NotCopying;
        };
        let mut state = cell.lock();
        match &state.role {
            Role::Replica(f) if f.syncing && f.primary == sender && f.epoch == head.epoch => {}
            _ => return Hold::NotCopying,
        }
        let held = state.pending.hold(
            super::pending::Held {
                attachment: head.attachment,
                epoch: head.epoch,
                entry: entry.clone(),
            },
            self.copy_buffer_bytes,
        );
        if held { Hold::Held } else { Hold::Overflow }
    }

    /// Starts attaching `shard` to the primary it follows, unless an
    /// attachment is running.
    pub(super) fn spawn_attach(&self, shard: u32) {
        let Some(cell) = self.cell(shard) else { return };
        let attachment = {
            let mut state = cell.lock();
            let Role::Replica(follow) = &mut state.role else {
                return;
            };
            if follow.syncing {
                // One is running: let it try again now, towards the
                // primary it follows now.
                cell.retry_now.notify_one();
                return;
            }
            follow.syncing = true;
            follow.in_step = false;
            follow.attach = cell.next_attachment();
            let attach = follow.attach;
            // Pushes held for an earlier attachment will not apply.
            state.pending.clear();
            attach
        };
        let Some(this) = self.weak.upgrade() else {
            return;
        };
        let stop = self.stop.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = this.attach_loop(shard, attachment) => {}
                _ = stop.cancelled() => {}
            }
        });
    }

    /// Attaches until in step, as long as the shard follows a primary with
    /// this `attachment` working for it.
    async fn attach_loop(self: Arc<Self>, shard: u32, attachment: u64) {
        let mut backoff = Duration::from_millis(50);
        loop {
            let target = {
                let Some(cell) = self.cell(shard) else { return };
                let mut state = cell.lock();
                match &mut state.role {
                    Role::Replica(follow) if follow.attach == attachment => {
                        follow.syncing = true;
                        follow.primary.clone()
                    }
                    _ => return,
                }
            };
            let pause = match Arc::clone(&self)
                .attach_once(shard, &target, attachment)
                .await
            {
                Ok(()) => return,
                // The primary changed under it: again, shortly.
                Err(CopyError::Superseded) => Duration::from_millis(20),
                Err(err) => {
                    if matches!(err, CopyError::Older { .. }) {
                        metrics::counter!("tessera_ps_replication_older_copies_refused_total")
                            .increment(1);
                        tracing::error!(shard, primary = %target, %err, "refusing to copy an older copy of the shard");
                    } else {
                        tracing::info!(shard, primary = %target, %err, "attaching to the primary failed; retrying");
                    }
                    let pause = backoff;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                    pause
                }
            };
            if let Some(cell) = self.cell(shard) {
                tokio::select! {
                    _ = tokio::time::sleep(pause) => {}
                    _ = cell.retry_now.notified() => {}
                }
            }
        }
    }

    /// One attachment of `shard` to `target`: in step already, or a copy
    /// (installed off the async threads: it holds the shard's write lock
    /// for as long as the copy takes).
    async fn attach_once(
        self: Arc<Self>,
        shard: u32,
        target: &str,
        attachment: u64,
    ) -> Result<(), CopyError> {
        let own = self.store.version(shard).unwrap_or_default();
        let started = Instant::now();
        let fetched = self.fetch_copy(shard, target, own, true).await?;
        let target = target.to_owned();
        tokio::task::spawn_blocking(move || {
            self.install_attached(shard, &target, attachment, fetched, started)
        })
        .await
        .map_err(|_| CopyError::Superseded)?
    }

    fn install_attached(
        &self,
        shard: u32,
        target: &str,
        attachment: u64,
        mut fetched: sync::Fetched,
        started: Instant,
    ) -> Result<(), CopyError> {
        let (Some(cell), Some(mut writing)) = (self.cell(shard), self.store.lock_shard(shard))
        else {
            return Err(CopyError::Superseded);
        };
        let mut state = cell.lock();
        if fetched.epoch < state.known_epoch {
            return Err(CopyError::Superseded);
        }
        match &state.role {
            Role::Replica(f) if f.primary == target && f.attach == attachment => {}
            _ => return Err(CopyError::Superseded),
        }
        let offered = fetched.version;
        // Never back: a copy older than what the shard holds now (another
        // attachment got further meanwhile) is not installed.
        if offered < writing.version() {
            return Err(CopyError::Older {
                offered,
                own: writing.version(),
            });
        }
        let copy = fetched.copy.take();
        let copied = copy.as_ref().map(|copy| copy.bytes);
        let (rows, old_rows) = match copy {
            Some(copy) => {
                let (rows, old) = copy.install(&self.store, &writing, Instant::now());
                (Some(rows), old)
            }
            None => (None, Vec::new()),
        };
        // After the install: what it drops is in the copy.
        fetched.keep_origins(&self.store, &writing);
        writing.set_version(offered);
        state.learn(fetched.epoch, target);
        state.has_copy = true;
        if let Role::Replica(f) = &mut state.role {
            f.epoch = fetched.epoch;
            f.attachment = fetched.attachment;
            f.counted_through = None;
            f.in_step = true;
            f.syncing = false;
            f.last_heard = Some(Instant::now());
        }
        // The Pushes forwarded while the copy was on its way, after it.
        let (held, overflowed) = state.pending.take(fetched.epoch, fetched.attachment);
        let mut replayed = 0usize;
        let mut resync = overflowed;
        for held in held
            .iter()
            .filter(|h| h.entry.gap || h.entry.position > offered.position)
        {
            match self.apply_locked(
                &mut writing,
                &mut state,
                target,
                held.epoch,
                &held.entry,
                Instant::now(),
            ) {
                Entry::Applied | Entry::Already => replayed += 1,
                _ => {
                    resync = true;
                    break;
                }
            }
        }
        if resync && let Role::Replica(f) = &mut state.role {
            f.in_step = false;
        }
        let version = writing.version();
        drop(state);
        drop(writing);
        drop(old_rows);
        if let Some(bytes) = copied {
            self.syncs
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            metrics::counter!("tessera_ps_replication_syncs_total").increment(1);
            tracing::info!(shard, primary = target, copied = %offered, %version, rows, bytes, replayed, took = ?started.elapsed(), "shard copied from its primary");
        } else {
            tracing::info!(shard, primary = target, %version, replayed, "replica in step with its primary without a copy");
        }
        if resync {
            tracing::info!(
                shard,
                primary = target,
                overflowed,
                "pushes held during the copy do not follow it; copying again"
            );
            self.spawn_attach(shard);
        }
        Ok(())
    }

    /// What this server holds of `shard`.
    pub(super) fn shard_status(&self, shard: u32) -> ShardStatusResponse {
        let (Some(cell), Some(version)) = (self.cell(shard), self.store.version(shard)) else {
            return ShardStatusResponse::default();
        };
        let state = cell.lock();
        ShardStatusResponse {
            hosted: true,
            version: Some(crate::wire::version_to_wire(version)),
            known_epoch: state.known_epoch,
            primary_head: match &state.role {
                Role::Replica(f) => Some(crate::wire::version_to_wire(f.head)),
                _ => None,
            },
            in_step_epoch: state.in_step_epoch(version.position),
        }
    }
}
