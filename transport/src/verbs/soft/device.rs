//! A soft device and the fabric it sits on: [`SoftFabric`] (the devices
//! that can reach each other, this process's or every process's of the
//! host), [`SoftDevice`] (the verbs `Device`: CQs, QPs,
//! SRQs, memory registration into the shared region table, memory
//! windows, async events), its seeded fault injection ([`SoftFaults`]),
//! its profile ([`SoftProfile`]: limits and port) and its counters
//! ([`SoftStats`]).

use crate::sync::LockExt;
use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use super::agent::{self, Answer, Request};
use super::cq::SoftCq;
use super::port::SoftPort;
use super::qp::{SoftQp, SoftQpInner};
use super::rings::{Binding, GENERATION_MASK, MemoryRegion, REGION_SLOTS, RegionTable};
use super::srq::SoftSrq;
use crate::pool::{
    Access, RegisteredRegion, RegistrationCause, RegistrationError, RegistrationHook,
};
use crate::verbs::{
    CompletionQueue, Device, DeviceLimits, QpCaps, QueuePair, SharedReceiveQueue, VerbsError,
    WcStatus,
};

/// Faults a soft device injects, each with a probability in millionths,
/// drawn from a generator seeded with `seed` (so a failing test replays).
/// All zero by default: no faults.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SoftFaults {
    /// Seed of the fault generator.
    pub seed: u64,
    /// A SEND or WRITE_WITH_IMM finds no receive posted even if one is.
    pub rnr_per_million: u32,
    /// A work request fails with `RetryExceeded` and puts the QP in error.
    pub qp_error_per_million: u32,
    /// A completion is held back for up to `max_delay_polls` polls.
    pub delay_per_million: u32,
    /// Longest delay, in polls of the completion queue.
    pub max_delay_polls: u32,
    /// A `post_send` or `post_recv` stops part way, as `ibv_post_send` does
    /// with `bad_wr` (ENOMEM): the work requests before a drawn one are
    /// posted, the rest are not.
    pub post_error_per_million: u32,
    /// A SEND from this device makes the peer's receive fail with a local
    /// length error (as a SEND longer than the receive buffer would),
    /// which puts the peer's QP in error; the sender sees a remote
    /// operation error.
    pub recv_error_per_million: u32,
    /// Drill knob of the I/O threads over this device (not of the NIC):
    /// handling a received message of exactly this many bytes panics, as a
    /// bug in an engine would, to show that the panic fails that engine
    /// only. 0: off.
    pub panic_on_message_len: u32,
}

/// What a soft device is like: its limits and its port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SoftProfile {
    /// What it reports and enforces. Default: [`DeviceLimits::SOFT`].
    pub limits: DeviceLimits,
    /// Its port. Default: [`SoftPort::default`].
    pub port: SoftPort,
}

impl Default for SoftProfile {
    fn default() -> Self {
        Self {
            limits: DeviceLimits::SOFT,
            port: SoftPort::default(),
        }
    }
}

/// Event counters of a soft device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SoftStats {
    /// SENDs and WRITE_WITH_IMMs that found no receive posted.
    pub rnr_events: u64,
    /// One-sided accesses refused by rkey, access or bounds checks.
    pub remote_access_errors: u64,
    /// Injected QP errors.
    pub injected_qp_errors: u64,
    /// Bytes moved by the device's send queues.
    pub bytes_moved: u64,
    /// Queue pairs destroyed while a memory window was still bound on
    /// them. A bound type-2 window holds a reference to its QP, and rxe's
    /// `ibv_destroy_qp` waits for it up to 50 s (then warns in the
    /// kernel's log): the soft NIC counts and logs it instead, so the
    /// suite catches the mistake without a real device.
    pub qps_destroyed_with_bound_windows: u64,
}

/// The network that soft devices are attached to.
#[derive(Debug, Clone, Default)]
pub struct SoftFabric {
    inner: Arc<FabricInner>,
}

