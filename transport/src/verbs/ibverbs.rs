//! The `ibverbs` provider: RC queue pairs on a real RNIC (or Soft-RoCE)
//! through libibverbs, via `rdma-sys`.
//!
//! [`IbvDevice::open`] reports a missing device or a kernel without
//! InfiniBand support as [`VerbsError::NoDevice`] with the reason (for
//! example `ibv_get_device_list: Function not implemented (os error 38)`),
//! never a crash; the transport then falls back or fails the connection.
//!
//! libibverbs objects are safe to use from several threads (the library
//! locks internally unless thread domains say otherwise), which is what the
//! `Send`/`Sync` implementations below rely on. Where the device supports
//! them (`ibv_alloc_td`), each QP is created in a thread domain of its own
//! (a parent domain over the PD), since one driver thread posts to it: the
//! provider then skips its locks and gives the QP its own doorbell; a
//! per-QP guard keeps a second poster from racing. Devices without thread
//! domains get a plain QP. (The extended verbs are reached through this
//! module's `extended`, not rdma-sys's inline wrappers, whose context check
//! never matches on 64-bit hosts.)
//!
//! Also: fork safety is set up before the first registration
//! (`ibv_fork_init`, unless the kernel needs none); sends of up to 64
//! bytes go inline where the device allows; CQs spread over the device's
//! completion vectors; the port must be active, and the GID is picked as
//! [`super::port::pick_gid`] says.

use std::ffi::CStr;
use std::sync::{Arc, Mutex};

use rdma_sys::*;

use super::port::{self, GidEntry, GidType, LinkLayer};
use super::{
    CompletionQueue, Device, DeviceLimits, QpCaps, QpEndpoint, QpState, QueuePair, RecvWr, SendOp,
    SendWr, SharedReceiveQueue, VerbsError, WcKind, WcStatus, WorkCompletion,
};
use crate::pool::{Access, RegisteredRegion, RegistrationError, RegistrationHook};

fn os_error(call: &str) -> String {
    format!("{call}: {}", std::io::Error::last_os_error())
}

/// An opened device: context, protection domain and the port's addressing.
#[derive(Debug)]
struct Context {
    ctx: *mut ibv_context,
    pd: *mut ibv_pd,
    name: String,
    port: u8,
    gid_index: u8,
    lid: u16,
    gid: [u8; 16],
    /// The port's active MTU, in bytes.
    mtu: u32,
    link_layer: LinkLayer,
    gid_type: GidType,
    /// Traffic class of the GRH (RoCE QoS), from the configuration.
    traffic_class: u8,
    /// From `ibv_query_device`.
    limits: DeviceLimits,
    /// The completion vector of the next CQ.
    next_vector: std::sync::atomic::AtomicU32,
}

// SAFETY: libibverbs contexts and protection domains may be used from any
// thread; the pointers are only freed in Drop, when no other handle exists.
unsafe impl Send for Context {}
// SAFETY: as above; all calls through these pointers are thread-safe verbs.
unsafe impl Sync for Context {}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: `pd` and `ctx` were created in `IbvDevice::open` and every
        // object made from them (CQs, QPs, MRs) holds an Arc to this context,
        // so none is left when it drops.
        unsafe {
            ibv_dealloc_pd(self.pd);
            ibv_close_device(self.ctx);
        }
    }
}

/// The names of the RDMA devices on this host.
pub fn device_names() -> Result<Vec<String>, VerbsError> {
    let mut count = 0;
    // SAFETY: `count` is a valid out-pointer; the list is freed below.
    let list = unsafe { ibv_get_device_list(&mut count) };
    if list.is_null() {
        return Err(VerbsError::NoDevice(os_error("ibv_get_device_list")));
    }
    let mut names = Vec::new();
    for i in 0..usize::try_from(count).unwrap_or(0) {
        // SAFETY: the list holds `count` valid device pointers, and a
        // device's name is a NUL-terminated string owned by the library.
        let name = unsafe { CStr::from_ptr(ibv_get_device_name(*list.add(i))) };
        names.push(name.to_string_lossy().into_owned());
    }
    // SAFETY: `list` came from ibv_get_device_list and is freed once.
    unsafe { ibv_free_device_list(list) };
    Ok(names)
}

/// What `tessera doctor` reports of one device: its limits and ports.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DeviceReport {
    /// The device's name (`mlx5_0`, `rxe0`).
    pub name: String,
    /// Its limits, if it could be queried.
    pub limits: Option<DeviceLimitsReport>,
    /// Its ports.
    pub ports: Vec<PortReport>,
    /// Why it could not be opened or queried, if it could not.
    pub error: Option<String>,
}

/// A device's limits, as reported.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DeviceLimitsReport {
    /// Entries of one completion queue.
    pub max_cqe: u32,
    /// Work requests of one queue.
    pub max_qp_wr: u32,
    /// Scatter/gather entries of one work request.
    pub max_sge: u32,
    /// Receives of one shared receive queue.
    pub max_srq_wr: u32,
    /// Queue pairs.
    pub max_qp: u32,
}

/// One port of a device.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PortReport {
    /// Its number (from 1).
    pub port: u8,
    /// Whether it is ACTIVE (the only state Tessera can use).
    pub active: bool,
    /// `ibv_port_state` as a number (4: active).
    pub state: u32,
    /// `InfiniBand` or `Ethernet`.
    pub link_layer: String,
    /// Active MTU in bytes.
    pub mtu: u32,
    /// Its LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Filled GID table entries: index, GID, type.
    pub gids: Vec<(u8, String, String)>,
    /// The entry Tessera would pick (RoCE).
    pub picked_gid: Option<u8>,
}

