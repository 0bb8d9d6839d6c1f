//! The soft NIC's RC queue pair: its state machine (RESET, INIT, RTR, RTS,
//! error), its send queue executed in the posting thread (SEND into the
//! receive the peer posted first, WRITE and WRITE_WITH_IMM into the
//! peer's registered memory after the key, rights and bounds checks,
//! memory-window binds and invalidations), its completions, the link's
//! admission of each SEND or WRITE (`port.rs`), and the stalls behind a
//! receiver-not-ready NAK or a busy link that `retry.rs` retries. A
//! destroyed QP waits for a peer still copying into it before its memory
//! goes.

use crate::sync::LockExt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use super::cq::{Pending, SoftCq};
use super::device::{DeviceInner, Fault};
use super::peer::{Peer, PeerMemory};
use super::rings::{
    QpSegment, RingCompletion, STATE_ERROR, STATE_INIT, STATE_READY, STATE_RESET, STATE_RTR,
};
use super::srq::SoftSrq;
use crate::verbs::{
    QpCaps, QpEndpoint, QpState, QueuePair, RecvWr, SendOp, SendWr, VerbsError, WcKind, WcStatus,
    WorkCompletion,
};

/// How long a destroyed QP waits for a peer still copying into it (only a
/// peer that died mid-copy takes that long).
const DMA_DRAIN_LIMIT: Duration = Duration::from_secs(1);

#[derive(Debug)]
struct QpLocal {
    remote: Option<QpEndpoint>,
    peer: Option<Arc<Peer>>,
    /// Unsignalled requests since the last completion; the next completion
    /// frees their send-queue slots too.
    unsignaled_run: u32,
    /// Whether the receives were flushed after the QP entered error.
    flushed: bool,
    /// The path MTU set at RTR.
    path_mtu: u32,
}

/// A soft RC queue pair.
#[derive(Debug)]
pub(crate) struct SoftQpInner {
    qpn: u32,
    device: Weak<DeviceInner>,
    caps: QpCaps,
    /// State, DMA guard and receive queue, in memory peers share.
    pub(crate) segment: Arc<QpSegment>,
    local: Mutex<QpLocal>,
    /// Send-queue slots in use (posted and not yet freed by a polled
    /// completion).
    send_outstanding: Arc<AtomicU32>,
    send_cq: Arc<SoftCq>,
    pub(crate) recv_cq: Arc<SoftCq>,
    /// The shared receive queue its receives come from, if any.
    srq: Option<Arc<SoftSrq>>,
    /// Send work requests behind a receiver-not-ready NAK, for the retry
    /// engine (`retry.rs`). Held while a work request executes, so that
    /// posts and retries run one at a time, in order.
    stalled: Mutex<Stalled>,
}

/// What a QP has left in its send queue after a retry pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Left {
    /// Nothing.
    Nothing,
    /// A head that met a receiver-not-ready NAK again.
    Rnr,
    /// A head the link holds until then (monotonic nanoseconds).
    HeldByLink(u64),
}

/// Whether the links let `wr` go now (`port.rs`); only SENDs and WRITEs
/// cross them.
fn link_admits(device: &DeviceInner, peer: &Peer, wr: &SendWr) -> Result<(), u64> {
    if !crosses_link(wr) {
        return Ok(());
    }
    // A peer that is gone fails in `execute`.
    let Some(memory) = peer.memory() else {
        return Ok(());
    };
    super::port::admit(&device.table, memory.table())
}

/// Books the bytes of `wr` on the links if it went (`port.rs`).
fn link_book(device: &DeviceInner, peer: &Peer, wr: &SendWr, status: WcStatus) {
    if status != WcStatus::Success || !crosses_link(wr) {
        return;
    }
    if let Some(memory) = peer.memory() {
        let bytes = wr.sges.iter().map(|sge| u64::from(sge.len)).sum();
        super::port::book(&device.table, memory.table(), bytes);
    }
}

fn crosses_link(wr: &SendWr) -> bool {
    matches!(
        wr.op,
        SendOp::Send | SendOp::Write { .. } | SendOp::WriteWithImm { .. }
    )
}

