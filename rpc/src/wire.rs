//! Tessera's RPC wire format, as a sans-IO codec.
//!
//! Every RPC message is one transport message: a fixed 24-byte header
//! followed by the body. For a request, and for a response whose status is
//! `Ok`, the body is the protobuf-encoded message; for an error response it
//! is the status message in UTF-8 or, with the [`FLAG_STATUS_DETAILS`]
//! flag, the message's length (u32 LE), the message, and the status
//! details (see [`encode_status_body`]).
//!
//! ```text
//!  0      1        2     3      4         6          8          12             16           24
//!  magic  version  kind  flags  status    service    method id  deadline (µs)  request id
//!  u8     u8       u8    u8     u16 LE    u16 LE     u32 LE     u32 LE         u64 LE
//! ```
//!
//! The service tag ([`crate::service_tag`]) names the service the caller
//! meant, so that a method id colliding with another service's (ids are
//! 32-bit hashes) is refused instead of misrouted; 0 (what builds before
//! it sent in this reserved field, and raw calls) skips the check. A
//! response echoes the request's method id and tag.
//!
//! The deadline is the *remaining* time in microseconds when the request was
//! sent (0 = none), so clocks need not be synchronised; it saturates at
//! about 71 minutes.

use std::time::Duration;

use bytes::Bytes;

/// First byte of every header.
pub const MAGIC: u8 = 0x54;
/// The wire format version this build speaks.
pub const VERSION: u8 = 1;
/// Bytes of the fixed header.
pub const HEADER_LEN: usize = 24;

/// Flag of an error response whose body carries status details.
pub const FLAG_STATUS_DETAILS: u8 = 0x01;

/// Flag of a response from a server that is shutting down (like HTTP/2's
/// GOAWAY): the client sends no new requests on this connection (it dials
/// again, and finds the server gone or back), while the calls outstanding
/// on it are still answered there.
pub const FLAG_GOING_AWAY: u8 = 0x02;

/// Flag of a stopping server's last message on a connection (a response
/// with request id 0, status `Ok` and no body, [`RpcHeader::drained`]),
/// sent once every request it read there has been answered and it reads
/// no more: a request the client is still waiting on was never read, so
/// it did no work and may go elsewhere whatever its method (HTTP/2's
/// GOAWAY says the same with a last stream id). Without it a client
/// cannot tell a drained connection's end from a crashed server's, whose
/// unanswered requests may have been applied. Builds before it ignore the
/// flag and count the message as a late answer.
pub const FLAG_DRAINED: u8 = 0x04;

/// The body of an error response with `message` and `details`, and the
/// header flags that go with it.
pub fn encode_status_body(message: &str, details: &[u8]) -> (u8, Bytes) {
    if details.is_empty() {
        return (0, Bytes::copy_from_slice(message.as_bytes()));
    }
    let mut body = Vec::with_capacity(4 + message.len() + details.len());
    body.extend_from_slice(&(message.len() as u32).to_le_bytes());
    body.extend_from_slice(message.as_bytes());
    body.extend_from_slice(details);
    (FLAG_STATUS_DETAILS, Bytes::from(body))
}

/// The message and details of an error response's body (the inverse of
/// [`encode_status_body`]). Never fails: a body that does not parse is
/// taken as the message, lossily, with no details.
pub fn decode_status_body(flags: u8, body: &Bytes) -> (String, Bytes) {
    if flags & FLAG_STATUS_DETAILS != 0
        && let Some(len) = body.get(..4)
        && let Some(end) = (u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize)
            .checked_add(4)
            .filter(|&end| end <= body.len())
    {
        let message = String::from_utf8_lossy(&body[4..end]).into_owned();
        return (message, body.slice(end..));
    }
    (String::from_utf8_lossy(body).into_owned(), Bytes::new())
}

/// Whether a message is a request or a response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A call from a client.
    Request = 0,
    /// The answer to a request with the same request id.
    Response = 1,
}

/// The fixed header in front of every RPC message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RpcHeader {
    /// Request or response.
    pub kind: Kind,
    /// [`FLAG_STATUS_DETAILS`] on an error response with details;
    /// otherwise 0. Unknown flags are ignored on receipt.
    pub flags: u8,
    /// Status code of a response ([`crate::Code`] as u16); 0 in requests.
    pub status: u16,
    /// Tag of the service the method belongs to ([`crate::service_tag`]);
    /// 0 = not said (the server does not check it).
    pub service: u16,
    /// Id of the method called ([`crate::method_id`]).
    pub method: u32,
    /// Remaining deadline in microseconds when sent; 0 = no deadline.
    pub deadline_micros: u32,
    /// Caller-chosen id that the response echoes.
    pub request_id: u64,
}

