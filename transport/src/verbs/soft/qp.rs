use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, Weak};

use super::cq::{Pending, SoftCq};
use super::device::{DeviceInner, Fault};
use crate::pool::Access;
use crate::verbs::{
    QpCaps, QpEndpoint, QpState, QueuePair, RecvWr, SendOp, SendWr, VerbsError, WcKind, WcStatus,
    WorkCompletion,
};

#[derive(Debug)]
struct QpShared {
    state: QpState,
    remote: Option<QpEndpoint>,
    recvs: VecDeque<RecvWr>,
    /// Unsignalled requests since the last completion; the next completion
    /// frees their send-queue slots too.
    unsignaled_run: u32,
}

/// A soft RC queue pair.
#[derive(Debug)]
pub(crate) struct SoftQpInner {
    qpn: u32,
    device: Weak<DeviceInner>,
    caps: QpCaps,
    shared: Mutex<QpShared>,
    /// Send-queue slots in use (posted and not yet freed by a polled
    /// completion).
    send_outstanding: Arc<AtomicU32>,
    send_cq: Arc<SoftCq>,
    recv_cq: Arc<SoftCq>,
    /// Held shared by a peer while it writes into memory addressed through
    /// this QP, and exclusively when the QP is destroyed: once destruction
    /// returns, no peer write into this side's buffers is under way or can
    /// start (the soft counterpart of a NIC that stops DMA when the QP is
    /// destroyed).
    dma: RwLock<()>,
}

impl SoftQpInner {
    pub(crate) fn new(
        qpn: u32,
        device: Weak<DeviceInner>,
        caps: QpCaps,
        send_cq: Arc<SoftCq>,
        recv_cq: Arc<SoftCq>,
    ) -> Self {
        Self {
            qpn,
            device,
            caps,
            shared: Mutex::new(QpShared {
                state: QpState::Reset,
                remote: None,
                recvs: VecDeque::new(),
                unsignaled_run: 0,
            }),
            send_outstanding: Arc::new(AtomicU32::new(0)),
            send_cq,
            recv_cq,
            dma: RwLock::new(()),
        }
    }

