//! A Push's identity and outcome: what a caller needs to retry a Push
//! that failed on some shards without applying it twice on the others.
//!
//! A Push (one table or several, [`crate::PsClient::push_many`]) is split
//! into one sub-request per (table, shard). Every sub-request carries the
//! client's worker id and the Push's [`PushId`], and each shard applies a
//! (worker, id) once per table. So when some parts fail, the whole Push can
//! be sent again *with the same id* ([`crate::PsClient::push_many_as`]):
//! the parts that were applied are acknowledged without being applied
//! again, the others are applied now. A retry under a fresh id (a plain
//! second `push`) would apply the successful parts twice.
//!
//! Every part's outcome is collected (no part is cancelled because a
//! sibling failed: a cancelled part's outcome would be unknown), and a
//! [`PushFailure`] lists the parts that failed with their errors.

use std::collections::HashMap;
use std::fmt;

use tessera_rpc::{Code, RpcError};

use crate::client::PushSpec;

/// The identity of one logical Push in deduplication (its sequence
/// number in this client's numbering). Ids come from
/// [`crate::PsClient::next_push_id`]; reuse one only to retry the same
/// Push (same tables, keys and gradients): the servers acknowledge a
/// repeated id without looking at its contents.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PushId(pub(crate) u64);

impl PushId {
    /// The id of sequence number `sequence`: only to name again a Push
    /// this client numbered (for a caller that keeps ids as plain numbers,
    /// such as the Python client).
    pub fn from_sequence(sequence: u64) -> Self {
        Self(sequence)
    }

    /// The sequence number the sub-requests carry.
    pub fn sequence(self) -> u64 {
        self.0
    }
}

/// One failed part of a Push.
#[derive(Debug)]
pub struct PartFailure {
    /// The table.
    pub table: String,
    /// The shard.
    pub shard: u32,
    /// The server that answered last (or was tried last).
    pub addr: String,
    /// Why the part failed. Whether it was applied is unknown unless the
    /// server refused it (see [`PartFailure::retriable`]).
    pub source: RpcError,
}

impl PartFailure {
    /// Whether sending the Push again under the same id can succeed: the
    /// part timed out, its connection broke, no primary was reachable
    /// within the Push's deadline, or a resize moved its keys and did not
    /// reach this worker in time (`ABORTED` with a `KeysMoved`: the part
    /// was not applied, and the Push goes again split by the count routed
    /// by then; its parts applied already are duplicates). A refusal on
    /// the request's merits (unknown table, wrong dimension, a sequence
    /// below the window) is not.
    pub fn retriable(&self) -> bool {
        match self.source.code() {
            Code::Unavailable | Code::DeadlineExceeded => true,
            Code::Aborted => crate::routing::moved(&self.source).is_some(),
            _ => false,
        }
    }
}

/// A Push of which some parts failed: the parts that succeeded were
/// applied exactly once; retry under [`PushFailure::id`] to complete it.
#[derive(Debug)]
pub struct PushFailure {
    /// The Push's id: pass it to [`crate::PsClient::push_many_as`] (or
    /// `push_as`) with the same specs to retry.
    pub id: PushId,
    /// The (table, shard) parts that were acknowledged.
    pub acknowledged: Vec<(String, u32)>,
    /// The parts that failed, in (table, shard) order.
    pub failed: Vec<PartFailure>,
}

impl PushFailure {
    /// Whether every failed part may succeed when retried under the same
    /// id.
    pub fn retriable(&self) -> bool {
        self.failed.iter().all(PartFailure::retriable)
    }
}

impl fmt::Display for PushFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "push {} failed on {} of {} parts",
            self.id.0,
            self.failed.len(),
            self.failed.len() + self.acknowledged.len()
        )?;
        for (i, part) in self.failed.iter().enumerate() {
            let sep = if i == 0 { ": " } else { "; " };
            write!(
                f,
                "{sep}table {} shard {} at {}: {}",
                part.table, part.shard, part.addr, part.source
            )?;
        }
        Ok(())
    }
}

impl std::error::Error for PushFailure {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.failed
            .first()
            .map(|part| &part.source as &(dyn std::error::Error + 'static))
    }
}

/// Why the specs of a batched Push do not fit together.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SpecError {
    /// `gradients.len()` is not `keys.len() * dim`.
    #[error("table {table}: {gradients} gradient values do not match {keys} keys of dim {dim}")]
    GradientLength {
        /// The table.
        table: String,
        /// Keys passed.
        keys: usize,
        /// Dimension passed.
        dim: usize,
        /// Gradient values passed.
        gradients: usize,
    },
    /// Two specs of one table give different dimensions.
    #[error("table {table} appears with dim {first} and dim {second}")]
    Dimension {
        /// The table.
        table: String,
        /// The first spec's dimension.
        first: usize,
        /// A later spec's.
        second: usize,
    },
}

