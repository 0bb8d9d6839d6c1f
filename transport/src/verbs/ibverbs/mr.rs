//! Memory regions: the hook that registers pool blocks with the device's
//! protection domain (pinning them).

use super::*;
#[allow(clippy::wildcard_imports)]
use crate::sync::LockExt;

/// Registers pool memory with the device's protection domain.
#[derive(Debug)]
pub(super) struct IbvRegistration {
    pub(super) ctx: Arc<Context>,
}

impl RegistrationHook for IbvRegistration {
    fn register(
        &self,
        addr: usize,
        len: usize,
        access: Access,
    ) -> Result<RegisteredRegion, RegistrationError> {
        let mut flags = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
        match access {
            Access::LocalOnly => {}
            Access::RemoteWrite => flags |= ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0,
            // Peers write only through windows bound to parts of it; the
            // region's own rkey lets nobody in.
            Access::Windows => flags |= ibv_access_flags::IBV_ACCESS_MW_BIND.0,
        }
        // SAFETY: the pool passes memory it has mapped and keeps mapped
        // until it deregisters it; the PD is alive (held by the Arc).
        let mr = unsafe { ibv_reg_mr(self.ctx.pd, addr as *mut libc::c_void, len, flags as i32) };
        if mr.is_null() {
            let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
            return Err(RegistrationError {
                len,
                cause: crate::verbs::memlock::registration_failure(errno),
            });
        }
        // SAFETY: `mr` is a valid memory region returned just above.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        self.ctx.live.locked().regions.insert(mr as u64);
        Ok(RegisteredRegion {
            lkey,
            rkey,
            handle: mr as u64,
        })
    }

    fn deregister(&self, _addr: usize, _len: usize, region: &RegisteredRegion) {
        let mut live = self.ctx.live.locked();
        if !live.regions.remove(&region.handle) {
            return;
        }
        // SAFETY: `handle` is the ibv_mr this hook registered (it was
        // live), deregistered once: it left the live set above, under the
        // lock binds hold while they post.
        let rc = unsafe { ibv_dereg_mr(region.handle as *mut ibv_mr) };
        if rc != 0 {
            // EBUSY/EINVAL while a window is still bound to it: its pinned
            // memory stays. Engines drop their windows before their buffers.
            tracing::warn!(
                errno = rc,
                "ibv_dereg_mr failed; the region stays registered (a memory window bound to it?)"
            );
        }
    }
}