#[derive(Debug, Default)]
pub(crate) struct FabricInner {
    devices: Mutex<HashMap<u64, Weak<DeviceInner>>>,
    next_node: AtomicU64,
    /// Whether devices of other processes are reachable (through their
    /// agents): the process fabric.
    pub(crate) host_wide: bool,
}

impl FabricInner {
    pub(crate) fn device(&self, node: u64) -> Option<Arc<DeviceInner>> {
        self.devices.locked().get(&node).and_then(Weak::upgrade)
    }
}

impl SoftFabric {
    /// An empty fabric.
    pub fn new() -> Self {
        Self::default()
    }

    /// The fabric of every soft device of this process, and through it of
    /// the other processes of this host: what the transport uses. The
    /// first call starts this process's agent (which hands this process's
    /// shared memory to peers) and raises the open-file limit (every pool
    /// block is a memfd).
    pub fn process() -> Self {
        static PROCESS: std::sync::OnceLock<SoftFabric> = std::sync::OnceLock::new();
        PROCESS
            .get_or_init(|| {
                super::shm::raise_open_file_limit();
                let inner = Arc::new(FabricInner {
                    host_wide: true,
                    ..FabricInner::default()
                });
                if let Err(err) = agent::start(Arc::clone(&inner)) {
                    tracing::warn!(%err, "soft NIC agent did not start: peers in other processes cannot reach this one");
                }
                SoftFabric { inner }
            })
            .clone()
    }

    /// The devices open on this fabric now, in this process (drills reach
    /// a transport's device by its name: [`crate::Transport::rdma_device`]).
    pub fn devices(&self) -> Vec<SoftDevice> {
        self.inner
            .devices
            .locked()
            .values()
            .filter_map(Weak::upgrade)
            .map(|inner| SoftDevice { inner })
            .collect()
    }

    /// Opens a device (an RNIC with its protection domain) on the fabric,
    /// with the limits of the smallest real one ([`DeviceLimits::SOFT`]).
    pub fn open(
        &self,
        name: impl Into<String>,
        faults: SoftFaults,
    ) -> Result<SoftDevice, VerbsError> {
        self.open_with(name, faults, SoftProfile::default())
    }

    /// Opens a device with the limits and port of `profile` (tests of what
    /// a smaller device refuses, of ports that differ).
    pub fn open_with(
        &self,
        name: impl Into<String>,
        faults: SoftFaults,
        profile: SoftProfile,
    ) -> Result<SoftDevice, VerbsError> {
        let SoftProfile { limits, port } = profile;
        let counter = self.inner.next_node.fetch_add(1, Ordering::Relaxed) + 1;
        // Node ids are unique on the host: the pid names the process (and
        // its agent), the counter the device.
        let node = (u64::from(std::process::id()) << 32) | (counter & 0xffff_ffff);
        let table = RegionTable::create()
            .map_err(|e| VerbsError::NoDevice(format!("soft NIC shared memory: {e}")))?;
        table.set_ps_per_byte(super::port::ps_per_byte(port.rate_mbps));
        let inner = Arc::new(DeviceInner {
            node,
            name: name.into(),
            fabric: Arc::clone(&self.inner),
            table,
            slots: Mutex::new(SlotAllocator {
                free: (0..REGION_SLOTS).rev().collect(),
                generation: vec![0; REGION_SLOTS],
                windows: std::collections::HashSet::new(),
            }),
            region_fds: Mutex::new(HashMap::new()),
            qps: Mutex::new(HashMap::new()),
            cqs: Mutex::new(HashMap::new()),
            srqs: Mutex::new(HashMap::new()),
            next_qpn: AtomicU32::new(0x10),
            faults,
            limits,
            port,
            events: EventSlot::default(),
            rng: Mutex::new(faults.seed ^ 0x9e37_79b9_7f4a_7c15 ^ (node & 0xffff_ffff)),
            injected_qp_errors: AtomicU64::new(0),
            bytes_moved: AtomicU64::new(0),
            qps_destroyed_with_bound_windows: AtomicU64::new(0),
        });
        self.inner
            .devices
            .locked()
            .insert(node, Arc::downgrade(&inner));
        Ok(SoftDevice { inner })
    }
}