/// Every RDMA device of this host, described (for `tessera doctor`); an
/// error if libibverbs finds none (the reason says why, as a kernel
/// without InfiniBand support answers ENOSYS).
pub fn describe_devices() -> Result<Vec<DeviceReport>, VerbsError> {
    let names = device_names()?;
    Ok(names.iter().map(|name| describe(name)).collect())
}

fn describe(name: &str) -> DeviceReport {
    let mut report = DeviceReport {
        name: name.to_owned(),
        limits: None,
        ports: Vec::new(),
        error: None,
    };
    let mut count = 0;
    // SAFETY: `count` is a valid out-pointer; the list is freed below.
    let list = unsafe { ibv_get_device_list(&mut count) };
    if list.is_null() {
        report.error = Some(os_error("ibv_get_device_list"));
        return report;
    }
    let device = (0..usize::try_from(count).unwrap_or(0))
        // SAFETY: the list holds `count` valid device pointers.
        .map(|i| unsafe { *list.add(i) })
        // SAFETY: a listed device's name is a library-owned C string.
        .find(|&d| unsafe { CStr::from_ptr(ibv_get_device_name(d)) }.to_string_lossy() == name);
    // SAFETY: `device` is valid until the list is freed, after opening.
    let ctx = device.map_or(std::ptr::null_mut(), |d| unsafe { ibv_open_device(d) });
    // SAFETY: freeing the list obtained above, once.
    unsafe { ibv_free_device_list(list) };
    if ctx.is_null() {
        report.error = Some(os_error("ibv_open_device"));
        return report;
    }
    // SAFETY: a zeroed ibv_device_attr is a valid out-parameter.
    let mut attr: ibv_device_attr = unsafe { std::mem::zeroed() };
    // SAFETY: `ctx` is open and `attr` a valid out-pointer.
    if unsafe { ibv_query_device(ctx, &mut attr) } == 0 {
        let limit = |v: i32| u32::try_from(v).unwrap_or(0);
        report.limits = Some(DeviceLimitsReport {
            max_cqe: limit(attr.max_cqe),
            max_qp_wr: limit(attr.max_qp_wr),
            max_sge: limit(attr.max_sge),
            max_srq_wr: limit(attr.max_srq_wr),
            max_qp: limit(attr.max_qp),
        });
        for port in 1..=attr.phys_port_cnt {
            // SAFETY: a zeroed ibv_port_attr is a valid out-parameter.
            let mut port_attr: ibv_port_attr = unsafe { std::mem::zeroed() };
            // SAFETY: `ctx` is open and `port_attr` a valid out-pointer.
            if unsafe { ___ibv_query_port(ctx, port, &mut port_attr) } != 0 {
                continue;
            }
            let ethernet = port_attr.link_layer == 2;
            // SAFETY: `ctx` is open.
            let entries = unsafe { gid_entries(ctx, name, port, port_attr.gid_tbl_len) };
            let gids = entries
                .iter()
                .filter(|e| e.gid != [0; 16])
                .map(|e| {
                    let kind = match e.gid_type {
                        Some(GidType::RoceV2) => "RoCE v2",
                        Some(GidType::IbRoceV1) => "IB/RoCE v1",
                        None => "unknown",
                    };
                    (e.index, port::format_gid(&e.gid), kind.to_owned())
                })
                .collect();
            report.ports.push(PortReport {
                port,
                active: port_attr.state == ibv_port_state::IBV_PORT_ACTIVE,
                state: port_attr.state,
                link_layer: if ethernet { "Ethernet" } else { "InfiniBand" }.to_owned(),
                mtu: mtu_bytes(port_attr.active_mtu),
                lid: port_attr.lid,
                gids,
                picked_gid: if ethernet {
                    port::pick_gid(&entries, None).ok().map(|e| e.index)
                } else {
                    None
                },
            });
        }
    } else {
        report.error = Some(os_error("ibv_query_device"));
    }
    // SAFETY: closing the context opened above, used by nothing else.
    unsafe { ibv_close_device(ctx) };
    report
}

/// An RNIC opened through libibverbs.
#[derive(Debug, Clone)]
pub struct IbvDevice {
    ctx: Arc<Context>,
}