    fn shared(&self) -> MutexGuard<'_, QpShared> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn state(&self) -> QpState {
        self.shared().state
    }

    fn delay(&self) -> u32 {
        self.device.upgrade().map_or(0, |d| d.roll(Fault::Delay))
    }

    fn push_recv_completion(&self, wr_id: u64, status: WcStatus, kind: WcKind, byte_len: u32) {
        self.recv_cq.push(Pending {
            completion: WorkCompletion {
                wr_id,
                status,
                kind,
                byte_len,
                qpn: self.qpn,
            },
            delay_polls: self.delay(),
            frees: None,
        });
    }

    /// Moves the QP to the error state and flushes its posted receives.
    pub(crate) fn enter_error(&self) {
        let flushed: Vec<RecvWr> = {
            let mut shared = self.shared();
            if shared.state == QpState::Error {
                return;
            }
            shared.state = QpState::Error;
            shared.recvs.drain(..).collect()
        };
        for wr in flushed {
            self.push_recv_completion(wr.wr_id, WcStatus::Flushed, WcKind::Recv, 0);
        }
    }

    /// Takes the oldest posted receive; `None` if there is none or the QP
    /// is not ready.
    fn take_recv(&self) -> Option<RecvWr> {
        let mut shared = self.shared();
        if shared.state != QpState::ReadyToSend {
            return None;
        }
        shared.recvs.pop_front()
    }

    /// Records the outcome of one send work request.
    fn complete_send(&self, wr: &SendWr, status: WcStatus) {
        let mut shared = self.shared();
        let slots = shared.unsignaled_run + 1;
        if status == WcStatus::Success && !wr.signaled {
            shared.unsignaled_run += 1;
            return;
        }
        shared.unsignaled_run = 0;
        drop(shared);
        self.send_cq.push(Pending {
            completion: WorkCompletion {
                wr_id: wr.wr_id,
                status,
                kind: WcKind::Send,
                byte_len: 0,
                qpn: self.qpn,
            },
            delay_polls: self.delay(),
            frees: Some((slots, Arc::clone(&self.send_outstanding))),
        });
    }

    /// Runs one send work request against the peer; returns its status.
    fn execute(&self, device: &DeviceInner, remote: QpEndpoint, wr: &SendWr) -> WcStatus {
        if device.roll(Fault::QpError) > 0 {
            device.injected_qp_errors.fetch_add(1, Ordering::Relaxed);
            return WcStatus::RetryExceeded;
        }
        // Local gather list: registered memory of this device.
        let mut gather = Vec::with_capacity(wr.sges.len());
        let mut total = 0usize;
        for sge in &wr.sges {
            let len = sge.len as usize;
            match device.region(sge.lkey) {
                Some(region) if region.contains(sge.addr, len) => gather.push((sge.addr, len)),
                _ => return WcStatus::LocalProtectionError,
            }
            total += len;
        }
        let peer_device = device.fabric.device(remote.node).filter(|d| !d.is_dead());
        let Some(peer_device) = peer_device else {
            return WcStatus::RetryExceeded;
        };
        let Some(peer) = peer_device.qp(remote.qpn) else {
            return WcStatus::RetryExceeded;
        };
        // Checked under the peer's DMA guard, so the peer cannot be torn
        // down between the check and the copy.
        let _dma = peer.dma.read().unwrap_or_else(|p| p.into_inner());
        if peer.state() != QpState::ReadyToSend {
            return WcStatus::RetryExceeded;
        }
        let status = match wr.op {
            SendOp::Send => {
                let Some(recv) = take_recv_or_rnr(device, &peer_device, &peer) else {
                    return WcStatus::ReceiverNotReady;
                };
                let fits = peer_device
                    .region(recv.sge.lkey)
                    .is_some_and(|r| r.contains(recv.sge.addr, recv.sge.len as usize));
                if !fits {
                    peer.push_recv_completion(
                        recv.wr_id,
                        WcStatus::LocalProtectionError,
                        WcKind::Recv,
                        0,
                    );
                    peer.enter_error();
                    return WcStatus::RemoteOperationError;
                }
                if total > recv.sge.len as usize {
                    peer.push_recv_completion(
                        recv.wr_id,
                        WcStatus::LocalLengthError,
                        WcKind::Recv,
                        0,
                    );
                    peer.enter_error();
                    return WcStatus::RemoteOperationError;
                }
                copy_gather(&gather, recv.sge.addr);
                peer.push_recv_completion(
                    recv.wr_id,
                    WcStatus::Success,
                    WcKind::Recv,
                    total as u32,
                );
                WcStatus::Success
            }
            SendOp::Write { remote_addr, rkey } => {
                if !remote_writable(&peer_device, rkey, remote_addr, total) {
                    return WcStatus::RemoteAccessError;
                }
                copy_gather(&gather, remote_addr);
                WcStatus::Success
            }
            SendOp::WriteWithImm {
                remote_addr,
                rkey,
                imm,
            } => {
                if !remote_writable(&peer_device, rkey, remote_addr, total) {
                    return WcStatus::RemoteAccessError;
                }
                // The responder needs a receive before it accepts the data.
                let Some(recv) = take_recv_or_rnr(device, &peer_device, &peer) else {
                    return WcStatus::ReceiverNotReady;
                };
                copy_gather(&gather, remote_addr);
                peer.push_recv_completion(
                    recv.wr_id,
                    WcStatus::Success,
                    WcKind::RecvWithImm(imm),
                    total as u32,
                );
                WcStatus::Success
            }
        };
        device
            .bytes_moved
            .fetch_add(total as u64, Ordering::Relaxed);
        status
    }
}

fn take_recv_or_rnr(
    device: &DeviceInner,
    peer_device: &DeviceInner,
    peer: &SoftQpInner,
) -> Option<RecvWr> {
    let recv = if device.roll(Fault::Rnr) > 0 {
        None
    } else {
        peer.take_recv()
    };
    if recv.is_none() {
        peer_device.rnr_events.fetch_add(1, Ordering::Relaxed);
    }
    recv
}

fn remote_writable(peer_device: &DeviceInner, rkey: u32, addr: usize, len: usize) -> bool {
    let ok = peer_device
        .region(rkey)
        .is_some_and(|r| r.access == Access::RemoteWrite && r.contains(addr, len));
    if !ok {
        peer_device
            .remote_access_errors
            .fetch_add(1, Ordering::Relaxed);
    }
    ok
}

