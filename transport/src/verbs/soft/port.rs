//! A soft device's port: what it is like (link layer, GID type, MTU) and
//! whether it is up.
//!
//! A port can be taken down and brought back ([`SoftDevice::set_port_active`]),
//! as pulling and plugging an RNIC's cable: while it is down no message
//! moves to or from the device, every QP on it fails (as their retries run
//! out on a real NIC) and watchers hear [`AsyncEvent::PortDown`], then
//! [`AsyncEvent::PortUp`] when it is back. QPs that failed stay failed, as
//! on real hardware: connections are made anew. The host's TCP is not
//! touched, which is the fault the RDMA-to-TCP fallback is for.
//!
//! A process can be told to follow a file instead
//! ([`SoftDevice::follow_port_file`]: down while the file exists), so that
//! a drill breaks the RDMA path of a server process from outside it.
//!
//! **Link rate.** A port may have a rate ([`SoftPort::rate_mbps`]), which
//! holds both directions of its link to it: a SEND or WRITE goes when the
//! sender's egress and the receiver's ingress are both done with what was
//! booked on them before ([`admit`]), and once it went, books its bytes on
//! both ([`book`]). Until then it waits in its QP's send queue, in order,
//! as behind a link that is busy or paused (PFC), and the soft NIC's retry
//! engine sends it when the link frees. So many senders into one rate-limited port (incast)
//! queue in their send queues, as on a lossless fabric, which is what a
//! send window is for. The bookings live in each device's shared header,
//! on the machine's monotonic clock, so senders in every process share a
//! receiver's link. The model is coarse: a message lands at the start of
//! its slot on the link, not its end (one message's serialization time
//! early); two senders that find a link free at the same moment both go
//! (a burst of a message each over the rate, paid back by the wait after
//! it); and a free link goes to whoever asks first, not in turn, so a
//! sender that asks rarely (one with a small send window) can wait longer
//! than its share.

use std::path::PathBuf;
use std::sync::{Arc, Weak};
use std::time::Duration;

use super::device::{DeviceInner, SoftDevice};
use super::rings::RegionTable;
use crate::verbs::AsyncEvent;

/// The port of a soft device. Connecting QPs are held to the rules of real
/// ports ([`crate::verbs::port::agree`]), and a QP whose path MTU is above
/// its peer's port MTU loses every message larger than the peer's MTU (its
/// retries run out), as on a real path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SoftPort {
    /// Default Ethernet (RoCE).
    pub link_layer: crate::verbs::LinkLayer,
    /// Default RoCE v2.
    pub gid_type: crate::verbs::GidType,
    /// Active MTU in bytes. Default 4096.
    pub mtu: u32,
    /// The link's rate in megabits per second, each way; 0: unlimited
    /// (the default: a copy in memory).
    pub rate_mbps: u64,
}

impl Default for SoftPort {
    fn default() -> Self {
        Self {
            link_layer: crate::verbs::LinkLayer::Ethernet,
            gid_type: crate::verbs::GidType::RoceV2,
            mtu: 4096,
            rate_mbps: 0,
        }
    }
}

/// How often a followed port file is looked at. 10 ms: a drill's clock
/// reads the break within that, and a `stat` per 10 ms costs nothing.
const FOLLOW_INTERVAL: Duration = Duration::from_millis(10);

impl SoftDevice {
    /// Takes the port down (`false`) or brings it back (`true`); see the
    /// module docs. Does nothing on a killed device ([`SoftDevice::kill`]).
    pub fn set_port_active(&self, active: bool) {
        set_port_active(&self.inner, active);
    }

    /// Whether the port is up (and the device alive).
    pub fn port_active(&self) -> bool {
        !self.inner.table.is_dead()
    }

    /// Keeps the port down while `path` exists and up while it does not,
    /// looking every 10 ms on a thread of its own, for as long as the
    /// device lives (`[rdma] soft_port_file`).
    pub fn follow_port_file(&self, path: PathBuf) -> std::io::Result<()> {
        let device: Weak<DeviceInner> = Arc::downgrade(&self.inner);
        std::thread::Builder::new()
            .name("tessera-soft-port".into())
            .spawn(move || {
                while let Some(device) = device.upgrade() {
                    set_port_active(&device, !path.exists());
                    drop(device);
                    std::thread::sleep(FOLLOW_INTERVAL);
                }
            })?;
        Ok(())
    }
}

fn set_port_active(device: &Arc<DeviceInner>, active: bool) {
    if !device.table.set_port_down(!active) {
        return;
    }
    if active {
        tracing::warn!(device = %device.name, "soft NIC port up");
        device.raise(AsyncEvent::PortUp { port: 1 });
    } else {
        tracing::warn!(device = %device.name, "soft NIC port down: its QPs fail");
        device.fail_qps();
        device.raise(AsyncEvent::PortDown { port: 1 });
    }
}

/// Picoseconds a byte takes at `rate_mbps` (0: unlimited).
pub(crate) fn ps_per_byte(rate_mbps: u64) -> u64 {
    match rate_mbps {
        0 => 0,
        // 8 bits of 1 / (rate x 10^6) s, in 10^-12 s; at least 1.
        rate => (8_000_000 / rate).max(1),
    }
}

/// This machine's monotonic clock, in nanoseconds: one clock for every
/// process, so bookings made by one are read right by another.
pub(crate) fn now_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).map_or(0, |t| {
        (t.tv_sec() as u64)
            .saturating_mul(1_000_000_000)
            .saturating_add(t.tv_nsec() as u64)
    })
}

/// Whether a message from the device of table `local` to that of `peer`
/// may go now: both links done with what was booked on them. Otherwise
/// `Err` says when the busier one frees (monotonic nanoseconds).
pub(crate) fn admit(local: &RegionTable, peer: &RegionTable) -> Result<(), u64> {
    let mut free = 0;
    if local.ps_per_byte() > 0 {
        free = local.link_free_ns(false);
    }
    if peer.ps_per_byte() > 0 {
        free = free.max(peer.link_free_ns(true));
    }
    if free > now_ns() {
        return Err(free);
    }
    Ok(())
}

/// Books `bytes` that went from `local` to `peer` on both links: a
/// message that went (not one the peer refused, receiver not ready, which
/// costs a round trip, not its bytes).
pub(crate) fn book(local: &RegionTable, peer: &RegionTable, bytes: u64) {
    let (out_rate, in_rate) = (local.ps_per_byte(), peer.ps_per_byte());
    if out_rate == 0 && in_rate == 0 {
        return;
    }
    let now = now_ns();
    let cost = |rate: u64| bytes.saturating_mul(rate) / 1000;
    if out_rate > 0 {
        local.book_link(false, now, cost(out_rate));
    }
    if in_rate > 0 {
        peer.book_link(true, now, cost(in_rate));
    }
}
