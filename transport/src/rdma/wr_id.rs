//! What a work request id says.
//!
//! An I/O thread's completion queue carries the completions of its engines'
//! sends (ids: positions in the send ring), of their own receives (ids:
//! receive slots) and of the thread's shared receive queue (ids: its
//! slots). A successful completion's opcode would tell them apart, but an
//! error completion carries only the id, the status, the QP number and the
//! vendor's error code: its opcode (and length) are undefined (the
//! `ibv_poll_cq` man page). So receives carry a tag in the id's top bits,
//! and every completion is classified by its id alone. Before, a failed
//! shared receive was taken for a send, and its slot never went back to
//! the queue.

/// Tag of an engine's own receive.
const RECV: u64 = 1 << 63;
/// Tag of a receive of the I/O thread's shared receive queue.
const SHARED_RECV: u64 = 1 << 62;
const TAGS: u64 = RECV | SHARED_RECV;

/// What a completion's work request was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WrKind {
    /// A send-queue work request (its id untagged).
    Send(u64),
    /// A receive of the engine's own queue: its slot.
    Recv(usize),
    /// A receive of the shared queue: its slot.
    SharedRecv(usize),
}

/// The id of the engine's receive in `slot`.
pub(crate) fn recv(slot: usize) -> u64 {
    RECV | (slot as u64 & !TAGS)
}

/// The id of the shared queue's receive in `slot`.
pub(crate) fn shared_recv(slot: usize) -> u64 {
    SHARED_RECV | (slot as u64 & !TAGS)
}

/// What `wr_id` names (never fails: an id with both tags is no receive of
/// ours, and is taken for a send, which its engine does not know).
pub(crate) fn classify(wr_id: u64) -> WrKind {
    let index = usize::try_from(wr_id & !TAGS).unwrap_or(usize::MAX);
    match wr_id & TAGS {
        RECV => WrKind::Recv(index),
        SHARED_RECV => WrKind::SharedRecv(index),
        _ => WrKind::Send(wr_id),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn ids_round_trip_and_never_collide(slot in 0usize..(1 << 40), position in 0u64..(1 << 62)) {
            prop_assert_eq!(classify(recv(slot)), WrKind::Recv(slot));
            prop_assert_eq!(classify(shared_recv(slot)), WrKind::SharedRecv(slot));
            prop_assert_eq!(classify(position), WrKind::Send(position));
        }

        #[test]
        fn any_id_classifies(id in any::<u64>()) {
            let _ = classify(id);
        }
    }
}
