//! Arbitrary bytes, delivered in arbitrary chunks, into the TCP frame
//! decoder: it must never panic, never yield a frame over the limit, and
//! never reserve more than the limit allows.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use tessera_transport::tcp::{FRAME_HEADER_LEN, FrameDecoder};

fuzz_target!(|data: &[u8]| {
    let Some((&chunk, rest)) = data.split_first() else {
        return;
    };
    let chunk = usize::from(chunk).max(1);
    let max = 4096u64;
    let mut decoder = FrameDecoder::new(max);
    let mut buf = BytesMut::new();
    for piece in rest.chunks(chunk) {
        buf.extend_from_slice(piece);
        loop {
            match decoder.decode(&mut buf) {
                Ok(Some(frame)) => assert!(frame.len() as u64 <= max),
                Ok(None) => break,
                Err(_) => return,
            }
        }
        assert!(buf.capacity() <= rest.len() + FRAME_HEADER_LEN + max as usize + 64);
    }
    let _ = decoder.end_of_stream(&buf);
});