/// Work requests waiting behind a receiver-not-ready NAK or a busy link,
/// in posting order.
#[derive(Debug, Default)]
struct Stalled {
    wrs: std::collections::VecDeque<SendWr>,
    /// Retries of the head so far.
    tries: u8,
    /// When the head first met the NAK.
    since: Option<std::time::Instant>,
    /// The QP is destroyed: nothing executes any more.
    dead: bool,
}

impl SoftQpInner {
    pub(crate) fn new(
        qpn: u32,
        device: Weak<DeviceInner>,
        caps: QpCaps,
        send_cq: Arc<SoftCq>,
        recv_cq: Arc<SoftCq>,
        srq: Option<Arc<SoftSrq>>,
    ) -> Result<Self, VerbsError> {
        if let Some(device) = device.upgrade() {
            device.adopt_cq(&recv_cq);
        }
        let srq_id = srq.as_ref().map_or(0, |s| s.id);
        let segment = QpSegment::create(caps.max_recv_wr, recv_cq.id, srq_id)
            .map_err(|e| VerbsError::NoDevice(format!("soft NIC shared memory: {e}")))?;
        Ok(Self {
            qpn,
            device,
            caps,
            segment: Arc::new(segment),
            local: Mutex::new(QpLocal {
                remote: None,
                peer: None,
                unsignaled_run: 0,
                flushed: false,
                path_mtu: 0,
            }),
            send_outstanding: Arc::new(AtomicU32::new(0)),
            send_cq,
            recv_cq,
            srq,
            stalled: Mutex::new(Stalled::default()),
        })
    }

