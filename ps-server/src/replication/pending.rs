//! Pushes forwarded to a replica while it copies the shard, held to apply
//! after the copy.
//!
//! A primary attaches a replica at the copy's version and forwards every
//! later Push at once. While the copy downloads, the replica holds those
//! Pushes here, in stream order, tagged with the attachment their stream
//! head carried, and answers them as processed: the primary's queue for
//! the replica drains (so a long copy is not cut off for lagging), and the
//! shard's Pushes no longer hold back the other shards' in the same
//! stream. When the copy is installed, the Pushes of its attachment after
//! its version are applied in order; a gap means the replica attaches
//! again.
//!
//! Memory is bounded by `copy_buffer_bytes` of held gradients per shard;
//! beyond, the held Pushes are dropped and the replica, once the copy is
//! in, copies the shard again (as a lagging replica would have been cut
//! off).

use std::collections::VecDeque;

use tessera_proto::v1::ReplicatedPush;

/// One held Push: its attachment and epoch (from its stream head).
#[derive(Debug)]
pub(crate) struct Held {
    pub attachment: u64,
    pub epoch: u64,
    pub entry: ReplicatedPush,
}

/// The Pushes held for one shard (module docs), all of one stream: one
/// (epoch, attachment).
#[derive(Debug, Default)]
pub(crate) struct Pending {
    held: VecDeque<Held>,
    /// The (epoch, attachment) of what is held.
    stream: Option<(u64, u64)>,
    bytes: usize,
    /// Pushes of `stream` were dropped for the bound: the copy alone is
    /// not in step.
    overflowed: bool,
}

fn size(entry: &ReplicatedPush) -> usize {
    entry
        .push
        .as_ref()
        .map_or(0, |p| p.gradients.len() + p.keys.len() * 8)
        + entry.evicted_keys.len() * 12
        + entry.not_admitted.len() * 4
        + entry.expired.as_ref().map_or(0, |e| e.keys.len() * 8)
        + 64
}

impl Pending {
    /// Holds `entry`; false when that overflowed `limit` bytes (the held
    /// Pushes are dropped, and the shard must copy again after this copy).
    pub fn hold(&mut self, held: Held, limit: usize) -> bool {
        let stream = (held.epoch, held.attachment);
        if self.stream != Some(stream) {
            // Another stream (a new attachment, a new primary): what was
            // held for the old one will never apply.
            self.clear();
            self.stream = Some(stream);
        }
        if self.overflowed {
            return false;
        }
        let bytes = size(&held.entry);
        if self.bytes + bytes > limit {
            metrics::counter!("tessera_ps_replication_copy_buffer_overflows_total").increment(1);
            self.held.clear();
            self.bytes = 0;
            self.overflowed = true;
            return false;
        }
        self.bytes += bytes;
        self.held.push_back(held);
        true
    }

    /// The held Pushes of the stream (`epoch`, `attachment`), in order,
    /// and whether any of them were dropped; nothing is held afterwards.
    pub fn take(&mut self, epoch: u64, attachment: u64) -> (Vec<Held>, bool) {
        let ours = self.stream == Some((epoch, attachment));
        let overflowed = ours && self.overflowed;
        let held = if ours {
            std::mem::take(&mut self.held).into()
        } else {
            Vec::new()
        };
        self.clear();
        (held, overflowed)
    }

    /// Drops everything held, and forgets the stream.
    pub fn clear(&mut self) {
        self.held.clear();
        self.stream = None;
        self.bytes = 0;
        self.overflowed = false;
    }

    /// Bytes held now.
    #[cfg(test)]
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_proto::v1::PushRequest;

    fn held(attachment: u64, position: u64) -> Held {
        Held {
            attachment,
            epoch: 1,
            entry: ReplicatedPush {
                shard: 0,
                position,
                push: Some(PushRequest {
                    gradients: vec![0u8; 100].into(),
                    ..PushRequest::default()
                }),
                ..ReplicatedPush::default()
            },
        }
    }

    #[test]
    fn held_pushes_come_back_in_order_for_their_stream_only() {
        let mut pending = Pending::default();
        for (attachment, position) in [(1, 5), (2, 6), (2, 7)] {
            assert!(pending.hold(held(attachment, position), 1 << 20));
        }
        assert!(
            pending.take(1, 1).0.is_empty(),
            "a new stream dropped the old"
        );
        for position in [6, 7] {
            assert!(pending.hold(held(2, position), 1 << 20));
        }
        assert!(pending.take(2, 2).0.is_empty(), "another epoch");
        for position in [6, 7] {
            assert!(pending.hold(held(2, position), 1 << 20));
        }
        let (two, overflowed) = pending.take(1, 2);
        assert!(!overflowed);
        assert_eq!(
            two.iter().map(|h| h.entry.position).collect::<Vec<_>>(),
            vec![6, 7]
        );
        assert_eq!(pending.bytes(), 0);
        assert!(pending.take(1, 2).0.is_empty(), "nothing held after a take");
    }

    #[test]
    fn the_bound_drops_everything_and_says_so_once() {
        let mut pending = Pending::default();
        assert!(pending.hold(held(1, 1), 400));
        assert!(pending.hold(held(1, 2), 400));
        assert!(!pending.hold(held(1, 3), 400), "over 400 bytes");
        assert!(!pending.hold(held(1, 4), 400), "dropping until taken");
        let (held, overflowed) = pending.take(1, 1);
        assert!(held.is_empty() && overflowed);
        assert!(!pending.take(1, 1).1, "reported once");
        // A new stream starts clean.
        assert!(pending.hold(held_at(1, 2, 1), 400));
        assert!(!pending.take(1, 2).1);
    }

    fn held_at(epoch: u64, attachment: u64, position: u64) -> Held {
        Held {
            epoch,
            ..held(attachment, position)
        }
    }
}
