//! The retry budget: like Finagle's `RetryBudget` (a share of recent
//! requests, plus a small reserve over time) and gRPC's retry throttling.
//!
//! Every successful call deposits `ratio` tokens, every retry withdraws
//! one, and `reserve_per_sec` tokens trickle in with time so that a client
//! with little traffic can still retry now and then. The balance is capped
//! at `max_tokens`. With the defaults (ratio 0.2) retries add at most about
//! 20% to the load a healthy service sees, and during an outage (no
//! successes) they stop once the balance is spent.

use std::time::Instant;

/// Settings of a [`RetryBudget`].
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetryBudgetConfig {
    /// Tokens a success deposits (the share of traffic retries may add).
    /// Default 0.2: Finagle's default budget.
    pub ratio: f64,
    /// Most tokens saved up (the largest burst of retries). Default 10.
    pub max_tokens: f64,
    /// Tokens added per second regardless of traffic. Default 1: a quiet
    /// client may still retry once a second.
    pub reserve_per_sec: f64,
}

impl Default for RetryBudgetConfig {
    fn default() -> Self {
        Self {
            ratio: 0.2,
            max_tokens: 10.0,
            reserve_per_sec: 1.0,
        }
    }
}

impl tessera_config::Validate for RetryBudgetConfig {
    fn validate(&self) -> Result<(), tessera_config::ConfigError> {
        use tessera_config::invalid;
        for (key, value) in [
            ("budget.ratio", self.ratio),
            ("budget.max_tokens", self.max_tokens),
            ("budget.reserve_per_sec", self.reserve_per_sec),
        ] {
            if !value.is_finite() || value < 0.0 {
                return Err(invalid(key, "must be a finite number, at least 0"));
            }
        }
        Ok(())
    }
}

/// A retry budget (see the module docs).
#[derive(Debug, Clone)]
pub struct RetryBudget {
    config: RetryBudgetConfig,
    tokens: f64,
    refilled_at: Instant,
    exhausted: u64,
}

impl RetryBudget {
    /// A full budget at `now`.
    pub fn new(config: RetryBudgetConfig, now: Instant) -> Self {
        Self {
            tokens: config.max_tokens,
            config,
            refilled_at: now,
            exhausted: 0,
        }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now
            .saturating_duration_since(self.refilled_at)
            .as_secs_f64();
        self.tokens =
            (self.tokens + elapsed * self.config.reserve_per_sec).min(self.config.max_tokens);
        self.refilled_at = self.refilled_at.max(now);
    }

    /// A call succeeded.
    pub fn on_success(&mut self, now: Instant) {
        self.refill(now);
        self.tokens = (self.tokens + self.config.ratio).min(self.config.max_tokens);
    }

    /// Withdraws one token for a retry; false (and counted) if the budget
    /// is spent.
    pub fn try_withdraw(&mut self, now: Instant) -> bool {
        self.refill(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            self.exhausted += 1;
            false
        }
    }

    /// Tokens now.
    pub fn balance(&mut self, now: Instant) -> f64 {
        self.refill(now);
        self.tokens
    }

    /// Retries refused for lack of tokens so far.
    pub fn exhausted(&self) -> u64 {
        self.exhausted
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn retries_are_bounded_by_a_share_of_successes() {
        let start = Instant::now();
        let config = RetryBudgetConfig {
            reserve_per_sec: 0.0,
            ..RetryBudgetConfig::default()
        };
        let mut budget = RetryBudget::new(config, start);
        // The initial burst.
        let burst = (0..100).filter(|_| budget.try_withdraw(start)).count();
        assert_eq!(burst, 10);
        assert_eq!(budget.exhausted(), 90);
        // 1000 successes earn 200 tokens, capped at 10 at a time: with a
        // retry attempted after every success, 1 in 5 gets through.
        let mut retried = 0;
        for _ in 0..1000 {
            budget.on_success(start);
            if budget.try_withdraw(start) {
                retried += 1;
            }
        }
        assert_eq!(retried, 200);
    }

    #[test]
    fn an_outage_spends_the_budget_and_the_reserve_refills_it_slowly() {
        let start = Instant::now();
        let mut budget = RetryBudget::new(RetryBudgetConfig::default(), start);
        let during = (0..50).filter(|_| budget.try_withdraw(start)).count();
        assert_eq!(during, 10, "no successes: only the saved tokens");
        let later = start + Duration::from_millis(2500);
        assert!((budget.balance(later) - 2.5).abs() < 1e-9);
        assert!(budget.try_withdraw(later) && budget.try_withdraw(later));
        assert!(!budget.try_withdraw(later));
        // Never above the cap, however long the pause.
        assert_eq!(budget.balance(later + Duration::from_secs(3600)), 10.0);
    }
}
