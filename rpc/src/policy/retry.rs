//! Whether a failed attempt is tried again (§7.2: probabilistic retries).
//!
//! A retry is considered only for failures that say nothing about the
//! request having been applied twice: a connection that could not be
//! opened, a server that refused the request unprocessed (`Unavailable`),
//! or a request that timed out or lost its connection while the caller's
//! deadline has time left. Then, in this order: the attempt limit,
//! idempotence (a non-idempotent method is retried only when the request
//! carries an id the server deduplicates), the remaining deadline, a coin
//! (so that under a broad failure only a fraction of callers add load), and
//! finally the [`RetryBudget`].
//!
//! The coin has two weights. A timed-out attempt is retried with
//! `probability` (the paper: "a timed-out request may be retried
//! probabilistically"): a timeout may mean an overloaded server, and every
//! retry adds load. A connection that could not be made or broke is retried
//! with `connection_failure_probability`, by default always: it says the
//! node or the path failed, not that it is busy, so the retry goes to
//! another replica and adds no load to the failed one; the budget still
//! caps how much retrying a client does.
//!
//! One kind of failure skips all of that: an attempt that did no work
//! anywhere (a dial that failed or was refused, a listener that is gone, a
//! request never handed to the transport, or a server that answered
//! `Unavailable`: not ready for the shard, shutting down, starting) is
//! moved at once and always to another replica that has not turned the
//! call away: one not tried yet, or one tried whose attempt did work (it
//! timed out or lost its connection, and may answer now)
//! ([`RetryDecision::Redirect`]): no coin, no token, and it does not count
//! as an attempt. Such a failure is the replica's state, not the
//! request's or the load's (like gRPC's transparent retry of a request the
//! server never processed, or a primary's redirect), and it costs the
//! other replica nothing it would not have done anyway. It is bounded by
//! the replicas: once every replica turned the call away, the rules above
//! decide. (Counting it once every replica was tried made a Fetch give up
//! in a drill: the killed primary's connection lost, the replica slow once,
//! then the dead primary again, its backoff run out, refused: the third
//! attempt, while the replica served.)

use std::time::{Duration, Instant};

use rand::Rng;

use super::budget::RetryBudget;

/// Settings of a [`RetryPolicy`].
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetryPolicyConfig {
    /// Chance that a timed-out attempt is retried. Default 0.5: the paper
    /// retries timeouts "probabilistically"; half keeps an overload from
    /// doubling the load while most single slow attempts are still absorbed.
    pub probability: f64,
    /// Chance that an attempt whose connection failed (could not be made,
    /// or broke) is retried. Default 1.0: a failed node or path is not a
    /// busy one, and a replica set should hide a dead replica completely
    /// (the budget still bounds retries).
    pub connection_failure_probability: f64,
    /// Attempts per call, the first included. Default 3.
    pub max_attempts: u32,
    /// A retry is not started with less than this left of the deadline
    /// (it could not finish). Default 2 ms.
    pub min_remaining_ms: u64,
}

impl Default for RetryPolicyConfig {
    fn default() -> Self {
        Self {
            probability: 0.5,
            connection_failure_probability: 1.0,
            max_attempts: 3,
            min_remaining_ms: 2,
        }
    }
}

impl tessera_config::Validate for RetryPolicyConfig {
    fn validate(&self) -> Result<(), tessera_config::ConfigError> {
        use tessera_config::invalid;
        if !(0.0..=1.0).contains(&self.probability) {
            return Err(invalid("retry.probability", "must be between 0 and 1"));
        }
        if !(0.0..=1.0).contains(&self.connection_failure_probability) {
            return Err(invalid(
                "retry.connection_failure_probability",
                "must be between 0 and 1",
            ));
        }
        if self.max_attempts == 0 {
            return Err(invalid("retry.max_attempts", "must be at least 1"));
        }
        Ok(())
    }
}

/// How an attempt failed, as far as retrying is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttemptFailure {
    /// No connection could be made: the request was never sent.
    Connect,
    /// The server answered `Unavailable` without acting on the request
    /// (starting, stopping, a replica catching up), or a stopping server
    /// closed the connection having answered every request it read
    /// ([`crate::LinkClosed::Drained`]): as safe as `Connect`, but says
    /// nothing against the node's health.
    Refused,
    /// The connection broke after the request was sent: it may or may not
    /// have been applied.
    Lost,
    /// The attempt's time ran out: it may or may not have been applied.
    TimedOut,
    /// The server answered with an error status: not retried here.
    Status,
}

impl AttemptFailure {
    /// Whether the attempt did no work anywhere: never sent, or refused
    /// unprocessed (module docs).
    pub fn did_no_work(self) -> bool {
        matches!(self, AttemptFailure::Connect | AttemptFailure::Refused)
    }
}

