//! One hosted shard's place in replication: its role (primary, replica,
//! recovering, none), the newest epoch heard of for it, and, on a replica,
//! its view of the primary's stream.
//!
//! Lock order: a caller that needs both takes the store's shard write lock
//! ([`tessera_store::store::Store::lock_shard`]) before a cell's state; every
//! change of role happens under both, so that a Push (which holds the write
//! lock from its admission to its stream position) never straddles one.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tessera_rpc::sync::LockExt;

use tessera_proto::v1::{self, NotPrimary};

use tessera_store::version::Version;

/// A replica's view of the primary it follows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Follow {
    /// The primary's address.
    pub primary: String,
    /// The primary's epoch (0: not learned yet).
    pub epoch: u64,
    /// This copy is a prefix of the primary's stream and the forwarded
    /// Pushes apply to it in order.
    pub in_step: bool,
    /// A copy from the primary is being fetched.
    pub syncing: bool,
    /// When the primary's stream (Pushes or a heartbeat) was last heard.
    pub last_heard: Option<Instant>,
    /// The primary's head as last heard.
    pub head: Version,
    /// The attachment task working for this follow (its number, from
    /// [`ShardCell::next_attachment`]; 0: none yet).
    pub attach: u64,
    /// The primary's number for this replica's attachment to its stream
    /// (from the Sync answer); heads under another one mean the primary
    /// does not forward to this replica under it.
    pub attachment: u64,
    /// Under this attachment: the primary counts this replica among those
    /// it waits for, and acknowledged Pushes up to this position without
    /// it (`StreamHead.acked_alone_through`); `None` until a head says it
    /// counts this replica.
    pub counted_through: Option<u64>,
}

impl Follow {
    pub fn new(primary: String, epoch: u64) -> Self {
        Self {
            primary,
            epoch,
            in_step: false,
            syncing: false,
            last_heard: None,
            head: Version::default(),
            attach: 0,
            attachment: 0,
            counted_through: None,
        }
    }

    /// Whether this copy, at `position`, holds every Push the primary
    /// acknowledged: in step, counted by the primary, and past what it
    /// acknowledged without this replica.
    pub fn holds_every_ack(&self, position: u64) -> bool {
        self.in_step
            && self
                .counted_through
                .is_some_and(|through| position >= through)
    }

    /// A follow of `primary` at `epoch` taking over what `previous` was
    /// doing: a running attachment goes on (towards the new primary)
    /// rather than a second one starting.
    pub fn replacing(previous: &Role, primary: String, epoch: u64) -> Self {
        let mut next = Self::new(primary, epoch);
        if let Role::Replica(old) = previous {
            next.syncing = old.syncing;
            next.attach = old.attach;
        }
        next
    }
}

/// What a server is for one of its shards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Role {
    /// No primary known (a failover in progress), or not decided yet.
    Idle,
    /// Becoming the primary under `epoch` (0 in static mode until the
    /// replicas have answered): copying the freshest copy first.
    Recovering { epoch: u64 },
    /// The primary under `epoch`, which started from `base`.
    Primary { epoch: u64, base: Version },
    /// Following a primary.
    Replica(Follow),
}

/// The replication state of one shard (module docs).
#[derive(Debug)]
pub(crate) struct ShardState {
    pub role: Role,
    /// The newest epoch heard of for the shard, and its primary.
    pub known_epoch: u64,
    pub known_primary: Option<String>,
    /// This process holds a complete copy: it synced from a primary or
    /// recovered as one since it started. A checkpoint alone does not
    /// count: it is only a candidate for recovery.
    pub has_copy: bool,
    /// The newest epoch whose primary's every acknowledged Push this
    /// process's copy held (as that primary, or as a replica in step with
    /// it), as recorded; [`ShardState::in_step_epoch`] adds the current
    /// role's. 0: none since this process started.
    pub held_epoch: u64,
    /// A primary handing the shard over (shutting down): it takes no more
    /// Pushes while its queues drain to the replicas.
    pub handing_over: bool,
    /// Pushes forwarded while the shard is being copied (a replica).
    pub pending: super::pending::Pending,
}

