//! Items used by the code that `tessera-rpc-build` generates. Not meant to be
//! called by hand, but public (and stable within a release) because the
//! generated code lives in other crates.

pub use bytes::Bytes;
pub use futures::future::BoxFuture;
use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint, key_len};
pub use tessera_transport::Message;
use tessera_transport::pool::{Pool, PoolError};

use crate::{RpcError, Status};

/// `bytes` fields shorter than this are copied into the encoded message;
/// longer ones travel as parts of their own. 1 KiB: below it, an extra
/// `iovec` (or scatter/gather entry) costs more than copying.
pub const INLINE_BYTES_LIMIT: usize = 1024;

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

/// Encodes `head` (a message whose large `bytes` fields were taken out)
/// followed by those fields, `(tag, value)`, as transport message parts: the
/// encoding of `head`, small fields and the key and length of each large
/// field go into one send-pool buffer; each large field's own buffer follows
/// its key and length without being copied. Empty fields are left out, as
/// proto3 leaves them out.
pub fn encode_parts<T: prost::Message>(
    head: &T,
    fields: Vec<(u32, Bytes)>,
    pool: &Pool,
) -> Result<Message, PoolError> {
    let framing = |tag: u32, len: usize| key_len(tag) + encoded_len_varint(len as u64);
    let len: usize = head.encoded_len()
        + fields
            .iter()
            .filter(|(_, value)| !value.is_empty())
            .map(|(tag, value)| {
                framing(*tag, value.len())
                    + if value.len() < INLINE_BYTES_LIMIT {
                        value.len()
                    } else {
                        0
                    }
            })
            .sum::<usize>();
    let mut buf = pool.alloc(len)?;
    buf.set_len(len);
    // (end of the buffer's section, large field that follows it)
    let mut sections: Vec<(usize, Bytes)> = Vec::new();
    {
        let mut out: &mut [u8] = &mut buf;
        if head.encode(&mut out).is_err() {
            return Err(PoolError::TooLarge { len });
        }
        // Small fields first, so that they share the head's section.
        for (tag, value) in fields
            .iter()
            .filter(|(_, v)| !v.is_empty() && v.len() < INLINE_BYTES_LIMIT)
        {
            encode_key(*tag, WireType::LengthDelimited, &mut out);
            encode_varint(value.len() as u64, &mut out);
            bytes::BufMut::put_slice(&mut out, value);
        }
        for (tag, value) in fields.iter().filter(|(_, v)| v.len() >= INLINE_BYTES_LIMIT) {
            encode_key(*tag, WireType::LengthDelimited, &mut out);
            encode_varint(value.len() as u64, &mut out);
            sections.push((len - out.len(), value.clone()));
        }
    }
    let encoded = buf.freeze();
    let mut message = Message::new();
    let mut start = 0;
    for (end, value) in sections {
        message.push(encoded.slice(start..end));
        message.push(value);
        start = end;
    }
    message.push(encoded.slice(start..));
    Ok(message)
}

/// The status for a response that could not be encoded (no send-pool
/// memory).
pub fn response_encode_error(err: PoolError) -> Status {
    Status::resource_exhausted(format!("cannot encode the response: {err}"))
}

/// The error for a request that could not be encoded (no send-pool memory).
pub fn request_encode_error(err: PoolError) -> RpcError {
    RpcError::Memory(err)
}

/// The answer to a method id that the service does not have.
pub fn unimplemented(
    service: &'static str,
    method_id: u32,
) -> BoxFuture<'static, Result<Message, Status>> {
    Box::pin(std::future::ready(Err(Status::unimplemented(format!(
        "service {service} has no method with id {method_id:#010x}"
    )))))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use prost::Message as _;
    use tessera_transport::pool::{Access, CountingHook, Pool, PoolConfig};

    use super::*;

    #[derive(Clone, PartialEq, prost::Message)]
    struct Sample {
        #[prost(uint32, tag = "1")]
        dim: u32,
        #[prost(bytes = "bytes", tag = "2")]
        values: Bytes,
        #[prost(string, tag = "3")]
        name: String,
        #[prost(bytes = "bytes", tag = "4")]
        small: Bytes,
    }

    fn pool() -> Pool {
        Pool::new(
            PoolConfig::named("codegen-test"),
            Access::LocalOnly,
            Arc::new(CountingHook::new()),
        )
        .unwrap()
    }

    fn split(message: &Sample, pool: &Pool) -> Message {
        let mut head = message.clone();
        let fields = vec![
            (2, std::mem::take(&mut head.values)),
            (4, std::mem::take(&mut head.small)),
        ];
        encode_parts(&head, fields, pool).unwrap()
    }

    #[test]
    fn large_fields_travel_as_their_own_part_and_decode_to_the_same_message() {
        let pool = pool();
        let message = Sample {
            dim: 7,
            values: Bytes::from(vec![5u8; 100_000]),
            name: "rows".into(),
            small: Bytes::from_static(b"tiny"),
        };
        let parts = split(&message, &pool);
        assert_eq!(
            parts.parts().len(),
            2,
            "head (with the small field) and the large field"
        );
        assert_eq!(
            parts.parts()[1].as_ptr(),
            message.values.as_ptr(),
            "the large field is sent from its own buffer, not copied"
        );
        let decoded = Sample::decode(parts.to_contiguous()).unwrap();
        assert_eq!(decoded, message);
        assert_eq!(parts.len(), message.encoded_len());
    }

    #[test]
    fn empty_and_small_fields_are_encoded_inline() {
        let pool = pool();
        for message in [
            Sample::default(),
            Sample {
                dim: 1,
                values: Bytes::from_static(b"short"),
                name: String::new(),
                small: Bytes::new(),
            },
        ] {
            let parts = split(&message, &pool);
            assert!(parts.parts().len() <= 1);
            assert_eq!(Sample::decode(parts.to_contiguous()).unwrap(), message);
        }
    }
}
