//! The RPC layer's recovery policies (the paper's §7), as sans-IO state
//! machines: each takes events with the time passed in and answers
//! questions; none reads a clock, sleeps or draws randomness it was not
//! handed, so tests drive them step by step with a seeded generator.
//!
//! - [`RetryBudget`]: retries earn and spend tokens, so they cannot
//!   multiply load during an outage.
//! - [`RetryPolicy`]: whether one failed attempt is tried again
//!   (probability, attempts, idempotence, deadline, budget).
//! - [`Quarantine`]: nodes with too many failures in a sliding window are
//!   excluded for a growing cooldown, never all of a replica set.
//! - [`ReplicaSelector`]: prefer the caller's failure domain, then
//!   power-of-two-choices on latency and load, failing over across
//!   domains.
//! - [`FallbackLadder`]: when RDMA to a destination breaks, reconnect, then
//!   TCP to the same address, probing RDMA to move back.

mod budget;
mod fallback;
mod quarantine;
mod retry;
mod select;

pub use budget::{RetryBudget, RetryBudgetConfig};
pub use fallback::{FallbackConfig, FallbackLadder, HEALTHY_AFTER, LadderStep, Path};
pub use quarantine::{Ejection, Quarantine, QuarantineConfig};
pub use retry::{AttemptFailure, GiveUp, RetryDecision, RetryPolicy, RetryPolicyConfig};
pub use select::{Replica, ReplicaSelector};
