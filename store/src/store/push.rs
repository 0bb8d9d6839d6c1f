//! Pushes: every check before any lock, then applied under the shard's
//! write lock once per Push id (or as the primary applied it, on a
//! replica).

use std::time::Instant;

use tessera_proto::rows::F32_BYTES;

use super::{ShardGuard, Store, StoreError};
use crate::config::Mode;
use crate::dedup::Admission;
use crate::table::{GradientError, ShardState, Table};

/// What a Push did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushOutcome {
    /// Rows updated (0 for a duplicate).
    pub applied: usize,
    /// The Push had been applied before and was only acknowledged.
    pub duplicate: bool,
    /// Rows evicted to make room for its rows (a table with `max_rows`),
    /// in order: the replicas evict the same.
    pub evicted: Vec<crate::table::Eviction>,
    /// Indices of its keys that admission left without a row (a table
    /// with `admission`), ascending: the replicas leave out the same.
    pub not_admitted: Vec<u32>,
    /// The expiry stamp its rows got (a table with expiry: its wall
    /// clock or Push count, `table/expiry.rs`; 0 otherwise): the replicas
    /// stamp them alike.
    pub stamp: u32,
}

/// The identity of a Push for exactly-once application: the worker and its
/// sequence number (0 and 0: not deduplicated).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PushId {
    /// The worker (random per worker process).
    pub worker: u64,
    /// The worker's sequence number of this Push.
    pub sequence: u64,
}

/// A Push that passed every check ([`Store::check_push`]), ready to apply
/// under its shard's write lock.
#[derive(Debug)]
pub struct CheckedPush<'a> {
    table: &'a Table,
    state: &'a ShardState,
    shard: u32,
    keys: &'a [u64],
    gradients: &'a [u8],
    id: PushId,
    /// The shard's count at the check (`Store::route_count`).
    num_shards: u32,
    /// The shard count the worker split it by (0: not said).
    split_by: u32,
    /// The count before the store's last shrink (`Store::shrunk_from`).
    shrunk_from: u32,
}

