//! The path between two queue pairs: what each side's port is (link
//! layer, GID type, MTU), and what two ports must agree on before a QP may
//! go to RTR.
//!
//! Each side tells its peer its port in the connection hello
//! ([`QpEndpoint`]); [`agree`] refuses ports that cannot talk (an
//! InfiniBand port and a RoCE one, RoCE v1 and v2, a RoCE peer without a
//! GID) with an error that says which, and takes the smaller MTU, so that
//! hosts with different MTUs do not fail only for messages above the
//! smaller one (each side used its own before). [`pick_gid`] chooses the
//! GID table entry of a RoCE port when none is configured.

use super::{QpEndpoint, VerbsError};

/// The link a port runs on (`ibv_port_attr.link_layer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkLayer {
    /// InfiniBand: addressed by LID, no GRH needed on one subnet.
    InfiniBand,
    /// Ethernet (RoCE): addressed by GID, every packet carries a GRH.
    Ethernet,
}

/// How a GID table entry addresses (sysfs `gid_attrs/types`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GidType {
    /// An InfiniBand GID, or RoCE v1 (`IB/RoCE v1`): not routable.
    IbRoceV1,
    /// RoCE v2 (UDP/IP encapsulated): routable, what fabrics run today.
    RoceV2,
}

impl LinkLayer {
    /// Wire code in the hello.
    pub fn code(self) -> u8 {
        match self {
            LinkLayer::InfiniBand => 1,
            LinkLayer::Ethernet => 2,
        }
    }

    /// From a hello's code (`None`: unknown).
    pub fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(LinkLayer::InfiniBand),
            2 => Some(LinkLayer::Ethernet),
            _ => None,
        }
    }
}

impl GidType {
    /// Wire code in the hello.
    pub fn code(self) -> u8 {
        match self {
            GidType::IbRoceV1 => 1,
            GidType::RoceV2 => 2,
        }
    }

    /// From a hello's code (`None`: unknown).
    pub fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(GidType::IbRoceV1),
            2 => Some(GidType::RoceV2),
            _ => None,
        }
    }

    /// From the text of sysfs `gid_attrs/types/<index>`.
    pub fn from_sysfs(text: &str) -> Option<Self> {
        match text.trim() {
            "RoCE v2" => Some(GidType::RoceV2),
            "IB/RoCE v1" | "RoCE v1" | "IB" => Some(GidType::IbRoceV1),
            _ => None,
        }
    }
}

/// The path MTUs verbs knows (`ibv_mtu`), in bytes.
pub const MTUS: [u32; 5] = [256, 512, 1024, 2048, 4096];

/// The MTU two QPs use: the smaller of their ports'. Refuses ports that
/// cannot reach each other, naming what differs.
pub fn agree(local: &QpEndpoint, remote: &QpEndpoint) -> Result<u32, VerbsError> {
    if local.link_layer != remote.link_layer {
        return Err(VerbsError::PathMismatch {
            what: "link layer",
            local: format!("{:?}", local.link_layer),
            remote: format!("{:?}", remote.link_layer),
        });
    }
    if local.link_layer == LinkLayer::Ethernet {
        if remote.gid == [0; 16] {
            return Err(VerbsError::PathMismatch {
                what: "GID (a RoCE peer needs one)",
                local: format_gid(&local.gid),
                remote: "none".into(),
            });
        }
        if local.gid_type != remote.gid_type {
            return Err(VerbsError::PathMismatch {
                what: "RoCE version",
                local: format!("{:?}", local.gid_type),
                remote: format!("{:?}", remote.gid_type),
            });
        }
    }
    let mtu = local.mtu.min(remote.mtu);
    if !MTUS.contains(&mtu) {
        return Err(VerbsError::PathMismatch {
            what: "MTU",
            local: local.mtu.to_string(),
            remote: remote.mtu.to_string(),
        });
    }
    Ok(mtu)
}

/// A GID as text (IPv6 notation; an IPv4-mapped one shows its address).
pub fn format_gid(gid: &[u8; 16]) -> String {
    std::net::Ipv6Addr::from(*gid).to_string()
}

/// Whether `gid` is IPv4-mapped (`::ffff:a.b.c.d`), as the RoCE v2 entry
/// of an interface's IPv4 address is.
fn ipv4_mapped(gid: &[u8; 16]) -> bool {
    gid[..10].iter().all(|&b| b == 0) && gid[10] == 0xff && gid[11] == 0xff
}

/// One entry of a port's GID table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GidEntry {
    /// Its index in the table.
    pub index: u8,
    /// The GID (all zero: an empty entry).
    pub gid: [u8; 16],
    /// Its type, where the host says (sysfs).
    pub gid_type: Option<GidType>,
}

