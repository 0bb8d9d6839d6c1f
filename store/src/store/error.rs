//! Why the store refused a Fetch or Push.

/// Why a Fetch or Push was refused. Nothing is applied when one is returned.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// Rows a forwarded expiry step removed at the primary are not all
    /// here (this copy is not the primary's), or the table does not
    /// expire rows here.
    #[error("rows the primary expired from table {table} are not all in this copy")]
    BadExpiry {
        /// The table.
        table: String,
    },
    /// A forwarded Push's keys left out by admission do not point into its
    /// keys in ascending order, or its table has no admission here.
    #[error("a forwarded push's admissions do not fit its {keys} keys or this table")]
    BadAdmissions {
        /// Keys of the Push.
        keys: usize,
    },
    /// A forwarded Push's evictions do not point into its keys in order
    /// (a corrupt stream entry), or name a row this copy lacks (it is not
    /// the primary's).
    #[error("a forwarded push's evictions do not fit its {keys} keys or this copy")]
    BadEvictions {
        /// Keys of the Push.
        keys: usize,
    },
    /// A delta's (or a delta copy's) rows do not have the table's shape.
    #[error(
        "a delta of table `{table}` has {got} (bytes or entries) of {part} for {keys} rows; the table takes {expected}"
    )]
    DeltaLength {
        /// The table.
        table: String,
        /// `values` or `state` (bytes), `steps` or `stamps` (entries).
        part: &'static str,
        /// Rows in it.
        keys: usize,
        /// Bytes (entries) the table's shape takes.
        expected: usize,
        /// Bytes (entries) it had.
        got: usize,
    },
    /// No table of that name.
    #[error("no table named `{0}`")]
    UnknownTable(String),
    /// The request names a shard this server does not host.
    #[error("shard {shard} is not hosted here (hosted: {hosted:?})")]
    ShardNotHosted {
        /// The shard requested.
        shard: u32,
        /// The shards this server hosts.
        hosted: Vec<u32>,
    },
    /// A key of the request moved to another shard in a resize of the
    /// cluster's shard count (the cut-over fenced it here).
    #[error(
        "key {key} moved from shard {shard} to shard {to} when the cluster was resized to {num_shards} shards (shard map version {map_version}): route it by the new map"
    )]
    Moved {
        /// The first moved key of the request.
        key: u64,
        /// The shard asked.
        shard: u32,
        /// The shard count keys are routed by now.
        num_shards: u32,
        /// The key's shard now.
        to: u32,
        /// The shard-map version that moved it.
        map_version: u64,
    },
    /// A Push split by another shard count than this shard's, before a
    /// resize to that count fenced the shard (`PushRequest.num_shards`):
    /// retried shortly, it is taken once the cut-over reaches the shard.
    #[error(
        "the Push was split by {split_by} shards; shard {shard} routes keys by {num_shards} until a resize to {split_by} cuts over here (retry shortly)"
    )]
    NotCutOver {
        /// The shard asked.
        shard: u32,
        /// The count the Push was split by.
        split_by: u32,
        /// The shard's count.
        num_shards: u32,
    },
    /// A key this shard receives in a shrink of the cluster, asked before
    /// the shard holds every moved row (this copy has not opened):
    /// retried shortly, or at the copy that opened.
    #[error(
        "key {key} comes to shard {shard} when the cluster shrinks to {num_shards} shards; this copy serves it once it holds the moved rows (retry shortly)"
    )]
    NotOpened {
        /// The first such key of the request.
        key: u64,
        /// The shard asked.
        shard: u32,
        /// The count the cluster shrinks to.
        num_shards: u32,
    },
    /// A Push split by the count before a shrink, at a shard that routes
    /// by the shrunk count now: the worker splits it anew (answered
    /// `ABORTED` with a `KeysMoved`, as [`StoreError::Moved`]).
    #[error(
        "the Push was split by {split_by} shards; shard {shard} routes keys by {num_shards} since the cluster shrank: split it anew"
    )]
    Resplit {
        /// The shard asked.
        shard: u32,
        /// The count the Push was split by.
        split_by: u32,
        /// The count the shard routes by.
        num_shards: u32,
    },
    /// A key does not belong to the shard named in the request.
    #[error("key {key} belongs to shard {actual}, not to shard {shard}")]
    WrongShard {
        /// The key.
        key: u64,
        /// The shard named in the request.
        shard: u32,
        /// The shard the key maps to.
        actual: u32,
    },
    /// More keys than `max_keys_per_request`.
    #[error("{got} keys in one request; at most {max} are accepted")]
    TooManyKeys {
        /// Keys sent.
        got: usize,
        /// The limit.
        max: u32,
    },
    /// The gradients do not hold `keys * dim` values.
    #[error("expected {expected} gradient bytes ({keys} keys x dim {dim} x 4), got {got}")]
    GradientLength {
        /// Number of keys.
        keys: usize,
        /// The table's dimension.
        dim: u32,
        /// Bytes expected.
        expected: usize,
        /// Bytes received.
        got: usize,
    },
    /// A gradient is NaN or infinite and the table rejects those.
    #[error("gradient value {index} of the push to `{table}` is not finite; nothing was applied")]
    NonFiniteGradient {
        /// The table.
        table: String,
        /// Index of the first bad value.
        index: usize,
    },
    /// The Push's sequence number is below the deduplication window: the
    /// server cannot tell whether it was applied, so it refuses it.
    #[error(
        "push {sequence} of worker {worker:#x} is older than the deduplication window (lowest {lowest}); it may already have been applied"
    )]
    SequenceTooOld {
        /// The worker.
        worker: u64,
        /// The sequence sent.
        sequence: u64,
        /// The lowest sequence still tracked.
        lowest: u64,
    },
    /// A Push's sequence is above the largest accepted or jumps too far
    /// above the worker's highest (see [`crate::dedup::MAX_JUMP`]).
    #[error(
        "push {sequence} of worker {worker:#x} is implausible (its highest is {highest}; at most {} above it, and at most {} in all)",
        crate::dedup::MAX_JUMP,
        crate::dedup::MAX_SEQUENCE
    )]
    SequenceImplausible {
        /// The worker.
        worker: u64,
        /// The sequence sent.
        sequence: u64,
        /// The worker's highest sequence so far.
        highest: u64,
    },
    /// A Fetch's answer would exceed the largest message.
    #[error(
        "the answer of {keys} keys x {row_bytes} bytes a row exceeds the largest message ({max} bytes); fetch fewer keys at a time"
    )]
    ResponseTooLarge {
        /// Keys asked for.
        keys: usize,
        /// Bytes of a row.
        row_bytes: usize,
        /// Most bytes a Fetch's rows may take.
        max: usize,
    },
    /// The Push comes from a worker the shard's deduplication has no room
    /// for: refused, so that no remembered worker has to be forgotten.
    #[error(
        "push deduplication of this shard remembers {max_workers} workers (dedup_max_workers), all seen within dedup_idle_secs; worker {worker:#x} is refused until some go idle"
    )]
    DedupFull {
        /// The refused worker.
        worker: u64,
        /// The limit.
        max_workers: usize,
    },
    /// The output buffer of a fetch has the wrong size (a caller bug).
    #[error("fetch output holds {got} bytes, {expected} needed")]
    OutputLength {
        /// Bytes needed.
        expected: usize,
        /// Bytes given.
        got: usize,
    },
    /// Pushes are refused in inference mode.
    #[error("this server is in inference mode and does not accept pushes")]
    InferenceMode,
    /// Pushes are refused by a serving server: its rows come from a
    /// training fleet's delta stream.
    #[error(
        "this server serves a training fleet's rows (mode = serving) and does not accept pushes: push to the training fleet"
    )]
    ServingMode,
    /// A stripe of the shard holds as many rows as it can
    /// ([`crate::table::MAX_SHARD_ROWS`] per shard): add shards, or set
    /// `max_rows`.
    #[error(
        "shard {shard} of table `{table}` holds as many rows as it can; add shards or set max_rows"
    )]
    ShardFull {
        /// The table.
        table: String,
        /// The shard.
        shard: u32,
    },
}