/// Free region slots and each slot's generation (so a reused slot gets a
/// new key), and which slots hold memory windows.
#[derive(Debug)]
struct SlotAllocator {
    free: Vec<usize>,
    generation: Vec<u32>,
    windows: std::collections::HashSet<usize>,
}

/// The generation after `generation` (never 0: key 0 names nothing).
fn next_generation(generation: u32) -> u32 {
    match (generation + 1) & GENERATION_MASK {
        0 => 1,
        next => next,
    }
}

/// A soft type-2 memory window: a slot of its device's region table, with
/// nothing published under it until it is bound.
#[derive(Debug)]
pub(crate) struct SoftWindow {
    device: Arc<DeviceInner>,
    slot: usize,
    rkey: u32,
}

impl crate::verbs::MemoryWindow for SoftWindow {
    fn handle(&self) -> u64 {
        self.slot as u64
    }

    fn rkey(&self) -> u32 {
        self.rkey
    }

    fn next_rkey(&self, rkey: u32) -> u32 {
        RegionTable::key(self.slot, next_generation(rkey >> super::rings::SLOT_BITS))
    }
}

impl Drop for SoftWindow {
    fn drop(&mut self) {
        // Deallocation ends any binding: whatever key is published under
        // the slot is withdrawn.
        self.device.table.retire_slot(self.slot);
        let mut slots = self.device.slots.locked();
        slots.windows.remove(&self.slot);
        drop(slots);
        self.device.free_slot(self.slot);
    }
}

impl DeviceInner {
    fn free_slot(&self, slot: usize) {
        let mut slots = self.slots.locked();
        if slot < REGION_SLOTS {
            slots.free.push(slot);
        }
    }

    /// A memory window: a table slot that only bindings publish under.
    pub(crate) fn alloc_window(self: &Arc<Self>) -> Result<SoftWindow, VerbsError> {
        let mut slots = self.slots.locked();
        if slots.windows.len() >= self.limits.memory_windows as usize {
            return Err(VerbsError::OverLimit {
                what: "memory windows (max_mw)",
                asked: u32::try_from(slots.windows.len() + 1).unwrap_or(u32::MAX),
                max: self.limits.memory_windows,
            });
        }
        let Some(slot) = slots.free.pop() else {
            return Err(VerbsError::InvalidRequest(format!(
                "soft NIC region table full ({REGION_SLOTS} regions and windows)"
            )));
        };
        slots.windows.insert(slot);
        let generation = &mut slots.generation[slot];
        *generation = next_generation(*generation);
        let rkey = RegionTable::key(slot, *generation);
        Ok(SoftWindow {
            device: Arc::clone(self),
            slot,
            rkey,
        })
    }

    /// Runs a bind of window `window` under `rkey` to `len` bytes at
    /// `addr` of the region `lkey`, for writes arriving on QP `qpn`, as a
    /// NIC checks one: the window must be this device's, the key its slot's
    /// with a new tag, the region registered for windows and holding the
    /// range. What a failed check completes with is a local protection
    /// error (the QP then fails, as on real devices).
    pub(crate) fn bind_window(
        &self,
        window: u64,
        rkey: u32,
        addr: usize,
        len: usize,
        lkey: u32,
        qpn: u32,
    ) -> WcStatus {
        let slot = RegionTable::slot_of(rkey);
        let mut slots = self.slots.locked();
        if !slots.windows.contains(&slot)
            || window != slot as u64
            || rkey >> super::rings::SLOT_BITS == 0
        {
            return WcStatus::LocalProtectionError;
        }
        // A type-2 window is bound only when free: a bound one must be
        // invalidated first (mlx5 and rxe refuse the bind otherwise).
        if self.table.key_in(slot) != 0 {
            return WcStatus::LocalProtectionError;
        }
        let Some(parent) = self.table.lookup(lkey) else {
            return WcStatus::LocalProtectionError;
        };
        if parent.access != Access::Windows || parent.bound.is_some() || !parent.contains(addr, len)
        {
            return WcStatus::LocalProtectionError;
        }
        // The slot's generation follows the window's keys, so that the
        // slot's next owner (after the window is gone) never reuses a key
        // this window handed out.
        slots.generation[slot] = rkey >> super::rings::SLOT_BITS;
        drop(slots);
        self.table.publish(
            rkey,
            MemoryRegion {
                addr,
                len,
                access: Access::RemoteWrite,
                bound: Some(Binding { qpn, parent: lkey }),
            },
        );
        WcStatus::Success
    }

