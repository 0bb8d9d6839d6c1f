//! Forwarding a primary's Pushes to one replica.
//!
//! A primary keeps one [`Forwarder`] per peer that hosts one of its shards.
//! Its queue holds the Pushes applied since the peer attached, in stream
//! order, for every shard the peer is *attached* to (it copied the shard,
//! or was found in step, when it called `Sync`). A task sends the queue in
//! batches with the stream heads of every shard this server is primary of,
//! and an empty batch every `heartbeat_ms` when there is nothing to send,
//! so that the replica hears the stream even when it is idle.
//!
//! Per attached shard the forwarder counts what is queued and what the
//! replica confirmed it applied:
//!
//! - **Cut-off**: a shard whose queue reaches `max_lag_pushes` is cut off:
//!   its entries are dropped, a gap marker tells the replica, and nothing
//!   more is queued for it until it copies the shard again. Each shard is
//!   counted on its own, so one busy shard cannot cut off the others.
//! - **Acknowledgements** (`ack = "replicas"`): a Push waits until every
//!   replica that is *confirmed* (it reported applying the stream since it
//!   attached) has applied its position; a confirmed replica that does not
//!   within `replica_timeout_ms` is cut off instead, so a dead replica
//!   stalls Pushes once, for that long. A replica still fetching its copy
//!   is not waited for: its place in step is not earned yet.
//!
//! Each attachment has a generation, bumped whenever it changes, so that a
//! late answer to an old batch cannot undo a newer attachment.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};
use tessera_rpc::sync::lock;

use tessera_proto::v1::{
    ExpiredRows, PushRequest, ReplicateRequest, ReplicateResponse, ReplicatedPush,
    ReplicationClient,
};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::Replication;

/// One queued forward, with a local id to acknowledge it by. The Push is
/// shared by every replica's queue (one copy per Push, not per replica);
/// `None` is a gap marker.
#[derive(Debug, Clone)]
pub(crate) struct Queued {
    id: u64,
    shard: u32,
    epoch: u64,
    position: u64,
    push: Option<Arc<Forwarded>>,
}

/// A Push as the primary applied it, for its replicas: the request and
/// the rows its application evicted; or an expiry step of its sweep.
#[derive(Debug, Default)]
pub(crate) struct Forwarded {
    /// The Push (unused for an expiry step).
    pub request: PushRequest,
    /// See `ReplicatedPush.stamp`.
    pub stamp: u32,
    /// An expiry step instead of a Push (`ReplicatedPush.expired`).
    pub expired: Option<ExpiredRows>,
    /// See `ReplicatedPush.evicted_before` in `ps.proto`.
    pub evicted_before: Vec<u32>,
    /// See `ReplicatedPush.evicted_keys`.
    pub evicted_keys: Vec<u64>,
    /// See `ReplicatedPush.not_admitted`.
    pub not_admitted: Vec<u32>,
}

impl Queued {
    /// The entry as sent (prost encodes owned messages).
    fn to_wire(&self) -> ReplicatedPush {
        let expired = self.push.as_ref().and_then(|p| p.expired.clone());
        ReplicatedPush {
            shard: self.shard,
            position: self.position,
            push: self
                .push
                .as_ref()
                .filter(|p| p.expired.is_none())
                .map(|p| p.request.clone()),
            gap: self.push.is_none(),
            expired,
            stamp: self.push.as_ref().map_or(0, |p| p.stamp),
            evicted_before: self
                .push
                .as_ref()
                .map(|p| p.evicted_before.clone())
                .unwrap_or_default(),
            evicted_keys: self
                .push
                .as_ref()
                .map(|p| p.evicted_keys.clone())
                .unwrap_or_default(),
            not_admitted: self
                .push
                .as_ref()
                .map(|p| p.not_admitted.clone())
                .unwrap_or_default(),
        }
    }
}