impl IbvDevice {
    /// Opens the device called `name` (or the first one), using `port`
    /// (which must be ACTIVE) and, on RoCE, GID table entry `gid_index` (or
    /// the one [`port::pick_gid`] picks); GRHs carry `traffic_class`.
    pub fn open(
        name: Option<&str>,
        port: u8,
        gid_index: Option<u8>,
        traffic_class: u8,
    ) -> Result<Self, VerbsError> {
        fork_safety();
        let mut count = 0;
        // SAFETY: `count` is a valid out-pointer; the list is freed below on
        // every path.
        let list = unsafe { ibv_get_device_list(&mut count) };
        if list.is_null() {
            return Err(VerbsError::NoDevice(os_error("ibv_get_device_list")));
        }
        let mut chosen = None;
        for i in 0..usize::try_from(count).unwrap_or(0) {
            // SAFETY: `i < count` indexes a valid device pointer whose name
            // is a NUL-terminated library-owned string.
            let (device, device_name) = unsafe {
                let device = *list.add(i);
                (
                    device,
                    CStr::from_ptr(ibv_get_device_name(device))
                        .to_string_lossy()
                        .into_owned(),
                )
            };
            if name.is_none_or(|wanted| wanted == device_name) {
                chosen = Some((device, device_name));
                break;
            }
        }
        let Some((device, device_name)) = chosen else {
            // SAFETY: freeing the list obtained above, once.
            unsafe { ibv_free_device_list(list) };
            return Err(VerbsError::NoDevice(match name {
                Some(wanted) => format!("no RDMA device named {wanted}"),
                None => "no RDMA devices on this host".into(),
            }));
        };
        // SAFETY: `device` is valid until the list is freed, after opening.
        let ctx = unsafe { ibv_open_device(device) };
        // SAFETY: freeing the list obtained above, once; the context stays valid.
        unsafe { ibv_free_device_list(list) };
        if ctx.is_null() {
            return Err(VerbsError::NoDevice(os_error("ibv_open_device")));
        }
        // SAFETY: `ctx` is an open context.
        let pd = unsafe { ibv_alloc_pd(ctx) };
        if pd.is_null() {
            let reason = os_error("ibv_alloc_pd");
            // SAFETY: closing the context opened above.
            unsafe { ibv_close_device(ctx) };
            return Err(VerbsError::NoDevice(reason));
        }
        let mut context = Context {
            ctx,
            pd,
            name: device_name,
            port,
            gid_index: 0,
            lid: 0,
            gid: [0; 16],
            mtu: 1024,
            link_layer: LinkLayer::InfiniBand,
            gid_type: GidType::IbRoceV1,
            traffic_class,
            limits: DeviceLimits::SOFT,
            next_vector: std::sync::atomic::AtomicU32::new(0),
        };
        // SAFETY: a zeroed ibv_device_attr is a valid out-parameter.
        let mut attr: ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: `ctx` is open and `attr` a valid out-pointer.
        if unsafe { ibv_query_device(ctx, &mut attr) } != 0 {
            return Err(VerbsError::NoDevice(os_error("ibv_query_device")));
        }
        let limit = |v: i32| u32::try_from(v).unwrap_or(0);
        context.limits = DeviceLimits {
            max_qp: limit(attr.max_qp),
            max_qp_wr: limit(attr.max_qp_wr),
            max_sge: limit(attr.max_sge),
            max_cq: limit(attr.max_cq),
            max_cqe: limit(attr.max_cqe),
            max_srq: limit(attr.max_srq),
            max_srq_wr: limit(attr.max_srq_wr),
            max_mr_size: attr.max_mr_size,
        };
        // SAFETY: a zeroed ibv_port_attr is a valid out-parameter.
        let mut port_attr: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: `ctx` is open and `port_attr` a valid out-pointer.
        if unsafe { ___ibv_query_port(ctx, port, &mut port_attr) } != 0 {
            return Err(VerbsError::NoDevice(os_error("ibv_query_port")));
        }
        if port_attr.state != ibv_port_state::IBV_PORT_ACTIVE {
            return Err(VerbsError::NoDevice(format!(
                "port {port} of {} is not active (state {}): check the link (`ibv_devinfo`)",
                context.name, port_attr.state
            )));
        }
        context.mtu = mtu_bytes(port_attr.active_mtu);
        // IBV_LINK_LAYER_UNSPECIFIED (0) and _INFINIBAND (1) are
        // InfiniBand, _ETHERNET (2) is RoCE.
        context.link_layer = match port_attr.link_layer {
            2 => LinkLayer::Ethernet,
            _ => LinkLayer::InfiniBand,
        };
        match context.link_layer {
            LinkLayer::InfiniBand => {
                if port_attr.lid == 0 {
                    return Err(VerbsError::NoDevice(format!(
                        "port {port} of {} has no LID: is a subnet manager running (`sminfo`)?",
                        context.name
                    )));
                }
                context.lid = port_attr.lid;
            }
            LinkLayer::Ethernet => {
                let entries = gid_table(&context, port_attr.gid_tbl_len);
                let chosen = port::pick_gid(&entries, gid_index)?;
                context.gid_index = chosen.index;
                context.gid = chosen.gid;
                // A type the host does not say is taken for v2, what every
                // RoCE fabric of today runs.
                context.gid_type = chosen.gid_type.unwrap_or(GidType::RoceV2);
            }
        }
        Ok(Self {
            ctx: Arc::new(context),
        })
    }
}

/// Inline data asked of every QP: room for a control message (a header
/// of the RDMA engine is 32 bytes) and a little more.
const INLINE_WANTED: u32 = 64;

/// Packet sequence numbers are 24 bits.
const PSN_MASK: u32 = 0x00ff_ffff;

/// `ibv_async_event` with its type as a plain integer: rdma-sys types it as
/// a Rust enum, and a type a newer library reports would be an invalid
/// value of it. Same layout (the enum is `repr(u32)`).
#[repr(C)]
struct RawAsyncEvent {
    element: ibv_async_event_element_t,
    event_type: u32,
}

