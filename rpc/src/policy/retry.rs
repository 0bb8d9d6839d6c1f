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
    /// (starting, stopping, a replica catching up): as safe as `Connect`,
    /// but says nothing against the node's health.
    Refused,
    /// The connection broke after the request was sent: it may or may not
    /// have been applied.
    Lost,
    /// The attempt's time ran out: it may or may not have been applied.
    TimedOut,
    /// The server answered with an error status: not retried here.
    Status,
}

/// What to do after a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryDecision {
    /// Try again (preferably on another replica).
    Retry,
    /// Give up; the reason (for logs and metrics).
    GiveUp(&'static str),
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

    /// Decides after attempt number `attempt` (1 for the first) failed
    /// with `failure`. `safe` says whether a second application is
    /// harmless (idempotent method, or a request id the server
    /// deduplicates); `deadline` is the caller's.
    #[allow(clippy::too_many_arguments)]
    pub fn decide(
        &self,
        attempt: u32,
        failure: AttemptFailure,
        safe: bool,
        deadline: Instant,
        now: Instant,
        budget: &mut RetryBudget,
        rng: &mut impl Rng,
    ) -> RetryDecision {
        if failure == AttemptFailure::Status {
            return RetryDecision::GiveUp("the server answered");
        }
        if attempt >= self.config.max_attempts {
            return RetryDecision::GiveUp("attempts used up");
        }
        // A request that was never sent cannot have been applied.
        if matches!(failure, AttemptFailure::Lost | AttemptFailure::TimedOut) && !safe {
            return RetryDecision::GiveUp("not idempotent");
        }
        let left = deadline.saturating_duration_since(now);
        if left < Duration::from_millis(self.config.min_remaining_ms) {
            return RetryDecision::GiveUp("deadline");
        }
        let probability = match failure {
            AttemptFailure::TimedOut => self.config.probability,
            _ => self.config.connection_failure_probability,
        };
        if !rng.random_bool(probability.clamp(0.0, 1.0)) {
            return RetryDecision::GiveUp("not drawn");
        }
        if !budget.try_withdraw(now) {
            return RetryDecision::GiveUp("retry budget exhausted");
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
                        policy.decide(1, failure, true, deadline, now, &mut budget, &mut rng)
                            == RetryDecision::Retry
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
            sure.decide(attempt, failure, safe, deadline, now, budget, &mut rng)
        };
        assert_eq!(
            decide(1, AttemptFailure::Connect, false, later, &mut b),
            RetryDecision::Retry
        );
        for failure in [AttemptFailure::Lost, AttemptFailure::TimedOut] {
            assert_eq!(
                decide(1, failure, false, later, &mut b),
                RetryDecision::GiveUp("not idempotent")
            );
            assert_eq!(
                decide(1, failure, true, later, &mut b),
                RetryDecision::Retry
            );
        }
        assert_eq!(
            decide(3, AttemptFailure::Connect, true, later, &mut b),
            RetryDecision::GiveUp("attempts used up")
        );
        assert_eq!(
            decide(1, AttemptFailure::Status, true, later, &mut b),
            RetryDecision::GiveUp("the server answered")
        );
        assert_eq!(
            decide(
                1,
                AttemptFailure::Connect,
                true,
                now + Duration::from_millis(1),
                &mut b
            ),
            RetryDecision::GiveUp("deadline")
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
                RetryDecision::GiveUp("retry budget exhausted"),
                RetryDecision::GiveUp("retry budget exhausted"),
            ]
        );
    }
}