    fn stalled(&self) -> MutexGuard<'_, Stalled> {
        self.stalled.locked()
    }

    /// Whether work requests wait for the retry engine.
    pub(crate) fn has_stalled(&self) -> bool {
        !self.stalled().wrs.is_empty()
    }

    /// Runs one work request now, as its QP stands; `Err(when)` while the
    /// link holds it (`port.rs`: when it frees, monotonic nanoseconds).
    fn run_one(&self, wr: &SendWr) -> Result<WcStatus, u64> {
        let (remote, peer, path_mtu) = {
            let local = self.local();
            (local.remote, local.peer.clone(), local.path_mtu)
        };
        Ok(match (self.device.upgrade(), peer, remote, self.state()) {
            (Some(device), Some(peer), Some(remote), QpState::ReadyToSend) => {
                link_admits(&device, &peer, wr)?;
                let status = self.execute(&device, &peer, remote, path_mtu, wr);
                link_book(&device, &peer, wr, status);
                status
            }
            _ => WcStatus::Flushed,
        })
    }

    /// Records the final outcome of `wr` (a failure fails the QP).
    fn finish(&self, wr: &SendWr, status: WcStatus) {
        if status != WcStatus::Success {
            self.enter_error();
        }
        self.complete_send(wr, status);
    }

    /// The retry engine's pass: retries the stalled work requests in order
    /// until one meets the NAK again with retries left, or the link holds
    /// it. Returns what is left. Completions made here wake the send CQ's
    /// owner.
    pub(crate) fn retry_stalled(&self) -> Left {
        let mut stalled = self.stalled();
        let mut completed = false;
        let mut held_until = None;
        while !stalled.dead {
            let Some(wr) = stalled.wrs.front().cloned() else {
                break;
            };
            let status = match self.run_one(&wr) {
                Ok(status) => status,
                Err(free_at) => {
                    held_until = Some(free_at);
                    break;
                }
            };
            if status == WcStatus::ReceiverNotReady {
                stalled.tries = stalled.tries.saturating_add(1);
                let since = *stalled.since.get_or_insert_with(std::time::Instant::now);
                let again = match self.caps.rnr_retry {
                    7.. => since.elapsed() < RNR_RETRY_FOREVER,
                    n => stalled.tries < n,
                };
                if again {
                    break;
                }
            }
            stalled.wrs.pop_front();
            stalled.tries = 0;
            stalled.since = None;
            self.finish(&wr, status);
            completed = true;
        }
        let left = match (stalled.dead || stalled.wrs.is_empty(), held_until) {
            (true, _) => Left::Nothing,
            (false, Some(free_at)) => Left::HeldByLink(free_at),
            (false, None) => Left::Rnr,
        };
        drop(stalled);
        if completed {
            // Not the owner's thread: its CQs' sleeper is woken (the
            // receive CQ gets the flushes of a QP that failed here).
            crate::verbs::CompletionQueue::wake(&*self.send_cq);
            if !Arc::ptr_eq(&self.send_cq, &self.recv_cq) {
                crate::verbs::CompletionQueue::wake(&*self.recv_cq);
            }
        }
        left
    }

    fn local(&self) -> MutexGuard<'_, QpLocal> {
        self.local.locked()
    }

    /// The state; a QP that a peer put in error is flushed when seen.
    fn state(&self) -> QpState {
        match self.segment.state() {
            STATE_RESET => QpState::Reset,
            STATE_INIT => QpState::Init,
            STATE_RTR => QpState::ReadyToReceive,
            STATE_READY => QpState::ReadyToSend,
            _ => {
                self.flush();
                QpState::Error
            }
        }
    }

    fn delay(&self) -> u32 {
        self.device.upgrade().map_or(0, |d| d.roll(Fault::Delay))
    }

    /// Moves the QP to the error state and flushes its posted receives.
    pub(crate) fn enter_error(&self) {
        self.segment.set_state(STATE_ERROR);
        self.flush();
    }

    /// Flushes the posted receives (once).
    fn flush(&self) {
        {
            let mut local = self.local();
            if local.flushed {
                return;
            }
            local.flushed = true;
        }
        // Completions peers pushed before come first.
        self.recv_cq.collect();
        // A shared receive queue's receives belong to every QP on it.
        if self.srq.is_some() {
            return;
        }
        while let Some(wr) = self.segment.take_recv() {
            self.recv_cq.push(Pending {
                completion: WorkCompletion {
                    wr_id: wr.wr_id,
                    status: WcStatus::Flushed,
                    kind: WcKind::Recv,
                    byte_len: 0,
                    qpn: self.qpn,
                    vendor_err: 0,
                },
                delay_polls: 0,
                frees: None,
            });
        }
    }

    /// Records the outcome of one send work request.
    fn complete_send(&self, wr: &SendWr, status: WcStatus) {
        let mut local = self.local();
        let slots = local.unsignaled_run + 1;
        if status == WcStatus::Success && !wr.signaled {
            local.unsignaled_run += 1;
            return;
        }
        local.unsignaled_run = 0;
        drop(local);
        self.send_cq.push(Pending {
            completion: WorkCompletion {
                wr_id: wr.wr_id,
                status,
                kind: WcKind::Send,
                byte_len: 0,
                qpn: self.qpn,
                vendor_err: 0,
            },
            delay_polls: self.delay(),
            frees: Some((slots, Arc::clone(&self.send_outstanding))),
        });
    }

    /// Runs one send work request against the peer; returns its status.
    fn execute(
        &self,
        device: &DeviceInner,
        peer: &Peer,
        remote: QpEndpoint,
        path_mtu: u32,
        wr: &SendWr,
    ) -> WcStatus {
        // Memory-window operations are local: they move nothing.
        match wr.op {
            SendOp::BindWindow {
                window,
                rkey,
                addr,
                len,
                lkey,
                region: _,
            } => {
                if !wr.sges.is_empty() {
                    return WcStatus::LocalProtectionError;
                }
                return device.bind_window(window, rkey, addr, len, lkey, self.qpn);
            }
            SendOp::Invalidate { rkey } => {
                let status = device.invalidate_window(rkey);
                // Writes that found the key before it went may still be
                // copying: the invalidation completes once they are done
                // (they enter through this QP's DMA guard), as a NIC's
                // does once no packet of the old binding can land.
                if status == WcStatus::Success {
                    std::sync::atomic::fence(Ordering::SeqCst);
                    if !self.segment.wait_dma_idle(DMA_DRAIN_LIMIT) {
                        return WcStatus::LocalProtectionError;
                    }
                }
                return status;
            }
            SendOp::Send | SendOp::Write { .. } | SendOp::WriteWithImm { .. } => {}
        }
        // This device's own port down (or the device dead): nothing leaves.
        if device.table.is_dead() {
            return WcStatus::RetryExceeded;
        }
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
        // A path MTU above the peer port's: packets larger than the peer's
        // MTU never arrive, so every message above it times out.
        if path_mtu > remote.mtu && total > remote.mtu as usize {
            return WcStatus::RetryExceeded;
        }
        let Some(memory) = peer.memory() else {
            return WcStatus::RetryExceeded;
        };
        // The receive a SEND or WRITE_WITH_IMM consumes is waited for
        // (receiver-not-ready retries) before the DMA guard: a sender
        // waiting there would hold up whatever waits for the peer's guard
        // to empty (its invalidations, its teardown) while the peer's
        // thread, the one to post more receives, waits in it.
        // A responder not (yet, or no longer) taking traffic drops the
        // packets: the sender's retries run out, whether or not it has
        // receives posted.
        if !peer.qp.receiving() {
            return WcStatus::RetryExceeded;
        }
        let recv = match wr.op {
            SendOp::Send | SendOp::WriteWithImm { .. } => {
                match take_recv_once(device, &memory, &peer.recvs) {
                    Some(recv) => Some(recv),
                    None => return WcStatus::ReceiverNotReady,
                }
            }
            _ => None,
        };
        // Inside the peer's DMA guard, so the peer cannot tear the QP down
        // (and free the memory behind it) between the checks and the copy.
        if !peer.qp.begin_dma() {
            return WcStatus::RetryExceeded;
        }
        let status = self.execute_guarded(device, peer, &memory, remote, wr, recv, &gather, total);
        peer.qp.end_dma();
        if status == WcStatus::Success {
            device
                .bytes_moved
                .fetch_add(total as u64, Ordering::Relaxed);
        }
        status
    }

    #[allow(clippy::too_many_arguments)]
    fn execute_guarded(
        &self,
        device: &DeviceInner,
        peer: &Peer,
        memory: &PeerMemory<'_>,
        remote: QpEndpoint,
        wr: &SendWr,
        recv: Option<RecvWr>,
        gather: &[(usize, usize)],
        total: usize,
    ) -> WcStatus {
        let complete_peer = |wr_id: u64, status: WcStatus, kind: WcKind, byte_len: u32| {
            let pushed = peer.cq().push(RingCompletion {
                completion: WorkCompletion {
                    wr_id,
                    status,
                    kind,
                    byte_len,
                    qpn: remote.qpn,
                    vendor_err: 0,
                },
                delay_polls: device.roll(Fault::Delay),
            });
            if !pushed {
                // Completion queue overrun: the peer's QP fails.
                peer.qp.set_state(STATE_ERROR);
            }
            pushed
        };
        let fail_peer = |wr_id: u64, status: WcStatus| {
            complete_peer(wr_id, status, WcKind::Recv, 0);
            peer.qp.set_state(STATE_ERROR);
            WcStatus::RemoteOperationError
        };
        match wr.op {
            SendOp::Send => {
                let Some(recv) = recv else {
                    return WcStatus::ReceiverNotReady;
                };
                if total > recv.sge.len as usize || device.roll(Fault::RecvError) > 0 {
                    return fail_peer(recv.wr_id, WcStatus::LocalLengthError);
                }
                let Some(target) = memory.resolve(recv.sge.lkey, recv.sge.addr, total, None) else {
                    return fail_peer(recv.wr_id, WcStatus::LocalProtectionError);
                };
                copy_gather(gather, target.addr);
                if !complete_peer(recv.wr_id, WcStatus::Success, WcKind::Recv, total as u32) {
                    return WcStatus::RemoteOperationError;
                }
                WcStatus::Success
            }
            SendOp::Write { remote_addr, rkey } => {
                let Some(target) = memory.resolve(rkey, remote_addr, total, Some(remote.qpn))
                else {
                    memory.table().count_remote_access_error();
                    return WcStatus::RemoteAccessError;
                };
                copy_gather(gather, target.addr);
                #[cfg(test)]
                super::tap::wrote(remote_addr, total);
                WcStatus::Success
            }
            SendOp::WriteWithImm {
                remote_addr,
                rkey,
                imm,
            } => {
                // The responder needs a receive before it accepts the data.
                let Some(recv) = recv else {
                    return WcStatus::ReceiverNotReady;
                };
                let Some(target) = memory.resolve(rkey, remote_addr, total, Some(remote.qpn))
                else {
                    // The receive it took completes in error and the
                    // responder's QP fails too (rxe's responder does so on
                    // an access error).
                    memory.table().count_remote_access_error();
                    fail_peer(recv.wr_id, WcStatus::RemoteAccessError);
                    return WcStatus::RemoteAccessError;
                };
                copy_gather(gather, target.addr);
                #[cfg(test)]
                super::tap::wrote(remote_addr, total);
                if !complete_peer(
                    recv.wr_id,
                    WcStatus::Success,
                    WcKind::RecvWithImm(imm),
                    total as u32,
                ) {
                    return WcStatus::RemoteOperationError;
                }
                WcStatus::Success
            }
            // Run locally by `execute`, never against the peer.
            SendOp::BindWindow { .. } | SendOp::Invalidate { .. } => WcStatus::LocalProtectionError,
        }
    }
}