/// One shard's attachment of the peer.
#[derive(Debug, Default, Clone)]
struct Attachment {
    attached: bool,
    /// The replica reported applying the stream since it attached: it is
    /// in step, and `ack = "replicas"` waits for it.
    confirmed: bool,
    generation: u64,
    /// Entries of the shard in the queue.
    queued: usize,
    /// The highest position it confirmed.
    applied: u64,
    /// The highest position queued for it while it was not confirmed (a
    /// Push acknowledged without it), or the position it attached at: it
    /// holds every acknowledged Push once it applied this.
    alone_through: u64,
}

/// Per shard: whether the replica is counted for acknowledgements (it is
/// confirmed), and the highest position acknowledged without it
/// (`StreamHead.counted`, `acked_alone_through`).
type Counted = HashMap<u32, (bool, u64)>;

/// Each shard's attachment generation if it was attached, else 0.
fn attached_generations(generations: &HashMap<u32, (u64, bool)>) -> HashMap<u32, u64> {
    generations
        .iter()
        .map(|(&s, &(g, attached))| (s, if attached { g } else { 0 }))
        .collect()
}

impl Attachment {
    /// Ends the attachment, with `queued` entries of the shard left in the
    /// queue (a gap marker, or none).
    fn end(&mut self, queued: usize) {
        self.attached = false;
        self.confirmed = false;
        self.generation += 1;
        self.queued = queued;
    }
}

#[derive(Debug, Default)]
struct PeerQueue {
    entries: VecDeque<Queued>,
    shards: HashMap<u32, Attachment>,
    next_id: u64,
}

/// Why a replica was cut off from a shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CutOff {
    /// Its queue reached `max_lag_pushes`.
    Lag,
    /// It did not confirm a Push within `replica_timeout_ms`.
    Timeout,
    /// The primary's rows changed outside the stream: a resize's
    /// receiving shard opening (`crate::reshard`).
    Resize,
}

/// How a wait for a replica's confirmation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Confirmation {
    /// It applied the position.
    Applied,
    /// It is no longer attached (cut off, out of sync, or this server
    /// stopped being the primary).
    Detached,
    /// The deadline passed first.
    TimedOut,
}

/// What one replica's forwarding needs to know.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ForwardSettings {
    pub max_lag: usize,
    pub batch: usize,
    pub heartbeat: Duration,
}

/// The forwarding of a primary's streams to one replica (module docs).
#[derive(Debug)]
pub(crate) struct Forwarder {
    pub addr: String,
    /// Shards this server and the peer both host.
    pub shards: Vec<u32>,
    queue: Mutex<PeerQueue>,
    /// New entries, or a new stream to announce.
    wake: Notify,
    /// Confirmations and detachments, for Pushes waiting on them.
    progress: Notify,
    client: ReplicationClient,
    settings: ForwardSettings,
    cutoffs: Arc<AtomicU64>,
}

impl Forwarder {
    pub fn new(
        addr: String,
        shards: Vec<u32>,
        client: ReplicationClient,
        settings: ForwardSettings,
        cutoffs: Arc<AtomicU64>,
    ) -> Self {
        Self {
            addr,
            shards,
            queue: Mutex::new(PeerQueue::default()),
            wake: Notify::new(),
            progress: Notify::new(),
            client,
            settings,
            cutoffs,
        }
    }

    /// Queues the Push at `position` of `shard` (applied under `epoch`,
    /// called under the shard's write lock, in stream order). Returns the
    /// attachment's generation when the replica is confirmed, i.e. when an
    /// acknowledgement should wait for it.
    pub fn enqueue(
        &self,
        shard: u32,
        epoch: u64,
        position: u64,
        push: &Arc<Forwarded>,
    ) -> Option<u64> {
        let mut queue = lock(&self.queue);
        let attachment = queue.shards.get(&shard)?;
        if !attachment.attached {
            return None;
        }
        if attachment.queued >= self.settings.max_lag {
            self.cut_off_locked(&mut queue, shard, epoch, position, CutOff::Lag);
            return None;
        }
        let id = queue.next_id;
        queue.next_id += 1;
        queue.entries.push_back(Queued {
            id,
            shard,
            epoch,
            position,
            push: Some(Arc::clone(push)),
        });
        let attachment = queue.shards.entry(shard).or_default();
        attachment.queued += 1;
        if !attachment.confirmed {
            attachment.alone_through = attachment.alone_through.max(position);
        }
        let wait = attachment.confirmed.then_some(attachment.generation);
        drop(queue);
        self.wake.notify_one();
        wait
    }

