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

use std::path::PathBuf;
use std::sync::{Arc, Weak};
use std::time::Duration;

use super::device::{DeviceInner, SoftDevice};
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
}

impl Default for SoftPort {
    fn default() -> Self {
        Self {
            link_layer: crate::verbs::LinkLayer::Ethernet,
            gid_type: crate::verbs::GidType::RoceV2,
            mtu: 4096,
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