/// Longest a SEND keeps being retried when its QP's `rnr_retry` is 7
/// ("without end"): far above any repost delay of a live receiver, and
/// bounded so a dead one cannot stall the QP for long.
const RNR_RETRY_FOREVER: Duration = Duration::from_millis(500);

/// A receive from `recvs`, if one is posted; a miss is a counted
/// receiver-not-ready event (the retry engine tries again later).
fn take_recv_once(
    device: &DeviceInner,
    memory: &PeerMemory<'_>,
    recvs: &QpSegment,
) -> Option<RecvWr> {
    let recv = if device.roll(Fault::Rnr) > 0 {
        None
    } else {
        recvs.take_recv()
    };
    if recv.is_none() {
        memory.table().count_rnr();
    }
    recv
}

/// Copies the gather list to consecutive bytes at `dest`.
fn copy_gather(gather: &[(usize, usize)], dest: usize) {
    let mut at = dest;
    for &(src, len) in gather {
        // SAFETY: the source range lies in a region registered with the
        // local device (checked before; memory named by a posted work
        // request stays registered until the request completes, the verbs
        // contract the transport keeps by owning its buffers). The
        // destination range was checked against the peer's registration and
        // lies in this process's address space: the peer's own memory when
        // it lives in this process, else a shared mapping of it that
        // `Target` keeps alive; the peer's DMA guard is held, so it cannot
        // free that memory meanwhile. `copy` tolerates overlap (a QP
        // writing into its own memory).
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
        // As strict as rxe: a window still bound here holds the QP there,
        // and its destruction blocks up to 50 s waiting for it.
        if let Some(device) = self.inner.device.upgrade() {
            let bound = device.windows_bound_on(self.inner.qpn);
            if bound > 0 {
                device
                    .qps_destroyed_with_bound_windows
                    .fetch_add(1, Ordering::Relaxed);
                tracing::error!(
                    qpn = self.inner.qpn,
                    bound,
                    "soft NIC: a queue pair destroyed with memory windows still bound on it \
                     (rxe blocks ibv_destroy_qp up to 50 s for that: deallocate them first)"
                );
            }
        }
        // The retry engine runs nothing more on it (it waits here for a
        // retry under way): the memory its stalled requests name is the
        // owner's to free once the QP is gone.
        {
            let mut stalled = self.inner.stalled();
            stalled.dead = true;
            stalled.wrs.clear();
        }
        // Refuse new writes and wait out those in progress.
        self.inner.segment.set_state(STATE_ERROR);
        if !self.inner.segment.wait_dma_idle(DMA_DRAIN_LIMIT) {
            tracing::warn!(
                qpn = self.inner.qpn,
                "a peer did not leave the DMA guard of a destroyed soft QP"
            );
        }
        self.inner.flush();
    }
}