    /// The generation of `shard`'s attachment when the replica is confirmed
    /// (a duplicate Push waits for it to reach the head).
    pub fn confirmed_generation(&self, shard: u32) -> Option<u64> {
        let queue = lock(&self.queue);
        queue
            .shards
            .get(&shard)
            .filter(|a| a.attached && a.confirmed)
            .map(|a| a.generation)
    }

    fn cut_off_locked(
        &self,
        queue: &mut PeerQueue,
        shard: u32,
        epoch: u64,
        position: u64,
        why: CutOff,
    ) {
        queue.entries.retain(|q| q.shard != shard);
        let id = queue.next_id;
        queue.next_id += 1;
        // The replica learns of it from a gap marker in the stream.
        queue.entries.push_back(Queued {
            id,
            shard,
            epoch,
            position,
            push: None,
        });
        queue.shards.entry(shard).or_default().end(1);
        self.cutoffs.fetch_add(1, Ordering::Relaxed);
        let reason = match why {
            CutOff::Lag => "lag",
            CutOff::Timeout => "timeout",
            CutOff::Resize => "resize",
        };
        metrics::counter!("tessera_ps_replication_cutoffs_total", "reason" => reason).increment(1);
        tracing::warn!(peer = %self.addr, shard, reason, max_lag = self.settings.max_lag, "replica cut off from the shard until it copies it again");
        self.progress.notify_waiters();
        self.wake.notify_one();
    }

    /// Cuts the replica off from `shard` at `position` if it is attached
    /// (the primary's rows changed outside the stream): it attaches again
    /// and copies the shard.
    pub fn cut_off_for_resize(&self, shard: u32, epoch: u64, position: u64) {
        let mut queue = lock(&self.queue);
        if queue.shards.get(&shard).is_some_and(|a| a.attached) {
            self.cut_off_locked(&mut queue, shard, epoch, position, CutOff::Resize);
        }
    }

    /// Cuts the replica off from `shard` if its attachment is still
    /// `generation` (a confirmation that timed out).
    pub fn cut_off(&self, shard: u32, generation: u64, epoch: u64, position: u64) {
        let mut queue = lock(&self.queue);
        let current = queue
            .shards
            .get(&shard)
            .is_some_and(|a| a.attached && a.generation == generation);
        if current {
            self.cut_off_locked(&mut queue, shard, epoch, position, CutOff::Timeout);
        }
    }

    /// Attaches the replica to `shard` from `position` (the version of the
    /// copy it took, or holds already): older entries are in that copy.
    /// Returns the attachment's number, which every stream head to the
    /// replica carries from now on.
    pub fn attach(&self, shard: u32, position: u64) -> u64 {
        let mut queue = lock(&self.queue);
        queue.entries.retain(|q| q.shard != shard);
        let attachment = queue.shards.entry(shard).or_default();
        attachment.attached = true;
        attachment.confirmed = false;
        attachment.generation += 1;
        attachment.queued = 0;
        attachment.applied = position;
        attachment.alone_through = position;
        let generation = attachment.generation;
        drop(queue);
        self.progress.notify_waiters();
        self.wake.notify_one();
        generation
    }

