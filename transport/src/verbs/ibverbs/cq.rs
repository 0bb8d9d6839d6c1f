//! Completion queues: polling, and event mode's arm, wait and wake.

#[allow(clippy::wildcard_imports)]
use super::*;

/// A completion queue of the device.
#[derive(Debug)]
pub struct IbvCq {
    pub(super) cq: *mut ibv_cq,
    /// Where the CQ announces a completion after `ibv_req_notify_cq`
    /// (event mode).
    pub(super) channel: *mut ibv_comp_channel,
    /// Wakes a thread sleeping in `wait` on behalf of `wake`.
    pub(super) wake_fd: std::os::fd::OwnedFd,
    pub(super) armed: std::sync::atomic::AtomicBool,
    pub(super) _ctx: Arc<Context>,
}

// SAFETY: CQs may be polled from any thread (libibverbs locks per CQ).
unsafe impl Send for IbvCq {}

// SAFETY: as above.
unsafe impl Sync for IbvCq {}

impl Drop for IbvCq {
    fn drop(&mut self) {
        // SAFETY: QPs using this CQ hold an Arc to it, so none is left;
        // the channel goes after the CQ that reports to it.
        unsafe {
            ibv_destroy_cq(self.cq);
            ibv_destroy_comp_channel(self.channel);
        }
    }
}

pub(super) fn status(status: ibv_wc_status::Type) -> WcStatus {
    match status {
        ibv_wc_status::IBV_WC_SUCCESS => WcStatus::Success,
        ibv_wc_status::IBV_WC_LOC_LEN_ERR => WcStatus::LocalLengthError,
        ibv_wc_status::IBV_WC_LOC_PROT_ERR => WcStatus::LocalProtectionError,
        ibv_wc_status::IBV_WC_WR_FLUSH_ERR => WcStatus::Flushed,
        ibv_wc_status::IBV_WC_REM_ACCESS_ERR => WcStatus::RemoteAccessError,
        ibv_wc_status::IBV_WC_RETRY_EXC_ERR => WcStatus::RetryExceeded,
        ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR => WcStatus::ReceiverNotReady,
        ibv_wc_status::IBV_WC_REM_OP_ERR => WcStatus::RemoteOperationError,
        raw => WcStatus::Other(raw),
    }
}

