//! Items used by the code that `tessera-rpc-build` generates. Not meant to be
//! called by hand, but public (and stable within a release) because the
//! generated code lives in other crates.

pub use bytes::Bytes;
pub use futures::future::BoxFuture;
use tessera_transport::pool::{Pool, PoolError};

use crate::Status;

/// Decodes a request body; a body that does not decode is the caller's
/// fault ([`crate::Code::InvalidArgument`]). `bytes` fields of the result
/// share `body`'s storage.
pub fn decode_request<T: prost::Message + Default>(body: Bytes) -> Result<T, Status> {
    T::decode(body)
        .map_err(|err| Status::invalid_argument(format!("request does not decode: {err}")))
}

/// Encodes a message into a buffer of `pool` (the transport's send pool),
/// so that it goes out from registered memory.
pub fn encode_to_pool<T: prost::Message>(message: &T, pool: &Pool) -> Result<Bytes, PoolError> {
    let len = message.encoded_len();
    let mut buf = pool.alloc(len)?;
    buf.set_len(len);
    let mut out: &mut [u8] = &mut buf;
    // The buffer holds exactly `encoded_len` bytes, which is all `encode`
    // needs; it cannot run out of room.
    if message.encode(&mut out).is_err() {
        return Err(PoolError::TooLarge { len });
    }
    Ok(buf.freeze())
}

/// Encodes a response body into the send pool; a pool that cannot give
/// memory is reported to the caller as `ResourceExhausted`.
pub fn encode_response<T: prost::Message>(response: &T, pool: &Pool) -> Result<Bytes, Status> {
    encode_to_pool(response, pool)
        .map_err(|err| Status::resource_exhausted(format!("cannot encode the response: {err}")))
}

/// The answer to a method id that the service does not have.
pub fn unimplemented(
    service: &'static str,
    method_id: u32,
) -> BoxFuture<'static, Result<Bytes, Status>> {
    Box::pin(std::future::ready(Err(Status::unimplemented(format!(
        "service {service} has no method with id {method_id:#010x}"
    )))))
}
