//! Ordered delivery: messages and closes are handed on per socket in the
//! order sent; one whose memory window is being invalidated is held until
//! the invalidation completes, and what came after it waits behind it.

#[allow(clippy::wildcard_imports)]
use super::*;

impl Engine {
    pub(super) fn deliver(&mut self, socket: SocketId, bytes: Bytes) {
        self.deliver_after(socket, bytes, None);
    }

    /// Hands a message on, after the work request `after` (a window's
    /// invalidation) has completed where given, and in any case after
    /// everything held before it.
    pub(super) fn deliver_after(&mut self, socket: SocketId, bytes: Bytes, after: Option<u64>) {
        if !self.open.contains(&socket) {
            self.stats.orphan_messages += 1;
            return;
        }
        self.stats.received += 1;
        self.stats.bytes_received += bytes.len() as u64;
        self.emit_ordered(EngineEvent::Message { socket, bytes }, after);
    }

    /// An event of a socket's stream (a message, its close), behind any
    /// held one.
    pub(super) fn emit_ordered(&mut self, event: EngineEvent, after: Option<u64>) {
        if after.is_none() && self.held.is_empty() {
            self.events.push_back(event);
        } else {
            self.held.push_back((after, event));
        }
    }

    /// After the engine failed, once its QP is in error (no write can land
    /// any more): the messages and closes held for invalidations that will
    /// never complete, in order, to hand on before the failure.
    pub fn take_held(&mut self) -> Vec<EngineEvent> {
        if !self.failed {
            return Vec::new();
        }
        self.held.drain(..).map(|(_, event)| event).collect()
    }

    /// Send work requests up to `wr_id` have completed: held events whose
    /// invalidation was among them go out, in order.
    pub(super) fn release_held(&mut self, wr_id: u64) {
        while let Some((after, _)) = self.held.front() {
            if after.is_some_and(|id| id > wr_id) {
                break;
            }
            if let Some((_, event)) = self.held.pop_front() {
                self.events.push_back(event);
            }
        }
    }

    /// Events held for invalidations.
    #[cfg(test)]
    pub(crate) fn held_len(&self) -> usize {
        self.held.len()
    }
}
