//! Arbitrary received messages through the RPC header decoder and the
//! parameter-server request decoders.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use prost::Message;
use tessera_proto::v1::{FetchRequest, FetchResponse, PushRequest};
use tessera_rpc::wire::RpcHeader;

fuzz_target!(|data: &[u8]| {
    let message = Bytes::copy_from_slice(data);
    if let Ok((header, body)) = RpcHeader::decode(&message) {
        assert_eq!(header.encode().len() + body.len(), message.len());
        let _ = FetchRequest::decode(body.clone());
        let _ = PushRequest::decode(body.clone());
        let _ = FetchResponse::decode(body);
    }
});