impl SoftQp {
    /// Send-queue slots in use.
    pub fn send_outstanding(&self) -> u32 {
        self.inner.send_outstanding.load(Ordering::Acquire)
    }

    /// Receives posted and not yet consumed.
    pub fn recvs_posted(&self) -> usize {
        self.inner.segment.posted()
    }
}

impl QueuePair for SoftQp {
    fn qpn(&self) -> u32 {
        self.inner.qpn
    }

    fn endpoint(&self) -> QpEndpoint {
        let (node, port) = self
            .inner
            .device
            .upgrade()
            .map_or((0, super::SoftPort::default()), |d| (d.node, d.port));
        // A RoCE port has a GID: an IPv4-mapped loopback address numbered
        // by the device (InfiniBand ports address by LID instead).
        let (lid, gid) = match port.link_layer {
            crate::verbs::LinkLayer::Ethernet => {
                let mut gid = [0u8; 16];
                gid[10] = 0xff;
                gid[11] = 0xff;
                gid[12] = 127;
                gid[13..16].copy_from_slice(&(node as u32 | 1).to_be_bytes()[1..]);
                (0, gid)
            }
            crate::verbs::LinkLayer::InfiniBand => ((node as u16) | 1, [0; 16]),
        };
        QpEndpoint {
            qpn: self.inner.qpn,
            lid,
            gid,
            psn: self.inner.qpn.wrapping_mul(2_654_435_761) & 0x00ff_ffff,
            node,
            mtu: port.mtu,
            link_layer: port.link_layer,
            gid_type: port.gid_type,
        }
    }

