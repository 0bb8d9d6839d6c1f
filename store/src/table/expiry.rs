//! Expiry (issue 37): rows not pushed (or not used) within a bound are
//! removed, so that ids which went cold stop taking memory.
//!
//! **Stamps.** A table with expiry keeps a 32-bit *stamp* in each row
//! (`rows/layout.rs`): when it was last pushed, in the table's clock,
//! either the primary's wall clock in seconds (`after_secs`) or a count
//! of the table's Pushes to the shard (`after_pushes_to_shard`: every
//! Push applied counts, whatever admission made of its ids; duplicates
//! and sweep steps do not). The primary stamps a Push, and the stamp
//! travels with it in the stream (`ReplicatedPush.stamp`), so replicas
//! stamp rows exactly as the primary did and their Push counts follow
//! the primary's. A copy's rows carry their stamps, and its receiver's
//! count starts from the latest of them. With `refresh = "access"` a Fetch that finds a row
//! also marks it (beside the records, under the read lock); a sweep
//! folds the mark into the row's stamp. Fetch marks are each copy's own:
//! the primary decides from the Fetches it served.
//!
//! **Ages** are differences of 32-bit stamps, wrapping: a row is expired
//! when `now - stamp` (mod 2^32) exceeds the bound. Bounds are at most
//! 2^31 - 1, and the sweep visits every row far more often than every
//! 2^31 units, so a difference never wraps past a live row's age.
//!
//! **The sweep** (`crate::sweeper` runs it on each shard's primary, and
//! only there) walks the shard's rows a few thousand record slots at a
//! time ([`SWEEP_STEP_SLOTS`]), holding one stripe's write lock at a
//! time and the shard's write lock (ordering it with Pushes) for one
//! step, and removes the expired rows it finds. The keys a step removed
//! go into the replication stream as an entry of their own, and replicas
//! remove exactly those: no copy ever decides an expiry by its own clock,
//! so every copy holds the same rows. A row is thus removed between
//! `bound` and `bound` plus one pass over the shard's record slots after
//! its last Push (a pass takes `slots / sweep_rows_per_sec` seconds;
//! slots are rows plus the free records a shrunken slab keeps).
//!
//! **Checkpoints and copies** hold the primary's rows as they are, with
//! their stamps, expired rows not yet swept included. A server that left
//! them out (a replica installing a copy, a server loading its own
//! checkpoint) would differ from a copy at the same version that kept
//! them, for good if no copy follows, and a Push to such a row would give
//! the two different values. The sweep's next pass removes them on every
//! copy at once. Rows without a stamp (an older row file, a copy from a
//! server without expiry) are stamped at install: with the checkpoint's
//! save time, or the time a copy arrives.
//!
//! A server that does not sweep a shard (a replica) still moves a
//! wall-clock table's clock on ([`crate::store::Store::advance_clock`]),
//! so its own Fetch marks carry their time should it lead later.
//!
//! Written here rather than taken from a crate: the expiry decision is
//! part of the replicated state machine (positions and stamps of the
//! primary's stream), which no TTL cache crate models.

use serde::{Deserialize, Serialize};

pub use crate::rows::stamp::{Bound, SweepCursor, expired, later};

/// Record slots one sweep step visits at most: one slab chunk's worth,
/// so that a step holds a stripe's lock for tens of microseconds.
pub const SWEEP_STEP_SLOTS: usize = 4096;

/// Largest bound: ages are 32-bit differences (module docs).
pub const MAX_BOUND: u64 = (1 << 31) - 1;

/// What refreshes a row's stamp.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Refresh {
    /// Pushes only: a row that is only read expires (a serving-only id
    /// carries no training signal).
    #[default]
    Push,
    /// Pushes, and Fetches that find the row (on the copy that served
    /// them: module docs).
    Access,
}

/// How a table expires rows (`expiry = { after_secs = ... }` or
/// `{ after_pushes_to_shard = ... }`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExpiryConfig {
    /// A row not refreshed for this many seconds (the primary's clock)
    /// expires. Exactly one of this and `after_pushes_to_shard`.
    #[serde(default)]
    pub after_secs: Option<u64>,
    /// A row not refreshed while this many Pushes of its table reached
    /// its shard expires.
    #[serde(default)]
    pub after_pushes_to_shard: Option<u64>,
    /// What refreshes a row: `push` (default: a Push is the signal that
    /// an id still trains) or `access` (Pushes and Fetches).
    #[serde(default)]
    pub refresh: Refresh,
    /// Record slots the sweep visits per second per (table, shard).
    /// Default 1,000,000: a pass over a shard of 10^7 rows every 10 s, at
    /// about 1% of a core (a slot costs a few nanoseconds to check).
    #[serde(default = "default_sweep_rate")]
    pub sweep_rows_per_sec: u64,
}

