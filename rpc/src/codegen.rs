//! Items used by the code that `tessera-rpc-build` generates. Not meant to be
//! called by hand, but public (and stable within a release) because the
//! generated code lives in other crates.

pub use bytes::Bytes;
pub use futures::future::BoxFuture;

use crate::Status;

/// Decodes a request body; a body that does not decode is the caller's
/// fault ([`crate::Code::InvalidArgument`]). `bytes` fields of the result
/// share `body`'s storage.
pub fn decode_request<T: prost::Message + Default>(body: Bytes) -> Result<T, Status> {
    T::decode(body)
        .map_err(|err| Status::invalid_argument(format!("request does not decode: {err}")))
}

/// Encodes a response body.
pub fn encode_response<T: prost::Message>(response: &T) -> Bytes {
    Bytes::from(response.encode_to_vec())
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