    fn init(&self) -> Result<(), VerbsError> {
        let state = self.inner.state();
        if state != QpState::Reset {
            return Err(VerbsError::WrongState {
                qpn: self.inner.qpn,
                state,
            });
        }
        self.inner.segment.set_state(STATE_INIT);
        Ok(())
    }

    fn connect(&self, remote: &QpEndpoint) -> Result<(), VerbsError> {
        let state = self.inner.state();
        if state != QpState::Init {
            return Err(VerbsError::WrongState {
                qpn: self.inner.qpn,
                state,
            });
        }
        let device = self.inner.device.upgrade().ok_or(VerbsError::UnknownPeer {
            node: remote.node,
            qpn: remote.qpn,
        })?;
        let path_mtu = crate::verbs::port::agree(&self.endpoint(), remote)?;
        let peer = Peer::resolve(&device, remote)?;
        let mut local = self.inner.local();
        local.path_mtu = path_mtu;
        local.remote = Some(*remote);
        local.peer = Some(Arc::new(peer));
        drop(local);
        // RTR, then RTS (as `ibv_modify_qp` twice).
        self.inner.segment.set_state(STATE_RTR);
        self.inner.segment.set_state(STATE_READY);
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
        // Sends only in RTS (an ERROR QP takes them and flushes them).
        let state = inner.state();
        if matches!(
            state,
            QpState::Reset | QpState::Init | QpState::ReadyToReceive
        ) {
            return Err(VerbsError::WrongState {
                qpn: inner.qpn,
                state,
            });
        }
        // Read once per post, not per work request.
        let (remote, peer, path_mtu) = {
            let local = inner.local();
            (local.remote, local.peer.clone(), local.path_mtu)
        };
        let device = inner.device.upgrade();
        // An injected post failure: the work requests before the drawn one
        // go up, the rest do not (`bad_wr`).
        let stop = device.as_ref().and_then(|d| d.roll_post_failure(wrs.len()));
        let (wrs, failed) = match stop {
            Some(posted) => (&wrs[..posted], Some(posted)),
            None => (wrs, None),
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
        let mut stalled = inner.stalled();
        let mut stalls = false;
        for wr in wrs {
            // RC order: behind a stalled request, everything waits.
            if !stalled.wrs.is_empty() {
                stalled.wrs.push_back(wr.clone());
                continue;
            }
            let status = match (&device, &peer, remote, inner.state()) {
                (Some(device), Some(peer), Some(remote), QpState::ReadyToSend) => {
                    if link_admits(device, peer, wr).is_err() {
                        // The link is busy: it waits in the send queue,
                        // and the retry engine sends it when it frees.
                        stalled.wrs.push_back(wr.clone());
                        stalls = true;
                        continue;
                    }
                    let status = inner.execute(device, peer, remote, path_mtu, wr);
                    link_book(device, peer, wr, status);
                    status
                }
                _ => WcStatus::Flushed,
            };
            if status == WcStatus::ReceiverNotReady && inner.caps.rnr_retry > 0 {
                // The retry engine takes it from here, as a NIC's hardware
                // does; this thread goes on.
                stalled.wrs.push_back(wr.clone());
                stalled.tries = 0;
                stalled.since = Some(std::time::Instant::now());
                stalls = true;
                continue;
            }
            inner.finish(wr, status);
        }
        drop(stalled);
        if stalls {
            super::retry::register(&self.inner);
        }
        match failed {
            Some(posted) => Err(post_failed("send", posted)),
            None => Ok(()),
        }
    }

    fn post_recv(&self, wrs: &[RecvWr]) -> Result<(), VerbsError> {
        let inner = &self.inner;
        if inner.srq.is_some() {
            return Err(VerbsError::InvalidRequest(
                "this QP takes its receives from a shared receive queue".into(),
            ));
        }
        let state = inner.state();
        if state == QpState::Reset {
            // rxe and hns refuse with EINVAL: receives need INIT.
            return Err(VerbsError::WrongState {
                qpn: inner.qpn,
                state,
            });
        }
        if state == QpState::Error {
            for wr in wrs {
                inner.recv_cq.push(Pending {
                    completion: WorkCompletion {
                        wr_id: wr.wr_id,
                        status: WcStatus::Flushed,
                        kind: WcKind::Recv,
                        byte_len: 0,
                        qpn: inner.qpn,
                        vendor_err: 0,
                    },
                    delay_polls: 0,
                    frees: None,
                });
            }
            return Ok(());
        }
        let stop = inner
            .device
            .upgrade()
            .and_then(|d| d.roll_post_failure(wrs.len()));
        let (wrs, failed) = match stop {
            Some(posted) => (&wrs[..posted], Some(posted)),
            None => (wrs, None),
        };
        // One poster at a time: the local lock makes the owner the ring's
        // single producer.
        let _local = inner.local();
        let posted = inner.segment.posted();
        let depth = inner.caps.max_recv_wr as usize;
        if posted + wrs.len() > depth {
            return Err(VerbsError::QueueFull {
                queue: "recv",
                posted: u32::try_from(posted + wrs.len()).unwrap_or(u32::MAX),
                depth: inner.caps.max_recv_wr,
            });
        }
        for wr in wrs {
            if !inner.segment.push_recv(wr) {
                return Err(VerbsError::QueueFull {
                    queue: "recv",
                    posted: u32::try_from(posted + wrs.len()).unwrap_or(u32::MAX),
                    depth: inner.caps.max_recv_wr,
                });
            }
        }
        match failed {
            Some(posted) => Err(post_failed("recv", posted)),
            None => Ok(()),
        }
    }

    fn state(&self) -> QpState {
        self.inner.state()
    }

    fn fail(&self) -> Result<(), VerbsError> {
        // New writes are refused from here on; one already copying is
        // waited for only by `quiesce` (before, here: a peer frozen in the
        // middle of a copy held up every failure by the drain bound).
        self.inner.enter_error();
        Ok(())
    }

    fn quiesce(&self) {
        // Like a NIC's QP in error, it takes no more writes once this
        // returns: those already copying finish first.
        std::sync::atomic::fence(Ordering::SeqCst);
        if !self.inner.segment.wait_dma_idle(DMA_DRAIN_LIMIT) {
            tracing::warn!(
                qpn = self.inner.qpn,
                "a peer did not leave the DMA guard of a failed soft QP"
            );
        }
    }
}

/// The error of a post that stopped after `posted` work requests (ENOMEM,
/// as a provider out of queue memory answers).
fn post_failed(queue: &'static str, posted: usize) -> VerbsError {
    VerbsError::PostFailed {
        queue,
        posted: u32::try_from(posted).unwrap_or(u32::MAX),
        errno: libc::ENOMEM,
    }
}
