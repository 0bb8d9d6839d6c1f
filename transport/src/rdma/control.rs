//! The engine's control header: every SEND starts with it.
//!
//! ```text
//!  0      1     2           4         8              16       20         24
//!  magic  kind  credits     msg id    addr / size    rkey     socket
//!  u8     u8    u16 LE      u32 LE    u64 LE         u32 LE   u32 LE
//! ```
//!
//! `credits` returns receive credits to the peer on every SEND (piggy-back);
//! `Data` is followed by a message of `socket`; `Rts` asks for a destination
//! of `size` bytes for message `msg id` of `socket`; `Cts` answers with
//! `addr` and `rkey`; `Credit` only returns credits; `Open` and `Close`
//! start and end a logical socket on the engine's queue pair, `Accept` and
//! `Refuse` answer an `Open`; `Slot` tells where (`addr`, `rkey`) the peer
//! writes its keepalive, once a memory window confines it there; `Offer`
//! gives a destination (`addr`, `rkey`) for `socket`'s next large message
//! before it is asked for (`engine/offers.rs`): its id in `msg id`, and
//! the bytes offered in 8 more bytes after the header (u64 LE).
//!
//! **Rail keys.** Where the receiver has several rails and the peer may
//! write anywhere in its registered memory (no confinement), a `Cts` and
//! an `Offer` are followed by the destination's key on each of the
//! receiver's rails, u32 LE in rail order ([`encode_rail_keys`]): the
//! sender may then write parts of the message through its queue pairs on
//! the other rails (`engine/stripes.rs`). A receiver with one rail, or a
//! confined one (whose windows are bound on this queue pair only), sends
//! none.

/// First byte of every control header.
pub const MAGIC: u8 = 0xbe;
/// Bytes of the header.
pub const HEADER_LEN: usize = 24;

/// What a SEND carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControlKind {
    /// A whole small message follows the header.
    Data,
    /// Request to send a large message of `size` bytes.
    Rts {
        /// Bytes of the message.
        size: u64,
    },
    /// Clear to send: write message `msg_id` to `addr` with `rkey`.
    Cts {
        /// Destination address.
        addr: u64,
        /// Its remote key.
        rkey: u32,
    },
    /// Only returns credits.
    Credit,
    /// The sender opened logical socket `socket`.
    Open,
    /// The sender closed logical socket `socket` (after its last message).
    Close,
    /// The acceptor took socket `socket` (a listener has it).
    Accept,
    /// The acceptor refused socket `socket` (no listener).
    Refuse,
    /// Write your keepalive to `addr` with `rkey` (a window bound to the
    /// sender's keepalive slot; see `rdma/windows.rs`).
    Slot {
        /// The slot's address.
        addr: u64,
        /// The window's key.
        rkey: u32,
    },
    /// A destination for socket `socket`'s next large message, offer
    /// `msg_id`; its size follows the header ([`OFFER_LEN`]).
    Offer {
        /// Destination address.
        addr: u64,
        /// Its remote key.
        rkey: u32,
    },
}

/// Bytes of an `Offer`: the header and the size offered (u64 LE).
pub const OFFER_LEN: usize = HEADER_LEN + 8;

/// The size an `Offer` carries after its header; `None` if `bytes` (the
/// whole message) is too short to hold it.
pub fn decode_offer_size(bytes: &[u8]) -> Option<u64> {
    let raw: [u8; 8] = bytes.get(HEADER_LEN..OFFER_LEN)?.try_into().ok()?;
    Some(u64::from_le_bytes(raw))
}

/// Most rail keys a `Cts` or `Offer` carries (more rails are not used for
/// striping).
pub const MAX_RAIL_KEYS: usize = 16;

/// The rail keys to put after a `Cts` header or an `Offer`'s size.
pub fn encode_rail_keys(keys: &[u32]) -> Vec<u8> {
    keys.iter()
        .take(MAX_RAIL_KEYS)
        .flat_map(|key| key.to_le_bytes())
        .collect()
}

/// The rail keys in `bytes` (the whole message) from offset `from`: as
/// many whole u32 as there are, at most [`MAX_RAIL_KEYS`]; none if the
/// message ends before `from`.
pub fn decode_rail_keys(bytes: &[u8], from: usize) -> Vec<u32> {
    bytes
        .get(from..)
        .unwrap_or_default()
        .chunks_exact(4)
        .take(MAX_RAIL_KEYS)
        .map(|raw| u32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]))
        .collect()
}

/// A decoded control header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ControlHeader {
    /// What follows.
    pub kind: ControlKind,
    /// Receive credits returned to the peer.
    pub credits: u16,
    /// The large message this is about (0 for `Data` and `Credit`).
    pub msg_id: u32,
    /// The logical socket it belongs to (0 for engine-level messages).
    pub socket: u32,
}

/// A header that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ControlError {
    /// Shorter than the header.
    #[error("control message of {0} bytes is shorter than its header")]
    TooShort(usize),
    /// Wrong magic byte.
    #[error("bad control magic {0:#04x}")]
    BadMagic(u8),
    /// Unknown kind byte.
    #[error("unknown control kind {0}")]
    UnknownKind(u8),
}