impl CheckedPush<'_> {
    /// The shard it goes to.
    pub fn shard(&self) -> u32 {
        self.shard
    }

    /// Notes the shard count the worker split the Push by
    /// (`PushRequest.num_shards`; 0: not said). A count other than the
    /// store's is taken only once a resize to it fenced the shard's
    /// moving keys and every receiving shard serves them
    /// (`store/resize.rs`); before, the Push is refused as
    /// [`StoreError::NotCutOver`], which the worker retries.
    #[must_use]
    pub fn split_by(mut self, num_shards: u32) -> Self {
        self.split_by = num_shards;
        self
    }

    /// Applies it as the shard's primary did (a replica following its
    /// stream): its id is recorded, never judged, exactly the rows the
    /// primary evicted are evicted (`evictions`, in order), and no row is
    /// created for the keys admission left out there (`not_admitted`).
    /// Refused, with nothing applied, if an eviction or a key left out
    /// does not point into the Push's keys in order. Rows are stamped
    /// `stamp`, as the primary stamped them (`table/expiry.rs`). The
    /// caller holds the shard's write lock.
    pub fn apply_replicated(
        &self,
        writing: &ShardGuard<'_>,
        evictions: &[crate::table::Eviction],
        not_admitted: &[u32],
        now: Instant,
        stamp: u32,
    ) -> Result<(), StoreError> {
        debug_assert_eq!(writing.shard(), self.shard, "another shard's lock");
        let in_order = evictions.windows(2).all(|w| w[0].before <= w[1].before);
        if !in_order
            || evictions
                .iter()
                .any(|e| e.before as usize >= self.keys.len())
        {
            return Err(StoreError::BadEvictions {
                keys: self.keys.len(),
            });
        }
        let ascending = not_admitted.windows(2).all(|w| w[0] < w[1]);
        if !ascending
            || not_admitted
                .last()
                .is_some_and(|&i| i as usize >= self.keys.len())
            || (!not_admitted.is_empty() && self.table.config().admission.is_none())
        {
            return Err(StoreError::BadAdmissions {
                keys: self.keys.len(),
            });
        }
        let followed = self.table.apply_replicated(
            writing,
            self.state,
            self.keys,
            self.gradients,
            self.id.worker,
            self.id.sequence,
            evictions,
            not_admitted,
            now,
            stamp,
        );
        if !followed {
            // A row the primary evicted is not here, or one it left out
            // is: this copy is not the primary's (applied anyway; the
            // caller copies the shard again).
            return Err(StoreError::BadEvictions {
                keys: self.keys.len(),
            });
        }
        Ok(())
    }

    /// Applies it, unless its id was applied before (then it is
    /// acknowledged as a duplicate). With expiry, its rows are stamped
    /// (`table/expiry.rs`) with the wall clock now. The caller holds the
    /// shard's write lock.
    pub fn apply(&self, writing: &ShardGuard<'_>, now: Instant) -> Result<PushOutcome, StoreError> {
        // The wall clock only where a table's rows are stamped with it.
        let secs = match self.table.config().expiry {
            Some(_) => crate::table::expiry::unix_secs(),
            None => 0,
        };
        self.apply_at(writing, now, secs)
    }

    /// [`CheckedPush::apply`] with the wall clock read as `secs` (seconds
    /// since the Unix epoch; tests and benchmarks move it by hand).
    pub fn apply_at(
        &self,
        writing: &ShardGuard<'_>,
        now: Instant,
        secs: u64,
    ) -> Result<PushOutcome, StoreError> {
        debug_assert_eq!(writing.shard(), self.shard, "another shard's lock");
        // Checked again under the lock: the fence may have come since
        // `check_push` (`store/resize.rs`).
        // Keys this shard receives in a shrink that has not opened here
        // (`store/resize.rs`; an earlier growth's fence may name them
        // moved away); and Pushes split by that count wait for it.
        if let Some(to) = writing.incoming() {
            super::resize::refuse_incoming(self.shard, self.keys, self.num_shards, to)?;
            if self.split_by == to {
                return Err(StoreError::NotCutOver {
                    shard: self.shard,
                    split_by: self.split_by,
                    num_shards: self.num_shards,
                });
            }
        }
        let moved = writing.moved();
        if let Some(moved) = moved {
            super::resize::refuse_moved(self.shard, self.keys, moved)?;
        }
        // A count below the shard's own is an older one (a shard that took
        // a finished growth's count): its keys were checked against this
        // shard's own count, and moved ones refused above. A larger one is
        // a growth's, taken once it opened here, or, where a shrink opened
        // (the shard's count may have changed since the check), the count
        // before it: split anew.
        let own = writing.routes_by().unwrap_or(self.num_shards);
        let growing_to = moved.map(|(to, _)| to) == Some(self.split_by);
        if self.split_by > own && !(growing_to && writing.new_count_open()) {
            let before_shrink =
                writing.routes_by().is_some() || (!growing_to && self.split_by <= self.shrunk_from);
            return Err(if before_shrink {
                StoreError::Resplit {
                    shard: self.shard,
                    split_by: self.split_by,
                    num_shards: own,
                }
            } else {
                StoreError::NotCutOver {
                    shard: self.shard,
                    split_by: self.split_by,
                    num_shards: self.num_shards,
                }
            });
        }
        let id = self.id;
        let (admission, applied) = self.table.apply(
            writing,
            self.state,
            self.keys,
            self.gradients,
            id.worker,
            id.sequence,
            now,
            secs,
        );
        match admission {
            Admission::Apply => {
                // For the delta stream: the rows written, and those evicted
                // for them (keys admission left out have no row: they are
                // sent as absent, which changes nothing downstream).
                self.state.note_changed(
                    self.keys
                        .iter()
                        .copied()
                        .chain(applied.evicted.iter().map(|e| e.key)),
                );
                metrics::counter!("tessera_ps_push_keys_total").increment(self.keys.len() as u64);
                if !applied.not_admitted.is_empty() {
                    metrics::counter!("tessera_ps_admission_dropped_total", "table" => self.table.config().name.clone())
                        .increment(applied.not_admitted.len() as u64);
                }
                Ok(PushOutcome {
                    applied: self.keys.len() - applied.not_admitted.len(),
                    duplicate: false,
                    evicted: applied.evicted,
                    not_admitted: applied.not_admitted,
                    stamp: applied.stamp,
                })
            }
            Admission::Duplicate => {
                metrics::counter!("tessera_ps_push_duplicates_total").increment(1);
                Ok(PushOutcome {
                    applied: 0,
                    duplicate: true,
                    evicted: applied.evicted,
                    not_admitted: applied.not_admitted,
                    stamp: 0,
                })
            }
            Admission::TooOld { lowest } => Err(StoreError::SequenceTooOld {
                worker: id.worker,
                sequence: id.sequence,
                lowest,
            }),
            Admission::Full { max_workers } => Err(StoreError::DedupFull {
                worker: id.worker,
                max_workers,
            }),
            Admission::Implausible { highest } => Err(StoreError::SequenceImplausible {
                worker: id.worker,
                sequence: id.sequence,
                highest,
            }),
        }
    }
}

