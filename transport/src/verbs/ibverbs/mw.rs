//! Type-2 memory windows (`ibv_alloc_mw`): what confines a peer's writes
//! to the bytes it was granted (see `rdma/windows.rs`).

use super::*;
#[allow(clippy::wildcard_imports)]
use crate::sync::LockExt;

/// A type-2 memory window of the device's protection domain.
#[derive(Debug)]
pub(super) struct IbvWindow {
    pub(super) mw: *mut ibv_mw,
    /// Keeps the protection domain alive while the window is.
    pub(super) _ctx: Arc<Context>,
    pub(super) rkey: u32,
}

// SAFETY: an ibv_mw is used only through verbs calls that libibverbs makes
// thread safe (posting a bind on a QP, deallocation once, from Drop); its
// `rkey` field is written only by a bind's poster while it holds the
// context's `live` lock, which deallocation takes too.
unsafe impl Send for IbvWindow {}
// SAFETY: as above: `&self` methods read nothing through the pointer.
unsafe impl Sync for IbvWindow {}

impl IbvWindow {
    pub(super) fn allocate(ctx: &Arc<Context>) -> Result<Self, VerbsError> {
        // SAFETY: the PD is alive (held by `ctx`); `ibv_alloc_mw` reports
        // a provider without windows as `None`.
        let mw = unsafe { ibv_alloc_mw(ctx.pd, ibv_mw_type::IBV_MW_TYPE_2) };
        let mw = match mw {
            Some(mw) if !mw.is_null() => mw,
            _ => return Err(VerbsError::NoDevice(os_error("ibv_alloc_mw"))),
        };
        // SAFETY: `mw` was returned valid just above.
        let rkey = unsafe { (*mw).rkey };
        ctx.live.locked().windows.insert(mw as u64);
        Ok(Self {
            mw,
            _ctx: Arc::clone(ctx),
            rkey,
        })
    }
}

impl Drop for IbvWindow {
    fn drop(&mut self) {
        let mut live = self._ctx.live.locked();
        live.windows.remove(&(self.mw as u64));
        // SAFETY: `mw` was allocated by `allocate` and is deallocated once,
        // here, under the lock binds hold while they post; deallocation
        // ends any binding.
        unsafe { ibv_dealloc_mw(self.mw) };
    }
}

impl crate::verbs::MemoryWindow for IbvWindow {
    fn handle(&self) -> u64 {
        self.mw as u64
    }

    fn rkey(&self) -> u32 {
        self.rkey
    }

    fn next_rkey(&self, rkey: u32) -> u32 {
        // SAFETY: plain arithmetic on the key's low byte (the tag).
        unsafe { ibv_inc_rkey(rkey) }
    }
}
