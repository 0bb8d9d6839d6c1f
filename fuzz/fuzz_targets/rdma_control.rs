//! Arbitrary bytes as the RDMA engine's control header (the start of every
//! SEND a peer makes) and as the connection handshake.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera_transport::rdma::connection::{HELLO_LEN, Hello};
use tessera_transport::rdma::control::ControlHeader;

fuzz_target!(|data: &[u8]| {
    if let Ok(header) = ControlHeader::decode(data) {
        assert_eq!(ControlHeader::decode(&header.encode()), Ok(header));
    }
    if let Some(raw) = data.get(..HELLO_LEN) {
        let mut hello = [0u8; HELLO_LEN];
        hello.copy_from_slice(raw);
        let _ = Hello::decode(&hello);
    }
});