impl ShardState {
    /// The newest epoch whose every acknowledged Push this copy, at
    /// `position`, holds (the in-step record's measure, see `in_step`).
    pub fn in_step_epoch(&self, position: u64) -> u64 {
        let current = match &self.role {
            Role::Primary { epoch, .. } => *epoch,
            Role::Replica(f) if f.holds_every_ack(position) => f.epoch,
            _ => 0,
        };
        self.held_epoch.max(current)
    }

    /// Records what [`ShardState::in_step_epoch`] says now, before the
    /// role changes.
    pub fn note_held(&mut self, position: u64) {
        self.held_epoch = self.in_step_epoch(position);
    }

    fn readable(&self) -> bool {
        match &self.role {
            Role::Primary { .. } => true,
            // A replica becoming primary serves the copy it holds while it
            // asks the others for a fresher one (which is installed under
            // the shard's write lock, all at once): its readers see what
            // they saw a moment ago, where refusing them left the shard
            // with no reader at all when the old primary was gone (a
            // graceful restart under etcd failed Fetches for the recovery's
            // wait on the dying server). A restarted server holds no copy
            // yet and still answers nothing.
            Role::Recovering { .. } => self.has_copy,
            // Likewise a replica copying a newer copy (staged aside and
            // swapped in at once, `sync::Staged`): it serves the complete
            // copy it holds. Refusing left a shard with no reader while a
            // new primary recovered from this very copy (the fault soak:
            // 205 Fetches failed, the replica following the recovering
            // primary and marked copying before any copy could start).
            Role::Replica(_) => self.has_copy,
            Role::Idle => self.has_copy,
        }
    }

    /// The epoch, when this server is the primary.
    pub fn primary_epoch(&self) -> Option<u64> {
        match self.role {
            Role::Primary { epoch, .. } => Some(epoch),
            _ => None,
        }
    }

    /// Notes that `primary` holds `epoch`, if that is newer than anything
    /// heard; returns whether it was.
    pub fn learn(&mut self, epoch: u64, primary: &str) -> bool {
        if epoch > self.known_epoch {
            self.known_epoch = epoch;
            self.known_primary = Some(primary.to_owned());
            true
        } else {
            false
        }
    }

    /// Where a Push refused here should go.
    pub fn redirect(&self, shard: u32) -> NotPrimary {
        NotPrimary {
            shard,
            primary: self.known_primary.clone().unwrap_or_default(),
            epoch: self.known_epoch,
        }
    }

    /// The role as Health reports it.
    pub fn health_role(&self) -> v1::ShardRole {
        match self.role {
            Role::Primary { .. } => v1::ShardRole::Primary,
            Role::Replica(_) => v1::ShardRole::Replica,
            Role::Recovering { .. } => v1::ShardRole::Recovering,
            Role::Idle => v1::ShardRole::NoPrimary,
        }
    }

    /// Whether a replica has heard its primary within `stale_after`
    /// (`None`: not a replica).
    pub fn receiving(&self, now: Instant, stale_after: Duration) -> Option<bool> {
        match &self.role {
            Role::Replica(f) => Some(
                f.last_heard
                    .is_some_and(|t| now.saturating_duration_since(t) < stale_after),
            ),
            _ => None,
        }
    }
}

/// One hosted shard: its state, and whether Fetches of it are served (a
/// flag every Fetch reads without taking the lock).
#[derive(Debug)]
pub(crate) struct ShardCell {
    pub shard: u32,
    state: Mutex<ShardState>,
    readable: AtomicBool,
    /// Wakes a replica's attachment that is waiting to retry (there is
    /// news: a new primary, a new epoch).
    pub retry_now: tokio::sync::Notify,
    attachments: std::sync::atomic::AtomicU64,
}