/// Reads `ctx`'s asynchronous events until `stop`, handing each to
/// `handler` (after acknowledging it: a QP or CQ cannot be destroyed while
/// one of its events is unacknowledged).
fn watch_async_events(
    ctx: &Context,
    fd: i32,
    stop: &std::sync::atomic::AtomicBool,
    handler: &(dyn Fn(crate::verbs::AsyncEvent) + Send + Sync),
) {
    use crate::verbs::AsyncEvent;
    while !stop.load(std::sync::atomic::Ordering::Acquire) {
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd; a bounded wait.
        if unsafe { libc::poll(&mut pfd, 1, 100) } <= 0 {
            continue;
        }
        // SAFETY: plain data; zeroed is a valid value of both fields.
        let mut raw: RawAsyncEvent = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open (held by `ctx`); `raw` has the layout
        // of `ibv_async_event`.
        let rc = unsafe { ibv_get_async_event(ctx.ctx, (&mut raw as *mut RawAsyncEvent).cast()) };
        if rc != 0 {
            continue;
        }
        // SAFETY: the union member read is the one the event type says the
        // library filled; a QP stays alive until its event is acknowledged.
        let event = unsafe {
            match raw.event_type {
                1..=3 => AsyncEvent::QpFailed {
                    qpn: (*raw.element.qp).qp_num,
                },
                0 => AsyncEvent::CqFailed,
                8 => AsyncEvent::DeviceFailed,
                9 => AsyncEvent::PortUp {
                    port: u8::try_from(raw.element.port_num).unwrap_or(0),
                },
                10 => AsyncEvent::PortDown {
                    port: u8::try_from(raw.element.port_num).unwrap_or(0),
                },
                code => AsyncEvent::Other { code },
            }
        };
        // SAFETY: the event was returned by ibv_get_async_event above and
        // is acknowledged once.
        unsafe { ibv_ack_async_event((&mut raw as *mut RawAsyncEvent).cast()) };
        handler(event);
    }
}

/// What fork safety this process has (`ibv_is_fork_initialized`).
pub fn fork_status() -> &'static str {
    // SAFETY: a query of library state, no preconditions.
    match unsafe { ibv_is_fork_initialized() } {
        IBV_FORK_UNNEEDED => "not needed (the kernel copes with fork)",
        IBV_FORK_ENABLED => "enabled (ibv_fork_init)",
        _ => "disabled",
    }
}

/// Makes registered memory safe across `fork` before the first
/// registration, as brpc does: without it, a child's copy-on-write of a
/// registered page leaves the NIC writing into the parent's old copy.
/// Kernels since 5.13 need nothing (`IBV_FORK_UNNEEDED`). Once per
/// process; a failure is logged (the library refuses after memory was
/// registered).
fn fork_safety() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: queries and sets library state; called before this
        // process registers memory through the provider.
        unsafe {
            if ibv_is_fork_initialized() == IBV_FORK_UNNEEDED {
                return;
            }
            let rc = ibv_fork_init();
            if rc != 0 {
                tracing::warn!(
                    err = %std::io::Error::from_raw_os_error(rc.abs()),
                    "ibv_fork_init failed: a forked child may corrupt registered memory"
                );
            }
        }
    });
}

/// The active MTU in bytes.
fn mtu_bytes(mtu: ibv_mtu::Type) -> u32 {
    match mtu {
        ibv_mtu::IBV_MTU_256 => 256,
        ibv_mtu::IBV_MTU_512 => 512,
        ibv_mtu::IBV_MTU_2048 => 2048,
        ibv_mtu::IBV_MTU_4096 => 4096,
        _ => 1024,
    }
}

/// The `ibv_mtu` of `bytes` (one of [`port::MTUS`]).
fn mtu_enum(bytes: u32) -> ibv_mtu::Type {
    match bytes {
        256 => ibv_mtu::IBV_MTU_256,
        512 => ibv_mtu::IBV_MTU_512,
        2048 => ibv_mtu::IBV_MTU_2048,
        4096 => ibv_mtu::IBV_MTU_4096,
        _ => ibv_mtu::IBV_MTU_1024,
    }
}

/// The port's GID table: each entry and its type as sysfs says
/// (`/sys/class/infiniband/<device>/ports/<port>/gid_attrs/types/<i>`,
/// which libibverbs reads too). An empty entry comes back as zeros.
fn gid_table(context: &Context, len: i32) -> Vec<GidEntry> {
    // SAFETY: the context is open.
    unsafe { gid_entries(context.ctx, &context.name, context.port, len) }
}

/// The GID table of `port` of the open device `ctx` (called `name`).
///
/// # Safety
/// `ctx` is an open context.
unsafe fn gid_entries(ctx: *mut ibv_context, name: &str, port: u8, len: i32) -> Vec<GidEntry> {
    let len = u8::try_from(len.clamp(0, 255)).unwrap_or(0);
    (0..len)
        .filter_map(|index| {
            // SAFETY: a zeroed gid is a valid out-parameter.
            let mut gid: ibv_gid = unsafe { std::mem::zeroed() };
            // SAFETY: `ctx` is open (the caller's promise) and `gid` a
            // valid out-pointer.
            if unsafe { ibv_query_gid(ctx, port, i32::from(index), &mut gid) } != 0 {
                return None;
            }
            let types =
                format!("/sys/class/infiniband/{name}/ports/{port}/gid_attrs/types/{index}");
            Some(GidEntry {
                index,
                // SAFETY: every bit pattern of the union is a valid [u8; 16].
                gid: unsafe { gid.raw },
                gid_type: std::fs::read_to_string(types)
                    .ok()
                    .and_then(|t| GidType::from_sysfs(&t)),
            })
        })
        .collect()
}

/// Registers pool memory with the device's protection domain.
#[derive(Debug)]
struct IbvRegistration {
    ctx: Arc<Context>,
}

