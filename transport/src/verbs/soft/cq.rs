use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use crate::verbs::{CompletionQueue, WorkCompletion};

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

/// A software completion queue.
#[derive(Debug, Default)]
pub struct SoftCq {
    queue: Mutex<VecDeque<Pending>>,
}

impl SoftCq {
    /// An empty queue.
    pub fn new() -> Self {
        Self::default()
    }

    pub(crate) fn push(&self, pending: Pending) {
        self.queue
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(pending);
    }

    /// Completions queued (visible or delayed).
    pub fn len(&self) -> usize {
        self.queue.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Whether no completion is queued.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl CompletionQueue for SoftCq {
    fn poll(&self, out: &mut Vec<WorkCompletion>, max: usize) -> usize {
        let mut queue = self.queue.lock().unwrap_or_else(|p| p.into_inner());
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
            out.push(pending.completion);
            taken += 1;
        }
        taken
    }

    fn into_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }
}