impl CompletionQueue for IbvCq {
    fn poll(&self, out: &mut Vec<WorkCompletion>, max: usize) -> usize {
        const BATCH: usize = 32;
        let mut taken = 0;
        while taken < max {
            // SAFETY: ibv_wc is plain data; zeroed is a valid value.
            let mut wcs: [ibv_wc; BATCH] = unsafe { std::mem::zeroed() };
            let want = (max - taken).min(BATCH) as i32;
            // SAFETY: `cq` is alive and `wcs` holds `want` entries.
            let n = unsafe { ibv_poll_cq(self.cq, want, wcs.as_mut_ptr()) };
            if n < 0 {
                // Not "empty": the CQ failed (its QPs' completions are
                // lost; the device reports IBV_EVENT_CQ_ERR, which fails
                // the engines). Counted, said once.
                metrics::counter!("tessera_rdma_cq_poll_errors_total").increment(1);
                static WARNED: std::sync::atomic::AtomicBool =
                    std::sync::atomic::AtomicBool::new(false);
                if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    tracing::warn!(rc = n, "ibv_poll_cq failed: the completion queue is broken");
                }
                break;
            }
            if n == 0 {
                break;
            }
            for wc in &wcs[..n as usize] {
                let failed = wc.status != ibv_wc_status::IBV_WC_SUCCESS;
                let kind = match wc.opcode {
                    // An error's opcode is undefined (ibv_poll_cq(3)).
                    _ if failed => WcKind::Unknown,
                    ibv_wc_opcode::IBV_WC_RECV => WcKind::Recv,
                    // SAFETY: for this opcode the union holds the immediate.
                    ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM => {
                        WcKind::RecvWithImm(u32::from_be(unsafe {
                            wc.imm_data_invalidated_rkey_union.imm_data
                        }))
                    }
                    _ => WcKind::Send,
                };
                out.push(WorkCompletion {
                    wr_id: wc.wr_id,
                    status: status(wc.status),
                    kind,
                    byte_len: if failed { 0 } else { wc.byte_len },
                    qpn: wc.qp_num,
                    vendor_err: if failed { wc.vendor_err } else { 0 },
                });
            }
            taken += n as usize;
            if (n as usize) < want as usize {
                break;
            }
        }
        taken
    }

    fn into_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }

    fn arm(&self) {
        use std::sync::atomic::{Ordering, fence};
        self.armed.store(true, Ordering::Relaxed);
        // Pairs with the fence in `wake`: a command queued before a waker's
        // look at `armed` is seen by the caller's last look at its queue,
        // or the waker sees `armed` (before, a waker could miss both and
        // the thread slept its whole bound with a command waiting).
        fence(Ordering::SeqCst);
        // SAFETY: the CQ is alive.
        let rc = unsafe { ibv_req_notify_cq(self.cq, 0) };
        if rc != 0 {
            // No event will come: the thread wakes at its bound, and says
            // so once.
            static WARNED: std::sync::atomic::AtomicBool =
                std::sync::atomic::AtomicBool::new(false);
            if !WARNED.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    err = %std::io::Error::from_raw_os_error(rc),
                    "ibv_req_notify_cq failed: the I/O thread polls at its sleep bound"
                );
            }
        }
    }

    fn wait(&self, timeout: std::time::Duration) {
        use std::os::fd::AsRawFd;
        use std::sync::atomic::Ordering;
        // SAFETY: the channel is alive for as long as the CQ.
        let channel_fd = unsafe { (*self.channel).fd };
        let mut fds = [
            libc::pollfd {
                fd: channel_fd,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.wake_fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let millis = i32::try_from(timeout.as_millis().max(1)).unwrap_or(i32::MAX);
        // SAFETY: `fds` is a valid array of two pollfds for the call.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), 2, millis) };
        if ready > 0 && fds[0].revents & libc::POLLIN != 0 {
            let mut cq: *mut ibv_cq = std::ptr::null_mut();
            let mut context: *mut std::ffi::c_void = std::ptr::null_mut();
            // SAFETY: the channel reported an event; out pointers valid.
            if unsafe { ibv_get_cq_event(self.channel, &mut cq, &mut context) } == 0 {
                // SAFETY: every event taken is acknowledged, on its CQ.
                unsafe { ibv_ack_cq_events(cq, 1) };
            }
        }
        if ready > 0 && fds[1].revents & libc::POLLIN != 0 {
            let mut counter = [0u8; 8];
            // SAFETY: reading 8 bytes into a buffer of 8 resets the eventfd.
            unsafe { libc::read(self.wake_fd.as_raw_fd(), counter.as_mut_ptr().cast(), 8) };
        }
        self.armed.store(false, Ordering::Relaxed);
    }

    fn notify_by_fd(&self) -> Option<Vec<std::os::fd::OwnedFd>> {
        use std::os::fd::{AsFd, BorrowedFd};
        // SAFETY: the channel is alive for as long as the CQ, and `self`
        // borrows the CQ for the borrow's life.
        let channel = unsafe { BorrowedFd::borrow_raw((*self.channel).fd) };
        let channel = channel.try_clone_to_owned().ok()?;
        // Non-blocking, so that `clear_notification` never waits (a file
        // status flag: the channel's own descriptor shares it).
        let flags = nix::fcntl::fcntl(&channel, nix::fcntl::FcntlArg::F_GETFL).ok()?;
        let flags = nix::fcntl::OFlag::from_bits_retain(flags) | nix::fcntl::OFlag::O_NONBLOCK;
        nix::fcntl::fcntl(&channel, nix::fcntl::FcntlArg::F_SETFL(flags)).ok()?;
        let wake = self.wake_fd.as_fd().try_clone_to_owned().ok()?;
        Some(vec![channel, wake])
    }

    fn clear_notification(&self) {
        use std::os::fd::AsRawFd;
        use std::sync::atomic::Ordering;
        // Every event the channel holds, each acknowledged (the channel is
        // non-blocking after `notify_by_fd`: an empty one says EAGAIN).
        loop {
            let mut cq: *mut ibv_cq = std::ptr::null_mut();
            let mut context: *mut std::ffi::c_void = std::ptr::null_mut();
            // SAFETY: the channel is alive; out pointers are valid.
            if unsafe { ibv_get_cq_event(self.channel, &mut cq, &mut context) } != 0 {
                break;
            }
            // SAFETY: every event taken is acknowledged, on its CQ.
            unsafe { ibv_ack_cq_events(cq, 1) };
        }
        let mut counter = [0u8; 8];
        // SAFETY: reading 8 bytes into a buffer of 8 resets the eventfd
        // (non-blocking: nothing signalled is EAGAIN).
        unsafe { libc::read(self.wake_fd.as_raw_fd(), counter.as_mut_ptr().cast(), 8) };
        self.armed.store(false, Ordering::Relaxed);
    }

    fn wake(&self) {
        use std::os::fd::AsRawFd;
        use std::sync::atomic::{Ordering, fence};
        // Pairs with the fence in `arm` (see there).
        fence(Ordering::SeqCst);
        if self.armed.load(Ordering::Relaxed) {
            let one = 1u64.to_ne_bytes();
            // SAFETY: writing 8 bytes to an eventfd adds to its counter.
            unsafe { libc::write(self.wake_fd.as_raw_fd(), one.as_ptr().cast(), 8) };
        }
    }
}