/// Copies the gather list to consecutive bytes at `dest`.
fn copy_gather(gather: &[(usize, usize)], dest: usize) {
    let mut at = dest;
    for &(src, len) in gather {
        // SAFETY: the source range lies in a region registered with the
        // local device and the destination range in a region registered
        // with the peer device (both checked just before); registered pool
        // memory stays mapped while registered, and memory named by a posted
        // work request stays registered until the request completes (the
        // verbs contract the transport keeps by owning its buffers). `copy`
        // tolerates overlap (a QP writing into its own memory).
        unsafe { std::ptr::copy(src as *const u8, at as *mut u8, len) };
        at += len;
    }
}

/// A soft queue pair handle.
#[derive(Debug)]
pub struct SoftQp {
    pub(crate) inner: Arc<SoftQpInner>,
}

impl Drop for SoftQp {
    fn drop(&mut self) {
        // Wait out writes in progress and refuse new ones.
        let _guard = self.inner.dma.write().unwrap_or_else(|p| p.into_inner());
        self.inner.enter_error();
    }
}

impl SoftQp {
    /// Send-queue slots in use.
    pub fn send_outstanding(&self) -> u32 {
        self.inner.send_outstanding.load(Ordering::Acquire)
    }

    /// Receives posted and not yet consumed.
    pub fn recvs_posted(&self) -> usize {
        self.inner.shared().recvs.len()
    }
}

impl QueuePair for SoftQp {
    fn qpn(&self) -> u32 {
        self.inner.qpn
    }

    fn endpoint(&self) -> QpEndpoint {
        let node = self.inner.device.upgrade().map_or(0, |d| d.node);
        QpEndpoint {
            qpn: self.inner.qpn,
            lid: 0,
            gid: [0; 16],
            psn: self.inner.qpn.wrapping_mul(2_654_435_761) & 0x00ff_ffff,
            node,
        }
    }

    fn connect(&self, remote: &QpEndpoint) -> Result<(), VerbsError> {
        let mut shared = self.inner.shared();
        if shared.state != QpState::Reset {
            return Err(VerbsError::WrongState {
                qpn: self.inner.qpn,
                state: shared.state,
            });
        }
        shared.remote = Some(*remote);
        shared.state = QpState::ReadyToSend;
        Ok(())
    }

    fn post_send(&self, wrs: &[SendWr]) -> Result<(), VerbsError> {
        let inner = &self.inner;
        if let Some(wr) = wrs
            .iter()
            .find(|wr| wr.sges.len() > inner.caps.max_sge as usize)
        {
            return Err(VerbsError::InvalidRequest(format!(
                "work request {} has {} scatter/gather entries (max {})",
                wr.wr_id,
                wr.sges.len(),
                inner.caps.max_sge
            )));
        }
        let remote = {
            let shared = inner.shared();
            if shared.state == QpState::Reset {
                return Err(VerbsError::WrongState {
                    qpn: inner.qpn,
                    state: shared.state,
                });
            }
            shared.remote
        };
        let n = u32::try_from(wrs.len()).unwrap_or(u32::MAX);
        let depth = inner.caps.max_send_wr;
        let reserved =
            inner
                .send_outstanding
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                    used.checked_add(n).filter(|total| *total <= depth)
                });
        if let Err(used) = reserved {
            return Err(VerbsError::QueueFull {
                queue: "send",
                posted: used.saturating_add(n),
                depth,
            });
        }
        let device = inner.device.upgrade();
        for wr in wrs {
            let status = match (&device, remote, inner.state()) {
                (Some(device), Some(remote), QpState::ReadyToSend) => {
                    inner.execute(device, remote, wr)
                }
                _ => WcStatus::Flushed,
            };
            if status != WcStatus::Success {
                inner.enter_error();
            }
            inner.complete_send(wr, status);
        }
        Ok(())
    }

    fn post_recv(&self, wrs: &[RecvWr]) -> Result<(), VerbsError> {
        let inner = &self.inner;
        let mut shared = inner.shared();
        if shared.state == QpState::Error {
            drop(shared);
            for wr in wrs {
                inner.push_recv_completion(wr.wr_id, WcStatus::Flushed, WcKind::Recv, 0);
            }
            return Ok(());
        }
        let depth = inner.caps.max_recv_wr as usize;
        if shared.recvs.len() + wrs.len() > depth {
            return Err(VerbsError::QueueFull {
                queue: "recv",
                posted: u32::try_from(shared.recvs.len() + wrs.len()).unwrap_or(u32::MAX),
                depth: inner.caps.max_recv_wr,
            });
        }
        shared.recvs.extend(wrs.iter().copied());
        Ok(())
    }

    fn state(&self) -> QpState {
        self.inner.state()
    }
}