impl ControlHeader {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0] = MAGIC;
        let (kind, a, b) = match self.kind {
            ControlKind::Data => (1u8, 0u64, 0u32),
            ControlKind::Rts { size } => (2, size, 0),
            ControlKind::Cts { addr, rkey } => (3, addr, rkey),
            ControlKind::Credit => (4, 0, 0),
            ControlKind::Open => (5, 0, 0),
            ControlKind::Close => (6, 0, 0),
            ControlKind::Accept => (7, 0, 0),
            ControlKind::Refuse => (8, 0, 0),
            ControlKind::Slot { addr, rkey } => (9, addr, rkey),
            ControlKind::Offer { addr, rkey } => (10, addr, rkey),
        };
        out[1] = kind;
        out[2..4].copy_from_slice(&self.credits.to_le_bytes());
        out[4..8].copy_from_slice(&self.msg_id.to_le_bytes());
        out[8..16].copy_from_slice(&a.to_le_bytes());
        out[16..20].copy_from_slice(&b.to_le_bytes());
        out[20..24].copy_from_slice(&self.socket.to_le_bytes());
        out
    }

    /// Decodes the header at the front of `bytes`.
    pub fn decode(bytes: &[u8]) -> Result<Self, ControlError> {
        let Some(raw) = bytes.get(..HEADER_LEN) else {
            return Err(ControlError::TooShort(bytes.len()));
        };
        if raw[0] != MAGIC {
            return Err(ControlError::BadMagic(raw[0]));
        }
        let mut a = [0u8; 8];
        a.copy_from_slice(&raw[8..16]);
        let a = u64::from_le_bytes(a);
        let b = u32::from_le_bytes([raw[16], raw[17], raw[18], raw[19]]);
        let kind = match raw[1] {
            1 => ControlKind::Data,
            2 => ControlKind::Rts { size: a },
            3 => ControlKind::Cts { addr: a, rkey: b },
            4 => ControlKind::Credit,
            5 => ControlKind::Open,
            6 => ControlKind::Close,
            7 => ControlKind::Accept,
            8 => ControlKind::Refuse,
            9 => ControlKind::Slot { addr: a, rkey: b },
            10 => ControlKind::Offer { addr: a, rkey: b },
            other => return Err(ControlError::UnknownKind(other)),
        };
        Ok(Self {
            kind,
            credits: u16::from_le_bytes([raw[2], raw[3]]),
            msg_id: u32::from_le_bytes([raw[4], raw[5], raw[6], raw[7]]),
            socket: u32::from_le_bytes([raw[20], raw[21], raw[22], raw[23]]),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn every_kind_round_trips() {
        for kind in [
            ControlKind::Data,
            ControlKind::Rts { size: 64 << 20 },
            ControlKind::Cts {
                addr: 0x7f00_dead_beef,
                rkey: 0x1234,
            },
            ControlKind::Credit,
            ControlKind::Open,
            ControlKind::Close,
            ControlKind::Accept,
            ControlKind::Refuse,
            ControlKind::Slot {
                addr: 0x7f00_0000_0008,
                rkey: 0x4321,
            },
            ControlKind::Offer {
                addr: 0x7f00_0000_1000,
                rkey: 0x5678,
            },
        ] {
            let header = ControlHeader {
                kind,
                credits: 17,
                msg_id: 99,
                socket: 0x8000_0007,
            };
            assert_eq!(ControlHeader::decode(&header.encode()), Ok(header));
        }
        assert_eq!(
            ControlHeader::decode(&[MAGIC; 3]),
            Err(ControlError::TooShort(3))
        );
    }

    #[test]
    fn an_offer_carries_its_size_after_the_header() {
        let mut bytes = ControlHeader {
            kind: ControlKind::Offer { addr: 64, rkey: 7 },
            credits: 0,
            msg_id: 1 << 31,
            socket: 3,
        }
        .encode()
        .to_vec();
        assert_eq!(decode_offer_size(&bytes), None);
        bytes.extend_from_slice(&(300_000u64).to_le_bytes());
        assert_eq!(decode_offer_size(&bytes), Some(300_000));
        assert_eq!(decode_offer_size(&bytes[..OFFER_LEN - 1]), None);
    }

    proptest! {
        #[test]
        fn garbage_never_panics(data in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = ControlHeader::decode(&data);
            let _ = decode_offer_size(&data);
            let keys = decode_rail_keys(&data, HEADER_LEN);
            prop_assert!(keys.len() <= MAX_RAIL_KEYS);
        }

        #[test]
        fn rail_keys_round_trip_behind_a_header(keys in proptest::collection::vec(any::<u32>(), 0..20)) {
            let mut bytes = vec![0u8; OFFER_LEN];
            bytes.extend(encode_rail_keys(&keys));
            let back = decode_rail_keys(&bytes, OFFER_LEN);
            prop_assert_eq!(&back[..], &keys[..keys.len().min(MAX_RAIL_KEYS)]);
            // A torn key is not read.
            bytes.pop();
            prop_assert_eq!(
                decode_rail_keys(&bytes, OFFER_LEN).len(),
                keys.len().min(MAX_RAIL_KEYS).saturating_sub(1)
            );
        }
    }
}