    /// How many of this device's windows are bound on QP `qpn` now.
    pub(crate) fn windows_bound_on(&self, qpn: u32) -> usize {
        let slots = self.slots.locked();
        slots
            .windows
            .iter()
            .filter(|&&slot| {
                let key = self.table.key_in(slot);
                key != 0
                    && self
                        .table
                        .lookup(key)
                        .and_then(|region| region.bound)
                        .is_some_and(|binding| binding.qpn == qpn)
            })
            .count()
    }

    /// Runs a local invalidation of the window bound under `rkey`: a key
    /// that is not a window's current binding is a local protection
    /// error.
    pub(crate) fn invalidate_window(&self, rkey: u32) -> WcStatus {
        match self.table.lookup(rkey) {
            Some(region) if region.bound.is_some() => {
                self.table.retire(rkey);
                WcStatus::Success
            }
            _ => WcStatus::LocalProtectionError,
        }
    }
}

/// A soft RNIC.
#[derive(Debug, Clone)]
pub struct SoftDevice {
    pub(crate) inner: Arc<DeviceInner>,
}

#[derive(Debug)]
pub(crate) struct DeviceInner {
    pub(crate) node: u64,
    pub(crate) name: String,
    pub(crate) fabric: Arc<FabricInner>,
    /// Registered regions and the counters peers update (shared memory).
    pub(crate) table: RegionTable,
    slots: Mutex<SlotAllocator>,
    /// The memfd behind each region registered from shared memory, for
    /// peers in other processes.
    region_fds: Mutex<HashMap<u32, OwnedFd>>,
    qps: Mutex<HashMap<u32, Weak<SoftQpInner>>>,
    cqs: Mutex<HashMap<u32, Weak<SoftCq>>>,
    srqs: Mutex<HashMap<u32, Weak<SoftSrq>>>,
    next_qpn: AtomicU32,
    faults: SoftFaults,
    /// What it reports and enforces at every create call.
    limits: DeviceLimits,
    /// Its port, as its QPs' endpoints tell peers.
    pub(crate) port: SoftPort,
    /// Who hears its asynchronous events.
    events: EventSlot,
    rng: Mutex<u64>,
    pub(crate) injected_qp_errors: AtomicU64,
    pub(crate) bytes_moved: AtomicU64,
    pub(crate) qps_destroyed_with_bound_windows: AtomicU64,
}

/// The watcher of a device's events.
#[derive(Default)]
struct EventSlot(Mutex<Option<crate::verbs::EventHandler>>);

impl std::fmt::Debug for EventSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventSlot").finish_non_exhaustive()
    }
}

/// Which fault to roll for.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Fault {
    Rnr,
    QpError,
    Delay,
    PostError,
    RecvError,
}

impl DeviceInner {
    /// Puts every QP of the device in the error state.
    pub(crate) fn fail_qps(&self) {
        let qps: Vec<Arc<SoftQpInner>> = self
            .qps
            .locked()
            .values()
            .filter_map(Weak::upgrade)
            .collect();
        for qp in qps {
            qp.enter_error();
        }
    }

