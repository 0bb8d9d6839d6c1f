//! Queue pairs: creation (with inline data and a thread domain where the
//! device has them), the RESET -> INIT -> RTR -> RTS transitions, posting.

use super::*;
#[allow(clippy::wildcard_imports)]
use crate::sync::LockExt;

/// Inline data asked of every QP: room for a control message (a header
/// of the RDMA engine is 32 bytes) and a little more.
pub(super) const INLINE_WANTED: u32 = 64;

/// Packet sequence numbers are 24 bits.
pub(super) const PSN_MASK: u32 = 0x00ff_ffff;

/// An RC queue pair of the device.
#[derive(Debug)]
pub struct IbvQp {
    pub(super) qp: *mut ibv_qp,
    /// The thread domain the QP was created in, where the device has them.
    pub(super) domain: Option<ThreadDomain>,
    /// Held while posting when the QP lives in a thread domain: the device
    /// then takes no locks of its own and relies on one poster at a time.
    /// Uncontended (one driver thread posts), it costs one atomic.
    pub(super) post_guard: Mutex<()>,
    pub(super) ctx: Arc<Context>,
    pub(super) state: Mutex<QpState>,
    pub(super) psn: u32,
    pub(super) rnr_retry: u8,
    /// Bytes a send may carry inline (copied into the work request: no
    /// DMA read of the buffer, less latency for control messages).
    pub(super) inline: u32,
    pub(super) _cqs: (Arc<IbvCq>, Arc<IbvCq>),
    pub(super) _srq: Option<Arc<IbvSrq>>,
}

/// Receive work requests as libibverbs takes them: a linked list whose
/// entries point at their scatter/gather entries. Both live in vectors
/// whose heap buffers do not move when the struct does, so the pointers
/// stay valid for as long as it lives.
pub(super) struct RecvList {
    pub(super) _sges: Vec<ibv_sge>,
    pub(super) list: Vec<ibv_recv_wr>,
}

impl RecvList {
    /// The list for `wrs` (not empty).
    pub(super) fn new(wrs: &[RecvWr]) -> Self {
        let mut sges: Vec<ibv_sge> = wrs
            .iter()
            .map(|wr| ibv_sge {
                addr: wr.sge.addr as u64,
                length: wr.sge.len,
                lkey: wr.sge.lkey,
            })
            .collect();
        // SAFETY: plain data (integers and pointers); zeroed is a valid
        // value, and every field used is set below.
        let mut list: Vec<ibv_recv_wr> = (0..wrs.len())
            .map(|_| unsafe { std::mem::zeroed() })
            .collect();
        for (i, wr) in wrs.iter().enumerate() {
            list[i].wr_id = wr.wr_id;
            list[i].sg_list = &mut sges[i];
            list[i].num_sge = 1;
        }
        for i in 1..list.len() {
            let next: *mut ibv_recv_wr = &mut list[i];
            list[i - 1].next = next;
        }
        Self { _sges: sges, list }
    }

    /// The first entry, for a post call.
    pub(super) fn head(&mut self) -> *mut ibv_recv_wr {
        self.list.as_mut_ptr()
    }
}

// SAFETY: posting to a QP is thread-safe in libibverbs, and for a QP in a
// thread domain (where it is not) `post_guard` serialises the posts.
unsafe impl Send for IbvQp {}

// SAFETY: as above.
unsafe impl Sync for IbvQp {}

impl Drop for IbvQp {
    fn drop(&mut self) {
        // SAFETY: the QP was created in `create_qp` and is destroyed once.
        unsafe { ibv_destroy_qp(self.qp) };
        // Its thread domain goes after it.
        drop(self.domain.take());
    }
}

impl IbvQp {
    pub(super) fn modify(
        &self,
        attr: &mut ibv_qp_attr,
        mask: ibv_qp_attr_mask,
        step: &str,
    ) -> Result<(), VerbsError> {
        // SAFETY: `qp` is alive and `attr` a valid attribute block.
        let rc = unsafe { ibv_modify_qp(self.qp, attr, mask.0 as i32) };
        if rc != 0 {
            // The error is the return value (errno is not set).
            return Err(VerbsError::InvalidRequest(format!(
                "{step}: {}",
                std::io::Error::from_raw_os_error(rc)
            )));
        }
        Ok(())
    }
}

/// How many entries of the list at `first` (of `len`) a failed post put up
/// before `bad`, the entry it stopped at (none if `bad` is not one of
/// them: the provider did not say).
pub(super) fn posted_before<T>(first: *const T, len: usize, bad: *const T) -> u32 {
    let (start, at) = (first as usize, bad as usize);
    let size = std::mem::size_of::<T>().max(1);
    if at < start || at >= start + len * size {
        return 0;
    }
    u32::try_from((at - start) / size).unwrap_or(u32::MAX)
}

