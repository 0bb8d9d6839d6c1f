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
//! (`ibv_fork_init`, unless the kernel needs none); small sends go inline
//! (64 bytes asked of the device, what it grants used); CQs spread over the device's
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

mod counters;
mod cq;
mod describe;
mod domain;
mod events;
mod mr;
mod mw;
mod qp;
mod srq;

pub use cq::IbvCq;
pub use describe::{DeviceLimitsReport, DeviceReport, PortReport, describe_devices};
use domain::ThreadDomain;
use events::watch_async_events;
use mr::IbvRegistration;
pub use qp::IbvQp;
use qp::{RecvList, posted_before};
pub use srq::IbvSrq;

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
    /// The memory regions and windows alive on this context, by address:
    /// a bind's handles are checked against it before libibverbs is given
    /// them as pointers (so a stale or made-up handle is refused, never
    /// dereferenced), and held while the bind is posted.
    live: Mutex<Live>,
    /// The port's receiver-not-ready counter, where the provider has one.
    rnr: Option<counters::PortCounter>,
}

/// What [`Context::live`] holds.
#[derive(Debug, Default)]
struct Live {
    regions: std::collections::HashSet<u64>,
    windows: std::collections::HashSet<u64>,
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
            live: Mutex::new(Live::default()),
            rnr: None,
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
            memory_windows: {
                let type_2 = ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2A.0
                    | ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2B.0;
                match attr.device_cap_flags & type_2 {
                    0 => 0,
                    _ => limit(attr.max_mw),
                }
            },
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
                context.gid_type = chosen.gid_type.unwrap_or_else(|| {
                    tracing::warn!(
                        device = %context.name,
                        index = chosen.index,
                        "the GID's type is not known here (no sysfs gid_attrs): taking it for RoCE v2; set rdma.gid_index if that is wrong"
                    );
                    GidType::RoceV2
                });
            }
        }
        context.rnr = counters::PortCounter::rnr(&context.name, port);
        Ok(Self {
            ctx: Arc::new(context),
        })
    }
}

/// What fork safety this process has (`ibv_is_fork_initialized`).
pub fn fork_status() -> &'static str {
    // SAFETY: a query of library state, no preconditions.
    match unsafe { ibv_is_fork_initialized() } {
        IBV_FORK_UNNEEDED => "not needed (the kernel copes with fork)",
        IBV_FORK_ENABLED => "enabled (ibv_fork_init)",
        _ => "not set up yet (ibv_fork_init runs when an ibverbs transport starts)",
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

    fn rnr_events(&self) -> Option<u64> {
        self.ctx.rnr.as_ref().map(counters::PortCounter::value)
    }

    fn port_active(&self) -> bool {
        // SAFETY: a zeroed ibv_port_attr is a valid out-parameter.
        let mut port_attr: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open for as long as `self.ctx` lives, and
        // `port_attr` is a valid out-pointer.
        let queried = unsafe { ___ibv_query_port(self.ctx.ctx, self.ctx.port, &mut port_attr) };
        queried == 0 && port_attr.state == ibv_port_state::IBV_PORT_ACTIVE
    }

    fn numa_node(&self) -> Option<u32> {
        describe::numa_node(&self.ctx.name)
    }

    fn alloc_window(&self) -> Result<Arc<dyn crate::verbs::MemoryWindow>, VerbsError> {
        Ok(Arc::new(mw::IbvWindow::allocate(&self.ctx)?))
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
