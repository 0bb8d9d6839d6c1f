//! Training to serving: a serving fleet fed by a stream of changed rows
//! from the training fleet.
//!
//! Rankers read a **serving fleet** (`mode = "serving"`: Pushes refused,
//! any number of copies of each shard, its own shard count); trainers
//! push into a **training fleet** whose servers have `[delta]`. As
//! Monolith syncs training to serving parameter servers, and PERSIA ships
//! deltas, each training primary sends every `delta.interval_ms` the rows
//! its shards changed, as they are now, to every serving server hosting
//! those rows' keys, over the same transports as everything else.
//!
//! - **What changed** is a set of keys per (table, shard)
//!   (`table/changes.rs`), fed by Pushes, row-creating Fetches, evictions
//!   and expiry, and taken under the shard's write lock at each **cut**
//!   (`sender.rs`): the rows are read after it, so a delta holds each row
//!   as new as the cut or newer. Values only, unless
//!   `delta.optimizer_state`.
//! - **Order and gaps** (`follower.rs`): a stream is one primary term of
//!   a training shard (a random id); its deltas are numbered, and a
//!   serving server applies number n+1 only after n. Anything it cannot
//!   place (a lost or dropped delta, a new primary after a failover or a
//!   restart, a serving server that just started) is a gap: it copies the
//!   rows it hosts from the training shard's primary (`source.rs`: a
//!   snapshot taken with the stream's mark, paged, filtered by the serving
//!   shard of each key), holding the deltas that arrive meanwhile, then
//!   goes on from the copy's delta number (`feed.rs`). A copy also
//!   removes the rows of that training shard that the copy no longer
//!   holds.
//! - **Freshness** (`feed.rs`): per training shard, the delta and
//!   position applied, the delay of its oldest change (training Push to
//!   serving visibility), rows applied, copies; in Health, `tessera
//!   status` and metrics. With `serving.max_delay_ms`, a serving server
//!   refuses Fetches (`Unavailable`) while a training shard's rows are
//!   older than that, so rankers read another copy.
//!
//! - **Resizes** (`crate::reshard`) use the same stream inside one
//!   training cluster: while a shard gives keys to a resize, its primary
//!   adds a route (`route.rs`) to the receiving shards' servers, rows
//!   whole (optimizer state, updates applied, expiry stamps) and routed
//!   by the new shard count; a receiving training server's feed, open
//!   only then, copies and follows as a serving server does.
//!
//! # Consistency
//!
//! A serving copy converges to the training fleet: once Pushes stop and
//! the last deltas are applied, its rows are bit for bit the training
//! primaries' values (the tests and the drill compare fleet-wide
//! digests). Meanwhile a ranker reads each row as of some recent cut of
//! its training shard, no older than the bound; rows of different
//! training shards (or of different deltas) may be from different cuts.
//! Every copy of a serving shard is fed on its own, so two copies may
//! differ by a delta for an interval.

mod feed;
mod follower;
mod parts;
mod route;
mod sender;
mod service;
mod source;

pub use self::feed::{Feed, FeedError, LeadCheck};
pub use self::follower::{Follower, Header, MAX_HELD_BYTES, Resume, Verdict};
pub use self::parts::{CHUNK_BYTES, PART_BYTES, route as route_rows};
pub use self::route::ResizePlan;
pub use self::sender::{Mark, QUEUE_DELTAS, Sender, stall_bound};
pub use self::service::DeltaService;
pub use self::source::Sources;