/// The locked state of a cell; publishes whether the shard is readable
/// when dropped.
pub(crate) struct StateGuard<'a> {
    cell: &'a ShardCell,
    state: MutexGuard<'a, ShardState>,
}

impl std::ops::Deref for StateGuard<'_> {
    type Target = ShardState;
    fn deref(&self) -> &ShardState {
        &self.state
    }
}

impl std::ops::DerefMut for StateGuard<'_> {
    fn deref_mut(&mut self) -> &mut ShardState {
        &mut self.state
    }
}

impl Drop for StateGuard<'_> {
    fn drop(&mut self) {
        self.cell
            .readable
            .store(self.state.readable(), Ordering::Release);
    }
}

impl ShardCell {
    /// A shard with no role yet.
    pub fn new(shard: u32) -> Self {
        Self {
            shard,
            state: Mutex::new(ShardState {
                role: Role::Idle,
                known_epoch: 0,
                known_primary: None,
                has_copy: false,
                held_epoch: 0,
                handing_over: false,
                pending: super::pending::Pending::default(),
            }),
            readable: AtomicBool::new(false),
            retry_now: tokio::sync::Notify::new(),
            attachments: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// A number for a new attachment task (never 0).
    pub fn next_attachment(&self) -> u64 {
        self.attachments.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Its state, locked.
    pub fn lock(&self) -> StateGuard<'_> {
        StateGuard {
            cell: self,
            state: self.state.locked(),
        }
    }

    /// Whether Fetches are served.
    pub fn readable(&self) -> bool {
        self.readable.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replica_holds_every_ack_once_counted_and_past_what_was_acked_without_it() {
        let mut f = Follow::new("p".into(), 2);
        f.in_step = true;
        assert!(
            !f.holds_every_ack(100),
            "the primary has not counted it yet"
        );
        f.counted_through = Some(12);
        assert!(!f.holds_every_ack(11));
        assert!(f.holds_every_ack(12));
        f.in_step = false;
        assert!(!f.holds_every_ack(12), "out of the stream");
    }

    #[test]
    fn only_complete_copies_are_readable() {
        let cell = ShardCell::new(3);
        assert!(!cell.readable(), "a fresh process serves nothing");
        {
            let mut s = cell.lock();
            s.role = Role::Replica(Follow::new("p".into(), 4));
        }
        assert!(!cell.readable(), "no copy yet");
        {
            let mut s = cell.lock();
            s.has_copy = true;
        }
        assert!(cell.readable());
        {
            let mut s = cell.lock();
            if let Role::Replica(f) = &mut s.role {
                f.syncing = true;
            }
        }
        assert!(
            cell.readable(),
            "a complete copy is served while a newer one is copied"
        );
        {
            let mut s = cell.lock();
            s.role = Role::Recovering { epoch: 5 };
            s.has_copy = false;
        }
        assert!(
            !cell.readable(),
            "a recovering primary without a complete copy answers nothing"
        );
        {
            let mut s = cell.lock();
            s.has_copy = true;
        }
        assert!(
            cell.readable(),
            "a replica becoming primary serves the copy it holds"
        );
        {
            let mut s = cell.lock();
            s.role = Role::Idle;
        }
        assert!(
            cell.readable(),
            "during a failover the last copy is still served"
        );
    }

    #[test]
    fn only_newer_epochs_are_learned() {
        let cell = ShardCell::new(0);
        let mut s = cell.lock();
        assert!(s.learn(3, "a"));
        assert!(!s.learn(3, "b"));
        assert!(!s.learn(2, "c"));
        assert_eq!(s.redirect(0).primary, "a");
        assert!(s.learn(4, "b"));
        assert_eq!(
            (s.redirect(0).primary.as_str(), s.redirect(0).epoch),
            ("b", 4)
        );
    }
}