impl QueuePair for IbvQp {
    fn qpn(&self) -> u32 {
        // SAFETY: `qp` is alive; qp_num is immutable after creation.
        unsafe { (*self.qp).qp_num }
    }

    fn endpoint(&self) -> QpEndpoint {
        QpEndpoint {
            qpn: self.qpn(),
            lid: self.ctx.lid,
            gid: self.ctx.gid,
            psn: self.psn,
            node: 0,
            mtu: self.ctx.mtu,
            link_layer: self.ctx.link_layer,
            gid_type: self.ctx.gid_type,
        }
    }

    fn init(&self) -> Result<(), VerbsError> {
        let state = self.state();
        if state != QpState::Reset {
            return Err(VerbsError::WrongState {
                qpn: self.qpn(),
                state,
            });
        }
        let ctx = &self.ctx;
        // SAFETY: ibv_qp_attr is plain data; zeroed is a valid start.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv_qp_state::IBV_QPS_INIT;
        attr.pkey_index = 0;
        attr.port_num = ctx.port;
        attr.qp_access_flags = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0
            | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        self.modify(
            &mut attr,
            ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
                | ibv_qp_attr_mask::IBV_QP_PORT
                | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS,
            "ibv_modify_qp(INIT)",
        )?;
        *self.state.locked() = QpState::Init;
        Ok(())
    }

    fn connect(&self, remote: &QpEndpoint) -> Result<(), VerbsError> {
        let state = self.state();
        if state != QpState::Init {
            return Err(VerbsError::WrongState {
                qpn: self.qpn(),
                state,
            });
        }
        let ctx = &self.ctx;
        // Same link layer and RoCE version, the smaller MTU.
        let mtu = port::agree(&self.endpoint(), remote)?;
        // SAFETY: ibv_qp_attr is plain data; zeroed is a valid start.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv_qp_state::IBV_QPS_RTR;
        attr.path_mtu = mtu_enum(mtu);
        attr.dest_qp_num = remote.qpn;
        attr.rq_psn = remote.psn & PSN_MASK;
        attr.max_dest_rd_atomic = 1;
        attr.min_rnr_timer = 12;
        attr.ah_attr.dlid = remote.lid;
        attr.ah_attr.port_num = ctx.port;
        // RoCE addresses by GID: every packet carries a GRH (without one,
        // RTR fails with EINVAL). InfiniBand on one subnet needs none.
        if ctx.link_layer == LinkLayer::Ethernet {
            attr.ah_attr.is_global = 1;
            attr.ah_attr.grh.dgid = ibv_gid { raw: remote.gid };
            attr.ah_attr.grh.sgid_index = ctx.gid_index;
            // Routable (RoCE v2): a hop count that crosses a data centre.
            attr.ah_attr.grh.hop_limit = 64;
            attr.ah_attr.grh.traffic_class = ctx.traffic_class;
        }
        self.modify(
            &mut attr,
            ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_AV
                | ibv_qp_attr_mask::IBV_QP_PATH_MTU
                | ibv_qp_attr_mask::IBV_QP_DEST_QPN
                | ibv_qp_attr_mask::IBV_QP_RQ_PSN
                | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
                | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER,
            "ibv_modify_qp(RTR)",
        )?;
        *self.state.locked() = QpState::ReadyToReceive;
        // SAFETY: as above.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv_qp_state::IBV_QPS_RTS;
        attr.sq_psn = self.psn & PSN_MASK;
        attr.timeout = 14;
        attr.retry_cnt = 7;
        attr.rnr_retry = self.rnr_retry;
        attr.max_rd_atomic = 1;
        self.modify(
            &mut attr,
            ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_SQ_PSN
                | ibv_qp_attr_mask::IBV_QP_TIMEOUT
                | ibv_qp_attr_mask::IBV_QP_RETRY_CNT
                | ibv_qp_attr_mask::IBV_QP_RNR_RETRY
                | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC,
            "ibv_modify_qp(RTS)",
        )?;
        *self.state.locked() = QpState::ReadyToSend;
        Ok(())
    }