    /// Detaches `shard` if its attachment is still the one in `seen` (the
    /// replica said it is out of sync in answer to a batch sent then), or
    /// unconditionally with `None` (this server stopped being its primary).
    pub fn detach(&self, shard: u32, seen: Option<u64>) {
        let mut queue = lock(&self.queue);
        let Some(attachment) = queue.shards.get(&shard) else {
            return;
        };
        if seen.is_some_and(|g| g != attachment.generation) {
            return;
        }
        queue.entries.retain(|q| q.shard != shard);
        queue.shards.entry(shard).or_default().end(0);
        drop(queue);
        self.progress.notify_waiters();
    }

    /// Whether nothing is queued for an attached shard.
    pub fn is_drained(&self) -> bool {
        let queue = lock(&self.queue);
        queue
            .entries
            .iter()
            .all(|q| !queue.shards.get(&q.shard).is_some_and(|a| a.attached))
    }

    /// Wakes the sending task (a new stream to announce at once).
    pub fn nudge(&self) {
        self.wake.notify_one();
    }

    /// Waits until the replica confirmed `position` of `shard` under
    /// attachment `generation`, or is detached, or `deadline` passes.
    pub async fn wait_applied(
        &self,
        shard: u32,
        generation: u64,
        position: u64,
        deadline: Instant,
    ) -> Confirmation {
        loop {
            let notified = self.progress.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let queue = lock(&self.queue);
                match queue.shards.get(&shard) {
                    Some(a) if a.attached && a.generation == generation => {
                        if a.applied >= position {
                            return Confirmation::Applied;
                        }
                    }
                    _ => return Confirmation::Detached,
                }
            }
            tokio::select! {
                _ = &mut notified => {}
                _ = tokio::time::sleep_until(deadline.into()) => return Confirmation::TimedOut,
            }
        }
    }

    /// (attached, in step, queued, applied) of `shard`, for Health; in
    /// step: confirmed, and it applied every Push acknowledged without it
    /// (while it was copying the shard).
    pub fn status(&self, shard: u32) -> (bool, bool, usize, u64) {
        let queue = lock(&self.queue);
        queue.shards.get(&shard).map_or((false, false, 0, 0), |a| {
            let holds_every_ack = a.confirmed && a.applied >= a.alone_through;
            (a.attached, holds_every_ack, a.queued, a.applied)
        })
    }

    /// Whether the replica holds the Push at `position` of `shard` and every
    /// one acknowledged before it: attached, confirmed, and past both
    /// (it may be listed in the in-step record).
    pub fn holds(&self, shard: u32, position: u64) -> bool {
        let queue = lock(&self.queue);
        queue.shards.get(&shard).is_some_and(|a| {
            a.attached && a.confirmed && a.applied >= a.alone_through.max(position)
        })
    }

    /// Takes up to a batch of entries to send, with every attachment's
    /// generation at that moment, and the shards attached then.
    fn pending(&self) -> (Vec<Queued>, HashMap<u32, (u64, bool)>, Counted) {
        let queue = lock(&self.queue);
        (
            queue
                .entries
                .iter()
                .take(self.settings.batch)
                .cloned()
                .collect(),
            queue
                .shards
                .iter()
                .map(|(&s, a)| (s, (a.generation, a.attached)))
                .collect(),
            queue
                .shards
                .iter()
                .map(|(&s, a)| (s, (a.attached && a.confirmed, a.alone_through)))
                .collect(),
        )
    }

    /// Takes the replica's answer to `sent` into account (`generations`:
    /// each shard's attachment when the batch was built, 0 if detached).
    fn acknowledge(
        &self,
        sent: &[Queued],
        answer: &ReplicateResponse,
        generations: &HashMap<u32, u64>,
    ) {
        let done = (answer.processed as usize).min(sent.len());
        let mut queue = lock(&self.queue);
        if let Some(last) = done.checked_sub(1).map(|i| sent[i].id) {
            while let Some(front) = queue.entries.front()
                && front.id <= last
            {
                let shard = front.shard;
                queue.entries.pop_front();
                if let Some(a) = queue.shards.get_mut(&shard) {
                    a.queued = a.queued.saturating_sub(1);
                }
            }
        }
        for head in &answer.applied {
            if let Some(a) = queue.shards.get_mut(&head.shard)
                && a.attached
                && generations.get(&head.shard) == Some(&a.generation)
            {
                a.confirmed = true;
                a.applied = a.applied.max(head.position);
            }
        }
        drop(queue);
        if !answer.out_of_sync.is_empty() {
            tracing::info!(peer = %self.addr, shards = ?answer.out_of_sync, "replica out of sync; it copies the shards again");
        }
        for &shard in &answer.out_of_sync {
            self.detach(shard, Some(generations.get(&shard).copied().unwrap_or(0)));
        }
        self.progress.notify_waiters();
    }

    /// Sends the queue, and heartbeats, until `stop`.
    pub async fn run(self: Arc<Self>, weak: Weak<Replication>, stop: CancellationToken) {
        let heartbeat = self.settings.heartbeat;
        let mut backoff = Duration::from_millis(50);
        let mut last_sent: Option<Instant> = None;
        let mut announced: HashMap<u32, u64> = HashMap::new();
        loop {
            let wake = self.wake.notified();
            tokio::pin!(wake);
            wake.as_mut().enable();
            let (mut pending, generations, counted) = self.pending();
            let Some(replication) = weak.upgrade() else {
                return;
            };
            let mut heads = replication.heads(&self.shards);
            let me = replication.me().to_owned();
            drop(replication);
            // Each head says which attachment of this replica it belongs
            // to (0: none), so that a replica in step with a stream this
            // server no longer forwards to it finds out.
            for head in &mut heads {
                let (generation, attached) =
                    generations.get(&head.shard).copied().unwrap_or((0, false));
                head.attachment = generation;
                head.detached = !attached;
                (head.counted, head.acked_alone_through) =
                    counted.get(&head.shard).copied().unwrap_or((false, 0));
            }
            for &shard in &self.shards {
                let (_, _, queued, _) = self.status(shard);
                metrics::gauge!("tessera_ps_replication_lag_pushes", "peer" => self.addr.clone(), "shard" => shard.to_string())
                    .set(queued as f64);
            }
            // Entries of a stream this server no longer leads are not sent.
            pending.retain(|q| {
                heads
                    .iter()
                    .any(|h| h.shard == q.shard && h.epoch == q.epoch)
            });
            let new_stream = heads
                .iter()
                .any(|h| announced.get(&h.shard) != Some(&h.epoch));
            let heartbeat_due = last_sent.is_none_or(|t| t.elapsed() >= heartbeat);
            if pending.is_empty() && (heads.is_empty() || !(new_stream || heartbeat_due)) {
                let wait = last_sent.map_or(heartbeat, |t| heartbeat.saturating_sub(t.elapsed()));
                tokio::select! {
                    _ = &mut wake => {}
                    _ = tokio::time::sleep(wait.max(Duration::from_millis(1))) => {}
                    _ = stop.cancelled() => return,
                }
                continue;
            }
            let request = ReplicateRequest {
                primary: me,
                heads: heads.clone(),
                pushes: pending.iter().map(Queued::to_wire).collect(),
            };
            let sent_at = Instant::now();
            let answer = tokio::select! {
                answer = self.client.replicate(request) => answer,
                _ = stop.cancelled() => return,
            };
            match answer {
                Ok(answer) => {
                    backoff = Duration::from_millis(50);
                    last_sent = Some(sent_at);
                    for head in &heads {
                        announced.insert(head.shard, head.epoch);
                    }
                    self.acknowledge(&pending, &answer, &attached_generations(&generations));
                    if !answer.deposed.is_empty()
                        && let Some(replication) = weak.upgrade()
                    {
                        // The replica follows a newer primary of these
                        // shards: this server was fenced off from them.
                        for deposed in &answer.deposed {
                            replication.deposed(deposed, &self.addr);
                        }
                    }
                    if answer.syncing && answer.processed == 0 {
                        tokio::select! {
                            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
                            _ = stop.cancelled() => return,
                        }
                    }
                }
                Err(err) => {
                    tracing::debug!(peer = %self.addr, %err, "forwarding failed; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = stop.cancelled() => return,
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
            }
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use tessera_rpc::{Channel, ChannelConfig};

    pub(in crate::replication) fn forwarder(max_lag: usize) -> Forwarder {
        Forwarder::new(
            "127.0.0.1:1".into(),
            vec![0, 1],
            ReplicationClient::new(Channel::lazy("127.0.0.1:1", ChannelConfig::default()).unwrap()),
            ForwardSettings {
                max_lag,
                batch: 64,
                heartbeat: Duration::from_millis(500),
            },
            Arc::new(AtomicU64::new(0)),
        )
    }

    pub(in crate::replication) fn push() -> Arc<Forwarded> {
        Arc::new(Forwarded::default())
    }

    /// The replica's answer to what is pending: `processed` entries done,
    /// and `shard` applied up to `position` (under `epoch`).
    pub(in crate::replication) fn answer(
        f: &Forwarder,
        processed: u32,
        shard: u32,
        epoch: u64,
        position: u64,
    ) {
        let (sent, generations, _) = f.pending();
        f.acknowledge(
            &sent,
            &ReplicateResponse {
                processed,
                applied: vec![tessera_proto::v1::StreamHead {
                    shard,
                    epoch,
                    position,
                    ..Default::default()
                }],
                ..ReplicateResponse::default()
            },
            &attached_generations(&generations),
        );
    }

    fn queued(f: &Forwarder, shard: u32) -> Vec<Queued> {
        lock(&f.queue)
            .entries
            .iter()
            .filter(|q| q.shard == shard)
            .cloned()
            .collect()
    }

    /// The cut-off counts each shard's own queue: a busy shard is cut off
    /// alone. (Before, the whole peer queue was compared with the limit and
    /// whichever shard pushed next was cut off, so one busy shard cut off
    /// the others one by one.)
    #[test]
    fn a_busy_shard_is_cut_off_alone() {
        let f = forwarder(3);
        f.attach(0, 0);
        f.attach(1, 0);
        for position in 1..=3 {
            f.enqueue(0, 1, position, &push());
        }
        // Three queued in all; shard 1 has none of its own queued yet.
        f.enqueue(1, 1, 1, &push());
        assert!(f.status(1).0, "shard 1 still attached");
        assert_eq!(queued(&f, 1).len(), 1);
        // Shard 0's own queue is full: its next Push cuts it off.
        f.enqueue(0, 1, 4, &push());
        let shard0 = queued(&f, 0);
        assert_eq!(shard0.len(), 1, "its queue replaced by a gap marker");
        assert!(shard0[0].push.is_none() && shard0[0].position == 4);
        assert!(shard0[0].to_wire().gap);
        assert!(!f.status(0).0 && f.status(1).0);
        assert_eq!(f.cutoffs.load(Ordering::Relaxed), 1);
        // Shard 1 goes on queueing up to its own limit.
        f.enqueue(1, 1, 2, &push());
        f.enqueue(1, 1, 3, &push());
        assert!(f.status(1).0);
    }

    #[test]
    fn an_old_out_of_sync_answer_does_not_undo_a_newer_attachment() {
        let f = forwarder(100);
        f.attach(0, 0);
        let (sent, before, _) = f.pending();
        // The replica attached again before its answer to the earlier
        // batch came back: forwarding must go on.
        f.attach(0, 0);
        f.acknowledge(
            &sent,
            &ReplicateResponse {
                out_of_sync: vec![0],
                ..ReplicateResponse::default()
            },
            &attached_generations(&before),
        );
        f.enqueue(0, 1, 1, &push());
        assert_eq!(queued(&f, 0).len(), 1, "still attached");
        // An answer about the current attachment does detach.
        let (sent, now, _) = f.pending();
        f.acknowledge(
            &sent,
            &ReplicateResponse {
                out_of_sync: vec![0],
                ..ReplicateResponse::default()
            },
            &attached_generations(&now),
        );
        assert!(queued(&f, 0).is_empty(), "queue of the shard dropped");
        f.enqueue(0, 1, 2, &push());
        assert!(queued(&f, 0).is_empty(), "detached: nothing queued");
    }

    #[test]
    fn only_confirmed_replicas_are_waited_for_and_confirmations_count() {
        let f = forwarder(100);
        f.attach(0, 10);
        assert_eq!(f.enqueue(0, 2, 11, &push()), None, "not confirmed yet");
        // The replica applied it and says where it stands.
        answer(&f, 1, 0, 2, 11);
        assert!(
            queued(&f, 0).is_empty(),
            "acknowledged entries leave the queue"
        );
        let generation = f.enqueue(0, 2, 12, &push()).expect("confirmed now");
        assert_eq!(f.confirmed_generation(0), Some(generation));
        assert_eq!(f.status(0), (true, true, 1, 11));
    }

    /// The soak's lost Pushes (issue 33): a replica that installed its copy
    /// at 10 while the primary acknowledged 11 and 12 without it was "in
    /// step" at 10, and the primary was stopped as safe to lose.
    #[test]
    fn a_replica_is_in_step_once_it_applied_what_was_acknowledged_without_it() {
        let f = forwarder(100);
        f.attach(0, 10);
        assert_eq!(f.enqueue(0, 2, 11, &push()), None, "acknowledged alone");
        assert_eq!(f.enqueue(0, 2, 12, &push()), None, "acknowledged alone");
        let (_, _, counted) = f.pending();
        assert_eq!(counted[&0], (false, 12), "not counted yet");
        // Confirmed at 11: waited for from now on, not yet in step.
        answer(&f, 1, 0, 2, 11);
        assert!(f.enqueue(0, 2, 13, &push()).is_some(), "waited for now");
        let (_, _, counted) = f.pending();
        assert_eq!(counted[&0], (true, 12), "heads tell the replica");
        assert_eq!(f.status(0), (true, false, 2, 11), "12 only on the primary");
        answer(&f, 1, 0, 2, 12);
        assert_eq!(
            f.status(0),
            (true, true, 1, 12),
            "holds every acknowledged Push"
        );
        // A new attachment starts from its copy.
        f.attach(0, 20);
        let (_, _, counted) = f.pending();
        assert_eq!(counted[&0], (false, 20));
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_ends_when_applied_detached_or_late() {
        let f = Arc::new(forwarder(100));
        f.attach(0, 0);
        answer(&f, 0, 0, 1, 0);
        let generation = f.enqueue(0, 1, 1, &push()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(2);
        // Late: the deadline passes (the paused clock jumps there).
        assert_eq!(
            f.wait_applied(0, generation, 1, deadline).await,
            Confirmation::TimedOut
        );
        // Applied: a confirmation arrives while it waits.
        let waiter = {
            let f = Arc::clone(&f);
            tokio::spawn(async move {
                f.wait_applied(0, generation, 1, Instant::now() + Duration::from_secs(60))
                    .await
            })
        };
        tokio::task::yield_now().await;
        answer(&f, 1, 0, 1, 1);
        assert_eq!(waiter.await.unwrap(), Confirmation::Applied);
        // Detached: the attachment changes under it.
        let generation = f.enqueue(0, 1, 2, &push()).unwrap();
        f.detach(0, None);
        assert_eq!(
            f.wait_applied(0, generation, 2, Instant::now() + Duration::from_secs(60))
                .await,
            Confirmation::Detached
        );
    }
}