    /// The region `key` names, if registered.
    pub(crate) fn region(&self, key: u32) -> Option<MemoryRegion> {
        self.table.lookup(key)
    }

    /// What this device's agent hands a peer in another process.
    pub(crate) fn answer(&self, request: Request) -> Option<Answer> {
        let plain = |fd: Option<OwnedFd>| {
            fd.map(|fd| Answer {
                fd,
                base: 0,
                len: 0,
            })
        };
        match request {
            Request::Table => plain(agent::dup(self.table.fd())),
            Request::Region(key) => {
                let region = self.table.lookup(key)?;
                let fds = self.region_fds.locked();
                Some(Answer {
                    fd: fds.get(&key)?.try_clone().ok()?,
                    base: region.addr as u64,
                    len: region.len as u64,
                })
            }
            Request::Qp(qpn) => {
                let qp = self.qp(qpn)?;
                plain(agent::dup(qp.segment.fd()))
            }
            Request::Srq(id) => {
                let srq = self.srq(id)?;
                plain(agent::dup(srq.segment.fd()))
            }
            Request::Cq(id) => plain(agent::dup(self.cq(id)?.ring.fd())),
            Request::CqEvent(id) => plain(agent::dup(self.cq(id)?.ring.event_fd()?)),
        }
    }

    /// The completion queue `id`, if alive.
    fn cq(&self, id: u32) -> Option<Arc<SoftCq>> {
        self.cqs.locked().get(&id).and_then(Weak::upgrade)
    }

    /// The shared receive queue `id`, if alive.
    pub(crate) fn srq(&self, id: u32) -> Option<Arc<SoftSrq>> {
        self.srqs.locked().get(&id).and_then(Weak::upgrade)
    }

    /// Makes `cq` reachable by peers in other processes.
    /// Hands `event` to the watcher of this device's events, if any.
    pub(crate) fn raise(&self, event: crate::verbs::AsyncEvent) {
        // Called under the lock, so that no call comes after the watch's
        // drop has cleared it.
        let handler = self.events.0.locked();
        if let Some(handler) = handler.as_ref() {
            handler(event);
        }
    }

    pub(crate) fn adopt_cq(self: &Arc<Self>, cq: &Arc<SoftCq>) {
        *cq.device.locked() = Arc::downgrade(self);
        self.cqs.locked().insert(cq.id, Arc::downgrade(cq));
    }

    pub(crate) fn qp(&self, qpn: u32) -> Option<Arc<SoftQpInner>> {
        self.qps.locked().get(&qpn).and_then(Weak::upgrade)
    }

    /// Rolls the dice for `fault`; for `Delay`, the number of polls (0 = none).
    pub(crate) fn roll(&self, fault: Fault) -> u32 {
        let per_million = match fault {
            Fault::Rnr => self.faults.rnr_per_million,
            Fault::QpError => self.faults.qp_error_per_million,
            Fault::Delay => self.faults.delay_per_million,
            Fault::PostError => self.faults.post_error_per_million,
            Fault::RecvError => self.faults.recv_error_per_million,
        };
        if per_million == 0 {
            return 0;
        }
        let mut state = self.rng.locked();
        let mut next = || {
            *state ^= *state >> 12;
            *state ^= *state << 25;
            *state ^= *state >> 27;
            state.wrapping_mul(0x2545_f491_4f6c_dd1d)
        };
        if next() % 1_000_000 >= u64::from(per_million) {
            return 0;
        }
        match fault {
            Fault::Delay => 1 + (next() % u64::from(self.faults.max_delay_polls.max(1))) as u32,
            Fault::PostError => 1 + (next() % 0x1_0000) as u32,
            _ => 1,
        }
    }

    /// Where a post of `n` work requests stops, if it fails
    /// ([`SoftFaults::post_error_per_million`]): how many go up before it.
    pub(crate) fn roll_post_failure(&self, n: usize) -> Option<usize> {
        match self.roll(Fault::PostError) {
            0 => None,
            drawn => Some((drawn as usize - 1) % n.max(1)),
        }
    }
}