    fn post_send(&self, wrs: &[SendWr]) -> Result<(), VerbsError> {
        if wrs.is_empty() {
            return Ok(());
        }
        // A bind hands libibverbs its window and region as pointers: only
        // ones alive on this context, checked and kept alive (the lock)
        // until the post is done; a made-up handle is refused here.
        let binds = wrs
            .iter()
            .any(|wr| matches!(wr.op, SendOp::BindWindow { .. }));
        let live = match binds {
            false => None,
            true => {
                let live = self.ctx.live.locked();
                for wr in wrs {
                    if let SendOp::BindWindow { window, region, .. } = wr.op
                        && !(live.windows.contains(&window) && live.regions.contains(&region))
                    {
                        return Err(VerbsError::InvalidRequest(format!(
                            "work request {} binds a window or region that is not alive on this device",
                            wr.wr_id
                        )));
                    }
                }
                Some(live)
            }
        };
        let mut sges: Vec<Vec<ibv_sge>> = wrs
            .iter()
            .map(|wr| {
                wr.sges
                    .iter()
                    .map(|s| ibv_sge {
                        addr: s.addr as u64,
                        length: s.len,
                        lkey: s.lkey,
                    })
                    .collect()
            })
            .collect();
        // SAFETY: ibv_send_wr is plain data (pointers and integers); zeroed
        // is a valid start, and every field used is set below.
        let mut list: Vec<ibv_send_wr> = (0..wrs.len())
            .map(|_| unsafe { std::mem::zeroed() })
            .collect();
        for ((entry, wr), sges) in list.iter_mut().zip(wrs).zip(sges.iter_mut()) {
            fill_send_wr(entry, wr, sges, self.inline);
        }
        // Link the list (one doorbell for all of it).
        for i in 0..list.len() - 1 {
            let next: *mut ibv_send_wr = &mut list[i + 1];
            list[i].next = next;
        }
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        let _one_poster = self.post_guard.locked();
        // SAFETY: `list` and `sges` outlive the call (the library copies
        // work requests into the send queue before returning); one thread
        // posts at a time (the guard), as a thread domain requires; the
        // windows and regions a bind names are alive (checked under the
        // `live` lock, held through the call).
        let rc = unsafe { ibv_post_send(self.qp, list.as_mut_ptr(), &mut bad) };
        let posted = match rc {
            0 => wrs.len(),
            _ => posted_before(list.as_ptr(), list.len(), bad) as usize,
        };
        // A window's key is its latest binding's: providers name the window
        // by `mw->rkey` in the next bind (rxe refuses one whose key is not
        // the kernel's current one), as `ibv_bind_mw` would have set it.
        if live.is_some() {
            for wr in &wrs[..posted.min(wrs.len())] {
                if let SendOp::BindWindow { window, rkey, .. } = wr.op {
                    // SAFETY: `window` is a live ibv_mw of this context
                    // (checked above under the `live` lock, still held, so
                    // it cannot be deallocated meanwhile).
                    unsafe { (*(window as *mut ibv_mw)).rkey = rkey };
                }
            }
        }
        drop(live);
        if rc != 0 {
            return Err(VerbsError::PostFailed {
                queue: "send",
                posted: posted as u32,
                errno: rc,
            });
        }
        Ok(())
    }

    fn post_recv(&self, wrs: &[RecvWr]) -> Result<(), VerbsError> {
        if wrs.is_empty() {
            return Ok(());
        }
        let mut list = RecvList::new(wrs);
        let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
        let _one_poster = self.post_guard.locked();
        // SAFETY: `list` (and the entries it points to) outlives the call;
        // one thread posts at a time (the guard).
        let rc = unsafe { ibv_post_recv(self.qp, list.head(), &mut bad) };
        if rc != 0 {
            return Err(VerbsError::PostFailed {
                queue: "recv",
                posted: posted_before(list.list.as_ptr(), list.list.len(), bad),
                errno: rc,
            });
        }
        Ok(())
    }

    fn state(&self) -> QpState {
        *self.state.locked()
    }

    fn fail(&self) -> Result<(), VerbsError> {
        // SAFETY: ibv_qp_attr is plain data; zeroed is a valid start.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv_qp_state::IBV_QPS_ERR;
        let result = self.modify(
            &mut attr,
            ibv_qp_attr_mask::IBV_QP_STATE,
            "ibv_modify_qp(ERR)",
        );
        *self.state.locked() = QpState::Error;
        result
    }
}