impl RegistrationHook for IbvRegistration {
    fn register(
        &self,
        addr: usize,
        len: usize,
        access: Access,
    ) -> Result<RegisteredRegion, RegistrationError> {
        let mut flags = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
        if access.allows_remote_write() {
            flags |= ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        }
        // SAFETY: the pool passes memory it has mapped and keeps mapped
        // until it deregisters it; the PD is alive (held by the Arc).
        let mr = unsafe { ibv_reg_mr(self.ctx.pd, addr as *mut libc::c_void, len, flags as i32) };
        if mr.is_null() {
            let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
            return Err(RegistrationError {
                len,
                reason: super::memlock::registration_failure(len, errno),
            });
        }
        // SAFETY: `mr` is a valid memory region returned just above.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Ok(RegisteredRegion {
            lkey,
            rkey,
            handle: mr as u64,
        })
    }

    fn deregister(&self, _addr: usize, _len: usize, region: &RegisteredRegion) {
        // SAFETY: `handle` is the ibv_mr this hook registered, deregistered
        // once (the pool calls this once per registration).
        unsafe { ibv_dereg_mr(region.handle as *mut ibv_mr) };
    }
}

/// A completion queue of the device.
#[derive(Debug)]
pub struct IbvCq {
    cq: *mut ibv_cq,
    /// Where the CQ announces a completion after `ibv_req_notify_cq`
    /// (event mode).
    channel: *mut ibv_comp_channel,
    /// Wakes a thread sleeping in `wait` on behalf of `wake`.
    wake_fd: std::os::fd::OwnedFd,
    armed: std::sync::atomic::AtomicBool,
    _ctx: Arc<Context>,
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

fn status(status: ibv_wc_status::Type) -> WcStatus {
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

/// An RC queue pair of the device.
#[derive(Debug)]
pub struct IbvQp {
    qp: *mut ibv_qp,
    /// The thread domain the QP was created in, where the device has them.
    domain: Option<ThreadDomain>,
    /// Held while posting when the QP lives in a thread domain: the device
    /// then takes no locks of its own and relies on one poster at a time.
    /// Uncontended (one driver thread posts), it costs one atomic.
    post_guard: Mutex<()>,
    ctx: Arc<Context>,
    state: Mutex<QpState>,
    psn: u32,
    rnr_retry: u8,
    /// Bytes a send may carry inline (copied into the work request: no
    /// DMA read of the buffer, less latency for control messages).
    inline: u32,
    _cqs: (Arc<IbvCq>, Arc<IbvCq>),
    _srq: Option<Arc<IbvSrq>>,
}

/// Receive work requests as libibverbs takes them: a linked list whose
/// entries point at their scatter/gather entries. Both live in vectors
/// whose heap buffers do not move when the struct does, so the pointers
/// stay valid for as long as it lives.
struct RecvList {
    _sges: Vec<ibv_sge>,
    list: Vec<ibv_recv_wr>,
}

impl RecvList {
    /// The list for `wrs` (not empty).
    fn new(wrs: &[RecvWr]) -> Self {
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
    fn head(&mut self) -> *mut ibv_recv_wr {
        self.list.as_mut_ptr()
    }
}

/// An ibverbs shared receive queue.
#[derive(Debug)]
pub struct IbvSrq {
    srq: *mut ibv_srq,
    _ctx: Arc<Context>,
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
            return Err(VerbsError::InvalidRequest(format!(
                "ibv_post_srq_recv: {}",
                std::io::Error::from_raw_os_error(rc)
            )));
        }
        Ok(())
    }

    fn into_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }
}

/// A thread domain and the parent domain that puts the protection domain
/// and it together (§6.2: a QP created on it has its own doorbell and
/// skips libibverbs' locks, so I/O threads do not contend).
#[derive(Debug)]
struct ThreadDomain {
    td: *mut ibv_td,
    parent: *mut ibv_pd,
}

impl ThreadDomain {
    /// A thread domain on `ctx`, or `None` where the device has none.
    fn allocate(ctx: &Context) -> Option<Self> {
        // SAFETY: plain data; zeroed (comp_mask 0) is the default request.
        let mut td_attr: ibv_td_init_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open; `extended::alloc_td` finds the
        // operation as verbs.h does, or says the provider lacks it.
        let td = unsafe { extended::alloc_td(ctx.ctx, &mut td_attr) }?;
        // SAFETY: plain data; pd and td are set, no allocator callbacks.
        let mut pd_attr: ibv_parent_domain_init_attr = unsafe { std::mem::zeroed() };
        pd_attr.pd = ctx.pd;
        pd_attr.td = td;
        // SAFETY: the PD and TD are alive and `pd_attr` is fully set.
        let parent = unsafe { extended::alloc_parent_domain(ctx.ctx, &mut pd_attr) };
        match parent {
            Some(parent) => Some(Self { td, parent }),
            None => {
                // SAFETY: `td` was allocated above and is used by nothing.
                unsafe { extended::dealloc_td(td) };
                None
            }
        }
    }
}

/// The extended verbs (thread and parent domains), reached as verbs.h's
/// inline functions reach them. rdma-sys 0.3's own `verbs_get_ctx`
/// compares `abi_compat` with `u32::MAX` where libibverbs stores
/// `UINTPTR_MAX` (`__VERBS_ABI_IS_EXTENDED`), so through it every extended
/// verb reported "not supported" and no QP ever got a thread domain.
mod extended {
    use rdma_sys::*;

