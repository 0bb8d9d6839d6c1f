//! What `tessera doctor` reports of the host's devices: every device's
//! limits and ports, GIDs and their types, queried without keeping the
//! device open.

#[allow(clippy::wildcard_imports)]
use super::*;

/// What `tessera doctor` reports of one device: its limits and ports.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DeviceReport {
    /// The device's name (`mlx5_0`, `rxe0`).
    pub name: String,
    /// Its limits, if it could be queried.
    pub limits: Option<DeviceLimitsReport>,
    /// The NUMA node its PCI function hangs off (sysfs; `None` where the
    /// host does not say, as for Soft-RoCE and single-node hosts).
    pub numa_node: Option<u32>,
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
    /// Its link's signalling rate in Gbit/s (lanes x lane rate, as
    /// `ibv_devinfo` reads `active_width` and `active_speed`); `None` for
    /// codes this build does not know.
    pub link_gbps: Option<f64>,
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

pub(super) fn describe(name: &str) -> DeviceReport {
    let mut report = DeviceReport {
        name: name.to_owned(),
        limits: None,
        numa_node: numa_node(name),
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
                link_gbps: link_gbps(port_attr.active_width, port_attr.active_speed),
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

/// The NUMA node of device `name` from sysfs (`-1`, absent or unreadable:
/// `None`).
pub fn numa_node(name: &str) -> Option<u32> {
    let path = format!("/sys/class/infiniband/{name}/device/numa_node");
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// A port's signalling rate in Gbit/s from `ibv_port_attr`'s
/// `active_width` (lanes: 1 = 1x, 2 = 4x, 4 = 8x, 8 = 12x, 16 = 2x) and
/// `active_speed` (per lane: 1 SDR 2.5, 2 DDR 5, 4 QDR 10, 8 FDR10 10,
/// 16 FDR 14, 32 EDR 25, 64 HDR 50, 128 NDR 100 Gbit/s).
pub fn link_gbps(width: u8, speed: u8) -> Option<f64> {
    let lanes = match width {
        1 => 1.0,
        2 => 4.0,
        4 => 8.0,
        8 => 12.0,
        16 => 2.0,
        _ => return None,
    };
    let lane = match speed {
        1 => 2.5,
        2 => 5.0,
        4 | 8 => 10.0,
        16 => 14.0,
        32 => 25.0,
        64 => 50.0,
        128 => 100.0,
        _ => return None,
    };
    Some(lanes * lane)
}

#[cfg(test)]
mod tests {
    use super::link_gbps;

    #[test]
    fn link_rates_read_as_ibv_devinfo_reads_them() {
        assert_eq!(link_gbps(2, 32), Some(100.0), "4x EDR");
        assert_eq!(link_gbps(2, 64), Some(200.0), "4x HDR");
        assert_eq!(link_gbps(1, 1), Some(2.5), "1x SDR (rxe reports this)");
        assert_eq!(link_gbps(16, 128), Some(200.0), "2x NDR");
        assert_eq!(link_gbps(3, 32), None);
        assert_eq!(link_gbps(2, 3), None);
    }
}