impl SoftDevice {
    /// The device's node id on the fabric.
    pub fn node(&self) -> u64 {
        self.inner.node
    }

    /// Event counters.
    pub fn stats(&self) -> SoftStats {
        SoftStats {
            rnr_events: self.inner.table.rnr_events(),
            remote_access_errors: self.inner.table.remote_access_errors(),
            injected_qp_errors: self.inner.injected_qp_errors.load(Ordering::Relaxed),
            bytes_moved: self.inner.bytes_moved.load(Ordering::Relaxed),
            qps_destroyed_with_bound_windows: self
                .inner
                .qps_destroyed_with_bound_windows
                .load(Ordering::Relaxed),
        }
    }

    /// Simulates the host dying: every QP of this device goes to error, and
    /// peers' operations towards it fail with `RetryExceeded`.
    pub fn kill(&self) {
        self.inner.table.mark_dead();
        self.inner.fail_qps();
    }

    /// Raises `event` as the device would (a drill: a port going down, a
    /// QP failing on its own), to whoever watches its events.
    pub fn raise_event(&self, event: crate::verbs::AsyncEvent) {
        self.inner.raise(event);
    }

    /// Creates a soft completion queue (the concrete type, for tests).
    pub fn create_soft_cq(&self) -> Result<Arc<SoftCq>, VerbsError> {
        let cq = Arc::new(SoftCq::with_depth(1024)?);
        self.inner.adopt_cq(&cq);
        Ok(cq)
    }
}

/// Registers pool memory with a soft device (the MR table the soft NIC
/// checks one-sided accesses against).
#[derive(Debug)]
struct SoftRegistration {
    device: Arc<DeviceInner>,
}

impl SoftRegistration {
    fn publish(
        &self,
        region: MemoryRegion,
        memory: Option<OwnedFd>,
    ) -> Result<RegisteredRegion, RegistrationError> {
        let key = {
            let mut slots = self.device.slots.locked();
            let Some(slot) = slots.free.pop() else {
                return Err(RegistrationError {
                    len: region.len,
                    cause: RegistrationCause::RegionTableFull {
                        regions: REGION_SLOTS,
                    },
                });
            };
            let generation = &mut slots.generation[slot];
            *generation = next_generation(*generation);
            RegionTable::key(slot, *generation)
        };
        if let Some(fd) = memory {
            self.device.region_fds.locked().insert(key, fd);
        }
        self.device.table.publish(key, region);
        Ok(RegisteredRegion {
            lkey: key,
            rkey: key,
            handle: u64::from(key),
        })
    }
}

impl RegistrationHook for SoftRegistration {
    fn register(
        &self,
        addr: usize,
        len: usize,
        access: Access,
    ) -> Result<RegisteredRegion, RegistrationError> {
        self.publish(MemoryRegion::registered(addr, len, access), None)
    }

    fn shares_memory(&self) -> bool {
        true
    }

    fn register_shared(
        &self,
        addr: usize,
        len: usize,
        access: Access,
        memory: OwnedFd,
    ) -> Result<RegisteredRegion, RegistrationError> {
        self.publish(MemoryRegion::registered(addr, len, access), Some(memory))
    }

    fn deregister(&self, _addr: usize, _len: usize, region: &RegisteredRegion) {
        let key = region.lkey;
        self.device.table.retire(key);
        self.device.region_fds.locked().remove(&key);
        self.device.free_slot(RegionTable::slot_of(key));
    }
}

impl Device for SoftDevice {
    fn name(&self) -> &str {
        &self.inner.name
    }

    fn limits(&self) -> DeviceLimits {
        self.inner.limits
    }

    fn registration_hook(&self) -> Arc<dyn RegistrationHook> {
        Arc::new(SoftRegistration {
            device: Arc::clone(&self.inner),
        })
    }