/// What to do after a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryDecision {
    /// Try another replica that has not turned this call away, at once:
    /// the attempt did no work (module docs). Drew no coin and no token,
    /// and does not count as an attempt.
    Redirect,
    /// Try again (preferably on another replica).
    Retry,
    /// Give up, and why (for logs and metrics).
    GiveUp(GiveUp),
}

/// Why a failed call is not tried again ([`RetryDecision::GiveUp`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GiveUp {
    /// The server answered with an error status: its answer is final.
    #[error("the server answered")]
    ServerAnswered,
    /// `max_attempts` attempts were made.
    #[error("attempts used up")]
    AttemptsUsedUp,
    /// The request may have been applied and a second application is not
    /// harmless.
    #[error("not idempotent")]
    NotIdempotent,
    /// Less than `min_remaining_ms` is left before the caller's deadline.
    #[error("deadline")]
    Deadline,
    /// The retry probability's draw said no.
    #[error("not drawn")]
    NotDrawn,
    /// The retry budget has no token left.
    #[error("retry budget exhausted")]
    BudgetExhausted,
}

/// The retry decision of a client (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy {
    config: RetryPolicyConfig,
}

impl RetryPolicy {
    /// A policy with `config`.
    pub fn new(config: RetryPolicyConfig) -> Self {
        Self { config }
    }