/// A header that could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The message is shorter than the fixed header.
    #[error("message of {0} bytes is shorter than the {HEADER_LEN}-byte RPC header")]
    TooShort(usize),
    /// The first byte is not [`MAGIC`].
    #[error("bad magic byte {0:#04x}")]
    BadMagic(u8),
    /// The version is not one this build speaks.
    #[error("unsupported wire version {0}")]
    UnsupportedVersion(u8),
    /// The kind byte is neither request nor response.
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
}

impl RpcHeader {
    /// A request header for `method` of the service tagged `service` (0:
    /// not said).
    pub fn request(method: u32, service: u16, request_id: u64, deadline: Option<Duration>) -> Self {
        Self {
            kind: Kind::Request,
            flags: 0,
            status: 0,
            service,
            method,
            deadline_micros: deadline.map_or(0, encode_deadline),
            request_id,
        }
    }

    /// A response header answering `request`.
    pub fn response(request: &RpcHeader, status: u16) -> Self {
        Self {
            kind: Kind::Response,
            flags: 0,
            status,
            service: request.service,
            method: request.method,
            deadline_micros: 0,
            request_id: request.request_id,
        }
    }

    /// A stopping server's last message on a connection
    /// ([`FLAG_DRAINED`], with [`FLAG_GOING_AWAY`]).
    pub fn drained() -> Self {
        Self {
            kind: Kind::Response,
            flags: FLAG_GOING_AWAY | FLAG_DRAINED,
            status: 0,
            service: 0,
            method: 0,
            deadline_micros: 0,
            request_id: 0,
        }
    }

    /// Whether this is a stopping server's last message on a connection
    /// ([`FLAG_DRAINED`]).
    pub fn is_drained(&self) -> bool {
        self.kind == Kind::Response && self.flags & FLAG_DRAINED != 0
    }

    /// The remaining deadline carried by this header, if any.
    pub fn deadline(&self) -> Option<Duration> {
        (self.deadline_micros != 0).then(|| Duration::from_micros(u64::from(self.deadline_micros)))
    }

    /// Encodes the header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0] = MAGIC;
        out[1] = VERSION;
        out[2] = self.kind as u8;
        out[3] = self.flags;
        out[4..6].copy_from_slice(&self.status.to_le_bytes());
        out[6..8].copy_from_slice(&self.service.to_le_bytes());
        out[8..12].copy_from_slice(&self.method.to_le_bytes());
        out[12..16].copy_from_slice(&self.deadline_micros.to_le_bytes());
        out[16..24].copy_from_slice(&self.request_id.to_le_bytes());
        out
    }

    /// Splits a received message into its header and body. The body shares
    /// the message's storage.
    pub fn decode(message: &Bytes) -> Result<(RpcHeader, Bytes), WireError> {
        let Some(raw) = message.get(..HEADER_LEN) else {
            return Err(WireError::TooShort(message.len()));
        };
        if raw[0] != MAGIC {
            return Err(WireError::BadMagic(raw[0]));
        }
        if raw[1] != VERSION {
            return Err(WireError::UnsupportedVersion(raw[1]));
        }
        let kind = match raw[2] {
            0 => Kind::Request,
            1 => Kind::Response,
            other => return Err(WireError::UnknownKind(other)),
        };
        let header = RpcHeader {
            kind,
            flags: raw[3],
            status: u16::from_le_bytes([raw[4], raw[5]]),
            service: u16::from_le_bytes([raw[6], raw[7]]),
            method: u32::from_le_bytes([raw[8], raw[9], raw[10], raw[11]]),
            deadline_micros: u32::from_le_bytes([raw[12], raw[13], raw[14], raw[15]]),
            request_id: u64::from_le_bytes([
                raw[16], raw[17], raw[18], raw[19], raw[20], raw[21], raw[22], raw[23],
            ]),
        };
        Ok((header, message.slice(HEADER_LEN..)))
    }
}

