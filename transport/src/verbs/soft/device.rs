use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};

use super::cq::SoftCq;
use super::qp::{SoftQp, SoftQpInner};
use crate::pool::{Access, RegisteredRegion, RegistrationError, RegistrationHook};
use crate::verbs::{CompletionQueue, Device, QpCaps, QueuePair, VerbsError};

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
}

/// A registered memory region as the soft NIC sees it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MemoryRegion {
    pub(crate) addr: usize,
    pub(crate) len: usize,
    pub(crate) access: Access,
}

impl MemoryRegion {
    pub(crate) fn contains(&self, addr: usize, len: usize) -> bool {
        addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.addr + self.len)
    }
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
}

impl FabricInner {
    pub(crate) fn device(&self, node: u64) -> Option<Arc<DeviceInner>> {
        self.devices
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&node)
            .and_then(Weak::upgrade)
    }
}

impl SoftFabric {
    /// An empty fabric.
    pub fn new() -> Self {
        Self::default()
    }

    /// The fabric shared by every soft device of this process (what the
    /// transport uses, so that its connections can reach each other).
    pub fn process() -> Self {
        static PROCESS: std::sync::OnceLock<SoftFabric> = std::sync::OnceLock::new();
        PROCESS.get_or_init(SoftFabric::new).clone()
    }

    /// Opens a device (an RNIC with its protection domain) on the fabric.
    pub fn open(&self, name: impl Into<String>, faults: SoftFaults) -> SoftDevice {
        let node = self.inner.next_node.fetch_add(1, Ordering::Relaxed) + 1;
        let inner = Arc::new(DeviceInner {
            node,
            name: name.into(),
            fabric: Arc::clone(&self.inner),
            regions: RwLock::new(HashMap::new()),
            next_key: AtomicU32::new(0x100),
            qps: Mutex::new(HashMap::new()),
            next_qpn: AtomicU32::new(0x10),
            faults,
            rng: Mutex::new(faults.seed ^ 0x9e37_79b9_7f4a_7c15 ^ node),
            dead: AtomicBool::new(false),
            rnr_events: AtomicU64::new(0),
            remote_access_errors: AtomicU64::new(0),
            injected_qp_errors: AtomicU64::new(0),
            bytes_moved: AtomicU64::new(0),
        });
        self.inner
            .devices
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(node, Arc::downgrade(&inner));
        SoftDevice { inner }
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
    name: String,
    pub(crate) fabric: Arc<FabricInner>,
    regions: RwLock<HashMap<u32, MemoryRegion>>,
    next_key: AtomicU32,
    qps: Mutex<HashMap<u32, Weak<SoftQpInner>>>,
    next_qpn: AtomicU32,
    faults: SoftFaults,
    rng: Mutex<u64>,
    dead: AtomicBool,
    pub(crate) rnr_events: AtomicU64,
    pub(crate) remote_access_errors: AtomicU64,
    pub(crate) injected_qp_errors: AtomicU64,
    pub(crate) bytes_moved: AtomicU64,
}

/// Which fault to roll for.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Fault {
    Rnr,
    QpError,
    Delay,
}

impl DeviceInner {
    /// The region `key` names, if registered.
    pub(crate) fn region(&self, key: u32) -> Option<MemoryRegion> {
        self.regions
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
            .copied()
    }

    pub(crate) fn qp(&self, qpn: u32) -> Option<Arc<SoftQpInner>> {
        self.qps
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&qpn)
            .and_then(Weak::upgrade)
    }

    pub(crate) fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// Rolls the dice for `fault`; for `Delay`, the number of polls (0 = none).
    pub(crate) fn roll(&self, fault: Fault) -> u32 {
        let per_million = match fault {
            Fault::Rnr => self.faults.rnr_per_million,
            Fault::QpError => self.faults.qp_error_per_million,
            Fault::Delay => self.faults.delay_per_million,
        };
        if per_million == 0 {
            return 0;
        }
        let mut state = self.rng.lock().unwrap_or_else(|p| p.into_inner());
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
            _ => 1,
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
            rnr_events: self.inner.rnr_events.load(Ordering::Relaxed),
            remote_access_errors: self.inner.remote_access_errors.load(Ordering::Relaxed),
            injected_qp_errors: self.inner.injected_qp_errors.load(Ordering::Relaxed),
            bytes_moved: self.inner.bytes_moved.load(Ordering::Relaxed),
        }
    }

    /// Simulates the host dying: every QP of this device goes to error, and
    /// peers' operations towards it fail with `RetryExceeded`.
    pub fn kill(&self) {
        self.inner.dead.store(true, Ordering::Release);
        let qps: Vec<Arc<SoftQpInner>> = self
            .inner
            .qps
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter_map(Weak::upgrade)
            .collect();
        for qp in qps {
            qp.enter_error();
        }
    }

    /// Creates a soft completion queue (the concrete type, for tests).
    pub fn create_soft_cq(&self) -> Arc<SoftCq> {
        Arc::new(SoftCq::new())
    }
}

/// Registers pool memory with a soft device (the MR table the soft NIC
/// checks one-sided accesses against).
#[derive(Debug)]
struct SoftRegistration {
    device: Arc<DeviceInner>,
}

impl RegistrationHook for SoftRegistration {
    fn register(
        &self,
        addr: usize,
        len: usize,
        access: Access,
    ) -> Result<RegisteredRegion, RegistrationError> {
        let key = self.device.next_key.fetch_add(1, Ordering::Relaxed);
        self.device
            .regions
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, MemoryRegion { addr, len, access });
        Ok(RegisteredRegion {
            lkey: key,
            rkey: key,
            handle: u64::from(key),
        })
    }

    fn deregister(&self, _addr: usize, _len: usize, region: &RegisteredRegion) {
        self.device
            .regions
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&region.lkey);
    }
}

impl Device for SoftDevice {
    fn name(&self) -> &str {
        &self.inner.name
    }

    fn registration_hook(&self) -> Arc<dyn RegistrationHook> {
        Arc::new(SoftRegistration {
            device: Arc::clone(&self.inner),
        })
    }

    fn create_cq(&self, _depth: u32) -> Result<Arc<dyn CompletionQueue>, VerbsError> {
        Ok(Arc::new(SoftCq::new()))
    }

    fn create_qp(
        &self,
        send_cq: Arc<dyn CompletionQueue>,
        recv_cq: Arc<dyn CompletionQueue>,
        caps: QpCaps,
    ) -> Result<Arc<dyn QueuePair>, VerbsError> {
        let send_cq = crate::verbs::downcast_cq::<SoftCq>(send_cq)?;
        let recv_cq = crate::verbs::downcast_cq::<SoftCq>(recv_cq)?;
        let qpn = self.inner.next_qpn.fetch_add(1, Ordering::Relaxed);
        let qp = Arc::new(SoftQpInner::new(
            qpn,
            Arc::downgrade(&self.inner),
            caps,
            send_cq,
            recv_cq,
        ));
        self.inner
            .qps
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(qpn, Arc::downgrade(&qp));
        Ok(Arc::new(SoftQp { inner: qp }))
    }
}
