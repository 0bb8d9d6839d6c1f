//! One connection of a channel (a *link*): the calls outstanding on it,
//! their failure when it breaks, and the task that reads its answers.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Instant;

use bytes::Bytes;
use tessera_transport::sync::lock;
use tessera_transport::{MessageReceiver, MessageSender, TransportKind};
use tokio::sync::oneshot;

use super::ChannelInner;
use crate::wire::{Kind, RpcHeader};
use crate::{LinkClosed, RpcError};

pub(super) type Reply = Result<(RpcHeader, Bytes), RpcError>;

/// One connection and the calls outstanding on it.
#[derive(Debug)]
pub(super) struct Link {
    pub(super) sender: MessageSender,
    /// `Tcp` or `Rdma`.
    pub(super) kind: TransportKind,
    pub(super) shared: Arc<LinkShared>,
    pub(super) reader: tokio::task::JoinHandle<()>,
    /// The transport put it on another RDMA rail than it would have taken
    /// with every rail up (one was down or refused the peer): after
    /// [`RETURN_AFTER`] the lane dials again, so that links come back to a
    /// rail once it is up.
    pub(super) displaced: bool,
}

/// How long a displaced link serves before its lane dials again: 1 s, so
/// that links return to a rail within about 1.5 s of its port's return
/// (the transport tries a rail a peer refused last for 500 ms), while an
/// outage costs each displaced link one dial a second (a socket on a
/// queue pair already there, as a rule).
pub(super) const RETURN_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

#[derive(Debug)]
pub(super) struct LinkShared {
    pub(super) addr: String,
    /// This link's number among the channel's events.
    pub(super) event: u64,
    /// When it was installed.
    pub(super) since: Instant,
    /// It carried successful calls for `HEALTHY_AFTER` (reported once).
    pub(super) healthy: AtomicBool,
    pub(super) closed: AtomicBool,
    pub(super) pending: Mutex<PendingTable>,
    /// Whether the peer went silent (TCP links: `silence.rs`).
    pub(super) silence: crate::silence::Silence,
}

#[derive(Debug, Default)]
pub(super) struct PendingTable {
    /// Set once the link is dead; no call may register after that.
    pub(super) closed_reason: Option<Arc<LinkClosed>>,
    pub(super) calls: HashMap<u64, oneshot::Sender<Reply>>,
}

impl Drop for Link {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl Link {
    pub(super) fn is_usable(&self) -> bool {
        !self.shared.closed.load(Ordering::Acquire) && !self.sender.is_closed()
    }

    /// A displaced link that has served [`RETURN_AFTER`]: it takes no new
    /// calls from now on (those outstanding finish on it), and its lane
    /// dials again.
    pub(super) fn retire_if_displaced(&self) -> bool {
        let due = self.displaced && self.shared.since.elapsed() >= RETURN_AFTER;
        if due {
            self.shared.closed.store(true, Ordering::Release);
        }
        due
    }
}

impl LinkShared {
    pub(super) fn pending(&self) -> MutexGuard<'_, PendingTable> {
        // A panic while holding this lock cannot leave the table inconsistent
        // (every operation is a single insert or remove), so poisoning is ignored.
        lock(&self.pending)
    }

    pub(super) fn fail_all(&self, reason: LinkClosed) {
        self.closed.store(true, Ordering::Release);
        let reason = Arc::new(reason);
        let calls = {
            let mut table = self.pending();
            table.closed_reason = Some(Arc::clone(&reason));
            std::mem::take(&mut table.calls)
        };
        for (_, slot) in calls {
            let _ = slot.send(Err(RpcError::ConnectionLost {
                addr: self.addr.clone(),
                reason: Arc::clone(&reason),
                event: self.event,
            }));
        }
    }
}

/// Removes a call's pending slot if the call is abandoned (deadline, or the
/// caller dropped the future), so the table never leaks.
pub(super) struct PendingGuard<'a> {
    pub(super) shared: &'a LinkShared,
    pub(super) request_id: u64,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        self.shared.pending().calls.remove(&self.request_id);
    }
}

/// Reads responses until the connection ends; an RDMA connection that
/// ends tells its channel's ladder (`channel`).
pub(super) async fn read_responses(
    mut receiver: MessageReceiver,
    shared: Arc<LinkShared>,
    channel: Option<Weak<ChannelInner>>,
) {
    // The server said it is shutting down: a clean end, not the RDMA
    // path's fault.
    let mut going_away = false;
    let reason = loop {
        match receiver.recv().await {
            Ok(Some(message)) => {
                shared.silence.handle_heard();
                match RpcHeader::decode(&message) {
                    // The server answered every request it read here and
                    // reads no more: the calls still waiting were never
                    // read (work-free; `replicas` sends them elsewhere).
                    Ok((header, _)) if header.is_drained() => {
                        going_away = true;
                        break LinkClosed::Drained;
                    }
                    Ok((header, body)) if header.kind == Kind::Response => {
                        if header.flags & crate::wire::FLAG_GOING_AWAY != 0 && !going_away {
                            // No new calls here; the outstanding ones are
                            // still answered on it.
                            going_away = true;
                            shared.closed.store(true, Ordering::Release);
                            tracing::debug!(addr = %shared.addr, "server going away; new calls dial again");
                        }
                        let slot = shared.pending().calls.remove(&header.request_id);
                        match slot {
                            Some(slot) => {
                                let _ = slot.send(Ok((header, body)));
                            }
                            // The caller gave up (deadline) before the answer came.
                            None => metrics::counter!(crate::observe::CLIENT_LATE_RESPONSES)
                                .increment(1),
                        }
                    }
                    Ok(_) => break LinkClosed::RequestFromServer,
                    Err(err) => break LinkClosed::Malformed(err),
                }
            }
            Ok(None) => {
                // A clean close (a server stopping or restarting), not the
                // RDMA path failing.
                going_away = true;
                break LinkClosed::ByServer;
            }
            Err(err) => break LinkClosed::Transport(err),
        }
    };
    tracing::debug!(addr = %shared.addr, %reason, "connection ended");
    let why = (!going_away).then(|| reason.to_string());
    shared.fail_all(reason);
    if let Some(why) = why
        && let Some(channel) = channel.and_then(|weak| weak.upgrade())
    {
        channel.rdma_link_ended(&why);
    }
}