/// What kind of refusal a [`StoreError`] is: what a service answers it
/// with (ps-server maps each kind to an RPC status code). Classified here,
/// beside the errors, so that a new error cannot be left unclassified.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// No such table.
    NotFound,
    /// The request is malformed whatever the store's state: the caller
    /// must not retry it as it is.
    InvalidArgument,
    /// The store cannot serve it now, another attempt may succeed (a
    /// resize under way).
    Unavailable,
    /// The store's state refuses it: another shard, another server or
    /// another mode is needed.
    FailedPrecondition,
    /// A bound was reached (workers remembered, answer size, rows).
    ResourceExhausted,
    /// The keys moved in a resize: the caller splits the request by the
    /// count [`StoreError::moved_to`] names.
    Moved,
    /// A bug in the store's caller.
    Internal,
}

impl StoreError {
    /// What kind of refusal this is.
    pub fn kind(&self) -> ErrorKind {
        match self {
            StoreError::Moved { .. } | StoreError::Resplit { .. } => ErrorKind::Moved,
            StoreError::UnknownTable(_) => ErrorKind::NotFound,
            StoreError::GradientLength { .. }
            | StoreError::TooManyKeys { .. }
            | StoreError::SequenceImplausible { .. }
            | StoreError::NonFiniteGradient { .. }
            | StoreError::BadEvictions { .. }
            | StoreError::BadAdmissions { .. }
            | StoreError::BadExpiry { .. }
            | StoreError::DeltaLength { .. } => ErrorKind::InvalidArgument,
            StoreError::OutputLength { .. } => ErrorKind::Internal,
            StoreError::NotCutOver { .. } | StoreError::NotOpened { .. } => ErrorKind::Unavailable,
            StoreError::ShardNotHosted { .. }
            | StoreError::WrongShard { .. }
            | StoreError::InferenceMode
            | StoreError::ServingMode
            | StoreError::SequenceTooOld { .. } => ErrorKind::FailedPrecondition,
            StoreError::DedupFull { .. }
            | StoreError::ResponseTooLarge { .. }
            | StoreError::ShardFull { .. } => ErrorKind::ResourceExhausted,
        }
    }

    /// Where the keys of a [`ErrorKind::Moved`] refusal are routed now:
    /// the shard, the shard count to split by, and the shard-map version
    /// that moved them (0: the count is the store's own, no map named it).
    pub fn moved_to(&self) -> Option<(u32, u32, u64)> {
        match *self {
            StoreError::Moved {
                shard,
                num_shards,
                map_version,
                ..
            } => Some((shard, num_shards, map_version)),
            StoreError::Resplit {
                shard, num_shards, ..
            } => Some((shard, num_shards, 0)),
            _ => None,
        }
    }
}