/// Remaining time as wire microseconds: at least 1 (0 means "none"), at most
/// `u32::MAX`.
fn encode_deadline(remaining: Duration) -> u32 {
    u32::try_from(remaining.as_micros())
        .unwrap_or(u32::MAX)
        .max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn request_round_trip_with_body() {
        let header = RpcHeader::request(0xdead_beef, 0x1234, 42, Some(Duration::from_millis(40)));
        let mut wire = header.encode().to_vec();
        wire.extend_from_slice(b"body");
        let (decoded, body) = RpcHeader::decode(&Bytes::from(wire)).unwrap();
        assert_eq!(decoded, header);
        assert_eq!(decoded.deadline(), Some(Duration::from_millis(40)));
        assert_eq!(&body[..], b"body");
    }

    #[test]
    fn response_echoes_method_service_and_request_id() {
        let request = RpcHeader::request(7, 3, 99, None);
        let response = RpcHeader::response(&request, 5);
        assert_eq!(
            (
                response.kind,
                response.method,
                response.service,
                response.request_id,
                response.status
            ),
            (Kind::Response, 7, 3, 99, 5)
        );
        assert_eq!(request.deadline(), None);
    }

    #[test]
    fn the_drained_notice_round_trips_and_no_answer_is_one() {
        let (decoded, body) =
            RpcHeader::decode(&Bytes::copy_from_slice(&RpcHeader::drained().encode())).unwrap();
        assert!(decoded.is_drained());
        assert!(decoded.flags & FLAG_GOING_AWAY != 0);
        assert_eq!((decoded.request_id, body.len()), (0, 0));
        let request = RpcHeader::request(7, 3, 99, None);
        let mut answer = RpcHeader::response(&request, 0);
        answer.flags = FLAG_GOING_AWAY | FLAG_STATUS_DETAILS;
        assert!(!answer.is_drained());
        let mut asking = request;
        asking.flags = FLAG_DRAINED;
        assert!(!asking.is_drained(), "only a response says it");
    }

    proptest! {
        #[test]
        fn status_bodies_round_trip_and_any_body_decodes(
            message in ".{0,40}",
            details in proptest::collection::vec(any::<u8>(), 0..40),
            garbage in proptest::collection::vec(any::<u8>(), 0..40),
            flags in any::<u8>(),
        ) {
            let (f, body) = encode_status_body(&message, &details);
            prop_assert_eq!(f == FLAG_STATUS_DETAILS, !details.is_empty());
            let (m, d) = decode_status_body(f, &body);
            prop_assert_eq!(m, message);
            prop_assert_eq!(&d[..], &details[..]);
            // Whatever a peer sends decodes to something, never panics.
            let _ = decode_status_body(flags, &Bytes::from(garbage));
        }
    }

    #[test]
    fn deadlines_saturate_and_never_encode_as_none() {
        assert_eq!(encode_deadline(Duration::from_nanos(1)), 1);
        assert_eq!(encode_deadline(Duration::from_secs(1 << 40)), u32::MAX);
    }

    #[test]
    fn malformed_headers_are_rejected() {
        assert_eq!(
            RpcHeader::decode(&Bytes::from_static(b"short")),
            Err(WireError::TooShort(5))
        );
        let mut wire = RpcHeader::request(1, 1, 1, None).encode();
        wire[0] = 0;
        assert_eq!(
            RpcHeader::decode(&Bytes::copy_from_slice(&wire)),
            Err(WireError::BadMagic(0))
        );
        let mut wire = RpcHeader::request(1, 1, 1, None).encode();
        wire[1] = 9;
        assert_eq!(
            RpcHeader::decode(&Bytes::copy_from_slice(&wire)),
            Err(WireError::UnsupportedVersion(9))
        );
        let mut wire = RpcHeader::request(1, 1, 1, None).encode();
        wire[2] = 7;
        assert_eq!(
            RpcHeader::decode(&Bytes::copy_from_slice(&wire)),
            Err(WireError::UnknownKind(7))
        );
    }

    proptest! {
        #[test]
        fn any_bytes_decode_without_panicking(data in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = RpcHeader::decode(&Bytes::from(data));
        }

        #[test]
        fn any_header_round_trips(
            response in any::<bool>(), flags in any::<u8>(), status in any::<u16>(),
            service in any::<u16>(), method in any::<u32>(), deadline_micros in any::<u32>(),
            request_id in any::<u64>(),
        ) {
            let header = RpcHeader {
                kind: if response { Kind::Response } else { Kind::Request },
                flags, status, service, method, deadline_micros, request_id,
            };
            let (decoded, body) = RpcHeader::decode(&Bytes::copy_from_slice(&header.encode())).unwrap();
            prop_assert_eq!(decoded, header);
            prop_assert!(body.is_empty());
        }
    }
}