    fn alloc_window(&self) -> Result<Arc<dyn crate::verbs::MemoryWindow>, VerbsError> {
        Ok(Arc::new(self.inner.alloc_window()?))
    }

    fn create_cq(&self, depth: u32) -> Result<Arc<dyn CompletionQueue>, VerbsError> {
        let limits = self.inner.limits;
        limits.check_cq(depth)?;
        live_below(&self.inner.cqs, "completion queues (max_cq)", limits.max_cq)?;
        let cq = Arc::new(SoftCq::with_depth(depth)?);
        self.inner.adopt_cq(&cq);
        Ok(cq)
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
        static NEXT_SRQ: AtomicU32 = AtomicU32::new(1);
        let limits = self.inner.limits;
        limits.check_srq(depth)?;
        live_below(
            &self.inner.srqs,
            "shared receive queues (max_srq)",
            limits.max_srq,
        )?;
        let srq = Arc::new(SoftSrq::new(
            NEXT_SRQ.fetch_add(1, Ordering::Relaxed),
            depth,
        )?);
        self.inner
            .srqs
            .locked()
            .insert(srq.id, Arc::downgrade(&srq));
        Ok(srq)
    }

    fn create_qp_on_srq(
        &self,
        send_cq: Arc<dyn CompletionQueue>,
        recv_cq: Arc<dyn CompletionQueue>,
        srq: Arc<dyn SharedReceiveQueue>,
        caps: QpCaps,
    ) -> Result<Arc<dyn QueuePair>, VerbsError> {
        let srq = crate::verbs::downcast_srq::<SoftSrq>(srq)?;
        self.new_qp(send_cq, recv_cq, Some(srq), caps)
    }

    fn watch_events(
        &self,
        handler: crate::verbs::EventHandler,
    ) -> Result<crate::verbs::EventWatch, VerbsError> {
        *self.inner.events.0.locked() = Some(handler);
        let device = Arc::downgrade(&self.inner);
        Ok(crate::verbs::EventWatch::new(move || {
            if let Some(device) = device.upgrade() {
                *device.events.0.locked() = None;
            }
        }))
    }

    fn port_active(&self) -> bool {
        !self.inner.table.is_dead()
    }

    fn rnr_events(&self) -> Option<u64> {
        Some(self.inner.table.rnr_events())
    }
}

impl SoftDevice {
    fn new_qp(
        &self,
        send_cq: Arc<dyn CompletionQueue>,
        recv_cq: Arc<dyn CompletionQueue>,
        srq: Option<Arc<SoftSrq>>,
        caps: QpCaps,
    ) -> Result<Arc<dyn QueuePair>, VerbsError> {
        let limits = self.inner.limits;
        limits.check_qp(&caps)?;
        live_below(&self.inner.qps, "queue pairs (max_qp)", limits.max_qp)?;
        let send_cq = crate::verbs::downcast_cq::<SoftCq>(send_cq)?;
        let recv_cq = crate::verbs::downcast_cq::<SoftCq>(recv_cq)?;
        let qpn = self.inner.next_qpn.fetch_add(1, Ordering::Relaxed);
        let qp = Arc::new(SoftQpInner::new(
            qpn,
            Arc::downgrade(&self.inner),
            caps,
            send_cq,
            recv_cq,
            srq,
        )?);
        self.inner.qps.locked().insert(qpn, Arc::downgrade(&qp));
        Ok(Arc::new(SoftQp { inner: qp }))
    }
}

/// Room for one more live object in `objects` under `max`.
fn live_below<T>(
    objects: &Mutex<HashMap<u32, Weak<T>>>,
    what: &'static str,
    max: u32,
) -> Result<(), VerbsError> {
    let mut objects = objects.locked();
    objects.retain(|_, object| object.strong_count() > 0);
    let live = u32::try_from(objects.len()).unwrap_or(u32::MAX);
    if live >= max {
        return Err(VerbsError::OverLimit {
            what,
            asked: live.saturating_add(1),
            max,
        });
    }
    Ok(())
}
