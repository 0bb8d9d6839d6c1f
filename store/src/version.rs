//! The identity of a copy of a shard: which Pushes it holds.
//!
//! Every Push a shard's primary applies gets the next **position** of the
//! shard's stream (1, 2, ...: positions continue across primaries, so a
//! position counts the Pushes in the copy's history) and is applied under
//! the primary's **epoch**, which is new for every primary: taken from the
//! coordinator (`coordinator.kind = "etcd"`) or, in static mode, one above
//! every epoch the new primary found on its replicas. A copy's [`Version`]
//! is the epoch and position of the last Push it applied.
//!
//! Within one epoch there is one primary, so one history: two copies with
//! the same version hold the same rows. Versions order copies
//! lexicographically, epoch first. A copy of an older epoch is older even
//! when its position is higher: the Pushes beyond the position at which
//! the newer epoch started were applied by a primary that has since been
//! replaced (they are the "lost tail" of an `ack = "primary"` failover)
//! and are not part of the shard's history any more.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Epoch and position of the last Push a copy of a shard applied (module
/// docs). `Version::default()` is an empty copy that never saw a Push.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct Version {
    /// The epoch of the primary that applied the last Push (0: none).
    pub epoch: u64,
    /// Pushes in the copy's history.
    pub position: u64,
}

impl Version {
    /// The version at `epoch` and `position`.
    pub const fn new(epoch: u64, position: u64) -> Self {
        Self { epoch, position }
    }

    /// The version after one more Push applied under `epoch` (positions
    /// saturate: 2^64 Pushes are not reachable, but a peer's claim is not
    /// to be trusted with arithmetic).
    pub const fn next(self, epoch: u64) -> Self {
        Self {
            epoch,
            position: self.position.saturating_add(1),
        }
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.epoch, self.position)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_order_by_epoch_then_position() {
        let old_long = Version::new(3, 900);
        let new_short = Version::new(4, 10);
        assert!(new_short > old_long, "a newer epoch wins");
        assert!(Version::new(4, 11) > new_short);
        assert!(Version::default() < Version::new(0, 1));
        assert_eq!(Version::new(4, 10).next(5), Version::new(5, 11));
        assert_eq!(new_short.to_string(), "4:10");
    }
}
