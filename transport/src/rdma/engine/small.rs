//! Small messages and control messages: one SEND of the control header
//! followed by the message's own buffers, into a receive buffer of the
//! peer that then becomes the received message. Every SEND spends a
//! receive credit and carries the credits this end owes.

#[allow(clippy::wildcard_imports)]
use super::*;

impl Engine {
    /// Queues a SEND of a control header followed by `payload`.
    pub(super) fn push_send(
        &mut self,
        kind: ControlKind,
        msg_id: u32,
        socket: SocketId,
        payload: &[Bytes],
    ) -> Result<(), EngineError> {
        let header = ControlHeader {
            kind,
            credits: self.credits.take_returnable(),
            msg_id,
            socket,
        };
        let header = self
            .send_pool
            .alloc_copy(&header.encode())
            .map_err(EngineError::Memory)?
            .freeze();
        let mut keep = Vec::with_capacity(payload.len() + 1);
        let mut sges = Vec::with_capacity(payload.len() + 1);
        let mut bytes = 0;
        for part in std::iter::once(&header).chain(payload) {
            let sge = Self::sge(part, self.config.rail)
                .ok_or(EngineError::Unregistered("a send buffer"))?;
            bytes += part.len();
            sges.push(sge);
            keep.push(part.clone());
        }
        self.credits.spend();
        self.window.add(bytes);
        self.ring.push(RingEntry {
            wr: SendWr {
                wr_id: 0,
                op: SendOp::Send,
                sges,
                signaled: false,
            },
            keep,
            bytes,
        });
        Ok(())
    }
}
