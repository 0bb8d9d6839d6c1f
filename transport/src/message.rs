//! A whole message as the transport moves it: a list of byte chunks
//! ([`Message`]) sent as one frame without copying them together first.

use bytes::Bytes;

/// One whole message, as a list of byte chunks sent back to back.
///
/// A message is built from parts so that a header and a large payload can be
/// sent without first copying them into one buffer: the TCP transport hands
/// the parts to `writev`, the RDMA transport to a scatter/gather list.
#[derive(Debug, Clone, Default)]
pub struct Message {
    parts: Vec<Bytes>,
    len: usize,
}

impl Message {
    /// An empty message.
    pub fn new() -> Self {
        Self::default()
    }

    /// A message made of `parts`, in order.
    pub fn from_parts(parts: impl IntoIterator<Item = Bytes>) -> Self {
        let mut message = Self::new();
        for part in parts {
            message.push(part);
        }
        message
    }

    /// Appends a part. Empty parts are dropped.
    pub fn push(&mut self, part: Bytes) {
        if !part.is_empty() {
            self.len += part.len();
            self.parts.push(part);
        }
    }

    /// Total length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the message has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The parts, in order.
    pub fn parts(&self) -> &[Bytes] {
        &self.parts
    }

    /// Copies the message into one contiguous buffer. Only for tests and
    /// diagnostics: the data path never flattens a message.
    pub fn to_contiguous(&self) -> Bytes {
        match self.parts.as_slice() {
            [] => Bytes::new(),
            [one] => one.clone(),
            parts => {
                let mut buf = Vec::with_capacity(self.len);
                for part in parts {
                    buf.extend_from_slice(part);
                }
                Bytes::from(buf)
            }
        }
    }
}

impl From<Bytes> for Message {
    fn from(part: Bytes) -> Self {
        Self::from_parts([part])
    }
}

impl From<Vec<u8>> for Message {
    fn from(part: Vec<u8>) -> Self {
        Self::from(Bytes::from(part))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn length_counts_all_parts_and_skips_empty_ones() {
        let message = Message::from_parts([
            Bytes::from_static(b"ab"),
            Bytes::new(),
            Bytes::from_static(b"cde"),
        ]);
        assert_eq!(message.len(), 5);
        assert_eq!(message.parts().len(), 2);
        assert_eq!(&message.to_contiguous()[..], b"abcde");
    }
}
