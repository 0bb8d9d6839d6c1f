//! The far end of a connected soft QP, in this process or another: its
//! receive queue and state, the completion ring its receives complete on,
//! and a way to reach the memory it registered.

use crate::sync::LockExt;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use super::agent::{self, AgentClient, Request};
use super::cq::SoftCq;
use super::device::DeviceInner;
use super::rings::{CqRing, MemoryRegion, QpSegment, RegionTable};
use super::shm::SharedMapping;
use crate::pool::Access;
use crate::verbs::{QpEndpoint, VerbsError};

/// A connected QP's peer.
#[derive(Debug)]
pub(crate) struct Peer {
    pub(crate) qp: Arc<QpSegment>,
    /// Where its receives come from: its own ring, or its shared receive
    /// queue's.
    pub(crate) recvs: Arc<QpSegment>,
    cq: PeerCq,
    device: PeerDevice,
}

#[derive(Debug)]
enum PeerCq {
    Local(Arc<SoftCq>),
    Remote(CqRing),
}

#[derive(Debug)]
enum PeerDevice {
    Local(Weak<DeviceInner>),
    Remote(Arc<RemoteDevice>),
}

impl Peer {
    /// Finds the QP `remote` names, from a QP of `local`.
    pub(crate) fn resolve(local: &DeviceInner, remote: &QpEndpoint) -> Result<Self, VerbsError> {
        let unknown = || VerbsError::UnknownPeer {
            node: remote.node,
            qpn: remote.qpn,
        };
        if let Some(device) = local.fabric.device(remote.node) {
            let qp = device.qp(remote.qpn).ok_or_else(unknown)?;
            let recvs = match qp.segment.srq() {
                0 => Arc::clone(&qp.segment),
                id => Arc::clone(&device.srq(id).ok_or_else(unknown)?.segment),
            };
            return Ok(Self {
                recvs,
                qp: Arc::clone(&qp.segment),
                cq: PeerCq::Local(Arc::clone(&qp.recv_cq)),
                device: PeerDevice::Local(Arc::downgrade(&device)),
            });
        }
        let elsewhere = agent::node_pid(remote.node) != std::process::id();
        if !(local.fabric.host_wide && elsewhere) {
            return Err(unknown());
        }
        let failed = |what: &str, err: std::io::Error| {
            VerbsError::InvalidRequest(format!(
                "soft NIC peer {:#x} (process {}): {what}: {err}",
                remote.node,
                agent::node_pid(remote.node)
            ))
        };
        let device = RemoteDevice::get(remote.node).map_err(|e| failed("device", e))?;
        let qp = device
            .ask(Request::Qp(remote.qpn))
            .and_then(|answer| QpSegment::open(answer.fd))
            .map_err(|e| failed("queue pair", e))?;
        let event = device
            .ask(Request::CqEvent(qp.recv_cq()))
            .map_err(|e| failed("completion queue's eventfd", e))?;
        let cq = device
            .ask(Request::Cq(qp.recv_cq()))
            .and_then(|answer| CqRing::open(answer.fd, Some(event.fd)))
            .map_err(|e| failed("completion queue", e))?;
        let qp = Arc::new(qp);
        let recvs = match qp.srq() {
            0 => Arc::clone(&qp),
            id => Arc::new(
                device
                    .ask(Request::Srq(id))
                    .and_then(|answer| QpSegment::open(answer.fd))
                    .map_err(|e| failed("shared receive queue", e))?,
            ),
        };
        Ok(Self {
            recvs,
            qp,
            cq: PeerCq::Remote(cq),
            device: PeerDevice::Remote(device),
        })
    }

    /// The ring the peer's receive completions go to.
    pub(crate) fn cq(&self) -> &CqRing {
        match &self.cq {
            PeerCq::Local(cq) => &cq.ring,
            PeerCq::Remote(ring) => ring,
        }
    }

    /// The peer's memory, unless its device is gone or dead.
    pub(crate) fn memory(&self) -> Option<PeerMemory<'_>> {
        let memory = match &self.device {
            PeerDevice::Local(device) => PeerMemory::Local(device.upgrade()?),
            PeerDevice::Remote(device) => PeerMemory::Remote(device),
        };
        (!memory.table().is_dead()).then_some(memory)
    }
}

/// Access to a peer's registered memory for one work request.
pub(crate) enum PeerMemory<'a> {
    Local(Arc<DeviceInner>),
    Remote(&'a RemoteDevice),
}

