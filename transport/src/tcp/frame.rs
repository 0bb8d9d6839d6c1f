//! Length-prefixed framing, as a sans-IO codec.
//!
//! A frame is a 4-byte little-endian length followed by that many bytes of
//! message. The length is checked against the configured maximum *before*
//! any buffer is reserved for the body, so a hostile or corrupt prefix can
//! cost at most one refused connection, never a huge allocation.

use bytes::{Buf, Bytes, BytesMut};

use crate::TransportError;

/// Bytes of the length prefix.
pub const FRAME_HEADER_LEN: usize = 4;

/// Encodes the length prefix of a frame whose body is `len` bytes long.
pub fn encode_frame_header(len: usize, max: u64) -> Result<[u8; FRAME_HEADER_LEN], TransportError> {
    let len64 = len as u64;
    if len64 > max || len64 > u64::from(u32::MAX) {
        return Err(TransportError::MessageTooLarge { len: len64, max });
    }
    // The bound above makes this cast lossless.
    Ok((len as u32).to_le_bytes())
}

/// The body length announced by the prefix at the front of `buf`, or `None`
/// if fewer than [`FRAME_HEADER_LEN`] bytes are there. Fails if the length
/// exceeds `max`: nothing may be allocated for such a frame.
pub fn body_len(buf: &[u8], max: u64) -> Result<Option<usize>, TransportError> {
    let Some(prefix) = buf.get(..FRAME_HEADER_LEN) else {
        return Ok(None);
    };
    let mut len_bytes = [0u8; FRAME_HEADER_LEN];
    len_bytes.copy_from_slice(prefix);
    let len = u64::from(u32::from_le_bytes(len_bytes));
    if len > max {
        return Err(TransportError::MessageTooLarge { len, max });
    }
    // `len <= u32::MAX`, which fits in usize on every supported target.
    Ok(Some(len as usize))
}

/// Splits whole frames off the front of a receive buffer.
#[derive(Debug, Clone)]
pub struct FrameDecoder {
    max: u64,
}

impl FrameDecoder {
    /// A decoder that refuses frames longer than `max` bytes.
    pub fn new(max: u64) -> Self {
        Self { max }
    }

    /// Returns the next whole frame at the front of `buf`, or `None` when more
    /// bytes are needed (after reserving room for the rest of the frame).
    ///
    /// The returned frame shares `buf`'s storage: no copy.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Bytes>, TransportError> {
        let Some(len) = body_len(buf, self.max)? else {
            return Ok(None);
        };
        let total = FRAME_HEADER_LEN + len;
        if buf.len() < total {
            buf.reserve(total - buf.len());
            return Ok(None);
        }
        buf.advance(FRAME_HEADER_LEN);
        Ok(Some(buf.split_to(total - FRAME_HEADER_LEN).freeze()))
    }

    /// The error to report when the stream ends with `buf` still holding part
    /// of a frame, or `None` when it ended on a frame boundary.
    pub fn end_of_stream(&self, buf: &BytesMut) -> Option<TransportError> {
        if buf.is_empty() {
            return None;
        }
        let expected = match buf.get(..FRAME_HEADER_LEN) {
            Some(prefix) => {
                let mut len_bytes = [0u8; FRAME_HEADER_LEN];
                len_bytes.copy_from_slice(prefix);
                u64::from(u32::from_le_bytes(len_bytes))
            }
            None => FRAME_HEADER_LEN as u64,
        };
        Some(TransportError::Truncated {
            expected,
            received: buf.len().saturating_sub(FRAME_HEADER_LEN) as u64,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn encode(frames: &[&[u8]]) -> BytesMut {
        let mut buf = BytesMut::new();
        for frame in frames {
            buf.extend_from_slice(&encode_frame_header(frame.len(), 1 << 20).unwrap());
            buf.extend_from_slice(frame);
        }
        buf
    }

    #[test]
    fn round_trip_of_several_frames_including_an_empty_one() {
        let mut buf = encode(&[b"hello", b"", b"world!"]);
        let mut decoder = FrameDecoder::new(1 << 20);
        assert_eq!(&decoder.decode(&mut buf).unwrap().unwrap()[..], b"hello");
        assert_eq!(&decoder.decode(&mut buf).unwrap().unwrap()[..], b"");
        assert_eq!(&decoder.decode(&mut buf).unwrap().unwrap()[..], b"world!");
        assert!(decoder.decode(&mut buf).unwrap().is_none());
        assert!(decoder.end_of_stream(&buf).is_none());
    }

    #[test]
    fn truncated_frame_waits_then_reports_truncation_at_eof() {
        let full = encode(&[b"0123456789"]);
        let mut buf = BytesMut::from(&full[..7]);
        let mut decoder = FrameDecoder::new(1 << 20);
        assert!(decoder.decode(&mut buf).unwrap().is_none());
        assert!(
            buf.capacity() >= full.len(),
            "room for the whole frame is reserved"
        );
        match decoder.end_of_stream(&buf) {
            Some(TransportError::Truncated { expected, received }) => {
                assert_eq!((expected, received), (10, 3));
            }
            other => panic!("expected truncation, got {other:?}"),
        }
    }

    #[test]
    fn oversized_frame_is_refused_before_allocating() {
        let mut buf = BytesMut::from(&u32::MAX.to_le_bytes()[..]);
        let capacity_before = buf.capacity();
        let mut decoder = FrameDecoder::new(1024);
        match decoder.decode(&mut buf) {
            Err(TransportError::MessageTooLarge { len, max }) => {
                assert_eq!((len, max), (u64::from(u32::MAX), 1024));
            }
            other => panic!("expected MessageTooLarge, got {other:?}"),
        }
        assert_eq!(buf.capacity(), capacity_before, "nothing reserved");
        assert!(encode_frame_header(1025, 1024).is_err());
    }

    #[test]
    fn decoded_frame_shares_the_receive_buffer() {
        let mut buf = encode(&[b"zero-copy payload"]);
        let base = buf.as_ptr() as usize;
        let frame = FrameDecoder::new(1024).decode(&mut buf).unwrap().unwrap();
        assert_eq!(frame.as_ptr() as usize, base + FRAME_HEADER_LEN);
    }

    proptest! {
        #[test]
        fn garbage_never_panics_and_never_yields_more_than_max(
            data in proptest::collection::vec(any::<u8>(), 0..512),
            max in 0u64..256,
        ) {
            let mut buf = BytesMut::from(&data[..]);
            let mut decoder = FrameDecoder::new(max);
            while let Ok(Some(frame)) = decoder.decode(&mut buf) {
                prop_assert!(frame.len() as u64 <= max);
            }
        }

        #[test]
        fn any_split_point_reassembles(
            frames in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 1..8),
            split in any::<prop::sample::Index>(),
        ) {
            let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
            let wire = encode(&refs);
            let cut = split.index(wire.len() + 1);
            let mut decoder = FrameDecoder::new(1 << 20);
            let mut buf = BytesMut::from(&wire[..cut]);
            let mut out = Vec::new();
            while let Some(frame) = decoder.decode(&mut buf).unwrap() {
                out.push(frame.to_vec());
            }
            buf.extend_from_slice(&wire[cut..]);
            while let Some(frame) = decoder.decode(&mut buf).unwrap() {
                out.push(frame.to_vec());
            }
            prop_assert_eq!(out, frames);
        }
    }
}