fn default_sweep_rate() -> u64 {
    1_000_000
}

impl ExpiryConfig {
    /// After `secs` seconds without a Push.
    pub fn after_secs(secs: u64) -> Self {
        Self {
            after_secs: Some(secs),
            after_pushes_to_shard: None,
            refresh: Refresh::Push,
            sweep_rows_per_sec: default_sweep_rate(),
        }
    }

    /// After `pushes` Pushes to the shard without one of the row.
    pub fn after_pushes(pushes: u64) -> Self {
        Self {
            after_secs: None,
            after_pushes_to_shard: Some(pushes),
            refresh: Refresh::Push,
            sweep_rows_per_sec: default_sweep_rate(),
        }
    }

    /// The bound (a validated configuration has exactly one).
    pub fn bound(&self) -> Bound {
        match (self.after_secs, self.after_pushes_to_shard) {
            (Some(secs), _) => Bound::Secs(secs.min(MAX_BOUND) as u32),
            (None, Some(pushes)) => Bound::Pushes(pushes.min(MAX_BOUND) as u32),
            (None, None) => Bound::Secs(MAX_BOUND as u32),
        }
    }

    /// Checks the settings; the error names the key under `table`.
    pub fn validate(&self, table: &str) -> Result<(), tessera_config::ConfigError> {
        use tessera_config::invalid;
        let (at, value) = match (self.after_secs, self.after_pushes_to_shard) {
            (Some(_), Some(_)) | (None, None) => {
                return Err(invalid(
                    format!("{table}.expiry"),
                    "needs exactly one of after_secs and after_pushes_to_shard",
                ));
            }
            (Some(secs), None) => ("after_secs", secs),
            (None, Some(pushes)) => ("after_pushes_to_shard", pushes),
        };
        if !(1..=MAX_BOUND).contains(&value) {
            return Err(invalid(
                format!("{table}.expiry.{at}"),
                format!("{value} is outside 1..={MAX_BOUND}"),
            ));
        }
        if self.sweep_rows_per_sec < SWEEP_STEP_SLOTS as u64 {
            return Err(invalid(
                format!("{table}.expiry.sweep_rows_per_sec"),
                format!("must be at least {SWEEP_STEP_SLOTS} (one sweep step a second)"),
            ));
        }
        Ok(())
    }
}

/// Seconds since the Unix epoch now (0 before it: a clock that wrong
/// expires nothing until it is set right).
pub fn unix_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_wrap_and_the_bound_is_exclusive() {
        let b = Bound::Pushes(10);
        assert!(!expired(5, 15, b), "age 10 is at the bound");
        assert!(expired(5, 16, b));
        assert!(!expired(u32::MAX - 2, 7, b), "age 10 across the wrap");
        assert!(expired(u32::MAX - 2, 8, b));
        assert!(!expired(20, 10, b), "a stamp after now is younger");
        assert_eq!(later(u32::MAX, 3), 3);
        assert_eq!(later(3, u32::MAX), 3);
        assert_eq!(later(7, 9), 9);
    }

    #[test]
    fn configurations_are_checked_and_errors_name_the_key() {
        let both = ExpiryConfig {
            after_secs: Some(1),
            ..ExpiryConfig::after_pushes(5)
        };
        let err = both.validate("tables[0]").unwrap_err().to_string();
        assert!(err.contains("tables[0].expiry"), "{err}");
        let zero = ExpiryConfig::after_secs(0)
            .validate("tables[1]")
            .unwrap_err()
            .to_string();
        assert!(zero.contains("tables[1].expiry.after_secs"), "{zero}");
        let slow = ExpiryConfig {
            sweep_rows_per_sec: 10,
            ..ExpiryConfig::after_secs(60)
        };
        assert!(
            slow.validate("t")
                .unwrap_err()
                .to_string()
                .contains("t.expiry.sweep_rows_per_sec")
        );
        assert!(ExpiryConfig::after_pushes(1000).validate("t").is_ok());
        let parsed: ExpiryConfig =
            toml::from_str("after_secs = 86400\nrefresh = \"access\"").unwrap();
        assert_eq!(parsed.bound(), Bound::Secs(86400));
        assert_eq!(parsed.refresh, Refresh::Access);
        assert!(toml::from_str::<ExpiryConfig>("after_days = 1").is_err());
    }
}