/// Where in this process's address space a checked peer range lies.
pub(crate) struct Target {
    pub(crate) addr: usize,
    /// Keeps a peer mapping alive while it is written.
    _mapping: Option<Arc<RemoteRegion>>,
}

impl PeerMemory<'_> {
    /// The peer's region table (and shared counters).
    pub(crate) fn table(&self) -> &RegionTable {
        match self {
            PeerMemory::Local(device) => &device.table,
            PeerMemory::Remote(device) => &device.table,
        }
    }

    /// Checks that `len` bytes at the peer's `addr` lie in the region `key`
    /// names, and maps them. A remote write (`remote_write`: the peer's QP
    /// it arrives on) needs a key that allows one: a region registered
    /// remotely writable, or a memory window bound to that very QP (a
    /// window bound for another connection, or invalidated, is refused).
    pub(crate) fn resolve(
        &self,
        key: u32,
        addr: usize,
        len: usize,
        remote_write: Option<u32>,
    ) -> Option<Target> {
        let region = self.table().lookup(key)?;
        if !region.contains(addr, len) {
            return None;
        }
        if let Some(qpn) = remote_write {
            if region.access != Access::RemoteWrite {
                return None;
            }
            if region.bound.is_some_and(|b| b.qpn != qpn) {
                return None;
            }
        }
        // The memory behind a window is its parent region's.
        let (key, region) = match region.bound {
            None => (key, region),
            Some(binding) => {
                let parent = self.table().lookup(binding.parent)?;
                if !parent.contains(addr, len) {
                    return None;
                }
                (binding.parent, parent)
            }
        };
        match self {
            PeerMemory::Local(_) => Some(Target {
                addr,
                _mapping: None,
            }),
            PeerMemory::Remote(device) => {
                let mapping = device.region(key, region)?;
                Some(Target {
                    addr: mapping.map.addr() + (addr - mapping.base),
                    _mapping: Some(mapping),
                })
            }
        }
    }
}

/// A region of a peer in another process, mapped here.
#[derive(Debug)]
pub(crate) struct RemoteRegion {
    map: SharedMapping,
    /// Its first byte in the owner's address space.
    base: usize,
}

/// A soft device of another process.
#[derive(Debug)]
pub(crate) struct RemoteDevice {
    node: u64,
    agent: Mutex<AgentClient>,
    table: RegionTable,
    regions: Mutex<HashMap<u32, Arc<RemoteRegion>>>,
}

impl RemoteDevice {
    /// The device `node` (one per node in this process, shared by its QPs).
    fn get(node: u64) -> std::io::Result<Arc<Self>> {
        static DEVICES: OnceLock<Mutex<HashMap<u64, Weak<RemoteDevice>>>> = OnceLock::new();
        let devices = DEVICES.get_or_init(Mutex::default);
        let mut devices = devices.locked();
        if let Some(device) = devices.get(&node).and_then(Weak::upgrade) {
            return Ok(device);
        }
        devices.retain(|_, device| device.strong_count() > 0);
        let mut agent = AgentClient::connect(node)?;
        let table = RegionTable::open(agent.ask(node, Request::Table)?.fd)?;
        let device = Arc::new(Self {
            node,
            agent: Mutex::new(agent),
            table,
            regions: Mutex::new(HashMap::new()),
        });
        devices.insert(node, Arc::downgrade(&device));
        Ok(device)
    }

    fn ask(&self, request: Request) -> std::io::Result<agent::Answer> {
        self.agent.locked().ask(self.node, request)
    }

    /// The mapping of `region` (registered under `key`), asking the peer's
    /// agent for it the first time.
    fn region(&self, key: u32, region: MemoryRegion) -> Option<Arc<RemoteRegion>> {
        let mut regions = self.regions.locked();
        if let Some(mapped) = regions.get(&key)
            && mapped.base == region.addr
            && mapped.map.len() >= region.len
        {
            return Some(Arc::clone(mapped));
        }
        let answer = self.ask(Request::Region(key)).ok()?;
        let map = SharedMapping::open(answer.fd).ok()?;
        let base = usize::try_from(answer.base).ok()?;
        if base != region.addr || map.len() < region.len {
            return None;
        }
        let mapped = Arc::new(RemoteRegion { map, base });
        // Keys of retired regions are never reused (generations), so their
        // mappings only cost address space until dropped here.
        regions.retain(|k, _| self.table.lookup(*k).is_some());
        regions.insert(key, Arc::clone(&mapped));
        Some(mapped)
    }
}
