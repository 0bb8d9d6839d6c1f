//! The soft provider's completion queue ([`SoftCq`]): completions peers
//! push into a ring in shared memory, the owner's own QPs' completions in a
//! local queue, and the wake-up a sleeping poller arms.

use crate::sync::LockExt;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use super::rings::{CqRing, RingCompletion};
use crate::verbs::{CompletionQueue, VerbsError, WcKind, WcStatus, WorkCompletion};

/// A completion waiting in a soft CQ.
#[derive(Debug)]
pub(crate) struct Pending {
    pub(crate) completion: WorkCompletion,
    /// Polls to wait before it becomes visible (fault injection).
    pub(crate) delay_polls: u32,
    /// Send-queue slots this completion frees when it is polled, and the
    /// counter of its QP.
    pub(crate) frees: Option<(u32, Arc<AtomicU32>)>,
}

/// A software completion queue: a ring in shared memory into which peers
/// (in this process or another) push receive completions, and a local queue
/// for what the owner's own QPs complete (sends, flushes).
#[derive(Debug)]
pub struct SoftCq {
    pub(crate) id: u32,
    pub(crate) ring: CqRing,
    queue: Mutex<VecDeque<Pending>>,
    /// The wake sequence `arm` saw.
    armed_at: AtomicU32,
    /// `arm` arms the eventfd, not `wait`'s futex (after `notify_by_fd`).
    by_fd: AtomicBool,
    /// The device that reports this queue's overrun.
    pub(crate) device: Mutex<std::sync::Weak<super::device::DeviceInner>>,
}

impl SoftCq {
    /// A queue whose shared ring holds `depth` completions (rounded up to a
    /// power of two).
    pub fn with_depth(depth: u32) -> Result<Self, VerbsError> {
        static NEXT_ID: AtomicU32 = AtomicU32::new(1);
        let ring = CqRing::create(depth)
            .map_err(|e| VerbsError::NoDevice(format!("soft NIC shared memory: {e}")))?;
        Ok(Self {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            ring,
            queue: Mutex::new(VecDeque::new()),
            armed_at: AtomicU32::new(0),
            by_fd: AtomicBool::new(false),
            device: Mutex::new(std::sync::Weak::new()),
        })
    }

    pub(crate) fn push(&self, pending: Pending) {
        self.queue.locked().push_back(pending);
    }

    /// Moves what peers pushed into the local queue, behind what is there.
    fn drain_ring(&self, queue: &mut VecDeque<Pending>) {
        while let Some(RingCompletion {
            completion,
            delay_polls,
        }) = self.ring.pop()
        {
            queue.push_back(Pending {
                completion,
                delay_polls,
                frees: None,
            });
        }
    }

    /// Takes in what peers pushed so far (before the owner adds completions
    /// that must come after them, such as flushes).
    pub(crate) fn collect(&self) {
        let mut queue = self.queue.locked();
        self.drain_ring(&mut queue);
    }

    /// Completions queued (visible or delayed).
    pub fn len(&self) -> usize {
        let mut queue = self.queue.locked();
        self.drain_ring(&mut queue);
        queue.len()
    }

    /// Whether no completion is queued.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl CompletionQueue for SoftCq {
    fn poll(&self, out: &mut Vec<WorkCompletion>, max: usize) -> usize {
        if self.ring.take_overrun()
            && let Some(device) = self.device.locked().upgrade()
        {
            // As a real device: an overrun CQ is reported asynchronously.
            device.raise(crate::verbs::AsyncEvent::CqFailed);
        }
        let mut queue = self.queue.locked();
        self.drain_ring(&mut queue);
        let mut taken = 0;
        while taken < max {
            let Some(head) = queue.front_mut() else {
                break;
            };
            if head.delay_polls > 0 {
                // A delayed completion holds back the ones behind it, which
                // keeps every QP's completions in posting order.
                head.delay_polls -= 1;
                break;
            }
            let Some(pending) = queue.pop_front() else {
                break;
            };
            if let Some((slots, outstanding)) = &pending.frees {
                outstanding.fetch_sub(*slots, Ordering::AcqRel);
            }
            let mut completion = pending.completion;
            if completion.status != WcStatus::Success {
                // As real providers: an error completion's opcode and
                // length are undefined; only its id, status, QP and vendor
                // code may be relied on.
                completion.kind = WcKind::Unknown;
                completion.byte_len = 0;
            }
            out.push(completion);
            taken += 1;
        }
        taken
    }

    fn into_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }

    fn arm(&self) {
        let by_fd = self.by_fd.load(Ordering::Relaxed);
        self.armed_at.store(self.ring.arm(by_fd), Ordering::Relaxed);
        // Completions held back in the local queue (a fault-injected
        // delay counts down per poll) wake no one by themselves: `wait`
        // returns at once for them, and a reactor is signalled here.
        if by_fd && !self.queue.locked().is_empty() {
            self.ring.wake();
        }
    }

    fn wait(&self, timeout: std::time::Duration) {
        // Completions of the owner's own sends go to the local queue
        // without a wake-up: the owner's thread made them.
        let has_local = !self.queue.locked().is_empty();
        if has_local {
            return;
        }
        self.ring
            .wait(self.armed_at.load(Ordering::Relaxed), timeout);
    }

    fn wake(&self) {
        self.ring.wake();
    }

    fn notify_by_fd(&self) -> Option<Vec<std::os::fd::OwnedFd>> {
        // The ring's eventfd, which peers in any process write when they
        // push a completion to an armed queue (as a NIC interrupts).
        let fd = self.ring.event_fd()?.try_clone_to_owned().ok()?;
        self.by_fd.store(true, Ordering::Relaxed);
        Some(vec![fd])
    }

    fn clear_notification(&self) {
        self.ring.clear_event();
    }
}