    /// The `verbs_context` that `ctx` is the last field of, if the library
    /// made an extended one, and it is large enough to hold the field at
    /// `field_offset`.
    ///
    /// # Safety
    /// `ctx` is an open context.
    unsafe fn context(ctx: *mut ibv_context, field_offset: usize) -> Option<*mut verbs_context> {
        // SAFETY: the caller's context is valid to read.
        if unsafe { (*ctx).abi_compat } as usize != usize::MAX {
            return None;
        }
        let offset = std::mem::offset_of!(verbs_context, context);
        // SAFETY: an extended context is embedded as the last field of a
        // `verbs_context` (container_of in verbs.h), `offset` bytes in.
        let vctx = unsafe { ctx.cast::<u8>().sub(offset) }.cast::<verbs_context>();
        // `sz` counts the bytes of the structure the library filled, from
        // its end backwards (older libraries have fewer leading fields).
        // SAFETY: `sz` is the field right before `context`, always present.
        let size = unsafe { (*vctx).sz };
        (size >= std::mem::size_of::<verbs_context>() - field_offset).then_some(vctx)
    }

    /// `ibv_alloc_td`: `None` where the provider has no thread domains.
    ///
    /// # Safety
    /// `ctx` is an open context and `attr` a valid attribute block.
    pub(super) unsafe fn alloc_td(
        ctx: *mut ibv_context,
        attr: *mut ibv_td_init_attr,
    ) -> Option<*mut ibv_td> {
        // SAFETY: as the caller promises.
        let vctx = unsafe { context(ctx, std::mem::offset_of!(verbs_context, alloc_td)) }?;
        // SAFETY: `vctx` is the library's, holding this field (checked).
        let op = unsafe { (*vctx).alloc_td }?;
        // SAFETY: the provider's own entry point, called as verbs.h does.
        let td = unsafe { op(ctx, attr) };
        (!td.is_null()).then_some(td)
    }

    /// `ibv_alloc_parent_domain`: `None` where the provider has none.
    ///
    /// # Safety
    /// `ctx` is an open context and `attr` a valid attribute block.
    pub(super) unsafe fn alloc_parent_domain(
        ctx: *mut ibv_context,
        attr: *mut ibv_parent_domain_init_attr,
    ) -> Option<*mut ibv_pd> {
        // SAFETY: as the caller promises.
        let vctx = unsafe {
            context(
                ctx,
                std::mem::offset_of!(verbs_context, alloc_parent_domain),
            )
        }?;
        // SAFETY: `vctx` is the library's, holding this field (checked).
        let op = unsafe { (*vctx).alloc_parent_domain }?;
        // SAFETY: the provider's own entry point, called as verbs.h does.
        let pd = unsafe { op(ctx, attr) };
        (!pd.is_null()).then_some(pd)
    }