/// Translates `wr` into libibverbs' `entry` (zeroed before), its gather
/// list pointing into `sges`, which must outlive the post; a send of at
/// most `inline` bytes goes inline.
fn fill_send_wr(entry: &mut ibv_send_wr, wr: &SendWr, sges: &mut [ibv_sge], inline: u32) {
    entry.wr_id = wr.wr_id;
    entry.sg_list = sges.as_mut_ptr();
    entry.num_sge = sges.len() as i32;
    entry.send_flags = if wr.signaled {
        ibv_send_flags::IBV_SEND_SIGNALED.0
    } else {
        0
    };
    let bytes: u64 = wr.sges.iter().map(|s| u64::from(s.len)).sum();
    if bytes > 0 && bytes <= u64::from(inline) {
        entry.send_flags |= ibv_send_flags::IBV_SEND_INLINE.0;
    }
    match wr.op {
        SendOp::Send => entry.opcode = ibv_wr_opcode::IBV_WR_SEND,
        SendOp::Write { remote_addr, rkey } => {
            entry.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE;
            entry.wr.rdma = rdma_t {
                remote_addr: remote_addr as u64,
                rkey,
            };
        }
        SendOp::WriteWithImm {
            remote_addr,
            rkey,
            imm,
        } => {
            entry.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM;
            entry.wr.rdma = rdma_t {
                remote_addr: remote_addr as u64,
                rkey,
            };
            entry.imm_data_invalidated_rkey_union = imm_data_invalidated_rkey_union_t {
                imm_data: imm.to_be(),
            };
        }
        SendOp::BindWindow {
            window,
            rkey,
            addr,
            len,
            lkey: _,
            region,
        } => {
            entry.opcode = ibv_wr_opcode::IBV_WR_BIND_MW;
            entry.num_sge = 0;
            entry.bind_mw_tso_union = bind_mw_tso_union_t {
                bind_mw: bind_mw_t {
                    mw: window as *mut ibv_mw,
                    rkey,
                    bind_info: ibv_mw_bind_info {
                        mr: region as *mut ibv_mr,
                        addr: addr as u64,
                        length: len as u64,
                        mw_access_flags: ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0,
                    },
                },
            };
        }
        SendOp::Invalidate { rkey } => {
            entry.opcode = ibv_wr_opcode::IBV_WR_LOCAL_INV;
            entry.num_sge = 0;
            entry.imm_data_invalidated_rkey_union = imm_data_invalidated_rkey_union_t {
                invalidated_rkey: rkey,
            };
        }
    }
}

impl IbvDevice {
    pub(super) fn new_qp(
        &self,
        send_cq: Arc<dyn CompletionQueue>,
        recv_cq: Arc<dyn CompletionQueue>,
        srq: Option<Arc<IbvSrq>>,
        caps: QpCaps,
    ) -> Result<Arc<dyn QueuePair>, VerbsError> {
        self.ctx.limits.check_qp(&caps)?;
        let send_cq = crate::verbs::downcast_cq::<IbvCq>(send_cq)?;
        let recv_cq = crate::verbs::downcast_cq::<IbvCq>(recv_cq)?;
        // SAFETY: ibv_qp_init_attr is plain data; zeroed is a valid start.
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = send_cq.cq;
        init.recv_cq = recv_cq.cq;
        init.qp_type = ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 0;
        if let Some(srq) = &srq {
            init.srq = srq.srq;
        }
        init.cap = ibv_qp_cap {
            max_send_wr: caps.max_send_wr,
            max_recv_wr: caps.max_recv_wr,
            max_send_sge: caps.max_sge,
            max_recv_sge: 1,
            max_inline_data: INLINE_WANTED,
        };
        let domain = ThreadDomain::allocate(&self.ctx);
        let pd = domain.as_ref().map_or(self.ctx.pd, |d| d.parent);
        // SAFETY: the PD (or the parent domain over it) and both CQs are
        // alive; `init` is fully set.
        let mut qp = unsafe { ibv_create_qp(pd, &mut init) };
        if qp.is_null() {
            // A device without inline data (or with less) refuses the
            // request: again without.
            init.cap.max_inline_data = 0;
            // SAFETY: as above.
            qp = unsafe { ibv_create_qp(pd, &mut init) };
        }
        if qp.is_null() {
            return Err(VerbsError::InvalidRequest(os_error("ibv_create_qp")));
        }
        // What the device granted (it may round up).
        let inline = init.cap.max_inline_data;
        tracing::debug!(
            thread_domain = domain.is_some(),
            "ibverbs QP created{}",
            if domain.is_some() {
                " in its own thread domain"
            } else {
                ""
            }
        );
        Ok(Arc::new(IbvQp {
            qp,
            domain,
            post_guard: Mutex::new(()),
            ctx: Arc::clone(&self.ctx),
            state: Mutex::new(QpState::Reset),
            // Random, as rdma-core's examples do: a QP number reused soon
            // after must not start where its predecessor's packets were.
            psn: rand::random::<u32>() & PSN_MASK,
            rnr_retry: caps.rnr_retry.min(7),
            inline,
            _cqs: (send_cq, recv_cq),
            _srq: srq,
        }))
    }
}