/// The entry a RoCE port addresses by: the `configured` index if there is
/// one (it must not be empty), else a RoCE v2 IPv4-mapped entry, else any
/// RoCE v2 entry, else an IPv4-mapped entry of unknown type (where the
/// host does not say types), else any non-empty one. Index 0 is often the
/// link-local RoCE v1 GID, which is why the default is not simply the
/// first.
pub fn pick_gid(entries: &[GidEntry], configured: Option<u8>) -> Result<GidEntry, VerbsError> {
    let filled = |e: &&GidEntry| e.gid != [0; 16];
    if let Some(index) = configured {
        return entries
            .iter()
            .find(|e| e.index == index)
            .filter(filled)
            .copied()
            .ok_or(VerbsError::NoGid { index: Some(index) });
    }
    let v2 = |e: &&GidEntry| e.gid_type == Some(GidType::RoceV2);
    entries
        .iter()
        .filter(filled)
        .find(|e| v2(e) && ipv4_mapped(&e.gid))
        .or_else(|| entries.iter().filter(filled).find(v2))
        .or_else(|| {
            entries
                .iter()
                .filter(filled)
                .find(|e| e.gid_type.is_none() && ipv4_mapped(&e.gid))
        })
        .or_else(|| entries.iter().find(filled))
        .copied()
        .ok_or(VerbsError::NoGid { index: None })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint(link_layer: LinkLayer, gid_type: GidType, mtu: u32, gid: [u8; 16]) -> QpEndpoint {
        QpEndpoint {
            qpn: 1,
            lid: 0,
            gid,
            psn: 0,
            node: 0,
            mtu,
            link_layer,
            gid_type,
        }
    }

    const GID: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 1];

    #[test]
    fn ports_agree_on_the_smaller_mtu_and_refuse_what_cannot_talk() {
        use GidType::*;
        use LinkLayer::*;
        let roce = |mtu| endpoint(Ethernet, RoceV2, mtu, GID);
        assert_eq!(agree(&roce(4096), &roce(1024)), Ok(1024));
        assert_eq!(agree(&roce(1024), &roce(4096)), Ok(1024));
        let mismatch = |a: &QpEndpoint, b: &QpEndpoint| match agree(a, b) {
            Err(VerbsError::PathMismatch { what, .. }) => what,
            other => panic!("{other:?}"),
        };
        let ib = endpoint(InfiniBand, IbRoceV1, 4096, [0; 16]);
        assert_eq!(mismatch(&roce(4096), &ib), "link layer");
        assert_eq!(
            mismatch(&roce(4096), &endpoint(Ethernet, IbRoceV1, 4096, GID)),
            "RoCE version"
        );
        assert_eq!(
            mismatch(&roce(4096), &endpoint(Ethernet, RoceV2, 4096, [0; 16])),
            "GID (a RoCE peer needs one)"
        );
        // A hello naming an MTU verbs does not know.
        assert_eq!(mismatch(&roce(4096), &roce(1500)), "MTU");
        // InfiniBand needs no GID.
        assert_eq!(agree(&ib, &ib), Ok(4096));
    }

    #[test]
    fn a_roce_v2_ipv4_entry_is_picked_over_index_0() {
        let link_local = [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8];
        let entries = [
            GidEntry {
                index: 0,
                gid: link_local,
                gid_type: Some(GidType::IbRoceV1),
            },
            GidEntry {
                index: 1,
                gid: link_local,
                gid_type: Some(GidType::RoceV2),
            },
            GidEntry {
                index: 2,
                gid: GID,
                gid_type: Some(GidType::IbRoceV1),
            },
            GidEntry {
                index: 3,
                gid: GID,
                gid_type: Some(GidType::RoceV2),
            },
            GidEntry {
                index: 4,
                gid: [0; 16],
                gid_type: None,
            },
        ];
        assert_eq!(pick_gid(&entries, None).map(|e| e.index), Ok(3));
        assert_eq!(pick_gid(&entries[..3], None).map(|e| e.index), Ok(1));
        assert_eq!(pick_gid(&entries[..1], None).map(|e| e.index), Ok(0));
        assert_eq!(pick_gid(&entries, Some(2)).map(|e| e.index), Ok(2));
        // An empty entry (returned as zeros with success) is refused.
        assert_eq!(
            pick_gid(&entries, Some(4)),
            Err(VerbsError::NoGid { index: Some(4) })
        );
        assert_eq!(
            pick_gid(&entries[4..], None),
            Err(VerbsError::NoGid { index: None })
        );
        assert_eq!(format_gid(&GID), "::ffff:10.0.0.1");
        assert_eq!(GidType::from_sysfs("RoCE v2\n"), Some(GidType::RoceV2));
        assert_eq!(GidType::from_sysfs("IB/RoCE v1\n"), Some(GidType::IbRoceV1));
    }
}