    /// `ibv_dealloc_td`.
    ///
    /// # Safety
    /// `td` was allocated by [`alloc_td`] and is used by nothing.
    pub(super) unsafe fn dealloc_td(td: *mut ibv_td) {
        // SAFETY: a live thread domain knows its context.
        let ctx = unsafe { (*td).context };
        // SAFETY: the context is open while the domain lives.
        let Some(vctx) = (unsafe { context(ctx, std::mem::offset_of!(verbs_context, dealloc_td)) })
        else {
            return;
        };
        // SAFETY: `vctx` is the library's, holding this field (checked).
        if let Some(op) = unsafe { (*vctx).dealloc_td } {
            // SAFETY: the provider's own entry point, for its own domain.
            unsafe { op(td) };
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        /// What the test provider's `alloc_td` hands out.
        const SENTINEL: usize = 0x7d00;

        unsafe extern "C" fn fake_alloc_td(
            _ctx: *mut ibv_context,
            _attr: *mut ibv_td_init_attr,
        ) -> *mut ibv_td {
            SENTINEL as *mut ibv_td
        }

        /// The lookup verbs.h does, on a context laid out as libibverbs
        /// lays one out: found where `abi_compat` is `UINTPTR_MAX` (what
        /// rdma-sys's check, against `u32::MAX`, never finds on 64-bit
        /// hosts), refused for a context too small to hold the field.
        #[test]
        fn extended_verbs_are_found_as_verbs_h_finds_them() {
            // SAFETY: plain data; zeroed is a valid value (null pointers,
            // no functions).
            let mut vctx: Box<verbs_context> = Box::new(unsafe { std::mem::zeroed() });
            vctx.sz = std::mem::size_of::<verbs_context>();
            vctx.alloc_td = Some(fake_alloc_td);
            vctx.context.abi_compat = usize::MAX as *mut libc::c_void;
            let ctx: *mut ibv_context = &mut vctx.context;
            // SAFETY: plain data; zeroed is the default request.
            let mut attr: ibv_td_init_attr = unsafe { std::mem::zeroed() };
            // SAFETY: `ctx` points into a live, fully laid out context.
            let td = unsafe { alloc_td(ctx, &mut attr) };
            assert_eq!(td.map(|p| p as usize), Some(SENTINEL));
            // rdma-sys's own finds nothing on the very same context (what
            // the provider called before).
            // SAFETY: as above.
            let theirs = unsafe { rdma_sys::ibv_alloc_td(ctx, &mut attr) };
            assert!(theirs.is_none_or(|p| p.is_null()));
            vctx.context.abi_compat = u32::MAX as usize as *mut libc::c_void;
            let ctx: *mut ibv_context = &mut vctx.context;
            // SAFETY: as above.
            assert!(unsafe { alloc_td(ctx, &mut attr) }.is_none());
            vctx.context.abi_compat = usize::MAX as *mut libc::c_void;
            vctx.sz = 16;
            let ctx: *mut ibv_context = &mut vctx.context;
            // SAFETY: as above.
            assert!(unsafe { alloc_td(ctx, &mut attr) }.is_none());
        }
    }
}

impl Drop for ThreadDomain {
    fn drop(&mut self) {
        // SAFETY: dropped after the QP created on the parent domain was
        // destroyed (field order in `IbvQp`'s drop), parent before TD.
        unsafe {
            ibv_dealloc_pd(self.parent);
            extended::dealloc_td(self.td);
        }
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
    fn modify(
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
fn posted_before<T>(first: *const T, len: usize, bad: *const T) -> u32 {
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
        *self.state.lock().unwrap_or_else(|p| p.into_inner()) = QpState::Init;
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
        *self.state.lock().unwrap_or_else(|p| p.into_inner()) = QpState::ReadyToReceive;
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
        *self.state.lock().unwrap_or_else(|p| p.into_inner()) = QpState::ReadyToSend;
        Ok(())
    }

    fn post_send(&self, wrs: &[SendWr]) -> Result<(), VerbsError> {
        if wrs.is_empty() {
            return Ok(());
        }
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
        for (i, wr) in wrs.iter().enumerate() {
            let entry = &mut list[i];
            entry.wr_id = wr.wr_id;
            entry.sg_list = sges[i].as_mut_ptr();
            entry.num_sge = sges[i].len() as i32;
            entry.send_flags = if wr.signaled {
                ibv_send_flags::IBV_SEND_SIGNALED.0
            } else {
                0
            };
            let bytes: u64 = wr.sges.iter().map(|s| u64::from(s.len)).sum();
            if bytes > 0 && bytes <= u64::from(self.inline) {
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
            }
        }
        // Link the list (one doorbell for all of it).
        for i in 0..list.len() - 1 {
            let next: *mut ibv_send_wr = &mut list[i + 1];
            list[i].next = next;
        }
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        let _one_poster = self.post_guard.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: `list` and `sges` outlive the call (the library copies
        // work requests into the send queue before returning); one thread
        // posts at a time (the guard), as a thread domain requires.
        let rc = unsafe { ibv_post_send(self.qp, list.as_mut_ptr(), &mut bad) };
        if rc != 0 {
            return Err(VerbsError::PostFailed {
                queue: "send",
                posted: posted_before(list.as_ptr(), list.len(), bad),
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
        let _one_poster = self.post_guard.lock().unwrap_or_else(|p| p.into_inner());
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
        *self.state.lock().unwrap_or_else(|p| p.into_inner())
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
        *self.state.lock().unwrap_or_else(|p| p.into_inner()) = QpState::Error;
        result
    }
}

impl Device for IbvDevice {
    fn name(&self) -> &str {
        &self.ctx.name
    }

    fn registration_hook(&self) -> Arc<dyn RegistrationHook> {
        Arc::new(IbvRegistration {
            ctx: Arc::clone(&self.ctx),
        })
    }

    fn limits(&self) -> DeviceLimits {
        self.ctx.limits
    }

    fn watch_events(
        &self,
        handler: crate::verbs::EventHandler,
    ) -> Result<crate::verbs::EventWatch, VerbsError> {
        let ctx = Arc::clone(&self.ctx);
        // SAFETY: the context is open; its async fd lives as long.
        let fd = unsafe { (*ctx.ctx).async_fd };
        // Non-blocking, so the watcher can look at its stop flag.
        // SAFETY: fcntl on a descriptor the context owns; no memory.
        unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            if flags < 0 || libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) < 0 {
                return Err(VerbsError::NoDevice(os_error("fcntl(async_fd)")));
            }
        }
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let thread = std::thread::Builder::new()
            .name(format!("tessera-events-{}", ctx.name))
            .spawn({
                let stop = Arc::clone(&stop);
                move || watch_async_events(&ctx, fd, &stop, &*handler)
            })
            .map_err(|e| VerbsError::NoDevice(format!("event thread: {e}")))?;
        Ok(crate::verbs::EventWatch::new(move || {
            stop.store(true, std::sync::atomic::Ordering::Release);
            let _ = thread.join();
        }))
    }

    fn create_cq(&self, depth: u32) -> Result<Arc<dyn CompletionQueue>, VerbsError> {
        self.ctx.limits.check_cq(depth)?;
        // SAFETY: the context is open.
        let channel = unsafe { ibv_create_comp_channel(self.ctx.ctx) };
        if channel.is_null() {
            return Err(VerbsError::InvalidRequest(os_error(
                "ibv_create_comp_channel",
            )));
        }
        // CQs spread over the device's completion vectors (interrupt
        // lines), one after another.
        // SAFETY: the context is open; the count is immutable.
        let vectors = unsafe { (*self.ctx.ctx).num_comp_vectors }.max(1);
        let vector = (self
            .ctx
            .next_vector
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed) as i32)
            .rem_euclid(vectors);
        // SAFETY: the context and channel are alive; no context pointer;
        // `vector` is below the device's count.
        let cq = unsafe {
            ibv_create_cq(
                self.ctx.ctx,
                depth as i32,
                std::ptr::null_mut(),
                channel,
                vector,
            )
        };
        if cq.is_null() {
            let err = os_error("ibv_create_cq");
            // SAFETY: created above, used by nothing.
            unsafe { ibv_destroy_comp_channel(channel) };
            return Err(VerbsError::InvalidRequest(err));
        }
        // SAFETY: eventfd has no memory preconditions; checked below.
        let raw = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if raw < 0 {
            let err = os_error("eventfd");
            // SAFETY: created above, used by nothing.
            unsafe {
                ibv_destroy_cq(cq);
                ibv_destroy_comp_channel(channel);
            }
            return Err(VerbsError::InvalidRequest(err));
        }
        // SAFETY: a fresh descriptor nothing else owns.
        let wake_fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
        Ok(Arc::new(IbvCq {
            cq,
            channel,
            wake_fd,
            armed: std::sync::atomic::AtomicBool::new(false),
            _ctx: Arc::clone(&self.ctx),
        }))
    }

    fn create_qp(
        &self,
        send_cq: Arc<dyn CompletionQueue>,
        recv_cq: Arc<dyn CompletionQueue>,
        caps: QpCaps,
    ) -> Result<Arc<dyn QueuePair>, VerbsError> {
        self.new_qp(send_cq, recv_cq, None, caps)
    }

    fn create_srq(&self, depth: u32) -> Result<Arc<dyn SharedReceiveQueue>, VerbsError> {
        self.ctx.limits.check_srq(depth)?;
        // SAFETY: plain data; the fields used are set below.
        let mut attr: ibv_srq_init_attr = unsafe { std::mem::zeroed() };
        attr.attr.max_wr = depth;
        attr.attr.max_sge = 1;
        // SAFETY: the PD is alive and `attr` is set.
        let srq = unsafe { ibv_create_srq(self.ctx.pd, &mut attr) };
        if srq.is_null() {
            return Err(VerbsError::InvalidRequest(os_error("ibv_create_srq")));
        }
        Ok(Arc::new(IbvSrq {
            srq,
            _ctx: Arc::clone(&self.ctx),
        }))
    }

    fn create_qp_on_srq(
        &self,
        send_cq: Arc<dyn CompletionQueue>,
        recv_cq: Arc<dyn CompletionQueue>,
        srq: Arc<dyn SharedReceiveQueue>,
        caps: QpCaps,
    ) -> Result<Arc<dyn QueuePair>, VerbsError> {
        let srq = crate::verbs::downcast_srq::<IbvSrq>(srq)?;
        self.new_qp(send_cq, recv_cq, Some(srq), caps)
    }
}

impl IbvDevice {
    fn new_qp(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::{Pool, PoolConfig};
    use crate::verbs::Sge;

    /// Runs on hosts with an RDMA device; elsewhere prints why it did not.
    #[test]
    fn loopback_send_and_write_with_immediate_on_a_real_device() {
        let device = match IbvDevice::open(None, 1, None, 0) {
            Ok(device) => device,
            Err(VerbsError::NoDevice(reason)) => {
                eprintln!("SKIPPED ibverbs loopback test: {reason}");
                return;
            }
            Err(other) => panic!("unexpected error opening the device: {other}"),
        };
        let hook = device.registration_hook();
        let pool = Pool::new(PoolConfig::named("ibv-test"), Access::RemoteWrite, hook).unwrap();
        let cq_a = device.create_cq(64).unwrap();
        let cq_b = device.create_cq(64).unwrap();
        let a = device
            .create_qp(cq_a.clone(), cq_a.clone(), QpCaps::default())
            .unwrap();
        let b = device
            .create_qp(cq_b.clone(), cq_b.clone(), QpCaps::default())
            .unwrap();
        a.init().unwrap();
        b.init().unwrap();
        a.connect(&b.endpoint()).unwrap();
        b.connect(&a.endpoint()).unwrap();
        let mut inbox = pool.alloc(4096).unwrap();
        inbox.set_len(4096);
        let mut target = pool.alloc(8192).unwrap();
        // Its length is what the check below reads (a fresh buffer has
        // none: the check verified nothing before).
        target.set_len(8192);
        target.fill(0);
        let sge = |buf: &crate::pool::PoolBuf| Sge {
            addr: buf.as_ptr() as usize,
            len: buf.len() as u32,
            lkey: buf.region().unwrap().lkey,
        };
        b.post_recv(&[
            RecvWr {
                wr_id: 1,
                sge: sge(&inbox),
            },
            RecvWr {
                wr_id: 2,
                sge: sge(&inbox),
            },
        ])
        .unwrap();
        let message = pool.alloc_copy(&[7u8; 100]).unwrap();
        let data = pool.alloc_copy(&[9u8; 8192]).unwrap();
        a.post_send(&[
            SendWr {
                wr_id: 10,
                op: SendOp::Send,
                sges: vec![sge(&message)],
                signaled: false,
            },
            SendWr {
                wr_id: 11,
                op: SendOp::WriteWithImm {
                    remote_addr: target.as_ptr() as usize,
                    rkey: target.region().unwrap().rkey,
                    imm: 42,
                },
                sges: vec![sge(&data)],
                signaled: true,
            },
        ])
        .unwrap();
        let mut got = Vec::new();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while got.len() < 3 && std::time::Instant::now() < deadline {
            cq_a.poll(&mut got, 16);
            cq_b.poll(&mut got, 16);
        }
        assert_eq!(got.len(), 3, "{got:?}");
        assert!(got.iter().all(|c| c.status == WcStatus::Success), "{got:?}");
        assert!(
            got.iter()
                .any(|c| c.kind == WcKind::RecvWithImm(42) && c.byte_len == 8192)
        );
        assert_eq!(target.len(), 8192);
        assert!(target.iter().all(|&x| x == 9));
        assert!(inbox[..100].iter().all(|&x| x == 7));
    }
}