impl Store {
    /// Applies `gradients` (little-endian f32, `keys.len() * dim`) to the
    /// rows of `keys` with the table's optimizer, once per `id` (a retried
    /// Push with the same id is acknowledged as a duplicate). Validates
    /// everything before changing any row; duplicate keys in one request
    /// are applied once per occurrence. Leaves the shard's version as it
    /// is: servers apply Pushes through [`Store::check_push`] and
    /// [`CheckedPush::apply`] and move the version themselves.
    pub fn push(
        &self,
        table: &str,
        shard: u32,
        keys: &[u64],
        gradients: &[u8],
        id: PushId,
    ) -> Result<PushOutcome, StoreError> {
        let push = self.check_push(table, shard, keys, gradients, id)?;
        let guard = self
            .lock_shard(shard)
            .ok_or_else(|| StoreError::ShardNotHosted {
                shard,
                hosted: self.hosted.clone(),
            })?;
        push.apply(&guard, Instant::now())
    }

    /// Runs every check of a Push (table, shard, keys, key limit, mode,
    /// gradient length and values) without taking any lock.
    pub fn check_push<'a>(
        &'a self,
        table: &str,
        shard: u32,
        keys: &'a [u64],
        gradients: &'a [u8],
        id: PushId,
    ) -> Result<CheckedPush<'a>, StoreError> {
        match self.mode {
            Mode::Training => {}
            Mode::Inference => return Err(StoreError::InferenceMode),
            Mode::Serving => return Err(StoreError::ServingMode),
        }
        let (table, state) = self.shard_state(table, shard, keys)?;
        let dim = table.config().dim;
        let expected = keys.len() * dim as usize * F32_BYTES;
        if gradients.len() != expected {
            return Err(StoreError::GradientLength {
                keys: keys.len(),
                dim,
                expected,
                got: gradients.len(),
            });
        }
        table.check_gradients(gradients).map_err(|err| match err {
            GradientError::NonFinite(index) => StoreError::NonFiniteGradient {
                table: table.config().name.clone(),
                index,
            },
        })?;
        if !state.rows.has_room(keys.len()) {
            return Err(StoreError::ShardFull {
                table: table.config().name.clone(),
                shard,
            });
        }
        Ok(CheckedPush {
            table,
            state,
            shard,
            keys,
            gradients,
            id,
            num_shards: self.route_count(shard),
            split_by: 0,
            shrunk_from: self.shrunk_from(),
        })
    }
}
