//! Rails: the RDMA devices a transport opens (`[rdma] devices`, or
//! `[[rdma.soft_rails]]` for the soft provider), each registered with every
//! pool so that any buffer may leave on any of them.
//!
//! Opening is all this file does: which rail a connection takes, and
//! taking another when a port fails, belong to the RDMA side
//! (`rdma/rails.rs`: a runtime per rail).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::config::{RdmaProvider, TransportConfig};
use crate::error::TransportError;
use crate::verbs::Device;

/// Soft devices opened by transports of this process (each its own name).
static SOFT_DEVICES: AtomicU64 = AtomicU64::new(0);

/// Opens the rails `config` names, the primary first: at least one, or the
/// reason none could be opened.
pub(super) fn open_rails(config: &TransportConfig) -> Result<Vec<Arc<dyn Device>>, TransportError> {
    let rdma = &config.rdma;
    match rdma.provider {
        RdmaProvider::Soft => open_soft(config),
        #[cfg(feature = "ibverbs")]
        RdmaProvider::Ibverbs => open_ibverbs(config),
        #[cfg(not(feature = "ibverbs"))]
        RdmaProvider::Ibverbs => Err(TransportError::rdma_error(crate::RdmaError::NoProvider)),
    }
}

/// One soft device per `[[rdma.soft_rails]]` entry (or one from
/// `soft_link_mbps` and `soft_port_file`), named `soft-<n>` for the first
/// and `soft-<n>.<rail>` for the others.
fn open_soft(config: &TransportConfig) -> Result<Vec<Arc<dyn Device>>, TransportError> {
    use crate::verbs::soft::{SoftFabric, SoftPort, SoftProfile};
    let rdma = &config.rdma;
    let rails = match rdma.soft_rails.is_empty() {
        true => vec![crate::config::SoftRail {
            link_mbps: rdma.soft_link_mbps,
            port_file: rdma.soft_port_file.clone(),
        }],
        false => rdma.soft_rails.clone(),
    };
    let fabric = SoftFabric::process();
    let n = SOFT_DEVICES.fetch_add(1, Ordering::Relaxed);
    let mut devices = Vec::with_capacity(rails.len());
    for (i, rail) in rails.iter().enumerate() {
        let profile = SoftProfile {
            port: SoftPort {
                rate_mbps: rail.link_mbps,
                ..Default::default()
            },
            ..Default::default()
        };
        let name = match i {
            0 => format!("soft-{n}"),
            _ => format!("soft-{n}.{i}"),
        };
        let device = fabric
            .open_with(name, rdma.soft_faults, profile)
            .map_err(TransportError::rdma_error)?;
        if let Some(path) = &rail.port_file {
            // Its state now, before anyone reads it; then followed.
            device.set_port_active(!path.exists());
            device
                .follow_port_file(path.clone())
                .map_err(TransportError::Io)?;
        }
        devices.push(Arc::new(device) as Arc<dyn Device>);
    }
    Ok(devices)
}

/// The named devices (each must open, its `port` active), or with
/// `devices = "all"` every device whose port is active (those that are not
/// are skipped and logged), or the one `device` (the first if unset).
#[cfg(feature = "ibverbs")]
fn open_ibverbs(config: &TransportConfig) -> Result<Vec<Arc<dyn Device>>, TransportError> {
    use crate::config::Devices;
    use crate::verbs::ibverbs::{IbvDevice, device_names};
    let rdma = &config.rdma;
    let open = |name: Option<&str>| {
        IbvDevice::open(name, rdma.port, rdma.gid_index, rdma.traffic_class)
            .map(|device| Arc::new(device) as Arc<dyn Device>)
            .map_err(TransportError::rdma_error)
    };
    match &rdma.devices {
        None => Ok(vec![open(rdma.device.as_deref())?]),
        Some(Devices::Named(names)) => names.iter().map(|name| open(Some(name))).collect(),
        Some(Devices::All(_)) => {
            let names = device_names().map_err(TransportError::rdma_error)?;
            let mut devices = Vec::new();
            let mut last_error = None;
            for name in names.iter().take(crate::config::MAX_RAILS) {
                match open(Some(name)) {
                    Ok(device) => devices.push(device),
                    Err(err) => {
                        tracing::info!(device = %name, port = rdma.port, %err, "not a rail: the device did not open with its port active");
                        last_error = Some(err);
                    }
                }
            }
            match (devices.is_empty(), last_error) {
                (false, _) => Ok(devices),
                (true, Some(err)) => Err(err),
                (true, None) => Err(TransportError::rdma_error(
                    crate::verbs::VerbsError::NoDevice("no RDMA device on this host".into()),
                )),
            }
        }
    }
}

/// The hooks that register pool memory on each rail, in rail order.
pub(super) fn hooks(rails: &[Arc<dyn Device>]) -> Vec<Arc<dyn crate::pool::RegistrationHook>> {
    rails
        .iter()
        .map(|device| device.registration_hook())
        .collect()
}
