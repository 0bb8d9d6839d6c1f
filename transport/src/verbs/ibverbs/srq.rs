//! Shared receive queues.

#[allow(clippy::wildcard_imports)]
use super::*;

/// An ibverbs shared receive queue.
#[derive(Debug)]
pub struct IbvSrq {
    pub(super) srq: *mut ibv_srq,
    pub(super) _ctx: Arc<Context>,
}

// SAFETY: posting to an SRQ is thread-safe in libibverbs; the pointer is
// freed only in Drop.
unsafe impl Send for IbvSrq {}

// SAFETY: as above.
unsafe impl Sync for IbvSrq {}

impl Drop for IbvSrq {
    fn drop(&mut self) {
        // SAFETY: created in `create_srq`, destroyed once, after every QP
        // on it (they hold an `Arc` of it).
        unsafe { ibv_destroy_srq(self.srq) };
    }
}

impl SharedReceiveQueue for IbvSrq {
    fn post_recv(&self, wrs: &[RecvWr]) -> Result<(), VerbsError> {
        if wrs.is_empty() {
            return Ok(());
        }
        let mut list = RecvList::new(wrs);
        let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: `list` (and the entries it points to) outlives the call;
        // the SRQ is alive.
        let rc = unsafe { ibv_post_srq_recv(self.srq, list.head(), &mut bad) };
        if rc != 0 {
            // The receives before `bad` went up and the NIC owns their
            // buffers: the caller must keep those.
            return Err(VerbsError::PostFailed {
                queue: "srq",
                posted: posted_before(list.list.as_ptr(), list.list.len(), bad),
                errno: rc,
            });
        }
        Ok(())
    }

    fn into_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }
}