    /// Decides after attempt number `attempt` (1 for the first; attempts
    /// that ended in a [`RetryDecision::Redirect`] are not counted) failed
    /// with `failure`. `safe` says whether a second application is
    /// harmless (idempotent method, or a request id the server
    /// deduplicates); `elsewhere` whether the call has another replica
    /// that has not turned it away (not tried yet, or tried with an attempt
    /// that did work); `deadline` is the caller's.
    #[allow(clippy::too_many_arguments)]
    pub fn decide(
        &self,
        attempt: u32,
        failure: AttemptFailure,
        safe: bool,
        elsewhere: bool,
        deadline: Instant,
        now: Instant,
        budget: &mut RetryBudget,
        rng: &mut impl Rng,
    ) -> RetryDecision {
        if failure == AttemptFailure::Status {
            return RetryDecision::GiveUp(GiveUp::ServerAnswered);
        }
        let left = deadline.saturating_duration_since(now);
        let time_left = left >= Duration::from_millis(self.config.min_remaining_ms);
        if failure.did_no_work() && elsewhere && time_left {
            return RetryDecision::Redirect;
        }
        if attempt >= self.config.max_attempts {
            return RetryDecision::GiveUp(GiveUp::AttemptsUsedUp);
        }
        // A request that was never sent cannot have been applied.
        if matches!(failure, AttemptFailure::Lost | AttemptFailure::TimedOut) && !safe {
            return RetryDecision::GiveUp(GiveUp::NotIdempotent);
        }
        if !time_left {
            return RetryDecision::GiveUp(GiveUp::Deadline);
        }
        let probability = match failure {
            AttemptFailure::TimedOut => self.config.probability,
            _ => self.config.connection_failure_probability,
        };
        if !rng.random_bool(probability.clamp(0.0, 1.0)) {
            return RetryDecision::GiveUp(GiveUp::NotDrawn);
        }
        if !budget.try_withdraw(now) {
            return RetryDecision::GiveUp(GiveUp::BudgetExhausted);
        }
        RetryDecision::Retry
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;
    use crate::policy::RetryBudgetConfig;

    fn budget(now: Instant) -> RetryBudget {
        RetryBudget::new(
            RetryBudgetConfig {
                max_tokens: 1e9,
                ..RetryBudgetConfig::default()
            },
            now,
        )
    }

    #[test]
    fn retries_happen_with_the_configured_probability() {
        let now = Instant::now();
        let deadline = now + Duration::from_secs(1);
        let mut rng = StdRng::seed_from_u64(7);
        for probability in [0.1, 0.5, 0.9] {
            let policy = RetryPolicy::new(RetryPolicyConfig {
                probability,
                connection_failure_probability: 1.0 - probability,
                ..RetryPolicyConfig::default()
            });
            let mut budget = budget(now);
            let n = 20_000;
            let mut share = |failure| {
                let retried = (0..n)
                    .filter(|_| {
                        policy.decide(
                            1,
                            failure,
                            true,
                            false,
                            deadline,
                            now,
                            &mut budget,
                            &mut rng,
                        ) == RetryDecision::Retry
                    })
                    .count();
                retried as f64 / n as f64
            };
            // Binomial standard deviation at n = 20000 is at most 0.0036.
            let timed_out = share(AttemptFailure::TimedOut);
            assert!(
                (timed_out - probability).abs() < 0.02,
                "p = {probability}: {timed_out}"
            );
            for failure in [
                AttemptFailure::Connect,
                AttemptFailure::Refused,
                AttemptFailure::Lost,
            ] {
                let lost = share(failure);
                assert!(
                    (lost - (1.0 - probability)).abs() < 0.02,
                    "{failure:?}, p = {}: {lost}",
                    1.0 - probability
                );
            }
        }
    }

    #[test]
    fn limits_idempotence_deadline_and_budget_are_respected() {
        let now = Instant::now();
        let later = now + Duration::from_secs(1);
        let sure = RetryPolicy::new(RetryPolicyConfig {
            probability: 1.0,
            ..RetryPolicyConfig::default()
        });
        let mut rng = StdRng::seed_from_u64(1);
        let mut b = budget(now);
        let mut decide = |attempt, failure, safe, deadline, budget: &mut RetryBudget| {
            sure.decide(
                attempt, failure, safe, false, deadline, now, budget, &mut rng,
            )
        };
        assert_eq!(
            decide(1, AttemptFailure::Connect, false, later, &mut b),
            RetryDecision::Retry
        );
        for failure in [AttemptFailure::Lost, AttemptFailure::TimedOut] {
            assert_eq!(
                decide(1, failure, false, later, &mut b),
                RetryDecision::GiveUp(GiveUp::NotIdempotent)
            );
            assert_eq!(
                decide(1, failure, true, later, &mut b),
                RetryDecision::Retry
            );
        }
        assert_eq!(
            decide(3, AttemptFailure::Connect, true, later, &mut b),
            RetryDecision::GiveUp(GiveUp::AttemptsUsedUp)
        );
        assert_eq!(
            decide(1, AttemptFailure::Status, true, later, &mut b),
            RetryDecision::GiveUp(GiveUp::ServerAnswered)
        );
        assert_eq!(
            decide(
                1,
                AttemptFailure::Connect,
                true,
                now + Duration::from_millis(1),
                &mut b
            ),
            RetryDecision::GiveUp(GiveUp::Deadline)
        );
        // An empty budget stops retries.
        let mut empty = RetryBudget::new(
            RetryBudgetConfig {
                max_tokens: 2.0,
                reserve_per_sec: 0.0,
                ..RetryBudgetConfig::default()
            },
            now,
        );
        let outcomes: Vec<_> = (0..4)
            .map(|_| decide(1, AttemptFailure::Connect, true, later, &mut empty))
            .collect();
        assert_eq!(
            outcomes,
            [
                RetryDecision::Retry,
                RetryDecision::Retry,
                RetryDecision::GiveUp(GiveUp::BudgetExhausted),
                RetryDecision::GiveUp(GiveUp::BudgetExhausted),
            ]
        );
    }

    #[test]
    fn work_free_failures_go_elsewhere_without_coin_or_token() {
        let now = Instant::now();
        let later = now + Duration::from_secs(1);
        // A coin that never retries and an empty budget: only a redirect
        // can move the call on.
        let never = RetryPolicy::new(RetryPolicyConfig {
            probability: 0.0,
            connection_failure_probability: 0.0,
            max_attempts: 1,
            ..RetryPolicyConfig::default()
        });
        let mut empty = RetryBudget::new(
            RetryBudgetConfig {
                max_tokens: 0.0,
                reserve_per_sec: 0.0,
                ..RetryBudgetConfig::default()
            },
            now,
        );
        let mut rng = StdRng::seed_from_u64(3);
        let mut decide = |failure, safe, elsewhere, deadline| {
            never.decide(
                1, failure, safe, elsewhere, deadline, now, &mut empty, &mut rng,
            )
        };
        for failure in [AttemptFailure::Connect, AttemptFailure::Refused] {
            for safe in [false, true] {
                assert_eq!(
                    decide(failure, safe, true, later),
                    RetryDecision::Redirect,
                    "{failure:?}, safe {safe}"
                );
            }
            // Every replica turned the call away: the ordinary rules (here:
            // one attempt).
            assert_eq!(
                decide(failure, true, false, later),
                RetryDecision::GiveUp(GiveUp::AttemptsUsedUp)
            );
            // No time left for it.
            assert_eq!(
                decide(failure, true, true, now + Duration::from_millis(1)),
                RetryDecision::GiveUp(GiveUp::AttemptsUsedUp)
            );
        }
        // A failure that may have done work is never redirected for free.
        for failure in [AttemptFailure::Lost, AttemptFailure::TimedOut] {
            assert_eq!(
                decide(failure, true, true, later),
                RetryDecision::GiveUp(GiveUp::AttemptsUsedUp)
            );
        }
        assert_eq!(
            decide(AttemptFailure::Status, true, true, later),
            RetryDecision::GiveUp(GiveUp::ServerAnswered)
        );
        assert_eq!(empty.exhausted(), 0, "no token was asked for");
    }
}