/// The specs of one table, merged: keys and gradients of every spec that
/// names it, in order (repeated keys are summed by the Push plan).
#[derive(Debug, PartialEq)]
pub(crate) struct TablePush<'a> {
    pub table: &'a str,
    pub keys: Vec<u64>,
    pub gradients: Vec<f32>,
    pub dim: usize,
}

/// Merges `specs` per table, in the order tables first appear. A table
/// named twice gets one sub-request per shard carrying both specs' rows
/// (two sub-requests under one id would be taken for a retry of each
/// other, and one of them dropped).
pub(crate) fn merge_specs<'a>(specs: &[PushSpec<'a>]) -> Result<Vec<TablePush<'a>>, SpecError> {
    let mut out: Vec<TablePush<'a>> = Vec::new();
    let mut index: HashMap<&str, usize> = HashMap::new();
    for spec in specs {
        if spec.dim == 0 || spec.gradients.len() != spec.keys.len() * spec.dim {
            return Err(SpecError::GradientLength {
                table: spec.table.to_owned(),
                keys: spec.keys.len(),
                dim: spec.dim,
                gradients: spec.gradients.len(),
            });
        }
        match index.get(spec.table) {
            Some(&i) => {
                let merged = &mut out[i];
                if merged.dim != spec.dim {
                    return Err(SpecError::Dimension {
                        table: spec.table.to_owned(),
                        first: merged.dim,
                        second: spec.dim,
                    });
                }
                merged.keys.extend_from_slice(spec.keys);
                merged.gradients.extend_from_slice(spec.gradients);
            }
            None => {
                index.insert(spec.table, out.len());
                out.push(TablePush {
                    table: spec.table,
                    keys: spec.keys.to_vec(),
                    gradients: spec.gradients.to_vec(),
                    dim: spec.dim,
                });
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec<'a>(table: &'a str, keys: &'a [u64], gradients: &'a [f32]) -> PushSpec<'a> {
        PushSpec {
            table,
            keys,
            gradients,
            dim: 1,
        }
    }

    fn part(source: RpcError) -> PartFailure {
        PartFailure {
            table: "t".into(),
            shard: 0,
            addr: "a".into(),
            source,
        }
    }

    #[test]
    fn a_part_refused_because_its_keys_moved_is_retriable_other_refusals_are_not() {
        use prost::Message as _;
        let moved = tessera_proto::v1::KeysMoved {
            shard: 0,
            num_shards: 3,
            map_version: 7,
        };
        let status = |code, details: Vec<u8>| {
            RpcError::Status(tessera_rpc::Status::with_details(code, "x", details))
        };
        assert!(part(status(Code::Aborted, moved.encode_to_vec())).retriable());
        assert!(!part(status(Code::Aborted, Vec::new())).retriable());
        assert!(!part(status(Code::InvalidArgument, moved.encode_to_vec())).retriable());
        assert!(part(status(Code::Unavailable, Vec::new())).retriable());
        let failure = PushFailure {
            id: PushId(1),
            acknowledged: vec![("t".into(), 1)],
            failed: vec![part(status(Code::Aborted, moved.encode_to_vec()))],
        };
        assert!(failure.retriable(), "some parts applied, the rest moved");
    }

    #[test]
    fn specs_of_one_table_are_merged_in_order() {
        let merged = merge_specs(&[
            spec("a", &[1, 2], &[1.0, 2.0]),
            spec("b", &[1], &[5.0]),
            spec("a", &[2, 3], &[10.0, 20.0]),
        ])
        .unwrap();
        assert_eq!(merged.len(), 2);
        assert_eq!(merged[0].table, "a");
        assert_eq!(merged[0].keys, vec![1, 2, 2, 3]);
        assert_eq!(merged[0].gradients, vec![1.0, 2.0, 10.0, 20.0]);
        assert_eq!(merged[1].keys, vec![1]);
    }

    #[test]
    fn mismatched_specs_are_refused() {
        let two = PushSpec {
            table: "a",
            keys: &[1],
            gradients: &[1.0, 2.0],
            dim: 2,
        };
        assert!(matches!(
            merge_specs(&[spec("a", &[1], &[1.0]), two]),
            Err(SpecError::Dimension { .. })
        ));
        assert!(matches!(
            merge_specs(&[spec("a", &[1, 2], &[1.0])]),
            Err(SpecError::GradientLength { .. })
        ));
    }
}
